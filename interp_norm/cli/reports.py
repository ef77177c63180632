"""Subcommands that run everything and write a report: ``reproduce`` and ``dashboard``."""

from __future__ import annotations

import argparse
from typing import Any, Optional

from interp_norm.cli._support import (
    ANALYSES,
    command,
    hf_args,
    load_model_spec,
    looks_hf,
    out_args,
    positive_int,
    prepare_out,
    progress_arg,
    real_model_tables,
)


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
    progress_arg(p)


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
    out_args(p, "the report: one CSV per table, run.json and dashboard.html", default="report")
    p.add_argument("--checkpoints", nargs="+", metavar="CKPT",
                   help="checkpoint folders or pretrained names (default: the shipped reference set, see interp-norm list)")
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
    out_args(p, "dashboard.html", default=".")
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
