"""An independent recomputation of every verdict the README and docs/results.md print.

    .venv/bin/python scripts/recheck_verdicts.py                 # the two families, every recomputed verdict,
                                                                 # and a diff against README.md and docs/results.md
    .venv/bin/python scripts/recheck_verdicts.py --readme COPY   # check another copy of the README (exit 1 on a diff)

It shares no code with ``interp_norm.stats`` or ``scripts/verdicts.py``: only the *declaration* is read
from ``interp_norm.stats.verdicts`` (CLAIMS, ALPHA, MIN_SEEDS and the margin constants; none of its
functions), the rules from that module's docstring. Everything else is redone here by hand:

* exact permutation tests of the difference of means as a loop over ``itertools.combinations`` (every
  split of the pooled seeds; a split counts when its statistic is at least as extreme as the observed one,
  up to 1e-9 of the largest value: sums of a dozen values of size <= 100 carry rounding errors near 1e-13,
  so the tolerance only joins ties that rounding split), location shift for the margins;
* Student t's CDF from the regularised incomplete beta function (continued fraction, modified Lentz),
  its quantile by bisection; checked at start against printed t-table values;
* Welch's interval, one-sample t-tests, TOST, Holm's step-down adjustment.

Rules (from the docstring): ``order``: for = one-sided permutation test in the paper's direction, against
= the reverse. ``same``: for = TOST (shifted permutation tests at ±margin, the larger p), against = the
smaller of the two "outside the margin" p, doubled. ``above``: one-sided one-sample t-tests against
value − margin. ``near``: TOST of value ± margin, against = smaller "outside" p doubled; with censored
seeds (lower bounds) no test for, and against = the one-sided test above value + margin (the only side
lower bounds can show, so no doubling). Fewer than MIN_SEEDS seeds: no test. Two families (for, against),
identities outside, Holm within each; reproduced if Holm p for < ALPHA, else not reproduced if Holm p
against < ALPHA, else not established. Every number the pages print is compared at its printed precision.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from interp_norm.stats.verdicts import ABOVE_MARGIN, ALPHA, CLAIMS, MIN_SEEDS, NEAR_MARGIN, PAR_MARGIN

if TYPE_CHECKING:  # the declaration's type, for annotations only
    from interp_norm.stats.verdicts import Claim

ROOT = Path(__file__).resolve().parent.parent
#: The shipped seed tables: under $INTERP_NORM_DATA when set (as the package reads them), else data/.
TABLES = Path(os.environ.get("INTERP_NORM_DATA") or ROOT / "data") / "seed_tables"
#: (scaling, calibration, arm A (label, attn_norm), arm B): Menary et al. §4's Pre-Norm vs QKV-Norm, at
#: 1/√d_head and with the paper's Checkpoint calibration (the README's columns; checked against them).
SCALINGS = (("1/√d_head", "none", ("Pre-Norm", "pre"), ("QKV-Norm", "qkv")),
            ("Checkpoint calibration", "paper", ("Pre-cal", "pre"), ("QKV-cal", "qkv")))
NAN = math.nan

# ----------------------------------------------------------------------------- Student t, by hand


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz; Numerical Recipes §6.4)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            return h
    raise ArithmeticError(f"incomplete beta: no convergence at a={a}, b={b}, x={x}")


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with ``df`` degrees of freedom (any df > 0): I_{df/(df+t²)}(df/2, 1/2) / 2."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return tail if t >= 0 else 1.0 - tail


def t_ppf(q: float, df: float) -> float:
    """The q-quantile (q > 1/2) of Student's t, by bisection on :func:`t_sf`."""
    lo, hi = 0.0, 1e6
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_sf(mid, df) > 1.0 - q else (lo, mid)
    return 0.5 * (lo + hi)


#: (df, two-sided 95% critical value) from printed t tables (Student t, 6 significant digits).
T_TABLE = ((1, 12.7062), (2, 4.30265), (3, 3.18245), (5, 2.57058), (10, 2.22814), (30, 2.04227), (120, 1.97993))


def check_t() -> None:
    """Stop if the t quantile disagrees with the printed table."""
    for df, crit in T_TABLE:
        if abs(t_ppf(0.975, df) - crit) > 1e-5 * crit:
            raise SystemExit(f"t_ppf(0.975, {df}) = {t_ppf(0.975, df)!r}, the table says {crit}")


# ----------------------------------------------------------------------------- tests, by hand


