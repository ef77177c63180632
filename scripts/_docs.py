"""Read or rewrite one generated block of a page under docs/, between its start and end markers."""

from __future__ import annotations

from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
RESULTS = DOCS / "results.md"


def _split(name: str, page: Path) -> tuple[str, str, str]:
    """(text up to the start marker, the block, text from the end marker); markers ``<!-- NAME:start/end -->``."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = page.read_text(encoding="utf-8")
    if start not in text or end not in text:
        raise SystemExit(f"{page.name} lacks the markers {start} ... {end}")
    head, rest = text.split(start, 1)
    inner, tail = rest.split(end, 1)
    return head + start, inner, end + tail


def block(name: str, page: Path = RESULTS) -> str:
    """The block's text, without the newlines next to its markers."""
    return _split(name, page)[1].strip("\n")


def replace_block(name: str, markdown: str, page: Path = RESULTS) -> None:
    head, _, tail = _split(name, page)
    page.write_text(head + "\n" + markdown + "\n" + tail, encoding="utf-8")
    print(f"rewrote the {name} block of {page}")
