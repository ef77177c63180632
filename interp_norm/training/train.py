"""The training loop: the paper's recipe, resumable bit-for-bit after a kill or a Ctrl-C.

Recipe (Menary et al. 2024, arXiv 2406.17837, experimental set-up): AdamW (lr 3e-4, weight decay 0.01, other settings the
Keras 2.15 defaults: betas 0.9/0.999, eps 1e-7, no gradient clipping, decay on every weight),
epochs of 2000 batches of 128 generated on the fly, and the learning rate halved when the epoch's
mean training loss has not improved for 3 consecutive epochs (Keras ``ReduceLROnPlateau``
semantics: improvement means lower by more than ``lr_min_delta``; see :class:`PlateauHalving`).
The options and the LR schedules live in :mod:`interp_norm.training.config` ; checkpoint folders in :mod:`interp_norm.training.checkpoints`.

Data stream: the batch and the position offsets of step ``s`` come from
``random.Random(f"interp_norm-train:{seed}:{s}")``, a pure function of (seed, step). So the data
sampler has no state to save beyond the step counter, and a resumed run sees exactly the batches
an uninterrupted one would. Together with the saved model, AdamW moments, LR schedule, loss
accumulators and torch RNG state, a run killed at any moment and resumed with ``resume=True``
ends with weights bit-identical to an uninterrupted run. That holds on CPU for a fixed thread
count, which is why the run fixes it (``TrainConfig.threads``, 1 by default) and records it;
CUDA kernels are not guaranteed deterministic.

Ctrl-C (``KeyboardInterrupt``) saves a checkpoint of the last completed step before it
propagates; a Ctrl-C that arrives while a step updates the weights is held back until the update
is complete, so the checkpoint is always a step boundary.

Run folder layout: ``out_dir/step-XXXXXXXX/`` checkpoints and ``out_dir/LATEST`` (see
:mod:`interp_norm.training.checkpoints`); ``interp_norm.load(out_dir)`` loads the newest.
"""

from __future__ import annotations

import contextlib
import math
import random
import signal
import threading
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional

import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from interp_norm.training import checkpoints as C
from interp_norm.training import distributed
from interp_norm.training.devices import resolve_device
from interp_norm.errors import CheckpointError, ConfigError, OutputDirError, TrainingDivergedError
from interp_norm.core.scoring import count_correct, evaluate, token_correct_counts
from interp_norm.core.model import HookedNormTransformer, ModelConfig
from interp_norm.core.task import AdditionTask
from interp_norm.training.config import RESUMABLE_CHANGES, PlateauHalving, TrainConfig, cosine_lr

TRAIN_STATE_VERSION = 1  # train_state.pt keys added later ("threads", "schedule_total_steps") are optional


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


def _check_resume_compatible(saved: C.CheckpointInfo, model_cfg: ModelConfig, task: AdditionTask, train_cfg: TrainConfig) -> None:
    if saved.model_cfg.to_dict() != model_cfg.to_dict():
        diff = {k: (v, model_cfg.to_dict().get(k)) for k, v in saved.model_cfg.to_dict().items() if model_cfg.to_dict().get(k) != v}
        raise ConfigError(f"cannot resume {saved.path}: its model config differs (saved vs now: {diff}); use the same model options or a new --out")
    if saved.task.to_dict() != task.to_dict():
        raise ConfigError(f"cannot resume {saved.path}: it was trained on task {saved.task.to_dict()}, not {task.to_dict()}; use a new --out")
    if saved.train_cfg is None:
        raise CheckpointError(f"cannot resume {saved.path}: it has no training config")
    # Only the keys the checkpoint saved are compared (older checkpoints lack newer fields). The
    # thread count is compared separately, as the count actually used (see _check_threads).
    a, b = saved.train_cfg.to_dict(), train_cfg.to_dict()
    diff = {k: (a[k], b[k]) for k in a if a[k] != b.get(k) and k not in RESUMABLE_CHANGES and k != "threads"}
    if diff:
        raise ConfigError(
            f"cannot resume {saved.path}: training options changed (saved vs now: {diff}); resuming must use the "
            f"same options (only {', '.join(RESUMABLE_CHANGES)} may change) or train into a new --out"
        )


