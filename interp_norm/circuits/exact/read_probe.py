"""The logits positions a plain metric function reads, found once by probing it.

A metric that declares where it reads (``read_mask`` / ``read_positions``) lets the key/value-cache
engine skip every position after the last one read and unembed only the read ones. A plain function
``logits -> [batch]`` declares nothing, so without this the engine recomputed and unembedded every
position for it (1.7x slower on a 12-layer GPT-2-shaped bridge: ``benchmarks/bench_bridge_patching.py
--metric plain``). Here the metric is evaluated on the
corrupted run's logits with one position at a time replaced by three probes: NaN, the vocabulary
reversed, and seeded Gaussian noise at the logits' scale; a position is read when any probe changes
the value of any example.

The contract this relies on (documented on :func:`~interp_norm.circuits.activation_patch`): which
positions a metric reads must not depend on the logits' values. It is checked where it matters: the
engine hands the metric NaN at every position the probe found unread, so a metric that reads one of
them later returns NaN there, and :class:`ReadOutsideProbe` sends the sweep back to computing every
position (with a warning). Arithmetic on a NaN always shows; a read only through comparisons (an
argmax accuracy that stays wrong under all three probes) can escape both -- such a metric should
declare ``read_mask``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from interp_norm.circuits._types import MetricFn, metric_per_copy
from interp_norm.errors import PatchingError

#: Bytes of probed logits handed to the metric at once (copies x examples x positions x vocab).
PROBE_BYTES = 2**27


class ReadOutsideProbe(PatchingError):
    """A metric without ``read_mask`` read logits at a position its probe found unread (it returned
    NaN where the engine had put NaN); the sweep is redone over every position."""


def _probes(row: Tensor, gen: torch.Generator) -> list[Tensor]:
    """Replacements for one position's logits [b, vocab]: NaN, vocabulary reversed, noise."""
    scale = float(row.float().std()) + 1.0 if row.numel() > 1 else 1.0
    noise = torch.randn(row.shape, generator=gen, dtype=torch.float32).to(row.device, row.dtype) * scale
    return [torch.full_like(row, float("nan")), row.flip(-1), row + noise]


def _changed(vals: Tensor, base: Tensor) -> Tensor:
    """Per copy: did any example's value change (NaN counts as a change from a finite value)?"""
    diff = (vals != base) | (torch.isnan(vals) != torch.isnan(base))
    return diff.reshape(len(vals), -1).any(-1)


@torch.no_grad()
def probe_read_positions(metric: MetricFn, logits: Tensor, b: int) -> Optional[Tensor]:
    """``[pos]`` bool: the positions of ``logits`` [b, pos, vocab] whose values change the metric,
    or None when the probe cannot tell (the metric is not finite on ``logits``, or no probe changes it:
    then every position counts as read)."""
    n, V = logits.shape[1], logits.shape[2]
    base = metric_per_copy(metric, logits, 1, b)[0]
    if not bool(torch.isfinite(base).all()):
        return None
    gen = torch.Generator().manual_seed(0)
    per = max(1, PROBE_BYTES // max(1, b * n * V * logits.element_size()))
    read = torch.zeros(n, dtype=torch.bool)
    for p0 in range(0, n, per):
        ps = list(range(p0, min(n, p0 + per)))
        rows = [_probes(logits[:, p], gen) for p in ps]
        for k in range(3):
            stacked = logits.repeat(len(ps), 1, 1).view(len(ps), b, n, V)
            for j, p in enumerate(ps):
                stacked[j, :, p] = rows[j][k]
            try:
                vals = metric_per_copy(metric, stacked.view(len(ps) * b, n, V), len(ps), b)
            except Exception:  # the user's metric refuses a probe (e.g. asserts finite logits): read everywhere
                return None
            read[p0 : p0 + len(ps)] |= _changed(vals, base.unsqueeze(0)).cpu()
    return read if bool(read.any()) else None


__all__ = ["PROBE_BYTES", "ReadOutsideProbe", "probe_read_positions"]
