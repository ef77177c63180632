"""Plotly figures for :mod:`interp_norm.geometry` tables (no analysis here: DataFrames in, figures out).

Every function accepts the output of :func:`interp_norm.geometry.run_geometry` (one model) or
:func:`interp_norm.geometry.compare_geometry` (a ``variant`` column); variants become colours.
"""

from __future__ import annotations

from typing import Optional

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

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


def plot_norm_spread(norm_spread: pd.DataFrame) -> go.Figure:
    """Per-layer weighted quantiles of |x|/median − 1 (5–95% whiskers, 25–75% box) and ±spread markers."""
    df = _variant(norm_spread)
    df = df[df["head"].isna()]
    fig = go.Figure()
    cov = float(df["coverage"].iloc[0]) if len(df) else 0.9
    for v, g in df.groupby("variant", sort=False):
        x = g["layer"].astype(int)
        fig.add_trace(go.Box(
            name=str(v), x=x, q1=g["q25"], median=g["q50"], q3=g["q75"], lowerfence=g["q5"], upperfence=g["q95"],
            offsetgroup=str(v), legendgroup=str(v),
        ))
        fig.add_trace(go.Scatter(x=x, y=g["spread"], mode="markers", marker_symbol="triangle-up", name=f"{v} +spread",
                                 legendgroup=str(v), offsetgroup=str(v)))
    fig.update_layout(boxmode="group", title=f"Attended-embedding norm spread ({cov:.0%} of weight within ±spread)",
                      xaxis_title="layer", yaxis_title="|x| / median − 1", yaxis_tickformat=".0%")
    return fig


def plot_norm_distribution(attended: pd.DataFrame, layer: Optional[int] = None) -> go.Figure:
    """Attention-weighted histogram of |x|/median − 1 from :func:`geometry.attended_norms`."""
    df = _variant(attended)
    if layer is not None:
        df = df[df["layer"] == layer]
    fig = px.histogram(df, x="rel", y="weight", histfunc="sum", histnorm="probability", color="variant",
                       facet_col="layer", barmode="overlay", nbins=60, opacity=0.6)
    fig.update_layout(title="Attended-embedding norms relative to the head's median", yaxis_title="weight share")
    fig.update_xaxes(title="|x| / median − 1", tickformat=".0%")
    return fig


def plot_attention_sparsity(hist: pd.DataFrame) -> go.Figure:
    """Max-attention histograms per layer and pooled ("all"); paper: Pre-Norm peaks at 1."""
    df = _variant(hist).copy()
    df["panel"] = df["layer"].map(lambda l: "all layers" if pd.isna(l) else f"layer {int(l)}")
    df["mid"] = (df["lo"] + df["hi"]) / 2
    fig = px.bar(df, x="mid", y="fraction", color="variant", facet_col="panel", barmode="group",
                 labels={"mid": "max attention", "fraction": "share of distributions"})
    fig.update_layout(title="Attention sparsity: max_t a_t per distribution (row 0 excluded)")
    return fig


def plot_sphere_scores(scores: pd.DataFrame) -> go.Figure:
    """Orthogonal-spheres score and its two terms per layer (Theorem 2)."""
    df = _variant(scores).melt(id_vars=["variant", "layer"], value_vars=["constancy", "orthogonality", "score"],
                               var_name="term")
    fig = px.line(df, x="layer", y="value", color="variant", line_dash="term", markers=True)
    fig.update_layout(title="Orthogonal spheres: norm constancy × orthogonality of residual components",
                      yaxis_range=[0, 1.02])
    return fig


def plot_component_cosines(pairs: pd.DataFrame, layer: int, variant: Optional[str] = None) -> go.Figure:
    """Heatmap of mean |cos| between residual components at one layer's input."""
    df = _variant(pairs)
    df = df[df["layer"] == layer]
    if variant is not None:
        df = df[df["variant"] == variant]
    names = list(dict.fromkeys(list(df["a"]) + list(df["b"])))
    full = pd.concat([df, df.rename(columns={"a": "b", "b": "a"})])
    mat = full.pivot_table(index="a", columns="b", values="mean_abs_cos", aggfunc="mean").reindex(index=names, columns=names)
    fig = px.imshow(mat, zmin=0, zmax=1, color_continuous_scale="Viridis", labels={"color": "mean |cos|"})
    fig.update_layout(title=f"Component overlap at layer {layer} input" + (f" ({variant})" if variant else ""))
    return fig


def plot_subspace_angles(angles: pd.DataFrame, value: str = "min_angle") -> go.Figure:
    """Heatmap of principal angles (degrees; ``min_angle``/``mean_angle``) or ``overlap`` between subspaces."""
    names = list(dict.fromkeys(list(angles["a"]) + list(angles["b"])))
    full = pd.concat([angles, angles.rename(columns={"a": "b", "b": "a"})])
    mat = full.pivot_table(index="a", columns="b", values=value, aggfunc="mean").reindex(index=names, columns=names)
    rng = (0, 1) if value == "overlap" else (0, 90)
    fig = px.imshow(mat, zmin=rng[0], zmax=rng[1], color_continuous_scale="Viridis", labels={"color": value})
    fig.update_layout(title=f"Subspace principal angles ({value})")
    return fig


def plot_interference(interference: pd.DataFrame, value: str = "mean_tv") -> go.Figure:
    """Attention change per head under each intervention (Pre-Norm moves, QKV-Norm should not)."""
    df = _variant(interference).copy()
    df["head_name"] = "L" + df["layer"].astype(str) + "H" + df["head"].astype(str)
    fig = px.bar(df, x="head_name", y=value, color="variant", facet_row="intervention", barmode="group",
                 hover_data=[c for c in ("pos_read_q", "pos_read_k", "tok_read_q", "tok_read_k") if c in df])
    fig.update_layout(title="Direct interference: attention change when another subspace's component changes")
    fig.update_xaxes(title="head")
    return fig


def plot_ellipsoid_axes(axes: pd.DataFrame) -> go.Figure:
    """Semi-axis spectra of every norm's image ellipsoid (flat at √N for unit gains)."""
    df = _variant(axes).copy()
    df["norm"] = df["module"] + ":" + df["gain_row"].astype(str)
    fig = px.line(df, x="axis", y="semi_axis", color="norm", line_dash="variant", markers=False, log_y=True)
    fig.update_layout(title="LayerNorm/RMSNorm image ellipsoids: semi-axis lengths (Riechers 2024)")
    return fig
