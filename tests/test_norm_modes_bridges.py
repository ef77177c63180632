"""Frozen norm scales on TransformerBridges: node EAP with ``norm="frozen"`` equals ``(clean - corrupted) . dM/da``
with the gradient of a hand-written forward of the untouched Hugging Face model whose every norm
(pre- and post-norms, q/k norms, the final norm) divides by a detached scale."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import types

import pytest
import torch

from _models import bridge_pairs, bridges_with_hf_copies, hand_forward
from interp_norm.anatomy import tiny_bridge
from interp_norm.circuits import PatchingPairs, attribution_patch, node_attribution
from interp_norm.errors import PatchingError

B, N = 3, 7
EPS32 = torch.finfo(torch.float32).eps


def metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 5] - logits[:, -1, 6]


def _frozen_rms(self, x):
    s = (x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon).sqrt().detach()
    return self.weight * (x / s)


def _frozen_ln(self, x):
    xc = x - x.mean(-1, keepdim=True)
    s = (xc.pow(2).mean(-1, keepdim=True) + self.eps).sqrt().detach()
    return xc / s * self.weight + self.bias


def freeze_hf_norms(hf) -> int:
    """Every LayerNorm / RMSNorm module of ``hf`` divides by a detached scale (written out here)."""
    n = 0
    for m in hf.modules():
        if isinstance(m, torch.nn.LayerNorm):
            m.forward = types.MethodType(_frozen_ln, m)
        elif type(m).__name__.endswith("RMSNorm"):
            m.forward = types.MethodType(_frozen_rms, m)
        else:
            continue
        n += 1
    return n


def hand_eap_resid_pre(hf, arch: str, pairs: PatchingPairs) -> torch.Tensor:
    """[layer, pos, example]: (clean - corrupted) . d metric / d resid_pre on the corrupted run."""
    acts = {"clean": {}, "corr": {}}

    def keep(which):
        def at(kind, l, x):
            if kind == "resid_pre":
                if l == 0:
                    x = x.detach().requires_grad_()
                if x.requires_grad:
                    x.retain_grad()
                acts[which][l] = x
            return x
        return at

    with torch.no_grad():
        hand_forward(hf, arch, pairs.clean_tokens, keep("clean"))
    metric(hand_forward(hf, arch, pairs.corrupted_tokens, keep("corr"))).sum().backward()
    c, x = acts["clean"], acts["corr"]
    return torch.stack([((c[l] - x[l]) * x[l].grad).sum(-1).detach().T for l in range(len(x))])


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen3", "olmo2"])
def test_frozen_norm_eap_equals_the_hand_forward_with_detached_scales(arch):
    """float32: the hand forward and the bridge differ by rounding (~1e2 operations per step of a
    tiny model, each within eps32), so 1e3 * eps32 of the largest score; the live estimate differs
    from the frozen reference by far more, so the check can fail."""
    bridge, hf = bridges_with_hf_copies((arch,), seed=3)[arch]
    pairs = bridge_pairs(bridge, B, N, score_all=True)
    live_ref = hand_eap_resid_pre(hf, arch, pairs)
    assert freeze_hf_norms(hf) >= 2 * bridge.cfg.n_layers + 1
    ref = hand_eap_resid_pre(hf, arch, pairs)
    L = bridge.cfg.n_layers
    res = attribution_patch(bridge, pairs, metric, "resid_pre", norm="frozen")
    got = (res.per_example - res.baseline).view(L, N, B)
    tol = 1e3 * EPS32 * (1 + float(ref.abs().max()))
    assert float((got - ref.double()).abs().max()) <= tol
    assert float((live_ref - ref).abs().max()) > 10 * tol
    assert res.method == "eap+frozen-norm"


def test_frozen_patterns_on_a_bridge_zero_the_keys():
    bridge = tiny_bridge("llama")
    pairs = bridge_pairs(bridge, B, N, score_all=True)
    out = node_attribution(bridge, pairs, metric, ("k", "z"), norm="frozen", pattern="frozen")
    k = out["k"].per_example - out["k"].baseline
    z = out["z"].per_example - out["z"].baseline
    assert float(k.abs().max()) <= 1e2 * EPS32 * float(out["k"].baseline.abs().max())
    assert float(z.abs().max()) > 1e-4


def _frozen_gemma4_rms(self, x):
    """Gemma 4's RMSNorm (x * w / sqrt(mean(x^2) + eps), in float32, no 1 + w) with a detached scale."""
    xf = x.float()
    out = xf * (xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon).pow(-0.5).detach()
    return (out * self.weight.float() if self.with_scale else out).type_as(x)


