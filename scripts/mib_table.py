"""MIB's circuit-track numbers (CPR, CMD, average faithfulness) for every method on the shipped
models and on ground-truth suite models.

    PYTHONPATH=. python scripts/mib_table.py [--pairs 16] [--models pre qkv qk none] [--suite induction marker]
"""

from __future__ import annotations

import argparse

import pandas as pd

from interp_norm import load_with_info
from interp_norm.circuits import make_pairs
from interp_norm.circuits.benchmark.ground_truth import SUITE, make_gt_pairs
from interp_norm.circuits.benchmark.mib import run_mib

METHODS = ("exact", "eap", "eap-ig", "atp*")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["pre", "qkv", "qk", "none"])
    ap.add_argument("--suite", nargs="*", default=["induction", "marker", "duplicate_token"])
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = []
    for name in args.models:
        model, info = load_with_info(name)
        pairs = make_pairs(info.task, args.pairs, "id", seed=args.seed, aligned=True)
        rows.append(run_mib(model, pairs, methods=METHODS)["summary"].assign(model=name))
    for name in args.suite:
        pairs = make_gt_pairs(name, args.pairs, args.seed)
        rows.append(run_mib(SUITE[name].build(), pairs, methods=METHODS)["summary"].assign(model=f"suite:{name}"))
    df = pd.concat(rows, ignore_index=True)[["model", "method", "cpr", "cmd", "average"]]
    print(df.to_string(index=False, float_format=lambda v: f"{v:.3f}"))


if __name__ == "__main__":
    main()
