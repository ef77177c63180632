"""Figures of the model card and training: DataFrames in (``card.model_card``, training curves), plotly out."""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from interp_norm.errors import ConfigError
from interp_norm.report.plots._style import (
    PAPER_LINE,
    SPLITS,
    base_variant,
    VARIANT_LABELS,
    dodge,
    escape,
    line_style,
    log_axis,
    row_gap,
    variant_colour,
    variant_label,
)

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
    """Per-token accuracy per split for every checkpoint: one dot per checkpoint (the variant's
    colour, the seed's marker shape, open markers for a calibrated recipe; see
    :func:`~interp_norm.report.plots._style.member_style`), side by side within each split, with the
    paper's values (black-edged diamonds on a dashed line in the variant's colour)."""
    fig = go.Figure()
    records = card.to_dict("records")
    labels = [variant_label(r["checkpoint"], r.get("attn_norm")) for r in records]
    splits = [s for s in SPLITS if any(f"{s}_acc" in r for r in records)] or list(SPLITS)
    n = len(records)
    for i, (r, label) in enumerate(zip(records, labels)):
        x = [j + dodge(i, n, 0.45) for j in range(len(splits))]
        fig.add_trace(go.Scatter(
            x=x, y=[r.get(f"{s}_acc", math.nan) for s in splits], mode="markers", name=escape(label),
            hovertemplate=escape(label) + ": %{y:.1%}<extra></extra>", **line_style(label, size=10),
        ))
    shown = set()
    for r in records:
        a = r.get("attn_norm")
        if a in shown or all(math.isnan(r.get(f"paper_{s}_acc", math.nan)) for s in splits):
            continue
        shown.add(a)
        nice = VARIANT_LABELS.get(a, a)
        fig.add_trace(go.Scatter(
            x=list(range(len(splits))), y=[r[f"paper_{s}_acc"] for s in splits], mode="markers+lines",
            name=f"paper (Menary et al. 2024): {nice}",
            line=dict(PAPER_LINE, color=variant_colour(nice), width=1),
            marker=dict(symbol="diamond-wide", size=12, color=variant_colour(nice), line=dict(color="black", width=1.5)),
        ))
    fig.update_layout(title=title or "Per-token accuracy per split (dots: ours, one per checkpoint; diamonds: the paper)",
                      yaxis=dict(title="per-token accuracy", tickformat=".0%"), legend_title="checkpoint",
                      xaxis=dict(title="split", tickmode="array", tickvals=list(range(len(splits))), ticktext=splits,
                                 range=[-0.5, len(splits) - 0.5]))
    return fig


def plot_training_curves(curves: pd.DataFrame, value: str = "loss") -> go.Figure:
    """Training curves (``value`` = loss or acc) vs examples seen, one line per checkpoint (the
    variant's colour, the seed's dash and marker).

    ``curves``: the checkpoints' ``training_curve.csv`` rows with a ``checkpoint`` column.
    """
    if not isinstance(curves, pd.DataFrame) or not {"checkpoint", value} <= set(curves.columns):
        raise ConfigError(f"plot_training_curves expects a DataFrame with columns 'checkpoint' and {value!r}")
    x = "examples" if "examples" in curves else "step"
    groups = [(variant_label(name, g["attn_norm"].iloc[0] if "attn_norm" in g else None), g)
              for name, g in curves.groupby("checkpoint", sort=False)]
    # small multiples: one panel per variant, so its seeds and recipes are not drawn over the other variants'
    panels = list(dict.fromkeys(base_variant(label) or label for label, _ in groups))
    cols = 1 if len(panels) == 1 else 2
    rows = -(-len(panels) // cols)
    height = 120 + 230 * rows
    fig = make_subplots(rows=rows, cols=cols, shared_xaxes=True, shared_yaxes=True, horizontal_spacing=0.05,
                        vertical_spacing=row_gap(rows, height, 50, 0.12), subplot_titles=[escape(p) for p in panels])
    for label, g in groups:
        k = panels.index(base_variant(label) or label)
        st = line_style(label, width=1.5)
        st["marker"].update(maxdisplayed=10, size=7)
        fig.add_trace(go.Scatter(x=g[x], y=g[value], mode="lines+markers", name=escape(label), **st),
                      row=k // cols + 1, col=k % cols + 1)
    fig.update_layout(title=f"Training {value}" + (", one panel per variant" if len(panels) > 1 else ""),
                      legend_title="checkpoint", height=height)
    fig.update_xaxes(title_text=x, row=rows)
    fig.update_yaxes(title_text=value, col=1)
    if value == "loss":
        log_axis(fig, "y", curves[value])
    else:
        fig.update_yaxes(tickformat=".0%")
    return fig
