"""Circuit discovery on any TransformerLens-protocol model, CPU-first.

* :mod:`~interp_norm.circuits.pairs` -- clean/corrupted addition pairs;
  :mod:`~interp_norm.circuits.metrics` -- per-example metrics on them (logit difference,
  correct-token probability, KL to the clean distribution).
* :mod:`~interp_norm.circuits.exact.patching` -- exact activation patching, many cells per forward pass,
  equal to ``transformer_lens.patching`` cell by cell; :mod:`~interp_norm.circuits.exact.engine` is its
  incremental engine (recomputes only the rows a patch changes, with the model's block steps or fused
  kernels equal to them up to rounding).
* :mod:`~interp_norm.circuits.attribution` -- node-level attribution patching (EAP, EAP-IG) and
  agreement with exact patching.
* :mod:`~interp_norm.circuits.edges` -- the sender -> receiver edge graph and edge-intervening
  passes; :mod:`~interp_norm.circuits.edge_scores` -- EAP / EAP-IG edge scores, exact edge patching.
* :mod:`~interp_norm.circuits.circuit` -- :class:`Circuit` from thresholds/top-n, faithfulness under
  resample/mean/zero ablation (drawn by :func:`interp_norm.report.plots.draw_circuit`).
* :mod:`~interp_norm.circuits.attention_maps` -- which heads attend sparsely to which operand
  digit/operator/``=`` from each answer position.
* :mod:`~interp_norm.circuits.cell_circuit` -- the addition circuit at the grain of (layer, head,
  answer position) cells: located by resample ablation of every other cell, verified under resample,
  mean and zero ablation, with its size-vs-accuracy curve (:func:`locate_circuit`).
* :mod:`~interp_norm.circuits.cell_roles` -- what each cell reads: attention mass per token class,
  a role from a stated rule (:class:`RoleRule`), role counts, and a plain-words account generated from
  the tables; :func:`addition_circuit` locates and explains in one call.
  :mod:`~interp_norm.circuits.role_checks` -- the causal test of the roles (resample one token class).

Shared result/metric types live in the private ``_types`` module. :func:`run_circuits` runs the
standard set for a model and returns the tables; it writes nothing (``interp-norm circuits`` does).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import pandas as pd

from interp_norm.circuits._types import PatchResult
from interp_norm.circuits.cell_circuit import CircuitSpec, LocatedCircuit, locate_circuit
from interp_norm.circuits.cell_roles import (
    RoleRule,
    account,
    addition_circuit,
    assign_roles,
    attention_by_class,
    circuit_roles,
    role_counts,
)
from interp_norm.circuits.role_checks import role_agreement, role_tests
from interp_norm.circuits.attention_maps import attention_map, attention_map_split, sparse_attention_events, token_roles
from interp_norm.circuits.attribution import attribution_patch, compare_scores, node_attribution
from interp_norm.circuits.edge_scores import edge_attribution, exact_edge_patch
from interp_norm.circuits.edges import EdgeGraph, receiver_node
from interp_norm.circuits.circuit import ABLATIONS, Circuit, faithfulness, receiver_layout_of, run_with_circuit
from interp_norm.circuits.metrics import (
    METRICS,
    CorrectProb,
    KLToClean,
    LogitDiff,
    PairMetric,
    answer_metrics,
    correct_prob,
    kl_to_clean,
    logit_diff,
    make_metric,
)
from interp_norm.circuits.pairs import PatchingPairs, corrupt_problem, make_pairs, problem_format
from interp_norm.circuits.exact.patching import PatchSpec, activation_patch, patch_sweep
from interp_norm.errors import ConfigError


def _head_scores(est: PatchResult, exact_all: PatchResult) -> pd.DataFrame:
    """One row per head: the attribution estimate of patching the whole head's ``z`` (the per-position
    estimates summed over positions: attribution is linear in the patched cells, so this is what
    ``attribution_patch(..., by="all")`` returns) beside exact whole-head patching (``z_all``)."""
    attribution = est.effect().double().sum(1)  # [layer, pos, head] -> [layer, head]
    exact = exact_all.effect().double()  # [layer, head]
    n_layers, n_heads = exact.shape
    return pd.DataFrame([dict(method=est.method, activation="z", layer=l, head=h, attribution=float(attribution[l, h]),
                              exact=float(exact[l, h])) for l in range(n_layers) for h in range(n_heads)])


@dataclass(frozen=True)
class CircuitsSpec:
    """The settings of :func:`run_circuits` (pairs, metric, patched activations, attribution, circuit size)."""

    n_pairs: int = 32
    split: str = "id"
    seed: int = 0
    corrupt: str = "digit"
    aligned: bool = True
    metric: str = "logit_diff"
    activations: Sequence = ("resid_pre", "attn_out", "mlp_out", ("z", "pos"), ("z", "all"))
    ig_steps: int = 5
    top_n: int = 20
    ablations: Sequence[str] = ABLATIONS
    attention_problems: int = 256
    batch_size: int = 1024

    def replace(self, **fields: Any) -> "CircuitsSpec":
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ConfigError(f"run_circuits has no setting {', '.join(map(repr, unknown))}; "
                              f"the settings are CircuitsSpec's fields: {[f.name for f in dataclasses.fields(self)]}")
        return dataclasses.replace(self, **fields)


def run_circuits(model, task=None, spec: Optional[CircuitsSpec] = None, *, progress: bool = False,
                 **settings: Any) -> dict[str, pd.DataFrame]:
    from interp_norm.core.task import task_for

    task = task_for(model, task, who="run_circuits")
    sp = (spec or CircuitsSpec()).replace(**settings)
    cfg = model.cfg
    pairs = make_pairs(task, sp.n_pairs, sp.split, sp.seed, sp.corrupt, aligned=sp.aligned)
    met = make_metric(sp.metric, pairs, model)
    tables: dict[str, pd.DataFrame] = {"pairs": pairs.to_dataframe(), "answer_metrics": answer_metrics(model, pairs)}
    sweeps = patch_sweep(model, pairs, met, sp.activations, batch_size=sp.batch_size, progress=progress)
    for key, res in sweeps.items():
        tables[f"patch_{key}"] = res.to_dataframe()
    if "z" in sweeps:
        rows, heads = [], []
        for steps in sorted({1, sp.ig_steps}):
            est = attribution_patch(model, pairs, met, "z", ig_steps=steps, batch_size=sp.batch_size)
            rows.append(compare_scores(est, sweeps["z"]).assign(method=est.method, activation="z"))
            if "z_all" in sweeps:
                heads.append(_head_scores(est, sweeps["z_all"]))
        tables["eap_vs_exact"] = pd.concat(rows, ignore_index=True)
        if heads:
            tables["eap_vs_exact_heads"] = pd.concat(heads, ignore_index=True)
    edges = edge_attribution(model, pairs, met, ig_steps=sp.ig_steps, progress=progress)
    tables["edges"] = edges
    circuit = Circuit.from_edge_scores(edges, cfg.n_layers, cfg.n_heads, top_n=sp.top_n, layout=receiver_layout_of(model))
    tables["circuit"] = circuit.to_dataframe()
    tables["faithfulness"] = faithfulness(model, pairs, circuit, met, ablations=sp.ablations)
    tables["attention_map"] = attention_map_split(
        model, task, sp.split, n=sp.attention_problems, seed=sp.seed, progress=progress
    )
    return tables


__all__ = [
    # pairs and metrics
    "PatchingPairs", "make_pairs", "corrupt_problem", "problem_format", "PairMetric", "LogitDiff", "CorrectProb",
    "KLToClean", "logit_diff", "correct_prob", "kl_to_clean", "make_metric", "answer_metrics", "METRICS",
    # exact patching
    "PatchResult", "PatchSpec", "activation_patch", "patch_sweep",
    # attribution
    "attribution_patch", "node_attribution", "edge_attribution", "exact_edge_patch", "compare_scores", "EdgeGraph", "receiver_node",
    # circuits
    "Circuit", "faithfulness", "run_with_circuit", "receiver_layout_of", "ABLATIONS",
    # the addition circuit at the cell grain, its roles
    "addition_circuit", "locate_circuit", "CircuitSpec", "LocatedCircuit", "attention_by_class", "assign_roles",
    "circuit_roles", "role_counts", "account", "RoleRule", "role_tests", "role_agreement",
    # attention maps
    "token_roles", "sparse_attention_events", "attention_map", "attention_map_split",
    # orchestration
    "run_circuits", "CircuitsSpec",
]
