"""Node EAP on TransformerBridges at the residual stream (resid_pre / resid_mid / resid_post) equals
``(clean - corrupted) . dM/da`` with the gradient of a hand-written forward of the untouched Hugging
Face model; k / v of grouped-query attention are scored over the k/v heads, as TransformerLens's
gradient cache gives them.

A bridge's ``blocks.{l}.hook_resid_mid`` is an alias of the second norm's input (``ln2.hook_in``;
OLMo-2: the MLP's input), and the Hugging Face block also keeps that tensor as the residual it adds
the MLP's output to: the gradient at the hooked tensor must include the carried-on residual's path.
TransformerLens 4.3's ``attribution_patch`` does not score resid_mid, so the reference here is the
autograd gradient of a block-by-block forward (``tests/test_circuits_resid_mid.py`` checks the same
forward reproduces the models' logits), on both the re-run path and the full passes, with the
weights requiring gradients or not.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformer_lens.tools.analysis.attribution_patching import cache_activation_and_gradient

from _models import ReadAt, bridges_with_hf_copies, hand_forward
from interp_norm.anatomy import random_tokens, tiny_bridge
from interp_norm.circuits import PatchingPairs, attribution_patch, node_attribution
from interp_norm.errors import HookNameError, PatchingError
from interp_norm.core.hook_names import act_name

B, N = 3, 7
RESID = ("resid_pre", "resid_mid", "resid_post")
WRITES = ("attn_out", "mlp_out")  # the blocks' updates (OLMo-2: after the post-norms)
TOL = 1e-5


def metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 5] - logits[:, -1, 6]


def read_at(at: int) -> ReadAt:
    """logit(5) - logit(6) at position ``at`` of this module's [B, N] batches."""
    return ReadAt(at, B, N)


def _pairs(bridge) -> PatchingPairs:
    clean = random_tokens(bridge, B, N, seed=6, low=3)
    corr = clean.clone()
    for i, at in enumerate([1, 3, 2]):
        corr[i, at] = (corr[i, at] + 9) % 120 + 3
    return PatchingPairs(clean, corr, score_mask=torch.ones_like(clean, dtype=torch.bool))


# ----------------------------------------------------------------------------- the hand-written forward


def recorder(acts: dict):
    """An ``at`` for :func:`hand_forward` that keeps ``acts[(kind, l)]``: the residual tensors and the
    blocks' updates (resid_pre of layer 0 a leaf; every one keeps its gradient)."""

    def keep(kind: str, l: int, x: torch.Tensor) -> torch.Tensor:
        if kind == "resid_pre" and l == 0:
            x = x.detach().requires_grad_()
        if x.requires_grad:
            x.retain_grad()
        acts[(kind, l)] = x
        return x

    return keep


def hand_eap(hf, arch: str, pairs: PatchingPairs, fn) -> dict:
    """``{kind: [layer, pos, example]}``: (clean - corrupted) . d fn / d residual on the corrupted run."""
    ca, xa = {}, {}
    with torch.no_grad():
        hand_forward(hf, arch, pairs.clean_tokens, recorder(ca))
    fn(hand_forward(hf, arch, pairs.corrupted_tokens, recorder(xa))).sum().backward()
    L = 1 + max(l for _, l in xa)
    return {k: torch.stack([((ca[(k, l)] - xa[(k, l)]) * xa[(k, l)].grad).sum(-1).detach().T for l in range(L)])
            for k in RESID + WRITES}


# ----------------------------------------------------------------------------- the residual stream


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen3", "olmo2"])
def test_residual_eap_equals_the_hand_forward_gradient(arch, frozen, replays):
    """resid_pre / resid_mid / resid_post (and attn_out / mlp_out) by position, from the re-run path (no hook on the model) and
    the full passes (a no-op hook on it), each activation alone and all together, for metrics reading
    every position and one middle position; ``frozen``: the weights do not require gradients."""
    bridge, hf = bridges_with_hf_copies((arch,), seed=3)[arch]  # a fresh bridge: its wiring check runs here
    if frozen:
        bridge.requires_grad_(False)
    pairs = _pairs(bridge)
    L = bridge.cfg.n_layers
    calls = 0
    for fn in (metric, read_at(4)):
        ref = hand_eap(hf, arch, pairs, fn)
        for acts in [RESID + WRITES, ("resid_mid",)]:  # resid_pre in the first call: the wiring check hooks it
            fast = node_attribution(bridge, pairs, fn, acts)
            with bridge.hooks(fwd_hooks=[(act_name("resid_pre", 0), lambda act, hook: act)]):
                full = node_attribution(bridge, pairs, fn, acts)
            calls += 1
            for a in acts:
                r = ref[a]
                assert r.abs().max() > 1e-2  # the check compares something
                for res in (fast[a], full[a]):
                    got = (res.per_example - res.baseline).view(L, N, B)
                    assert (got - r).abs().max() <= TOL * (1 + r.abs().max()), (a, res.method)
    assert replays == [True] * calls  # the hooked calls did not try the re-run


