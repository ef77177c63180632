"""The row sets the incremental patching engine passes between its steps.

A chunk of ``K`` patched copies of the corrupted batch ``[b, n]`` addresses a row of a layer by
(copy, example, position); a row *set* is a bool mask ``[K, b, n_eff]`` over them, and the values
of its rows are stacked ``[M, ...]`` in the mask's order (copy, then example, then position:
``mask.nonzero()``'s order). The engine keeps only the rows that differ from the corrupted run, so
every step says which rows it gets and in which order: these dataclasses name those fields, instead
of the single letters of a positional argument list (:mod:`interp_norm.circuits.exact.engine`).

Order invariant: copies are sorted by the layer they are patched in, so in any layer the copies
already changed (patched in an earlier layer) come before the copies *entering* in this layer, and
their rows concatenate (:func:`cat_rows`) in mask order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Optional

import torch
from torch import Tensor

#: ``patch(values, idx)`` returns the stage values of rows ``idx = (copy, example, position)`` patched.
RowPatch = Callable[[Tensor, tuple], Tensor]


def from_first(mask: Tensor) -> Tensor:
    """True at and after the first True along the last axis (rows that attend to a changed row)."""
    return mask.cumsum(-1) > 0


def until_last(mask: Tensor) -> Tensor:
    """True at and before the last True along the last axis (key rows some query row sees)."""
    return mask.flip(-1).cumsum(-1).flip(-1) > 0


def cat_rows(*parts: Optional[Tensor]) -> Optional[Tensor]:
    """Concatenate the parts that exist (rows of earlier copies first); None if none does."""
    have = [p for p in parts if p is not None]
    return None if not have else have[0] if len(have) == 1 else torch.cat(have)


@dataclass
class Changed:
    """The rows of a layer's input (``resid_pre``) that differ from the corrupted run's: what one
    layer hands the next."""

    #: [M, d_model]: the new values, in ``mask`` order
    values: Tensor
    #: [K, b, n_eff]: which rows
    mask: Tensor


@dataclass
class Entry:
    """The copies patched in one layer, and how."""

    #: the stage the patch replaces (:data:`~interp_norm.circuits.exact.engine.STAGES`)
    stage: str
    #: writes the clean values into the stage values of the given rows
    patch: RowPatch
    #: [K, b, n_eff]: the rows each copy's patch changes (False for copies patched in other layers)
    rows: Tensor
    #: [K]: the one head each copy's patch changes (q/k/v/pattern cells of one head); None: any head
    heads: Optional[Tensor] = None


@dataclass
class LayerRows:
    """The rows one block recomputes, by why: the changed copies' rows and the entering ones'."""

    #: [K, b, n_eff]: rows at or after a changed input row (their attention sees it) that the
    #: metric can still read; None if none
    changed: Optional[Tensor]
    #: [K, b, n_eff]: rows of the entering copies that their patch changes; None if none
    entering: Optional[Tensor]
    #: ``changed | entering``: the rows whose block output may differ
    union: Tensor
    #: (copy, example, position) of the ``entering`` rows
    entering_idx: Optional[tuple]
    #: [M, d_model]: ``resid_pre`` of the ``changed`` rows
    x: Optional[Tensor]


@dataclass
class QueryRows:
    """Query rows of one attention, grouped by (copy, example): a group attends to its own copy's
    keys and values. Rows and groups are both sorted by (copy, example, position)."""

    #: (copy, example, position) of each row
    idx: tuple
    #: [M]: each row's group
    group: Tensor
    #: [M]: each row's place within its group
    slot: Tensor
    #: [G]: each group's copy
    group_copy: Tensor
    #: [G]: each group's example
    group_example: Tensor
    #: keys the rows attend to: positions up to the last query row's (shared by the parts of a :meth:`split`)
    n_keys: int

    @classmethod
    def of(cls, mask: Tensor, b: int) -> "QueryRows":
        """The rows of ``mask`` [K, b, n], grouped."""
        idx = kidx, bidx, _ = mask.nonzero(as_tuple=True)
        _, group, counts = torch.unique_consecutive(kidx * b + bidx, return_inverse=True, return_counts=True)
        start = counts.cumsum(0) - counts
        slot = torch.arange(len(kidx), device=mask.device) - start[group]
        return cls(idx, group, slot, kidx[start], bidx[start], int(idx[2].max()) + 1)

    @cached_property
    def causal(self) -> Tensor:
        """[M, n_keys]: the keys at or before each row."""
        return torch.arange(self.n_keys, device=self.idx[2].device) <= self.idx[2].unsqueeze(1)

    def split(self, n_rows: int) -> tuple["QueryRows", "QueryRows"]:
        """The first ``n_rows`` rows and the rest, each with its own groups (the split must fall
        between groups: between the changed copies' rows and the entering ones')."""
        n_groups = 0 if n_rows == 0 else int(self.group[n_rows - 1]) + 1
        first = QueryRows(tuple(i[:n_rows] for i in self.idx), self.group[:n_rows], self.slot[:n_rows],
                          self.group_copy[:n_groups], self.group_example[:n_groups], self.n_keys)
        rest = QueryRows(tuple(i[n_rows:] for i in self.idx), self.group[n_rows:] - n_groups, self.slot[n_rows:],
                         self.group_copy[n_groups:], self.group_example[n_groups:], self.n_keys)
        return first, rest


@dataclass
class Replaced:
    """Key (or value) rows of one attention that differ from the corrupted run's."""

    #: [K, b, n_eff]: which rows
    mask: Tensor
    #: [M, n_heads, d_head]: their values (after any per-head norm), in ``mask`` order
    values: Tensor
    #: [queries, keys]: which of them each query row sees (set for the shared-keys attention)
    seen: Optional[Tensor] = None


