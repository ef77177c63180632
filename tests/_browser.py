"""Headless-Chromium harness for the dashboard tests (test-only: the package never starts a browser).

:func:`browser_check` opens a page with Debian's Chromium (no sandbox, no network: every host
resolves to nothing), dumps the DOM after a virtual-time budget and reads what the page reports
about itself: ``#render-status`` (``data-expected`` / ``data-rendered`` / ``data-errors``), each
figure's ``data-*`` marks, and the ``[JS ERROR]`` title prefix (see :mod:`interp_norm.dashboard`).
"""

from __future__ import annotations

import html
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

from interp_norm.dashboard import ERROR_MARKER

__all__ = ["BrowserCheck", "browser_check", "find_chromium", "chromium_command", "ERROR_MARKER"]


@dataclass
class BrowserCheck:
    """What headless Chromium saw: counts from ``#render-status`` and each figure's ``data-*`` marks."""

    title: str
    expected: int
    rendered: int
    errors: int
    error_messages: str
    complete: bool
    figures: dict[str, dict[str, str]]  # figure id -> its data-* attributes
    dom: str
    wide_tables: int = -1  # tables wider than their panel (data-wide-tables)

    @property
    def ok(self) -> bool:
        return (self.complete and self.errors == 0 and not self.title.startswith(ERROR_MARKER)
                and self.expected == self.rendered == len(self.figures)
                and all(int(f.get("data-rendered", "0") or 0) > 0 for f in self.figures.values()))


def find_chromium() -> Optional[str]:
    """Debian's ``chromium`` (or ``chromium-browser`` / ``$CHROMIUM``), if installed."""
    import shutil

    env = os.environ.get("CHROMIUM")
    if env:
        return env
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def chromium_command(chromium: str, profile: str, extra: Sequence[str]) -> list[str]:
    """Headless, sandbox-free, network-free Chromium (every host resolves to nothing)."""
    return [
        chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio",
        "--host-resolver-rules=MAP * ~NOTFOUND", f"--user-data-dir={profile}", *extra,
    ]


def _attrs(tag: str) -> dict[str, str]:
    import re

    return {k: html.unescape(v) for k, v in re.findall(r'([\w-]+)="([^"]*)"', tag)}


def browser_check(
    path: Union[str, os.PathLike],
    *,
    screenshot: Optional[Union[str, os.PathLike]] = None,
    window: tuple[int, int] = (1300, 2000),
    selftest: bool = True,
    chromium: Optional[str] = None,
    budget_ms: int = 20000,
    timeout: float = 180,
) -> BrowserCheck:
    """Open a dashboard in headless Chromium and report what rendered (and optionally screenshot it).

    Uses ``--dump-dom`` after ``budget_ms`` of virtual time: the page's own error hooks and
    ``#render-status`` say whether any script failed and how many figures drew an SVG.
    """
    import re
    import subprocess
    import tempfile

    chromium = chromium or find_chromium()
    if chromium is None:
        raise FileNotFoundError("chromium is not installed (Debian: apt-get install chromium)")
    url = Path(path).resolve().as_uri() + ("#selftest" if selftest else "")
    with tempfile.TemporaryDirectory(prefix="interp-norm-chromium-") as tmp:
        profile = str(Path(tmp) / "dom")
        common = [f"--virtual-time-budget={budget_ms}", f"--window-size={window[0]},{window[1]}"]
        run = subprocess.run(chromium_command(chromium, profile, [*common, "--dump-dom", url]),
                             capture_output=True, text=True, timeout=timeout)
        dom = run.stdout
        if run.returncode != 0 or "<html" not in dom:
            raise RuntimeError(f"chromium failed (exit {run.returncode}): {run.stderr[-2000:]}")
        if screenshot is not None:
            shot = Path(screenshot).resolve()
            run2 = subprocess.run(chromium_command(chromium, str(Path(tmp) / "shot"), [*common, f"--screenshot={shot}", url]),
                                  capture_output=True, text=True, timeout=timeout)
            if run2.returncode != 0 or not shot.is_file():
                raise RuntimeError(f"chromium screenshot failed (exit {run2.returncode}): {run2.stderr[-2000:]}")
    m = re.search(r"<title>(.*?)</title>", dom, re.S)
    title = html.unescape(m.group(1)) if m else ""
    st = re.search(r'<span id="render-status"[^>]*>', dom)
    a = _attrs(st.group(0)) if st else {}
    figures = {}
    for tag in re.findall(r'<div [^>]*class="figure[^"]*"[^>]*>', dom):
        fa = _attrs(tag)
        figures[fa.get("id", f"?{len(figures)}")] = fa
    return BrowserCheck(
        title=title, expected=int(a.get("data-expected", -1)), rendered=int(a.get("data-rendered", -1)),
        errors=int(a.get("data-errors", -1)), error_messages=a.get("data-error-messages", ""),
        complete=a.get("data-complete") == "1", figures=figures, dom=dom,
        wide_tables=int(a.get("data-wide-tables", -1)),
    )
