"""The ``interp-norm`` command line: orchestration only, no science.

Each subcommand is one function that adds its parser and returns the function that runs it,
registered with :func:`command`::

    @command("noise", help="accuracy under norm noise")
    def _noise(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
        p.add_argument("ckpt")
        def run(args): ...; return 0
        return run

Subcommands appear in ``--help`` in registration order. Any :class:`InterpNormError` becomes
one line ``interp-norm: error: ...`` on stderr and exit code 2 (no traceback); so do bad
arguments. Heavy imports happen inside ``run`` so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from interp_norm.errors import InterpNormError, OutputDirError

Runner = Callable[[argparse.Namespace], int]
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], Runner]]] = {}
PROG = "interp-norm"


def command(name: str, help: str) -> Callable:
    """Register a subcommand: ``add(parser) -> run(args) -> exit code``."""

    def deco(add: Callable[[argparse.ArgumentParser], Runner]) -> Callable[[argparse.ArgumentParser], Runner]:
        COMMANDS[name] = (help, add)
        return add

    return deco


class _Parser(argparse.ArgumentParser):
    """argparse, but errors are one line (usage is behind --help)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _check_csv_out(path: Optional[str]) -> Optional[Path]:
    """Fail before any work if a --out CSV cannot be written."""
    if path is None:
        return None
    from interp_norm.checkpoints import ensure_writable_dir

    p = Path(path)
    if p.is_dir():
        raise OutputDirError(f"--out {path!r} is a folder; give a file name such as results.csv")
    ensure_writable_dir(p.parent if str(p.parent) else Path("."))
    return p


def _load_any(ckpt: str, device: str = "cpu"):
    from interp_norm.checkpoints import load_any

    return load_any(ckpt, device=device)


# ----------------------------------------------------------------------------- train


