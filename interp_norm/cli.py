"""The ``interp-norm`` command line: every subcommand, registered in one place; orchestration only.

A subcommand is a :class:`Command`: a name, a help line, ``add_arguments(parser)`` (declares the
options) and ``run(args) -> exit code`` (imports what it needs, calls the library, writes through
:mod:`interp_norm.io`). :func:`command` registers one::

    def _noise_args(p): p.add_argument("ckpt"); ...

    @command("noise", help="accuracy under norm noise", add_arguments=_noise_args)
    def _noise(args): ...; return 0

Subcommands appear in ``--help`` in registration order. Only the parser of the subcommand being
run is built and heavy modules load inside ``run``, so ``interp-norm --help`` imports neither torch
nor pandas; a subcommand whose shown defaults belong to an analysis module (noise levels, circuit
metrics) imports that module for its own ``--help``.

Conventions every subcommand follows: ``--out`` is a folder, and result files already in it are
kept unless ``--force``; progress bars are on (``--no-progress``); every option's help shows its
default. Any :class:`InterpNormError` becomes one line ``interp-norm CMD: error: ...`` on stderr
with exit code 2 (no traceback), naming flags rather than Python parameters; so do bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from interp_norm._cli_support import (
    COMMANDS,
    bridge_analysis,
    hf_args,
    hf_tokens,
    load_model_spec,
    load_ours,
    looks_hf,
    real_model_tables,
    PROG,
    Command,
    Parser,
    command,
    flag_map,
    nonnegative_float,
    positive_int,
    prepare_out,
    threshold_display,
    with_flag_names,
)
from interp_norm.errors import InterpNormError

__all__ = ["COMMANDS", "Command", "command", "build_parser", "main"]

#: The task's splits (the task module imports torch; --help must not).
SPLITS = ("id", "interp", "extrap")
#: The analyses ``reproduce`` can run (checkpoint_report.ANALYSES, which imports pandas; a test keeps them equal).
ANALYSES = ("evaluate", "circuits", "noise", "collapse", "forward_collapse", "temperature", "geometry", "attention")
CKPT_HELP = "checkpoint or run folder, or a pretrained name (see 'interp-norm list')"
MODEL_HELP = (CKPT_HELP[:-1] + "), or a Hugging Face model: a local save_pretrained folder or a name already in the "
              "Hugging Face cache (never downloaded)")


def _load_any(ckpt: str, device: str = "cpu") -> tuple[Any, Any]:
    from interp_norm.checkpoints import load_any

    return load_any(ckpt, device=device)


def _out_args(p: argparse.ArgumentParser, what: str, default: Optional[str] = None) -> None:
    p.add_argument("--out", required=default is None, default=default, help=f"folder for {what}")
    p.add_argument("--force", action="store_true", help="overwrite result files already in --out")


def _progress_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")


# ----------------------------------------------------------------------------- train


def _train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True,
                   help="run folder (checkpoints step-*/ and LATEST); an existing run is continued with --resume, "
                        "never overwritten")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its last checkpoint, with its saved options unless given here")
    p.add_argument("--preset", choices=["cpu", "paper"],
                   help="model, task and training recipe together (default: cpu, or the saved run's on --resume)")
    p.add_argument("--model-preset", choices=["tiny", "cpu", "paper"], help="override the model preset (default: --preset)")
    p.add_argument("--task-preset", choices=["cpu", "paper"], help="override the task preset (default: --preset)")
    p.add_argument("--attn-norm", choices=["pre", "qkv", "qk", "none"],
                   help="where attention normalises: Pre-Norm, QKV-Norm, QK-Norm or none (default: pre)")
    p.add_argument("--norm-kind", choices=["rms", "ln"], help="RMSNorm or LayerNorm (default: rms)")
    p.add_argument("--seed", type=int, help="seeds both the model init and the data stream (default: the preset's)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: the preset's)")
    p.add_argument("--threads", type=positive_int,
                   help="torch CPU threads for training; results are reproducible for a given thread count "
                        "(default: the training config's)")
    p.add_argument("--steps", type=positive_int, help="total optimizer steps (overrides --epochs; default: the preset's)")
    p.add_argument("--epochs", type=positive_int, help="number of epochs (default: the preset's)")
    p.add_argument("--steps-per-epoch", type=positive_int, help="optimizer steps per epoch (default: the preset's)")
    p.add_argument("--batch-size", type=positive_int, help="problems per optimizer step (default: the preset's)")
    p.add_argument("--lr", type=float, help="peak learning rate of AdamW (default: the preset's)")
    p.add_argument("--grad-clip", type=nonnegative_float, help="gradient-norm clip, 0 = none (default: the preset's)")
    p.add_argument("--log-every", type=positive_int, help="steps between training-curve rows (default: the preset's)")
    p.add_argument("--eval-every", type=positive_int, help="steps between held-out evaluations (default: the preset's)")
    p.add_argument("--eval-size", type=positive_int, help="problems per split in those evaluations (default: the preset's)")
    p.add_argument("--final-eval-size", type=positive_int,
                   help="problems per split in the final evaluation (default: the preset's)")
    p.add_argument("--checkpoint-every", type=positive_int, help="steps between checkpoints (default: the preset's)")
    _progress_arg(p)


@command("train", help="train a model (resumable; checkpoints into --out)", add_arguments=_train_args,
         flags=dict(max_steps="--steps", n_epochs="--epochs", lr="--lr", seed="--seed", device="--device",
                    attn_norm="--attn-norm", norm_kind="--norm-kind", threads="--threads"))
def _train(args: argparse.Namespace) -> int:
    import dataclasses

    import pandas as pd

    from interp_norm.checkpoints import latest_checkpoint, read_checkpoint_info
    from interp_norm.io import ensure_writable_dir
    from interp_norm.model import ModelConfig
    from interp_norm.task import AdditionTask
    from interp_norm.train import TrainConfig, resolve_device, train

    # --resume without options continues with the saved ones; options given here must agree
    # with them (train() says which differ), except those that cannot change the weights.
    saved = None
    if args.resume and Path(args.out).is_dir() and latest_checkpoint(args.out) is not None:
        saved = read_checkpoint_info(args.out, verify=False)
    reuse = saved is not None and args.preset is None
    preset = args.preset or "cpu"
    model_changes = {k: v for k, v in dict(attn_norm=args.attn_norm, norm_kind=args.norm_kind, seed=args.seed).items()
                     if v is not None}
    if reuse and args.model_preset is None:
        model_cfg = saved.model_cfg.replace(**model_changes)
    else:
        model_cfg = ModelConfig.preset(args.model_preset or preset, **model_changes)
    task = saved.task if reuse and args.task_preset is None else AdditionTask.preset(args.task_preset or preset)
    overrides = {
        k: v for k, v in dict(
            max_steps=args.steps, n_epochs=args.epochs, steps_per_epoch=args.steps_per_epoch,
            batch_size=args.batch_size, lr=args.lr, device=args.device, log_every=args.log_every,
            eval_every=args.eval_every, eval_size=args.eval_size, final_eval_size=args.final_eval_size,
            checkpoint_every=args.checkpoint_every, seed=args.seed,
        ).items() if v is not None
    }
    if args.grad_clip is not None:
        overrides["grad_clip"] = args.grad_clip or None
    if args.threads is not None:
        if "threads" in {f.name for f in dataclasses.fields(TrainConfig)}:
            overrides["threads"] = args.threads  # recorded in the checkpoint; train() sets torch's threads
        else:
            # Until TrainConfig has its `threads` field (persist branch), the thread count is set here
            # for this process only and not recorded in the checkpoint. Remove after the merge.
            import torch

            torch.set_num_threads(args.threads)
    if reuse and saved.train_cfg is not None:
        train_cfg = saved.train_cfg.replace(**overrides)
    else:
        train_cfg = TrainConfig.preset(preset, **{"seed": model_cfg.seed, **overrides})
    resolve_device(train_cfg.device)  # hardware and output folder are checked before any work
    ensure_writable_dir(args.out)
    train(model_cfg, task, train_cfg, args.out, resume=args.resume, progress=not args.no_progress)
    info = read_checkpoint_info(args.out)
    print(f"trained {info.step} steps; checkpoint: {info.path}")
    print(pd.DataFrame(info.metrics.get("evaluation", [])).to_string(index=False))
    return 0


# ----------------------------------------------------------------------------- evaluate


def _evaluate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", help=CKPT_HELP)
    p.add_argument("--size", type=positive_int, default=2048, help="problems per split")
    p.add_argument("--seed", type=int, default=1234, help="test-set seed")
    p.add_argument("--splits", nargs="+", default=list(SPLITS), choices=SPLITS, help="splits to evaluate")
    p.add_argument("--batch-size", type=positive_int, default=512, help="problems per forward pass")
    p.add_argument("--no-exact-match", action="store_true", help="skip greedy generation (faster)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    p.add_argument("--out", help="also write evaluation.csv into this folder (default: print only)")
    p.add_argument("--force", action="store_true", help="overwrite evaluation.csv already in --out")
    _progress_arg(p)


@command("evaluate", help="per-token and exact-match accuracy of a checkpoint per split", add_arguments=_evaluate_args)
def _evaluate(args: argparse.Namespace) -> int:
    from interp_norm.evaluate import evaluate
    from interp_norm.io import write_csv
    from interp_norm.train import resolve_device

    out = prepare_out(args.out, ["evaluation.csv"], args.force) if args.out is not None else None
    resolve_device(args.device)
    model, info = load_ours(args.ckpt, "evaluate", device=args.device)
    df = evaluate(model, info.task, splits=args.splits, size=args.size, seed=args.seed,
                  batch_size=args.batch_size, exact_match=not args.no_exact_match, progress=not args.no_progress)
    df.insert(0, "checkpoint", args.ckpt)
    print(df.to_string(index=False))
    if out is not None:
        print(f"wrote {write_csv(out / 'evaluation.csv', df)}")
    return 0


# ----------------------------------------------------------------------------- list


@command("list", help="list the pretrained checkpoints shipped in data/checkpoints")
def _list(args: argparse.Namespace) -> int:
    from interp_norm.checkpoints import list_pretrained, pretrained_dir

    df = list_pretrained()
    if df.empty:
        print(f"no pretrained checkpoints in {pretrained_dir()} (set INTERP_NORM_DATA to another data folder)")
    else:
        print(df.drop(columns=["path"]).to_string(index=False))
    return 0


# ----------------------------------------------------------------------------- circuits


CIRCUIT_FILES = ("*.csv", "circuit.html", "circuit.json")
BENCHMARK_FILES = ("benchmark.csv", "mib_curve.csv", "mib_summary.csv", "faithfulness.html")


def _circuits_args(p: argparse.ArgumentParser) -> None:
    from interp_norm.circuits.metrics import METRICS  # the choices shown are the library's

    from interp_norm.circuits.benchmark import METHODS

    p.add_argument("ckpt", nargs="?", help=CKPT_HELP + " (omit with --benchmark)")
    p.add_argument("--out", help="folder for the tables, circuit.html and circuit.json "
                                 "(default: ./circuits-<checkpoint name>, or ./circuits-benchmark)")
    p.add_argument("--force", action="store_true", help="overwrite result files already in --out")
    p.add_argument("--pairs", type=positive_int, default=32, help="clean/corrupted problem pairs")
    p.add_argument("--split", default="id", choices=SPLITS, help="split the pairs are drawn from")
    p.add_argument("--seed", type=int, default=0, help="seed of the pairs and the attention problems")
    p.add_argument("--corrupt", choices=["digit", "operator", "any"], default="digit",
                   help="what the corrupted problem changes: one operand digit, the operator, or either")
    p.add_argument("--unaligned", action="store_true", help="do not force one token layout for all pairs")
    p.add_argument("--metric", choices=list(METRICS), default="logit_diff",
                   help="patching metric: logit difference clean vs corrupted answer, probability of the "
                        "correct token, or KL divergence to the clean distribution")
    p.add_argument("--top-n", type=positive_int, default=20, help="edges kept in the circuit")
    p.add_argument("--ig-steps", type=positive_int, default=5, help="EAP-IG integration steps (1 = plain EAP)")
    p.add_argument("--attention-problems", type=positive_int, default=256,
                   help="problems for the sparse-attention map")
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
    _progress_arg(p)


@command("circuits", help="patching tables, EAP-IG edges, circuit graph and faithfulness for a checkpoint",
         add_arguments=_circuits_args, flags=dict(n="--pairs", n_pairs="--pairs"))
def _circuits(args: argparse.Namespace) -> int:
    from interp_norm.errors import ConfigError

    if args.benchmark:
        if args.ckpt is not None:
            raise ConfigError(f"--benchmark runs the ground-truth suite, not a checkpoint; drop {args.ckpt!r} "
                              "or drop --benchmark")
        return _circuits_benchmark(args)
    if args.ckpt is None:
        raise ConfigError("give a checkpoint (see 'interp-norm list'), or --benchmark for the ground-truth suite")
    from interp_norm.circuits import run_circuits

    out = prepare_out(args.out or f"circuits-{Path(str(args.ckpt).rstrip('/')).name}", CIRCUIT_FILES, args.force)
    model, info = load_ours(args.ckpt, "circuits")
    tables = run_circuits(
        model, info.task, n_pairs=args.pairs, split=args.split, seed=args.seed, corrupt=args.corrupt,
        aligned=not args.unaligned, metric=args.metric, top_n=args.top_n, ig_steps=args.ig_steps,
        attention_problems=args.attention_problems, progress=not args.no_progress,
    )
    write_circuit_tables(out, tables, model.cfg.n_layers, model.cfg.n_heads)
    f = tables["faithfulness"]
    print(f"wrote {len(tables)} tables, circuit.html and circuit.json to {out}")
    print(f"circuit: {len(tables['circuit'])} edges; recovered fraction of {args.metric}: "
          + ", ".join(f"{a} {v:.3f}" for a, v in zip(f["ablation"], f["faithfulness"])))
    return 0


def _circuits_benchmark(args: argparse.Namespace) -> int:
    """The ground-truth suite: run_benchmark's table, MIB curves/CPR/CMD and the faithfulness figure."""
    from interp_norm.circuits.benchmark import run_benchmark, run_benchmark_mib
    from interp_norm.io import write_atomic, write_tables
    from interp_norm.plots import plot_faithfulness

    out = prepare_out(args.out or "circuits-benchmark", BENCHMARK_FILES, args.force)
    mib_methods = [m for m in args.methods if m != "pruning"]  # pruning selects a circuit, it ranks no edges
    table = run_benchmark(args.models, args.methods, n_pairs=args.pairs, seed=args.seed, ig_steps=args.ig_steps,
                          rel_threshold=args.threshold)
    mib = run_benchmark_mib(args.models, mib_methods, n_pairs=args.pairs, seed=args.seed, ig_steps=args.ig_steps)
    write_tables(out, {"benchmark": table, "mib_curve": mib["curve"], "mib_summary": mib["summary"]})
    fig = plot_faithfulness(mib["curve"], mib["summary"])
    write_atomic(out / "faithfulness.html", lambda p: fig.write_html(p, include_plotlyjs=True))
    auc = table.pivot_table(index=["model", "method"], columns="level", values="auroc", sort=False)
    print(f"wrote benchmark.csv, mib_curve.csv, mib_summary.csv and faithfulness.html to {out}")
    print("AUROC against the ground truth (node, edge):")
    print(auc.round(3).to_string())
    return 0


