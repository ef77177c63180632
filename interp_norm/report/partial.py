"""Each checkpoint's finished analyses on disk as soon as they finish, so an interrupted ``reproduce``
keeps them and a re-run analyses only the rest.

``OUT/partial/<checkpoint>/`` holds ``<table>.csv`` for each of its tables (to read while the run goes
on), ``result.pkl`` (the frames exactly, dtypes included: what a re-run reads back) and
``fingerprint.json`` (what was run: the checkpoint's path, step and files, the settings, the analyses). A
re-run whose fingerprint differs recomputes that checkpoint. ``reproduce`` removes the folder once
the whole report is written; ``--force`` discards it first. ``result.pkl`` is a pickle: read only
the folders this package wrote.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pandas as pd

PARTIAL = "partial"

#: (evaluation or None, {table key: [frames]}, {analysis: seconds}): one checkpoint's result.
Result = tuple[Optional[pd.DataFrame], dict[str, list[pd.DataFrame]], dict[str, float]]


def _files(path: Any) -> list:
    """(name, size, mtime) of the files in a checkpoint folder: a checkpoint rewritten in place differs."""
    try:
        return [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(Path(path).iterdir()) if f.is_file()]
    except (OSError, TypeError):
        return []


def fingerprint(info: Any, settings: Any, todo: Any, analysed: bool) -> str:
    """What decides a checkpoint's tables, as a canonical string."""
    facts = dict(path=str(getattr(info, "path", "")), step=getattr(info, "step", None), files=_files(getattr(info, "path", None)),
                 settings=({k: v for k, v in settings.as_dict().items() if k != "workers"}  # changes no table
                           if hasattr(settings, "as_dict") else repr(settings)),
                 analyses=sorted(todo), analysed=bool(analysed))
    return json.dumps(facts, sort_keys=True, default=repr)


def _safe(name: str) -> str:
    return re.sub(r"[^\w.-]", "_", name) or "_"


@dataclass
class PartialStore:
    """``root``: the report's output folder; the checkpoints' results live in ``root/partial``."""

    root: Path

    @property
    def folder(self) -> Path:
        return Path(self.root) / PARTIAL

    def path(self, name: str) -> Path:
        return self.folder / _safe(name)

    def load(self, name: str, key: str) -> Optional[Result]:
        """The stored result of ``name`` if it was computed with fingerprint ``key``, else None."""
        d = self.path(name)
        try:
            if (d / "fingerprint.json").read_text(encoding="utf-8") != key:
                return None
            ev, tables, seconds = pd.read_pickle(d / "result.pkl")
        except (OSError, ValueError, EOFError, ImportError, AttributeError, TypeError):
            return None  # missing, half written by an older version, or unreadable: recompute
        return ev, tables, seconds

    def save(self, name: str, key: str, result: Result) -> None:
        """Write ``result``: the tables as CSVs, then the pickle, then the fingerprint (written last,
        so a folder interrupted while being written is never taken as finished)."""
        from interp_norm.training.io import ensure_writable_dir, write_atomic, write_csv, write_text_atomic

        d = ensure_writable_dir(self.path(name))
        (d / "fingerprint.json").unlink(missing_ok=True)
        ev, tables, _ = result
        if ev is not None:
            write_csv(d / "evaluation.csv", ev)
        for table, frames in tables.items():
            if frames:
                write_csv(d / f"{table}.csv", pd.concat(frames, ignore_index=True))
        write_atomic(d / "result.pkl", lambda p: pd.to_pickle(result, p))
        write_text_atomic(d / "fingerprint.json", key, durable=False)

    def clear(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


__all__ = ["PartialStore", "fingerprint", "PARTIAL"]
