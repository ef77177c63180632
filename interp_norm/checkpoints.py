"""Checkpoints: one folder per checkpoint, written atomically, read without unpickling.

A checkpoint folder holds::

    model.safetensors     weights (safetensors: no code can hide in it)
    config.json           {"format_version": 1, "model": ..., "task": ..., "train": ..., "step": ...,
                           "files": {name: {"bytes": n, "sha256": h}}}  -- written last
    training_curve.csv    one row per logged step (optional)
    metrics.json          the latest evaluation (optional)
    train_state.pt        optimizer / LR schedule / RNG / step, for resuming (optional; read with
                          ``torch.load(weights_only=True)`` only, so it can hold tensors and plain
                          containers but never arbitrary objects)

Why a checksum manifest: safetensors checks its header, not its data, so a flipped byte in the
middle of the weights would load silently. Every file a reader opens is checked against the
sha256 recorded in ``config.json``.

Atomic writes: everything goes into a hidden temporary folder next to the target
(``.<name>.tmp-*``), is fsynced, and is moved into place with one ``os.replace``. A process killed
at any moment leaves either the old checkpoint or the new one, plus perhaps a hidden temporary
folder that is never mistaken for a checkpoint (it is hidden and has no ``config.json`` until
complete; :func:`clean_temporary` removes it).

A training *run* folder holds several step checkpoints and a ``LATEST`` file naming the newest
complete one (``step-00001000``); ``LATEST`` is itself replaced atomically, so it is the commit
point. :func:`load_checkpoint` accepts a checkpoint folder or a run folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pandas as pd
import torch

from interp_norm.errors import CheckpointError, CheckpointNotFoundError, ConfigError, OutputDirError
from interp_norm.model import HookedNormTransformer, ModelConfig
from interp_norm.task import AdditionTask

FORMAT_VERSION = 1
WEIGHTS, CONFIG, CURVE, METRICS, TRAIN_STATE = (
    "model.safetensors", "config.json", "training_curve.csv", "metrics.json", "train_state.pt",
)
LATEST = "LATEST"
DATA_ENV = "INTERP_NORM_DATA"
_STEP_RE = re.compile(r"^step-(\d+)$")


@dataclass
class CheckpointInfo:
    """What a checkpoint says about itself, besides the weights."""

    path: Path
    model_cfg: ModelConfig
    task: AdditionTask
    train_cfg: Any = None  # interp_norm.train.TrainConfig, or None if not saved
    step: Optional[int] = None
    metrics: dict = field(default_factory=dict)
    curve: pd.DataFrame = field(default_factory=pd.DataFrame)
    config: dict = field(default_factory=dict)  # the raw config.json

    @property
    def has_train_state(self) -> bool:
        return (self.path / TRAIN_STATE).is_file()


# ----------------------------------------------------------------------------- writing


def ensure_writable_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` if needed and prove we can write in it; else :class:`OutputDirError`.

    Called before any expensive work so a bad ``--out`` fails in a second, not after training.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputDirError(f"output path {str(path)!r} exists and is a file, not a folder; choose another --out")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OutputDirError(
            f"cannot write to output folder {str(path)!r} ({e.strerror or e}); choose a writable --out"
        ) from None
    return path


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open folders; rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write a small text file so readers see the old or the new content, never a mix."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _json_default(x: Any) -> Any:
    if isinstance(x, (tuple, set)):
        return list(x)
    if hasattr(x, "item"):  # numpy / torch scalars
        return x.item()
    raise TypeError(f"cannot write {type(x).__name__} to JSON")


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

    ``train_cfg`` is a :class:`interp_norm.train.TrainConfig` (or a dict); ``train_state`` a dict of
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
        save_file(state, str(tmp / WEIGHTS))
        if train_state is not None:
            torch.save(train_state, tmp / TRAIN_STATE)
        if curve is not None:
            curve.to_csv(tmp / CURVE, index=False)
        if metrics is not None:
            (tmp / METRICS).write_text(json.dumps(metrics, indent=1, default=_json_default))
        files = {}
        for name in (WEIGHTS, TRAIN_STATE, CURVE, METRICS):
            f = tmp / name
            if f.exists():
                _fsync_file(f)
                files[name] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
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
        with open(tmp / CONFIG, "w") as f:  # written last: no config.json, no checkpoint
            json.dump(config, f, indent=1, default=_json_default)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if path.exists():
            # No portable atomic swap of folders: move the old one aside first. A kill between the
            # two renames leaves the old checkpoint intact under the hidden .old name.
            old = parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        _fsync_dir(parent)
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
    write_text_atomic(run_dir / LATEST, ckpt.name + "\n")
    steps = sorted(
        (int(m.group(1)), p) for p in run_dir.iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name))
    )
    for s, p in steps[: max(0, len(steps) - max(1, keep_last))]:
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
    if not _STEP_RE.match(name):
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


def _read_config(ckpt: Path) -> dict:
    try:
        config = json.loads((ckpt / CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{ckpt / CONFIG} is not valid JSON ({e}); the checkpoint is corrupted") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{ckpt / CONFIG} should hold a JSON object; the checkpoint is corrupted")
    version = config.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{ckpt / CONFIG} has format_version {version!r}; this interp_norm reads version {FORMAT_VERSION}. "
            "Upgrade interp_norm or re-save the checkpoint"
        )
    for key in ("model", "task"):
        if not isinstance(config.get(key), dict):
            raise CheckpointError(f"{ckpt / CONFIG} lacks the {key!r} section; the checkpoint is incomplete")
    return config


def _verify(ckpt: Path, config: dict, name: str) -> None:
    """Check a file against the sha256 in config.json (raises CheckpointError on mismatch)."""
    f = ckpt / name
    entry = config.get("files", {}).get(name)
    if not f.is_file():
        raise CheckpointError(f"checkpoint {str(ckpt)!r} lacks {name}; it is incomplete")
    if entry is None:
        return  # written by hand without a manifest entry: nothing to check against
    size = f.stat().st_size
    if size != entry.get("bytes"):
        raise CheckpointError(
            f"{f} is {size} bytes but config.json recorded {entry.get('bytes')}; the file is truncated or corrupted"
        )
    if _sha256(f) != entry.get("sha256"):
        raise CheckpointError(f"{f} does not match the sha256 recorded in config.json; the file is corrupted")


def _train_cfg_from(d: Any, ckpt: Path) -> Any:
    if d is None:
        return None
    from interp_norm.train import TrainConfig  # train imports this module

    try:
        return TrainConfig.from_dict(d)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{ckpt / CONFIG} has an invalid 'train' section: {e}") from None


def read_checkpoint_info(path: str | os.PathLike, verify: bool = True) -> CheckpointInfo:
    """Everything but the weights (cheap: no model is built)."""
    ckpt = resolve_checkpoint(path)
    config = _read_config(ckpt)
    try:
        model_cfg = ModelConfig.from_dict(config["model"])
        task = AdditionTask.from_dict(config["task"])
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{ckpt / CONFIG} describes an invalid model or task: {e}") from None
    metrics: dict = {}
    if (ckpt / METRICS).is_file():
        if verify:
            _verify(ckpt, config, METRICS)
        try:
            metrics = json.loads((ckpt / METRICS).read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{ckpt / METRICS} is not valid JSON ({e}); the checkpoint is corrupted") from None
    curve = pd.DataFrame()
    if (ckpt / CURVE).is_file():
        if verify:
            _verify(ckpt, config, CURVE)
        try:
            # round_trip: floats come back bit-identical, so a resumed run's curve matches exactly
            curve = pd.read_csv(ckpt / CURVE, float_precision="round_trip")
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{ckpt / CURVE} cannot be read ({e}); the checkpoint is corrupted") from None
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


def _summarise(keys: list[str], n: int = 6) -> str:
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def load_checkpoint(
    path: str | os.PathLike, device: str | torch.device = "cpu", verify: bool = True
) -> tuple[HookedNormTransformer, CheckpointInfo]:
    """Load ``(model, info)`` from a checkpoint or run folder; the model is in eval mode.

    ``verify`` checks every file read against config.json's sha256 (catches corruption that
    safetensors' header check cannot). Raises :class:`CheckpointNotFoundError` /
    :class:`CheckpointError` naming the problem.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    info = read_checkpoint_info(path, verify=verify)
    ckpt = info.path
    if verify:
        _verify(ckpt, info.config, WEIGHTS)
    elif not (ckpt / WEIGHTS).is_file():
        raise CheckpointError(f"checkpoint {str(ckpt)!r} lacks {WEIGHTS}; it is incomplete")
    try:
        state = load_file(str(ckpt / WEIGHTS), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{ckpt / WEIGHTS} is truncated or corrupted ({e})") from None
    model = HookedNormTransformer(info.model_cfg)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items() if k in state and state[k].shape != v.shape
    )
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing weights: {_summarise(missing)}")
        if unexpected:
            parts.append(f"unexpected weights: {_summarise(unexpected)}")
        if wrong:
            parts.append(f"shape mismatch (file vs config): {_summarise(wrong)}")
        cfg = info.model_cfg
        raise CheckpointError(
            f"{ckpt}: config.json (attn_norm={cfg.attn_norm!r}, n_layers={cfg.n_layers}, d_model={cfg.d_model}) "
            f"disagrees with {WEIGHTS}: " + "; ".join(parts)
        )
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})
    return model.to(device).eval(), info


