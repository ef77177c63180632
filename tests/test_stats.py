"""interp_norm.stats.inference against independent computations: explicit enumerations, hand-computable cases."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from interp_norm.errors import StatisticsError
from interp_norm.stats.inference import bootstrap_diff_ci, bootstrap_mean_ci, permutation_test


def _enumerated_p(a, b):
    """Two-sided p by brute force: every relabelling of the pooled values, written out with lists, in
    exact rational arithmetic on the decimal values (so 0.1 + 0.2 == 0.3 here)."""
    a, b = [Fraction(str(x)) for x in a], [Fraction(str(x)) for x in b]
    pooled = list(a) + list(b)
    n, na = len(pooled), len(a)
    obs = abs(sum(a) / len(a) - sum(b) / len(b))
    hits = total = 0
    for chosen in itertools.combinations(range(n), na):
        xa = [pooled[i] for i in chosen]
        xb = [pooled[i] for i in range(n) if i not in chosen]
        total += 1
        hits += abs(sum(xa) / len(xa) - sum(xb) / len(xb)) >= obs
    return float(Fraction(hits, total)), total


def test_perfectly_separated_six_vs_six_is_two_over_924():
    a = [10.0, 11.0, 12.5, 13.0, 14.0, 15.0]
    b = [1.0, 2.0, 3.0, 4.5, 5.0, 6.0]
    t = permutation_test(a, b)
    assert t.method == "exact" and t.n_permutations == 924
    assert t.p_value == pytest.approx(2 / 924)
    assert t.difference == pytest.approx(np.mean(a) - np.mean(b))
    assert permutation_test(b, a).p_value == pytest.approx(2 / 924)  # two-sided


def test_two_vs_two_can_never_go_below_one_third():
    t = permutation_test([100.0, 101.0], [0.0, 1.0])
    assert t.n_permutations == 6 and t.p_value == pytest.approx(2 / 6)


@pytest.mark.parametrize("a,b", [([3.1, 0.2, 5.0], [1.0, 2.0, 2.5, 7.0]), ([1, 1, 2], [1, 2, 2]), ([4.0], [1, 2, 3, 9])])
def test_exact_p_matches_an_explicit_enumeration(a, b):
    want, total = _enumerated_p(a, b)
    t = permutation_test(a, b)
    assert t.n_permutations == total and t.p_value == pytest.approx(want)


def test_ties_and_rounding_count_as_at_least_as_extreme():
    # in floating point 0.1 + 0.2 != 0.3: the split {0.3, 0.0} ties with the observed {0.1, 0.2} only
    # in exact arithmetic; it must count as at least as extreme, whichever way the rounding went
    # ([2.2, 2.2, 0.1] vs [0.6, 3.3, 2.2]: without a tolerance the rounding drops three tied splits, 0.55 vs 0.7)
    for a, b in (([0.1, 0.2], [0.3, 0.0, 5.0]), ([0.3, 0.0], [0.1, 0.2, 5.0]), ([2.2, 2.2, 0.1], [0.6, 3.3, 2.2])):
        want, _ = _enumerated_p(a, b)
        assert permutation_test(a, b).p_value == pytest.approx(want)
    # by hand: the 4 splits holding 5.0, and those of the small values with sum <= 0.3 ({.1,.2}, {.3,0}, {.1,0}, {.2,0})
    assert _enumerated_p([0.1, 0.2], [0.3, 0.0, 5.0])[0] == pytest.approx(8 / 10)


def test_monte_carlo_beyond_the_exact_limit_says_so_and_agrees_with_enumeration():
    rng = np.random.default_rng(5)
    a, b = rng.normal(0.6, 1, 7), rng.normal(0, 1, 7)  # C(14, 7) = 3432 splits
    exact, _ = _enumerated_p(list(a), list(b))
    t = permutation_test(a, b, max_exact=1000, n_resamples=40_000, seed=1)
    assert t.method == "monte carlo" and t.n_permutations == 40_000
    se = math.sqrt(exact * (1 - exact) / 40_000)
    assert abs(t.p_value - exact) < 5 * se + 1 / 40_000
    assert "Monte Carlo, 40000 permutations" in t.describe()
    # separated arms: Monte Carlo never reports 0
    t = permutation_test(np.arange(10) + 100.0, np.arange(10), max_exact=10, n_resamples=500)
    assert t.p_value == pytest.approx(1 / 501)


def _exact_bootstrap_quantile(values, q):
    """The bootstrap distribution of the mean, enumerated (n^n equally likely resamples), and its q-quantile."""
    n = len(values)
    means = sorted(sum(values[i] for i in idx) / n for idx in itertools.product(range(n), repeat=n))
    return means[int(math.floor(q * (len(means) - 1)))], means[int(math.ceil(q * (len(means) - 1)))]


def test_bootstrap_interval_converges_to_the_enumerated_bootstrap_distribution():
    values = [0.0, 1.0, 5.0, 2.0]  # 256 resamples; 2.5% and 97.5% fall between atoms of the distribution
    lo, hi = bootstrap_mean_ci(values, n_resamples=200_000, seed=3)
    lo_a, lo_b = _exact_bootstrap_quantile(values, 0.025)
    hi_a, hi_b = _exact_bootstrap_quantile(values, 0.975)
    assert lo_a - 1e-9 <= lo <= lo_b + 1e-9 and hi_a - 1e-9 <= hi <= hi_b + 1e-9
    assert lo > min(values) and hi < max(values)


def test_bootstrap_of_two_seeds_spans_their_range_and_one_seed_is_nan():
    assert bootstrap_mean_ci([2.0, 6.0]) == pytest.approx((2.0, 6.0))  # means 2, 4, 6 with prob 1/4, 1/2, 1/4
    assert all(math.isnan(x) for x in bootstrap_mean_ci([3.0]))
    assert all(math.isnan(x) for x in bootstrap_diff_ci([3.0], [1.0, 2.0]))


def test_bootstrap_of_many_values_is_close_to_the_normal_interval():
    x = np.random.default_rng(0).normal(10, 2, 400)
    lo, hi = bootstrap_mean_ci(x, seed=1)
    half = 1.96 * x.std(ddof=0) / math.sqrt(len(x))
    assert lo == pytest.approx(x.mean() - half, abs=0.05 * half + 0.01)
    assert hi == pytest.approx(x.mean() + half, abs=0.05 * half + 0.01)
    y = np.random.default_rng(1).normal(7, 1, 400)
    dlo, dhi = bootstrap_diff_ci(x, y, seed=2)
    dhalf = 1.96 * math.sqrt(x.var() / len(x) + y.var() / len(y))
    d = x.mean() - y.mean()
    assert dlo == pytest.approx(d - dhalf, abs=0.06 * dhalf) and dhi == pytest.approx(d + dhalf, abs=0.06 * dhalf)


def test_bootstrap_is_seeded():
    v = [1.0, 4.0, 2.0, 8.0, 3.0]
    assert bootstrap_mean_ci(v, seed=7) == bootstrap_mean_ci(v, seed=7)
    assert bootstrap_mean_ci(v, seed=7, n_resamples=50) != bootstrap_mean_ci(v, seed=8, n_resamples=50)


@pytest.mark.parametrize("call,match", [
    (lambda: bootstrap_mean_ci([1.0, float("nan")]), "NaN"),
    (lambda: permutation_test([], [1.0]), "at least one value"),
    (lambda: bootstrap_mean_ci([1.0, 2.0], level=95), "level"),
    (lambda: permutation_test([1.0], [2.0], n_resamples=0), "n_resamples"),
])
def test_bad_input_is_a_typed_error(call, match):
    with pytest.raises(StatisticsError, match=match):
        call()
