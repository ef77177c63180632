"""Variant A vs variant B over seeds: per-seed values, bootstrap intervals and a permutation p-value.

Every comparison the findings make between Pre-Norm and QKV-Norm (Menary et al. 2024, §4: OOD
accuracy, the cost of norm noise, the 1% collapse level, attention sparsity, the norm spread) is
made here from one row per trained seed, for each score scaling apart: 1/√d_head (``pre``,
``pre-s1``, ... vs ``qkv``, ``qkv-s1``, ...) and the paper's Checkpoint calibration (``pre-cal``...
vs ``qkv-cal``...). :func:`compare_seeds` reads :func:`interp_norm.stats.seed_summary.per_checkpoint`;
:func:`matched_id_comparison` reads the training curves (ID / interp / extrap accuracy every
1 000 steps) and compares OOD accuracy **at matched ID accuracy**, beside the end of training.

Statistics (:mod:`interp_norm.stats.inference`): per arm the mean and a Student-t 95% interval over
seeds (a percentile bootstrap undercovers with 6 seeds); the difference A − B with its Welch-t
interval; a two-sided exact permutation p-value, per comparison (the verdicts in
:mod:`interp_norm.stats.verdicts` use one-sided and equivalence tests and adjust over their declared family). A collapse level never reached within the tested noise levels is *right-censored*, not
missing: it is kept at the largest level tested and the test runs on ranks (:func:`compare_arms`).
A value missing for another reason (an analysis that did not run) is left out and counted
(``n_missing_a``/``n_missing_b``); the note says so.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import pandas as pd

from interp_norm.stats.seed_summary import CONTROLS, DECOMPOSITION, QUANTITIES, quantity_order
from interp_norm.stats.inference import permutation_test, t_interval, welch_interval

__all__ = ["PAIRS", "NOISE_CROSS", "DEFAULT_SEEDS", "SEED_ANALYSES", "seed_pass_settings", "seed_tables", "compare_seeds",
           "compare_arms", "matched_id_comparison"]

#: The shipped set's seeds a default run reads (0 and 1); ``all_seeds=True`` reads every seed.
DEFAULT_SEEDS = 2
#: The analyses the seed tables need: ``all_seeds`` runs them on checkpoints the heavy analyses skip.
SEED_ANALYSES = ("evaluate", "noise", "collapse", "forward_collapse", "geometry")
#: With ``--controls`` the seed pass runs these too (their per-seed numbers: ``seed_summary.CONTROLS``).
SEED_CONTROLS = ("noise_decomposition", "collapse_consequence")


def seed_pass_settings(settings: Any) -> Any:
    """``settings`` for the seed tables' pass: the noise sweep cut to the levels 0 and 1% on all rows
    (the seed tables use the cost of 1% noise only); every other size unchanged. The noise draws do
    not depend on which levels or row groups are swept, so the 1% cost is the one the full sweep gives."""
    levels = tuple(l for l in settings.noise_levels if l in (0.0, 0.01))
    return settings.replace(noise_levels=levels if len(levels) == 2 else settings.noise_levels,
                            noise_rows=("all",), noise_matched=False,
                            analyses=tuple(a for a in settings.analyses if a in SEED_ANALYSES + SEED_CONTROLS))


def seed_tables(T: Mapping[str, pd.DataFrame], checkpoints: pd.DataFrame, seed: int = 0) -> dict[str, pd.DataFrame]:
    """The report's seed tables from its ``seed_numbers`` and ``training_curves`` tables:
    ``seed_comparisons``, ``seed_comparison_values``, ``seed_matched_id``, ``seed_matched_id_values``."""
    out: dict[str, pd.DataFrame] = {}
    out["seed_comparisons"], out["seed_comparison_values"] = compare_seeds(T.get("seed_numbers"), seed=seed)
    out["seed_matched_id"], out["seed_matched_id_values"] = matched_id_comparison(T.get("training_curves"), checkpoints,
                                                                                seed=seed)
    return out


#: (scaling, calibration, arm A (label, attn_norm), arm B): the variants the findings compare.
PAIRS = (
    ("1/√d_head", "none", ("Pre-Norm", "pre"), ("QKV-Norm", "qkv")),
    ("Checkpoint calibration", "paper", ("Pre-cal", "pre"), ("QKV-cal", "qkv")),
)
_BEFORE, _AFTER = QUANTITIES[3][0], QUANTITIES[4][0]
#: The noise comparison across placements: Pre-Norm's noise before its (only) norm against QKV-Norm's
#: noise placed after its per-head norm (before it, the norm removes the noise by construction).
NOISE_CROSS = ("accuracy lost to 1% noise: A before its norm vs B after its norm", _BEFORE, _AFTER)
#: Noise before the norm that a QKV-Norm model's per-head norms remove exactly (all but "random",
#: whose change of direction a norm keeps).
_REMOVED = {_BEFORE, *(q for (mode, _), (q, _) in zip(DECOMPOSITION, CONTROLS) if mode != "random")}


def compare_arms(a: Sequence[float], b: Sequence[float], *, seed: int = 0,
                 censored_a: Optional[Sequence[float]] = None, censored_b: Optional[Sequence[float]] = None) -> dict:
    """The statistics of one comparison from the per-seed values of two arms.

    NaNs are dropped and counted, except where ``censored_a``/``censored_b`` give a bound for that
    seed (a collapse level never reached within the tested noise: the true level is above the bound).
    Such right-censored seeds are kept, not dropped (dropping them biases an arm toward low levels):
    the means and their t-intervals use the bound in their place (so they are *lower bounds*, said in
    ``note``), the difference's interval is not given, and the p-value is the exact permutation test
    on ranks (Wilcoxon-Mann-Whitney with ties), every censored seed tied above every reached value.
    """
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    ca = np.full(len(a), np.nan) if censored_a is None else np.asarray(censored_a, dtype=float)
    cb = np.full(len(b), np.nan) if censored_b is None else np.asarray(censored_b, dtype=float)
    cens_a, cens_b = ~np.isfinite(a) & np.isfinite(ca), ~np.isfinite(b) & np.isfinite(cb)
    keep_a, keep_b = np.isfinite(a) | cens_a, np.isfinite(b) | cens_b
    va, vb = np.where(cens_a, ca, a)[keep_a], np.where(cens_b, cb, b)[keep_b]
    out: dict = dict(n_a=len(va), n_b=len(vb), n_missing_a=int((~keep_a).sum()), n_missing_b=int((~keep_b).sum()),
                     n_censored_a=int(cens_a.sum()), n_censored_b=int(cens_b.sum()))
    for arm, v in (("a", va), ("b", vb)):
        lo, hi = t_interval(v) if len(v) else (math.nan, math.nan)
        out.update({f"mean_{arm}": float(v.mean()) if len(v) else math.nan, f"ci_lo_{arm}": lo, f"ci_hi_{arm}": hi})
    nan = dict(diff=math.nan, diff_lo=math.nan, diff_hi=math.nan, p_value=math.nan, p_method="", n_splits=0)
    if not len(va) or not len(vb):
        return {**out, **nan}
    if not (cens_a.any() or cens_b.any()):
        lo, hi = welch_interval(va, vb)
        t = permutation_test(va, vb, seed=seed)
        return {**out, "diff": t.difference, "diff_lo": lo, "diff_hi": hi, "p_value": t.p_value,
                "p_method": t.method, "n_splits": t.n_permutations}
    pooled = np.concatenate([np.where(cens_a[keep_a], np.inf, va), np.where(cens_b[keep_b], np.inf, vb)])
    ranks = pd.Series(pooled).rank(method="average").to_numpy()
    t = permutation_test(ranks[:len(va)], ranks[len(va):], seed=seed)
    return {**out, "diff": float(va.mean() - vb.mean()), "diff_lo": math.nan, "diff_hi": math.nan,
            "p_value": t.p_value, "p_method": f"{t.method}, ranks (censored tied at the top)",
            "n_splits": t.n_permutations}


def _note(stats: dict) -> str:
    parts = []
    for arm in ("a", "b"):
        if stats.get(f"n_censored_{arm}"):
            parts.append(f"{stats[f'n_censored_{arm}']} seed(s) of {arm.upper()} never reached it within the tested "
                         "noise: counted at the largest level tested, so its mean is a lower bound; p from ranks")
        if stats[f"n_missing_{arm}"]:
            parts.append(f"{stats[f'n_missing_{arm}']} seed(s) of {arm.upper()} without a value "
                         "(no sparse row to collapse, or not analysed), left out")
    if stats["n_a"] < 2 or stats["n_b"] < 2:
        parts.append("fewer than 2 seeds in an arm: no interval")
    return "; ".join(parts)


def _fmt_values(d: pd.DataFrame) -> str:
    bounds = d["censored_above"] if "censored_above" in d.columns else [math.nan] * len(d)
    return ", ".join(f"s{int(s)}: " + (f"> {c:.0f}" if pd.isna(v) and pd.notna(c) else "—" if pd.isna(v) else f"{v:.1f}")
                     for s, v, c in zip(d["seed"], d["value"], bounds))


def compare_seeds(per_ckpt: pd.DataFrame, *, seed: int = 0,
                  pairs: Sequence[tuple] = PAIRS) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(summary, values)``: one summary row per (pair, comparison) and the per-seed rows behind it.

    ``per_ckpt``: :func:`~interp_norm.stats.seed_summary.per_checkpoint` (columns checkpoint, attn_norm,
    calibration, seed, quantity, unit, value). Every quantity both arms have gets a comparison of
    like with like; the noise cost is also compared across placements (:data:`NOISE_CROSS`).
    Summary columns: ``scaling``, ``comparison``, ``quantity_a``/``quantity_b``, ``unit``,
    ``arm_a``/``arm_b``, ``values_a``/``values_b`` (per seed), ``n_a``, ``mean_a``, ``ci_lo_a``,
    ``ci_hi_a`` (and for b), ``diff`` (A − B), ``diff_lo``/``diff_hi``, ``p_value``, ``p_method``,
    ``n_splits``, ``note``. Pairs with no seed in either arm are left out.
    """
    summary, values = [], []
    if per_ckpt is None or not len(per_ckpt):
        return pd.DataFrame(), pd.DataFrame()
    for scaling, cal, (label_a, norm_a), (label_b, norm_b) in pairs:
        arm_a = per_ckpt[(per_ckpt["attn_norm"] == norm_a) & (per_ckpt["calibration"] == cal)]
        arm_b = per_ckpt[(per_ckpt["attn_norm"] == norm_b) & (per_ckpt["calibration"] == cal)]
        if not len(arm_a) or not len(arm_b):
            continue
        quantities = sorted(set(arm_a["quantity"]) & set(arm_b["quantity"]), key=quantity_order)
        specs = [(q, q, q) for q in quantities]
        if _BEFORE in set(arm_a["quantity"]) and _AFTER in set(arm_b["quantity"]):
            specs.insert(next((i + 1 for i, s in enumerate(specs) if s[0] == _AFTER), len(specs)), NOISE_CROSS)
        for name, qa, qb in specs:
            da = arm_a[arm_a["quantity"] == qa].sort_values("seed")
            db = arm_b[arm_b["quantity"] == qb].sort_values("seed")
            if _AFTER in (qa, qb) and not (da["value"].notna().any() and db["value"].notna().any()):
                continue  # noise after the norm: only where both arms have a q/k norm
            stats = compare_arms(da["value"], db["value"], seed=seed,
                                 censored_a=da.get("censored_above"), censored_b=db.get("censored_above"))
            note = "; ".join(filter(None, [_note(stats), *(
                f"{label}: 0 by construction (its q, k and v norms remove noise placed before them)"
                for label, norm, q in ((label_a, norm_a, qa), (label_b, norm_b, qb)) if q in _REMOVED and norm == "qkv")]))
            summary.append(dict(scaling=scaling, comparison=name, quantity_a=qa, quantity_b=qb, unit=da["unit"].iloc[0],
                                arm_a=label_a, arm_b=label_b, values_a=_fmt_values(da), values_b=_fmt_values(db),
                                **stats, note=note))
            for arm, label, d in (("A", label_a, da), ("B", label_b, db)):
                for r in d.itertuples():
                    values.append(dict(scaling=scaling, comparison=name, arm=arm, variant=label, attn_norm=r.attn_norm,
                                       checkpoint=r.checkpoint,
                                       seed=int(r.seed), quantity=r.quantity, unit=r.unit, value=r.value,
                                       censored_above=getattr(r, "censored_above", math.nan)))
    return pd.DataFrame(summary), pd.DataFrame(values)


