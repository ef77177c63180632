"""Subcommands that run one analysis on one model: ``circuits`` (and the ground-truth ``--benchmark``),
``noise``, ``collapse``, ``geometry`` (our checkpoints, or Hugging Face models through a bridge)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from interp_norm.cli._grammar import (
    add_alias,
    add_batch_size,
    add_device_map,
    add_dtype,
    add_heavy,
    add_n_examples,
    add_out,
    add_split,
    add_window_batch,
)
from interp_norm.cli._support import (
    CKPT_HELP,
    MODEL_HELP,
    SPLITS,
    command,
    hf_args,
    hf_tokens,
    check_placement,
    load_ours,
    nonnegative_float,
    as_percent,
    percent_table,
    positive_int,
    prepare_out,
    threshold_display,
    with_model,
)
from interp_norm.cli._grammar import HELP
from interp_norm.core.defaults import DISTRIBUTIONS, PLACEMENTS

LEVELS_HELP = HELP["levels"]

# ----------------------------------------------------------------------------- circuits


CIRCUIT_FILES = ("*.csv", "circuit.html", "circuit.json")
BENCHMARK_FILES = ("benchmark.csv", "mib_curve.csv", "mib_summary.csv", "faithfulness.html")
CELL_FILES = ("addition_*.csv", "addition_account.txt")


def _circuits_args(p: argparse.ArgumentParser) -> None:
    from interp_norm.core.defaults import BENCHMARK_METHODS as METHODS
    from interp_norm.core.defaults import (
        CIRCUIT_METRICS as METRICS,  # the library's choices, without importing it
    )

    p.add_argument("ckpt", nargs="?", help=CKPT_HELP + " (omit with --benchmark)")
    add_out(p)
    p.add_argument("--pairs", type=positive_int, default=32, help="clean/corrupted problem pairs")
    add_n_examples(p, 256, " for the sparse-attention map")
    add_alias(p, "--attention-problems", "--n-examples", "n_examples", type=positive_int)
    add_split(p, SPLITS)
    p.add_argument("--corrupt", choices=["digit", "operator", "any"], default="digit",
                   help="what the corrupted problem changes: one operand digit, the operator, or either")
    p.add_argument("--unaligned", action="store_true", help="do not force one token layout for all pairs")
    p.add_argument("--metric", choices=list(METRICS), default="logit_diff",
                   help="patching metric: logit difference clean vs corrupted answer, probability of the "
                        "correct token, or KL divergence to the clean distribution")
    p.add_argument("--top-n", type=positive_int, default=20, help="edges kept in the circuit")
    p.add_argument("--ig-steps", type=positive_int, default=5, help="EAP-IG integration steps (1 = plain EAP)")
    b = p.add_argument_group("ground-truth benchmark (--benchmark; no checkpoint)")
    b.add_argument("--benchmark", action="store_true",
                   help="score every discovery method against the known circuits of the ground-truth suite "
                        "(node/edge precision, recall, AUROC) and MIB faithfulness: benchmark.csv, mib_curve.csv, "
                        "mib_summary.csv, faithfulness.html")
    b.add_argument("--models", nargs="+", help="suite models to run (default: all; see the benchmark module)")
    b.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS),
                   help="discovery methods to score")
    b.add_argument("--threshold", type=nonnegative_float, default=0.05,
                   help="selection threshold, as a fraction of the clean-corrupted metric gap")
    c = p.add_argument_group("the addition circuit by cells (--cells)")
    c.add_argument("--cells", action="store_true",
                   help="instead of the patching tables: locate the addition circuit at (layer, head, answer "
                        "position) by ablating every other cell, give each cell a role from its attention, test the roles "
                        "by resampling what each cell reads from one token class, and write addition_{circuit,effects,"
                        "curve,verification,roles,role_counts,attention,role_tests,role_agreement}.csv and "
                        "addition_account.txt (--n-examples problems)")
    c.add_argument("--keep", type=nonnegative_float, default=0.9,
                   help="share of the full model's per-token accuracy the circuit must keep (default: 0.9)")
    c.add_argument("--grow", choices=["ranked", "greedy"], default="ranked",
                   help="grow the circuit in the order of single-cell necessity, or greedily (slower)")
    add_heavy(p)


@command("circuits", help="patching tables, EAP-IG edges, circuit graph (circuit.html, circuit.json) and faithfulness "
                          "for a checkpoint; --benchmark scores the methods on circuits known by construction",
         add_arguments=_circuits_args,
         flags=dict(n="--pairs", n_pairs="--pairs", attention_problems="--n-examples"))
def _circuits(args: argparse.Namespace) -> int:
    from interp_norm.errors import ConfigError
    from interp_norm.training.devices import resolve_device

    if args.benchmark:
        if args.ckpt is not None:
            raise ConfigError(f"--benchmark runs the ground-truth suite, not a checkpoint; drop {args.ckpt!r} "
                              "or drop --benchmark")
        return _circuits_benchmark(args)
    if args.ckpt is not None and args.cells:
        return _circuits_cells(args)
    if args.ckpt is None:
        raise ConfigError("give a checkpoint (see 'interp-norm list'), or --benchmark for the ground-truth suite")
    from interp_norm.circuits import run_circuits

    out = prepare_out(args.out, CIRCUIT_FILES, args.force)
    resolve_device(args.device)
    model, info = load_ours(args.ckpt, "circuits", device=args.device)
    tables = run_circuits(
        model, info.task, n_pairs=args.pairs, split=args.split, seed=args.seed, corrupt=args.corrupt,
        aligned=not args.unaligned, metric=args.metric, top_n=args.top_n, ig_steps=args.ig_steps,
        attention_problems=args.n_examples, progress=not args.no_progress,
    )
    write_circuit_tables(out, tables, model.cfg.n_layers, model.cfg.n_heads, name=Path(str(args.ckpt).rstrip("/")).name)
    f = tables["faithfulness"]
    print(f"wrote {len(tables)} tables, circuit.html and circuit.json to {out}")
    print(f"circuit of {Path(str(args.ckpt).rstrip('/')).name}: {len(tables['circuit'])} edges; share of {args.metric} it recovers: "
          + ", ".join(f"{a} {as_percent(v)}" for a, v in zip(f["ablation"], f["faithfulness"])))
    return 0


def _circuits_cells(args: argparse.Namespace) -> int:
    """The addition circuit by cells: its tables and the plain-words account."""
    from interp_norm.circuits.cell_circuit import CircuitSpec
    from interp_norm.circuits.cell_roles import addition_circuit
    from interp_norm.training.devices import resolve_device
    from interp_norm.training.io import write_tables, write_text_atomic

    out = prepare_out(args.out, CELL_FILES, args.force)
    resolve_device(args.device)
    model, info = load_ours(args.ckpt, "circuits", device=args.device)
    spec = CircuitSpec(n=args.n_examples, split=args.split, seed=args.seed, keep=args.keep, grow=args.grow,
                       progress=not args.no_progress)
    name = Path(str(args.ckpt).rstrip("/")).name
    tables = addition_circuit(model, info.task, spec=spec, name=name, test_roles=True)
    account = tables.pop("account")
    write_tables(out, {f"addition_{k}": v for k, v in tables.items()})
    write_text_atomic(out / "addition_account.txt", account + "\n")
    print(f"wrote {len(tables)} addition_*.csv tables and addition_account.txt to {out}")
    print(account)
    return 0


def _circuits_benchmark(args: argparse.Namespace) -> int:
    """The ground-truth suite: run_benchmark's table, MIB curves/CPR/CMD and the faithfulness figure."""
    from interp_norm.circuits.benchmark.suite import run_benchmark, run_benchmark_mib
    from interp_norm.training.io import write_atomic, write_tables
    from interp_norm.report.plots import plot_faithfulness

    out = prepare_out(args.out, BENCHMARK_FILES, args.force)
    mib_methods = [m for m in args.methods if m != "pruning"]  # pruning selects a circuit, it ranks no edges
    table = run_benchmark(args.models, args.methods, n_pairs=args.pairs, seed=args.seed, ig_steps=args.ig_steps,
                          rel_threshold=args.threshold, progress=not args.no_progress)
    mib = run_benchmark_mib(args.models, mib_methods, n_pairs=args.pairs, seed=args.seed, ig_steps=args.ig_steps,
                            progress=not args.no_progress)
    write_tables(out, {"benchmark": table, "mib_curve": mib["curve"], "mib_summary": mib["summary"]})
    fig = plot_faithfulness(mib["curve"], mib["summary"])
    write_atomic(out / "faithfulness.html", lambda p: fig.write_html(p, include_plotlyjs=True))
    auc = table.pivot_table(index=["model", "method"], columns="level", values="auroc", sort=False)
    print(f"wrote benchmark.csv, mib_curve.csv, mib_summary.csv and faithfulness.html to {out}")
    print("AUROC against the ground truth (node, edge):")
    print(auc.round(3).to_string())
    return 0


