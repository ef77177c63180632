"""Riechers's LayerNorm ellipsoid against explicit formulas and cached model outputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from interp_norm import AdditionTask, HookedNormTransformer, ModelConfig
from interp_norm.errors import GeometryError
from interp_norm.core.task import PAD_ID
from interp_norm.geometry import (
    ellipsoid_axes,
    ellipsoid_membership,
    ellipsoid_table,
    module_ellipsoids,
    norm_ellipsoid,
)

N, EPS = 16, 1e-5


def _gain_bias(seed: int, n: int = N):
    g = torch.Generator().manual_seed(seed)
    gain = torch.randn(n, generator=g, dtype=torch.float64)  # signed, like trained gains can be
    gain = gain + 0.2 * torch.sign(gain)  # keep away from 0
    bias = torch.randn(n, generator=g, dtype=torch.float64)
    return gain, bias


def _hyperplane_basis(n: int) -> np.ndarray:
    """Orthonormal basis of 1⊥ (mean-free vectors), built independently via Helmert-like SVD."""
    P = np.eye(n) - np.full((n, n), 1.0 / n)
    U, s, _ = np.linalg.svd(P)
    return U[:, : n - 1]


@pytest.mark.parametrize("seed", range(3))
def test_layernorm_outputs_lie_on_plane_with_membership_formula(seed):
    gain, bias = _gain_bias(seed)
    e = norm_ellipsoid(gain, bias, "ln")
    x = torch.randn(500, N, generator=torch.Generator().manual_seed(seed + 10), dtype=torch.float64)
    x[:100] *= 1e-3  # small inputs land deep inside the ellipsoid
    y = F.layer_norm(x, (N,), gain, bias, EPS)
    var = x.var(-1, unbiased=False)
    expected = var / (var + EPS)
    m = e.membership(y)
    assert torch.allclose(m, expected, atol=1e-5, rtol=0)
    assert (m < 1).all() and m[:100].max() < 0.5
    # hyperplane through b with normal ∝ 1/g: Σ (y_n − b_n)/g_n = 0
    assert torch.allclose(((y - bias) / gain).sum(-1), torch.zeros(500, dtype=torch.float64), atol=1e-9)
    assert torch.allclose(e.plane_residual(y), torch.zeros(500, dtype=torch.float64), atol=1e-9)
    alpha = 1 / gain
    assert torch.allclose(e.normal.abs(), (alpha / alpha.norm()).abs(), atol=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_layernorm_axes_match_eigendecomposition_and_svd(seed):
    gain, bias = _gain_bias(seed)
    e = norm_ellipsoid(gain, bias, "ln")
    g = gain.numpy()
    assert torch.equal(e.center, bias)
    # route 1: the formula, eigen-decomposition of Π₂ diag(1/g²) Π₂ with the zero dropped
    a = (1 / g) / np.linalg.norm(1 / g)
    P2 = np.eye(N) - np.outer(a, a)
    Q = P2 @ np.diag(1 / g**2) @ P2
    lam, V = np.linalg.eigh(Q)
    structural = np.argmax(np.abs(V.T @ a))
    lam = np.delete(lam, structural)
    expected = np.sort(np.sqrt(N / lam))[::-1]
    assert e.semi_axes.shape == (N - 1,)
    assert np.allclose(e.semi_axes.numpy(), expected, rtol=1e-5)
    assert np.allclose(e.quad.numpy(), Q, atol=1e-10)
    # route 2 (no Q at all): the image {G u : u ⊥ 1, |u| = √N} has semi-axes √N · singular values of G·B
    sv = np.linalg.svd(np.diag(g) @ _hyperplane_basis(N), compute_uv=False)
    assert np.allclose(e.semi_axes.numpy(), math.sqrt(N) * np.sort(sv)[::-1], rtol=1e-5)
    # axes are unit, orthogonal, in the plane, and their endpoints are images of boundary points u
    A = e.axes.numpy()
    assert np.allclose(A @ A.T, np.eye(N - 1), atol=1e-10)
    assert np.allclose(A @ a, 0, atol=1e-10)
    for v, s in zip(A, e.semi_axes.numpy()):
        u = (s * v) / g  # pre-affine vector of the endpoint b + s·v
        assert abs(u.sum()) < 1e-8 and abs(u @ u - N) < 1e-5 * N
    assert np.allclose(e.membership(bias + e.semi_axes[:, None] * e.axes).numpy(), 1.0, atol=1e-10)


def test_unit_gain_is_a_sphere_of_radius_sqrt_n():
    e = norm_ellipsoid(torch.ones(N), None, "ln")
    assert torch.allclose(e.semi_axes, torch.full((N - 1,), math.sqrt(N), dtype=torch.float64))
    assert torch.allclose(e.normal.abs(), torch.full((N,), 1 / math.sqrt(N), dtype=torch.float64))


def test_rmsnorm_analogue():
    gain, bias = _gain_bias(5)
    e = norm_ellipsoid(gain, None, "rms")
    assert e.normal is None and e.semi_axes.shape == (N,)
    assert np.allclose(e.semi_axes.numpy(), math.sqrt(N) * np.sort(np.abs(gain.numpy()))[::-1], rtol=1e-10)
    x = torch.randn(300, N, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x[:50] *= 1e-3
    ms = (x**2).mean(-1)
    y = gain * x / torch.sqrt(ms + EPS)[:, None]
    assert torch.allclose(e.membership(y), ms / (ms + EPS), atol=1e-5, rtol=0)
    # each axis is a coordinate direction with semi-axis √N|g_n|
    idx = e.axes.abs().argmax(-1)
    assert torch.allclose(e.semi_axes, math.sqrt(N) * gain.abs()[idx])


def test_zero_or_bad_gain_raises():
    g = torch.ones(N)
    g[3] = 0
    with pytest.raises(GeometryError, match=r"zero in 1 dimension\(s\) \[3\]"):
        norm_ellipsoid(g, None, "ln")
    with pytest.raises(GeometryError, match="zero"):
        norm_ellipsoid(g, None, "rms")
    with pytest.raises(GeometryError, match="kind"):
        norm_ellipsoid(torch.ones(N), None, "batch")
    with pytest.raises(GeometryError, match="bias has"):
        norm_ellipsoid(torch.ones(N), torch.zeros(N + 1))
    with pytest.raises(GeometryError, match="N >= 2"):
        norm_ellipsoid(torch.ones(1), None, "ln")
    model = HookedNormTransformer(ModelConfig.preset("tiny")).eval()
    with torch.no_grad():
        model.blocks[1].ln2.w[5] = 0
    with pytest.raises(GeometryError, match="zero"):
        module_ellipsoids(model.blocks[1].ln2)
    with pytest.raises(GeometryError, match="zero"):
        ellipsoid_table(model)


# ----------------------------------------------------------------------------- a real model's cached outputs


def _model(eps: float, **kw) -> HookedNormTransformer:
    """A tiny model with a large eps (so membership is visibly < 1) and every gain/bias randomised."""
    model = HookedNormTransformer(ModelConfig.preset("tiny", eps=eps, **kw)).eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".w") or name.endswith(".b"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize(
    "variant", [dict(attn_norm="pre", norm_kind="rms"), dict(attn_norm="pre", norm_kind="ln", pre_norm_gains="shared"),
                dict(attn_norm="qkv")], ids=["pre-rms-separate", "pre-ln-shared", "qkv"],
)
def test_membership_of_cached_outputs(variant):
    eps = 0.3
    model = _model(eps, **variant)
    tokens = AdditionTask.preset("cpu").sample_batch(8, "id", seed=1).tokens
    _, cache = model.run_with_cache(tokens)
    real = tokens != PAD_ID
    # independent: the LayerNorm input's variance gives σ²/(σ²+ε) for every ln2 and ln_final
    for name, inp in [(f"blocks.{l}.ln2", f"blocks.{l}.hook_resid_mid") for l in range(2)] + [("ln_final", "blocks.1.hook_resid_post")]:
        x = cache[inp].double()[real]
        var = x.var(-1, unbiased=False)
        mod = model.get_submodule(name)
        (e,) = module_ellipsoids(mod)
        y = cache[f"{name}.hook_normalized"].double()[real]
        assert torch.allclose(e.membership(y), var / (var + eps), atol=1e-5, rtol=0), name
        assert e.plane_residual(y).abs().max() < 1e-5
    if variant["attn_norm"] == "pre":  # ln1: RMS or LN over resid_pre, one ellipsoid per gain row
        x = cache["blocks.0.hook_resid_pre"].double()[real]
        if variant["norm_kind"] == "ln":
            x = x - x.mean(-1, keepdim=True)
        ms = (x**2).mean(-1)
        for e in module_ellipsoids(model.blocks[0].ln1):
            u = cache["blocks.0.ln1.hook_normalized"].double()[real]
            y = u * e.gain if model.blocks[0].ln1.n_gains > 1 else u
            assert torch.allclose(e.membership(y), ms / (ms + eps), atol=1e-5, rtol=0)
    df = ellipsoid_membership(model, tokens)
    n_norm_rows = 2 + 1 + (0 if variant["attn_norm"] != "pre" else 2 * model.blocks[0].ln1.n_gains)
    assert len(df) == n_norm_rows
    assert (df["max_abs_err"] < 1e-5).all()
    assert (df["membership_max"] < 1).all() and (df["membership_min"] < 0.99).all()
    assert (df["max_plane_residual"] < 1e-5).all()
    tab = ellipsoid_table(model)
    assert len(tab) == n_norm_rows
    row = tab[tab["module"] == "ln_final"].iloc[0]
    w = model.ln_final.w.detach().double().numpy()
    a = (1 / w) / np.linalg.norm(1 / w)
    assert row["normal_cos_ones"] == pytest.approx(abs(a.sum()) / math.sqrt(len(w)), rel=1e-9)
    axes = ellipsoid_axes(model)
    assert len(axes[axes["module"] == "ln_final"]) == model.cfg.d_model - 1
