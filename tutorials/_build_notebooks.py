"""Build tutorials/*.ipynb from the cell lists below (edit here, then run this file).

    .venv/bin/python tutorials/_build_notebooks.py

Notebooks are written without outputs; CI executes them top to bottom (tests/test_tutorials.py).
Conventions (ARENA-style): each section opens with "What you will learn"; an exercise is a
markdown cell with the task and collapsed hints, a code cell for your attempt (it runs as is and
says so when the attempt is still empty), then a solution cell whose source is collapsed in
JupyterLab (``jupyter.source_hidden``) and which CI executes and checks.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

SETUP = """\
import os
import warnings
os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", message="IProgress not found")  # progress bars fall back to text
import numpy as np
import pandas as pd
import torch
torch.set_num_threads(1)   # these small models run fastest on one thread
torch.manual_seed(0)

from interp_norm import plots
from interp_norm.checkpoints import list_pretrained, load_pretrained
"""


def md(text: str):
    return new_markdown_cell(textwrap.dedent(text).strip("\n"))


def code(text: str):
    return new_code_cell(textwrap.dedent(text).strip("\n"))


def solution(text: str):
    cell = code(text)
    cell.metadata["jupyter"] = {"source_hidden": True}
    cell.metadata["tags"] = ["solution"]
    return cell


def hints(*items: str) -> str:
    """Collapsed hints for a markdown f-string; continuation lines carry the cell's 4-space indent so
    that :func:`md`'s dedent still applies to the whole cell."""
    text = "\n".join(f"<details><summary>Hint {i + 1}</summary>\n\n{textwrap.dedent(h).strip()}\n\n</details>\n"
                      for i, h in enumerate(items))
    return text.replace("\n", "\n    ")


# ============================================================================= 01 quickstart

