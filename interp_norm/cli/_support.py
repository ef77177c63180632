"""The machinery under :mod:`interp_norm.cli`: the command registry, the parser, and the CLI boundary.

Kept apart so the subcommand modules read as lists of subcommands. Nothing here imports more than the
standard library (``interp-norm --help`` must stay fast). At the boundary, library errors are
rewritten to speak the command line's language: Python parameter names become the flags that set
them (``max_steps`` -> ``--steps``), and every ``--out`` is a folder whose existing result files
are kept unless ``--force`` is given.
"""

from __future__ import annotations

import argparse
import difflib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from interp_norm.errors import OutputDirError
# the analyses ``reproduce`` can run and the opt-in ones (``--controls``); the registry imports only the standard library
from interp_norm.report.registry import ANALYSES, CONTROLS  # noqa: F401

PROG = "interp-norm"
#: What Ctrl-C prints unless the subcommand says otherwise: the one-checkpoint analyses write their
#: tables once, at the end, so nothing of an interrupted run is kept.
INTERRUPTED = "interrupted before the results were written; run the command again"
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
    interrupted: str = INTERRUPTED


COMMANDS: dict[str, Command] = {}


def command(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None] = lambda p: None,
            flags: Mapping[str, str] = {}, interrupted: str = INTERRUPTED) -> Callable[[Runner], Runner]:
    """Register the decorated ``run(args) -> exit code`` as subcommand ``name``; ``interrupted`` is
    the line Ctrl-C prints (after ``interp-norm NAME:``)."""

    def deco(run: Runner) -> Runner:
        COMMANDS[name] = Command(name, help, add_arguments, run, dict(flags), interrupted)
        return run

    return deco


# ----------------------------------------------------------------------------- parser


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default after its help, unless the help already says it (or there is none);
    a description or epilog keeps its paragraphs (blank lines)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n\n".join(super(HelpFormatter, self)._fill_text(par, width, indent) for par in text.split("\n\n"))

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
        self.exit(2, f"{self.prog}: error: {with_suggestion(message)} (see '{self.prog} --help')\n")


def with_suggestion(message: str) -> str:
    """argparse's ``invalid choice: 'QKV' (choose from ...)`` plus ``; did you mean 'qkv'?``."""
    m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if not m:
        return message
    hit = closest(m.group(1), re.findall(r"'([^']*)'", m.group(2)))
    return f"{message}; did you mean {hit!r}?" if hit else message


def closest(word: str, choices: Iterable[str]) -> Optional[str]:
    """The choice the user most likely meant: the same word in another case, else the nearest by spelling."""
    choices = [str(c) for c in choices]
    for c in choices:
        if c.lower() == word.lower():
            return c
    hit = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return hit[0] if hit else None


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
    from interp_norm.training.io import ensure_writable_dir

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
                show.at[i, col] = f"> {as_percent(g['level'].max())}"
                used.add(">")
            elif g[src].iloc[0] >= row["target"]:
                show.at[i, col] = f"< {as_percent(g['level'].min())}"
                used.add("<")
    for col in ("level_measured", "level_predicted"):  # levels are fractions: percentages, like the target
        if col in cols:
            show[col] = show[col].map(as_percent)
    from interp_norm.core.defaults import SPARSE_THRESHOLD

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


# ----------------------------------------------------------------------------- models: ours or Hugging Face


def load_ours(spec: str, command_name: str, device: str = "cpu") -> tuple[Any, Any]:
    """(model, info) of one of our checkpoints; a Hugging Face model gets a ConfigError naming the command
    (recognised from its config.json or the cache, before any weights load)."""
    from interp_norm.anatomy.loading import load_with_info, spec_kind
    from interp_norm.errors import ConfigError

    if spec_kind(spec) == "bridge":  # neither kind: the error names both places it looked
        raise ConfigError(f"{spec!r} is a Hugging Face model; 'interp-norm {command_name}' runs on the addition task "
                          "and needs one of our checkpoints (HF models work with collapse, noise, geometry and dashboard)")
    return load_with_info(spec, device=device, kind="interp_norm")


def hf_tokens(model: Any, args: argparse.Namespace) -> Any:
    """Text windows for a Hugging Face model (--text, else the shipped sample; random ids without a tokenizer)."""
    from interp_norm.geometry.bridge import bridge_tokens

    if getattr(args, "text", None):
        from interp_norm.anatomy import text_tokens
        from interp_norm.errors import ConfigError

        if getattr(model, "tokenizer", None) is None:
            raise ConfigError(f"--text needs a tokenizer, but {getattr(model.cfg, 'model_name', None) or 'the model'!r} has none "
                              "(no tokenizer files were saved beside the weights); copy tokenizer.json / "
                              "tokenizer_config.json into the model folder, or leave out --text")

        return text_tokens(model, Path(args.text).read_text(encoding="utf-8"), n_ctx=args.n_ctx, max_windows=args.windows)
    return bridge_tokens(model, args.windows, args.n_ctx, args.seed)