def write_circuit_tables(out: Path, tables: dict, n_layers: int, n_heads: int) -> None:
    """One CSV per table of ``run_circuits``, the circuit as ``circuit.html`` (plotly, offline) and ``circuit.json``."""
    import math

    from interp_norm.io import write_atomic, write_json, write_tables
    from interp_norm.plots import plot_circuit_graph

    write_tables(out, tables)
    edges = tables["circuit"]
    fig = plot_circuit_graph(edges, n_layers=n_layers, n_heads=n_heads)
    write_atomic(out / "circuit.html", lambda p: fig.write_html(p, include_plotlyjs=True))
    scores = [None if s is None or math.isnan(s) else float(s) for s in edges["score"]]
    write_json(out / "circuit.json", dict(n_layers=n_layers, n_heads=n_heads, edges=[
        dict(sender=u, receiver=r, score=s) for u, r, s in zip(edges["sender"], edges["receiver"], scores)
    ]))


# ----------------------------------------------------------------------------- noise and collapse


def _noise_common_args(p: argparse.ArgumentParser, default_levels: Sequence[float], default_n: int) -> None:
    p.add_argument("ckpt", help=MODEL_HELP)
    _out_args(p, "the CSV tables")
    p.add_argument("--levels", type=nonnegative_float, nargs="+", default=list(default_levels),
                   help="noise levels: the RMS of κ in the factor (1+κ) on the q/k/v norms")
    p.add_argument("--split", default="id", choices=SPLITS, help="split the problems are drawn from")
    p.add_argument("--n-examples", type=positive_int, default=default_n, help="problems per dataset")
    p.add_argument("--placement", default="before_norm", choices=["before_norm", "after_norm"],
                   help="for QK/QKV-Norm models: noise before the norm (removed by it) or after it")
    p.add_argument("--distribution", default="uniform", choices=["uniform", "normal"], help="distribution of κ")
    p.add_argument("--seed", type=int, default=0, help="seed of the problems and the noise")
    hf_args(p)
    _progress_arg(p)


