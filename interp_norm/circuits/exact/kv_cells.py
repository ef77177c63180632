"""Sweeping cells with the key/value-cache engine: which copies each cell recomputes, in chunks.

:class:`~interp_norm.circuits.exact.kv_patching.KVCacheEngine` recomputes one chunk of patched copies
from a position on; this module plans the chunks over a set of cells (copies of the examples that
differ in the cell, grouped by position, at most ``batch_size`` rows each) and hands their logits to
the metric, read only at the positions the metric reads (:mod:`~interp_norm.circuits.exact.read_probe`).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from interp_norm.circuits._types import MetricFn, metric_per_copy
from interp_norm.circuits.exact.kv_patching import METRIC_BYTES, KVCacheEngine
from interp_norm.circuits.exact.read_probe import ReadOutsideProbe


def kv_patch_cells(engine: KVCacheEngine, cells: Tensor, differs: Tensor, clean_acts: list, metric: MetricFn, *,
                   batch_size: int, columns: tuple[Optional[int], Optional[int]], progress: bool = False,
                   desc: str = "patching") -> Tensor:
    """Metric values ``[n_cells, batch]`` (or ``[n_cells]`` for a scalar metric) of ``cells`` (live
    ones, in any order): copies of the examples that differ in the cell (``differs`` [cells, batch])
    are recomputed; the rest keep the corrupted logits. Chunks share the cell position (all
    positions: 0) and hold at most ``batch_size`` rows (copies x examples). ``columns``: which cell
    column holds the (destination) position and which the head (None: the cells have none)."""
    row_col, head_col = columns
    b, n = engine.b, engine.n
    dev = engine.logits.device
    if row_col is not None and engine.activation != "resid_pre":
        # after the attention of the last block a position reaches only its own logits: a cell there
        # at a position the metric does not read cannot change it (the corrupted baseline)
        unread = (cells[:, 0] == engine.L - 1) & ~torch.isin(cells[:, row_col], engine.cols.cpu())
        if bool(unread.any()):
            base_val = metric_per_copy(metric, engine.logits, 1, b)[0].to(torch.float64).cpu()
            out = torch.zeros((len(cells),) + tuple(base_val.shape), dtype=torch.float64)
            out[unread] = base_val
            keep = (~unread).nonzero().flatten()
            if len(keep):
                out[keep] = kv_patch_cells(engine, cells[keep], differs[keep], clean_acts, metric,
                                           batch_size=batch_size, columns=columns, progress=progress, desc=desc)
            return out
    starts = cells[:, row_col] if row_col is not None else torch.zeros(len(cells), dtype=torch.long)
    order = np.lexsort((cells[:, 0].numpy(), starts.numpy()))
    chunks: list[list[int]] = []
    cur: list[int] = []
    rows = 0
    for i in order:  # consecutive cells of one start position, at most batch_size rows each
        w = int(differs[i].sum())
        if cur and (int(starts[i]) != int(starts[cur[0]]) or rows + w > batch_size):
            chunks.append(cur)
            cur, rows = [], 0
        cur.append(int(i))
        rows += w
    if cur:
        chunks.append(cur)
    base = engine.logits  # [b, n, vocab]
    V = base.shape[-1]
    per = max(1, METRIC_BYTES // max(1, b * n * V * base.element_size()))  # copies per metric call
    buf = base.repeat(min(per, max(len(c) for c in chunks)), 1, 1)
    cols = engine.cols
    ref_val: Optional[Tensor] = None
    if engine.probed:  # the probe's contract, checked: NaN where it found no read shows in the values
        unread_pos = torch.ones(n, dtype=torch.bool, device=dev)
        unread_pos[cols] = False
        buf[:, unread_pos] = float("nan")
        ref_val = metric_per_copy(metric, base, 1, b)
    result: Optional[Tensor] = None
    for chunk in (tqdm(chunks, desc=desc) if progress else chunks):
        idx = torch.tensor(chunk)
        cc, live = cells[idx], differs[idx]  # [K, axes], [K, b]
        k_of, e_of = live.nonzero(as_tuple=True)  # rows: (copy, example), copies in layer order
        lay = cc[k_of, 0]
        srt = torch.argsort(lay, stable=True)
        k_of, e_of, lay = k_of[srt], e_of[srt], lay[srt]
        p = int(starts[chunk[0]])
        pos = None if row_col is None else cc[k_of, row_col].to(dev)
        heads = None if head_col is None else cc[k_of, head_col].to(dev)
        rc, new = engine.run_chunk(p, lay, e_of.to(dev), pos, heads, clean_acts)
        K = len(chunk)
        for s in range(0, K, per):  # the metric on the corrupted logits with the recomputed rows replaced
            kk = min(per, K - s)
            view = buf[: kk * b].view(kk, b, n, V)
            view[:, :, cols] = base[:, cols]
            m = ((k_of >= s) & (k_of < s + kk)).to(dev)
            view[(k_of.to(dev)[m] - s).unsqueeze(1), e_of.to(dev)[m].unsqueeze(1), rc.unsqueeze(0)] = new[m]
            vals = metric_per_copy(metric, buf[: kk * b], kk, b)
            if ref_val is not None and bool((torch.isnan(vals) & ~torch.isnan(ref_val)).any()):
                raise ReadOutsideProbe(
                    "the metric read logits at a position its probe found unread (NaN there came back); "
                    "give the metric a read_mask [batch, pos] of the positions it reads"
                )
            if result is None:
                result = torch.zeros((len(cells),) + tuple(vals.shape[1:]), dtype=torch.float64)
            result[idx[s : s + kk]] = vals.to(torch.float64).cpu()
    assert result is not None  # callers pass at least one cell
    return result


__all__ = ["kv_patch_cells"]