def hf_args(p: argparse.ArgumentParser) -> None:
    """Options that only apply to a Hugging Face model (it has no addition task)."""
    p.add_argument("--text", help="Hugging Face models: a UTF-8 text file to analyse (default: the shipped sample text)")
    p.add_argument("--n-ctx", type=positive_int, default=64, help="Hugging Face models: tokens per text window")
    p.add_argument("--windows", type=positive_int, default=8, help="Hugging Face models: text windows analysed")


def real_model_tables(models: dict, args: argparse.Namespace) -> dict:
    """``real_layers`` (per layer of each HF model: norm spread, sparse fraction ..., ``input``: "text" or
    "random token ids" for a model without a tokenizer) and
    ``real_anatomy`` (its attention anatomy), for the dashboard's real-model section."""
    import pandas as pd

    from interp_norm.geometry import geometry_summary, run_geometry

    layers, anat = [], []
    for name, model in models.items():
        res = run_geometry(model, tokens=hf_tokens(model, args), progress=not args.no_progress)
        # what the windows were: the dashboard must not call random ids text
        source = "text" if getattr(model, "tokenizer", None) is not None else "random token ids"
        layers.append(geometry_summary(res).assign(model=name, input=source))
        anat.append(res["anatomy"].assign(model=name))
    return {"real_layers": pd.concat(layers, ignore_index=True), "real_anatomy": pd.concat(anat, ignore_index=True)}


# ----------------------------------------------------------------------------- shared by the subcommands

#: The task's splits (the task module imports torch; --help must not).
SPLITS = ("id", "interp", "extrap")
CKPT_HELP = "checkpoint or run folder, or a pretrained name (see 'interp-norm list')"
MODEL_HELP = (CKPT_HELP[:-1] + "), or a Hugging Face model: a local save_pretrained folder or a name already in the "
              "Hugging Face cache (never downloaded)")


#: Printed columns that hold fractions (shown as percentages; the CSVs keep fractions).
PERCENT_COLUMNS = re.compile(r"^(.*_acc|per_token_acc.*|accuracy|exact_match|agreement|within_tol|frac_.*|"
                             r"faithfulness|target|se|agreement_se|level|level_measured|level_predicted|"
                             r"mean_spread|max_spread)$")


def as_percent(value: Any) -> Any:
    """0.8926 -> '89.26%' (NaN and non-numbers unchanged)."""
    try:
        v = float(value) * 100
    except (TypeError, ValueError):
        return value
    if math.isnan(v):
        return value
    return f"{v:.2f}%" if v == 0 or abs(v) >= 0.01 else f"{v:.2g}%"


def with_model(df: Any, spec: Any) -> Any:
    """``df`` with a first ``model`` column naming the model (a folder by its name, a step folder by its
    run's), unless it already names it: every one-line table says whose numbers it shows."""
    if "model" in df.columns or "checkpoint" in df.columns:
        return df
    path = Path(str(spec))
    name = str(spec)
    if path.exists():
        path = path.resolve()
        name = path.parent.name if path.name.startswith("step-") else path.name
    return df.assign(model=name)[["model", *df.columns]]


def percent_table(df: Any) -> str:
    """``df.to_string`` with every fraction column (:data:`PERCENT_COLUMNS`) as a percentage."""
    show = df.copy()
    for col in show.columns:
        if isinstance(col, str) and PERCENT_COLUMNS.match(col) and show[col].dtype.kind in "fi":
            show[col] = show[col].map(as_percent)
    return show.to_string(index=False)


def check_placement(model: Any, placement: str) -> None:
    """``--placement after_norm`` means something only where a norm sits on q, k or v (QK/QKV-Norm,
    Qwen3, Gemma ...); elsewhere (Pre-Norm, No-Norm, GPT-2-like Pre-LN models) the noise after the
    norm is the noise before it, so the run would record a placement that changed nothing: a ConfigError."""
    if placement != "after_norm":
        return
    from interp_norm.anatomy import anatomy
    from interp_norm.errors import ConfigError

    anat = anatomy(model)
    if not any(la.norms.get(t) is not None for la in anat.layers for t in ("q", "k", "v")):
        kind = getattr(getattr(model, "cfg", None), "attn_norm", None)
        what = {"pre": "a Pre-Norm model", "none": "a No-Norm model"}.get(kind, anat.architecture)
        raise ConfigError(f"--placement after_norm means nothing for {what}: it has no norm on q, k or v, so noise "
                          "after the norm is the noise before it; drop --placement (it applies to QK-/QKV-Norm "
                          "models and models with q/k norms such as Qwen3)")

