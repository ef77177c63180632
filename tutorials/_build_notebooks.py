"""Build tutorials/*.ipynb from the cell lists below (edit here, then run this file).

    .venv/bin/python tutorials/_build_notebooks.py             # write the six .ipynb (no outputs)
    .venv/bin/python tutorials/_build_notebooks.py --execute   # also run them and write tutorials/html/*.html

Notebooks are written without outputs; CI executes them top to bottom (tests/test_tutorials.py).
``--execute`` runs each in a fresh kernel and, if nbconvert is installed, writes an offline HTML page
per notebook (all pages share one local plotly.min.js and one notebook.css, no CDN; see ``_export.py``) so the
figures show without Jupyter.

Exercise convention (ARENA-style; every section opens with "What you will learn"):

1. a markdown cell: the task, ``Difficulty: 🔴🔴⚪⚪⚪ · ~10 min``, collapsed hints;
2. one code cell with the learner's function — a stub returning ``None`` — followed by the call
   ``check_<name>(<name>, ...)``. The checks live in ``_checks.py`` (imported by the setup cell):
   each compares the learner's output with an independent computation and prints ✅ / ❌ / ⬜
   "not attempted yet"; it never raises for an unattempted or broken attempt;
3. the solution as *text*: a collapsed ``<details>`` markdown block showing the source of the
   function of the same name in ``_solutions.py``.

So Run All never redefines the learner's function (no executable cell after the stub defines that
name; a test parses every cell to make sure), and the notebooks never depend on the learner's
answer: cells after an exercise use the library (e.g. ``circuits.faithfulness``) for what comes next.
CI executes the notebooks with the stubs unattempted (each check prints ⬜), and the fast tests run
every check on its ``_solutions.py`` function (must pass) and on a deliberately wrong one (must fail).
"""

from __future__ import annotations

import argparse
import inspect
import sys
import textwrap
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import _solutions  # noqa: E402  (the solution sources shown in the notebooks)

SETUP = """\
import os
import sys
import warnings
os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", message="IProgress not found")  # progress bars fall back to text
if not os.path.exists("_checks.py") and os.path.exists("tutorials/_checks.py"):
    sys.path.insert(0, "tutorials")  # the kernel was started in the repository root, not in tutorials/
import numpy as np
import pandas as pd
import torch
torch.set_num_threads(1)   # these small models run fastest on one thread
torch.manual_seed(0)

from interp_norm import plots
from interp_norm.checkpoints import list_pretrained, load_pretrained
"""


def setup(*checks: str) -> str:
    """The setup cell, importing this notebook's exercise checks from tutorials/_checks.py."""
    return SETUP + f"from _checks import {', '.join(f'check_{c}' for c in checks)}  # tutorials/_checks.py\n"


def md(text: str):
    return new_markdown_cell(textwrap.dedent(text).strip("\n"))


def code(text: str):
    return new_code_cell(textwrap.dedent(text).strip("\n"))


def hints(*items: str) -> str:
    """Collapsed hints for a markdown f-string; continuation lines carry the cell's 4-space indent so
    that :func:`md`'s dedent still applies to the whole cell."""
    text = "\n".join(f"<details><summary>Hint {i + 1}</summary>\n\n{textwrap.dedent(h).strip()}\n\n</details>\n"
                      for i, h in enumerate(items))
    return text.replace("\n", "\n    ")


def difficulty(level: int, minutes: int) -> str:
    """ARENA-style badge: ``Difficulty: 🔴🔴⚪⚪⚪ · ~10 min``."""
    return f"> **Difficulty:** {'🔴' * level}{'⚪' * (5 - level)} · **~{minutes} min**"


def exercise(name: str, stub: str):
    """The learner's cell: the stub of ``name`` and the call of its check (``stub`` must contain both)."""
    cell = code(stub)
    assert f"def {name}(" in cell.source and f"check_{name}({name}," in cell.source, name
    cell.metadata["tags"] = ["exercise"]
    return cell


