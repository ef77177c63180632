"""Tests for interp_norm.theory against independent computations (brute force, Monte-Carlo,
closed forms), never against the function's own output."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from interp_norm.errors import ConfigError, InterpNormError, NoiseSpecError
from interp_norm.theory import (
    NoiseLaw,
    collapse_condition_exact,
    collapse_condition_first_order,
    collapse_condition_small_angle,
    collapse_probability_small_angle,
    critical_ratio,
    noise_level_at_rate,
    nonsparse_mask,
    predicted_collapse_probability,
    predicted_collapse_probability_strict,
    small_angle_threshold,
    sparse_mask,
)

NEG = -math.inf
F64 = torch.float64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_rows(R: int, T: int, g: torch.Generator) -> torch.Tensor:
    """Rows with small gaps, a third all-negative, random -inf masks (≥ 1 key left)."""
    w = torch.randn(R, T, generator=g, dtype=F64) * 2.0
    w[: R // 3] -= 8.0  # all-negative rows
    masked = torch.rand(R, T, generator=g) < 0.25
    keep = torch.randint(0, T, (R,), generator=g)
    masked[torch.arange(R), keep] = False
    return w.masked_fill(masked, NEG)


def brute_collapse(w: torch.Tensor, kk: torch.Tensor, kq: torch.Tensor | None) -> torch.Tensor:
    """Perturb the scores, softmax, and compare argmaxes (the definition itself)."""
    masked = torch.isneginf(w)
    noised = (1 + kk) * w
    if kq is not None:
        noised = (1 + kq)[..., None] * noised
    noised = noised.masked_fill(masked.expand_as(noised), NEG)
    clean = torch.softmax(w, -1).argmax(-1)
    return torch.softmax(noised, -1).argmax(-1) != clean


# ----------------------------------------------------------------------------- exact condition


@pytest.mark.parametrize(
    "law", [NoiseLaw(0.2, "uniform"), NoiseLaw(0.3, "normal"), NoiseLaw(0.8, "normal")], ids=str
)
def test_exact_condition_matches_brute_force(law):
    g = gen(1)
    R, T = 4000, 7
    w = random_rows(R, T, g)
    w[-50:, 1:] = NEG  # some rows with a single unmasked key
    kk = law.sample((R, T), g, dtype=F64)
    kq = law.sample((R,), g, dtype=F64)
    brute = brute_collapse(w, kk, kq)
    assert 0.05 < brute.double().mean() < 0.95  # both outcomes well represented
    # with the query factor passed explicitly: exact for any sign of 1+κ_q
    assert torch.equal(collapse_condition_exact(w, kk, kappa_q=kq), brute)
    # without it: the query factor cancels wherever 1+κ_q > 0
    pos = (1 + kq) > 0
    assert torch.equal(collapse_condition_exact(w, kk)[pos], brute[pos])
    # rows with a single unmasked key never collapse
    single = (~torch.isneginf(w)).sum(-1) == 1
    assert single.any() and not collapse_condition_exact(w, kk, kappa_q=kq)[single].any()


def test_exact_condition_broadcasts_over_samples():
    g = gen(2)
    w = random_rows(50, 5, g)
    kk = NoiseLaw(0.3).sample((200, 50, 5), g, dtype=F64)
    got = collapse_condition_exact(w, kk)
    assert got.shape == (200, 50)
    assert torch.equal(got, brute_collapse(w.expand(200, 50, 5), kk, None))


def test_query_noise_alone_never_changes_the_argmax():
    g = gen(3)
    R, T = 3000, 9
    w = random_rows(R, T, g)
    kq = NoiseLaw(0.5, "uniform").sample((R,), g, dtype=F64)  # 1+κ_q ∈ (0.13, 1.87)
    zeros = torch.zeros(R, T, dtype=F64)
    assert not brute_collapse(w, zeros, kq).any()
    assert not collapse_condition_exact(w, zeros, kappa_q=kq).any()
    assert not collapse_condition_first_order(w, zeros, kappa_q=kq).any()  # λ_w = 1


@settings(max_examples=300, deadline=None)
@given(
    data=st.lists(
        st.tuples(
            st.one_of(st.none(), st.integers(-8, 8)),  # score (None = masked)
            st.integers(-100, 100),  # κ_t · 64: 1+κ_t may be negative
        ),
        min_size=1,
        max_size=6,
    ),
    kq64=st.integers(-100, 100),
)
def test_exact_condition_property_on_exact_grid(data, kq64):
    """Dyadic values make every product exact in float64, so ties are real ties."""
    assume(any(s is not None for s, _ in data))
    assume(kq64 != -64)  # 1+κ_q = 0 flattens the row: argmax undefined
    scores = [NEG if s is None else float(s) for s, _ in data]
    kappa = [k / 64 for _, k in data]
    kq = kq64 / 64
    unmasked = [i for i, s in enumerate(scores) if s != NEG]
    tstar = max(unmasked, key=lambda i: (scores[i], -i))  # first maximum
    noised = {i: (1 + kq) * (1 + kappa[i]) * scores[i] for i in unmasked}
    top = max(noised.values())
    winners = [i for i in unmasked if noised[i] == top]
    assume(not (tstar in winners and len(winners) > 1))  # a tie with t* is no collapse by definition
    expected = winners[0] != tstar
    w = torch.tensor(scores, dtype=F64)
    k = torch.tensor(kappa, dtype=F64)
    assert bool(collapse_condition_exact(w, k, kappa_q=torch.tensor(kq, dtype=F64))) == expected
    if 1 + kq > 0:
        assert bool(collapse_condition_exact(w, k)) == expected


def test_exact_condition_explicit_tstar_and_errors():
    w = torch.tensor([[1.0, 2.0, 0.5]], dtype=F64)
    k = torch.tensor([[0.0, 0.0, 0.0]], dtype=F64)
    # if t* is declared to be key 0, key 1 already beats it
    assert collapse_condition_exact(w, k, tstar=torch.tensor([0])).item()
    assert not collapse_condition_exact(w, k).item()
    with pytest.raises(ConfigError):
        collapse_condition_exact(w, k, tstar=torch.tensor([3]))
    with pytest.raises(ConfigError):
        collapse_condition_exact(torch.tensor([[1.0, math.nan]]), torch.zeros(1, 2))
    with pytest.raises(ConfigError):
        collapse_condition_exact(w, torch.zeros(2, 4))
    with pytest.raises(NoiseSpecError):
        collapse_condition_exact(w, torch.tensor([[math.inf, 0.0, 0.0]]))


# ----------------------------------------------------------------------------- first order, small angle


def test_first_order_equals_exact_without_query_noise_and_converges_with_it():
    g = gen(4)
    R, T = 20000, 6
    ratios = []
    for level in (0.1, 0.01):
        law = NoiseLaw(level)
        w = 1.0 + level * torch.randn(R, T, generator=g, dtype=F64)  # gaps ∝ noise: ~constant collapse rate
        kk = law.sample((R, T), g, dtype=F64)
        kq = law.sample((R,), g, dtype=F64)
        truth = brute_collapse(w, kk, kq)
        assert torch.equal(collapse_condition_first_order(w, kk), truth)  # κ_q = 0: same inequality
        first = collapse_condition_first_order(w, kk, kappa_q=kq)
        ratios.append((first != truth).sum().item() / truth.sum().item())
    assert ratios[0] > 0  # at 10% noise Theorem 7 really is only first order
    assert ratios[1] < 0.02 and ratios[1] < 0.3 * ratios[0]  # disagreement is O(κ)


def test_first_order_is_the_papers_lambda_w_case_split():
    g = gen(5)
    R, T = 5000, 5
    w = torch.randn(R, T, generator=g, dtype=F64)
    kk = NoiseLaw(0.3).sample((R, T), g, dtype=F64)
    kq = NoiseLaw(0.3).sample((R,), g, dtype=F64)
    ts = w.argmax(-1)
    lam = critical_ratio(kk, ts, kq)
    # independent λ_w
    k_star = kk[torch.arange(R), ts][:, None]
    assert torch.allclose(lam, (1 + kq[:, None] + kk) / (1 + kq[:, None] + k_star))
    w_star = w[torch.arange(R), ts][:, None]
    sign = w * (1 + kq[:, None] + k_star)
    ratio = w_star / w
    per_t = torch.where(sign > 0, ratio < lam, ratio > lam)
    per_t[torch.arange(R), ts] = False
    assert torch.equal(collapse_condition_first_order(w, kk, kappa_q=kq), per_t.any(-1))


def test_small_angle_lemma_matches_exact_condition_in_the_limit():
    g = gen(6)
    R, T = 20000, 5
    disagreement = []
    for level in (0.03, 0.001):
        law = NoiseLaw(level)
        theta_max = math.sqrt(4 * law.half_width)  # ½θ² up to 2a: every outcome possible
        theta = torch.rand(R, T, generator=g, dtype=F64) * theta_max
        theta[:, 0] = 0.0  # t* is aligned with q (the lemma's θ_t* ≈ 0)
        kk = law.sample((R, T), g, dtype=F64)
        exact = brute_collapse(torch.cos(theta), kk, None)  # equal-norm keys: w_t ∝ cos θ_t
        lemma = collapse_condition_small_angle(theta, kk)
        assert 0.1 < exact.double().mean() < 0.9
        disagreement.append((lemma != exact).double().mean().item())
    assert disagreement[1] < 0.005 and disagreement[1] < disagreement[0]
    assert small_angle_threshold(0.2) == pytest.approx(0.02)


# ----------------------------------------------------------------------------- probabilities

ROWS = torch.tensor(
    [
        [5.0, 4.8, 4.0, 1.0, -2.0, NEG],  # small gap
        [5.0, 3.0, 2.9, 2.8, 0.0, NEG],  # several close competitors
        [10.0, 4.0, 3.0, 0.0, 0.0, -1.0],  # sparse
        [-1.0, -1.1, -1.5, -3.0, NEG, NEG],  # all negative
        [2.0, 0.0, 0.0, -0.5, 1.9, 1.95],  # zero scores
        [1.0, 1.0, 0.5, NEG, NEG, NEG],  # tie: t* = first maximum
        [0.0, -1.0, -2.0, -0.1, NEG, NEG],  # w_t* = 0
        [3.0, NEG, NEG, NEG, NEG, NEG],  # single key: never collapses
    ],
    dtype=F64,
)


def monte_carlo_loose(w, law, n, seed, query=True):
    g = gen(seed)
    R, T = w.shape
    kk = law.sample((n, R, T), g, dtype=F64)
    kq = law.sample((n, R), g, dtype=F64) if query else None
    return brute_collapse(w, kk, kq).double().mean(0)


@pytest.mark.parametrize(
    "law",
    [NoiseLaw(0.05), NoiseLaw(0.11), NoiseLaw(0.4), NoiseLaw(0.05, "normal"), NoiseLaw(0.3, "normal"),
     NoiseLaw(0.7, "normal")],
    ids=str,
)
def test_predicted_probability_matches_monte_carlo(law):
    n = 100_000
    mc = monte_carlo_loose(ROWS, law, n, seed=7)
    pred = predicted_collapse_probability(ROWS, law)
    tol = 4 * torch.sqrt(mc * (1 - mc) / n) + 1e-3
    assert ((pred - mc).abs() <= tol).all(), (pred, mc)
    assert pred[-1] == 0.0


def test_predicted_probability_without_query_noise_normal():
    law, n = NoiseLaw(0.7, "normal"), 100_000
    mc = monte_carlo_loose(ROWS, law, n, seed=8, query=False)
    pred = predicted_collapse_probability(ROWS, law, include_query_noise=False)
    assert ((pred - mc).abs() <= 4 * torch.sqrt(mc * (1 - mc) / n) + 1e-3).all(), (pred, mc)
    # for the uniform law 1+κ_q > 0 always, so the flag changes nothing
    u = NoiseLaw(0.3)
    assert torch.equal(predicted_collapse_probability(ROWS, u), predicted_collapse_probability(ROWS, u, False))


def _phi(z):
    return 0.5 * math.erfc(-z / math.sqrt(2))


@pytest.mark.parametrize("w_star,w", [(1.0, 0.7), (2.0, -0.5), (-0.3, -0.4), (5.0, 4.99), (1.0, 0.0), (3.0, 3.0)])
@pytest.mark.parametrize("level", [0.02, 0.2, 0.5])
def test_two_keys_closed_forms(w_star, w, level):
    """T = 2: D = (1+κ_1)w − (1+κ_0)w* is a sum of two independent variables."""
    row = torch.tensor([[w_star, w]], dtype=F64)
    g = w_star - w  # collapse ⇔ κ_1 w − κ_0 w* > g
    # normal: D ~ N(−g, σ²(w² + w*²)); with 1+κ_q < 0 the inequality flips
    law = NoiseLaw(level, "normal")
    sd = level * math.hypot(w, w_star)
    p_pos = _phi(-g / sd)
    p_neg = _phi(g / sd)  # P(D < 0)
    q = _phi(-1 / level)
    assert predicted_collapse_probability(row, law, False).item() == pytest.approx(p_pos, abs=1e-9)
    assert predicted_collapse_probability(row, law).item() == pytest.approx((1 - q) * p_pos + q * p_neg, abs=1e-9)
    # uniform: X = κ_1 w ~ U(−A, A), Y = −κ_0 w* ~ U(−B, B); area of the box above x + y = g
    a = math.sqrt(3) * level
    A, B = a * abs(w), a * abs(w_star)
    if A == 0 or B == 0:
        C = A + B  # one-dimensional: P(U(−C, C) > g)
        expected = min(max((C - g) / (2 * C), 0.0), 1.0) if C > 0 else float(g < 0)
    else:

        def r2(z):
            return max(z, 0.0) ** 2

        area = 0.5 * (r2(A + B - g) - r2(-A + B - g) - r2(A - B - g) + r2(-A - B - g))
        expected = area / (4 * A * B)
    assert predicted_collapse_probability(row, NoiseLaw(level)).item() == pytest.approx(expected, abs=1e-12)


def test_predicted_probability_edge_cases():
    assert torch.equal(predicted_collapse_probability(ROWS, NoiseLaw(0.0)), torch.zeros(8, dtype=F64))
    masked = torch.full((2, 4), NEG)
    assert torch.equal(predicted_collapse_probability(masked, NoiseLaw(0.2)), torch.zeros(2))
    # a positive rescaling of a row (temperature) changes nothing
    for law in (NoiseLaw(0.2), NoiseLaw(0.4, "normal")):
        p1 = predicted_collapse_probability(ROWS, law)
        p2 = predicted_collapse_probability(ROWS * 7.3, law)
        assert torch.allclose(p1, p2, atol=1e-12)
    # batch shape and dtype are kept
    batched = ROWS[:6].reshape(2, 3, 6).float()
    out = predicted_collapse_probability(batched, NoiseLaw(0.1))
    assert out.shape == (2, 3) and out.dtype == torch.float32
    with pytest.raises(NoiseSpecError):
        predicted_collapse_probability(ROWS, 0.1)
    with pytest.raises(ConfigError):
        predicted_collapse_probability(torch.tensor([[1.0, math.inf]]), NoiseLaw(0.1))


def test_strict_probability_monte_carlo():
    law = NoiseLaw(0.3)
    rows = torch.tensor([[5.0, 4.0], [4.0, 3.8], [8.0, 7.0]], dtype=F64)
    n = 40_000
    # threshold 0.5 with two keys: the new argmax always holds ≥ 50%, so strict = loose (exact)
    p, se = predicted_collapse_probability_strict(rows, law, 0.5, n, gen(9), return_stderr=True)
    exact = predicted_collapse_probability(rows, law)
    assert ((p - exact).abs() <= 4 * torch.sqrt(exact * (1 - exact) / n) + 1e-3).all()
    assert torch.allclose(se, torch.sqrt(p * (1 - p) / n))
    # threshold 0.95 with two keys: (1+κ_q)[(1+κ_1)w_1 − (1+κ_0)w_0] ≥ log 19, by independent sampling
    g = gen(10)
    kk = law.sample((n, 3, 2), g, dtype=F64)
    kq = law.sample((n, 3), g, dtype=F64)
    diff = (1 + kq) * ((1 + kk[..., 1]) * rows[:, 1] - (1 + kk[..., 0]) * rows[:, 0])
    mc = (diff >= math.log(19)).double().mean(0)
    p = predicted_collapse_probability_strict(rows, law, 0.95, n, gen(11))
    tol = 4 * torch.sqrt((mc * (1 - mc) + p * (1 - p)) / n) + 1e-3
    assert ((p - mc).abs() <= tol).all(), (p, mc)
    assert (p <= exact + 1e-2).all() and p[2] > 0.01  # strict ⊂ loose, and not trivially zero
    # reproducible with a seeded generator
    assert torch.equal(p, predicted_collapse_probability_strict(rows, law, 0.95, n, gen(11)))


def test_small_angle_closed_form_vs_monte_carlo():
    n = 400_000
    for law in (NoiseLaw(0.1), NoiseLaw(0.1, "normal")):
        g = gen(12)
        diff = law.sample((n,), g, dtype=F64) - law.sample((n,), g, dtype=F64)
        deltas = torch.tensor([-0.5, -0.3, -0.1, -0.02, 0.0, 0.02, 0.1, 0.2, 0.3, 0.5], dtype=F64)
        mc = (diff[:, None] > deltas).double().mean(0)
        got = collapse_probability_small_angle(deltas, law)
        assert ((got - mc).abs() <= 4 * torch.sqrt(mc * (1 - mc) / n) + 1e-3).all(), (got, mc)
    a = NoiseLaw(0.1).half_width
    assert collapse_probability_small_angle(np.array([0.0, 2 * a, 3 * a]), NoiseLaw(0.1)) == pytest.approx([0.5, 0, 0])
    assert collapse_probability_small_angle(a, NoiseLaw(0.1)) == pytest.approx((2 * a - a) ** 2 / (8 * a * a))


# ----------------------------------------------------------------------------- noise law


@pytest.mark.parametrize("level", [-0.1, math.nan, math.inf, 1 / math.sqrt(3), 0.6, True, "0.1"])
def test_noise_law_rejects_bad_levels(level):
    with pytest.raises(NoiseSpecError) as err:
        NoiseLaw(level, "uniform")
    assert isinstance(err.value, (InterpNormError, ValueError))


def test_noise_law_validation_messages_and_normal_allows_large_levels():
    with pytest.raises(NoiseSpecError, match="1/√3"):
        NoiseLaw(0.6)
    with pytest.raises(NoiseSpecError, match="uniform"):
        NoiseLaw(0.1, "laplace")
    with pytest.raises(NoiseSpecError):
        NoiseLaw(-1.0, "normal")
    law = NoiseLaw(2.0, "normal")
    assert law.prob_negative_factor == pytest.approx(_phi(-0.5))
    assert NoiseLaw(0.3).prob_negative_factor == 0.0


def test_noise_law_samples_and_distribution_functions():
    n = 1_000_000
    for law in (NoiseLaw(0.11), NoiseLaw(0.5), NoiseLaw(0.11, "normal")):
        x = law.sample((n,), gen(13), dtype=F64)
        assert x.pow(2).mean().sqrt().item() == pytest.approx(law.level, rel=5e-3)  # RMS = level
        assert abs(x.mean().item()) < 5 * law.level / math.sqrt(n)
        if law.distribution == "uniform":
            assert x.abs().max().item() <= math.sqrt(3) * law.level
        # cdf vs empirical cdf (Kolmogorov distance), pdf vs histogram
        xs = x.sort().values

        def ecdf(t, xs=xs):
            return torch.searchsorted(xs, t, right=True).double() / n

        grid = torch.linspace(-2.5 * law.level, 2.5 * law.level, 41, dtype=F64)
        assert (law.cdf(grid) - ecdf(grid)).abs().max() < 3e-3
        h = 0.25 * law.level
        centres = grid[1:-1]
        if law.distribution == "uniform":  # skip bins that straddle the support's edge
            centres = centres[((centres.abs() - law.half_width).abs() > h / 2)]
        hist = (ecdf(centres + h / 2) - ecdf(centres - h / 2)) / h
        assert torch.allclose(law.pdf(centres), hist, rtol=0.03, atol=0.03 / law.level)
    assert x.dtype == F64 and NoiseLaw(0.1).sample((3,)).dtype == torch.get_default_dtype()
    # numpy in → numpy out, tensor dtype kept
    law = NoiseLaw(0.1, "normal")
    assert isinstance(law.cdf(np.array([0.0, 1.0])), np.ndarray)
    assert law.cdf(np.array([0.0]))[0] == pytest.approx(0.5)
    assert law.pdf(torch.zeros(2, dtype=torch.float32)).dtype == torch.float32
    assert NoiseLaw(0.2).cdf(np.array([-1.0, 1.0])).tolist() == [0.0, 1.0]


# ----------------------------------------------------------------------------- curves & masks


def test_noise_level_at_rate_on_known_curves():
    levels = np.array([0.0, 0.02, 0.04, 0.06, 0.08])
    rates = 10 ** (-4 + levels / 0.025)  # log-linear curve crossing 1% at 0.05
    assert noise_level_at_rate(levels, rates) == pytest.approx(0.05)
    assert noise_level_at_rate(levels, rates, target=10 ** (-4 + 0.07 / 0.025)) == pytest.approx(0.07)
    assert noise_level_at_rate(levels, rates, target=rates[2]) == pytest.approx(0.04)  # exact hit
    # unsorted, with NaN and a zero lower rate (linear fallback): (0.01 − 0)/(0.04 − 0) of the way
    assert noise_level_at_rate(torch.tensor([0.2, 0.1, 0.15]), [0.04, 0.0, math.nan]) == pytest.approx(0.125)
    assert math.isnan(noise_level_at_rate(levels, rates * 1e-3))  # never reached
    assert math.isnan(noise_level_at_rate([0.1, 0.2], [0.05, 0.2]))  # already above at the start
    with pytest.raises(NoiseSpecError):
        noise_level_at_rate([0.1, 0.2], [0.01])
    with pytest.raises(NoiseSpecError):
        noise_level_at_rate([0.1, 0.2], [0.0, 0.1], target=0.0)


def test_sparse_and_nonsparse_masks():
    pattern = torch.tensor(
        [[0.95, 0.05, 0.0], [0.94, 0.06, 0.0], [0.70, 0.3, 0.0], [0.69, 0.31, 0.0], [1 / 3, 1 / 3, 1 / 3]]
    )
    assert sparse_mask(pattern).tolist() == [True, False, False, False, False]
    assert nonsparse_mask(pattern).tolist() == [False, False, False, True, True]
    assert sparse_mask(pattern.reshape(5, 1, 3), threshold=0.9).shape == (5, 1)
    with pytest.raises(ConfigError):
        sparse_mask(pattern, threshold=1.5)


def test_predict_rows_dispatches_on_how_noise_reaches_the_scores():
    """predict_rows (shared by noise/ and bridges/): each kind against its closed form."""
    from interp_norm.theory import THEORY_KINDS, predict_rows

    w = torch.tensor([[4.0, 1.0, -math.inf], [3.0, 2.5, 0.5]], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    uni, nor = NoiseLaw(0.2, "uniform"), NoiseLaw(0.5, "normal")
    assert set(THEORY_KINDS) == {"multiplicative", "removed_by_norm", "not_modelled"}
    lo, st_, ns = predict_rows(w, uni, ("q", "k"), "removed_by_norm", 0.95, 64, generator=gen)
    assert (lo == 0).all() and (st_ == 0).all() and math.isinf(ns)
    lo, st_, _ = predict_rows(w, nor, ("q", "k"), True, 0.95, 64, generator=gen)  # old bool form; 1+κ<0 is possible
    assert lo.isnan().all() and st_.isnan().all()
    lo, st_, _ = predict_rows(w, uni, ("q", "k"), "not_modelled", 0.95, 64, generator=gen)
    assert lo.isnan().all() and st_.isnan().all()
    lo, _, _ = predict_rows(w, nor, ("q",), "multiplicative", 0.95, 64, generator=gen)  # only a reversal: P(1+κ_q<0)
    assert torch.allclose(lo, torch.full((2,), 0.5 * math.erfc(1 / 0.5 / math.sqrt(2)), dtype=torch.float64))
    # multiplicative, uniform on both: Monte Carlo of the argmax of (1+κ_q)(1+κ_k) w
    lo, st_, ns = predict_rows(w, uni, ("q", "k"), "multiplicative", 0.95, 64, generator=gen)
    a = 0.2 * math.sqrt(3)
    g = torch.Generator().manual_seed(1)
    kq = (torch.rand(200_000, 2, 1, generator=g, dtype=torch.float64) * 2 - 1) * a
    kk = (torch.rand(200_000, 2, 3, generator=g, dtype=torch.float64) * 2 - 1) * a
    noised = (w.masked_fill(w.isneginf(), 0) * (1 + kq) * (1 + kk)).masked_fill(w.isneginf(), -math.inf)
    mc = (noised.argmax(-1) != w.argmax(-1)).double().mean(0)
    assert torch.allclose(lo, mc, atol=4e-3) and lo[1] > 0.05 and ns == 64 and not st_.isnan().any()
    _, st_, ns = predict_rows(w, uni, ("q", "k"), "multiplicative", 0.95, 64, generator=gen, softcap=30.0)
    assert st_.isnan().all() and math.isinf(ns)  # the theory's strict event has no soft cap
    with pytest.raises(NoiseSpecError, match="theory kind"):
        predict_rows(w, uni, ("q", "k"), "sometimes")
