"""Plotly figures for :mod:`interp_norm.geometry` tables (no analysis here: DataFrames in, figures out).

Every function accepts the output of :func:`interp_norm.geometry.run_geometry` (one model) or
:func:`interp_norm.geometry.compare_geometry` (a ``variant`` column); variants become colours, the same in every figure
(:mod:`interp_norm.report.plots._style`), and several variants' heatmaps become panels of one figure.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from interp_norm.report.plots._style import base_variant, colour_map, dodge, escape, line_style, log_axis, row_gap

__all__ = [
    "plot_norm_spread",
    "plot_norm_distribution",
    "plot_attention_sparsity",
    "plot_sphere_scores",
    "plot_component_cosines",
    "plot_subspace_angles",
    "plot_interference",
    "plot_ellipsoid_axes",
]


def _variant(df: pd.DataFrame) -> pd.DataFrame:
    return df if "variant" in df.columns else df.assign(variant="model")


def _strip_facet_names(fig: go.Figure) -> go.Figure:
    """plotly express writes facet titles as ``column=value``: keep the value."""
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=", 1)[-1]) if a.text and "=" in a.text else None)
    return fig


def plot_norm_spread(norm_spread: pd.DataFrame) -> go.Figure:
    """Per-layer weighted quantiles of |x|/median − 1 as dot-and-range: the median (the series'
    marker), 25–75% (thick bar), 5–95% (thin bar), and the ±spread (a short dash); series side by
    side within each layer, one colour per variant, one marker per seed."""
    df = _variant(norm_spread)
    df = df[df["head"].isna()]
    fig = go.Figure()
    cov = float(df["coverage"].iloc[0]) if len(df) else 0.9
    series = list(dict.fromkeys(df["variant"]))
    for i, v in enumerate(series):
        g = df[df["variant"] == v].sort_values("layer")
        x = g["layer"].astype(int) + dodge(i, len(series), 0.7)
        st = line_style(v, size=9)
        c = st["marker"]["color"]
        fig.add_trace(go.Scatter(x=x, y=g["q50"], mode="markers", name=str(v), legendgroup=str(v), marker=st["marker"],
                                 error_y=dict(type="data", symmetric=False, array=g["q95"] - g["q50"],
                                              arrayminus=g["q50"] - g["q5"], thickness=1, width=0, color=c),
                                 hovertemplate=f"{escape(v)}, layer %{{x:.0f}}: median %{{y:.1%}}<extra></extra>"))
        fig.add_trace(go.Scatter(x=x, y=g["q50"], mode="markers", name=f"{v}: 25–75%", legendgroup=str(v), showlegend=False,
                                 marker=dict(size=1, color=c), hoverinfo="skip",
                                 error_y=dict(type="data", symmetric=False, array=g["q75"] - g["q50"],
                                              arrayminus=g["q50"] - g["q25"], thickness=5, width=0, color=c)))
        fig.add_trace(go.Scatter(x=x, y=g["spread"], mode="markers", name=f"{v}: +spread", legendgroup=str(v),
                                 showlegend=False, marker=dict(symbol="line-ew", size=12, color=c, line=dict(color=c, width=2))))
    fig.update_layout(title=f"Attended-embedding norm spread: median (marker), 25–75% (thick), 5–95% (thin), "
                            f"±spread (short dash; {cov:.0%} of weight within it)", xaxis_title="layer",
                      yaxis_title="|x| / median − 1", yaxis_tickformat=".0%", legend_title="model")
    fig.update_xaxes(tickmode="linear", dtick=1)
    return fig


def plot_norm_distribution(attended: pd.DataFrame, layer: Optional[int] = None) -> go.Figure:
    """Attention-weighted histogram of |x|/median − 1 from :func:`geometry.attended_norms`."""
    df = _variant(attended)
    if layer is not None:
        df = df[df["layer"] == layer]
    fig = px.histogram(df, x="rel", y="weight", histfunc="sum", histnorm="probability", color="variant",
                       facet_col="layer", barmode="overlay", nbins=60, opacity=0.6,
                       color_discrete_map=colour_map(df["variant"]))
    fig.update_layout(title="Attended-embedding norms relative to the head's median", yaxis_title="weight share")
    fig.update_xaxes(title="|x| / median − 1", tickformat=".0%")
    return _strip_facet_names(fig)


def plot_attention_sparsity(hist: pd.DataFrame) -> go.Figure:
    """Max-attention histograms per layer and pooled ("all layers"), one panel each, one line per
    series (the variant's colour, the seed's dash and marker); paper: Pre-Norm peaks at 1."""
    df = _variant(hist).copy()
    df["panel"] = df["layer"].map(lambda l: "all layers" if pd.isna(l) else f"layer {int(l)}")
    df["mid"] = (df["lo"] + df["hi"]) / 2
    panels = sorted(dict.fromkeys(df["panel"]), key=lambda p: (p != "all layers", p))
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    height = 300 * rows + 120
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=panels, shared_xaxes=True, shared_yaxes=True,
                        horizontal_spacing=0.06, vertical_spacing=row_gap(rows, height, 70, 0.14))
    shown: set = set()
    for k, p in enumerate(panels):
        r, c = k // cols + 1, k % cols + 1
        for v, g in df[df["panel"] == p].groupby("variant", sort=False):
            g = g.sort_values("mid")
            fig.add_trace(go.Scatter(x=g["mid"], y=g["fraction"], mode="lines+markers", name=str(v), legendgroup=str(v),
                                     showlegend=v not in shown, **line_style(v, width=1.8, size=6),
                                     hovertemplate=f"{escape(v)}: max attention %{{x:.2f}}, %{{y:.1%}} of rows<extra></extra>"),
                          row=r, col=c)
            shown.add(v)
    fig.update_layout(title="Attention sparsity: histogram of max_t a_t per distribution (row 0 excluded)",
                      height=height, legend_title="model")
    fig.update_yaxes(tickformat=".0%")
    fig.update_yaxes(title_text="share of distributions", col=1)
    fig.update_xaxes(title_text="max attention", row=rows)
    return fig


def plot_sphere_scores(scores: pd.DataFrame) -> go.Figure:
    """Orthogonal-spheres score and its two terms per layer (Theorem 2): one panel per term, one line per series."""
    df = _variant(scores)
    terms = ["constancy", "orthogonality", "score"]
    fig = make_subplots(rows=1, cols=3, subplot_titles=terms, shared_yaxes=True, horizontal_spacing=0.04)
    for v, g in df.groupby("variant", sort=False):
        g = g.sort_values("layer")
        for j, term in enumerate(terms):
            fig.add_trace(go.Scatter(x=g["layer"], y=g[term], mode="lines+markers", name=str(v), legendgroup=str(v),
                                     showlegend=j == 0, **line_style(v, width=1.8, size=7)), row=1, col=j + 1)
    fig.update_layout(title="Orthogonal spheres: score = norm constancy × orthogonality of residual components",
                      legend_title="model", height=420)
    fig.update_yaxes(range=[0, 1.02])
    fig.update_xaxes(tickmode="linear", dtick=1, title_text="layer")
    return fig


def _square(df: pd.DataFrame, value: str) -> pd.DataFrame:
    """The symmetric matrix of a pair table (columns ``a``, ``b``), names in first-seen order."""
    names = list(dict.fromkeys(list(df["a"]) + list(df["b"])))
    full = pd.concat([df, df.rename(columns={"a": "b", "b": "a"})])
    return full.pivot_table(index="a", columns="b", values=value, aggfunc="mean").reindex(index=names, columns=names)


def _rect(df: pd.DataFrame, value: str) -> pd.DataFrame:
    """The pair table as a matrix with no block left blank: rows are the subspaces that are compared with
    every other (column ``a``: the residual components), columns every subspace (components first, then the
    head read spaces, which are compared with the components only); a row or column with no value is dropped."""
    mat = _square(df, value)
    rows = [n for n in dict.fromkeys(df["a"]) if n in mat.index]
    cols = rows + [n for n in mat.columns if n not in set(rows)]
    return mat.reindex(index=rows, columns=cols).dropna(how="all", axis=0).dropna(how="all", axis=1)


#: Smallest tick-label font of a heatmap (px): every row and column is labelled, so the rows get taller instead.
TICK_PX = 10


def _empty_block_note(mat: pd.DataFrame) -> Optional[tuple[str, str, str]]:
    """(x, y, text) for an annotation centred on the block of pairs the analysis did not compute."""
    empty = mat.isna().to_numpy().copy()
    np.fill_diagonal(empty, False)
    if empty.sum() < max(4, 0.05 * empty.size):
        return None
    rows = [i for i in range(len(mat)) if empty[i].mean() > 0.3]
    cols = [j for j in range(len(mat)) if empty[:, j].mean() > 0.3]
    if not rows or not cols:
        return None
    names = [str(n) for n in mat.index[rows]]
    reads = all(n.rsplit(".", 1)[-1] in ("q", "k", "v") for n in names)
    text = ("not computed (by design):<br>head read spaces are compared<br>with the components only" if reads
            else "not computed (by design)")
    return str(mat.columns[cols[len(cols) // 2]]), str(mat.index[rows[len(rows) // 2]]), text


def _heatmap_grid(mats: Sequence[tuple[str, pd.DataFrame]], title: str, zrange: tuple[float, float], colour_title: str,
                  axis_title: str, *, cols: int = 2, panel_height: int = 460) -> go.Figure:
    """One heatmap per model (panels sharing one colour scale), every row and column labelled, axis
    titles on every panel, and blocks that were not computed marked as such."""
    rows = -(-len(mats) // cols)
    ncols = min(cols, len(mats))
    longest = max((len(str(n)) for _, m in mats for n in [*m.index, *m.columns]), default=4)
    gap = 60 + 7 * longest  # the x tick labels (vertical) and axis title under each panel
    height = max(300, panel_height * rows + gap * rows + 40)
    fig = make_subplots(rows=rows, cols=ncols, subplot_titles=[escape(v) for v, _ in mats],
                        horizontal_spacing=0.16, vertical_spacing=row_gap(rows, height, gap + 30, 0.3))
    font = TICK_PX
    for i, (v, mat) in enumerate(mats):
        r, c = i // ncols + 1, i % ncols + 1
        x, y = [str(n) for n in mat.columns], [str(n) for n in mat.index]
        fig.add_trace(go.Heatmap(z=mat.to_numpy(), x=x, y=y, coloraxis="coloraxis", name=escape(v),
                                 hovertemplate="%{y} vs %{x}: %{z:.3g}<extra>" + escape(v) + "</extra>"), row=r, col=c)
        fig.update_xaxes(tickmode="array", tickvals=x, ticktext=x, tickfont=dict(size=font), tickangle=-90,
                         title_text=axis_title, title_font=dict(size=11), row=r, col=c)
        fig.update_yaxes(tickmode="array", tickvals=y, ticktext=y, tickfont=dict(size=font), autorange="reversed",
                         title_text=axis_title, title_font=dict(size=11), row=r, col=c)
        note = _empty_block_note(mat)
        if note:
            k = "" if i == 0 else str(i + 1)
            fig.add_annotation(x=note[0], y=note[1], xref=f"x{k}", yref=f"y{k}", text=note[2], showarrow=False,
                               font=dict(size=10, color="#444"), bgcolor="rgba(255,255,255,0.85)")
    fig.update_layout(title=title, height=height,
                      coloraxis=dict(colorscale="Viridis", cmin=zrange[0], cmax=zrange[1],
                                     colorbar=dict(title=dict(text=colour_title, side="right"), lenmode="pixels",
                                                   len=min(320, panel_height),
                                                   yanchor="top", y=1, thickness=14)))
    return fig


def plot_component_cosines(pairs: pd.DataFrame, layer: int, variant: Optional[str] = None) -> go.Figure:
    """Heatmap of mean |cos| between residual components at one layer's input (one panel per model)."""
    df = _variant(pairs)
    df = df[df["layer"] == layer]
    if variant is not None:
        df = df[df["variant"] == variant]
    mats = [(str(v), _square(g, "mean_abs_cos")) for v, g in df.groupby("variant", sort=False)]
    n = max((len(m) for _, m in mats), default=0)
    return _heatmap_grid(mats, f"Mean |cos| between the residual components at the input of layer {layer} "
                         "(orthogonal spheres need ≈ 0 off the diagonal)", (0, 1), "mean |cos|",
                         "residual component", panel_height=max(300, 40 + (TICK_PX + 4) * n))


