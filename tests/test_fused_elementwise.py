"""The attribution re-run's one-kernel stand-ins for a bridge's elementwise modules
(``interp_norm.circuits.exact.fused_elementwise``): each accepted stand-in and the module it replaces
both equal the module's formula evaluated in float64 (written out here) within float32 rounding; a
module computing something else is not replaced; entering and leaving ``fused`` leaves every module as
it was; node EAP with the stand-ins equals TransformerLens's per pair (also in test_bridge_attribution.py)."""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformer_lens.tools.analysis.attribution_patching import Node
from transformer_lens.tools.analysis.attribution_patching import attribution_patch as tl_attribution_patch

from _models import bridge_pairs
from interp_norm.anatomy import tiny_bridge
from interp_norm.circuits import node_attribution
from interp_norm.circuits.exact.fused_elementwise import fused, probe

B, N = 3, 7
EPS32 = torch.finfo(torch.float32).eps


def _gelu_tanh64(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _norm64(x: torch.Tensor, w: torch.Tensor, b, eps: float, centred: bool) -> torch.Tensor:
    x = x.double()
    xc = x - x.mean(-1, keepdim=True) if centred else x
    y = xc / torch.sqrt(xc.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    return y if b is None else y + b.double()


@pytest.fixture(scope="module")
def bridges():
    return {arch: tiny_bridge(arch, seed=3, n_layers=2) for arch in ("gpt2", "llama", "qwen3", "olmo2")}


def _inputs(d: int) -> torch.Tensor:
    """Residual-like rows [rows, d] at three scales, with a mean offset (not the probe's draws)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 40, d, generator=g) * torch.tensor([0.05, 1.0, 6.0]).view(3, 1, 1)
    return (x + torch.randn(3, 40, 1, generator=g)).reshape(-1, d)


@pytest.mark.parametrize("arch,kinds", [("gpt2", {"layer_norm", "gelu_tanh"}), ("llama", {"rms_norm", "silu"}),
                                        ("qwen3", {"rms_norm", "silu"}), ("olmo2", {"rms_norm", "silu"})])
def test_each_stand_in_and_its_module_equal_the_formula_in_float64(bridges, arch, kinds):
    """Every norm and activation of the blocks and the final norm is replaced (the kinds expected of the
    architecture), and the stand-in and the module are each within float32 rounding of the formula
    computed in float64: |error| <= c eps (|w| (|x_hat| + 1) + |b| + 1) for a norm (c = log2(d) + 8: the
    two d-term sums and ~6 more roundings), 4 eps (|x| + 1) for an activation (~5 roundings of |x| / 2)."""
    bridge = bridges[arch]
    subs = probe(bridge)
    assert {s.kind for s in subs} == kinds
    norms = [m for m in bridge.modules() if hasattr(m, "hook_normalized") and hasattr(m, "original_component")]
    assert {id(s.module) for s in subs if "norm" in s.kind} == {id(m) for m in norms}
    d = bridge.cfg.d_model
    for s in subs:
        oc = getattr(s.module, "original_component", None)
        width = oc.weight.shape[0] if oc is not None else d
        x = _inputs(width)
        if "norm" in s.kind:
            b = getattr(oc, "bias", None)
            eps = getattr(oc, "eps", getattr(oc, "variance_epsilon", None))
            want = _norm64(x, oc.weight.detach(), None if b is None else b.detach(), eps, s.kind == "layer_norm")
            xd = x.double()
            mu = xd.mean(-1, keepdim=True)
            xhat = (xd.abs() + mu.abs()) / (xd - mu).pow(2).mean(-1, keepdim=True).sqrt()
            bias = 0.0 if b is None else b.detach().double().abs()
            tol = (math.log2(width) + 8) * EPS32 * (oc.weight.detach().double().abs() * (xhat + 1) + bias + 1)
        else:
            want, tol = _gelu_tanh64(x) if s.kind == "gelu_tanh" else torch.nn.functional.silu(x.double()), 4 * EPS32 * (x.double().abs() + 1)
        with torch.no_grad():
            own = s.module(x).double()
            with fused(subs):
                assert vars(s.module).get("forward") is s.forward
                stand_in = s.module(x).double()
        assert ((own - want).abs() <= tol).all(), f"{arch} {s.kind}: the module is off its formula"
        assert ((stand_in - want).abs() <= tol).all(), f"{arch} {s.kind}: the stand-in is off the formula"


class _QuickGelu(torch.nn.Module):
    """x sigmoid(1.702 x): a GELU approximation none of the stand-ins computes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class _GeluOtherConstant(torch.nn.Module):
    """The tanh GELU with 0.0447 for 0.044715: off the stand-in by ~1e-5 at |x| ~ 2."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.0447 * torch.pow(x, 3.0))))


@pytest.mark.parametrize("act", [_QuickGelu, _GeluOtherConstant])
def test_an_activation_the_probe_rejects_runs_as_it_is(act):
    bridge = tiny_bridge("gpt2", seed=4, n_layers=2)
    for blk in bridge.blocks:
        blk.mlp.original_component.act = act()
    subs = probe(bridge)
    assert not any(isinstance(s.module, act) for s in subs) and {s.kind for s in subs} == {"layer_norm"}


def test_a_norm_with_another_epsilon_is_not_replaced_and_scores_stay_transformer_lens(replays):
    """The bridge's Python LayerNorm uses the config's epsilon (1e-5); the wrapped module told 1e-3 makes
    the one-kernel LayerNorm another function: that norm keeps running, the others are replaced, and
    node EAP still equals TransformerLens's per pair."""
    bridge = tiny_bridge("gpt2", seed=4, n_layers=2)
    odd = bridge.blocks[1].ln1
    odd.original_component.eps = 1e-3
    subs = probe(bridge)
    assert odd not in [s.module for s in subs] and sum(s.kind == "layer_norm" for s in subs) == 4
    pairs = bridge_pairs(bridge, B, N)
    res = node_attribution(bridge, pairs, lambda lg: lg[:, -1, 5] - lg[:, -1, 6], ("z", "mlp_out"))
    assert replays == [True]
    L, H = bridge.cfg.n_layers, bridge.cfg.n_heads
    z = (res["z"].per_example - res["z"].baseline).view(L, N, H, B)
    for i in range(B):
        ref = tl_attribution_patch(bridge, pairs.clean_tokens[i : i + 1], pairs.corrupted_tokens[i : i + 1],
                                   lambda lg: lg[0, -1, 5] - lg[0, -1, 6]).node_scores
        tz = torch.tensor([[[ref[Node("attn_head_out", p, l, h)] for h in range(H)] for p in range(N)] for l in range(L)])
        assert (z[..., i].float() - tz).abs().max() <= 1e-5 and tz.abs().max() > 1e-4


def test_fused_restores_every_module_and_skips_a_norm_hooked_inside(bridges):
    """Inside ``fused`` the stand-ins run (on the bridge component, not on the module it wraps); a norm with a
    hook on its ``hook_scale`` keeps its own forward; on exit no module has a forward of its own."""
    bridge = bridges["gpt2"]
    subs = probe(bridge)
    hooked = bridge.blocks[0].ln2
    handle = hooked.hook_scale.register_forward_hook(lambda m, a, out: None)
    try:
        with fused(subs):
            own = {id(m) for m in bridge.modules() if "forward" in vars(m)}
    finally:
        handle.remove()
    assert own == {id(s.module) for s in subs if s.module is not hooked}
    assert not any("forward" in vars(m) for m in bridge.modules())


@pytest.mark.parametrize("bias", [False, True])
def test_the_unembedding_as_weight_times_rows_equals_the_linear_map_in_float64(bias):
    """The re-run's unembedding product ``(weight @ rows.T).T`` (+ bias) is the ``nn.Linear``'s map: within
    float32 rounding of the float64 product, d eps sum|x w| per logit (a d-term dot product in any order)."""
    from interp_norm.circuits.attribution_replay import linear_rows

    g = torch.Generator().manual_seed(2)
    lin = torch.nn.Linear(64, 1000, bias=bias)
    rows = torch.randn(16, 64, generator=g)
    got = linear_rows(rows, lin)
    want = rows.double() @ lin.weight.detach().double().T + (lin.bias.detach().double() if bias else 0.0)
    tol = 64 * EPS32 * (rows.double().abs() @ lin.weight.detach().double().abs().T + (lin.bias.detach().double().abs() if bias else 0.0))
    assert got.shape == (16, 1000) and got.is_contiguous() and ((got.double() - want).abs() <= tol).all()


def test_the_rms_norm_stand_in_has_the_gradient_of_the_formula():
    """Its hand-written backward against autograd through the formula, in float64 (``gradcheck``: finite
    differences too), for the input and the weight; its float32 forward is ``F.rms_norm``'s, bit for bit."""
    from interp_norm.circuits.exact.fused_elementwise import rms_norm

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-5), (x, w))
    u = torch.randn(3, 4, 16, generator=g, dtype=torch.float64)
    want = torch.autograd.grad((_norm64(x, w, None, 1e-5, False) * u).sum(), (x, w))
    got = torch.autograd.grad((rms_norm(x, w, 1e-5) * u).sum(), (x, w))
    assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in zip(got, want))
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float()
    assert torch.equal(rms_norm(x32, w32, 1e-5), torch.nn.functional.rms_norm(x32, (16,), w32, 1e-5))