# ----------------------------------------------------------------------------- matched ID accuracy

_SPLIT_COLS = {"id": "eval_id_acc", "interp": "eval_interp_acc", "extrap": "eval_extrap_acc"}


def _at_id(steps: np.ndarray, id_acc: np.ndarray, ood: np.ndarray, target: float) -> tuple[float, float]:
    """(OOD accuracy, step) where the run's ID accuracy first reaches ``target``, linearly
    interpolated between the two evaluations around that first crossing; NaN if it never does."""
    hit = np.nonzero(id_acc >= target)[0]
    if not len(hit):
        return math.nan, math.nan
    i = int(hit[0])
    if i == 0:
        return (float(ood[0]), float(steps[0])) if id_acc[0] == target else (math.nan, math.nan)
    t = (target - id_acc[i - 1]) / (id_acc[i] - id_acc[i - 1])
    return float(ood[i - 1] + t * (ood[i] - ood[i - 1])), float(steps[i - 1] + t * (steps[i] - steps[i - 1]))


def matched_id_comparison(curves: pd.DataFrame, checkpoints: pd.DataFrame, *, n_points: int = 5, seed: int = 0,
                          pairs: Sequence[tuple] = PAIRS
                          ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """OOD accuracy of A vs B at matched ID accuracy along training, and at the end of training.

    ``curves``: training-curve rows (``checkpoint``, ``step``, ``eval_id_acc``, ``eval_interp_acc``,
    ``eval_extrap_acc``; evaluations every 1 000 steps on 512 problems per split);
    ``checkpoints``: ``checkpoint``, ``attn_norm``, ``calibration``, ``seed``. The grid: ``n_points``
    ID accuracies evenly spaced from the highest first-evaluation ID accuracy to the lowest best ID
    accuracy over every run of both arms, so that every run reaches every grid point. A run's OOD
    accuracy at a grid point is read where its ID accuracy *first* reaches it (linear interpolation
    between the evaluations around that crossing; curves are not monotone, and the first crossing
    is the one training passes through). ``at = "end of training"`` rows compare the last
    evaluation of each run (ID included, to show how far apart the arms end). Returns
    ``(summary, values)`` like :func:`compare_seeds` (values in %; ``id_target`` in %, NaN at the end).
    """
    if curves is None or not len(curves) or not set(_SPLIT_COLS.values()) <= set(curves.columns):
        return pd.DataFrame(), pd.DataFrame()
    ck = checkpoints.drop_duplicates("checkpoint").set_index("checkpoint")
    summary, values = [], []
    for scaling, cal, (label_a, norm_a), (label_b, norm_b) in pairs:
        runs: dict[str, list] = {"A": [], "B": []}
        for arm, norm in (("A", norm_a), ("B", norm_b)):
            names = [n for n in ck.index if ck.loc[n, "attn_norm"] == norm and ck.loc[n, "calibration"] == cal]
            for n in sorted(names, key=lambda n: ck.loc[n, "seed"]):
                c = curves[curves["checkpoint"] == n].dropna(subset=list(_SPLIT_COLS.values())).sort_values("step")
                if len(c):
                    runs[arm].append((n, int(ck.loc[n, "seed"]), c))
        if not runs["A"] or not runs["B"]:
            continue
        labels, norms = {"A": label_a, "B": label_b}, {"A": norm_a, "B": norm_b}
        every = runs["A"] + runs["B"]
        lo = max(float(c["eval_id_acc"].iloc[0]) for _, _, c in every)
        hi = min(float(c["eval_id_acc"].max()) for _, _, c in every)
        grid = list(np.linspace(lo, hi, n_points)) if hi > lo else []
        points: list[tuple[str, Optional[float], str]] = [("matched ID", x, s) for x in grid for s in ("interp", "extrap")]
        points += [("end of training", None, s) for s in ("id", "interp", "extrap")]
        for at, target, split in points:
            per_arm = {}
            for arm in ("A", "B"):
                vals = []
                for name, sd, c in runs[arm]:
                    if target is None:
                        v, step = float(c[_SPLIT_COLS[split]].iloc[-1]), float(c["step"].iloc[-1])
                    else:
                        v, step = _at_id(c["step"].to_numpy(float), c["eval_id_acc"].to_numpy(float),
                                         c[_SPLIT_COLS[split]].to_numpy(float), target)
                    vals.append(v * 100)
                    values.append(dict(scaling=scaling, at=at, id_target=math.nan if target is None else target * 100,
                                       split=split, arm=arm, variant=labels[arm], attn_norm=norms[arm], checkpoint=name, seed=sd,
                                       step=step, value=v * 100))
                per_arm[arm] = vals
            stats = compare_arms(per_arm["A"], per_arm["B"], seed=seed)
            fmt = lambda arm: ", ".join(f"s{sd}: {v:.1f}" for (_, sd, _), v in zip(runs[arm], per_arm[arm]))  # noqa: E731
            summary.append(dict(scaling=scaling, at=at, id_target=math.nan if target is None else target * 100,
                                split=split, unit="%", arm_a=label_a, arm_b=label_b, values_a=fmt("A"),
                                values_b=fmt("B"), **stats, note=_note(stats)))
    return pd.DataFrame(summary), pd.DataFrame(values)
