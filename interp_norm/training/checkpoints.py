"""Checkpoints: one folder per checkpoint, written atomically, read without unpickling.

The folder format (file names, the sha256 manifest, how each file is read and checked) is
:mod:`interp_norm.training.checkpoint_format`; this module writes folders and loads models from them.

Atomic writes: every file is written through :mod:`interp_norm.training.io` (mode 0644, like any file the
package writes) into a hidden temporary folder next to the target (``.<name>.tmp-*``), fsynced, and
the folder is moved into place with one ``os.replace``. A process killed
at any moment leaves either the old checkpoint or the new one, plus perhaps a hidden temporary
folder that is never mistaken for a checkpoint (it is hidden and has no ``config.json`` until
complete; :func:`clean_temporary` removes it).

A training *run* folder holds several step checkpoints and a ``LATEST`` file naming the newest
complete one (``step-00001000``); ``LATEST`` is itself replaced atomically, so it is the commit
point. Loading accepts a checkpoint folder or a run folder; shipped checkpoints are looked up by
name (:func:`list_pretrained`). The one public loader is ``interp_norm.load`` /
``interp_norm.load_with_info`` (:mod:`interp_norm.anatomy.loading`); ``_load_ours`` here is its
checkpoint half.

Layering: this module imports the run options (:class:`interp_norm.training.config.TrainConfig`) but
not the trainer; :mod:`interp_norm.training.train` imports this module.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pandas as pd
import torch

from interp_norm.training.checkpoint_format import (
    CONFIG, CURVE, FORMAT_VERSION, LATEST, METRICS, STEP_RE, TRAIN_STATE, WEIGHTS, folder_kind, hf_folder_message,
    manifest_entry, read_config, read_curve, read_metrics, read_train_state, read_weights, verify_file,
)
from interp_norm.errors import CheckpointError, CheckpointNotFoundError, ConfigError, OutputDirError
from interp_norm.training.io import ensure_writable_dir, fsync_dir, fsync_file, write_atomic, write_csv, write_json, write_text_atomic
from interp_norm.core.model import HookedNormTransformer, ModelConfig
from interp_norm.core.task import AdditionTask
from interp_norm.training.config import TrainConfig

DATA_ENV = "INTERP_NORM_DATA"


@dataclass
class CheckpointInfo:
    """What a checkpoint says about itself, besides the weights."""

    path: Path
    model_cfg: ModelConfig
    task: AdditionTask
    train_cfg: Optional[TrainConfig] = None  # None if not saved
    step: Optional[int] = None
    metrics: dict = field(default_factory=dict)
    curve: pd.DataFrame = field(default_factory=pd.DataFrame)
    config: dict = field(default_factory=dict)  # the raw config.json

    @property
    def has_train_state(self) -> bool:
        return (self.path / TRAIN_STATE).is_file()


# ----------------------------------------------------------------------------- writing


def save_checkpoint(
    model: HookedNormTransformer,
    path: str | os.PathLike,
    *,
    task: AdditionTask,
    train_cfg: Any = None,
    train_state: Optional[dict] = None,
    metrics: Optional[dict] = None,
    curve: Optional[pd.DataFrame] = None,
    step: Optional[int] = None,
) -> Path:
    """Write a checkpoint folder at ``path`` atomically (replacing an existing checkpoint there).

    ``train_cfg`` is a :class:`~interp_norm.training.config.TrainConfig` (or a dict); ``train_state`` a dict of
    tensors and plain containers (see :func:`load_train_state`). Returns the folder.
    """
    from safetensors.torch import save_file

    if not isinstance(model, HookedNormTransformer):
        raise CheckpointError(f"save_checkpoint needs a HookedNormTransformer, got {type(model).__name__}")
    if not isinstance(task, AdditionTask):
        raise CheckpointError(f"save_checkpoint needs task=AdditionTask(...), got {type(task).__name__}")
    path = Path(path)
    if path.exists() and not (path / CONFIG).is_file():
        raise OutputDirError(
            f"{str(path)!r} exists and is not a checkpoint; refusing to replace it. Choose a new folder"
        )
    parent = ensure_writable_dir(path.parent)
    tmp = parent / f".{path.name}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        tmp.mkdir()  # unlike mkdtemp, honours the umask (shipped checkpoints must be readable)
        state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
        write_atomic(tmp / WEIGHTS, lambda p: save_file(state, str(p)))  # io sets 0644 (safetensors: 0600)
        if train_state is not None:
            write_atomic(tmp / TRAIN_STATE, lambda p: torch.save(train_state, p))
        if curve is not None:
            write_csv(tmp / CURVE, curve)
        if metrics is not None:
            write_json(tmp / METRICS, metrics)
        files = {}
        for name in (WEIGHTS, TRAIN_STATE, CURVE, METRICS):
            f = tmp / name
            if f.exists():
                fsync_file(f)
                files[name] = manifest_entry(f)
        if train_cfg is not None and hasattr(train_cfg, "to_dict"):
            train_cfg = train_cfg.to_dict()
        config = {
            "format_version": FORMAT_VERSION,
            "model": model.cfg.to_dict(),
            "task": task.to_dict(),
            "train": train_cfg,
            "step": step,
            "files": files,
            "torch_version": torch.__version__,
        }
        write_json(tmp / CONFIG, config, durable=True)  # written last: no config.json, no checkpoint
        fsync_dir(tmp)
        if path.exists():
            # No portable atomic swap of folders: move the old one aside first. A kill between the
            # two renames leaves the old checkpoint intact under the hidden .old name.
            old = parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def clean_temporary(folder: str | os.PathLike) -> list[Path]:
    """Remove hidden temporary files/folders a killed writer left in ``folder``; returns them."""
    folder = Path(folder)
    removed = []
    if not folder.is_dir():
        return removed
    for p in folder.iterdir():
        if p.name.startswith(".") and any(t in p.name for t in (".tmp-", ".old-", ".write-test-")):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed


# ----------------------------------------------------------------------------- run folders


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def commit_run_checkpoint(run_dir: str | os.PathLike, step: int, keep_last: int = 1, **save_kwargs: Any) -> Path:
    """Save ``run_dir/step-XXXXXXXX`` then point ``run_dir/LATEST`` at it; prune older steps.

    ``LATEST`` is the commit point: a kill before it is rewritten leaves the previous checkpoint
    current. Older step folders beyond ``keep_last`` are removed only after the commit.
    """
    run_dir = Path(run_dir)
    ckpt = save_checkpoint(path=run_dir / step_dir_name(step), step=step, **save_kwargs)
    write_text_atomic(run_dir / LATEST, ckpt.name + "\n", durable=True)
    steps = sorted(
        (int(m.group(1)), p) for p in run_dir.iterdir() if p.is_dir() and (m := STEP_RE.match(p.name))
    )
    for _step, p in steps[: max(0, len(steps) - max(1, keep_last))]:
        if p != ckpt:
            shutil.rmtree(p, ignore_errors=True)
    return ckpt


def latest_checkpoint(run_dir: str | os.PathLike) -> Optional[Path]:
    """The checkpoint ``run_dir/LATEST`` names, or None if the run has none yet."""
    run_dir = Path(run_dir)
    pointer = run_dir / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    if not STEP_RE.match(name):
        raise CheckpointError(f"{pointer} should name a step folder like 'step-00001000', but holds {name!r}")
    ckpt = run_dir / name
    if not (ckpt / CONFIG).is_file():
        raise CheckpointError(f"{pointer} names {name!r}, but {ckpt} is missing or incomplete; the run folder is damaged")
    return ckpt


def _recover_interrupted_swap(path: Path) -> None:
    """If a writer was killed between moving ``path`` aside and moving its successor in, move it back."""
    if not path.parent.is_dir():
        return
    olds = [p for p in path.parent.glob(f".{path.name}.old-*") if (p / CONFIG).is_file()]
    if olds:
        try:
            os.replace(max(olds, key=lambda p: p.stat().st_mtime), path)
        except OSError:
            pass


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint folder itself, or the newest checkpoint of a run folder."""
    path = Path(path)
    if not path.exists():
        _recover_interrupted_swap(path)
    if not path.exists():
        raise CheckpointNotFoundError(
            f"no checkpoint at {str(path)!r}: the folder does not exist. Pass a checkpoint folder, a "
            "training run folder (--out of 'interp-norm train') or a pretrained name (see 'interp-norm list')"
        )
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{str(path)!r} is a file; a checkpoint is a folder holding {CONFIG} and {WEIGHTS}")
    if (path / CONFIG).is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is not None:
        return latest
    present = sorted(p.name for p in path.iterdir())[:8]
    if (path / WEIGHTS).is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} has {WEIGHTS} but no {CONFIG}; it is incomplete (an interrupted write?)")
    raise CheckpointNotFoundError(
        f"{str(path)!r} is not a checkpoint: it has no {CONFIG} and no {LATEST} file (it holds {present})"
    )


