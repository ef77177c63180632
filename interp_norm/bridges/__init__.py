"""Real architectures through TransformerLens 4 bridges: attention anatomy, scores, loading, noise.

Loaded lazily (PEP 562) so importing :mod:`interp_norm.bridges` does not import transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ArchitectureError": "describe", "NormSpec": "describe", "LayerAnatomy": "describe", "Anatomy": "describe",
    "anatomy": "describe", "identify_norm": "describe",
    "canonical": "scores", "attention_mask": "scores", "masked_softmax": "scores", "query_key": "scores",
    "attention_scores": "scores", "verify_scores": "scores",
    "ARCHITECTURES": "build", "tiny_config": "build", "tiny_hf_model": "build", "bridge_from_hf": "build",
    "tiny_bridge": "build",
    "load_model": "loading", "load_hf_model": "loading", "folder_kind": "loading",
    "HeadNoise": "noise", "uniform_sampler": "noise", "effective_factors": "noise", "argmax_changes": "noise",
    "collapse_factors": "noise",
    "sample_text": "text", "random_tokens": "text", "text_tokens": "text",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"interp_norm.bridges.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'interp_norm.bridges' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = sorted(_EXPORTS)
