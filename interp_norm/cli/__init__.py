"""The ``interp-norm`` command line: every subcommand, registered in one registry; orchestration only.

A subcommand is a :class:`Command`: a name, a help line, ``add_arguments(parser)`` (declares the
options) and ``run(args) -> exit code`` (imports what it needs, calls the library, writes through
:mod:`interp_norm.training.io`). :func:`command` registers one::

    def _noise_args(p): p.add_argument("ckpt"); ...

    @command("noise", help="accuracy under norm noise", add_arguments=_noise_args)
    def _noise(args): ...; return 0

Subcommands appear in ``--help`` in registration order. Only the parser of the subcommand being
run is built and heavy modules load inside ``run``, so no ``--help`` imports torch or pandas: the
defaults it shows (noise levels, circuit metrics) come from :mod:`interp_norm.core.defaults`, the
import-free module the analyses read them from too.

Conventions every subcommand follows (the shared flags are declared once, in ``_grammar``):
``--out`` is a folder, by default ``report/<subcommand>/<model>``, and result files already in it
are kept unless ``--force`` (a run that fails leaves no empty folder behind); ``--n-examples``,
``--seed``, ``--device``, ``--threads`` mean the same everywhere; progress bars are on
(``--no-progress``); every option's help shows its default; printed fractions are percentages.
An unknown option or a misspelt choice gets "did you mean"; Ctrl-C prints what the subcommand
leaves behind. Any :class:`InterpNormError` becomes one line ``interp-norm CMD: error: ...`` on stderr
with exit code 2 (no traceback), naming flags rather than Python parameters; so do bad arguments.
The package's warnings (e.g. what extending a run with a larger ``--steps`` does) become one line
``interp-norm CMD: warning: ...``, also naming flags.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

# importing a module registers its subcommands; --help lists them in this order
from interp_norm.cli import training  # noqa: F401, I001
from interp_norm.cli import analyses  # noqa: F401, I001
from interp_norm.cli import reports  # noqa: F401, I001
from interp_norm.cli._grammar import DEFAULTS, default_out, unknown_options_message
from interp_norm.cli._support import (
    ANALYSES,
    COMMANDS,
    PROG,
    Command,
    Parser,
    closest,
    command,
    flag_map,
    with_flag_names,
)
from interp_norm.errors import CheckpointNotFoundError, InterpNormError, NoTokenizerWarning

__all__ = ["COMMANDS", "ANALYSES", "Command", "command", "build_parser", "main"]

DESCRIPTION = "Pre-Norm vs QKV-Norm addition transformers: train, evaluate, analyse."
EPILOG = (
    "Models: a checkpoint or run folder, or a pretrained name (see 'interp-norm list'). noise, collapse, geometry "
    "and dashboard also take Hugging Face models through a TransformerLens bridge: a local save_pretrained folder "
    "(e.g. ~/models/Qwen3-0.6B) or a name already in the Hugging Face cache (e.g. Qwen/Qwen3-0.6B; nothing is "
    "downloaded); they analyse text windows (--text, --windows, --n-ctx). train, evaluate and circuits need our "
    "checkpoints (they run on the addition task).\n\n"
    "Every subcommand writes into --out, a folder: default report/SUBCOMMAND/MODEL (report/SUBCOMMAND for train, "
    "reproduce and dashboard); results already there are kept unless --force. Shared flags mean the same "
    "everywhere: --n-examples (problems drawn from the task), --seed (default 0), --device (default cpu), "
    "--threads (default 1), --no-progress.\n\nFractions are printed as percentages; the CSVs keep fractions. "
    "'interp-norm SUBCOMMAND --help' shows a subcommand's options."
)


def build_parser(only: Optional[str] = None) -> argparse.ArgumentParser:
    """The parser; with ``only``, just that subcommand's options are declared (the others stay names)."""
    parser = Parser(prog=PROG, description=DESCRIPTION, epilog=EPILOG)
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


_PACKAGE = str(Path(__file__).resolve().parents[1])


