"""One layer's activations at a time: ``layer_caches`` and ``StreamedCache`` give the
values TransformerLens's own ``run_with_cache`` gives, stop the forward after the last hook asked for
(no logits), and analyses built on them are unchanged."""

from __future__ import annotations

import pytest
import torch

from interp_norm.anatomy import random_tokens, tiny_bridge
from interp_norm.anatomy.stream import StreamedCache, layer_caches


def _names(model):
    return {l: {f"blocks.{l}.hook_resid_pre", f"blocks.{l}.attn.hook_pattern"} for l in range(len(model.blocks))}


@pytest.mark.parametrize("arch", ["qwen3", "gemma4-shared"])
def test_layer_caches_equal_run_with_cache_and_stop_before_the_logits(arch):
    model = tiny_bridge(arch, seed=0)
    tokens = random_tokens(model, 2, 9, seed=1)
    names = _names(model)
    wanted = set().union(*names.values())
    with torch.no_grad():
        _, ref = model.run_with_cache(tokens, names_filter=lambda n: n in wanted)
    fired = []
    with model.hooks(fwd_hooks=[("unembed.hook_out", lambda x, hook: fired.append(1))]):
        seen = []
        for layer, cache in layer_caches(model, tokens, {l: names[l] for l in (0, 1)}):
            seen.append(layer)
            for n in names[layer]:
                assert torch.equal(cache[n], ref[n]), n
            assert not any(k.startswith(f"blocks.{layer - 1}.") for k in cache)  # the previous layer was dropped
    assert seen == [0, 1] and fired == []  # stopped after layer 1: the unembedding never ran


def test_leaving_early_stops_the_forward_and_a_missing_hook_is_an_error():
    model = tiny_bridge("llama", seed=0)
    tokens = random_tokens(model, 1, 6, seed=1)
    for layer, _ in layer_caches(model, tokens, _names(model)):  # noqa: B007 (read after the loop)
        break  # the worker thread is stopped and joined on close
    assert layer == 0
    with pytest.raises(KeyError, match="not.a.hook"):  # TransformerLens's own error, raised in the caller
        list(layer_caches(model, tokens, {0: {"blocks.0.hook_resid_pre", "not.a.hook"}}))


def test_streamed_cache_reads_like_a_whole_cache():
    model = tiny_bridge("olmo2", seed=2)
    tokens = random_tokens(model, 2, 8, seed=3)
    names = _names(model)
    wanted = set().union(*names.values())
    with torch.no_grad():
        _, ref = model.run_with_cache(tokens, names_filter=lambda n: n in wanted)
    with StreamedCache(model, tokens, names) as cache:
        assert set(cache) == wanted and all(n in cache for n in wanted)
        for _sweep in range(2):  # two sweeps over the layers: two forwards
            for l in range(len(model.blocks)):
                for n in sorted(names[l]):
                    assert torch.equal(cache[n], ref[n])
        assert cache.passes == 2
        with pytest.raises(KeyError):
            cache["blocks.0.hook_mlp_out"]


def test_another_forward_while_a_stream_waits_is_left_alone():
    model = tiny_bridge("qwen3", seed=0)
    tokens = random_tokens(model, 1, 7, seed=1)
    with torch.no_grad():
        ref = model(tokens)
    names = _names(model)
    for layer, _cache in layer_caches(model, tokens, names):
        if layer == 0:
            with torch.no_grad():
                assert torch.equal(model(tokens), ref)  # the waiting stream's hooks neither block nor change it


@pytest.mark.parametrize("max_elements", [1, 50, 1 << 20])
def test_kl_by_blocks_of_positions_equals_the_whole_tensor_formula(max_elements):
    from interp_norm.noise.text_agreement import _kl

    g = torch.Generator().manual_seed(0)
    clean, out = torch.randn(2, 11, 37, generator=g) * 3, torch.randn(2, 11, 37, generator=g) * 3
    logp = clean.double().log_softmax(-1)
    whole = (logp.exp() * (logp - out.double().log_softmax(-1))).sum(-1)
    assert torch.equal(_kl(clean, out, max_elements=max_elements), whole)