def solution(name: str):
    """A collapsed markdown block with the source of ``_solutions.<name>`` (text, never executed)."""
    source = inspect.getsource(getattr(_solutions, name)).strip("\n")
    cell = new_markdown_cell(
        f"<details><summary>Solution: <code>{name}</code> (try first!)</summary>\n\n"
        f"```python\n{source}\n```\n\n</details>"
    )
    cell.metadata["tags"] = ["solution"]
    return cell


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
    2. how problems become tokens (including the `N` for negative numbers), and how the model answers;
    3. `run_with_cache`: every activation by its TransformerLens name;
    4. hooks: change a forward pass, and have the change undone automatically;
    5. read attention patterns, with an exercise on finding a previous-token head.

    **Exercises** (each checked by `check_<name>(...)`, which prints ✅, ❌ with the first mismatch, or ⬜ if
    not attempted yet; solutions are collapsed below each exercise): 1 · recompute the attention scores,
    2 · the most important head, 3 · previous-token heads.
    """),
    code(setup("my_scores", "most_important_head", "prev_token_scores")),
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
    **What you will learn:** the vocabulary and the problem format.
    A problem is `[` + terms + `=` + answer + `]`, one character per token; batches are right-padded with `*`.
    The model reads the question and must produce the answer.

    **The `N` notation.** A negative number is written with a leading `N` (`N7` is −7), so that `-` is always
    the subtraction *operator* and never a sign: `[7-N3=10]` reads 7 − (−3) = 10, `[N2+5=3]` is −2 + 5 = 3,
    and a negative answer looks like `[2-9=N7]`. The same holds everywhere in the package (`interp_norm.task`).
    """),
    code("""
    from interp_norm.task import VOCAB, encode, decode, parse_problem

    print("vocabulary:", "".join(VOCAB), f"({len(VOCAB)} tokens)")
    for text in ("[7-N3=10]", "[N2+5=3]", "[2-9=N7]"):
        p = parse_problem(text)
        print(f"{text:12s} terms {p.terms} -> result {p.result}")
    problem = info.task.sample_problems(1, "id", seed=3)[0]
    print("a test problem:", problem.text, " terms:", problem.terms, " result:", problem.result)
    tokens = model.to_tokens(problem.question)
    print("question tokens:", tokens.tolist(), "=", model.to_str_tokens(tokens[0]))
    print("the model answers:", model.generate([problem.question])[0], " (true answer:", problem.answer + ")")
    """),
    md("""
    ## 3. `run_with_cache`
    **What you will learn:** where every activation lives. The names are TransformerLens's
    (`blocks.{l}.attn.hook_q`, `hook_pattern`, `hook_resid_pre` ...), so TransformerLens tools work unchanged;
    `interp_norm.hooks.act_name("q", 0)` builds them like TransformerLens's `utils.get_act_name`, plus the
    QK/QKV-Norm hooks (`act_name("q_normed", 0)`). We run the *full* problem (question and answer): the
    logits at position p predict token p+1, and only answer tokens are scored.
    """),
    code("""
    logits, cache = model.run_with_cache(encode(problem.text)[None])
    print("logits:", tuple(logits.shape), "= [batch, position, vocabulary]")
    for name in [k for k in cache.keys() if k.startswith("blocks.0.")]:
        print(f"{name:34s} {tuple(cache[name].shape)}")
    """),
    md(f"""
    ### Exercise 1 — recompute the attention scores
    {difficulty(2, 10)}

    Write `my_scores(model, cache, layer)`. In a Pre-Norm model the scores of layer `l` are
    `q · k / attn_scale` with `q = cache[f"blocks.{{l}}.attn.hook_q"]`, `k = ...hook_k` (shape
    `[batch, pos, head, d_head]`) and `attn_scale = model.cfg.attn_scale`; the causal mask sets the keys after
    each query to `-inf`. Return `scores[b, h, q, k]`. The check compares your scores with
    `blocks.{{l}}.attn.hook_attn_scores` in every layer, and their softmax with `hook_pattern`.
    (QK/QKV-Norm models score the *normalised* q and k, `hook_q_normed`: the solution handles both.)

    {hints("`torch.einsum('bqhd,bkhd->bhqk', q, k)` contracts the head dimension.",
           "`torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)` marks the keys after each query; `scores.masked_fill(mask, float('-inf'))`.")}
    """),
    exercise("my_scores", """
    def my_scores(model, cache, layer):
        # YOUR CODE HERE: return the scores [batch, head, query, key], -inf above the diagonal
        return None

    check_my_scores(my_scores, model, cache)
    """),
    solution("my_scores"),
    md("""
    ## 4. Hooks
    **What you will learn:** how to intervene. A hook is a function `(activation, hook) -> activation`
    attached to a hook name. `with model.hooks(fwd_hooks=[...])` attaches hooks for the duration of the
    block and removes them on exit, even after an exception. Here we zero-ablate one head at a time
    (its `hook_z`, the per-head output before W_O) and measure how much the answer loss rises.
    """),
    code("""
    from interp_norm.hooks import act_name

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
                with model.hooks(fwd_hooks=[(act_name("z", layer), zero_head(head))]):
                    loss = model(batch.tokens, return_type="loss").item()
                rows.append(dict(layer=layer, head=head, loss_increase=loss - clean_loss))
    ablation = pd.DataFrame(rows)
    print(f"clean loss {clean_loss:.3f}; hooks left on the model afterwards: {len(model.hook_dict[act_name('z', 0)].fwd_hooks)}")
    import plotly.express as px
    px.imshow(ablation.pivot(index="layer", columns="head", values="loss_increase"), color_continuous_scale="Reds",
              title="Loss increase when one head is zero-ablated", labels=dict(color="Δ loss"))
    """),
    md(f"""
    ### Exercise 2 — the most important head
    {difficulty(1, 5)}

    Write `most_important_head(ablation)`: which (layer, head) raises the loss most when ablated? Return it as a
    tuple of two ints. The check compares with a plain loop over the rows, on this table and on a shuffled
    synthetic one.

    {hints("`DataFrame.idxmax()` gives the row label of the largest value; `.loc[label]` reads that row.")}
    """),
    exercise("most_important_head", """
    def most_important_head(ablation):
        # YOUR CODE HERE: return (layer, head)
        return None

    check_most_important_head(most_important_head, ablation)
    """),
    solution("most_important_head"),
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
    {difficulty(2, 15)}

    A *previous-token head* puts its attention on the token just before the query. Write
    `prev_token_scores(model, tokens)`: for every head, the mean attention from each query position p ≥ 1 to
    p−1, over every (example, p) whose token at p is not padding. Return a DataFrame with columns
    `layer, head, prev_token_score` (one row per head). The check compares with a loop over examples and
    positions.

    {hints("`pattern.diagonal(offset=-1, dim1=-2, dim2=-1)` gives `pattern[..., p, p-1]` with shape `[batch, head, pos-1]`.",
           "The query positions to keep are where `tokens[:, 1:] != PAD_ID` (`from interp_norm.task import PAD_ID`).")}
    """),
    exercise("prev_token_scores", """
    def prev_token_scores(model, tokens):
        # YOUR CODE HERE: return a DataFrame with columns layer, head, prev_token_score
        return None

    check_prev_token_scores(prev_token_scores, model, batch.tokens[:64])
    """),
    solution("prev_token_scores"),
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
    4. measured collapse vs the theory's prediction, and how to read the 1%-collapse thresholds (and their NaNs).

    **Exercises:** 1 · the noise factor on |q|, 2 · a Monte Carlo estimate of the collapse probability.
    """),
    code(setup("query_norm_ratio", "mc_collapse_probability")),
    code("""
    from interp_norm import theory
    from interp_norm.hooks import act_name
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
    position, layer and head. It works as a context manager, or as a hook list (`noise.hooks()`); after a
    forward pass, `noise.last_kappa[(layer, "q")]` holds the κ it used.

    ### Exercise 1 — the factor on |q|
    {difficulty(2, 10)}

    Write `query_norm_ratio(model, tokens, level, seed)`: run the model once clean and once under
    `NormNoise(model, level, targets="q", layers=[0], seed=seed)`, cache `blocks.0.attn.hook_q` in both, and
    return the ratio of noisy to clean query norms, shape `[batch, pos, head]`. It should be exactly 1+κ: the
    check compares it with `last_kappa` of the same seeded noise, at two levels.

    {hints("Enter the noise context, then `run_with_cache`: the cache then records the noised q.",
           "`.norm(dim=-1)` takes the norm over d_head.")}
    """),
    exercise("query_norm_ratio", """
    def query_norm_ratio(model, tokens, level, seed):
        # YOUR CODE HERE: return |q_noisy| / |q_clean| in layer 0, shape [batch, pos, head]
        return None

    check_query_norm_ratio(query_norm_ratio, pre, batch.tokens[:64])
    """),
    solution("query_norm_ratio"),
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
    md("""
    ## 3. When does a circuit collapse?
    **What you will learn:** the condition and its probability. Scaling q by (1+κ_q) and key t by (1+κ_t)
    turns score w_t into (1+κ_q)(1+κ_t)w_t. The query factor rescales the whole row, so it cannot change the
    argmax: a sparse row collapses exactly when some t ≠ t* has (1+κ_t)·w_t > (1+κ_t*)·w_t*
    (`theory.collapse_condition_exact`). `theory.predicted_collapse_probability` integrates that over the
    noise law exactly. Below we take the clean scores of the sparse rows of every layer and pick the most
    fragile one.
    """),
    code("""
    with torch.no_grad():
        _, cache = pre.run_with_cache(batch.tokens[:64])
    law = theory.NoiseLaw(0.2)
    candidates = []
    for layer in range(pre.cfg.n_layers):
        scores = cache[act_name("attn_scores", layer)]                # [batch, head, query, key]
        sparse = theory.sparse_mask(cache[act_name("pattern", layer)])  # max weight >= 95%
        sparse[:, :, 0] = False                                         # row 0 ('[') can only attend to itself
        rows = scores[sparse].double()                                  # [n_sparse, key]
        if len(rows):
            p = theory.predicted_collapse_probability(rows, law)        # one probability per sparse row
            print(f"layer {layer}: {len(rows)} sparse rows, mean predicted P(collapse) at 20% noise {p.mean():.4f}")
            candidates.append((float(p.max()), layer, rows[int(p.argmax())]))
    predicted, layer, row = max(candidates, key=lambda c: c[0])
    print(f"the most fragile sparse row (layer {layer}): predicted P(collapse) = {predicted:.4f}")
    """),
    md(f"""
    ### Exercise 2 — Monte Carlo check of the prediction
    {difficulty(3, 15)}

    Write `mc_collapse_probability(row, level, n_draws, seed)`: draw `n_draws` sets of key factors κ_t for the
    scores `row` (uniform, RMS `level`: half-width √3·level; use a `torch.Generator` seeded with `seed`) and
    return the fraction of draws in which the row collapses. The check compares your estimate with the exact
    integral (`theory.predicted_collapse_probability`) within five Monte Carlo standard errors, on this row at
    20% noise and on a synthetic row.

    {hints("`theory.NoiseLaw(level).sample((n_draws, len(row)), generator)` draws κ.",
           "Broadcast the row `[T]` against `κ` of shape `[n_draws, T]` and call `theory.collapse_condition_exact(row.expand_as(kappa), kappa)`; or compare `((1 + kappa) * row)` with its value at t* = `row.argmax()` yourself.")}
    """),
    exercise("mc_collapse_probability", """
    def mc_collapse_probability(row, level, n_draws, seed):
        # YOUR CODE HERE: return the fraction of n_draws noise draws in which the row collapses
        return None

    check_mc_collapse_probability(mc_collapse_probability, row, level=0.2)
    """),
    solution("mc_collapse_probability"),
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
    md("""
    **Reading the thresholds.** `collapse_thresholds` gives, per variant, layer and definition, the noise level
    at which 1% of the sparse rows collapse: `level_measured` from the measured curve, `level_predicted` from
    the theory's, interpolated between the tested levels. **NaN means "not reached in the tested range"**, not
    missing data: the rate never reaches 1% below the largest tested noise level (the last of `levels`), so
    that row is more robust than this sweep can resolve. (A threshold is also NaN if the rate is already
    above 1% at the smallest tested level: the crossing lies below the range.) QKV-Norm with the noise before
    its norm is NaN by construction — the norm removes the noise and nothing collapses. To turn a NaN into a
    number, extend `levels` upwards (uniform noise needs level < 1/√3 ≈ 0.577).
    """),
    code("""
    th = collapse_thresholds(collapse)
    overall = th[th["layer"].astype(str) == "all"][["variant", "definition", "level_measured", "level_predicted"]]
    curves = collapse[collapse["layer"].astype(str) == "all"]

    def why_nan(r):  # which of the two reasons makes a measured threshold NaN
        if pd.notna(r.level_measured):
            return ""
        rate = curves[(curves["variant"] == r.variant) & (curves["definition"] == r.definition)]["measured"]
        return f"below 1% up to {max(levels):.0%} noise" if rate.max() < 0.01 else f"above 1% already at {min(levels):.0%}"

    overall = overall.assign(why_nan=[why_nan(r) for r in overall.itertuples()])
    print(f"tested noise levels {levels}: {int(overall['level_measured'].isna().sum())} of {len(overall)} measured thresholds are NaN")
    overall
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

    **Exercises:** 1 · principal angles between two subspaces, 2 · the LayerNorm ellipsoid on real activations.
    """),
    code(setup("principal_angles_deg", "ln_coordinates")),
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
    md("""
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
    ### Exercise 1 — principal angles between two subspaces
    {difficulty(3, 15)}

    Write `principal_angles_deg(A, B)`: the principal angles, in degrees and ascending, between the column
    spaces of `A` `[d, k_A]` and `B` `[d, k_B]` — `min(rank A, rank B)` of them. The columns need not be
    orthonormal, and may be linearly dependent. The check compares with angles computed a different way
    (from the projectors' eigenvalues) on a known 30° case, on rank-deficient random subspaces, and on this
    model's token subspace (the span of the rows of `W_E`, i.e. the columns of `W_E.T`) against the
    sinusoidal positional subspace (`G.positional_subspace(pre)`: the first `2·n_freq` coordinates).

    {hints("Orthonormalise both: the left singular vectors of an SVD, keeping those with non-zero singular value (`S > S.max() * 1e-6`).",
           "The singular values of Q_Aᵀ Q_B are the cosines of the principal angles; clamp them to [0, 1] before `arccos`.")}
    """),
    exercise("principal_angles_deg", """
    def principal_angles_deg(A, B):
        # YOUR CODE HERE: return a 1-D tensor of angles in degrees, ascending
        return None

    check_principal_angles_deg(principal_angles_deg, pre)
    """),
    solution("principal_angles_deg"),
    md("""
    The library's `G.principal_angles` (radians) is the same computation. The table `geo["subspace_angles"]`
    uses a different, data-driven definition of each subspace: the directions holding 90% of each component's
    energy over the batch, so its `tok`/`pos` angle differs from the weight-space one.
    """),
    code("""
    weight_space = torch.rad2deg(G.principal_angles(pre.W_E.detach().double().T, G.positional_subspace(pre)))
    print("token vs positional subspace (weights), smallest angles in degrees:", weight_space[:5].numpy().round(2))
    angles = geo["subspace_angles"]
    plots.plot_subspace_angles(angles[angles["variant"] == "Pre-Norm"].drop(columns="variant"))
    """),
    md("""
    ## 4. The LayerNorm ellipsoid
    **What you will learn:** what a LayerNorm's outputs look like. LN(x) = g ⊙ (x − mean)/√(var + ε) + b lies
    on a hyperplane through b with normal ∝ 1/g, inside an ellipsoid whose semi-axes come from the gains
    (Riechers 2024). Every feed-forward block here has a Pre-LayerNorm (`ln2`).
    """),
    code("""
    plots.plot_ellipsoid_axes(geo["ellipsoid_axes"])
    """),
    md(f"""
    ### Exercise 2 — the ellipsoid on real activations
    {difficulty(2, 10)}

    Write `ln_coordinates(model, cache, layer)`: with `y = blocks.{{layer}}.ln2.hook_normalized` (the full LN
    output), `g = model.blocks[layer].ln2.w` and `b = model.blocks[layer].ln2.b`, return u = (y − b)/g,
    shape `[batch, pos, d_model]`. If the picture above is right, u = (x − mean)/√(var + ε), so u has mean 0
    and |u|²/N = σ²/(σ² + ε) < 1: every output lies inside the ellipsoid, typical ones very near its surface.
    The check compares u with (x − mean)/scale computed from ln2's *input* (`hook_resid_mid`) and `hook_scale`,
    and verifies |u|²/N = 1 − ε/scale², in every layer.

    {hints("`act_name('normalized', layer, 'ln2')` is the hook name of y; `.detach()` the parameters.",
           "`blocks.{l}.ln2.hook_scale` is √(σ² + ε), so σ²/(σ² + ε) = 1 − ε/scale²; N is d_model, ε is `model.cfg.eps`.")}
    """),
    code("""
    with torch.no_grad():
        _, cache = pre.run_with_cache(task.test_set("id", 64).tokens)
    """),
    exercise("ln_coordinates", """
    def ln_coordinates(model, cache, layer):
        # YOUR CODE HERE: return u = (y - b) / g, shape [batch, pos, d_model]
        return None

    check_ln_coordinates(ln_coordinates, pre, cache)
    """),
    solution("ln_coordinates"),
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
    2. a short CPU training run with checkpoints, resuming it, and what extending a run means;
    3. evaluating it and comparing it with a shipped model;
    4. a LayerNorm variant of QKV-Norm, and its per-head LayerNorm by hand.

    The shipped checkpoints were trained with `interp-norm train --preset cpu` for much longer; here we run a
    couple of hundred steps, enough to see learning start (about a minute on a laptop CPU).

    **Exercise:** 1 · a per-head LayerNorm by hand.
    """),
    code(setup("head_layernorm")),
    code("""
    import tempfile
    from pathlib import Path

    from interp_norm import AdditionTask, ModelConfig, TrainConfig
    from interp_norm.checkpoints import load_checkpoint
    from interp_norm.evaluate import evaluate
    from interp_norm.hooks import act_name
    from interp_norm.train import train
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
                                   final_eval_size=128, checkpoint_every=60, seed=0, min_lr=2e-4)
    print(task)
    print({k: getattr(model_cfg, k) for k in ("attn_norm", "norm_kind", "n_layers", "n_heads", "d_model", "d_head")})
    print({k: getattr(train_cfg, k) for k in ("lr", "batch_size", "max_steps", "grad_clip")})
    """),
    md("""
    ## 2. Train, checkpoint, resume
    **What you will learn:** how runs are stored, and what resuming does. A run folder holds step checkpoints
    (safetensors weights, JSON config with checksums, the training curve) and a `LATEST` pointer;
    `resume=True` continues from the newest one.
    """),
    code("""
    run_dir = Path(tempfile.mkdtemp(prefix="interp-norm-tutorial-")) / "qk-run"
    model, curve = train(model_cfg, task, train_cfg, run_dir, progress=False)
    print(sorted(p.name for p in run_dir.iterdir()))
    curve.tail()
    """),
    md("""
    **Resuming vs extending.** Resuming with the *same* `max_steps` (`--steps` on the command line), e.g. after
    an interruption, continues bit-identically: the weights equal those of an uninterrupted run. Below we
    resume with a *larger* `max_steps`, which extends the run. What that does to the learning rate is a
    choice, and this is the one made here: **the cosine schedule keeps the length it started with** (recorded
    in the checkpoint), so the extension continues the already decayed schedule and the extra steps run at
    `min_lr`; the learning rate never jumps back up to its peak (there is no restart or second warm-up).
    Training says so with a warning when the extension starts. That is why `train_cfg` above sets
    `min_lr=2e-4` (`--min-lr`): with the preset's `min_lr=0` the extra steps would run at learning rate 0 and
    leave the weights unchanged (training warns about that too). To train longer *on a full schedule*, start a
    new run with the larger total. (The paper's `"plateau"` schedule has no planned length: extending it is
    the same as having started with the larger total.) The table shows the learning rate around the step
    where the extension starts: it decays to `min_lr` at step 120 and stays there.
    """),
    code("""
    first_steps = train_cfg.max_steps
    model, curve = train(model_cfg, task, train_cfg.replace(max_steps=first_steps + 60), run_dir, resume=True, progress=False)
    display(curve[curve["step"].between(first_steps - 40, first_steps + 40)][["step", "lr", "loss", "acc"]])
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
    md("""
    ## 4. A LayerNorm variant
    **What you will learn:** the per-head norms of QKV-Norm. With `norm_kind="ln"` each head's query, key and
    value are LayerNorm-ed over `d_head` after the projection (with a learned per-head gain and no bias). We
    train a `tiny` model for 60 steps on the same task so the gains move away from 1.
    """),
    code("""
    ln_cfg = ModelConfig.preset("tiny", attn_norm="qkv", norm_kind="ln", seed=1)
    ln_model, _ = train(ln_cfg, task, TrainConfig.preset("cpu", max_steps=60, log_every=20, eval_every=60,
                        eval_size=32, final_eval_size=32, checkpoint_every=60), run_dir.parent / "ln-run", progress=False)
    with torch.no_grad():
        _, ln_cache = ln_model.run_with_cache(task.test_set("id", 32).tokens)
    print("q gains of layer 0, head 0:", ln_model.blocks[0].attn.q_norm.w[0].detach().numpy().round(3))
    """),
    md(f"""
    ### Exercise 1 — a per-head LayerNorm by hand
    {difficulty(2, 10)}

    Write `head_layernorm(q, w, eps)`: `q` is `[batch, pos, head, d_head]` (the raw `hook_q`, `hook_k` or
    `hook_v`), `w` the gain (`[head, d_head]`), `eps` the model's `cfg.eps`. Return the LayerNorm over `d_head`
    times the gain. The check feeds your function the raw q, k and v of every layer and compares with
    `torch.nn.functional.layer_norm` (head by head) and with the model's own `hook_q_normed` / `hook_k_normed` /
    `hook_v_normed`.

    {hints("Subtract the mean over the last dimension, divide by √(var + eps), multiply by `w` (it broadcasts over batch and pos).",
           "LayerNorm uses the *population* variance: `mean((x - mean)²)`, not `torch.var`'s default, which divides by d_head − 1.")}
    """),
    exercise("head_layernorm", """
    def head_layernorm(q, w, eps):
        # YOUR CODE HERE: return the per-head LayerNorm of q (over d_head) times the gain w
        return None

    check_head_layernorm(head_layernorm, ln_model, ln_cache)
    """),
    solution("head_layernorm"),
    md("""
    From the command line the same run is `interp-norm train --out runs/qk --attn-norm qk --steps 300`, and
    `interp-norm dashboard runs/qk` builds the full dashboard for it, next to any other checkpoints you pass.
    """),
]

