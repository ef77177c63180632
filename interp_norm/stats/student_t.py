"""Student's t distribution (CDF and quantile) in plain ``math``: the environment has no scipy.

The CDF goes through the regularised incomplete beta function, ``P(|T| > t) = I_x(df/2, 1/2)`` with
``x = df / (df + t²)`` (Abramowitz & Stegun 26.7.1), evaluated by its continued fraction with the
modified Lentz method (Numerical Recipes §6.4); relative accuracy ~1e-14. The quantile inverts the CDF
by bisection (the CDF is monotone), to 1e-12. Non-integer degrees of freedom are allowed (Welch).
"""

from __future__ import annotations

import functools
import math

from interp_norm.errors import StatisticsError

__all__ = ["t_cdf", "t_sf", "t_ppf", "betainc"]

_EPS, _TINY, _MAX_ITER = 1e-15, 1e-300, 500


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    h = d
    for m in range(1, _MAX_ITER + 1):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > _TINY else _TINY)
            c = 1.0 + aa / c
            c = c if abs(c) > _TINY else _TINY
            h *= d * c
        if abs(d * c - 1.0) < _EPS:
            return h
    return h  # converged to float precision for every (a, b) used here long before _MAX_ITER


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b), for a, b > 0 and 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def _df(df: float) -> float:
    if not (isinstance(df, (int, float)) and math.isfinite(df) and df > 0):
        raise StatisticsError(f"degrees of freedom must be a positive number, got {df!r}; use at least 2 seeds")
    return float(df)


def t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with ``df`` degrees of freedom."""
    df = _df(df)
    if math.isnan(t):
        return math.nan
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return tail if t >= 0 else 1.0 - tail


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    return 1.0 - t_sf(t, df) if t >= 0 else t_sf(-t, df)


@functools.lru_cache(maxsize=4096)
def t_ppf(q: float, df: float) -> float:
    """The ``q``-quantile of Student's t with ``df`` degrees of freedom (bisection on :func:`t_cdf`)."""
    df = _df(df)
    if not 0.0 < q < 1.0:
        raise StatisticsError(f"a quantile needs 0 < q < 1, got {q!r}")
    if q < 0.5:
        return -t_ppf(1.0 - q, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < q:
        lo, hi = hi, hi * 2.0
    while hi - lo > 1e-12 * max(1.0, hi):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < q else (lo, mid)
    return 0.5 * (lo + hi)
