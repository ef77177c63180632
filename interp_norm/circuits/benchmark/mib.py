"""MIB circuit-localisation metrics: the faithfulness curve, CPR and CMD, and MIB's edge-score JSON.

MIB (Mueller et al. 2025, "MIB: A Mechanistic Interpretability Benchmark", circuit track) scores
a circuit-discovery method by the circuits its edge scores produce at fixed sizes, not by one
hand-picked circuit, so no threshold has to be tuned. We follow MIB's reference implementation
(``evaluate_area_under_curve`` in the MIB-circuit-track repository, which builds on EAP-IG's
``Graph``) point by point:

* **Sizes.** For each fraction ``p`` in :data:`MIB_FRACTIONS` (0.1, 0.2, 0.5, 1, 2, 5, 10, 20,
  50, 100 % of all edges) the circuit is the top ``k = int(p * n_edges)`` edges by ``|score|``
  (``absolute=False``: by signed score), then *pruned* as MIB's ``Graph.prune`` does: a node stays
  only while some kept edge enters it (the embedding always counts as entered) and some kept
  edge leaves it (the logits always stay); edges touching a dropped node are dropped; repeat.
  So the circuit may end up with fewer than ``k`` edges (column ``n_edges``). Ties in ``|score|``
  keep the order of the score table (stable sort; MIB's ``argsort`` leaves ties unspecified).
* **Faithfulness.** ``f(C) = (m(C) - m(∅)) / (m(N) - m(∅))`` with the batch-mean metric, where
  every edge outside ``C`` is resample-ablated (the receiver sees the sender's value on the
  corrupted input -- MIB's default ``intervention="patching"``); ``m(N)`` is the clean model and
  ``m(∅)`` the circuit without edges. Computed by :func:`interp_norm.circuits.faithfulness`.
* **Areas.** CPR ("circuit performance ratio", higher is better) is the area under ``f`` and
  CMD ("circuit-model distance", lower is better) the area under ``|1 - f|``, both by the
  trapezoid rule over the edge *fraction* axis ``x = p`` (0.001 ... 1, linear, MIB's default
  ``log_scale=False``): ``sum_i (x_{i+1} - x_i) (g_i + g_{i+1}) / 2``. The axis spans 0.999, so a
  circuit with ``f = 1`` at every size has CPR 0.999 and CMD 0. ``log_scale=True`` integrates over
  ``ln p`` instead (MIB's option). ``average`` is the plain mean of ``f`` over the sizes.

The JSON export matches EAP-IG's ``Graph.to_json`` (what MIB's ``Graph.from_json`` loads):
``{"cfg": {n_layers, n_heads, parallel_attn_mlp, d_model}, "nodes": {name: {"in_graph"}},
"edges": {"input->a0.h1<q>": {"score", "in_graph"}, "a0.h1->m0": ..., "m1->logits": ...}}``.
Names map one to one: our ``embed`` is their ``input``, our receiver ``a1.h0.q`` is their child
``a1.h0`` with ``<q>``; the edge sets are identical (sequential attention then MLP per layer).
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Optional, Sequence, Union

import pandas as pd

from interp_norm.circuits import (
    Circuit,
    EdgeGraph,
    LogitDiff,
    PatchingPairs,
    edge_attribution,
    exact_edge_patch,
    faithfulness,
)
from interp_norm.circuits.edges import prune_edges
from interp_norm.errors import PatchingError
from interp_norm.core.nodes import EMBED, LOGITS, head_input, receiver_node
from interp_norm.core.nodes import parse as parse_node

#: MIB's circuit sizes, as fractions of all edges (0.1 % ... 100 %).
MIB_FRACTIONS: tuple[float, ...] = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
#: Edge-scoring methods :func:`run_mib` knows by name (see :func:`method_scores`).
MIB_METHODS: tuple[str, ...] = ("exact", "eap", "eap-ig", "atp*")

Scores = Union[pd.DataFrame, Mapping[str, pd.DataFrame]]


# ----------------------------------------------------------------------------- circuits by size


#: MIB's ``Graph.prune``: the same rule as :func:`interp_norm.circuits.edges.prune_edges`.
mib_prune = prune_edges


def edge_counts(n_edges: int, fractions: Sequence[float] = MIB_FRACTIONS) -> list[int]:
    """Edges requested at each fraction: MIB's ``int(p * n_edges)`` (floor)."""
    return [int(p * n_edges) for p in fractions]


def circuits_by_fraction(
    scores: pd.DataFrame, n_layers: int, n_heads: int, fractions: Sequence[float] = MIB_FRACTIONS,
    *, absolute: bool = True, prune: bool = True,
) -> list[Circuit]:
    """The top-``int(p * n_edges)`` circuit for each fraction ``p`` (pruned as MIB does)."""
    _check_fractions(fractions)
    n_total = len(EdgeGraph(n_layers, n_heads).edges())
    out = []
    for k in edge_counts(n_total, fractions):
        c = Circuit.from_edge_scores(scores, n_layers, n_heads, top_n=k, absolute=absolute, prune=False)
        edges = mib_prune(set(c.edges)) if prune else set(c.edges)
        out.append(Circuit(n_layers, n_heads, frozenset(edges), {e: s for e, s in c.scores.items() if e in edges}))
    return out


