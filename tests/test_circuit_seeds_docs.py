"""docs/findings-tables.md's circuit section is what scripts/circuit_seeds.py builds from docs/data."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_circuit_section_is_current():
    scripts = ROOT / "scripts"
    if not (ROOT / "docs" / "data" / "circuit_seed_comparisons.csv").exists():
        pytest.skip("no circuit seed tables in docs/data")
    sys.path.insert(0, str(scripts))
    try:
        spec = importlib.util.spec_from_file_location("circuit_seeds", scripts / "circuit_seeds.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        import _docs
    finally:
        sys.path.remove(str(scripts))
    assert _docs.block("CIRCUIT-TABLES", mod.PAGE) == mod.markdown_from_data(mod.DATA), \
        "run scripts/circuit_seeds.py summarise --write"
