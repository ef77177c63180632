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
    5. the library's one-call circuit pipeline (edge attribution, pruned circuits, faithfulness);
    6. a finer grain: the circuit as a set of (layer, head, answer position) cells, located by ablation;
    7. verifying it under resample, mean and zero ablation, and once by hand;
    8. what the reference model's heads compute: roles from attention mass per token class;
    9. where attribution's error comes from: the norms, the attention patterns, the rest.

    **Exercises:** 1 · one patching cell by hand (checked against `transformer_lens.patching`),
    2 · attribution scores for every head, 3 · faithfulness of a set of heads,
    4 · which tokens the most necessary cell at an answer position reads,
    5 · attribution's error against exact patching, pair by pair.
    """),
    code(setup("patch_one", "attribution_scores", "head_faithfulness", "most_necessary_reads", "eap_errors")),
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
    ## 6. A finer grain: heads at answer positions
    **What you will learn:** why a list of heads is not yet an explanation, and a finer unit. The ranking
    and the top-k curve of section 4 say *which* heads matter for one digit corruption, not *where* or
    *what for*: each head runs at every answer position and may do a different job at each, and a few
    heads kept against corrupted inputs is not the same as a few heads being enough to add. So the unit
    here is a *cell*: one head's output `z`
    at the rows of one answer position, i.e. the rows that *predict* the answer's sign, one of its digits
    (named by place value: hundreds, tens, units) or the closing `]` (`end`). Question rows are never ablated.

    `circuits.locate_circuit` ablates a cell by **resampling**: its `z` at its rows is replaced by the same
    rows of a run on another problem with the same token layout (same terms, digits per term and answer
    length), so every row means the same thing in both runs. It ranks the cells by *necessity*, the
    per-token accuracy lost when that cell alone is ablated (logit difference breaks ties), and keeps the
    top-k until the model with **every other cell ablated** keeps 90% of the full model's per-token accuracy
    (the answer digits and `]`, teacher-forced, as in the paper's §3). 128 problems keep this section quick.
    """),
    code("""
    spec = circuits.CircuitSpec(n=128, seed=0, keep=0.9, ablation="resample")
    located = circuits.locate_circuit(model, info.task, spec=spec)
    effects, located_curve = located.effects, located.curve
    size = len(located.cells)
    print(f"{size} of {len(effects)} cells ({size / len(effects):.0%} of the model) keep "
          f"{located_curve['accuracy_kept'].iloc[size]:.1%} of per-token accuracy")
    display(effects.head(8)[["cell", "position", "n_rows", "accuracy_drop", "logit_diff_drop"]])
    grid = (effects.assign(unit="L" + effects["layer"].astype(str) + "H" + effects["head"].astype(str))
            .pivot(index="unit", columns="position", values="accuracy_drop")[list(located.data.slots)])
    px.imshow(grid, text_auto=".2f", color_continuous_scale="Blues", aspect="auto",
              title="Necessity of each cell: accuracy lost when it alone is resample-ablated")
    """),
    code("""
    fig = px.line(located_curve, x="size", y="accuracy_kept", markers=True, hover_data=["added"],
                  title="Accuracy kept by the top-k cells, every other cell resample-ablated")
    fig.add_hline(y=spec.keep, line_dash="dot")
    fig.add_vline(x=size, line_dash="dot")
    fig
    """),
    md("""
    ## 7. Verifying the circuit
    **What you will learn:** what "the circuit keeps 90%" depends on. `located.verification` has one row per
    ablation: the full model's accuracy, the circuit's (every other cell ablated), no cell kept, the share of
    accuracy kept, the share *recovered* `(circuit − none) / (full − none)`, and the same ratio of logit
    differences (`faithfulness`; the logit difference is between the clean answer token and the resample
    source's, at the rows where they differ). The circuit was grown under resample ablation; mean and zero
    ablation put the other cells' outputs off the data distribution, so compare the rows before trusting one
    number. `share_of_cells` is the circuit's size as a share of the model.
    """),
    code("""
    display(located.verification[["ablation", "cells", "n_cells", "share_of_cells", "accuracy_full", "accuracy_circuit",
                                  "accuracy_none", "accuracy_kept", "accuracy_recovered", "faithfulness"]])
    """),
    md("""
    The same number once by hand, from the printed cells only: run the clean problems with a hook that puts
    the resample source's `z` into every answer row of every head whose cell is *not* in the circuit, and
    count the correct next tokens at the answer rows.
    """),
    code("""
    from interp_norm.core.hook_names import act_name
    from interp_norm.core.task import next_tokens

    data = located.data
    inside = set(zip(located.cells["layer"], located.cells["head"], located.cells["slot"]))
    z_names = [act_name("z", layer) for layer in range(cfg.n_layers)]
    answer_rows = data.answer_rows.nonzero().tolist()  # (problem, row) pairs
    with torch.no_grad():
        _, source_cache = model.run_with_cache(data.source, names_filter=lambda name: name in z_names)

        def resample_outside(z, hook):
            layer = z_names.index(hook.name)
            for b, q in answer_rows:
                for h in range(cfg.n_heads):
                    if (layer, h, int(data.slot[b, q])) not in inside:
                        z[b, q, h] = source_cache[hook.name][b, q, h]
            return z

        by_hand = model.run_with_hooks(data.tokens, fwd_hooks=[(name, resample_outside) for name in z_names])
        full_logits = model(data.tokens)
    right = lambda logits: (logits.argmax(-1) == next_tokens(data.tokens))[data.answer_rows].double().mean().item()
    row = located.verification.set_index("ablation").loc["resample"]
    print(f"by hand: the circuit {right(by_hand):.4f}, the full model {right(full_logits):.4f}; "
          f"locate_circuit: {row['accuracy_circuit']:.4f} and {row['accuracy_full']:.4f}")
    """),
    md("""
    ## 8. What the heads compute
    **What you will learn:** how a cell gets a role. `circuits.attention_by_class` measures, for every cell,
    its mean attention mass on each *token class* over its rows: operand digits by place value (`units
    digits` = the units digits of all terms, `tens digits`, ...), `operand signs`, `operators`, `=`,
    `earlier answer` (the answer tokens so far, the query's own included) and `[`. The classes partition the
    keys, so a cell's masses sum to 1. `circuits.assign_roles` applies a stated rule (`circuits.RoleRule`):
    a cell *reads X* when at least 60% of its mass is on X; *reads X and Y* when the two largest classes
    hold 60% together and the second at least 20%; *reads operand digits* when the digit classes together
    hold 60%; otherwise it is *spread*, named by its largest class. `circuits.circuit_roles` joins the roles
    to the circuit's cells; `circuits.role_counts` counts them per answer position and layer, which is what
    can be compared between models (head indices mean nothing across seeds).
    """),
    code("""
    attention = circuits.attention_by_class(model, located.data)
    roles = circuits.assign_roles(attention, circuits.RoleRule(dominant=0.6, pair=0.6, minor=0.2))
    circuit = circuits.circuit_roles(located, roles)
    display(circuit[["order", "cell", "accuracy_drop", "role", "top_class", "top_mass", "second_class", "second_mass"]])
    display(circuits.role_counts(circuit))
    masses = attention.merge(circuit[["layer", "head", "position", "cell", "order"]], on=["layer", "head", "position"])
    heat = masses.pivot(index="cell", columns="token_class", values="mass").loc[circuit["cell"]]
    px.imshow(heat, text_auto=".2f", color_continuous_scale="Blues", aspect="auto",
              title="Attention mass per token class of each circuit cell (in the order added)")
    """),
    md(f"""
    ### Exercise 4 — what does the most necessary cell read?
    {difficulty(2, 10)}

    Write `most_necessary_reads(effects, attention, position)`: among the cells at answer position `position`
    (e.g. `"units"`), take the most necessary one (largest `accuracy_drop`; `logit_diff_drop` breaks ties)
    and return the token class (a string such as `"tens digits"`) on which that cell puts the most attention
    mass. The check asks at every answer position and compares with the mass recomputed from `hook_pattern`
    by a loop over rows and keys; then it asks again on shuffled tables, so an answer typed in by hand fails.

    {hints("Filter `effects` to the position and sort by `['accuracy_drop', 'logit_diff_drop']`, descending.",
           "Then filter `attention` to that cell's `layer`, `head` and the same `position`, and take the `token_class` of the largest `mass` (`idxmax`).")}
    """),
    exercise("most_necessary_reads", """
    def most_necessary_reads(effects, attention, position):
        # YOUR CODE HERE: return a token class name (a str)
        return None

    check_most_necessary_reads(most_necessary_reads, model, located, attention)
    """),
    solution("most_necessary_reads"),
    md("""
    A role is read off attention; does the cell *use* what it reads? `circuits.role_tests` resamples, at one
    circuit cell, only the values it reads from one token class (the attention pattern stays clean) and
    measures what that costs; `circuits.role_agreement` says per cell whether the costliest class is one its
    role predicted (`None` for a *spread* role, which predicts nothing).
    """),
    code("""
    tests = circuits.role_tests(model, located, circuit)
    display(circuits.role_agreement(tests))
    """),
    md("""
    ## What the reference model's heads compute
    The account below is generated from the tables above (`circuits.account`), not written by hand: the
    circuit's size and what it keeps, then, per answer position, the circuit's cells with their roles, their
    largest class and their necessity. A position with no circuit cell is one whose cells were not needed to
    reach 90% (the circuit keeps 90% with all of them resampled), which does not mean they do nothing. Read
    it beside the role test above: a *spread* cell has a measured attention profile but no one-class story.
    `circuits.addition_circuit(model)` runs sections 6-8
    in one call, and `interp-norm circuits CKPT --cells` writes these tables for any checkpoint.
    """),
    code("""
    print(circuits.account(located, roles, name="The reference model (pre)"))
    """),
    md(f"""
    ## 9. Where attribution's error comes from
    **What you will learn:** how far attribution is from exact patching, and which nonlinearity carries
    the difference. Section 3 compared the *batch means*; but a head can help in one pair and hurt in
    another, and errors of opposite sign cancel in a mean. So score each head by the mean over pairs of
    |estimate − exact| (in logit-difference units).

    ### Exercise 5 — attribution's error, pair by pair
    {difficulty(2, 10)}

    Write `eap_errors(model, pairs, metric)`, returning a DataFrame `layer, head, error`: for each head's `z`
    (patched at every position), the mean over pairs of |EAP's estimate − exact patching's effect| on that
    pair's metric. The check recomputes both pair by pair by hand: exact patching with one hook per head,
    EAP from each pair's own gradient.

    {hints("`circuits.activation_patch(model, pairs, None, metric, 'z', by='all')` and `circuits.attribution_patch(model, pairs, metric, 'z', by='all', ig_steps=1)` return results with `per_example` ([cells, pairs]: the metric of each pair after the patch) and `baseline` ([pairs]: the corrupted run's).",
           "A pair's effect is `per_example - baseline`; the cells come in (layer, head) order, so cell `i` is layer `i // n_heads`, head `i % n_heads`.")}
    """),
    exercise("eap_errors", """
    def eap_errors(model, pairs, metric):
        # YOUR CODE HERE: return a DataFrame with columns layer, head, error
        return None

    check_eap_errors(eap_errors, model, pairs, metric)
    """),
    solution("eap_errors"),
    md("""
    Every nonlinearity between a node and the metric adds to this error: the norms (each divides by a
    length that the patch changes), the softmax of the attention patterns, the MLPs. Freezing one in the
    backward pass (`norm="frozen"`, `pattern="frozen"` on every attribution method) takes its curvature out
    of the estimate, so the error in three modes splits the live error exactly: the part freezing the norms'
    scales removes, the part freezing the patterns then removes, and the rest. A part below 0 means freezing
    made the estimate *worse* (a frozen norm is the wrong linearisation, not a better one).
    `attribution_error_budget` does this for AtP, AtP*, EAP and EAP-IG on every head output, head input
    (q, k, v) and MLP; a few pairs are enough to see it. `budget_summary` totals it per method and node kind;
    `rel_err_live` is the error as a share of the exact effects' size (1 = no better than attributing nothing).
    """),
    code("""
    from interp_norm.circuits.attribution_error import BudgetSpec, attribution_error_budget, budget_summary

    few = circuits.make_pairs(info.task, 8, "id", seed=1, aligned=True)
    budget = attribution_error_budget(model, few, circuits.LogitDiff(few), BudgetSpec(ig_steps=4))
    summary = pd.concat([budget_summary(budget), budget_summary(budget, by=("method",)).assign(activation="all")])
    display(summary[["method", "activation", "rel_err_live", "rel_err_norm", "share_removed_by_norm",
                     "share_removed_by_pattern", "share_rest"]].round(3))
    plots.plot_error_budget(summary.assign(arm="pre", checkpoint="pre"), title="The reference model (8 pairs)")
    """),
    md("""
    Over every shipped seed (`scripts/attribution_error_budget.py`; the dashboard's "Attribution's error"
    section), docs/findings-tables.md compares Pre-Norm with QKV-Norm: does a norm on q, k and v make
    attribution more or less faithful?
    """),
    md("""
    **Next:** `03_norm_noise_and_circuit_collapse.ipynb` asks how stable these circuits are when the norms
    inside attention are jittered, as Pre-Norm's shared normalisation does.
    """),
]
