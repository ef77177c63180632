"""Orthogonal spheres, principal angles and weighted quantiles against constructions with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from interp_norm.errors import GeometryError, InterpNormError
from interp_norm.geometry import (
    orthonormal_basis,
    principal_angles,
    sphere_structure,
    subspace_angles,
    weighted_quantile,
)

D = 12


def _rotation(d: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q


def _sphere_points(n: int, dims: list[int], radius, seed: int, d: int = D) -> torch.Tensor:
    """n points uniform in direction on a sphere inside the coordinate subspace ``dims``; radius per point."""
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(n, d, dtype=torch.float64)
    v = torch.randn(n, len(dims), generator=g, dtype=torch.float64)
    v = v / v.norm(dim=-1, keepdim=True)
    r = radius if isinstance(radius, torch.Tensor) else torch.full((n,), float(radius), dtype=torch.float64)
    x[:, dims] = v * r[:, None]
    return x


def _components(n=20000, radius1=2.0, overlap=False, seed=0):
    R = _rotation(D, seed + 100)  # so nothing is axis-aligned
    c1 = _sphere_points(n, [0, 1, 2], radius1, seed)
    c2 = _sphere_points(n, [0, 1, 2] if overlap else [3, 4, 5], 1.0, seed + 1)
    c3 = _sphere_points(n, [6, 7], 0.5, seed + 2)
    return {"a": c1 @ R.T, "b": c2 @ R.T, "c": c3 @ R.T}


@pytest.mark.parametrize("weighting", ["energy", "uniform"])
def test_orthogonal_spheres_score_one(weighting):
    res = sphere_structure(_components(n=4000), weighting=weighting)
    s = res["scores"].iloc[0]
    assert s["constancy"] == pytest.approx(1.0, abs=1e-9)
    assert s["orthogonality"] == pytest.approx(1.0, abs=1e-6)  # cosines are accumulated in float32
    assert s["score"] == pytest.approx(1.0, abs=1e-6)
    # Theorem 2's consequence: the summed vector has constant norm sqrt(2² + 1² + 0.5²)
    assert s["resid_norm_cv"] < 1e-9
    assert np.allclose(res["components"]["mean_norm"], [2.0, 1.0, 0.5])


def test_non_constant_norm_lowers_constancy_only():
    n = 20000
    r = torch.empty(n, dtype=torch.float64).uniform_(1.0, 3.0, generator=torch.Generator().manual_seed(7))
    comps = _components(n=n, radius1=r)
    cv_uniform_1_3 = (2 / math.sqrt(12)) / 2  # std/mean of U(1, 3)
    res = sphere_structure(comps, weighting="uniform")
    s = res["scores"].iloc[0]
    assert res["components"]["cv"].iloc[0] == pytest.approx(cv_uniform_1_3, abs=0.01)
    assert s["constancy"] == pytest.approx(1 - cv_uniform_1_3 / 3, abs=0.01)
    assert s["orthogonality"] == pytest.approx(1.0, abs=1e-6)
    assert s["resid_norm_cv"] > 0.05
    # energy weighting: w_a = E r² / (E r² + 1 + 0.25) with E r² = 13/3 for U(1, 3)
    e = sphere_structure(comps, weighting="energy")["scores"].iloc[0]
    wa = (13 / 3) / (13 / 3 + 1.25)
    assert e["constancy"] == pytest.approx(1 - wa * cv_uniform_1_3, abs=0.01)


def test_overlapping_subspaces_lower_orthogonality_only():
    res = sphere_structure(_components(overlap=True), weighting="uniform")
    s = res["scores"].iloc[0]
    pairs = res["pairs"].set_index(["a", "b"])
    # independent uniform directions on S² in the same 3-d subspace: E|cos| = 1/2
    assert pairs.loc[("a", "b"), "mean_abs_cos"] == pytest.approx(0.5, abs=0.01)
    assert pairs.loc[("a", "c"), "mean_abs_cos"] == pytest.approx(0.0, abs=1e-6)
    assert s["orthogonality"] == pytest.approx(1 - 0.5 / 3, abs=0.01)
    assert s["constancy"] == pytest.approx(1.0, abs=1e-9)
    assert s["score"] < 0.9


def test_mask_zero_component_and_centering():
    comps = _components(n=50)
    comps = {k: v.reshape(5, 10, D) for k, v in comps.items()}
    comps["zero"] = torch.zeros(5, 10, D, dtype=torch.float64)
    mask = torch.zeros(5, 10, dtype=torch.bool)
    mask[:, 1:] = True
    res = sphere_structure(comps, mask)
    c = res["components"].set_index("component")
    assert math.isnan(c.loc["zero", "cv"]) and c.loc["zero", "weight"] == 0
    assert res["scores"].iloc[0]["score"] == pytest.approx(1.0, abs=1e-6)
    assert len(res["pairs"]) == 3  # pairs with the zero component are skipped
    # centring: a component along the ones direction vanishes
    ones = {"a": torch.ones(4, D, dtype=torch.float64), "b": _sphere_points(4, [0, 1], 1.0, 0)}
    out = sphere_structure(ones, center=True)["components"].set_index("component")
    assert math.isnan(out.loc["a", "cv"])
    with pytest.raises(GeometryError, match="weighting"):
        sphere_structure(comps, weighting="bogus")
    with pytest.raises(GeometryError, match="no tokens"):
        sphere_structure(comps, torch.zeros(5, 10, dtype=torch.bool))


# ----------------------------------------------------------------------------- principal angles


def test_principal_angles_known_construction():
    a, b = 0.3, 1.1
    e = torch.eye(6, dtype=torch.float64)
    A = torch.stack([e[0], e[1]], 1) @ torch.tensor([[2.0, 1.0], [0.0, 3.0]], dtype=torch.float64)  # non-orthonormal
    B = torch.stack([math.cos(a) * e[0] + math.sin(a) * e[2], math.cos(b) * e[1] + math.sin(b) * e[3]], 1)
    assert torch.allclose(principal_angles(A, B), torch.tensor([a, b], dtype=torch.float64), atol=1e-10)
    R = _rotation(6, 3)
    assert torch.allclose(principal_angles(R @ A, R @ B), torch.tensor([a, b], dtype=torch.float64), atol=1e-10)


@pytest.mark.parametrize("seed", range(4))
def test_principal_angles_match_projection_eigenvalues(seed):
    """Independent route: the eigenvalues of P_A P_B P_A are cos² of the principal angles."""
    rng = np.random.default_rng(seed)
    d, ka, kb = 10, 3, 5
    A, B = rng.normal(size=(d, ka)), rng.normal(size=(d, kb))
    B[:, 0] = A[:, 0] + 0.1 * rng.normal(size=d)  # one small angle
    PA = A @ np.linalg.pinv(A)
    PB = B @ np.linalg.pinv(B)
    ev = np.sort(np.clip(np.linalg.eigvalsh(PA @ PB @ PA), 0, 1))[::-1][:ka]
    expected = np.arccos(np.sqrt(ev))
    got = principal_angles(torch.tensor(A), torch.tensor(B)).numpy()
    assert np.allclose(got, np.sort(expected), atol=1e-6)
    df = subspace_angles({"A": orthonormal_basis(torch.tensor(A)), "B": orthonormal_basis(torch.tensor(B))})
    row = df.iloc[0]
    assert row["min_angle"] == pytest.approx(np.degrees(expected.min()), abs=1e-4)
    assert row["overlap"] == pytest.approx(ev.mean(), abs=1e-8)


def test_orthonormal_basis_energy_and_errors():
    # energy 0.9/0.1 split between two directions (e0, e1) plus nothing else
    X = torch.zeros(5, 1000, dtype=torch.float64)
    X[0, :500] = 3.0
    X[1, 500:] = 1.0
    assert orthonormal_basis(X).shape == (5, 2)
    assert orthonormal_basis(X, energy=0.5).shape == (5, 1)
    Q = orthonormal_basis(X, energy=0.5)
    assert abs(abs(float(Q[0, 0])) - 1) < 1e-9
    assert orthonormal_basis(X, energy=0.95).shape == (5, 2)
    assert orthonormal_basis(torch.zeros(4, 3)).shape == (4, 0)
    with pytest.raises(GeometryError, match="energy"):
        orthonormal_basis(X, energy=1.5)
    with pytest.raises(InterpNormError, match="empty"):
        principal_angles(torch.zeros(4, 2), torch.eye(4))


# ----------------------------------------------------------------------------- weighted quantile


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.floats(-5, 5, allow_nan=False), st.integers(0, 4)), min_size=1, max_size=30),
    st.floats(0, 1),
)
def test_weighted_quantile_matches_repeated_values(pairs, q):
    v = np.array([p[0] for p in pairs])
    w = np.array([p[1] for p in pairs])
    if w.sum() == 0:
        with pytest.raises(GeometryError):
            weighted_quantile(v, w, q)
        return
    expected = np.quantile(np.repeat(v, w), q, method="inverted_cdf")
    assert weighted_quantile(v, w, q) == expected


def test_weighted_quantile_errors():
    with pytest.raises(GeometryError, match="non-negative"):
        weighted_quantile([1, 2], [1, -1], 0.5)
    with pytest.raises(GeometryError, match="differ"):
        weighted_quantile([1, 2], [1], 0.5)
    with pytest.raises(GeometryError, match="quantiles"):
        weighted_quantile([1, 2], [1, 1], 1.5)
