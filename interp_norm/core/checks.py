"""Input checks shared by the analyses (noise, geometry, ...): one place, one error per problem.

Each check returns the validated value so callers write ``cfg = require_norm_model(model)``.
"""

from __future__ import annotations

from typing import Type

from interp_norm.errors import ConfigError, InterpNormError
from interp_norm.core.model import HookedNormTransformer, ModelConfig


def require_norm_model(
    model: object, what: str = "this analysis", error: Type[InterpNormError] = ConfigError
) -> ModelConfig:
    """``model``'s config if it is a :class:`HookedNormTransformer`; else ``error`` (ConfigError).

    The analyses read hook names, per-head norms and ``cfg.attn_norm`` that only our model has, so
    a plain ``HookedTransformer`` (or a checkpoint path, or None) is refused up front with the fix
    rather than failing later on a missing hook.
    """
    if not isinstance(model, HookedNormTransformer) or not isinstance(getattr(model, "cfg", None), ModelConfig):
        raise error(
            f"{what} needs a HookedNormTransformer, got {type(model).__name__}; load one with "
            "interp_norm.load(name or checkpoint folder), "
            "or build HookedNormTransformer(ModelConfig.preset(...))"
        )
    return model.cfg


__all__ = ["require_norm_model"]
