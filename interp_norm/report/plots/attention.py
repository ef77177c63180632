"""Attention-pattern figures from the tidy table of :func:`interp_norm.circuits.attention_maps.attention_patterns`.

Tokens label both axes (``"3·5"`` = token 3 at position 5, so repeated tokens keep their own
row/column); query tokens are rows, attended (key) tokens columns.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from interp_norm.errors import ConfigError
from interp_norm.report.plots._style import escape, row_gap

__all__ = ["plot_attention_pattern", "plot_attention_patterns", "plot_attention_explorer"]


def _axis_labels(text: str) -> list[str]:
    # unique category labels, so repeated tokens keep their own row/column: "3·5" = token 3 at position 5
    return [f"{escape(c)}·{i}" for i, c in enumerate(text)]


def _pattern_matrix(g: pd.DataFrame, n: int) -> np.ndarray:
    z = np.full((n, n), np.nan)
    z[g["query"].to_numpy(), g["key"].to_numpy()] = g["weight"].to_numpy()
    return np.round(z, 4)


def _pattern_trace(g: pd.DataFrame, visible: bool = True, showscale: bool = True, **kw: Any) -> go.Heatmap:
    text = str(g["text"].iloc[0])
    labels = _axis_labels(text)
    return go.Heatmap(
        z=_pattern_matrix(g, len(text)), x=labels, y=labels, zmin=0, zmax=1, colorscale="Blues", visible=visible,
        showscale=showscale, hovertemplate="query %{y}<br>key %{x}<br>attention %{z:.3f}<extra></extra>", **kw,
    )


def _check_patterns(df: pd.DataFrame) -> pd.DataFrame:
    need = {"problem", "text", "layer", "head", "query", "key", "weight"}
    if not isinstance(df, pd.DataFrame) or not need <= set(df.columns):
        raise ConfigError(f"expected the DataFrame from plots.attention_patterns(...) with columns {sorted(need)}")
    return df if "model" in df.columns else df.assign(model="model")


def _pick(df: pd.DataFrame, **sel: Any) -> pd.DataFrame:
    for k, v in sel.items():
        if v is None:
            continue
        have = sorted(set(df[k]))
        df = df[df[k] == v]
        if not len(df):
            raise ConfigError(f"no attention pattern with {k}={v!r}; available: {have}")
    return df


def plot_attention_pattern(
    patterns: pd.DataFrame, problem: int = 0, layer: int = 0, head: int = 0, model: Optional[str] = None
) -> go.Figure:
    """One head's attention on one problem: query rows, key columns, tokens on both axes."""
    df = _check_patterns(patterns)
    model = model if model is not None else df["model"].iloc[0]
    g = _pick(df, model=model, problem=problem, layer=layer, head=head)
    text = str(g["text"].iloc[0])
    fig = go.Figure(_pattern_trace(g))
    fig.update_layout(title=f"{escape(model)}: layer {layer} head {head} on {escape(text)}",
                      xaxis_title="key (attended) token", yaxis_title="query token", height=520, width=600)
    fig.update_yaxes(autorange="reversed")
    return fig


def plot_attention_patterns(patterns: pd.DataFrame, model: Optional[str] = None) -> go.Figure:
    """Every layer (rows) × head (columns) of one model, with a dropdown over the problems."""
    df = _check_patterns(patterns)
    model = model if model is not None else df["model"].iloc[0]
    df = _pick(df, model=model)
    L, H = int(df["layer"].max()) + 1, int(df["head"].max()) + 1
    probs = sorted(set(df["problem"]))
    fig = make_subplots(rows=L, cols=H, subplot_titles=[f"L{l}H{h}" for l in range(L) for h in range(H)],
                        horizontal_spacing=0.03, vertical_spacing=row_gap(L, 260 * L + 80, 52, 0.06))
    for p in probs:
        for (l, h), g in df[df["problem"] == p].groupby(["layer", "head"]):
            fig.add_trace(_pattern_trace(g, visible=p == probs[0], showscale=False, coloraxis="coloraxis"),
                          row=int(l) + 1, col=int(h) + 1)
    per = L * H
    buttons = []
    for i, p in enumerate(probs):
        vis = [j // per == i for j in range(per * len(probs))]
        text = escape(df[df["problem"] == p]["text"].iloc[0])
        buttons.append(dict(label=text, method="update", args=[{"visible": vis}, {"title": f"{escape(model)}: attention on {text}"}]))
    fig.update_layout(
        title=f"{escape(model)}: attention on {escape(df[df['problem'] == probs[0]]['text'].iloc[0])}",
        coloraxis=dict(colorscale="Blues", cmin=0, cmax=1), height=260 * L + 80, width=max(700, 240 * H),
        updatemenus=[dict(buttons=buttons, x=0.5, xanchor="left", y=1.04, yanchor="bottom")] if len(probs) > 1 else [],
    )
    fig.update_yaxes(autorange="reversed", tickfont=dict(size=7))
    fig.update_xaxes(tickfont=dict(size=7))
    return fig


def plot_attention_explorer(patterns: pd.DataFrame) -> go.Figure:
    """One heatmap per (model, problem, layer, head), one visible at a time, tokens on the axes.

    In a notebook a single dropdown lists every combination. The dashboard replaces it with four
    selectors (model, problem, layer, head) using ``layout.meta["explorer"]``, which maps each
    combination to its trace.
    """
    df = _check_patterns(patterns)
    fig = go.Figure()
    index: dict[str, int] = {}
    labels = []
    models = list(dict.fromkeys(df["model"]))
    for (m, p, l, h), g in df.groupby(["model", "problem", "layer", "head"], sort=False):
        i = len(fig.data)
        index[f"{models.index(m)},{p},{l},{h}"] = i
        text = str(g["text"].iloc[0])
        labels.append(f"{escape(m)} · {escape(text)} · L{l}H{h}")
        fig.add_trace(_pattern_trace(g, visible=i == 0, name=labels[-1]))
    n = len(fig.data)
    buttons = [dict(label=lab, method="update", args=[{"visible": [j == i for j in range(n)]}, {"title": lab}])
               for i, lab in enumerate(labels)]
    problems = (df.drop_duplicates(["problem"]).sort_values("problem")["text"]).map(escape).tolist()
    fig.update_layout(
        title=labels[0], height=620, xaxis_title="key (attended) token", yaxis_title="query token",
        updatemenus=[dict(buttons=buttons, x=1.0, xanchor="right", y=1.12, yanchor="bottom")],
        meta={"explorer": {
            "models": [escape(m) for m in models], "problems": problems,
            "n_layers": int(df["layer"].max()) + 1, "n_heads": int(df["head"].max()) + 1,
            "index": index, "labels": labels,
        }},
    )
    fig.update_yaxes(autorange="reversed")
    return fig

