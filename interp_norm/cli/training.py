"""Subcommands that make and list models: ``train``, ``evaluate``, ``list``."""

from __future__ import annotations

import argparse
from pathlib import Path

from interp_norm.cli._grammar import add_alias, add_batch_size, add_heavy, add_n_examples, add_out, add_progress
from interp_norm.cli._support import (
    CKPT_HELP,
    SPLITS,
    command,
    load_ours,
    nonnegative_float,
    percent_table,
    positive_int,
    prepare_out,
)


# ----------------------------------------------------------------------------- train


def _train_args(p: argparse.ArgumentParser) -> None:
    add_out(p, force=False)
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its last checkpoint, with its saved options unless given here")
    p.add_argument("--preset", choices=["cpu", "paper"],
                   help="model, task and training recipe together (default: cpu, or the saved run's on --resume)")
    p.add_argument("--model-preset", choices=["tiny", "cpu", "paper"], help="override the model preset (default: --preset)")
    p.add_argument("--task-preset", choices=["cpu", "paper"], help="override the task preset (default: --preset)")
    p.add_argument("--attn-norm", choices=["pre", "qkv", "qk", "none"],
                   help="where attention normalises: Pre-Norm, QKV-Norm, QK-Norm or none (default: pre)")
    p.add_argument("--norm-kind", choices=["rms", "ln"], help="RMSNorm or LayerNorm (default: rms)")
    p.add_argument("--steps", type=positive_int,
                   help="total optimizer steps (overrides --epochs; default: the preset's). A larger value on "
                        "--resume extends the run and says what that does to the learning rate (see --min-lr)")
    p.add_argument("--epochs", type=positive_int, help="number of epochs (default: the preset's)")
    p.add_argument("--steps-per-epoch", type=positive_int, help="optimizer steps per epoch (default: the preset's)")
    add_batch_size(p, None, ", one optimizer step (default: the preset's)")
    p.add_argument("--lr", type=float, help="peak learning rate of AdamW (default: the preset's)")
    p.add_argument("--min-lr", type=nonnegative_float,
                   help="learning rate the cosine schedule decays to; a run extended with a larger --steps on "
                        "--resume continues at this rate (no restart), so set it > 0 if you may extend the run "
                        "(default: the preset's, 0)")
    p.add_argument("--grad-clip", type=nonnegative_float, help="gradient-norm clip, 0 = none (default: the preset's)")
    p.add_argument("--log-every", type=positive_int, help="steps between training-curve rows (default: the preset's)")
    p.add_argument("--eval-every", type=positive_int, help="steps between held-out evaluations (default: the preset's)")
    p.add_argument("--eval-size", type=positive_int, help="problems per split in those evaluations (default: the preset's)")
    p.add_argument("--final-eval-size", type=positive_int,
                   help="problems per split in the final evaluation (default: the preset's)")
    p.add_argument("--checkpoint-every", type=positive_int, help="steps between checkpoints (default: the preset's)")
    add_heavy(p, train=True)


@command("train", help="train a model (resumable; checkpoints into --out)", add_arguments=_train_args,
         interrupted="interrupted; continue the run from its last checkpoint with --resume (same --out)",
         flags=dict(max_steps="--steps", n_epochs="--epochs", lr="--lr", seed="--seed", device="--device",
                    attn_norm="--attn-norm", norm_kind="--norm-kind", threads="--threads"))
def _train(args: argparse.Namespace) -> int:
    import pandas as pd

    from interp_norm.errors import CheckpointNotFoundError
    from interp_norm.training.checkpoints import LATEST, latest_checkpoint, read_checkpoint_info
    from interp_norm.training.io import ensure_writable_dir
    from interp_norm.core.model import ModelConfig
    from interp_norm.core.task import AdditionTask
    from interp_norm.training.train import resolve_device, train
    from interp_norm.training.config import TrainConfig

    # --resume without options continues with the saved ones; options given here must agree
    # with them (train() says which differ), except those that cannot change the weights.
    saved = None
    if args.resume:
        if not Path(args.out).is_dir() or latest_checkpoint(args.out) is None:
            raise CheckpointNotFoundError(
                f"--resume: no training run in {args.out} (looked for {Path(args.out) / LATEST}, the pointer to "
                f"its last checkpoint); check the path, or drop --resume to start a fresh run")
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
            checkpoint_every=args.checkpoint_every, seed=args.seed, min_lr=args.min_lr, threads=args.threads,
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
    import os

    if os.environ.get("RANK", "0") != "0":  # under torchrun rank 0 reports for every process
        return 0
    info = read_checkpoint_info(args.out)
    print(f"trained {info.step} steps; checkpoint: {info.path}")
    print(percent_table(pd.DataFrame(info.metrics.get("evaluation", []))))
    return 0


# ----------------------------------------------------------------------------- evaluate


def _evaluate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", help=CKPT_HELP)
    add_out(p)
    add_n_examples(p, 2048, " per split")
    add_alias(p, "--size", "--n-examples", "n_examples", type=positive_int)
    p.add_argument("--splits", nargs="+", default=list(SPLITS), choices=SPLITS, help="splits to evaluate")
    add_batch_size(p, 512)
    p.add_argument("--no-exact-match", action="store_true", help="skip greedy generation (faster)")
    add_heavy(p)


@command("evaluate", help="per-token and exact-match accuracy of a checkpoint per split (evaluation.csv; --seed 1234 "
                          "draws the test sets its training evaluated on, the numbers 'interp-norm list' shows)",
         add_arguments=_evaluate_args, flags=dict(size="--n-examples"))
def _evaluate(args: argparse.Namespace) -> int:
    from interp_norm.core.scoring import evaluate
    from interp_norm.training.io import write_csv
    from interp_norm.training.devices import resolve_device

    out = prepare_out(args.out, ["evaluation.csv"], args.force)
    resolve_device(args.device)
    model, info = load_ours(args.ckpt, "evaluate", device=args.device)
    df = evaluate(model, info.task, splits=args.splits, size=args.n_examples, seed=args.seed,
                  batch_size=args.batch_size, exact_match=not args.no_exact_match, progress=not args.no_progress)
    df.insert(0, "checkpoint", args.ckpt)
    print(percent_table(df))
    print(f"wrote {write_csv(out / 'evaluation.csv', df)}")
    return 0


# ----------------------------------------------------------------------------- list


def _list_args(p: argparse.ArgumentParser) -> None:
    add_progress(p)  # accepted like everywhere (list draws no bar), so scripts can pass it to every command


@command("list", help="list the pretrained checkpoints shipped in data/checkpoints", add_arguments=_list_args)
def _list(args: argparse.Namespace) -> int:
    from interp_norm.training.checkpoints import list_pretrained, pretrained_dir

    df = list_pretrained()
    if df.empty:
        print(f"no pretrained checkpoints in {pretrained_dir()} (set INTERP_NORM_DATA to another data folder)")
    else:
        print(percent_table(df.drop(columns=["path"])))
    return 0
