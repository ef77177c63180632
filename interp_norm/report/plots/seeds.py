"""Variant A vs B over seeds as dot-and-range: a dot per seed, the mean with its Student-t 95% interval.

Draws the tables of :mod:`interp_norm.stats.seed_compare` (never bars of means: with a handful of seeds
every seed is shown). The permutation p-value of each comparison is in its panel title and in the
hover text of the means.
"""

from __future__ import annotations

import math
from typing import Optional

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from interp_norm.errors import ConfigError
from interp_norm.report.plots._style import NARROW_PX, VARIANT_LABELS, escape, row_gap, variant_colour, wrap

__all__ = ["plot_seed_comparisons", "plot_matched_id"]

#: A marker shape per seed (seed k -> the k-th shape; the same in every panel).
_SEED_SYMBOLS = ("circle", "square", "diamond", "triangle-up", "pentagon", "star", "hexagon", "cross")


def _symbol(seed: int) -> str:
    return _SEED_SYMBOLS[int(seed) % len(_SEED_SYMBOLS)]


def _colour(row: pd.Series) -> str:
    return variant_colour(VARIANT_LABELS.get(str(row.get("attn_norm", "")), row.get("variant", "")))


def _p_text(r: pd.Series) -> str:
    if pd.isna(r["p_value"]):
        return "p: —"
    how = "exact" if r["p_method"] == "exact" else "Monte Carlo"
    return f"p = {r['p_value']:.2g} ({how}, {int(r['n_splits'])})"


def _ci(lo: float, hi: float) -> str:
    return "—" if pd.isna(lo) else f"[{lo:.1f}, {hi:.1f}]"


def _short(name: str) -> str:
    return (name.replace("accuracy lost to 1% noise", "1% noise cost").replace("(max ≥ 95%)", "≥ 0.95")
            .replace("(90% of attended norms within ±)", "±").replace("1% loose collapse level", "1% collapse")
            .replace("rows with max attention ≥ 0.99", "rows ≥ 0.99").replace("sparse attention rows", "sparse rows")
            .replace(" (decomposition)", "").replace(" in a random direction of equal size", ", random direction")
            .replace(" with one κ per token shared across heads", ", one κ per token")
            .replace("accuracy lost by problems with", "cost with").replace(" (consequence)", ""))


def _arm_traces(fig: go.Figure, vals: pd.DataFrame, r: pd.Series, x0: float, arm: str, *, row: int, col: int,
                seen: set) -> None:
    d = vals[vals["arm"] == arm.upper()].sort_values("seed")
    if not len(d):
        return
    colour = _colour(d.iloc[0])
    n = len(d)
    for i, v in enumerate(d.itertuples()):
        dx = (i - (n - 1) / 2) * 0.08  # 8 px markers of equal value stay apart in a 230 px panel
        name = f"seed {v.seed}"
        bound = getattr(v, "censored_above", math.nan)
        censored = pd.isna(v.value) and not pd.isna(bound)  # never reached: drawn open, at the largest level tested
        hover = (f"never reached within the tested noise (> {bound:.0f} {escape(v.unit)})" if censored
                 else f"%{{y:.2f}} {escape(v.unit)}")
        fig.add_trace(go.Scatter(
            x=[x0 + dx], y=[bound if censored else v.value], mode="markers", name=name, legendgroup=name,
            showlegend=name not in seen,
            marker=dict(symbol=_symbol(v.seed) + ("-open" if censored else ""), size=8, color=colour,
                        line=dict(color=colour if censored else "white", width=1.5 if censored else 0.5)),
            hovertemplate=f"{escape(v.checkpoint)} (seed {v.seed}): {hover}<extra></extra>"), row=row, col=col)
        seen.add(name)
    mean, lo, hi = r[f"mean_{arm}"], r[f"ci_lo_{arm}"], r[f"ci_hi_{arm}"]
    if pd.isna(mean):
        return
    err = dict(type="data", symmetric=False, array=[max(hi - mean, 0)], arrayminus=[max(mean - lo, 0)],
               color=colour, thickness=2, width=10) if not pd.isna(lo) else None
    label = escape(r[f"arm_{arm}"])
    fig.add_trace(go.Scatter(
        x=[x0 + 0.3], y=[mean], mode="markers", name="mean, t 95% interval", legendgroup="mean",
        showlegend="mean" not in seen, error_y=err,
        marker=dict(symbol="line-ew-open", size=16, color=colour, line=dict(width=3, color=colour)),
        hovertemplate=(f"{label}: mean %{{y:.2f}}, 95% interval {_ci(lo, hi)} (n = {int(r[f'n_{arm}'])})<br>"
                       f"A − B = {r['diff']:.2f} {_ci(r['diff_lo'], r['diff_hi'])}; {_p_text(r)}<extra></extra>")),
        row=row, col=col)
    seen.add("mean")


