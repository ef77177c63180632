"""Geometry analyses on tiny models: brute-force loops, exact decompositions, a hand-built positional head."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
import torch

from interp_norm import AdditionTask, HookedNormTransformer, ModelConfig
from interp_norm import geometry as G
from interp_norm.report import plots as P
from interp_norm.errors import ConfigError, GeometryError, ProblemStringError
from interp_norm.core.task import BOS_ID, PAD_ID
from _models import check_read_matrices_reproduce_qkv, check_spheres_match_direct, layer1_change_from_doubled_embed, make_model


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return AdditionTask.preset("cpu").sample_batch(12, "id", seed=5).tokens


@pytest.fixture(scope="module", params=["pre", "qkv"])
def model(request) -> HookedNormTransformer:
    return make_model(attn_norm=request.param)


def _no_hooks(model: HookedNormTransformer) -> bool:
    return all(len(hp.fwd_hooks) == 0 and len(hp.bwd_hooks) == 0 for hp in model.hook_dict.values())


# ----------------------------------------------------------------------------- norm spread


def test_attended_norms_match_brute_force(model, tokens):
    df = G.attended_norms(model, tokens, center=False)
    _, cache = model.run_with_cache(tokens)
    B, Pn = tokens.shape
    for l in range(model.cfg.n_layers):
        x = cache[f"blocks.{l}.hook_resid_pre"]
        pat = cache[f"blocks.{l}.attn.hook_pattern"]
        for h in range(model.cfg.n_heads):
            vals, wts = [], []
            for b in range(B):
                for t in range(Pn):
                    if tokens[b, t] in (PAD_ID, BOS_ID):
                        continue
                    w = sum(float(pat[b, h, q, t]) for q in range(Pn) if tokens[b, q] not in (PAD_ID, BOS_ID))
                    vals.append(float(x[b, t].double().norm()))
                    wts.append(w)
            order = np.argsort(vals)
            cum, med = 0.0, None
            for i in order:  # weighted median, written as a loop
                cum += wts[i]
                if cum >= 0.5 * sum(wts) - 1e-12:
                    med = vals[i]
                    break
            g = df[(df["layer"] == l) & (df["head"] == h)]
            assert np.allclose(g["norm"], vals, rtol=1e-6)
            assert np.allclose(g["weight"], wts, rtol=1e-5, atol=1e-7)
            assert np.allclose(g["rel"], np.array(vals) / med - 1, rtol=1e-6, atol=1e-9)


def test_norm_spread_statistic(model, tokens):
    norms = G.attended_norms(model, tokens)
    spread = G.summarize_norm_spread(norms, coverage=0.8, tolerance=0.1)
    assert list(spread.columns[:5]) == ["layer", "head", "n_tokens", "weight", "median_norm"]
    for _, row in spread.iterrows():
        if pd.isna(row["head"]):
            g = norms[norms["layer"] == row["layer"]]
            w = g["weight"] / g.groupby("head")["weight"].transform("sum")  # each head counts equally
        else:
            g = norms[(norms["layer"] == row["layer"]) & (norms["head"] == row["head"])]
            w = g["weight"]
        a, w = g["rel"].abs().to_numpy(), w.to_numpy() / w.sum()
        s = row["spread"]
        # the smallest s with >= 80% of the weight inside ±s
        assert w[a <= s].sum() >= 0.8 - 1e-9
        assert w[a < s].sum() < 0.8
        assert row["within_tol"] == pytest.approx(w[a <= 0.1].sum())
        assert row["q5"] <= row["q25"] <= row["q50"] <= row["q75"] <= row["q95"]
    per_head = spread[spread["head"].notna()]
    assert per_head["q50"].abs().max() < 0.05  # relative to the head's own weighted median
    assert len(spread) == model.cfg.n_layers * (model.cfg.n_heads + 1)


def test_norm_spread_centering_for_layernorm(tokens):
    m = make_model(attn_norm="pre", norm_kind="ln")
    a = G.attended_norms(m, tokens)  # auto: centred for LayerNorm
    b = G.attended_norms(m, tokens, center=True)
    c = G.attended_norms(m, tokens, center=False)
    assert np.allclose(a["norm"], b["norm"]) and not np.allclose(a["norm"], c["norm"])
    with pytest.raises(ConfigError, match="center"):
        G.attended_norms(m, tokens, center="yes")


# ----------------------------------------------------------------------------- sparsity


def test_sparsity_histogram_matches_brute_force(model, tokens):
    hist = G.attention_sparsity(model, tokens, bins=10)
    _, cache = model.run_with_cache(tokens)
    B, Pn = tokens.shape
    pooled = []
    for l in range(model.cfg.n_layers):
        pat = cache[f"blocks.{l}.attn.hook_pattern"]
        vals = [float(pat[b, h, q].max()) for b in range(B) for h in range(model.cfg.n_heads) for q in range(1, Pn)
                if tokens[b, q] != PAD_ID]
        pooled += vals
        counts = [sum(1 for v in vals if (i / 10 <= v < (i + 1) / 10) or (i == 9 and v == 1.0)) for i in range(10)]
        got = hist[hist["layer"] == l].sort_values("bin")
        assert got["count"].tolist() == counts
        assert got["fraction"].sum() == pytest.approx(1.0)
    allrows = hist[hist["layer"].isna()]
    assert allrows["count"].sum() == len(pooled)
    summ = G.sparsity_summary(G.max_attention(model, tokens), sparse=0.5, nonsparse=0.3)
    assert summ[summ["layer"].isna()]["frac_sparse"].iloc[0] == pytest.approx(np.mean(np.array(pooled) >= 0.5))
    assert summ[summ["layer"].isna()]["frac_nonsparse"].iloc[0] == pytest.approx(np.mean(np.array(pooled) < 0.3))
    per_head = G.attention_sparsity(model, tokens, bins=4, per_head=True)
    assert set(per_head.columns) >= {"layer", "head", "bin", "count"}


def test_sparse_model_peaks_in_top_bin(tokens):
    """A head whose scores are sharpened ×100 concentrates its histogram in the top bin."""
    m = make_model(attn_norm="qkv")
    with torch.no_grad():
        m.blocks[0].attn.q_norm.w.mul_(10.0)
        m.blocks[0].attn.k_norm.w.mul_(10.0)
    hist = G.attention_sparsity(m, tokens, bins=20)
    top = hist[(hist["layer"] == 0) & (hist["bin"] == 19)]["fraction"].iloc[0]
    assert top > 0.8


# ----------------------------------------------------------------------------- decomposition and subspaces


@pytest.mark.parametrize("granularity", ["head", "layer"])
def test_residual_components_sum_to_the_stream(model, tokens, granularity):
    _, cache = model.run_with_cache(tokens)
    L = model.cfg.n_layers
    for layer in range(L + 1):
        comps = G.residual_components(model, tokens, layer, granularity=granularity)
        total = sum(comps.values())
        target = cache[f"blocks.{layer}.hook_resid_pre"] if layer < L else cache[f"blocks.{L - 1}.hook_resid_post"]
        assert torch.allclose(total, target, atol=1e-5)
    names = set(G.residual_components(model, tokens, L))
    assert {"tok", "pos", "L0.mlp", "L1.mlp"} <= names
    if granularity == "head":
        assert {"L1H3", "attn_bias"} <= names
    with pytest.raises(ConfigError, match="layer"):
        G.residual_components(model, tokens, L + 1)


@pytest.mark.parametrize("variant", [dict(attn_norm="pre", norm_kind="rms"), dict(attn_norm="pre", norm_kind="ln"),
                                     dict(attn_norm="pre", pre_norm_gains="shared"), dict(attn_norm="qkv")])
def test_effective_read_matrices_reproduce_q_k_v(variant, tokens):
    """hook_q = (resid_pre / scale) @ M_q for Pre-Norm, resid_pre @ M_q otherwise."""
    check_read_matrices_reproduce_qkv(make_model(**variant), tokens)


def test_orthogonal_spheres_per_layer_matches_direct_computation(model, tokens):
    """The streamed all-layer pass equals sphere_structure on each layer's decomposition, and its
    resid_norm_cv is the CV of |resid_pre| read straight from the cache."""
    check_spheres_match_direct(model, tokens)
    lay = G.orthogonal_spheres(model, tokens, layers=[2], granularity="layer")
    assert set(lay["components"]["component"]) == {"tok", "pos", "L0.attn", "L1.attn", "L0.mlp", "L1.mlp"}


def test_subspaces_match_direct_svd_of_components(model, tokens):
    """subspaces() avoids forming head outputs; it must agree with an SVD of the formed components,
    and the batched subspace_angles with a pair-by-pair principal_angles loop."""
    mask = (tokens != PAD_ID) & (tokens != BOS_ID)
    fast = G.subspaces(model, tokens, energy=0.9, include_reads=False)
    comps = G.residual_components(model, tokens, model.cfg.n_layers)
    for name, c in comps.items():
        X = c[mask].double().numpy()
        U, s, _ = np.linalg.svd(X.T, full_matrices=False)
        k = int(np.searchsorted(np.cumsum(s**2) / (s**2).sum(), 0.9 - 1e-12) + 1)
        assert fast[name].shape[1] == k, name
        ang = G.principal_angles(fast[name], torch.tensor(U[:, :k]))
        assert float(ang.max()) < 1e-4, name
    bases = {**fast, **G.head_read_subspaces(model, layers=[1], energy=0.8)}
    df = G.subspace_angles(bases)
    names = list(bases)
    assert len(df) == len(names) * (len(names) - 1) // 2
    for _, row in df.sample(25, random_state=0).iterrows():
        ang = np.degrees(G.principal_angles(bases[row["a"]], bases[row["b"]]).numpy())
        assert row["min_angle"] == pytest.approx(ang.min(), abs=1e-4)
        assert row["max_angle"] == pytest.approx(ang.max(), abs=1e-4)
        assert row["overlap"] == pytest.approx(np.mean(np.cos(np.radians(ang)) ** 2), abs=1e-6)
    with pytest.raises(GeometryError, match="unknown subspace"):
        G.subspace_angles(bases, pairs=[("tok", "nope")])


def test_positional_component_is_a_sphere_and_subspaces(model, tokens):
    """The sinusoidal encoding has constant norm √n_freq and spans the first 2·n_freq dimensions."""
    sph = G.orthogonal_spheres(model, tokens)
    comp = sph["components"]
    pos = comp[comp["component"] == "pos"]
    assert (pos["cv"] < 1e-6).all()
    assert np.allclose(pos["mean_norm"], math.sqrt(model.cfg.n_freq), rtol=1e-5)
    assert set(sph["scores"]["layer"]) == set(range(model.cfg.n_layers + 1))
    s = sph["scores"]
    assert ((s["score"] > 0) & (s["score"] <= 1)).all()
    assert np.allclose(s["score"], s["constancy"] * s["orthogonality"])
    B = G.positional_subspace(model)
    assert B.shape[1] == 2 * model.cfg.n_freq
    assert torch.allclose(B[2 * model.cfg.n_freq :], torch.zeros_like(B[2 * model.cfg.n_freq :]), atol=1e-10)
    bases = G.subspaces(model, tokens, energy=0.9)
    assert "L1H2.k" in bases and "tok" in bases
    ang = G.subspace_angles({k: bases[k] for k in ["tok", "pos", "L0H0.q"]})
    assert len(ang) == 3 and ((ang["min_angle"] >= 0) & (ang["max_angle"] <= 90 + 1e-9)).all()
    reads = G.head_read_fractions(model, {"pos": B, "all": torch.eye(model.cfg.d_model, dtype=torch.float64)})
    assert np.allclose(reads[reads["subspace"] == "all"]["fraction"], 1.0)


# ----------------------------------------------------------------------------- direct interference


def positional_head_model(attn_norm: str, beta: float = 3.0) -> HookedNormTransformer:
    """1 layer, 2 heads. Tokens live in dims 16..31, sinusoidal positions in dims 0..15.

    Head 0 reads only positions: q = β·R(−ω)·pos(p) = β·pos(p−1), k = pos(t), so it attends to the
    previous token. Head 1 reads only token dims (random W_Q/W_K there).
    """
    cfg = ModelConfig(d_model=32, d_head=16, n_heads=2, n_layers=1, n_ctx=32, d_mlp=32, n_freq=8,
                      head_hidden=(16,), attn_norm=attn_norm, max_pos_offset=0, seed=3)
    m = HookedNormTransformer(cfg).eval()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        m.W_E[:, :16] = 0
        a = m.blocks[0].attn
        a.W_Q.zero_()
        a.W_K.zero_()
        for i, w in enumerate(m.pos_embed.freqs.tolist()):
            c, s = math.cos(w), math.sin(w)
            a.W_Q[0, i, i], a.W_Q[0, 8 + i, i] = beta * c, -beta * s
            a.W_Q[0, 8 + i, 8 + i], a.W_Q[0, i, 8 + i] = beta * c, beta * s
        a.W_K[0, :16, :16] = torch.eye(16)
        a.W_Q[1, 16:] = torch.randn(16, 16, generator=g) / 2
        a.W_K[1, 16:] = torch.randn(16, 16, generator=g) / 2
    return m


@pytest.fixture(scope="module")
def long_tokens() -> torch.Tensor:
    return AdditionTask.preset("cpu").sample_batch(16, "extrap", seed=2).tokens


def test_hand_built_positional_head_attends_to_previous_token(long_tokens):
    m = positional_head_model("pre")
    _, cache = m.run_with_cache(long_tokens)
    pat = cache["blocks.0.attn.hook_pattern"][:, 0]
    q = torch.arange(2, long_tokens.shape[1])
    real = long_tokens[:, 2:] != PAD_ID
    assert (pat[:, q].argmax(-1)[real] == (q - 1).expand_as(real)[real]).float().mean() > 0.95


@pytest.mark.parametrize("intervention", [G.ScaleComponent("hook_embed", 0.3), G.ScaleComponent("hook_embed", 2.0),
                                          G.AddOrthogonal(None, 0.5, seed=1)], ids=["tok x0.3", "tok x2", "orth-pos"])
def test_direct_interference_pre_moves_qkv_does_not(intervention, long_tokens):
    res = {}
    for variant in ("pre", "qkv"):
        m = positional_head_model(variant)
        df = G.direct_interference(m, long_tokens, {"iv": intervention})
        assert _no_hooks(m)
        res[variant] = df.set_index("head")
    pre, qkv = res["pre"], res["qkv"]
    # head 0 reads only the positional subspace
    assert pre.loc[0, "pos_read_q"] == pytest.approx(1.0) and pre.loc[0, "pos_read_k"] == pytest.approx(1.0)
    assert qkv.loc[0, "tok_read_q"] == pytest.approx(0.0, abs=1e-12)
    # Pre-Norm: the positional head moves through the shared norm; QKV-Norm: it does not
    assert pre.loc[0, "mean_tv"] > 0.02
    assert qkv.loc[0, "max_abs"] < 1e-6
    # and for Pre-Norm all of it goes through the norm: with ln1's scale frozen nothing moves
    assert pre.loc[0, "mean_tv_direct"] < 1e-6
    assert pre.loc[0, "mean_tv_norm"] == pytest.approx(pre.loc[0, "mean_tv"], rel=1e-3)
    assert (qkv["mean_tv_norm"] == 0).all() and np.allclose(qkv["mean_tv_direct"], qkv["mean_tv"])
    # the token head reads the changed subspace and moves under both (the measurement is not blind)
    if isinstance(intervention, G.AddOrthogonal):
        assert qkv.loc[1, "mean_tv"] > 0.02


def test_direct_interference_is_layer_isolated_and_identity_is_zero(tokens):
    m = make_model(attn_norm="pre")
    df = G.direct_interference(m, tokens, {"none": G.ScaleComponent("hook_embed", 1.0)})
    assert df["max_abs"].max() < 1e-6
    assert len(df) == m.cfg.n_layers * m.cfg.n_heads
    assert _no_hooks(m)
    # layer 1's change must be the direct one: only layer 1's input scaled, layer 0 left clean
    df = G.direct_interference(m, tokens, {"x2": G.ScaleComponent("hook_embed", 2.0)})
    d, rows = layer1_change_from_doubled_embed(m, tokens)
    for h in range(m.cfg.n_heads):
        tv = 0.5 * d[:, h].sum(-1)[rows]
        got = df[(df["layer"] == 1) & (df["head"] == h)].iloc[0]
        assert got["mean_tv"] == pytest.approx(float(tv.mean()), rel=1e-4, abs=1e-7)
        assert got["max_abs"] == pytest.approx(float(d[:, h][rows].max()), rel=1e-4, abs=1e-7)
    # a failing intervention must not leave hooks behind
    class Broken(G.ScaleComponent):
        def delta(self, model, cache, layer):
            return torch.zeros(1, 1, 3)  # wrong shape -> error inside the hooked forward pass
    with pytest.raises(RuntimeError):
        G.direct_interference(m, tokens, {"broken": Broken()})
    assert _no_hooks(m)
    full = HookedNormTransformer(ModelConfig.preset("tiny", pos_embed="learned", d_model=32, n_ctx=32)).eval()
    with pytest.raises(GeometryError, match="whole residual stream"):
        G.direct_interference(full, tokens, {"o": G.AddOrthogonal()})


# ----------------------------------------------------------------------------- one call, plots, errors


def test_run_geometry_compare_summary_and_plots(tokens):
    task = AdditionTask.preset("cpu")
    models = {"pre": make_model(attn_norm="pre"), "qkv": make_model(attn_norm="qkv")}
    res = G.compare_geometry(models, task, n=16)
    expected = {"norm_spread", "sparsity_hist", "sparsity_summary", "sphere_components", "sphere_pairs",
                "sphere_scores", "subspace_angles", "head_reads", "interference", "ellipsoids",
                "ellipsoid_axes", "ellipsoid_membership"}
    assert set(res) == expected
    for k, df in res.items():
        assert isinstance(df, pd.DataFrame) and len(df) > 0, k
        assert df.columns[0] == "variant" and set(df["variant"]) == {"pre", "qkv"}, k
    summ = G.geometry_summary(res)
    assert set(summ["variant"]) == {"pre", "qkv"}
    assert {"spread", "within_tol", "frac_top_bin", "score", "tv[tok x0.5]", "tv_norm[tok x2]"} <= set(summ.columns)
    single = G.run_geometry(models["pre"], tokens=tokens)
    assert "variant" not in G.geometry_summary(single).columns
    for m in models.values():
        assert _no_hooks(m)
    figs = [P.plot_norm_spread(res["norm_spread"]), P.plot_attention_sparsity(res["sparsity_hist"]),
            P.plot_sphere_scores(res["sphere_scores"]), P.plot_component_cosines(res["sphere_pairs"], 1, "pre"),
            P.plot_subspace_angles(single["subspace_angles"]), P.plot_interference(res["interference"]),
            P.plot_ellipsoid_axes(res["ellipsoid_axes"]),
            P.plot_norm_distribution(G.attended_norms(models["qkv"], tokens), layer=0)]
    assert all(isinstance(f, go.Figure) and len(f.data) > 0 for f in figs)


def test_typed_errors(tokens):
    m = make_model()
    with pytest.raises(ConfigError, match="task"):
        G.run_geometry(m)
    with pytest.raises(ProblemStringError, match="tensor"):
        G.norm_spread(m, [[1, 2, 3]])
    with pytest.raises(ConfigError, match="HookedNormTransformer"):
        G.norm_spread(object(), tokens)
    only_bos = torch.tensor([[BOS_ID, PAD_ID, PAD_ID]])
    with pytest.raises(GeometryError, match="no tokens"):
        G.attended_norms(m, only_bos)
    with pytest.raises(GeometryError, match="coverage"):
        G.norm_spread(m, tokens, coverage=0)
    with pytest.raises(GeometryError, match="bins"):
        G.attention_sparsity(m, tokens, bins=0)


def test_overall_summary_pools_layers(tokens):
    models = {"pre": make_model(attn_norm="pre"), "qkv": make_model(attn_norm="qkv")}
    res = G.compare_geometry(models, tokens=tokens)
    per = G.geometry_summary(res)
    over = G.geometry_summary(res, per_layer=False)
    assert list(over["variant"]) == ["pre", "qkv"]
    for v in ("pre", "qkv"):
        rows = per[(per["variant"] == v) & per["spread"].notna()]
        assert len(rows) == models[v].cfg.n_layers
        o = over[over["variant"] == v].iloc[0]
        assert o["mean_spread"] == pytest.approx(rows["spread"].mean())
        assert o["sphere_score"] == pytest.approx(rows["score"].mean())
        mx = res["sparsity_summary"]
        assert o["frac_sparse"] == pytest.approx(mx[(mx["variant"] == v) & mx["layer"].isna()]["frac_sparse"].iloc[0])
        it = res["interference"]
        assert o["tv[tok x2]"] == pytest.approx(it[(it["variant"] == v) & (it["intervention"] == "tok x2")]["mean_tv"].mean())
    single = G.geometry_summary(G.run_geometry(models["pre"], tokens=tokens), per_layer=False)
    assert len(single) == 1 and "variant" not in single.columns