def plot_subspace_angles(angles: pd.DataFrame, value: str = "min_angle") -> go.Figure:
    """Heatmap of principal angles (degrees; ``min_angle``/``mean_angle``) or ``overlap`` between
    subspaces (residual components and each head's q/k/v read space), one panel per model."""
    df = _variant(angles)
    mats = [(str(v), _rect(g, value)) for v, g in df.groupby("variant", sort=False)]
    rng = (0, 1) if value == "overlap" else (0, 90)
    what = {"min_angle": "smallest principal angle (°)", "mean_angle": "mean principal angle (°)"}.get(value, value)
    n = max((len(m) for _, m in mats), default=0)
    return _heatmap_grid(mats, f"Subspaces of the residual stream: {what} between components (rows) and "
                         "components or head q/k/v read spaces (columns)", rng, what.split(" (")[0], "subspace",
                         cols=1, panel_height=max(160, 20 + (TICK_PX + 4) * n))


def plot_interference(interference: pd.DataFrame, value: str = "mean_tv") -> go.Figure:
    """Attention change per head under each intervention (Pre-Norm moves, QKV-Norm should not): one
    row per intervention, one dot per series and head (series side by side), log-free % axis."""
    df = _variant(interference).copy()
    df["head_name"] = "L" + df["layer"].astype(str) + "H" + df["head"].astype(str)
    label = {"mean_tv": "mean TV change", "max_tv": "max TV change"}.get(value, value)
    ints = list(dict.fromkeys(df["intervention"])) if "intervention" in df else ["all"]
    if "intervention" not in df:
        df["intervention"] = "all"
    heads = list(dict.fromkeys(df["head_name"]))
    series = list(dict.fromkeys(df["variant"]))
    height = 160 + 200 * len(ints)
    fig = make_subplots(rows=len(ints), cols=1, shared_xaxes=True, subplot_titles=[escape(i) for i in ints],
                        vertical_spacing=row_gap(len(ints), height, 60, 0.12))
    for r, it in enumerate(ints):
        for i, v in enumerate(series):
            g = df[(df["intervention"] == it) & (df["variant"] == v)]
            if not len(g):
                continue
            x = [heads.index(h) + dodge(i, len(series), 0.7) for h in g["head_name"]]
            fig.add_trace(go.Scatter(x=x, y=g[value], mode="markers", name=str(v), legendgroup=str(v), showlegend=r == 0,
                                     marker=line_style(v, size=8)["marker"], text=g["head_name"],
                                     hovertemplate=f"{escape(v)}, %{{text}}: %{{y:.3g}}<extra></extra>"),
                          row=r + 1, col=1)
        fig.update_yaxes(title_text=label, title_font=dict(size=11), row=r + 1, col=1)
    fig.update_xaxes(tickmode="array", tickvals=list(range(len(heads))), ticktext=heads, range=[-0.6, len(heads) - 0.4])
    fig.update_xaxes(title_text="head", row=len(ints), col=1)
    fig.update_layout(title="Direct interference: attention change (total variation) when another subspace's "
                            "component changes; one row per intervention", height=height, legend_title="model")
    return fig