def mean(v: list[float]) -> float:
    return math.fsum(v) / len(v)


def var(v: list[float]) -> float:
    m = mean(v)
    return math.fsum((x - m) ** 2 for x in v) / (len(v) - 1)


def perm_p(a: list[float], b: list[float], direction: str, shift: float = 0.0) -> float:
    """Exact one-sided permutation p of mean(a) − mean(b) against ``shift`` (H1: greater / less), by looping
    over every split of the pooled seeds (a − shift, b)."""
    pooled = [x - shift for x in a] + list(b)
    na, n = len(a), len(pooled)
    tol = 1e-9 * max(1.0, max(abs(x) for x in pooled))
    observed = mean(pooled[:na]) - mean(pooled[na:])
    hits = total = 0
    for idx in itertools.combinations(range(n), na):
        chosen = set(idx)
        stat = mean([pooled[i] for i in idx]) - mean([pooled[i] for i in range(n) if i not in chosen])
        hits += stat >= observed - tol if direction == "greater" else stat <= observed + tol
        total += 1
    return hits / total


def t_p(v: list[float], value: float, direction: str) -> float:
    """One-sample t-test p of H0 mean = value against H1 mean > value ("greater") or < value ("less")."""
    se, d = math.sqrt(var(v) / len(v)), mean(v) - value
    if se == 0.0:
        return 0.0 if (d > 0 if direction == "greater" else d < 0) else 1.0
    t = d / se
    return t_sf(t, len(v) - 1) if direction == "greater" else t_sf(-t, len(v) - 1)


def t_interval(v: list[float]) -> tuple[float, float]:
    if len(v) < 2:
        return NAN, NAN
    half = t_ppf(0.975, len(v) - 1) * math.sqrt(var(v) / len(v))
    return mean(v) - half, mean(v) + half


def welch(a: list[float], b: list[float]) -> tuple[float, float]:
    """Welch's 95% interval of mean(a) − mean(b)."""
    if min(len(a), len(b)) < 2:
        return NAN, NAN
    ea, eb = var(a) / len(a), var(b) / len(b)
    d = mean(a) - mean(b)
    if ea + eb == 0:
        return d, d
    df = (ea + eb) ** 2 / (ea ** 2 / (len(a) - 1) + eb ** 2 / (len(b) - 1))
    half = t_ppf(0.975, df) * math.sqrt(ea + eb)
    return d - half, d + half


def holm(ps: list[float]) -> list[float]:
    """Holm's step-down adjustment; NaN entries are not members and stay NaN."""
    members = sorted((p, i) for i, p in enumerate(ps) if not math.isnan(p))
    out, running = [NAN] * len(ps), 0.0
    for rank, (p, i) in enumerate(members):
        running = max(running, min(1.0, (len(members) - rank) * p))
        out[i] = running
    return out


def margin_of(claim: Claim) -> float:
    return {"same": PAR_MARGIN, "above": ABOVE_MARGIN * claim.value, "near": NEAR_MARGIN * claim.value}.get(claim.rule, NAN)


def two_arm_ps(rule: str, sign: int, a: list[float], b: list[float], m: float) -> tuple[float, float]:
    """(p for, p against) of an ``order`` or ``same`` claim."""
    if rule == "order":
        towards, away = ("greater", "less") if sign > 0 else ("less", "greater")
        return perm_p(a, b, towards), perm_p(a, b, away)
    p_for = max(perm_p(a, b, "greater", -m), perm_p(a, b, "less", m))
    return p_for, min(1.0, 2 * min(perm_p(a, b, "greater", m), perm_p(a, b, "less", -m)))


def value_ps(rule: str, a: list[float], v: float, m: float, censored: bool) -> tuple[float, float]:
    """(p for, p against) of an ``above`` or ``near`` claim."""
    if rule == "above":
        return t_p(a, v - m, "greater"), t_p(a, v - m, "less")
    if censored:
        return NAN, t_p(a, v + m, "greater")
    p_for = max(t_p(a, v - m, "greater"), t_p(a, v + m, "less"))
    return p_for, min(1.0, 2 * min(t_p(a, v + m, "greater"), t_p(a, v - m, "less")))


# ----------------------------------------------------------------------------- the recomputation


