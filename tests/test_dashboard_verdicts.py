"""The dashboard's first section, "What is established", and its 6-seed panels for the shipped checkpoints.

A report-like object (tables, checkpoints, timings, notes) naming four shipped seed checkpoints with their
own 2-seed comparison stands in for `make reproduce`; the page must open with the verdicts and draw six
seeds per arm from data/seed_tables/. The verdicts' p-values are checked against a brute-force
enumeration of the splits, the seed counts against the shipped CSV read directly.
"""

from __future__ import annotations

import itertools
import json
import shutil
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from interp_norm.report import dashboard as D
from interp_norm.report.dashboard.sections import figure_sections
from interp_norm.report.dashboard.verdicts import verdict_table
from interp_norm.stats import verdicts as V
from interp_norm.stats.seed_compare import compare_seeds
from interp_norm.stats.shipped import seed_tables_dir
from interp_norm.training.checkpoints import pretrained_dir

pytestmark = pytest.mark.skipif(not (seed_tables_dir() / "seed_values.csv").is_file()
                                or not (pretrained_dir() / "pre-s1").is_dir(),
                                reason="needs the shipped checkpoints and data/seed_tables/")
QUICK = ("pre", "pre-s1", "qkv", "qkv-s1", "pre-cal", "pre-cal-s1", "qkv-cal", "qkv-cal-s1")


def _report(names=QUICK, paths=None, own_seeds=True) -> SimpleNamespace:
    """What a quick run of the shipped set looks like to the dashboard: its checkpoints, its own 2-seed tables."""
    paths = paths or [str(pretrained_dir() / n) for n in names]
    values = pd.read_csv(seed_tables_dir() / "seed_values.csv")
    tables = {}
    if own_seeds:
        tables["seed_comparisons"], tables["seed_comparison_values"] = compare_seeds(values[values["checkpoint"].isin(names)])
    return SimpleNamespace(tables=tables, checkpoints=pd.DataFrame(dict(checkpoint=list(names), path=paths)),
                           timings={}, notes=[])


@pytest.fixture(scope="module")
def shipped_page():
    return figure_sections(_report(), strict=True)[0]


def test_the_first_section_is_the_verdicts(shipped_page):
    assert shipped_page[0].anchor == "verdicts" and shipped_page[0].title == "What is established"
    assert "make reproduce-seeds" in shipped_page[0].intro and "24 checkpoints" in shipped_page[0].intro
    html = D.dashboard_html(_report(), csv_links=False)
    assert html.startswith('<section id="verdicts">', html.index("<section", html.index("<main>")))
    first = html[html.index('<section id="verdicts">'):html.index("</section>", html.index('<section id="verdicts">'))]
    assert "<table" in first and "<details" not in first  # the verdicts are what the page opens on, not folded away
    rows = pd.concat([p.table for p in shipped_page[0].panels])
    assert len(rows) == 2 * len(V.CLAIMS)  # every claim at both score scalings
    assert {"claim", "verdict", "here (t 95% interval)", "rule", "raw p for / against", "Holm p for / against",
            "arms (seeds)", "measure"} <= set(rows.columns)


def _seed_points(fig) -> dict[str, tuple[int, int]]:
    """Per subplot: how many seed markers sit on arm A's side (x < 0.5) and on arm B's."""
    out: dict[str, list[int]] = {}
    for t in fig.data:
        if str(t.name).startswith("seed "):
            side = out.setdefault(t.xaxis or "x", [0, 0])
            side[int(t.x[0] > 0.5)] += 1
    return {k: (a, b) for k, (a, b) in out.items()}


def test_the_seed_figures_draw_six_seeds_per_arm_from_the_shipped_tables(shipped_page):
    section = next(s for s in shipped_page if s.anchor == "seed-comparisons")
    assert "make reproduce-seeds" in section.intro and "24 checkpoints" in section.intro
    csv = pd.read_csv(seed_tables_dir() / "seed_values.csv")
    for scaling, cal in (("1/√d_head", "none"), ("Checkpoint calibration", "paper")):
        fig = next(p.figure for p in section.panels if p.title == f"Over seeds: {scaling}")
        points = _seed_points(fig)
        n_seeds = {norm: csv[(csv["attn_norm"] == norm) & (csv["calibration"] == cal)]["seed"].nunique()
                   for norm in ("pre", "qkv")}
        assert n_seeds == {"pre": 6, "qkv": 6}
        assert len(points) >= 20 and all(a == b == 6 for a, b in points.values()), points


