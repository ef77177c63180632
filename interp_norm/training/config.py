"""What a training run is: its options (:class:`TrainConfig`, presets) and its LR schedules.

Kept apart from the loop (:mod:`interp_norm.training.train`) so that :mod:`interp_norm.training.checkpoints` can
read a saved run's options without importing the trainer: checkpoints sit below the trainer.

Two schedules: ``"plateau"`` (the paper's Keras ``ReduceLROnPlateau``, :class:`PlateauHalving`)
and ``"cosine"`` (linear warm-up then cosine decay, :func:`cosine_lr`). The cosine schedule is a
pure function of the step and of the run's *schedule length*, fixed when the run starts; see
:class:`TrainConfig` for what extending a run on resume means.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from interp_norm.errors import ConfigError, check_positive_int


@dataclass
class TrainConfig:
    """Optimisation, schedule, evaluation and checkpointing of one run.

    ``grad_clip``: global gradient-norm clip; ``None`` (default, as the paper's Keras setup) means
    no clipping. The gradient norm is logged either way. ``max_steps`` overrides
    ``n_epochs * steps_per_epoch`` (useful for short runs; the LR schedule still counts epochs of
    ``steps_per_epoch``). ``seed`` seeds the data stream only; the model's init seed is
    ``ModelConfig.seed`` (the CLI sets both from ``--seed``).

    ``threads``: CPU threads torch uses during the run (restored afterwards). The default 1 makes
    training bit-for-bit deterministic whatever ``OMP_NUM_THREADS`` says — a different thread
    count changes the summation order of the kernels, hence the bits — and at these model sizes
    one thread is also the fastest (3× faster than two for the ``cpu`` preset). ``None`` keeps
    torch's current setting. The count used is recorded in the checkpoint, and resuming with
    another count is refused (the continuation would not match an uninterrupted run).

    Extending a run on resume (a larger ``max_steps``/``n_epochs`` than the run started with)
    continues *the same run*: the data stream and, with ``"plateau"``, the LR schedule go on
    exactly as in a run started with the larger total. The ``"cosine"`` schedule is fixed when
    the run starts (its length is recorded in the checkpoint): extending continues the already
    decayed schedule, so the extra steps run at ``min_lr``; the learning rate never jumps back
    up. (With the default ``min_lr=0`` such extra steps leave the weights unchanged, and
    training warns; to train a cosine run longer, start it with the longer total, or with a
    ``min_lr > 0`` if you may extend it.) Shortening a cosine run stops it early on the same
    schedule.
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
    threads: Optional[int] = 1  # torch CPU threads for the run; None = leave torch's setting

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
            check_positive_int(v, name)

        for name in ("batch_size", "steps_per_epoch", "n_epochs", "log_every", "eval_every", "eval_size",
                     "final_eval_size", "checkpoint_every", "keep_checkpoints", "lr_patience"):
            pos_int(name)
        pos_int("max_steps", allow_none=True)
        pos_int("threads", allow_none=True)
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


# Fields that may differ between a run and its resumption without changing the weights. (``threads``
# is not among them: the trainer checks the thread count the run actually used, see train.py.)
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
    """Linear warm-up to ``peak`` over ``warmup_frac`` of ``total`` steps, then cosine decay to ``floor``.

    Steps at or beyond ``total`` get ``floor``: a run extended past its schedule's length stays
    at the final learning rate.
    """
    warm = max(1, int(round(warmup_frac * total)))
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * min(t, 1.0)))


__all__ = ["TrainConfig", "RESUMABLE_CHANGES", "PlateauHalving", "cosine_lr"]