def write_circuit_tables(out: Path, tables: dict, n_layers: int, n_heads: int, name: str = "") -> None:
    """One CSV per table of ``run_circuits``, the circuit as ``circuit.html`` (plotly, offline; titled
    with the checkpoint ``name``) and ``circuit.json``."""
    import math

    from interp_norm.training.io import write_atomic, write_json, write_tables
    from interp_norm.report.plots import plot_circuit_graph

    write_tables(out, tables)
    edges = tables["circuit"]
    fig = plot_circuit_graph(edges.assign(checkpoint=name) if name else edges, n_layers=n_layers, n_heads=n_heads)
    write_atomic(out / "circuit.html", lambda p: fig.write_html(p, include_plotlyjs=True))
    scores = [None if s is None or math.isnan(s) else float(s) for s in edges["score"]]
    write_json(out / "circuit.json", dict(n_layers=n_layers, n_heads=n_heads, edges=[
        dict(sender=u, receiver=r, score=s) for u, r, s in zip(edges["sender"], edges["receiver"], scores)
    ]))


# ----------------------------------------------------------------------------- noise and collapse


def _noise_common_args(p: argparse.ArgumentParser, default_levels: Sequence[float], default_n: int, unit: str) -> None:
    p.add_argument("ckpt", help=MODEL_HELP)
    add_out(p)
    p.add_argument("--levels", type=nonnegative_float, nargs="+", default=list(default_levels), help=LEVELS_HELP)
    add_split(p, SPLITS)
    add_n_examples(p, default_n, unit)
    p.add_argument("--placement", default="before_norm", choices=PLACEMENTS,
                   help="models with a norm on q/k/v (QK/QKV-Norm, Qwen3 ...): noise before the norm (removed by "
                        "it) or after it; elsewhere only before_norm means something")
    p.add_argument("--distribution", default="uniform", choices=DISTRIBUTIONS, help="distribution of κ")
    hf_args(p)
    add_dtype(p)
    add_device_map(p)
    add_heavy(p)


