"""The noise law: multiplicative noise 1+κ on the norms of q and k, and the one κ sampler."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence, Union

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from interp_norm.core.defaults import DISTRIBUTIONS
from interp_norm.errors import NoiseSpecError

_SQRT3 = math.sqrt(3.0)
_NORMAL_RANGE = 8.0  # integrate the normal law over ±8σ (tail mass 1.2e-15)
_MAX_ELEMS = 1 << 22  # memory budget (elements) for one vectorised block

ArrayLike = Union[Tensor, np.ndarray, float, Sequence[float]]


# ----------------------------------------------------------------------------- noise law


@dataclass(frozen=True)
class NoiseLaw:
    """Law of one multiplicative norm factor κ, as in v → (1+κ) v.

    ``level`` is the RMS of κ, the x-axis of the paper's noise figures. ``"uniform"`` is the
    paper's choice ("to avoid outliers"): κ ~ U(−a, a) with half-width a = √3·level, which needs
    a < 1 so that 1+κ > 0 (a norm cannot change sign). ``"normal"`` is κ ~ N(0, level²); any level
    is accepted, but then 1+κ < 0 with probability Φ(−1/level) (≈ 1e-23 at level 0.1, 2.3% at
    0.5), which flips the vector. :func:`predicted_collapse_probability` accounts for that.
    """

    level: float
    distribution: Literal["uniform", "normal"] = "uniform"

    def __post_init__(self) -> None:
        level = self.level
        if isinstance(level, Tensor):
            if level.numel() != 1:
                raise NoiseSpecError(f"noise level must be a scalar, got a tensor of shape {tuple(level.shape)}")
            level = level.item()
        if isinstance(level, bool) or not isinstance(level, (int, float, np.integer, np.floating)):
            raise NoiseSpecError(f"noise level must be a real number (the RMS of κ), got {level!r}")
        level = float(level)
        if not math.isfinite(level) or level < 0:
            raise NoiseSpecError(f"noise level must be finite and >= 0 (the RMS of κ), got {level}")
        if self.distribution not in DISTRIBUTIONS:
            raise NoiseSpecError(
                f"unknown noise distribution {self.distribution!r}; use one of {DISTRIBUTIONS}"
            )
        if self.distribution == "uniform" and _SQRT3 * level >= 1.0:
            raise NoiseSpecError(
                f"uniform noise level {level} has half-width √3·level = {_SQRT3 * level:.4g} >= 1, so "
                f"1+κ could be <= 0 and flip a norm's sign; use level < 1/√3 ≈ {1 / _SQRT3:.4f} "
                "or distribution='normal'"
            )
        object.__setattr__(self, "level", level)

    # -- parameters
    @property
    def half_width(self) -> float:
        """a = √3·level for the uniform law (RMS of U(−a, a) is a/√3); ``inf`` for the normal law."""
        return _SQRT3 * self.level if self.distribution == "uniform" else math.inf

    @property
    def std(self) -> float:
        """Standard deviation (= RMS = ``level``) of κ."""
        return self.level

    @property
    def prob_negative_factor(self) -> float:
        """P(1+κ < 0): 0 for the uniform law, Φ(−1/σ) for the normal law."""
        if self.distribution == "uniform" or self.level == 0:
            return 0.0
        return 0.5 * math.erfc(1.0 / (self.level * math.sqrt(2.0)))

    def _range(self) -> tuple[float, float]:
        """Interval of κ the quadrature integrates over (support, or ±8σ)."""
        if self.distribution == "uniform":
            return -self.half_width, self.half_width
        return -_NORMAL_RANGE * self.level, _NORMAL_RANGE * self.level

    def _kink_offsets(self) -> tuple[float, ...]:
        """Values of κ where the cdf has a kink (uniform) or most of its curvature (normal)."""
        if self.distribution == "uniform":
            return (-self.half_width, self.half_width)
        return (-3.0 * self.level, 0.0, 3.0 * self.level)

    # -- sampling and distribution functions
    def sample(
        self,
        shape: Sequence[int] | torch.Size,
        generator: torch.Generator | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> Float[Tensor, "*shape"]:
        """Draw i.i.d. κ of the given shape (default dtype: torch's default float dtype)."""
        return sample_kappa(shape, generator, self.distribution, self.level, dtype=dtype, device=device)

    def _cdf_t(self, x: Tensor) -> Tensor:
        if self.level == 0:
            return (x >= 0).to(x.dtype)
        if self.distribution == "uniform":
            a = self.half_width
            return ((x + a) / (2 * a)).clamp(0.0, 1.0)
        return torch.special.ndtr(x / self.level)

    def _pdf_t(self, x: Tensor) -> Tensor:
        if self.level == 0:  # a point mass at 0: report it as an infinite spike
            return torch.where(x == 0, torch.full_like(x, math.inf), torch.zeros_like(x))
        if self.distribution == "uniform":
            a = self.half_width
            return torch.where(x.abs() <= a, torch.full_like(x, 1.0 / (2 * a)), torch.zeros_like(x))
        s = self.level
        return torch.exp(-0.5 * (x / s) ** 2) / (s * math.sqrt(2 * math.pi))

    def cdf(self, x: ArrayLike) -> Tensor | np.ndarray:
        """P(κ ≤ x), vectorised. Tensor in → tensor out; numpy/float in → numpy out."""
        return _apply(self._cdf_t, x)

    def pdf(self, x: ArrayLike) -> Tensor | np.ndarray:
        """Density of κ at x (level 0: ``inf`` at 0, else 0). Tensor in → tensor out."""
        return _apply(self._pdf_t, x)


def _apply(fn, x: ArrayLike) -> Tensor | np.ndarray:
    if isinstance(x, Tensor):
        out_dtype = x.dtype if x.is_floating_point() else torch.get_default_dtype()
        return fn(x.to(torch.float64)).to(out_dtype)
    return fn(torch.as_tensor(np.asarray(x, dtype=np.float64))).numpy()


def sample_kappa(
    shape: Sequence[int] | torch.Size,
    generator: torch.Generator | None = None,
    distribution: str = "uniform",
    rms: float = 1.0,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Float[Tensor, "*shape"]:
    """The one κ sampler: i.i.d. draws with RMS ``rms``, uniform on ±√3·rms or N(0, rms²).

    :meth:`NoiseLaw.sample` (``rms`` = level) and the noise hooks' unit draws (``rms`` = 1, then
    κ = level·z) both call it, so a seeded generator gives the same numbers everywhere. It lives
    here, below :mod:`interp_norm.noise`, because the hooks import this module, not the reverse.
    """
    if distribution not in DISTRIBUTIONS:
        raise NoiseSpecError(f"unknown noise distribution {distribution!r}; use one of {DISTRIBUTIONS}")
    shape = tuple(shape)
    dtype = dtype or torch.get_default_dtype()
    if distribution == "uniform":
        r = torch.rand(shape, generator=generator, dtype=dtype, device=device)
        return (2.0 * r - 1.0) * (_SQRT3 * rms)
    return torch.randn(shape, generator=generator, dtype=dtype, device=device) * rms


def _as_law(law: NoiseLaw) -> NoiseLaw:
    if not isinstance(law, NoiseLaw):
        raise NoiseSpecError(f"expected a NoiseLaw (e.g. NoiseLaw(0.1, 'uniform')), got {law!r}")
    return law
