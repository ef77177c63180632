"""Plotly figures for :mod:`interp_norm.noise` tables (DataFrames in, figures out; no analysis).

The functions accept one model's table or several concatenated (``pd.concat``) with distinct
``variant`` labels (e.g. "Pre-Norm", "QKV-Norm"); variants become colours (one per variant, :mod:`interp_norm.report.plots._style`);
the other dimensions (noised rows, collapse definition) become facets, so legends stay short. The x axis is the
noise level (RMS of κ) on a log scale, as in the paper's figures.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from interp_norm.errors import ConfigError
from interp_norm.report.plots._style import dodge, escape, line_style, row_gap, variant_colour

__all__ = ["plot_accuracy_vs_noise", "plot_collapse_vs_noise", "plot_collapse_thresholds", "plot_temperature"]

#: The theory's curves: a wide pale line under the measured one (same colour), so both show where they agree.
THEORY_WIDTH, THEORY_OPACITY = 9.0, 0.3

_NOISED_NAME = {"all": "all rows", "sparse": "sparse rows only", "nonsparse": "non-sparse rows only",
                "nonsparse_matched": "non-sparse, as many as sparse"}


def _need(df: pd.DataFrame, cols: set, producer: str) -> pd.DataFrame:
    if not isinstance(df, pd.DataFrame) or not cols <= set(df.columns):
        raise ConfigError(f"expected a DataFrame from {producer} with columns {sorted(cols)}")
    return df if "variant" in df.columns else df.assign(variant="model")


def _note(fig: go.Figure, text: str, row: int = 1, col: int = 1, y: float = 0.5) -> None:
    """Grey text inside one facet: says that an empty region is empty by design, not missing data."""
    fig.add_annotation(text=text, xref="x domain", yref="y domain", x=0.5, y=y, showarrow=False, row=row, col=col,
                       font=dict(size=11, color="#555"), bgcolor="rgba(255,255,255,0.8)", align="center")


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

    One panel per set of noised rows (all / sparse only / non-sparse only), one colour per variant
    and one dash and marker per seed / placement (:func:`~interp_norm.report.plots._style.member_style`),
    one legend entry per series. Level 0 cannot sit on a log axis, so the clean accuracy is a thin
    pale horizontal line per series, its value in the legend.
    """
    df = _need(df, {"level", "accuracy", "noised"}, "noise.run_noise")
    noised = list(dict.fromkeys(df["noised"]))
    fig = make_subplots(rows=1, cols=len(noised), shared_yaxes=True, horizontal_spacing=0.03,
                        subplot_titles=[f"noise on {_NOISED_NAME.get(n, n)}" for n in noised])
    for variant, gv in df.groupby("variant", sort=False):
        c = variant_colour(variant)
        acc0 = gv[gv["level"] == 0]["accuracy"]
        name = f"{variant}" + (f" (clean {float(acc0.iloc[0]):.1%})" if len(acc0) else "")
        for j, n in enumerate(noised):
            g = gv[(gv["noised"] == n) & (gv["level"] > 0)].sort_values("level")
            if not len(g):
                continue
            fig.add_trace(go.Scatter(
                x=g["level"], y=g["accuracy"], mode="lines+markers", name=name, legendgroup=str(variant),
                showlegend=j == 0, **line_style(variant, width=1.8, size=7),
                error_y=dict(type="data", array=g["se"], visible=True, thickness=1) if "se" in g.columns else None,
            ), row=1, col=j + 1)
            if len(acc0):
                fig.add_hline(y=float(acc0.iloc[0]), line=dict(color=c, width=1), opacity=0.35, row=1, col=j + 1)
    fig.update_layout(
        title=title or "Per-token accuracy under multiplicative norm noise (all layers at once)",
        yaxis_title="per-token accuracy", legend_title="model (clean accuracy: thin pale lines)", height=480,
    )
    for j in range(len(noised)):
        fig.update_xaxes(title_text="noise level (RMS of κ)", row=1, col=j + 1)
    _log_level_axis(fig, df["level"], min_gap=0.3 if len(noised) > 2 else 0.12)
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
    (solid, ± standard error) and the theory's prediction (a wide pale line under it), per variant.

    One panel per collapse definition (and one row per layer when ``layer`` is None); one colour
    per variant, one marker per seed ("noise after norm" series: crosses, see
    :func:`~interp_norm.report.plots._style.member_style`). Series that
    never collapse at any tested level are named on the panel. ``layer``: ``"all"`` (pooled over
    layers, default), a layer index, or None for every layer. ``target`` draws the paper's 1% line.
    """
    df = _need(df, {"level", "measured", "predicted", "layer", "definition"}, "noise.run_collapse")
    if layer is not None:
        have = sorted(set(map(str, df["layer"])))
        df = df[df["layer"].astype(str) == str(layer)]
        if not len(df):
            raise ConfigError(f"no rows for layer {layer!r}; the table has layers {have}")
    df = df[df["definition"].isin(definitions)]
    defs = [d for d in definitions if d in set(df["definition"])]
    layers = [layer] if layer is not None else list(dict.fromkeys(df["layer"].astype(str)))
    titles = [f"{d} collapse" + ("" if layer is not None else f", layer {l}") for l in layers for d in defs]
    fig = make_subplots(rows=len(layers), cols=max(1, len(defs)), shared_yaxes=True, subplot_titles=titles,
                        horizontal_spacing=0.04,
                        vertical_spacing=row_gap(len(layers), 380 * len(layers) + 120, 200, 0.12))
    shown: set = set()
    for i, l in enumerate(layers):
        for j, d in enumerate(defs):
            panel = df[(df["layer"].astype(str) == str(l)) & (df["definition"] == d)]
            flat = []
            groups = [(series, g.sort_values("level")) for series, g in panel.groupby("variant", sort=False)]
            for series, g in groups:  # measured: solid, the series' marker
                st = line_style(series, width=1.5, size=7)
                st["line"]["dash"] = "solid"
                fig.add_trace(go.Scatter(
                    x=g["level"], y=g["measured"], mode="lines+markers", name=str(series), legendgroup=str(series),
                    showlegend=series not in shown, **st,
                    error_y=dict(type="data", array=g["se"], visible=True, thickness=1) if "se" in g.columns else None,
                ), row=i + 1, col=j + 1)
                shown.add(series)
                if not (g["measured"] > 0).any():
                    flat.append(str(series))
            for series, g in groups:  # theory: a wide pale band under the measured line, visible where they agree
                fig.add_trace(go.Scatter(
                    x=g["level"], y=g["predicted"], mode="lines", name=f"{series}: theory", legendgroup=str(series),
                    showlegend=False, opacity=THEORY_OPACITY, line=dict(color=variant_colour(series), width=THEORY_WIDTH),
                    hovertemplate=f"{escape(series)}, theory: %{{y:.2%}}<extra></extra>",
                ), row=i + 1, col=j + 1)
            n_theory = len(groups)
            fig.data = fig.data[:-2 * n_theory] + fig.data[-n_theory:] + fig.data[-2 * n_theory:-n_theory]
            if flat:
                top = f"{max(panel['level']):.0%}" if len(panel) else ""
                _note(fig, "no collapse at any tested level (≤ " + top + "):<br>" + "<br>".join(flat),
                      row=i + 1, col=j + 1, y=0.6)
            if target is not None:
                fig.add_hline(y=target, line=dict(color="grey", width=1, dash="dot"), row=i + 1, col=j + 1,
                              annotation_text=f"{target:.0%} collapse", annotation_position="top left",
                              annotation=dict(xshift=6))  # clear of the y tick labels
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", name="theory (wide pale line, the series' colour)",
                             opacity=THEORY_OPACITY, line=dict(color="#444", width=THEORY_WIDTH), legendgroup="theory"))
    where = "pooled over layers" if str(layer) == "all" else ("per layer" if layer is None else f"layer {layer}")
    fig.update_layout(
        title=title or f"Circuit collapse of sparse attention under norm noise ({where})",
        legend_title="measured (solid lines, markers)", height=max(460, 380 * len(layers) + 120),
    )
    fig.update_yaxes(title_text="P(collapse)", col=1)
    fig.update_xaxes(title_text="noise level (RMS of κ)", row=len(layers))
    _log_level_axis(fig, df["level"])
    fig.update_yaxes(type="log" if log_y else "linear", tickformat=".1%")
    return fig


def plot_collapse_thresholds(thresholds: pd.DataFrame, title: Optional[str] = None,
                             max_level: Optional[float] = None) -> go.Figure:
    """The 1%-collapse noise level per layer, from :func:`noise.collapse_thresholds`: one dot per
    series (the variant's colour, the seed's marker), side by side within each layer, and the
    theory's level as a short dash beside it; one panel per collapse definition.

    A level that was never reached (fewer than 1% collapse even at the largest tested level; NaN in
    the table) is drawn in a grey band above ``max_level`` (the largest tested level, if known),
    labelled "not reached", so it is neither missing nor mistaken for a measured level.
    """
    df = _need(thresholds, {"layer", "definition", "level_measured", "level_predicted"}, "noise.collapse_thresholds")
    defs = list(dict.fromkeys(df["definition"]))
    target = float(df["target"].iloc[0]) if "target" in df.columns and len(df) else 0.01
    vals = pd.concat([df["level_measured"], df["level_predicted"]]).dropna()
    ceiling = max_level if max_level is not None else (float(vals.max()) if len(vals) else 0.5)
    band = (ceiling * 1.08, ceiling * 1.45)
    # in the band: measured dots on one row, the theory's dashes on another, side by side (never stacked)
    never_y = {"measured": band[0] + 0.5 * (band[1] - band[0]), "theory": band[0] + 0.2 * (band[1] - band[0])}
    fig = make_subplots(rows=1, cols=max(1, len(defs)), shared_yaxes=True, horizontal_spacing=0.04,
                        subplot_titles=[f"{d} collapse" for d in defs])
    series = list(dict.fromkeys(df["variant"]))
    layers = sorted(set(df["layer"]), key=lambda v: (str(v) == "all", str(v)))
    xpos = {str(l): k for k, l in enumerate(layers)}
    shown: set = set()
    for j, d in enumerate(defs):
        panel = df[df["definition"] == d]
        fig.add_hrect(y0=band[0], y1=band[1], fillcolor="#ddd", opacity=0.5, line_width=0, row=1, col=j + 1, layer="below",
                      exclude_empty_subplots=False)
        fig.add_annotation(text=f"not reached (&gt; {ceiling:.0%})", xref=f"x{'' if j == 0 else j + 1} domain",
                           yref=f"y{'' if j == 0 else j + 1}", x=0.01, y=band[1], xanchor="left", yanchor="top",
                           showarrow=False, font=dict(size=10, color="#555"))
        for i, v in enumerate(series):
            g = panel[panel["variant"] == v]
            if not len(g):
                continue
            # series side by side within a layer, a quarter of a layer between layers; smaller marks for many series
            x = [xpos[str(l)] + dodge(i, len(series), 0.75) for l in g["layer"]]
            st = line_style(v, size=9 if len(series) <= 6 else 7)
            for kind, col in (("measured", "level_measured"), ("theory", "level_predicted")):
                y = g[col].astype(float)
                reached = y.notna()
                text = [f"{val:.1%}" if ok else f"not reached (≤ {target:.0%} collapse at {ceiling:.0%})"
                        for ok, val in zip(reached, y)]
                dash = 14 if len(series) <= 4 else 10 if len(series) <= 6 else 6
                marker = dict(st["marker"]) if kind == "measured" else dict(color=st["marker"]["color"], symbol="line-ew",
                                                                             size=dash, line=dict(color=st["marker"]["color"], width=2.5))
                fig.add_trace(go.Scatter(
                    x=x, y=y.fillna(never_y[kind]), mode="markers", marker=marker,
                    name=str(v) if kind == "measured" else f"{v}: theory", legendgroup=str(v),
                    showlegend=kind == "measured" and v not in shown, text=text,
                    hovertemplate=f"{escape(v)}, {kind}: %{{text}}<extra></extra>",
                ), row=1, col=j + 1)
            shown.add(v)
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="theory (short dash, the series' colour)",
                             marker=dict(symbol="line-ew", size=14, color="#444", line=dict(color="#444", width=2.5))))
    fig.update_xaxes(tickmode="array", tickvals=list(range(len(layers))), ticktext=[f"layer {l}" for l in layers],
                     range=[-0.6, len(layers) - 0.4])
    fig.update_layout(title=title or f"Noise level at which {target:.0%} of sparse distributions collapse",
                      yaxis_title="noise level (RMS of κ)", height=480, legend_title="measured (one marker per series)")
    fig.update_yaxes(tickformat=".0%", range=[0, band[1] * 1.02])
    return fig


def plot_temperature(df: pd.DataFrame, layer: object = "all", title: Optional[str] = None) -> go.Figure:
    """Attention temperature, from :func:`noise.run_temperature_sweep`: the fraction of sparse rows
    (left) and the noise level at which 1% of them collapse, loose (right), vs the score
    multiplier c (c > 1: colder, sharper attention). One colour per variant; a level never reached
    below the largest tested noise is left out and named on the panel."""
    df = _need(df, {"c", "layer", "frac_sparse", "collapse_level_loose"}, "noise.run_temperature_sweep")
    df = df[df["layer"].astype(str) == str(layer)]
    if not len(df):
        raise ConfigError(f"no rows for layer {layer!r} in the temperature table")
    n_series = df["variant"].nunique()
    missing = df[df["collapse_level_loose"].isna()].groupby("c")["variant"].nunique()
    never = [f"c = {c:g} by {k} of {n_series} series" for c, k in missing.items()]
    right = "noise level for 1% loose collapse"
    if never:  # said under the panel's title, where it covers no line (hover a point for its series)
        right += ("<br><span style='font-size:10px'>never reached (no sparse rows, or too few collapses at the "
                  "largest level) at " + "; ".join(never) + "</span>")
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=["sparse rows (max attention ≥ 95%)", right])
    for variant, g in df.groupby("variant", sort=False):
        g = g.sort_values("c")
        st = line_style(variant, width=1.8, size=7)
        fig.add_trace(go.Scatter(x=g["c"], y=g["frac_sparse"], mode="lines+markers", name=str(variant),
                                 legendgroup=str(variant), **st), row=1, col=1)
        fig.add_trace(go.Scatter(x=g["c"], y=g["collapse_level_loose"], mode="lines+markers", name=str(variant),
                                 legendgroup=str(variant), showlegend=False, **st), row=1, col=2)
    fig.update_xaxes(title_text="score multiplier c", type="log", tickvals=sorted(df["c"].unique()))
    fig.update_yaxes(tickformat=".0%")
    fig.update_yaxes(title_text="fraction of rows", row=1, col=1)
    fig.update_yaxes(title_text="noise level (RMS of κ)", row=1, col=2)
    where = "pooled over layers" if str(layer) == "all" else f"layer {layer}"
    fig.update_layout(title=title or f"Attention temperature: sharper attention, more sparse rows, earlier collapse ({where})",
                      legend_title="model", height=480)
    return fig
