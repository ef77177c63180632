"""Attribution's error against exact patching, split by the nonlinearity that carries it (one figure).

Draws the per-checkpoint table of ``scripts/attribution_error_budget.py``
(:func:`~interp_norm.circuits.attribution_error.budget_summary` per checkpoint, method and node kind):
per arm and method, stacked bars of the mean over seeds of the parts of the live error -- removed by
freezing the norms' scales, removed by freezing the attention patterns, the rest -- each as % of the
exact effects' size, so the parts add to the relative live error (a red bar marks it: where freezing the
norm makes the estimate worse, its part is below 0 and the stack above 0 is the frozen-norm error); with a
handful of seeds every seed's live and frozen-norm error is drawn too (a dot each), not only their mean.
"""

from __future__ import annotations

from typing import Optional, Sequence

import pandas as pd
import plotly.graph_objects as go

from interp_norm.errors import ConfigError

__all__ = ["plot_error_budget", "PARTS"]

#: (column, legend label, colour) of the stacked parts, bottom to top.
PARTS = (("removed_by_norm", "removed by freezing the norm", "#4c78a8"),
         ("removed_by_pattern", "removed by freezing the patterns", "#f58518"),
         ("rest", "rest (MLPs, output, interactions)", "#9d9d9d"))
_METHODS = {"atp": "AtP", "atp*": "AtP*", "eap": "EAP", "eap-ig": "EAP-IG"}
_NEEDED = ("arm", "checkpoint", "method", "activation", "exact_size", "err_live", "err_norm", *(p[0] for p in PARTS))


def plot_error_budget(per_checkpoint: pd.DataFrame, activation: str = "all", arms: Optional[Sequence[str]] = None,
                      title: str = "") -> go.Figure:
    """Stacked bars per (arm, method) of the live error's parts (% of the exact effects' size, mean over seeds),
    their sum (the mean live error, a red bar), every seed's live error (filled dot) and frozen-norm error
    (open dot: the parts without the first).

    ``activation``: a node kind of the table (``"z"``, ``"q"``, ...) or ``"all"`` (every node);
    ``arms``: which arms, in order (default: the table's)."""
    missing = [c for c in _NEEDED if c not in per_checkpoint.columns]
    if missing:
        raise ConfigError(f"the error budget table lacks columns {missing}; pass budget_summary's per-checkpoint "
                          "table (scripts/attribution_error_budget.py writes it as per_checkpoint.csv)")
    d = per_checkpoint[per_checkpoint["activation"] == activation]
    if not len(d):
        raise ConfigError(f"no rows for activation {activation!r}; the table has {sorted(set(per_checkpoint['activation']))}")
    arms = list(arms) if arms is not None else list(dict.fromkeys(d["arm"]))
    d = d[d["arm"].isin(arms)].copy()
    for c in [p[0] for p in PARTS] + ["err_live", "err_norm"]:
        d[c] = 100 * d[c] / d["exact_size"]
    methods = [m for m in _METHODS if m in set(d["method"])]
    keys = [(a, m) for a in arms for m in methods if len(d[(d["arm"] == a) & (d["method"] == m)])]
    means = d.groupby(["arm", "method"])[[p[0] for p in PARTS]].mean()
    x = [[a for a, _ in keys], [_METHODS[m] for _, m in keys]]
    fig = go.Figure()
    for col, label, colour in PARTS:
        fig.add_trace(go.Bar(x=x, y=[means.loc[k, col] for k in keys], name=label, marker_color=colour,
                             hovertemplate=f"{label}: %{{y:.1f}}%<extra>%{{x}}</extra>"))
    for col, label, symbol in (("err_live", "live error, per seed", "circle"),
                               ("err_norm", "error with the norm frozen, per seed", "circle-open")):
        pts = d.merge(pd.DataFrame(keys, columns=["arm", "method"]), on=["arm", "method"])
        fig.add_trace(go.Scatter(x=[pts["arm"].tolist(), [_METHODS[m] for m in pts["method"]]], y=pts[col], mode="markers",
                                 name=label, text=pts["checkpoint"], marker=dict(symbol=symbol, size=7, color="black"),
                                 hovertemplate=f"%{{text}}: {label.split(',')[0]} %{{y:.1f}}%<extra></extra>"))
    live = d.groupby(["arm", "method"])["err_live"].mean()
    fig.add_trace(go.Scatter(x=x, y=[live.loc[k] for k in keys], mode="markers", name="live error, mean over seeds",
                             marker=dict(symbol="line-ew-open", size=34, color="#d62728", line=dict(width=3)),
                             hovertemplate="mean live error %{y:.1f}%<extra>%{x}</extra>"))
    fig.add_hline(y=100, line_dash="dot", annotation_text="attributing nothing", annotation_position="top left")
    fig.update_layout(barmode="relative", template="plotly_white", title=title or None,
                      yaxis_title=f"error, % of the exact effects' size ({'every node' if activation == 'all' else activation})",
                      legend=dict(orientation="h", y=-0.2))
    return fig
