"""Edges out of heads whose attention output is normalised before it joins the residual (post-norm).

OLMo-2 and Gemma 4 add ``N(sum_h c_h + b_O)`` to the residual, ``c_h = z_h W_O[h]`` head ``h``'s
output and ``N`` the post-attention norm, so a head's write is not a term of a sum. We keep the
sender a head (the norm is part of its path) and define edge ``h -> r`` by what receiver ``r`` sees
when head ``h`` alone changes: ``N(S) - N(S - (c_h - c_h'))`` with ``S`` this pass's pre-norm sum.
Its first-order effect is ``J_N(S) (c_h' - c_h)``, the Jacobian-vector product that edge
attribution uses as the sender's difference. Choice: with several heads of one post-norm layer
corrected for the same receiver (a circuit, not a single edge), the single-head changes add; the
joint change through the norm differs from that sum at second order.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor


def post_attention_norms(model: Any, anat: Any) -> list[Optional[Callable[[Tensor], Tensor]]]:
    """Per layer: the post-attention norm module (the original Hugging Face one, no hooks) or None."""
    return [None if la.post_norm is None else model.get_submodule(la.post_norm.module) for la in anat.layers]


def single_head_changes(norm: Callable[[Tensor], Tensor], res: Tensor, ablated: Tensor, bias: Optional[Tensor]) -> Tensor:
    """[H, ...]: the residual change when head h alone moves from ``ablated[h]`` to ``res[h]``,
    ``N(S) - N(S - (res_h - ablated_h))`` with ``S = sum_h res_h + bias``."""
    S = res.sum(0) if bias is None else res.sum(0) + bias.to(res.dtype)
    moved = S.unsqueeze(0) - (res - ablated.to(res.dtype))
    return norm(S).unsqueeze(0) - norm(moved)


def linearised_head_deltas(norm: Callable[[Tensor], Tensor], delta: Tensor, S: Tensor) -> Tensor:
    """[H, ...]: ``J_N(S) delta_h``, the norm's Jacobian at the pre-norm attention output ``S`` applied
    to each head's difference (first order of :func:`single_head_changes`)."""
    x = S.unsqueeze(0).expand_as(delta).to(delta.dtype).contiguous()
    with torch.enable_grad():
        return torch.func.jvp(norm, (x,), (delta,))[1]


__all__ = ["post_attention_norms", "single_head_changes", "linearised_head_deltas"]
