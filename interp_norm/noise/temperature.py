"""Collapse level and sparse-row fraction as a function of attention temperature (scores × c).

Why: a model trained longer sharpens its attention (lower temperature). Theorem 7 says the
*argmax* of a row is temperature-free, but which rows count as sparse (max ≥ 95%) and whether a
flipped row is again ≥ 95% ("strict") do depend on it. Multiplying a layer's clean pre-softmax
scores by c (temperature 1/c) and re-running the collapse protocol on them asks what lower
temperature alone would do to the paper's 1%-collapse level — the mechanism behind our models'
gap to the paper. The machinery is :func:`interp_norm.noise.collapse.layer_decisions` with the
same draws, so c = 1 reproduces :func:`interp_norm.noise.measure_collapse` exactly.

What the sweep can and cannot show — an identity, true by construction (tested): for c > 0 and
any noise factors, argmax_t f_q·f_t·(c·w_t) = argmax_t f_q·f_t·w_t, because multiplying every
entry of a row by the same positive number preserves their order. So for a *fixed* set of rows
and the same draws, the loose collapse decisions are identical at every c, and so is their 1%
level. The max softmax weight of a row is non-decreasing in c (d p_max/dc = p_max·(w_max − E_p[w])
≥ 0), so the rows sparse at c ≥ 1 are the rows sparse at c = 1 plus new ones. A lower pooled
level at larger c therefore says only which rows are counted, never that the same circuits became
more fragile. The table reports both parts: ``same`` rows (sparse at c and at c = 1; at c ≥ 1 these
are exactly the c = 1 rows, whose loose level is the c = 1 level) and ``new`` rows (sparse at c
but not at c = 1), each with its own collapse level.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor
from tqdm.auto import tqdm

from interp_norm import theory
from interp_norm.errors import NoiseSpecError
from interp_norm.core.model import HookedNormTransformer
from interp_norm.noise import _validate as V
from interp_norm.noise.collapse import CollapseSpec, check_inputs, clean_attention, layer_decisions
from interp_norm.core.defaults import DEFAULT_COLLAPSE_LEVELS
from interp_norm.core.task import AdditionTask, Batch

#: Score multipliers c of the default sweep (c > 1: colder, sharper attention).
DEFAULT_MULTIPLIERS = (0.5, 1.0, 2.0, 4.0)


def _check_multipliers(multipliers: Sequence[float] | float) -> tuple[float, ...]:
    values = V.number_tuple(multipliers, "multipliers must be a positive number or a list of them",
                            "no score multipliers given; pass e.g. multipliers=(1, 2, 4)")
    for c in values:
        if isinstance(c, bool) or not isinstance(c, (int, float, np.integer, np.floating)) or not (
            math.isfinite(c) and c > 0
        ):
            raise NoiseSpecError(f"score multiplier {c!r} must be finite and > 0 (c <= 0 would reverse or flatten rows)")
    return tuple(float(c) for c in values)


@torch.no_grad()
def temperature_sweep(
    model: HookedNormTransformer,
    tokens: Int[Tensor, "batch pos"] | Batch,
    multipliers: Sequence[float] = DEFAULT_MULTIPLIERS,
    levels: Sequence[float] = DEFAULT_COLLAPSE_LEVELS,
    spec: Optional[CollapseSpec] = None,
    *,
    rate: float = 0.01,
    variant: Optional[str] = None,
    progress: bool = False,
    **options,
) -> pd.DataFrame:
    """Per score multiplier c and layer (and ``layer == "all"``): the fraction of rows that are
    sparse in softmax(c·w) and the noise levels at which a fraction ``rate`` of those rows
    collapse (loose and strict), measured with the collapse protocol on the scaled clean scores.

    Columns: ``variant``, ``attn_norm``, ``placement``, ``distribution``, ``targets``, ``c``,
    ``layer``, ``n_rows`` (rows that count: query ≥ 1, no padding, chosen heads), ``n_sparse``,
    ``frac_sparse`` = n_sparse / n_rows, ``collapse_level_loose``, ``collapse_level_strict``
    (:func:`theory.noise_level_at_rate` on the measured curve over ``levels``; NaN when the curve
    never reaches ``rate`` or starts above it), then the same split by rows (module docstring):
    ``n_same``, ``n_new``, ``collapse_level_same_loose``, ``collapse_level_same_strict``,
    ``collapse_level_new_loose``, ``collapse_level_new_strict``. w are the model's own pre-softmax scores
    (``hook_attn_scores``: 1/√d_head and any calibration included). ``options`` are
    :class:`CollapseSpec` fields; the draws do not depend on c (common random numbers).
    """
    spec, cfg, levels = check_inputs(model, levels, spec, options)
    multipliers = _check_multipliers(multipliers)
    rate = float(rate)
    if not (math.isfinite(rate) and 0 < rate <= 1):
        raise NoiseSpecError(f"rate must be a fraction in (0, 1], got {rate}")
    clean = clean_attention(model, tokens, spec)
    n_valid = int(clean.valid.sum())
    columns = dict(variant=V.variant_label(cfg, variant), attn_norm=cfg.attn_norm, placement=spec.placement,
                   distribution=spec.distribution, targets="".join(spec.targets))
    # rows sparse at c = 1, as a [b, h, q] grid per layer (the same rows layer_decisions counts at c = 1)
    base = {}
    for l in clean.layers:
        grid = torch.zeros(clean.valid.shape, dtype=torch.bool)
        grid[tuple(clean.sparse_rows(clean.pattern[l], spec.sparse_threshold).unbind(-1))] = True
        base[l] = grid
    out = []
    bar = tqdm(total=len(multipliers) * len(clean.layers), desc="temperature", disable=not progress)
    for c in multipliers:
        per_layer = []  # per layer: {definition: [per-row rates over draws, one [R] tensor per level]}, same-row mask
        for l in clean.layers:
            r = layer_decisions(clean, l, levels, spec, cfg.eps, multiplier=c)
            rates = {d: [dec.double().mean(0) for dec in getattr(r, d)] for d in ("loose", "strict")}
            same = base[l][tuple(r.rows.unbind(-1))] if len(r.rows) else torch.zeros(0, dtype=torch.bool)
            per_layer.append((rates, same))
            out.append(_row(columns, c, l, n_valid, levels, rates, same=same, rate=rate))
            bar.update()
        pooled = {d: [torch.cat([p[0][d][i] for p in per_layer]) for i in range(len(levels))] for d in ("loose", "strict")}
        same = torch.cat([p[1] for p in per_layer])
        out.append(_row(columns, c, "all", n_valid * len(clean.layers), levels, pooled, same=same, rate=rate))
    bar.close()
    df = pd.DataFrame(out)
    df["layer"] = df["layer"].astype(object)
    return df


def _levels(levels, rates: dict, keep: Tensor, rate: float) -> dict:
    """Loose and strict 1% levels of the rows ``keep`` selects (the same arithmetic as
    measure_collapse: per-row rates over draws, then their mean over rows)."""
    n = int(keep.sum())
    curve = {d: [float(v[keep].mean()) if n else math.nan for v in rates[d]] for d in rates}
    return {d: theory.noise_level_at_rate(levels, curve[d], rate) for d in ("loose", "strict")}


def _row(columns: dict, c: float, layer, n_rows: int, levels, rates: dict, *, same: Tensor, rate: float) -> dict:
    n_sparse = len(same)
    every, old, new = (_levels(levels, rates, keep, rate) for keep in (torch.ones_like(same), same, ~same))
    return dict(
        columns, c=c, layer=layer, n_rows=n_rows, n_sparse=n_sparse,
        frac_sparse=n_sparse / n_rows if n_rows else math.nan,
        collapse_level_loose=every["loose"], collapse_level_strict=every["strict"],
        n_same=int(same.sum()), n_new=int((~same).sum()),
        collapse_level_same_loose=old["loose"], collapse_level_same_strict=old["strict"],
        collapse_level_new_loose=new["loose"], collapse_level_new_strict=new["strict"],
    )


def run_temperature_sweep(
    model: HookedNormTransformer,
    task: Optional[AdditionTask] = None,
    multipliers: Sequence[float] = DEFAULT_MULTIPLIERS,
    levels: Sequence[float] = DEFAULT_COLLAPSE_LEVELS,
    spec: Optional[CollapseSpec] = None,
    *,
    split: str = V.TEST_SPLIT,
    n_examples: int = V.TEST_EXAMPLES,
    data_seed: int = V.TEST_SEED,
    **kwargs,
) -> pd.DataFrame:
    """:func:`temperature_sweep` on ``task.test_set(split, n_examples, seed=data_seed)`` (the same
    keywords and defaults, so the same problems, as :func:`interp_norm.noise.run_collapse`), with a
    ``split`` column. ``task`` defaults to the model's own (``model.task``)."""
    return V.on_test_set(temperature_sweep, model, task, multipliers, levels, spec, split=split, n_examples=n_examples,
                         data_seed=data_seed, who="run_temperature_sweep", **kwargs)


__all__ = ["DEFAULT_MULTIPLIERS", "temperature_sweep", "run_temperature_sweep"]
