"""Tutorial 02 (circuit): its cells, in order (built into the .ipynb by ``build_notebooks.py``)."""

from __future__ import annotations

from _cells import code, difficulty, exercise, hints, md, setup, solution  # noqa: F401

# ============================================================================= 02 circuit

NB02 = [
    md("""
    # 02 · Finding the addition circuit

    **What you will learn**
    1. clean/corrupted pairs and the logit-difference metric;
    2. exact activation patching, batched (and how to compute a cell by hand);
    3. attribution patching: a gradient approximation of every head's patching effect in one backward pass;
    4. circuits and faithfulness: how much of the behaviour a few heads carry;
    5. the library's one-call circuit pipeline (edge attribution, pruned circuits, faithfulness).

    **Exercises:** 1 · one patching cell by hand (checked against `transformer_lens.patching`),
    2 · attribution scores for every head, 3 · faithfulness of a set of heads.
    """),
    code(setup("patch_one", "attribution_scores", "head_faithfulness")),
    code("""
    from interp_norm import circuits

    model, info = load_with_info("pre")
    cfg = model.cfg
    """),
    md("""
    ## 1. Pairs and the metric
    **What you will learn:** what we compare. A pair is a clean problem and a copy with one operand digit
    changed so that the answer changes but the token layout does not; `aligned=True` gives every pair the
    same layout, so a position means the same thing in every row. The metric is the logit difference
    between the clean and the corrupted answer token, averaged over the answer positions that differ.
    """),
    code("""
    pairs = circuits.make_pairs(info.task, 48, "id", seed=0, aligned=True)
    display(pairs.to_dataframe().head())
    metric = circuits.LogitDiff(pairs)
    with torch.no_grad():
        clean_ld = metric(model(pairs.clean_tokens)).mean().item()
        corrupted_ld = metric(model(pairs.corrupted_tokens)).mean().item()
    print(f"logit difference: clean {clean_ld:.3f}, corrupted {corrupted_ld:.3f}")
    """),
    md("""
    ## 2. Exact activation patching
    **What you will learn:** which activations carry the difference. Patching runs the corrupted input but
    replaces one activation (one layer, one position or one head) by its value from the clean run; the
    *normalised* result is 0 when nothing is restored and 1 when the clean answer is fully restored.
    `patch_sweep` computes many cells per forward pass and equals `transformer_lens.patching` cell by cell.
    """),
    code("""
    sweep = circuits.patch_sweep(model, pairs, activations=("resid_pre", "attn_out", "mlp_out", ("z", "all")))
    frames = []
    for key, res in sweep.items():
        df = res.to_dataframe()
        df.insert(1, "by", res.by)
        frames.append(df)
    patching = pd.concat(frames, ignore_index=True)
    template = list(pairs.clean_problems[0].text)
    plots.plot_patching_heatmap(patching, pos_labels=template)
    """),
    md(f"""
    ### Exercise 1 — one cell by hand
    {difficulty(2, 10)}

    Write `patch_one(model, pairs, metric, layer, pos)`: run the corrupted tokens with
    `blocks.{{layer}}.hook_resid_pre` at position `pos` replaced by its value from the clean run, and return the
    normalised logit difference `(patched − corrupted) / (clean − corrupted)` of the batch means. The check
    compares a few cells with `transformer_lens.patching.get_act_patch_resid_pre`.

    {hints("Cache the clean run: `_, clean_cache = model.run_with_cache(pairs.clean_tokens)`.",
           "Inside the hook: `x[:, pos] = clean_cache[hook.name][:, pos]; return x`, and run it with `model.run_with_hooks(pairs.corrupted_tokens, fwd_hooks=[(name, hook)])`.",
           "`metric(logits).mean().item()` is the batch-mean logit difference of any run.")}
    """),
    exercise("patch_one", """
    def patch_one(model, pairs, metric, layer, pos):
        # YOUR CODE HERE: return the normalised logit difference (a float)
        return None

    check_patch_one(patch_one, model, pairs, metric)
    """),
    solution("patch_one"),
    md(f"""
    ## 3. Attribution patching
    **What you will learn:** the first-order shortcut. Instead of one forward pass per cell, take the
    gradient of the metric at the corrupted run and estimate each head's patching effect as
    `(z_clean − z_corrupted) · ∂metric/∂z`, summed over positions and the head dimension. One forward and one
    backward pass score every head. The estimate is exact for linear effects and can miss saturating ones.

    ### Exercise 2 — attribution scores for every head
    {difficulty(4, 25)}

    Write `attribution_scores(model, pairs, metric)`, returning a DataFrame `layer, head, attribution` (the
    estimated change of the *mean* logit difference when that head's `hook_z` is patched at every position).
    The check compares with the library's EAP, `circuits.attribution_patch(..., ig_steps=1)`.

    {hints("Keep the hooked activations with a forward hook that stores them and calls `.retain_grad()`; the model must not be under `torch.no_grad()`.",
           "Differentiate the batch mean of the metric; then sum `(clean_z - corr_z) * grad` over batch, positions and d_head: `.sum(dim=(0, 1, 3))` on `[batch, pos, head, d_head]`.",
           "Call `model.zero_grad(set_to_none=True)` at the end so later cells start clean.")}
    """),
    exercise("attribution_scores", """
    def attribution_scores(model, pairs, metric):
        # YOUR CODE HERE: return a DataFrame with columns layer, head, attribution
        return None

    check_attribution_scores(attribution_scores, model, pairs, metric)
    """),
    solution("attribution_scores"),
    md("""
    The library does the same, batched, per cell, and with integrated gradients (EAP-IG: average the gradient
    along the straight path from corrupted to clean activations, which fixes much of the first-order error):
    `circuits.attribution_patch(model, pairs, metric, "z", by="all", ig_steps=...)`. How well does each
    estimate track exact patching?
    """),
    code("""
    import plotly.express as px

    exact = sweep["z_all"].to_dataframe()[["layer", "head", "effect"]]
    eap = circuits.attribution_patch(model, pairs, metric, "z", by="all", ig_steps=1).to_dataframe()
    both = eap[["layer", "head", "effect"]].rename(columns={"effect": "attribution"}).merge(exact, on=["layer", "head"])
    r = np.corrcoef(both["attribution"], both["effect"])[0, 1]
    print(f"correlation between attribution and exact patching over {len(both)} heads: {r:.3f}")
    display(pd.concat([circuits.compare_scores(circuits.attribution_patch(model, pairs, metric, "z", by="all", ig_steps=k), sweep["z_all"])
                       .assign(method="EAP" if k == 1 else f"EAP-IG ({k} steps)") for k in (1, 5)]))
    px.scatter(both, x="effect", y="attribution", text="L" + both["layer"].astype(str) + "H" + both["head"].astype(str),
               title="Attribution patching vs exact patching (per head)")
    """),
    md(f"""
    ## 4. Circuits and faithfulness
    **What you will learn:** whether a handful of heads *is* the mechanism. Keep a set of heads and replace
    every other head's output by its corrupted value while running the clean input. Faithfulness =
    (metric − corrupted) / (clean − corrupted): 1 means the kept heads alone keep the clean behaviour (the
    MLPs and embeddings stay intact here: this is a head-level circuit).

    ### Exercise 3 — faithfulness of a set of heads
    {difficulty(3, 20)}

    Write `head_faithfulness(model, pairs, metric, heads_in_circuit)` where `heads_in_circuit` is a set of
    `(layer, head)` tuples. The check compares four head sets (all, none, one, a random half) with a
    computation that never touches `hook_z`: it adds each replaced head's change, through W_O, to
    `hook_attn_out`.

    {hints("Cache the corrupted `hook_z` of every layer and, in a hook on the clean run, overwrite the heads outside the circuit: `z[:, :, h] = corr[hook.name][:, :, h]`.",
           "With every head kept nothing is replaced, so `head_faithfulness(..., all_heads)` must be 1. With none kept it need not be 0: the MLPs still see the clean input.")}
    """),
    exercise("head_faithfulness", """
    def head_faithfulness(model, pairs, metric, heads_in_circuit):
        # YOUR CODE HERE: return the faithfulness (a float)
        return None

    check_head_faithfulness(head_faithfulness, model, pairs, metric)
    """),
    solution("head_faithfulness"),
    md("""
    The library computes the same quantity at the level of edges: a *node* circuit (the kept heads, every MLP,
    the embedding and the logits) run with every other edge resample-ablated replaces exactly the outputs of
    the heads left out. So the faithfulness of the top-k heads, ranked by exact patching, is one library call
    for all k at once:
    """),
    code("""
    ranked = exact.assign(size=exact["effect"].abs()).sort_values("size", ascending=False)
    heads = [f"a{l}.h{h}" for l, h in zip(ranked["layer"], ranked["head"])]
    mlps = [f"m{l}" for l in range(cfg.n_layers)]
    top_k = [circuits.Circuit.from_nodes(heads[:k] + mlps, cfg.n_layers, cfg.n_heads) for k in range(len(heads) + 1)]
    curve = circuits.faithfulness(model, pairs, top_k, metric, ablations=("resample",)).assign(k=range(len(top_k)))
    px.line(curve, x="k", y="faithfulness", markers=True, title="Faithfulness of the top-k heads (by exact patching)")
    """),
    md("""
    ## 5. The same in one call
    **What you will learn:** the library's circuit pipeline. `circuits.run_circuits` builds pairs, runs the
    patching sweeps, scores every *edge* (sender → receiver input, e.g. `a0.h1 → a2.h0.q`) with EAP-IG, keeps
    the strongest edges as a `Circuit`, and measures its faithfulness under resample, mean and zero ablation.
    `plots.plot_circuit_graph` draws it (embedding at the bottom, logits at the top). The dashboard
    (`interp-norm reproduce`) shows this for every model.
    """),
    code("""
    tables = circuits.run_circuits(model, info.task, n_pairs=48, seed=0, attention_problems=64)
    display(tables["faithfulness"][["ablation", "n_edges", "n_components", "faithfulness"]])
    plots.plot_circuit_graph(tables["circuit"], n_layers=cfg.n_layers, n_heads=cfg.n_heads)
    """),
    md("""
    **Next:** `03_norm_noise_and_circuit_collapse.ipynb` asks how stable these circuits are when the norms
    inside attention are jittered, as Pre-Norm's shared normalisation does.
    """),
]