def _noise_args(p: argparse.ArgumentParser) -> None:
    from interp_norm.core.defaults import (
        DEFAULT_NOISE_LEVELS,  # the library's defaults, without importing torch
    )

    _noise_common_args(p, DEFAULT_NOISE_LEVELS, 512, " per dataset")
    p.add_argument("--n-datasets", type=positive_int, default=3, help="independent datasets for the standard error")
    add_batch_size(p, 8, " (Hugging Face models: text windows per pass; their logits are made a block of positions "
                         "at a time by the model's own forward (logits_to_keep) where that equals its unembedding bit for bit, "
                         "else whole)")


@command("noise", help="per-token accuracy under multiplicative norm noise (the paper's noise-sensitivity sweep)",
         add_arguments=_noise_args, flags=dict(levels="--levels", distribution="--distribution"))
def _noise(args: argparse.Namespace) -> int:
    from interp_norm.training.io import write_csv
    from interp_norm.noise import run_noise

    out = prepare_out(args.out, ["noise_accuracy.csv"], args.force)
    model = _load_for_noise(args)
    # ours: accuracy on the task's test sets; a Hugging Face model: agreement with its clean prediction on text
    df = run_noise(model, levels=args.levels, split=args.split, n_datasets=args.n_datasets, n_examples=args.n_examples,
                   placement=args.placement, distribution=args.distribution, seed=args.seed,
                   progress=not args.no_progress, **_text_inputs(model, args, batch_size=args.batch_size))
    write_csv(out / "noise_accuracy.csv", df)
    print(percent_table(with_model(df, args.ckpt)))
    print(f"wrote {out / 'noise_accuracy.csv'}")
    return 0


def _load_any_kind(args: argparse.Namespace):  # noqa: ANN202
    """The model ``args.ckpt`` names, ours or a Hugging Face model (``--dtype`` / ``--device-map`` apply to the latter)."""
    from interp_norm.anatomy.loading import load

    return load(args.ckpt, device=args.device, dtype=args.dtype or "float32", device_map=args.device_map)


def _text_inputs(model, args: argparse.Namespace, command_name: str = "", **text_only) -> dict:  # noqa: ANN001
    """What a model without an addition task (a Hugging Face model) runs on: text windows
    (``--text``, ``--n-ctx``, ``--windows``) and the options that only apply to text (``text_only``);
    nothing for ours, which run on their own task (a text-only option given for them is refused)."""
    if getattr(model, "task", None) is None:
        return {"tokens": hf_tokens(model, args), **text_only}
    if command_name:
        _refuse_window_batch(args, command_name)
    return {}


