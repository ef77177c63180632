"""The noise model against the models, per seed: the models' own norm variation, and one κ per token.

    .venv/bin/python scripts/noise_model_seeds.py             # print the per-arm tables
    .venv/bin/python scripts/noise_model_seeds.py --write     # also write data/seed_tables/noise_model_values.csv
    .venv/bin/python scripts/noise_model_seeds.py --read      # the tables from that CSV (seconds)

For every shipped Pre-Norm and QKV-Norm checkpoint (6 seeds each, at 1/√d_head and with the paper's
calibration; ``--arms none`` for 1/√d_head only), two measures of Menary et al. 2024 §2.3's noise model:

* **The κ the models produce.** :func:`interp_norm.noise.norm_variation.norm_variation` on ``--problems``
  ID test problems (all non-padding positions, and the answer positions alone): per head, the RMS of κ̂ = ‖x‖ / median ‖x‖ − 1 over tokens (the uniform noise
  level with the same second moment), for q, k, v before any per-head norm and, in QKV-Norm, after it.
  Per checkpoint the value is the median over heads and layers, in % (a noise level, comparable to the
  experiments' 1%).
* **The 1% noise cost with one κ per token.** :func:`interp_norm.noise.noise_decomposition` at level
  1% (uniform κ, before any norm), modes ``qkv`` (an independent κ per head and vector, the paper's
  model) and ``shared`` (one κ per example, position and layer for every head and for q, k and v:
  interference through the one shared norm), on the same problems and κ streams as the report
  (3 datasets of 512 ID problems, noise seed 0), in points of accuracy.

Arms are compared as the verdicts are: Student-t 95% intervals per arm, Welch for A − B, and the
one-sided exact permutation test in the paper's direction (Pre-Norm costs more: A > B); within an arm,
shared minus per-head is paired by seed (t-interval of the seed differences).
About 8 s of CPU per checkpoint (one thread): 24 checkpoints in 185 s measured on the shared 2-core machine
(``--read``: seconds).

QKV-Norm's costs are 0 by construction (noise before a per-head norm is removed up to eps), so A > B there
is an identity, printed but not evidence; what the seeds measure is Pre-Norm's cost under each κ model.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd

from interp_norm import load
from interp_norm.noise.decomposition import run_noise_decomposition
from interp_norm.noise.norm_variation import norm_variation
from interp_norm.stats.inference import permutation_test, t_interval, welch_interval
from interp_norm.stats.seed_compare import PAIRS
from interp_norm.stats.shipped import seed_tables_dir

ROOT = Path(__file__).resolve().parent.parent
OUT = seed_tables_dir() / "noise_model_values.csv"
PER_HEAD = "accuracy lost to 1% noise, κ per head and vector (decomposition qkv)"
SHARED = "accuracy lost to 1% noise, one κ per token shared across heads (decomposition shared)"
LEVEL = "median head's own norm variation as a uniform noise level, {vector} {site}, {positions}"
POSITIONS = {"all": "all positions", "answer": "answer positions"}
SITES = {"before_norm": "before any per-head norm", "after_norm": "after the per-head norm"}


def measure(name: str, problems: int, examples: int) -> list[dict]:
    """The per-checkpoint values (quantity, unit, value) of one checkpoint."""
    model = load(ROOT / "data" / "checkpoints" / name)
    rows = []
    tokens = model.task.test_set("id", size=problems, seed=0).tokens
    for positions, label in POSITIONS.items():
        var = norm_variation(model, tokens, positions=positions)
        for (vector, site), g in var.groupby(["vector", "site"], sort=False):
            rows.append(dict(quantity=LEVEL.format(vector=vector, site=SITES[site], positions=label), unit="% noise",
                             value=100 * float(g["matching_level"].median())))
    dec = run_noise_decomposition(model, levels=(0.01,), modes=("qkv", "shared"), n_datasets=3,
                                  n_examples=examples, seed=0)
    for mode, quantity in (("qkv", PER_HEAD), ("shared", SHARED)):
        rows.append(dict(quantity=quantity, unit="points", value=float(dec.loc[dec["mode"] == mode, "drop"].iloc[0])))
    return [dict(checkpoint=name, attn_norm=model.cfg.attn_norm, calibration=model.cfg.calibration, **r) for r in rows]


def per_checkpoint(checkpoints: pd.DataFrame, problems: int, examples: int) -> pd.DataFrame:
    rows = []
    for name, seed in zip(checkpoints["checkpoint"], checkpoints["seed"]):
        start = time.perf_counter()
        rows += [dict(r, seed=int(seed)) for r in measure(name, problems, examples)]
        print(f"{name}: {time.perf_counter() - start:.1f} s", flush=True)
    cols = ["checkpoint", "attn_norm", "calibration", "seed", "quantity", "unit", "value"]
    return pd.DataFrame(rows)[cols]


def _ci(lo_hi: tuple[float, float]) -> str:
    return f"[{lo_hi[0]:.3g}, {lo_hi[1]:.3g}]"


def arms(values: pd.DataFrame) -> pd.DataFrame:
    """Per (quantity, arm): seeds, mean and Student-t 95% interval."""
    rows = []
    for (q, norm, cal), g in values.groupby(["quantity", "attn_norm", "calibration"], sort=False):
        v = g["value"].to_numpy(float)
        rows.append(dict(quantity=q, attn_norm=norm, calibration=cal, n=len(v), mean=v.mean(),
                         t_interval=_ci(t_interval(v)) if len(v) > 1 else ""))
    return pd.DataFrame(rows)


def compare(values: pd.DataFrame) -> pd.DataFrame:
    """Per (scaling, quantity): each arm's mean and t-interval, A − B with Welch's interval, one-sided p (A > B)."""
    rows = []
    for scaling, cal, (label_a, norm_a), (label_b, norm_b) in PAIRS:
        for q, g in values[values["calibration"] == cal].groupby("quantity", sort=False):
            a = g[g["attn_norm"] == norm_a].sort_values("seed")["value"].to_numpy(float)
            b = g[g["attn_norm"] == norm_b].sort_values("seed")["value"].to_numpy(float)
            if min(len(a), len(b)) < 2:
                continue
            (lo_a, hi_a), (lo_b, hi_b), (lo, hi) = t_interval(a), t_interval(b), welch_interval(a, b)
            rows.append(dict(scaling=scaling, quantity=q, arm_a=label_a, n_a=len(a), mean_a=a.mean(), ci_a=_ci((lo_a, hi_a)),
                             arm_b=label_b, n_b=len(b), mean_b=b.mean(), ci_b=_ci((lo_b, hi_b)), diff=a.mean() - b.mean(),
                             ci_diff=_ci((lo, hi)), p_greater=permutation_test(a, b, alternative="greater").p_value))
    return pd.DataFrame(rows)


def paired(values: pd.DataFrame) -> pd.DataFrame:
    """Per arm: shared-κ minus per-head-κ cost, paired by checkpoint, with its t-interval."""
    w = values[values["quantity"].isin([PER_HEAD, SHARED])].pivot_table(
        index=["attn_norm", "calibration", "checkpoint"], columns="quantity", values="value")
    rows = []
    for (norm, cal), g in w.groupby(level=[0, 1]):
        d = (g[SHARED] - g[PER_HEAD]).to_numpy(float)
        if len(d) < 2:
            continue
        rows.append(dict(attn_norm=norm, calibration=cal, n=len(d), per_head=g[PER_HEAD].mean(), shared=g[SHARED].mean(),
                         shared_minus_per_head=d.mean(), ci=_ci(t_interval(d))))
    return pd.DataFrame(rows)


def agreement(values: pd.DataFrame) -> float:
    """Largest |difference| between these per-head and shared-κ costs and the report's (data/seed_tables/seed_values.csv,
    the noise decomposition of ``reproduce --controls``, same problems and κ streams): 0 up to rounding."""
    seeds = pd.read_csv(seed_tables_dir() / "seed_values.csv")
    theirs = {PER_HEAD: "accuracy lost to 1% noise on q, k and v (decomposition)",
              SHARED: "accuracy lost to 1% noise on q, k and v with one κ per token shared across heads (decomposition)"}
    mine = values[values["quantity"].isin(list(theirs))].assign(quantity=lambda d: d["quantity"].map(theirs))
    both = mine.merge(seeds, on=["checkpoint", "quantity"], suffixes=("", "_report"))
    return float((both["value"] - both["value_report"]).abs().max()) if len(both) else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", type=int, default=256, help="ID problems for the norm variation (default 256)")
    ap.add_argument("--examples", type=int, default=512, help="ID problems per noise dataset, 3 datasets (default 512)")
    ap.add_argument("--arms", choices=("both", "none"), default="both",
                    help="'none': the 1/√d_head arms only (half the time)")
    ap.add_argument("--write", action="store_true", help=f"write {OUT}")
    ap.add_argument("--read", action="store_true", help=f"print the tables from {OUT}, computing nothing")
    args = ap.parse_args()
    ck = pd.read_csv(seed_tables_dir() / "checkpoints.csv")
    ck = ck[ck["attn_norm"].isin(["pre", "qkv"]) & ((args.arms == "both") | (ck["calibration"] == "none"))]
    values = pd.read_csv(OUT) if args.read else per_checkpoint(ck, args.problems, args.examples)
    if args.write:
        values.to_csv(OUT, index=False)
    fmt = dict(float_format=lambda x: f"{x:.4g}", index=False)
    with pd.option_context("display.width", 250, "display.max_colwidth", 90):
        print(arms(values).to_string(**fmt), "\n")
        print(compare(values).to_string(**fmt), "\n")
        print(paired(values).to_string(**fmt))
    print(f"\nlargest |difference| from the report's decomposition (seed_values.csv): {agreement(values):.3g} points")


if __name__ == "__main__":
    main()
