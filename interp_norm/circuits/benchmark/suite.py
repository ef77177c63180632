"""How well each discovery method recovers the known circuits of the ground-truth suite.

For every suite model (:mod:`interp_norm.circuits.benchmark.ground_truth`) and method, node and edge
scores are compared with the construction's circuit: precision and recall of the set the method
selects, and AUROC of its scores (the probability that a circuit element outranks a non-circuit
one, ties counting half -- threshold-free, like InterpBench's).

The suite is the hand-weighted models of :mod:`~interp_norm.circuits.benchmark.ground_truth` and the
tracr-compiled programs of :mod:`~interp_norm.circuits.benchmark.tracr_suite` (``tracr:<name>``, TransformerLens
bridges; their metric is the program-output difference, and AtP* does not apply to them -- its
rows are NaN -- because it recomputes attention with our model's own steps).

Methods (all on the model's clean/corrupted pairs; logit difference for the hand-weighted models):

* ``exact`` -- exact activation patching (nodes: ``z`` and ``mlp_out``, whole head/MLP at every
  position, ``by="all"``) and exact edge patching.
* ``eap`` / ``eap-ig`` -- attribution patching with 1 / ``ig_steps`` integration steps, node and edge.
* ``atp*`` -- AtP*: a head's node score is its largest of the q, k (softmax recomputed), v and z
  estimates; edges are EAP with q/k edges rescored (:mod:`interp_norm.circuits.atp_star`).
* ``pruning`` -- edge pruning by a threshold on the EAP-IG edge scores, then dropping edges not on
  an embed -> logits path (:meth:`Circuit.from_edge_scores`); a node is selected when it is in
  the pruned circuit, scored by the largest kept edge touching it (0 if none).

Selection threshold (precision/recall): ``|score| >= rel_threshold * |m(clean) - m(corrupted)|``
(default 5 % of the metric gap the pairs open). Nodes are the heads and MLPs except the circuit's
*fixed* nodes (tracr nodes whose output does not depend on the tokens, e.g. the length of the
input); edges are all edges except the circuit's *fixed* ones (they carry the same value in clean and corrupted runs, so no
resample-based method can see them -- see the ground-truth module), which are left out.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from interp_norm.circuits import (
    Circuit,
    EdgeGraph,
    activation_patch,
    attribution_patch,
    edge_attribution,
    exact_edge_patch,
)
from interp_norm.core import nodes
from interp_norm.circuits.atp_star import atp_star, edge_atp_star
from interp_norm.circuits.benchmark.ground_truth import SUITE, GroundTruth
from interp_norm.errors import PatchingError

from interp_norm.core.defaults import BENCHMARK_METHODS as METHODS  # noqa: E402


def auroc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """P(score of a positive > score of a negative), ties 1/2 (Mann-Whitney); NaN without both classes."""
    s, y = np.asarray(scores, dtype=float), np.asarray(labels, dtype=bool)
    pos, neg = s[y], s[~y]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size)


def _heads_mlps(L: int, H: int) -> list[str]:
    return nodes.components(L, H)


def _by_node(heads: torch.Tensor, mlps: torch.Tensor) -> dict[str, float]:
    """{node: |score|} from head scores [L, H] and MLP scores [L]."""
    L, H = heads.shape
    out = {nodes.head(l, h): abs(float(heads[l, h])) for l in range(L) for h in range(H)}
    out.update({nodes.mlp(l): abs(float(mlps[l])) for l in range(L)})
    return out


def node_scores(model, pairs, metric: Callable, method: str, *, ig_steps: int = 5) -> dict[str, float]:
    """|score| of every head and MLP under a node-level ``method`` (exact / eap / eap-ig / atp*)."""
    if method == "exact":
        def run(act):
            return activation_patch(model, pairs, None, metric, act, by="all").effect()
    elif method in ("eap", "eap-ig"):
        steps = 1 if method == "eap" else ig_steps

        def run(act):
            return attribution_patch(model, pairs, metric, act, by="all", ig_steps=steps).effect()
    elif method == "atp*":
        heads = torch.stack([atp_star(model, pairs, metric, a, by="all").effect().abs() for a in ("q", "k", "v", "z")]).amax(0)
        return _by_node(heads, atp_star(model, pairs, metric, "mlp_out", by="all").effect())
    else:
        raise PatchingError(f"no node-level scores for method {method!r}; choose from exact, eap, eap-ig, atp*")
    return _by_node(run("z"), run("mlp_out"))


def edge_scores(model, pairs, metric: Callable, method: str, *, ig_steps: int = 5) -> pd.DataFrame:
    """Edge-score table (sender, receiver, score) of an edge-level ``method`` (exact / eap / eap-ig / atp*)."""
    if method == "exact":
        return exact_edge_patch(model, pairs, metric)
    if method in ("eap", "eap-ig"):
        return edge_attribution(model, pairs, metric, ig_steps=1 if method == "eap" else ig_steps)
    if method == "atp*":
        return edge_atp_star(model, pairs, metric)
    raise PatchingError(f"no edge-level scores for method {method!r}; choose from exact, eap, eap-ig, atp*")


def _rows(truth: GroundTruth, method: str, nodes: Optional[dict[str, float]], edges: Optional[dict], *, threshold: float,
          L: int, H: int) -> list[dict]:
    rows = []
    candidates: dict[str, list] = {"node": [n for n in _heads_mlps(L, H) if n not in truth.fixed_nodes],
                  "edge": [e for e in EdgeGraph(L, H).edges() if e not in truth.fixed_edges]}
    positives: dict[str, set] = {"node": set(truth.nodes), "edge": truth.token_edges}
    for level, scores in (("node", nodes), ("edge", edges)):
        items = candidates[level]
        s = [scores.get(x, 0.0) for x in items] if scores is not None else []
        y = [x in positives[level] for x in items]
        if scores is None:  # the method does not apply to this model
            rows.append(dict(model=truth.name, method=method, level=level, n_true=len(positives[level]),
                             n_candidates=len(items), n_selected=0, precision=float("nan"), recall=float("nan"),
                             auroc=float("nan"), threshold=threshold))
            continue
        pred = {x for x, v in zip(items, s) if v >= threshold}
        tp = len(pred & positives[level])
        rows.append(dict(
            model=truth.name, method=method, level=level, n_true=len(positives[level]), n_candidates=len(items),
            n_selected=len(pred), precision=tp / len(pred) if pred else float("nan"),
            recall=tp / len(positives[level]), auroc=auroc(s, y), threshold=threshold,
        ))
    return rows


def score_model(
    truth: GroundTruth, methods: Sequence[str] = METHODS, *, n_pairs: int = 32, seed: int = 0,
    ig_steps: int = 5, rel_threshold: float = 0.05, model=None,
) -> pd.DataFrame:
    """Benchmark rows (one per method and level) for one suite model."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise PatchingError(f"unknown methods {unknown}; choose from {METHODS}")
    from interp_norm.core.model import HookedNormTransformer

    model = model if model is not None else truth.build()
    pairs = truth.make_pairs(n_pairs, seed)
    metric = truth.metric(pairs)
    with torch.no_grad():
        gap = float(metric(model(pairs.clean_tokens)).mean() - metric(model(pairs.corrupted_tokens)).mean())
    threshold = rel_threshold * abs(gap)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    rows = []
    for method in methods:
        if method == "atp*" and not isinstance(model, HookedNormTransformer):
            rows += _rows(truth, method, None, None, threshold=threshold, L=L, H=H)  # AtP* needs our attention's steps
            continue
        if method == "pruning":
            df = edge_scores(model, pairs, metric, "eap-ig", ig_steps=ig_steps)
            circuit = Circuit.from_edge_scores(df, L, H, threshold=threshold)
            edges = {e: abs(v) for e, v in circuit.scores.items()}
            by_node = {n: max((v for (u, r), v in edges.items() if n in (u, nodes.receiver_node(r))), default=0.0)
                       for n in circuit.components}
        else:
            by_node = node_scores(model, pairs, metric, method, ig_steps=ig_steps)
            df = edge_scores(model, pairs, metric, method, ig_steps=ig_steps)
            edges = {(u, r): abs(v) for u, r, v in zip(df["sender"], df["receiver"], df["score"])}
        rows += _rows(truth, method, by_node, edges, threshold=threshold, L=L, H=H)
    return pd.DataFrame(rows)


