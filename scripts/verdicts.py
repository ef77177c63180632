"""The paper's claims, each with a verdict decided by a declared rule from the unrounded per-seed values.

    .venv/bin/python scripts/verdicts.py                     # print the family and both blocks from docs/data/seed_values.csv
    .venv/bin/python scripts/verdicts.py --write             # rewrite README.md's VERDICTS block and
                                                             # docs/results.md's CLAIMS block
    .venv/bin/python scripts/verdicts.py report-seeds        # from a report folder's seed_numbers.csv instead

Nothing is typed by hand and nothing is read from a summary table: every p and interval is recomputed
here from ``seed_values.csv`` (one row per checkpoint and measure, unrounded: the report's
``seed_numbers.csv``, copied by ``scripts/findings_tables.py --write``). Arms: Menary et al. 2024 §4's
Pre-Norm vs QKV-Norm, at 1/√d_head and with the paper's Checkpoint calibration
(:data:`interp_norm.stats.seed_compare.PAIRS`). Each claim has a *test for* and a *test against*:

* ``order`` (the paper says A > B, or A < B): for = the one-sided exact permutation test in the
  paper's direction (every split of the seeds, 924 for 6 + 6); against = the same test in the reverse
  direction. **reproduced** / **not reproduced (reversed)** / **not established**.
* ``same`` (A and B on a par): for = TOST, two one-sided exact permutation tests under location
  shift with the declared margin ``±margin`` (:data:`PAR_MARGIN`); against = the difference lies
  outside the margin (the smaller of the two shifted one-sided p-values, doubled).
* ``above`` (the paper says "≳ value"): for = one-sided one-sample t-test of H0 mean <= value − margin
  ("≳" allows the declared margin, :data:`ABOVE_MARGIN` of the value); against = H0 mean >= value − margin.
* ``near`` (the paper says "≈ value"): for = TOST of mean within value ± margin (one-sample t,
  :data:`NEAR_MARGIN` of the value); against = the mean lies outside it (smaller one-sided p, doubled).
  Where seeds never reached a collapse level their values are lower bounds: only "above the margin"
  can then be shown (against), never "within" (for).

The thesis (the paper's title claim: Pre-Norm couples residual components through its shared norm,
QKV-Norm does not) is tested directly as an ``order`` claim on ``scripts/coupling_seeds.py``'s measure
(``docs/data/coupling_values.csv``): the attention change when the token component of each layer's
input is halved, Pre-Norm > QKV-Norm, beside the same for equal-norm random subspaces (the control: a
difference there too says the coupling is not specific to the semantic component).

No verdict rests on an interval's far end. **The family** is every test for and against of every claim
that is not an identity; Holm's adjustment runs over it and the verdicts are decided on the adjusted
p < :data:`ALPHA`. A comparison that holds by construction (an arm whose value is fixed by its
architecture) is an **identity**: it leaves the family and is labelled so. Intervals are Student-t 95%
over seeds (Welch for a difference).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from _docs import RESULTS, replace_block
from findings_tables import _num  # the seed tables' own number format

from interp_norm.stats.inference import (holm, permutation_test, t_interval, t_test_value, tost_permutation,
                                         tost_value, welch_interval)
from interp_norm.stats.seed_compare import PAIRS

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "data" / "seed_values.csv"
README = ROOT / "README.md"
ALPHA = 0.05
MIN_SEEDS = 3
RULES = ("order", "same", "above", "near")
#: ``same``: the largest |A − B| that counts as "on a par" (points; the paper's ID gap is 0.4).
PAR_MARGIN = 1.0
#: ``above``: "≳ v" is shown when the mean is above v − ABOVE_MARGIN·v (10% of the value).
ABOVE_MARGIN = 0.10
#: ``near``: "≈ v" is shown when the mean is within v ± NEAR_MARGIN·v (20% of the value).
NEAR_MARGIN = 0.20
_SPREAD = "norm spread (90% of attended norms within ±), layer {layer}"
#: ``scripts/coupling_seeds.py``'s measure (docs/data/coupling_values.csv): the thesis, tested directly.
_COUPLING = "attention moved by halving the token component (total, {subspace})"
COUPLING = ROOT / "docs" / "data" / "coupling_values.csv"


@dataclass(frozen=True)
class Claim:
    """One claim of Menary et al. 2024 (§4), the per-seed measure that tests it and its rule."""

    text: str        # the claim, as the README states it
    paper: str       # the paper's figure
    quantity: str    # ``seed_values.csv`` "quantity"
    rule: str        # one of RULES
    sign: int = 1    # order: +1 if the paper says A > B (Pre-Norm above QKV-Norm), -1 if A < B
    value: float = math.nan  # above / near: the paper's value, in the measure's unit
    group: str = ""  # claims with one group share a README row (the per-layer ones) ...
    part: str = ""   # ... each named by its part there ("layer 0")
    # scaling -> why the comparison holds by construction (then an identity, outside the family). None of
    # CLAIMS is one: the q/k-gain bound leaves 1 to 4 heads of every QKV-cal seed able to reach 0.99 on
    # two-key rows, so QKV-cal's 0% of rows at >= 0.99 is a measurement, not a construction.
    identity: dict = field(default_factory=dict)
    control: str = ""  # a control measure shown beside the claim's (same test, raw p; not in the family)

    @property
    def margin(self) -> float:
        return {"same": PAR_MARGIN, "above": ABOVE_MARGIN * self.value, "near": NEAR_MARGIN * self.value}.get(
            self.rule, math.nan)


CLAIMS = (
    Claim("ID accuracy on a par", "91.4 vs 91.0%", "ID accuracy", "same"),
    Claim("QKV-Norm interpolates worse", "87.5 vs 82.5%", "interpolation accuracy", "order", +1),
    Claim("QKV-Norm extrapolates worse", "66.7 vs 46.8%", "extrapolation accuracy", "order", +1),
    Claim("1% norm noise costs Pre-Norm ≳ 10 points", "≳ 10",
          "accuracy lost to 1% noise (all rows, before any norm)", "above", value=10.0),
    Claim("1% of Pre-Norm's sparse rows collapse at 11% noise (loose)", "11%",
          "1% loose collapse level, per-layer protocol", "near", value=11.0),
    *(Claim(f"Pre-Norm: 90% of attended norms within ±20%, layer {layer}", "±20%", _SPREAD.format(layer=layer),
            "near", value=20.0, group="Pre-Norm: 90% of attended norms within ±20%", part=f"layer {layer}")
      for layer in range(3)),
    *(Claim(f"QKV-Norm's norm spread is much wider, layer {layer}", "wider", _SPREAD.format(layer=layer), "order", -1,
            group="QKV-Norm's norm spread is much wider", part=f"layer {layer}") for layer in range(3)),
    Claim("attention peaks at 1 in Pre-Norm, not QKV-Norm (rows at ≥ 0.99)", "peak / none",
          "rows with max attention ≥ 0.99, all layers", "order", +1),
    Claim("thesis: halving the token component moves Pre-Norm's attention more (% TV)", "title claim",
          _COUPLING.format(subspace="token component"), "order", +1,
          control=_COUPLING.format(subspace="equal-norm random subspace")),
)


def _arm(values: pd.DataFrame, quantity: str, norm: str, cal: str) -> tuple[np.ndarray, np.ndarray]:
    """(values, lower bounds) of one arm's seeds for ``quantity``: a reached value, or the bound of a
    never-reached collapse level (``censored_above``); seeds with neither are left out."""
    d = values[(values["quantity"] == quantity) & (values["attn_norm"] == norm) & (values["calibration"] == cal)]
    d = d.sort_values("seed")
    v = d["value"].to_numpy(float)
    c = d["censored_above"].to_numpy(float) if "censored_above" in d.columns else np.full(len(d), np.nan)
    censored = ~np.isfinite(v) & np.isfinite(c)
    keep = np.isfinite(v) | censored
    return np.where(censored, c, v)[keep], censored[keep]


def _ci(m: float, lo: float, hi: float) -> str:
    return _num(m) if math.isnan(lo) else f"{_num(m)} [{_num(lo)}, {_num(hi)}]"


def _two_arm_tests(claim: Claim, a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(p for, p against) of an ``order`` or ``same`` claim."""
    if claim.rule == "order":
        towards, away = ("greater", "less") if claim.sign > 0 else ("less", "greater")
        return (permutation_test(a, b, alternative=towards).p_value,
                permutation_test(a, b, alternative=away).p_value)
    m = claim.margin
    outside = min(permutation_test(a, b, alternative="greater", shift=m).p_value,
                  permutation_test(a, b, alternative="less", shift=-m).p_value)
    return tost_permutation(a, b, m), min(1.0, 2 * outside)


