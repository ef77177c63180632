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


# ----------------------------------------------------------------------------- the decision rules

def _enumerated_one_sided(a, b, shift=0.0):
    """One-sided p (mean_a − mean_b >= observed) by brute force in exact rationals, after a − shift."""
    a = [Fraction(str(x)) - Fraction(str(shift)) for x in a]
    b = [Fraction(str(x)) for x in b]
    pooled, na = a + b, len(a)
    obs = sum(a) / na - sum(b) / len(b)
    splits = list(itertools.combinations(range(len(pooled)), na))
    hits = sum(sum(pooled[i] for i in c) / na - sum(pooled[i] for i in range(len(pooled)) if i not in c) / len(b) >= obs
               for c in splits)
    return float(Fraction(hits, len(splits))), len(splits)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_sided_exact_permutation_matches_brute_force_on_924_splits(seed):
    rng = np.random.default_rng(seed)
    a, b = list(np.round(rng.normal(1, 1, 6), 2)), list(np.round(rng.normal(0, 1, 6), 2))
    want, total = _enumerated_one_sided(a, b)
    g = permutation_test(a, b, alternative="greater")
    assert total == 924 and g.n_permutations == 924 and g.method == "exact"
    assert g.p_value == pytest.approx(want, abs=1e-12)
    # the reverse direction is the same enumeration of b against a
    assert permutation_test(a, b, alternative="less").p_value == pytest.approx(_enumerated_one_sided(b, a)[0], abs=1e-12)


def test_one_sided_separated_arms_reach_one_over_924_and_the_reverse_is_one():
    a, b = [10.0, 11.0, 12.5, 13.0, 14.0, 15.0], [1.0, 2.0, 3.0, 4.5, 5.0, 6.0]
    assert permutation_test(a, b, alternative="greater").p_value == pytest.approx(1 / 924)
    assert permutation_test(a, b, alternative="less").p_value == pytest.approx(1.0)


def test_shifted_permutation_test_matches_brute_force():
    a, b = [3.1, 2.2, 4.0, 2.9], [1.0, 1.5, 2.7, 0.4, 2.0]
    want, _ = _enumerated_one_sided(a, b, shift=0.5)
    assert permutation_test(a, b, alternative="greater", shift=0.5).p_value == pytest.approx(want, abs=1e-12)


def test_t_distribution_against_closed_forms_and_tables():
    from interp_norm.stats.student_t import t_cdf, t_ppf

    for t in (-3.0, -0.4, 0.0, 0.7, 2.5, 40.0):
        assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-13)  # Cauchy
        assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-13)
        # df = 3: 1/2 + (1/π)(u/(1+u²) + atan u), u = t/√3
        u = t / math.sqrt(3)
        assert t_cdf(t, 3) == pytest.approx(0.5 + (u / (1 + u * u) + math.atan(u)) / math.pi, abs=1e-13)
    # printed tables (two-sided 5%): t_{.975} for 5, 10 and 30 degrees of freedom; normal limit
    for df, q in ((5, 2.570582), (10, 2.228139), (30, 2.042272), (1e7, 1.959964)):
        assert t_ppf(0.975, df) == pytest.approx(q, abs=2e-6)
    assert t_ppf(0.025, 5) == pytest.approx(-t_ppf(0.975, 5))
    assert t_cdf(t_ppf(0.9, 7.3), 7.3) == pytest.approx(0.9, abs=1e-10)  # non-integer df (Welch)


def test_t_interval_and_t_test_against_the_formula():
    from interp_norm.stats.inference import t_interval, t_test_value, welch_interval

    x = [89.2, 91.7, 83.4, 90.6, 90.2, 89.1]
    m, s = sum(x) / 6, math.sqrt(sum((v - sum(x) / 6) ** 2 for v in x) / 5)
    lo, hi = t_interval(x)
    assert lo == pytest.approx(m - 2.570582 * s / math.sqrt(6), abs=1e-5)
    assert hi == pytest.approx(m + 2.570582 * s / math.sqrt(6), abs=1e-5)
    # t = (m − 88) / (s/√6) with 5 df; the one-sided p from the df = 5 closed form is hard, so use symmetry:
    # p_greater + p_less = 1 and the two-sided p is twice the smaller
    pg, pl = t_test_value(x, 88.0, alternative="greater"), t_test_value(x, 88.0, alternative="less")
    assert pg + pl == pytest.approx(1.0) and t_test_value(x, 88.0) == pytest.approx(2 * min(pg, pl))
    # at the critical value the one-sided p is exactly 2.5%
    crit = m - 2.570582 * s / math.sqrt(6)
    assert t_test_value(x, crit, alternative="greater") == pytest.approx(0.025, abs=1e-6)
    # Welch with equal variances and sizes: df = 2n − 2, se = √(2 s²/n)
    y = [v - 3.0 for v in x]
    dlo, dhi = welch_interval(x, y)
    assert (dlo + dhi) / 2 == pytest.approx(3.0)
    assert (dhi - dlo) / 2 == pytest.approx(2.228139 * s * math.sqrt(2 / 6), abs=1e-5)
    assert all(math.isnan(v) for v in t_interval([1.0]))