# ----------------------------------------------------------------------------- reading


def _train_cfg_from(d: Any, ckpt: Path) -> Optional[TrainConfig]:
    if d is None:
        return None
    try:
        return TrainConfig.from_dict(d)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{ckpt / CONFIG} has an invalid 'train' section: {e}") from None


def read_checkpoint_info(path: str | os.PathLike, verify: bool = True) -> CheckpointInfo:
    """Everything but the weights (cheap: no model is built)."""
    ckpt = resolve_checkpoint(path)
    config = read_config(ckpt)
    try:
        model_cfg = ModelConfig.from_dict(config["model"])
        task = AdditionTask.from_dict(config["task"])
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{ckpt / CONFIG} describes an invalid model or task: {e}") from None
    metrics: dict = {}
    if (ckpt / METRICS).is_file():
        if verify:
            verify_file(ckpt, config, METRICS)
        metrics = read_metrics(ckpt)
    curve = pd.DataFrame()
    if (ckpt / CURVE).is_file():
        if verify:
            verify_file(ckpt, config, CURVE)
        curve = read_curve(ckpt)
    return CheckpointInfo(
        path=ckpt,
        model_cfg=model_cfg,
        task=task,
        train_cfg=_train_cfg_from(config.get("train"), ckpt),
        step=config.get("step"),
        metrics=metrics,
        curve=curve,
        config=config,
    )


