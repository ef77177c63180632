"""The dashboard's sections: every registered analysis's panels, the seed sections and the real models.

Each analysis of :data:`interp_norm.report.registry.REGISTRY` names its panel builder (``figure``, in
:mod:`interp_norm.report.dashboard.panels` for the built-in ones); panels of analyses that name the same
section are shown together, sections in :data:`PAGE_ORDER` (a new anchor goes before the real-model
section). A figure whose table is missing is left out, one that fails to build becomes a note on the page.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import pandas as pd
import plotly.graph_objects as go

from interp_norm.report import plots
from interp_norm.report.dashboard.attribution_error import attribution_error_section
from interp_norm.report.dashboard.page import Panel, Section
from interp_norm.report.dashboard.panels import models_finding
from interp_norm.report.dashboard.story import lead
from interp_norm.report.plots._style import fit_layout

__all__ = ["figure_sections", "models_finding", "PAGE_ORDER"]

#: Where each section sits on the page (anchors; sections a registered analysis adds come after these, the
#: real-model section last): what is established first, then the paper's chain models → circuits → noise →
#: collapse → geometry, then the evidence over seeds and the controls.
PAGE_ORDER = ("verdicts", "models", "attention", "circuits", "addition-circuit", "attribution-error", "noise",
              "collapse", "geometry", "seeds", "seed-comparisons", "controls", "controls-23")


def figure_sections(report: Any, strict: bool = False, csv: bool = True) -> tuple[list[Section], list[str]]:
    """The dashboard's sections from a report's tables; returns ``(sections, problems)``.

    A figure whose table is missing is left out; a figure that fails to build is replaced by a
    note (``strict=True`` raises instead, for tests). ``csv``: whether the report's tables are
    written beside the page as CSVs (captions point at them only then). Every figure goes
    through :func:`~interp_norm.report.plots._style.fit_layout`.
    """
    from interp_norm.report.registry import REGISTRY, resolve

    T: dict[str, pd.DataFrame] = report.tables
    problems: list[str] = []

    def panel(title: str, build: Callable[[], go.Figure], caption: str = "", kind: str = "figure") -> Optional[Panel]:
        try:
            return Panel(title, figure=fit_layout(build()), caption=caption, kind=kind)
        except Exception as e:
            if strict:
                raise
            problems.append(f"{title}: {type(e).__name__}: {e}")
            return None

    by_anchor: dict[str, Section] = {}
    for analysis in REGISTRY:
        for s in resolve(analysis.figure)(T, panel, csv):
            if s.anchor in by_anchor:
                by_anchor[s.anchor].panels.extend(s.panels)
            else:
                by_anchor[s.anchor] = s
    from interp_norm.report.dashboard.verdicts import seed_tables_for, verdict_section
    from interp_norm.stats.shipped import shipped_checkpoints

    seed_T, seed_source = seed_tables_for(report)  # the shipped 6-seed tables for the shipped checkpoints
    verdicts = verdict_section(report)  # "What is established", first on the page
    for s in (_spread_sections(T, csv) + _seed_sections(seed_T, panel, seed_source)
              + attribution_error_section(T, panel, csv, shipped_checkpoints(getattr(report, "checkpoints", None))) + ([verdicts] if verdicts else [])):
        by_anchor[s.anchor] = s
    rank = {a: i for i, a in enumerate(PAGE_ORDER)}
    sections = sorted(by_anchor.values(), key=lambda s: rank.get(s.anchor, len(rank)))
    from interp_norm.report.dashboard.real_models import real_model_section

    real = real_model_section(report, panel)
    if real is not None:
        sections.append(real)
    for s in sections:
        try:
            s.lead = s.lead or lead(s.anchor, T)
        except Exception as e:
            if strict:
                raise
            problems.append(f"{s.title}: opening sentence: {type(e).__name__}: {e}")
    return sections, problems


def _spread_sections(T: dict, csv: bool = True) -> list[Section]:
    """Spread over seeds: each headline number per variant, with every seed's value."""
    out = []
    if "seed_spread" in T:
        s = Section("Spread over seeds", "Each headline number per variant: mean ± half the range over the seeds "
                    "analysed, with every seed's value" + (" (seed_spread.csv; per checkpoint in seed_numbers.csv)" if csv
                                                           else "") + ". A "
                    "difference between variants smaller than this spread is not a finding.", anchor="seeds")
        view = T["seed_spread"].copy()
        view["mean ± half range"] = [("—" if pd.isna(m) else f"{m:.1f} ± {h:.1f}") for m, h in zip(view["mean"], view["half_range"])]
        s.panels.append(Panel("Headline numbers over seeds", kind="table", table=view[
            ["attn_norm", "calibration", "quantity", "unit", "mean ± half range", "values", "n_seeds"]],
            caption="'—': not reached within the tested noise levels (collapse) or not applicable."))
        out.append(s)
    return out


