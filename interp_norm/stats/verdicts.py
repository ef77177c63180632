"""The paper's claims, each with a verdict decided by a declared rule from the unrounded per-seed values.

Nothing is typed by hand and nothing is read from a summary table: every p and interval is recomputed
from the per-seed values (one row per checkpoint and measure, unrounded: a report's ``seed_numbers``
table, shipped for the 24 seed checkpoints as ``seed_values.csv``, :mod:`interp_norm.stats.shipped`).
Arms: Menary et al. 2024 §4's Pre-Norm vs QKV-Norm, at 1/√d_head and with the paper's Checkpoint
calibration (:data:`interp_norm.stats.seed_compare.PAIRS`). Each claim has a *test for* and a *test against*:

* ``order`` (the paper says A > B, or A < B): for = the one-sided exact permutation test in the
  paper's direction (every split of the seeds, 924 for 6 + 6); against = the same test in the reverse
  direction. **reproduced** / **not reproduced (reversed)** / **not established**.
* ``same`` (A and B on a par): for = TOST, two one-sided exact permutation tests under location
  shift with the declared margin ``±margin`` (:data:`PAR_MARGIN`); against = the difference lies
  outside the margin (the smaller of the two shifted one-sided p-values, doubled).
* ``above`` (the paper says "≳ value"): for = one-sided one-sample t-test of H0 mean <= value − margin
  ("≳" allows the declared margin, :data:`ABOVE_MARGIN` of the value); against = H0 mean >= value − margin.
* ``near`` (the paper says "≈ value"): for = TOST of mean within value ± margin (one-sample t,
  :data:`NEAR_MARGIN` of the value); against = the mean lies outside it (smaller one-sided p, doubled).
  Where seeds never reached a collapse level their values are lower bounds: only "above the margin"
  can then be shown (against), never "within" (for).

The thesis (the paper's title claim: Pre-Norm couples residual components through its shared norm,
QKV-Norm does not) is tested directly as an ``order`` claim on ``scripts/coupling_seeds.py``'s measure
(``coupling_values.csv``): the attention change when the token component of each layer's input is
halved, Pre-Norm > QKV-Norm, beside the same for equal-norm random subspaces (the control: a
difference there too says the coupling is not specific to the semantic component).

A claim may carry a **robustness check**: another measure of the same claim under a different model
choice, tested by the claim's own rule and shown beside it with its raw p, **outside the family** (it
decides nothing). The noise cost carries the shared-κ variant: one κ per (example, position, layer) for
every head and for q, k and v (``NormNoise(shared=True)``, the paper's picture of interference through
the one shared norm) instead of an independent κ per head and vector, beside the per-head cost on the
same problems and κ streams (the noise decomposition, ``reproduce --controls``;
``scripts/noise_model_seeds.py`` recomputes both).

No verdict rests on an interval's far end. **Two declared families**, each Holm-adjusted at
:data:`ALPHA`: the tests *for* of every claim that is not an identity (is the paper supported?) and the
tests *against* (is it contradicted?); the verdicts are decided on the adjusted p. One family of both
would be a test that cannot succeed: with 6 + 6 seeds the smallest exact one-sided permutation p is
1/924, and Holm over the 51 tests of both sides multiplies it by at least 51 − 3 (0.052), so no
ordering claim could be established whatever the seeds showed (:func:`smallest_adjusted_order_p` states it for any design). A comparison that holds by construction (an arm whose value is fixed by its
architecture) is an **identity**: it leaves the family and is labelled so. Intervals are Student-t 95%
over seeds (Welch for a difference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pandas as pd

from interp_norm.stats.inference import (holm, permutation_test, t_interval, t_test_value, tost_permutation,
                                         tost_value, welch_interval)
from interp_norm.stats.seed_compare import PAIRS

__all__ = ["ALPHA", "MIN_SEEDS", "RULES", "PAR_MARGIN", "ABOVE_MARGIN", "NEAR_MARGIN", "Claim", "CLAIMS",
           "claim_tests", "verdicts", "family_table", "fmt_num", "fmt_p", "smallest_adjusted_order_p", "family_sizes"]

ALPHA = 0.05
MIN_SEEDS = 3
RULES = ("order", "same", "above", "near")
#: ``same``: the largest |A − B| that counts as "on a par" (points; the paper's ID gap is 0.4).
PAR_MARGIN = 1.0
#: ``above``: "≳ v" is shown when the mean is above v − ABOVE_MARGIN·v (10% of the value).
ABOVE_MARGIN = 0.10
#: ``near``: "≈ v" is shown when the mean is within v ± NEAR_MARGIN·v (20% of the value).
NEAR_MARGIN = 0.20
_SPREAD = "norm spread (90% of attended norms within ±), layer {layer}"
_DECOMPOSITION = "accuracy lost to 1% noise on q, k and v{how} (decomposition)"
_SHARED = _DECOMPOSITION.format(how=" with one κ per token shared across heads")
_PER_HEAD = _DECOMPOSITION.format(how="")
#: ``scripts/coupling_seeds.py``'s measure (coupling_values.csv): the thesis, tested directly.
_COUPLING = "attention moved by halving the token component (total, {subspace})"


@dataclass(frozen=True)
class Claim:
    """One claim of Menary et al. 2024 (§4), the per-seed measure that tests it and its rule."""

    text: str        # the claim, as the README states it
    paper: str       # the paper's figure
    quantity: str    # the per-seed values' "quantity"
    rule: str        # one of RULES
    sign: int = 1    # order: +1 if the paper says A > B (Pre-Norm above QKV-Norm), -1 if A < B
    value: float = math.nan  # above / near: the paper's value, in the measure's unit
    group: str = ""  # claims with one group share a README row (the per-layer ones) ...
    part: str = ""   # ... each named by its part there ("layer 0")
    # scaling -> why the comparison holds by construction (then an identity, outside the family). None of
    # CLAIMS is one: the q/k-gain bound leaves 1 to 4 heads of every QKV-cal seed able to reach 0.99 on
    # two-key rows, so QKV-cal's 0% of rows at >= 0.99 is a measurement, not a construction.
    identity: dict = field(default_factory=dict)
    control: str = ""  # a control measure shown beside the claim's (same test, raw p; not in the family)
    robustness: tuple[str, str, str] | tuple[()] = ()  # (label, measure, the per-head measure on the same
    # draws): a robustness check, tested by the claim's own rule and shown with raw p, outside the family

    @property
    def margin(self) -> float:
        return {"same": PAR_MARGIN, "above": ABOVE_MARGIN * self.value, "near": NEAR_MARGIN * self.value}.get(
            self.rule, math.nan)


CLAIMS = (
    Claim("ID accuracy on a par", "91.4 vs 91.0%", "ID accuracy", "same"),
    Claim("QKV-Norm interpolates worse", "87.5 vs 82.5%", "interpolation accuracy", "order", +1),
    Claim("QKV-Norm extrapolates worse", "66.7 vs 46.8%", "extrapolation accuracy", "order", +1),
    Claim("1% norm noise costs Pre-Norm ≳ 10 points", "≳ 10",
          "accuracy lost to 1% noise (all rows, before any norm)", "above", value=10.0,
          robustness=("one κ per token shared across heads", _SHARED, _PER_HEAD)),
    Claim("1% of Pre-Norm's sparse rows collapse at 11% noise (loose)", "11%",
          "1% loose collapse level, per-layer protocol", "near", value=11.0),
    *(Claim(f"Pre-Norm: 90% of attended norms within ±20%, layer {layer}", "±20%", _SPREAD.format(layer=layer),
            "near", value=20.0, group="Pre-Norm: 90% of attended norms within ±20%", part=f"layer {layer}")
      for layer in range(3)),
    *(Claim(f"QKV-Norm's norm spread is much wider, layer {layer}", "wider", _SPREAD.format(layer=layer), "order", -1,
            group="QKV-Norm's norm spread is much wider", part=f"layer {layer}") for layer in range(3)),
    Claim("attention peaks at 1 in Pre-Norm, not QKV-Norm (rows at ≥ 0.99)", "peak / none",
          "rows with max attention ≥ 0.99, all layers", "order", +1),
    Claim("thesis: halving the token component moves Pre-Norm's attention more (% TV)", "title claim",
          _COUPLING.format(subspace="token component"), "order", +1,
          control=_COUPLING.format(subspace="equal-norm random subspace")),
)


def fmt_num(x: float, digits: int = 1) -> str:
    """``x`` rounded, without the sign of a negative value that rounds to zero ("-0.0")."""
    s = f"{x:.{digits}f}"
    return s[1:] if s.startswith("-") and float(s) == 0 else s


def fmt_p(p: float) -> str:
    """Two significant digits, more where two would round across :data:`ALPHA` (0.0498 is not "0.05")."""
    if math.isnan(p):
        return "—"
    digits = 2
    while digits < 6 and (float(f"{p:.{digits}g}") < ALPHA) != (p < ALPHA):
        digits += 1
    return f"{p:.{digits}g}"


def _ci(m: float, lo: float, hi: float) -> str:
    return fmt_num(m) if math.isnan(lo) else f"{fmt_num(m)} [{fmt_num(lo)}, {fmt_num(hi)}]"


def _arm(values: pd.DataFrame, quantity: str, norm: str, cal: str) -> tuple[np.ndarray, np.ndarray]:
    """(values, lower bounds) of one arm's seeds for ``quantity``: a reached value, or the bound of a
    never-reached collapse level (``censored_above``); seeds with neither are left out."""
    d = values[(values["quantity"] == quantity) & (values["attn_norm"] == norm) & (values["calibration"] == cal)]
    d = d.sort_values("seed")
    v = d["value"].to_numpy(float)
    c = d["censored_above"].to_numpy(float) if "censored_above" in d.columns else np.full(len(d), np.nan)
    censored = ~np.isfinite(v) & np.isfinite(c)
    keep = np.isfinite(v) | censored
    return np.where(censored, c, v)[keep], censored[keep]


def _two_arm_tests(claim: Claim, a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(p for, p against) of an ``order`` or ``same`` claim."""
    if claim.rule == "order":
        towards, away = ("greater", "less") if claim.sign > 0 else ("less", "greater")
        return (permutation_test(a, b, alternative=towards).p_value,
                permutation_test(a, b, alternative=away).p_value)
    m = claim.margin
    outside = min(permutation_test(a, b, alternative="greater", shift=m).p_value,
                  permutation_test(a, b, alternative="less", shift=-m).p_value)
    return tost_permutation(a, b, m), min(1.0, 2 * outside)


