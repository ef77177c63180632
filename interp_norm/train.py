"""The training loop: the paper's recipe, resumable bit-for-bit after a kill.

Recipe (Menary et al. 2024, digest §3.4): AdamW (lr 3e-4, weight decay 0.01, other settings the
Keras 2.15 defaults: betas 0.9/0.999, eps 1e-7, no gradient clipping, decay on every weight),
epochs of 2000 batches of 128 generated on the fly, and the learning rate halved when the epoch's
mean training loss has not improved for 3 consecutive epochs (Keras ``ReduceLROnPlateau``
semantics: improvement means lower by more than ``lr_min_delta``; see :class:`PlateauHalving`).

Data stream: the batch and the position offsets of step ``s`` come from
``random.Random(f"interp_norm-train:{seed}:{s}")``, a pure function of (seed, step). So the data
sampler has no state to save beyond the step counter, and a resumed run sees exactly the batches
an uninterrupted one would. Together with the saved model, AdamW moments, LR schedule, loss
accumulators and torch RNG state, a run killed at any moment and resumed with ``resume=True``
ends with weights bit-identical to an uninterrupted run (on CPU with the same number of threads;
CUDA kernels are not guaranteed deterministic).

Run folder layout: ``out_dir/step-XXXXXXXX/`` checkpoints and ``out_dir/LATEST`` (see
:mod:`interp_norm.checkpoints`); ``load_checkpoint(out_dir)`` loads the newest.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from interp_norm import checkpoints as C
from interp_norm.errors import CheckpointError, ConfigError, OutputDirError, TrainingDivergedError
from interp_norm.evaluate import evaluate, token_correct_counts
from interp_norm.model import HookedNormTransformer, ModelConfig
from interp_norm.task import AdditionTask, next_token_targets

TRAIN_STATE_VERSION = 1


@dataclass
class TrainConfig:
    """Optimisation, schedule, evaluation and checkpointing of one run.

    ``grad_clip``: global gradient-norm clip; ``None`` (default, as the paper's Keras setup) means
    no clipping. The gradient norm is logged either way. ``max_steps`` overrides
    ``n_epochs * steps_per_epoch`` (useful for short runs; the LR schedule still counts epochs of
    ``steps_per_epoch``). ``seed`` seeds the data stream only; the model's init seed is
    ``ModelConfig.seed`` (the CLI sets both from ``--seed``).
    """

    lr: float = 3e-4
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-7  # Keras default (torch's is 1e-8)
    batch_size: int = 128
    steps_per_epoch: int = 2000
    n_epochs: int = 430  # ≈110M examples, the paper's 2 days on a V100
    max_steps: Optional[int] = None
    schedule: str = "plateau"  # "plateau" (the paper's Keras ReduceLROnPlateau) or "cosine" (warm-up + cosine decay)
    warmup_frac: float = 0.05  # "cosine" only: fraction of total steps with a linear warm-up
    lr_factor: float = 0.5
    lr_patience: int = 3
    lr_min_delta: float = 1e-4
    min_lr: float = 0.0
    grad_clip: Optional[float] = None
    pos_offsets: bool = True  # random position offset in [0, model max_pos_offset] per sequence
    log_every: int = 50
    eval_every: int = 2000
    eval_size: int = 512
    eval_seed: int = 1234
    eval_splits: tuple[str, ...] = ("id", "interp", "extrap")
    final_eval_size: int = 2048
    checkpoint_every: int = 2000
    keep_checkpoints: int = 1
    seed: int = 0
    device: str = "cpu"

    PRESETS = {
        # The paper's recipe for its Baseline on one GPU.
        "paper": dict(device="cuda", log_every=100, eval_every=2000, eval_size=1024, checkpoint_every=2000),
        # The shipped reference models (README): 10,000 steps of 128 with warm-up + cosine decay on the
        # cpu task preset, ~25 min on one core.
        "cpu": dict(
            lr=2e-3, batch_size=128, steps_per_epoch=250, n_epochs=40, grad_clip=1.0, schedule="cosine",
            log_every=25, eval_every=1000, eval_size=512, final_eval_size=2048, checkpoint_every=500,
        ),
    }

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)  # type: ignore[assignment]
        self.eval_splits = tuple(self.eval_splits)
        self.validate()

    def validate(self) -> None:
        def pos_int(name: str, allow_none: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")

        for name in ("batch_size", "steps_per_epoch", "n_epochs", "log_every", "eval_every", "eval_size",
                     "final_eval_size", "checkpoint_every", "keep_checkpoints", "lr_patience"):
            pos_int(name)
        pos_int("max_steps", allow_none=True)
        for name in ("lr", "lr_factor"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ConfigError(f"{name} must be a positive number, got {v!r}")
        if not self.lr_factor < 1:
            raise ConfigError(f"lr_factor must be below 1 (it multiplies the lr), got {self.lr_factor}")
        for name in ("weight_decay", "min_lr", "lr_min_delta", "adam_eps"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ConfigError(f"{name} must be a number >= 0, got {v!r}")
        if self.grad_clip is not None and not (self.grad_clip > 0 and math.isfinite(self.grad_clip)):
            raise ConfigError(f"grad_clip must be a positive number or None (no clipping), got {self.grad_clip!r}")
        if self.schedule not in ("plateau", "cosine"):
            raise ConfigError(f"schedule must be 'plateau' (the paper's) or 'cosine', got {self.schedule!r}")
        if not (0 <= self.warmup_frac < 1):
            raise ConfigError(f"warmup_frac must be in [0, 1), got {self.warmup_frac!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        bad = [s for s in self.eval_splits if s not in ("id", "interp", "extrap")]
        if bad or not self.eval_splits:
            raise ConfigError(f"eval_splits must be a non-empty subset of ('id', 'interp', 'extrap'), got {self.eval_splits!r}")
        if not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ConfigError(f"unknown device {self.device!r}; use 'cpu', 'cuda' or 'cuda:0'") from None

    @property
    def total_steps(self) -> int:
        return self.max_steps if self.max_steps is not None else self.n_epochs * self.steps_per_epoch

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "TrainConfig":
        if name not in cls.PRESETS:
            raise ConfigError(f"unknown training preset {name!r}; choose one of {sorted(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["betas"], d["eval_splits"] = list(self.betas), list(self.eval_splits)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown training config fields {unknown}; known fields: {sorted(names)}")
        return cls(**d)

    def replace(self, **changes: Any) -> "TrainConfig":
        return TrainConfig.from_dict({**self.to_dict(), **changes})


# Fields that may differ between a run and its resumption without changing the weights.
RESUMABLE_CHANGES = ("n_epochs", "max_steps", "device", "log_every", "eval_every", "eval_size",
                     "final_eval_size", "checkpoint_every", "keep_checkpoints")


class PlateauHalving:
    """Multiply the lr by ``factor`` after ``patience`` epochs without improvement (Keras semantics).

    Keras' ``ReduceLROnPlateau`` (which the paper used) reduces when the count of epochs without
    improvement reaches ``patience``; torch's reduces only when it *exceeds* it. Improvement: the
    epoch loss is below the best so far by more than ``min_delta`` (absolute, Keras' default 1e-4).
    The state is plain floats so it loads with ``weights_only=True``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, factor: float, patience: int, min_delta: float, min_lr: float):
        self.optimizer, self.factor, self.patience, self.min_delta, self.min_lr = optimizer, factor, patience, min_delta, min_lr
        self.best = math.inf
        self.wait = 0
        self.n_reductions = 0

    def step(self, epoch_loss: float) -> None:
        if epoch_loss < self.best - self.min_delta:
            self.best, self.wait = epoch_loss, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            for g in self.optimizer.param_groups:
                g["lr"] = max(g["lr"] * self.factor, self.min_lr)
            self.wait = 0
            self.n_reductions += 1

    def state_dict(self) -> dict:
        return {"best": self.best, "wait": self.wait, "n_reductions": self.n_reductions}

    def load_state_dict(self, d: dict) -> None:
        self.best, self.wait, self.n_reductions = float(d["best"]), int(d["wait"]), int(d["n_reductions"])


def cosine_lr(step: int, total: int, peak: float, warmup_frac: float, floor: float = 0.0) -> float:
    """Linear warm-up to ``peak`` over ``warmup_frac`` of the run, then cosine decay to ``floor``."""
    warm = max(1, int(round(warmup_frac * total)))
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * min(t, 1.0)))


