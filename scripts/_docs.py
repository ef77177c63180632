"""Rewrite one generated block of README.md, between its start and end markers."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def replace_block(start: str, end: str, markdown: str, readme: Path = README) -> None:
    text = readme.read_text()
    if start not in text or end not in text:
        raise SystemExit(f"{readme.name} lacks the markers {start} ... {end}")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(head + start + "\n" + markdown + "\n" + end + tail)
