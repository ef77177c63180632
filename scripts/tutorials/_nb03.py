"""Tutorial 03 (noise and collapse): its cells, in order (built into the .ipynb by ``build_notebooks.py``)."""

from __future__ import annotations

from _cells import code, difficulty, exercise, hints, md, setup, solution  # noqa: F401

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
    from interp_norm.core.hook_names import act_name
    from interp_norm.noise import NormNoise, collapse_thresholds, run_collapse, run_noise

    pre, pre_info = load_with_info("pre")
    qkv, qkv_info = load_with_info("qkv")
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
