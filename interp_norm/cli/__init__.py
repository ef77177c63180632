"""The ``interp-norm`` command line: every subcommand, registered in one registry; orchestration only.

A subcommand is a :class:`Command`: a name, a help line, ``add_arguments(parser)`` (declares the
options) and ``run(args) -> exit code`` (imports what it needs, calls the library, writes through
:mod:`interp_norm.io`). :func:`command` registers one::

    def _noise_args(p): p.add_argument("ckpt"); ...

    @command("noise", help="accuracy under norm noise", add_arguments=_noise_args)
    def _noise(args): ...; return 0

Subcommands appear in ``--help`` in registration order. Only the parser of the subcommand being
run is built and heavy modules load inside ``run``, so no ``--help`` imports torch or pandas: the
defaults it shows (noise levels, circuit metrics) come from :mod:`interp_norm.defaults`, the
import-free module the analyses read them from too.

Conventions every subcommand follows: ``--out`` is a folder, and result files already in it are
kept unless ``--force``; progress bars are on (``--no-progress``); every option's help shows its
default. Any :class:`InterpNormError` becomes one line ``interp-norm CMD: error: ...`` on stderr
with exit code 2 (no traceback), naming flags rather than Python parameters; so do bad arguments.
The package's warnings (e.g. what extending a run with a larger ``--steps`` does) become one line
``interp-norm CMD: warning: ...``, also naming flags.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

# importing a module registers its subcommands; --help lists them in this order
from interp_norm.cli import training  # noqa: F401, I001
from interp_norm.cli import analyses  # noqa: F401, I001
from interp_norm.cli import reports  # noqa: F401, I001
from interp_norm.cli._support import ANALYSES, COMMANDS, PROG, Command, Parser, command, flag_map, with_flag_names
from interp_norm.errors import InterpNormError

__all__ = ["COMMANDS", "ANALYSES", "Command", "command", "build_parser", "main"]

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


_PACKAGE = str(Path(__file__).resolve().parents[1])


def _show_warning(prog: str, flags: dict, default: Callable) -> Callable:
    """``warnings.showwarning`` for the CLI: the package's own warnings become one line
    ``interp-norm CMD: warning: ...`` naming flags (as errors do); other libraries' warnings are shown as usual."""

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        if str(Path(filename).resolve()).startswith(_PACKAGE):
            print(f"{prog}: warning: {with_flag_names(' '.join(str(message).split()), flags)}", file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    return show


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``interp-norm``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = _command_in(argv)
    args = build_parser(only=name or "").parse_args(argv)
    prog = f"{PROG} {args.command}"
    flags = flag_map(args._parser, COMMANDS[args.command].flags)
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning(prog, flags, warnings.showwarning)
        try:
            return int(args._run(args) or 0)
        except InterpNormError as e:
            print(f"{prog}: error: {with_flag_names(' '.join(str(e).split()), flags)}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"{prog}: interrupted (a training run continues with --resume)", file=sys.stderr)
            return 130