def load(paths: list[Path]) -> dict:
    """{(quantity, attn_norm, calibration): [(seed, value, censored), ...]} of reached values and the bounds
    of never-reached levels; rows with neither are left out."""
    out: dict = {}
    for path in paths:
        with open(path, newline="", encoding="utf-8") as f:
            for r in csv.DictReader(f):
                value = float(r["value"]) if r["value"] not in ("", "nan", "NaN") else NAN
                bound = float(r.get("censored_above") or "nan")
                if math.isfinite(value) or math.isfinite(bound):
                    key = (r["quantity"], r["attn_norm"], r["calibration"])
                    out.setdefault(key, []).append((int(r["seed"]), value if math.isfinite(value) else bound,
                                                    not math.isfinite(value)))
    return out


def arm(data: dict, quantity: str, norm: str, cal: str) -> tuple[list[float], int]:
    rows = sorted(data.get((quantity, norm, cal), []))
    return [v for _, v, _ in rows], sum(c for _, _, c in rows)


@dataclass
class Row:
    claim: Claim
    scaling: str
    labels: tuple[str, str]
    a: list[float]
    b: list[float]
    n_censored: int
    p_for: float = NAN
    p_against: float = NAN
    holm_for: float = NAN
    holm_against: float = NAN
    verdict: str = ""
    extras: dict = field(default_factory=dict)  # control / robustness numbers

    @property
    def identity(self) -> str:
        return self.claim.identity.get(self.scaling, "")


def control_of(data: dict, claim: Claim, norms: tuple[str, str], cal: str) -> dict:
    a, _ = arm(data, claim.control, norms[0], cal)
    b, _ = arm(data, claim.control, norms[1], cal)
    if min(len(a), len(b)) < MIN_SEEDS:
        return {}
    p = two_arm_ps(claim.rule, claim.sign, a, b, margin_of(claim))[0]
    return dict(mean_a=mean(a), mean_b=mean(b), diff=mean(a) - mean(b), ci=welch(a, b), p=p)


def robustness_of(data: dict, claim: Claim, norms: tuple[str, str], cal: str) -> dict:
    label, quantity, per_head = claim.robustness  # type: ignore[misc]
    a, _ = arm(data, quantity, norms[0], cal)
    ref, _ = arm(data, per_head, norms[0], cal)
    if len(a) < MIN_SEEDS:
        return {}
    out = dict(label=label, mean_a=mean(a), per_head=mean(ref) if ref else NAN)
    if claim.rule in ("order", "same"):
        b, _ = arm(data, quantity, norms[1], cal)
        if len(b) < MIN_SEEDS:
            return {}
        out.update(mean_b=mean(b), diff=mean(a) - mean(b), ci=welch(a, b))
        out["p"] = two_arm_ps(claim.rule, claim.sign, a, b, margin_of(claim))
    else:
        out.update(ci=t_interval(a), p=value_ps(claim.rule, a, claim.value, margin_of(claim), False))
    return out


def recompute(data: dict) -> list[Row]:
    """Every (claim, scaling) row with its raw p, both families' Holm p and the verdict."""
    rows = []
    for claim in CLAIMS:
        for scaling, cal, (label_a, norm_a), (label_b, norm_b) in SCALINGS:
            a, n_cens = arm(data, claim.quantity, norm_a, cal)
            b, _ = arm(data, claim.quantity, norm_b, cal)
            if not a:
                continue
            r = Row(claim, scaling, (label_a, label_b), a, b, n_cens)
            if claim.rule in ("order", "same") and min(len(a), len(b)) >= MIN_SEEDS:
                r.p_for, r.p_against = two_arm_ps(claim.rule, claim.sign, a, b, margin_of(claim))
            elif claim.rule in ("above", "near") and len(a) >= MIN_SEEDS:
                r.p_for, r.p_against = value_ps(claim.rule, a, claim.value, margin_of(claim), n_cens > 0)
            if claim.control:
                r.extras["control"] = control_of(data, claim, (norm_a, norm_b), cal)
            if claim.robustness:
                r.extras["robustness"] = robustness_of(data, claim, (norm_a, norm_b), cal)
            rows.append(r)
    for side in ("for", "against"):
        adjusted = holm([NAN if r.identity else getattr(r, f"p_{side}") for r in rows])
        for r, p in zip(rows, adjusted):
            setattr(r, f"holm_{side}", p)
    for r in rows:
        r.verdict = ("identity" if r.identity else "reproduced" if r.holm_for < ALPHA else
                     ("not reproduced (reversed)" if r.claim.rule == "order" else "not reproduced")
                     if r.holm_against < ALPHA else "not established")
    return rows


