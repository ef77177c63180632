"""Compare every CSV of two ``interp-norm reproduce`` reports: same files, same columns, same numbers.

    python scripts/compare_reports.py OLD_DIR NEW_DIR [--rtol 1e-9] [--atol 0] [--ignore timings.csv ...]

Numbers are equal when ``|new - old| <= atol + rtol * |old|`` (NaN equals NaN); every other cell
must be equal as text. ``timings.csv`` (wall times) and ``checkpoints.csv`` (absolute paths) are
skipped unless ``--ignore`` is given explicitly. Prints one verdict per file and exits 1 if any
file differs or is missing on either side, 0 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

DEFAULT_IGNORE = ("timings.csv", "checkpoints.csv")


def compare_frames(old: pd.DataFrame, new: pd.DataFrame, rtol: float, atol: float) -> list[str]:
    """Differences between two tables, as short messages (empty: equal)."""
    if list(old.columns) != list(new.columns):
        gone = [c for c in old.columns if c not in new.columns]
        added = [c for c in new.columns if c not in old.columns]
        if gone or added:
            return [f"columns differ: missing {gone}, new {added}"]
        return [f"column order differs: {list(old.columns)} vs {list(new.columns)}"]
    if len(old) != len(new):
        return [f"{len(old)} rows vs {len(new)} rows"]
    out = []
    for col in old.columns:
        a, b = old[col], new[col]
        if pd.api.types.is_numeric_dtype(a) and pd.api.types.is_numeric_dtype(b):
            x, y = a.to_numpy(dtype=float), b.to_numpy(dtype=float)
            both_nan = np.isnan(x) & np.isnan(y)
            with np.errstate(invalid="ignore"):
                close = both_nan | (np.abs(y - x) <= atol + rtol * np.abs(x)) | (x == y)
            if not close.all():
                i = int(np.flatnonzero(~close)[0])
                worst = np.nanmax(np.where(close, 0.0, np.abs(y - x) / np.maximum(np.abs(x), 1e-300)))
                out.append(f"{col}: {int((~close).sum())} cells differ (row {i}: {x[i]!r} vs {y[i]!r}; "
                           f"max relative difference {worst:.3g})")
        else:
            sa, sb = a.astype(str).to_numpy(), b.astype(str).to_numpy()
            diff = (sa != sb) & ~(a.isna().to_numpy() & b.isna().to_numpy())  # an empty cell equals an empty cell
            if diff.any():
                i = int(np.flatnonzero(diff)[0])
                out.append(f"{col}: {int(diff.sum())} cells differ (row {i}: {sa[i]!r} vs {sb[i]!r})")
    return out


def compare_reports(old_dir: Path, new_dir: Path, rtol: float = 1e-9, atol: float = 0.0,
                    ignore: tuple[str, ...] = DEFAULT_IGNORE) -> dict[str, list[str]]:
    """``{file name: differences}`` for every CSV in either folder (an empty list: the same)."""
    names = sorted({p.name for d in (old_dir, new_dir) for p in d.glob("*.csv")} - set(ignore))
    verdicts: dict[str, list[str]] = {}
    for name in names:
        a, b = old_dir / name, new_dir / name
        if not a.is_file():
            verdicts[name] = [f"only in {new_dir}"]
        elif not b.is_file():
            verdicts[name] = [f"only in {old_dir}"]
        else:
            verdicts[name] = compare_frames(_read(a), _read(b), rtol, atol)
    return verdicts


def _read(path: Path) -> pd.DataFrame:
    try:
        return pd.read_csv(path)
    except pd.errors.EmptyDataError:
        return pd.DataFrame()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Compare the CSV tables of two interp-norm reports.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("old", type=Path, help="the reference report folder")
    ap.add_argument("new", type=Path, help="the report folder to check")
    ap.add_argument("--rtol", type=float, default=1e-9, help="relative tolerance for numbers")
    ap.add_argument("--atol", type=float, default=0.0, help="absolute tolerance for numbers")
    ap.add_argument("--ignore", nargs="*", default=list(DEFAULT_IGNORE), help="CSV file names not compared")
    args = ap.parse_args(argv)
    for d in (args.old, args.new):
        if not d.is_dir():
            print(f"compare_reports: error: {str(d)!r} is not a folder", file=sys.stderr)
            return 2
    verdicts = compare_reports(args.old, args.new, args.rtol, args.atol, tuple(args.ignore))
    if not verdicts:
        print("compare_reports: error: no CSV files in either folder", file=sys.stderr)
        return 2
    width = max(map(len, verdicts))
    for name, diffs in verdicts.items():
        print(f"{name:<{width}}  {'same' if not diffs else 'DIFFERENT'}")
        for d in diffs:
            print(f"{'':<{width}}    {d}")
    n_bad = sum(bool(d) for d in verdicts.values())
    tol = f"rtol {args.rtol:g}" + (f", atol {args.atol:g}" if args.atol else "")
    print(f"{len(verdicts) - n_bad} of {len(verdicts)} tables the same ({tol}); ignored: {', '.join(args.ignore) or 'none'}")
    return 1 if n_bad else 0


if __name__ == "__main__":
    sys.exit(main())