@command("train", help="train a model (resumable; checkpoints into --out)")
def _train(p: argparse.ArgumentParser) -> Runner:
    p.add_argument("--out", required=True, help="run folder (checkpoints step-*/ and LATEST go here)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its last checkpoint, with its saved options unless given here")
    p.add_argument("--preset", choices=["cpu", "paper"],
                   help="model, task and training recipe together (default: cpu)")
    p.add_argument("--model-preset", choices=["tiny", "cpu", "paper"], help="override the model preset")
    p.add_argument("--task-preset", choices=["cpu", "paper"], help="override the task preset")
    p.add_argument("--attn-norm", choices=["pre", "qkv", "qk", "none"], help="default: pre")
    p.add_argument("--norm-kind", choices=["rms", "ln"], help="default: rms")
    p.add_argument("--seed", type=int, help="seeds both the model init and the data stream (default: the preset's)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: the preset's)")
    p.add_argument("--steps", type=int, help="total optimizer steps (overrides --epochs)")
    p.add_argument("--epochs", type=int, help="number of epochs")
    p.add_argument("--steps-per-epoch", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--grad-clip", type=float, help="gradient-norm clip (0 = none)")
    p.add_argument("--log-every", type=int)
    p.add_argument("--eval-every", type=int)
    p.add_argument("--eval-size", type=int)
    p.add_argument("--final-eval-size", type=int)
    p.add_argument("--checkpoint-every", type=int)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    def run(args: argparse.Namespace) -> int:
        import pandas as pd

        from interp_norm.checkpoints import ensure_writable_dir, latest_checkpoint, read_checkpoint_info
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

    return run


# ----------------------------------------------------------------------------- evaluate


@command("evaluate", help="per-token and exact-match accuracy of a checkpoint per split")
def _evaluate(p: argparse.ArgumentParser) -> Runner:
    p.add_argument("ckpt", help="checkpoint or run folder, or a pretrained name (see 'interp-norm list')")
    p.add_argument("--size", type=int, default=2048, help="problems per split (default 2048)")
    p.add_argument("--seed", type=int, default=1234, help="test-set seed (default 1234)")
    p.add_argument("--splits", nargs="+", default=["id", "interp", "extrap"], choices=["id", "interp", "extrap"])
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--no-exact-match", action="store_true", help="skip greedy generation (faster)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", help="also write the table to this CSV file")

    def run(args: argparse.Namespace) -> int:
        from interp_norm.evaluate import evaluate
        from interp_norm.train import resolve_device

        out = _check_csv_out(args.out)
        resolve_device(args.device)
        model, info = _load_any(args.ckpt, device=args.device)
        df = evaluate(model, info.task, splits=args.splits, size=args.size, seed=args.seed,
                      batch_size=args.batch_size, exact_match=not args.no_exact_match)
        df.insert(0, "checkpoint", args.ckpt)
        print(df.to_string(index=False))
        if out is not None:
            df.to_csv(out, index=False)
        return 0

    return run


# ----------------------------------------------------------------------------- noise and collapse


def _noise_args(p: argparse.ArgumentParser, default_levels: Sequence[float], default_n: int) -> None:
    p.add_argument("ckpt", help="checkpoint or run folder, or a pretrained name (see 'interp-norm list')")
    p.add_argument("--out", required=True, help="folder for the CSV tables")
    p.add_argument("--levels", type=float, nargs="+", default=list(default_levels), help="noise RMS levels")
    p.add_argument("--split", default="id", choices=["id", "interp", "extrap"])
    p.add_argument("--n-examples", type=int, default=default_n)
    p.add_argument("--placement", default="before_norm", choices=["before_norm", "after_norm"],
                   help="for QK/QKV-Norm models: noise before the norm (removed by it) or after it")
    p.add_argument("--distribution", default="uniform", choices=["uniform", "normal"])
    p.add_argument("--seed", type=int, default=0, help="noise seed")


@command("noise", help="per-token accuracy under multiplicative norm noise (the paper's noise-sensitivity sweep)")
def _noise(p: argparse.ArgumentParser) -> Runner:
    from interp_norm.noise import DEFAULT_NOISE_LEVELS

    _noise_args(p, DEFAULT_NOISE_LEVELS, 512)
    p.add_argument("--n-datasets", type=int, default=3, help="independent datasets for the standard error")

    def run(args: argparse.Namespace) -> int:
        from interp_norm.checkpoints import ensure_writable_dir
        from interp_norm.noise import run_noise

        out = ensure_writable_dir(args.out)
        model, info = _load_any(args.ckpt)
        df = run_noise(model, info.task, args.levels, split=args.split, n_datasets=args.n_datasets,
                       n_examples=args.n_examples, placement=args.placement, distribution=args.distribution,
                       seed=args.seed, progress=True)
        df.to_csv(out / "noise_accuracy.csv", index=False)
        print(df.to_string(index=False))
        print(f"wrote {out / 'noise_accuracy.csv'}")
        return 0

    return run


@command("collapse", help="circuit-collapse probability vs noise, measured and predicted by the theory")
def _collapse(p: argparse.ArgumentParser) -> Runner:
    from interp_norm.noise import DEFAULT_COLLAPSE_LEVELS

    _noise_args(p, DEFAULT_COLLAPSE_LEVELS, 256)

    def run(args: argparse.Namespace) -> int:
        from interp_norm.checkpoints import ensure_writable_dir
        from interp_norm.noise import collapse_thresholds, run_collapse

        out = ensure_writable_dir(args.out)
        model, info = _load_any(args.ckpt)
        curves = run_collapse(model, info.task, args.levels, split=args.split, n_examples=args.n_examples,
                              placement=args.placement, distribution=args.distribution, seed=args.seed, progress=True)
        thresholds = collapse_thresholds(curves)
        curves.to_csv(out / "collapse_curves.csv", index=False)
        thresholds.to_csv(out / "collapse_thresholds.csv", index=False)
        print(thresholds.to_string(index=False))
        print(f"wrote {out / 'collapse_curves.csv'} and {out / 'collapse_thresholds.csv'}")
        return 0

    return run


@command("geometry", help="norm spread, orthogonal spheres, subspace angles, interference, sparsity, LayerNorm ellipsoids")
def _geometry(p: argparse.ArgumentParser) -> Runner:
    p.add_argument("ckpt", help="checkpoint or run folder, or a pretrained name (see 'interp-norm list')")
    p.add_argument("--out", required=True, help="folder for the CSV tables")
    p.add_argument("--n", type=int, default=256, help="problems analysed (default 256)")
    p.add_argument("--split", default="id", choices=["id", "interp", "extrap"])
    p.add_argument("--seed", type=int, default=0)

    def run(args: argparse.Namespace) -> int:
        from interp_norm.checkpoints import ensure_writable_dir
        from interp_norm.geometry import geometry_summary, run_geometry

        out = ensure_writable_dir(args.out)
        model, info = _load_any(args.ckpt)
        results = run_geometry(model, info.task, n=args.n, split=args.split, seed=args.seed, progress=True)
        for name, df in results.items():
            df.to_csv(out / f"geometry_{name}.csv", index=False)
        print(geometry_summary(results, per_layer=False).to_string(index=False))
        print(f"wrote {len(results)} tables geometry_*.csv to {out}")
        return 0

    return run


# ----------------------------------------------------------------------------- list


@command("list", help="list the pretrained checkpoints shipped in data/checkpoints")
def _list(p: argparse.ArgumentParser) -> Runner:
    def run(args: argparse.Namespace) -> int:
        from interp_norm.checkpoints import list_pretrained, pretrained_dir

        df = list_pretrained()
        if df.empty:
            print(f"no pretrained checkpoints in {pretrained_dir()} (set INTERP_NORM_DATA to another data folder)")
        else:
            print(df.drop(columns=["path"]).to_string(index=False))
        return 0

    return run


# ----------------------------------------------------------------------------- main


from interp_norm import dashboard as _dashboard, reproduce as _reproduce  # noqa: E402  (register their commands)
from interp_norm.circuits import cli_command as _circuits_command  # noqa: E402

command("circuits", help="patching tables, EAP-IG edges, circuit graph and faithfulness for a checkpoint")(_circuits_command)

_reproduce.register_cli(command)
_dashboard.register_cli(command)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Pre-Norm vs QKV-Norm addition transformers: train, evaluate, analyse.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, (help_text, add) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_run=add(p))
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``interp-norm``; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except InterpNormError as e:
        print(f"{PROG}: error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted (a training run continues with --resume)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