def test_value_claim_an_upper_end_rule_accepts_and_the_one_sided_test_does_not():
    """'costs ≳ 10 points' on seeds whose mean is 8.8: the bootstrap interval's upper end reaches 10
    (a rule reading that far end says "reproduced"), but the one-sided t-test cannot reject mean <= 10 − 1."""
    from interp_norm.stats.inference import t_test_value

    seeds = [8.0, 10.6, 6.4, 11.2, 8.1, 8.5]  # mean 8.8, SD 1.8, two of six seeds reach 10
    _, hi = bootstrap_mean_ci(seeds)
    assert hi >= 10.0  # the far end reaches the paper's value
    p = t_test_value(seeds, 9.0, alternative="greater")
    t = (np.mean(seeds) - 9.0) / (np.std(seeds, ddof=1) / math.sqrt(6))
    assert t < 0 and p > 0.5  # the mean is below 9: no evidence of "≳ 10", whatever the interval's far end


def test_tost_equivalence_is_the_larger_one_sided_p():
    from interp_norm.stats.inference import t_test_value, tost_permutation, tost_value

    x = [10.2, 10.9, 11.4, 10.8, 11.1, 11.6]
    assert tost_value(x, 11.0, 1.0) == pytest.approx(max(t_test_value(x, 10.0, alternative="greater"),
                                                         t_test_value(x, 12.0, alternative="less")))
    assert tost_value(x, 11.0, 1.0) < 0.05 and tost_value(x, 11.0, 0.1) > 0.05  # a tight margin cannot be shown
    a, b = [91.0, 91.3, 90.8, 91.2, 90.9, 91.1], [91.1, 90.9, 91.2, 91.0, 90.8, 91.3]  # same values: diff 0
    # H0 diff <= −1: a + 1 against b, "greater"; H0 diff >= +1: b + 1 against a, "greater" (the same splits
    # as a − 1 against b, "less": shifting the whole pool changes no difference)
    want = max(_enumerated_one_sided(a, b, shift=-1.0)[0], _enumerated_one_sided(b, a, shift=-1.0)[0])
    assert tost_permutation(a, b, 1.0) == pytest.approx(want, abs=1e-12)
    assert tost_permutation(a, b, 1.0) == pytest.approx(1 / 924)
    with pytest.raises(StatisticsError, match="margin"):
        tost_value(x, 11.0, 0.0)


def test_t_interval_covers_on_simulated_six_seed_normal_data():
    """Seeded simulation: 6 normal seeds, 4000 repetitions; the t-interval's coverage is 0.95 (±0.007
    binomial SD), well above the 0.93 floor; the percentile bootstrap's is far lower (about 0.86)."""
    from interp_norm.stats.inference import t_interval

    rng = np.random.default_rng(2024)
    data = rng.normal(10.0, 2.0, size=(4000, 6))
    cover = np.mean([lo <= 10.0 <= hi for lo, hi in (t_interval(row) for row in data)])
    assert cover >= 0.93
    boot = np.mean([lo <= 10.0 <= hi for lo, hi in (bootstrap_mean_ci(row, n_resamples=400, seed=i)
                                                   for i, row in enumerate(data[:400]))])
    assert boot < cover


def test_hierarchical_interval_carries_within_seed_error_and_covers():
    from interp_norm.stats.inference import hierarchical_interval, t_interval

    rng = np.random.default_rng(7)
    hits, n_rep = 0, 150
    for r in range(n_rep):
        seed_means = rng.normal(5.0, 0.5, 6)
        groups = [rng.normal(m, 3.0, 40) for m in seed_means]  # within-seed error comparable to between-seed
        m, lo, hi = hierarchical_interval(groups, n_resamples=400, seed=r)
        hits += lo <= 5.0 <= hi
    assert hits / n_rep >= 0.90  # 150 reps: binomial SD 0.018 around >= 0.95
    # with no within-seed spread the two-stage SE is the seeds' bootstrap SE: close to the t-interval's
    groups = [np.full(10, v) for v in (1.0, 2.0, 4.0, 3.0, 2.5, 5.0)]
    m, lo, hi = hierarchical_interval(groups, n_resamples=20_000, seed=1)
    tlo, thi = t_interval([1.0, 2.0, 4.0, 3.0, 2.5, 5.0])
    # the bootstrap SE is s·√((n−1)/n) up to Monte Carlo error
    assert (hi - lo) == pytest.approx((thi - tlo) * math.sqrt(5 / 6), rel=0.03)
    assert m == pytest.approx(17.5 / 6)


def test_holm_on_a_hand_worked_family():
    from interp_norm.stats.inference import holm

    # sorted 0.01, 0.02, 0.03, 0.04 (m = 4): 4·.01 = .04; 3·.02 = .06; 2·.03 = .06; 1·.04 = .04 -> monotone .06
    got = holm([0.03, 0.01, float("nan"), 0.04, 0.02])
    assert got[[1, 4, 0, 3]] == pytest.approx([0.04, 0.06, 0.06, 0.06])
    assert math.isnan(got[2])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
    with pytest.raises(StatisticsError, match="p-values"):
        holm([1.5])