@pytest.mark.parametrize("arch", ["llama", "olmo2"])
def test_resid_mid_eap_ig_through_both_paths_equals_the_hand_forward_at_alpha_zero_plus_the_rest(arch):
    """EAP-IG with one step is EAP; with several steps the two paths agree (the re-run path against
    the full passes, both adding the gradient at the residual)."""
    bridge, hf = bridges_with_hf_copies((arch,), seed=3)[arch]
    pairs = _pairs(bridge)
    fast = node_attribution(bridge, pairs, metric, ("resid_mid",), ig_steps=3, batch_size=2 * B)["resid_mid"]
    with bridge.hooks(fwd_hooks=[(act_name("resid_pre", 0), lambda act, hook: act)]):
        full = node_attribution(bridge, pairs, metric, ("resid_mid",), ig_steps=3, batch_size=2 * B)["resid_mid"]
    assert (fast.per_example - full.per_example).abs().max() <= TOL * (1 + fast.per_example.abs().max())
    assert (fast.per_example - fast.baseline).abs().max() > 1e-2


def test_gemma4_resid_mid_eap_equals_a_finite_difference(replays):
    """Gemma 4 (the re-run, with each row's per-layer inputs; no hand forward here): EAP at
    resid_mid equals (M(corrupted + eps (clean - corrupted) at one cell) - M(corrupted)) / eps, the
    step written in place into the hooked tensor (which is what the block carries on: checked for the
    other architectures in tests/test_circuits_resid_mid.py). Float64; the tolerance covers the
    second-order term and Gemma 4's float32 parts (0.3% of the scale here; the bug was 84%)."""
    bridge = tiny_bridge("gemma4", seed=3, n_layers=2).to(torch.float64)
    pairs = _pairs(bridge)
    L = bridge.cfg.n_layers
    res = node_attribution(bridge, pairs, metric, ("resid_mid",))["resid_mid"]
    assert replays == [True]
    got = (res.per_example - res.baseline).view(L, N, B)
    eps = 1e-3
    with torch.no_grad():
        _, cc = bridge.run_with_cache(pairs.clean_tokens)
        _, xc = bridge.run_with_cache(pairs.corrupted_tokens)
        m0 = metric(bridge(pairs.corrupted_tokens))
        fd = torch.zeros(L, N, B, dtype=torch.float64)
        for l in range(L):
            nm = act_name("resid_mid", l)
            for p in range(N):
                def step(act, hook, nm=nm, p=p):
                    act[:, p] += eps * (cc[nm][:, p] - xc[nm][:, p])
                    return act

                fd[l, p] = (metric(bridge.run_with_hooks(pairs.corrupted_tokens, fwd_hooks=[(nm, step)])) - m0) / eps
    scale = float(fd.abs().max())
    assert scale > 0.1 and (got - fd).abs().max() <= 2e-2 * scale


# ----------------------------------------------------------------------------- grouped k/v heads


def _tl_head_scores(bridge, pairs: PatchingPairs, act: str, i: int) -> torch.Tensor:
    """[layer, pos, head] scores of pair ``i`` from TransformerLens's gradient cache at ``hook_{act}``."""
    L = bridge.cfg.n_layers
    names = [act_name(act, l) for l in range(L)]
    with torch.no_grad():
        _, cc = bridge.run_with_cache(pairs.clean_tokens[i : i + 1], names_filter=lambda nm: nm in names)
    gc = cache_activation_and_gradient(bridge, pairs.corrupted_tokens[i : i + 1],
                                       lambda lg: lg[0, -1, 5] - lg[0, -1, 6], names_filter=["hook_embed"] + names)
    # (hook_embed cached too, as TransformerLens's attribution_patch does: it gives the first hook a gradient)
    return torch.stack([((cc[nm] - gc.activations[nm]) * gc.gradients[nm]).sum(-1)[0] for nm in names])


@pytest.mark.parametrize("arch", ["llama", "qwen3", "olmo2", "gemma4"])
def test_k_v_eap_on_grouped_query_bridges_runs_over_the_kv_heads(arch):
    bridge = tiny_bridge(arch, seed=5, n_layers=2)
    pairs = _pairs(bridge)
    L, kv = bridge.cfg.n_layers, bridge.cfg.n_key_value_heads
    assert kv < bridge.cfg.n_heads  # grouped
    for act in ("k", "v", "q"):
        heads = kv if act != "q" else bridge.cfg.n_heads
        by_pos = attribution_patch(bridge, pairs, metric, act)
        by_all = attribution_patch(bridge, pairs, metric, act, by="all")
        assert by_pos.values.shape == (L, N, heads) and by_all.values.shape == (L, heads)
        got = (by_pos.per_example - by_pos.baseline).view(L, N, heads, B)
        ref = torch.stack([_tl_head_scores(bridge, pairs, act, i) for i in range(B)], -1)
        scale = float(ref.abs().max())
        assert ref.shape == got.shape and scale > 1e-4  # (tiny Gemma 4's scores are small)
        assert (got - ref).abs().max() <= 1e-3 * scale, act
        summed = (by_all.per_example - by_all.baseline).view(L, heads, B)
        assert (summed - got.sum(1)).abs().max() <= 1e-3 * scale


def test_hooks_that_cannot_be_scored_are_typed_errors():
    """Gemma 4's KV-sharing layers have no hook_k (nor hook_v in k = v layers); its hook_pattern fires
    after the attention ran, so its gradient would be 0 everywhere: refused, not a table of zeros."""
    shared = tiny_bridge("gemma4-shared", seed=3)
    pairs = _pairs(shared)
    for act in ("k", "v"):
        with pytest.raises(HookNameError, match="no hook"):
            attribution_patch(shared, pairs, metric, act)
    with pytest.raises(PatchingError, match="post hoc"):
        attribution_patch(tiny_bridge("gemma4", seed=3, n_layers=2), pairs, metric, "pattern")
