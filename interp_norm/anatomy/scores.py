"""Attention scores rebuilt from q and k for any described model, checked against its own pattern.

The model-facing face of :mod:`interp_norm.anatomy.rebuild`: the same functions with the anatomy
defaulting to ``anatomy(model)``. The scores are ``scale · q_rot · k_rot`` (after the q/k norms,
after RoPE, grouped key heads mapped), optionally soft-capped; never a bridge's
``hook_attn_scores``, which on some architectures holds something else (Gemma 4: the pattern).
:func:`verify_scores` is the acceptance check: softmax(masked scores) must equal ``hook_pattern``.
"""

from __future__ import annotations

from typing import Any, Optional

import pandas as pd
import torch
from torch import Tensor

from interp_norm.anatomy._common import canonical, from_canonical  # noqa: F401 (public names)
from interp_norm.anatomy.describe import Anatomy
from interp_norm.anatomy.model_anatomy import anatomy
from interp_norm.anatomy.rebuild import (  # noqa: F401 (public names)
    attention_mask,
    layer_check,
    masked_softmax,
    rebuilt_query_key,
    rebuilt_scores,
    verify_anatomy,
)


def query_key(model: Any, cache: Any, layer: int, anat: Optional[Anatomy] = None) -> tuple[Tensor, Tensor]:
    """(q [b, p, n_heads, d], k [b, p, n_kv_heads, d]) exactly as the scores use them: after
    their norm and after RoPE."""
    return rebuilt_query_key(model, cache, anat or anatomy(model), layer)


def attention_scores(model: Any, cache: Any, layer: int, anat: Optional[Anatomy] = None, softcap: bool = True) -> Tensor:
    """Pre-mask scores [batch, head, query, key] of ``layer``, rebuilt from the cached q and k.

    On our models this is ``attn.scores(q_used, k_used)`` (the model's own step, calibration
    included); on a bridge ``score_scale · q·k`` with grouped key heads mapped by
    ``kv_head_of``, then the soft cap if the layer has one (``softcap=False``: before it, what
    multiplicative noise on q and k scales). Apply :func:`attention_mask` before a softmax.
    """
    return rebuilt_scores(model, cache, anat or anatomy(model), layer, softcap)


@torch.no_grad()
def verify_scores(model: Any, tokens: Tensor, anat: Optional[Anatomy] = None) -> pd.DataFrame:
    """Per layer: max |softmax(masked rebuilt scores) − hook_pattern| (``pattern_error``, ``ok``)
    and the same for the model's ``hook_attn_scores`` (``scores_hook_error``, ``scores_hook_ok``)."""
    anat = anat or anatomy(model)
    wanted = {h for la in anat.layers for h in la.hooks.values() if h}
    _, cache = model.run_with_cache(tokens, names_filter=lambda name: name in wanted)
    return pd.DataFrame([layer_check(model, anat, cache, l) for l in range(anat.n_layers)])


__all__ = ["canonical", "from_canonical", "attention_mask", "masked_softmax", "query_key", "attention_scores",
           "verify_anatomy", "verify_scores"]