def _grid(n: int, cols: int, titles: list[str], height_per_row: int = 260) -> go.Figure:
    """Panels in rows, each title wrapped to its panel's width at the narrowest page (as
    :func:`~interp_norm.report.plots._style.fit_layout` will) and the gap above each row as tall as its titles
    (11 px text, 15 px a line) plus the row above's tick labels, so no title runs into the row above."""
    rows = max(1, math.ceil(n / cols))
    spacing = 0.08
    panel_px = 0.9 * (1 - spacing * (cols - 1)) / cols * (NARROW_PX - 140)
    titles = [wrap(t, max(110.0, panel_px), 11) for t in titles]
    lines = max((t.count("<br>") + 1 for t in titles), default=1)
    gap = 34 + 15 * lines
    height = 80 + height_per_row * rows + gap * (rows - 1)
    return make_subplots(rows=rows, cols=cols, subplot_titles=titles, horizontal_spacing=spacing,
                         vertical_spacing=row_gap(rows, height, gap, 0.5)).update_layout(height=height)


def plot_seed_comparisons(summary: pd.DataFrame, values: pd.DataFrame, scaling: Optional[str] = None,
                          cols: int = 3, title: Optional[str] = None) -> go.Figure:
    """One panel per comparison of ``summary`` (:func:`~interp_norm.stats.seed_compare.compare_seeds`) for
    ``scaling`` (default: the first): arm A left, arm B right; a dot per seed (shape = seed; open at the
    largest level tested for a collapse level never reached), the mean with its Student-t 95% interval
    beside them; the permutation p-value in the panel title."""
    need = {"scaling", "comparison", "arm_a", "arm_b", "mean_a", "p_value"}
    if not isinstance(summary, pd.DataFrame) or not need <= set(summary.columns):
        raise ConfigError("plot_seed_comparisons expects the summary from seed_compare.compare_seeds(...)")
    scaling = scaling or str(summary["scaling"].iloc[0])
    s = summary[summary["scaling"] == scaling]
    if not len(s):
        raise ConfigError(f"no comparison at scaling {scaling!r}; choose from {sorted(set(summary['scaling']))}")
    titles = [f"{escape(_short(r['comparison']))}<br><span style='font-size:10px'>{escape(_p_text(r))}</span>" for _, r in s.iterrows()]
    fig = _grid(len(s), cols, titles)
    seen: set = set()
    for i, (_, r) in enumerate(s.iterrows()):
        row, col = i // cols + 1, i % cols + 1
        v = values[(values["scaling"] == scaling) & (values["comparison"] == r["comparison"])]
        _arm_traces(fig, v, r, 0.0, "a", row=row, col=col, seen=seen)
        _arm_traces(fig, v, r, 1.0, "b", row=row, col=col, seen=seen)
        fig.update_xaxes(tickmode="array", tickvals=[0.1, 1.1], ticktext=[escape(r["arm_a"]), escape(r["arm_b"])],
                         range=[-0.4, 1.6], row=row, col=col)
        fig.update_yaxes(title=dict(text=escape(r["unit"]), font=dict(size=10)), row=row, col=col)
    fig.update_annotations(font=dict(size=11))
    fig.update_layout(title=title or f"{escape(s['arm_a'].iloc[0])} vs {escape(s['arm_b'].iloc[0])} ({escape(scaling)}): "
                      "a dot per seed, mean with t 95% interval", legend=dict(title="marker"))
    return fig


