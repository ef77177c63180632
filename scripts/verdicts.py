"""The paper's claims, each with a verdict decided by a written rule from the seed tables (issue 23).

    .venv/bin/python scripts/verdicts.py                     # print both blocks from docs/data/seed_comparisons.csv
    .venv/bin/python scripts/verdicts.py --write             # rewrite README.md's VERDICTS block and
                                                             # docs/results.md's CLAIMS block
    .venv/bin/python scripts/verdicts.py report-seeds        # from a report folder instead

Nothing is typed by hand: every number comes from ``seed_comparisons.csv`` (written by
``interp-norm reproduce --all-seeds``; ``scripts/findings_tables.py --write`` keeps a copy in
``docs/data/``), and the verdict from one of three rules (:data:`RULES`), applied per score scaling:

* ``order`` (the paper says variant A > B, or A < B): **reproduced** when the two-sided permutation
  p < 0.05 and the difference has the paper's sign; **not reproduced (reversed)** when p < 0.05 with
  the other sign; otherwise **not established**.
* ``same`` (the paper says A and B are on a par): **reproduced** when the 95% interval of A − B lies
  within ±1 point (:data:`PAR_MARGIN`); **not reproduced** when p < 0.05; otherwise **not established**.
* ``equals`` (the paper gives a value for Pre-Norm): **reproduced** when the value lies inside the
  95% bootstrap interval of the Pre-Norm seeds' mean; **not reproduced** when it lies outside;
  **not established** with fewer than 3 seeds. Where seeds never reached a collapse level, the
  interval is of a lower bound: a value below its lower end is still **not reproduced**; otherwise
  **not established**.
* ``at_least`` (the paper says "≳ value"): **reproduced** when the interval's upper end reaches the
  value; **not reproduced** when the whole interval lies below it.

The p-values are not corrected for the number of claims (here about 20 decisions).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from _docs import RESULTS, replace_block
from findings_tables import _ci  # the seed tables' own interval format, so the prose test can match it

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "data" / "seed_comparisons.csv"
README = ROOT / "README.md"
ALPHA = 0.05
MIN_SEEDS = 3
RULES = ("order", "same", "equals", "at_least")
#: ``same``: the largest |A − B| that counts as "on a par" (points; the paper's ID gap is 0.4).
PAR_MARGIN = 1.0
_SPREAD = "norm spread (90% of attended norms within ±), layer {layer}"


@dataclass(frozen=True)
class Claim:
    """One claim of Menary et al. 2024 (§4) and the seed-table row that tests it."""

    text: str        # the claim, as the README states it
    paper: str       # the paper's figure
    comparison: str  # ``seed_comparisons.csv`` "comparison"
    rule: str        # one of RULES
    sign: int = 1    # order: +1 if the paper says A > B (Pre-Norm above QKV-Norm), -1 if A < B
    value: float = math.nan  # equals / at_least: the paper's value, in the row's unit
    group: str = ""  # claims with one group share a README row (the per-layer ones) ...
    part: str = ""   # ... each named by its part there ("layer 0")


CLAIMS = (
    Claim("ID accuracy on a par", "91.4 vs 91.0%", "ID accuracy", "same"),
    Claim("QKV-Norm interpolates worse", "87.5 vs 82.5%", "interpolation accuracy", "order", +1),
    Claim("QKV-Norm extrapolates worse", "66.7 vs 46.8%", "extrapolation accuracy", "order", +1),
    Claim("1% norm noise costs Pre-Norm ≳ 10 points", "≳ 10",
          "accuracy lost to 1% noise (all rows, before any norm)", "at_least", value=10.0),
    Claim("1% of Pre-Norm's sparse rows collapse at 11% noise (loose)", "11%",
          "1% loose collapse level, per-layer protocol", "equals", value=11.0),
    *(Claim(f"Pre-Norm: 90% of attended norms within ±20%, layer {layer}", "±20%", _SPREAD.format(layer=layer),
            "equals", value=20.0, group="Pre-Norm: 90% of attended norms within ±20%", part=f"layer {layer}")
      for layer in range(3)),
    *(Claim(f"QKV-Norm's norm spread is much wider, layer {layer}", "wider", _SPREAD.format(layer=layer), "order", -1,
            group="QKV-Norm's norm spread is much wider", part=f"layer {layer}") for layer in range(3)),
    Claim("attention peaks at 1 in Pre-Norm, not QKV-Norm (rows at ≥ 0.99)", "peak / none",
          "rows with max attention ≥ 0.99, all layers", "order", +1),
)


def _num(x: float) -> str:
    return f"{x:.1f}"


def _p(p: float) -> str:
    return f"p = {p:.2g}"


def verdict(claim: Claim, row: pd.Series) -> tuple[str, str]:
    """``(verdict, evidence)`` for one claim on one scaling's row, by the claim's rule."""
    if claim.rule in ("order", "same"):
        p, diff = float(row["p_value"]), float(row["diff"])
        evidence = f"{row['arm_a']} {_num(row['mean_a'])} vs {row['arm_b']} {_num(row['mean_b'])}, {_p(p)}"
        if math.isnan(p):
            return "not established", "no test (an arm without values)"
        if claim.rule == "same":
            within = abs(float(row["diff_lo"])) <= PAR_MARGIN and abs(float(row["diff_hi"])) <= PAR_MARGIN
            evidence += f", A − B {_ci(diff, row['diff_lo'], row['diff_hi'])}"
            return ("reproduced" if within else "not reproduced" if p < ALPHA else "not established"), evidence
        if p >= ALPHA:
            return "not established", evidence
        return ("reproduced", evidence) if diff * claim.sign > 0 else ("not reproduced (reversed)", evidence)
    lo, hi, n = float(row["ci_lo_a"]), float(row["ci_hi_a"]), int(row["n_a"])
    censored = int(row.get("n_censored_a", 0) or 0)
    evidence = _ci(row["mean_a"], lo, hi) + (f", {censored} seed(s) never reached: a lower bound"
                                                                   if censored else "")
    if n < MIN_SEEDS or math.isnan(lo):
        return "not established", f"{n} seed(s)"
    if claim.rule == "at_least":
        return ("reproduced", evidence) if hi >= claim.value else ("not reproduced", evidence)
    if censored:
        return ("not reproduced", evidence) if lo > claim.value else ("not established", evidence)
    return ("reproduced", evidence) if lo <= claim.value <= hi else ("not reproduced", evidence)


def verdicts(comp: pd.DataFrame) -> pd.DataFrame:
    """One row per (claim, scaling): the verdict, its evidence and the arms' seed counts."""
    rows = []
    for claim in CLAIMS:
        for scaling, s in comp.groupby("scaling", sort=False):
            r = s[s["comparison"] == claim.comparison]
            if not len(r):
                continue
            v, ev = verdict(claim, r.iloc[0])
            rows.append(dict(claim=claim.text, group=claim.group or claim.text, part=claim.part, paper=claim.paper, rule=claim.rule, scaling=scaling, verdict=v,
                             evidence=ev, n_a=int(r.iloc[0]["n_a"]), n_b=int(r.iloc[0]["n_b"])))
    return pd.DataFrame(rows)


