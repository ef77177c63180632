"""scripts/verdicts.py's robustness check: shown beside a claim with its raw p, never in the Holm family."""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import pandas as pd
import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
NOISE = "accuracy lost to 1% noise (all rows, before any norm)"
EXTRAP = "extrapolation accuracy"


@pytest.fixture(scope="module")
def verdicts():
    sys.path.insert(0, str(SCRIPTS))
    try:
        yield importlib.import_module("verdicts")
    finally:
        sys.path.remove(str(SCRIPTS))


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
