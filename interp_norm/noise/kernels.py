"""The noise kernels every model shares: the seeded generator, κ draws, and the factor after a norm.

One copy each, used by :class:`~interp_norm.noise.NormNoise` (hooks), the collapse measurements on
our models (:mod:`interp_norm.noise.collapse`) and on any described model
(:mod:`interp_norm.noise.rows`). The noise model is Menary et al. (2024) §2.3: a vector x becomes
(1+κ)·x with κ drawn per (example, position, head).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from interp_norm import theory
from interp_norm.anatomy import LayerAnatomy
from interp_norm.errors import ArchitectureError
from interp_norm.noise import _validate as V


def seeded_generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded from a tuple of non-negative ints (NumPy's SeedSequence mixing)."""
    state = np.random.SeedSequence([int(k) for k in keys]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state) & 0x7FFF_FFFF_FFFF_FFFF)


def unit_noise(
    shape: Sequence[int], generator: torch.Generator, distribution: str = "uniform", dtype: torch.dtype = torch.float32
) -> Tensor:
    """Draws z with RMS 1 (uniform on ±√3 or standard normal); κ = level · z has RMS ``level``."""
    return theory.sample_kappa(shape, generator, V.check_distribution(distribution), 1.0, dtype=dtype)


def pass_noise(seed: int, layer: int, target: str, call: int, shape: Sequence[int], *, distribution: str = "uniform",
               dtype: torch.dtype = torch.float32) -> Tensor:
    """Unit-RMS z of forward pass ``call`` at (layer, target): the stream of every noise hook, seeded by
    ``(seed, layer, target code, call)`` so draws do not depend on which other sites are noised."""
    return unit_noise(shape, seeded_generator(seed, layer, V.TARGET_CODE[target], call), distribution, dtype)


#: Seed streams of the collapse sweeps' draws (ours: one generator per layer for z_q then z_k; bridges:
#: one per (layer, target), z_k seeded by the layer whose keys are read). Kept as each sweep had them:
#: changing one changes every collapse table of that kind of model.
OWN_COLLAPSE_STREAM = 0xC011A95E
BRIDGE_COLLAPSE_STREAM = 0xB21C0


def collapse_draws(q_shape: Sequence[int], k_shape: Sequence[int], q_keys: tuple[int, ...],
                   k_keys: tuple[int, ...] | None = None, *, distribution: str = "uniform") -> tuple[Tensor, Tensor]:
    """Unit-RMS draws (z_q, z_k) of one layer of a collapse sweep; κ = level · z at every level (common
    random numbers: curves are smooth in the level). z_q comes from a generator seeded by ``q_keys``;
    z_k from its own stream ``k_keys`` (a KV-sharing layer reads its source's keys and their κ), or
    next from z_q's generator when ``k_keys`` is None."""
    g = seeded_generator(*q_keys)
    z_q = unit_noise(q_shape, g, distribution)
    return z_q, unit_noise(k_shape, g if k_keys is None else seeded_generator(*k_keys), distribution)


def norm_factor(one: Tensor, root: Tensor, m: Tensor, eps: float) -> Tensor:
    """f = (1+κ)·s / √((1+κ)²·m + eps) with s = √(m + eps) the clean divisor: what a norm whose divisor
    is s leaves of a factor (1+κ) applied before it (→ sign(1+κ) as eps → 0: removed by the norm)."""
    return one * root / torch.sqrt(one * one * m + eps)


def effective_factor(kappa: Tensor, scale: Tensor, eps: float) -> Tensor:
    """What noise (1+κ) on x *before* a norm leaves on the normalised vector.

    With divisor s = sqrt(m + eps) (m = mean(x²), or the variance for LayerNorm; both scale by
    (1+κ)²), N((1+κ)x) = f · N(x) with f = (1+κ)·s / sqrt((1+κ)²(s² − eps) + eps). So f → sign(1+κ)
    as eps → 0: the norm removes the noise "by construction", and only an eps-sized residue
    (|f − 1| ≲ |κ|·eps/m) survives. ``scale`` is the clean ``hook_{q,k,v}_scale``.
    """
    one = 1.0 + kappa
    m = (scale * scale - eps).clamp(min=0.0)
    return norm_factor(one, scale, m, eps)


def effective_factors(la: LayerAnatomy, target: str, kappa: Tensor, raw: Tensor) -> Tensor:
    """What (1+κ) applied *before* ``target``'s norm leaves on its output, per head (float64).

    ``raw`` is the clean projection output [b, p, h, d] (canonical), ``kappa`` [..., b, p, h]
    (leading draw dimensions allowed). With m the clean mean square (variance for LayerNorm):
    per-head norm f = (1+κ)·√(m+eps)/√((1+κ)²m+eps) (:func:`norm_factor`; → sign(1+κ) as eps → 0:
    removed); all-heads RMS norm f_h = (1+κ_h)·√(M+eps)/√(M'+eps), M = mean_h m_h,
    M' = mean_h (1+κ_h)² m_h. No norm: 1+κ.
    """
    one = 1.0 + kappa.to(torch.float64)
    norm = la.norms.get(target)
    if norm is None:
        return one
    x = raw.to(torch.float64)
    if norm.kind == "ln":
        if norm.axis == "all_heads":
            raise ArchitectureError("per-head noise before a LayerNorm over all heads is not a per-head factor (the mean mixes heads)")
        x = x - x.mean(-1, keepdim=True)
    m = x.pow(2).mean(-1)  # [b, p, h]
    if norm.axis == "per_head":
        return norm_factor(one, (m + norm.eps).sqrt(), m, norm.eps)
    M = m.mean(-1, keepdim=True)
    M_noised = (one * one * m).mean(-1, keepdim=True)
    return one * (M + norm.eps).sqrt() / (M_noised + norm.eps).sqrt()  # float64: f − 1 is often below float32 resolution


def placed_factors(la: LayerAnatomy, target: str, kappa: Tensor, raw: Tensor | None, placement: str) -> Tensor:
    """Factor (float64) that κ at ``placement`` leaves on the q or k the scores use: 1+κ after the norm
    or where there is none, else :func:`effective_factors` of the clean projection ``raw``."""
    if placement == "after_norm" or la.norms.get(target) is None:
        return 1.0 + kappa.to(torch.float64)
    return effective_factors(la, target, kappa, raw)


__all__ = ["seeded_generator", "unit_noise", "pass_noise", "collapse_draws", "OWN_COLLAPSE_STREAM", "BRIDGE_COLLAPSE_STREAM", "norm_factor", "effective_factor", "effective_factors",
           "placed_factors"]
