"""Circuit-collapse theory: pure functions of attention scores and a noise law.

Nothing here touches a model or a hook. The inputs are the clean pre-softmax scores of attention
rows (``hook_attn_scores``: already scaled, masked keys set to ``-inf``), a multiplicative noise
law on the norms of q and k_t, or attention patterns. Everything follows Menary, Kaski & Freitas
(2024), digest §1–2:

* Pre-Norm interference is modelled as multiplicative noise on the norms, q → (1+κ_q) q and
  k_t → (1+κ_t) k_t, so a score becomes w_t → (1+κ_q)(1+κ_t) w_t (Theorem 7's model).
* **Circuit collapse**: a sparse distribution (max_t a_t ≥ 95%) picks another token because of
  the noise. The "loose" definition only asks that the argmax changes; the "strict" one also asks
  that the new token gets ≥ 95% attention (digest §3.6).

Why exact formulas rather than only Theorem 7's first-order one: the query factor (1+κ_q)
multiplies every score in a row, so for 1+κ_q > 0 it cancels exactly from the argmax. The
first-order form keeps κ_q in λ_w and so disagrees with the true argmax at finite noise.

Masked keys must be ``-inf`` (as in ``HookedNormTransformer``). A finite sentinel such as −1e5 is
treated as a real (very negative) score; under normal noise with 1+κ_q < 0 such a key could win.
Scores must not have been shifted by a constant: softmax ignores shifts, multiplicative noise
does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence, Union

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from interp_norm.errors import ConfigError, NoiseSpecError
from interp_norm.hooks import NONSPARSE_THRESHOLD, SPARSE_THRESHOLD

__all__ = [
    "DISTRIBUTIONS",
    "NoiseLaw",
    "sample_kappa",
    "collapse_condition_exact",
    "collapse_condition_first_order",
    "critical_ratio",
    "small_angle_threshold",
    "collapse_condition_small_angle",
    "predicted_collapse_probability",
    "predicted_collapse_probability_strict",
    "collapse_probability_small_angle",
    "noise_level_at_rate",
    "sparse_mask",
    "nonsparse_mask",
]

DISTRIBUTIONS = ("uniform", "normal")
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
    """Exact collapse test: ∃ t ≠ t*: (1+κ_t*)·w_t* < (1+κ_t)·w_t (digest §2.5, Thm 7 without
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


# ----------------------------------------------------------------------------- probabilities


def _score_rows(scores: Tensor) -> tuple[Tensor, torch.Size, torch.dtype]:
    """Validated scores as float64 rows [R, T], with the batch shape and dtype to restore."""
    scores = _check_scores(scores)
    return scores.detach().to(torch.float64).reshape(-1, scores.shape[-1]), scores.shape[:-1], scores.dtype


def predicted_collapse_probability(
    scores: Float[Tensor, "... key"],
    law: NoiseLaw,
    include_query_noise: bool = True,
    *,
    nodes_per_panel: int = 8,
) -> Float[Tensor, "..."]:
    """Exact P(argmax changes) per row ("loose" collapse) under i.i.d. key noise κ_t ~ ``law``.

    Why a 1-D integral suffices: given u = κ_t*, the events "t beats t*" for different t are
    independent, so P(no collapse) = ∫ Π_{t≠t*} F_t(u) p(u) du with
    F_t(u) = P((1+κ_t) w_t ≤ (1+u) w_t*), i.e. with c = (1+u) w_t*:
    cdf(c/w_t − 1) if w_t > 0, 1 − cdf(c/w_t − 1) if w_t < 0, [c ≥ 0] if w_t = 0, and 1 for
    masked keys. The query factor cancels for 1+κ_q > 0 (:func:`collapse_condition_exact`); with
    ``include_query_noise`` and the normal law, the branch 1+κ_q < 0 (probability Φ(−1/σ)), where
    the row's order reverses, is added exactly. For the uniform law the flag changes nothing.

    Quadrature: Gauss–Legendre with ``nodes_per_panel`` nodes on panels split at every kink of
    every F_t (uniform: where c/w_t − 1 = ±a) or at the centre and ±3σ of every F_t (normal), and
    at u = −1; keys that cannot beat t* anywhere are dropped first. For the uniform law the
    integrand is a polynomial on each panel, so the result is exact up to rounding when a panel
    has < 2·nodes_per_panel varying factors (else ~1e-8); for the normal law (range ±8σ) the
    error was ≤ 5e-7 against 48 nodes per panel on dense, sparse and near-zero-score rows.
    Vectorised over rows (blocks bounded in memory). Scale-invariant: multiplying a row by a
    positive constant does not change it.
    Rows with no competitor (fully masked, single key) or level 0 give 0. The paper conditions on
    clean sparse rows (max a ≥ 95%); select them with :func:`sparse_mask` first.
    """
    law = _as_law(law)
    if not isinstance(nodes_per_panel, int) or nodes_per_panel < 1:
        raise ConfigError(f"nodes_per_panel must be a positive int, got {nodes_per_panel!r}")
    w, batch, out_dtype = _score_rows(scores)
    R, T = w.shape
    result = torch.zeros(R, dtype=torch.float64, device=w.device)
    if R == 0 or T < 2 or law.level == 0:
        return result.to(out_dtype).reshape(batch)
    q_neg = law.prob_negative_factor if include_query_noise else 0.0
    x, wq = np.polynomial.legendre.leggauss(nodes_per_panel)
    x = torch.as_tensor(x, dtype=torch.float64, device=w.device)
    wq = torch.as_tensor(wq, dtype=torch.float64, device=w.device)
    n_bp = T * len(law._kink_offsets()) + 6
    rows_per_block = max(1, _MAX_ELEMS // ((n_bp + 1) * nodes_per_panel))
    for r0 in range(0, R, rows_per_block):  # memory blocks, each fully vectorised
        result[r0 : r0 + rows_per_block] = _collapse_block(w[r0 : r0 + rows_per_block], law, q_neg, x, wq)
    return result.clamp(0.0, 1.0).to(out_dtype).reshape(batch)


def _survival_factors(law: NoiseLaw, wt: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """F = P((1+κ_t) w_t ≤ c) and G = P((1+κ_t) w_t ≥ c) for i.i.d. κ_t (broadcasting)."""
    safe = torch.where(wt == 0, torch.ones_like(wt), wt)
    cdf = law._cdf_t(c / safe - 1.0)
    pos, neg = wt > 0, wt < 0
    F = torch.where(pos, cdf, torch.where(neg, 1.0 - cdf, (c >= 0).to(cdf.dtype)))
    G = torch.where(pos, 1.0 - cdf, torch.where(neg, cdf, (c <= 0).to(cdf.dtype)))
    return F, G


def _collapse_block(w: Tensor, law: NoiseLaw, q_neg: float, x: Tensor, wq: Tensor) -> Tensor:
    R, T = w.shape
    dev = w.device
    f64 = dict(dtype=torch.float64, device=dev)
    masked = torch.isneginf(w)
    tstar = w.argmax(-1)
    wstar = w.gather(-1, tstar[:, None])  # [R, 1]
    keys = torch.arange(T, device=dev)
    active = ~masked & (keys != tstar[:, None]) & ~torch.isneginf(wstar)
    live = active.any(-1)
    lo, hi = law._range()

    # Drop keys that cannot beat t* anywhere in the range (F ≡ 1, so G ≡ 0): F and G are
    # monotone in u, so checking both ends suffices. Such a key also kills the 1+κ_q < 0 branch.
    c_end = (1.0 + torch.tensor([lo, hi], **f64)) * wstar  # [R, 2]
    F_end, G_end = _survival_factors(law, w[:, None, :], c_end[..., None])  # [R, 2, T]
    trivial = active & (F_end.amin(1) == 1.0) & (G_end.amax(1) == 0.0)
    keep = active & ~trivial
    neg_dead = trivial.any(-1)
    order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)
    T_eff = int(keep.sum(-1).max().item())
    w = w.gather(-1, order[:, :T_eff])
    keep = keep.gather(-1, order[:, :T_eff])

    # panel edges: kinks of each F_t as a function of u, plus fixed points
    offs = torch.tensor(law._kink_offsets(), **f64)
    ratio = torch.where(keep & (wstar != 0), w / wstar, torch.full_like(w, math.nan))
    bp = ((1.0 + offs) * ratio[..., None] - 1.0).reshape(R, -1)
    fixed = [-1.0]
    if law.distribution == "normal":
        s = law.level
        fixed += [-4 * s, -2 * s, 0.0, 2 * s, 4 * s]
    bp = torch.cat([bp, torch.tensor(fixed, **f64).expand(R, -1)], dim=1)
    inside = torch.isfinite(bp) & (bp > lo) & (bp < hi)
    bp = torch.where(inside, bp, torch.full_like(bp, math.inf)).sort(-1).values
    K = int(inside.sum(-1).max().item())
    bp = bp[:, :K].clamp(max=hi)
    edges = torch.cat([torch.full((R, 1), lo, **f64), bp, torch.full((R, 1), hi, **f64)], dim=1)
    a, b = edges[:, :-1, None], edges[:, 1:, None]  # [R, K+1, 1]
    half = 0.5 * (b - a)
    u = (a + half * (x + 1.0)).reshape(R, -1)  # [R, N]
    du = (half * wq).reshape(R, -1)
    weight = law._pdf_t(u) * du
    c = (1.0 + u) * wstar  # [R, N]: t*'s noised score / (1+κ_q)

    prod_pos = torch.ones_like(u)
    prod_neg = torch.ones_like(u) if q_neg > 0 else None
    N = u.shape[1]
    kb = max(1, _MAX_ELEMS // max(1, R * N))
    for k0 in range(0, T_eff, kb):  # key blocks (not rows), each vectorised over rows and nodes
        act = keep[:, None, k0 : k0 + kb]
        F, G = _survival_factors(law, w[:, None, k0 : k0 + kb], c[..., None])
        prod_pos *= torch.where(act, F, torch.ones_like(F)).prod(-1)
        if prod_neg is not None:  # 1+κ_q < 0 reverses the row: t* survives iff it is the minimum
            prod_neg *= torch.where(act, G, torch.ones_like(G)).prod(-1)
    p_survive = (prod_pos * weight).sum(-1)
    if prod_neg is not None:
        p_neg = torch.where(neg_dead, torch.zeros_like(p_survive), (prod_neg * weight).sum(-1))
        p_survive = (1.0 - q_neg) * p_survive + q_neg * p_neg
    return torch.where(live, 1.0 - p_survive, torch.zeros_like(p_survive))


def predicted_collapse_probability_strict(
    scores: Float[Tensor, "... key"],
    law: NoiseLaw,
    threshold: float = SPARSE_THRESHOLD,
    n_samples: int = 20_000,
    generator: torch.Generator | None = None,
    *,
    include_query_noise: bool = True,
    return_stderr: bool = False,
) -> Float[Tensor, "..."] | tuple[Float[Tensor, "..."], Float[Tensor, "..."]]:
    """Monte-Carlo P(argmax changes AND the new top token gets ≥ ``threshold`` attention), the
    paper's "strict" collapse (digest §3.6).

    Why Monte-Carlo: the strict event depends on the whole noised softmax, not only on the order
    of the scores, so the 1-D reduction of :func:`predicted_collapse_probability` does not apply.
    It also depends on the temperature: each sample multiplies the row by (1+κ_q) (query noise
    rescales every score, Thm 10) and by (1+κ_t) per key, so ``scores`` must be the actual
    pre-softmax scores (after 1/√d_head or any calibration factor). The estimate has standard
    error sqrt(p(1−p)/n_samples) per row (returned second with ``return_stderr``).
    """
    law = _as_law(law)
    if not (isinstance(n_samples, int) and n_samples >= 1):
        raise ConfigError(f"n_samples must be a positive int, got {n_samples!r}")
    if not (0.0 < float(threshold) <= 1.0):
        raise ConfigError(f"threshold must be in (0, 1], got {threshold}")
    w, batch, out_dtype = _score_rows(scores)
    R, T = w.shape
    masked = torch.isneginf(w)
    tstar = w.argmax(-1)
    hits = torch.zeros(R, dtype=torch.float64, device=w.device)
    chunk = max(1, _MAX_ELEMS // max(1, R * T))
    done = 0
    while done < n_samples and R > 0:
        s = min(chunk, n_samples - done)
        kk = law.sample((s, R, T), generator, dtype=torch.float64, device=w.device)
        noised = (1.0 + kk) * w
        if include_query_noise:
            noised = noised * (1.0 + law.sample((s, R, 1), generator, dtype=torch.float64, device=w.device))
        noised = noised.masked_fill(masked, -math.inf)
        top = noised.argmax(-1)  # [s, R]
        p_top = torch.softmax(noised, -1).gather(-1, top[..., None]).squeeze(-1)
        hits += ((top != tstar) & (p_top >= threshold)).sum(0).to(torch.float64)
        done += s
    p = hits / n_samples
    p = p.to(out_dtype).reshape(batch)
    if return_stderr:
        return p, (p * (1 - p) / n_samples).sqrt()
    return p


def collapse_probability_small_angle(
    delta: Float[Tensor, "..."] | float | np.ndarray, law: NoiseLaw
) -> Float[Tensor, "..."] | np.ndarray:
    """P(κ_t − κ_t* > δ) for i.i.d. κ ~ ``law``: the per-token collapse probability of the
    small-angle lemma with δ = ½θ_t² (digest §2.5).

    Uniform, a = √3·level: κ_t − κ_t* is triangular on [−2a, 2a], so the tail is
    (2a − δ)²/(8a²) for 0 ≤ δ ≤ 2a, 0 for δ ≥ 2a, and 1 − (2a + δ)²/(8a²) for −2a ≤ δ < 0.
    Normal: the difference is N(0, 2σ²), so 1 − Φ(δ/(√2σ)). Per competitor; with several
    competitors 1 − Π(1 − p_t) is only approximate because κ_t* is shared (use
    :func:`predicted_collapse_probability` for the exact value).
    """
    law = _as_law(law)

    def f(d: Tensor) -> Tensor:
        if law.level == 0:
            return (d < 0).to(d.dtype)
        if law.distribution == "normal":
            return torch.special.ndtr(-d / (math.sqrt(2.0) * law.level))
        a = law.half_width
        tail = (2 * a - d.abs()).clamp(min=0.0) ** 2 / (8 * a * a)
        return torch.where(d >= 0, tail, 1.0 - tail)

    return _apply(f, delta)


# ----------------------------------------------------------------------------- curves & masks


def noise_level_at_rate(
    levels: ArrayLike, rates: ArrayLike, target: float = 0.01
) -> float:
    """Noise level where a rising rate curve first reaches ``target`` (e.g. the paper's "1% of
    sparse distributions collapse at noise 11%").

    Points are sorted by level and NaN rates dropped; between the last point below target and the
    first at or above it, log(rate) is interpolated linearly in level (rates grow roughly
    exponentially at small noise); if the lower rate is 0 the interpolation is linear in rate.
    Returns NaN when the target is never reached, and also when the first point is already above
    target (the crossing lies below the measured range); returns the level itself on an exact hit.
    """
    lv = np.asarray(levels.detach().cpu() if isinstance(levels, Tensor) else levels, dtype=np.float64).ravel()
    rt = np.asarray(rates.detach().cpu() if isinstance(rates, Tensor) else rates, dtype=np.float64).ravel()
    if lv.shape != rt.shape:
        raise NoiseSpecError(f"levels and rates must have the same length, got {lv.size} and {rt.size}")
    target = float(target)
    if not (math.isfinite(target) and target > 0):
        raise NoiseSpecError(f"target rate must be finite and > 0, got {target}")
    if not np.isfinite(lv).all():
        raise NoiseSpecError("noise levels must be finite")
    keep = ~np.isnan(rt)
    lv, rt = lv[keep], rt[keep]
    if (rt < 0).any():
        raise NoiseSpecError("rates must be >= 0 (they are probabilities or frequencies)")
    order = np.argsort(lv, kind="stable")
    lv, rt = lv[order], rt[order]
    hit = np.nonzero(rt >= target)[0]
    if hit.size == 0:
        return math.nan
    i = int(hit[0])
    if rt[i] == target:
        return float(lv[i])
    if i == 0:
        return math.nan
    x0, x1, r0, r1 = lv[i - 1], lv[i], rt[i - 1], rt[i]
    if r0 > 0:
        frac = (math.log(target) - math.log(r0)) / (math.log(r1) - math.log(r0))
    else:
        frac = (target - r0) / (r1 - r0)
    return float(x0 + frac * (x1 - x0))


def _check_pattern(pattern: Tensor, threshold: float) -> Tensor:
    if not isinstance(pattern, Tensor):
        pattern = torch.as_tensor(np.asarray(pattern, dtype=np.float64))
    if pattern.ndim == 0:
        raise ConfigError("pattern must have a trailing key dimension [..., T], got a scalar")
    if not (0.0 < float(threshold) <= 1.0):
        raise ConfigError(f"threshold must be in (0, 1], got {threshold}")
    return pattern


def sparse_mask(pattern: Float[Tensor, "... key"], threshold: float = SPARSE_THRESHOLD) -> Bool[Tensor, "..."]:
    """Rows whose attention is sparse: max_t a_t ≥ ``threshold`` (the paper's 95%, §3.6).

    The paper excludes row 0 (the BEG token attends only to itself); drop it before calling.
    NaN rows are neither sparse nor non-sparse.
    """
    pattern = _check_pattern(pattern, threshold)
    return pattern.amax(-1) >= threshold


def nonsparse_mask(pattern: Float[Tensor, "... key"], threshold: float = NONSPARSE_THRESHOLD) -> Bool[Tensor, "..."]:
    """Rows whose attention is non-sparse: max_t a_t < ``threshold`` (the paper's 70%, §3.6)."""
    pattern = _check_pattern(pattern, threshold)
    return pattern.amax(-1) < threshold
