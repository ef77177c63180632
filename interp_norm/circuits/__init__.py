"""Circuit discovery on any TransformerLens-protocol model, CPU-first.

* :mod:`~interp_norm.circuits.pairs` -- clean/corrupted addition pairs and per-example metrics
  (logit difference, correct-token probability, KL to the clean distribution).
* :mod:`~interp_norm.circuits.patching` -- exact activation patching, many cells per forward pass,
  equal to ``transformer_lens.patching`` cell by cell.
* :mod:`~interp_norm.circuits.attribution` -- attribution patching (EAP) and EAP-IG, node and edge
  level; exact edge patching; agreement with exact patching.
* :mod:`~interp_norm.circuits.graph` -- :class:`Circuit` from thresholds/top-n, faithfulness under
  resample/mean/zero ablation, plotly drawing.
* :mod:`~interp_norm.circuits.attention_maps` -- which heads attend sparsely to which operand
  digit/operator/``=`` from each answer position.

:func:`run_circuits` runs the standard set for a model and returns (optionally writes) the tables;
:func:`cli_command` is the ``interp-norm circuits`` subcommand.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

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
from interp_norm.circuits.graph import ABLATIONS, Circuit, draw_circuit, faithfulness, run_with_circuit
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
from interp_norm.errors import OutputDirError


def run_circuits(
    model,
    task=None,
    out_dir: Optional[Union[str, Path]] = None,
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
    """The standard circuit analysis of one model; returns the tables, and writes them if ``out_dir``.

    Tables: ``pairs``, ``answer_metrics``, ``patch_<activation>`` (exact patching), ``eap_vs_exact``
    (node-level EAP and EAP-IG against exact ``z`` patching), ``edges`` (EAP-IG edge scores),
    ``circuit`` (top ``top_n`` edges, pruned), ``faithfulness`` (all ablations), ``attention_map``.
    With ``out_dir``: one CSV per table, ``circuit.html`` (plotly, offline) and ``circuit.json``.
    """
    from interp_norm.task import AdditionTask

    task = task if task is not None else AdditionTask()
    cfg = model.cfg
    if out_dir is not None:
        out = _writable(out_dir)
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
    if out_dir is not None:
        try:
            for name, df in tables.items():
                df.to_csv(out / f"{name}.csv", index=False)
            draw_circuit(circuit).write_html(out / "circuit.html", include_plotlyjs=True)
            (out / "circuit.json").write_text(json.dumps(dict(
                n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                edges=[dict(sender=u, receiver=r, score=circuit.scores.get((u, r))) for u, r in sorted(circuit.edges)],
            ), indent=1))
        except OSError as e:
            raise OutputDirError(f"cannot write circuit tables to {str(out)!r}: {e}") from None
    return tables


def _writable(path: Union[str, Path]) -> Path:
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise OutputDirError(f"{str(p)!r} exists and is not a folder; give a folder for the circuit tables")
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise OutputDirError(f"cannot write to {str(p)!r} ({e}); choose another --out folder") from None
    return p


def cli_command(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """``interp-norm circuits CKPT``: add the arguments to ``p`` and return the runner.

    Register in interp_norm/cli.py with ``command("circuits", help=...)(cli_command)``.
    """
    p.add_argument("ckpt", help="checkpoint or run folder, or a pretrained name")
    p.add_argument("--out", default=None, help="output folder (default: ./circuits-<checkpoint name>)")
    p.add_argument("--pairs", type=int, default=32, help="clean/corrupted pairs (default 32)")
    p.add_argument("--split", default="id", help="id, interp or extrap (default id)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corrupt", choices=["digit", "operator", "any"], default="digit")
    p.add_argument("--unaligned", action="store_true", help="do not force one token layout for all pairs")
    p.add_argument("--metric", choices=list(METRICS), default="logit_diff")
    p.add_argument("--top-n", type=int, default=20, help="edges kept in the circuit (default 20)")
    p.add_argument("--ig-steps", type=int, default=5, help="EAP-IG integration steps (default 5)")
    p.add_argument("--attention-problems", type=int, default=256)
    p.add_argument("--progress", action="store_true")

    def run(args: argparse.Namespace) -> int:
        from interp_norm.checkpoints import ensure_writable_dir, load_any

        if args.out:
            ensure_writable_dir(args.out)  # fail before any work
        model, info = load_any(args.ckpt)
        out = args.out or f"circuits-{Path(str(args.ckpt).rstrip('/')).name}"
        tables = run_circuits(
            model, info.task, out, n_pairs=args.pairs, split=args.split, seed=args.seed, corrupt=args.corrupt,
            aligned=not args.unaligned, metric=args.metric, top_n=args.top_n, ig_steps=args.ig_steps,
            attention_problems=args.attention_problems, progress=args.progress,
        )
        f = tables["faithfulness"]
        print(f"wrote {len(tables)} tables, circuit.html and circuit.json to {out}")
        print(f"circuit: {len(tables['circuit'])} edges; recovered fraction of {args.metric}: "
              + ", ".join(f"{a} {v:.3f}" for a, v in zip(f["ablation"], f["faithfulness"])))
        return 0

    return run


__all__ = [
    # pairs and metrics
    "PatchingPairs", "make_pairs", "corrupt_problem", "problem_format", "PairMetric", "LogitDiff", "CorrectProb",
    "KLToClean", "logit_diff", "correct_prob", "kl_to_clean", "make_metric", "answer_metrics", "METRICS",
    # exact patching
    "ACTIVATIONS", "PatchResult", "activation_patch", "patch_sweep", "forward_from", "hook_name",
    # attribution
    "attribution_patch", "edge_attribution", "exact_edge_patch", "compare_scores", "EdgeGraph", "receiver_node",
    # circuits
    "Circuit", "faithfulness", "run_with_circuit", "draw_circuit", "ABLATIONS",
    # attention maps
    "token_roles", "sparse_attention_events", "attention_map", "attention_map_split",
    # orchestration
    "run_circuits", "cli_command",
]