def _check_threads(state: dict, threads: int, path: Path) -> None:
    """Refuse to resume with another CPU thread count (the bits would differ); warn if unknown."""
    saved = state.get("threads")
    if saved is None:  # written before the count was recorded
        warnings.warn(
            f"{path} does not record the CPU thread count it was trained with; resuming with {threads}. The "
            f"result matches an uninterrupted run bit-for-bit only if that run used {threads} thread(s) too",
            stacklevel=4,
        )
    elif int(saved) != threads:
        raise ConfigError(
            f"cannot resume {path}: it was trained with {int(saved)} CPU thread(s) and would continue with {threads}, "
            f"which changes the result of every later step; resume with threads={int(saved)} "
            "or train into a new --out"
        )


def extension_message(train_cfg: TrainConfig, schedule_total: int, total: int) -> str:
    """What resuming with ``total`` steps does to a run whose schedule was planned for ``schedule_total``."""
    if train_cfg.schedule != "cosine":
        return (f"extending this run from {schedule_total} to {total} steps: the plateau schedule has no planned "
                f"length, so this continues exactly as a run started with max_steps={total} would")
    head = (f"extending this run from {schedule_total} to {total} steps: its cosine schedule keeps the length it "
            f"started with ({schedule_total} steps), so steps {schedule_total}-{total}")
    if train_cfg.min_lr == 0:
        return (f"{head} continue the decayed schedule where it ended: they run at min_lr=0 and will not change "
                "the weights (no restart, no new warm-up). To train longer, start a new run with the longer total "
                "(or with min_lr > 0 if you may extend it)")
    return (f"{head} continue the decayed schedule at min_lr={train_cfg.min_lr:g} (no restart, no new warm-up). "
            f"For a full cosine schedule over {total} steps, start a new run with that total")


