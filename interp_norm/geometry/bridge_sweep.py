"""The hook-reading geometry of a bridge in one streamed sweep, a block of windows at a time.

:func:`~interp_norm.geometry.run.bridge_geometry`'s ``norm_spread`` (the paper's attended-embedding norm
spread, Menary et al. 2024 §5), ``sparsity_hist`` / ``sparsity_summary`` (max attention per row, the
paper's appendix) and ``ellipsoid_membership`` read, per layer, the residual stream, the attention
pattern [windows, heads, query, key] and every norm's input/output. Here each block of windows'
hooks of a layer (:func:`~interp_norm.anatomy.stream.window_blocks`) is reduced at once to what the
tables need per position or per normalised vector — the residual norm and the attention each
position receives per head, each row's max attention, each vector's membership and prediction — and
dropped before the next block runs; the global statistics (weighted medians, quantiles, histogram,
means) are computed from those small per-row values, in the order one pass gives them, so the tables
are those of :func:`~interp_norm.geometry.norm_spread`, :func:`~interp_norm.geometry.max_attention`
and :func:`~interp_norm.geometry.bridge.bridge_ellipsoid_membership` on the whole batch.

Memory: weights + one block's hooks of one layer (``window_batch`` windows) + the per-row values
(O(layers · heads · positions) numbers), never a pattern of every window.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from interp_norm.errors import GeometryError
from interp_norm.geometry.bridge import (
    BridgeNorm,
    bridge_pattern_hooks,
    bridge_resid_hooks,
    membership_rows,
    membership_table,
    position_mask,
)
from interp_norm.geometry.sparsity import sparsity_histogram, sparsity_summary
from interp_norm.geometry.spread import layer_frames, summarize_norm_spread

__all__ = ["bridge_sweep"]


@torch.no_grad()
def bridge_sweep(model: Any, tokens: Tensor, norms: list[BridgeNorm], *, coverage: float, tolerance: float, bins: int,
                 window_batch: Optional[int] = None, steps: Optional[tqdm] = None) -> dict[str, pd.DataFrame]:
    """``norm_spread``, ``sparsity_hist``, ``sparsity_summary`` and ``ellipsoid_membership`` of a bridge
    (defaults of those functions: position 0 excluded, residual centred iff the first Pre-Norm is a
    LayerNorm) from one early-stopped forward per block of ``window_batch`` windows (None = all)."""
    from interp_norm.anatomy import anatomy
    from interp_norm.anatomy.stream import window_blocks

    n_layers = len(model.blocks)
    patterns, resid = bridge_pattern_hooks(model), bridge_resid_hooks(model)
    names: dict[int, set[str]] = {l: {p, r} for l, (p, r) in enumerate(zip(patterns, resid))}
    at: dict[int, list[BridgeNorm]] = {}
    for nm in norms:  # a norm outside the blocks (the final norm) fires after the last one
        if nm.hook_in is not None:
            l = n_layers if nm.layer is None else nm.layer
            names.setdefault(l, set()).update((nm.hook_in, nm.hook_out))
            at.setdefault(l, []).append(nm)
    pre = anatomy(model)[0].pre_norm
    center = pre is not None and pre.kind == "ln"
    keep = position_mask(tokens, True)
    if not keep.any():
        raise GeometryError("no tokens left after excluding padding and '['; pass sequences with content")
    bi, pi = keep.nonzero(as_tuple=True)
    total = len(tokens)
    step = total if window_batch is None else min(int(window_batch), total)
    spread, max_attn = [], []
    got: dict[str, list] = {}  # norm name -> membership_rows of each block
    received: list = []  # per block of the layer: attention received [rows, heads] and residual norms [rows]
    maxima: list = []  # per block of the layer: max attention [rows, heads]
    for layer, start, cache in window_blocks(model, tokens, names, window_batch):
        if layer < n_layers:
            kb = keep[start:start + step]
            bl, pl = kb.nonzero(as_tuple=True)
            x = cache[resid[layer]].double()
            if center:
                x = x - x.mean(-1, keepdim=True)
            pat = cache[patterns[layer]]
            w = torch.einsum("bhqk,bq->bhk", pat.double(), kb.double())  # as attended_norms
            received.append((w[bl, :, pl].cpu().numpy(), x.norm(dim=-1)[bl, pl].cpu().numpy()))
            del x, w
            maxima.append(pat.max(dim=-1).values[bl, :, pl].double().cpu().numpy())  # as max_attention
            del pat
        for nm in at.get(layer, ()):
            got.setdefault(nm.name, []).append(membership_rows(nm, cache[nm.hook_in], cache[nm.hook_out]))
        del cache
        if start + step < total or layer >= n_layers:
            continue
        weights, norm = (np.concatenate([r[i] for r in received]) for i in range(2))
        spread.append(summarize_norm_spread(pd.concat(layer_frames(layer, tokens, bi, pi, norm, weights),
                                                      ignore_index=True), coverage=coverage, tolerance=tolerance))
        max_attn.append(np.concatenate(maxima).T.ravel())  # (head, window, query): max_attention's row order
        received, maxima = [], []
    unhooked = [nm for nm in norms if nm.hook_in is None]
    if unhooked:
        _unhooked_rows(model, tokens, unhooked, step, got)
    if steps is not None:
        steps.update()
    norm_spread = (pd.concat(spread).sort_values(["layer", "head"], na_position="last", kind="stable")
                   .reset_index(drop=True))
    mx = pd.DataFrame(dict(layer=np.repeat(np.arange(len(max_attn)), [len(m) for m in max_attn]),
                           max_attn=np.concatenate(max_attn)))
    out = {"norm_spread": norm_spread, "sparsity_hist": sparsity_histogram(mx, bins=bins),
           "sparsity_summary": sparsity_summary(mx), "ellipsoid_membership": membership_table(norms, got)}
    if steps is not None:
        steps.update()
    return out


def _unhooked_rows(model: Any, tokens: Tensor, unhooked: list[BridgeNorm], step: int, got: dict) -> None:
    """Membership rows of norms the bridge does not wrap (a torch forward hook on the module; its last
    call in each forward counts, as in :func:`bridge_ellipsoid_membership`), a block of windows at a time."""
    from interp_norm.anatomy.stream import cache_before_unembed

    for start in range(0, len(tokens), step):
        last: dict[str, tuple] = {}
        handles = []
        for nm in unhooked:
            def keep(mod, args, out, nm=nm):
                last[nm.name] = membership_rows(nm, args[0].detach(), out.detach())
            handles.append(nm.module.register_forward_hook(keep))
        try:
            cache_before_unembed(model, tokens[start:start + step], set())
        finally:
            for h in handles:
                h.remove()
        for name, rows in last.items():
            got.setdefault(name, []).append(rows)
