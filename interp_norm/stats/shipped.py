"""The shipped evidence about the shipped checkpoints: the 6-seed tables under ``data/seed_tables/``.

``make reproduce-seeds`` analyses every seed of the shipped Pre-/QKV-Norm variants (24 checkpoints: 6
seeds × pre, qkv, pre-cal, qkv-cal; about 40 minutes on two cores) and keeps the tables the verdicts and
the seed figures need in :func:`seed_tables_dir` (``data_dir()/seed_tables``): ``seed_values.csv`` (the
report's unrounded ``seed_numbers``), ``coupling_values.csv`` (the thesis measure),
``noise_model_values.csv``, ``seed_comparisons.csv``, ``seed_matched_id*.csv``, and that run's
``checkpoints.csv`` and ``run.json``. A quick report (``make reproduce``, seeds 0 and 1) reads them
instead of its own 2-seed tables when it is of the shipped checkpoints (:func:`shipped_in`): two seeds
can never show a difference, six can.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pandas as pd

from interp_norm.stats.seed_compare import compare_seeds
from interp_norm.training.checkpoints import data_dir, pretrained_dir

__all__ = ["SEED_TABLES", "is_shipped_checkpoint", "shipped_checkpoints", "seed_tables_dir", "read_seed_table", "seed_values", "shipped_in", "shipped_seed_tables"]

#: The folder under the data folder that holds the shipped seed tables.
SEED_TABLES = "seed_tables"


def seed_tables_dir() -> Path:
    return data_dir() / SEED_TABLES


def read_seed_table(name: str) -> Optional[pd.DataFrame]:
    """``seed_tables_dir()/name`` (``name`` with or without ``.csv``) as a DataFrame, None if it is absent."""
    path = seed_tables_dir() / (name if name.endswith(".csv") else f"{name}.csv")
    return pd.read_csv(path) if path.is_file() else None


def seed_values() -> Optional[pd.DataFrame]:
    """The verdicts' input: the per-seed values with the thesis measure (coupling_values.csv) when it exists;
    None without the shipped seed tables."""
    values = read_seed_table("seed_values")
    coupling = read_seed_table("coupling_values")
    if values is None or coupling is None:
        return values
    return pd.concat([values, coupling], ignore_index=True)


def _weights_hash(folder: Path) -> Optional[str]:
    """The sha256 a checkpoint folder's config.json records for its weights (None if unreadable)."""
    try:
        files = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("files", {})
        return next(iter(v["sha256"] for k, v in files.items() if k.endswith(".safetensors")), None)
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None


def is_shipped_checkpoint(name: str, path: object) -> bool:
    """Whether the report's checkpoint ``name`` at ``path`` is the shipped checkpoint of that name: the same
    folder, or a copy with the same weights (its config.json's sha256)."""
    shipped = pretrained_dir() / name
    if not shipped.is_dir() or not isinstance(path, str) or not path:
        return False
    here = Path(path)
    if here.resolve() == shipped.resolve():
        return True
    mine = _weights_hash(here)
    return mine is not None and mine == _weights_hash(shipped)


def shipped_checkpoints(checkpoints: Optional[pd.DataFrame]) -> list[str]:
    """The report's checkpoints (its ``checkpoints`` table: ``checkpoint`` and ``path``) that are shipped
    checkpoints (:func:`is_shipped_checkpoint`); empty for a report of other checkpoints."""
    if checkpoints is None or not len(checkpoints) or "path" not in checkpoints.columns:
        return []
    return [str(n) for n, p in zip(checkpoints["checkpoint"], checkpoints["path"]) if is_shipped_checkpoint(str(n), p)]


def shipped_in(checkpoints: Optional[pd.DataFrame]) -> list[str]:
    """:func:`shipped_checkpoints` that the shipped seed tables cover."""
    values = read_seed_table("seed_values")
    if values is None:
        return []
    covered = set(values["checkpoint"].astype(str))
    return [n for n in shipped_checkpoints(checkpoints) if n in covered]


def shipped_seed_tables() -> dict[str, pd.DataFrame]:
    """The seed figures' tables from the shipped 6-seed values: ``seed_comparisons`` and
    ``seed_comparison_values`` recomputed from seed_values.csv by :func:`compare_seeds` (the same numbers
    as the shipped seed_comparisons.csv), ``seed_matched_id`` and ``seed_matched_id_values`` as shipped.
    Empty without the shipped tables."""
    values = read_seed_table("seed_values")
    if values is None:
        return {}
    out: dict[str, pd.DataFrame] = {}
    out["seed_comparisons"], out["seed_comparison_values"] = compare_seeds(values)
    for name in ("seed_matched_id", "seed_matched_id_values"):
        table = read_seed_table(name)
        if table is not None:
            out[name] = table
    return out
