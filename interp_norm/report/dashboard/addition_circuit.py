"""The dashboard section "The addition circuit": per variant, the circuit's verification, its cells with
their roles by layer and answer position, the size-vs-accuracy curve, and the generated account; for the
shipped set, the same from the kept 24-checkpoint tables with the circuit vs matched-control noise cost
(:mod:`~interp_norm.report.dashboard.shipped_circuit`)."""

from __future__ import annotations

from typing import Optional

import pandas as pd
import plotly.graph_objects as go

from interp_norm.report.dashboard.page import Panel, Section
from interp_norm.report.dashboard.shipped_circuit import shipped_panels

TITLE = "The addition circuit"
INTRO = ("Cells are (layer, head, answer position): one head's output at the rows predicting the answer's sign, "
         "one of its digits (by place value) or the closing ']'. The circuit is the smallest set of cells, grown "
         "in the order of single-cell necessity, that keeps 90% of per-token accuracy when every other cell is "
         "resample-ablated (its z rows taken from a problem of the same layout); mean and zero ablation are "
         "reported beside it. A cell's role comes from a stated rule on its attention mass per token class "
         "(≥ 60% on one class: 'reads X').")


def plot_circuit_curve(curve: pd.DataFrame) -> go.Figure:
    """Per-token accuracy with every cell outside the first k ablated, against k as a share of all cells."""
    fig = go.Figure()
    for name, g in curve.groupby("checkpoint", sort=False):
        fig.add_trace(go.Scatter(x=g["share_of_cells"], y=g["accuracy_kept"], mode="lines+markers", name=str(name),
                                 text=g["added"], hovertemplate="%{text}: %{y:.3f}<extra>%{fullData.name}</extra>"))
    fig.add_hline(y=0.9, line_dash="dot")
    fig.update_layout(xaxis_title="cells kept (share of all cells)", yaxis_title="share of full accuracy kept",
                      template="plotly_white")
    return fig


def addition_circuit(T: dict, panel, csv: bool = True) -> list[Section]:
    panels: list[Optional[Panel]] = []
    if "addition_verification" in T:
        v = T["addition_verification"]
        cols = [c for c in ("variant", "checkpoint", "ablation", "cells", "n_cells", "share_of_cells", "accuracy_full",
                            "accuracy_circuit", "accuracy_none", "accuracy_kept", "faithfulness") if c in v.columns]
        panels.append(Panel("Circuit size and verification", kind="table", table=v[cols],
                            caption="accuracy_kept = circuit / full per-token accuracy; faithfulness = logit-difference "
                                    "share recovered, (circuit - none) / (full - none)."
                                    + (" addition_verification.csv." if csv else "")))
    if "addition_curve" in T:
        curve = T["addition_curve"]
        panels.append(panel("Size vs accuracy", lambda: plot_circuit_curve(curve)))
    if "addition_circuit" in T:
        c = T["addition_circuit"]
        cols = [k for k in ("variant", "checkpoint", "position", "layer", "head", "role", "top_class", "top_mass",
                            "accuracy_drop") if k in c.columns]
        panels.append(Panel("Circuit cells and their roles", kind="table", table=c[cols],
                            caption="accuracy_drop: per-token accuracy lost when the cell alone is ablated."
                                    + (" addition_circuit.csv, addition_roles.csv (every cell)." if csv else "")))
    if "addition_account" in T:
        a = T["addition_account"]
        panels.append(Panel("In plain words", kind="table", table=a[[k for k in ("checkpoint", "account") if k in a]]))
    panels += shipped_panels(T, panel, csv)
    shown = [p for p in panels if p is not None]
    return [Section(TITLE, INTRO, shown, anchor="addition-circuit")] if shown else []


__all__ = ["addition_circuit", "plot_circuit_curve"]
