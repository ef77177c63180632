"""The machinery under :mod:`interp_norm.cli`: the command registry, the parser, and the CLI boundary.

Kept apart so ``cli.py`` reads as the list of subcommands. Nothing here imports more than the
standard library (``interp-norm --help`` must stay fast). At the boundary, library errors are
rewritten to speak the command line's language: Python parameter names become the flags that set
them (``max_steps`` -> ``--steps``), and every ``--out`` is a folder whose existing result files
are kept unless ``--force`` is given.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from interp_norm.errors import OutputDirError

PROG = "interp-norm"
Runner = Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class Command:
    """One subcommand: ``add_arguments`` declares its options, ``run`` does the work.

    ``flags`` maps library parameter names to the flag that sets them where the two differ
    (``{"max_steps": "--steps"}``); options whose name matches their parameter are found from the parser.
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Runner
    flags: Mapping[str, str] = field(default_factory=dict)


COMMANDS: dict[str, Command] = {}


def command(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None] = lambda p: None,
            flags: Mapping[str, str] = {}) -> Callable[[Runner], Runner]:
    """Register the decorated ``run(args) -> exit code`` as subcommand ``name``."""

    def deco(run: Runner) -> Runner:
        COMMANDS[name] = Command(name, help, add_arguments, run, dict(flags))
        return run

    return deco


# ----------------------------------------------------------------------------- parser


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default after its help, unless the help already says it (or there is none)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if ("default" in text or d is None or d is False or d is argparse.SUPPRESS
                or not (action.option_strings or action.nargs in ("?", "*"))):
            return text
        return f"{text} (default: {show_default(d)})"


def show_default(value: Any) -> str:
    """A default as the user would type it: lists space-separated."""
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value).replace("%", "%%")


class Parser(argparse.ArgumentParser):
    """argparse, but errors are one line (usage is behind --help) and defaults are shown."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (the message names the flag: ``argument --pairs: ...``)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {v}")
    return v


def nonnegative_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v


# ----------------------------------------------------------------------------- the boundary


def flag_map(parser: argparse.ArgumentParser, extra: Mapping[str, str]) -> dict[str, str]:
    """Parameter name -> flag: ``extra`` plus every option whose dest has an underscore (``n_examples``)."""
    out = {}
    for a in parser._actions:
        longs = [s for s in a.option_strings if s.startswith("--")]
        if longs and "_" in a.dest:
            out[a.dest] = longs[0]
    out.update(extra)
    return out


def with_flag_names(message: str, flags: Mapping[str, str]) -> str:
    """``"max_steps must be ..."`` -> ``"--steps must be ..."`` (whole identifiers only)."""
    for name in sorted(flags, key=len, reverse=True):
        message = re.sub(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", flags[name], message)
    return message


def prepare_out(folder: str | Path, files: Sequence[str], force: bool) -> Path:
    """``--out`` is always a folder: make sure it is writable and holds none of ``files`` (globs) unless ``force``.

    Called before any work, so a run never ends by refusing to write.
    """
    from interp_norm.io import ensure_writable_dir

    out = ensure_writable_dir(folder)
    existing = sorted({p.name for pattern in files for p in out.glob(pattern) if p.is_file()})
    if existing and not force:
        shown = ", ".join(existing[:4]) + (f" and {len(existing) - 4} more" if len(existing) > 4 else "")
        raise OutputDirError(f"--out {str(folder)!r} already holds {shown}; pass --force to overwrite, "
                             "or choose another --out folder")
    return out


def threshold_display(thresholds: Any, curves: Any) -> tuple[Any, list[str]]:
    """The 1%-collapse table for the terminal: a NaN level says why it is missing.

    ``> L``: the collapse rate stayed below the target up to the largest level tested (L);
    ``< L``: it was already above the target at the smallest level (L); ``no rows``: no sparse
    attention row to collapse. The CSV keeps NaN.
    """
    import pandas as pd

    cols = list(thresholds.columns)
    keys = cols[:cols.index("target")] if "target" in cols else [c for c in cols if not c.startswith("level_")]
    show = thresholds.astype({c: object for c in ("level_measured", "level_predicted") if c in cols})
    used: set[str] = set()
    for i, row in thresholds.iterrows():
        g = curves
        for k in keys:
            g = g[g[k].isna()] if pd.isna(row[k]) else g[g[k] == row[k]]
        g = g.sort_values("level")
        for col, src in (("level_measured", "measured"), ("level_predicted", "predicted")):
            if col not in cols or not pd.isna(row[col]) or not len(g):
                continue
            if g[src].isna().all():
                show.at[i, col] = "no rows"
                used.add("none")
            elif (g[src] < row["target"]).all():
                show.at[i, col] = f"> {g['level'].max():g}"
                used.add(">")
            elif g[src].iloc[0] >= row["target"]:
                show.at[i, col] = f"< {g['level'].min():g}"
                used.add("<")
    from interp_norm.hooks import SPARSE_THRESHOLD

    notes = []
    if "none" in used:
        notes.append(f"'no rows': no attention row there is sparse (max weight >= {SPARSE_THRESHOLD}) on these "
                     "problems, so nothing can collapse; collapse_thresholds.csv holds NaN there.")
    if ">" in used:
        notes.append("'> L': the collapse rate never reached the target below the largest level tested, L "
                     "(test larger --levels to find it); collapse_thresholds.csv holds NaN there.")
    if "<" in used:
        notes.append("'< L': the collapse rate was already above the target at the smallest level tested, L "
                     "(test smaller --levels); collapse_thresholds.csv holds NaN there.")
    return show, notes