def _seed_sections(T: dict, panel: Callable, source: str = "") -> list[Section]:
    """Variant A vs B over seeds (seed_comparisons.csv, seed_matched_id.csv): dot-and-range figures and the table;
    ``source``: where the tables come from when they are not the report's own."""
    comp, vals = T.get("seed_comparisons"), T.get("seed_comparison_values")
    if comp is None or not len(comp) or vals is None:
        return []
    s = Section("Variants compared over seeds", (f"{source} " if source else "") +
                "Every comparison the findings make, per score scaling: a dot per seed (its shape is the seed), the "
                "mean with its Student-t 95% interval over seeds beside it (Welch's for the difference), and in each "
                "panel's title the two-sided exact permutation p-value of the difference of means (every split of the "
                "seeds). The verdicts rest on one-sided and equivalence tests with Holm's adjustment (What is established, "
                "docs/findings-tables.md)." + ("" if source else " Tables: seed_comparisons.csv (per-seed values in "
                                              "seed_comparison_values.csv), seed_matched_id.csv."), anchor="seed-comparisons")
    for scaling in dict.fromkeys(comp["scaling"]):
        s.panels.append(panel(f"Over seeds: {scaling}", lambda scaling=scaling: plots.plot_seed_comparisons(
            comp, vals, scaling)))
    m, mv = T.get("seed_matched_id"), T.get("seed_matched_id_values")
    if m is not None and len(m) and mv is not None:
        for scaling in dict.fromkeys(m.loc[m["at"] == "matched ID", "scaling"]):
            s.panels.append(panel(f"At matched ID accuracy: {scaling}", lambda scaling=scaling: plots.plot_matched_id(
                m, mv, scaling), caption="From the training curves (ID / interp / extrap accuracy every 1 000 steps, "
                                         "512 problems per split): each run's OOD accuracy where its ID accuracy first "
                                         "reaches the value on the x axis; the end-of-training rows are in "
                                         "seed_matched_id.csv."))
    view = comp.copy()
    fmt = lambda m, lo, hi: "—" if pd.isna(m) else f"{m:.1f} [{'—' if pd.isna(lo) else f'{lo:.1f}, {hi:.1f}'}]"  # noqa: E731
    view["A: mean [95% CI]"] = [fmt(*x) for x in zip(view["mean_a"], view["ci_lo_a"], view["ci_hi_a"])]
    view["B: mean [95% CI]"] = [fmt(*x) for x in zip(view["mean_b"], view["ci_lo_b"], view["ci_hi_b"])]
    view["A − B [95% CI]"] = [fmt(*x) for x in zip(view["diff"], view["diff_lo"], view["diff_hi"])]
    view["p"] = [("—" if pd.isna(p) else f"{p:.2g}") for p in view["p_value"]]
    s.panels.append(Panel("Comparisons over seeds", kind="table", table=view[
        ["scaling", "comparison", "unit", "arm_a", "values_a", "A: mean [95% CI]", "arm_b", "values_b",
         "B: mean [95% CI]", "A − B [95% CI]", "p"]],
        caption="Per seed (s0, s1, ...), mean and Student-t 95% interval per arm, the difference with its interval, "
                "and the permutation p-value (uncorrected for the number of comparisons)."))
    s.lead = lead("seed-comparisons", T)  # from the tables drawn (the shipped 6-seed ones for the shipped set)
    return [s]