def _noise_args(p: argparse.ArgumentParser) -> None:
    from interp_norm.noise import DEFAULT_NOISE_LEVELS  # the defaults shown in --help are the module's

    _noise_common_args(p, DEFAULT_NOISE_LEVELS, 512)
    p.add_argument("--n-datasets", type=positive_int, default=3, help="independent datasets for the standard error")


@command("noise", help="per-token accuracy under multiplicative norm noise (the paper's noise-sensitivity sweep)",
         add_arguments=_noise_args, flags=dict(levels="--levels"))
def _noise(args: argparse.Namespace) -> int:
    from interp_norm.io import write_csv
    from interp_norm.noise import run_noise

    out = prepare_out(args.out, ["noise_accuracy.csv"], args.force)
    model, info = load_model_spec(args.ckpt)
    if info is None:  # a Hugging Face model: agreement with its clean next-token prediction on text
        text_agreement = bridge_analysis("text_agreement")
        df = text_agreement(model, hf_tokens(model, args), args.levels)
        write_csv(out / "noise_accuracy.csv", df)
        print(df.to_string(index=False))
        print(f"wrote {out / 'noise_accuracy.csv'}")
        return 0
    df = run_noise(model, info.task, args.levels, split=args.split, n_datasets=args.n_datasets,
                   n_examples=args.n_examples, placement=args.placement, distribution=args.distribution,
                   seed=args.seed, progress=not args.no_progress)
    write_csv(out / "noise_accuracy.csv", df)
    print(df.to_string(index=False))
    print(f"wrote {out / 'noise_accuracy.csv'}")
    return 0


