"""The offline dashboard: every figure of a :class:`~interp_norm.report.reproduce.Report` in one HTML file.

:mod:`~interp_norm.report.dashboard.sections` chooses the figures and tables (from :mod:`interp_norm.report.plots`),
:mod:`~interp_norm.report.dashboard.page` renders them as one self-contained page (plotly.js embedded once,
user text escaped, a render status the browser test reads). This module ties them to a report (any object
with ``tables``, ``checkpoints``, ``timings`` and ``notes``, e.g. a
:class:`~interp_norm.report.reproduce.Report`) and writes the file through :mod:`interp_norm.training.io`;
:func:`interp_norm.report.reproduce.make_dashboard` runs the analyses first. The headless-browser check
lives in ``tests/_devtools.py`` (driven by ``tests/test_browser.py``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Optional, Union

from interp_norm.report.dashboard.page import ERROR_MARKER, Panel, Section, render_html, table_html
from interp_norm.report.dashboard.sections import figure_sections
from interp_norm.report.dashboard.verdicts import verdict_note
from interp_norm.errors import OutputDirError
from interp_norm.report.plots._style import base_variant

__all__ = [
    "ERROR_MARKER",
    "Panel",
    "Section",
    "figure_sections",
    "render_html",
    "table_html",
    "dashboard_html",
    "page_title",
    "hf_model_names",
    "write_dashboard",
    "report_from_folder",
]


def hf_model_names(report: Any) -> list[str]:
    """The Hugging Face models a report compares beside ours (from its ``real_*`` tables)."""
    from interp_norm.report.dashboard.real_models import display_name

    names: list[str] = []
    for key in ("real_layers", "real_anatomy"):
        t = getattr(report, "tables", {}).get(key)
        if t is not None and "model" in t.columns:
            names += [display_name(m) for m in t["model"]]
    return list(dict.fromkeys(names))


def page_title(report: Any) -> str:
    """A title that fits what was analysed: one model's name, or the variants compared, and the
    Hugging Face models beside them."""
    ck = report.checkpoints
    hf = hf_model_names(report)
    if not len(ck):
        return (" vs ".join(hf) + ": interp_norm dashboard") if hf else "interp_norm dashboard"
    labels = list(dict.fromkeys(map(str, ck["label"] if "label" in ck.columns else ck["checkpoint"])))
    if len(ck) == 1:
        ours = labels[0]
    else:
        variants = list(dict.fromkeys(base_variant(v) or v for v in labels))
        ours = f"{variants[0]} ({len(ck)} checkpoints)" if len(variants) == 1 else " vs ".join(variants)
    return ours + (" beside " + ", ".join(hf) if hf else "") + ": interp_norm dashboard"


def dashboard_html(report: Any, title: Optional[str] = None, strict: bool = False, csv_links: bool = True) -> str:
    """The dashboard of a :class:`~interp_norm.report.reproduce.Report` as one HTML string (``title``:
    default :func:`page_title`)."""
    title = title or page_title(report)
    sections, problems = figure_sections(report, strict=strict, csv=csv_links)
    facts: dict[str, Any] = {}
    if len(report.checkpoints):
        facts["checkpoints"] = ", ".join(map(str, report.checkpoints["checkpoint"]))
    hf = hf_model_names(report)
    if hf:
        facts["Hugging Face models"] = ", ".join(hf)
    total = report.timings.get("total")
    if total:
        facts["analysis time"] = f"{total:.0f} s"
    facts["generated"] = time.strftime("%Y-%m-%d %H:%M")
    links = [f"{k}.csv" for k in report.tables] if csv_links else []
    on = ("small addition transformers" + (" beside Hugging Face models" if hf else "") if len(report.checkpoints)
          else "Hugging Face models")
    subtitle = ("Mechanistic interpretability of attention normalisation (Menary, Kaski & Freitas 2024): circuits, "
                f"norm noise and circuit collapse, and residual-stream geometry, on {on}.")
    return render_html(sections, title=title, subtitle=subtitle, facts=facts,
                       notes=[*report.notes, *filter(None, [verdict_note(report)]),
                              *[f"figure skipped: {p}" for p in problems]], csv_links=links)


def report_from_folder(folder: Union[str, os.PathLike]) -> Any:
    """The report ``reproduce`` wrote to ``folder``, read back as what :func:`dashboard_html` reads (``tables``:
    every ``<key>.csv``; ``checkpoints.csv``, ``timings.csv`` and ``run.json``'s notes as they were), so its
    dashboard can be drawn again without analysing anything (``scripts/dashboard_screenshot.py --report``)."""
    import json
    from types import SimpleNamespace

    import pandas as pd

    folder = Path(folder)
    if not (folder / "run.json").is_file():
        raise OutputDirError(f"{str(folder)!r} is not a report folder (no run.json); give the folder "
                             "'interp-norm reproduce --out' wrote")
    special = {"checkpoints", "timings"}
    tables = {p.stem: pd.read_csv(p) for p in sorted(folder.glob("*.csv")) if p.stem not in special}
    ck = pd.read_csv(folder / "checkpoints.csv") if (folder / "checkpoints.csv").is_file() else pd.DataFrame()
    timings: dict[str, float] = {}
    if (folder / "timings.csv").is_file():
        t = pd.read_csv(folder / "timings.csv")
        timings = {str(k): float(v) for k, v in zip(t.iloc[:, 0], t.iloc[:, 1])}
    notes = json.loads((folder / "run.json").read_text(encoding="utf-8")).get("notes", [])
    return SimpleNamespace(tables=tables, checkpoints=ck, timings=timings, notes=list(notes))


def write_dashboard(report: Any, path: Union[str, os.PathLike], **kwargs: Any) -> Path:
    """Write :func:`dashboard_html` to ``path`` (its folder is created; :class:`OutputDirError` if impossible)."""
    from interp_norm.training.io import ensure_writable_dir, write_text_atomic

    path = Path(path)
    if path.is_dir():
        raise OutputDirError(f"{str(path)!r} is a folder; give a file name such as dashboard.html")
    ensure_writable_dir(path.parent if str(path.parent) else Path("."))
    return write_text_atomic(path, dashboard_html(report, **kwargs), durable=False)
