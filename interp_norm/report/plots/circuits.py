"""Circuit figures: patching heatmaps, the one circuit drawer, and MIB faithfulness curves.

:func:`plot_circuit_graph` is the entry point for every circuit figure. A
:class:`~interp_norm.circuits.Circuit` or its edge table (``sender``/``receiver``) is drawn by
:func:`draw_circuit` (embed at the bottom, one row per attention layer and MLP); any other edge
table (``source``/``target``/``score``) as a layered graph, left to right.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from interp_norm.errors import ConfigError
from interp_norm.core.nodes import parse as parse_node
from interp_norm.core.nodes import receiver_input, receiver_node
from interp_norm.report.plots._style import bar_style, escape, row_gap

__all__ = ["plot_patching_heatmap", "plot_circuit_graph", "draw_circuit", "plot_faithfulness", "plot_faithfulness_bars",
           "plot_attribution_scatter", "INPUT_COLOURS"]


def plot_patching_heatmap(
    patching: pd.DataFrame,
    value: str = "normalized",
    pos_labels: Optional[Sequence[str]] = None,
    title: Optional[str] = None,
) -> go.Figure:
    """Activation- (or attribution-) patching results as heatmaps, one panel per activation.

    ``patching``: rows of ``PatchResult.to_dataframe()`` (several activations may be
    concatenated; an optional ``variant`` column gives one row of panels per model). The grid is
    layer × position, layer × head, or (per-position head results) layer.head × position;
    ``value`` is ``normalized`` (0 = no effect, 1 = clean restored), ``effect`` or ``value``.
    """
    if not isinstance(patching, pd.DataFrame) or not {"activation", "layer", value} <= set(patching.columns):
        raise ConfigError(f"expected PatchResult.to_dataframe() rows with columns 'activation', 'layer' and {value!r}")
    df = patching if "variant" in patching.columns else patching.assign(variant="")
    if "by" not in df.columns:
        df = df.assign(by="")
    panels = list(dict.fromkeys(zip(df["variant"], df["activation"], df["by"])))
    variants = list(dict.fromkeys(df["variant"]))
    acts = list(dict.fromkeys(zip(df["activation"], df["by"])))
    # sized to the content: each row of panels as tall as its grid's rows need (24 px each, at least 150 px),
    # plus the gap for the position labels and the next row's titles
    n_y = max(len(set(_row_keys(g))) for _, g in df.groupby(["variant", "activation", "by"], sort=False))
    plot_px, gap_px = max(150, 24 * n_y), 120
    height = 110 + len(variants) * (plot_px + gap_px)
    fig = make_subplots(
        rows=len(variants), cols=len(acts), horizontal_spacing=0.06,
        vertical_spacing=row_gap(len(variants), height, gap_px, 0.5),
        subplot_titles=[
            (f"{escape(v)}: " if v else "") + f"{escape(a)}" + (f" ({escape(b)})" if b else "")
            for v in variants for a, b in acts
        ],
    )
    vals = df[value].to_numpy(dtype=float)
    lo, hi = _colour_range(vals, unit=value == "normalized")
    for v, a, b in panels:
        g = df[(df["variant"] == v) & (df["activation"] == a) & (df["by"] == b)]
        has_pos = "pos" in g.columns and g["pos"].notna().any()
        has_head = "head" in g.columns and g["head"].notna().any()
        if has_pos and has_head:
            rows_key = g["layer"].astype(int).astype(str).radd("L") + g["head"].astype(int).astype(str).radd("H")
            x_key = g["pos"].astype(int)
        elif has_pos:
            rows_key, x_key = g["layer"].astype(int).astype(str).radd("L"), g["pos"].astype(int)
        elif has_head:
            rows_key, x_key = g["layer"].astype(int).astype(str).radd("L"), g["head"].astype(int).astype(str).radd("H")
        else:
            rows_key, x_key = g["layer"].astype(int).astype(str).radd("L"), pd.Series("all", index=g.index)
        mat = pd.DataFrame({"r": rows_key, "c": x_key, "v": g[value]}).pivot_table(index="r", columns="c", values="v", aggfunc="mean", sort=False)
        cols = list(mat.columns)
        if has_pos and pos_labels is not None:
            xt = [f"{escape(pos_labels[int(c)])}·{c}" if isinstance(c, (int, np.integer)) and c < len(pos_labels) else str(c) for c in cols]
        else:
            xt = [str(c) for c in cols]
        fig.add_trace(
            go.Heatmap(z=mat.to_numpy(), x=xt, y=list(mat.index), coloraxis="coloraxis",
                       hovertemplate="%{y} @ %{x}<br>" + value + " %{z:.3f}<extra></extra>"),
            row=variants.index(v) + 1, col=acts.index((a, b)) + 1,
        )
    fig.update_layout(
        title=title or f"Activation patching (clean → corrupted), {value}",
        coloraxis=dict(colorscale=_diverging(lo, hi), cmin=lo, cmax=hi,
                       colorbar=dict(title=value, lenmode="pixels", len=min(300, height - 120), yanchor="top", y=1,
                                     thickness=14)),
        height=height,
    )
    fig.update_yaxes(autorange="reversed")
    return fig


def _row_keys(g: pd.DataFrame) -> pd.Series:
    """The row label of each patching result: ``L1H2`` for per-position head results, else ``L1``."""
    lay = g["layer"].astype(int).astype(str).radd("L")
    has_pos = "pos" in g.columns and g["pos"].notna().any()
    if has_pos and "head" in g.columns and g["head"].notna().any():
        return lay + g["head"].astype(int).astype(str).radd("H")
    return lay


def _colour_range(vals: np.ndarray, unit: bool) -> tuple[float, float]:
    """The colour bar's range: the data's, widened to 0…1 for a normalised effect (0 = no effect, 1 =
    clean restored), never a symmetric −1…1 for values that are mostly in 0…1."""
    v = vals[np.isfinite(vals)]
    lo, hi = (float(v.min()), float(v.max())) if len(v) else (0.0, 1.0)
    lo, hi = min(lo, 0.0), max(hi, 1.0 if unit else 0.0)
    return (lo, hi) if hi > lo else (lo - 1.0, hi + 1.0)


def _diverging(lo: float, hi: float) -> list:
    """RdBu's ends with white at 0 wherever 0 falls in [lo, hi]: blue = restores, red = the opposite,
    each end as deep as its own extreme (|lo| and hi need not match)."""
    red, white, blue = (178, 24, 43), (247, 247, 247), (33, 102, 172)
    span = max(-lo, hi)

    def mix(a: tuple, t: float) -> str:
        return "rgb({},{},{})".format(*(round(w + (c - w) * t) for c, w in zip(a, white)))

    z = -lo / (hi - lo)
    if z <= 0:
        return [[0, mix(blue, lo / span)], [1, mix(blue, 1.0)]]
    if z >= 1:
        return [[0, mix(red, 1.0)], [1, mix(red, -hi / span)]]
    return [[0, mix(red, -lo / span)], [z, mix(red, 0.0)], [1, mix(blue, hi / span)]]


def _node_layer(name: str) -> float:
    """Column of a node in the graph: embeddings left, layer l in column l+1, output right."""
    import re

    s = str(name)
    m = re.search(r"(?:^|[^0-9])(?:L|blocks\.|a|m|layer)(\d+)", s)
    if s.lower() in ("embed", "input", "tokens", "hook_embed", "hook_pos_embed", "pos_embed") or s.lower().startswith("embed"):
        return 0.0
    if s.lower() in ("logits", "output", "unembed", "head", "resid_post") or s.lower().startswith("logit"):
        return math.inf
    if m:
        base = 1.0 + int(m.group(1))
        return base + (0.5 if ("mlp" in s.lower() or s.startswith("m")) else 0.0)
    return 0.5


def plot_circuit_graph(
    circuit: Any,
    nodes: Optional[pd.DataFrame] = None,
    *,
    n_layers: Optional[int] = None,
    n_heads: Optional[int] = None,
    source: str = "source",
    target: str = "target",
    score: str = "score",
    title: Optional[str] = None,
    max_edges: int = 60,
) -> go.Figure:
    """A circuit as a graph.

    ``circuit`` is a :class:`interp_norm.circuits.Circuit`, or its edge table (``Circuit.to_dataframe()``:
    ``sender``, ``receiver``, ``score``, with ``n_layers``/``n_heads`` given or as columns): both are drawn
    by :func:`draw_circuit` (embed at the bottom, one row per attention layer and
    MLP, edge colour = the input it enters). Any other edge table with ``source``/``target``/``score``
    columns is drawn as a layered graph, left to right: nodes by layer (names like ``L1H2``,
    ``a1.2``, ``m1``, ``blocks.1...``; ``embed`` first, ``logits`` last, or ``nodes`` with ``node`` and
    ``layer`` columns), edges coloured by sign, width by |score|, the ``max_edges`` strongest drawn.
    """
    from interp_norm.circuits import Circuit

    if isinstance(circuit, Circuit):
        return draw_circuit(circuit, title=title)
    if not isinstance(circuit, pd.DataFrame):
        raise ConfigError("plot_circuit_graph expects a circuits.Circuit or an edge DataFrame")
    if {"sender", "receiver"} <= set(circuit.columns):
        L = n_layers if n_layers is not None else (int(circuit["n_layers"].iloc[0]) if "n_layers" in circuit and len(circuit) else None)
        H = n_heads if n_heads is not None else (int(circuit["n_heads"].iloc[0]) if "n_heads" in circuit and len(circuit) else None)
        if L is None or H is None:
            raise ConfigError("a Circuit edge table needs n_layers and n_heads (arguments or columns)")
        sc = circuit["score"] if "score" in circuit else pd.Series(math.nan, index=circuit.index)
        edges = list(zip(circuit["sender"].astype(str), circuit["receiver"].astype(str)))
        c = Circuit(L, H, frozenset(edges), {e: float(v) for e, v in zip(edges, sc) if not pd.isna(v)})
        if title is None and "checkpoint" in circuit.columns and len(circuit):
            title = (f"checkpoint {escape(circuit['checkpoint'].iloc[0])}: circuit of {len(edges)} edges, "
                     f"{len(c.components)} components")
        return draw_circuit(c, title=title)
    return _layered_graph(circuit, nodes, source=source, target=target, score=score, title=title, max_edges=max_edges)


def _layered_graph(
    edges: pd.DataFrame,
    nodes: Optional[pd.DataFrame],
    *,
    source: str,
    target: str,
    score: str,
    title: Optional[str],
    max_edges: int,
) -> go.Figure:
    if not isinstance(edges, pd.DataFrame) or not {source, target, score} <= set(edges.columns):
        raise ConfigError(f"expected an edge table with columns {source!r}, {target!r}, {score!r}")
    e = edges.assign(_abs=edges[score].abs()).sort_values("_abs", ascending=False).head(max_edges)
    names = list(dict.fromkeys(list(e[source].astype(str)) + list(e[target].astype(str))))
    if nodes is not None and {"node", "layer"} <= set(nodes.columns):
        layer_of = {str(n): float(l) for n, l in zip(nodes["node"], nodes["layer"])}
    else:
        layer_of = {}
    col = {n: layer_of.get(n, _node_layer(n)) for n in names}
    finite = [c for c in col.values() if math.isfinite(c)]
    last = (max(finite) if finite else 0.0) + 1.0
    col = {n: (c if math.isfinite(c) else last) for n, c in col.items()}
    pos: dict[str, tuple[float, float]] = {}
    for c in sorted(set(col.values())):
        members = sorted(n for n in names if col[n] == c)
        for i, n in enumerate(members):
            pos[n] = (c, (i + 1) / (len(members) + 1))
    fig = go.Figure()
    wmax = float(e["_abs"].max()) if len(e) else 1.0
    wmax = wmax if wmax > 0 else 1.0
    for r in e.to_dict("records"):
        (x0, y0), (x1, y1) = pos[str(r[source])], pos[str(r[target])]
        s = float(r[score])
        fig.add_trace(go.Scatter(
            x=[x0, x1], y=[y0, y1], mode="lines", showlegend=False,
            line=dict(width=0.5 + 5 * abs(s) / wmax, color="rgba(31,119,180,0.6)" if s >= 0 else "rgba(214,39,40,0.6)"),
            hovertemplate=f"{escape(r[source])} → {escape(r[target])}<br>{escape(score)} {s:.4g}<extra></extra>",
        ))
    fig.add_trace(go.Scatter(
        x=[pos[n][0] for n in names], y=[pos[n][1] for n in names], mode="markers+text",
        text=[escape(n) for n in names], textposition="top center", showlegend=False,
        marker=dict(size=14, color="#444", line=dict(color="white", width=1)), hoverinfo="text",
    ))
    fig.update_layout(
        title=title or f"Circuit graph: {len(e)} strongest edges (blue: positive, red: negative; width ∝ |{escape(score)}|)",
        xaxis=dict(showgrid=False, zeroline=False, title="layer (embed → logits)"),
        yaxis=dict(showgrid=False, zeroline=False, showticklabels=False), height=520, plot_bgcolor="white",
    )
    return fig


#: Edge colour by the input it enters: none of them is a variant's colour (variants are blue, red,
#: green and purple in every figure).
INPUT_COLOURS: dict[str, str] = {"q": "#ff7f0e", "k": "#17becf", "v": "#8c564b", "mlp": "#7f7f7f", "logits": "#000000"}
# where an edge into a head's q / k / v ends: three ports under the head, so k and v edges never overlap
_PORT = {"q": -0.22, "k": 0.0, "v": 0.22}
_PORT_DROP = 0.18  # how far below its head a port sits (data units: a layer's attention and MLP rows are 0.6 apart)


def _draw_ports(fig: go.Figure, edges: Any, pos: Any) -> None:
    """The q / k / v ports the edges end at, drawn first (under the arrowheads), each tied to its head."""
    ports = sorted({(receiver_node(r), receiver_input(r)) for _, r in edges if receiver_input(r) in _PORT})
    for node, inp in ports:
        x, y = pos(node)
        fig.add_trace(go.Scatter(x=[x, x + _PORT[inp]], y=[y, y - _PORT_DROP], mode="lines", hoverinfo="skip",
                                 line=dict(color="#999", width=1), showlegend=False))
    if ports:
        px, py = zip(*((pos(n)[0] + _PORT[i], pos(n)[1] - _PORT_DROP) for n, i in ports))
        fig.add_trace(go.Scatter(
            x=px, y=py, mode="markers+text", text=[i for _, i in ports], textposition="middle center",
            textfont=dict(size=10, color="white"), hovertext=[f"{n}: {i} input" for n, i in ports], hoverinfo="text",
            marker=dict(symbol="square", size=13, color=[INPUT_COLOURS[i] for _, i in ports], line=dict(width=0)),
            showlegend=False, name="ports"))


def draw_circuit(circuit: Any, title: Optional[str] = None) -> go.Figure:
    """A :class:`~interp_norm.circuits.Circuit` as a plotly figure: embed at the bottom, one row per
    attention layer and per MLP, logits on top.

    Edges are arrows from sender to receiver, coloured by the input they enter
    (:data:`INPUT_COLOURS`: q orange, k teal, v brown, MLP grey, logits black) and ending at that
    input's own port under the head (q left, k centre, v right), so edges into k and v of one head
    never overlap; width ~ |score| (uniform without scores). Node names sit on a white label beside
    the node, above the edges. Hover shows names and scores.
    """
    L, H = circuit.n_layers, circuit.n_heads

    def pos(node: str) -> tuple[float, float]:
        n = parse_node(node)
        if n.kind == "embed":
            return (H - 1) / 2, 0.0
        if n.kind == "logits":
            return (H - 1) / 2, 2 * L + 1.0
        assert n.layer is not None  # heads and MLPs sit in a layer
        if n.kind == "head":
            assert n.head is not None
            return float(n.head), 2 * n.layer + 1.0
        return float(H), 2 * n.layer + 1.6  # MLPs to the right of their layer's heads

    fig = go.Figure()
    scores = [abs(v) for v in circuit.scores.values() if np.isfinite(v)]
    smax = max(scores) if scores else 1.0
    _draw_ports(fig, circuit.edges, pos)
    for u, r in sorted(circuit.edges):
        inp = receiver_input(r)
        (x0, y0), (x1, y1) = pos(u), pos(receiver_node(r))
        if inp in _PORT:
            x1, y1 = x1 + _PORT[inp], y1 - _PORT_DROP
        else:
            y1 -= 0.12
        y0 += 0.1
        s = circuit.scores.get((u, r))
        width = 1.5 if s is None or not np.isfinite(s) else 0.8 + 4.5 * abs(s) / smax
        fig.add_trace(go.Scatter(
            x=[x0, x1], y=[y0, y1], mode="lines+markers", line=dict(color=INPUT_COLOURS[inp], width=width),
            marker=dict(symbol=["circle", "arrow"], size=[0, 7 + 2 * width], angleref="previous",
                        color=INPUT_COLOURS[inp], line=dict(width=0)),
            hoverinfo="text", text=f"{u} -> {r}" + ("" if s is None else f": {s:.4g}"), showlegend=False,
            legendgroup=f"into {inp}",
        ))
    nodes = sorted(circuit.nodes) or ["embed", "logits"]
    xs, ys = zip(*(pos(nd) for nd in nodes))
    fig.add_trace(go.Scatter(
        x=xs, y=ys, mode="markers",
        marker=dict(size=14, color=[{"mlp": "#f0c000", "head": "#555"}.get(parse_node(nd).kind, "#222") for nd in nodes],
                    line=dict(color="white", width=1.5)),
        hovertext=[f"{nd}: {circuit.node_scores.get(nd, '')}" for nd in nodes], hoverinfo="text", showlegend=False,
    ))
    for nd, x, y in zip(nodes, xs, ys):
        fig.add_annotation(x=x, y=y, text=escape(nd), showarrow=False, xanchor="left", yanchor="bottom", xshift=6, yshift=4,
                           font=dict(size=10, color="#222"), bgcolor="rgba(255,255,255,0.9)", borderpad=1)
    for name, col in INPUT_COLOURS.items():
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines+markers", line=dict(color=col, width=3),
                                 marker=dict(symbol="arrow", angleref="previous", color=col), name=f"into {name}",
                                 legendgroup=f"into {name}"))
    ticks = [0.0] + [y for l in range(L) for y in (2 * l + 1.0, 2 * l + 1.6)] + [2 * L + 1.0]
    labels = ["embed"] + [t for l in range(L) for t in (f"attn {l}", f"mlp {l}")] + ["logits"]
    fig.update_layout(
        title=title or f"circuit: {len(circuit.edges)} edges, {len(circuit.components)} components",
        xaxis=dict(title="head (edges end at the head's q | k | v port)", tickmode="array", tickvals=list(range(H)) + [H],
                   ticktext=[str(h) for h in range(H)] + ["MLP"], range=[-0.6, H + 0.8], showgrid=False),
        yaxis=dict(tickmode="array", tickvals=ticks, ticktext=labels, range=[-0.5, 2 * L + 1.6]),
        template="plotly_white", height=250 + 110 * L, width=350 + 90 * H, legend_title="edge colour: the input it enters",
    )
    return fig


# ----------------------------------------------------------------------------- MIB faithfulness

_METHOD_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f")


def plot_faithfulness(
    curve: pd.DataFrame, summary: Optional[pd.DataFrame] = None, *, title: Optional[str] = None, cols: int = 4,
) -> go.Figure:
    """MIB's faithfulness curve f(circuit size) per method, CPR and CMD beside each method's name.

    ``curve``: rows of :func:`~interp_norm.circuits.benchmark.mib.faithfulness_curve` (columns ``method``,
    ``fraction``, ``faithfulness``; an optional ``model`` column gives one panel per model).
    ``summary``: its :func:`~interp_norm.circuits.benchmark.mib.cpr_cmd` (same ``model`` column if any); the
    areas are read from it, never recomputed here. Sizes are on a log axis (MIB's fractions
    span 0.1 %..100 %); f = 1 (the full model) and f = 0 (the empty circuit) are dotted.
    """
    need = {"method", "fraction", "faithfulness"}
    if not isinstance(curve, pd.DataFrame) or not need <= set(curve.columns) or curve.empty:
        raise ConfigError(f"expected faithfulness_curve rows with columns {sorted(need)}")
    if summary is not None and (not isinstance(summary, pd.DataFrame) or not {"method", "cpr", "cmd"} <= set(summary.columns)):
        raise ConfigError("summary must be cpr_cmd rows with columns 'method', 'cpr', 'cmd'")
    models = list(dict.fromkeys(curve["model"])) if "model" in curve.columns else [None]
    methods = list(dict.fromkeys(curve["method"]))
    color = {m: _METHOD_COLORS[i % len(_METHOD_COLORS)] for i, m in enumerate(methods)}
    ncols = min(cols, len(models))
    nrows = math.ceil(len(models) / ncols)
    fig = make_subplots(rows=nrows, cols=ncols, subplot_titles=[escape(m) for m in models] if models[0] is not None else None,
                        horizontal_spacing=0.06, vertical_spacing=row_gap(nrows, 320 * nrows + 80, 48, 0.12))

    def areas(model, method) -> Optional[tuple[float, float]]:
        if summary is None:
            return None
        s = summary[summary["method"] == method]
        if model is not None and "model" in s.columns:
            s = s[s["model"] == model]
        return None if s.empty else (float(s["cpr"].iloc[0]), float(s["cmd"].iloc[0]))

    for i, model in enumerate(models):
        row, col = i // ncols + 1, i % ncols + 1
        sub = curve if model is None else curve[curve["model"] == model]
        notes = []
        for method in methods:
            g = sub[sub["method"] == method].sort_values("fraction")
            if g.empty:
                continue
            a = areas(model, method)
            tag = "" if a is None else f" (CPR {a[0]:.3f}, CMD {a[1]:.3f})"
            name = escape(method) + (tag if len(models) == 1 else "")
            if a is not None and len(models) > 1:
                notes.append(f"<span style='color:{color[method]}'>{escape(method)}</span> CPR {a[0]:.2f} CMD {a[1]:.2f}")
            fig.add_trace(go.Scatter(
                x=100 * g["fraction"], y=g["faithfulness"], mode="lines+markers", name=name,
                legendgroup=str(method), showlegend=i == 0, line=dict(color=color[method]),
                hovertemplate=f"{escape(method)}{tag}<br>%{{x:.3g}} % of edges<br>f = %{{y:.3f}}<extra></extra>",
            ), row=row, col=col)
        for y in (0.0, 1.0):
            fig.add_hline(y=y, line=dict(color="gray", dash="dot", width=1), row=row, col=col)
        if notes:
            ref = "" if i == 0 else str(i + 1)
            fig.add_annotation(text="<br>".join(notes), xref=f"x{ref} domain", yref=f"y{ref} domain", x=0.98, y=0.02,
                               xanchor="right", yanchor="bottom", showarrow=False, align="right", font=dict(size=10))
    fig.update_xaxes(type="log", title_text="edges in the circuit (%)")
    fig.update_yaxes(title_text="faithfulness f", col=1)
    fig.update_layout(
        title=escape(title) if title else "MIB faithfulness: f = (m(C) - m(∅)) / (m(N) - m(∅)); CPR = area under f, "
                                          "CMD = area under |1 - f|",
        template="plotly_white", height=320 * nrows + 80, width=max(520, 330 * ncols + 160),
        legend=dict(title="method"),
    )
    return fig


# ----------------------------------------------------------------------------- circuit tables as figures


def plot_faithfulness_bars(faith: pd.DataFrame, title: Optional[str] = None) -> go.Figure:
    """Circuit faithfulness per ablation (``circuits_faithfulness``: (circuit − all ablated) / (clean − all
    ablated)) as bars: one bar per series, the variant's colour, the seed's pattern."""
    need = {"variant", "ablation", "faithfulness"}
    if not isinstance(faith, pd.DataFrame) or not need <= set(faith.columns):
        raise ConfigError(f"expected the circuits faithfulness table with columns {sorted(need)}")
    fig = go.Figure()
    for v, g in faith.groupby("variant", sort=False):
        extra = g["n_edges"].astype(str) + " edges" if "n_edges" in g.columns else None
        fig.add_trace(go.Bar(x=g["ablation"], y=g["faithfulness"], name=str(v), marker=bar_style(v), customdata=extra,
                             hovertemplate=f"{escape(v)}, %{{x}} ablation: %{{y:.1%}} (%{{customdata}})<extra></extra>"))
    fig.add_hline(y=1, line=dict(color="grey", dash="dot", width=1))
    fig.update_layout(barmode="group", title=title or "Circuit faithfulness per ablation (100% = the full model's metric)",
                      xaxis_title="ablation of the edges outside the circuit", yaxis_title="faithfulness",
                      yaxis_tickformat=".0%", legend_title="model", height=420)
    return fig


def plot_attribution_agreement(table: pd.DataFrame, title: Optional[str] = None) -> go.Figure:
    """How well attribution (EAP, EAP-IG) ranks heads like exact patching (``circuits_eap_vs_exact``):
    Pearson, Spearman and top-k overlap per series as dots (the series' marker), one panel per method."""
    need = {"variant", "method"}
    if not isinstance(table, pd.DataFrame) or not need <= set(table.columns):
        raise ConfigError(f"expected the circuits eap_vs_exact table with columns {sorted(need)}")
    from interp_norm.report.plots._style import dodge, line_style

    metrics = [m for m in ("pearson", "spearman", "topk_overlap", "topk_sign_agreement") if m in table.columns]
    names = {"pearson": "Pearson r", "spearman": "Spearman ρ", "topk_overlap": "top-k overlap",
             "topk_sign_agreement": "top-k sign agreement"}
    methods = list(dict.fromkeys(table["method"]))
    series = list(dict.fromkeys(table["variant"]))
    fig = make_subplots(rows=1, cols=len(methods), shared_yaxes=True, horizontal_spacing=0.04,
                        subplot_titles=[f"{escape(m)} vs exact patching" for m in methods])
    for j, m in enumerate(methods):
        for i, v in enumerate(series):
            g = table[(table["method"] == m) & (table["variant"] == v)]
            if not len(g):
                continue
            r = g.iloc[0]
            fig.add_trace(go.Scatter(
                x=[k + dodge(i, len(series), 0.6) for k in range(len(metrics))], y=[r[c] for c in metrics], mode="markers",
                name=str(v), legendgroup=str(v), showlegend=j == 0, marker=line_style(v, size=9)["marker"],
                text=[names[c] for c in metrics], hovertemplate=f"{escape(v)}, %{{text}}: %{{y:.3f}}<extra></extra>",
            ), row=1, col=j + 1)
        fig.update_xaxes(tickmode="array", tickvals=list(range(len(metrics))), ticktext=[names[c] for c in metrics],
                         range=[-0.6, len(metrics) - 0.4], row=1, col=j + 1)
    k = int(table["k"].iloc[0]) if "k" in table.columns and len(table) else None
    fig.update_layout(title=title or "Attribution vs exact patching of heads (z, per position): agreement"
                      + (f" (top-k: k = {k})" if k else ""), legend_title="model", height=420)
    fig.update_yaxes(title_text="agreement", col=1)
    return fig


def plot_attribution_scatter(heads: pd.DataFrame, title: Optional[str] = None) -> go.Figure:
    """Attribution vs exact patching per head (``circuits_eap_vs_exact_heads``): one dot per head
    (x: exact effect of patching the whole head's ``z``, y: the EAP / EAP-IG estimate of it), one
    colour per variant (seeds by marker), one panel per method; on the dashed diagonal the estimate
    is exact."""
    need = {"variant", "method", "layer", "head", "attribution", "exact"}
    if not isinstance(heads, pd.DataFrame) or not need <= set(heads.columns):
        raise ConfigError(f"expected the circuits eap_vs_exact_heads table with columns {sorted(need)}")
    from interp_norm.report.plots._style import line_style

    methods = list(dict.fromkeys(heads["method"]))
    fig = make_subplots(rows=1, cols=len(methods), horizontal_spacing=0.08,
                        subplot_titles=[f"{escape(m).upper()} estimate vs exact" for m in methods])
    for j, m in enumerate(methods):
        g_m = heads[heads["method"] == m]
        for v, g in g_m.groupby("variant", sort=False):
            fig.add_trace(go.Scatter(
                x=g["exact"], y=g["attribution"], mode="markers", name=str(v), legendgroup=str(v), showlegend=j == 0,
                marker=line_style(v, size=9)["marker"], text=[f"L{int(l)}H{int(h)}" for l, h in zip(g["layer"], g["head"])],
                hovertemplate=f"{escape(v)}, %{{text}}: exact %{{x:.3g}}, {escape(m)} %{{y:.3g}}<extra></extra>",
            ), row=1, col=j + 1)
        lo = float(min(g_m["exact"].min(), g_m["attribution"].min(), 0.0)) if len(g_m) else 0.0
        hi = float(max(g_m["exact"].max(), g_m["attribution"].max(), 0.0)) if len(g_m) else 1.0
        pad = 0.05 * (hi - lo or 1.0)
        fig.add_trace(go.Scatter(x=[lo - pad, hi + pad], y=[lo - pad, hi + pad], mode="lines", showlegend=False,
                                 hoverinfo="skip", line=dict(color="grey", dash="dash", width=1)), row=1, col=j + 1)
        fig.update_xaxes(title_text="exact patching effect (whole head)", range=[lo - pad, hi + pad], row=1, col=j + 1)
        fig.update_yaxes(range=[lo - pad, hi + pad], row=1, col=j + 1)
    fig.update_yaxes(title_text="attribution estimate", col=1)
    fig.update_layout(title=title or "Attribution vs exact patching, one dot per head (z, whole head)",
                      legend_title="model", height=440)
    return fig


def plot_attention_map(table: pd.DataFrame, split: Optional[str] = None, cols: int = 2,
                       title: Optional[str] = None) -> go.Figure:
    """Sparse attention from the answer positions (``circuits_attention_map``) as heatmaps, one
    panel per series: rows are heads (``L1H3``), columns the query positions, colour the share of
    problems in which the head attends sparsely (max weight ≥ 95%) to its most frequent key,
    whose token role is written in the cell."""
    need = {"variant", "query", "layer", "head", "key", "frequency"}
    if not isinstance(table, pd.DataFrame) or not need <= set(table.columns):
        raise ConfigError(f"expected the circuits attention_map table with columns {sorted(need)}")
    df = table
    if "split" in df.columns:
        split = split if split is not None else str(df["split"].iloc[0])
        df = df[df["split"] == split]
    series = list(dict.fromkeys(df["variant"]))
    queries = list(dict.fromkeys(df["query"]))
    ncols = min(cols, len(series))
    nrows = -(-len(series) // ncols)
    heads_of = {v: sorted({(int(l), int(h)) for l, h in zip(g["layer"], g["head"])}) for v, g in df.groupby("variant", sort=False)}
    n_heads = max((len(h) for h in heads_of.values()), default=1)
    panel_h = 90 + 26 * n_heads
    height = panel_h * nrows + 140
    fig = make_subplots(rows=nrows, cols=ncols, subplot_titles=[escape(v) for v in series], horizontal_spacing=0.12,
                        vertical_spacing=row_gap(nrows, height, 90, 0.2))
    for i, v in enumerate(series):
        g = df[df["variant"] == v]
        top = g.sort_values("frequency", ascending=False).drop_duplicates(["layer", "head", "query"])
        heads = heads_of[v]
        z = np.zeros((len(heads), len(queries)))  # a head the table does not list at a position: sparse in 0%
        text = [["–" for _ in queries] for _ in heads]
        for rec in top.itertuples():
            a, b = heads.index((int(rec.layer), int(rec.head))), queries.index(rec.query)
            z[a, b] = rec.frequency
            text[a][b] = escape(rec.key)
        fig.add_trace(go.Heatmap(z=z, x=[escape(q) for q in queries], y=[f"L{l}H{h}" for l, h in heads], text=text,
                                 texttemplate="%{text}", textfont=dict(size=10), coloraxis="coloraxis",
                                 hovertemplate="%{y} from %{x}: attends to %{text} in %{z:.0%} of problems<extra></extra>"),
                      row=i // ncols + 1, col=i % ncols + 1)
    fig.update_yaxes(autorange="reversed", tickfont=dict(size=10))
    fig.update_xaxes(tickfont=dict(size=10))
    fig.update_layout(title=title or "Sparse attention from the answer positions: which head attends to which token"
                      + (f" ({escape(split)} split)" if split else "") + " (–: never sparse there)", height=height,
                      coloraxis=dict(colorscale="Blues", cmin=0, cmax=1,
                                     colorbar=dict(title="share", tickformat=".0%", lenmode="pixels",
                                                   len=min(300, panel_h), yanchor="top", y=1, thickness=14)))
    return fig
