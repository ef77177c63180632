"""Text agreement of TransformerLens 4 bridges under noise, and the names bridge users reach for.

The model adapter (anatomy, scores, building and loading models, text) lives in
:mod:`interp_norm.anatomy`, and the one noise/collapse implementation in :mod:`interp_norm.noise`
(:class:`~interp_norm.noise.HeadNoise` = the per-head core of ``NormNoise``,
:func:`~interp_norm.noise.bridge_collapse`); their public names are re-exported here unchanged, so
``from interp_norm.bridges import anatomy, tiny_bridge, HeadNoise`` keeps working. Only
:func:`text_agreement` (``agreement``) is implemented here.

Submodules load lazily (PEP 562): ``import interp_norm.bridges`` imports none of them.
"""

from __future__ import annotations

import importlib
from typing import Any

from interp_norm.anatomy import _EXPORTS as _ANATOMY

_EXPORTS = {name: f"interp_norm.anatomy.{mod}" for name, mod in _ANATOMY.items()} | {
    "HeadNoise": "interp_norm.noise.head_noise", "seeded_sampler": "interp_norm.noise.head_noise",
    "effective_factors": "interp_norm.noise.kernels",
    "bridge_collapse": "interp_norm.noise.bridge_collapse", "collapse_chunks": "interp_norm.noise.bridge_collapse",
    "collapse_kappa": "interp_norm.noise.bridge_collapse",
    "text_agreement": "interp_norm.bridges.agreement",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'interp_norm.bridges' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = sorted(_EXPORTS)
