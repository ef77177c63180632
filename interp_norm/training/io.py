"""The only code that writes files: a writable-folder check, atomic writes, tables to CSV.

Everything the package writes (checkpoints, reports, dashboards, CLI tables) goes through here, so
"a killed process leaves the old file or the new one, never half of one" holds everywhere, and a
bad ``--out`` fails before any work starts (:func:`ensure_writable_dir`).
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping

import pandas as pd

from interp_norm.errors import OutputDirError

#: Files we write are readable by everyone, like ``open(..., "w")`` under the usual umask.
FILE_MODE = 0o644


def ensure_writable_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` if needed and prove we can write in it; else :class:`OutputDirError`.

    Called before any expensive work so a bad ``--out`` fails in a second, not after training.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputDirError(f"output path {str(path)!r} exists and is a file, not a folder; choose another --out")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OutputDirError(
            f"cannot write to output folder {str(path)!r} ({e.strerror or e}); choose a writable --out"
        ) from None
    return path


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open folders; rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike, write: Callable[[Path], object], *, durable: bool = False) -> Path:
    """Call ``write(tmp)`` on a hidden temporary file next to ``path``, then move it into place.

    Readers see the old content or the new, never a mix; an error removes the temporary file and
    raises :class:`OutputDirError` naming the path. ``durable=True`` also fsyncs file and folder
    (checkpoints); reports skip that cost.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        os.chmod(tmp, FILE_MODE)
        if durable:
            fsync_file(tmp)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OutputDirError(f"cannot write {str(path)!r} ({e.strerror or e}); choose a writable --out") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)
    return path


def write_text_atomic(path: str | os.PathLike, text: str, *, durable: bool = True) -> Path:
    """Write a text file atomically (UTF-8)."""
    return write_atomic(path, lambda p: p.write_text(text, encoding="utf-8"), durable=durable)


def write_json(path: str | os.PathLike, obj: Any, *, durable: bool = False) -> Path:
    """Write ``obj`` as indented JSON; numpy/torch scalars and paths become plain values."""
    return write_text_atomic(path, json.dumps(obj, indent=2, default=_json_default), durable=durable)


def write_csv(path: str | os.PathLike, df: pd.DataFrame, *, durable: bool = False) -> Path:
    """Write one table as CSV without the index."""
    return write_atomic(path, lambda p: df.to_csv(p, index=False), durable=durable)


def write_tables(folder: str | os.PathLike, tables: Mapping[str, pd.DataFrame]) -> dict[str, Path]:
    """Write every table as ``<folder>/<name>.csv``; returns ``{name: path}``."""
    folder = ensure_writable_dir(folder)
    return {name: write_csv(folder / f"{name}.csv", df) for name, df in tables.items()}


def _json_default(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (Path, os.PathLike)):
        return str(x)
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


__all__ = ["FILE_MODE", "ensure_writable_dir", "fsync_file", "fsync_dir", "write_atomic", "write_text_atomic",
           "write_json", "write_csv", "write_tables"]