def plot_matched_id(summary: pd.DataFrame, values: pd.DataFrame, scaling: Optional[str] = None,
                    title: Optional[str] = None) -> go.Figure:
    """OOD accuracy at matched ID accuracy (:func:`~interp_norm.stats.seed_compare.matched_id_comparison`):
    one panel per OOD split, x = the ID accuracy every run reached; a dot per seed, each arm's mean
    with its Student-t 95% interval, p-values in the hover text."""
    if not isinstance(summary, pd.DataFrame) or not {"at", "id_target", "split"} <= set(summary.columns):
        raise ConfigError("plot_matched_id expects the summary from seed_compare.matched_id_comparison(...)")
    scaling = scaling or str(summary["scaling"].iloc[0])
    s = summary[(summary["scaling"] == scaling) & (summary["at"] == "matched ID")]
    v = values[(values["scaling"] == scaling) & (values["at"] == "matched ID")]
    splits = [sp for sp in ("interp", "extrap") if sp in set(s["split"])]
    if not splits:
        raise ConfigError(f"no matched-ID rows at scaling {scaling!r} (the runs' ID accuracies never overlap)")
    fig = make_subplots(rows=1, cols=len(splits), subplot_titles=[f"{sp} accuracy" for sp in splits])
    width = float(s["id_target"].diff().abs().dropna().min()) if s["id_target"].nunique() > 1 else 1.0
    seen: set = set()
    for c, sp in enumerate(splits, start=1):
        for arm, off in (("a", -0.15), ("b", 0.15)):
            d = v[(v["split"] == sp) & (v["arm"] == arm.upper())]
            for sd, g in d.groupby("seed", sort=True):
                g = g.sort_values("id_target")
                name = f"{g['variant'].iloc[0]} seed {sd}"
                fig.add_trace(go.Scatter(
                    x=g["id_target"] + off * width, y=g["value"], mode="markers", name=escape(name), legendgroup=name,
                    showlegend=name not in seen,
                    marker=dict(symbol=_symbol(sd), size=7, color=_colour(g.iloc[0]), opacity=0.75),
                    customdata=g[["checkpoint", "step"]].to_numpy(),
                    hovertemplate="%{customdata[0]}: %{y:.1f}% at ID %{x:.1f}% (step ≈ %{customdata[1]:.0f})<extra></extra>"),
                    row=1, col=c)
                seen.add(name)
            m = s[s["split"] == sp].sort_values("id_target")
            if not len(m):
                continue
            colour = _colour(d.iloc[0]) if len(d) else "black"
            label = str(m[f"arm_{arm}"].iloc[0])
            texts = [f"{escape(label)}: mean {r[f'mean_{arm}']:.1f}% {_ci(r[f'ci_lo_{arm}'], r[f'ci_hi_{arm}'])}; "
                     f"A − B = {r['diff']:.1f} {_ci(r['diff_lo'], r['diff_hi'])}; {escape(_p_text(r))}" for _, r in m.iterrows()]
            fig.add_trace(go.Scatter(
                x=m["id_target"] + 2 * off * width, y=m[f"mean_{arm}"], mode="lines+markers", name=f"{escape(label)}: mean, 95% interval",
                line=dict(color=colour, width=2), marker=dict(symbol="line-ew-open", size=14, color=colour, line=dict(width=3)),
                error_y=dict(type="data", symmetric=False, array=(m[f"ci_hi_{arm}"] - m[f"mean_{arm}"]).clip(lower=0).fillna(0),
                             arrayminus=(m[f"mean_{arm}"] - m[f"ci_lo_{arm}"]).clip(lower=0).fillna(0), color=colour),
                legendgroup=f"mean {label}", showlegend=c == 1, text=texts, hovertemplate="%{text}<extra></extra>"),
                row=1, col=c)
        fig.update_xaxes(title="ID accuracy reached (%)", row=1, col=c)
        fig.update_yaxes(title="accuracy (%)", row=1, col=c)
    fig.update_layout(height=460, title=title or f"Out-of-distribution accuracy at matched ID accuracy along training ({escape(scaling)})")
    return fig
