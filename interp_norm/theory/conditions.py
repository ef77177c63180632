"""Collapse conditions of one attention row: exact, first-order (Theorem 7) and small-angle forms."""

from __future__ import annotations

import math

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from interp_norm.errors import ConfigError, NoiseSpecError


# ----------------------------------------------------------------------------- validation


def _check_scores(scores: Tensor, name: str = "scores") -> Tensor:
    """Return float scores; -inf (masked) is allowed, NaN and +inf are not."""
    if not isinstance(scores, Tensor):
        scores = torch.as_tensor(np.asarray(scores, dtype=np.float64))
    if scores.ndim == 0:
        raise ConfigError(f"{name} must have a trailing key dimension [..., T], got a scalar")
    if not scores.is_floating_point():
        scores = scores.to(torch.get_default_dtype())
    if torch.isnan(scores).any() or torch.isposinf(scores).any():
        raise ConfigError(f"{name} contain NaN or +inf; pass finite scores with -inf for masked keys")
    return scores


def _check_kappa(kappa: Tensor, name: str) -> Tensor:
    if not isinstance(kappa, Tensor):
        kappa = torch.as_tensor(np.asarray(kappa, dtype=np.float64))
    if not kappa.is_floating_point():
        kappa = kappa.to(torch.get_default_dtype())
    if not torch.isfinite(kappa).all():
        raise NoiseSpecError(f"{name} must be finite (multiplicative factors 1+κ)")
    return kappa


def _tstar(scores: Tensor, tstar: Tensor | None, shape: torch.Size) -> Tensor:
    """Clean argmax t* (first maximum, like torch.argmax), broadcast to ``shape[:-1]``."""
    if tstar is None:
        tstar = scores.argmax(-1)
    else:
        tstar = torch.as_tensor(tstar)
        if tstar.is_floating_point() or tstar.dtype == torch.bool:
            raise ConfigError(f"tstar must hold integer key indices, got dtype {tstar.dtype}")
        T = shape[-1]
        if tstar.numel() and (tstar.min() < 0 or tstar.max() >= T):
            raise ConfigError(f"tstar must lie in [0, {T}) (the key dimension), got values outside it")
    try:
        return tstar.long().expand(shape[:-1])
    except RuntimeError as e:
        raise ConfigError(f"tstar of shape {tuple(tstar.shape)} does not broadcast to {tuple(shape[:-1])}") from e