def _value_tests(claim: Claim, a: np.ndarray, censored: bool) -> tuple[float, float]:
    """(p for, p against) of an ``above`` or ``near`` claim on arm A's seeds."""
    v, m = claim.value, claim.margin
    if claim.rule == "above":
        return (t_test_value(a, v - m, alternative="greater"), t_test_value(a, v - m, alternative="less"))
    if censored:  # lower bounds: "above v + m" can be shown, "within" cannot
        return math.nan, t_test_value(a, v + m, alternative="greater")
    outside = min(t_test_value(a, v + m, alternative="greater"), t_test_value(a, v - m, alternative="less"))
    return tost_value(a, v, m), min(1.0, 2 * outside)


def _row(values: pd.DataFrame, claim: Claim, pair: tuple) -> dict | None:
    """One (claim, scaling) row of :func:`claim_tests`, or None when arm A has no seed."""
    scaling, cal, (label_a, norm_a), (label_b, norm_b) = pair
    a, ca = _arm(values, claim.quantity, norm_a, cal)
    b, _ = _arm(values, claim.quantity, norm_b, cal)
    if not len(a):
        return None
    row = dict(claim=claim.text, group=claim.group or claim.text, part=claim.part, paper=claim.paper,
               quantity=claim.quantity, rule=claim.rule, margin=claim.margin, scaling=scaling, arm_a=label_a,
               arm_b=label_b, n_a=len(a), n_b=len(b), n_censored_a=int(ca.sum()), mean_a=float(a.mean()),
               identity=claim.identity.get(scaling, ""), p_for=math.nan, p_against=math.nan)
    row["ci_lo_a"], row["ci_hi_a"] = t_interval(a)
    if claim.rule in ("order", "same"):
        row["mean_b"] = float(b.mean()) if len(b) else math.nan
        row["diff"] = row["mean_a"] - row["mean_b"]
        row["diff_lo"], row["diff_hi"] = welch_interval(a, b) if len(b) else (math.nan, math.nan)
        if min(len(a), len(b)) >= MIN_SEEDS:
            row["p_for"], row["p_against"] = _two_arm_tests(claim, a, b)
    elif len(a) >= MIN_SEEDS:
        row["p_for"], row["p_against"] = _value_tests(claim, a, bool(ca.any()))
    row["control"] = _control(values, claim, norm_a, norm_b, cal) if claim.control else ""
    row["robustness"] = _robustness(values, claim, norm_a, norm_b, cal) if claim.robustness else ""
    return row