def hf_eap_resid(hf, pairs: PatchingPairs) -> dict:
    """{"resid_pre"/"resid_mid": [layer, pos, example]}: (clean - corrupted) . d metric / d x on the
    corrupted run of the Hugging Face model itself, x = each decoder layer's input and the input of its
    pre-feedforward norm (the residual after attention, which the layer also carries on)."""
    layers = hf.model.layers
    acts: dict = {"clean": {}, "corr": {}}

    def grab(which, key):
        def pre(module, args):
            x = args[0]
            if key == ("resid_pre", 0) and torch.is_grad_enabled():
                # a new leaf: the per-layer inputs were made from the embedding already (as on the bridge,
                # whose hook_resid_pre.0 fires after them), so they do not see it
                x = x.detach().requires_grad_()
            if x.requires_grad:
                x.retain_grad()
            acts[which][key] = x
            return (x,) + tuple(args[1:])
        return pre

    def run(which, tokens):
        hs = [m.register_forward_pre_hook(grab(which, ("resid_pre", l))) for l, m in enumerate(layers)]
        hs += [m.pre_feedforward_layernorm.register_forward_pre_hook(grab(which, ("resid_mid", l))) for l, m in enumerate(layers)]
        try:
            return hf(tokens).logits
        finally:
            for h in hs:
                h.remove()

    with torch.no_grad():
        run("clean", pairs.clean_tokens)
    metric(run("corr", pairs.corrupted_tokens)).sum().backward()
    c, x = acts["clean"], acts["corr"]
    return {a: torch.stack([((c[a, l] - x[a, l]) * x[a, l].grad).sum(-1).detach().T for l in range(len(layers))])
            for a in ("resid_pre", "resid_mid")}


@pytest.mark.parametrize("arch", ["gemma4", "gemma4-shared"])
def test_gemma4_frozen_norm_eap_equals_its_own_model_with_detached_scales(arch):
    """Gemma 4's norms have no hook_scale: they are frozen between hook_in and hook_out. The reference
    is the untouched Hugging Face model whose every RMSNorm (pre-, post-, q/k/v norms, the per-layer
    input norms, the final norm) divides by a detached scale, differentiated by autograd. float32 on
    both sides: 1e3 * eps32 of the largest score (as above); the live scores differ by far more."""
    bridge, hf = bridges_with_hf_copies((arch,), seed=3)[arch]
    pairs = bridge_pairs(bridge, B, N, score_all=True)
    live_ref = hf_eap_resid(hf, pairs)
    frozen = [m for m in hf.modules() if type(m).__name__ == "Gemma4RMSNorm"]
    for m in frozen:
        m.forward = types.MethodType(_frozen_gemma4_rms, m)
    assert len(frozen) >= 5 * bridge.cfg.n_layers + 1
    ref = hf_eap_resid(hf, pairs)
    L = bridge.cfg.n_layers
    for act in ("resid_pre", "resid_mid"):
        want, live_want = ref[act].double(), live_ref[act].double()
        res = attribution_patch(bridge, pairs, metric, act, norm="frozen")
        got = (res.per_example - res.baseline).view(L, N, B)
        tol = 1e3 * EPS32 * (1 + float(want.abs().max()))
        assert float((got - want).abs().max()) <= tol, act
        assert float((live_want - want).abs().max()) > 10 * tol
        assert res.method == "eap+frozen-norm"
        live = attribution_patch(bridge, pairs, metric, act)
        assert float(((live.per_example - live.baseline).view(L, N, B) - live_want).abs().max()) <= tol


def test_a_bridge_norm_that_is_not_x_w_over_s_is_refused():
    """A norm whose output is not x * w / s of its input (here: Gemma 4's with its gain offset by one,
    as Gemma 1-3 compute it) cannot be frozen from hook_in to hook_out: a typed error, not a wrong gradient."""
    bridge = tiny_bridge("gemma4")
    norm = bridge.blocks[0].ln1.original_component
    forward = norm.forward
    norm.forward = lambda x: forward(x) + norm._norm(x.float()).type_as(x)
    with pytest.raises(PatchingError, match="does not compute"):
        attribution_patch(bridge, bridge_pairs(bridge, B, N, score_all=True), metric, "z", norm="frozen")
