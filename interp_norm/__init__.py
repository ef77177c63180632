"""interp_norm: mechanistic interpretability of normalisation layers (Pre-Norm vs QKV-Norm).

Reproduces and extends Menary, Kaski & Freitas (2024), "Transformer Normalisation Layers and the
Independence of Semantic Subspaces", on small addition transformers hooked like TransformerLens.
"""

from interp_norm.checkpoints import list_pretrained, load_checkpoint, load_pretrained, save_checkpoint
from interp_norm.errors import InterpNormError
from interp_norm.evaluate import evaluate
from interp_norm.model import HookedNormTransformer, ModelConfig
from interp_norm.task import AdditionTask, Problem, parse_problem
from interp_norm.train import TrainConfig, train

__version__ = "0.1.0"

__all__ = [
    "AdditionTask",
    "TrainConfig",
    "evaluate",
    "list_pretrained",
    "load_checkpoint",
    "load_pretrained",
    "save_checkpoint",
    "train",
    "HookedNormTransformer",
    "InterpNormError",
    "ModelConfig",
    "Problem",
    "parse_problem",
]