def _collapse_args(p: argparse.ArgumentParser) -> None:
    from interp_norm.noise import DEFAULT_COLLAPSE_LEVELS

    _noise_common_args(p, DEFAULT_COLLAPSE_LEVELS, 256)


#: Table names shared with ``interp-norm reproduce``.
COLLAPSE_FILES = ("collapse.csv", "collapse_thresholds.csv")


@command("collapse", help="circuit-collapse probability vs noise, measured and predicted by the theory",
         add_arguments=_collapse_args, flags=dict(levels="--levels"))
def _collapse(args: argparse.Namespace) -> int:
    from interp_norm.io import write_csv
    from interp_norm.noise import collapse_thresholds, run_collapse

    out = prepare_out(args.out, COLLAPSE_FILES, args.force)
    model, info = load_model_spec(args.ckpt)
    if info is None:  # a Hugging Face model: collapse from its clean scores on text
        bridge_collapse = bridge_analysis("bridge_collapse")
        curves = bridge_collapse(model, hf_tokens(model, args), args.levels)
        write_csv(out / COLLAPSE_FILES[0], curves)
        print(curves.to_string(index=False))
        print(f"wrote {out / COLLAPSE_FILES[0]}")
        return 0
    curves = run_collapse(model, info.task, args.levels, split=args.split, n_examples=args.n_examples,
                          placement=args.placement, distribution=args.distribution, seed=args.seed,
                          progress=not args.no_progress)
    thresholds = collapse_thresholds(curves)
    write_csv(out / COLLAPSE_FILES[0], curves)
    write_csv(out / COLLAPSE_FILES[1], thresholds)
    shown, notes = threshold_display(thresholds, curves)
    print("noise level at which 1% of sparse attention rows collapse:")
    print(shown.to_string(index=False))
    for note in notes:
        print(note)
    print(f"wrote {out / COLLAPSE_FILES[0]} and {out / COLLAPSE_FILES[1]}")
    return 0