def all_ground_truth() -> dict:
    """The hand-weighted suite, then the tracr-compiled programs whose files are present."""
    from interp_norm.circuits.benchmark.tracr_suite import TRACR_SUITE, tracr_dir

    out: dict = dict(SUITE)
    out.update({f"tracr:{n}": g for n, g in TRACR_SUITE.items() if (tracr_dir() / f"{n}.npz").is_file()})
    return out


def run_benchmark(
    models: Optional[Sequence[str]] = None, methods: Sequence[str] = METHODS, *, n_pairs: int = 32,
    seed: int = 0, ig_steps: int = 5, rel_threshold: float = 0.05, progress: bool = False,
) -> pd.DataFrame:
    """Node and edge precision, recall and AUROC of every method on every suite model: one row
    per (model, method, level), columns as :func:`score_model`. ``progress``: a bar over the models."""
    suite = all_ground_truth()
    names = list(models) if models is not None else list(suite)
    missing = [n for n in names if n not in suite]
    if missing:
        raise PatchingError(f"unknown suite models {missing}; choose from {list(suite)}")
    return pd.concat([score_model(suite[n], methods, n_pairs=n_pairs, seed=seed, ig_steps=ig_steps,
                                  rel_threshold=rel_threshold).assign(model=n)
                      for n in tqdm(names, disable=not progress, desc="benchmark: scoring")], ignore_index=True)


