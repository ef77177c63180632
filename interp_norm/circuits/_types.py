"""Types and small helpers every circuits module shares: the patching result, cell axes, metrics.

Private to the package: the modules import from here instead of from each other, so each of them
(patching, engine, attribution, edges, graph, attention maps) depends only on this file, on
:mod:`~interp_norm.circuits.pairs` and on the core layer (model, hooks, errors).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import pandas as pd
import torch
from torch import Tensor

from interp_norm.errors import PatchingError, check_positive_int
from interp_norm.core.hook_names import PATCHABLE

#: A metric maps logits ``[batch, pos, vocab]`` to per-example values ``[batch]`` (or a scalar).
MetricFn = Callable[[Tensor], Tensor]

#: (cell kind, ``by``) -> axis names of the cells, in TransformerLens's order.
AXES: dict[tuple[str, str], tuple[str, ...]] = {
    ("resid", "pos"): ("layer", "pos"),
    ("resid", "all"): ("layer",),
    ("head", "pos"): ("layer", "pos", "head"),
    ("head", "all"): ("layer", "head"),
    ("pattern", "pos"): ("layer", "head", "dest_pos"),
    ("pattern", "all"): ("layer", "head"),
    ("pattern", "dest_src"): ("layer", "head", "dest_pos", "src_pos"),
}


# ----------------------------------------------------------------------------- result


@dataclass
class PatchResult:
    """Patching (or attribution) results over a grid of cells, with per-example values.

    ``values`` has TransformerLens's shape for the sweep (e.g. ``[n_layers, pos, n_heads]`` for
    ``z`` by position) or one entry per row of ``index_df`` when explicit cells were given; it is
    the batch mean of the patched metric. ``baseline``/``clean`` are the unpatched corrupted and
    clean metric per example. For attribution results ``values`` is ``baseline.mean()`` plus the
    estimated effect, so :meth:`effect` compares directly with exact patching.
    """

    activation: str
    by: str
    axis_names: list[str]
    values: Tensor
    index_df: pd.DataFrame
    per_example: Optional[Tensor] = None  # [n_cells, batch]
    baseline: Optional[Tensor] = None
    clean: Optional[Tensor] = None
    metric_name: str = "metric"
    method: str = "exact"
    flat: bool = False
    #: Block rows (example x position x layer) the incremental engine computed: the corrupted run's
    #: plus every recomputed row. A forward pass computes ``batch * pos * n_layers``; the ratio says
    #: how much arithmetic a sweep costs in forward passes (None for the hooks method).
    rows_computed: Optional[int] = None

    def effect(self) -> Tensor:
        """Patched minus unpatched corrupted metric: what the patch changes."""
        if self.baseline is None:
            raise PatchingError("this result has no corrupted baseline")
        return self.values - self.baseline.mean()

    def normalized(self) -> Tensor:
        """(patched - corrupted) / (clean - corrupted) on batch means: 0 = no effect, 1 = fully restored."""
        if self.baseline is None or self.clean is None:
            raise PatchingError("normalized() needs clean and corrupted baselines; patch with pairs or clean_tokens")
        return (self.values - self.baseline.mean()) / (self.clean.mean() - self.baseline.mean())

    def to_dataframe(self) -> pd.DataFrame:
        """One row per cell: the axis indices, ``value``, ``effect`` and ``normalized`` where known."""
        df = self.index_df.copy()
        df.insert(0, "activation", self.activation)
        df["value"] = self.values.detach().reshape(-1).cpu().numpy()
        if self.baseline is not None:
            df["effect"] = self.effect().detach().reshape(-1).cpu().numpy()
        if self.baseline is not None and self.clean is not None:
            df["normalized"] = self.normalized().detach().reshape(-1).cpu().numpy()
        df["metric"] = self.metric_name
        df["method"] = self.method
        return df


# ----------------------------------------------------------------------------- activations and cells


def cell_kind(activation: str) -> str:
    """``resid``, ``head`` or ``pattern``: the axes of ``activation``'s cells (raises for unknown names)."""
    if activation not in PATCHABLE:
        raise PatchingError(f"unknown activation {activation!r}; choose one of {list(PATCHABLE)}")
    return PATCHABLE[activation]