# ----------------------------------------------------------------------------- reading the pages

NUM = r"-?\d+(?:\.\d+)?"
P = r"—|\d+(?:\.\d+)?(?:e-?\d+)?"
VERDICT = r"reproduced|not reproduced \(reversed\)|not reproduced|not established|identity"
SAME_WAY = " — the control differs the same way, so the difference is not specific to the claim's component"
TWO = re.compile(rf"(?P<la>[\w-]+) (?P<ma>{NUM}) vs (?P<lb>[\w-]+) (?P<mb>{NUM}), A − B (?P<d>{NUM}) "
                 rf"\[(?P<lo>{NUM}), (?P<hi>{NUM})\]")
ONE = re.compile(rf"(?P<m>{NUM}) \[(?P<lo>{NUM}), (?P<hi>{NUM})\](?:, (?P<nc>\d+) seed\(s\) never reached: lower bounds)?")
HOLM = re.compile(rf"(?P<main>.*?), Holm p (?P<pf>{P}) for / (?P<pa>{P}) against(?P<rest>.*)")
CONTROL = re.compile(rf"; control \(equal-norm random subspace\): (?P<ma>{NUM}) vs (?P<mb>{NUM}), A − B (?P<d>{NUM}) "
                     rf"\[(?P<lo>{NUM}), (?P<hi>{NUM})\], raw p (?P<p>{P})(?P<same>{re.escape(SAME_WAY)})?")
ROBUST = re.compile(rf"; robustness check, outside the family \((?P<label>[^)]*)\): (?P<body>.*?)"
                    rf"(?: \(κ per head on the same draws: (?P<ph>{NUM})\))?, raw p (?P<pf>{P}) for / (?P<pa>{P}) against")


def sig_digits(s: str) -> int:
    return max(1, len(s.split("e")[0].replace(".", "").lstrip("0")))