def _load_for_noise(args: argparse.Namespace):  # noqa: ANN202
    """The model of ``noise``/``collapse`` on ``--device``, refusing a ``--placement`` that means nothing for it."""
    from interp_norm.training.devices import resolve_device, return_large_frees

    resolve_device(args.device)
    return_large_frees()  # freed activations go back to the system: the peak stays near the weights
    model = _load_any_kind(args)
    check_placement(model, args.placement)
    return model


def _collapse_args(p: argparse.ArgumentParser) -> None:
    from interp_norm.core.defaults import DEFAULT_COLLAPSE_LEVELS

    _noise_common_args(p, DEFAULT_COLLAPSE_LEVELS, 256, "")
    add_window_batch(p)


#: Table names shared with ``interp-norm reproduce``.
COLLAPSE_FILES = ("collapse.csv", "collapse_thresholds.csv")


@command("collapse", help="circuit-collapse probability vs noise, measured and predicted by the theory",
         add_arguments=_collapse_args, flags=dict(levels="--levels", distribution="--distribution"))
def _collapse(args: argparse.Namespace) -> int:
    from interp_norm.training.io import write_csv
    from interp_norm.noise import collapse_thresholds, run_collapse

    out = prepare_out(args.out, COLLAPSE_FILES, args.force)
    model = _load_for_noise(args)
    # ours: from one clean cache of the task's test set; a Hugging Face model: from its clean scores on text
    curves = run_collapse(model, levels=args.levels, split=args.split, n_examples=args.n_examples,
                          placement=args.placement, distribution=args.distribution, seed=args.seed,
                          progress=not args.no_progress,
                          **_text_inputs(model, args, "collapse", window_batch=args.window_batch))
    thresholds = collapse_thresholds(curves)
    write_csv(out / COLLAPSE_FILES[0], curves)
    write_csv(out / COLLAPSE_FILES[1], thresholds)
    shown, notes = threshold_display(thresholds, curves)
    print("noise level at which 1% of sparse attention rows collapse:")
    print(percent_table(with_model(shown, args.ckpt)))
    for note in notes:
        print(note)
    print(f"wrote {out / COLLAPSE_FILES[0]} and {out / COLLAPSE_FILES[1]}")
    return 0


# ----------------------------------------------------------------------------- geometry


def _geometry_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", help=MODEL_HELP)
    add_out(p)
    add_n_examples(p, 256)
    add_alias(p, "--n", "--n-examples", "n_examples", type=positive_int)
    add_split(p, SPLITS)
    hf_args(p)
    add_dtype(p)
    add_device_map(p)
    add_window_batch(p)
    add_heavy(p)


def _refuse_window_batch(args: argparse.Namespace, name: str) -> None:
    if args.window_batch is not None:
        from interp_norm.errors import ConfigError

        raise ConfigError(f"--window-batch applies to Hugging Face models; {args.ckpt!r} is an interp_norm model, whose "
                          f"'{name}' runs its problems in one pass: drop --window-batch")


@command("geometry", help="norm spread, orthogonal spheres, subspace angles, interference, sparsity, LayerNorm ellipsoids",
         add_arguments=_geometry_args, flags=dict(n="--n-examples"))
def _geometry(args: argparse.Namespace) -> int:
    from interp_norm.geometry import geometry_summary, run_geometry
    from interp_norm.training.io import write_tables

    from interp_norm.training.devices import resolve_device, return_large_frees

    out = prepare_out(args.out, ["geometry_*.csv"], args.force)
    resolve_device(args.device)
    return_large_frees()  # freed activations go back to the system: the peak stays near the weights
    model = _load_any_kind(args)
    # ours: every analysis on the task's problems; a Hugging Face model: every norm's ellipsoid, sparsity and spread on text
    results = run_geometry(model, n=args.n_examples, split=args.split, seed=args.seed, progress=not args.no_progress,
                           **_text_inputs(model, args, "geometry", window_batch=args.window_batch))
    write_tables(out, {f"geometry_{name}": df for name, df in results.items()})
    print(percent_table(with_model(geometry_summary(results, per_layer=False), args.ckpt)))
    print(f"wrote {len(results)} tables geometry_*.csv to {out}")
    return 0
