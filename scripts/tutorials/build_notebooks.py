"""Build tutorials/*.ipynb from the cell lists in ``_nb01.py`` ... ``_nb06.py`` beside this file (edit there, then run it).

    .venv/bin/python scripts/tutorials/build_notebooks.py             # write the six .ipynb (no outputs)
    .venv/bin/python scripts/tutorials/build_notebooks.py --execute   # also run them and write tutorials/html/*.html

The sources live here, in ``scripts/tutorials/``, and the checks and solutions in the package
(``interp_norm.tutorial``), so that ``tutorials/`` (the folder JupyterLab opens) holds only the
notebooks, their README and their HTML export: no solutions one click away.

Notebooks are written without outputs; CI executes them top to bottom (tests/test_tutorials.py).
``--execute`` runs each in a fresh kernel and, if nbconvert is installed, writes an offline HTML page
per notebook (all pages share one local plotly.min.js and one notebook.css, no CDN; see ``_export.py``) so the
figures show without Jupyter.

Exercise convention (ARENA-style; every section opens with "What you will learn"):

1. a markdown cell: the task, ``Difficulty: 2/5 · ~10 min`` (plain text: it reads the same in any
   font, with no emoji), collapsed hints;
2. one code cell with the learner's function — a stub returning ``None`` — followed by the call
   ``check_<name>(<name>, ...)``. The checks live in ``interp_norm.tutorial`` (imported by the setup
   cell): each compares the learner's output with an independent computation and reports
   ``[PASS]`` / ``[FAIL]`` / ``[TODO]`` "not attempted yet"; it never raises for an unattempted or
   broken attempt;
3. the solution as *text*: a collapsed ``<details>`` markdown block showing the source of the
   function of the same name in ``interp_norm.tutorial.solutions``.

So Run All never redefines the learner's function (no executable cell after the stub defines that
name; a test parses every cell to make sure), and the notebooks never depend on the learner's
answer: cells after an exercise use the library (e.g. ``circuits.faithfulness``) for what comes next.
CI executes the notebooks with the stubs unattempted (each check reports [TODO]), and the fast tests run
every check on its solution (must pass) and on a deliberately wrong one (must fail).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_notebook

HERE = Path(__file__).resolve().parent  # scripts/tutorials: the cell lists
REPO = HERE.parents[1]
TUTORIALS = REPO / "tutorials"  # where the notebooks go
for _p in (REPO, HERE):  # this checkout's interp_norm (its solutions are shown in the notebooks), then the cell lists
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from _nb01 import NB01  # noqa: E402  (one module per tutorial; cell builders in _cells.py)
from _nb02 import NB02  # noqa: E402
from _nb03 import NB03  # noqa: E402
from _nb04 import NB04  # noqa: E402
from _nb05 import NB05  # noqa: E402
from _nb06 import NB06  # noqa: E402

NOTEBOOKS = {
    "01_quickstart.ipynb": NB01,
    "02_finding_the_addition_circuit.ipynb": NB02,
    "03_norm_noise_and_circuit_collapse.ipynb": NB03,
    "04_geometry.ipynb": NB04,
    "05_train_your_own_variant.ipynb": NB05,
    "06_circuit_collapse_in_production.ipynb": NB06,
}


def build(out_dir: Path = TUTORIALS) -> list[Path]:
    paths = []
    for name, cells in NOTEBOOKS.items():
        nb = new_notebook(cells=[nbformat.from_dict(c) for c in cells])
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nb.metadata["language_info"] = {"name": "python"}
        for i, c in enumerate(nb.cells):
            c["id"] = f"{name.split('_')[0]}-{i:02d}"  # stable ids: rebuilding gives identical files
        nbformat.validate(nb)
        path = out_dir / name
        nbformat.write(nb, path)
        paths.append(path)
    return paths


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--execute", action="store_true",
                        help="also run every notebook (nbclient) and write tutorials/html/<name>.html (needs nbconvert)")
    parser.add_argument("--only", nargs="+", metavar="NAME", default=None,
                        help="with --execute: only these notebooks (e.g. 01_quickstart)")
    parser.add_argument("--html-dir", type=Path, default=TUTORIALS / "html", help="where --execute writes the HTML pages")
    args = parser.parse_args(argv)
    names = [n for n in NOTEBOOKS if args.only is None or any(n.startswith(o) for o in args.only)]
    if not names:
        parser.error(f"--only {args.only} matches none of {list(NOTEBOOKS)}")
    for p in build():
        print("wrote", p)
    if args.execute:
        from _export import execute_all

        execute_all(names, args.html_dir)


if __name__ == "__main__":
    main()