class Diff:
    """Collects every disagreement between a page and the recomputation."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.checked = 0  # printed items compared (a verdict, a number, a p, a label)

    def add(self, where: str, what: str, printed: object, recomputed: object) -> None:
        self.lines.append(f"{where}: {what}: printed {printed!r}, recomputed {recomputed!r}")

    def num(self, where: str, what: str, s: str | None, x: float) -> None:
        """``s`` must be ``x`` rounded to the decimals ``s`` shows."""
        self.checked += 1
        if s is None:
            self.add(where, what, None, x)
            return
        d = len(s.split(".")[1]) if "." in s else 0
        if math.isnan(x) or float(f"{x:.{d}f}") != float(s):
            self.add(where, what, s, x)

    def p(self, where: str, what: str, s: str | None, x: float) -> None:
        """``s`` must be ``x`` at its significant digits (at least two; "—" for no test) and on ``x``'s side
        of ALPHA."""
        self.checked += 1
        if s is None or s == "—" or math.isnan(x):
            if not (s == "—" and math.isnan(x)):
                self.add(where, what, s, x)
            return
        k = max(2, sig_digits(s))
        if float(f"{x:.{k}g}") != float(s) or (float(s) < ALPHA) != (x < ALPHA):
            self.add(where, what, s, x)

    def same(self, where: str, what: str, s: object, x: object) -> None:
        self.checked += 1
        if s != x and not (isinstance(s, float) and isinstance(x, float) and math.isnan(s) and math.isnan(x)):
            self.add(where, what, s, x)


def check_main(diff: Diff, where: str, text: str, r: Row) -> None:
    """The measure and its interval: A vs B with Welch's interval, or A's mean with its t-interval."""
    if r.claim.rule in ("order", "same"):
        m = TWO.fullmatch(text)
        if not m:
            return diff.add(where, "evidence (A vs B, A − B [interval])", text, "unparseable")
        lo, hi = welch(r.a, r.b)
        diff.same(where, "arms", (m["la"], m["lb"]), r.labels)
        for key, x in (("ma", mean(r.a)), ("mb", mean(r.b) if r.b else NAN), ("d", mean(r.a) - mean(r.b) if r.b else NAN),
                       ("lo", lo), ("hi", hi)):
            diff.num(where, {"ma": "mean A", "mb": "mean B", "d": "A − B", "lo": "A − B low", "hi": "A − B high"}[key],
                     m[key], x)
        return None
    m = ONE.fullmatch(text)
    if not m:
        return diff.add(where, "evidence (mean [interval])", text, "unparseable")
    lo, hi = t_interval(r.a)
    diff.num(where, "mean A", m["m"], mean(r.a))
    diff.num(where, "interval low", m["lo"], lo)
    diff.num(where, "interval high", m["hi"], hi)
    diff.same(where, "censored seeds", int(m["nc"] or 0), r.n_censored)
    return None


def check_extras(diff: Diff, where: str, rest: str, r: Row) -> None:
    """The control and the robustness check after the evidence (raw p, outside the family)."""
    c, rb = r.extras.get("control"), r.extras.get("robustness")
    m = CONTROL.match(rest)
    if c:
        if not m:
            return diff.add(where, "control", rest, c)
        for key, x in (("ma", c["mean_a"]), ("mb", c["mean_b"]), ("d", c["diff"]), ("lo", c["ci"][0]), ("hi", c["ci"][1])):
            diff.num(where, f"control {key}", m[key], x)
        diff.p(where, "control raw p", m["p"], c["p"])
        diff.same(where, "control 'differs the same way'", bool(m["same"]), c["p"] < ALPHA)
        rest = rest[m.end():]
    elif m:
        diff.add(where, "control", m.group(0), "none declared")
    m = ROBUST.match(rest)
    if rb:
        if not m:
            return diff.add(where, "robustness check", rest, rb)
        diff.same(where, "robustness label", m["label"], rb["label"])
        body = (TWO if "diff" in rb else ONE).fullmatch(m["body"])
        if not body:
            return diff.add(where, "robustness measure", m["body"], "unparseable")
        pairs = ((("ma", rb["mean_a"]), ("mb", rb["mean_b"]), ("d", rb["diff"])) if "diff" in rb else (("m", rb["mean_a"]),))
        for key, x in (*pairs, ("lo", rb["ci"][0]), ("hi", rb["ci"][1])):
            diff.num(where, f"robustness {key}", body[key], x)
        if m["ph"] is not None or not math.isnan(rb["per_head"]):
            diff.num(where, "robustness: κ per head", m["ph"], rb["per_head"])
        diff.p(where, "robustness raw p for", m["pf"], rb["p"][0])
        diff.p(where, "robustness raw p against", m["pa"], rb["p"][1])
        rest = rest[m.end():]
    elif m:
        diff.add(where, "robustness check", m.group(0), "none declared")
    if rest:
        diff.add(where, "unexpected text", rest, "")
    return None


def check_item(diff: Diff, where: str, text: str, r: Row, with_holm: bool) -> None:
    """One claim's evidence: the README's (with Holm p) or results.md's "here" cell (without)."""
    if r.identity:
        main, _, rest = text.partition(f"; {r.identity}")
        check_main(diff, where, main, r)
        return None
    if with_holm:
        m = HOLM.fullmatch(text)
        if not m:
            return diff.add(where, "evidence with 'Holm p … for / … against'", text, "unparseable")
        diff.p(where, "Holm p for", m["pf"], r.holm_for)
        diff.p(where, "Holm p against", m["pa"], r.holm_against)
        main, rest = m["main"], m["rest"]
    else:
        cut = min((i for i in (text.find("; control ("), text.find("; robustness check")) if i >= 0), default=len(text))
        main, rest = text[:cut], text[cut:]
    check_main(diff, where, main, r)
    check_extras(diff, where, rest, r)
    return None


def block(page: Path, name: str) -> str:
    text = page.read_text(encoding="utf-8")
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if start not in text or end not in text:
        raise SystemExit(f"{page} lacks the markers {start} ... {end}")
    return text.split(start, 1)[1].split(end, 1)[0].strip("\n")


