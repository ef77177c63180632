"""Patch cells: their masks, parsing, and the proof that a cell cannot change the metric.

A *cell* is one row of indices (layer, position, head, ...; the axes of
:data:`~interp_norm.circuits._types.AXES`) naming the slice of an activation one patched copy
replaces. :func:`cell_mask` places it in the stacked activation ``[K, b, ...]``.

A *dead* cell leaves the corrupted run unchanged for an example: the clean and corrupted values
agree in its slice. That is proved without a patched pass, in one of three ways
(:func:`interp_norm.circuits.exact.patching.activation_patch`'s "dead cells" step):

* causality: positions before an example's first differing input agree in every layer
  (:func:`after_first_difference`, from :func:`input_differs` / :func:`first_difference`);
* layer 0 before attention (``resid_pre``, ``q``, ``k``, ``v``): a position's value is a function of
  its own input row, so it differs only where the input does (:func:`layer0_cells_differ`);
* otherwise the activations themselves, computed bit for bit as the clean cache's were, are compared
  (:func:`cell_differs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import pandas as pd
import torch
from torch import Tensor

from interp_norm.errors import HookNameError, PatchingError, PatternNotEditable
from interp_norm.core.hook_names import act_name


@dataclass(frozen=True)
class PatchSpec:
    """How :func:`~interp_norm.circuits.exact.patching.activation_patch` patches (also taken as keywords; an
    unknown one: PatchingError).

    ``by``: ``"pos"`` (per position; per destination position for ``pattern``), ``"all"`` (all positions
    at once) or ``"dest_src"`` (``pattern`` only). ``cells``: a DataFrame of explicit cells (columns = the
    axis names); the result is then flat, one value per row, as in TransformerLens. ``method``:
    ``"auto"`` (the fastest exact one; hooks where an engine refuses the model, with a warning),
    ``"incremental"`` (our models), ``"kv-cache"`` (bridges) or ``"hooks"``. ``batch_size`` bounds the
    work per forward pass and with it the memory (see ``activation_patch``).
    """

    by: str = "pos"
    cells: Optional[pd.DataFrame] = None
    method: str = "auto"
    batch_size: int = 1024


def row_axis(kind: str, by: str) -> Optional[int]:
    """Which cell column is the (destination) position, or None for all-position cells."""
    if by == "all":
        return None
    return 2 if kind == "pattern" else 1


def cell_mask(kind: str, by: str, cells: Tensor, n_rows: int, n_heads: int, n_keys: int) -> Tensor:
    """Bool mask, broadcastable to the stacked activation [K, b, ...], True where copy k is patched.

    Layouts: resid [K, b, R, d]; head [K, b, R, h, dh]; pattern [K, b, h, R, keys]; R = ``n_rows``
    (the first positions; cells at later positions patch nothing).
    """
    K, R = cells.shape[0], n_rows
    k = torch.arange(K)
    if kind == "resid":
        m = torch.zeros(K, 1, R, 1, dtype=torch.bool)
        if by == "all":
            m[:] = True
        else:
            ok = cells[:, 1] < R
            m[k[ok], 0, cells[ok, 1], 0] = True
    elif kind == "head":
        m = torch.zeros(K, 1, R, n_heads, 1, dtype=torch.bool)
        if by == "all":
            m[k, 0, :, cells[:, 1], 0] = True
        else:
            ok = cells[:, 1] < R
            m[k[ok], 0, cells[ok, 1], cells[ok, 2], 0] = True
    else:  # pattern
        m = torch.zeros(K, 1, n_heads, R, n_keys, dtype=torch.bool)
        h = cells[:, 1]
        if by == "all":
            m[k, 0, h] = True
        else:
            ok = cells[:, 2] < R
            if by == "pos":
                m[k[ok], 0, h[ok], cells[ok, 2], :] = True
            else:
                ok &= cells[:, 3] < n_keys
                m[k[ok], 0, h[ok], cells[ok, 2], cells[ok, 3]] = True
    return m


def cell_differs(kind: str, by: str, cells: Tensor, clean_acts: list, corr_acts: list) -> Tensor:
    """[n_cells, batch] bool: does the clean value differ from the corrupted one in the cell's slice?"""
    per_layer = []
    for a, c in zip(clean_acts, corr_acts):
        ne = a.to(c.device, c.dtype) != c
        per_layer.append(ne if kind == "pattern" else ne.any(-1))
    M = torch.stack(per_layer).cpu()  # [L, b, ...]
    l = cells[:, 0]
    if kind == "resid":
        return M[l, :, cells[:, 1]] if by == "pos" else M.any(-1)[l]
    if kind == "head":
        return M[l, :, cells[:, 1], cells[:, 2]] if by == "pos" else M.any(2)[l, :, cells[:, 1]]
    if by == "pos":
        return M.any(-1)[l, :, cells[:, 1], cells[:, 2]]
    if by == "all":
        return M.any(-1).any(-1)[l, :, cells[:, 1]]
    return M[l, :, cells[:, 1], cells[:, 2], cells[:, 3]]


