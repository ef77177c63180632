"""The verdict rules of :mod:`interp_norm.stats.verdicts` on constructed seeds, whose verdict follows from
the arithmetic: separated or interleaved arms, values inside or outside a declared margin, censored seeds,
Holm over the family by hand, a control beside its claim."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from interp_norm.stats import verdicts


def _seeds(quantity, a, b=(), cal="none", censored_a=()):
    """Per-seed rows as in data/seed_tables/seed_values.csv: arm A Pre-Norm, arm B QKV-Norm."""
    rows = [dict(checkpoint=f"{norm}-{cal}-s{i}", attn_norm=norm, calibration=cal, seed=i, quantity=quantity, unit="%",
                 value=v, censored_above=c)
            for norm, vals, cens in (("pre", a, censored_a or [float("nan")] * len(a)), ("qkv", b, [float("nan")] * len(b)))
            for i, (v, c) in enumerate(zip(vals, cens))]
    return pd.DataFrame(rows)


_ID, _EXTRAP, _NOISE, _COLLAPSE, _PEAK = ("ID accuracy", "extrapolation accuracy",
                                          "accuracy lost to 1% noise (all rows, before any norm)",
                                          "1% loose collapse level, per-layer protocol",
                                          "rows with max attention ≥ 0.99, all layers")


@pytest.mark.parametrize("quantity, a, b, expected", [
    (_EXTRAP, [80, 81, 82, 83, 84, 85], [70, 71, 72, 73, 74, 75], "reproduced"),  # the paper's direction, separated
    (_EXTRAP, [70, 71, 72, 73, 74, 75], [80, 81, 82, 83, 84, 85], "not reproduced (reversed)"),
    (_EXTRAP, [70, 81, 72, 83, 74, 85], [80, 71, 82, 73, 84, 75], "not established"),
    (_ID, [91.0, 91.3, 90.8, 91.2, 90.9, 91.1], [91.1, 90.9, 91.2, 91.0, 90.8, 91.3], "reproduced"),  # within ±1
    (_ID, [85.0, 86.0, 85.5, 84.9, 85.2, 86.1], [91.1, 90.9, 91.2, 91.0, 90.8, 91.3], "not reproduced"),
    (_NOISE, [12.1, 11.8, 12.6, 11.5, 12.3, 12.0], (), "reproduced"),  # clearly above 10 − 1
    (_NOISE, [3.1, 4.2, 2.8, 3.9, 3.5, 4.1], (), "not reproduced"),
    # a rule reading the bootstrap interval's upper end would say "reproduced" here (it reaches 10): mean 8.8
    (_NOISE, [8.0, 10.6, 6.4, 11.2, 8.1, 8.5], (), "not established"),
    (_COLLAPSE, [10.9, 11.2, 10.7, 11.4, 11.0, 10.8], (), "reproduced"),  # within 11 ± 2.2
    (_COLLAPSE, [26.0, 28.0, 25.0, 27.5, 26.5, 27.0], (), "not reproduced"),
])
def test_verdict_rules_on_constructed_seeds(quantity, a, b, expected):
    v = verdicts
    t = v.verdicts(_seeds(quantity, a, b))
    assert list(t["verdict"]) == [expected]


def test_an_upper_end_rule_and_the_one_sided_test_disagree_on_the_same_seeds():
    from interp_norm.stats.inference import bootstrap_mean_ci

    seeds = [8.0, 10.6, 6.4, 11.2, 8.1, 8.5]
    assert bootstrap_mean_ci(seeds)[1] >= 10.0  # the interval's far end reaches the paper's value
    r = verdicts.verdicts(_seeds(_NOISE, seeds)).iloc[0]
    assert r["verdict"] == "not established" and r["p_for"] > 0.5


def test_censored_seeds_are_lower_bounds_and_can_only_refute():
    nan = float("nan")
    v = verdicts
    high = v.verdicts(_seeds(_COLLAPSE, [nan, 40.0, 38.0, nan, 45.0, 41.0], censored_a=[50.0, nan, nan, 50.0, nan, nan]))
    assert high["verdict"].iloc[0] == "not reproduced" and np.isnan(high["p_for"].iloc[0])
    low = v.verdicts(_seeds(_COLLAPSE, [nan, 11.0, 10.0, nan, 12.0, 11.5], censored_a=[50.0, nan, nan, 50.0, nan, nan]))
    assert low["verdict"].iloc[0] == "not established"


def test_families_are_holm_over_the_tests_for_and_the_tests_against_and_identities_leave_them():
    v = verdicts
    peak = [c for c in v.CLAIMS if c.quantity == _PEAK][0]
    claims = tuple(c if c is not peak else v.Claim(
        c.text, c.paper, c.quantity, c.rule, c.sign, identity={"Checkpoint calibration": "QKV-cal: 0 by construction"})
        for c in v.CLAIMS)
    frame = pd.concat([_seeds(_EXTRAP, [80, 81, 82, 83, 84, 85], [70, 71, 72, 73, 74, 75]),
                       _seeds(_NOISE, [12.1, 11.8, 12.6, 11.5, 12.3, 12.0]),
                       _seeds(_PEAK, [0.5, 0.2, 0.9, 0.1, 0.3, 0.4], [0.0] * 6, cal="paper")])
    t = v.verdicts(frame, claims)
    peak = t[t["claim"].str.startswith("attention peaks")].iloc[0]
    assert peak["verdict"] == "identity" and np.isnan(peak["holm_for"])
    fam = v.family_table(frame, claims)
    assert len(fam) == 4  # two claims, a test for and against each; the identity is not a member
    for side in ("for", "against"):  # two families: the tests for, the tests against
        g = fam[fam["test"] == side]
        p = np.sort(g["p_raw"].to_numpy())
        # Holm by hand within the family of two: adjusted p_(i) = max_{j<=i} (m − j + 1)·p_(j), capped at 1
        want = np.minimum(1, np.maximum.accumulate([2 * p[0], p[1]]))
        assert np.sort(g["p_holm"].to_numpy()) == pytest.approx(want)
    # the ordering's one-sided exact p for separated 6 + 6 seeds: 1 of C(12, 6) = 924 splits
    assert fam[(fam["test"] == "for") & fam["claim"].str.contains("extrapolates")]["p_raw"].iloc[0] == pytest.approx(1 / 924)


def test_a_control_is_shown_beside_its_claim_and_stays_out_of_the_family():
    v = verdicts
    thesis = [c for c in v.CLAIMS if c.control][0]
    frame = pd.concat([_seeds(thesis.quantity, [10.1, 10.9, 11.4, 10.2, 10.8, 11.0], [8.1, 8.9, 9.0, 8.4, 8.6, 9.2]),
                       _seeds(thesis.control, [7.0, 7.2, 6.9, 7.4, 7.1, 7.3], [5.8, 5.6, 6.1, 5.9, 5.7, 6.0])])
    fam = v.family_table(frame)
    assert len(fam) == 2 and set(fam["test"]) == {"for", "against"}  # the control adds no member
    r = v.verdicts(frame).iloc[0]
    # control means 7.15 and 5.85 (both just below .x5 in binary floating point, so shown as 7.1 and 5.8)
    assert r["verdict"] == "reproduced" and "control (equal-norm random subspace): 7.1 vs 5.8" in r["evidence"]
    assert "raw p 0.0011" in r["evidence"]  # separated 6 + 6 seeds: 1 of 924 splits, one-sided


def test_the_declared_families_can_establish_an_ordering_claim_on_the_shipped_design():
    """A rule that cannot succeed is no test: with 6 + 6 seeds and the shipped claims, a complete ordering
    survives Holm in its family (one family of both sides could not: 51 / 924 > 0.05)."""
    v = verdicts
    from interp_norm.stats.shipped import seed_values

    t = v.verdicts(seed_values())
    member = t["identity"] == ""
    n_for = int(t.loc[member, "p_for"].notna().sum())
    n_both = n_for + int(t.loc[member, "p_against"].notna().sum())
    assert v.smallest_adjusted_order_p(6, 6, n_for) < v.ALPHA <= v.smallest_adjusted_order_p(6, 6, n_both)
    assert v.smallest_adjusted_order_p(6, 6, 10) == pytest.approx(10 / 924)
