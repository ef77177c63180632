"""The headline numbers of a report, one row per checkpoint, and their spread over seeds.

A claim about "Pre-Norm" from one trained model is a claim about one seed. :func:`per_checkpoint`
reads the few numbers the paper's argument rests on from a report's tables (accuracy per split,
the cost of 1% norm noise, the 1% collapse level in both protocols, the fraction of sparse rows and
of rows with max attention ≥ 0.99, pooled and per layer, and the norm spread per layer),
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
    ("rows with max attention ≥ 0.99, all layers", "%"),
)
#: Per-layer quantities (``{layer}`` filled in), after :data:`QUANTITIES`. The norm spread is the
#: median over a layer's heads of each head's ±s holding 90% of the attention-weighted input norms
#: around its median (``geometry_norm_spread.csv``; the paper: ±20% for Pre-Norm).
PER_LAYER = (
    ("sparse attention rows (max ≥ 95%), layer {layer}", "%"),
    ("rows with max attention ≥ 0.99, layer {layer}", "%"),
    ("norm spread (90% of attended norms within ±), layer {layer}", "%"),
)

#: The controls (``reproduce --controls``), per seed: the 1% noise cost split by where the noise goes
#: (``noise_decomposition.csv``, noise before any norm), and the cost of a collapse
#: (``collapse_consequence.csv``: noise on sparse rows only, problems with at least one collapsed
#: sparse row vs problems with none, and their difference).
DECOMPOSITION = (("q", "q only"), ("k", "k only"), ("v", "v only"), ("qkv", "q, k and v"),
                 ("random", "q, k and v in a random direction of equal size"),
                 ("shared", "q, k and v with one κ per token shared across heads"))
CONTROLS = (
    *((f"accuracy lost to 1% noise on {text} (decomposition)", "points") for _, text in DECOMPOSITION),
    ("accuracy lost by problems with a collapsed sparse row (consequence)", "points"),
    ("accuracy lost by problems with no collapsed sparse row (consequence)", "points"),
    ("collapsed minus not collapsed (consequence)", "points"),
)


def quantity_order(quantity: str) -> tuple[int, int, int]:
    """Sort key of a quantity: :data:`QUANTITIES` in order, then the per-layer ones by kind and layer."""
    for i, (q, _) in enumerate(QUANTITIES):
        if q == quantity:
            return (0, i, 0)
    for i, (q, _) in enumerate(PER_LAYER):
        head = q.split("{layer}")[0]
        if quantity.startswith(head) and quantity[len(head):].isdigit():
            return (1, i, int(quantity[len(head):]))
    for i, (q, _) in enumerate(CONTROLS):
        if q == quantity:
            return (2, i, 0)
    return (3, 0, 0)


def _per_layer(T: Mapping[str, pd.DataFrame], name: str) -> list[tuple[str, str, float]]:
    """``(quantity, unit, value)`` of :data:`PER_LAYER` for one checkpoint (the layers its geometry tables hold)."""
    out: dict[str, float] = {}
    ss = T.get("geometry_sparsity_summary")
    if ss is not None and len(ss):
        d = ss[(ss["checkpoint"] == name) & ss["layer"].notna()]
        for r in d.itertuples():
            out[PER_LAYER[0][0].format(layer=int(r.layer))] = float(r.frac_sparse) * 100
            if hasattr(r, "frac_very_sparse"):
                out[PER_LAYER[1][0].format(layer=int(r.layer))] = float(r.frac_very_sparse) * 100
    ns = T.get("geometry_norm_spread")
    if ns is not None and len(ns):
        d = ns[(ns["checkpoint"] == name) & ns["head"].notna()]
        for layer, g in d.groupby("layer", sort=True):
            out[PER_LAYER[2][0].format(layer=int(layer))] = float(g["spread"].median()) * 100
    unit = {q: PER_LAYER[quantity_order(q)[1]][1] for q in out}
    return [(q, unit[q], out[q]) for q in sorted(out, key=quantity_order)]


def _controls(T: Mapping[str, pd.DataFrame], name: str) -> list[tuple[str, str, float]]:
    """``(quantity, unit, value)`` of :data:`CONTROLS` for one checkpoint (those its report has)."""
    out = []
    dec = T.get("noise_decomposition")
    if dec is not None and len(dec):
        d = dec[(dec["checkpoint"] == name) & np.isclose(dec["level"], 0.01) & (dec["placement"] == "before_norm")]
        for (mode, _), (q, unit) in zip(DECOMPOSITION, CONTROLS):
            m = d[d["mode"] == mode]
            if len(m):
                out.append((q, unit, float(m["drop"].iloc[0])))
    con = T.get("collapse_consequence")
    if con is not None and len(con):
        d = con[con["checkpoint"] == name]
        for group, (q, unit) in zip(("collapsed", "none", "difference"), CONTROLS[len(DECOMPOSITION):]):
            g = d[d["group"] == group]
            if len(g):
                out.append((q, unit, float(g["drop"].iloc[0])))
    return out


def _threshold(T: Mapping[str, pd.DataFrame], key: str, label: str, after: bool, name: str) -> tuple[float, float]:
    """``(level, censored_above)`` in % noise: the pooled loose 1% collapse level, and where the sweep
    never reached 1% (a thresholds row with no level, over at least one sparse row) the largest noise
    level it tested, so that the seed is *right-censored* there rather than missing (NaN otherwise; a
    model without sparse rows has no collapse level: missing, not censored)."""
    df = T.get(key)
    if df is None or not len(df):
        return np.nan, np.nan
    want = f"{label}, noise after norm" if after else label
    d = df[(df["variant"] == want) & (df["layer"].astype(str) == "all") & (df["definition"] == "loose")]
    if not len(d):
        return np.nan, np.nan
    level = float(d["level_measured"].iloc[0]) * 100
    sweep = T.get(key.replace("_thresholds", ""))
    if not np.isnan(level) or sweep is None or not len(sweep):
        return level, np.nan
    own = sweep[sweep["checkpoint"] == name] if "checkpoint" in sweep.columns else sweep
    own = own if len(own) else sweep
    if "n_rows" in own.columns and not own["n_rows"].max() > 0:
        return level, np.nan  # no sparse row at all: the level is undefined (missing), not beyond the sweep
    return level, float(own["level"].max()) * 100


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
    analysis did not run) and ``censored_above`` (for a collapse level never reached: the largest
    noise level tested, in %; NaN otherwise). Checkpoints marked ``analysed == False`` (evaluated only) get their
    accuracies and nothing else."""
    rows = []
    ev = tables.get("evaluation", pd.DataFrame())
    sparse = tables.get("geometry_sparsity_summary", pd.DataFrame())
    for ck in checkpoints.itertuples():
        name, label = ck.checkpoint, ck.label
        acc = {r.split: r.per_token_acc * 100 for r in ev[ev["checkpoint"] == name].itertuples()} if len(ev) else {}
        frac = very = np.nan
        if len(sparse):
            s = sparse[(sparse["checkpoint"] == name) & sparse["layer"].isna()]
            frac = float(s["frac_sparse"].iloc[0]) * 100 if len(s) else np.nan
            if len(s) and "frac_very_sparse" in s.columns:
                very = float(s["frac_very_sparse"].iloc[0]) * 100
        after = ck.attn_norm in ("qk", "qkv")
        (per_layer, per_layer_bound), (forward, forward_bound) = (
            _threshold(tables, key, label, after, name) for key in ("collapse_thresholds", "forward_collapse_thresholds"))
        values = (acc.get("id", np.nan), acc.get("interp", np.nan), acc.get("extrap", np.nan),
                  _noise_cost(tables, name, "before_norm"), _noise_cost(tables, name, "after_norm"),
                  per_layer, forward, frac, very)
        bounds = {QUANTITIES[5][0]: per_layer_bound, QUANTITIES[6][0]: forward_bound}
        analysed = bool(getattr(ck, "analysed", True))
        layered = [*_per_layer(tables, name), *_controls(tables, name)] if analysed else []
        for quantity, unit, value in [*((q, u, v) for (q, u), v in zip(QUANTITIES, values)), *layered]:
            if not analysed and not quantity.endswith("accuracy"):
                continue  # evaluated only: no noise, collapse or geometry numbers to report
            rows.append(dict(checkpoint=name, attn_norm=ck.attn_norm, calibration=getattr(ck, "calibration", "none"),
                             seed=ck.seed, quantity=quantity, unit=unit, value=value,
                             censored_above=bounds.get(quantity, np.nan)))
    return pd.DataFrame(rows)


