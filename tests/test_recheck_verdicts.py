"""scripts/recheck_verdicts.py: its hand-written statistics against closed forms and hand-worked cases, its
independence from the package's statistics, its agreement with the shipped pages, and that it catches a
tampered page or tampered values."""

from __future__ import annotations

import ast
import csv
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _scripts import load_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "recheck_verdicts.py"
DECLARATION = {"ABOVE_MARGIN", "ALPHA", "CLAIMS", "MIN_SEEDS", "NEAR_MARGIN", "PAR_MARGIN"}


@pytest.fixture(scope="module")
def rv():
    yield load_script("recheck_verdicts")
    sys.modules.pop("recheck_verdicts", None)


def test_it_reads_only_the_declaration_from_the_package():
    imported = []
    for node in ast.walk(ast.parse(SCRIPT.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            imported.append((node.module, {a.name for a in node.names}))
        elif isinstance(node, ast.Import):
            imported += [(a.name, set()) for a in node.names]
    ours = [(m, names) for m, names in imported if m and (m.startswith("interp_norm") or m in ("scipy", "verdicts"))]
    # the declaration's constants, and its Claim type for annotations only (under TYPE_CHECKING)
    assert ours == [("interp_norm.stats.verdicts", DECLARATION), ("interp_norm.stats.verdicts", {"Claim"})]


@pytest.mark.parametrize("a, b, x, exact", [
    (1.0, 3.0, 0.3, 1 - 0.7 ** 3),                       # I_x(1, b) = 1 − (1 − x)^b
    (1.0, 0.5, 0.99, 1 - 0.01 ** 0.5),
    (2.5, 1.0, 0.7, 0.7 ** 2.5),                         # I_x(a, 1) = x^a
    (0.5, 0.5, 0.2, 2 / math.pi * math.asin(0.2 ** 0.5)),  # I_x(1/2, 1/2) = (2/π) asin(√x)
    (0.5, 0.5, 0.9, 2 / math.pi * math.asin(0.9 ** 0.5)),
    (2.0, 2.0, 0.4, 3 * 0.4 ** 2 - 2 * 0.4 ** 3),        # I_x(2, 2) = 3x² − 2x³
])
def test_incomplete_beta_against_closed_forms(rv, a, b, x, exact):
    assert rv.betainc(a, b, x) == pytest.approx(exact, rel=1e-12, abs=1e-14)


@pytest.mark.parametrize("t", [-3.0, -0.4, 0.0, 0.7, 2.0, 12.0])
def test_t_tail_against_closed_forms(rv, t):
    # df 1 is Cauchy: P(T > t) = 1/2 − atan(t)/π; df 2: P(T > t) = 1/2 − t / (2 √(2 + t²))
    assert rv.t_sf(t, 1) == pytest.approx(0.5 - math.atan(t) / math.pi, rel=1e-12, abs=1e-15)
    assert rv.t_sf(t, 2) == pytest.approx(0.5 - t / (2 * math.sqrt(2 + t * t)), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("df", [2.5, 5.0, 7.3, 10.9])
@pytest.mark.parametrize("t", [0.5, 1.7, 3.2])
def test_t_tail_against_integrating_the_density(rv, df, t):
    # Welch's degrees of freedom are not integers: P(T > t) = 1/2 − ∫_0^t density, by Simpson's rule on 20 001
    # points (step h = t / 20 000: error below h⁴ · t · max|f⁽⁴⁾| / 180 < 1e-14; summing 20 001 terms rounds ~1e-13).
    x = np.linspace(0.0, t, 20_001)
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    f = c * (1 + x * x / df) ** (-(df + 1) / 2)
    h = x[1] - x[0]
    simpson = 0.5 - h / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())
    assert rv.t_sf(t, df) == pytest.approx(simpson, rel=0, abs=1e-12)


@pytest.mark.parametrize("df, q, crit", [(5, 0.95, 2.015048), (10, 0.95, 1.812461), (4, 0.975, 2.776445),
                                         (20, 0.99, 2.527977)])
def test_t_quantile_against_the_table(rv, df, q, crit):
    assert rv.t_ppf(q, df) == pytest.approx(crit, abs=2e-6)


def test_permutation_p_by_hand(rv):
    # a = [3, 4], b = [1, 2]: of the 6 splits only the observed one has mean_a − mean_b = 2
    assert rv.perm_p([3.0, 4.0], [1.0, 2.0], "greater") == pytest.approx(1 / 6)
    assert rv.perm_p([3.0, 4.0], [1.0, 2.0], "less") == pytest.approx(1.0)
    # shifted by 2: pooled [1, 2, 1, 2]; the 6 splits give 0 four times, +1 once, −1 once
    assert rv.perm_p([3.0, 4.0], [1.0, 2.0], "greater", 2.0) == pytest.approx(5 / 6)
    assert rv.perm_p([3.0, 4.0], [1.0, 2.0], "less", 2.0) == pytest.approx(5 / 6)
    # ties split only by rounding count as ties: 0.1 + 0.2 != 0.3 in floats
    assert rv.perm_p([0.1, 0.2], [0.3, 0.0], "greater") == pytest.approx(4 / 6)


def test_holm_by_hand(rv):
    # sorted 0.01, 0.03, 0.04 over m = 3: 0.03, max(0.03, 0.06), max(0.06, 0.04); NaN is not a member
    out = rv.holm([0.01, 0.04, 0.03, math.nan])
    assert out[:3] == pytest.approx([0.03, 0.06, 0.06]) and math.isnan(out[3])
    assert rv.holm([0.6, 0.9]) == pytest.approx([1.0, 1.0])


def test_t_test_and_intervals_by_hand(rv):
    v = [1.0, 2.0, 3.0, 4.0, 5.0]  # mean 3, s² = 2.5, se = √0.5, df 4
    t = 1 / math.sqrt(0.5)
    assert rv.t_p(v, 2.0, "greater") == pytest.approx(rv.t_sf(t, 4), rel=1e-14)
    assert rv.t_p(v, 2.0, "less") == pytest.approx(1 - rv.t_sf(t, 4), rel=1e-14)
    lo, hi = rv.t_interval(v)
    assert (lo, hi) == pytest.approx((3 - 2.776445 * math.sqrt(0.5), 3 + 2.776445 * math.sqrt(0.5)), abs=1e-5)
    # an arm with no spread: Welch's df is the other arm's n − 1, the interval that arm's t-interval, shifted
    assert rv.welch(v, [1.0, 1.0, 1.0]) == pytest.approx((lo - 1, hi - 1), rel=1e-9)


def test_the_shipped_pages_agree_with_the_recomputation():
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": ""})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "The family of the tests for: 25 tests" in out.stdout
    assert "The family of the tests against: 26 tests" in out.stdout
    assert "agrees with the recomputation (26 claim rows" in out.stdout


def run(rv, capsys, *args: str) -> tuple[int, str]:
    """(exit code, printed text) of the script's main, in this process (the subprocess run is above)."""
    code = rv.main(list(args))
    return code, capsys.readouterr().out


def tampered(tmp_path: Path, page: Path, old: str, new: str) -> Path:
    text = page.read_text(encoding="utf-8")
    assert old in text, f"the page no longer holds {old!r}: pick another edit"
    out = tmp_path / page.name
    out.write_text(text.replace(old, new, 1), encoding="utf-8")
    return out


@pytest.mark.parametrize("old, new, expected", [
    ("| reproduced: Pre-Norm 2.5 vs QKV-Norm 0.0", "| not established: Pre-Norm 2.5 vs QKV-Norm 0.0",
     "verdict: printed 'not established', recomputed 'reproduced'"),
    ("not reproduced: 9.1 [7.6, 10.5]", "not reproduced: 9.2 [7.6, 10.5]", "mean A: printed '9.2'"),
    ("Holm p 0.0498 for", "Holm p 0.05 for", "Holm p for: printed '0.05'"),
    ("the 25 tests for", "the 24 tests for", "family sizes"),
])
def test_a_tampered_readme_is_caught(rv, capsys, tmp_path, old, new, expected):
    code, out = run(rv, capsys, "--readme", str(tampered(tmp_path, ROOT / "README.md", old, new)))
    assert code == 1 and "1 disagreement(s)" in out and expected in out, out[-2000:]


def test_a_tampered_results_table_is_caught(rv, capsys, tmp_path):
    page = tampered(tmp_path, ROOT / "docs" / "results.md", "| near, ±2.2 | 0.99 / 0.013", "| near, ±2.5 | 0.99 / 0.013")
    code, out = run(rv, capsys, "--results", str(page))
    assert code == 1 and "1 disagreement(s)" in out and "margin: printed 2.5, recomputed 2.2" in out, out[-2000:]


def test_tampered_values_are_caught(rv, capsys, tmp_path):
    # one Pre-Norm seed's ID accuracy 6 points lower moves that arm's mean by 1 point: the pages no longer hold
    tables = ROOT / "data" / "seed_tables"
    with open(tables / "seed_values.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    row = next(r for r in rows if r["checkpoint"] == "pre" and r["quantity"] == "ID accuracy")
    row["value"] = str(float(row["value"]) - 6.0)
    path = tmp_path / "seed_values.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    code, out = run(rv, capsys, "--values", str(path), str(tables / "coupling_values.csv"))
    assert code == 1 and "README | ID accuracy on a par | 1/√d_head: mean A" in out, out[-2000:]