def after_first_difference(kind: str, by: str, cells: Tensor, first: Tensor, n: int) -> Tensor:
    """[n_cells, batch] bool: is the cell's (destination) position at or after the example's first
    differing input position? Before it the clean and corrupted runs agree exactly (causality)."""
    first = first.cpu()
    col = row_axis(kind, by)
    if col is None:
        return (first < n).unsqueeze(0).repeat(len(cells), 1)
    return cells[:, col].unsqueeze(1) >= first.unsqueeze(0)


def input_differs(corrupted: Tensor, clean_tokens: Optional[Tensor], clean_cache, corrupted_resid0) -> Optional[Tensor]:
    """[batch, pos] bool: where the clean and corrupted inputs differ, from the tokens or from the
    clean cache's layer-0 residual; None if neither is known."""
    b, n = corrupted.shape
    if clean_tokens is not None and tuple(clean_tokens.shape) == (b, n):
        return clean_tokens.to(corrupted.device) != corrupted
    clean0 = resid0(clean_cache, b, n) if corrupted_resid0 is not None else None
    if corrupted_resid0 is not None and clean0 is not None:
        return (clean0.to(corrupted_resid0.device, corrupted_resid0.dtype) != corrupted_resid0).any(-1)
    return None


def first_difference(diff: Tensor) -> Tensor:
    """Per example, the first position where the inputs differ (``n`` if none)."""
    b, n = diff.shape
    pos = torch.arange(n, device=diff.device).expand(b, n)
    return torch.where(diff, pos, n).amin(-1)


def layer0_cells_differ(by: str, cells: Tensor, diff: Tensor) -> Tensor:
    """[n_cells, batch] bool for layer-0 cells before attention (resid_pre, q, k, v): a position's
    value there is a function of its own input row, so it differs only where the input does."""
    diff = diff.cpu()
    if by == "all":
        return diff.any(-1).unsqueeze(0).repeat(len(cells), 1)
    return diff[:, cells[:, 1]].T


def resid0(clean_cache, b: int, n: int) -> Optional[Tensor]:
    """The clean run's residual entering layer 0, if the cache holds it."""
    try:
        t = clean_cache[act_name("resid_pre", 0)]
    except (KeyError, TypeError):
        return None
    return t if tuple(t.shape[:2]) == (b, n) else None


