"""Tutorial 06 (production architectures): its cells, in order (built into the .ipynb by ``build_notebooks.py``)."""

from __future__ import annotations

from _cells import code, difficulty, exercise, hints, md, setup, solution  # noqa: F401

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
    - how `interp_norm.anatomy.anatomy` describes where a production model normalises q, k and v;
    - why collapse is computed from q and k rather than from a bridge's `hook_attn_scores`;
    - how multiplicative noise on |q| and |k| changes the attention argmax without re-running the model
      (your exercise), and why noise *before* a per-head norm does nothing.
    """),
    code(setup("noised_argmax")),
    code("""
    from interp_norm.anatomy import anatomy, attention_scores, random_tokens, tiny_bridge, verify_scores
    from interp_norm.noise import HeadNoise
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
    norm it reaches the scores. *(`interp_norm.noise.bridge_collapse` gives measured and predicted collapse
    rates, chunked by layer and head; this cell uses `HeadNoise` and the pattern directly to show the mechanism.)*
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
    (`interp_norm.anatomy.text_tokens`, the shipped sample text by default); and the models are large, so
    collapse is chunked by layer and head. What does not change: the anatomy, the checks against the
    model's own pattern and the ellipsoid formula — they are the same code you ran here.
    """),
]
