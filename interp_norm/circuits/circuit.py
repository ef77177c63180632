"""Circuits as edge sets, built from any score table; faithfulness under three ablations.

Drawing lives in :func:`interp_norm.report.plots.draw_circuit` (analyses never plot).

A :class:`Circuit` is a set of edges (sender -> receiver, named as in
:mod:`interp_norm.circuits.edges`: ``embed``, ``a{l}.h{h}``, ``m{l}`` -> ``a{l}.h{h}.q|k|v``,
``m{l}``, ``logits``). Node circuits (a set of heads/MLPs) become every edge among the kept nodes,
the embedding and the logits -- which is the same as ablating every other node's output.
A model whose receivers are not each head's q, k and v (grouped k/v heads; Gemma 4's KV-sharing and
``k = v`` layers) has circuits over its own receivers: give ``layout=`` (:func:`receiver_layout_of`).
A node circuit keeps the edges from its nodes into a k/v receiver (``a{l}.kv{g}.k|v``, read by several
heads, of several layers under KV sharing): the heads outside it have every output edge ablated, so
what they read does not matter.

Faithfulness runs the clean input with every edge *outside* the circuit ablated: the receiver
sees the ablated value of that sender instead of its value in this run. Ablation choices give very
different numbers (Miller et al. 2024), so :func:`faithfulness` reports all three:

* ``resample``: the sender's activation on the paired corrupted input (EAP-IG's "patching");
  ablating every edge reproduces the corrupted run exactly.
* ``mean``: the sender's mean over the clean batch at each position ("mean-positional").
* ``zero``: zero (biases outside the senders, e.g. ``b_O``, stay).

The recovered fraction is ``(M(circuit) - M(empty)) / (M(clean) - M(empty))`` with the
batch-mean metric, so the full model scores 1 and the empty circuit 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence, Union

import pandas as pd
import torch
from torch import Tensor

from interp_norm.circuits._types import MetricFn, PatchResult, device, metric_values
from interp_norm.circuits.edge_layer_input import check_hf_bridge
from interp_norm.circuits.edges import EdgeGraph, EdgeRunner, prune_edges, receiver_node
from interp_norm.circuits.metrics import LogitDiff
from interp_norm.circuits.pairs import PatchingPairs
from interp_norm.errors import PatchingError
from interp_norm.core.nodes import EMBED, LOGITS, parse
from interp_norm.core.nodes import head as head_node
from interp_norm.core.nodes import mlp as mlp_node

ABLATIONS = ("resample", "mean", "zero")

Layout = Optional[tuple[tuple[int, str], ...]]


def receiver_layout_of(model) -> Layout:
    """The per-layer (k/v heads, inputs) a circuit of ``model`` needs as ``layout=`` (None: each head's
    q, k and v in every layer, the default), as :class:`EdgeRunner` builds its graph."""
    layout = check_hf_bridge(model)[0]
    if layout is None:
        return None
    g = EdgeGraph.of_layers(model.cfg.n_layers, model.cfg.n_heads, layout)
    return None if not g.grouped else tuple(g.layer_layout(l) for l in range(g.n_layers))


@dataclass
class Circuit:
    """A set of edges with optional scores, for a model with ``n_layers`` x ``n_heads`` (and, where its
    receivers are not each head's q, k and v, per layer (k/v heads, inputs): ``layout``)."""

    n_layers: int
    n_heads: int
    edges: frozenset = frozenset()
    scores: dict = field(default_factory=dict)
    node_scores: dict = field(default_factory=dict)
    layout: Layout = None

    def __post_init__(self) -> None:
        if self.layout is not None:
            self.layout = tuple((int(kv), str(inputs)) for kv, inputs in self.layout)
        g = self.graph
        valid = set(g.edges())
        edges = frozenset(tuple(e) for e in self.edges)
        bad = sorted(edges - valid)
        if bad:
            raise PatchingError(
                f"{len(bad)} edges do not exist in a {self.n_layers}-layer, {self.n_heads}-head model, e.g. {bad[:3]}; "
                "senders are 'embed', 'a{l}.h{h}', 'm{l}' and receivers 'a{l}.h{h}.q|k|v' (or the model's own: "
                "layout=receiver_layout_of(model)), 'm{l}', 'logits' at a later point"
            )
        self.edges = edges

    @property
    def graph(self) -> EdgeGraph:
        if self.layout is None:
            return EdgeGraph(self.n_layers, self.n_heads)
        return EdgeGraph.of_layers(self.n_layers, self.n_heads, self.layout)

    @property
    def nodes(self) -> set[str]:
        """Senders and receiver nodes touched by an edge (``embed`` and ``logits`` included)."""
        out = set()
        for u, r in self.edges:
            out.add(u)
            out.add(receiver_node(r))
        return out

    @property
    def components(self) -> set[str]:
        """The heads and MLPs in the circuit (nodes without ``embed``/``logits``)."""
        return self.nodes - {EMBED, LOGITS}

    def __len__(self) -> int:
        return len(self.edges)

    def __contains__(self, edge) -> bool:
        return tuple(edge) in self.edges

    def mask(self) -> Tensor:
        """[n_senders, n_receivers] bool: True for edges in the circuit."""
        g = self.graph
        si = {s: i for i, s in enumerate(g.senders)}
        ri = {r: i for i, r in enumerate(g.receivers)}
        m = torch.zeros(len(si), len(ri), dtype=torch.bool)
        for u, r in self.edges:
            m[si[u], ri[r]] = True
        return m

    def to_dataframe(self) -> pd.DataFrame:
        """One row per edge: ``sender``, ``receiver``, ``receiver_node``, ``score`` (NaN if unscored)."""
        rows = [dict(sender=u, receiver=r, receiver_node=receiver_node(r), score=self.scores.get((u, r), math.nan)) for u, r in self.edges]
        df = pd.DataFrame(rows, columns=["sender", "receiver", "receiver_node", "score"])
        return df.sort_values(["sender", "receiver"]).reset_index(drop=True)

    def to_json(self) -> dict:
        """A JSON-able dict: ``n_layers``, ``n_heads``, the sorted ``edges`` (sender, receiver, score or None)
        and, where it is not the default, the ``layout``."""
        out = dict(
            n_layers=self.n_layers, n_heads=self.n_heads,
            edges=[dict(sender=u, receiver=r, score=self.scores.get((u, r))) for u, r in sorted(self.edges)],
        )
        return out if self.layout is None else {**out, "layout": [list(x) for x in self.layout]}

    # -- constructors ------------------------------------------------------------------------
    @classmethod
    def full(cls, n_layers: int, n_heads: int, *, layout: Layout = None) -> "Circuit":
        return cls(n_layers, n_heads, frozenset(cls.empty(n_layers, n_heads, layout=layout).graph.edges()), layout=layout)

    @classmethod
    def empty(cls, n_layers: int, n_heads: int, *, layout: Layout = None) -> "Circuit":
        return cls(n_layers, n_heads, frozenset(), layout=layout)

    @classmethod
    def from_dataframe(cls, df: pd.DataFrame, n_layers: int, n_heads: int, *, layout: Layout = None) -> "Circuit":
        """The circuit of an edge table (:meth:`to_dataframe`'s columns ``sender``, ``receiver``, ``score``)."""
        for col in ("sender", "receiver"):
            if col not in df.columns:
                raise PatchingError(f"a circuit table needs columns sender and receiver; missing {col!r}")
        edges = list(zip(df["sender"].astype(str), df["receiver"].astype(str)))
        scores = df["score"] if "score" in df.columns else [math.nan] * len(df)
        return cls(n_layers, n_heads, frozenset(edges), {e: float(v) for e, v in zip(edges, scores) if not pd.isna(v)}, layout=layout)

    @classmethod
    def from_nodes(cls, nodes: Iterable[str], n_layers: int, n_heads: int, node_scores: Optional[dict] = None, *,
                   layout: Layout = None) -> "Circuit":
        """Every edge among ``nodes`` (heads ``a{l}.h{h}``, MLPs ``m{l}``), the embedding and the logits (and
        from them into k/v receivers: see the module docstring)."""
        keep = set(nodes) | {EMBED, LOGITS}
        g = cls.empty(n_layers, n_heads, layout=layout).graph
        unknown = sorted(set(nodes) - set(g.senders))
        if unknown:
            raise PatchingError(f"unknown nodes {unknown[:5]}; use names like 'a0.h1' and 'm0'")
        edges = frozenset((u, r) for u, r in g.edges() if u in keep and (receiver_node(r) in keep or parse(r).kind == "kv"))
        return cls(n_layers, n_heads, edges, node_scores=dict(node_scores or {}), layout=layout)

    @classmethod
    def from_edge_scores(
        cls, df: pd.DataFrame, n_layers: int, n_heads: int, *, threshold: Optional[float] = None,
        top_n: Optional[int] = None, absolute: bool = True, prune: bool = True, layout: Layout = None,
    ) -> "Circuit":
        """Edges whose score passes ``threshold`` (on |score| if ``absolute``) or the ``top_n`` best.

        ``prune`` drops edges that cannot carry signal from the embedding to the logits (a sender
        no kept edge feeds, or a receiver node with no kept way out); with ``top_n`` the ranking is
        then followed further until at least ``top_n`` edges survive (or the ranking ends).
        """
        _check_select(threshold, top_n)
        for col in ("sender", "receiver", "score"):
            if col not in df.columns:
                raise PatchingError(f"edge scores need columns sender, receiver, score; missing {col!r}")
        key = df["score"].abs() if absolute else df["score"]
        order = key.sort_values(ascending=False, kind="stable").index
        ranked = list(zip(df.loc[order, "sender"], df.loc[order, "receiver"]))
        if top_n is None:
            edges = set(ranked[: int((key.loc[order] >= threshold).sum())])
            if prune:
                edges = prune_edges(edges)
        elif not prune:
            edges = set(ranked[:top_n])
        else:  # grow down the ranking until top_n edges survive pruning
            edges = set()
            for k in range(top_n, len(ranked) + 1):
                edges = prune_edges(set(ranked[:k]))
                if len(edges) >= top_n:
                    break
        scores = {(u, r): float(s) for u, r, s in zip(df["sender"], df["receiver"], df["score"]) if (u, r) in edges}
        return cls(n_layers, n_heads, frozenset(edges), scores, layout=layout)

    @classmethod
    def from_node_scores(
        cls, scores: Union[PatchResult, pd.DataFrame], n_layers: int, n_heads: int, *,
        threshold: Optional[float] = None, top_n: Optional[int] = None, absolute: bool = True, layout: Layout = None,
    ) -> "Circuit":
        """Heads (rows with ``layer`` and ``head``) and MLPs (``layer`` only, e.g. an ``mlp_out``
        sweep) whose score passes ``threshold`` or are the ``top_n`` best.

        A :class:`PatchResult` contributes its ``effect()`` summed over positions (use ``by="all"``
        results to rank whole heads by one patch); a DataFrame needs a ``score`` column, or
        ``effect``, and a ``kind`` column ('head'/'mlp') when it mixes both.
        """
        _check_select(threshold, top_n)
        df = _node_table(scores)
        key = df["score"].abs() if absolute else df["score"]
        order = key.sort_values(ascending=False, kind="stable").index
        sel = df.loc[order]
        sel = sel.head(top_n) if top_n is not None else sel[key.loc[order] >= threshold]
        nodes = set(sel["node"])
        return cls.from_nodes(nodes, n_layers, n_heads, node_scores=dict(zip(df["node"], df["score"])), layout=layout)


def _check_select(threshold: Optional[float], top_n: Optional[int]) -> None:
    if (threshold is None) == (top_n is None):
        raise PatchingError("give exactly one of threshold= or top_n=")
    if top_n is not None and (not isinstance(top_n, int) or top_n < 0):
        raise PatchingError(f"top_n must be a non-negative integer, got {top_n!r}")


def _node_table(scores: Union[PatchResult, pd.DataFrame]) -> pd.DataFrame:
    if isinstance(scores, PatchResult):
        if scores.activation in ("z", "q", "k", "v", "pattern"):
            kind = "head"
        elif scores.activation == "mlp_out":
            kind = "mlp"
        else:
            raise PatchingError(
                f"node circuits come from head activations (z, q, k, v, pattern) or mlp_out, not {scores.activation!r}"
            )
        df = scores.to_dataframe().rename(columns={"effect": "score"})
    else:
        df = scores.copy()
        if "score" not in df.columns:
            if "effect" not in df.columns:
                raise PatchingError("node scores need a 'score' (or 'effect') column")
            df = df.rename(columns={"effect": "score"})
        kind = None
    if "layer" not in df.columns:
        raise PatchingError("node scores need a 'layer' column (and 'head' for heads)")
    if kind is None:
        kind = df["kind"] if "kind" in df.columns else ("head" if "head" in df.columns else "mlp")
    df = df.assign(kind=kind)
    has_head = "head" in df.columns
    df["node"] = [
        head_node(l, h) if k == "head" else mlp_node(l)
        for l, h, k in zip(df["layer"], df["head"] if has_head else [0] * len(df), df["kind"])
    ]
    return df.groupby("node", as_index=False)["score"].sum()


def _check_graphs(circuits: Sequence[Circuit], graph: EdgeGraph) -> None:
    """Each circuit's receivers are the model's (a circuit is a mask over the model's edges)."""
    for c in circuits:
        if c.graph != graph and c.layout is None and graph.grouped:
            raise PatchingError(
                "this model groups its k/v heads or has layers without k/v projections of their own (receivers "
                "a{l}.kv{g}.k|v, or none): build the circuit over its receivers with layout=receiver_layout_of(model)"
            )
        if c.graph != graph:
            raise PatchingError(
                f"the circuit's receivers ({c.n_layers} x {c.n_heads}, layout {c.layout}) are not the model's "
                f"({graph.n_layers} x {graph.n_heads}, per layer {[graph.layer_layout(l) for l in range(graph.n_layers)]}); "
                "build it with layout=receiver_layout_of(model)"
            )


def _ablation_values(kind: str, s_clean: Tensor, s_corr: Tensor) -> Tensor:
    if kind == "resample":
        return s_corr
    if kind == "mean":
        return s_clean.mean(1, keepdim=True).expand_as(s_clean)
    if kind == "zero":
        return torch.zeros_like(s_clean)
    raise PatchingError(f"unknown ablation {kind!r}; choose from {ABLATIONS}")


@torch.no_grad()
def run_with_circuit(
    model, tokens: Tensor, circuits: Sequence[Circuit], ablated: Tensor, backend: str = "auto", _runner=None
) -> Tensor:
    """Logits ``[len(circuits), batch, pos, vocab]`` of ``tokens`` with every edge outside each
    circuit ablated to the sender values ``ablated`` ``[n_senders, batch, pos, d_model]``."""
    runner = _runner or EdgeRunner(model, backend)
    _check_graphs(circuits, runner.graph)
    dev = device(model)
    valid = runner.valid
    W = torch.stack([valid & ~c.mask() for c in circuits]).to(dev)
    G = len(circuits)
    logits, _ = runner.run(tokens.to(dev).repeat(G, 1), weights=W, ablated=ablated)
    return logits.view(G, tokens.shape[0], *logits.shape[1:])


@torch.no_grad()
def faithfulness(
    model,
    pairs: PatchingPairs,
    circuit: Union[Circuit, Sequence[Circuit]],
    metric: Optional[MetricFn] = None,
    *,
    ablations: Sequence[str] = ABLATIONS,
    backend: str = "auto",
) -> pd.DataFrame:
    """Fraction of the metric each circuit recovers, for each ablation type.

    One row per (circuit, ablation): ``metric_circuit``, ``metric_clean``, ``metric_empty`` (every
    edge ablated), ``metric_corrupted``, ``faithfulness`` = (circuit - empty) / (clean - empty),
    and the circuit's size.
    """
    if not isinstance(pairs, PatchingPairs):
        raise PatchingError("faithfulness needs PatchingPairs (clean and corrupted tokens)")
    circuits = [circuit] if isinstance(circuit, Circuit) else list(circuit)
    cfg = model.cfg
    for c in circuits:
        if (c.n_layers, c.n_heads) != (cfg.n_layers, cfg.n_heads):
            raise PatchingError(
                f"the circuit is for {c.n_layers} layers x {c.n_heads} heads but the model has "
                f"{cfg.n_layers} x {cfg.n_heads}"
            )
    metric = metric if metric is not None else LogitDiff(pairs)
    runner = EdgeRunner(model, backend)
    _check_graphs(circuits, runner.graph)
    dev = device(model)
    clean, corr = pairs.clean_tokens.to(dev), pairs.corrupted_tokens.to(dev)
    b = clean.shape[0]
    clean_logits, s_clean = runner.sender_cache(clean)
    corr_logits, s_corr = runner.sender_cache(corr)
    m_clean = float(metric_values(metric, clean_logits, b).mean())
    m_corr = float(metric_values(metric, corr_logits, b).mean())
    empty = Circuit.empty(cfg.n_layers, cfg.n_heads, layout=circuits[0].layout if circuits else None)
    rows = []
    for kind in ablations:
        abl = _ablation_values(kind, s_clean, s_corr)
        logits = run_with_circuit(model, clean, [empty, *circuits], abl, _runner=runner)
        vals = metric_values(metric, logits.reshape(-1, *logits.shape[2:]), b).view(len(circuits) + 1, b).mean(-1)
        m_empty = float(vals[0])
        for i, c in enumerate(circuits):
            mc = float(vals[i + 1])
            denom = m_clean - m_empty
            rows.append(dict(
                circuit=i, ablation=kind, n_edges=len(c), n_components=len(c.components),
                metric_circuit=mc, metric_clean=m_clean, metric_empty=m_empty, metric_corrupted=m_corr,
                faithfulness=(mc - m_empty) / denom if denom != 0 else math.nan,
            ))
    return pd.DataFrame(rows)


__all__ = ["Circuit", "faithfulness", "run_with_circuit", "receiver_layout_of", "ABLATIONS"]
