"""The dashboard's first section, "What is established": the paper's claims with their verdicts.

The verdicts are decided by :mod:`interp_norm.stats.verdicts` from the shipped 6-seed tables
(:mod:`interp_norm.stats.shipped`, ``make reproduce-seeds``), never from a quick report's two seeds, on
which no difference can be shown. They are about the shipped checkpoints, so the section is shown only
when the report is of them (some of its checkpoints are shipped seed checkpoints, by folder or weights);
for other checkpoints the page says in one line why it is absent. The same rule lets the "Variants
compared over seeds" figures read the 6-seed tables (:func:`seed_tables_for`).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import pandas as pd

from interp_norm.report.dashboard.page import Panel, Section
from interp_norm.stats.shipped import seed_tables_dir, seed_values, shipped_in, shipped_seed_tables
from interp_norm.stats.verdicts import ALPHA, family_sizes, fmt_num, fmt_p, verdicts

__all__ = ["ANCHOR", "SOURCE", "verdict_table", "verdict_section", "verdict_note", "seed_tables_for"]

ANCHOR = "verdicts"
#: Where the section's numbers come from, said in its captions.
SOURCE = ("the shipped 6-seed tables (data/seed_tables/, written by `make reproduce-seeds`: 24 checkpoints, "
          "6 seeds × Pre-Norm, QKV-Norm, Pre-cal, QKV-cal)")


def _p_pair(a: float, b: float) -> str:
    return f"{fmt_p(a)} / {fmt_p(b)}"


def _here(r: Any) -> str:
    """The measured values: A vs B with the difference's interval, or A's mean with its interval."""
    if r.rule in ("order", "same"):
        text = f"{fmt_num(r.mean_a)} vs {fmt_num(r.mean_b)}, A − B {fmt_num(r.diff)}"
        return text + ("" if math.isnan(r.diff_lo) else f" [{fmt_num(r.diff_lo)}, {fmt_num(r.diff_hi)}]")
    text = f"{fmt_num(r.mean_a)}" + ("" if math.isnan(r.ci_lo_a) else f" [{fmt_num(r.ci_lo_a)}, {fmt_num(r.ci_hi_a)}]")
    return text + (f", {r.n_censored_a} never reached (lower bounds)" if r.n_censored_a else "")


def verdict_table(v: pd.DataFrame) -> pd.DataFrame:
    """The verdicts of :func:`interp_norm.stats.verdicts.verdicts` as the page shows them: one row per claim
    and score scaling, the verdict beside the claim; identities say so and carry no Holm p (they are
    outside the family)."""
    rows = []
    for r in v.itertuples():
        two_arms = r.rule in ("order", "same")
        margin = "" if math.isnan(r.margin) else f", ±{r.margin:.2g}"
        rows.append({
            "scaling": r.scaling, "claim": r.claim,
            "verdict": f"identity: {r.identity}" if r.identity else r.verdict,
            "here (t 95% interval)": _here(r), "paper": r.paper, "rule": f"{r.rule}{margin}",
            "raw p for / against": _p_pair(r.p_for, r.p_against),
            "Holm p for / against": "outside the family" if r.identity else _p_pair(r.holm_for, r.holm_against),
            "arms (seeds)": f"{r.arm_a} ({r.n_a}) vs {r.arm_b} ({r.n_b})" if two_arms else f"{r.arm_a} ({r.n_a})",
            "measure": r.quantity,
        })
    return pd.DataFrame(rows)


def _beside(v: pd.DataFrame) -> str:
    """The controls and robustness checks, outside the family, in words."""
    parts = [f"{r.claim} ({r.scaling}): {x}" for r in v.itertuples() for x in (r.control, r.robustness) if x]
    return (" Beside the claims, outside the family: " + "; ".join(parts) + ".") if parts else ""


def _intro(v: pd.DataFrame, shipped: list[str]) -> str:
    n_for, n_against = family_sizes(v)
    return (f"The paper's claims (Menary et al. 2024, §4) tested on {SOURCE}, not on this report's own analyses "
            f"(of the checkpoints those tables describe, this report analyses {len(shipped)}). Each claim has a "
            "one-sided or equivalence test for it and one against it; a verdict needs Holm-adjusted p < "
            f"{ALPHA} within its family (the {n_for} tests for, the {n_against} against), and no verdict rests on an "
            "interval's far end (rules and margins: interp_norm.stats.verdicts).")


def _lead(v: pd.DataFrame) -> str:
    """What to look at: the tally, then the claims decided either way."""
    counts = v["verdict"].value_counts()
    tally = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    parts = [f"Read the verdict column first: of {len(v)} claim × scaling rows, {tally}."]
    for kind in ("reproduced", "not reproduced", "not reproduced (reversed)"):
        rows = v[v["verdict"] == kind]
        if len(rows):
            parts.append(kind[0].upper() + kind[1:] + ": " + "; ".join(f"{r.claim} ({r.scaling})" for r in rows.itertuples())
                         + ".")
    return " ".join(parts)


def verdict_section(report: Any) -> Optional[Section]:
    """"What is established", or None when the report is not of the shipped seed checkpoints."""
    shipped = shipped_in(getattr(report, "checkpoints", None))
    values = seed_values() if shipped else None
    if values is None:
        return None
    v = verdicts(values)
    table = verdict_table(v)
    caption = ("Intervals: Student-t 95% over seeds (Welch for A − B). 'not established': neither test survives "
               "Holm; 'not reproduced': the test against does.")
    panels = [Panel(f"{v.loc[g.index[0], 'arm_a']} vs {v.loc[g.index[0], 'arm_b']} ({scaling})", kind="table",
                    table=g.drop(columns="scaling").reset_index(drop=True), caption=caption, fold=False)  # what the page opens on
              for scaling, g in table.groupby("scaling", sort=False)]
    beside = _beside(v)
    if beside:
        panels[-1].caption += beside
    section = Section("What is established", _intro(v, shipped), anchor=ANCHOR, panels=panels)
    section.lead = _lead(v)
    return section


def verdict_note(report: Any) -> str:
    """One line saying why the verdicts are absent ('' when they are shown or the report has none of our models)."""
    ck = getattr(report, "checkpoints", None)
    if ck is None or not len(ck) or shipped_in(ck):
        return ""
    if seed_values() is None:
        return (f"No verdict table: no shipped seed tables in {seed_tables_dir()} (`make reproduce-seeds` writes "
                "them).")
    return ("No verdict table: the paper's verdicts are decided on the shipped seed checkpoints' 6-seed tables "
            "(data/seed_tables/), and none of this report's checkpoints is one of them.")


def seed_tables_for(report: Any) -> tuple[dict, str]:
    """The tables the "Variants compared over seeds" section draws, and where they come from: the shipped 6-seed
    tables when the report is of the shipped checkpoints and its own seed comparison (if any) covers none but
    them; else the report's tables and ''."""
    T = report.tables
    shipped = set(shipped_in(getattr(report, "checkpoints", None)))
    own = T.get("seed_comparison_values")
    if not shipped or (own is not None and len(own) and not set(own["checkpoint"].astype(str)) <= shipped):
        return T, ""
    tables = shipped_seed_tables()
    if not tables:
        return T, ""
    return {**T, **tables}, f"From {SOURCE}, not this report's own seeds."