def _load_checkpoint(
    path: str | os.PathLike, device: str | torch.device = "cpu", verify: bool = True
) -> tuple[HookedNormTransformer, CheckpointInfo]:
    """Load ``(model, info)`` from a checkpoint or run folder; the model is in eval mode and carries
    the task it was trained on (``model.task``, which analyses default to) and ``model.name``.

    ``verify`` checks every file read against config.json's sha256 (catches corruption that
    safetensors' header check cannot). Raises :class:`CheckpointNotFoundError` /
    :class:`CheckpointError` naming the problem; a ``device`` that is not there, a ConfigError.
    """
    from interp_norm.training.devices import resolve_device

    resolve_device(device)
    info = read_checkpoint_info(path, verify=verify)
    ckpt = info.path
    if verify:
        verify_file(ckpt, info.config, WEIGHTS)
    elif not (ckpt / WEIGHTS).is_file():
        raise CheckpointError(f"checkpoint {str(ckpt)!r} lacks {WEIGHTS}; it is incomplete")
    model = HookedNormTransformer(info.model_cfg, task=info.task, name=str(path))
    cfg = info.model_cfg
    describe = f"attn_norm={cfg.attn_norm!r}, n_layers={cfg.n_layers}, d_model={cfg.d_model}"
    model.load_state_dict(read_weights(ckpt, model.state_dict(), describe))
    return model.to(device).eval(), info


def load_train_state(path: str | os.PathLike, verify: bool = True) -> dict:
    """The resumable training state, loaded with ``weights_only=True`` (never arbitrary pickles)."""
    ckpt = resolve_checkpoint(path)
    config = read_config(ckpt)
    if not (ckpt / TRAIN_STATE).is_file():
        raise CheckpointError(f"checkpoint {str(ckpt)!r} has no {TRAIN_STATE}, so training cannot resume from it")
    if verify:
        verify_file(ckpt, config, TRAIN_STATE)
    return read_train_state(ckpt)


def export_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, include_train_state: bool = False) -> Path:
    """Copy a checkpoint (or a run's newest) to ``dst``, by default without the optimizer state.

    For shipping: ``export_checkpoint("runs/pre", "data/checkpoints/pre")`` keeps weights, config,
    curve and metrics; ``train_state.pt`` (≈2× the weights) is only needed to resume.
    """
    model, info = _load_checkpoint(src)
    return save_checkpoint(
        model, dst, task=info.task, train_cfg=info.train_cfg, step=info.step, metrics=info.metrics or None,
        curve=info.curve if len(info.curve) else None,
        train_state=load_train_state(info.path) if include_train_state and info.has_train_state else None,
    )


# ----------------------------------------------------------------------------- pretrained


