"""Whose collapse level is it? The 1% collapse level per head, each head's share of the sparse rows,
and the effective number of heads behind a pooled level.

The paper's 1% collapse level (Menary et al. 2024, §4: "1% of sparse distributions collapse at
noise ≈ 11%") pools every sparse row of every layer and head. The pooled collapse rate is the
share-weighted mean of the heads' rates, Σ_h s_h·r_h(level) with s_h the fraction of the sparse
rows that head h holds, so when one head holds most rows the pooled level is essentially that
head's. :func:`head_collapse_table` reports, per (layer, head): the number of sparse rows, the
share s_h (of all rows pooled over layers, and of its layer's rows), and the head's own 1% level
(loose and strict, the per-layer protocol of :func:`~interp_norm.noise.collapse_decisions`, the
same draws). :func:`effective_heads` summarises the shares by the inverse Simpson index
1/Σ s_h² (Hill number of order 2): n for n heads with equal shares, 1 when one head holds every
row — how many heads a pooled level actually rests on. :func:`beside_thresholds` puts it beside
each pooled level of :func:`~interp_norm.noise.collapse_thresholds`.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor

from interp_norm import theory
from interp_norm.errors import ConfigError, NoiseSpecError
from interp_norm.core.model import HookedNormTransformer, ModelConfig
from interp_norm.noise import _validate as V
from interp_norm.noise.collapse import CollapseSpec, LayerCollapse, check_inputs, clean_attention, collapse_decisions, layer_decisions, run_collapse
from interp_norm.core.defaults import DEFAULT_COLLAPSE_LEVELS
from interp_norm.core.task import AdditionTask, Batch


def effective_heads(shares) -> float:
    """Inverse Simpson index 1/Σ s² of shares (normalised to sum 1 first): 2 for two equal
    shares, 1 for one head holding everything; NaN when there is nothing to share (all zero)."""
    s = np.asarray(shares, dtype=np.float64).ravel()
    if s.size and (not np.isfinite(s).all() or (s < 0).any()):
        raise NoiseSpecError(f"shares must be finite and >= 0, got {s.tolist()}")
    total = s.sum()
    if not s.size or total <= 0:
        return math.nan
    s = s / total
    return float(1.0 / np.square(s).sum())


def head_collapse_table(
    results: Sequence[LayerCollapse], cfg: ModelConfig, spec: CollapseSpec, *, rate: float = 0.01,
    variant: Optional[str] = None,
) -> pd.DataFrame:
    """Per (layer, head): ``n_sparse``, ``share`` (of the sparse rows of every layer), ``share_in_layer``
    and the head's ``collapse_level_loose`` / ``collapse_level_strict`` (the noise level where a
    fraction ``rate`` of its rows collapse, :func:`theory.noise_level_at_rate` on its measured
    curve; NaN for a head without sparse rows or whose curve never reaches ``rate``), from the
    per-layer decisions ``results`` (:func:`~interp_norm.noise.collapse_decisions`)."""
    rate = _check_rate(rate)
    if not results:
        raise ConfigError("no per-layer collapse decisions given; pass collapse_decisions(model, tokens, ...)")
    levels = results[0].levels
    total = sum(len(r.rows) for r in results)
    columns = dict(variant=V.variant_label(cfg, variant), attn_norm=cfg.attn_norm, placement=spec.placement,
                   distribution=spec.distribution, targets="".join(spec.targets))
    out = []
    for r in results:
        heads = r.rows[:, 1] if len(r.rows) else torch.zeros(0, dtype=torch.long)
        for h in range(cfg.n_heads):
            mine = heads == h
            n = int(mine.sum())
            level = {}
            for d in ("loose", "strict"):
                dec = getattr(r, d)[:, :, mine]  # [level, draw, rows of this head]
                curve = dec.double().mean((1, 2)).tolist() if n else [math.nan] * len(levels)
                level[d] = theory.noise_level_at_rate(levels, curve, rate)
            out.append(dict(columns, layer=r.layer, head=h, n_sparse=n,
                            share=n / total if total else math.nan,
                            share_in_layer=n / len(r.rows) if len(r.rows) else math.nan,
                            collapse_level_loose=level["loose"], collapse_level_strict=level["strict"], rate=rate))
    return pd.DataFrame(out)


def head_summary(heads: pd.DataFrame) -> pd.DataFrame:
    """Per layer and pooled (``layer == "all"``), from :func:`head_collapse_table`: ``n_sparse``,
    ``effective_heads`` (:func:`effective_heads` of the heads' shares within that layer, or of all
    (layer, head) shares for ``"all"``), ``top_layer``/``top_head`` and ``top_share`` (the head
    holding most of those rows and its share). Grouped by the table's leading columns."""
    need = {"layer", "head", "n_sparse"}
    if not isinstance(heads, pd.DataFrame) or not need <= set(heads.columns):
        raise ConfigError(f"heads must be a DataFrame from head_collapse_table with columns {sorted(need)}")
    keys = [c for c in ("checkpoint", "variant", "attn_norm", "placement", "distribution", "targets", "split")
            if c in heads.columns]
    out = []
    for key, g in heads.groupby(keys, sort=False) if keys else [((), heads)]:
        key = key if isinstance(key, tuple) else (key,)
        parts = [(l, g[g["layer"] == l]) for l in g["layer"].drop_duplicates()] + [("all", g)]
        for layer, part in parts:
            n = part["n_sparse"].to_numpy(dtype=float)
            top = part.iloc[int(n.argmax())] if n.sum() > 0 else None
            out.append(dict(zip(keys, key), layer=layer, n_sparse=int(n.sum()), effective_heads=effective_heads(n),
                            top_layer=int(top["layer"]) if top is not None else -1,
                            top_head=int(top["head"]) if top is not None else -1,
                            top_share=float(n.max() / n.sum()) if n.sum() > 0 else math.nan))
    df = pd.DataFrame(out)
    df["layer"] = df["layer"].astype(object)
    return df