def curve_from(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame(rows)


class _Accumulator:
    """Running sums of per-step loss/accuracy; plain floats so they resume exactly."""

    def __init__(self) -> None:
        self.loss = self.correct = self.total = self.grad_norm = 0.0
        self.n = 0

    def add(self, loss: float, correct: float, total: float, grad_norm: float) -> None:
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


class _HeldInterrupts:
    """Holds back Ctrl-C while a step changes the training state (``with guard.hold(): ...``).

    A SIGINT inside ``hold()`` is remembered and raised as ``KeyboardInterrupt`` when the block
    ends, so the trainer only ever sees one at a step boundary. Active only in the main thread
    and while SIGINT has Python's default handler (otherwise a Ctrl-C is raised where it lands).
    """

    def __init__(self) -> None:
        self.holding = self.pending = False
        self._previous: Any = None

    def __enter__(self) -> "_HeldInterrupts":
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _on_sigint(self, signum: int, frame: object) -> None:
        if not self.holding:
            raise KeyboardInterrupt
        self.pending = True

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt


# ----------------------------------------------------------------------------- training


def train(
    model_cfg: ModelConfig,
    task: AdditionTask,
    train_cfg: TrainConfig,
    out_dir: str | Path,
    resume: bool = False,
    progress: bool = True,
) -> tuple[HookedNormTransformer, pd.DataFrame]:
    """Train a model, checkpointing into ``out_dir``; returns ``(model in eval mode, curve)``; the model
    carries ``task`` (``model.task``), which analyses of it default to.

    The curve has one row per ``log_every`` steps: ``step, epoch, examples, lr, loss, acc,
    grad_norm`` (means since the previous row) and ``eval_<split>_acc`` on eval rows.
    ``resume=True`` continues from ``out_dir``'s newest checkpoint (or starts fresh if it has
    none); ``resume=False`` refuses an ``out_dir`` that already holds a run.

    Torch runs with ``train_cfg.threads`` CPU threads (restored on return); resuming with another
    count than the run used raises :class:`ConfigError`. Resuming with a larger total extends the
    run: the cosine schedule keeps the length it started with, so the extra steps run at
    ``min_lr`` (see :class:`TrainConfig`); a ``UserWarning`` says so when the extension starts. Ctrl-C saves a checkpoint of the last completed step,
    then re-raises ``KeyboardInterrupt``. Raises :class:`TrainingDivergedError` on a NaN/inf loss
    or gradient, leaving the last good checkpoint untouched.
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
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(train_cfg.threads or previous_threads)
    dist, device = distributed.setup(train_cfg.device)  # one process, or this rank's under torchrun
    try:
        return _train(model_cfg, task, train_cfg, Path(out_dir), resume, progress and dist.main, dist=dist, device=device)
    finally:
        dist.close()
        torch.set_num_threads(previous_threads)


def _train(
    model_cfg: ModelConfig, task: AdditionTask, train_cfg: TrainConfig, out_dir: Path, resume: bool, progress: bool,
    *, dist: distributed.Dist, device: torch.device,
) -> tuple[HookedNormTransformer, pd.DataFrame]:
    out_dir = C.ensure_writable_dir(out_dir)
    saved_path = C.latest_checkpoint(out_dir)
    if not resume and (saved_path is not None or any(out_dir.glob("step-*"))):
        raise OutputDirError(
            f"{str(out_dir)!r} already holds a training run; pass resume=True (--resume) to continue it, "
            "or choose another output folder"
        )
    if dist.main:
        C.clean_temporary(out_dir)  # what a killed writer left behind
    dist.barrier()

    run = _Run(model_cfg, task, train_cfg, out_dir, dist=dist, device=device)
    if resume and saved_path is not None and run.resume_from(saved_path):
        return run.model.eval(), run.curve()  # a finished run: nothing to do
    if run.total > run.schedule_total:  # extending the run: say what that means for the learning rate
        warnings.warn(extension_message(train_cfg, run.schedule_total, run.total), stacklevel=3)
    max_off = model_cfg.max_pos_offset if (train_cfg.pos_offsets and model_cfg.pos_embed == "sinusoidal") else 0
    run.params = [p for p in run.model.parameters() if p.requires_grad]
    eval_sets = {s: task.test_set(s, size=train_cfg.eval_size, seed=train_cfg.eval_seed).tokens for s in train_cfg.eval_splits}
    if not run.model.is_calibrated:  # the paper's Checkpoint layers: fitted once, on the first training batch
        tokens, offsets = batch_for_step(task, train_cfg.seed, 0, train_cfg.batch_size, max_off)
        run.model.calibrate(tokens.to(device), offsets.to(device) if max_off else None)
    return run.loop(max_off, eval_sets if dist.main else {}, progress)


class _Run:
    """One training run: the state a checkpoint saves (model, AdamW, schedule, accumulators, curve,
    step) and the steps that change it.

    A step first computes (forward, backward: only the RNG may move, and it is restored on an
    interrupt), then updates under ``guard.hold()`` (weights, moments, schedule, counters, curve).
    """

    def __init__(self, model_cfg: ModelConfig, task: AdditionTask, train_cfg: TrainConfig, out_dir: Path,
                 *, dist: distributed.Dist, device: torch.device):
        self.model_cfg, self.task, self.cfg, self.out_dir = model_cfg, task, train_cfg, out_dir
        self.dist, self.device = dist, device
        self.threads = torch.get_num_threads()
        self.model = HookedNormTransformer(model_cfg, task=task, name=str(out_dir)).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=train_cfg.lr, betas=train_cfg.betas,
                                     eps=train_cfg.adam_eps, weight_decay=train_cfg.weight_decay)
        self.sched = PlateauHalving(self.opt, train_cfg.lr_factor, train_cfg.lr_patience, train_cfg.lr_min_delta,
                                    train_cfg.min_lr)
        self.window, self.epoch_acc = _Accumulator(), _Accumulator()
        self.rows: list[dict] = []
        self.step = self.saved_step = 0
        self.last_eval: dict = {}
        self.total = train_cfg.total_steps
        self.schedule_total = self.total  # the cosine schedule's length, fixed when the run starts
        self.params: list = []
        self.step_start_rng: Optional[dict] = None
        self.updating = False  # True only if an interrupt could not be held back (guard inactive): state half-updated

    def resume_from(self, saved_path: Path) -> bool:
        """Load the state saved at ``saved_path``; True if that run had already finished."""
        saved_model, info = C._load_checkpoint(saved_path)
        _check_resume_compatible(info, self.model_cfg, self.task, self.cfg)
        state = C.load_train_state(saved_path)
        if state.get("version") != TRAIN_STATE_VERSION:
            raise CheckpointError(f"{saved_path}/train_state.pt has version {state.get('version')!r}; expected {TRAIN_STATE_VERSION}")
        _check_threads(state, self.threads, saved_path)
        self.model.load_state_dict(saved_model.state_dict())
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.window.load_state_dict(state["window"])
        self.epoch_acc.load_state_dict(state["epoch"])
        self.step = self.saved_step = int(state["step"])
        # before this was recorded, the schedule's length was the saved run's total
        assert info.train_cfg is not None  # _check_resume_compatible refuses a checkpoint without one
        self.schedule_total = int(state.get("schedule_total_steps", info.train_cfg.total_steps))
        torch.set_rng_state(state["torch_rng"])
        if self.device.type == "cuda" and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state_all(list(state["cuda_rng"]))
        self.rows = info.curve.to_dict("records")
        self.last_eval = info.metrics
        del saved_model
        return bool(self.step >= self.total and info.step == self.step and info.metrics.get("final"))

    def rng_state(self) -> dict:
        return {"torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None}

    def train_state(self) -> dict:
        return {
            "version": TRAIN_STATE_VERSION,
            "step": self.step,
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "window": self.window.state_dict(),
            "epoch": self.epoch_acc.state_dict(),
            **self.rng_state(),
            "threads": self.threads,
            "schedule_total_steps": self.schedule_total,
            "data_stream": f"random.Random('interp_norm-train:{{seed}}:{{step}}'), seed={self.cfg.seed}",
        }

    def curve(self) -> pd.DataFrame:
        return curve_from(self.rows)

    def save(self, metrics: dict, sync: bool = True) -> None:
        bad = [n for n, p in self.model.named_parameters() if not torch.isfinite(p).all()]
        if bad:  # never let a non-finite model overwrite the last good checkpoint
            raise TrainingDivergedError(
                f"weights became non-finite by step {self.step} ({', '.join(bad[:3])}); the last good checkpoint in "
                f"{self.out_dir} is kept. Lower the learning rate (now {self.opt.param_groups[0]['lr']:.3g}) or set grad_clip"
            )
        if self.dist.main:  # under torchrun rank 0 writes, the others wait for it
            C.commit_run_checkpoint(
                self.out_dir, self.step, keep_last=self.cfg.keep_checkpoints, model=self.model, task=self.task,
                train_cfg=self.cfg, train_state=self.train_state(), metrics=metrics, curve=self.curve(),
            )
        if sync:
            self.dist.barrier()
        self.saved_step = self.step

    def diverged(self, what: str, value: float) -> TrainingDivergedError:
        kept = C.latest_checkpoint(self.out_dir)
        where = f"the last good checkpoint {kept} is kept" if kept else "no checkpoint had been written yet"
        return TrainingDivergedError(
            f"training {what} became {value} at step {self.step + 1} (lr {self.opt.param_groups[0]['lr']:.3g}); {where}. "
            "Lower the learning rate or set grad_clip and train into a new folder"
        )

    def loop(self, max_off: int, eval_sets: dict, progress: bool) -> tuple[HookedNormTransformer, pd.DataFrame]:
        """Train up to ``total`` steps, evaluate, save the final checkpoint; a Ctrl-C saves the last completed step."""
        cfg, model = self.cfg, self.model
        net = self.dist.wrap(model, self.device)  # DistributedDataParallel under torchrun, else the model itself
        bar = tqdm(total=self.total, initial=self.step, disable=not progress, desc=f"train {self.model_cfg.attn_norm}",
                   dynamic_ncols=True)
        model.train()
        try:
            with _HeldInterrupts() as guard:
                while self.step < self.total:
                    self.one_step(net, guard, max_off, eval_sets, bar)
                model.eval()
                final = evaluate(model, self.task, splits=cfg.eval_splits, size=cfg.final_eval_size,
                                 seed=cfg.eval_seed) if self.dist.main else pd.DataFrame()
                self.save({"step": self.step, "final": True, "evaluation": final.to_dict("records")})
        except KeyboardInterrupt as interrupt:
            self.on_interrupt(interrupt)
            raise
        finally:
            bar.close()
        return model, self.curve()

    def one_step(self, net: torch.nn.Module, guard: _HeldInterrupts, max_off: int, eval_sets: dict, bar: tqdm) -> None:
        cfg = self.cfg
        self.step_start_rng = self.rng_state()
        loss_value, correct, n_tok, grad_norm = self.forward_backward(net, max_off)
        gn = float(grad_norm)
        with guard.hold():  # from here the step completes before an interrupt is raised
            self.updating, self.step_start_rng = True, None
            _update(self.step, self.schedule_total, self.opt, self.params, grad_norm, cfg)
            self.window.add(loss_value, correct, n_tok, gn)
            self.epoch_acc.add(loss_value, correct, n_tok, gn)
            self.step += 1
            bar.update(1)
            if self.step % cfg.steps_per_epoch == 0 and cfg.schedule == "plateau":
                self.sched.step(self.epoch_acc.loss / self.epoch_acc.n)
                self.epoch_acc = _Accumulator()
            if self.step % cfg.log_every == 0 or self.step % cfg.eval_every == 0 or self.step == self.total:
                row, self.last_eval = _log_row(self.step, self.total, self.opt, self.window, self.model, eval_sets,
                                               train_cfg=cfg, last_eval=self.last_eval)
                self.window = _Accumulator()
                self.rows.append(row)
                bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['acc']:.3f}", lr=f"{row['lr']:.2g}")
            self.updating = False
        if self.step % cfg.checkpoint_every == 0 and self.step < self.total:
            self.save(self.last_eval)

    def forward_backward(self, net: torch.nn.Module, max_off: int) -> tuple[float, float, float, Tensor]:
        """The step's loss, correct and scored tokens (the global batch's under torchrun) and gradient norm."""
        dist, device = self.dist, self.device
        tokens, offsets = batch_for_step(self.task, self.cfg.seed, self.step, self.cfg.batch_size, max_off)
        if dist.active:
            logits, loss, tokens = _shard_loss(net, tokens, offsets if max_off else None, dist, device)
        else:
            tokens, offsets = tokens.to(device), offsets.to(device)
            logits, loss = training_loss(self.model, tokens, offsets if max_off else None)
        correct: float
        n_tok: float
        with torch.no_grad():
            correct, n_tok = count_correct(logits, tokens)
        loss_value = float(loss.detach())
        if dist.active:  # the logged numbers are the global batch's
            loss_value, correct, n_tok = dist.all_sum([loss_value, correct, n_tok], device)
            loss_value /= dist.world
        if not math.isfinite(loss_value):
            raise self.diverged("loss", loss_value)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
        if not math.isfinite(float(grad_norm)):
            raise self.diverged("gradient norm", float(grad_norm))
        return loss_value, correct, n_tok, grad_norm

    def on_interrupt(self, interrupt: KeyboardInterrupt) -> None:
        """At a step boundary: back to the step's RNG state and save the last completed step (not at a
        boundary -- the guard was inactive -- the last periodic checkpoint is kept)."""
        if self.updating:
            return
        if self.step_start_rng is not None:  # interrupted mid-computation: back to the step's start
            torch.set_rng_state(self.step_start_rng["torch_rng"])
            if self.step_start_rng["cuda_rng"] is not None:
                torch.cuda.set_rng_state_all(self.step_start_rng["cuda_rng"])
        if self.step != self.saved_step:
            self.save(self.last_eval, sync=False)  # the other ranks may be interrupted elsewhere: no barrier
            add_note(interrupt, f"interp_norm: saved a checkpoint at step {self.step} in {self.out_dir}; "
                               "resume=True (--resume) continues")


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)`` where Python has it (3.11+); on 3.10 the note is dropped."""
    if hasattr(error, "add_note"):
        error.add_note(note)


