"""Analyses of TransformerLens 4 bridges of Hugging Face models: noise, collapse, text agreement.

The model adapter (anatomy, scores, building and loading models, text) lives in
:mod:`interp_norm.anatomy`; its public names are re-exported here unchanged, so
``from interp_norm.bridges import anatomy, tiny_bridge`` keeps working.

* :class:`HeadNoise`, :func:`effective_factors`, :func:`argmax_changes` (``noise``): per-head
  multiplicative noise and collapse decisions from clean scores.
* :func:`bridge_collapse`, :func:`collapse_kappa` (``collapse``): the collapse rate on a bridge.
* :func:`text_agreement` (``agreement``).

Submodules load lazily (PEP 562): ``import interp_norm.bridges`` imports none of them.
"""

from __future__ import annotations

import importlib
from typing import Any

from interp_norm.anatomy import _EXPORTS as _ANATOMY

_EXPORTS = {name: f"interp_norm.anatomy.{mod}" for name, mod in _ANATOMY.items()} | {
    name: f"interp_norm.bridges.{mod}" for name, mod in {
        "HeadNoise": "noise", "seeded_sampler": "noise", "effective_factors": "noise", "argmax_changes": "noise",
        "collapse_factors": "noise",
        "bridge_collapse": "collapse", "collapse_chunks": "collapse", "collapse_kappa": "collapse",
        "text_agreement": "agreement",
    }.items()
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'interp_norm.bridges' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = sorted(_EXPORTS)
