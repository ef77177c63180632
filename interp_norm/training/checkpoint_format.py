"""The checkpoint folder format: its file names, its checksum manifest, and how each file is read.

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
sha256 recorded in ``config.json`` (:func:`verify_file`).

This module only reads and checks; :mod:`interp_norm.training.checkpoints` writes folders (through
:mod:`interp_norm.training.io`) and builds models from them.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pandas as pd
import torch

from interp_norm.errors import CheckpointError

FORMAT_VERSION = 1
WEIGHTS, CONFIG, CURVE, METRICS, TRAIN_STATE = (
    "model.safetensors", "config.json", "training_curve.csv", "metrics.json", "train_state.pt",
)
LATEST = "LATEST"  # in a run folder: names the newest complete step checkpoint
STEP_RE = re.compile(r"^step-(\d+)$")
# Floats must come back bit-identical (a resumed run's curve matches exactly): pandas 3 parses them
# round-trip by default and deprecates the option; pandas 2 needs it.
_ROUND_TRIP = {} if int(pd.__version__.split(".")[0]) >= 3 else {"float_precision": "round_trip"}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest_entry(path: Path) -> dict:
    """What ``config.json`` records about a file: ``{"bytes": n, "sha256": h}``."""
    return {"bytes": path.stat().st_size, "sha256": sha256(path)}


def folder_kind(path: Path) -> str:
    """"interp_norm" (our checkpoint or run folder), "hf" (a transformers ``save_pretrained``
    folder: config.json with ``model_type``) or "unknown", read from config.json alone."""
    path = Path(path)
    if (path / LATEST).is_file():
        return "interp_norm"
    config = path / CONFIG
    if not config.is_file():
        return "unknown"
    try:
        data = json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return "unknown"
    if not isinstance(data, dict):
        return "unknown"
    if "format_version" in data:
        return "interp_norm"
    if "model_type" in data or "architectures" in data:
        return "hf"
    return "unknown"


def hf_folder_message(path: Path) -> str:
    """What to do with a Hugging Face folder passed where one of our checkpoints is expected."""
    return (f"{str(path)!r} is a Hugging Face model folder (config.json with model_type), not an interp_norm "
            f"checkpoint; load it with interp_norm.load({str(path)!r}), which wraps it in a TransformerLens bridge")


def read_config(ckpt: Path) -> dict:
    """``config.json`` of a checkpoint folder, checked for version and the model/task sections."""
    try:
        config = json.loads((ckpt / CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{ckpt / CONFIG} is not valid JSON ({e}); the checkpoint is corrupted") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{ckpt / CONFIG} should hold a JSON object; the checkpoint is corrupted")
    version = config.get("format_version")
    if version is None and ("model_type" in config or "architectures" in config):
        raise CheckpointError(hf_folder_message(ckpt))
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{ckpt / CONFIG} has format_version {version!r}; this interp_norm reads version {FORMAT_VERSION}. "
            "Upgrade interp_norm or re-save the checkpoint"
        )
    for key in ("model", "task"):
        if not isinstance(config.get(key), dict):
            raise CheckpointError(f"{ckpt / CONFIG} lacks the {key!r} section; the checkpoint is incomplete")
    return config


def verify_file(ckpt: Path, config: dict, name: str) -> None:
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
    if sha256(f) != entry.get("sha256"):
        raise CheckpointError(f"{f} does not match the sha256 recorded in config.json; the file is corrupted")


def read_metrics(ckpt: Path) -> dict:
    try:
        return json.loads((ckpt / METRICS).read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{ckpt / METRICS} is not valid JSON ({e}); the checkpoint is corrupted") from None


def read_curve(ckpt: Path) -> pd.DataFrame:
    try:
        return pd.read_csv(ckpt / CURVE, **_ROUND_TRIP)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{ckpt / CURVE} cannot be read ({e}); the checkpoint is corrupted") from None


def _summarise(keys: list[str], n: int = 6) -> str:
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def read_weights(ckpt: Path, expected: dict[str, torch.Tensor], describe: str) -> dict[str, torch.Tensor]:
    """The weights of ``ckpt``, checked against a freshly built model's ``expected`` state dict.

    Returns them in the expected dtypes. A mismatch names the missing, unexpected and misshapen
    tensors; ``describe`` says what config.json claims (e.g. ``attn_norm='pre', n_layers=2``).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        state = load_file(str(ckpt / WEIGHTS), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{ckpt / WEIGHTS} is truncated or corrupted ({e})") from None
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
        raise CheckpointError(f"{ckpt}: config.json ({describe}) disagrees with {WEIGHTS}: " + "; ".join(parts))
    return {k: v.to(expected[k].dtype) for k, v in state.items()}


def read_train_state(ckpt: Path) -> dict:
    """``train_state.pt`` loaded with ``weights_only=True``: tensors and plain containers, never objects."""
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


__all__ = ["FORMAT_VERSION", "WEIGHTS", "CONFIG", "CURVE", "METRICS", "TRAIN_STATE", "LATEST", "STEP_RE",
           "sha256", "manifest_entry", "read_config", "verify_file", "read_metrics", "read_curve", "read_weights",
           "read_train_state"]
