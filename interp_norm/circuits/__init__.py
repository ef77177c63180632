"""Circuit discovery on any TransformerLens-protocol model, CPU-first.

* :mod:`~interp_norm.circuits.pairs` -- clean/corrupted addition pairs and per-example metrics
  (logit difference, correct-token probability, KL to the clean distribution).
* :mod:`~interp_norm.circuits.patching` -- exact activation patching, many cells per forward pass,
  equal to ``transformer_lens.patching`` cell by cell.
* :mod:`~interp_norm.circuits.attribution` -- attribution patching (EAP) and EAP-IG, node and edge
  level; exact edge patching; agreement with exact patching.
* :mod:`~interp_norm.circuits.graph` -- :class:`Circuit` from thresholds/top-n, faithfulness under
  resample/mean/zero ablation (drawn by :func:`interp_norm.plots.draw_circuit`).
* :mod:`~interp_norm.circuits.attention_maps` -- which heads attend sparsely to which operand
  digit/operator/``=`` from each answer position.

:func:`run_circuits` runs the standard set for a model and returns the tables (``interp-norm
circuits`` in :mod:`interp_norm.cli` writes them).
"""

from __future__ import annotations

from typing import Sequence

import pandas as pd

from interp_norm.circuits.attention_maps import attention_map, attention_map_split, sparse_attention_events, token_roles
from interp_norm.circuits.attribution import (
    EdgeGraph,
    attribution_patch,
    compare_scores,
    edge_attribution,
    exact_edge_patch,
    receiver_node,
)
from interp_norm.circuits.graph import ABLATIONS, Circuit, faithfulness, run_with_circuit
from interp_norm.circuits.pairs import (
    METRICS,
    CorrectProb,
    KLToClean,
    LogitDiff,
    PairMetric,
    PatchingPairs,
    answer_metrics,
    correct_prob,
    corrupt_problem,
    kl_to_clean,
    logit_diff,
    make_metric,
    make_pairs,
    problem_format,
)
from interp_norm.circuits.patching import ACTIVATIONS, PatchResult, activation_patch, forward_from, hook_name, patch_sweep


def run_circuits(
    model,
    task=None,
    *,
    n_pairs: int = 32,
    split: str = "id",
    seed: int = 0,
    corrupt: str = "digit",
    aligned: bool = True,
    metric: str = "logit_diff",
    activations: Sequence = ("resid_pre", "attn_out", "mlp_out", ("z", "pos"), ("z", "all")),
    ig_steps: int = 5,
    top_n: int = 20,
    ablations: Sequence[str] = ABLATIONS,
    attention_problems: int = 256,
    batch_size: int = 1024,
    progress: bool = False,
) -> dict[str, pd.DataFrame]:
    """The standard circuit analysis of one model; returns the tables (never writes files).

    Tables: ``pairs``, ``answer_metrics``, ``patch_<activation>`` (exact patching), ``eap_vs_exact``
    (node-level EAP and EAP-IG against exact ``z`` patching), ``edges`` (EAP-IG edge scores),
    ``circuit`` (top ``top_n`` edges, pruned), ``faithfulness`` (all ablations), ``attention_map``.
    """
    from interp_norm.task import AdditionTask

    task = task if task is not None else AdditionTask()
    cfg = model.cfg
    pairs = make_pairs(task, n_pairs, split, seed, corrupt, aligned=aligned)
    met = make_metric(metric, pairs, model)
    tables: dict[str, pd.DataFrame] = {"pairs": pairs.to_dataframe(), "answer_metrics": answer_metrics(model, pairs)}
    sweeps = patch_sweep(model, pairs, met, activations, batch_size=batch_size, progress=progress)
    for key, res in sweeps.items():
        tables[f"patch_{key}"] = res.to_dataframe()
    if "z" in sweeps:
        rows = []
        for steps in sorted({1, ig_steps}):
            est = attribution_patch(model, pairs, met, "z", ig_steps=steps, batch_size=batch_size)
            rows.append(compare_scores(est, sweeps["z"]).assign(method=est.method, activation="z"))
        tables["eap_vs_exact"] = pd.concat(rows, ignore_index=True)
    edges = edge_attribution(model, pairs, met, ig_steps=ig_steps, progress=progress)
    tables["edges"] = edges
    circuit = Circuit.from_edge_scores(edges, cfg.n_layers, cfg.n_heads, top_n=top_n)
    tables["circuit"] = circuit.to_dataframe()
    tables["faithfulness"] = faithfulness(model, pairs, circuit, met, ablations=ablations)
    tables["attention_map"] = attention_map_split(
        model, task, split, n=attention_problems, seed=seed, progress=progress
    )
    return tables


__all__ = [
    # pairs and metrics
    "PatchingPairs", "make_pairs", "corrupt_problem", "problem_format", "PairMetric", "LogitDiff", "CorrectProb",
    "KLToClean", "logit_diff", "correct_prob", "kl_to_clean", "make_metric", "answer_metrics", "METRICS",
    # exact patching
    "ACTIVATIONS", "PatchResult", "activation_patch", "patch_sweep", "forward_from", "hook_name",
    # attribution
    "attribution_patch", "edge_attribution", "exact_edge_patch", "compare_scores", "EdgeGraph", "receiver_node",
    # circuits
    "Circuit", "faithfulness", "run_with_circuit", "ABLATIONS",
    # attention maps
    "token_roles", "sparse_attention_events", "attention_map", "attention_map_split",
    # orchestration
    "run_circuits",
]