def load_train_state(path: str | os.PathLike, verify: bool = True) -> dict:
    """The resumable training state, loaded with ``weights_only=True`` (never arbitrary pickles)."""
    ckpt = resolve_checkpoint(path)
    config = _read_config(ckpt)
    if not (ckpt / TRAIN_STATE).is_file():
        raise CheckpointError(f"checkpoint {str(ckpt)!r} has no {TRAIN_STATE}, so training cannot resume from it")
    if verify:
        _verify(ckpt, config, TRAIN_STATE)
    try:
        state = torch.load(ckpt / TRAIN_STATE, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, EOFError... depending on the damage
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            raise CheckpointError(
                f"{ckpt / TRAIN_STATE} contains objects other than tensors and plain containers; refusing to "
                "unpickle it (that could run arbitrary code). Only load checkpoints written by interp_norm"
            ) from None
        raise CheckpointError(f"{ckpt / TRAIN_STATE} is truncated or corrupted ({msg})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{ckpt / TRAIN_STATE} should hold a dict, got {type(state).__name__}")
    return state


def export_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, include_train_state: bool = False) -> Path:
    """Copy a checkpoint (or a run's newest) to ``dst``, by default without the optimizer state.

    For shipping: ``export_checkpoint("runs/pre", "data/checkpoints/pre")`` keeps weights, config,
    curve and metrics; ``train_state.pt`` (≈2× the weights) is only needed to resume.
    """
    model, info = load_checkpoint(src)
    return save_checkpoint(
        model, dst, task=info.task, train_cfg=info.train_cfg, step=info.step, metrics=info.metrics or None,
        curve=info.curve if len(info.curve) else None,
        train_state=load_train_state(info.path) if include_train_state and info.has_train_state else None,
    )


