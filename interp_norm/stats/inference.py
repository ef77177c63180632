"""Statistics over seeds: intervals, exact permutation tests, equivalence tests and Holm's adjustment.

Pure functions on small arrays of per-seed values (numbers in, numbers out), used to compare two
trained variants (e.g. Pre-Norm vs QKV-Norm, Menary et al. 2024 §4) with as many seeds as were
trained. The choices, and why:

* **Interval: percentile bootstrap of the mean** (Efron & Tibshirani 1993, ch. 13). The seeds'
  values are resampled with replacement ``n_resamples`` times (a seeded ``numpy`` generator, so a
  report is reproducible) and the interval is the ``(1 - level) / 2`` and ``(1 + level) / 2``
  quantiles of the resampled means (``numpy.quantile``, linear interpolation). For a difference of
  two arms each arm is resampled on its own (independent seeds). With few seeds this interval is
  *too narrow* (it never leaves the range of the values: with 2 seeds it is at most their range), so
  it describes the seeds; the decision rests on the permutation p-value. Fewer than 2 values: NaN.
* **Test: two-sided permutation test of the difference of means** (Fisher; Good 2005, ch. 3). Under
  the null hypothesis that the variant does not matter, every assignment of the pooled values to arms
  of sizes ``n_a`` and ``n_b`` is equally likely. The p-value is the share of assignments whose
  ``|mean_a - mean_b|`` is at least the observed one (ties count; a relative tolerance of 1e-9 keeps
  equal sums that differ only by floating-point rounding together). When there are at most
  ``max_exact`` assignments (C(n_a + n_b, n_a); 6 vs 6 seeds: 924) every one is enumerated (an exact
  p-value; its smallest possible value is 2 / C(n_a + n_b, n_a) with distinct values, e.g. 1/3 for
  2 vs 2 seeds, 2/924 = 0.0022 for 6 vs 6); above it ``n_resamples`` random permutations are drawn
  and p = (1 + hits) / (1 + n_resamples) (Phipson & Smyth 2010: never 0, valid), and the result says
  so (``method = "monte carlo"``, ``n_permutations``).

The decision rules a verdict rests on (:mod:`interp_norm.stats.decisions` applies them):

* **Intervals: Student t over seeds** (:func:`t_interval`, :func:`welch_interval`): mean ± t·s/√n.
  The percentile bootstrap above undercovers with 6 seeds (about 86% for a nominal 95% on normal
  seeds); the t-interval has its nominal coverage on normal seeds (``tests/test_stats.py`` simulates it).
  :func:`hierarchical_interval` carries the within-seed error too: its standard error comes from a
  two-stage bootstrap (seeds, then the items -- problems, noise draws -- inside each drawn seed), its
  quantile from t with n_seeds − 1 degrees of freedom.
* **Ordering: one-sided exact permutation tests**, ``alternative="greater"`` (mean_a > mean_b) or
  ``"less"``, each in a stated direction; ``shift`` tests a difference other than 0 (location shift).
* **Parity: two one-sided tests** (TOST, Schuirmann 1987) with a declared margin:
  :func:`tost_permutation` (two arms, shifted permutation tests) and :func:`tost_value` (one arm
  against a value, one-sample t). A value claim ("≳ 10") is a one-sided one-sample t-test,
  :func:`t_test_value`; never an interval's far end.
* **Families: Holm's step-down adjustment** (:func:`holm`), controlling the family-wise error rate.

Missing values (a level never reached, an analysis not run) are the caller's to handle: these
functions raise :class:`~interp_norm.errors.StatisticsError` on NaN or infinite input.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Sequence, Union

import numpy as np

from interp_norm.errors import StatisticsError, check_positive_int
from interp_norm.stats.student_t import t_ppf, t_sf

__all__ = ["PermutationTest", "bootstrap_mean_ci", "bootstrap_diff_ci", "permutation_test", "MAX_EXACT",
           "N_BOOTSTRAP", "N_PERMUTATIONS", "ALTERNATIVES", "t_interval", "welch_interval", "t_test_value",
           "tost_value", "tost_permutation", "hierarchical_interval", "holm"]

#: Enumerate every split up to this many (C(n_a + n_b, n_a)); above it, draw random permutations.
MAX_EXACT = 100_000
#: Default bootstrap resamples.
N_BOOTSTRAP = 10_000
#: Default random permutations when the exact enumeration is too large.
N_PERMUTATIONS = 100_000
_RTOL = 1e-9
#: A test's direction: ``"greater"`` (mean_a − mean_b > shift), ``"less"``, or ``"two-sided"``.
ALTERNATIVES = ("two-sided", "greater", "less")

ArrayLike = Union[Sequence[float], np.ndarray]


def _values(x: ArrayLike, name: str) -> np.ndarray:
    v = np.asarray(x, dtype=float).ravel()
    if not np.all(np.isfinite(v)):
        raise StatisticsError(f"{name} holds NaN or infinite values {v.tolist()}; drop the missing seeds first")
    return v


def _level(level: float) -> float:
    if not isinstance(level, (int, float)) or not 0 < level < 1:
        raise StatisticsError(f"level must lie strictly between 0 and 1 (e.g. 0.95), got {level!r}")
    return float(level)


def _count(n: int, name: str) -> int:
    return int(check_positive_int(n, name, StatisticsError))


def _quantiles(samples: np.ndarray, level: float) -> tuple[float, float]:
    lo, hi = np.quantile(samples, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def _resampled_means(v: np.ndarray, n_resamples: int, rng: np.random.Generator) -> np.ndarray:
    idx = rng.integers(0, len(v), size=(n_resamples, len(v)))
    return v[idx].mean(axis=1)


def bootstrap_mean_ci(values: ArrayLike, *, level: float = 0.95, n_resamples: int = N_BOOTSTRAP,
                      seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval ``(lo, hi)`` of the mean of ``values`` (see the module docstring).

    Descriptive only: over a handful of seeds it undercovers, so no decision should rest on it (least of
    all on its far end); use :func:`t_interval` and the tests below.

    ``(nan, nan)`` for fewer than 2 values (one seed says nothing about the spread over seeds).
    """
    v = _values(values, "values")
    level, n_resamples = _level(level), _count(n_resamples, "n_resamples")
    if len(v) < 2:
        return math.nan, math.nan
    return _quantiles(_resampled_means(v, n_resamples, np.random.default_rng(seed)), level)


