"""docs/findings-tables.md's circuit section is what scripts/circuit_seeds.py builds from data/seed_tables."""

from __future__ import annotations

from pathlib import Path

import pytest
from _scripts import load_script

ROOT = Path(__file__).resolve().parent.parent


def test_circuit_section_is_current():
    if not (ROOT / "data" / "seed_tables" / "circuit_seed_comparisons.csv").exists():
        pytest.skip("no circuit seed tables in data/seed_tables")
    mod, _docs = load_script("circuit_seeds"), load_script("_docs")
    assert _docs.block("CIRCUIT-TABLES", mod.PAGE) == mod.markdown_from_data(mod.DATA), \
        "run scripts/circuit_seeds.py summarise --write"


def test_circuit_findings_cite_only_numbers_the_tables_hold():
    """Every "mean [lo, hi]" and "p = x" of docs/results.md's addition-circuit section is a cell of
    docs/findings-tables.md: the prose cannot drift from the tables."""
    import re

    prose = load_script("_docs").block("CIRCUIT-FINDINGS")
    page = (ROOT / "docs" / "findings-tables.md").read_text(encoding="utf-8")
    intervals = re.findall(r"-?\d+\.\d \[-?\d+\.\d, -?\d+\.\d\]", prose)
    assert len(intervals) >= 20
    assert not [x for x in intervals if x not in page], [x for x in intervals if x not in page]
    cells = set(re.findall(r"\| (\d[\d.e-]*\d|\d)(?= \|)", page))  # adjacent cells share a "|"
    p_values = re.findall(r"p = (\d[\d.e-]*\d|\d)", prose)
    assert p_values and not [p for p in p_values if p not in cells], [p for p in p_values if p not in cells]