def _shard_loss(net: torch.nn.Module, tokens: Tensor, offsets: Optional[Tensor], dist: distributed.Dist,
                device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(logits, loss, tokens) of this rank's share of the global batch ``tokens``: the sum of its answer-token
    losses over the global batch's count, times the world size, so DDP's gradient average is the gradient of
    the global batch's mean loss (:mod:`interp_norm.training.distributed`)."""
    from interp_norm.core.task import next_token_targets

    n_answer = distributed.answer_token_count(next_token_targets(tokens))
    tokens, offsets = dist.shard(tokens, offsets) if offsets is not None else (dist.shard(tokens)[0], None)
    tokens = tokens.to(device)
    logits, per_token = net(tokens, return_type="both", pos_offset=None if offsets is None else offsets.to(device),
                            loss_per_token=True)
    return logits, per_token.sum() * (dist.world / max(n_answer, 1)), tokens


def _update(step: int, schedule_total: int, opt: torch.optim.Optimizer, params: list, grad_norm: Tensor,
            train_cfg: TrainConfig) -> None:
    """Clip, set the cosine LR of ``step`` (a pure function of it: nothing to save), take the AdamW step."""
    if train_cfg.grad_clip is not None:
        torch.nn.utils.clip_grads_with_norm_(params, train_cfg.grad_clip, grad_norm)
    if train_cfg.schedule == "cosine":
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, schedule_total, train_cfg.lr, train_cfg.warmup_frac, train_cfg.min_lr)
    opt.step()