def bootstrap_diff_ci(a: ArrayLike, b: ArrayLike, *, level: float = 0.95, n_resamples: int = N_BOOTSTRAP,
                      seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of ``mean(a) - mean(b)``, each arm resampled on its own
    (independent seeds); ``(nan, nan)`` if either arm has fewer than 2 values."""
    va, vb = _values(a, "a"), _values(b, "b")
    level, n_resamples = _level(level), _count(n_resamples, "n_resamples")
    if len(va) < 2 or len(vb) < 2:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    diff = _resampled_means(va, n_resamples, rng) - _resampled_means(vb, n_resamples, rng)
    return _quantiles(diff, level)


@dataclass(frozen=True)
class PermutationTest:
    """A permutation test of ``mean(a) - mean(b)`` against ``shift``, in the direction ``alternative``.

    ``method``: ``"exact"`` (every one of ``n_permutations`` = C(n_a + n_b, n_a) splits enumerated)
    or ``"monte carlo"`` (``n_permutations`` random permutations, p = (1 + hits) / (1 + n)).
    """

    p_value: float
    difference: float
    method: str
    n_permutations: int
    n_a: int
    n_b: int
    alternative: str = "two-sided"
    shift: float = 0.0

    def describe(self) -> str:
        """``"p = 0.0022 (exact, 924 splits)"`` or ``"p = 0.0001 (Monte Carlo, 100000 permutations)"``."""
        how = (f"exact, {self.n_permutations} splits" if self.method == "exact"
               else f"Monte Carlo, {self.n_permutations} permutations")
        side = "" if self.alternative == "two-sided" else f", one-sided: A − B {'>' if self.alternative == 'greater' else '<'} {self.shift:g}"
        return f"p = {self.p_value:.2g} ({how}{side})"


def _alternative(alternative: str) -> str:
    if alternative not in ALTERNATIVES:
        raise StatisticsError(f"alternative must be one of {ALTERNATIVES}, got {alternative!r}")
    return alternative


def _extreme(stats: np.ndarray, observed: float, alternative: str, tol: float) -> int:
    """How many split statistics (mean_a − mean_b) are at least as extreme as ``observed``."""
    if alternative == "greater":
        return int(np.count_nonzero(stats >= observed - tol))
    if alternative == "less":
        return int(np.count_nonzero(stats <= observed + tol))
    return int(np.count_nonzero(np.abs(stats) >= abs(observed) - tol))


def permutation_test(a: ArrayLike, b: ArrayLike, *, alternative: str = "two-sided", shift: float = 0.0,
                     max_exact: int = MAX_EXACT, n_resamples: int = N_PERMUTATIONS, seed: int = 0) -> PermutationTest:
    """Permutation p-value for a difference of means (see the module docstring).

    ``alternative``: ``"two-sided"`` (|mean_a − mean_b| large), ``"greater"`` (H1: mean_a − mean_b >
    ``shift``) or ``"less"``. ``shift`` tests H0: the arms differ by a location shift of ``shift``
    (``a − shift`` and ``b`` exchangeable), which the equivalence test needs. Exact when
    C(n_a + n_b, n_a) <= ``max_exact``, otherwise ``n_resamples`` seeded random permutations.
    """
    va, vb = _values(a, "a"), _values(b, "b")
    alternative = _alternative(alternative)
    if not len(va) or not len(vb):
        raise StatisticsError(f"both arms need at least one value (got {len(va)} and {len(vb)}); "
                              "add seeds or drop this comparison")
    max_exact, n_resamples = _count(max_exact, "max_exact"), _count(n_resamples, "n_resamples")
    na, nb = len(va), len(vb)
    pooled = np.concatenate([va - shift, vb])
    total = float(pooled.sum())
    observed = float(pooled[:na].mean() - vb.mean())
    tol = _RTOL * max(1.0, float(np.abs(pooled).max()))
    n_splits = math.comb(na + nb, na)
    result: dict[str, Any] = dict(difference=float(va.mean() - vb.mean()), n_a=na, n_b=nb, alternative=alternative,
                                  shift=float(shift))
    if n_splits <= max_exact:
        idx = np.fromiter(itertools.chain.from_iterable(itertools.combinations(range(na + nb), na)),
                          dtype=np.int64, count=n_splits * na).reshape(n_splits, na)
        sums = pooled[idx].sum(axis=1)
        hits = _extreme(sums / na - (total - sums) / nb, observed, alternative, tol)
        return PermutationTest(hits / n_splits, method="exact", n_permutations=n_splits, **result)
    rng = np.random.default_rng(seed)
    hits, done, chunk = 0, 0, 10_000
    while done < n_resamples:
        k = min(chunk, n_resamples - done)
        perm = np.argsort(rng.random((k, na + nb)), axis=1)[:, :na]
        sums = pooled[perm].sum(axis=1)
        hits += _extreme(sums / na - (total - sums) / nb, observed, alternative, tol)
        done += k
    return PermutationTest((1 + hits) / (1 + n_resamples), method="monte carlo", n_permutations=n_resamples, **result)


# ----------------------------------------------------------------------------- t-based intervals and tests

def _two_or_more(v: np.ndarray, name: str) -> np.ndarray:
    if len(v) < 2:
        raise StatisticsError(f"{name} needs at least 2 values for a spread over seeds, got {len(v)}; add seeds")
    return v


def t_interval(values: ArrayLike, *, level: float = 0.95) -> tuple[float, float]:
    """Student-t interval of the mean over seeds: mean ± t_{(1+level)/2, n−1}·s/√n.
    ``(nan, nan)`` for fewer than 2 values; ``(mean, mean)`` when every value is equal."""
    v, level = _values(values, "values"), _level(level)
    if len(v) < 2:
        return math.nan, math.nan
    half = t_ppf((1 + level) / 2, len(v) - 1) * float(v.std(ddof=1)) / math.sqrt(len(v))
    return float(v.mean() - half), float(v.mean() + half)


def _welch(va: np.ndarray, vb: np.ndarray) -> tuple[float, float]:
    """Welch's (standard error, degrees of freedom) of mean_a − mean_b."""
    ea, eb = va.var(ddof=1) / len(va), vb.var(ddof=1) / len(vb)
    se = math.sqrt(ea + eb)
    if se == 0:
        return 0.0, float(len(va) + len(vb) - 2)
    return se, float((ea + eb) ** 2 / (ea ** 2 / (len(va) - 1) + eb ** 2 / (len(vb) - 1)))


def welch_interval(a: ArrayLike, b: ArrayLike, *, level: float = 0.95) -> tuple[float, float]:
    """Welch-t interval of mean(a) − mean(b) (independent seeds, unequal variances);
    ``(nan, nan)`` if either arm has fewer than 2 values."""
    va, vb, level = _values(a, "a"), _values(b, "b"), _level(level)
    if len(va) < 2 or len(vb) < 2:
        return math.nan, math.nan
    se, df = _welch(va, vb)
    d, half = float(va.mean() - vb.mean()), t_ppf((1 + level) / 2, df) * se
    return d - half, d + half


def t_test_value(values: ArrayLike, value: float, *, alternative: str = "two-sided") -> float:
    """One-sample t-test p-value of H0: mean = ``value`` against ``alternative`` ("greater": mean > value)."""
    v, alternative = _two_or_more(_values(values, "values"), "a t-test"), _alternative(alternative)
    se = float(v.std(ddof=1)) / math.sqrt(len(v))
    d = float(v.mean()) - value
    if se == 0:  # no spread: the data decide with certainty
        side = {"greater": d > 0, "less": d < 0, "two-sided": d != 0}[alternative]
        return 0.0 if side else 1.0
    t, df = d / se, len(v) - 1
    return {"greater": t_sf(t, df), "less": t_sf(-t, df), "two-sided": min(1.0, 2 * t_sf(abs(t), df))}[alternative]


def _margin(margin: float) -> float:
    if not (isinstance(margin, (int, float)) and math.isfinite(margin) and margin > 0):
        raise StatisticsError(f"an equivalence margin must be a positive number, got {margin!r}; declare one")
    return float(margin)


def tost_value(values: ArrayLike, value: float, margin: float) -> float:
    """TOST p-value that the mean lies within ``value ± margin`` (the larger of the two one-sided
    t-test p-values: H0 mean <= value − margin, H0 mean >= value + margin)."""
    margin = _margin(margin)
    return max(t_test_value(values, value - margin, alternative="greater"),
               t_test_value(values, value + margin, alternative="less"))


def tost_permutation(a: ArrayLike, b: ArrayLike, margin: float, **kw) -> float:
    """TOST p-value that |mean(a) − mean(b)| < ``margin``: the larger of two one-sided exact permutation
    tests under location shift (H0 diff <= −margin; H0 diff >= +margin). ``kw``: :func:`permutation_test`'s."""
    margin = _margin(margin)
    return max(permutation_test(a, b, alternative="greater", shift=-margin, **kw).p_value,
               permutation_test(a, b, alternative="less", shift=margin, **kw).p_value)


def hierarchical_interval(groups: Sequence[ArrayLike], *, level: float = 0.95, n_resamples: int = 2000,
                          seed: int = 0) -> tuple[float, float, float]:
    """``(mean, lo, hi)`` of the mean over seeds of per-seed item means, carrying the within-seed error.

    ``groups``: one array per seed of per-item values (problems, noise draws). The standard error is the
    spread of a two-stage bootstrap (draw seeds with replacement, then items with replacement inside
    each drawn seed); the interval is mean ± t_{(1+level)/2, n_seeds−1}·SE (a percentile interval over
    6 seeds undercovers). Resampling both stages counts the within-seed variance twice over, so the
    interval errs wide (conservative), never narrow.
    """
    vs = [_values(g, f"group {i}") for i, g in enumerate(groups)]
    level, n_resamples = _level(level), _count(n_resamples, "n_resamples")
    if any(len(v) == 0 for v in vs):
        raise StatisticsError("every seed needs at least one item value; drop empty seeds first")
    means = np.array([v.mean() for v in vs])
    if len(vs) < 2:
        return float(means.mean()) if len(vs) else math.nan, math.nan, math.nan
    rng, n = np.random.default_rng(seed), len(vs)
    # item-resampled means: for every seed, one independent item resample per (resample, slot)
    inner = np.stack([v[rng.integers(0, len(v), size=(n_resamples, n, len(v)))].mean(axis=2) for v in vs])
    pick = rng.integers(0, n, size=(n_resamples, n))
    stat = inner[pick, np.arange(n_resamples)[:, None], np.arange(n)[None, :]].mean(axis=1)
    half = t_ppf((1 + level) / 2, n - 1) * float(stat.std(ddof=1))
    m = float(means.mean())
    return m, m - half, m + half


def holm(p_values: ArrayLike) -> np.ndarray:
    """Holm's step-down adjusted p-values (family-wise error rate) over the family ``p_values``.

    Sorted ascending p_(1) <= ... <= p_(m): adjusted p_(i) = max_{j<=i} min(1, (m − j + 1)·p_(j)).
    NaN entries are not members of the family and stay NaN.
    """
    p = np.asarray(p_values, dtype=float).ravel()
    out = np.full(len(p), np.nan)
    member = np.flatnonzero(~np.isnan(p))
    if np.any((p[member] < 0) | (p[member] > 1)):
        raise StatisticsError(f"p-values must lie in [0, 1], got {p[member].tolist()}")
    order = member[np.argsort(p[member], kind="stable")]
    m = len(order)
    out[order] = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
    return out