def table(text: str) -> list[list[str]]:
    """The markdown table's rows as cells (header included, the |---| line left out)."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines() if line.startswith("|")]
    return [r for r in rows if not all(set(c) <= set("-: ") for c in r)]


def check_readme_cell(diff: Diff, where: str, cell: str, expected: list[Row]) -> None:
    """One README cell: a verdict for all parts ("v: layer 0 …; layer 1 …") or one per part."""
    common = re.match(rf"({VERDICT}): ", cell)
    body = cell[common.end():] if common else cell
    parts = [r.claim.part for r in expected]
    items = re.split("; (?=(?:" + "|".join(re.escape(p) for p in parts) + ") )", body) if all(parts) else [body]
    if len(items) != len(expected):
        return diff.add(where, "parts", len(items), len(expected))
    for text, r in zip(items, expected):
        here = f"{where}, {r.claim.part}" if r.claim.part else where
        if r.claim.part:
            if not text.startswith(f"{r.claim.part} "):
                diff.add(here, "part", text[:20], r.claim.part)
                continue
            text = text[len(r.claim.part) + 1:]
        verdict = common
        if not common:
            verdict = re.match(rf"({VERDICT}): ", text)
            text = text[verdict.end():] if verdict else text
        diff.same(here, "verdict", verdict.group(1) if verdict else None, r.verdict)
        check_item(diff, here, text, r, with_holm=True)
    return None


def check_readme(diff: Diff, page: Path, rows: list[Row]) -> None:
    text = block(page, "VERDICTS")
    members = [r for r in rows if not r.identity]
    m = re.search(r"the (\d+) tests for and the (\d+) tests against", text)
    counts = (sum(not math.isnan(r.p_for) for r in members), sum(not math.isnan(r.p_against) for r in members))
    diff.same("README intro", "family sizes (for, against)", (int(m[1]), int(m[2])) if m else None, counts)
    diff.same("README intro", "alpha", bool(re.search(rf"Holm-adjusted p < {ALPHA}\b", text)), True)
    for scaling, _, (la, _), (lb, _) in SCALINGS:
        s = [r for r in rows if r.scaling == scaling]
        m = re.search(rf"{re.escape(la)} (\d+) and {re.escape(lb)} (\d+) seeds \({re.escape(scaling)}\)", text)
        diff.same("README intro", f"seeds ({scaling})", (int(m[1]), int(m[2])) if m else None,
                  (max(len(r.a) for r in s), max(len(r.b) for r in s)))
    header, *body = table(text)
    scalings = [s for s, *_ in SCALINGS]
    diff.same("README table", "columns", header[1:], scalings)
    groups = list(dict.fromkeys(r.claim.group or r.claim.text for r in rows))
    diff.same("README table", "rows", [b[0] for b in body], groups)
    for cells in body:
        for scaling, cell in zip(header[1:], cells[1:]):
            expected = [r for r in rows if (r.claim.group or r.claim.text) == cells[0] and r.scaling == scaling]
            if expected:
                check_readme_cell(diff, f"README | {cells[0]} | {scaling}", cell, expected)


def check_results(diff: Diff, page: Path, rows: list[Row]) -> None:
    header, *body = table(block(page, "CLAIMS"))
    seen = set()
    for cells in body:
        if len(cells) != 9:
            diff.add("results.md", "cells in a row", len(cells), 9)
            continue
        claim, paper, scaling, seeds, here, rule, raw, adjusted, verdict = cells
        where = f"results.md | {claim} | {scaling}"
        r = next((r for r in rows if r.claim.text == claim and r.scaling == scaling), None)
        if r is None:
            diff.add(where, "row", "present", "no such claim and scaling")
            continue
        seen.add((claim, scaling))
        diff.same(where, "paper", paper, r.claim.paper)
        diff.same(where, "seeds (A / B)", seeds, f"{len(r.a)} / {len(r.b)}")
        check_item(diff, where, here, r, with_holm=False)
        m = re.fullmatch(rf"(\w+)(?:, ±({NUM}))?", rule)
        diff.same(where, "rule", m[1] if m else rule, r.claim.rule)
        margin = margin_of(r.claim)  # printed with two significant digits; none for ``order``
        diff.same(where, "margin", float(m[2]) if m and m[2] else None,
                  None if math.isnan(margin) else float(f"{margin:.2g}"))
        for name, pair, (pf, pa) in (("raw p", raw, (r.p_for, r.p_against)), ("Holm p", adjusted, (r.holm_for, r.holm_against))):
            printed = pair.split(" / ")
            if len(printed) != 2:
                diff.add(where, name, pair, (pf, pa))
                continue
            diff.p(where, f"{name} for", printed[0], pf)
            diff.p(where, f"{name} against", printed[1], pa)
        diff.same(where, "verdict", verdict, r.verdict)
    for r in rows:
        if (r.claim.text, r.scaling) not in seen:
            diff.add(f"results.md | {r.claim.text} | {r.scaling}", "row", "missing", r.verdict)


# ----------------------------------------------------------------------------- printing


def g(p: float) -> str:
    return "—" if math.isnan(p) else f"{p:.4g}"


def print_families(rows: list[Row]) -> None:
    for side in ("for", "against"):
        members = sorted((getattr(r, f"p_{side}"), i) for i, r in enumerate(rows)
                         if not r.identity and not math.isnan(getattr(r, f"p_{side}")))
        print(f"\nThe family of the tests {side}: {len(members)} tests, Holm within it "
              f"(rank k of m multiplies the k-th smallest raw p by m − k + 1, running maximum, capped at 1)")
        print(f"{'k':>3} {'×':>3}  {'raw p':>10} {'Holm p':>10}  claim | scaling")
        for k, (p, i) in enumerate(members):
            r = rows[i]
            print(f"{k + 1:>3} {len(members) - k:>3}  {g(p):>10} {g(getattr(r, f'holm_{side}')):>10}  "
                  f"{r.claim.text} | {r.scaling}")


def describe(r: Row) -> str:
    if r.claim.rule in ("order", "same"):
        lo, hi = welch(r.a, r.b)
        return f"{mean(r.a):.3f} vs {mean(r.b):.3f}, A − B {mean(r.a) - mean(r.b):.3f} [{lo:.3f}, {hi:.3f}]"
    lo, hi = t_interval(r.a)
    return f"{mean(r.a):.3f} [{lo:.3f}, {hi:.3f}]" + (f" ({r.n_censored} lower bounds)" if r.n_censored else "")


def near_ties(rows: list[Row]) -> list[str]:
    """Two-arm tests where a split's statistic lies between 1e-12 and 1e-6 (relative) of the observed one: there
    the tie tolerance could decide a count. Below 1e-12 a tie split only by rounding is joined, as it should be."""
    out = []
    for r in rows:
        if r.claim.rule not in ("order", "same") or min(len(r.a), len(r.b)) < MIN_SEEDS:
            continue
        for shift in (0.0,) if r.claim.rule == "order" else (margin_of(r.claim), -margin_of(r.claim)):
            pooled, na = [x - shift for x in r.a] + r.b, len(r.a)
            scale, observed = max(1.0, max(abs(x) for x in pooled)), mean(pooled[:na]) - mean(r.b)
            gaps = (abs(mean([pooled[i] for i in idx]) - mean([pooled[i] for i in range(len(pooled)) if i not in idx])
                        - observed) / scale for idx in itertools.combinations(range(len(pooled)), na))
            if any(1e-12 < gap < 1e-6 for gap in gaps):
                out.append(f"{r.claim.text} | {r.scaling} (shift {shift:g}): a split near the observed difference")
    return out


def print_verdicts(rows: list[Row]) -> None:
    print("\nEvery verdict, recomputed (unrounded means and Student-t / Welch 95% intervals):")
    for r in rows:
        print(f"  {r.claim.text} | {r.scaling} | n {len(r.a)}/{len(r.b)} | {r.claim.rule} | {describe(r)} | "
              f"raw {g(r.p_for)} / {g(r.p_against)} | Holm {g(r.holm_for)} / {g(r.holm_against)} | {r.verdict}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md", help="the README whose VERDICTS block is checked")
    ap.add_argument("--results", type=Path, default=ROOT / "docs" / "results.md",
                    help="the page whose CLAIMS table is checked")
    ap.add_argument("--values", type=Path, nargs="+", default=[TABLES / "seed_values.csv", TABLES / "coupling_values.csv"],
                    help="the unrounded per-seed values (default: the shipped seed_values.csv and coupling_values.csv)")
    args = ap.parse_args(argv)
    check_t()
    rows = recompute(load(args.values))
    print_families(rows)
    print_verdicts(rows)
    ties = near_ties(rows)
    print("\nSplits the tie tolerance could decide (a statistic 1e-12 to 1e-6 from the observed):", *ties or ["none"],
          sep="\n  ")
    diff = Diff()
    check_readme(diff, args.readme, rows)
    check_results(diff, args.results, rows)
    if diff.lines:
        print(f"\n{len(diff.lines)} disagreement(s) with the pages:", *diff.lines, sep="\n  ")
        return 1
    print(f"\nEvery verdict and printed number of {args.readme.name}'s VERDICTS block and {args.results.name}'s "
          f"CLAIMS table agrees with the recomputation ({len(rows)} claim rows, {diff.checked} printed items compared).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
