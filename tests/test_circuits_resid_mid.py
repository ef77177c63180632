"""Patching on TransformerLens 4 bridges of Hugging Face models, by full forward passes (``method="hooks"``).

``resid_mid`` of layer ``l`` is the residual stream between the block's attention and its MLP, as in
``HookedTransformer``: replacing it changes the MLP's input AND the residual the block adds the MLP's
output to. On a bridge, ``blocks.{l}.hook_resid_mid`` is an alias of the second norm's input
(``ln2.hook_in``; OLMo-2: the MLP's input), and the Hugging Face block keeps that same tensor as its
residual: a hook that returns a new tensor reaches the MLP only. The independent reference here is a
forward of the untouched Hugging Face model written out block by block, with ``resid_mid`` replaced
explicitly; ``transformer_lens.patching`` (in-place setters) agrees with it. The other activations are
checked against ``transformer_lens.patching`` and the key/value-cache engine; k/v of grouped-query
attention have the k/v heads (as TransformerLens sizes them); hooks that cannot be patched (missing in
some layers, or fired after the attention used them) are typed errors.
"""

from __future__ import annotations

import contextlib
import io
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformer_lens import patching

from _models import bridges_with_hf_copies, differing_tokens, hand_forward
from interp_norm.anatomy import tiny_bridge
from interp_norm.circuits import activation_patch
from interp_norm.errors import HookNameError, PatchingError
from interp_norm.core.hook_names import act_name

ARCHS = ("gpt2", "llama", "qwen3", "olmo2")
TOL = 1e-5


def metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 5] - logits[:, -1, 6]


@pytest.fixture(scope="module")
def models():
    return bridges_with_hf_copies(ARCHS, seed=3)


def _tl(fn, *args, **kw):
    with contextlib.redirect_stderr(io.StringIO()), torch.no_grad():  # TL's tqdm bar
        return fn(*args, **kw)


def _tl_resid(bridge, act, corr, cache, by="pos"):
    setter, axes = (patching.layer_pos_patch_setter, ("layer", "pos")) if by == "pos" else (
        lambda c, idx, clean: _set_all(c, clean), ("layer",))
    return _tl(patching.generic_activation_patch, bridge, corr, cache, lambda lg: metric(lg).mean(), setter, act,
               index_axis_names=axes)


def _set_all(corrupted, clean):
    corrupted[:] = clean
    return corrupted


# ----------------------------------------------------------------------------- the hand-written forward


@torch.no_grad()
def patched_forward(hf, arch: str, tokens: torch.Tensor, patch_mid=None) -> torch.Tensor:
    """:func:`hand_forward` with ``patch_mid(l, mid)`` returning the residual that layer ``l``'s MLP reads
    and that is carried on (mid = block input + attention update)."""
    if patch_mid is None:
        return hand_forward(hf, arch, tokens)
    return hand_forward(hf, arch, tokens, lambda kind, l, x: patch_mid(l, x) if kind == "resid_mid" else x)


def hand_mids(hf, arch: str, tokens: torch.Tensor) -> dict:
    mids = {}

    def keep(l, mid):
        mids[l] = mid.clone()
        return mid

    patched_forward(hf, arch, tokens, keep)
    return mids


def hand_resid_mid_table(hf, arch: str, clean: torch.Tensor, corr: torch.Tensor, by: str) -> torch.Tensor:
    """The mean metric with the clean resid_mid written into every corrupted example, cell by cell."""
    cm = hand_mids(hf, arch, clean)
    L, n = len(cm), clean.shape[1]
    out = torch.zeros(L, n) if by == "pos" else torch.zeros(L)
    for l in range(L):
        for p in range(n) if by == "pos" else [None]:
            def patch(ll, mid, l=l, p=p):
                if ll != l:
                    return mid
                mid = mid.clone()
                sl = slice(None) if p is None else p
                mid[:, sl] = cm[l][:, sl]
                return mid

            out[(l, p) if p is not None else l] = metric(patched_forward(hf, arch, corr, patch)).mean()
    return out


