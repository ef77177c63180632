"""Statistics over seeds: a bootstrap interval of a mean and a permutation test of a difference of means.

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

Missing values (a level never reached, an analysis not run) are the caller's to handle: these
functions raise :class:`~interp_norm.errors.StatisticsError` on NaN or infinite input.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np

from interp_norm.errors import StatisticsError, check_positive_int

__all__ = ["PermutationTest", "bootstrap_mean_ci", "bootstrap_diff_ci", "permutation_test", "MAX_EXACT",
           "N_BOOTSTRAP", "N_PERMUTATIONS"]

#: Enumerate every split up to this many (C(n_a + n_b, n_a)); above it, draw random permutations.
MAX_EXACT = 100_000
#: Default bootstrap resamples.
N_BOOTSTRAP = 10_000
#: Default random permutations when the exact enumeration is too large.
N_PERMUTATIONS = 100_000
_RTOL = 1e-9

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
    """A two-sided permutation test of ``mean(a) - mean(b)``.

    ``method``: ``"exact"`` (every one of ``n_permutations`` = C(n_a + n_b, n_a) splits enumerated)
    or ``"monte carlo"`` (``n_permutations`` random permutations, p = (1 + hits) / (1 + n)).
    """

    p_value: float
    difference: float
    method: str
    n_permutations: int
    n_a: int
    n_b: int

    def describe(self) -> str:
        """``"p = 0.0022 (exact, 924 splits)"`` or ``"p = 0.0001 (Monte Carlo, 100000 permutations)"``."""
        how = (f"exact, {self.n_permutations} splits" if self.method == "exact"
               else f"Monte Carlo, {self.n_permutations} permutations")
        return f"p = {self.p_value:.2g} ({how})"


def permutation_test(a: ArrayLike, b: ArrayLike, *, max_exact: int = MAX_EXACT,
                     n_resamples: int = N_PERMUTATIONS, seed: int = 0) -> PermutationTest:
    """Two-sided permutation p-value for a difference of means (see the module docstring).

    Exact when C(n_a + n_b, n_a) <= ``max_exact``, otherwise ``n_resamples`` seeded random permutations.
    """
    va, vb = _values(a, "a"), _values(b, "b")
    if not len(va) or not len(vb):
        raise StatisticsError(f"both arms need at least one value (got {len(va)} and {len(vb)}); "
                              "add seeds or drop this comparison")
    max_exact, n_resamples = _count(max_exact, "max_exact"), _count(n_resamples, "n_resamples")
    na, nb = len(va), len(vb)
    pooled = np.concatenate([va, vb])
    total = float(pooled.sum())
    observed = abs(va.mean() - vb.mean())
    tol = _RTOL * max(1.0, float(np.abs(pooled).max()))
    n_splits = math.comb(na + nb, na)
    if n_splits <= max_exact:
        idx = np.fromiter(itertools.chain.from_iterable(itertools.combinations(range(na + nb), na)),
                          dtype=np.int64, count=n_splits * na).reshape(n_splits, na)
        sums = pooled[idx].sum(axis=1)
        stats = np.abs(sums / na - (total - sums) / nb)
        hits = int(np.count_nonzero(stats >= observed - tol))
        return PermutationTest(hits / n_splits, float(va.mean() - vb.mean()), "exact", n_splits, na, nb)
    rng = np.random.default_rng(seed)
    hits, done, chunk = 0, 0, 10_000
    while done < n_resamples:
        k = min(chunk, n_resamples - done)
        perm = np.argsort(rng.random((k, na + nb)), axis=1)[:, :na]
        sums = pooled[perm].sum(axis=1)
        hits += int(np.count_nonzero(np.abs(sums / na - (total - sums) / nb) >= observed - tol))
        done += k
    return PermutationTest((1 + hits) / (1 + n_resamples), float(va.mean() - vb.mean()), "monte carlo",
                           n_resamples, na, nb)
