"""The accuracy table of the shipped checkpoints (docs/results.md), from their metrics.json files.

    .venv/bin/python scripts/results_table.py           # print the markdown table
    .venv/bin/python scripts/results_table.py --write   # also rewrite it in docs/results.md between the markers

Numbers are read from ``data/checkpoints/*/metrics.json`` (written at the end of training by
``interp_norm.training.train`` on fixed seeded test sets of 2048 problems per split), so the table always
matches the shipped files. Per variant and scaling (√d_head, or the paper's Checkpoint
calibration): mean ± half the range over seeds (± 0 for one seed).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd
from _docs import replace_block

ROOT = Path(__file__).resolve().parent.parent
BLOCK = "RESULTS"
PAPER = {"pre": (91.38, 87.46, 66.65), "qkv": (90.99, 82.54, 46.76)}
LABEL = {"pre": "Pre-Norm", "qkv": "QKV-Norm", "qk": "QK-Norm", "none": "No-Norm"}


def collect(data: Path) -> pd.DataFrame:
    rows = []
    for metrics_file in sorted(data.glob("*/metrics.json")):
        metrics = json.loads(metrics_file.read_text())
        config = json.loads((metrics_file.parent / "config.json").read_text())
        for rec in metrics["evaluation"]:
            rows.append(
                dict(
                    name=metrics_file.parent.name,
                    variant=config["model"]["attn_norm"],
                    calibration=config["model"].get("calibration", "none"),
                    set=metrics.get("set", "reference"),
                    seed=config["model"]["seed"],
                    split=rec["split"],
                    per_token=100 * rec["per_token_acc"],
                    per_token_no_eos=100 * rec["per_token_acc_no_eos"],
                    exact=100 * rec["exact_match"],
                    train_seconds=metrics.get("train_seconds", float("nan")),
                )
            )
    return pd.DataFrame(rows)


def fmt(values: pd.Series) -> str:
    mean, half = values.mean(), (values.max() - values.min()) / 2
    return f"{mean:.2f} ± {half:.2f}"


def table(df: pd.DataFrame) -> str:
    lines = [
        "| variant | scaling | seeds | split | per-token % | per-token % without `]` | exact match % | paper per-token % | train time (s, 1 thread) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    sets = ["reference"] + sorted(set(df.set) - {"reference"})
    groups = [(v, c, st) for st in sets for c in ("none", "paper") for v in ("pre", "qkv", "qk", "none")
              if ((df.variant == v) & (df.calibration == c) & (df.set == st)).any()]
    for variant, calibration, st in groups:
        d = df[(df.variant == variant) & (df.calibration == calibration) & (df.set == st)]
        scaling = "Checkpoint calibration" if calibration == "paper" else "1/√d_head"
        if st != "reference":
            scaling += f", {st}"
        seeds = ",".join(str(s) for s in sorted(d.seed.unique()))
        times = d.groupby("name").train_seconds.first()
        for i, split in enumerate(("id", "interp", "extrap")):
            s = d[d.split == split]
            paper = f"{PAPER[variant][i]:.2f}" if variant in PAPER else "—"
            t = f"{times.mean():.0f}" if i == 0 else ""
            lines.append(
                f"| {LABEL[variant] if i == 0 else ''} | {scaling if i == 0 else ''} | {seeds if i == 0 else ''} | {split} | {fmt(s.per_token)} | "
                f"{fmt(s.per_token_no_eos)} | {fmt(s.exact)} | {paper} | {t} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(ROOT / "data" / "checkpoints"))
    ap.add_argument("--write", action="store_true", help="rewrite the table in docs/results.md")
    args = ap.parse_args()
    md = table(collect(Path(args.data)))
    print(md)
    if args.write:
        replace_block(BLOCK, md)

if __name__ == "__main__":
    main()
