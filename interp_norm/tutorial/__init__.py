"""The tutorials' exercise checks (``tutorials/*.ipynb``): ``from interp_norm.tutorial import check_my_scores``.

Each ``check_<name>(your_function, ...)`` compares your function with an independent computation
and reports ``[PASS]``, ``[FAIL]`` (with the first mismatch) or ``[TODO]`` (not attempted yet); see
:mod:`interp_norm.tutorial.checks`. The reference solutions are in
:mod:`interp_norm.tutorial.solutions` (the notebooks show them collapsed under each exercise): they
live in the package, like the checks, so that the folder JupyterLab opens holds only the notebooks.

Importing this package inside IPython/Jupyter also sets up the notebook's warnings (nothing changes in
plain Python): a warning prints as ``Category: message``, without the path of the kernel's temporary
file for the cell, and tqdm's "IProgress not found" notice is silenced (progress bars fall back to
text without ipywidgets).
"""

from __future__ import annotations

import warnings

from interp_norm.tutorial._core import _ipython  # imports no progress bar (tqdm.auto) yet


def _short_warning(message, category, filename, lineno, line=None) -> str:
    return f"{category.__name__}: {message}\n"


def _notebook_warnings() -> None:
    """In a notebook: warnings as ``Category: message``; no "IProgress not found" notice. Idempotent."""
    if _ipython() is None:
        return
    warnings.formatwarning = _short_warning
    warnings.filterwarnings("ignore", message="IProgress not found")


# before the checks import the library: tqdm.auto warns about IProgress when it is first imported
_notebook_warnings()

from interp_norm.tutorial._core import MARK  # noqa: E402
from interp_norm.tutorial.checks import *  # noqa: E402,F401,F403  (check_<name>, CheckResult, CHECKS, the statuses)
from interp_norm.tutorial.checks import __all__ as _checks_all  # noqa: E402

__all__ = [*_checks_all, "MARK"]
