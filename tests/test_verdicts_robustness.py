"""The verdicts' robustness check (interp_norm.stats.verdicts): shown beside a claim with its raw p, never in the Holm family."""

from __future__ import annotations

import math

import pandas as pd
import pytest

NOISE = "accuracy lost to 1% noise (all rows, before any norm)"
EXTRAP = "extrapolation accuracy"


@pytest.fixture(scope="module")
def verdicts():
    from interp_norm.stats import verdicts

    return verdicts


def _seeds(quantity, a, b=()):
    return pd.DataFrame([dict(checkpoint=f"{norm}-s{i}", attn_norm=norm, calibration="none", seed=i, quantity=quantity,
                              unit="points", value=v, censored_above=math.nan)
                         for norm, vals in (("pre", a), ("qkv", b)) for i, v in enumerate(vals)])


def test_the_shared_kappa_row_is_beside_the_noise_claim_and_outside_the_family(verdicts):
    claim = [c for c in verdicts.CLAIMS if c.quantity == NOISE][0]
    _, shared, per_head = claim.robustness
    base = pd.concat([_seeds(NOISE, [12.1, 11.8, 12.6, 11.5, 12.3, 12.0]),
                      _seeds(EXTRAP, [80, 81, 82, 83, 84, 85], [70, 71, 72, 73, 74, 75])])
    # mean exactly 9.0 = the claim's value minus its margin: the one-sided t statistic is 0, so p = 1/2 both ways
    extra = pd.concat([base, _seeds(shared, [10.0, 8.0, 9.5, 8.5, 9.2, 8.8]), _seeds(per_head, [7.0] * 6)])
    without, with_ = verdicts.verdicts(base), verdicts.verdicts(extra)
    cols = ["claim", "p_for", "p_against", "holm_for", "holm_against", "verdict"]
    pd.testing.assert_frame_equal(without[cols], with_[cols])
    assert len(verdicts.family_table(base)) == len(verdicts.family_table(extra))
    row = with_[with_["claim"] == claim.text].iloc[0]
    assert "outside the family" in row["robustness"]
    assert "9.0 [" in row["robustness"] and "same draws: 7.0" in row["robustness"]
    assert "raw p 0.5 for / 0.5 against" in row["robustness"]
    assert row["robustness"] in row["evidence"]
    assert without[without["claim"] == claim.text].iloc[0]["robustness"] == ""


def test_too_few_seeds_give_no_robustness_text(verdicts):
    claim = [c for c in verdicts.CLAIMS if c.quantity == NOISE][0]
    frame = pd.concat([_seeds(NOISE, [12.1, 11.8, 12.6, 11.5, 12.3, 12.0]), _seeds(claim.robustness[1], [9.0, 10.0])])
    assert verdicts.verdicts(frame).iloc[0]["robustness"] == ""


def test_the_shipped_noise_model_costs_are_the_seed_tables_decomposition():
    """scripts/noise_model_seeds.py recomputed the per-head and shared-κ costs the verdict's robustness row reads
    from data/seed_tables/seed_values.csv (the report's decomposition, same problems and κ streams): both files agree."""
    from interp_norm.stats.shipped import seed_tables_dir

    data = seed_tables_dir()
    mine = pd.read_csv(data / "noise_model_values.csv")
    seeds = pd.read_csv(data / "seed_values.csv")
    pairs = {"accuracy lost to 1% noise, κ per head and vector (decomposition qkv)":
             "accuracy lost to 1% noise on q, k and v (decomposition)",
             "accuracy lost to 1% noise, one κ per token shared across heads (decomposition shared)":
             "accuracy lost to 1% noise on q, k and v with one κ per token shared across heads (decomposition)"}
    m = mine[mine["quantity"].isin(list(pairs))].assign(quantity=lambda d: d["quantity"].map(pairs))
    both = m.merge(seeds, on=["checkpoint", "quantity"], suffixes=("", "_seeds"))
    assert len(both) == len(m) == 2 * 24
    # accuracies are counts over the same tokens: equal up to float64 rounding of the mean of three ratios
    assert (both["value"] - both["value_seeds"]).abs().max() < 1e-9