# ----------------------------------------------------------------------------- geometry


def _geometry_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", help=MODEL_HELP)
    _out_args(p, "the CSV tables geometry_*.csv")
    p.add_argument("--n", type=positive_int, default=256, help="problems analysed")
    p.add_argument("--split", default="id", choices=SPLITS, help="split the problems are drawn from")
    p.add_argument("--seed", type=int, default=0, help="seed of the problems")
    hf_args(p)
    _progress_arg(p)


@command("geometry", help="norm spread, orthogonal spheres, subspace angles, interference, sparsity, LayerNorm ellipsoids",
         add_arguments=_geometry_args, flags=dict(n="--n"))
def _geometry(args: argparse.Namespace) -> int:
    from interp_norm.geometry import geometry_summary, run_geometry
    from interp_norm.io import write_tables

    out = prepare_out(args.out, ["geometry_*.csv"], args.force)
    model, info = load_model_spec(args.ckpt)
    if info is None:  # a Hugging Face model: every norm's ellipsoid, sparsity and norm spread on text
        results = run_geometry(model, tokens=hf_tokens(model, args), progress=not args.no_progress)
    else:
        results = run_geometry(model, info.task, n=args.n, split=args.split, seed=args.seed,
                               progress=not args.no_progress)
    write_tables(out, {f"geometry_{name}": df for name, df in results.items()})
    print(geometry_summary(results, per_layer=False).to_string(index=False))
    print(f"wrote {len(results)} tables geometry_*.csv to {out}")
    return 0


