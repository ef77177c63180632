"""The :func:`anatomy` entry point: which describer a model needs, and a per-model cache.

It sits above :mod:`describe` (types, our models) and :mod:`bridge_anatomy` (bridges), so the
functions that take an optional ``anat`` and default it to ``anatomy(model)`` import this module
and nothing below has to import back up.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Capabilities:
    """What the analyses may ask of a model beyond its hooks, decided from its kind without a probe.

    * ``full_vocabulary``: built from interp_norm's components -- every hook of
      :mod:`interp_norm.core.hook_names` fires (``pos_embed``, the q/k/v norm hooks, ``hook_pattern``
      as computed), ``model(resid, start_at_layer=l)`` restarts a run, its config can be rebuilt
      (a twin with ``use_split_qkv_input``) and the incremental patching engine replays it;
    * ``hf_original``: a TransformerBridge of a Hugging Face model -- its anatomy (post-norms, grouped
      k/v heads) is read from the original, its ``unembed`` and ``ln_final`` are modules, and the
      key/value-cache patching engine may replay it.

    A model that is neither (e.g. a plain ``HookedTransformer``) has both False: hooks only.
    """

    full_vocabulary: bool
    hf_original: bool


def capabilities(model: Any) -> Capabilities:
    """The :class:`Capabilities` of ``model`` (no forward pass): analyses ask these, never the kind."""
    kind = kind_of(model)
    return Capabilities(full_vocabulary=kind == "interp_norm", hf_original=kind == "bridge")


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


__all__ = ["anatomy", "kind_of", "KINDS", "Capabilities", "capabilities"]
