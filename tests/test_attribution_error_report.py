"""The error budget's figure, dashboard section, seed statistics and docs block.

* The figure's stacked bars are the per-seed means of the parts (recomputed here), and add up to the
  mean relative live error; each seed's live and frozen-norm errors are its dots.
* The section reads a report's own table, else the shipped one for a report of shipped checkpoints only.
* The seed comparison's Holm family on constructed seeds: the adjusted p recomputed by hand; the identity
  (AtP = EAP) and the control stay out of it.
* docs/findings-tables.md's ATTRIBUTION-ERROR block is what the script builds from data/seed_tables, and every
  interval and p the results page cites from it is a cell of that block.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from _scripts import load_script

from interp_norm.errors import ConfigError
from interp_norm.report.dashboard import attribution_error as section
from interp_norm.report.plots import plot_error_budget

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("removed_by_norm", "removed_by_pattern", "rest")


def _table() -> pd.DataFrame:
    """Two arms, two seeds each, two methods; parts chosen so that they add to err_live."""
    rng = np.random.default_rng(0)
    rows = []
    for arm in ("pre", "qkv"):
        for s, name in enumerate((arm, f"{arm}-s1")):
            for method in ("eap", "eap-ig"):
                parts = rng.uniform(-0.5, 1.0, 3)
                size = rng.uniform(1.0, 3.0)
                rows.append(dict(checkpoint=name, arm=arm, seed=s, method=method, activation="all", exact_size=size,
                                 **dict(zip(PARTS, parts)), err_live=parts.sum(), err_norm=parts[1:].sum(),
                                 err_both=parts[2], rel_err_live=parts.sum() / size, rel_err_norm=parts[1:].sum() / size,
                                 rel_err_both=parts[2] / size))
    df = pd.DataFrame(rows)
    return pd.concat([df, df.assign(activation="z")], ignore_index=True)


def _load_script():
    return load_script("attribution_error_budget"), load_script("_docs")


def test_bars_are_the_mean_parts_and_dots_every_seed():
    df = _table()
    fig = plot_error_budget(df)
    bars = [t for t in fig.data if t.type == "bar"]
    assert [t.name.split(" (")[0] for t in bars] == ["removed by freezing the norm", "removed by freezing the patterns", "rest"]
    keys = list(zip(bars[0].x[0], bars[0].x[1]))
    assert keys == [("pre", "EAP"), ("pre", "EAP-IG"), ("qkv", "EAP"), ("qkv", "EAP-IG")]
    for i, (arm, label) in enumerate(keys):
        method = label.lower()
        rows = [r for r in df.itertuples() if r.arm == arm and r.method == method and r.activation == "all"]
        for t, part in zip(bars, PARTS):
            want = 100 * sum(getattr(r, part) / r.exact_size for r in rows) / len(rows)
            assert abs(t.y[i] - want) <= 1e-9 * max(1.0, abs(want))
        total = 100 * sum(r.rel_err_live for r in rows) / len(rows)
        assert abs(sum(t.y[i] for t in bars) - total) <= 1e-9 * max(1.0, total)
    live, frozen, mean = [t for t in fig.data if t.type == "scatter"]
    assert len(live.y) == len(frozen.y) == 8  # 4 checkpoints x 2 methods
    assert np.allclose(mean.y, [sum(t.y[i] for t in bars) for i in range(len(keys))])
    assert fig.layout.barmode == "relative"


def test_bad_tables_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="lacks columns"):
        plot_error_budget(_table().drop(columns="rest"))
    with pytest.raises(ConfigError, match="no rows for activation 'q'"):
        plot_error_budget(_table(), activation="q")


def _panel(title, build, caption="", kind="figure"):
    from interp_norm.report.dashboard.page import Panel

    return Panel(title, figure=build(), caption=caption, kind=kind)


def test_section_reads_the_reports_table_else_the_shipped_one_for_shipped_checkpoints(tmp_path):
    df = _table()
    shipped = tmp_path / "shipped.csv"
    df.to_csv(shipped, index=False)
    own = section.attribution_error_section({section.KEY: df}, _panel, shipped=tmp_path / "absent.csv")
    assert [s.anchor for s in own] == ["attribution-error"] and "this report's" in own[0].panels[0].caption
    ev = lambda *names: {"evaluation": pd.DataFrame({"checkpoint": names})}  # noqa: E731
    ours = ("pre", "pre-s1")  # what is_shipped_checkpoint found among the report's checkpoints
    got = section.budget_table(ev("pre", "pre-s1"), ours, shipped)
    assert set(got["arm"]) == {"pre"} and len(got) == len(df) // 2
    assert section.budget_table(ev("pre", "/somewhere/my-model"), ours, shipped) is None  # not the shipped set
    assert section.budget_table(ev("pre", "pre-s1"), ("pre",), shipped) is None  # pre-s1 is a look-alike
    assert section.budget_table(ev("pre"), ours, tmp_path / "absent.csv") is None  # no shipped table (an installed wheel)
    assert section.attribution_error_section({}, _panel, shipped=shipped) == []


def test_section_sits_after_the_circuit_sections_and_before_the_noise():
    from interp_norm.report.dashboard.sections import PAGE_ORDER, figure_sections

    report = SimpleNamespace(tables={section.KEY: _table()}, checkpoints=pd.DataFrame(), timings={}, notes=[])
    sections, problems = figure_sections(report, strict=True)
    assert not problems and [s.anchor for s in sections] == ["attribution-error"]
    assert PAGE_ORDER.index("addition-circuit") + 1 == PAGE_ORDER.index("attribution-error") < PAGE_ORDER.index("noise")
    assert sections[0].lead.startswith("Look at the red bars")


def _seeds(values: dict) -> pd.DataFrame:
    """Per-seed rows as seed_values writes them: quantity -> (6 Pre values, 6 QKV values), both scalings."""
    rows = []
    for cal in ("none", "paper"):
        for q, (a, b) in values.items():
            for norm, vals in (("pre", a), ("qkv", b)):
                rows += [dict(checkpoint=f"{norm}-{cal}-s{i}", attn_norm=norm, calibration=cal, seed=i, quantity=q,
                              unit="logit diff" if "control" in q else "%", value=v) for i, v in enumerate(vals)]
    return pd.DataFrame(rows)


def test_holm_family_on_constructed_seeds():
    mod, _ = _load_script()
    high, low = [50.0, 51, 52, 53, 54, 55], [40.0, 41, 42, 43, 44, 45]
    quantities = [mod._quantity(m, n) for m in mod.LABEL for n in ("live", "frozen")] + [mod.CONTROL]
    per = _seeds({q: (high, low) for q in quantities})
    worse = per["quantity"].str.endswith("norm frozen")
    per.loc[worse, "value"] += np.tile([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], int(worse.sum()) // 6)  # frozen − live per seed
    comp, within = mod.with_family_holm(mod.comparisons(per), mod.within_arm(per))
    fam = comp[comp["role"] == "family"]
    assert len(fam) == 2 * 3 * 2  # (AtP*, EAP, EAP-IG) x (live, frozen) x two scalings
    assert set(comp.loc[comp["role"] != "family", "comparison"]) == {mod._quantity("atp", "live"),
                                                                     mod._quantity("atp", "frozen"), mod.CONTROL}
    # within each arm: frozen − live = 0.1..0.6, mean 0.35, s = 0.1 sqrt(3.5), t = 0.35 / (s / sqrt 6) on 5 df
    t = 0.35 / (0.1 * 3.5 ** 0.5 / 6 ** 0.5)
    assert len(within) == 4 * 4 and np.allclose(within["mean"], 0.35) and (within["n_positive"] == 6).all()
    theta = math.atan(t / math.sqrt(5))  # Student t with 5 df in closed form (Abramowitz & Stegun 26.7.3)
    p_t = (1 - 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * (1 + 2 / 3 * math.cos(theta) ** 2))) / 2
    assert np.allclose(within["p_greater"], p_t, rtol=1e-6)
    # separated 6 + 6 seeds: one-sided p = 1 / C(12, 6) = 1/924 (12 of them), the other direction 1 (12), and
    # 12 within-arm t p (p_t ≈ 0.003 > 1/924): Holm over m = 36 gives the smallest twelve 36/924, then the
    # running maximum of (36 - 12) * p_t ... (25 - 12) * p_t, so 24 * p_t for all twelve t p; the rest 1
    assert np.allclose(fam["p_greater"], 1 / 924) and np.allclose(fam["p_greater_holm"], 36 / 924)
    assert np.allclose(fam["p_less"], 1.0) and np.allclose(fam["p_less_holm"], 1.0)
    inside = within["role"] == "family"
    assert np.allclose(within.loc[inside, "p_holm"], 24 * p_t) and within.loc[~inside, "p_holm"].isna().all()
    assert comp.loc[comp["role"] != "family", ["p_greater_holm", "p_less_holm"]].isna().all().all()
    assert np.allclose(comp["diff"], 10.0)


def test_docs_block_is_current_and_the_results_cite_only_its_cells():
    mod, docs = _load_script()
    if not (mod.DATA / "attribution_error_seed_comparisons.csv").exists():
        pytest.skip("no attribution error tables in data/seed_tables")
    block = docs.block(mod.BLOCK, mod.PAGE)
    assert block == mod.markdown_from_data(mod.DATA), "run scripts/attribution_error_budget.py --write"
    results = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    prose = results.split("## Attribution's error against exact patching", 1)[1].split("\n## ", 1)[0]
    intervals = re.findall(r"-?\d+\.\d+ \[-?\d+\.\d+, -?\d+\.\d+\]", prose)
    assert intervals and not [x for x in intervals if x not in block]
    p_values = re.findall(r"p = (\d[\d.e-]*\d|\d)", prose)
    cells = set(re.findall(r"\| (\d[\d.e-]*\d|\d)(?= \|)", block))
    assert p_values and not [p for p in p_values if p not in cells]
