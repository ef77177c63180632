"""Edges out of heads whose attention output is normalised before it joins the residual (post-norm).

OLMo-2 and Gemma 4 add ``N(sum_h c_h + b_O)`` to the residual, ``c_h = z_h W_O[h]`` head ``h``'s
output and ``N`` the post-attention norm, so a head's write is not a term of a sum. We keep the
sender a head (the norm is part of its path) and define edge ``h -> r`` by what receiver ``r`` sees
when head ``h`` alone changes: ``N(S) - N(S - (c_h - c_h'))`` with ``S`` this pass's pre-norm sum.
Its first-order effect is ``J_N(S) (c_h' - c_h)``, the Jacobian-vector product that edge
attribution uses as the sender's difference. Choice: with several heads of one post-norm layer
corrected for the same receiver (a circuit, not a single edge), the single-head changes add; the
joint change through the norm differs from that sum at second order.

With the norms' scales frozen (``norm="frozen"``, :mod:`~interp_norm.circuits.norm_modes`) the norm
is ``w * P(x) / s + b`` with ``s`` a constant (``P`` the centring of a LayerNorm, the identity for an
RMSNorm), linear in its input, so the sender's difference becomes ``w * P(c_h' - c_h) / s``
(:func:`held_scale_head_deltas`). Choice: ``s`` is the scale of ``S``, the pre-norm sum of the very
pass whose backward the freeze hooks detach -- the run differentiated, each integration point's rows
for EAP-IG -- computed as they compute it (``sqrt(mean(P(S)^2) + eps)``, in float32 or wider), so the
sender's path and the receivers' gradients hold one and the same scale. ``S`` is the edge runner's
own ``sum_h z_h W_O[h] + b_O``, equal to the norm's input in that pass up to the rounding of the sum.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from interp_norm.anatomy import norm_eps
from interp_norm.errors import PatchingError


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


def held_scale_head_deltas(norm: Callable[[Tensor], Tensor], delta: Tensor, S: Tensor) -> Tensor:
    """[H, ...]: ``w * P(delta_h) / s(S)``, each head's difference through the norm with its scale held
    at its value at ``S`` (the module docstring says which ``S``). The norm must compute
    ``w * P(x) / s(x) + b`` (checked on ``S`` itself; a typed error otherwise, e.g. a ``1 + w`` gain)."""
    w_over_s, centred = _held_gain(norm, S)
    d = delta.to(w_over_s.dtype)
    if centred:
        d = d - d.mean(-1, keepdim=True)
    return (d * w_over_s.unsqueeze(0)).to(delta.dtype)


def _held_gain(norm: Callable[[Tensor], Tensor], S: Tensor) -> tuple[Tensor, bool]:
    """(``w / s(S)`` [..., d] in float32 or wider, whether the norm centres), read from the module's
    weight and epsilon and checked against the module's own output on ``S`` to float32 rounding."""
    mod = getattr(norm, "original_component", norm)
    eps = norm_eps(mod)
    w = getattr(mod, "weight", None) if getattr(mod, "with_scale", True) else None
    b = getattr(mod, "bias", None)
    if eps is None or (w is not None and not isinstance(w, Tensor)) or (b is not None and not isinstance(b, Tensor)):
        raise PatchingError(f"the post-norm {type(mod).__name__} has no numeric epsilon or tensor gain, so its "
                            "scale cannot be held for norm='frozen' edges; use norm='live'")
    centred = isinstance(mod, torch.nn.LayerNorm) or b is not None
    xf = S.detach().to(torch.promote_types(S.dtype, torch.float32))
    xc = xf - xf.mean(-1, keepdim=True) if centred else xf
    inv = (xc.pow(2).mean(-1, keepdim=True) + eps).pow(-0.5)
    gain = inv if w is None else inv * w.detach().to(xf.dtype)
    want = xc * gain + (0 if b is None else b.detach().to(xf.dtype))
    with torch.no_grad():
        got = norm(S.detach()).to(xf.dtype)
    if float((got - want).abs().max()) > 64 * torch.finfo(torch.float32).eps * (float(want.abs().max()) + 1):
        raise PatchingError(f"the post-norm {type(mod).__name__} does not compute w * x / sqrt(mean(x^2) + eps) (+ b, "
                            "centred for a LayerNorm), so its scale cannot be held for norm='frozen' edges; use norm='live'")
    return gain, centred


__all__ = ["post_attention_norms", "single_head_changes", "linearised_head_deltas", "held_scale_head_deltas"]
