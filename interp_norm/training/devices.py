"""Where a model runs and in which number format: ``device``, ``dtype`` and ``device_map`` checked once.

Every command and API that takes ``device=`` (``--device``) resolves it here, so a device that is not
there is one typed line (:class:`~interp_norm.errors.ConfigError`) before any work, not a CUDA
traceback halfway through. ``dtype`` and ``device_map`` apply to Hugging Face models (ours are small
and stored in float32): a model is loaded in its stored dtype (``"auto"``) or a chosen one
(``"bfloat16"`` ...), converted tensor by tensor as it loads, so no second copy of the weights is
ever held; ``device_map`` (e.g. ``"auto"``) spreads a model too large for one device over the
available ones through ``transformers``' ``from_pretrained`` (which needs the ``accelerate``
package). Standard library and torch only (a core module).
"""

from __future__ import annotations

import importlib.util
from typing import Any, Optional, Union

import torch

from interp_norm.errors import ConfigError

#: Spellings accepted for ``dtype`` / ``--dtype``: name -> torch dtype ("auto": the stored one).
DTYPES: dict[str, Optional[torch.dtype]] = {
    "auto": None,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
}
#: The canonical names (what ``--dtype`` lists).
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "float64")


def resolve_device(device: Union[str, torch.device, None]) -> torch.device:
    """``torch.device`` for ``device`` (None = cpu), or :class:`ConfigError` if it is malformed or that hardware is absent."""
    if device is None:
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"unknown device {device!r}; use cpu, cuda, cuda:1 ... (or mps on Apple)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {str(device)!r} requested but CUDA is not available (torch {torch.__version__}); use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"device {str(device)!r} requested but only {torch.cuda.device_count()} CUDA device(s) exist; "
                          f"use cuda:0 ... cuda:{max(0, torch.cuda.device_count() - 1)}")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {str(device)!r} requested but MPS is not available; use --device cpu")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"device {str(device)!r} is not supported here; use cpu, cuda, cuda:1 ... or mps")
    return dev


def resolve_dtype(dtype: Union[str, torch.dtype, None]) -> Union[torch.dtype, str]:
    """A torch floating dtype, or ``"auto"`` (the dtype the weights are stored in); :class:`ConfigError` otherwise."""
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ConfigError(f"dtype {dtype} is not a floating-point type; choose one of {', '.join(DTYPE_CHOICES)}")
        return dtype
    if isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key in DTYPES:
            return DTYPES[key] or "auto"
    raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_CHOICES)} (auto = the stored dtype)")


def check_device_map(device_map: Any, device: Union[str, torch.device, None] = None) -> Any:
    """``device_map`` as ``from_pretrained`` takes it, after checking that ``accelerate`` is installed
    and that ``device`` does not ask for something else (None and cpu defer to the map)."""
    if device_map is None:
        return None
    if not isinstance(device_map, (str, dict)):
        raise ConfigError(f"device_map must be a string such as 'auto' or a dict of module -> device, got "
                          f"{type(device_map).__name__}")
    if importlib.util.find_spec("accelerate") is None:
        raise ConfigError(f"device_map={device_map!r} needs the accelerate package, which is not installed; "
                          "run 'pip install accelerate', or pass a single device instead")
    if device is not None and torch.device(device).type != "cpu":
        raise ConfigError(f"pass either device ({str(device)!r}) or device_map ({device_map!r}), not both: "
                          "device_map places every layer itself")
    return device_map


#: glibc's ``mallopt`` parameter number of the mmap threshold (``M_MMAP_THRESHOLD`` in malloc.h).
_M_MMAP_THRESHOLD = -3
#: The threshold :func:`return_large_frees` sets: 128 KiB, glibc's own starting value.
MMAP_THRESHOLD = 128 << 10


def return_large_frees(threshold: int = MMAP_THRESHOLD) -> bool:
    """Make every allocation of ``threshold`` bytes or more its own memory mapping, returned to the
    system when it is freed (glibc ``mallopt(M_MMAP_THRESHOLD, threshold)``; True if it was set).

    Why: glibc raises its mmap threshold each time a mapped block is freed (up to 32 MiB), after which
    blocks of a few MB (activations, score blocks, the 8 MB float64 matrices of an ellipsoid) come from
    the heap, and freed heap memory below a live allocation is kept by the process: resident memory
    then grows with every pass although the live tensors do not (~190 MB over the 57 norm ellipsoids of
    a Qwen3-0.6B-shaped model). A fixed threshold turns that dynamic adjustment off; allocations, values
    and results are unchanged, each large allocation costs a system call and fresh pages. The analysis
    commands on Hugging Face models call it once per process; a no-op (False) where the C library is
    not glibc (macOS, musl, Windows).
    """
    import ctypes
    import ctypes.util
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False


__all__ = ["DTYPES", "DTYPE_CHOICES", "resolve_device", "resolve_dtype", "check_device_map", "return_large_frees",
           "MMAP_THRESHOLD"]