def beside_thresholds(thresholds: pd.DataFrame, heads: pd.DataFrame) -> pd.DataFrame:
    """:func:`~interp_norm.noise.collapse_thresholds` with :func:`head_summary`'s ``n_sparse``,
    ``effective_heads``, ``top_layer``, ``top_head``, ``top_share`` beside every level (per layer
    and pooled), joined on the columns both tables share."""
    summary = head_summary(heads)
    on = [c for c in ("checkpoint", "variant", "attn_norm", "placement", "distribution", "targets", "split", "layer")
          if c in thresholds.columns and c in summary.columns]
    left = thresholds.assign(layer=thresholds["layer"].astype(str))
    right = summary.assign(layer=summary["layer"].astype(str))
    out = left.merge(right, on=on, how="left")
    out["layer"] = [int(x) if x.isdigit() else x for x in out["layer"]]
    out["layer"] = out["layer"].astype(object)
    return out


def _check_rate(rate: float) -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (math.isfinite(rate) and 0 < rate <= 1):
        raise NoiseSpecError(f"rate must be a fraction in (0, 1], got {rate!r}")
    return float(rate)


@torch.no_grad()
def measure_head_collapse(
    model: HookedNormTransformer,
    tokens: Int[Tensor, "batch pos"] | Batch,
    levels: Sequence[float] = DEFAULT_COLLAPSE_LEVELS,
    spec: Optional[CollapseSpec] = None,
    *,
    rate: float = 0.01,
    variant: Optional[str] = None,
    **options,
) -> pd.DataFrame:
    """:func:`head_collapse_table` of the per-layer collapse protocol on ``tokens`` (the same rows
    and draws as :func:`~interp_norm.noise.measure_collapse` with the same ``spec``)."""
    spec, cfg, levels = check_inputs(model, levels, spec, options)
    clean = clean_attention(model, tokens, spec)
    results = [layer_decisions(clean, l, levels, spec, cfg.eps) for l in clean.layers]
    return head_collapse_table(results, cfg, spec, rate=rate, variant=variant)


def run_head_collapse(
    model: HookedNormTransformer,
    task: Optional[AdditionTask] = None,
    levels: Sequence[float] = DEFAULT_COLLAPSE_LEVELS,
    spec: Optional[CollapseSpec] = None,
    *,
    split: str = V.TEST_SPLIT,
    n_examples: int = V.TEST_EXAMPLES,
    data_seed: int = V.TEST_SEED,
    **kwargs,
) -> pd.DataFrame:
    """:func:`measure_head_collapse` on the test set of :func:`~interp_norm.noise.run_collapse`
    (the same keywords and defaults, so the same problems), with a ``split`` column. ``task``
    defaults to the model's own (``model.task``)."""
    return V.on_test_set(measure_head_collapse, model, task, levels, spec, split=split, n_examples=n_examples,
                         data_seed=data_seed, who="run_head_collapse", **kwargs)




def run_collapse_with_heads(
    model: HookedNormTransformer,
    task: Optional[AdditionTask] = None,
    levels: Sequence[float] = DEFAULT_COLLAPSE_LEVELS,
    spec: Optional[CollapseSpec] = None,
    *,
    rate: float = 0.01,
    **kwargs,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(run_collapse(...), its per-head table)`` from one set of decisions: the per-head table of
    exactly the rows and draws behind the pooled curves, at no extra cost. Keywords as
    :func:`~interp_norm.noise.run_collapse` (``variant`` labels both tables)."""
    fields = {f for f in CollapseSpec.__dataclass_fields__}
    spec = CollapseSpec.make(spec, **{k: v for k, v in kwargs.items() if k in fields})
    rest = {k: v for k, v in kwargs.items() if k not in fields}
    kept: list = []

    def decisions(*args, **kw):
        kept[:] = collapse_decisions(*args, **kw)
        return kept

    curves = run_collapse(model, task, levels, spec, decisions=decisions, **rest)
    heads = head_collapse_table(kept, model.cfg, spec, rate=rate, variant=rest.get("variant"))
    heads.insert(5, "split", rest.get("split", V.TEST_SPLIT))
    return curves, heads


__all__ = ["effective_heads", "head_collapse_table", "head_summary", "beside_thresholds", "measure_head_collapse",
           "run_head_collapse", "run_collapse_with_heads"]
