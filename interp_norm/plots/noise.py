"""Plotly figures for :mod:`interp_norm.noise` tables (DataFrames in, figures out; no analysis).

Both functions accept one model's table or several concatenated (``pd.concat``) with distinct
``variant`` labels (e.g. "Pre-Norm", "QKV-Norm"); variants become colours. The x axis is the
noise level (RMS of κ) on a log scale, as in the paper's figures.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import pandas as pd
import plotly.colors
import plotly.graph_objects as go

from interp_norm.errors import ConfigError

__all__ = ["plot_accuracy_vs_noise", "plot_collapse_vs_noise", "plot_collapse_thresholds"]

_DASH = {"all": "solid", "sparse": "dash", "nonsparse": "dot"}
_SYMBOL = {"loose": "circle", "strict": "diamond"}
_NOISED_NAME = {"all": "all rows", "sparse": "sparse rows only", "nonsparse": "non-sparse rows only"}


def _need(df: pd.DataFrame, cols: set, producer: str) -> pd.DataFrame:
    if not isinstance(df, pd.DataFrame) or not cols <= set(df.columns):
        raise ConfigError(f"expected a DataFrame from {producer} with columns {sorted(cols)}")
    return df if "variant" in df.columns else df.assign(variant="model")


def _colours(variants: Sequence[str]) -> dict[str, str]:
    pal = plotly.colors.qualitative.Plotly
    return {v: pal[i % len(pal)] for i, v in enumerate(variants)}


def _pct(x: float) -> str:
    """0.001 -> "0.1%", 0.13 -> "13%" (no rounding of distinct levels onto the same label)."""
    return f"{float(x) * 100:.3g}%"


def _log_level_axis(fig: go.Figure, levels: Iterable[float], min_gap: float = 0.12) -> None:
    """Log x axis ticked at the noise levels actually used (thinned so neighbouring labels are at
    least ``min_gap`` decades apart; the largest level is always kept), labelled as percentages."""
    levels = sorted({float(v) for v in levels if v > 0 and math.isfinite(v)})
    ticks: list[float] = []
    for v in levels:
        if not ticks or math.log10(v / ticks[-1]) >= min_gap:
            ticks.append(v)
    if len(ticks) > 1 and ticks[-1] != levels[-1]:
        ticks[-1] = levels[-1]
    fig.update_xaxes(type="log", tickmode="array", tickvals=ticks, ticktext=[_pct(v) for v in ticks],
                     hoverformat=".3~%", minor=dict(showgrid=False))


def plot_accuracy_vs_noise(df: pd.DataFrame, title: Optional[str] = None) -> go.Figure:
    """Per-token accuracy (± standard error over datasets) vs noise level, from :func:`noise.run_noise`.

    One trace per (variant, noised rows): colour = variant, dash = which rows were noised (solid:
    all, dashed: sparse only, dotted: non-sparse only). Level 0 cannot sit on a log axis, so the
    clean accuracy is a thin horizontal line per variant.
    """
    df = _need(df, {"level", "accuracy", "noised"}, "noise.run_noise")
    colour = _colours(list(dict.fromkeys(df["variant"])))
    fig = go.Figure()
    titled: set = set()
    for (variant, noised), g in df.groupby(["variant", "noised"], sort=False):
        g = g.sort_values("level")
        pos = g[g["level"] > 0]
        err = pos["se"] if "se" in pos.columns else None
        clean = g[g["level"] == 0]
        group_title = None
        if variant not in titled:
            titled.add(variant)
            acc0 = df[(df["variant"] == variant) & (df["level"] == 0)]["accuracy"]
            group_title = f"{variant}" + (f" — clean: {float(acc0.iloc[0]):.1%} (long-dash line)" if len(acc0) else "")
        fig.add_trace(go.Scatter(
            x=pos["level"], y=pos["accuracy"], mode="lines+markers", name=f"{variant}, {_NOISED_NAME.get(noised, noised)}",
            line=dict(color=colour[variant], dash=_DASH.get(noised, "solid")), legendgroup=str(variant),
            legendgrouptitle_text=group_title,
            error_y=dict(type="data", array=err, visible=True) if err is not None else None,
        ))
        if noised == "all" and len(clean):  # labelled in the legend group title, not in the plot
            fig.add_hline(y=float(clean["accuracy"].iloc[0]), line=dict(color=colour[variant], width=1, dash="longdash"),
                          opacity=0.5)
    fig.update_layout(
        title=title or "Per-token accuracy under multiplicative norm noise (all layers at once)",
        xaxis_title="noise level (RMS of κ)", yaxis_title="per-token accuracy", legend_title="model, noised rows",
    )
    _log_level_axis(fig, df["level"])
    fig.update_yaxes(tickformat=".0%")
    return fig


def plot_collapse_vs_noise(
    df: pd.DataFrame,
    layer: object = "all",
    definitions: Sequence[str] = ("loose", "strict"),
    target: Optional[float] = 0.01,
    log_y: bool = False,
    title: Optional[str] = None,
) -> go.Figure:
    """Circuit-collapse probability vs noise level from :func:`noise.run_collapse`: measured
    (solid, ± standard error) and the theory's prediction (dashed), per variant and definition.

    ``layer``: ``"all"`` (pooled over layers, default), a layer index, or None for every layer
    (then one colour per (variant, layer)). ``target`` draws the paper's 1% line.
    """
    df = _need(df, {"level", "measured", "predicted", "layer", "definition"}, "noise.run_collapse")
    if layer is not None:
        have = sorted(set(map(str, df["layer"])))
        df = df[df["layer"].astype(str) == str(layer)]
        if not len(df):
            raise ConfigError(f"no rows for layer {layer!r}; the table has layers {have}")
    df = df[df["definition"].isin(definitions)]
    df = df.assign(series=df["variant"].astype(str) + ("" if layer is not None else ", layer " + df["layer"].astype(str)))
    colour = _colours(list(dict.fromkeys(df["series"])))
    fig = go.Figure()
    for (series, definition), g in df.groupby(["series", "definition"], sort=False):
        g = g.sort_values("level")
        c = colour[series]
        fig.add_trace(go.Scatter(
            x=g["level"], y=g["measured"], mode="lines+markers", name=f"{series}, {definition} (measured)",
            line=dict(color=c, width=2 if definition == "loose" else 1.5),
            marker=dict(symbol=_SYMBOL.get(definition, "circle")), legendgroup=f"{series}{definition}",
            error_y=dict(type="data", array=g["se"], visible=True) if "se" in g.columns else None,
        ))
        fig.add_trace(go.Scatter(
            x=g["level"], y=g["predicted"], mode="lines", name=f"{series}, {definition} (theory)",
            line=dict(color=c, dash="dash", width=1.5), legendgroup=f"{series}{definition}",
        ))
    if target is not None:
        fig.add_hline(y=target, line=dict(color="grey", width=1, dash="dot"),
                      annotation_text=f"{target:.0%} collapse", annotation_position="top left")
    where = "pooled over layers" if str(layer) == "all" else ("per layer" if layer is None else f"layer {layer}")
    fig.update_layout(
        title=title or f"Circuit collapse of sparse attention under norm noise ({where})",
        xaxis_title="noise level (RMS of κ)", yaxis_title="P(collapse)", legend_title="model, definition",
    )
    _log_level_axis(fig, df["level"])
    fig.update_yaxes(type="log" if log_y else "linear", tickformat=".1%")
    return fig


def plot_collapse_thresholds(thresholds: pd.DataFrame, title: Optional[str] = None) -> go.Figure:
    """Bar chart of the 1%-collapse noise level per layer: measured (filled) vs predicted (hatched),
    from :func:`noise.collapse_thresholds`."""
    df = _need(thresholds, {"layer", "definition", "level_measured", "level_predicted"}, "noise.collapse_thresholds")
    colour = _colours(list(dict.fromkeys(df["variant"])))
    fig = go.Figure()
    for (variant, definition), g in df.groupby(["variant", "definition"], sort=False):
        x = "layer " + g["layer"].astype(str)
        for kind, pattern in (("measured", ""), ("predicted", "/")):
            fig.add_trace(go.Bar(
                x=x, y=g[f"level_{kind}"], name=f"{variant}, {definition}, {kind}",
                marker=dict(color=colour[variant], pattern_shape=pattern, opacity=1.0 if definition == "loose" else 0.6),
            ))
    target = float(df["target"].iloc[0]) if "target" in df.columns and len(df) else 0.01
    fig.update_layout(barmode="group", title=title or f"Noise level at which {target:.0%} of sparse distributions collapse",
                      yaxis_title="noise level (RMS of κ)")
    fig.update_yaxes(tickformat=".0%")
    return fig