# ----------------------------------------------------------------------------- reproduce and dashboard


def _settings_args(p: argparse.ArgumentParser) -> None:
    """Options shared by ``reproduce`` and ``dashboard``."""
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds; for tests and smoke checks)")
    p.add_argument("--analyse", nargs="+", metavar="NAME",
                   help="checkpoints for the heavy analyses ('all' = every one; default: every seed without "
                        "Checkpoint calibration for the shipped set, every given checkpoint otherwise)")
    p.add_argument("--problems", nargs="+", metavar="PROBLEM",
                   help="problems for the attention figure, e.g. '[12+N7=' (default: one per split)")
    p.add_argument("--only", nargs="+", choices=ANALYSES, help="run only these analyses (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed for data and noise draws")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch threads (these small models run fastest on one thread)")
    p.add_argument("--workers", type=positive_int, default=None,
                   help="processes analysing checkpoints side by side, one thread each (default: up to 2)")
    _progress_arg(p)


def _settings(args: argparse.Namespace) -> Any:
    from interp_norm.reproduce import Settings
    from interp_norm.task import parse_problem

    kw: dict[str, Any] = dict(seed=args.seed, workers=args.workers)
    if args.problems:
        kw["problems"] = tuple(parse_problem(p).text for p in args.problems)  # typed error on a bad string
    if args.only:
        kw["analyses"] = tuple(args.only)
    return Settings.quick(**kw) if args.quick else Settings.full(**kw)


