"""The cell builders every tutorial's content uses (see ``build_notebooks.py`` for the conventions)."""

from __future__ import annotations

import inspect
import textwrap

from nbformat.v4 import new_code_cell, new_markdown_cell

from interp_norm.tutorial import solutions as _solutions  # the solution sources shown in the notebooks

# The first code cell of every notebook. No set-up beyond ordinary imports: interp_norm is installed
# (``pip install -e .``), and importing ``interp_norm.tutorial`` sets up the notebook's warnings; it comes
# before the rest of the library, whose first import would otherwise print tqdm's "IProgress not found".
SETUP = """\
import numpy as np
import pandas as pd
import torch
torch.set_num_threads(1)   # these small models run fastest on one thread
torch.manual_seed(0)

"""
LIBRARY = """
from interp_norm.report import plots
from interp_norm import list_pretrained, load_with_info
"""


def setup(*checks: str) -> str:
    """The setup cell, importing this notebook's exercise checks from ``interp_norm.tutorial``."""
    return SETUP + f"from interp_norm.tutorial import {', '.join(f'check_{c}' for c in checks)}" + LIBRARY


def md(text: str):
    return new_markdown_cell(textwrap.dedent(text).strip("\n"))


def code(text: str):
    return new_code_cell(textwrap.dedent(text).strip("\n"))


def hints(*items: str) -> str:
    """Collapsed hints for a markdown f-string; continuation lines carry the cell's 4-space indent so
    that :func:`md`'s dedent still applies to the whole cell."""
    text = "\n".join(f"<details><summary>Hint {i + 1}</summary>\n\n{textwrap.dedent(h).strip()}\n\n</details>\n"
                      for i, h in enumerate(items))
    return text.replace("\n", "\n    ")


def difficulty(level: int, minutes: int) -> str:
    """ARENA-style badge in plain text, legible in any font (no emoji): ``Difficulty: 2/5 · ~10 min``."""
    assert 1 <= level <= 5, level
    return f"> **Difficulty:** {level}/5 · **~{minutes} min**"


def exercise(name: str, stub: str):
    """The learner's cell: the stub of ``name`` and the call of its check (``stub`` must contain both)."""
    cell = code(stub)
    assert f"def {name}(" in cell.source and f"check_{name}({name}," in cell.source, name
    cell.metadata["tags"] = ["exercise"]
    return cell


def solution(name: str):
    """A collapsed markdown block with the source of ``interp_norm.tutorial.solutions.<name>`` (text, never executed)."""
    source = inspect.getsource(getattr(_solutions, name)).strip("\n")
    cell = new_markdown_cell(
        f"<details><summary>Solution: <code>{name}</code> (try first!)</summary>\n\n"
        f"```python\n{source}\n```\n\n</details>"
    )
    cell.metadata["tags"] = ["solution"]
    return cell