def cells_from_df(cells: pd.DataFrame, axes: Sequence[str], sizes: dict[str, int]) -> Tensor:
    """The explicit cells of a DataFrame (columns = the axis names) as a [n_cells, axes] tensor, checked."""
    df = cells.rename(columns={"head_index": "head"})
    missing = [a for a in axes if a not in df.columns]
    if missing:
        raise PatchingError(f"cells need columns {list(axes)}; missing {missing}")
    if len(df) == 0:
        raise PatchingError(
            f"the set of cells to patch is empty; pass at least one row with columns {list(axes)}, or cells=None for every cell"
        )
    try:
        values = df[list(axes)].to_numpy(dtype="int64")
    except (TypeError, ValueError):
        raise PatchingError(f"cells columns {list(axes)} must hold integer indices") from None
    t = torch.tensor(values, dtype=torch.long).reshape(-1, len(axes))
    for j, a in enumerate(axes):
        if len(t) and (t[:, j].min() < 0 or t[:, j].max() >= sizes[a]):
            raise PatchingError(f"cell column {a!r} must lie in [0, {sizes[a]}), got {t[:, j].min()}..{t[:, j].max()}")
    return t


def check_hooks(model, names: Sequence[str]) -> None:
    """A :class:`HookNameError` naming the first of ``names`` the model has no hook for (a bridge's
    KV-sharing layer has no ``hook_k``/``hook_v``; a k = v layer no ``hook_v``)."""
    hooks = getattr(model, "hook_dict", None)
    if not isinstance(hooks, Mapping):
        return
    missing = [nm for nm in names if nm not in hooks]
    if missing:
        raise HookNameError(
            f"this model has no hook {missing[0]!r} ({len(missing)} of {len(names)} layers lack it: "
            "e.g. layers reusing another layer's keys and values, or whose values are their keys); patch another activation"
        )


@torch.no_grad()
def check_pattern_hooks_act(model, tokens: Tensor, names: Sequence[str]) -> None:
    """A :class:`~interp_norm.errors.PatternNotEditable` (a :class:`PatchingError`) if writing into the ``hook_pattern`` tensors ``names`` leaves the
    logits unchanged: the hook then fires after the attention has used its pattern (a bridge whose
    attention runs inside the Hugging Face module, e.g. Gemma 4), and every patch would be the baseline."""
    def halve(act: Tensor, hook) -> Tensor:
        act.mul_(0.5)
        return act

    base = model(tokens[:1])
    with model.hooks(fwd_hooks=[(nm, halve) for nm in names]):
        changed = model(tokens[:1])
    if torch.equal(base, changed):
        raise PatternNotEditable(
            f"writing into {names[0]!r} does not change this model's output: its attention pattern is read "
            "after the attention ran (TransformerLens fires it post hoc), so patching it changes nothing; "
            "patch 'q', 'k' or 'z' instead"
        )


def head_count(kind: str, clean_acts: Sequence[Tensor], n_heads: int) -> int:
    """Heads of a per-head activation (its axis 2): ``n_heads`` for q and z, the k/v heads for k and v
    under grouped-query attention (as ``transformer_lens.patching`` sizes them); ``n_heads`` for
    other kinds. A :class:`PatchingError` where layers differ (no rectangular grid)."""
    if kind != "head":
        return n_heads
    counts = [int(a.shape[2]) for a in clean_acts]
    if len(set(counts)) > 1:
        raise PatchingError(
            f"the activation has different numbers of heads across layers ({counts}), so its cells form no grid; "
            "patch 'z' or 'q' instead"
        )
    return counts[0]


def clean_act(clean_cache: Mapping[str, Tensor], name: str) -> Tensor:
    """The clean activation ``name``, or a :class:`HookNameError` saying how to get it."""
    try:
        return clean_cache[name]
    except KeyError:
        raise HookNameError(
            f"the clean cache has no {name!r}; run model.run_with_cache(clean_tokens) without a names_filter that drops it"
        ) from None


__all__ = [
    "after_first_difference",
    "cell_differs",
    "cell_mask",
    "cells_from_df",
    "check_hooks",
    "check_pattern_hooks_act",
    "clean_act",
    "first_difference",
    "head_count",
    "input_differs",
    "layer0_cells_differ",
    "resid0",
    "row_axis",
]