def claim_tests(values: pd.DataFrame, claims: Sequence[Claim] = CLAIMS) -> pd.DataFrame:
    """One row per (claim, scaling): the measure, its interval, and the raw p for and against."""
    rows = [_row(values, claim, pair) for claim in claims for pair in PAIRS]
    return pd.DataFrame([r for r in rows if r is not None])


def _control(values: pd.DataFrame, claim: Claim, norm_a: str, norm_b: str, cal: str) -> str:
    """The control measure's A vs B in words, with the claim's test in the claim's direction (raw p)."""
    a, _ = _arm(values, claim.control, norm_a, cal)
    b, _ = _arm(values, claim.control, norm_b, cal)
    if min(len(a), len(b)) < MIN_SEEDS:
        return ""
    lo, hi = welch_interval(a, b)
    p = _two_arm_tests(claim, a, b)[0]
    same_way = (" — the control differs the same way, so the difference is not specific to the claim's "
                "component" if p < ALPHA else "")
    return (f"control (equal-norm random subspace): {fmt_num(a.mean())} vs {fmt_num(b.mean())}, "
            f"A − B {_ci(a.mean() - b.mean(), lo, hi)}, raw p {fmt_p(p)}{same_way}")


def _robustness(values: pd.DataFrame, claim: Claim, norm_a: str, norm_b: str, cal: str) -> str:
    """The robustness measure in words, tested by the claim's rule (raw p, outside the family), beside the
    per-head measure on the same problems and κ streams."""
    label, quantity, per_head = claim.robustness  # type: ignore[misc]
    a, _ = _arm(values, quantity, norm_a, cal)
    ref, _ = _arm(values, per_head, norm_a, cal)
    if len(a) < MIN_SEEDS:
        return ""
    if claim.rule in ("order", "same"):
        b, _ = _arm(values, quantity, norm_b, cal)
        if len(b) < MIN_SEEDS:
            return ""
        p_for, p_against = _two_arm_tests(claim, a, b)
        text = f"{fmt_num(a.mean())} vs {fmt_num(b.mean())}, A − B {_ci(a.mean() - b.mean(), *welch_interval(a, b))}"
    else:
        p_for, p_against = _value_tests(claim, a, False)
        text = _ci(a.mean(), *t_interval(a))
    beside = f" (κ per head on the same draws: {fmt_num(ref.mean())})" if len(ref) else ""
    return (f"robustness check, outside the family ({label}): {text}{beside}, "
            f"raw p {fmt_p(p_for)} for / {fmt_p(p_against)} against")


