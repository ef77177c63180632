"""One function per figure: DataFrames in, plotly figures out (the dashboard and the notebooks share them).

The noise/collapse figures live in :mod:`interp_norm.plots_noise`, the geometry figures in
:mod:`interp_norm.plots_geometry`; both are re-exported here, so ``from interp_norm import plots``
reaches every figure. This module adds the model card, attention patterns, patching heatmaps and
the circuit graph. Two small table helpers sit beside the figures because they only *read* what a
model already holds (its config, its cached ``hook_pattern``): :func:`model_card` and
:func:`attention_patterns`; every analysis proper lives in its own module.

Labels that come from users (checkpoint names, problem strings) are HTML-escaped before they
reach plotly, which would otherwise interpret tags like ``<b>`` inside them.
"""

from __future__ import annotations

import html
import math
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import pandas as pd
import plotly.colors
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from interp_norm.errors import ConfigError
from interp_norm.plots_geometry import (
    plot_attention_sparsity,
    plot_component_cosines,
    plot_ellipsoid_axes,
    plot_interference,
    plot_norm_distribution,
    plot_norm_spread,
    plot_sphere_scores,
    plot_subspace_angles,
)
from interp_norm.plots_noise import plot_accuracy_vs_noise, plot_collapse_thresholds, plot_collapse_vs_noise

__all__ = [
    "PAPER_PER_TOKEN_ACCURACY",
    "VARIANT_LABELS",
    "escape",
    "variant_label",
    # model card
    "model_card",
    "plot_model_card",
    "plot_accuracy_by_split",
    "plot_training_curves",
    # attention
    "attention_patterns",
    "plot_attention_pattern",
    "plot_attention_patterns",
    "plot_attention_explorer",
    # circuits
    "plot_patching_heatmap",
    "plot_circuit_graph",
    # re-exported: noise
    "plot_accuracy_vs_noise",
    "plot_collapse_vs_noise",
    "plot_collapse_thresholds",
    # re-exported: geometry
    "plot_norm_spread",
    "plot_norm_distribution",
    "plot_attention_sparsity",
    "plot_sphere_scores",
    "plot_component_cosines",
    "plot_subspace_angles",
    "plot_interference",
    "plot_ellipsoid_axes",
]

# Menary et al. (2024), results table: per-token accuracy of the Baseline models on the paper's
# task and model size (digest §3.7). Our CPU models are smaller and train on a smaller task, so
# these are a reference point for the shape (ID ≈ equal, QKV-Norm worse OOD), not a target.
PAPER_PER_TOKEN_ACCURACY: dict[str, dict[str, float]] = {
    "pre": {"id": 0.9138, "interp": 0.8746, "extrap": 0.6665},
    "qkv": {"id": 0.9099, "interp": 0.8254, "extrap": 0.4676},
}
VARIANT_LABELS = {"pre": "Pre-Norm", "qkv": "QKV-Norm", "qk": "QK-Norm", "none": "No-Norm"}
SPLITS = ("id", "interp", "extrap")


def escape(text: Any) -> str:
    """HTML-escape user text for plotly labels and the dashboard (plotly renders entities back)."""
    return html.escape(str(text), quote=True)


def variant_label(name: str, attn_norm: Optional[str] = None) -> str:
    """``"Pre-Norm (pre-s1)"`` for a checkpoint called ``pre-s1``; ``"Pre-Norm"`` when the name is the variant.

    Raw text (for tables and CSVs); figures escape it when they display it.
    """
    nice = VARIANT_LABELS.get(attn_norm or "", attn_norm or "")
    if not nice or name == attn_norm:
        return str(nice or name)
    return f"{nice} ({name})"


# ----------------------------------------------------------------------------- model card