def seed_spread(per_ckpt: pd.DataFrame) -> pd.DataFrame:
    """Group :func:`per_checkpoint` over seeds: one row per (variant, scaling, quantity) with
    ``mean``, ``half_range`` (0 for one seed), ``n_seeds``, ``n_missing`` and ``values``."""
    rows = []
    for (a, cal, q), g in per_ckpt.groupby(["attn_norm", "calibration", "quantity"], sort=False):
        v = g["value"].dropna()
        if q.startswith("accuracy lost to 1% noise placed after") and not len(v):
            continue  # no q/k norm to place noise after
        rows.append(dict(attn_norm=a, calibration=cal, quantity=q, unit=g["unit"].iloc[0],
                         mean=float(v.mean()) if len(v) else np.nan,
                         half_range=float((v.max() - v.min()) / 2) if len(v) else np.nan,
                         n_seeds=int(len(g)), n_missing=int(g["value"].isna().sum()),
                         values=", ".join("—" if pd.isna(x) else f"{x:.1f}" for x in g["value"]),
                         order=quantity_order(q)))
    out = pd.DataFrame(rows)
    if not len(out):
        return out
    rank = {"pre": 0, "qkv": 1, "qk": 2, "none": 3}
    out["_r"] = out["attn_norm"].map(rank).fillna(9)
    return out.sort_values(["calibration", "_r", "order"]).drop(columns=["_r", "order"]).reset_index(drop=True)


__all__ = ["QUANTITIES", "PER_LAYER", "CONTROLS", "quantity_order", "per_checkpoint", "seed_spread"]