def data_dir() -> Path:
    """The data folder: ``$INTERP_NORM_DATA`` if set, else the repository's ``data/``."""
    env = os.environ.get(DATA_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[2] / "data"


def pretrained_dir() -> Path:
    return data_dir() / "checkpoints"


def pretrained_names() -> list[str]:
    """The shipped checkpoints' names (folders under :func:`pretrained_dir`)."""
    root = pretrained_dir()
    if not root.is_dir():
        return []
    return sorted(
        p.name for p in root.iterdir()
        if p.is_dir() and not p.name.startswith(".") and ((p / CONFIG).is_file() or (p / LATEST).is_file())
    )


_ANY_MODEL = "interp_norm.load(spec) loads any model (ours, a Hugging Face folder or a cached Hugging Face name)"


def looks_like_path(spec: str | os.PathLike) -> bool:
    """CKPT arguments that exist, contain a path separator or start with '.' are folders, not names."""
    text = str(spec)
    return Path(text).exists() or any(sep in text for sep in "/\\") or text.startswith(".")


def not_ours_message(spec: str | os.PathLike) -> str:
    """Why ``spec`` is none of our models: neither a checkpoint folder nor a shipped name (which are listed)."""
    names = pretrained_names()
    return (f"{str(spec)!r} is neither a checkpoint folder nor a pretrained name "
            f"(available: {', '.join(names) if names else 'none'}); see 'interp-norm list'")


def _load_ours(spec: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[HookedNormTransformer, CheckpointInfo]:
    """``(model, info)`` of one of our models: a checkpoint or run folder if ``spec`` looks like a path,
    else a shipped name (``"pre"``, ``"qkv"``...; the model is then named after it).

    The checkpoint half of :func:`interp_norm.load`; a Hugging Face folder gets a
    :class:`CheckpointError` pointing to ``interp_norm.load``.
    """
    if isinstance(spec, os.PathLike) or looks_like_path(spec):
        path = Path(spec)
        if path.is_dir() and folder_kind(path) == "hf":
            raise CheckpointError(hf_folder_message(path))
        return _load_checkpoint(path, device=device)
    names = pretrained_names()
    if not isinstance(spec, str) or spec not in names:
        avail = ", ".join(names) if names else f"none (no checkpoints under {pretrained_dir()}; set {DATA_ENV} to the data folder)"
        raise CheckpointNotFoundError(f"no pretrained checkpoint named {spec!r}; available: {avail}. {_ANY_MODEL}")
    model, info = _load_checkpoint(pretrained_dir() / spec, device=device)
    model.name = spec
    return model, info


def list_pretrained() -> pd.DataFrame:
    """One row per shipped checkpoint: name, architecture (with its calibration), seed, step, set and per-token accuracies."""
    rows = []
    for name in pretrained_names():
        try:
            info = read_checkpoint_info(pretrained_dir() / name, verify=False)
        except CheckpointError as e:
            rows.append({"name": name, "error": str(e)})
            continue
        cfg = info.model_cfg
        row = {
            "name": name,
            "attn_norm": cfg.attn_norm,
            "norm_kind": cfg.norm_kind,
            "calibration": cfg.calibration,  # pre and pre-cal differ only here
            "n_layers": cfg.n_layers,
            "d_model": cfg.d_model,
            "seed": cfg.seed,
            "step": info.step,
            # "reference": the set `interp-norm reproduce` analyses by default; other sets (e.g. the
            # Pre-Norm seeds trained three times as long) load by name and are analysed on request
            "set": info.metrics.get("set", "reference"),
        }
        for rec in info.metrics.get("evaluation", []):
            if "split" in rec and "per_token_acc" in rec:
                row[f"{rec['split']}_acc"] = rec["per_token_acc"]
        row["path"] = str(info.path)
        rows.append(row)
    cols = ["name", "attn_norm", "norm_kind", "calibration", "n_layers", "d_model", "seed", "step", "set", "id_acc",
            "interp_acc", "extrap_acc", "path"]
    df = pd.DataFrame(rows)
    return df.reindex(columns=cols + [c for c in df.columns if c not in cols])


__all__ = [
    "CheckpointInfo",
    "save_checkpoint",
    "export_checkpoint",
    "load_train_state",
    "read_checkpoint_info",
    "commit_run_checkpoint",
    "latest_checkpoint",
    "resolve_checkpoint",
    "clean_temporary",
    "list_pretrained",
    "data_dir",
    "pretrained_dir",
    "FORMAT_VERSION",
]