def run_benchmark_mib(
    models: Optional[Sequence[str]] = None, methods: Sequence[str] = ("exact", "eap", "eap-ig"), *,
    n_pairs: int = 32, seed: int = 0, ig_steps: int = 5, progress: bool = False,
) -> dict[str, pd.DataFrame]:
    """MIB's faithfulness curve and CPR/CMD of every method on every suite model (the same pairs and
    metric as :func:`run_benchmark`): tables ``curve`` and ``summary`` of
    :func:`~interp_norm.circuits.benchmark.mib.run_mib`, each with a ``model`` column. ``atp*`` runs on our
    models only (as in :func:`score_model`); ``pruning`` selects a circuit and ranks no edges, so
    it has no curve. ``progress``: a bar over the models."""
    from interp_norm.circuits.benchmark.mib import MIB_METHODS, run_mib
    from interp_norm.core.model import HookedNormTransformer

    bad = [m for m in methods if m not in MIB_METHODS]
    if bad:
        raise PatchingError(f"methods {bad} have no MIB curve; choose from {MIB_METHODS}")

    suite = all_ground_truth()
    names = list(models) if models is not None else list(suite)
    missing = [n for n in names if n not in suite]
    if missing:
        raise PatchingError(f"unknown suite models {missing}; choose from {list(suite)}")
    curves, summaries = [], []
    for n in tqdm(names, disable=not progress, desc="benchmark: MIB curves"):
        truth = suite[n]
        pairs, model = truth.make_pairs(n_pairs, seed), truth.build()
        ms = [m for m in methods if m != "atp*" or isinstance(model, HookedNormTransformer)]
        r = run_mib(model, pairs, truth.metric(pairs), methods=ms, ig_steps=ig_steps)
        curves.append(r["curve"].assign(model=n))
        summaries.append(r["summary"].assign(model=n))
    return {"curve": pd.concat(curves, ignore_index=True), "summary": pd.concat(summaries, ignore_index=True)}


__all__ = ["METHODS", "auroc", "node_scores", "edge_scores", "score_model", "all_ground_truth", "run_benchmark",
           "run_benchmark_mib"]
