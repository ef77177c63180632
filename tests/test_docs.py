"""The README and the generated pages under docs/.

* docs/results.md's accuracy table is what ``scripts/results_table.py`` builds from the shipped
  ``metrics.json`` files today (a new checkpoint without ``--write`` fails here).
* Every generated block the scripts write has its markers on its page.
* The README is a user guide: at most 200 lines, every relative link points at a file that exists.
* No dated or time-of-day wording in the tracked text (results are current, not a log).
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"


@pytest.fixture(scope="module")
def scripts():
    sys.path.insert(0, str(SCRIPTS))
    try:
        yield {name: importlib.import_module(name) for name in ("_docs", "results_table", "phenomena_table",
                                                                   "verdicts", "findings_tables")}
    finally:
        sys.path.remove(str(SCRIPTS))


def test_results_table_is_current(scripts):
    rt, docs = scripts["results_table"], scripts["_docs"]
    expected = rt.table(rt.collect(ROOT / "data" / "checkpoints"))
    assert docs.block(rt.BLOCK) == expected, (
        "docs/results.md's accuracy table differs from the shipped metrics.json files: "
        "run .venv/bin/python scripts/results_table.py --write")


def test_every_generated_block_has_its_markers(scripts):
    docs = scripts["_docs"]
    for name in ("RESULTS", "PHENOMENA", "PHENOMENA30K", "FINDINGS", "CLAIMS"):
        assert docs.block(name).strip(), name
    assert docs.block("VERDICTS", ROOT / "README.md").strip()


def test_verdicts_and_seed_tables_are_current(scripts):
    """The README's verdict table, docs/results.md's claims table and docs/findings-tables.md are what the
    scripts build from the seed tables kept in data/seed_tables/ (nothing typed by hand)."""

    v, ft, docs = scripts["verdicts"], scripts["findings_tables"], scripts["_docs"]
    comp = v.load(None)
    fix = "run scripts/findings_tables.py REPORT --write, then scripts/verdicts.py --write"
    assert docs.block("VERDICTS", ROOT / "README.md") == v.readme_block(comp), fix
    assert docs.block("CLAIMS") == v.results_block(comp), fix
    assert docs.block("FINDINGS-TABLES", ft.PAGE) == ft.markdown(ft.DATA), fix


def test_findings_prose_cites_only_numbers_the_seed_tables_hold(scripts):
    """Every "mean [lo, hi]" and "p = x" in docs/results.md's findings (outside the generated claims
    table) is a cell of docs/findings-tables.md: the prose cannot drift from the tables."""
    docs, ft = scripts["_docs"], scripts["findings_tables"]
    prose = docs.block("FINDINGS").replace(docs.block("CLAIMS"), "")
    tables = docs.block("FINDINGS-TABLES", ft.PAGE)
    intervals = re.findall(r"-?\d+\.\d \[-?\d+\.\d, -?\d+\.\d\]", prose)
    assert len(intervals) >= 20
    missing = [x for x in intervals if x not in tables]
    assert not missing, f"intervals in the findings that no seed table holds: {missing}"
    p_values = re.findall(r"p = (\d[\d.e-]*\d|\d)", prose)
    cells = set(re.findall(r"\| (\d[\d.e-]*\d|\d)(?: \(MC \d+\))? \|", tables))
    assert p_values and not [p for p in p_values if p not in cells], [p for p in p_values if p not in cells]


def test_replace_block_rewrites_only_the_block(scripts, tmp_path):
    page = tmp_path / "p.md"
    page.write_text("head\n<!-- X:start -->\nold\n<!-- X:end -->\ntail\n", encoding="utf-8")
    scripts["_docs"].replace_block("X", "new\nlines", page)
    assert page.read_text(encoding="utf-8") == "head\n<!-- X:start -->\nnew\nlines\n<!-- X:end -->\ntail\n"
    with pytest.raises(SystemExit, match="lacks the markers"):
        scripts["_docs"].replace_block("Y", "x", page)


def test_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert "docs/results.md" in links and "docs/benchmarks.md" in links and "CONTRIBUTING.md" in links
    for link in links:
        if "://" not in link:
            assert (ROOT / link).exists(), f"README links to {link}, which does not exist"


# Words that date a statement (a measurement "from last night") or an ISO date; this file is not scanned.
DATED = re.compile(r"\b(tonight|overnight|night|morning|evening|yesterday)\b|\b20\d\d-[01]\d-[0-3]\d\b", re.IGNORECASE)
TEXT_FILES = ("README.md", "CONTRIBUTING.md", "Makefile", "pyproject.toml", ".ci/run")
TEXT_GLOBS = ("docs/*.md", "interp_norm/**/*.py", "tests/*.py", "scripts/*.py", "benchmarks/*.py",
              "scripts/tutorials/*.py", "tutorials/*.md", "data/**/README.md")


def test_no_dated_wording():
    paths = [ROOT / p for p in TEXT_FILES] + [p for g in TEXT_GLOBS for p in ROOT.glob(g)]
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}"
            for p in paths if p.is_file() and p.name != Path(__file__).name
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if DATED.search(line)]
    assert not hits, "dated wording (write what holds now, not when it was measured):\n" + "\n".join(hits)


def test_the_findings_count_the_verdicts_the_package_decides(scripts):
    """docs/results.md's summary of the verdicts ("of the N claim × scaling rows, r are reproduced, a are not
    reproduced and b are not established") holds the counts interp_norm.stats.verdicts decides from the
    shipped seed tables."""
    from interp_norm.stats.shipped import seed_values
    from interp_norm.stats.verdicts import verdicts

    prose = scripts["_docs"].block("FINDINGS")
    m = re.search(r"of the (\d+) claim × scaling\s+rows, (\d+) are \*\*reproduced\*\*, (\d+) are \*\*not reproduced\*\*"
                  r"\s+and (\d+) are \*\*not established\*\*", prose, flags=re.I)
    assert m, "the findings lack their one-line count of the verdicts"
    counts = verdicts(seed_values())["verdict"].value_counts()
    n_rows = int(counts.sum())
    assert [int(x) for x in m.groups()] == [n_rows, counts.get("reproduced", 0), counts.get("not reproduced", 0),
                                            counts.get("not established", 0)]