def _seeds_line(comp: pd.DataFrame) -> str:
    parts = []
    for scaling, s in comp.groupby("scaling", sort=False):
        r = s.iloc[0]
        parts.append(f"{r['arm_a']} {int(r['n_a'] + r['n_missing_a'])} and {r['arm_b']} "
                     f"{int(r['n_b'] + r['n_missing_b'])} seeds ({scaling})")
    return "; ".join(parts)


def readme_block(comp: pd.DataFrame) -> str:
    v = verdicts(comp)
    scalings = list(dict.fromkeys(v["scaling"]))
    head = "| paper's claim | " + " | ".join(scalings) + " |"
    lines = [f"The paper's claims against the shipped seeds, {_seeds_line(comp)} ([tables](docs/findings-tables.md), "
             "[reasoning and controls](docs/results.md#findings)). Verdicts by the rules in `scripts/verdicts.py` "
             f"(p < {ALPHA} for an ordering, the paper's value inside the 95% interval over seeds for a value):", "",
             head, "|---" * (len(scalings) + 1) + "|"]
    for group, g in v.groupby("group", sort=False):
        cells = []
        for scaling in scalings:
            c = g[g["scaling"] == scaling]
            kinds = list(dict.fromkeys(c["verdict"]))
            part = lambda r: f"{r.part} " if r.part else ""  # noqa: E731
            if len(kinds) == 1:  # one verdict for the group's rows: say it once
                cells.append(f"{kinds[0]}: " + "; ".join(f"{part(r)}{r.evidence}" for r in c.itertuples()))
            else:
                cells.append("; ".join(f"{part(r)}{r.verdict}: {r.evidence}" for r in c.itertuples()))
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def results_block(comp: pd.DataFrame) -> str:
    v = verdicts(comp)
    lines = ["| paper's claim (Menary et al. 2024) | paper | scaling | seeds (A / B) | here | verdict | rule |",
             "|---|---|---|---|---|---|---|"]
    for r in v.itertuples():
        lines.append(f"| {r.claim} | {r.paper} | {r.scaling} | {r.n_a} / {r.n_b} | {r.evidence} | {r.verdict} | {r.rule} |")
    return "\n".join(lines) + ("\n\nGenerated by `scripts/verdicts.py` from `docs/data/seed_comparisons.csv`; its "
                               "docstring states the three rules.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report", nargs="?", help="a report folder with seed_comparisons.csv (default: docs/data)")
    ap.add_argument("--write", action="store_true", help="rewrite README.md's VERDICTS and docs/results.md's CLAIMS blocks")
    args = ap.parse_args()
    comp = pd.read_csv(Path(args.report) / "seed_comparisons.csv" if args.report else DATA)
    readme, results = readme_block(comp), results_block(comp)
    print(readme, "\n", results, sep="\n")
    if args.write:
        replace_block("VERDICTS", readme, page=README)
        replace_block("CLAIMS", results, page=RESULTS)


if __name__ == "__main__":
    main()