def check_by(activation: str, by: str) -> tuple[str, ...]:
    """The axis names of ``activation`` patched ``by`` (pos/all/dest_src), or a PatchingError."""
    kind = cell_kind(activation)
    if (kind, by) not in AXES:
        ok = sorted(b for (k, b) in AXES if k == kind)
        raise PatchingError(f"by={by!r} is not available for {activation!r}; choose one of {ok}")
    return AXES[(kind, by)]


def grid_cells(axes: Sequence[str], sizes: dict[str, int]) -> Tensor:
    """Every cell of the grid, ``[n_cells, len(axes)]``, in row-major (TransformerLens's) order."""
    ranges = [range(sizes[a]) for a in axes]
    return torch.tensor(list(itertools.product(*ranges)), dtype=torch.long).reshape(-1, len(axes))


# ----------------------------------------------------------------------------- models


def device(model) -> torch.device:
    """The device of the model's parameters (the configured device for a parameterless model)."""
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device(getattr(getattr(model, "cfg", None), "device", None) or "cpu")


def require_eval(model) -> None:
    """Patching stacks many copies of a batch; dropout would make each copy differ."""
    if any(m.training for m in model.modules()):
        raise PatchingError("the model is in training mode; call model.eval() before patching (dropout etc. would vary per copy)")


# ----------------------------------------------------------------------------- metrics


def metric_per_copy(metric: MetricFn, logits: Tensor, K: int, b: int) -> Tensor:
    """The metric of ``K`` stacked copies of a batch of ``b``: ``[K, b]``, or ``[K]`` for a scalar metric."""
    if getattr(metric, "supports_stacked", False):
        out = metric(logits)
        if out.shape != (K * b,):
            raise PatchingError(f"metric returned shape {tuple(out.shape)} for {K} stacked copies of {b} examples")
        return out.view(K, b)
    outs = [torch.as_tensor(metric(logits[i * b : (i + 1) * b])) for i in range(K)]
    if all(o.ndim == 0 for o in outs):
        return torch.stack(outs)
    if any(o.shape != (b,) for o in outs):
        raise PatchingError(
            f"a metric must map logits [batch, pos, vocab] to per-example values [batch] (or a scalar); got shape "
            f"{tuple(outs[0].shape)} for batch {b}"
        )
    return torch.stack(outs)


def metric_values(metric: MetricFn, logits: Tensor, b: int) -> Tensor:
    """Per-example metric of stacked copies, flat ``[R*b]`` and differentiable (attribution needs both)."""
    R = logits.shape[0] // b
    if getattr(metric, "supports_stacked", False):
        return metric(logits)
    outs = [metric(logits[i * b : (i + 1) * b]) for i in range(R)]
    if outs[0].ndim == 0:
        raise PatchingError(
            "attribution needs a per-example metric (logits -> [batch]); a scalar metric cannot be "
            "split across the stacked integration steps"
        )
    return torch.cat(outs)


def metric_name(metric: MetricFn) -> str:
    return getattr(metric, "name", getattr(metric, "__name__", "metric"))


def ig_alphas(ig_steps: int) -> Tensor:
    """EAP-IG's points on the corrupted -> clean line: ``k / m`` for ``k = 0..m-1`` (``m = 1``: EAP)."""
    check_positive_int(ig_steps, "ig_steps", PatchingError, hint="1 = EAP")
    return torch.arange(ig_steps, dtype=torch.float64) / ig_steps


__all__ = [
    "MetricFn", "AXES", "PatchResult", "cell_kind", "check_by", "grid_cells", "device", "require_eval",
    "metric_per_copy", "metric_values", "metric_name", "ig_alphas",
]
