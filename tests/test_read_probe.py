"""A plain metric function (no ``read_mask``) gets the key/value-cache engine's read-position savings:
the positions it reads are found by probing it, the values stay TransformerLens's, and a metric that
breaks the probe's contract (reads a position only in some patched copies) is caught and recomputed
over every position.

References: the positions a hand-written metric reads (known by construction), TransformerLens's own
``patching`` functions (one full forward pass per cell), and the engine's own row count for the same
metric declaring its ``read_mask``.
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformer_lens import patching

from _models import ReadAt, differing_tokens
from interp_norm.anatomy import tiny_bridge
from interp_norm.circuits import activation_patch
from interp_norm.circuits.exact.read_probe import probe_read_positions


def _tl(bridge, fn, corr, cache, metric):
    with contextlib.redirect_stderr(io.StringIO()), torch.no_grad():
        return fn(bridge, corr, cache, lambda lg: metric(lg).mean())


@pytest.fixture(scope="module")
def gpt2():
    return tiny_bridge("gpt2", seed=3, n_layers=3)


def test_probe_finds_exactly_the_positions_read():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=g)
    for read, metric in [
        ({1, 4}, lambda lg: lg[:, 1, 2] - lg[:, 4].logsumexp(-1)),
        ({6}, lambda lg: (lg[:, -1].argmax(-1) == 3).float()),  # a comparison: the reversed vocabulary moves it
        ({0, 2, 5}, lambda lg: lg[:, [0, 2, 5], 0].sum()),  # a scalar metric
    ]:
        got = probe_read_positions(metric, logits, 3)
        assert got is not None and set(got.nonzero().flatten().tolist()) == read
    assert probe_read_positions(lambda lg: torch.zeros(len(lg)), logits, 3) is None  # reads nothing visible: all
    assert probe_read_positions(lambda lg: lg[:, 0, 0] / 0.0 * 0.0, logits, 3) is None  # not finite: all

    def strict(lg):
        assert torch.isfinite(lg).all()
        return lg[:, 2, 0]

    assert probe_read_positions(strict, logits, 3) is None  # refuses the probe: all


def last_diff(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, 4, 5] - logits[:, 4, 6]


@pytest.mark.parametrize("act", ["resid_pre", "z"])
def test_plain_metric_runs_as_declared_and_equals_transformer_lens(gpt2, act):
    """The plain function reads position 4 of 6: it recomputes exactly the rows the same metric
    declaring ``read_mask`` does (nothing after position 4), with TransformerLens's values."""
    clean, corr = differing_tokens(gpt2)
    _, cache = gpt2.run_with_cache(clean)
    fn = {"resid_pre": patching.get_act_patch_resid_pre, "z": patching.get_act_patch_attn_head_out_by_pos}[act]
    ref = _tl(gpt2, fn, corr, cache, last_diff)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        plain = activation_patch(gpt2, corr, cache, last_diff, act, method="kv-cache", batch_size=5)
    declared = activation_patch(gpt2, corr, cache, ReadAt(4, 3, 6), act, method="kv-cache", batch_size=5)
    assert (plain.values - ref).abs().max() <= 1e-5 and (ref - ref.flatten()[0]).abs().max() > 1e-3
    assert plain.rows_computed == declared.rows_computed
    everywhere = activation_patch(gpt2, corr, cache, lambda lg: last_diff(lg) + 0 * lg[:, -1, 0], act, method="kv-cache")
    assert everywhere.rows_computed > plain.rows_computed  # reading the last position costs more rows


def test_metric_reading_outside_its_probe_is_recomputed_everywhere(gpt2):
    """Reads position 1 only where the last position's logits moved from the corrupted run's: the
    probe of the corrupted logits cannot see it, the NaN the engine puts there shows, and the sweep is
    redone over every position, equal to TransformerLens."""
    clean, corr = differing_tokens(gpt2)
    _, cache = gpt2.run_with_cache(clean)
    base_last = gpt2(corr)[:, -1].detach()

    def sneaky(lg: torch.Tensor) -> torch.Tensor:
        moved = (lg[:, -1] - base_last.repeat(len(lg) // 3, 1)).abs().max(-1).values > 1e-4
        return torch.where(moved, lg[:, 1, 5] + lg[:, -1, 6], lg[:, -1, 5])

    ref = _tl(gpt2, patching.get_act_patch_resid_pre, corr, cache, sneaky)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ours = activation_patch(gpt2, corr, cache, sneaky, "resid_pre", method="kv-cache")
    assert any("recomputing every position" in str(x.message) for x in w)
    assert (ours.values - ref).abs().max() <= 1e-5 and (ref - ref.flatten()[0]).abs().max() > 1e-3
