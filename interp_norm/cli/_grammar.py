"""The command line's grammar: every flag that several subcommands share, declared once.

One name, one meaning: a shared flag is added by one function here, so its name, ``dest``, type,
default and help text are the same in every subcommand that has it (``tests/test_cli_grammar.py``
checks this over every subcommand's parser). The scheme:

* ``--n-examples N``: how many problems a subcommand draws from the addition task (per split for
  ``evaluate``; for the sparse-attention map in ``circuits``, whose main count is ``--pairs``,
  because its unit is a clean/corrupted pair);
* ``--out DIR``: always a folder; default ``report/<subcommand>/<model name>`` for a subcommand on
  one model, ``report/<subcommand>`` for ``train``, ``reproduce`` and ``dashboard``
  (:func:`default_out`);
* ``--seed`` (default 0), ``--device`` (default cpu), ``--threads`` (default 1) on every subcommand
  that does heavy work; ``train`` reads "not given" as "the preset's, or the saved run's on
  ``--resume``" (the help says so);
* ``--no-progress`` hides the progress bars.

Old spellings (``--size``, ``--n``, ``--attention-problems``, ``reproduce --checkpoints``) stay as
hidden aliases that warn once and do what the new flag does, so scripts keep working.
Standard library only (``interp-norm --help`` must stay fast).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from interp_norm.cli._support import closest, positive_int

#: Root of every default ``--out``.
OUT_ROOT = "report"
#: Subcommands whose default ``--out`` has no model part (they make a model, or take several).
NO_MODEL_PART = ("train", "reproduce", "dashboard")

#: Help of each shared flag: one text for every subcommand.
HELP = {
    "out": ("output folder; result files already in it are kept unless --force (default: report/SUBCOMMAND/MODEL, "
            "e.g. report/noise/qkv; report/SUBCOMMAND for reproduce and dashboard)"),
    "force": "replace result files already in --out",
    "seed": "seed of every random draw: problems, noise, model init (default: 0)",
    "device": "cpu, cuda, cuda:1 ... (default: cpu)",
    "threads": "torch CPU threads (default: 1, whatever OMP_NUM_THREADS says: these small models run fastest on one)",
    "no_progress": "hide the progress bars",
    "n_examples": "problems drawn from the addition task",
    "split": "split the problems are drawn from",
    "batch_size": "problems per forward pass",
    "levels": "noise levels: the RMS of κ in the factor (1+κ) on the q/k/v norms",
    "dtype": ("Hugging Face models: number format the weights are loaded and run in: float32, bfloat16, float16, "
              "float64, or auto (as stored); converted while loading, never held twice, the largest tensors (the "
              "embedding) into a nameless file in TMPDIR that is mapped, so only the rows used are resident "
              "(default: float32; our models run in float32)"),
    "window_batch": ("Hugging Face models: text windows per forward pass, the passes run layer by layer in "
                     "lockstep and each layer is analysed one block of windows at a time: bounds the peak memory "
                     "whatever --windows is, same tables as one pass (default: 8; --windows or more: one pass)"),
    "device_map": ("Hugging Face models too large for one device: spread the layers over the devices, e.g. auto "
                   "(passed to transformers' from_pretrained; needs the accelerate package; replaces --device; "
                   "default: the whole model on --device)"),
}
#: ``train``'s help of the shared flags: the same meaning, its own defaults (the preset's, or the saved run's).
TRAIN_HELP = {
    "out": "output folder; the run's checkpoints go there and --resume continues the run in it (default: report/train)",
    "seed": "seed of every random draw: problems, noise, model init (default: the preset's, or the saved run's on "
            "--resume)",
    "device": "cpu, cuda, cuda:1 ... (default: the preset's, or the saved run's on --resume)",
    "threads": "torch CPU threads (default: the saved run's on --resume, else 1, whatever OMP_NUM_THREADS says)",
}
#: What an unset --seed / --device / --threads means outside ``train``.
DEFAULTS = dict(seed=0, device="cpu", threads=1)


# ----------------------------------------------------------------------------- the shared flags


def _help(flag: str, train: bool) -> str:
    return TRAIN_HELP[flag] if train else HELP[flag]


def add_out(p: argparse.ArgumentParser, force: bool = True) -> None:
    """``--out`` (and ``--force``; ``train`` has ``--resume`` instead, and its own help)."""
    p.add_argument("--out", metavar="DIR", help=_help("out", train=not force))
    if force:
        p.add_argument("--force", action="store_true", help=HELP["force"])


def add_seed(p: argparse.ArgumentParser, train: bool = False) -> None:
    p.add_argument("--seed", type=int, help=_help("seed", train))


def add_device(p: argparse.ArgumentParser, train: bool = False) -> None:
    p.add_argument("--device", help=_help("device", train))


def add_threads(p: argparse.ArgumentParser, train: bool = False) -> None:
    p.add_argument("--threads", type=positive_int, help=_help("threads", train))


def add_dtype(p: argparse.ArgumentParser) -> None:
    """``--dtype`` (checked by ``interp_norm.training.devices.resolve_dtype``: an unknown name is a ConfigError)."""
    p.add_argument("--dtype", metavar="DTYPE", help=HELP["dtype"])


def add_window_batch(p: argparse.ArgumentParser) -> None:
    """``--window-batch`` (collapse and geometry on Hugging Face models; checked by the library)."""
    p.add_argument("--window-batch", type=positive_int, metavar="N", help=HELP["window_batch"])


def add_device_map(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device-map", metavar="MAP", help=HELP["device_map"])


def add_progress(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true", help=HELP["no_progress"])


def add_heavy(p: argparse.ArgumentParser, train: bool = False) -> None:
    """``--seed``, ``--device``, ``--threads`` and ``--no-progress``: every subcommand that does heavy work
    (``train=True``: with train's defaults in their help)."""
    add_seed(p, train)
    add_device(p, train)
    add_threads(p, train)
    add_progress(p)


def add_n_examples(p: argparse.ArgumentParser, default: int, unit: str = "") -> None:
    """``--n-examples`` (the default depends on the analysis; ``unit`` says what it counts per, if anything)."""
    p.add_argument("--n-examples", type=positive_int, default=default, metavar="N", help=HELP["n_examples"] + unit)


def add_split(p: argparse.ArgumentParser, choices: Sequence[str]) -> None:
    p.add_argument("--split", default="id", choices=choices, help=HELP["split"])


def add_batch_size(p: argparse.ArgumentParser, default: Optional[int], note: str = "") -> None:
    p.add_argument("--batch-size", type=positive_int, default=default, help=HELP["batch_size"] + note)


# ----------------------------------------------------------------------------- deprecated spellings


class DeprecatedAlias(argparse.Action):
    """A hidden old spelling: warns once on stderr (naming the subcommand) and sets the new flag's ``dest``."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: str = "", **kw: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        print(f"{parser.prog}: warning: {option_string} is deprecated; use {self.new} (same meaning)",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_alias(p: argparse.ArgumentParser, old: str, new: str, dest: str, **kw: Any) -> None:
    """Accept ``old`` as a deprecated spelling of ``new`` (not shown in --help)."""
    p.add_argument(old, dest=dest, action=DeprecatedAlias, new=new, help=argparse.SUPPRESS,
                   default=argparse.SUPPRESS, **kw)


# ----------------------------------------------------------------------------- --out


def model_name(spec: Any) -> str:
    """A short name for a model argument: a pretrained name as is, a folder by its last part (a
    ``step-*`` folder by its run's), a Hugging Face name by its part after the organisation."""
    path = Path(str(spec).rstrip("/\\"))
    name = path.name or str(spec)
    if name.startswith("step-") and path.parent.name:
        name = path.parent.name
    return name


def default_out(command: str, model: Any = None) -> Path:
    """``report/<command>/<model name>``, or ``report/<command>`` without one model (see :data:`NO_MODEL_PART`)."""
    base = Path(OUT_ROOT) / command
    if command in NO_MODEL_PART or model is None or isinstance(model, (list, tuple)):
        return base
    return base / model_name(model)


# ----------------------------------------------------------------------------- did you mean


def unknown_options_message(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """``unrecognized arguments: --quik (did you mean --quick?)`` for the subcommand's own options."""
    msg = f"unrecognized arguments: {' '.join(extras)}"
    options = [s for a in parser._actions for s in a.option_strings if a.help is not argparse.SUPPRESS]
    for word in extras:
        if word.startswith("-"):
            hit = closest(word.split("=", 1)[0], options)
            if hit:
                return f"{msg} (did you mean {hit}?)"
    return msg
