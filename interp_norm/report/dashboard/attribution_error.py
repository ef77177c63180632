"""The dashboard section "Attribution's error against exact patching": the error budget per variant and method.

The numbers come from ``scripts/attribution_error_budget.py`` (every shipped seed, about two minutes on one
thread), not from ``reproduce``: a report whose checkpoints are all shipped ones (the same folders or the same weights) shows the shipped table
(``data/seed_tables/attribution_error_per_checkpoint.csv``) for its variants; a report that carries its own
``attribution_error_per_checkpoint`` table shows that one; any other report has no such section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

import pandas as pd

from interp_norm.report import plots
from interp_norm.stats.shipped import seed_tables_dir
from interp_norm.report.dashboard.page import Panel, Section

__all__ = ["attribution_error_section", "budget_table", "SHIPPED", "KEY"]

KEY = "attribution_error_per_checkpoint"
#: The shipped table, among the seed tables of the data folder (:func:`interp_norm.stats.shipped.seed_tables_dir`).
SHIPPED = seed_tables_dir() / f"{KEY}.csv"
TITLE = "Attribution's error against exact patching"
INTRO = ("How far attribution (AtP, AtP*, EAP, EAP-IG) is from exact activation patching, the ground truth, and "
         "which nonlinearity carries the error: per node the mean over pairs of |estimate − exact|, summed over every "
         "head output, head input (q, k, v) and MLP, as % of the exact effects' size (100% is no better than "
         "attributing nothing). The bar splits the live error into the part freezing the norms' scales in the backward "
         "pass removes, the part freezing the attention patterns then removes, and the rest; a part below 0 means "
         "freezing made the estimate worse. Pre-Norm vs QKV-Norm over seeds, with intervals and tests: "
         "docs/findings-tables.md (ATTRIBUTION-ERROR).")


def budget_table(T: dict, shipped_checkpoints: Sequence[str] = (), shipped: Path = SHIPPED) -> Optional[pd.DataFrame]:
    """The report's own budget table, else the shipped one restricted to the report's variants when every
    checkpoint the report evaluated is a shipped one (``shipped_checkpoints``: the report's checkpoints that
    are, by :func:`interp_norm.stats.shipped.is_shipped_checkpoint`), else None."""
    if KEY in T:
        return T[KEY]
    ev = T.get("evaluation")
    if ev is None or "checkpoint" not in ev.columns or not len(ev) or not shipped.exists():
        return None
    names = set(map(str, ev["checkpoint"]))
    if not names <= set(shipped_checkpoints):
        return None
    table = pd.read_csv(shipped)
    arms = {n.split("-s")[0] for n in names}
    table = table[table["arm"].isin(arms)]
    return table if len(table) else None


def attribution_error_section(T: dict, panel: Callable, csv: bool = True, shipped_checkpoints: Sequence[str] = (),
                              shipped: Path = SHIPPED) -> list[Section]:
    table = budget_table(T, shipped_checkpoints, shipped)
    if table is None:
        return []
    source = "this report's attribution_error_per_checkpoint.csv" if KEY in T else (
        "the shipped data/seed_tables/attribution_error_per_checkpoint.csv, every shipped seed of these variants")
    panels = [panel("Error budget, every node", lambda: plots.plot_error_budget(table),
                    caption="Bars: the parts, mean over seeds; red bar: their sum, the live error; dots: each seed's "
                            "live (filled) and frozen-norm (open) error. Where freezing the norm makes the estimate "
                            f"worse its part is below 0, and the stack above 0 is the frozen-norm error. From {source}.")]
    view = table[table["activation"] != "all"].groupby(["arm", "method", "activation"], sort=False).agg(
        seeds=("checkpoint", "nunique"), live=("rel_err_live", "mean"), norm_frozen=("rel_err_norm", "mean"),
        both_frozen=("rel_err_both", "mean")).reset_index()
    for c in ("live", "norm_frozen", "both_frozen"):
        view[c] = (100 * view[c]).round(1)
    panels.append(Panel("Relative error per node kind (%)", kind="table", table=view,
                        caption="Mean over seeds of the relative error with the norms and patterns live, the norms "
                                "frozen, and both frozen; z: a head's output, q/k/v: its inputs, mlp_out: an MLP."))
    section = Section(TITLE, INTRO, [p for p in panels if p is not None], anchor="attribution-error")
    section.lead = _lead(table)
    return [section]


def _lead(table: pd.DataFrame) -> str:
    """What to look at: EAP-IG's relative error per variant with the norms live and frozen (mean over seeds)."""
    rows = table[(table["activation"] == "all") & (table["method"] == "eap-ig")]
    if not len(rows):
        return ""
    m = rows.groupby("arm", sort=False)[["rel_err_live", "rel_err_norm"]].mean()
    parts = [f"{arm} {100 * r.rel_err_live:.0f}% live, {100 * r.rel_err_norm:.0f}% with the norms frozen"
             for arm, r in m.iterrows()]
    return "Look at the red bars, the live error, and at where freezing the norm moves it: EAP-IG " + "; ".join(parts) + "."