@dataclass
class KVChanges:
    """What differs from the corrupted run in one attention's inputs: rows whose block input changed
    (new q, k and v), and the key or value rows the entering copies patch."""

    #: [K, b, n_eff]: changed input rows some query row sees; None if none
    rows: Optional[Tensor] = None
    #: [M, n_heads, d_head] each: the new q, k, v of ``rows`` (after any per-head norm)
    q: Optional[Tensor] = None
    k: Optional[Tensor] = None
    v: Optional[Tensor] = None
    #: "k" or "v" when entering copies patch keys or values, else None
    patched_stage: Optional[str] = None
    #: [K, b, n_eff]: those patched rows that some query row sees
    patched: Optional[Tensor] = None
    #: [M', n_heads, d_head]: their patched values (after any per-head norm)
    patched_values: Optional[Tensor] = None

    def replaced(self, which: str) -> Optional[Replaced]:
        """Every ``which`` ("k" or "v") row that differs: the changed copies' then the patched ones.
        Without a patch here, keys and values share one mask object (``is``: their seen pairs are
        computed once)."""
        values = self.k if which == "k" else self.v
        if self.patched_stage != which:
            if self.rows is None:
                return None
            assert values is not None  # changed rows come with their new k and v
            return Replaced(self.rows, values)
        assert self.patched is not None and self.patched_values is not None  # set with patched_stage
        both = self.patched if self.rows is None else self.rows | self.patched
        joined = cat_rows(values, self.patched_values)
        assert joined is not None
        return Replaced(both, joined)

    def only_changed(self) -> "KVChanges":
        """Without the entering copies' patched rows (for the changed copies' queries, which never
        see another copy's rows)."""
        return KVChanges(self.rows, self.q, self.k, self.v)

    def only_patched(self) -> "KVChanges":
        """Only the entering copies' patched rows (for their queries)."""
        return KVChanges(patched_stage=self.patched_stage, patched=self.patched, patched_values=self.patched_values)


__all__ = ["Changed", "Entry", "KVChanges", "LayerRows", "QueryRows", "Replaced", "RowPatch",
           "cat_rows", "from_first", "until_last"]
