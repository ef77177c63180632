"""Subcommands that run everything and write a report: ``reproduce`` and ``dashboard``."""

from __future__ import annotations

import argparse
from typing import Any, Optional

from interp_norm.cli._grammar import add_alias, add_device_map, add_dtype, add_heavy, add_out
from interp_norm.cli._support import (
    ANALYSES,
    CONTROLS,
    command,
    hf_args,
    positive_int,
    prepare_out,
    real_model_tables,
)
from interp_norm.report.registry import get


# ----------------------------------------------------------------------------- reproduce and dashboard


def _settings_args(p: argparse.ArgumentParser) -> None:
    """Options shared by ``reproduce`` and ``dashboard``."""
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds; for tests and smoke checks)")
    p.add_argument("--analyse", nargs="+", metavar="NAME",
                   help="checkpoints for the heavy analyses ('all' = every one; default: every seed without "
                        "Checkpoint calibration for the shipped set, every given checkpoint otherwise)")
    p.add_argument("--problems", nargs="+", metavar="PROBLEM",
                   help="problems for the attention figure, e.g. '[12+N7=' (default: one per split)")
    p.add_argument("--only", nargs="+", choices=ANALYSES,
                   help=f"run only these analyses (default: all but {', '.join(CONTROLS)})")
    p.add_argument("--controls", action="store_true",
                   help=f"also run {' and '.join(CONTROLS)} ({'; '.join(get(a).help for a in CONTROLS)}; about +5 s "
                        "of CPU per analysed checkpoint)")
    p.add_argument("--workers", type=positive_int, default=None,
                   help="processes analysing checkpoints side by side, one thread each (default: up to 2 on cpu, "
                        "1 on another --device)")
    add_heavy(p)


def _settings(args: argparse.Namespace) -> Any:
    from interp_norm.report.reproduce import Settings
    from interp_norm.core.task import parse_problem

    kw: dict[str, Any] = dict(seed=args.seed, workers=args.workers)
    if args.problems:
        kw["problems"] = tuple(parse_problem(p).text for p in args.problems)  # typed error on a bad string
    if args.only:
        kw["analyses"] = tuple(args.only)
    if args.controls:
        base = kw.get("analyses", Settings().analyses)
        kw["analyses"] = tuple(base) + tuple(a for a in CONTROLS if a not in base)
    return Settings.quick(**kw) if args.quick else Settings.full(**kw)


def _analyse(args: argparse.Namespace) -> Optional[Any]:
    if not args.analyse:
        return None
    return "all" if args.analyse == ["all"] else list(args.analyse)


REPORT_FILES = ("*.csv", "run.json", "dashboard.html")
CKPTS_HELP = "checkpoint or run folders, or pretrained names (see 'interp-norm list')"


def _reproduce_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", nargs="*", metavar="CKPT",
                   help=CKPTS_HELP + "; default: the shipped reference set")
    add_alias(p, "--checkpoints", "positional CKPT arguments", "checkpoints_old", nargs="+", metavar="CKPT")
    add_out(p)
    p.add_argument("--all-seeds", action="store_true",
                   help="every seed of the shipped set (default: seeds 0 and 1): the seed tables' analyses "
                        "(evaluation, noise at 1%%, collapse, forward collapse, geometry) on every checkpoint the "
                        "full analyses skip, for seed_comparisons.csv and seed_matched_id.csv (slower)")
    _settings_args(p)


@command("reproduce", help="run the paper's whole analysis on the shipped checkpoints (or CKPT ...): one CSV per "
                           "table, run.json and an offline dashboard.html",
         add_arguments=_reproduce_args, flags=dict(threads="--threads", analyse="--analyse", device="--device"),
         interrupted="interrupted; the checkpoints analysed so far are kept (OUT/partial): run the same command "
                     "again, without --force, to analyse only the rest")
def _reproduce(args: argparse.Namespace) -> int:
    from interp_norm.report.partial import PartialStore
    from interp_norm.report.reproduce import reproduce
    from interp_norm.training.devices import resolve_device

    out = prepare_out(args.out, REPORT_FILES, args.force)  # before any work
    if args.force:  # a fresh report: no checkpoint is taken from an interrupted run
        PartialStore(out).clear()
    resolve_device(args.device)
    ckpts = list(args.ckpt) + list(getattr(args, "checkpoints_old", None) or [])
    report = reproduce(out, ckpts or None, settings=_settings(args), analyse=_analyse(args),
                       progress=not args.no_progress, threads=args.threads, device=args.device,
                       all_seeds=args.all_seeds)
    extra = "timings.csv, checkpoints.csv" if len(report.checkpoints) else "timings.csv"  # what write_report adds
    print(f"wrote {len(report.tables)} analysis tables, {extra}, run.json and {out / 'dashboard.html'} "
          f"in {report.timings['total']:.0f} s")
    for note in report.notes:
        print(f"note: {note}")
    return 0


def _dashboard_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", nargs="+", metavar="CKPT",
                   help=CKPTS_HELP + "; Hugging Face models (save_pretrained folders or cached names) get a section "
                                     "comparing their layers beside ours")
    add_out(p)
    _settings_args(p)
    hf_args(p)
    add_dtype(p)
    add_device_map(p)


@command("dashboard", help="analyse any checkpoints (and Hugging Face models) and write their offline dashboard.html "
                           "into --out",
         add_arguments=_dashboard_args, flags=dict(threads="--threads", analyse="--analyse", device="--device"),
         interrupted="interrupted; the checkpoints analysed so far are kept (OUT/partial): run the same command "
                     "again, without --force, to analyse only the rest")
def _dashboard(args: argparse.Namespace) -> int:
    import time

    from interp_norm.report.reproduce import make_dashboard

    from interp_norm.training.devices import resolve_device

    out = prepare_out(args.out, ["dashboard.html"], args.force)  # before any work
    if args.force:  # a fresh page: no checkpoint is taken from an interrupted run
        from interp_norm.report.partial import PartialStore

        PartialStore(out).clear()
    resolve_device(args.device)
    t = time.perf_counter()
    from interp_norm.anatomy.loading import load, spec_kind

    hf = {}
    for spec in args.ckpt:
        if spec_kind(spec) == "bridge":
            hf[spec] = load(spec, device=args.device, dtype=args.dtype or "float32", device_map=args.device_map)
    ours = [spec for spec in args.ckpt if spec not in hf]
    if ours:  # --dtype / --device-map apply to Hugging Face models only
        from interp_norm.anatomy.loading import check_ours

        check_ours(ours[0], args.dtype or "float32", args.device_map)
    if not hf:
        path = make_dashboard(ours, out / "dashboard.html", settings=_settings(args), analyse=_analyse(args),
                              progress=not args.no_progress, threads=args.threads, device=args.device)
    else:
        from interp_norm.report.dashboard import write_dashboard
        from interp_norm.report.reproduce import Report, run_analyses

        report = (run_analyses(ours, _settings(args), analyse=_analyse(args),
                               progress=False if args.no_progress else "dashboard", threads=args.threads,
                               device=args.device) if ours else Report())
        report.tables.update(real_model_tables(hf, args))
        path = write_dashboard(report, out / "dashboard.html", csv_links=False)
    print(f"wrote {path} in {time.perf_counter() - t:.0f} s")
    return 0