def model_card(
    models: Mapping[str, Any],
    evaluation: Optional[pd.DataFrame] = None,
    paper: Mapping[str, Mapping[str, float]] = PAPER_PER_TOKEN_ACCURACY,
) -> pd.DataFrame:
    """One row per checkpoint: architecture, training, per-split accuracy and the paper's number.

    ``models`` maps a name to a :class:`~interp_norm.checkpoints.CheckpointInfo` (or a
    ``(model, info)`` pair). ``evaluation``: :func:`interp_norm.evaluate.evaluate` rows with a
    ``checkpoint`` column; without it, the accuracies stored in the checkpoint are used.
    """
    rows = []
    for name, item in models.items():
        info = item[1] if isinstance(item, tuple) else item
        cfg, tc = info.model_cfg, info.train_cfg
        row: dict[str, Any] = dict(
            checkpoint=name, attn_norm=cfg.attn_norm, norm_kind=cfg.norm_kind, seed=cfg.seed,
            n_layers=cfg.n_layers, n_heads=cfg.n_heads, d_model=cfg.d_model, d_head=cfg.d_head, d_mlp=cfg.d_mlp,
            n_params=_n_params(item[0]) if isinstance(item, tuple) else math.nan,
            task_terms="/".join(
                ",".join(map(str, t)) for t in (info.task.train_terms, info.task.interp_terms, info.task.extrap_terms)
            ),
            steps=info.step,
            examples=(info.step or 0) * tc.batch_size if tc is not None else math.nan,
            lr=tc.lr if tc is not None else math.nan,
        )
        if len(info.curve) and "loss" in info.curve:
            row["final_train_loss"] = float(info.curve["loss"].iloc[-1])
        if evaluation is not None and len(evaluation):
            ev = evaluation[evaluation["checkpoint"] == name] if "checkpoint" in evaluation else evaluation
            accs = {r["split"]: r for r in ev.to_dict("records")}
        else:
            accs = {r["split"]: r for r in info.metrics.get("evaluation", []) if "split" in r}
        for s in SPLITS:
            r = accs.get(s, {})
            row[f"{s}_acc"] = r.get("per_token_acc", math.nan)
            row[f"paper_{s}_acc"] = paper.get(cfg.attn_norm, {}).get(s, math.nan)
            row[f"{s}_exact"] = r.get("exact_match", math.nan)
        rows.append(row)
    return pd.DataFrame(rows)


def _n_params(model: Any) -> int:
    return int(sum(p.numel() for p in model.parameters()))


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
    """Per-token accuracy per split for every checkpoint (bars) with the paper's value (black marks)."""
    fig = go.Figure()
    pal = plotly.colors.qualitative.Plotly
    for i, r in enumerate(card.to_dict("records")):
        fig.add_trace(go.Bar(
            x=list(SPLITS), y=[r.get(f"{s}_acc", math.nan) for s in SPLITS],
            name=escape(variant_label(r["checkpoint"], r.get("attn_norm"))), marker_color=pal[i % len(pal)],
        ))
    shown = set()
    for r in card.to_dict("records"):
        a = r.get("attn_norm")
        if a in shown or all(math.isnan(r.get(f"paper_{s}_acc", math.nan)) for s in SPLITS):
            continue
        shown.add(a)
        fig.add_trace(go.Scatter(
            x=list(SPLITS), y=[r[f"paper_{s}_acc"] for s in SPLITS], mode="markers+lines",
            name=f"paper: {VARIANT_LABELS.get(a, a)}", line=dict(color="black", dash="dot" if a == "qkv" else "dash", width=1),
            marker=dict(symbol="line-ew-open", size=18, color="black"),
        ))
    fig.update_layout(barmode="group", title=title or "Per-token accuracy per split (ours: bars; Menary et al. 2024: black)",
                      yaxis=dict(title="per-token accuracy", tickformat=".0%", range=[0, 1]), xaxis_title="split")
    return fig


def plot_training_curves(curves: pd.DataFrame, value: str = "loss") -> go.Figure:
    """Training curves (``value`` = loss or acc) vs examples seen, one line per checkpoint.

    ``curves``: the checkpoints' ``training_curve.csv`` rows with a ``checkpoint`` column.
    """
    if not isinstance(curves, pd.DataFrame) or not {"checkpoint", value} <= set(curves.columns):
        raise ConfigError(f"plot_training_curves expects a DataFrame with columns 'checkpoint' and {value!r}")
    x = "examples" if "examples" in curves else "step"
    fig = go.Figure()
    for name, g in curves.groupby("checkpoint", sort=False):
        a = g["attn_norm"].iloc[0] if "attn_norm" in g else None
        fig.add_trace(go.Scatter(x=g[x], y=g[value], mode="lines", name=escape(variant_label(name, a))))
    fig.update_layout(title=f"Training {value}", xaxis_title=x, yaxis_title=value)
    if value == "loss":
        fig.update_yaxes(type="log")
    else:
        fig.update_yaxes(tickformat=".0%")
    return fig


# ----------------------------------------------------------------------------- attention


