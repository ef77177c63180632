"""Tutorial 04 (geometry): its cells, in order (built into the .ipynb by ``build_notebooks.py``)."""

from __future__ import annotations

from _cells import code, difficulty, exercise, hints, md, setup, solution  # noqa: F401

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

    pre, pre_info = load_with_info("pre")
    qkv, qkv_info = load_with_info("qkv")
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