def plot_ellipsoid_axes(axes: pd.DataFrame) -> go.Figure:
    """Semi-axis spectra of every norm's image ellipsoid (flat at √N for unit gains) as small multiples: one
    row per norm (``ln1:q`` ... ``ln2``), one column per layer (the final norm in its own column), one line per
    series (colour = variant, dash and marker = seed). A norm only some variants have (ln1 is Pre-Norm's;
    the others normalise per head instead) says so in its row's first title."""
    df = _variant(axes).copy()
    mod = df["module"].astype(str)
    df["layer"] = mod.str.extract(r"blocks\.(\d+)\.", expand=False).fillna("final")
    df["norm"] = mod.str.replace(r"^blocks\.\d+\.", "", regex=True) + np.where(df["gain_row"].astype(str) == "all", "",
                                                                              ":" + df["gain_row"].astype(str))
    variants = list(dict.fromkeys(df["variant"]))
    bases = list(dict.fromkeys(base_variant(v) or v for v in variants))
    layers = list(dict.fromkeys(l for l in df["layer"] if l != "final"))
    cols = layers + (["final"] if (df["layer"] == "final").any() else [])
    norms = list(dict.fromkeys(df.loc[df["layer"] != "final", "norm"])) or ["final"]
    slots: dict[tuple[int, int], tuple[str, str]] = {}
    for r, n in enumerate(norms):
        for c, l in enumerate(cols):
            if l == "final":
                if r == len(norms) - 1:  # the final norm sits at the end of the last row
                    slots[(r, c)] = (str(df.loc[df["layer"] == "final", "norm"].iloc[0]), "final")
            elif ((df["norm"] == n) & (df["layer"] == l)).any():
                slots[(r, c)] = (n, l)
    titles = []
    for r, n in enumerate(norms):
        have = list(dict.fromkeys(base_variant(v) or v for v in df.loc[df["norm"] == n, "variant"]))
        only = f" ({', '.join(map(escape, have))} only)" if len(have) < len(bases) else ""
        for c in range(len(cols)):
            if (r, c) not in slots:
                titles.append("")
                continue
            norm, l = slots[(r, c)]
            titles.append(escape(norm) if l == "final" else f"{escape(norm)}, layer {l}" + (only if c == 0 else ""))
    nrows, panel_px = len(norms), 190
    height = 130 + nrows * (panel_px + 60)
    fig = make_subplots(rows=nrows, cols=len(cols), subplot_titles=titles, shared_yaxes=True, shared_xaxes=True,
                        horizontal_spacing=0.04, vertical_spacing=row_gap(nrows, height, 60, 0.14))
    shown: set = set()
    for (r, c), (n, l) in slots.items():
        g = df[(df["norm"] == n) & (df["layer"] == l)]
        for v, h in g.groupby("variant", sort=False):
            st = line_style(v, width=1.5, size=6)
            st["marker"]["maxdisplayed"] = 8
            fig.add_trace(go.Scatter(x=h["axis"], y=h["semi_axis"], mode="lines+markers", name=escape(v), legendgroup=str(v),
                                     showlegend=v not in shown, **st,
                                     hovertemplate=f"{escape(v)}, layer {l}, {escape(n)}: axis %{{x}}, %{{y:.3g}}<extra></extra>"),
                          row=r + 1, col=c + 1)
            shown.add(v)
    log_axis(fig, "y", df["semi_axis"])
    fig.update_yaxes(title_text="semi-axis", col=1)
    fig.update_xaxes(title_text="axis (sorted)", row=nrows)
    fig.update_layout(title="LayerNorm/RMSNorm image ellipsoids: semi-axis lengths (Riechers 2024), one panel per "
                            "norm and layer", height=height, legend_title="model")
    return fig