# ============================================================================= 06 production architectures

NB06 = [
    md("""
    # 06 · Circuit collapse in a production architecture

    The paper's question — does *where* attention normalises make its circuits fragile? — matters most for
    the models people use, and they now sit on the paper's axis: GPT-2 and Llama are **Pre-Norm**, Qwen3
    normalises q and k per head (**QK-Norm**), and Gemma 4 normalises q, k *and* v per head (**QKV-Norm**,
    its v-norm without a learnable scale). This notebook runs the analyses on TransformerLens 4
    `TransformerBridge`s of **tiny Qwen3 and Gemma 4 models built locally from their configs** (nothing is
    downloaded).

    **Say it plainly:** these models have *random weights*. They have learned no circuits, so the numbers
    below show that the machinery works on the real modelling code (norm placement, RoPE, grouped k/v
    heads, Gemma 4's score scale of 1.0), not what a trained Qwen3 does. The last section gives the
    commands to run with real weights.

    **What you will learn**
    - how `interp_norm.bridges.anatomy` describes where a production model normalises q, k and v;
    - why collapse is computed from q and k rather than from a bridge's `hook_attn_scores`;
    - how multiplicative noise on |q| and |k| changes the attention argmax without re-running the model
      (your exercise), and why noise *before* a per-head norm does nothing.
    """),
    code(setup("noised_argmax")),
    code("""
    from interp_norm.bridges import HeadNoise, anatomy, attention_scores, random_tokens, tiny_bridge, verify_scores
    from interp_norm.geometry import ellipsoid_membership

    qwen = tiny_bridge("qwen3", seed=0)    # 2 layers, 4 query heads sharing 2 k/v heads, RMS q/k norms per head
    gemma = tiny_bridge("gemma4", seed=0)  # q/k norms with a gain, v norm without; sliding + full layers
    tokens = random_tokens(qwen, 4, 12, seed=1, low=3)  # tiny models have no tokenizer: random ordinary ids
    pd.concat([anatomy(m).table() for m in (qwen, gemma)])[
        ["architecture", "layer", "placement", "n_heads", "n_kv_heads", "q_norm", "k_norm", "v_norm", "score_scale",
         "sliding_window", "scores_hook"]]
    """),
    md("""
    ## 1 · Scores you can trust

    The anatomy was derived from each model's config and module tree, then *checked on a forward pass*.
    Look at the `scores_hook` column: on Gemma 4 the bridge's `hook_attn_scores` does **not** hold the
    pre-softmax scores (`not_pre_softmax`). Collapse is therefore computed from q and k after their norms
    and rotation, and verified against the model's own pattern — that is the acceptance check below
    (`pattern_error` ≈ 1e-7 means softmax of the rebuilt scores *is* the pattern).
    """),
    code("""
    pd.concat([verify_scores(m, tokens).assign(model=name) for name, m in (("qwen3", qwen), ("gemma4", gemma))])
    """),
    md(f"""
    ## 2 · Exercise: the noisy argmax from clean scores

    {difficulty(3, 15)}

    Noise multiplies each query by (1+κ_q) and each key by (1+κ_k), per (example, position, head). A score
    q·k is then multiplied by (1+κ_q)(1+κ_k) — RoPE rotates each vector by an orthogonal map, which commutes
    with a scalar factor — so the noisy attention's argmax can be read off the clean scores.

    Write `noised_argmax(model, cache, layer, kappa_q, kappa_k)` returning the argmax over keys,
    `[batch, head, query]`, of the noisy scores. `kappa_q` is `[batch, pos, n_heads]`, `kappa_k` is
    `[batch, pos, n_kv_heads]`: Gemma 4 and Qwen3 group key/value heads. The check re-runs the model with
    the noise hooked in after the norms and compares with the argmax of its pattern.

    {hints(
        "`attention_scores(model, cache, layer)` gives the clean scores `[batch, head, query, key]`; "
        "`anatomy(model)[layer]` has `kv_head_of` (the k/v head each query head reads) and "
        "`attention_mask(la, n_q, n_k)` the allowed keys (causal, and Gemma 4's sliding window).",
        "Broadcast (1+κ_q) over keys and (1+κ_k) over queries; mask disallowed keys with −inf before `argmax(-1)`.",
    )}
    """),
    exercise("noised_argmax", """
    def noised_argmax(model, cache, layer, kappa_q, kappa_k):
        # your code here: clean scores × (1+κ_q)(1+κ_k), masked, argmax over keys
        return None


    _, gemma_cache = gemma.run_with_cache(tokens)
    check_noised_argmax(noised_argmax, gemma, gemma_cache, tokens)
    """),
    solution("noised_argmax"),
    md("""
    ## 3 · Collapse: noise before vs after the norm

    A *collapse* is a sparse attention row (max weight ≥ 0.95) whose argmax moves under noise. We count
    argmax changes on every row with `HeadNoise` (the library's noise hooks; grouped k/v heads are noised
    once per key/value head). Noise placed *before* a per-head norm is divided out by it: on both models the
    q/k norms remove it, and on Gemma 4 the gainless v-norm removes v noise exactly. Placed *after* the
    norm it reaches the scores. *(Until `bridge_collapse` — measured and predicted collapse rates, chunked
    by layer and head — lands in `interp_norm.bridges`, this cell uses `HeadNoise` and the pattern directly.)*
    """),
    code("""
    rows = []
    for name, model in (("qwen3", qwen), ("gemma4", gemma)):
        anat = anatomy(model)
        names = [la.hooks["pattern"] for la in anat.layers]
        _, clean = model.run_with_cache(tokens, names_filter=lambda n: n in names)
        for placement in ("before_norm", "after_norm"):
            for level in (0.05, 0.2, 0.4):
                noise = HeadNoise(model, level=level, placement=placement, targets=("q", "k"), seed=2)
                with model.hooks(fwd_hooks=noise.hooks()):  # (run_with_cache ignores fwd_hooks= on a bridge)
                    _, noisy = model.run_with_cache(tokens, names_filter=lambda n: n in names)
                for l, nm in enumerate(names):
                    changed = (noisy[nm].argmax(-1) != clean[nm].argmax(-1)).double().mean().item()
                    rows.append(dict(model=name, placement=placement, level=level, layer=l, argmax_changed=changed))
    table = pd.DataFrame(rows)
    table.pivot_table(index=["model", "placement"], columns="level", values="argmax_changed")
    """),
    md("""
    Before the norm nothing moves (up to float rounding); after it, argmax changes grow with the level.
    Random tiny models attend diffusely, so few rows are sparse and "collapse" here is mostly argmax churn
    among near-equal keys. A trained model concentrates attention, and the paper's prediction is about those
    sparse rows: that is what changes with real weights.

    ## 4 · Geometry of every norm

    Every LayerNorm/RMSNorm maps its input onto an ellipsoid fixed by its gain (Riechers 2024). The check
    below holds for all of Gemma 4's norms — residual, per-head q/k, the gainless v-norm — with σ² read from
    each norm's input: `max_abs_err` is float rounding.
    """),
    code("""
    ellipsoid_membership(gemma, tokens)[["module", "role", "axis", "N", "n", "membership_mean", "predicted_mean", "max_abs_err"]]
    """),
    md("""
    ## 5 · With real weights

    Nothing here downloads. On a machine with network, fetch a model once (`hf download Qwen/Qwen3-0.6B`) and
    copy the Hugging Face cache (set `HF_HUB_CACHE`), or `save_pretrained` it into a folder. Then:

    ```bash
    interp-norm geometry Qwen/Qwen3-0.6B --out geo-qwen3            # norm spread, sparsity, every norm's ellipsoid
    interp-norm collapse Qwen/Qwen3-0.6B --out col-qwen3 --text my.txt   # collapse from clean scores (bridge_collapse)
    interp-norm noise path/to/gemma-4-folder --out noise-gemma4      # next-token agreement under noise
    interp-norm dashboard data/checkpoints/pre Qwen/Qwen3-0.6B --out dash   # its layers beside ours
    ```

    What changes: trained attention is sparse in places (induction, previous-token and copying heads), so
    the sparse-row collapse rates and their prediction become meaningful; text windows replace random ids
    (`interp_norm.bridges.text_tokens`, the shipped sample text by default); and the models are large, so
    collapse is chunked by layer and head. What does not change: the anatomy, the checks against the
    model's own pattern and the ellipsoid formula — they are the same code you ran here.
    """),
]