def attention_patterns(model: Any, problems: Sequence[Any], name: Optional[str] = None) -> pd.DataFrame:
    """The cached ``hook_pattern`` of each problem as a tidy table for the attention figures.

    ``problems``: strings (``"[12+N7="`` or a full ``"[12+N7=5]"``) or :class:`~interp_norm.task.Problem`;
    a question without answer is completed with the true answer, so the table shows the pattern
    while the answer is produced (teacher forcing). One row per (problem, layer, head, query, key)
    with ``key <= query``: ``weight``, ``q_token``, ``k_token``. ``name`` labels the model.
    """
    import torch

    from interp_norm import task as T

    if isinstance(problems, (str, T.Problem)):
        problems = [problems]
    if not problems:
        raise ConfigError("attention_patterns needs at least one problem, e.g. ['[12+N7=5]']")
    probs = [p if isinstance(p, T.Problem) else T.parse_problem(p) for p in problems]
    texts = [p.text for p in probs]
    cfg = model.cfg
    longest = max(len(t) for t in texts)
    if longest > cfg.n_ctx:
        raise ConfigError(f"a problem has {longest} tokens but the model's n_ctx is {cfg.n_ctx}; choose shorter problems")
    frames = []
    names = {f"blocks.{l}.attn.hook_pattern" for l in range(cfg.n_layers)}
    with torch.no_grad():
        for i, text in enumerate(texts):
            tokens = T.encode(text)[None].to(model.W_E.device)
            _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
            toks = list(text)
            n = len(toks)
            qi, ki = np.tril_indices(n)
            for l in range(cfg.n_layers):
                pat = cache[f"blocks.{l}.attn.hook_pattern"][0].double().cpu().numpy()  # h q k
                for h in range(cfg.n_heads):
                    frames.append(pd.DataFrame(dict(
                        problem=i, text=text, layer=l, head=h, query=qi, key=ki, weight=pat[h, qi, ki],
                        q_token=[toks[j] for j in qi], k_token=[toks[j] for j in ki],
                    )))
    df = pd.concat(frames, ignore_index=True)
    df.insert(0, "model", name if name is not None else cfg.attn_norm)
    return df


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
                        horizontal_spacing=0.03, vertical_spacing=0.06)
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


# ----------------------------------------------------------------------------- circuits


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
    fig = make_subplots(
        rows=len(variants), cols=len(acts), horizontal_spacing=0.06, vertical_spacing=0.12,
        subplot_titles=[
            (f"{escape(v)}: " if v else "") + f"{escape(a)}" + (f" ({escape(b)})" if b else "")
            for v in variants for a, b in acts
        ],
    )
    vals = df[value].to_numpy(dtype=float)
    lim = float(np.nanmax(np.abs(vals))) if np.isfinite(vals).any() else 1.0
    lim = lim if lim > 0 else 1.0
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
            xt = [f"{escape(pos_labels[c])}·{c}" if isinstance(c, (int, np.integer)) and c < len(pos_labels) else str(c) for c in cols]
        else:
            xt = [str(c) for c in cols]
        fig.add_trace(
            go.Heatmap(z=mat.to_numpy(), x=xt, y=list(mat.index), coloraxis="coloraxis",
                       hovertemplate="%{y} @ %{x}<br>" + value + " %{z:.3f}<extra></extra>"),
            row=variants.index(v) + 1, col=acts.index((a, b)) + 1,
        )
    fig.update_layout(
        title=title or f"Activation patching (clean → corrupted), {value}",
        coloraxis=dict(colorscale="RdBu", cmid=0, cmin=-lim, cmax=lim, colorbar=dict(title=value)),
        height=max(320, 300 * len(variants)),
    )
    fig.update_yaxes(autorange="reversed")
    return fig


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
    by :func:`interp_norm.circuits.draw_circuit` (embed at the bottom, one row per attention layer and
    MLP, edge colour = the input it enters). Any other edge table with ``source``/``target``/``score``
    columns is drawn as a layered graph, left to right: nodes by layer (names like ``L1H2``,
    ``a1.2``, ``m1``, ``blocks.1...``; ``embed`` first, ``logits`` last, or ``nodes`` with ``node`` and
    ``layer`` columns), edges coloured by sign, width by |score|, the ``max_edges`` strongest drawn.
    """
    from interp_norm.circuits import Circuit, draw_circuit

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
