"""Key/value-cache patching on TransformerLens 4 bridges (``method="kv-cache"``) equals
``transformer_lens.patching`` on the same bridge, cell by cell, and refuses what it cannot run.

The reference is TransformerLens's own ``patching`` functions: one full forward pass of the bridge per
cell with its patching hook. The pairs differ at a different position per example (so cells live for
some examples only), and the metrics read the last position or a middle one (so positions after it
are skipped), per example or as a scalar.
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pandas as pd
import pytest
import torch
from transformer_lens import patching

from _models import ReadAt, differing_tokens
from interp_norm.anatomy import tiny_bridge
from interp_norm.circuits import activation_patch
from interp_norm.errors import PatchingError

TL = {
    "resid_pre": patching.get_act_patch_resid_pre,
    "attn_out": patching.get_act_patch_attn_out,
    "mlp_out": patching.get_act_patch_mlp_out,
    "z": patching.get_act_patch_attn_head_out_by_pos,
}


def last_diff(logits: torch.Tensor) -> torch.Tensor:
    """A plain per-example function: no read positions declared (every position is unembedded)."""
    return logits[:, -1, 5] - logits[:, -1, 6]


@pytest.fixture(scope="module")
def bridges():
    return {arch: tiny_bridge(arch, seed=3, n_layers=3) for arch in ("gpt2", "llama", "qwen3", "olmo2")}


def _tl(bridge, fn, corr, cache, metric):
    with contextlib.redirect_stderr(io.StringIO()), torch.no_grad():
        return fn(bridge, corr, cache, lambda lg: metric(lg).mean())


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen3", "olmo2"])
@pytest.mark.parametrize("act", list(TL))
def test_kv_cache_patching_equals_transformer_lens(bridges, arch, act):
    bridge = bridges[arch]
    clean, corr = differing_tokens(bridge)
    _, cache = bridge.run_with_cache(clean)
    for metric in (ReadAt(5, 3, 6), last_diff) if arch != "olmo2" else (ReadAt(3, 3, 6),):
        ref = _tl(bridge, TL[act], corr, cache, metric)
        ours = activation_patch(bridge, corr, cache, metric, act, batch_size=5)  # several chunks per position
        assert ours.method == "exact-kv-cache"
        assert ours.values.shape == ref.shape
        assert (ours.values - ref).abs().max() <= 1e-5
        assert (ref - ref.flatten()[0]).abs().max() > 1e-3  # the table is not flat: the check compares something


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_other_residual_points_all_positions_and_explicit_cells(bridges, arch):
    bridge = bridges[arch]
    clean, corr = differing_tokens(bridge)
    _, cache = bridge.run_with_cache(clean)
    metric = ReadAt(5, 3, 6)
    for act in ("resid_mid", "resid_post"):
        ref = _tl(bridge, lambda m, x, c, f: patching.generic_activation_patch(
            m, x, c, f, patching.layer_pos_patch_setter, act, index_axis_names=("layer", "pos")), corr, cache, metric)
        ours = activation_patch(bridge, corr, cache, metric, act, method="kv-cache")
        assert (ours.values - ref).abs().max() <= 1e-5
    ref = _tl(bridge, patching.get_act_patch_attn_head_out_all_pos, corr, cache, metric)
    ours = activation_patch(bridge, corr, cache, metric, "z", by="all", method="kv-cache")
    assert (ours.values - ref).abs().max() <= 1e-5 and (ref - ref.flatten()[0]).abs().max() > 1e-3
    cells = pd.DataFrame({"layer": [2, 0, 1, 1], "pos": [5, 3, 0, 4], "head_index": [1, 3, 0, 2]})
    with contextlib.redirect_stderr(io.StringIO()), torch.no_grad():
        ref = patching.generic_activation_patch(bridge, corr, cache, lambda lg: metric(lg).mean(),
                                                patching.layer_pos_head_vector_patch_setter, "z", index_df=cells)
    ours = activation_patch(bridge, corr, cache, metric, "z", cells=cells, method="kv-cache")
    assert ours.flat and (ours.values - ref).abs().max() <= 1e-5


def test_scalar_metric_and_per_example_values(bridges):
    """A scalar metric works; per-example values equal TransformerLens run on each example alone."""
    bridge = bridges["llama"]
    clean, corr = differing_tokens(bridge)
    _, cache = bridge.run_with_cache(clean)
    ref = _tl(bridge, TL["z"], corr, cache, last_diff)
    ours = activation_patch(bridge, corr, cache, lambda lg: last_diff(lg).mean(), "z", method="kv-cache")
    assert ours.per_example is None and (ours.values - ref).abs().max() <= 1e-5
    ours = activation_patch(bridge, corr, cache, ReadAt(5, 3, 6), "attn_out", method="kv-cache")
    for i in range(3):
        _, c1 = bridge.run_with_cache(clean[i : i + 1])
        one = _tl(bridge, TL["attn_out"], corr[i : i + 1], c1, ReadAt(5, 1, 6))
        assert (ours.per_example[:, i].view_as(one) - one).abs().max() <= 1e-5


@pytest.fixture(scope="module")
def gemmas():
    """Gemma 4 with sliding windows of 4 over 8 tokens; the shared one: layers 3-5 read the keys and
    values of layers 1 (full) and 2 (sliding), k = v full layers, per-layer inputs."""
    return {"gemma4": tiny_bridge("gemma4", seed=3), "gemma4-shared": tiny_bridge("gemma4-shared", seed=3, n_layers=6)}


@pytest.mark.parametrize("arch", ["gemma4", "gemma4-shared"])
@pytest.mark.parametrize("act", list(TL))
def test_gemma4_runs_the_engine_and_equals_transformer_lens(gemmas, arch, act):
    """The engine itself (not the fallback) runs Gemma 4, sliding windows and KV sharing included."""
    gemma = gemmas[arch]
    clean, corr = differing_tokens(gemma, n=8)  # longer than the sliding window (4)
    _, cache = gemma.run_with_cache(clean)
    for metric in (ReadAt(7, 3, 8), ReadAt(5, 3, 8)):
        ref = _tl(gemma, TL[act], corr, cache, metric)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback warns
            ours = activation_patch(gemma, corr, cache, metric, act, batch_size=5)
        assert ours.method == "exact-kv-cache"
        assert (ours.values - ref).abs().max() <= 1e-5
        assert (ref - ref.flatten()[0]).abs().max() > 1e-3


def test_gemma4_other_residual_points_and_all_positions(gemmas):
    """resid_mid / resid_post by position and z over all positions on the KV-sharing Gemma 4."""
    gemma = gemmas["gemma4-shared"]
    clean, corr = differing_tokens(gemma, n=8)
    _, cache = gemma.run_with_cache(clean)
    metric = ReadAt(6, 3, 8)
    for act in ("resid_mid", "resid_post"):
        ref = _tl(gemma, lambda m, x, c, f: patching.generic_activation_patch(
            m, x, c, f, patching.layer_pos_patch_setter, act, index_axis_names=("layer", "pos")), corr, cache, metric)
        ours = activation_patch(gemma, corr, cache, metric, act, method="kv-cache")
        assert (ours.values - ref).abs().max() <= 1e-5 and (ref - ref.flatten()[0]).abs().max() > 1e-3
    ref = _tl(gemma, patching.get_act_patch_attn_head_out_all_pos, corr, cache, metric)
    ours = activation_patch(gemma, corr, cache, metric, "z", by="all", method="kv-cache")
    assert (ours.values - ref).abs().max() <= 1e-5 and (ref - ref.flatten()[0]).abs().max() > 1e-3


def test_gemma4_kv_sharing_is_read_from_the_model(gemmas):
    """Which layers store and which read shared keys/values is what the corrupted run did."""
    from interp_norm.circuits.exact.kv_patching import KVCacheEngine

    gemma = gemmas["gemma4-shared"]
    _, corr = differing_tokens(gemma, n=8)
    eng = KVCacheEngine(gemma, corr, ReadAt(7, 3, 8).read_mask, "resid_pre")
    assert eng.shares is not None and sorted(eng.shares.writes) == [1, 2]
    assert eng.shares.reads == {3: {"full_attention": 1}, 4: {"sliding_attention": 2}, 5: {"full_attention": 1}}
    assert [k is None for k in eng.keys] == [False, False, False, True, True, True]


def test_refuses_what_it_cannot_run(bridges, gemmas, monkeypatch):
    """An attention that ignores the cache it is given: kv-cache refuses, auto falls back to full passes."""
    gemma = gemmas["gemma4"]
    clean, corr = differing_tokens(gemma)
    _, cache = gemma.run_with_cache(clean)
    metric = ReadAt(5, 3, 6)
    attn_cls = type(gemma.blocks[0].original_component.self_attn)
    forward = attn_cls.forward
    monkeypatch.setattr(attn_cls, "forward", lambda self, *a, **kw: forward(self, *a, **{**kw, "cache": None}))
    with pytest.raises(PatchingError, match="key/value cache"):
        activation_patch(gemma, corr, cache, metric, "resid_pre", method="kv-cache")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ours = activation_patch(gemma, corr, cache, metric, "resid_pre")
    assert ours.method == "exact-hooks" and any("falling back" in str(x.message) for x in w)
    assert (ours.values - _tl(gemma, TL["resid_pre"], corr, cache, metric)).abs().max() <= 1e-5
    monkeypatch.undo()
    bridge = bridges["gpt2"]
    clean, corr = differing_tokens(bridge)
    _, cache = bridge.run_with_cache(clean)
    with pytest.raises(PatchingError, match="pattern"):
        activation_patch(bridge, corr, cache, metric, "pattern", method="kv-cache")
    assert activation_patch(bridge, corr, cache, metric, "pattern").method == "exact-hooks"
    with pytest.raises(PatchingError, match="kv-cache"):
        activation_patch(bridge, corr, cache, metric, "z", method="incremental")
