"""The paper's thesis per seed: does scaling a residual component move attention through the shared norm?

    .venv/bin/python scripts/coupling_seeds.py              # print the per-arm table
    .venv/bin/python scripts/coupling_seeds.py --write      # also write data/seed_tables/coupling_values.csv

For every shipped Pre-Norm and QKV-Norm checkpoint (6 seeds each, at 1/√d_head and with the paper's
calibration): at each layer's input the token component (the span of the token embeddings W_E) is
halved, and :func:`interp_norm.geometry.coupling.norm_coupling` measures each head's attention change
(mean total variation over the query rows of ``--problems`` ID test problems) in total, through the
direct path (norm scales held) and through the norm path alone (scales swapped), beside equal-norm
random subspaces of the same dimension. Per checkpoint the value is the mean over heads and layers, in %
(100 × total variation: the share of attention that moved).
Arms are compared with the seed tables' statistics (Student-t intervals, exact permutation p).
A few seconds of CPU per checkpoint.

Read the "norm" path with care: in Pre-Norm it is the one norm all heads share; in QKV-Norm it is the
head's own q/k norms, which see only what the head reads. The token component is read by the heads,
so neither number alone is the thesis (a component a head does *not* read moves a QKV-Norm head by
exactly 0, ``tests/test_coupling.py``); the equal-norm random subspaces are the baseline to read them against.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from interp_norm.geometry.coupling import norm_coupling
from interp_norm.stats.seed_compare import PAIRS, compare_arms
from interp_norm.stats.shipped import seed_tables_dir
from interp_norm import load

ROOT = Path(__file__).resolve().parent.parent
OUT = seed_tables_dir() / "coupling_values.csv"
QUANTITY = "attention moved by halving the token component ({path}, {subspace})"


def per_checkpoint(checkpoints: pd.DataFrame, problems: int) -> pd.DataFrame:
    rows = []
    for name, seed in zip(checkpoints["checkpoint"], checkpoints["seed"]):
        model = load(ROOT / "data" / "checkpoints" / name)
        tokens = model.task.test_set("id", size=problems, seed=0).tokens
        frames = [norm_coupling(model, tokens, layer, model.W_E.detach().T, factor=0.5, n_controls=4)
                  for layer in range(model.cfg.n_layers)]
        d = pd.concat(frames)
        d["kind"] = d["subspace"].where(d["subspace"] == "component", "random subspace")
        for (kind, path), g in d.groupby(["kind", "path"]):
            subspace = "token component" if kind == "component" else "equal-norm random subspace"
            rows.append(dict(checkpoint=name, attn_norm=model.cfg.attn_norm, calibration=model.cfg.calibration,
                             seed=int(seed), quantity=QUANTITY.format(path=path, subspace=subspace),
                             unit="% (TV)", value=100 * float(g["tv"].mean())))
    return pd.DataFrame(rows)


def compare(values: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for scaling, cal, (label_a, norm_a), (label_b, norm_b) in PAIRS:
        for q, g in values[values["calibration"] == cal].groupby("quantity", sort=False):
            a = g[g["attn_norm"] == norm_a].sort_values("seed")["value"].to_numpy()
            b = g[g["attn_norm"] == norm_b].sort_values("seed")["value"].to_numpy()
            if len(a) and len(b):
                s = compare_arms(a, b)
                rows.append(dict(scaling=scaling, quantity=q, arm_a=label_a, arm_b=label_b, n_a=s["n_a"], n_b=s["n_b"],
                                 mean_a=s["mean_a"], ci_lo_a=s["ci_lo_a"], ci_hi_a=s["ci_hi_a"], mean_b=s["mean_b"],
                                 ci_lo_b=s["ci_lo_b"], ci_hi_b=s["ci_hi_b"], diff=s["diff"], p_value=s["p_value"]))
    return pd.DataFrame(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", type=int, default=64, help="ID test problems per checkpoint (default 64)")
    ap.add_argument("--write", action="store_true", help=f"write {OUT}")
    args = ap.parse_args()
    ck = pd.read_csv(seed_tables_dir() / "checkpoints.csv")
    values = per_checkpoint(ck[ck["attn_norm"].isin(["pre", "qkv"])], args.problems)
    with pd.option_context("display.width", 220, "display.max_colwidth", 80):
        print(compare(values).to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    if args.write:
        values.to_csv(OUT, index=False)


if __name__ == "__main__":
    main()
