"""Write docs/dashboard.png: the top of the dashboard of the shipped reference checkpoints, as headless Chromium shows it.

    python scripts/dashboard_screenshot.py                      # analyse the shipped set (--quick sizes) first
    python scripts/dashboard_screenshot.py --dashboard report/dashboard.html --full-page-to shots/

Uses the test suite's DevTools driver (tests/_devtools.py; Debian's chromium, no network).
``--full-page-to`` also writes one PNG per figure at 1000, 1280 and 1400 px, for looking at every figure.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dashboard", help="an existing dashboard.html (default: run 'reproduce --quick' on the shipped set)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "dashboard.png"))
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=1700)
    ap.add_argument("--full-page-to", help="folder for one PNG per figure at 1000, 1280 and 1400 px")
    args = ap.parse_args()

    from _devtools import Browser
    from test_browser import find_chromium

    chromium = find_chromium()
    if chromium is None:
        sys.exit("chromium is not installed (Debian: apt-get install chromium; 'make browser')")
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(args.dashboard) if args.dashboard else None
        if page is None:
            from interp_norm.report.reproduce import reproduce

            reproduce(Path(tmp) / "report", quick=True, progress=True)
            page = Path(tmp) / "report" / "dashboard.html"
        with Browser(chromium) as b:
            load = b.load(page, args.width)
            if load.console_errors or load.requests or not load.complete:
                sys.exit(f"the page did not render cleanly: {load.console_errors} {load.requests}")
            b.screenshot(args.out, 0, args.height)
            print(f"wrote {args.out}")
            if args.full_page_to:
                for w in (1000, 1280, 1400):
                    folder = Path(args.full_page_to) / str(w)
                    folder.mkdir(parents=True, exist_ok=True)
                    load = b.load(page, w)
                    for f in load.figures:
                        b.figure_screenshot(folder / f"{f['id']}.png", f["id"])
                    b.screenshot(folder / "top.png", 0, args.height)
                print(f"wrote one PNG per figure to {args.full_page_to}")


if __name__ == "__main__":
    main()