def _broadcast(*tensors: Tensor) -> list[Tensor]:
    try:
        dtype = tensors[0].dtype
        for t in tensors[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
        return [t.to(dtype) for t in torch.broadcast_tensors(*tensors)]
    except RuntimeError as e:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise ConfigError(f"shapes {shapes} do not broadcast to a common [..., T]") from e


def _beats_tstar(noised: Tensor, masked: Tensor, tstar: Tensor) -> Bool[Tensor, "..."]:
    """∃ t ≠ t*, t unmasked: noised_t > noised_t* (strict: a tie is not a collapse)."""
    noised = noised.masked_fill(masked, -math.inf)
    star = noised.gather(-1, tstar.unsqueeze(-1))
    is_star = torch.arange(noised.shape[-1], device=noised.device) == tstar.unsqueeze(-1)
    others = noised.masked_fill(is_star, -math.inf)
    return (others > star).any(-1)


# ----------------------------------------------------------------------------- conditions


def collapse_condition_exact(
    scores: Float[Tensor, "... key"],
    kappa_k: Float[Tensor, "... key"],
    tstar: Int[Tensor, "..."] | None = None,
    *,
    kappa_q: Float[Tensor, "..."] | None = None,
) -> Bool[Tensor, "..."]:
    """Exact collapse test: ∃ t ≠ t*: (1+κ_t*)·w_t* < (1+κ_t)·w_t (Menary et al. 2024, Theorem 7 without
    the first-order expansion).

    Why the query factor cancels: noise multiplies every score of the row by the same
    (1+κ_q)(1+κ_t) w_t, and a positive common factor (1+κ_q > 0) rescales the row without
    reordering it (it only changes the temperature, Thm 10). So for 1+κ_q > 0 the argmax, and
    with it collapse, depends on the key factors alone; query noise alone can never collapse a
    circuit (λ_w = 1 in Thm 7). Pass ``kappa_q`` (shape [...]) only to cover 1+κ_q ≤ 0 (normal
    law): a negative factor reverses the order of the row.

    ``scores`` and ``kappa_k`` broadcast to [..., T]; ``tstar`` defaults to the clean argmax
    (first maximum). Masked (-inf) keys never win whatever the sign of their factor, and ties
    (equality) are not collapse. 1+κ_t ≤ 0 is allowed and handled literally.
    """
    scores = _check_scores(scores)
    kappa_k = _check_kappa(kappa_k, "kappa_k")
    w, k = _broadcast(scores, kappa_k)
    ts = _tstar(scores, tstar, w.shape)
    noised = (1.0 + k) * w
    if kappa_q is not None:
        kq = _check_kappa(kappa_q, "kappa_q")
        try:
            noised = (1.0 + kq.to(noised.dtype)).unsqueeze(-1) * noised
        except RuntimeError as e:
            raise ConfigError(f"kappa_q of shape {tuple(kq.shape)} must broadcast to the rows {tuple(w.shape[:-1])}") from e
        w = w.expand_as(noised)
        ts = ts.expand(noised.shape[:-1])
    return _beats_tstar(noised, torch.isneginf(w), ts)


def critical_ratio(
    kappa_k: Float[Tensor, "... key"],
    tstar: Int[Tensor, "..."],
    kappa_q: float | Float[Tensor, "..."] = 0.0,
) -> Float[Tensor, "... key"]:
    """Theorem 7's critical ratio λ_w = (1+κ_q+κ_t)/(1+κ_q+κ_t*), per key t."""
    kappa_k = _check_kappa(kappa_k, "kappa_k")
    kq = torch.as_tensor(kappa_q, dtype=kappa_k.dtype)
    if kq.ndim:
        kq = kq.unsqueeze(-1)
    ts = torch.as_tensor(tstar).long().expand(kappa_k.shape[:-1])
    k_star = kappa_k.gather(-1, ts.unsqueeze(-1))
    return (1.0 + kq + kappa_k) / (1.0 + kq + k_star)


def collapse_condition_first_order(
    scores: Float[Tensor, "... key"],
    kappa_k: Float[Tensor, "... key"],
    tstar: Int[Tensor, "..."] | None = None,
    *,
    kappa_q: float | Float[Tensor, "..."] = 0.0,
) -> Bool[Tensor, "..."]:
    """Theorem 7 (first order, ε^w_t = (κ_q+κ_t) w_t): collapse iff some t ≠ t* has
    w_t*/w_t < λ_w when w_t(1+κ_q+κ_t*) > 0, and w_t*/w_t > λ_w otherwise.

    Evaluated in the equivalent division-free form (1+κ_q+κ_t*)·w_t* < (1+κ_q+κ_t)·w_t (multiply
    the ratio inequality by w_t(1+κ_q+κ_t*); its sign picks the direction), which is also defined
    for w_t = 0. It keeps κ_q, which the exact condition cancels, so the two disagree at O(κ_q κ)
    and agree exactly when κ_q = 0.
    """
    scores = _check_scores(scores)
    kappa_k = _check_kappa(kappa_k, "kappa_k")
    kq = _check_kappa(torch.as_tensor(kappa_q, dtype=kappa_k.dtype), "kappa_q")
    if kq.ndim:
        kq = kq.unsqueeze(-1)
    w, k = _broadcast(scores, kappa_k)
    ts = _tstar(scores, tstar, w.shape)
    noised = (1.0 + kq + k) * w
    w = w.expand_as(noised)
    ts = ts.expand(noised.shape[:-1])
    return _beats_tstar(noised, torch.isneginf(w), ts)


def small_angle_threshold(theta: Float[Tensor, "..."] | float) -> Float[Tensor, "..."] | float:
    """δ = ½θ²: the κ difference needed to swap two equal-norm keys at angles θ and 0 to q
    (Thm 7's small-angle lemma, from cos θ ≈ 1 − ½θ²)."""
    return 0.5 * theta * theta


def collapse_condition_small_angle(
    theta: Float[Tensor, "... key"],
    kappa_k: Float[Tensor, "... key"],
    tstar: Int[Tensor, "..."] | None = None,
) -> Bool[Tensor, "..."]:
    """Theorem 7's small-angle lemma: collapse iff ∃ t ≠ t*: ½θ_t² − ½θ_t*² < κ_t − κ_t*.

    ``theta`` [..., T] are the angles between q and the (equal-norm) keys, t* = smallest angle by
    default. The paper states ½θ_t² ≲ κ_t − κ_t* with θ_t* ≈ 0; keeping ½θ_t*² is the same
    second-order expansion and reduces to it when θ_t* = 0. Valid for θ ≪ 1 (w_t > 0) and small
    κ; non-finite angles mark masked keys, which never win.
    """
    theta = torch.as_tensor(theta)
    if not theta.is_floating_point():
        theta = theta.to(torch.get_default_dtype())
    kappa_k = _check_kappa(kappa_k, "kappa_k")
    th, k = _broadcast(theta, kappa_k)
    masked = ~torch.isfinite(th)
    if tstar is None:
        tstar = th.masked_fill(masked, math.inf).argmin(-1)
    ts = _tstar(th, tstar, th.shape)
    # score proxy: κ_t − ½θ_t²; collapse iff a competitor's proxy beats t*'s
    proxy = k - small_angle_threshold(th.masked_fill(masked, 0.0))
    return _beats_tstar(proxy, masked, ts)