# ----------------------------------------------------------------------------- data


def batch_for_step(task: AdditionTask, seed: int, step: int, batch_size: int, max_pos_offset: int) -> tuple[Tensor, Tensor]:
    """Tokens and position offsets of training step ``step``: a pure function of its arguments."""
    rng = random.Random(f"interp_norm-train:{seed}:{step}")  # str seeds hash with sha512: stable across runs
    tokens = task.sample_batch(batch_size, "id", seed=rng).tokens
    offsets = torch.tensor([rng.randint(0, max_pos_offset) for _ in range(batch_size)], dtype=torch.long)
    return tokens, offsets


def training_loss(model: HookedNormTransformer, tokens: Tensor, pos_offset: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(logits, masked answer-token loss) of one batch; a seam tests use to inject failures."""
    return model(tokens, return_type="both", pos_offset=pos_offset)


# ----------------------------------------------------------------------------- helpers


def resolve_device(device: str) -> torch.device:
    """``torch.device`` for ``device``, or :class:`ConfigError` if that hardware is absent."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available (torch {torch.__version__}); use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"device {device!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {device!r} requested but MPS is not available; use --device cpu")
    return dev


def _check_resume_compatible(saved: C.CheckpointInfo, model_cfg: ModelConfig, task: AdditionTask, train_cfg: TrainConfig) -> None:
    if saved.model_cfg.to_dict() != model_cfg.to_dict():
        diff = {k: (v, model_cfg.to_dict().get(k)) for k, v in saved.model_cfg.to_dict().items() if model_cfg.to_dict().get(k) != v}
        raise ConfigError(f"cannot resume {saved.path}: its model config differs (saved vs now: {diff}); use the same model options or a new --out")
    if saved.task.to_dict() != task.to_dict():
        raise ConfigError(f"cannot resume {saved.path}: it was trained on task {saved.task.to_dict()}, not {task.to_dict()}; use a new --out")
    if saved.train_cfg is None:
        raise CheckpointError(f"cannot resume {saved.path}: it has no training config")
    a, b = saved.train_cfg.to_dict(), train_cfg.to_dict()
    diff = {k: (a[k], b[k]) for k in a if a[k] != b.get(k) and k not in RESUMABLE_CHANGES}
    if diff:
        raise ConfigError(
            f"cannot resume {saved.path}: training options changed (saved vs now: {diff}); resuming must use the "
            f"same options (only {', '.join(RESUMABLE_CHANGES)} may change) or train into a new --out"
        )


def curve_from(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame(rows)


class _Accumulator:
    """Running sums of per-step loss/accuracy; plain floats so they resume exactly."""

    def __init__(self) -> None:
        self.loss = self.correct = self.total = self.grad_norm = 0.0
        self.n = 0

    def add(self, loss: float, correct: int, total: int, grad_norm: float) -> None:
        self.loss += loss
        self.correct += correct
        self.total += total
        self.grad_norm += grad_norm
        self.n += 1

    def state_dict(self) -> dict:
        return dict(loss=self.loss, correct=self.correct, total=self.total, grad_norm=self.grad_norm, n=self.n)

    def load_state_dict(self, d: dict) -> None:
        self.loss, self.correct, self.total, self.grad_norm, self.n = (
            float(d["loss"]), float(d["correct"]), float(d["total"]), float(d["grad_norm"]), int(d["n"]))


# ----------------------------------------------------------------------------- training


def train(
    model_cfg: ModelConfig,
    task: AdditionTask,
    train_cfg: TrainConfig,
    out_dir: str | Path,
    resume: bool = False,
    progress: bool = True,
) -> tuple[HookedNormTransformer, pd.DataFrame]:
    """Train a model, checkpointing into ``out_dir``; returns ``(model in eval mode, curve)``.

    The curve has one row per ``log_every`` steps: ``step, epoch, examples, lr, loss, acc,
    grad_norm`` (means since the previous row) and ``eval_<split>_acc`` on eval rows.
    ``resume=True`` continues from ``out_dir``'s newest checkpoint (or starts fresh if it has
    none); ``resume=False`` refuses an ``out_dir`` that already holds a run.
    Raises :class:`TrainingDivergedError` on a NaN/inf loss or gradient, leaving the last good
    checkpoint untouched.
    """
    if not isinstance(model_cfg, ModelConfig):
        raise ConfigError(f"model_cfg must be a ModelConfig, got {type(model_cfg).__name__}")
    if not isinstance(task, AdditionTask):
        raise ConfigError(f"task must be an AdditionTask, got {type(task).__name__}")
    if not isinstance(train_cfg, TrainConfig):
        raise ConfigError(f"train_cfg must be a TrainConfig, got {type(train_cfg).__name__}")
    need = task.max_len()
    if need > model_cfg.n_ctx:
        raise ConfigError(
            f"the task's longest problem has {need} tokens but the model's n_ctx is {model_cfg.n_ctx}; "
            f"raise n_ctx to at least {need} or use fewer terms/digits"
        )
    device = resolve_device(train_cfg.device)
    out_dir = C.ensure_writable_dir(out_dir)
    saved_path = C.latest_checkpoint(out_dir)
    if not resume and (saved_path is not None or any(out_dir.glob("step-*"))):
        raise OutputDirError(
            f"{str(out_dir)!r} already holds a training run; pass resume=True (--resume) to continue it, "
            "or choose another output folder"
        )
    C.clean_temporary(out_dir)  # what a killed writer left behind

    model = HookedNormTransformer(model_cfg).to(device)
    opt = torch.optim.AdamW(
        model.parameters(), lr=train_cfg.lr, betas=train_cfg.betas, eps=train_cfg.adam_eps, weight_decay=train_cfg.weight_decay
    )
    sched = PlateauHalving(opt, train_cfg.lr_factor, train_cfg.lr_patience, train_cfg.lr_min_delta, train_cfg.min_lr)
    window, epoch_acc = _Accumulator(), _Accumulator()
    rows: list[dict] = []
    step = 0
    last_eval: dict = {}

    if resume and saved_path is not None:
        saved_model, info = C.load_checkpoint(saved_path)
        _check_resume_compatible(info, model_cfg, task, train_cfg)
        state = C.load_train_state(saved_path)
        if state.get("version") != TRAIN_STATE_VERSION:
            raise CheckpointError(f"{saved_path}/train_state.pt has version {state.get('version')!r}; expected {TRAIN_STATE_VERSION}")
        model.load_state_dict(saved_model.state_dict())
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        window.load_state_dict(state["window"])
        epoch_acc.load_state_dict(state["epoch"])
        step = int(state["step"])
        torch.set_rng_state(state["torch_rng"])
        if device.type == "cuda" and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state_all(list(state["cuda_rng"]))
        rows = info.curve.to_dict("records")
        last_eval = info.metrics
        del saved_model
        if step >= train_cfg.total_steps and info.step == step and info.metrics.get("final"):
            return model.eval(), curve_from(rows)  # a finished run: nothing to do

    total = train_cfg.total_steps
    max_off = model_cfg.max_pos_offset if (train_cfg.pos_offsets and model_cfg.pos_embed == "sinusoidal") else 0
    params = [p for p in model.parameters() if p.requires_grad]
    eval_sets = {s: task.test_set(s, size=train_cfg.eval_size, seed=train_cfg.eval_seed).tokens for s in train_cfg.eval_splits}

    def train_state() -> dict:
        return {
            "version": TRAIN_STATE_VERSION,
            "step": step,
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "window": window.state_dict(),
            "epoch": epoch_acc.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if device.type == "cuda" else None,
            "data_stream": f"random.Random('interp_norm-train:{{seed}}:{{step}}'), seed={train_cfg.seed}",
        }

    def curve() -> pd.DataFrame:
        return curve_from(rows)

    def save(metrics: dict) -> None:
        bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
        if bad:  # never let a non-finite model overwrite the last good checkpoint
            raise TrainingDivergedError(
                f"weights became non-finite by step {step} ({', '.join(bad[:3])}); the last good checkpoint in "
                f"{out_dir} is kept. Lower the learning rate (now {opt.param_groups[0]['lr']:.3g}) or set grad_clip"
            )
        C.commit_run_checkpoint(
            out_dir, step, keep_last=train_cfg.keep_checkpoints, model=model, task=task, train_cfg=train_cfg,
            train_state=train_state(), metrics=metrics, curve=curve(),
        )

    def diverged(what: str, value: float) -> TrainingDivergedError:
        kept = C.latest_checkpoint(out_dir)
        where = f"the last good checkpoint {kept} is kept" if kept else "no checkpoint had been written yet"
        return TrainingDivergedError(
            f"training {what} became {value} at step {step + 1} (lr {opt.param_groups[0]['lr']:.3g}); {where}. "
            "Lower the learning rate or set grad_clip and train into a new folder"
        )

    if not model.is_calibrated:  # the paper's Checkpoint layers: fitted once, on the first training batch
        tokens, offsets = batch_for_step(task, train_cfg.seed, 0, train_cfg.batch_size, max_off)
        model.calibrate(tokens.to(device), offsets.to(device) if max_off else None)

    bar = tqdm(total=total, initial=step, disable=not progress, desc=f"train {model_cfg.attn_norm}", dynamic_ncols=True)
    model.train()
    try:
        while step < total:
            if train_cfg.schedule == "cosine":  # a pure function of the step: nothing to save for resume
                for g in opt.param_groups:
                    g["lr"] = cosine_lr(step, total, train_cfg.lr, train_cfg.warmup_frac, train_cfg.min_lr)
            tokens, offsets = batch_for_step(task, train_cfg.seed, step, train_cfg.batch_size, max_off)
            tokens, offsets = tokens.to(device), offsets.to(device)
            logits, loss = training_loss(model, tokens, offsets if max_off else None)
            loss_value = float(loss.detach())
            if not math.isfinite(loss_value):
                raise diverged("loss", loss_value)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grads = [p.grad for p in params if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads)
            gn = float(grad_norm)
            if not math.isfinite(gn):
                raise diverged("gradient norm", gn)
            if train_cfg.grad_clip is not None:
                torch.nn.utils.clip_grads_with_norm_(params, train_cfg.grad_clip, grad_norm)
            opt.step()
            with torch.no_grad():
                targets = next_token_targets(tokens)
                mask = targets != -100
                correct = int(((logits.argmax(-1) == targets) & mask).sum())
                n_tok = int(mask.sum())
            window.add(loss_value, correct, n_tok, gn)
            epoch_acc.add(loss_value, correct, n_tok, gn)
            step += 1
            bar.update(1)

            if step % train_cfg.steps_per_epoch == 0 and train_cfg.schedule == "plateau":
                sched.step(epoch_acc.loss / epoch_acc.n)
                epoch_acc = _Accumulator()
            is_eval = step % train_cfg.eval_every == 0 or step == total
            if step % train_cfg.log_every == 0 or is_eval:
                row = dict(
                    step=step,
                    epoch=step / train_cfg.steps_per_epoch,
                    examples=step * train_cfg.batch_size,
                    lr=opt.param_groups[0]["lr"],
                    loss=window.loss / window.n,
                    acc=window.correct / max(window.total, 1.0),
                    grad_norm=window.grad_norm / window.n,
                )
                window = _Accumulator()
                if is_eval:
                    model.eval()
                    for split, eval_tokens in eval_sets.items():
                        c = token_correct_counts(model, eval_tokens)
                        row[f"eval_{split}_acc"] = c["correct"] / c["total"]
                    model.train()
                    last_eval = {"step": step, "evaluation": [
                        {"split": s, "per_token_acc": row[f"eval_{s}_acc"], "n": train_cfg.eval_size} for s in train_cfg.eval_splits
                    ]}
                rows.append(row)
                bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['acc']:.3f}", lr=f"{row['lr']:.2g}")
            if step % train_cfg.checkpoint_every == 0 and step < total:
                save(last_eval)
    finally:
        bar.close()

    model.eval()
    final = evaluate(model, task, splits=train_cfg.eval_splits, size=train_cfg.final_eval_size, seed=train_cfg.eval_seed)
    save({"step": step, "final": True, "evaluation": final.to_dict("records")})
    return model, curve()


__all__ = ["TrainConfig", "PlateauHalving", "train", "batch_for_step", "resolve_device", "training_loss", "RESUMABLE_CHANGES"]