def _check_fractions(fractions: Sequence[float]) -> None:
    fr = list(fractions)
    if len(fr) < 2 or any(not (0 < p <= 1) for p in fr) or any(b <= a for a, b in zip(fr, fr[1:])):
        raise PatchingError(f"fractions must be at least two increasing numbers in (0, 1], got {fr!r}")


# ----------------------------------------------------------------------------- curve and areas


def faithfulness_curve(
    model,
    pairs: PatchingPairs,
    scores: Scores,
    metric: Optional[Callable] = None,
    *,
    fractions: Sequence[float] = MIB_FRACTIONS,
    absolute: bool = True,
    prune: bool = True,
    ablation: str = "resample",
    chunk: int = 32,
) -> pd.DataFrame:
    """Faithfulness of each method's circuit at each size.

    ``scores``: one edge-score table (columns sender, receiver, score -- e.g. from
    :func:`~interp_norm.circuits.edge_attribution`) or ``{method: table}``. One row per
    (method, fraction): ``k`` (edges requested), ``n_edges`` (after pruning), ``faithfulness``,
    ``metric_circuit``, ``metric_clean``, ``metric_empty``. ``chunk`` circuits share a forward pass.
    """
    if not isinstance(pairs, PatchingPairs):
        raise PatchingError("faithfulness_curve needs PatchingPairs (clean and corrupted tokens)")
    tables = _as_tables(scores)
    metric = metric if metric is not None else LogitDiff(pairs)
    cfg = model.cfg
    rows = []
    for method, df in tables.items():
        circuits = circuits_by_fraction(df, cfg.n_layers, cfg.n_heads, fractions, absolute=absolute, prune=prune)
        ks = edge_counts(len(EdgeGraph(cfg.n_layers, cfg.n_heads).edges()), fractions)
        parts = [
            faithfulness(model, pairs, circuits[i : i + chunk], metric, ablations=(ablation,))
            for i in range(0, len(circuits), chunk)
        ]
        f = pd.concat(parts, ignore_index=True)
        for p, k, c, (_, r) in zip(fractions, ks, circuits, f.iterrows()):
            rows.append(dict(
                method=method, fraction=float(p), k=k, n_edges=len(c), faithfulness=float(r["faithfulness"]),
                metric_circuit=float(r["metric_circuit"]), metric_clean=float(r["metric_clean"]),
                metric_empty=float(r["metric_empty"]), ablation=ablation, absolute=absolute,
            ))
    return pd.DataFrame(rows)


def area_under(x: Sequence[float], y: Sequence[float], *, log_scale: bool = False) -> float:
    """Trapezoid rule ``sum (x_{i+1} - x_i)(y_i + y_{i+1}) / 2`` (over ``ln x`` if ``log_scale``)."""
    xs = [math.log(v) for v in x] if log_scale else [float(v) for v in x]
    ys = [float(v) for v in y]
    if len(xs) != len(ys) or len(xs) < 2:
        raise PatchingError("area_under needs two equally long sequences of at least two points")
    return sum((xs[i + 1] - xs[i]) * (ys[i] + ys[i + 1]) / 2 for i in range(len(xs) - 1))


def cpr_cmd(curve: pd.DataFrame, *, log_scale: bool = False) -> pd.DataFrame:
    """CPR (area under f) and CMD (area under |1 - f|) per method of a :func:`faithfulness_curve`.

    Also ``average`` (mean f over the sizes, MIB's third number) and ``f_at_full`` (f of the
    100 % circuit: 1 up to rounding when the last fraction is 1).
    """
    rows = []
    for method, g in curve.groupby("method", sort=False):
        g = g.sort_values("fraction")
        x, f = g["fraction"].tolist(), g["faithfulness"].tolist()
        rows.append(dict(
            method=method, cpr=area_under(x, f, log_scale=log_scale),
            cmd=area_under(x, [abs(1 - v) for v in f], log_scale=log_scale),
            average=sum(f) / len(f), f_at_full=f[-1], n_sizes=len(f), log_scale=log_scale,
        ))
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- methods and runner


def method_scores(
    model, pairs: PatchingPairs, metric: Optional[Callable] = None,
    methods: Sequence[str] = ("exact", "eap", "eap-ig"), *, ig_steps: int = 5,
) -> dict[str, pd.DataFrame]:
    """Edge scores of each named method: ``exact`` (exact edge patching), ``eap``, ``eap-ig``
    (``ig_steps`` steps) and ``atp*`` (EAP with q/k edges rescored through the exact softmax,
    :func:`interp_norm.circuits.atp_star.edge_atp_star`)."""
    metric = metric if metric is not None else LogitDiff(pairs)
    out = {}
    for m in methods:
        if m == "exact":
            out[m] = exact_edge_patch(model, pairs, metric)
        elif m == "eap":
            out[m] = edge_attribution(model, pairs, metric, ig_steps=1)
        elif m == "eap-ig":
            out[m] = edge_attribution(model, pairs, metric, ig_steps=ig_steps)
        elif m == "atp*":
            from interp_norm.circuits.atp_star import edge_atp_star

            out[m] = edge_atp_star(model, pairs, metric)
        else:
            raise PatchingError(f"unknown method {m!r}; choose from {MIB_METHODS} or pass your own score tables")
    return out