# ----------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("arch", ARCHS)
def test_hand_forward_is_the_model_and_hook_resid_mid_holds_its_mid(models, arch):
    """The reference is right: it reproduces the Hugging Face logits, and the bridge's hook_resid_mid
    holds its mid (= hook_resid_pre + hook_attn_out)."""
    bridge, hf = models[arch]
    clean, _ = differing_tokens(bridge)
    with torch.no_grad():
        logits = hand_forward(hf, arch, clean)
        assert (logits - hf(clean).logits).abs().max() <= TOL
        assert (logits - bridge(clean)).abs().max() <= TOL
    _, cache = bridge.run_with_cache(clean)
    for l, mid in hand_mids(hf, arch, clean).items():
        got = cache[act_name("resid_mid", l)]
        assert (got - mid).abs().max() <= TOL
        assert (got - cache[act_name("resid_pre", l)] - cache[act_name("attn_out", l)]).abs().max() <= TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_an_in_place_write_at_hook_resid_mid_reaches_the_mlp_and_the_carried_residual(models, arch):
    """What the hooks path relies on: the clean values written in place into the tensor at hook_resid_mid
    are what the MLP reads (mlp_out = the HF MLP of the patched mid) and what hook_resid_post carries on."""
    bridge, hf = models[arch]
    clean, corr = differing_tokens(bridge)
    mids = hand_mids(hf, arch, clean)
    seen = {}

    def write(act, hook):
        act[:, 2] = mids[0][:, 2]
        seen["mid"] = act.clone()
        return act

    def keep(name):
        def hook(act, hook):
            seen[name] = act.clone()
        return hook

    with torch.no_grad():
        bridge.run_with_hooks(corr, fwd_hooks=[(act_name("resid_mid", 0), write)] + [
            (act_name(k, 0), keep(k)) for k in ("mlp_out", "resid_post")])
        if arch == "gpt2":
            blk = hf.transformer.h[0]
            mlp = blk.mlp(blk.ln_2(seen["mid"]))
        elif arch == "olmo2":
            blk = hf.model.layers[0]
            mlp = blk.post_feedforward_layernorm(blk.mlp(seen["mid"]))
        else:
            blk = hf.model.layers[0]
            mlp = blk.mlp(blk.post_attention_layernorm(seen["mid"]))
    assert (seen["mlp_out"] - mlp).abs().max() <= TOL
    assert (seen["resid_post"] - seen["mlp_out"] - seen["mid"]).abs().max() <= TOL


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("by", ["pos", "all"])
def test_resid_mid_patching_equals_the_hand_written_forward(models, arch, by):
    bridge, hf = models[arch]
    clean, corr = differing_tokens(bridge)
    _, cache = bridge.run_with_cache(clean)
    ref = hand_resid_mid_table(hf, arch, clean, corr, by)
    baseline = metric(hand_forward(hf, arch, corr)).mean()
    assert (ref - baseline).abs().max() > 1e-3  # the patches change the metric: the check compares something
    assert (_tl_resid(bridge, "resid_mid", corr, cache, by) - ref).abs().max() <= TOL  # TransformerLens agrees
    for method in ("hooks", "kv-cache", "auto"):
        ours = activation_patch(bridge, corr, cache, metric, "resid_mid", by=by, method=method, batch_size=5)
        assert ours.values.shape == ref.shape
        assert (ours.values - ref).abs().max() <= TOL, method


@pytest.mark.parametrize("arch", ARCHS)
def test_hooks_path_equals_transformer_lens_and_the_kv_cache_engine(models, arch):
    bridge, _ = models[arch]
    clean, corr = differing_tokens(bridge)
    _, cache = bridge.run_with_cache(clean)
    for act in ("resid_pre", "resid_post", "attn_out", "mlp_out", "z"):
        if act == "z":
            ref = _tl(patching.get_act_patch_attn_head_out_by_pos, bridge, corr, cache, lambda lg: metric(lg).mean())
        else:
            ref = _tl_resid(bridge, act, corr, cache)
        hooks = activation_patch(bridge, corr, cache, metric, act, method="hooks", batch_size=7)
        kv = activation_patch(bridge, corr, cache, metric, act, method="kv-cache")
        assert hooks.method == "exact-hooks" and kv.method == "exact-kv-cache"
        assert (hooks.values - ref).abs().max() <= TOL, act
        assert (hooks.values - kv.values).abs().max() <= TOL, act


@pytest.mark.parametrize("act,by,fn", [
    ("k", "pos", patching.get_act_patch_attn_head_k_by_pos),
    ("v", "pos", patching.get_act_patch_attn_head_v_by_pos),
    ("k", "all", patching.get_act_patch_attn_head_k_all_pos),
])
def test_grouped_key_value_heads_are_the_head_axis(models, act, by, fn):
    """Llama has 2 k/v heads for 4 query heads: k and v cells run over the k/v heads."""
    bridge, _ = models["llama"]
    clean, corr = differing_tokens(bridge)
    _, cache = bridge.run_with_cache(clean)
    ref = _tl(fn, bridge, corr, cache, lambda lg: metric(lg).mean())
    ours = activation_patch(bridge, corr, cache, metric, act, by=by, method="hooks")
    assert ours.values.shape[-1] == bridge.cfg.n_key_value_heads == 2
    assert ours.values.shape == ref.shape and (ours.values - ref).abs().max() <= TOL
    assert (ref - ref.flatten()[0]).abs().max() > 1e-3


def test_pattern_patching_equals_transformer_lens_where_the_pattern_is_used(models):
    bridge, _ = models["llama"]
    clean, corr = differing_tokens(bridge)
    _, cache = bridge.run_with_cache(clean)
    ref = _tl(patching.get_act_patch_attn_head_pattern_by_pos, bridge, corr, cache, lambda lg: metric(lg).mean())
    ours = activation_patch(bridge, corr, cache, metric, "pattern", method="hooks")
    assert (ours.values - ref).abs().max() <= TOL and (ref - ref.flatten()[0]).abs().max() > 1e-3


def test_hooks_that_cannot_be_patched_are_typed_errors():
    """Gemma 4's KV-sharing layers have no hook_k (and k = v layers no hook_v); its attention runs inside
    the Hugging Face module and TransformerLens fires hook_pattern afterwards, so a written pattern is
    never used (every patch would be the baseline): both refused, not a table of baselines."""
    bridge = tiny_bridge("gemma4-shared", seed=3)
    clean, corr = differing_tokens(bridge)
    for act in ("k", "v"):
        with pytest.raises(HookNameError, match="no hook"):
            activation_patch(bridge, corr, metric=metric, activation=act, clean_tokens=clean)
    with pytest.raises(PatchingError, match="post hoc"):
        activation_patch(bridge, corr, metric=metric, activation="pattern", clean_tokens=clean)


def test_head_counts_that_differ_across_layers_are_a_typed_error():
    from interp_norm.circuits.exact.patch_cells import head_count

    assert head_count("head", [torch.zeros(1, 2, 2, 3)] * 3, 4) == 2  # the k/v heads, not n_heads
    with pytest.raises(PatchingError, match="different numbers of heads"):
        head_count("head", [torch.zeros(1, 2, 2, 3), torch.zeros(1, 2, 1, 3)], 4)
