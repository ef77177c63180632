"""scripts/compare_reports.py: equal reports pass; a changed number, column, row or file fails."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
from _scripts import load_script

C = load_script("compare_reports")


def write(folder: Path, **tables: pd.DataFrame) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, df in tables.items():
        df.to_csv(folder / f"{name}.csv", index=False)
    return folder


BASE = pd.DataFrame(dict(variant=["Pre-Norm", "QKV-Norm"], level=[0.1, 0.2], accuracy=[0.5, math.nan]))


def test_equal_reports_pass_and_timings_are_ignored(tmp_path, capsys):
    a = write(tmp_path / "a", noise=BASE, timings=pd.DataFrame(dict(stage=["x"], seconds=[1.0])))
    b = write(tmp_path / "b", noise=BASE.assign(accuracy=[0.5 * (1 + 1e-12), math.nan]),
              timings=pd.DataFrame(dict(stage=["x"], seconds=[9.0])))
    assert C.main([str(a), str(b)]) == 0
    assert "noise.csv" in capsys.readouterr().out


def test_empty_text_cells_on_both_sides_are_equal(tmp_path):
    """pandas 3 reads a text column with empty cells as ``str`` dtype holding NaN, and NaN != NaN."""
    df = BASE.assign(note=[math.nan, "x"])
    assert C.main([str(write(tmp_path / "a", t=df)), str(write(tmp_path / "b", t=df))]) == 0
    assert C.main([str(write(tmp_path / "c", t=df)), str(write(tmp_path / "d", t=df.assign(note=["y", "x"])))]) == 1


@pytest.mark.parametrize("change, needle", [
    (lambda df: df.assign(accuracy=[0.5 + 1e-6, math.nan]), "accuracy: 1 cells differ"),
    (lambda df: df.assign(accuracy=[0.5, 0.1]), "accuracy: 1 cells differ"),
    (lambda df: df.assign(variant=["Pre-Norm", "QK-Norm"]), "variant: 1 cells differ"),
    (lambda df: df.assign(variant=["Pre-Norm", None]), "variant: 1 cells differ"),  # an empty cell is not a text
    (lambda df: df.drop(columns="level"), "missing ['level']"),
    (lambda df: df.iloc[:1], "2 rows vs 1 rows"),
])
def test_a_difference_fails_and_is_named(tmp_path, capsys, change, needle):
    a = write(tmp_path / "a", noise=BASE)
    b = write(tmp_path / "b", noise=change(BASE))
    assert C.main([str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "DIFFERENT" in out and needle in out


def test_a_missing_file_fails(tmp_path, capsys):
    a = write(tmp_path / "a", noise=BASE, collapse=BASE)
    b = write(tmp_path / "b", noise=BASE)
    assert C.main([str(a), str(b)]) == 1
    assert "only in" in capsys.readouterr().out
    assert C.main([str(a), str(tmp_path / "nothing")]) == 2


def test_empty_text_cells_are_equal(tmp_path, capsys):
    """A text column with empty cells on both sides (read back as NaN) is the same table."""
    df = BASE.assign(method=["exact", None])
    a, b = write(tmp_path / "a", noise=df), write(tmp_path / "b", noise=df.copy())
    assert C.main([str(a), str(b)]) == 0
