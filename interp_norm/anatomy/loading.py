"""Load any model an analysis accepts: our checkpoints, or a Hugging Face model as a bridge.

:func:`load` (public as ``interp_norm.load``) takes what a user types after
``interp-norm collapse``:

* one of our checkpoint or run folders, or a shipped pretrained name -> a
  :class:`~interp_norm.core.model.HookedNormTransformer` (through ``checkpoints._load_ours``);
* a local Hugging Face folder (``save_pretrained`` output: ``config.json`` with a ``model_type``)
  -> a TransformerLens ``TransformerBridge``;
* a Hugging Face name such as ``Qwen/Qwen3-0.6B`` that is already in the local cache -> a bridge.
  Nothing is ever downloaded (``local_files_only``): weights come from a machine with network,
  via ``hf download NAME`` and a copy of the cache (``HF_HUB_CACHE`` / ``HF_HOME``).

A folder that is neither gets a :class:`~interp_norm.errors.CheckpointError` saying what it holds,
instead of being read as one of our checkpoints ("config.json has format_version None").
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from interp_norm.anatomy._common import outside_stacklevel as _outside_stacklevel
from interp_norm.training.checkpoint_format import folder_kind
from interp_norm.errors import ArchitectureError, CheckpointError, CheckpointNotFoundError, ConfigError, NoTokenizerWarning


def _hub_cache_dir() -> Optional[str]:
    """The cache folder, read from the environment at call time (huggingface_hub reads it once at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def _load_hf_model(folder: str | os.PathLike, *, dtype: torch.dtype | str = torch.float32, device: str = "cpu",
                  name: Optional[str] = None, device_map: Any = None) -> Any:
    """A bridge around the HF model saved in ``folder`` (weights, optional tokenizer; no network).

    ``dtype``: a torch dtype or its name, ``"auto"`` for the stored one; each tensor is converted as
    it is read, so the weights are held once. ``device_map`` (e.g. ``"auto"``; needs ``accelerate``)
    goes to ``from_pretrained`` for a model too large for one device; ``device`` is then unused.
    """
    import transformers

    from interp_norm.training.devices import check_device_map, resolve_device, resolve_dtype
    from transformer_lens.model_bridge.sources._hf_format import determine_architecture_from_hf_config
    from transformer_lens.model_bridge.sources.transformers import get_hf_model_class_for_architecture

    from interp_norm.anatomy.build import bridge_from_hf

    dtype = resolve_dtype(dtype)
    device_map = check_device_map(device_map, device)
    if device_map is None:
        resolve_device(device)
    folder = Path(folder)
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ArchitectureError(f"{str(folder)!r} holds a config.json transformers {transformers.__version__} cannot read: {e}") from None
    try:
        architecture = determine_architecture_from_hf_config(config)
        model_class = get_hf_model_class_for_architecture(architecture)
    except (ValueError, KeyError) as e:
        raise ArchitectureError(f"{str(folder)!r}: TransformerLens has no bridge for this model ({e})") from None
    try:
        placement = {} if device_map is None else {"device_map": device_map}
        concrete = getattr(transformers, architecture, None)  # from_pretrained(None, state_dict=) needs the class
        plain = device_map is None and getattr(concrete, "config_class", None) is type(config)
        converted = _converted_weights(folder, dtype, concrete) if plain else None
        if converted is not None and concrete is not None:  # the stored copy is never held: see safetensors_read
            model = concrete.from_pretrained(None, config=config, state_dict=converted, dtype=dtype,
                                             attn_implementation="eager")
            del converted
        else:
            model = model_class.from_pretrained(folder, config=config, local_files_only=True, dtype=dtype,
                                                attn_implementation="eager", **placement)
    except (OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"cannot load the weights in {str(folder)!r}: {e}") from None
    if device_map is None:
        model = model.to(device)  # a no-op on the device it was loaded on: never a second copy
    model = model.eval()
    tokenizer = None
    # transformers 5 builds an empty tokenizer from config.json alone; only load one that was saved
    if any((folder / f).is_file() for f in _TOKENIZER_FILES):
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except Exception as e:
            raise CheckpointError(f"{str(folder)!r} holds tokenizer files that transformers cannot read: {e}") from None
    bridge = bridge_from_hf(model, tokenizer=tokenizer, name=name or str(folder))
    if tokenizer is None:  # runs on token ids only: say so once, and make text methods say the fix
        from interp_norm.anatomy.text import refuse_text_without_tokenizer

        warnings.warn(NoTokenizerWarning(
            f"{name or str(folder)!r} has no tokenizer (no tokenizer files beside the weights): it runs on token ids "
            "only, to_tokens raises and text analyses use random token ids; copy tokenizer.json / "
            "tokenizer_config.json into the folder to work with text"), stacklevel=_outside_stacklevel())
        refuse_text_without_tokenizer(bridge)
    return bridge


def _converted_weights(folder: Path, dtype: Any, concrete: Any) -> Optional[dict]:
    """The folder's weights read in ``dtype`` block by block, when it stores floats in another dtype
    (``from_pretrained`` would hold the stored copy mapped while converting); else None."""
    from interp_norm.anatomy.safetensors_read import read_converted, stored_float_dtypes

    if not isinstance(dtype, torch.dtype) or not stored_float_dtypes(folder) - {dtype}:
        return None
    if any(getattr(concrete, a, None) for a in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict")):
        return None  # it keeps some weights in float32: they must be read as stored
    return read_converted(folder, dtype)


def _hf_snapshot(name: str, cache_dir: Optional[str]) -> Optional[Path]:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id=name, local_files_only=True, cache_dir=cache_dir or _hub_cache_dir()))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError):
        return None


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