def _analyse(args: argparse.Namespace) -> Optional[Any]:
    if not args.analyse:
        return None
    return "all" if args.analyse == ["all"] else list(args.analyse)


REPORT_FILES = ("*.csv", "run.json", "dashboard.html")


def _reproduce_args(p: argparse.ArgumentParser) -> None:
    _out_args(p, "the report: one CSV per table, run.json and dashboard.html", default="report")
    p.add_argument("--checkpoints", nargs="+", metavar="CKPT",
                   help="checkpoint folders or pretrained names (default: every shipped checkpoint)")
    _settings_args(p)


@command("reproduce", help="run the paper's whole analysis on the shipped checkpoints -> CSVs + offline dashboard",
         add_arguments=_reproduce_args, flags=dict(threads="--threads", analyse="--analyse"))
def _reproduce(args: argparse.Namespace) -> int:
    from interp_norm.reproduce import reproduce

    out = prepare_out(args.out, REPORT_FILES, args.force)  # before any work
    report = reproduce(out, args.checkpoints, settings=_settings(args), analyse=_analyse(args),
                       progress=not args.no_progress, threads=args.threads)
    print(f"wrote {len(report.tables)} tables and {out / 'dashboard.html'} in {report.timings['total']:.0f} s")
    for note in report.notes:
        print(f"note: {note}")
    return 0


def _dashboard_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", nargs="+", help="checkpoint or run folders, or pretrained names (see 'interp-norm list'); "
                                           "Hugging Face models (save_pretrained folders or cached names) get a "
                                           "section comparing their layers beside ours")
    _out_args(p, "dashboard.html", default=".")
    _settings_args(p)
    hf_args(p)


@command("dashboard", help="analyse any checkpoints and write their offline HTML dashboard (dashboard.html in --out)",
         add_arguments=_dashboard_args, flags=dict(threads="--threads", analyse="--analyse"))
def _dashboard(args: argparse.Namespace) -> int:
    import time

    from interp_norm.reproduce import make_dashboard

    out = prepare_out(args.out, ["dashboard.html"], args.force)  # before any work
    t = time.perf_counter()
    hf = {}
    for spec in args.ckpt:
        if looks_hf(spec):
            hf[spec] = load_model_spec(spec)[0]
    ours = [spec for spec in args.ckpt if spec not in hf]
    if not hf:
        path = make_dashboard(ours, out / "dashboard.html", settings=_settings(args), analyse=_analyse(args),
                              progress=not args.no_progress, threads=args.threads)
    else:
        from interp_norm.dashboard import write_dashboard
        from interp_norm.reproduce import Report, run_analyses

        report = (run_analyses(ours, _settings(args), analyse=_analyse(args), progress=not args.no_progress,
                               threads=args.threads) if ours else Report())
        report.tables.update(real_model_tables(hf, args))
        path = write_dashboard(report, out / "dashboard.html", csv_links=False)
    print(f"wrote {path} in {time.perf_counter() - t:.0f} s")
    return 0


# ----------------------------------------------------------------------------- main


def build_parser(only: Optional[str] = None) -> argparse.ArgumentParser:
    """The parser; with ``only``, just that subcommand's options are declared (the others stay names)."""
    parser = Parser(prog=PROG, description="Pre-Norm vs QKV-Norm addition transformers: train, evaluate, analyse.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        if only is None or only == name:
            cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run, _parser=p)
    return parser


def _command_in(argv: Sequence[str]) -> Optional[str]:
    """The subcommand named in ``argv`` (the first word not starting with '-'), if registered."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return first if first in COMMANDS else None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``interp-norm``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = _command_in(argv)
    args = build_parser(only=name or "").parse_args(argv)
    prog = f"{PROG} {args.command}"
    try:
        return int(args._run(args) or 0)
    except InterpNormError as e:
        message = with_flag_names(" ".join(str(e).split()), flag_map(args._parser, COMMANDS[args.command].flags))
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (a training run continues with --resume)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