def _value_tests(claim: Claim, a: np.ndarray, censored: bool) -> tuple[float, float]:
    """(p for, p against) of an ``above`` or ``near`` claim on arm A's seeds."""
    v, m = claim.value, claim.margin
    if claim.rule == "above":
        return (t_test_value(a, v - m, alternative="greater"), t_test_value(a, v - m, alternative="less"))
    if censored:  # lower bounds: "above v + m" can be shown, "within" cannot
        return math.nan, t_test_value(a, v + m, alternative="greater")
    outside = min(t_test_value(a, v + m, alternative="greater"), t_test_value(a, v - m, alternative="less"))
    return tost_value(a, v, m), min(1.0, 2 * outside)


def tests(values: pd.DataFrame) -> pd.DataFrame:
    """One row per (claim, scaling): the measure, its interval, and the raw p for and against."""
    rows = []
    for claim in CLAIMS:
        for scaling, cal, (label_a, norm_a), (label_b, norm_b) in PAIRS:
            a, ca = _arm(values, claim.quantity, norm_a, cal)
            b, _ = _arm(values, claim.quantity, norm_b, cal)
            if not len(a):
                continue
            row = dict(claim=claim.text, group=claim.group or claim.text, part=claim.part, paper=claim.paper,
                       rule=claim.rule, margin=claim.margin, scaling=scaling, arm_a=label_a, arm_b=label_b,
                       n_a=len(a), n_b=len(b), n_censored_a=int(ca.sum()), mean_a=float(a.mean()),
                       identity=claim.identity.get(scaling, ""), p_for=math.nan, p_against=math.nan)
            row["ci_lo_a"], row["ci_hi_a"] = t_interval(a)
            if claim.rule in ("order", "same"):
                row["mean_b"] = float(b.mean()) if len(b) else math.nan
                row["diff"] = row["mean_a"] - row["mean_b"]
                row["diff_lo"], row["diff_hi"] = welch_interval(a, b) if len(b) else (math.nan, math.nan)
                enough = min(len(a), len(b)) >= MIN_SEEDS
                if enough:
                    row["p_for"], row["p_against"] = _two_arm_tests(claim, a, b)
            elif len(a) >= MIN_SEEDS:
                row["p_for"], row["p_against"] = _value_tests(claim, a, bool(ca.any()))
            row["control"] = _control(values, claim, norm_a, norm_b, cal) if claim.control else ""
            rows.append(row)
    return pd.DataFrame(rows)


