"""The :func:`anatomy` entry point: which describer a model needs, and a per-model cache.

It sits above :mod:`describe` (types, our models) and :mod:`bridge_anatomy` (bridges), so the
functions that take an optional ``anat`` and default it to ``anatomy(model)`` import this module
and nothing below has to import back up.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from interp_norm.anatomy._common import is_bridge
from interp_norm.anatomy.bridge_anatomy import bridge_anatomy
from interp_norm.anatomy.describe import Anatomy, own_anatomy
from interp_norm.errors import ArchitectureError
from interp_norm.core.model import HookedNormTransformer

_CACHE: "weakref.WeakKeyDictionary[nn.Module, Anatomy]" = weakref.WeakKeyDictionary()

#: The kinds of model the adapter knows (:attr:`Anatomy.kind` holds the same strings).
KINDS = ("interp_norm", "bridge")


def kind_of(model: Any) -> str:
    """Which kind of model this is, without a probe forward: ``"interp_norm"`` (our
    :class:`HookedNormTransformer`), ``"bridge"`` (a TransformerLens 4 ``TransformerBridge`` of a
    Hugging Face model) or ``"other"``. The one place the package tells model kinds apart; an
    analysis that needs more than the kind asks :func:`anatomy`."""
    if isinstance(model, HookedNormTransformer):
        return "interp_norm"
    if is_bridge(model):
        return "bridge"
    return "other"


def anatomy(model: Any, *, strict: bool = True, refresh: bool = False) -> Anatomy:
    """The :class:`Anatomy` of ``model`` (cached per model object; ``refresh=True`` re-derives it).

    For a bridge this runs one probe forward (:mod:`interp_norm.anatomy.bridge_anatomy`).
    ``strict`` raises :class:`ArchitectureError` when the scores rebuilt from q and k do not
    reproduce the model's pattern; ``strict=False`` records the error in ``pattern_error`` instead.
    """
    if not refresh and model in _CACHE:
        result = _CACHE[model]
        bad = [la.layer for la in result.layers if la.pattern_ok is False]
        if strict and bad:
            raise ArchitectureError(f"layers {bad}: the rebuilt scores do not reproduce the pattern (see anatomy(model, strict=False).table())")
        return result
    kind = kind_of(model)
    if kind == "interp_norm":
        result = own_anatomy(model)
    elif kind == "bridge":
        result = bridge_anatomy(model, strict)
    else:
        raise ArchitectureError(
            f"cannot describe the attention of a {type(model).__name__}: pass a HookedNormTransformer or a "
            "TransformerLens TransformerBridge (interp_norm.anatomy.load / bridge_from_hf)"
        )
    _CACHE[model] = result
    return result


__all__ = ["anatomy", "kind_of", "KINDS"]
