"""The shipped seed tables (data/seed_tables/) and their reader, interp_norm.stats.shipped."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from interp_norm.report.dashboard.verdicts import verdict_note, verdict_section
from interp_norm.stats import shipped
from interp_norm.stats.seed_compare import compare_seeds

pytestmark = pytest.mark.skipif(not (shipped.seed_tables_dir() / "seed_values.csv").is_file(),
                                reason="needs data/seed_tables/")


def test_the_shipped_comparisons_are_what_compare_seeds_makes_of_the_shipped_values():
    values = pd.read_csv(shipped.seed_tables_dir() / "seed_values.csv")
    recomputed, _ = compare_seeds(values)
    stored = pd.read_csv(shipped.seed_tables_dir() / "seed_comparisons.csv")
    assert list(recomputed.columns) == list(stored.columns) and len(recomputed) == len(stored)
    for c in stored.columns:
        if stored[c].dtype.kind == "f":
            # stored as CSV text: the 17 significant digits pandas writes round-trip float64 exactly
            np.testing.assert_allclose(recomputed[c].to_numpy(float), stored[c].to_numpy(float), rtol=1e-15,
                                       atol=0, equal_nan=True, err_msg=c)
        else:
            assert (recomputed[c].fillna("").astype(str) == stored[c].fillna("").astype(str)).all(), c


def test_six_seeds_per_arm_and_the_thesis_measure_are_shipped():
    values = shipped.seed_values()
    arms = values[values["attn_norm"].isin(["pre", "qkv"]) & values["calibration"].isin(["none", "paper"])]
    assert arms.groupby(["attn_norm", "calibration"])["checkpoint"].nunique().tolist() == [6, 6, 6, 6]
    assert values["quantity"].str.startswith("attention moved by halving the token component").any()


def test_without_the_seed_tables_nothing_is_shown_and_the_page_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("INTERP_NORM_DATA", str(tmp_path))
    assert shipped.seed_values() is None and shipped.shipped_seed_tables() == {}
    from types import SimpleNamespace

    report = SimpleNamespace(tables={}, checkpoints=pd.DataFrame(dict(checkpoint=["pre"], path=["/x/pre"])),
                             timings={}, notes=[])
    assert shipped.shipped_in(report.checkpoints) == [] and verdict_section(report) is None
    assert "no shipped seed tables" in verdict_note(report)
