"""interp_norm: mechanistic interpretability of normalisation layers (Pre-Norm vs QKV-Norm).

Reproduces and extends Menary, Kaski & Freitas (2024), "Transformer Normalisation Layers and the
Independence of Semantic Subspaces", on small addition transformers hooked like TransformerLens.

``interp_norm.load(spec)`` loads any model: a shipped name (``"pre"``), one of our checkpoint folders,
or a Hugging Face folder or cached name (a TransformerLens bridge); ``interp_norm.load_with_info(spec)``
also returns what was loaded (a checkpoint's ``CheckpointInfo``, a bridge's ``BridgeInfo``). Our
models know their task (``model.task``), and every analysis defaults to it.

The names below load on first use (PEP 562), so ``import interp_norm`` -- and with it
``interp-norm --help`` -- does not import torch, TransformerLens, plotly or pandas.

The functions ``train`` and ``evaluate`` live in the submodules of the same names
(``from interp_norm.training.train import train``); they are not re-exported here so that the submodules
stay reachable as attributes.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the submodule that defines it
_LAZY = {
    "AdditionTask": "interp_norm.core.task",
    "Problem": "interp_norm.core.task",
    "parse_problem": "interp_norm.core.task",
    "TrainConfig": "interp_norm.training.config",
    "list_pretrained": "interp_norm.training.checkpoints",
    "load": "interp_norm.anatomy.loading",
    "load_with_info": "interp_norm.anatomy.loading",
    "save_checkpoint": "interp_norm.training.checkpoints",
    "HookedNormTransformer": "interp_norm.core.model",
    "ModelConfig": "interp_norm.core.model",
    "InterpNormError": "interp_norm.errors",
}

__all__ = [
    "AdditionTask",
    "TrainConfig",
    "list_pretrained",
    "load",
    "load_with_info",
    "save_checkpoint",
    "HookedNormTransformer",
    "InterpNormError",
    "ModelConfig",
    "Problem",
    "parse_problem",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'interp_norm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
