"""Plumbing shared by the geometry analyses: the model check, token input, which tokens count, one
cached forward pass, and what an attention layer writes into the residual stream.

Kept in one place so every analysis accepts the same inputs, excludes the same tokens and can reuse
one :class:`~transformer_lens.ActivationCache` (``cache=``) instead of running the model again.
"""

from __future__ import annotations

from typing import Iterable, Union

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from interp_norm.core import task as T
from interp_norm.core.checks import require_norm_model
from interp_norm.errors import ConfigError, ProblemStringError
from interp_norm.core.hook_names import act_name
from interp_norm.core.model import HookedNormTransformer

TokensLike = Union[Int[Tensor, "batch pos"], "T.Batch"]
#: Floor for divisions by norms and means (zero components must not produce NaN weights).
TINY = 1e-12


def check_model(model: HookedNormTransformer) -> None:
    """Raise :class:`ConfigError` unless ``model`` is one of ours (the analyses read its hooks and steps)."""
    require_norm_model(model, what="the geometry analysis")


def as_tokens(model: HookedNormTransformer, tokens: TokensLike) -> Int[Tensor, "batch pos"]:
    """``[batch, pos]`` token ids on the model's device, from a tensor or a task ``Batch``."""
    if isinstance(tokens, T.Batch):
        tokens = tokens.tokens
    if not isinstance(tokens, Tensor):
        raise ProblemStringError(
            f"tokens must be a [batch, pos] integer tensor or a task Batch, got {type(tokens).__name__}; "
            "use task.sample_batch(n).tokens or model.to_tokens([...])"
        )
    if tokens.ndim == 1:
        tokens = tokens.unsqueeze(0)
    if tokens.ndim != 2 or tokens.numel() == 0:
        raise ProblemStringError(f"tokens must be a non-empty [batch, pos] tensor, got shape {tuple(tokens.shape)}")
    param = next(iter(model.parameters()), None)
    return tokens.to(param.device if param is not None else "cpu")


def use_center(model: HookedNormTransformer, center: Union[bool, str]) -> bool:
    """``"auto"``: centre (remove the mean over d_model) iff the model's norms are LayerNorms.

    LayerNorm divides by |Πx| (Π removes the mean), RMSNorm by |x|, so that is the norm a
    Pre-Norm model must keep constant. The choice depends only on ``norm_kind``, not on where the
    norm sits, so a Pre-Norm and a QKV-Norm model of the same kind are measured the same way.
    """
    if center == "auto":
        return model.cfg.norm_kind == "ln"
    if not isinstance(center, bool):
        raise ConfigError(f"center must be True, False or 'auto', got {center!r}")
    return center


def valid_mask(tokens: Int[Tensor, "batch pos"], exclude_bos: bool = True) -> Bool[Tensor, "batch pos"]:
    """True at real tokens: not padding ``*`` and, if ``exclude_bos``, not the opening ``[``."""
    m = tokens != T.PAD_ID
    if exclude_bos:
        m = m & (tokens != T.BOS_ID)
    return m


def writer_hooks(n_layers: int, kinds: Iterable[str] = ("z", "attn_out", "mlp_out")) -> list[str]:
    """Hooks holding the residual stream's writers below layer ``n_layers``: the two embeddings,
    then per layer the activations ``kinds`` (``z`` for per-head writes, ``attn_out``, ``mlp_out``)."""
    kinds = tuple(kinds)
    names = [act_name("embed"), act_name("pos_embed")]
    for l in range(n_layers):
        names += [act_name(k, l) for k in kinds]
    return names


def run_cached(model: HookedNormTransformer, tokens: Tensor, names: Iterable[str], cache=None):
    """Forward pass caching only ``names`` (memory stays small on the paper-size model).

    A ``cache`` (ActivationCache or dict from a run on the same tokens) holding all ``names`` is
    reused instead: :func:`~interp_norm.geometry.run_geometry` runs the model once for every analysis."""
    wanted = set(names)
    if cache is not None:
        have = cache.cache_dict if hasattr(cache, "cache_dict") else cache
        if all(n in have for n in wanted):
            return cache
    missing = sorted(n for n in wanted if n not in model.hook_dict)
    if missing:
        raise ConfigError(f"the model has no hook(s) {missing}; see model.hook_names()")
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in wanted)
    return cache


def attn_write(model: HookedNormTransformer, layer: int, x: Tensor) -> Tensor:
    """``x`` — part of what attention ``layer`` outputs (one head's z·W_O, or b_O) — as it reaches the
    residual stream: the block's update Checkpoint multiplies it for ``calibration="paper"`` models
    (so the heads and b_O sum to ``hook_attn_out``); unchanged otherwise."""
    if model.cfg.calibration == "paper":
        return model.blocks[layer].calib_attn_out(x)
    return x


def projection_matrices(model: HookedNormTransformer, layer: int) -> dict[str, Tensor]:
    """W_Q/W_K/W_V of ``layer`` as the attention applies them (``{"q"|"k"|"v": [h, d_model, d_head]}``,
    float64): ``attn.project`` of the identity, so any input Checkpoint factor is included.

    ``project`` is linear, so its value on the identity is its matrix; on an uncalibrated model this
    equals W exactly (1·w plus exact zeros)."""
    attn = model.blocks[layer].attn
    eye = torch.eye(model.cfg.d_model, dtype=attn.W_Q.dtype, device=attn.W_Q.device).unsqueeze(0)
    with torch.no_grad():
        return {n: attn.project(eye, n)[0].transpose(0, 1).double() for n in ("q", "k", "v")}
