"""``norm="frozen"`` edge attribution through post-norm blocks (OLMo-2, Gemma 4).

With the norms' scales frozen, edge EAP is the first-order effect of each edge in the *frozen-scale
model*: the model whose every norm divides by the constant it computed on the run differentiated
(the corrupted run). That model is written here by hand, independently of
:mod:`interp_norm.circuits.norm_modes`: every RMSNorm module of the Hugging Face model is replaced by
``x * w / s`` with ``s`` read off a recording of the corrupted run, and exact edge patching is
applied to it. EAP must equal the five-point finite difference of that patching, and, with patterns
pinned too and linear MLPs (an affine model), the patching itself. EAP-IG: the scale is held at each
integration point, as the node pass's freeze hooks hold it, so a head's out-edges add up to its
frozen node EAP-IG score.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import types
from contextlib import contextmanager
from typing import Any, Iterator

import pytest
import torch

from interp_norm.anatomy import original, tiny_bridge
from interp_norm.circuits import attribution_patch, edge_attribution, exact_edge_patch
from interp_norm.core.hook_names import act_name

from _models import bridge_pairs

B, N = 3, 6
EPS32, EPS64 = torch.finfo(torch.float32).eps, torch.finfo(torch.float64).eps


def plain(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 5] - logits[:, -1, 6]


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return (x.double().pow(2).mean(-1, keepdim=True) + eps).sqrt()


class Pins:
    """Recordings of the clean and the corrupted run, and the rule that decides whether a call is pinned:
    the clean run (recognised by its input, bit for bit, as exact edge patching reads its senders from
    it) and calls of another row layout (the edge runner's one-row probes) run live; every other call --
    the corrupted run, the patched runs' stacked copies ``[K * b, ...]``, the edge runner's own calls of
    a post-norm on ``[heads, groups, b, ...]`` -- gets the corrupted run's value, repeated over the rows."""

    def __init__(self, b: int):
        self.b, self.phase = b, "clean"
        self.clean: dict[Any, torch.Tensor] = {}
        self.corr: dict[Any, torch.Tensor] = {}

    def record(self, key: Any, x: torch.Tensor, value: torch.Tensor) -> None:
        into = self.clean if self.phase == "clean" else self.corr
        assert key not in into, "each pinned site fires once per run"
        into[key] = (x if self.phase == "clean" else value).detach().clone()

    def pinned(self, key: Any, x: torch.Tensor) -> torch.Tensor | None:
        """The corrupted run's value for ``x`` (its rows stacked as ``[..., b]`` before the recorded
        tensor's other axes), or None: the call runs live."""
        if self.phase != "pin":
            return None
        c, ref = self.clean[key], self.corr[key]
        k = c.ndim - 1
        lead = x.shape[: x.ndim - k]
        if (x.shape == c.shape and torch.equal(x, c)) or x.shape[x.ndim - k :] != c.shape[1:] or lead.numel() % self.b:
            return None
        return ref.repeat(lead.numel() // self.b, *([1] * k)).reshape(*lead, *ref.shape[1:])


def _pinned_rms(self, x: torch.Tensor, *, pins: Pins, orig) -> torch.Tensor:
    """An RMSNorm ``x * w / s`` whose ``s`` is the corrupted run's (see :class:`Pins`), in float64."""
    eps = self.variance_epsilon
    if pins.phase != "pin":
        pins.record(self, x, _rms(x, eps))
        return orig(x)
    s = pins.pinned(self, x)
    if s is None:
        return orig(x)
    out = x.double() / s
    if getattr(self, "with_scale", True):
        out = out * self.weight.double()
    return out.to(x.dtype)


def _pinned_pattern(act: torch.Tensor, hook: Any, *, pins: Pins) -> torch.Tensor:
    if pins.phase != "pin":
        pins.record(hook.name, act, act)
        return act
    ref = pins.pinned(hook.name, act)
    return act if ref is None else ref


@contextmanager
def frozen_scale_model(bridge, clean: torch.Tensor, corr: torch.Tensor, patterns: bool = False) -> Iterator[int]:
    """Inside: ``bridge`` is the frozen-scale model of the corrupted run (every RMSNorm of its Hugging Face
    model divides by its scale on ``corr``; with ``patterns`` every attention pattern is pinned too).
    Yields how many norms it pinned."""
    pins = Pins(clean.shape[0])
    norms = [m for m in bridge.original_model.modules() if type(m).__name__.endswith("RMSNorm")]
    own = [m.__dict__.get("forward") for m in norms]  # a forward set on the instance before (the float64 one below)
    for m in norms:
        m.forward = types.MethodType(lambda self, x, orig=m.forward: _pinned_rms(self, x, pins=pins, orig=orig), m)
    hooks = [(act_name("pattern", l), lambda a, hook: _pinned_pattern(a, hook, pins=pins)) for l in range(bridge.cfg.n_layers)]
    try:
        with bridge.hooks(fwd_hooks=hooks if patterns else []), torch.no_grad():
            bridge(clean)
            pins.phase = "corr"
            bridge(corr)
            pins.phase = "pin"
            yield len(norms)
    finally:
        for m, f in zip(norms, own):
            if f is None:
                del m.forward  # back to the class's forward
            else:
                m.forward = f


@pytest.fixture(scope="module")
def olmo2():
    return tiny_bridge("olmo2", seed=5, n_layers=2).double()


@pytest.fixture(scope="module")
def gemma4():
    return tiny_bridge("gemma4", seed=5).double()


def _five_point(bridge, pairs, edges) -> Any:
    def patched(scale: float):
        return exact_edge_patch(bridge, pairs, plain, edges=edges, scale=scale).set_index(["sender", "receiver"])["score"]

    eps = 1e-2
    return (8 * (patched(eps) - patched(-eps)) - (patched(2 * eps) - patched(-2 * eps))) / (12 * eps)


@pytest.mark.parametrize("arch", ["olmo2", "gemma4"])
def test_frozen_edge_eap_is_the_derivative_of_exact_patching_in_the_frozen_scale_model(request, arch):
    """Five-point stencil at eps = 1e-2 on the frozen-scale model (its pinned norms compute in float64):
    truncation ~ eps^4 |M^(5)| / 30, roundoff ~ 1e-15 |M| / eps; the frozen EAP's own backward runs
    through the model's norms in float32 at worst (~1e-7 relative). So 1e-4. The live estimate and the
    finite difference of the real model's patching differ from it by far more: the check can fail."""
    bridge = request.getfixturevalue(arch)
    pairs = bridge_pairs(bridge, B, N)
    est = edge_attribution(bridge, pairs, plain, norm="frozen")
    assert set(est.method) == {"eap+frozen-norm"}
    eap = est.set_index(["sender", "receiver"])["score"]
    edges = list(eap.index)
    heads = [e for e in edges if e[0].startswith("a0.")]  # senders through layer 0's post-attention norm
    assert {r.split(".")[-1] for _, r in heads} >= {"q", "k", "v", "m0", "m1", "logits"}
    with frozen_scale_model(bridge, pairs.clean_tokens, pairs.corrupted_tokens) as n_norms:
        fd = _five_point(bridge, pairs, edges)
    assert n_norms >= 4 * bridge.cfg.n_layers + 1  # post-attention/-MLP, q/k norms per layer, the final norm
    assert max(abs(fd[e] - eap[e]) for e in edges) <= 1e-4
    assert max(abs(eap[e]) for e in heads) > 1e-2  # the post-norm heads' edges carry signal
    live = edge_attribution(bridge, pairs, plain).set_index(["sender", "receiver"])["score"]
    assert max(abs(live[e] - eap[e]) for e in heads) > 1e-2
    live_up, live_down = (exact_edge_patch(bridge, pairs, plain, edges=heads, scale=s).set_index(["sender", "receiver"])["score"]
                          for s in (1e-2, -1e-2))  # the real model (the pins were undone): a central difference
    assert max(abs((live_up[e] - live_down[e]) / 2e-2 - fd[e]) for e in heads) > 1e-2


def _float64_rms(self, x: torch.Tensor) -> torch.Tensor:
    """OLMo-2's RMSNorm computed in float64 (the Hugging Face one rounds to float32 inside)."""
    return (x.double() / _rms(x, self.variance_epsilon) * self.weight.double()).to(x.dtype)


class _Ones(torch.nn.Module):
    """A gate activation that is 1 everywhere: the gated MLP ``down(act(gate x) * up x)`` becomes linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(x)


def test_fully_frozen_edge_eap_equals_exact_edge_patching_of_the_pinned_linear_model():
    """OLMo-2 with linear MLPs, every norm scale and attention pattern pinned to the corrupted run: the
    model is affine in every sender (post-norms divide by constants), so exact patching of it is its
    first-order effect, which frozen/frozen EAP computes. The norms compute in float64 here (the
    model's own, the frozen ones and the pins), so ~1e3 rounding steps of relative size eps64 per
    path: 1e4 * eps64 of the largest effect. The live estimate differs by far more."""
    bridge = tiny_bridge("olmo2", seed=5, n_layers=2).double()
    for blk in bridge.blocks:
        original(blk.mlp).act_fn = _Ones().eval()
    for m in bridge.original_model.modules():
        if type(m).__name__ == "Olmo2RMSNorm":
            m.forward = types.MethodType(_float64_rms, m)
    pairs = bridge_pairs(bridge, B, N)
    est = edge_attribution(bridge, pairs, plain, norm="frozen", pattern="frozen")
    with frozen_scale_model(bridge, pairs.clean_tokens, pairs.corrupted_tokens, patterns=True):
        exact = exact_edge_patch(bridge, pairs, plain)
    j = est.merge(exact, on=["sender", "receiver"], suffixes=("", "_exact"))
    assert len(j) == len(exact) == len(est)
    scale = float(j.score_exact.abs().max())
    assert scale > 1e-2 and float(j[j.sender.str.startswith("a0.")].score_exact.abs().max()) > 1e-3
    assert float((j.score - j.score_exact).abs().max()) <= 1e4 * EPS64 * max(scale, 1.0)
    live = edge_attribution(bridge, pairs, plain).merge(exact, on=["sender", "receiver"])
    assert float((live.score_x - live.score_y).abs().max()) > 1e-4 * scale
    real = exact_edge_patch(bridge, pairs, plain).merge(exact, on=["sender", "receiver"])
    assert float((real.score_x - real.score_y).abs().max()) > 1e-4 * scale  # the pins took effect


@pytest.mark.parametrize("arch", ["olmo2", "gemma4"])
def test_frozen_edge_eap_ig_out_edges_add_up_to_frozen_node_scores(request, arch):
    """EAP-IG holds each post-norm's scale at each integration point, as the freeze hooks do in the node
    pass (autograd through the model): a head's out-edges then sum to its frozen node EAP-IG score
    (the residual after the norm is read by every later receiver). Both in float64; the node pass reads
    the corrupted ``z`` off its frozen pass, where OLMo-2's edited norms recompute in float64 what the
    edge pass's plain sender run got from the float32 Hugging Face norms: ~eps32 relative per
    activation, so 1e2 * eps32 of the largest score. Holding the corrupted run's scale at every point
    instead misses by ~1e-2."""
    bridge = request.getfixturevalue(arch)
    pairs = bridge_pairs(bridge, B, N)
    r = attribution_patch(bridge, pairs, plain, "z", by="all", ig_steps=3, norm="frozen")
    edges = edge_attribution(bridge, pairs, plain, ig_steps=3, norm="frozen")
    assert set(edges.method) == {"eap-ig3+frozen-norm"}
    out = edges.groupby("sender")["score"].sum()
    got = torch.tensor([[out[f"a{l}.h{h}"] for h in range(bridge.cfg.n_heads)] for l in range(bridge.cfg.n_layers)])
    want = (r.per_example.double().mean(-1) - r.baseline.double().mean()).reshape(got.shape)
    assert float(want.abs().max()) > 1e-2
    assert float((got - want).abs().max()) <= 1e2 * EPS32 * float(want.abs().max())
    live = attribution_patch(bridge, pairs, plain, "z", by="all", ig_steps=3).effect().reshape(got.shape).double()
    assert float((live - want).abs().max()) > 1e-3


def test_a_post_norm_that_is_not_w_x_over_s_is_refused_when_frozen():
    """A post-attention norm with a ``1 + w`` gain (as Gemma 1-3 compute it) has no held-scale map of the
    form read from its weight: a typed error naming it, not a wrong score."""
    from interp_norm.errors import PatchingError

    bridge = tiny_bridge("olmo2", seed=5, n_layers=2).double()
    norm = bridge.blocks[0].ln1_post.original_component  # the Hugging Face module the bridge wraps
    forward = norm.forward
    norm.forward = lambda x: forward(x) + (x.double() / _rms(x, norm.variance_epsilon)).to(x.dtype)
    pairs = bridge_pairs(bridge, B, N)
    edge_attribution(bridge, pairs, plain)  # live: the norm's own Jacobian, whatever it computes
    with pytest.raises(PatchingError, match="post-norm Olmo2RMSNorm does not compute"):
        edge_attribution(bridge, pairs, plain, norm="frozen")
