"""Small helpers every adapter module needs: hook-tensor layouts, the HF module behind a component,
a norm module's epsilon, and where a warning about the user's call should point.

They sit below :mod:`describe`, :mod:`rebuild` and :mod:`bridge_anatomy` so that none of those
has to import another only for a layout conversion (the import graph stays acyclic).
"""

from __future__ import annotations

import sys
from typing import Any, Optional, overload

from torch import Tensor, nn

from interp_norm.errors import ArchitectureError


def canonical(x: Tensor, layout: str, heads: int, d_head: int) -> Tensor:
    """A hook tensor in ``layout`` ("bphd", "bhpd", "flat") as [batch, pos, head, d_head]."""
    if layout == "bphd":
        return x
    if layout == "bhpd":
        return x.transpose(1, 2)
    if layout == "flat":
        return x.unflatten(-1, (heads, d_head))
    raise ArchitectureError(f"unknown hook layout {layout!r}")


def from_canonical(x: Tensor, layout: str) -> Tensor:
    """Inverse of :func:`canonical`: [batch, pos, head, d_head] back to the hook's own layout."""
    if layout == "bphd":
        return x
    if layout == "bhpd":
        return x.transpose(1, 2)
    if layout == "flat":
        return x.flatten(-2)
    raise ArchitectureError(f"unknown hook layout {layout!r}")


def is_bridge(model: Any) -> bool:
    """Whether ``model`` is a TransformerLens 4 ``TransformerBridge``.

    A bridge exists only once ``transformer_lens.model_bridge`` has been imported, so the check never
    imports it itself (that import costs seconds, and our own models never need it)."""
    bridge_module = sys.modules.get("transformer_lens.model_bridge")
    TransformerBridge = getattr(bridge_module, "TransformerBridge", None)
    return TransformerBridge is not None and isinstance(model, TransformerBridge)


def wrapped(component: Any) -> Optional[nn.Module]:
    """The HF module a bridge component wraps, or None if ``component`` wraps none."""
    return getattr(component, "_modules", {}).get("_original_component")


@overload
def original(component: None) -> None: ...
@overload
def original(component: nn.Module) -> nn.Module: ...
@overload
def original(component: Any) -> Optional[nn.Module]: ...
def original(component: Any) -> Optional[nn.Module]:
    """The HF module a bridge component wraps (or the module itself if it is not a bridge)."""
    if component is None:
        return None
    orig = wrapped(component)
    return orig if orig is not None else component


def norm_eps(module: Any) -> Optional[float]:
    """A norm module's epsilon under any of the names libraries give it (``eps``: torch and most Hugging
    Face norms, ``variance_epsilon``: Llama-style RMSNorms, ``epsilon``), or None if it has none."""
    for name in ("eps", "variance_epsilon", "epsilon"):
        v = getattr(module, name, None)
        if isinstance(v, (int, float)):
            return float(v)
    return None


def outside_stacklevel() -> int:
    """The ``stacklevel`` (for a warning raised by the caller) of the first frame outside this package:
    the user's ``interp_norm.load(...)`` line, however many loaders lie between."""
    from pathlib import Path
    from types import FrameType

    package = str(Path(__file__).resolve().parents[1])
    level = 1
    frame_or_none: Optional[FrameType] = sys._getframe(1)  # the function that warns
    while frame_or_none is not None and str(Path(frame_or_none.f_code.co_filename).resolve()).startswith(package):
        level, frame_or_none = level + 1, frame_or_none.f_back
    return level


__all__ = ["canonical", "from_canonical", "is_bridge", "wrapped", "original", "norm_eps", "outside_stacklevel"]