# ----------------------------------------------------------------------------- pretrained


def data_dir() -> Path:
    """The data folder: ``$INTERP_NORM_DATA`` if set, else the repository's ``data/``."""
    env = os.environ.get(DATA_ENV)
    return Path(env) if env else Path(__file__).resolve().parent.parent / "data"


def pretrained_dir() -> Path:
    return data_dir() / "checkpoints"


def _pretrained_names() -> list[str]:
    root = pretrained_dir()
    if not root.is_dir():
        return []
    return sorted(
        p.name for p in root.iterdir()
        if p.is_dir() and not p.name.startswith(".") and ((p / CONFIG).is_file() or (p / LATEST).is_file())
    )


def load_pretrained(name: str, device: str | torch.device = "cpu") -> tuple[HookedNormTransformer, CheckpointInfo]:
    """Load a shipped checkpoint by name (``"pre"``, ``"qkv"``...; see :func:`list_pretrained`)."""
    names = _pretrained_names()
    if not isinstance(name, str) or name not in names:
        avail = ", ".join(names) if names else f"none (no checkpoints under {pretrained_dir()}; set {DATA_ENV} to the data folder)"
        raise CheckpointNotFoundError(f"no pretrained checkpoint named {name!r}; available: {avail}")
    return load_checkpoint(pretrained_dir() / name, device=device)


def looks_like_path(spec: str | os.PathLike) -> bool:
    """CKPT arguments that exist, contain a path separator or start with '.' are folders, not names."""
    text = str(spec)
    return Path(text).exists() or any(sep in text for sep in "/\\") or text.startswith(".")


def load_any(spec: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[HookedNormTransformer, CheckpointInfo]:
    """A checkpoint or run folder if ``spec`` looks like a path, else a pretrained name.

    What the CLI and ``reproduce`` accept as CKPT; an unknown name lists the available ones.
    """
    text = str(spec)
    if looks_like_path(text):
        return load_checkpoint(text, device=device)
    try:
        return load_pretrained(text, device=device)
    except CheckpointNotFoundError:
        names = [n for n in _pretrained_names()]
        raise CheckpointNotFoundError(
            f"{text!r} is neither a checkpoint folder nor a pretrained name "
            f"(available: {', '.join(names) if names else 'none'}); see 'interp-norm list'"
        ) from None


def list_pretrained() -> pd.DataFrame:
    """One row per shipped checkpoint: name, architecture, seed, step and per-token accuracies."""
    rows = []
    for name in _pretrained_names():
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
            "n_layers": cfg.n_layers,
            "d_model": cfg.d_model,
            "seed": cfg.seed,
            "step": info.step,
        }
        for rec in info.metrics.get("evaluation", []):
            if "split" in rec and "per_token_acc" in rec:
                row[f"{rec['split']}_acc"] = rec["per_token_acc"]
        row["path"] = str(info.path)
        rows.append(row)
    cols = ["name", "attn_norm", "norm_kind", "n_layers", "d_model", "seed", "step", "id_acc", "interp_acc", "extrap_acc", "path"]
    df = pd.DataFrame(rows)
    return df.reindex(columns=cols + [c for c in df.columns if c not in cols])


__all__ = [
    "CheckpointInfo",
    "load_any",
    "save_checkpoint",
    "load_checkpoint",
    "export_checkpoint",
    "load_train_state",
    "read_checkpoint_info",
    "commit_run_checkpoint",
    "latest_checkpoint",
    "resolve_checkpoint",
    "clean_temporary",
    "ensure_writable_dir",
    "load_pretrained",
    "list_pretrained",
    "data_dir",
    "pretrained_dir",
    "FORMAT_VERSION",
]
