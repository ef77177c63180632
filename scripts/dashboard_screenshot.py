"""Write docs/dashboard.png: the top of the dashboard of the reference report, as headless Chromium shows it.

    python scripts/dashboard_screenshot.py --report report/         # the page drawn again from a report folder
    python scripts/dashboard_screenshot.py --dashboard report/dashboard.html --full-page-to shots/
    python scripts/dashboard_screenshot.py                          # analyse the shipped set (--quick sizes) first

``--report`` reads the folder ``make reproduce`` wrote (its CSVs, checkpoints.csv, run.json) and draws its
dashboard with the current code, analysing nothing: that is how docs/dashboard.png is kept current. The PNG
carries what the page reported in its text chunks (``interp_norm:figures``, ``interp_norm:sections`` as JSON
``[[anchor, figures], ...]``, ``interp_norm:page_bytes``), which ``tests/test_dashboard_story.py`` checks.
Uses the test suite's DevTools driver (tests/_devtools.py; Debian's chromium, no network).
``--full-page-to`` also writes one PNG per figure at 1000, 1280 and 1400 px, for looking at every figure.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import tempfile
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

#: What the page says about itself once drawn: its sections with their figure counts, and the render status.
PAGE_FACTS_JS = """(() => ({
  sections: Array.from(document.querySelectorAll('main > section')).map(
    (s) => [s.id, s.querySelectorAll('div.figure[data-fig]').length]),
  status: Object.assign({}, document.getElementById('render-status').dataset)}))()"""


def png_text(png: bytes, items: dict) -> bytes:
    """``png`` with a tEXt chunk per item inserted before its IEND chunk."""
    chunks = b""
    for k, v in items.items():
        data = k.encode("latin-1") + b"\0" + str(v).encode("latin-1")
        chunks += struct.pack(">I", len(data)) + b"tEXt" + data + struct.pack(">I", zlib.crc32(b"tEXt" + data))
    end = png.rindex(b"IEND") - 4
    return png[:end] + chunks + png[end:]


def read_png_text(png: bytes) -> dict:
    """The tEXt chunks of a PNG as ``{key: value}``."""
    out, pos = {}, 8
    while pos < len(png):
        n, kind = struct.unpack(">I4s", png[pos:pos + 8])
        if kind == b"tEXt":
            k, _, v = png[pos + 8:pos + 8 + n].partition(b"\0")
            out[k.decode("latin-1")] = v.decode("latin-1")
        pos += 12 + n
    return out


def _page(args: argparse.Namespace, tmp: Path) -> Path:
    if args.dashboard:
        return Path(args.dashboard)
    if args.report:
        from interp_norm.report.dashboard import report_from_folder, write_dashboard

        return write_dashboard(report_from_folder(args.report), tmp / "dashboard.html")
    from interp_norm.report.reproduce import reproduce

    reproduce(tmp / "report", quick=True, progress=True)
    return tmp / "report" / "dashboard.html"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--report", help="a report folder ('interp-norm reproduce --out'): its dashboard drawn again")
    src.add_argument("--dashboard", help="an existing dashboard.html")
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
        page = _page(args, Path(tmp))
        with Browser(chromium) as b:
            load = b.load(page, args.width)
            if load.console_errors or load.requests or not load.complete:
                sys.exit(f"the page did not render cleanly: {load.console_errors} {load.requests}")
            facts = b.evaluate(PAGE_FACTS_JS)
            n = int(facts["status"]["rendered"])
            if n != int(facts["status"]["expected"]) or n != sum(k for _, k in facts["sections"]):
                sys.exit(f"figures drawn and counted disagree: {facts}")
            shot = b.screenshot(args.out, 0, args.height)
            shot.write_bytes(png_text(shot.read_bytes(), {
                "interp_norm:figures": n, "interp_norm:sections": json.dumps(facts["sections"]),
                "interp_norm:page_bytes": page.stat().st_size}))
            print(f"wrote {args.out}: {n} figures in {len(facts['sections'])} sections, page {page.stat().st_size:,} bytes")
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
