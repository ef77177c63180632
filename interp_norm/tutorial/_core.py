"""The machinery of the tutorial checks: the result type, the decorator that turns a comparison into
a reporting check, and the comparison helpers. The checks themselves are in ``checks.py``.

A check never raises because of the learner: ``None`` or ``NotImplementedError`` from the learner's
function means "not attempted", any other exception is reported as a failure with the line that
raised it, and hooks the function forgot on the model are removed and reported.
"""

from __future__ import annotations

import functools
import html
import math
import traceback
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pandas as pd
import torch

PASS, FAIL, NOT_ATTEMPTED = "pass", "fail", "not attempted"
# Plain-ASCII marks, legible in any font (emoji render as empty boxes where no emoji font is installed);
# in Jupyter they are also coloured (see CheckResult.html).
MARK = {PASS: "[PASS]", FAIL: "[FAIL]", NOT_ATTEMPTED: "[TODO]"}
_COLOUR = {PASS: "#1a7f37", FAIL: "#cf222e", NOT_ATTEMPTED: "#9a6700"}  # green, red, amber (readable on light and dark)
_VERDICT = {PASS: "correct", FAIL: "not right yet", NOT_ATTEMPTED: "not attempted yet"}


@dataclass(frozen=True)
class CheckResult:
    """Outcome of one check; truthy only when it passed. Already reported, so it displays as nothing."""

    exercise: str
    status: str
    message: str

    def __bool__(self) -> bool:
        return self.status == PASS

    def line(self) -> str:
        """The report as one line of plain text: ``[PASS] name — correct: ...``."""
        return f"{MARK[self.status]} {self.exercise} — {_VERDICT[self.status]}: {self.message}"

    def html(self) -> str:
        """The same line as HTML, the mark in bold colour (the text stays legible if a front end strips styles)."""
        mark = f'<b style="color:{_COLOUR[self.status]}">{MARK[self.status]}</b>'
        return (f'<div style="font-family:monospace;white-space:pre-wrap">{mark} <b>{html.escape(self.exercise)}</b>'
                f" — {_VERDICT[self.status]}: {html.escape(self.message)}</div>")

    def report(self) -> None:
        """Print the line; in IPython/Jupyter display it (coloured HTML with the plain line as text/plain)."""
        shell = _ipython()
        if shell is None:
            print(self.line(), flush=True)
        else:
            from IPython.display import display

            display({"text/plain": self.line(), "text/html": self.html()}, raw=True)

    def _ipython_display_(self) -> None:  # the check reported its line already
        pass


def _ipython():
    """The running IPython shell, or None (plain Python, pytest)."""
    import sys

    if "IPython" not in sys.modules:  # never import IPython just to find out it is not running
        return None
    from IPython import get_ipython

    return get_ipython()


class _NotAttempted(Exception):
    pass


class _Fail(Exception):
    pass


def _where(exc: BaseException, fn: Callable) -> str:
    """' (line N: code)' of the deepest frame of the learner's own code, if any."""
    code = getattr(fn, "__code__", None)
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if code is not None and f.filename == code.co_filename] or frames[-1:]
    if not mine:
        return ""
    f = mine[-1]
    return f" (line {f.lineno}: {f.line.strip()})" if f.line else f" (line {f.lineno})"


class _Learner:
    """Calls the learner's function: None/NotImplementedError = not attempted, an exception = a failure."""

    def __init__(self, fn: Callable, model=None):
        self.fn, self.model = fn, model

    def __call__(self, *args, **kwargs):
        try:
            out = self.fn(*args, **kwargs)
        except NotImplementedError:
            raise _NotAttempted() from None
        except Exception as e:  # the learner's bug: report it, do not crash the notebook
            raise _Fail(f"your function raised {type(e).__name__}: {e}{_where(e, self.fn)}") from None
        if self.model is not None:
            left = [name for name, hp in self.model.hook_dict.items() if hp.fwd_hooks or hp.bwd_hooks]
            if left:
                self.model.reset_hooks()
                raise _Fail(
                    f"your function left hooks on the model ({left[:3]}); use model.run_with_hooks(...) or "
                    "`with model.hooks(...)`, which remove them (the check has called model.reset_hooks())"
                )
        if out is None:
            raise _NotAttempted()
        return out


def _exercise(name: str, *, uses_model: bool = True):
    """Decorator: turn ``body(learner, *args) -> pass message`` into a check that reports its result."""

    def deco(body):
        @functools.wraps(body)
        def check(fn, *args, **kwargs) -> CheckResult:
            if not callable(fn):
                result = CheckResult(name, FAIL, f"pass your function itself, e.g. check_{name}({name}), not {type(fn).__name__}")
            else:
                model = args[0] if uses_model and args else None
                try:
                    result = CheckResult(name, PASS, body(_Learner(fn, model), *args, **kwargs))
                except _NotAttempted:
                    result = CheckResult(name, NOT_ATTEMPTED, "fill in the function (it still returns None), then run this cell again")
                except _Fail as e:
                    result = CheckResult(name, FAIL, str(e))
            result.report()
            return result

        check.exercise = name
        return check

    return deco


# ----------------------------------------------------------------------------- comparison helpers


def _as_tensor(x, what: str, shape=None, axes: str = "") -> torch.Tensor:
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    if not isinstance(x, torch.Tensor):
        raise _Fail(f"{what} should return a torch.Tensor, got {type(x).__name__}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise _Fail(f"{what} returned shape {tuple(x.shape)}; expected {tuple(shape)} {axes}".rstrip())
    return x.detach()


def _close(got: torch.Tensor, ref: torch.Tensor, what: str, atol: float, rtol: float = 0.0, hint: str = "") -> None:
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    diff = (got - ref).abs()
    bad = ~(diff <= atol + rtol * ref.abs())  # NaN counts as bad
    if bad.any():
        diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
        idx = np.unravel_index(int(diff.reshape(-1).argmax()), tuple(diff.shape)) if diff.ndim else ()
        at = f" at index {list(map(int, idx))}" if idx else ""
        raise _Fail(
            f"{what}: {int(bad.sum())} of {bad.numel()} values differ; the largest difference is{at}: "
            f"yours {float(got[idx]):.6g}, expected {float(ref[idx]):.6g}" + (f". {hint}" if hint else "")
        )


def _is_close(got: torch.Tensor, ref: torch.Tensor, atol: float) -> bool:
    return got.shape == ref.shape and bool(((got.double() - ref.double()).abs() <= atol).all())


def _frame(df, what: str, columns: list[str]) -> pd.DataFrame:
    if not isinstance(df, pd.DataFrame):
        raise _Fail(f"{what} should return a pandas DataFrame with columns {columns}, got {type(df).__name__}")
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise _Fail(f"{what}'s DataFrame lacks columns {missing}; it has {list(df.columns)}")
    return df


def _per_head(df: pd.DataFrame, what: str, value: str, n_layers: int, n_heads: int) -> torch.Tensor:
    """[layer, head] tensor from a ``layer, head, value`` table with exactly one row per head."""
    df = _frame(df, what, ["layer", "head", value])
    keys = list(zip(df["layer"].astype(int), df["head"].astype(int)))
    want = [(l, h) for l in range(n_layers) for h in range(n_heads)]
    if sorted(keys) != want:
        raise _Fail(f"{what} should have one row per (layer, head): {len(want)} rows for {n_layers} layers × {n_heads} heads, got {len(df)}")
    out = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    for (l, h), v in zip(keys, df[value].astype(float)):
        out[l, h] = v
    return out


def _head_label(l: int, h: int) -> str:
    return f"L{l}H{h}"