NB01 = [
    md("""
    # 01 · Quickstart: a trained model, its tokens, its cache and its hooks

    `interp_norm` trains small transformers on the multi-term addition task of Menary, Kaski & Freitas
    (2024), *Transformer Normalisation Layers and the Independence of Semantic Subspaces*, with the
    attention normalisation as a switch: **Pre-Norm** (normalise the residual stream before W_Q/W_K/W_V,
    the usual choice) or **QKV-Norm** (normalise each head's query, key and value after the projection).
    Every internal vector is exposed through TransformerLens hook points.

    **What you will learn**
    1. load a shipped checkpoint and read what it is;
    2. how problems become tokens, and how the model answers;
    3. `run_with_cache`: every activation by its TransformerLens name;
    4. hooks: change a forward pass, and have the change undone automatically;
    5. read attention patterns, with an exercise on finding a previous-token head.
    """),
    code(SETUP),
    md("""
    ## 1. Load a shipped model
    **What you will learn:** what is shipped, and what a checkpoint tells you about itself.
    `list_pretrained()` lists the checkpoints in `data/checkpoints/` with their per-token accuracy per split:
    in-distribution (`id`), interpolation (`interp`: a number of terms never seen in training, but inside the
    trained range) and extrapolation (`extrap`: more terms than in training).
    """),
    code("""
    list_pretrained().drop(columns="path")
    """),
    code("""
    model, info = load_pretrained("pre")
    cfg = model.cfg
    print(f"attention norm: {cfg.attn_norm}, {cfg.n_layers} layers, {cfg.n_heads} heads of {cfg.d_head}, d_model {cfg.d_model}")
    print("task:", info.task)
    print("trained for", info.step, "steps; batch size", info.train_cfg.batch_size if info.train_cfg else "?")
    """),
    md("""
    ## 2. Tokens
    **What you will learn:** the 17-token vocabulary and the problem format.
    A problem is `[` + terms + `=` + answer + `]`; negative numbers are written with `N` (so `-7` is `N7`), and
    batches are right-padded with `*`. The model reads the question and must produce the answer.
    """),
    code("""
    from interp_norm.task import VOCAB, encode, decode, parse_problem

    print("vocabulary:", "".join(VOCAB))
    problem = info.task.sample_problems(1, "id", seed=3)[0]
    print("problem:", problem.text, " terms:", problem.terms, " result:", problem.result)
    tokens = model.to_tokens(problem.question)
    print("question tokens:", tokens.tolist(), "=", model.to_str_tokens(tokens[0]))
    print("the model answers:", model.generate([problem.question])[0], " (true answer:", problem.answer + ")")
    """),
    md("""
    ## 3. `run_with_cache`
    **What you will learn:** where every activation lives. The names are TransformerLens's
    (`blocks.{l}.attn.hook_q`, `hook_pattern`, `hook_resid_pre` ...), so TransformerLens tools work unchanged.
    We run the *full* problem (question and answer): the logits at position p predict token p+1, and only
    answer tokens are scored.
    """),
    code("""
    logits, cache = model.run_with_cache(encode(problem.text)[None])
    print("logits:", tuple(logits.shape), "= [batch, position, vocabulary]")
    for name in [k for k in cache.keys() if k.startswith("blocks.0.")]:
        print(f"{name:34s} {tuple(cache[name].shape)}")
    """),
    md(f"""
    ### Exercise 1 — recompute the attention scores
    In a Pre-Norm model the scores of layer 0 are `q · k / attn_scale` with `q = hook_q`, `k = hook_k`
    (shape `[batch, pos, head, d_head]`), and the causal mask sets keys after the query to `-inf`.
    Compute `scores[b, h, q, k]` from the cache and compare with `blocks.0.attn.hook_attn_scores`;
    then check that the softmax over keys gives `hook_pattern`.

    {hints("`torch.einsum('bqhd,bkhd->bhqk', q, k)` contracts the head dimension.",
           "`torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)` marks the keys after each query.")}
    """),
    code("""
    def my_scores(cache, layer):
        # YOUR CODE HERE: return scores [batch, head, query, key] with -inf above the diagonal
        return None

    attempt = my_scores(cache, 0)
    if attempt is None:
        print("not attempted yet: the solution follows")
    else:
        torch.testing.assert_close(attempt, cache["blocks.0.attn.hook_attn_scores"])
        print("correct!")
    """),
    solution("""
    # Solution
    def scores_from_cache(cache, layer):
        q, k = cache[f"blocks.{layer}.attn.hook_q"], cache[f"blocks.{layer}.attn.hook_k"]
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / model.cfg.attn_scale
        n = s.shape[-1]
        return s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1), float("-inf"))

    for layer in range(model.cfg.n_layers):
        s = scores_from_cache(cache, layer)
        torch.testing.assert_close(s, cache[f"blocks.{layer}.attn.hook_attn_scores"])
        torch.testing.assert_close(s.softmax(-1), cache[f"blocks.{layer}.attn.hook_pattern"])
    print("scores and patterns match the cache in every layer")
    """),
    md("""
    ## 4. Hooks
    **What you will learn:** how to intervene. A hook is a function `(activation, hook) -> activation`
    attached to a hook name. `with model.hooks(fwd_hooks=[...])` attaches hooks for the duration of the
    block and removes them on exit, even after an exception. Here we zero-ablate one head at a time
    (its `hook_z`, the per-head output before W_O) and measure how much the answer loss rises.
    """),
    code("""
    batch = info.task.test_set("id", size=256)
    with torch.no_grad():
        clean_loss = model(batch.tokens, return_type="loss").item()

    def zero_head(head):
        def hook(z, hook):
            z[:, :, head] = 0.0
            return z
        return hook

    rows = []
    with torch.no_grad():
        for layer in range(cfg.n_layers):
            for head in range(cfg.n_heads):
                with model.hooks(fwd_hooks=[(f"blocks.{layer}.attn.hook_z", zero_head(head))]):
                    loss = model(batch.tokens, return_type="loss").item()
                rows.append(dict(layer=layer, head=head, loss_increase=loss - clean_loss))
    ablation = pd.DataFrame(rows)
    print(f"clean loss {clean_loss:.3f}; hooks left on the model afterwards: {len(model.hook_dict['blocks.0.attn.hook_z'].fwd_hooks)}")
    import plotly.express as px
    px.imshow(ablation.pivot(index="layer", columns="head", values="loss_increase"), color_continuous_scale="Reds",
              title="Loss increase when one head is zero-ablated", labels=dict(color="Δ loss"))
    """),
    md(f"""
    ### Exercise 2 — the most important head
    Which (layer, head) raises the loss most when ablated? Return it as a tuple.

    {hints("`DataFrame.idxmax()` gives the row label of the largest value.")}
    """),
    code("""
    def most_important_head(ablation):
        # YOUR CODE HERE
        return None

    print(most_important_head(ablation) or "not attempted yet")
    """),
    solution("""
    # Solution
    def most_important_head(ablation):
        row = ablation.loc[ablation["loss_increase"].idxmax()]
        return int(row["layer"]), int(row["head"])

    top = most_important_head(ablation)
    assert ablation.set_index(["layer", "head"])["loss_increase"].max() == ablation.set_index(["layer", "head"]).loc[top, "loss_increase"]
    print("most important head:", top)
    """),
    md("""
    ## 5. Attention patterns
    **What you will learn:** reading attention with token labels. `plots.attention_patterns` runs the model
    on problems and returns a tidy table; `plots.plot_attention_patterns` draws every layer × head for one
    problem (the dropdown picks the problem). Axis labels are `token·position`.
    """),
    code("""
    problems = [problem.text, info.task.sample_problems(1, "extrap", seed=1)[0].text]
    patterns = plots.attention_patterns(model, problems, name="Pre-Norm")
    plots.plot_attention_patterns(patterns)
    """),
    md(f"""
    ### Exercise 3 — find the previous-token heads
    A *previous-token head* puts its attention on the token just before the query. For every head, compute
    the mean attention from each query position p ≥ 1 to p−1 over a batch (ignore padding rows), and
    return a DataFrame with columns `layer, head, prev_token_score`.

    {hints("`pattern.diagonal(offset=-1, dim1=-2, dim2=-1)` gives `pattern[..., p, p-1]` with shape `[batch, head, pos-1]`.",
           "Padding rows are where `tokens[:, 1:] == PAD_ID` (`from interp_norm.task import PAD_ID`).")}
    """),
    code("""
    def prev_token_scores(model, tokens):
        # YOUR CODE HERE
        return None

    print("not attempted yet" if prev_token_scores(model, batch.tokens[:64]) is None else "attempted")
    """),
    solution("""
    # Solution
    from interp_norm.task import PAD_ID

    def prev_token_scores(model, tokens):
        names = [f"blocks.{l}.attn.hook_pattern" for l in range(model.cfg.n_layers)]
        with torch.no_grad():
            _, c = model.run_with_cache(tokens, names_filter=lambda n: n in names)
        valid = (tokens[:, 1:] != PAD_ID)                      # [batch, pos-1]
        rows = []
        for l in range(model.cfg.n_layers):
            diag = c[names[l]].diagonal(offset=-1, dim1=-2, dim2=-1)  # [batch, head, pos-1]
            for h in range(model.cfg.n_heads):
                rows.append(dict(layer=l, head=h, prev_token_score=float(diag[:, h][valid].mean())))
        return pd.DataFrame(rows)

    scores = prev_token_scores(model, batch.tokens[:64])
    assert scores["prev_token_score"].between(0, 1).all()
    scores.sort_values("prev_token_score", ascending=False).head()
    """),
    md("""
    **Next:** `02_finding_the_addition_circuit.ipynb` turns these interventions into activation patching.
    """),
]