def _show_warning(prog: str, flags: dict, default: Callable) -> Callable:
    """``warnings.showwarning`` for the CLI: the package's own warnings become one line
    ``interp-norm CMD: warning: ...`` naming flags (as errors do); other libraries' warnings are shown as usual.
    The package's own are those raised in it or of a category of ``interp_norm.errors`` (one that points at the
    caller's line, outside the package)."""

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        if str(Path(filename).resolve()).startswith(_PACKAGE) or category.__module__ == "interp_norm.errors":
            print(f"{prog}: warning: {with_flag_names(' '.join(str(message).split()), flags)}", file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    return show


def _model_of(args: argparse.Namespace) -> Any:
    """The model argument that names the default --out (None: several models, or none)."""
    if getattr(args, "benchmark", False):
        return "benchmark"
    return getattr(args, "ckpt", None)


def _fill_defaults(args: argparse.Namespace) -> None:
    """One default rule for the shared flags: --out (see ``_grammar.default_out``); --seed, --device and
    --threads left unset mean 0, cpu and 1, except for ``train`` (the preset's, or the saved run's)."""
    if hasattr(args, "out") and args.out is None:
        args.out = str(default_out(args.command, _model_of(args)))
    if args.command != "train":
        for dest, value in DEFAULTS.items():
            if getattr(args, dest, value) is None:
                setattr(args, dest, value)


def _new_folders(out: Optional[str]) -> list[Path]:
    """``out`` and its parents that do not exist yet, deepest first (removed again if a run fails before writing)."""
    if not out:
        return []
    new = []
    for p in (Path(out), *Path(out).parents):
        if p.exists() or str(p) in ("", "."):
            break
        new.append(p)
    return new


def _remove_empty(folders: list[Path]) -> None:
    for p in folders:  # deepest first; stops at the first folder that holds anything
        try:
            p.rmdir()
        except OSError:
            break


def _did_you_mean(message: str, args: argparse.Namespace) -> str:
    """A model argument that is not found but is close to a pretrained name: say which one."""
    specs = getattr(args, "ckpt", None)
    specs = [specs] if isinstance(specs, str) else list(specs or [])
    for spec in specs:
        if Path(spec).exists() or f"{spec!r}" not in message:
            continue
        try:
            from interp_norm.training.checkpoints import list_pretrained

            names = list(list_pretrained()["name"])
        except Exception:  # the suggestion is a courtesy; never hide the error behind another
            return message
        hit = closest(spec, [n for n in names if n != spec])
        if hit:
            return (f"{spec!r} is not a checkpoint folder nor a known model name; did you mean {hit!r}? "
                    "(names are case-sensitive; see 'interp-norm list')")
    return message


@contextlib.contextmanager
def _quiet_loading(args: argparse.Namespace) -> Iterator[None]:
    """--no-progress also hides transformers' "Loading weights" bar (Hugging Face models), for this
    run only. (Every heavy command imports transformers anyway: TransformerLens builds on it.)"""
    if not getattr(args, "no_progress", False):
        yield
        return
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _threads(args: argparse.Namespace) -> Iterator[None]:
    """--threads for the whole run (restored after it); ``train`` records and sets its own."""
    n = getattr(args, "threads", None)
    if n is None or args.command == "train":
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``interp-norm``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = _command_in(argv)
    args, extras = build_parser(only=name or "").parse_known_args(argv)
    if extras:  # said by the subcommand, with the option it most likely meant
        args._parser.error(unknown_options_message(args._parser, extras))
    prog = f"{PROG} {args.command}"
    cmd = COMMANDS[args.command]
    flags = flag_map(args._parser, cmd.flags)
    _fill_defaults(args)
    new = _new_folders(getattr(args, "out", None))
    code = 1
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning(prog, flags, warnings.showwarning)
        # loading without a tokenizer: each analysis says what it then runs on, once, in its own words
        warnings.simplefilter("ignore", NoTokenizerWarning)
        try:
            with _threads(args), _quiet_loading(args):
                code = int(args._run(args) or 0)
            return code
        except InterpNormError as e:
            message = ' '.join(str(e).split())
            if isinstance(e, CheckpointNotFoundError):
                message = _did_you_mean(message, args)
            print(f"{prog}: error: {with_flag_names(message, flags)}", file=sys.stderr)
            code = 2
            return code
        except KeyboardInterrupt:
            print(f"{prog}: {cmd.interrupted}", file=sys.stderr)
            code = 130
            return code
        finally:
            if code != 0:  # a failed run leaves no empty output folder behind
                _remove_empty(new)
