"""Predicted collapse probabilities (loose and strict), noise level at a rate, sparse/non-sparse masks."""

from __future__ import annotations

import math
from typing import Any, Literal, overload

import numpy as np
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from interp_norm.errors import ConfigError, NoiseSpecError
from interp_norm.core.defaults import NONSPARSE_THRESHOLD, SPARSE_THRESHOLD
from interp_norm.theory.law import ArrayLike, NoiseLaw, _MAX_ELEMS, _apply, _as_law
from interp_norm.theory.conditions import _check_scores


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
    x_np, wq_np = np.polynomial.legendre.leggauss(nodes_per_panel)
    x = torch.as_tensor(x_np, dtype=torch.float64, device=w.device)
    wq = torch.as_tensor(wq_np, dtype=torch.float64, device=w.device)
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
    f64: dict[str, Any] = dict(dtype=torch.float64, device=dev)
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


@overload
def predicted_collapse_probability_strict(
    scores: Tensor, law: NoiseLaw, threshold: float = ..., n_samples: int = ..., generator: torch.Generator | None = ...,
    *, include_query_noise: bool = ..., return_stderr: Literal[False] = ...,
) -> Tensor: ...
@overload
def predicted_collapse_probability_strict(
    scores: Tensor, law: NoiseLaw, threshold: float = ..., n_samples: int = ..., generator: torch.Generator | None = ...,
    *, include_query_noise: bool = ..., return_stderr: Literal[True],
) -> tuple[Tensor, Tensor]: ...
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
    paper's "strict" collapse (Menary et al. 2024, arXiv 2406.17837).

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
    small-angle lemma with δ = ½θ_t² (Menary et al. 2024, the collapse theory behind Theorem 7).

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