def verdicts(values: pd.DataFrame, claims: Sequence[Claim] = CLAIMS) -> pd.DataFrame:
    """:func:`claim_tests` with Holm-adjusted p over the family (identities left out), each verdict and its
    evidence in words."""
    t = claim_tests(values, claims)
    if not len(t):
        return t
    member = t["identity"] == ""
    t["holm_for"] = holm(t["p_for"].where(member).to_numpy(dtype=float))
    t["holm_against"] = holm(t["p_against"].where(member).to_numpy(dtype=float))
    t["verdict"] = [_verdict(r) for r in t.itertuples()]
    t["evidence"] = [_evidence(r) for r in t.itertuples()]
    return t


def family_sizes(v: pd.DataFrame) -> tuple[int, int]:
    """(tests for, tests against) in the two families of :func:`verdicts`' table (identities and
    tests that could not be run left out)."""
    member = v.loc[v["identity"] == ""]
    return int(member["p_for"].notna().sum()), int(member["p_against"].notna().sum())


def smallest_adjusted_order_p(n_a: int, n_b: int, family_size: int) -> float:
    """The smallest Holm-adjusted p an ordering claim can reach: the exact permutation test's smallest
    p (one split of C(n_a + n_b, n_a)) times the family's size. At or above :data:`ALPHA` no ordering
    claim can be established, whatever the data."""
    return min(1.0, family_size / math.comb(n_a + n_b, n_a))


def _verdict(r) -> str:
    if r.identity:
        return "identity"
    if math.isnan(r.p_for) and math.isnan(r.p_against):
        return "not established"
    if r.holm_for < ALPHA:
        return "reproduced"
    if r.holm_against < ALPHA:
        return "not reproduced (reversed)" if r.rule == "order" else "not reproduced"
    return "not established"


def _evidence(r) -> str:
    if r.rule in ("order", "same"):
        text = f"{r.arm_a} {fmt_num(r.mean_a)} vs {r.arm_b} {fmt_num(r.mean_b)}, A − B {_ci(r.diff, r.diff_lo, r.diff_hi)}"
    else:
        text = _ci(r.mean_a, r.ci_lo_a, r.ci_hi_a) + (f", {r.n_censored_a} seed(s) never reached: lower bounds"
                                                       if r.n_censored_a else "")
    if r.identity:
        return f"{text}; {r.identity}"
    control = "".join(f"; {x}" for x in (r.control, r.robustness) if x)
    return f"{text}, Holm p {fmt_p(r.holm_for)} for / {fmt_p(r.holm_against)} against{control}"


def family_table(values: pd.DataFrame, claims: Sequence[Claim] = CLAIMS) -> pd.DataFrame:
    """The family, one row per test: claim, scaling, which test, raw and Holm-adjusted p."""
    v = verdicts(values, claims)
    rows = [dict(claim=r.claim, scaling=r.scaling, test=side, p_raw=getattr(r, f"p_{side}"),
                 p_holm=getattr(r, f"holm_{side}"), verdict=r.verdict)
            for r in v.itertuples() if not r.identity for side in ("for", "against")
            if not math.isnan(getattr(r, f"p_{side}"))]
    return pd.DataFrame(rows)
