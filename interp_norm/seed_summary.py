"""The headline numbers of a report, one row per checkpoint, and their spread over seeds.

A claim about "Pre-Norm" from one trained model is a claim about one seed. :func:`per_checkpoint`
reads the few numbers the paper's argument rests on from a report's tables (accuracy per split,
the cost of 1% norm noise, the 1% collapse level in both protocols, the fraction of sparse rows),
and :func:`seed_spread` groups checkpoints of the same variant and scaling: mean, half the range,
and the values themselves, so the dashboard and the README show the spread beside every number.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import pandas as pd

#: (quantity, unit) in the order tables show them.
QUANTITIES = (
    ("ID accuracy", "%"), ("interpolation accuracy", "%"), ("extrapolation accuracy", "%"),
    ("accuracy lost to 1% noise (all rows, before any norm)", "points"),
    ("accuracy lost to 1% noise placed after the norm", "points"),
    ("1% loose collapse level, per-layer protocol", "% noise"),
    ("1% loose collapse level, real forward pass", "% noise"),
    ("sparse attention rows (max ≥ 95%), all layers", "%"),
)


def _threshold(T: Mapping[str, pd.DataFrame], key: str, label: str, after: bool) -> float:
    df = T.get(key)
    if df is None or not len(df):
        return np.nan
    want = f"{label}, noise after norm" if after else label
    d = df[(df["variant"] == want) & (df["layer"].astype(str) == "all") & (df["definition"] == "loose")]
    return float(d["level_measured"].iloc[0]) * 100 if len(d) else np.nan


def _noise_cost(T: Mapping[str, pd.DataFrame], name: str, placement: str) -> float:
    df = T.get("noise_accuracy")
    if df is None or not len(df):
        return np.nan
    d = df[(df["checkpoint"] == name) & (df["noised"] == "all") & (df["placement"] == placement)
           & (df["split"] == "id")]
    clean, noisy = d[d["level"] == 0]["accuracy"], d[np.isclose(d["level"], 0.01)]["accuracy"]
    if not len(clean) or not len(noisy):
        return np.nan
    return float(clean.iloc[0] - noisy.iloc[0]) * 100


def per_checkpoint(tables: Mapping[str, pd.DataFrame], checkpoints: pd.DataFrame) -> pd.DataFrame:
    """One row per (checkpoint, quantity): ``value`` (NaN where the level was never reached or the
    analysis did not run). Checkpoints marked ``analysed == False`` (evaluated only) get their
    accuracies and nothing else."""
    rows = []
    ev = tables.get("evaluation", pd.DataFrame())
    sparse = tables.get("geometry_sparsity_summary", pd.DataFrame())
    for ck in checkpoints.itertuples():
        name, label = ck.checkpoint, ck.label
        acc = {r.split: r.per_token_acc * 100 for r in ev[ev["checkpoint"] == name].itertuples()} if len(ev) else {}
        frac = np.nan
        if len(sparse):
            s = sparse[(sparse["checkpoint"] == name) & sparse["layer"].isna()]
            frac = float(s["frac_sparse"].iloc[0]) * 100 if len(s) else np.nan
        values = (acc.get("id", np.nan), acc.get("interp", np.nan), acc.get("extrap", np.nan),
                  _noise_cost(tables, name, "before_norm"), _noise_cost(tables, name, "after_norm"),
                  _threshold(tables, "collapse_thresholds", label, ck.attn_norm in ("qk", "qkv")),
                  _threshold(tables, "forward_collapse_thresholds", label, ck.attn_norm in ("qk", "qkv")), frac)
        analysed = bool(getattr(ck, "analysed", True))
        for (quantity, unit), value in zip(QUANTITIES, values):
            if not analysed and not quantity.endswith("accuracy"):
                continue  # evaluated only: no noise, collapse or geometry numbers to report
            rows.append(dict(checkpoint=name, attn_norm=ck.attn_norm, calibration=getattr(ck, "calibration", "none"),
                             seed=ck.seed, quantity=quantity, unit=unit, value=value))
    return pd.DataFrame(rows)


def seed_spread(per_ckpt: pd.DataFrame) -> pd.DataFrame:
    """Group :func:`per_checkpoint` over seeds: one row per (variant, scaling, quantity) with
    ``mean``, ``half_range`` (0 for one seed), ``n_seeds``, ``n_missing`` and ``values``."""
    rows = []
    order = {q: i for i, (q, _) in enumerate(QUANTITIES)}
    for (a, cal, q), g in per_ckpt.groupby(["attn_norm", "calibration", "quantity"], sort=False):
        v = g["value"].dropna()
        if q.startswith("accuracy lost to 1% noise placed after") and not len(v):
            continue  # no q/k norm to place noise after
        rows.append(dict(attn_norm=a, calibration=cal, quantity=q, unit=g["unit"].iloc[0],
                         mean=float(v.mean()) if len(v) else np.nan,
                         half_range=float((v.max() - v.min()) / 2) if len(v) else np.nan,
                         n_seeds=int(len(g)), n_missing=int(g["value"].isna().sum()),
                         values=", ".join("—" if pd.isna(x) else f"{x:.1f}" for x in g["value"]),
                         order=order[q]))
    out = pd.DataFrame(rows)
    if not len(out):
        return out
    rank = {"pre": 0, "qkv": 1, "qk": 2, "none": 3}
    out["_r"] = out["attn_norm"].map(rank).fillna(9)
    return out.sort_values(["calibration", "_r", "order"]).drop(columns=["_r", "order"]).reset_index(drop=True)


__all__ = ["QUANTITIES", "per_checkpoint", "seed_spread"]
