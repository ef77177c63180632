"""Geometry on models with the paper's Checkpoint calibration (``calibration="paper"``).

The Checkpoints scale the attention inputs and each residual update, so formulas read from the
weights alone would be off by those factors. Each check compares with the model's own cached
activations or with an independent hooked forward pass.
"""

from __future__ import annotations

import pytest
import torch

from interp_norm import AdditionTask, HookedNormTransformer
from interp_norm import geometry as G
from interp_norm.core.task import BOS_ID, PAD_ID
from _models import check_read_matrices_reproduce_qkv, check_spheres_match_direct, layer1_change_from_doubled_embed, make_model


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return AdditionTask.preset("cpu").sample_batch(12, "id", seed=5).tokens


@pytest.fixture(scope="module", params=["pre", "qkv"])
def model(request, tokens) -> HookedNormTransformer:
    m = make_model(attn_norm=request.param, calibration="paper")
    m.calibrate(tokens)
    factors = m.calibration_factors()
    # the checks below are only meaningful if the factors are far from 1
    assert min(abs(f - 1) for k, f in factors.items() if k.endswith("attn_out")) > 0.1
    return m


@pytest.mark.parametrize("granularity", ["head", "layer"])
def test_residual_components_sum_to_the_stream(model, tokens, granularity):
    _, cache = model.run_with_cache(tokens)
    L = model.cfg.n_layers
    for layer in range(L + 1):
        total = sum(G.residual_components(model, tokens, layer, granularity=granularity).values())
        target = cache[f"blocks.{layer}.hook_resid_pre"] if layer < L else cache[f"blocks.{L - 1}.hook_resid_post"]
        assert torch.allclose(total, target, atol=1e-5)


def test_effective_read_matrices_reproduce_q_k_v(model, tokens):
    """hook_q = (resid_pre / scale) @ M_q for Pre-Norm, resid_pre @ M_q otherwise, Checkpoints included."""
    check_read_matrices_reproduce_qkv(model, tokens)


def test_orthogonal_spheres_match_decomposition_and_stream_norm(model, tokens):
    check_spheres_match_direct(model, tokens, pairs=False)


def test_subspaces_match_formed_components(model, tokens):
    """The factored head bases and the summed bias agree with the formed (calibrated) components."""
    mask = (tokens != PAD_ID) & (tokens != BOS_ID)
    fast = G.subspaces(model, tokens, energy=0.9, include_reads=False)
    slow = G.component_subspaces(G.residual_components(model, tokens, model.cfg.n_layers), mask, energy=0.9)
    slow["attn_bias"] = G.orthonormal_basis(G.residual_components(model, tokens, model.cfg.n_layers)["attn_bias"][0, :1].T)
    for name, B in fast.items():
        assert B.shape == slow[name].shape, name
        assert float(G.principal_angles(B, slow[name]).max()) < 1e-3, name


def test_direct_interference_matches_a_hooked_run(tokens):
    m = make_model(attn_norm="pre", calibration="paper")
    m.calibrate(tokens)
    df = G.direct_interference(m, tokens, {"x2": G.ScaleComponent("hook_embed", 2.0),
                                           "none": G.ScaleComponent("hook_embed", 1.0)})
    assert df[df["intervention"] == "none"]["max_abs"].max() < 1e-6
    d, rows = layer1_change_from_doubled_embed(m, tokens)
    got = df[(df["intervention"] == "x2") & (df["layer"] == 1)].set_index("head")
    for h in range(m.cfg.n_heads):
        assert got.loc[h, "mean_tv"] == pytest.approx(float((0.5 * d[:, h].sum(-1))[rows].mean()), rel=1e-4, abs=1e-7)