NOTEBOOKS = {
    "01_quickstart.ipynb": NB01,
    "02_finding_the_addition_circuit.ipynb": NB02,
    "03_norm_noise_and_circuit_collapse.ipynb": NB03,
    "04_geometry.ipynb": NB04,
    "05_train_your_own_variant.ipynb": NB05,
    "06_circuit_collapse_in_production.ipynb": NB06,
}


def build(out_dir: Path = HERE) -> list[Path]:
    paths = []
    for name, cells in NOTEBOOKS.items():
        nb = new_notebook(cells=[nbformat.from_dict(c) for c in cells])
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nb.metadata["language_info"] = {"name": "python"}
        for i, c in enumerate(nb.cells):
            c["id"] = f"{name.split('_')[0]}-{i:02d}"  # stable ids: rebuilding gives identical files
        nbformat.validate(nb)
        path = out_dir / name
        nbformat.write(nb, path)
        paths.append(path)
    return paths


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--execute", action="store_true",
                        help="also run every notebook (nbclient) and write tutorials/html/<name>.html (needs nbconvert)")
    parser.add_argument("--only", nargs="+", metavar="NAME", default=None,
                        help="with --execute: only these notebooks (e.g. 01_quickstart)")
    parser.add_argument("--html-dir", type=Path, default=HERE / "html", help="where --execute writes the HTML pages")
    args = parser.parse_args(argv)
    names = [n for n in NOTEBOOKS if args.only is None or any(n.startswith(o) for o in args.only)]
    if not names:
        parser.error(f"--only {args.only} matches none of {list(NOTEBOOKS)}")
    for p in build():
        print("wrote", p)
    if args.execute:
        from _export import execute_all

        execute_all(names, args.html_dir)


if __name__ == "__main__":
    main()