def _control(values: pd.DataFrame, claim: Claim, norm_a: str, norm_b: str, cal: str) -> str:
    """The control measure's A vs B in words, with the claim's test in the claim's direction (raw p)."""
    a, _ = _arm(values, claim.control, norm_a, cal)
    b, _ = _arm(values, claim.control, norm_b, cal)
    if min(len(a), len(b)) < MIN_SEEDS:
        return ""
    lo, hi = welch_interval(a, b)
    p = _two_arm_tests(claim, a, b)[0]
    return f"control (equal-norm random subspace): {_num(a.mean())} vs {_num(b.mean())}, A − B {_ci(a.mean() - b.mean(), lo, hi)}, raw p {_p(p)}"


def verdicts(values: pd.DataFrame) -> pd.DataFrame:
    """:func:`tests` with Holm-adjusted p over the family (identities left out) and each verdict."""
    t = tests(values)
    member = t["identity"] == ""
    family = np.concatenate([t["p_for"].where(member), t["p_against"].where(member)])
    adjusted = holm(family)
    t["holm_for"], t["holm_against"] = adjusted[:len(t)], adjusted[len(t):]
    t["verdict"] = [_verdict(r) for r in t.itertuples()]
    t["evidence"] = [_evidence(r) for r in t.itertuples()]
    return t


def _verdict(r) -> str:
    if r.identity:
        return "identity"
    if math.isnan(r.p_for) and math.isnan(r.p_against):
        return "not established"
    if r.holm_for < ALPHA:
        return "reproduced"
    if r.holm_against < ALPHA:
        return "not reproduced (reversed)" if r.rule == "order" else "not reproduced"
    return "not established"


def _p(p: float) -> str:
    return "—" if math.isnan(p) else f"{p:.2g}"


def _evidence(r) -> str:
    if r.rule in ("order", "same"):
        text = f"{r.arm_a} {_num(r.mean_a)} vs {r.arm_b} {_num(r.mean_b)}, A − B {_ci(r.diff, r.diff_lo, r.diff_hi)}"
    else:
        text = _ci(r.mean_a, r.ci_lo_a, r.ci_hi_a) + (f", {r.n_censored_a} seed(s) never reached: lower bounds"
                                                       if r.n_censored_a else "")
    if r.identity:
        return f"{text}; {r.identity}"
    control = f"; {r.control}" if r.control else ""
    return f"{text}, Holm p {_p(r.holm_for)} for / {_p(r.holm_against)} against{control}"


def _seeds_line(v: pd.DataFrame) -> str:
    parts = []
    for scaling, s in v.groupby("scaling", sort=False):
        r = s.iloc[0]
        parts.append(f"{r['arm_a']} {int(s['n_a'].max())} and {r['arm_b']} {int(s['n_b'].max())} seeds ({scaling})")
    return "; ".join(parts)