def _brute_one_sided(a: np.ndarray, b: np.ndarray) -> float:
    """P(mean_A − mean_B >= observed) over every split of the pooled seeds."""
    pooled, observed = np.concatenate([a, b]), a.mean() - b.mean()
    splits = list(itertools.combinations(range(len(pooled)), len(a)))
    hits = sum(pooled[list(s)].mean() - np.delete(pooled, list(s)).mean() >= observed - 1e-9 for s in splits)
    return hits / len(splits)


def test_the_verdict_table_p_values_are_the_brute_force_split_counts(shipped_page):
    csv = pd.read_csv(seed_tables_dir() / "seed_values.csv")
    d = csv[(csv["quantity"] == "extrapolation accuracy") & (csv["calibration"] == "none")]
    a, b = (d[d["attn_norm"] == n].sort_values("seed")["value"].to_numpy() for n in ("pre", "qkv"))
    row = shipped_page[0].panels[0].table.set_index("claim").loc["QKV-Norm extrapolates worse"]
    p_for, p_against = (float(x) for x in row["raw p for / against"].split(" / "))
    # the paper says Pre-Norm > QKV-Norm: for = greater, against = less (the same count on B − A)
    assert p_for == pytest.approx(float(f"{_brute_one_sided(a, b):.2g}"))
    assert p_against == pytest.approx(float(f"{_brute_one_sided(b, a):.2g}"))
    holm_for, holm_against = (float(x) for x in row["Holm p for / against"].split(" / "))
    assert holm_for >= p_for and holm_against >= p_against


def test_identities_are_labelled_and_carry_no_holm_p():
    values = pd.read_csv(seed_tables_dir() / "seed_values.csv")
    claims = tuple(V.Claim(c.text, c.paper, c.quantity, c.rule, c.sign, c.value,
                           identity={"Checkpoint calibration": "QKV-cal: 0 by construction"})
                   if c.text.startswith("attention peaks") else c for c in V.CLAIMS)
    table = verdict_table(V.verdicts(values, claims)).set_index(["claim", "scaling"])
    ident = table.loc[(claims[-2].text, "Checkpoint calibration")]
    assert ident["verdict"] == "identity: QKV-cal: 0 by construction"
    assert ident["Holm p for / against"] == "outside the family"
    assert table.loc[(claims[-2].text, "1/√d_head")]["verdict"] != ident["verdict"]


def test_other_checkpoints_get_a_note_and_their_own_seed_tables(tmp_path):
    fake = tmp_path / "pre"
    fake.mkdir()
    config = json.loads((pretrained_dir() / "pre" / "config.json").read_text())
    config["files"]["model.safetensors"]["sha256"] = "0" * 64  # other weights under a shipped name
    (fake / "config.json").write_text(json.dumps(config))
    other = _report(names=("pre",), paths=[str(fake)], own_seeds=False)
    sections = figure_sections(other, strict=True)[0]
    assert "verdicts" not in [s.anchor for s in sections]
    assert "No verdict table" in D.dashboard_html(other, csv_links=False)
    # a copy with the shipped weights is the shipped checkpoint
    copy = tmp_path / "copy"
    shutil.copytree(pretrained_dir() / "pre", copy)
    same = _report(names=("pre",), paths=[str(copy)], own_seeds=False)
    assert figure_sections(same, strict=True)[0][0].anchor == "verdicts"


def test_a_report_seed_table_with_other_checkpoints_keeps_its_own():
    report = _report()
    own = report.tables["seed_comparison_values"]
    report.tables["seed_comparison_values"] = own.assign(checkpoint=own["checkpoint"].where(own["seed"] == 0, "mine"))
    section = next(s for s in figure_sections(report, strict=True)[0] if s.anchor == "seed-comparisons")
    assert "make reproduce-seeds" not in section.intro
    fig = section.panels[0].figure
    assert all(a == b == 2 for a, b in _seed_points(fig).values())


def test_the_seed_sections_opening_sentence_reads_the_six_seed_tables_it_draws(shipped_page):
    """The opening sentence counts the differences of the tables drawn (the shipped 6-seed ones), not the
    report's own 2-seed comparisons."""
    from interp_norm.stats.shipped import shipped_seed_tables

    comp = shipped_seed_tables()["seed_comparisons"]
    c = comp[comp["diff_lo"].notna()]
    apart = int(((c["diff_lo"] > 0) | (c["diff_hi"] < 0)).sum())
    section = next(s for s in shipped_page if s.anchor == "seed-comparisons")
    assert f"in {apart} of the {len(c)} differences" in section.lead
