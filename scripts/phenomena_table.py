"""The "evidence about the models" tables of docs/results.md, from a report folder written by ``make reproduce``.

    .venv/bin/python scripts/phenomena_table.py report           # print the markdown
    .venv/bin/python scripts/phenomena_table.py report --write   # also rewrite docs/results.md between the markers

Every number is read from the report's CSVs (nothing is typed by hand). Seeds of one variant are
grouped: mean ± half the range over seeds ("± 0" is printed for a single seed). Rows are grouped by
``checkpoints.csv`` (variant label -> attention norm and calibration).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
from _docs import replace_block

ROOT = Path(__file__).resolve().parent.parent
LABEL = {"pre": "Pre-Norm", "qkv": "QKV-Norm", "qk": "QK-Norm", "none": "No-Norm"}
ORDER = ("pre", "qkv", "qk", "none")


def spread(values: pd.Series, scale: float = 100.0, digits: int = 1) -> str:
    v = values.dropna() * scale
    if len(v) == 0:
        return "—"
    missing = len(values) - len(v)
    txt = f"{v.mean():.{digits}f} ± {(v.max() - v.min()) / 2:.{digits}f}"
    return txt + (f" ({missing} of {len(values)} never)" if missing else "")


def load(report: Path) -> dict[str, pd.DataFrame]:
    T = {p.stem: pd.read_csv(p) for p in report.glob("*.csv")}
    ck = T["checkpoints"]
    T["_analysed"] = ck[ck["analysed"]]
    return T


def _group(df: pd.DataFrame, ck: pd.DataFrame, by_label: bool = False) -> pd.DataFrame:
    """Attach attn_norm/calibration/seed via the checkpoint (or the variant label)."""
    keys = ck[["checkpoint", "label", "attn_norm", "calibration", "seed"]]
    if by_label:
        base = df["variant"].str.replace(", noise after norm", "", regex=False)
        df = df.assign(label=base, after_norm=df["variant"].str.endswith(", noise after norm"))
        return df.drop(columns=[c for c in ("attn_norm",) if c in df]).merge(keys, on="label")
    return df.drop(columns=[c for c in ("attn_norm",) if c in df]).merge(keys, on="checkpoint")


def seeds_of(d: pd.DataFrame, col: str, scale: float = 100.0) -> str:
    """Each seed's value, in seed order ("never" where a level was not reached): the spread's parts."""
    if d["seed"].nunique() < 2 or d[col].isna().all():
        return ""
    vals = d.sort_values("seed")[col] * scale
    return " (seeds: " + ", ".join("never" if pd.isna(v) else f"{v:.1f}" for v in vals) + ")"


def _seed_note(g: pd.DataFrame) -> str:
    return ",".join(str(s) for s in sorted(g["seed"].unique()))


def noise_table(T: dict) -> str:
    df = _group(T["noise_accuracy"], T["checkpoints"])
    df = df[(df["split"] == "id") & (df["calibration"] == "none")]
    levels = [0.0, 0.01, 0.03, 0.1, 0.3]
    lines = ["| variant | seeds | noise on | rows noised | " + " | ".join(f"{l:.0%}" for l in levels) + " |",
             "|---|---|---|---|" + "---|" * len(levels)]
    names = {"all": "all", "sparse": "sparse only (q, k)", "nonsparse": "non-sparse only (q, k)",
             "nonsparse_matched": "non-sparse, matched count (q, k)"}
    for a in ORDER:
        for placement in ("before_norm", "after_norm"):
            d = df[(df["attn_norm"] == a) & (df["placement"] == placement)]
            for noised in ("all", "sparse", "nonsparse", "nonsparse_matched"):
                g = d[d["noised"] == noised]
                if not len(g):
                    continue
                where = "before the norm" if placement == "before_norm" else "**after** the norm"
                if a in ("pre", "none"):
                    where = "q, k, v"
                cells = [spread(g[g["level"].round(6) == l]["accuracy"]) for l in levels]
                lines.append(f"| {LABEL[a]} | {_seed_note(g)} | {where} | {names[noised]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def collapse_table(T: dict) -> str:
    rows = ["| variant | seeds | noise on | definition | per-layer protocol: measured | theory (exact) | real forward pass: measured | theory, per layer |",
            "|---|---|---|---|---|---|---|---|"]
    per = _group(T["collapse_thresholds"], T["checkpoints"], by_label=True)
    fwd = _group(T["forward_collapse_thresholds"], T["checkpoints"], by_label=True) if "forward_collapse_thresholds" in T else None
    for a in ORDER:
        for after in (False, True):
            for definition in ("loose", "strict"):
                sel = lambda d: d[(d["attn_norm"] == a) & (d["after_norm"] == after) & (d["layer"].astype(str) == "all")  # noqa: E731
                                  & (d["definition"] == definition) & (d["calibration"] == "none")]
                p = sel(per)
                if not len(p):
                    continue
                f = sel(fwd) if fwd is not None else p.iloc[0:0]
                where = "after the norm" if after else ("before the norm (removed)" if a in ("qk", "qkv") else "q, k")
                rows.append(f"| {LABEL[a]} | {_seed_note(p)} | {where} | {definition} | {spread(p['level_measured'])}"
                            f"{seeds_of(p, 'level_measured')} | {spread(p['level_predicted'])} | "
                            f"{spread(f['level_measured']) + seeds_of(f, 'level_measured') if len(f) else '—'} | "
                            f"{spread(f['level_predicted']) if len(f) else '—'} |")
    return "\n".join(rows)


def sparsity_table(T: dict) -> str:
    s = _group(T["geometry_sparsity_summary"], T["checkpoints"], by_label=True)
    s = s[s["calibration"] == "none"]
    layers = sorted(int(l) for l in s["layer"].dropna().unique())
    lines = ["| variant | seeds | " + " | ".join(f"layer {l}" for l in layers) + " | all layers |",
             "|---|---|" + "---|" * (len(layers) + 1)]
    for a in ORDER:
        d = s[s["attn_norm"] == a]
        if not len(d):
            continue
        cells = [spread(d[d["layer"] == l]["frac_sparse"]) for l in layers] + [spread(d[d["layer"].isna()]["frac_sparse"])]
        lines.append(f"| {LABEL[a]} | {_seed_note(d)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def histogram_table(T: dict) -> str:
    """Per layer, the share of rows whose max attention falls in the top bin (≥ 0.95) beside the bin
    below it (0.90–0.95): a top bin larger than its neighbour is a peak at 1, as in the paper's Pre-Norm."""
    h = _group(T["geometry_sparsity_hist"], T["checkpoints"])
    h = h[h["calibration"] == "none"]
    h = h[h["layer"].notna() & (h["layer"].astype(str) != "all")]
    h = h.assign(layer=h["layer"].astype(int))
    layers = sorted(h["layer"].unique())
    top, below = h[h["lo"].round(6) == 0.95], h[h["lo"].round(6) == 0.9]
    lines = ["| variant | seeds | " + " | ".join(f"layer {l}: ≥ 0.95 vs 0.90–0.95" for l in layers) + " |",
             "|---|---|" + "---|" * len(layers)]
    for a in ORDER:
        t, b = top[top["attn_norm"] == a], below[below["attn_norm"] == a]
        if len(t):
            cells = [f"{spread(t[t['layer'] == l]['fraction'])} vs {spread(b[b['layer'] == l]['fraction'])}" for l in layers]
            lines.append(f"| {LABEL[a]} | {_seed_note(t)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def temperature_table(T: dict) -> str:
    if "temperature" not in T:
        return ""
    df = _group(T["temperature"], T["checkpoints"])
    df = df[(df["layer"].astype(str) == "all") & (df["calibration"] == "none")]
    cs = sorted(df["c"].unique())
    lines = ["| variant | seeds | noise on | " + " | ".join(f"c = {c:g}" for c in cs) + " |",
             "|---|---|---|" + "---|" * len(cs)]
    for a in ORDER:
        d = df[df["attn_norm"] == a]
        if not len(d):
            continue
        where = "after the norm" if a in ("qk", "qkv") else "q, k"
        cells = [f"{spread(d[d['c'] == c]['frac_sparse'])} sparse; 1% at {spread(d[d['c'] == c]['collapse_level_loose'])}"
                 for c in cs]
        lines.append(f"| {LABEL[a]} | {_seed_note(d)} | {where} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def spread_table(T: dict) -> str:
    s = _group(T["geometry_norm_spread"], T["checkpoints"])
    s = s[s["calibration"] == "none"]
    per_ckpt = s.groupby(["attn_norm", "checkpoint", "seed", "layer"])["spread"].median().reset_index()
    layers = sorted(per_ckpt["layer"].unique())
    lines = ["| variant | seeds | " + " | ".join(f"layer {l}" for l in layers) + " |", "|---|---|" + "---|" * len(layers)]
    for a in ORDER:
        d = per_ckpt[per_ckpt["attn_norm"] == a]
        if len(d):
            lines.append(f"| {LABEL[a]} | {_seed_note(d)} | " + " | ".join(f"±{spread(d[d['layer'] == l]['spread'])}"
                                                                         for l in layers) + " |")
    return "\n".join(lines)


def markdown(report: Path) -> str:
    T = load(report)
    parts = [
        "**Accuracy under norm noise** (`noise_accuracy.csv`: ID per-token %, uniform multiplicative noise of the given RMS on "
        "the L2 norms, all layers in one forward pass, 3 datasets of 512 problems; mean ± half the range over seeds):\n",
        noise_table(T),
        "\n**Noise level at which 1% of sparse rows collapse**, all layers pooled (`collapse_thresholds.csv`, "
        "`forward_collapse_thresholds.csv`; loose: the argmax moves; strict: it moves to a key that then gets ≥ 95%; "
        "\"never\": not reached below 50% noise):\n",
        collapse_table(T),
        "\n**Fraction of sparse attention rows** (max attention ≥ 95%, `geometry_sparsity_summary.csv`, 256 ID problems):\n",
        sparsity_table(T),
        "\n**Max-attention histogram, top of the range** (`geometry_sparsity_hist.csv`: % of rows whose max attention "
        "lies in the top bin beside the bin below it; a peak at 1 shows as a top bin larger than its neighbour):\n",
        histogram_table(T),
        "\n**Norm spread at the attention inputs** (`geometry_norm_spread.csv`: median over heads of the ±x within which 90% "
        "of attention-weighted input norms lie around the head's median):\n",
        spread_table(T),
    ]
    temp = temperature_table(T)
    if temp:
        parts += ["\n**Attention temperature** (`temperature.csv`: scores × c; fraction of rows that are sparse and the "
                  "1% loose collapse level, all layers):\n", temp]
    return "\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("report", nargs="?", default=str(ROOT / "report"))
    ap.add_argument("--write", action="store_true", help="rewrite the tables in docs/results.md between the markers")
    ap.add_argument("--block", default="PHENOMENA", help="the page's markers' name (<!-- NAME:start --> ... end)")
    args = ap.parse_args()
    md = markdown(Path(args.report))
    print(md)
    if args.write:
        replace_block(args.block, md)

if __name__ == "__main__":
    main()