def readme_block(values: pd.DataFrame) -> str:
    v = verdicts(values)
    scalings = list(dict.fromkeys(v["scaling"]))
    n_family = int(v.loc[v["identity"] == "", ["p_for", "p_against"]].notna().to_numpy().sum())
    lines = [f"The paper's claims against the shipped seeds, {_seeds_line(v)} ([tables](docs/findings-tables.md), "
             "[reasoning and controls](docs/results.md#findings)). Each claim has a one-sided or equivalence test "
             "for it and one against it (rules and margins in `scripts/verdicts.py`); the verdict is decided on "
             f"Holm-adjusted p < {ALPHA} over the family of all {n_family} such tests, recomputed from the unrounded "
             "per-seed values in `docs/data/seed_values.csv` (the thesis row: `docs/data/coupling_values.csv`, from `scripts/coupling_seeds.py`) by `python scripts/verdicts.py`. Intervals: "
             "Student-t 95% over seeds (Welch for A − B); identities (true by construction) are outside the family:",
             "", "| paper's claim | " + " | ".join(scalings) + " |", "|---" * (len(scalings) + 1) + "|"]
    for group, g in v.groupby("group", sort=False):
        cells = []
        for scaling in scalings:
            c = g[g["scaling"] == scaling]
            kinds = list(dict.fromkeys(c["verdict"]))
            part = lambda r: f"{r.part} " if r.part else ""  # noqa: E731
            if len(kinds) == 1:
                cells.append(f"{kinds[0]}: " + "; ".join(f"{part(r)}{r.evidence}" for r in c.itertuples()))
            else:
                cells.append("; ".join(f"{part(r)}{r.verdict}: {r.evidence}" for r in c.itertuples()))
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def results_block(values: pd.DataFrame) -> str:
    v = verdicts(values)
    lines = ["| paper's claim (Menary et al. 2024) | paper | scaling | seeds (A / B) | here (95% t-interval) | rule, margin "
             "| p for / against (raw) | Holm p for / against | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for r in v.itertuples():
        here = r.evidence.split(", Holm p")[0] + (f"; {r.control}" if r.control else "")
        margin = "" if math.isnan(r.margin) else f", ±{r.margin:.2g}"
        lines.append(f"| {r.claim} | {r.paper} | {r.scaling} | {r.n_a} / {r.n_b} | {here} | {r.rule}{margin} | "
                     f"{_p(r.p_for)} / {_p(r.p_against)} | {_p(r.holm_for)} / {_p(r.holm_against)} | {r.verdict} |")
    return "\n".join(lines) + ("\n\nGenerated by `scripts/verdicts.py` from the unrounded per-seed values in "
                               "`docs/data/seed_values.csv` (the thesis: `docs/data/coupling_values.csv`); its docstring states the rules, "
                               "the margins and the family.")


def family_table(values: pd.DataFrame) -> pd.DataFrame:
    """The family, one row per test: claim, scaling, which test, raw and Holm-adjusted p."""
    v = verdicts(values)
    rows = [dict(claim=r.claim, scaling=r.scaling, test=side, p_raw=getattr(r, f"p_{side}"),
                 p_holm=getattr(r, f"holm_{side}"), verdict=r.verdict)
            for r in v.itertuples() if not r.identity for side in ("for", "against")
            if not math.isnan(getattr(r, f"p_{side}"))]
    return pd.DataFrame(rows)


def load(report: str | None) -> pd.DataFrame:
    """The per-seed values, with the coupling measure (``scripts/coupling_seeds.py --write``) when it exists."""
    values = pd.read_csv(Path(report) / "seed_numbers.csv" if report else DATA)
    return pd.concat([values, pd.read_csv(COUPLING)], ignore_index=True) if COUPLING.exists() else values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report", nargs="?", help="a report folder with seed_numbers.csv (default: docs/data/seed_values.csv)")
    ap.add_argument("--write", action="store_true", help="rewrite README.md's VERDICTS and docs/results.md's CLAIMS blocks")
    args = ap.parse_args()
    values = load(args.report)
    fam = family_table(values)
    with pd.option_context("display.width", 200, "display.max_colwidth", 70, "display.max_rows", 200):
        print(f"The family: {len(fam)} tests (Holm over all of them; identities left out)\n")
        print(fam.to_string(index=False, float_format=lambda x: f"{x:.4g}"), "\n")
    readme, results = readme_block(values), results_block(values)
    print(readme, "\n", results, sep="\n")
    if args.write:
        replace_block("VERDICTS", readme, page=README)
        replace_block("CLAIMS", results, page=RESULTS)


if __name__ == "__main__":
    main()
