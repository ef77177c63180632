"""Tutorial 01 (quickstart): its cells, in order (built into the .ipynb by ``build_notebooks.py``)."""

from __future__ import annotations

from _cells import code, difficulty, exercise, hints, md, setup, solution  # noqa: F401

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

    **Exercises** (each checked by `check_<name>(...)`, which reports **[PASS]**, **[FAIL]** with the first
    mismatch, or **[TODO]** if not attempted yet; solutions are collapsed below each exercise): 1 · recompute the attention scores,
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
    model, info = load_with_info("pre")
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
    and a negative answer looks like `[2-9=N7]`. The same holds everywhere in the package (`interp_norm.core.task`).
    """),
    code("""
    from interp_norm.core.task import VOCAB, encode, decode, parse_problem

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
    `interp_norm.core.hook_names.act_name("q", 0)` builds them like TransformerLens's `utils.get_act_name`, plus the
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
    from interp_norm.core.hook_names import act_name

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
    **What you will learn:** reading attention with token labels. `attention_patterns` runs the model
    on problems and returns a tidy table; `plots.plot_attention_patterns` draws every layer × head for one
    problem (the dropdown picks the problem). Axis labels are `token·position`.
    """),
    code("""
    from interp_norm.circuits.attention_maps import attention_patterns

    problems = [problem.text, info.task.sample_problems(1, "extrap", seed=1)[0].text]
    patterns = attention_patterns(model, problems, name="Pre-Norm")
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
           "The query positions to keep are where `tokens[:, 1:] != PAD_ID` (`from interp_norm.core.task import PAD_ID`).")}
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