# ============================================================================= 02 circuit

NB02 = [
    md("""
    # 02 · Finding the addition circuit

    **What you will learn**
    1. clean/corrupted pairs and the logit-difference metric;
    2. exact activation patching, batched (and how to check a cell by hand);
    3. attribution patching: a gradient approximation of every head's patching effect in one backward pass;
    4. circuits and faithfulness: how much of the behaviour a few heads carry;
    5. the library's one-call circuit pipeline (edge attribution, pruned circuits, faithfulness).
    """),
    code(SETUP),
    code("""
    from interp_norm import circuits

    model, info = load_pretrained("pre")
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
    Patch `blocks.{{l}}.hook_resid_pre` at one position `p` from the clean run into the corrupted run with a
    hook, and compute the normalised logit difference. It must equal the sweep's value for that cell.

    {hints("Cache the clean run: `_, clean_cache = model.run_with_cache(pairs.clean_tokens)`.",
           "Inside the hook: `x[:, p] = clean_cache[hook.name][:, p]; return x`.",
           "normalised = (patched − corrupted) / (clean − corrupted).")}
    """),
    code("""
    def patch_one(layer, pos):
        # YOUR CODE HERE: return the normalised logit difference
        return None

    print("not attempted yet" if patch_one(1, 3) is None else patch_one(1, 3))
    """),
    solution("""
    # Solution
    with torch.no_grad():
        _, clean_cache = model.run_with_cache(pairs.clean_tokens)

    def patch_one(layer, pos):
        def hook(x, hook):
            x[:, pos] = clean_cache[hook.name][:, pos]
            return x
        with torch.no_grad():
            logits = model.run_with_hooks(pairs.corrupted_tokens, fwd_hooks=[(f"blocks.{layer}.hook_resid_pre", hook)])
        return (metric(logits).mean().item() - corrupted_ld) / (clean_ld - corrupted_ld)

    resid = sweep["resid_pre"].to_dataframe().set_index(["layer", "pos"])["normalized"]
    # the most informative cell: the largest effect that is not a full restoration
    partial = resid[(resid - 1).abs() > 0.02]
    layer, pos = partial.abs().idxmax() if len(partial) else resid.abs().idxmax()
    mine = patch_one(layer, pos)
    print(f"layer {layer}, position {pos}: by hand {mine:.5f}, sweep {resid.loc[(layer, pos)]:.5f}")
    assert abs(mine - resid.loc[(layer, pos)]) < 1e-4
    """),
    md(f"""
    ## 3. Attribution patching
    **What you will learn:** the first-order shortcut. Instead of one forward pass per cell, take the
    gradient of the metric at the corrupted run and estimate each head's patching effect as
    `(z_clean − z_corrupted) · ∂metric/∂z`, summed over positions and the head dimension. One forward and one
    backward pass score every head. The estimate is exact for linear effects and can miss saturating ones.

    ### Exercise 2 — attribution scores for every head
    Return a DataFrame `layer, head, attribution` (the estimated change of the *mean* logit difference).

    {hints("Keep the hooked activations with a forward hook that stores them and calls `.retain_grad()`; the model must not be under `torch.no_grad()`.",
           "Differentiate the batch mean of the metric; then sum `(clean_z - corr_z) * grad` over batch, positions and d_head: `.sum(dim=(0, 1, 3))` on `[batch, pos, head, d_head]`.")}
    """),
    code("""
    def attribution_scores(model, pairs, metric):
        # YOUR CODE HERE
        return None

    print("not attempted yet" if attribution_scores(model, pairs, metric) is None else "attempted")
    """),
    solution("""
    # Solution
    def attribution_scores(model, pairs, metric):
        names = [f"blocks.{l}.attn.hook_z" for l in range(model.cfg.n_layers)]
        with torch.no_grad():
            _, clean = model.run_with_cache(pairs.clean_tokens, names_filter=lambda n: n in names)
        saved = {}
        def keep(z, hook):
            z.retain_grad()
            saved[hook.name] = z
            return z
        logits = model.run_with_hooks(pairs.corrupted_tokens, fwd_hooks=[(n, keep) for n in names])
        metric(logits).mean().backward()
        rows = []
        for l, n in enumerate(names):
            z = saved[n]
            # the gradient of the batch *mean* already carries 1/batch: sum over batch, positions, d_head
            attr = ((clean[n] - z.detach()) * z.grad).sum(dim=(0, 1, 3))  # [head]
            rows += [dict(layer=l, head=h, attribution=float(a)) for h, a in enumerate(attr)]
        model.zero_grad(set_to_none=True)
        return pd.DataFrame(rows)

    attribution = attribution_scores(model, pairs, metric)
    exact = sweep["z_all"].to_dataframe()[["layer", "head", "effect"]]
    both = attribution.merge(exact, on=["layer", "head"])
    r = np.corrcoef(both["attribution"], both["effect"])[0, 1]
    print(f"correlation between attribution and exact patching over {len(both)} heads: {r:.3f}")
    import plotly.express as px
    px.scatter(both, x="effect", y="attribution", text=both["layer"].astype(str).radd("L") + both["head"].astype(str).radd("H"),
               title="Attribution patching vs exact patching (per head)")
    """),
    md("""
    The library does the same, batched, per cell, and with integrated gradients (EAP-IG: average the gradient
    along the straight path from corrupted to clean activations, which fixes much of the first-order error):
    `circuits.attribution_patch(model, pairs, metric, "z", by="all", ig_steps=...)`. Check that plain EAP
    (`ig_steps=1`) equals your scores, and see how EAP-IG compares with exact patching.
    """),
    code("""
    eap = circuits.attribution_patch(model, pairs, metric, "z", by="all", ig_steps=1)
    np.testing.assert_allclose(eap.effect().reshape(-1).numpy(), attribution["attribution"].to_numpy(), atol=1e-4)
    exact_all = sweep["z_all"]
    pd.concat([circuits.compare_scores(circuits.attribution_patch(model, pairs, metric, "z", by="all", ig_steps=k), exact_all)
               .assign(method="EAP" if k == 1 else f"EAP-IG ({k} steps)") for k in (1, 5)])
    """),
    md(f"""
    ## 4. Circuits and faithfulness
    **What you will learn:** whether a handful of heads *is* the mechanism. Keep the k heads with the largest
    exact patching effect and replace every other head's output by its corrupted value while running the
    clean input. Faithfulness = (metric − corrupted) / (clean − corrupted): 1 means the k heads alone keep the
    clean behaviour (the MLPs and embeddings stay intact here: this is a head-level circuit).

    ### Exercise 3 — faithfulness of the top-k heads
    {hints("Cache the corrupted `hook_z` of every layer and, in a hook on the clean run, overwrite the heads outside the circuit.")}
    """),
    code("""
    def faithfulness(model, pairs, heads_in_circuit):
        # YOUR CODE HERE
        return None

    print("not attempted yet" if faithfulness(model, pairs, set()) is None else "attempted")
    """),
    solution("""
    # Solution
    def faithfulness(model, pairs, heads_in_circuit):
        names = [f"blocks.{l}.attn.hook_z" for l in range(model.cfg.n_layers)]
        with torch.no_grad():
            _, corr = model.run_with_cache(pairs.corrupted_tokens, names_filter=lambda n: n in names)
        def knock_out(z, hook):
            l = int(hook.name.split(".")[1])
            for h in range(model.cfg.n_heads):
                if (l, h) not in heads_in_circuit:
                    z[:, :, h] = corr[hook.name][:, :, h]
            return z
        with torch.no_grad():
            logits = model.run_with_hooks(pairs.clean_tokens, fwd_hooks=[(n, knock_out) for n in names])
        return (metric(logits).mean().item() - corrupted_ld) / (clean_ld - corrupted_ld)

    ranked = exact.assign(size=exact["effect"].abs()).sort_values("size", ascending=False)
    heads = list(zip(ranked["layer"], ranked["head"]))
    all_heads = set(heads)
    assert abs(faithfulness(model, pairs, all_heads) - 1.0) < 1e-4   # nothing knocked out: the clean run
    curve = pd.DataFrame([dict(k=k, faithfulness=faithfulness(model, pairs, set(heads[:k]))) for k in range(len(heads) + 1)])
    import plotly.express as px
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

# ============================================================================= 03 noise and collapse

NB03 = [
    md("""
    # 03 · Norm noise and circuit collapse: Pre-Norm vs QKV-Norm

    Menary et al. argue that under Pre-Norm, semantic subspaces interfere through the shared norm |x|:
    change one component and the scale of every other one changes. They model that interference as
    multiplicative noise on the norms of queries, keys and values, v → (1+κ)v, and measure two things:
    per-token accuracy as the noise grows, and **circuit collapse**, a sparse attention row (max weight ≥ 95%)
    that jumps to another token. Under QKV-Norm the per-head norm removes such noise by construction.

    **What you will learn**
    1. the `NormNoise` hooks, and how to check what they do;
    2. accuracy under noise for both models;
    3. the exact collapse condition and the theory's collapse probability (with a Monte Carlo check);
    4. measured collapse vs the theory's prediction.
    """),
    code(SETUP),
    code("""
    from interp_norm import theory
    from interp_norm.noise import NormNoise, collapse_thresholds, run_collapse, run_noise

    pre, pre_info = load_pretrained("pre")
    qkv, qkv_info = load_pretrained("qkv")
    task = pre_info.task
    batch = task.test_set("id", size=256)
    """),
    md(f"""
    ## 1. The noise hooks
    **What you will learn:** how noise enters. `NormNoise(model, level)` multiplies every query, key and
    value vector by (1+κ), κ uniform with RMS `level` (the paper's choice), independently per example,
    position, layer and head. It works as a context manager, or as a hook list (`noise.hooks()`).

    ### Exercise 1 — check the factor
    Run the Pre-Norm model with `NormNoise(pre, 0.05, targets="q", layers=[0])` and cache `blocks.0.attn.hook_q`.
    Show that the ratio of noisy to clean query norms is 1+κ, with κ from `noise.last_kappa[(0, "q")]`,
    and that the RMS of κ is close to 0.05.

    {hints("Enter the noise context first, then `run_with_cache`: the cache then records the noised q.",
           "`last_kappa[(0, 'q')]` has shape `[batch, pos, head, 1]`.")}
    """),
    code("""
    tokens = batch.tokens[:64]
    # YOUR CODE HERE
    """),
    solution("""
    # Solution
    with torch.no_grad():
        _, clean = pre.run_with_cache(tokens, names_filter="blocks.0.attn.hook_q")
        with NormNoise(pre, 0.05, targets="q", layers=[0], seed=1) as noise:
            _, noisy = pre.run_with_cache(tokens, names_filter="blocks.0.attn.hook_q")
    ratio = noisy["blocks.0.attn.hook_q"].norm(dim=-1) / clean["blocks.0.attn.hook_q"].norm(dim=-1)
    kappa = noise.last_kappa[(0, "q")][..., 0]
    torch.testing.assert_close(ratio, 1 + kappa, atol=1e-5, rtol=1e-5)
    print(f"|q| ratio = 1 + κ everywhere; RMS of κ = {kappa.pow(2).mean().sqrt():.4f} (asked for 0.05)")
    """),
    md("""
    ## 2. Accuracy under noise
    **What you will learn:** how fragile each model is. Noise hits all layers at once, so errors compound
    with depth, as in the paper. The *sparse rows only* / *non-sparse rows only* variants put the q/k noise only
    on attention rows whose clean max weight is ≥ 95% / < 70%. The paper's Pre-Norm loses ≳10% per-token
    accuracy at 1% noise, mostly through non-sparse heads; QKV-Norm is flat.
    """),
    code("""
    levels = (0.0, 0.003, 0.01, 0.03, 0.1, 0.3)
    kw = dict(n_examples=256, n_datasets=2, seed=0)
    acc = pd.concat([run_noise(pre, task, levels, variant="Pre-Norm", **kw),
                     run_noise(qkv, task, levels, variant="QKV-Norm", **kw)], ignore_index=True)
    plots.plot_accuracy_vs_noise(acc)
    """),
    md(f"""
    ## 3. When does a circuit collapse?
    **What you will learn:** the condition and its probability. Scaling q by (1+κ_q) and key t by (1+κ_t)
    turns score w_t into (1+κ_q)(1+κ_t)w_t. The query factor rescales the whole row, so it cannot change the
    argmax: a sparse row collapses exactly when some t ≠ t* has (1+κ_t)·w_t > (1+κ_t*)·w_t*
    (`theory.collapse_condition_exact`). `theory.predicted_collapse_probability` integrates that over the
    noise law exactly.

    ### Exercise 2 — Monte Carlo check of the prediction
    Take the clean scores of one sparse row of the Pre-Norm model, draw 20 000 sets of key factors κ_t
    (uniform, RMS 0.2: half-width √3·0.2), and estimate P(collapse); compare with the prediction.

    {hints("`theory.NoiseLaw(0.2).sample(shape, generator)` draws κ.",
           "Broadcast the row `[T]` against `κ` of shape `[draws, T]` and call `theory.collapse_condition_exact`.")}
    """),
    code("""
    with torch.no_grad():
        _, cache = pre.run_with_cache(batch.tokens[:64])
    layer = pre.cfg.n_layers - 1
    scores = cache[f"blocks.{layer}.attn.hook_attn_scores"]          # [batch, head, query, key]
    pattern = cache[f"blocks.{layer}.attn.hook_pattern"]
    sparse = theory.sparse_mask(pattern)                             # max weight >= 95%
    sparse[:, :, 0] = False                                          # row 0 ('[') can only attend to itself
    law = theory.NoiseLaw(0.2)
    rows = scores[sparse].double()                                   # [n_sparse, key]
    p_all = theory.predicted_collapse_probability(rows, law)         # one probability per sparse row
    i = int(p_all.argmax())                                          # the most fragile sparse row
    row, predicted = rows[i], float(p_all[i])
    print(f"{len(rows)} sparse rows in layer {layer}; mean predicted P(collapse) at 20% noise {p_all.mean():.4f}")
    print(f"the most fragile one: predicted P(collapse) = {predicted:.4f}")
    # YOUR CODE HERE: a Monte Carlo estimate
    """),
    solution("""
    # Solution
    g = torch.Generator().manual_seed(0)
    kappa = law.sample((20_000, row.shape[-1]), g).double()
    collapsed = theory.collapse_condition_exact(row.expand_as(kappa), kappa)
    mc = collapsed.double().mean().item()
    se = (mc * (1 - mc) / len(kappa)) ** 0.5
    print(f"Monte Carlo {mc:.4f} ± {se:.4f} vs predicted {predicted:.4f}")
    assert abs(mc - predicted) < 5 * se + 1e-3
    """),
    md("""
    ## 4. Measured collapse vs the theory
    **What you will learn:** whether the models behave as predicted. `run_collapse` takes each layer's clean
    queries and keys, applies fresh noise many times (each layer on its clean inputs, as in the paper) and counts
    how often sparse rows change their argmax (*loose*) or move to another token with ≥ 95% weight (*strict*).
    Beside each measured rate is the theory's prediction for the same rows. For QKV-Norm the noise placed before
    the norm is removed (flat zero); the *noise after norm* series asks how fragile its attention would be if
    noise survived. The paper: 1% of Pre-Norm's sparse rows collapse at about 11% noise (loose), 17% (strict).
    """),
    code("""
    levels = (0.02, 0.05, 0.1, 0.17, 0.3, 0.5)
    kw = dict(n_examples=128, n_draws=32, strict_samples=64, seed=0)
    collapse = pd.concat([
        run_collapse(pre, task, levels, variant="Pre-Norm", **kw),
        run_collapse(qkv, task, levels, variant="QKV-Norm", **kw),
        run_collapse(qkv, task, levels, variant="QKV-Norm, noise after norm", placement="after_norm", **kw),
    ], ignore_index=True)
    plots.plot_collapse_vs_noise(collapse)
    """),
    code("""
    th = collapse_thresholds(collapse)
    th[th["layer"].astype(str) == "all"][["variant", "definition", "level_measured", "level_predicted"]]
    """),
    md("""
    **Questions to think about.** Is the measured curve within sampling error of the prediction? Which layers
    collapse first, and do they have more or fewer sparse rows? Why does the query noise not matter for
    collapse, but matter for accuracy?

    **Next:** `04_geometry.ipynb` looks at the representation structure that makes Pre-Norm vulnerable.
    """),
]

# ============================================================================= 04 geometry

NB04 = [
    md("""
    # 04 · Geometry: norm spread, orthogonal spheres and the LayerNorm ellipsoid

    Theorem 2 of Menary et al.: a Pre-Norm head sees x/|x|, so the semantic subspaces of the residual stream
    stay independent only if they are **orthogonal spheres** — each component of constant norm, the components
    mutually orthogonal. QKV-Norm needs only linear independence (Theorem 3).

    **What you will learn**
    1. the attended-embedding norm spread (the paper: 90% of Pre-Norm's mass within ±20%);
    2. attention sparsity (Pre-Norm peaks at max weight 1);
    3. the orthogonal-spheres score and principal angles between subspaces;
    4. the image of a LayerNorm: an ellipsoid (Riechers 2024), checked on cached activations.
    """),
    code(SETUP),
    code("""
    from interp_norm import geometry as G

    pre, pre_info = load_pretrained("pre")
    qkv, qkv_info = load_pretrained("qkv")
    task = pre_info.task
    geo = G.compare_geometry({"Pre-Norm": pre, "QKV-Norm": qkv}, task, n=128, seed=0)
    sorted(geo)
    """),
    md("""
    ## 1. Norm spread
    **What you will learn:** how constant |x| is where heads look. For every head the residual-stream norms of
    the attended tokens, weighted by attention, are compared with the head's median; the box shows the middle
    50% and the whiskers 90% of the attention mass, per layer.
    """),
    code("""
    plots.plot_norm_spread(geo["norm_spread"])
    """),
    md("""
    ## 2. Attention sparsity
    **What you will learn:** how peaked attention is. The histogram of the max weight of each attention row
    (row 0 excluded): the paper finds Pre-Norm peaked at 1 and QKV-Norm weighted towards low values.
    """),
    code("""
    plots.plot_attention_sparsity(geo["sparsity_hist"])
    """),
    md(f"""
    ## 3. Orthogonal spheres and subspace angles
    **What you will learn:** whether the residual components comply with Theorem 2. The residual stream at a
    layer's input is the sum of its writers (token and position embeddings, each earlier head and MLP).
    *Constancy* is how constant each component's norm is, *orthogonality* how orthogonal the components are;
    the score combines both (1 = orthogonal spheres).
    """),
    code("""
    plots.plot_sphere_scores(geo["sphere_scores"])
    """),
    md(f"""
    ### Exercise 1 — the angle between token and position embeddings
    The token subspace is spanned by the rows of `W_E` (17 vectors), the positional subspace by the
    sinusoidal encoding's first `2·n_freq` coordinates. Compute the principal angles (degrees) between
    these two spans for the Pre-Norm model by hand, and compare with `G.principal_angles`.
    (The table `geo["subspace_angles"]` uses a different, data-driven definition: the directions holding 90%
    of each component's energy over the batch, so its `tok`/`pos` angle differs.)

    {hints("Orthonormalise both (an SVD of `W_E.T`, keeping non-zero singular values); the singular values of Q_Aᵀ Q_B are the cosines of the principal angles.",
           "The positional basis is `torch.eye(d_model)[:, :2 * n_freq]`; `G.positional_subspace(pre)` returns the same.")}
    """),
    code("""
    # YOUR CODE HERE
    """),
    solution("""
    # Solution
    cfg = pre.cfg
    U, S, _ = torch.linalg.svd(pre.W_E.detach().double().T, full_matrices=False)
    Q_tok = U[:, S > S.max() * 1e-6]
    Q_pos = torch.eye(cfg.d_model, dtype=torch.float64)[:, : 2 * cfg.n_freq]
    cosines = torch.linalg.svdvals(Q_tok.T @ Q_pos).clamp(0, 1)
    mine = torch.rad2deg(torch.arccos(cosines)).sort().values
    library = torch.rad2deg(G.principal_angles(pre.W_E.detach().double().T, G.positional_subspace(pre)))
    print("by hand (smallest 5):", mine[:5].numpy().round(2), " library:", library[:5].numpy().round(2))
    torch.testing.assert_close(mine, library, atol=1e-6, rtol=0)
    """),
    code("""
    angles = geo["subspace_angles"]
    plots.plot_subspace_angles(angles[angles["variant"] == "Pre-Norm"].drop(columns="variant"))
    """),
    md(f"""
    ## 4. The LayerNorm ellipsoid
    **What you will learn:** what a LayerNorm's outputs look like. LN(x) = g ⊙ (x − mean)/√(var + ε) + b lies
    on a hyperplane through b with normal ∝ 1/g, inside an ellipsoid whose semi-axes come from the gains
    (Riechers 2024). Every feed-forward block here has a Pre-LayerNorm (`ln2`).
    """),
    code("""
    plots.plot_ellipsoid_axes(geo["ellipsoid_axes"])
    """),
    md(f"""
    ### Exercise 2 — check the ellipsoid on real activations
    With `y = blocks.0.ln2.hook_normalized` (the full LN output), `g = blocks[0].ln2.w`, `b = blocks[0].ln2.b`
    and `σ² = var(x)`: show that u = (y − b)/g has mean 0 and |u|²/N = σ²/(σ² + ε), i.e. every output lies
    inside the ellipsoid (strictly, because of ε) and typical ones very near its surface.

    {hints("`blocks.0.ln2.hook_scale` is √(σ² + ε), so σ²/(σ² + ε) = 1 − ε/scale².", "N is d_model; ε is `pre.cfg.eps`.")}
    """),
    code("""
    with torch.no_grad():
        _, cache = pre.run_with_cache(task.test_set("id", 64).tokens)
    # YOUR CODE HERE
    """),
    solution("""
    # Solution
    ln = pre.blocks[0].ln2
    y = cache["blocks.0.ln2.hook_normalized"].double()
    scale = cache["blocks.0.ln2.hook_scale"].double()
    u = (y - ln.b.detach().double()) / ln.w.detach().double()
    N = pre.cfg.d_model
    membership = u.pow(2).sum(-1) / N
    expected = 1 - pre.cfg.eps / scale[..., 0] ** 2
    torch.testing.assert_close(u.mean(-1), torch.zeros_like(u.mean(-1)), atol=1e-5, rtol=0)
    torch.testing.assert_close(membership, expected, atol=1e-5, rtol=1e-5)
    print(f"|u|²/N between {membership.min():.6f} and {membership.max():.6f}: inside the ellipsoid, near its surface")
    """),
    md("""
    **Next:** `05_train_your_own_variant.ipynb` trains a model of your own design on the CPU.
    """),
]

# ============================================================================= 05 train

NB05 = [
    md("""
    # 05 · Train your own variant

    **What you will learn**
    1. the configuration objects: model, task and training recipe;
    2. a short CPU training run with checkpoints, and resuming it;
    3. evaluating it and comparing it with a shipped model.

    The shipped checkpoints were trained with `interp-norm train --preset cpu` for much longer; here we run a
    couple of hundred steps, enough to see learning start (about half a minute).
    """),
    code(SETUP),
    code("""
    import tempfile
    from pathlib import Path

    from interp_norm.checkpoints import load_checkpoint
    from interp_norm.evaluate import evaluate
    from interp_norm.model import ModelConfig
    from interp_norm.task import AdditionTask
    from interp_norm.train import TrainConfig, train
    """),
    md("""
    ## 1. Configurations
    **What you will learn:** what you can change. `ModelConfig.preset("cpu", attn_norm=...)` picks the
    architecture; `attn_norm` is one of `pre`, `qkv`, `qk` (QK-Norm, as in Qwen3 / Gemma 3 / OLMo 2) or
    `none`, and `norm_kind` is `rms` or `ln`. The task preset `cpu` is a smaller version of the paper's task.
    """),
    code("""
    task = AdditionTask.preset("cpu")
    model_cfg = ModelConfig.preset("cpu", attn_norm="qk", seed=0)
    train_cfg = TrainConfig.preset("cpu", max_steps=120, log_every=20, eval_every=60, eval_size=64,
                                   final_eval_size=128, checkpoint_every=60, seed=0)
    print(task)
    print({k: getattr(model_cfg, k) for k in ("attn_norm", "norm_kind", "n_layers", "n_heads", "d_model", "d_head")})
    print({k: getattr(train_cfg, k) for k in ("lr", "batch_size", "max_steps", "grad_clip")})
    """),
    md("""
    ## 2. Train, checkpoint, resume
    **What you will learn:** how runs are stored. A run folder holds step checkpoints (safetensors weights,
    JSON config with checksums, the training curve) and a `LATEST` pointer; `resume=True` continues
    bit-exactly from the newest one.
    """),
    code("""
    run_dir = Path(tempfile.mkdtemp(prefix="interp-norm-tutorial-")) / "qk-run"
    model, curve = train(model_cfg, task, train_cfg, run_dir, progress=False)
    print(sorted(p.name for p in run_dir.iterdir()))
    curve.tail()
    """),
    code("""
    # continue the same run for 60 more steps
    model, curve = train(model_cfg, task, train_cfg.replace(max_steps=180), run_dir, resume=True, progress=False)
    import plotly.express as px
    px.line(curve, x="examples", y=["loss", "acc"], title="Training curve (loss and per-token accuracy)")
    """),
    md("""
    ## 3. Evaluate and compare
    **What you will learn:** per-split accuracy. `evaluate` reports teacher-forced per-token accuracy and
    exact match (greedy generation) on fixed, seeded test sets.
    """),
    code("""
    mine, info = load_checkpoint(run_dir)
    shipped_name = "qk" if "qk" in set(list_pretrained()["name"]) else "pre"
    shipped, shipped_info = load_pretrained(shipped_name)
    table = pd.concat([
        evaluate(mine, info.task, size=128).assign(model=f"mine ({info.step} steps)"),
        evaluate(shipped, shipped_info.task, size=128).assign(model=f"shipped {shipped_name} ({shipped_info.step} steps)"),
    ])
    table[["model", "split", "per_token_acc", "exact_match"]]
    """),
    md(f"""
    ### Exercise — a LayerNorm variant
    Train a `tiny` model (`ModelConfig.preset("tiny", ...)`) with `attn_norm="qkv"` and `norm_kind="ln"` for
    60 steps on the same task, and check that its QKV norms are LayerNorms: the normalised queries of each head
    (`blocks.0.attn.hook_q_normed`, before the gain) should have mean ≈ 0 over `d_head`.

    {hints("The tiny preset's context is 32 tokens, enough for the cpu task.",
           "With per-head gains g, `hook_q_normed / g` undoes the gain: `model.blocks[0].attn.q_norm.w` has shape `[n_heads, d_head]`.")}
    """),
    code("""
    # YOUR CODE HERE
    """),
    solution("""
    # Solution
    ln_cfg = ModelConfig.preset("tiny", attn_norm="qkv", norm_kind="ln", seed=1)
    ln_model, _ = train(ln_cfg, task, TrainConfig.preset("cpu", max_steps=60, log_every=20, eval_every=60,
                        eval_size=32, final_eval_size=32, checkpoint_every=60), run_dir.parent / "ln-run", progress=False)
    with torch.no_grad():
        _, cache = ln_model.run_with_cache(task.test_set("id", 32).tokens)
    g = ln_model.blocks[0].attn.q_norm.w.detach()            # [head, d_head]
    q = cache["blocks.0.attn.hook_q_normed"] / g             # undo the gain
    print("largest |mean over d_head| of the normalised queries:", float(q.mean(-1).abs().max()))
    assert q.mean(-1).abs().max() < 1e-4
    """),
    md("""
    From the command line the same run is `interp-norm train --out runs/qk --attn-norm qk --steps 300`, and
    `interp-norm dashboard runs/qk` builds the full dashboard for it, next to any other checkpoints you pass.
    """),
]

NOTEBOOKS = {
    "01_quickstart.ipynb": NB01,
    "02_finding_the_addition_circuit.ipynb": NB02,
    "03_norm_noise_and_circuit_collapse.ipynb": NB03,
    "04_geometry.ipynb": NB04,
    "05_train_your_own_variant.ipynb": NB05,
}


def build(out_dir: Path = HERE) -> list[Path]:
    paths = []
    for name, cells in NOTEBOOKS.items():
        nb = new_notebook(cells=cells)
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nb.metadata["language_info"] = {"name": "python"}
        for i, c in enumerate(nb.cells):
            c["id"] = f"{name.split('_')[0]}-{i:02d}"  # stable ids: rebuilding gives identical files
        nbformat.validate(nb)
        path = out_dir / name
        nbformat.write(nb, path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in build():
        print("wrote", p)
