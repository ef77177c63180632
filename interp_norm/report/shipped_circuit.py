"""The addition circuit of the shipped checkpoints, read from the tables kept in the repository.

Locating the circuit of one checkpoint takes minutes, so ``make reproduce`` (3 minutes for everything)
cannot compute it; ``scripts/circuit_seeds.py`` did, once, over the 24 checkpoints of ``pre``, ``qkv``,
``pre-cal`` and ``qkv-cal`` (6 seeds each), and keeps its tables in ``data/seed_tables/circuit_*.csv``. A run
on the shipped set puts those tables in its report under :data:`TABLES`' keys, so the default
dashboard has the section "The addition circuit" with where its numbers come from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pandas as pd

from interp_norm.stats.shipped import seed_tables_dir

#: Report table key -> the file in data/seed_tables it is read from.
TABLES: dict[str, str] = {
    "shipped_circuit_verification": "circuit_verification.csv",
    "shipped_circuit_cells": "circuit_circuit_per_checkpoint.csv",
    "shipped_circuit_curve": "circuit_curve_per_checkpoint.csv",
    "shipped_circuit_noise_cost": "circuit_noise_cost.csv",
    "shipped_circuit_noise_cost_seeds": "circuit_noise_cost_seeds.csv",
    "shipped_circuit_comparisons": "circuit_seed_comparisons.csv",
}
#: Where the tables come from (the dashboard's caption).
SOURCE = ("not computed in this run: read from data/seed_tables/circuit_*.csv, written by scripts/circuit_seeds.py over the "
          "24 checkpoints pre, qkv, pre-cal, qkv-cal (seeds 0-5 each), 256 ID problems per checkpoint")


def shipped_circuit_tables(folder: Optional[Path] = None) -> dict[str, pd.DataFrame]:
    """The kept tables under their report keys; empty when the folder lacks any of them (an install
    without the repository's docs), so a report never shows part of the section."""
    folder = seed_tables_dir() if folder is None else Path(folder)
    paths = {k: folder / f for k, f in TABLES.items()}
    if not all(p.is_file() for p in paths.values()):
        return {}
    return {k: pd.read_csv(p) for k, p in paths.items()}


__all__ = ["SOURCE", "TABLES", "shipped_circuit_tables"]
