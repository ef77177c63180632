"""The shipped set's addition circuit on the default dashboard: the kept tables reach a run on the shipped
set (and no other), and the section's numbers are the tables' own, recounted from the CSV rows."""

from __future__ import annotations

import csv
import re
import shutil
from collections import defaultdict
from types import SimpleNamespace

import pandas as pd
import pytest

from interp_norm.report import reproduce as R
from interp_norm.report.dashboard import dashboard_html
from interp_norm.report.dashboard.shipped_circuit import plot_noise_cost, plot_role_map, verification_view
from interp_norm.report.shipped_circuit import SOURCE, TABLES, shipped_circuit_tables
from interp_norm.stats.shipped import seed_tables_dir

CHECKPOINTS = {f"{a}{s}" for a in ("pre", "qkv", "pre-cal", "qkv-cal") for s in ("", *(f"-s{i}" for i in range(1, 6)))}

pytestmark = pytest.mark.skipif(not all((seed_tables_dir() / f).is_file() for f in TABLES.values()),
                                reason="no kept circuit tables in data/seed_tables")


def rows(key: str) -> list[dict]:
    with open(seed_tables_dir() / TABLES[key], newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_the_kept_tables_cover_the_24_checkpoints():
    T = shipped_circuit_tables()
    assert set(T) == set(TABLES)
    for key in ("shipped_circuit_verification", "shipped_circuit_cells", "shipped_circuit_curve",
                "shipped_circuit_noise_cost"):
        assert set(T[key]["checkpoint"]) == CHECKPOINTS, key


def test_a_missing_table_gives_none(tmp_path):
    for f in list(TABLES.values())[1:]:
        shutil.copy(seed_tables_dir() / f, tmp_path / f)
    assert shipped_circuit_tables(tmp_path) == {}


def test_only_a_run_on_the_shipped_set_carries_them(monkeypatch):
    monkeypatch.setattr(R, "_load_models", lambda *a, **k: {})
    quick = R.Settings.quick(analyses=("evaluate",))
    assert set(TABLES) <= set(R.run_analyses(None, settings=quick, progress=False).tables)
    assert not set(TABLES) & set(R.run_analyses({}, settings=quick, progress=False).tables)


def test_role_map_counts_cells_per_seed():
    """Each heatmap value = circuit cells at (layer, position) over the arm's checkpoints / its seeds."""
    fig = plot_role_map(shipped_circuit_tables()["shipped_circuit_cells"])
    count, seeds = defaultdict(int), defaultdict(set)
    for r in rows("shipped_circuit_cells"):
        arm = r["checkpoint"].split("-s")[0]
        count[(arm, int(r["layer"]), r["position"])] += 1
        seeds[arm].add(r["checkpoint"])
    arms = ("pre", "qkv", "pre-cal", "qkv-cal")
    assert len(fig.data) == len(arms)
    for arm, trace in zip(arms, fig.data):
        for i, layer in enumerate(trace.y):
            for j, pos in enumerate(trace.x):
                want = count[(arm, int(layer.split()[1]), pos)] / len(seeds[arm])
                assert trace.z[i][j] == pytest.approx(want, abs=1e-12), (arm, layer, pos)


def test_verification_view_means_over_seeds():
    view = verification_view(shipped_circuit_tables()["shipped_circuit_verification"])
    shares = defaultdict(list)
    for r in rows("shipped_circuit_verification"):
        if r["ablation"] == "resample":
            shares[r["checkpoint"].split("-s")[0]].append(float(r["share_of_cells"]))
    got = view[view["ablation"] == "resample"]
    assert list(got["seeds"]) == [6] * 4
    for label, cell in zip(got["variant"], got["cells at 90% (share, %)"]):
        arm = {"Pre-Norm": "pre", "QKV-Norm": "qkv"}.get(label) or re.search(r"\((.*)\)", label).group(1)
        assert float(cell) == pytest.approx(100 * sum(shares[arm]) / 6, abs=0.05)


def test_noise_cost_bars_are_means_over_seeds_of_means_over_draws():
    fig = plot_noise_cost(shipped_circuit_tables()["shipped_circuit_noise_cost"])
    draws = defaultdict(list)
    for r in rows("shipped_circuit_noise_cost"):
        draws[(float(r["level"]), r["checkpoint"].split("-s")[0], r["rows"], r["checkpoint"])].append(float(r["drop"]))
    bar = next(t for t in fig.data if t.type == "bar" and t.name == "Pre-Norm")  # first level, Pre-Norm
    level = min(k[0] for k in draws)
    for rows_name, y in zip(bar.x[1], bar.y):
        per_seed = [sum(v) / len(v) for k, v in draws.items() if k[:3] == (level, "pre", rows_name)]
        assert len(per_seed) == 6 and y == pytest.approx(sum(per_seed) / 6, abs=1e-9)


def test_the_section_is_on_the_page_with_its_source():
    report = SimpleNamespace(tables=shipped_circuit_tables(), checkpoints=pd.DataFrame(), timings={}, notes=[])
    page = dashboard_html(report, strict=True)
    assert re.findall(r'<section id="([^"]+)"', page) == ["addition-circuit"]
    for title in ("circuit size and verification", "circuit cells by layer and answer position", "size vs accuracy",
                  "noise on the circuit vs a matched control", "circuit minus matched control, over seeds",
                  "Pre-Norm vs QKV-Norm circuits"):
        assert f"Shipped models: {title}" in page
    assert SOURCE.split(":")[0] in page and "data/seed_tables/circuit_*.csv" in page
