"""Attention anatomy of our own four variants, norm identification and the typed errors."""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from torch import nn

from interp_norm.anatomy import (
    ArchitectureError,
    anatomy,
    attention_mask,
    attention_scores,
    identify_norm,
    masked_softmax,
    random_tokens,
    tiny_bridge,
    verify_scores,
)
from interp_norm.errors import ConfigError, InterpNormError
from interp_norm.core.defaults import ATTN_NORMS
from interp_norm.core.hook_names import act_name

from _models import make_model


@pytest.mark.parametrize("attn_norm", ATTN_NORMS)
def test_own_variant_scores_reproduce_the_pattern(attn_norm):
    """The acceptance check on our models: softmax(masked attention_scores) == hook_pattern."""
    model = make_model(attn_norm=attn_norm)
    tokens = random_tokens(model, 3, 12, seed=1)
    check = verify_scores(model, tokens)
    assert check["ok"].all() and check["pattern_error"].max() <= 1e-5
    assert check["scores_hook_ok"].all()  # our hook_attn_scores is the pre-softmax score, by construction
    an = anatomy(model)
    cfg = model.cfg
    for la in an.layers:
        assert la.placement == attn_norm and la.n_kv_heads == la.n_heads == cfg.n_heads
        assert la.score_scale == pytest.approx(1 / math.sqrt(cfg.d_head))  # the default attn_scale = √d_head
        assert la.kv_head_of == tuple(range(cfg.n_heads))
        normed = {"qkv": "qkv", "qk": "qk"}.get(attn_norm, "")
        for t in "qkv":
            assert (la.norms[t] is not None) == (t in normed)
            if t in normed:
                assert (la.norms[t].kind, la.norms[t].axis, la.norms[t].gain) == ("rms", "per_head", True)
        assert (la.pre_norm is not None) == (attn_norm == "pre")


def test_own_scores_equal_q_dot_k_formula():
    """attention_scores = q_used · k_used / attn_scale (CONTRIBUTING's formula), computed by hand."""
    model = make_model(attn_norm="qkv")
    tokens = random_tokens(model, 2, 9, seed=4)
    _, cache = model.run_with_cache(tokens)
    for l in range(model.cfg.n_layers):
        q, k = cache[act_name("q_normed", l)], cache[act_name("k_normed", l)]
        ref = torch.einsum("bqhd,bkhd->bhqk", q, k) / model.cfg.attn_scale
        assert torch.allclose(attention_scores(model, cache, l), ref, atol=1e-6)


def test_paper_calibration_is_included_in_the_scores():
    model = make_model(attn_norm="qkv", calibration="paper")
    model.calibrate(random_tokens(model, 8, 12, seed=3))
    check = verify_scores(model, random_tokens(model, 3, 12, seed=1))
    assert check["ok"].all()
    factor = float(model.blocks[0].attn.calib_scores.factor)
    assert anatomy(model)[0].score_scale == pytest.approx(factor / model.cfg.attn_scale)


@pytest.mark.parametrize("make,kind,gain,bias", [
    (lambda: nn.LayerNorm(12), "ln", True, True),
    (lambda: nn.LayerNorm(12, elementwise_affine=False), "ln", False, False),
    (lambda: nn.RMSNorm(12, eps=1e-6), "rms", True, False),
    (lambda: nn.RMSNorm(12, eps=1e-6, elementwise_affine=False), "rms", False, False),
])
def test_identify_norm_by_what_it_computes(make, kind, gain, bias):
    torch.manual_seed(0)
    m = make()
    for p in m.parameters():  # gains/biases away from init
        nn.init.normal_(p, 1.0, 0.3)
    spec = identify_norm(m, 12, "x", "per_head")
    assert (spec.kind, spec.gain, spec.bias) == (kind, gain, bias)


def test_identify_norm_recognises_gemma_one_plus_w_gain():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    m = Gemma3RMSNorm(12, eps=1e-6)
    with torch.no_grad():
        m.weight.normal_(0, 0.3)  # effective gain 1 + w
    spec = identify_norm(m, 12, "x", "per_head")
    assert (spec.kind, spec.gain, spec.eps) == ("rms", True, 1e-6)


def test_identify_norm_rejects_a_non_norm():
    with pytest.raises(ArchitectureError, match="neither an RMSNorm nor a LayerNorm"):
        identify_norm(nn.Linear(12, 12), 12, "blocks.0.attn.mystery", "per_head")


def test_architecture_error_is_typed_and_names_the_model():
    with pytest.raises(ArchitectureError, match="Linear") as e:
        anatomy(nn.Linear(3, 3))
    assert isinstance(e.value, ConfigError) and isinstance(e.value, InterpNormError) and isinstance(e.value, ValueError)


def test_unattributable_attention_norm_is_an_error():
    """A norm inside the attention that is none of q_norm/k_norm/v_norm: named, not guessed."""
    bridge = tiny_bridge("qwen3")
    hf_attn = bridge.blocks[1].attn.original_component
    hf_attn.add_module("extra_ln", nn.LayerNorm(16))
    with pytest.raises(ArchitectureError, match="extra_ln"):
        anatomy(bridge, refresh=True)


def test_missing_score_scale_is_an_error():
    bridge = tiny_bridge("llama")
    del bridge.blocks[0].attn.original_component.scaling
    with pytest.raises(ArchitectureError, match="scaling"):
        anatomy(bridge, refresh=True)


def test_a_wrong_anatomy_fails_the_pattern_check():
    """The pattern check catches an anatomy that misses something (here: a doubled score scale)."""
    from dataclasses import replace

    from interp_norm.anatomy.scores import verify_anatomy

    bridge = tiny_bridge("llama")
    an = anatomy(bridge)
    wrong = replace(an, layers=(replace(an[0], score_scale=2 * an[0].score_scale),) + an.layers[1:])
    tokens = random_tokens(bridge, 2, 9, seed=5)
    check = verify_scores(bridge, tokens, anat=wrong)
    assert not check["ok"][0] and check["ok"][1]
    _, cache = bridge.run_with_cache(tokens)
    with pytest.raises(ArchitectureError, match="layer 0"):
        verify_anatomy(bridge, wrong, cache, tokens, strict=True)


def test_attention_mask_causal_and_sliding_window():
    from interp_norm.anatomy.describe import LayerAnatomy

    la = LayerAnatomy(0, 2, 1, 4, "none", {"q": None, "k": None, "v": None}, None, None, {}, {}, 1.0, sliding_window=3)
    m = attention_mask(la, 6)
    for q in range(6):
        for k in range(6):
            assert bool(m[q, k]) == (k <= q and q - k < 3)
    s = torch.randn(1, 2, 6, 6)
    p = masked_softmax(s, m)
    assert torch.allclose(p.sum(-1), torch.ones(1, 2, 6)) and (p[..., ~m] == 0).all()


def test_architecture_error_lives_in_errors_and_is_a_config_error():
    import interp_norm.anatomy as A
    from interp_norm import errors

    assert issubclass(errors.ArchitectureError, ConfigError) and issubclass(errors.ArchitectureError, ValueError)
    for name in A._EXPORTS:  # every public name resolves to its module's object
        assert getattr(A, name) is not None