KINDS = ("interp_norm", "bridge")  # the values of ``kind_of(model)``; ``load(..., kind=)`` takes one of them


@dataclass(frozen=True)
class BridgeInfo:
    """What :func:`load_with_info` loaded for a Hugging Face model (ours get a ``CheckpointInfo``).

    ``path`` is the folder the weights were read from (a cache snapshot for a cached name),
    ``architecture`` the Hugging Face class TransformerLens bridged (``config.architectures[0]``).
    A bridge has no training task: ``task`` is always None, as analyses that need one expect.
    """

    name: str
    path: Path
    architecture: str
    dtype: torch.dtype
    task: None = None


def spec_kind(spec: str | os.PathLike, *, cache_dir: Optional[str] = None) -> str:
    """``"interp_norm"`` or ``"bridge"``: what :func:`load` would build from ``spec``, found without loading weights.

    A folder's ``config.json`` decides; a name is one of our shipped names first, else a Hugging
    Face name in the local cache. Anything else raises the typed error :func:`load` would raise.
    """
    return _locate(str(spec), cache_dir)[0]


def _locate(text: str, cache_dir: Optional[str]) -> tuple[str, Any]:
    """(kind, where): ("interp_norm", our folder or shipped name) or ("bridge", a Hugging Face folder)."""
    from interp_norm.training import checkpoints as C

    path = Path(text)
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{text!r} is a file; pass the folder holding config.json")
        kind = folder_kind(path)
        if kind in ("interp_norm", "hf"):
            return ("interp_norm" if kind == "interp_norm" else "bridge"), path
        held = sorted(p.name for p in path.iterdir())[:8]
        raise CheckpointError(
            f"{text!r} is not a supported model folder: it holds {held}. Expected an interp_norm checkpoint "
            "(config.json with format_version), an interp_norm run folder (LATEST), or a Hugging Face "
            "save_pretrained folder (config.json with model_type, plus weights)"
        )
    not_ours = ""
    if not C.looks_like_path(text):
        if text in C.pretrained_names():
            return "interp_norm", text
        not_ours = f"{C.not_ours_message(text)}; "
    elif not _REPO_ID.match(text):
        raise CheckpointNotFoundError(f"no model at {text!r}: the folder does not exist")
    snapshot = _hf_snapshot(text, cache_dir)
    if snapshot is not None:
        return "bridge", snapshot
    raise CheckpointNotFoundError(
        f"{not_ours}{text!r} is not in the Hugging Face cache "
        f"({cache_dir or _hub_cache_dir() or 'the default ~/.cache/huggingface/hub'}) nor a local folder. interp_norm "
        f"never downloads: run 'hf download {text}' on a machine with network and copy the cache here (set "
        "HF_HUB_CACHE), or pass a local save_pretrained folder"
    )