def run_mib(
    model, pairs: PatchingPairs, metric: Optional[Callable] = None, *,
    methods: Sequence[str] = ("exact", "eap", "eap-ig"), scores: Optional[Mapping[str, pd.DataFrame]] = None,
    ig_steps: int = 5, fractions: Sequence[float] = MIB_FRACTIONS, absolute: bool = True,
    log_scale: bool = False,
) -> dict[str, pd.DataFrame]:
    """MIB's circuit-track evaluation of every method: tables ``curve`` (faithfulness per size)
    and ``summary`` (CPR, CMD, average per method). Extra ``scores`` tables join the comparison."""
    tables = dict(method_scores(model, pairs, metric, methods, ig_steps=ig_steps))
    tables.update(scores or {})
    curve = faithfulness_curve(model, pairs, tables, metric, fractions=fractions, absolute=absolute)
    return {"curve": curve, "summary": cpr_cmd(curve, log_scale=log_scale)}


def _as_tables(scores: Scores) -> dict[str, pd.DataFrame]:
    if isinstance(scores, pd.DataFrame):
        name = str(scores["method"].iloc[0]) if "method" in scores.columns and len(scores) else "scores"
        return {name: scores}
    if isinstance(scores, Mapping) and scores and all(isinstance(v, pd.DataFrame) for v in scores.values()):
        return dict(scores)
    raise PatchingError("scores must be an edge-score DataFrame or a non-empty {method: DataFrame} mapping")


# ----------------------------------------------------------------------------- MIB's JSON format


def _mib_node(name: str) -> str:
    return "input" if name == EMBED else name


def _mib_edge(sender: str, receiver: str) -> str:
    r = parse_node(receiver)
    if r.kind == "head" and r.input:
        return f"{_mib_node(sender)}->{receiver_node(receiver)}<{r.input}>"
    return f"{_mib_node(sender)}->{receiver}"


def to_mib_json(scores: pd.DataFrame, cfg, circuit: Optional[Circuit] = None) -> dict:
    """Edge scores (and which edges a ``circuit`` keeps; none if not given) as EAP-IG/MIB's
    ``Graph.to_json`` dict. Write it with :func:`interp_norm.training.io.write_json`."""
    L, H = cfg.n_layers, cfg.n_heads
    graph = EdgeGraph(L, H)
    given = {(u, r): float(s) for u, r, s in zip(scores["sender"], scores["receiver"], scores["score"])}
    missing = [e for e in graph.edges() if e not in given]
    if missing:
        raise PatchingError(f"{len(missing)} edges have no score (e.g. {missing[:3]}); score every edge of the model")
    kept = set(circuit.edges) if circuit is not None else set()
    in_nodes = set(circuit.nodes) if circuit is not None else set()
    nodes = {_mib_node(n): {"in_graph": n in in_nodes} for n in graph.senders}
    nodes[LOGITS] = {"in_graph": True}
    edges = {_mib_edge(u, r): {"score": given[(u, r)], "in_graph": (u, r) in kept} for u, r in graph.edges()}
    return {
        "cfg": {"n_layers": L, "n_heads": H, "parallel_attn_mlp": False, "d_model": int(cfg.d_model)},
        "nodes": nodes, "edges": edges,
    }


def from_mib_json(d: dict) -> pd.DataFrame:
    """Edge scores back from a MIB/EAP-IG JSON dict: columns sender, receiver, score, in_graph."""
    if not all(k in d for k in ("cfg", "nodes", "edges")):
        raise PatchingError("a MIB graph JSON has the keys 'cfg', 'nodes' and 'edges'")
    rows = []
    for name, info in d["edges"].items():
        parent, child = name.split("->")
        sender = EMBED if parent == "input" else parent
        if child.endswith(">"):
            node, qkv = child[:-1].split("<")
            n = parse_node(node)
            assert n.layer is not None and n.head is not None  # parse gives every head node both
            receiver = head_input(n.layer, n.head, qkv)
        else:
            receiver = child
        rows.append(dict(sender=sender, receiver=receiver, score=float(info["score"]), in_graph=bool(info["in_graph"])))
    return pd.DataFrame(rows)


__all__ = [
    "MIB_FRACTIONS", "MIB_METHODS", "mib_prune", "edge_counts", "circuits_by_fraction", "faithfulness_curve",
    "area_under", "cpr_cmd", "method_scores", "run_mib", "to_mib_json", "from_mib_json",
]
