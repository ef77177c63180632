"""interp_norm: mechanistic interpretability of normalisation layers (Pre-Norm vs QKV-Norm).

Reproduces and extends Menary, Kaski & Freitas (2024), "Transformer Normalisation Layers and the
Independence of Semantic Subspaces", on small addition transformers hooked like TransformerLens.

The functions ``train`` and ``evaluate`` live in the submodules of the same names
(``from interp_norm.train import train``); they are not re-exported here so that the submodules
stay reachable as attributes.
"""

from interp_norm.checkpoints import list_pretrained, load_checkpoint, load_pretrained, save_checkpoint
from interp_norm.errors import InterpNormError
from interp_norm.model import HookedNormTransformer, ModelConfig
from interp_norm.task import AdditionTask, Problem, parse_problem
from interp_norm.train import TrainConfig

__version__ = "0.1.0"

__all__ = [
    "AdditionTask",
    "TrainConfig",
    "list_pretrained",
    "load_checkpoint",
    "load_pretrained",
    "save_checkpoint",
    "HookedNormTransformer",
    "InterpNormError",
    "ModelConfig",
    "Problem",
    "parse_problem",
]
