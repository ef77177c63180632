"""Figures of the model card and training: DataFrames in (``card.model_card``, training curves), plotly out."""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from interp_norm.errors import ConfigError
from interp_norm.plots._style import PAPER_LINE, SPLITS, VARIANT_LABELS, escape, member_dashes, variant_colour, variant_label

__all__ = ["plot_model_card", "plot_accuracy_by_split", "plot_training_curves"]


def _fmt(v: Any, col: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if col.endswith("_acc") or col.endswith("_exact"):
        return f"{100 * v:.1f}%"
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, (int, np.integer)) and abs(int(v)) >= 10_000:
        return f"{int(v):,}"
    return escape(v)


def plot_model_card(card: pd.DataFrame, title: str = "Model card") -> go.Figure:
    """The :func:`model_card` table as a plotly table (accuracies in %, the paper's beside ours)."""
    if not isinstance(card, pd.DataFrame) or "checkpoint" not in card:
        raise ConfigError("plot_model_card expects the DataFrame from plots.model_card(...)")
    cols = list(card.columns)
    cells = [[_fmt(v, c) for v in card[c]] for c in cols]
    fig = go.Figure(go.Table(
        header=dict(values=[f"<b>{escape(c)}</b>" for c in cols], align="left", fill_color="#e8eef7"),
        cells=dict(values=cells, align="left"),
    ))
    fig.update_layout(title=title, height=120 + 32 * len(card), margin=dict(l=10, r=10, t=50, b=10))
    return fig


def plot_accuracy_by_split(card: pd.DataFrame, title: Optional[str] = None) -> go.Figure:
    """Per-token accuracy per split for every checkpoint (bars, the variant's colour; a second seed
    of a variant is dotted) with the paper's values (dashed lines in the variant's colour, black-edged
    markers, each with its own legend entry)."""
    fig = go.Figure()
    records = card.to_dict("records")
    labels = [variant_label(r["checkpoint"], r.get("attn_norm")) for r in records]
    dashes = member_dashes(labels)
    for r, label in zip(records, labels):
        fig.add_trace(go.Bar(
            x=list(SPLITS), y=[r.get(f"{s}_acc", math.nan) for s in SPLITS], name=escape(label),
            marker=dict(color=variant_colour(label), pattern_shape="" if dashes[label] == "solid" else ".",
                        line=dict(color="white", width=0.5)),
        ))
    shown = set()
    for r in records:
        a = r.get("attn_norm")
        if a in shown or all(math.isnan(r.get(f"paper_{s}_acc", math.nan)) for s in SPLITS):
            continue
        shown.add(a)
        nice = VARIANT_LABELS.get(a, a)
        fig.add_trace(go.Scatter(
            x=list(SPLITS), y=[r[f"paper_{s}_acc"] for s in SPLITS], mode="markers+lines",
            name=f"paper (Menary et al. 2024): {nice}",
            line=dict(PAPER_LINE, color=variant_colour(nice), dash="dash" if a == "pre" else "dashdot"),
            marker=dict(symbol="diamond-wide", size=11, color=variant_colour(nice), line=dict(color="black", width=1.5)),
        ))
    fig.update_layout(barmode="group", title=title or "Per-token accuracy per split (ours: bars; the paper: dashed lines)",
                      yaxis=dict(title="per-token accuracy", tickformat=".0%", range=[0, 1.02]), xaxis_title="split")
    return fig


def plot_training_curves(curves: pd.DataFrame, value: str = "loss") -> go.Figure:
    """Training curves (``value`` = loss or acc) vs examples seen, one line per checkpoint.

    ``curves``: the checkpoints' ``training_curve.csv`` rows with a ``checkpoint`` column.
    """
    if not isinstance(curves, pd.DataFrame) or not {"checkpoint", value} <= set(curves.columns):
        raise ConfigError(f"plot_training_curves expects a DataFrame with columns 'checkpoint' and {value!r}")
    x = "examples" if "examples" in curves else "step"
    fig = go.Figure()
    groups = [(variant_label(name, g["attn_norm"].iloc[0] if "attn_norm" in g else None), g)
              for name, g in curves.groupby("checkpoint", sort=False)]
    dashes = member_dashes(label for label, _ in groups)
    for label, g in groups:
        fig.add_trace(go.Scatter(x=g[x], y=g[value], mode="lines", name=escape(label),
                                 line=dict(color=variant_colour(label), dash=dashes[label])))
    fig.update_layout(title=f"Training {value}", xaxis_title=x, yaxis_title=value)
    if value == "loss":
        fig.update_yaxes(type="log")
    else:
        fig.update_yaxes(tickformat=".0%")
    return fig

