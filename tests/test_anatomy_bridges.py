"""Tiny random GPT-2, Llama, Qwen3, OLMo-2 and Gemma 4 bridges, built offline from configs.

For each: the bridge's logits equal the untouched HF model's; the anatomy matches the HF config
(read independently here); and the acceptance check — softmax(masked scores rebuilt from q and
k) equals the model's own hook_pattern — holds on sequences longer than Gemma 4's sliding window.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from interp_norm.anatomy import (
    ARCHITECTURES,
    anatomy,
    attention_mask,
    attention_scores,
    masked_softmax,
    random_tokens,
    verify_scores,
)
from _models import bridges_with_hf_copies

ARCHS = sorted(ARCHITECTURES)


@pytest.fixture(scope="module")
def built():
    """arch -> (bridge, untouched HF copy)."""
    return bridges_with_hf_copies(ARCHS, seed=3)


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_bridge_logits_equal_hf_logits(built, arch):
    bridge, ref = built[arch]
    tokens = random_tokens(bridge, 2, 11, seed=7)
    assert torch.allclose(bridge(tokens), ref(tokens).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_scores_reproduce_the_pattern(built, arch):
    """THE acceptance check, per architecture, on fresh tokens (not the anatomy's probe)."""
    bridge, _ = built[arch]
    tokens = random_tokens(bridge, 3, 13, seed=11)
    check = verify_scores(bridge, tokens)
    assert check["ok"].all(), check
    assert check["pattern_error"].max() <= 1e-5
    # and by hand, independent of verify_scores: masked softmax of attention_scores vs the pattern
    an = anatomy(bridge)
    _, cache = bridge.run_with_cache(tokens)
    for la in an.layers:
        pattern = cache[la.hooks["pattern"]]
        ours = masked_softmax(attention_scores(bridge, cache, la.layer), attention_mask(la, 13))
        assert (ours - pattern).abs().max() <= 1e-5


def _hf_attentions(ref):
    """The untouched HF model's attention modules, in layer order."""
    return [m for m in ref.modules() if type(m).__name__.endswith("Attention")]


@pytest.mark.parametrize("arch", ARCHS)
def test_anatomy_matches_the_hf_config(built, arch):
    bridge, ref = built[arch]
    cfg = ref.config
    an = anatomy(bridge)
    n_heads = cfg.num_attention_heads
    gemma = dict(placement="qkv", q=("rms", "per_head", True), v=("rms", "per_head", False), pre="rms", rope=True, scale=1.0)
    expect = {
        "gpt2": dict(placement="pre", q=None, v=None, pre="ln", rope=False, scale=None),
        "llama": dict(placement="pre", q=None, v=None, pre="rms", rope=True, scale=None),
        "qwen3": dict(placement="qk", q=("rms", "per_head", True), v=None, pre="rms", rope=True, scale=None),
        "olmo2": dict(placement="qk", q=("rms", "all_heads", True), v=None, pre=None, rope=True, scale=None),
        "gemma4": gemma, "gemma4-shared": gemma,
    }[arch]
    attns = _hf_attentions(ref)
    assert len(attns) == an.n_layers == cfg.num_hidden_layers
    for la, hf in zip(an.layers, attns):
        d_head = hf.head_dim
        n_kv = n_heads // getattr(hf, "num_key_value_groups", 1)
        assert (la.n_heads, la.n_kv_heads, la.d_head) == (n_heads, n_kv, d_head)
        assert la.placement == expect["placement"]
        assert la.score_scale == pytest.approx(expect["scale"] or d_head ** -0.5)
        assert la.rope == expect["rope"]
        for t, key in (("q", "q"), ("k", "q"), ("v", "v")):
            n = la.norms[t]
            assert (None if n is None else (n.kind, n.axis, n.gain)) == expect[key]
        assert (None if la.pre_norm is None else la.pre_norm.kind) == expect["pre"]
        assert la.kv_head_of == tuple(h // (n_heads // n_kv) for h in range(n_heads))
    if arch in ("llama", "qwen3", "olmo2", "gemma4"):
        assert all(la.n_kv_heads == cfg.num_key_value_heads < n_heads for la in an.layers)
    if arch == "olmo2":
        assert all(la.post_norm is not None for la in an.layers)  # post-norm blocks
    if arch.startswith("gemma4"):
        windows = [la.sliding_window for la in an.layers]
        assert windows == [cfg.sliding_window if t == "sliding_attention" else None for t in cfg.layer_types]
        assert not any(la.rope_from_hooks for la in an.layers)  # hook_rot_q exists but never fires
    if arch == "gemma4-shared":  # the config built: 4 layers, last 2 share k/v; full layers k = v, 1 head of 32
        assert [la.kv_layer for la in an.layers] == [0, 1, 0, 1]
        assert [la.v_from_k for la in an.layers] == [False, True, False, True]
        assert [(la.n_kv_heads, la.d_head) for la in an.layers] == [(2, 16), (1, 32), (2, 16), (1, 32)]
        assert cfg.num_kv_shared_layers == 2 and cfg.attention_k_eq_v


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_which_score_hooks_are_trustworthy(built, arch):
    """Recorded per layer: on Gemma 4 hook_attn_scores holds the post-softmax pattern itself."""
    bridge, _ = built[arch]
    an = anatomy(bridge)
    tokens = random_tokens(bridge, 2, 10, seed=2)
    _, cache = bridge.run_with_cache(tokens)
    for la in an.layers:
        hook = cache[la.hooks["attn_scores"]]
        pattern = cache[la.hooks["pattern"]]
        if arch.startswith("gemma4"):
            assert la.scores_hook == "not_pre_softmax"
            assert torch.allclose(hook, pattern)  # what the hook really holds
        else:
            assert la.scores_hook == "pre_softmax"
            ours = attention_scores(bridge, cache, la.layer)
            allowed = attention_mask(la, 10)
            assert torch.allclose(hook[..., allowed], ours[..., allowed], atol=1e-5)


@torch.no_grad()
def test_gpt2_scale_attn_by_inverse_layer_idx_is_followed_by_the_bridge():
    """GPT-2's ``scale_attn_by_inverse_layer_idx`` divides layer l's scores by l + 1 as well: the
    bridge's logits equal the untouched HF model's, and the pattern check holds on every layer."""
    import copy

    import transformers as tf

    from interp_norm.anatomy import bridge_from_hf, tiny_config, tiny_hf_model

    plain = tiny_hf_model("gpt2", seed=3)
    cfg = tiny_config("gpt2")
    cfg.scale_attn_by_inverse_layer_idx = True
    scaled = tf.GPT2LMHeadModel(cfg).eval()
    scaled.load_state_dict(plain.state_dict())
    ref = copy.deepcopy(scaled)
    bridge = bridge_from_hf(scaled, name="tiny-gpt2-inverse-layer-idx")
    tokens = random_tokens(bridge, 2, 11, seed=7)
    assert (ref(tokens).logits - plain(tokens).logits).abs().max() > 1e-3  # the flag changes the model
    assert torch.allclose(bridge(tokens), ref(tokens).logits, atol=1e-5, rtol=1e-5)
    check = verify_scores(bridge, tokens)
    assert check["ok"].all() and check["pattern_error"].max() <= 1e-5, check
