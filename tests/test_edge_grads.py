"""Edge EAP from one plain backward pass (Pre-Norm bridges) equals the receiver-copies backend,
which reads each receiver's gradient at its own copy of the residual: every edge, EAP and EAP-IG,
plain and grouped k/v heads, QK-Norm; post-norm heads (OLMo-2) and frozen modes keep the copies.
(Equality with TransformerLens's edges: tests/test_bridge_attribution.py, through the same default.)

Tolerance: both are float32 sums of the same products in another order (the copies backend adds a
zero leaf and backpropagates 1 + 3 x heads copies; here the projection's transpose and the norm's
vector-Jacobian product run per receiver): a few float32 ulps of the largest gradient-times-difference
terms, 1e-6 relative to the largest score.
"""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from _models import bridge_pairs
from interp_norm.anatomy import tiny_bridge
from interp_norm.circuits import edge_attribution
import interp_norm.circuits.edge_grads as edge_grads


def metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 5] - logits[:, -1, 6]


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen3"])
def test_one_pass_equals_the_copies_backend(arch, monkeypatch):
    bridge = tiny_bridge(arch, seed=3, n_layers=3)
    pairs = bridge_pairs(bridge, 3, 6)
    used = []
    real = edge_grads.fast_receivers
    monkeypatch.setattr(edge_grads, "fast_receivers", lambda *a, **k: (lambda g: used.append(g is not None) or g)(real(*a, **k)))
    for ig in (1, 3):
        used.clear()
        fast = edge_attribution(bridge, pairs, metric, ig_steps=ig).set_index(["sender", "receiver"])["score"]
        ref = edge_attribution(bridge, pairs, metric, ig_steps=ig, backend="copies").set_index(["sender", "receiver"])["score"]
        assert used == [True]  # the one-pass path ran (once: every pair and step in one pass)
        assert set(fast.index) == set(ref.index)
        scale = float(ref.abs().max())
        assert scale > 1e-2 and float((fast - ref.reindex(fast.index)).abs().max()) <= 1e-6 * scale


def test_post_norm_and_frozen_modes_keep_the_copies(monkeypatch):
    called = []
    monkeypatch.setattr(edge_grads, "fast_receivers", lambda *a, **k: called.append(1))
    olmo = tiny_bridge("olmo2", seed=3, n_layers=2)
    edge_attribution(olmo, bridge_pairs(olmo, 3, 6), metric)
    gpt2 = tiny_bridge("gpt2", seed=3, n_layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        edge_attribution(gpt2, bridge_pairs(gpt2, 3, 6), metric, norm="frozen")
    assert called == []


class _OnePlusGain(torch.nn.Module):
    """An RMSNorm whose gain is ``1 + weight`` (Gemma's convention): the closed form, which reads
    ``weight`` as the gain, is wrong for it and must be caught by its check."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d) * 0.5)
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


@pytest.mark.parametrize("norm", ["layer", "rms", "one_plus_gain"])
def test_norm_transposed_jacobian_equals_autograd_one_vector_at_a_time(norm):
    """Each vector's ``J^T v`` against a separate autograd backward through the norm (brute force)."""
    from interp_norm.circuits.edge_grads import _through_norm

    torch.manual_seed(0)
    d = 32
    mod = {"layer": torch.nn.LayerNorm(d), "rms": torch.nn.RMSNorm(d, eps=1e-6), "one_plus_gain": _OnePlusGain(d)}[norm]
    with torch.no_grad():
        for p in mod.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    x, vecs = torch.randn(2, 5, d) * 2 + 0.5, torch.randn(4, 2, 5, d)
    got = _through_norm(mod, x, vecs)
    for k in range(4):
        xk = x.clone().requires_grad_()
        (ref,) = torch.autograd.grad(mod(xk), xk, vecs[k])
        assert torch.allclose(got[k], ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max())), (norm, k)