def _log_row(step: int, total: int, opt: torch.optim.Optimizer, window: _Accumulator, model: HookedNormTransformer,
             eval_sets: dict, *, train_cfg: TrainConfig, last_eval: dict) -> tuple[dict, dict]:
    """The curve row of ``step`` (means over the window; eval accuracies on eval steps) and the latest eval."""
    row = dict(
        step=step,
        epoch=step / train_cfg.steps_per_epoch,
        examples=step * train_cfg.batch_size,
        lr=opt.param_groups[0]["lr"],
        loss=window.loss / window.n,
        acc=window.correct / max(window.total, 1.0),
        grad_norm=window.grad_norm / window.n,
    )
    if (step % train_cfg.eval_every == 0 or step == total) and eval_sets:  # none on ranks > 0 under torchrun
        model.eval()
        for split, eval_tokens in eval_sets.items():
            c = token_correct_counts(model, eval_tokens)
            row[f"eval_{split}_acc"] = c["correct"] / c["total"]
        model.train()
        last_eval = {"step": step, "evaluation": [
            {"split": s, "per_token_acc": row[f"eval_{s}_acc"], "n": train_cfg.eval_size} for s in train_cfg.eval_splits
        ]}
    return row, last_eval


__all__ = ["TrainConfig", "PlateauHalving", "cosine_lr", "train", "batch_for_step", "resolve_device", "training_loss",
           "RESUMABLE_CHANGES"]