def load(spec: str | os.PathLike, *, device: str = "cpu", dtype: torch.dtype | str = torch.float32,
         cache_dir: Optional[str] = None, device_map: Any = None, kind: Optional[str] = None) -> Any:
    """Any model interp_norm analyses, from one spec (``interp_norm.load``; nothing is downloaded).

    * a shipped pretrained name (``"pre"``, ``"qkv"``; see ``interp_norm.list_pretrained()``) or one of
      our checkpoint / training-run folders -> a :class:`~interp_norm.core.model.HookedNormTransformer` in
      eval mode that knows its training task (``model.task``; every analysis defaults to it);
    * a Hugging Face ``save_pretrained`` folder (``config.json`` with ``model_type``), or a Hugging
      Face name already in the local cache (``HF_HUB_CACHE`` / ``HF_HOME``; ``cache_dir`` overrides it)
      -> a TransformerLens ``TransformerBridge`` (with the tokenizer if one was saved beside the weights).

    An existing folder wins over a cached name of the same spelling (``org/name``), and one of our
    shipped names over a cached Hugging Face name. Anything else is a typed error saying what the
    folder holds or how to get the model (``hf download NAME`` elsewhere).

    ``device``: cpu, cuda, cuda:1 ... (a device that is not there is a ConfigError). Hugging Face models
    only: ``dtype`` (default float32; ``"auto"`` = as stored, ``"bfloat16"`` ...) and ``device_map``
    (e.g. ``"auto"``, passed to ``from_pretrained``; needs ``accelerate``) for a model too large for one
    device. Our models are stored and run in float32 on one device: another dtype or a device_map for
    them is a ConfigError. ``kind`` (``"interp_norm"`` or ``"bridge"``) refuses the other kind with a
    CheckpointError before any weights load (``HookedNormTransformer.from_pretrained`` passes
    ``"interp_norm"``). :func:`load_with_info` also returns what was loaded.

    Examples::

        import interp_norm
        model = interp_norm.load("pre")                     # shipped checkpoint; model.task is its task
        model = interp_norm.load("runs/my-run")             # a training run (its newest checkpoint)
        gpt2 = interp_norm.load("path/to/gpt2-folder")      # hf_model.save_pretrained(...) output
        qwen = interp_norm.load("Qwen/Qwen3-0.6B")          # already in the Hugging Face cache

        from interp_norm.noise import run_collapse
        run_collapse(model)                                 # on the model's own task
    """
    return load_with_info(spec, device=device, dtype=dtype, cache_dir=cache_dir, device_map=device_map, kind=kind)[0]


def load_with_info(spec: str | os.PathLike, *, device: str = "cpu", dtype: torch.dtype | str = torch.float32,
                   cache_dir: Optional[str] = None, device_map: Any = None, kind: Optional[str] = None
                   ) -> tuple[Any, Any]:
    """``(model, info)``: :func:`load`'s model and what was loaded (``interp_norm.load_with_info``).

    ``info`` is the checkpoint's :class:`~interp_norm.training.checkpoints.CheckpointInfo` for ours
    (path, configs, step, metrics, learning curve, task) and a :class:`BridgeInfo` for a Hugging
    Face model. The arguments are :func:`load`'s.
    """
    from interp_norm.training import checkpoints as C
    from interp_norm.training.devices import resolve_device, resolve_dtype

    if kind is not None and kind not in KINDS:
        raise ConfigError(f"kind={kind!r} is not a model kind; pass one of {KINDS} or None (any)")
    resolve_device(device)
    resolve_dtype(dtype)
    text = str(spec)
    try:
        found, where = _locate(text, cache_dir)
    except CheckpointNotFoundError:
        if kind != "interp_norm":
            raise
        return C._load_ours(text, device=device)  # raises the checkpoint loader's own message (our names listed)
    if kind is not None and found != kind:
        raise CheckpointError(_wrong_kind(text, where, found))
    if found == "interp_norm":
        check_ours(text, dtype, device_map)  # before reading any weights
        return C._load_ours(where, device=device)
    model = _load_hf_model(where, dtype=dtype, device=device, device_map=device_map,
                          name=None if Path(text).exists() else text)
    hf = getattr(model, "original_model", None)
    architecture = (getattr(getattr(hf, "config", None), "architectures", None) or [type(hf).__name__])[0]
    held = next(hf.parameters()).dtype if hf is not None else next(model.parameters()).dtype
    return model, BridgeInfo(name=text, path=Path(where), architecture=architecture, dtype=held)


def _wrong_kind(text: str, where: Any, found: str) -> str:
    from interp_norm.training.checkpoint_format import hf_folder_message

    if found == "interp_norm":
        return f"{text!r} is an interp_norm model, not a Hugging Face one; load it with interp_norm.load({text!r})"
    if Path(text).exists():
        return hf_folder_message(Path(text))
    return (f"{text!r} is a Hugging Face model (found in the Hugging Face cache), not an interp_norm checkpoint; "
            f"load it with interp_norm.load({text!r}), which wraps it in a TransformerLens bridge")


def check_ours(spec: str, dtype: Any, device_map: Any) -> None:
    """Our models are stored and run in float32 on one device: refuse another dtype or a device_map."""
    from interp_norm.training.devices import resolve_dtype

    if device_map is not None:
        raise ConfigError(f"device_map={device_map!r} applies to Hugging Face models; {spec!r} is an interp_norm model, "
                          "which fits on one device: pass device= (--device) instead")
    if resolve_dtype(dtype) not in ("auto", torch.float32):
        raise ConfigError(f"dtype {dtype!r} applies to Hugging Face models; {spec!r} is an interp_norm model, stored "
                          "and run in float32: drop dtype (--dtype) or pass float32")


__all__ = ["load", "load_with_info", "spec_kind", "BridgeInfo", "KINDS", "folder_kind", "check_ours"]
