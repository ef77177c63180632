"""The dashboard's story and weight: section order, the opening sentences (recomputed by hand from the
tables they read), folded tables, the compacted figure JSON, the report read back from its folder, the
figures' defect fixes that can be checked without a browser, and docs/dashboard.png's recorded figure count."""

from __future__ import annotations

import base64
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

from interp_norm.errors import OutputDirError
from interp_norm.report import plots
from interp_norm.report.dashboard import Panel, Section, render_html, report_from_folder
from interp_norm.report.dashboard.page import FOLD_ROWS, compact_spec
from interp_norm.report.dashboard.sections import PAGE_ORDER
from interp_norm.report.dashboard.story import lead

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- order and opening sentences


def test_the_page_opens_with_the_verdicts_and_follows_the_papers_chain():
    chain = ["verdicts", "models", "circuits", "noise", "collapse", "geometry", "seeds", "controls"]
    ranks = [PAGE_ORDER.index(a) for a in chain]
    assert PAGE_ORDER[0] == "verdicts" and ranks == sorted(ranks)
    assert PAGE_ORDER.index("attention") < PAGE_ORDER.index("noise")  # the circuits part holds attention
    assert PAGE_ORDER.index("addition-circuit") < PAGE_ORDER.index("noise")
    # every anchor a panel builder or the seed sections use has its place (a new one would drift to the end)
    import inspect
    import re

    from interp_norm.report.dashboard import addition_circuit, panels, sections

    used = set(panels.SECTIONS) | {m for mod in (panels, sections, addition_circuit)
                                   for m in re.findall(r'anchor="([a-z0-9-]+)"', inspect.getsource(mod))}
    assert used - {"real-models"} <= set(PAGE_ORDER), used - set(PAGE_ORDER)


def _noise_table() -> pd.DataFrame:
    rows = []
    for variant, clean, noisy in (("Pre-Norm", 0.90, 0.50), ("Pre-Norm (pre-s1)", 0.80, 0.60), ("QKV-Norm", 0.95, 0.95),
                                  ("QKV-Norm, noise after norm", 0.95, 0.45)):
        rows += [dict(variant=variant, noised="all", level=0.0, accuracy=clean),
                 dict(variant=variant, noised="all", level=0.3, accuracy=noisy),
                 dict(variant=variant, noised="sparse", level=0.3, accuracy=0.0)]  # another panel: not read
    return pd.DataFrame(rows)


def test_the_noise_sentence_states_each_variants_drop_at_the_largest_level():
    text = lead("noise", {"noise_accuracy": _noise_table()})
    # by hand: Pre-Norm seeds (0.90 - 0.50 + 0.80 - 0.60) / 2 = 0.30; QKV-Norm 0; after its norm 0.50
    assert "noised at 30%" in text
    assert "QKV-Norm 0.0 points, Pre-Norm 30.0 points and QKV-Norm, noise after norm 50.0 points" in text


def test_the_collapse_sentence_names_the_lowest_and_highest_level_and_the_series_never_reaching_it():
    th = pd.DataFrame(dict(variant=["Pre-Norm", "Pre-Norm (pre-s1)", "QKV-Norm", "QKV-Norm, noise after norm"],
                           layer=["all", "all", "all", "all"], definition="loose",
                           level_measured=[0.244, 0.132, np.nan, 0.385]))
    th = pd.concat([th, th.assign(layer=0, level_measured=0.01)])  # per-layer rows are not the pooled level
    text = lead("collapse", {"collapse_thresholds": th})
    assert "from a noise level of 13.2% (Pre-Norm (pre-s1)) up to 38.5% (QKV-Norm, noise after norm)" in text
    assert "1 of 4 series never reach it" in text


def test_the_other_sentences_quote_their_tables():
    card = pd.DataFrame(dict(checkpoint=["pre", "qkv"], attn_norm=["pre", "qkv"], id_acc=[0.9, 0.95],
                             extrap_acc=[0.7, 0.8]))
    assert "from 70% (Pre-Norm) to 80% (QKV-Norm), against 90%–95% in distribution" in lead("models", {"model_card": card})
    sc = pd.DataFrame(dict(variant=["Pre-Norm", "Pre-Norm", "QKV-Norm"], layer=[0, 1, 0], score=[0.2, 0.4, 0.9]))
    assert "is Pre-Norm 0.30 and QKV-Norm 0.90" in lead("geometry", {"geometry_sphere_scores": sc})
    tp = pd.DataFrame(dict(variant="Pre-Norm", layer="all", c=[1.0, 4.0], frac_sparse=[0.1, 0.4]))
    assert "from 1 to 4 moves the share of sparse rows Pre-Norm 10% → 40%" in lead("controls", {"temperature": tp})
    assert lead("noise", {}) == lead("unknown anchor", {}) == ""


def test_the_attention_seed_and_effective_head_sentences_count_by_hand():
    # three query rows: (L0H1, q1) puts 0.97 on one key, (L0H1, q0) 1.0, (L1H0, q1) at most 0.6 -> 2 of 3 sparse
    pat = pd.DataFrame(dict(model="m", problem=0, layer=[0, 0, 0, 1, 1], head=[1, 1, 1, 0, 0], query=[0, 1, 1, 1, 1],
                            weight=[1.0, 0.97, 0.03, 0.6, 0.4]))
    assert "66.7% of the 3 query rows shown" in lead("attention", {"attention_patterns": pat})
    assert "most often in m, layer 0 head 1" in lead("attention", {"attention_patterns": pat})
    comp = pd.DataFrame(dict(diff_lo=[0.5, -1.0, -3.0, np.nan], diff_hi=[2.0, 1.0, -0.1, np.nan]))
    assert "in 2 of the 3 differences with an interval" in lead("seed-comparisons", {"seed_comparisons": comp})
    assert "no difference here has a 95% interval" in lead("seed-comparisons", {"seed_comparisons": comp.iloc[3:]})
    th = pd.DataFrame(dict(layer=["all", "all", "all", 0], definition="loose", effective_heads=[1.04, 2.96, 7.0, 9.0],
                           level_measured=[0.2, 0.3, np.nan, 0.1]))  # a level never reached rests on nothing
    assert "rest on 1.0 to 3.0 heads'" in lead("controls-23", {"collapse_thresholds": th})
    assert lead("controls-23", {"collapse_thresholds": th.assign(level_measured=np.nan)}) == ""


# ----------------------------------------------------------------------------- the page


def test_long_tables_fold_and_short_ones_stay_open():
    def page(n, **kw):
        return render_html([Section("s", panels=[Panel("t", table=pd.DataFrame({"a": range(n)}), kind="table", **kw)])])

    assert "<details" not in page(FOLD_ROWS) and f"data: {FOLD_ROWS + 1} rows × 1 columns" in page(FOLD_ROWS + 1)
    assert "<details" not in page(90, fold=False) and "<details" in page(3, fold=True)


def test_compact_spec_keeps_every_number_a_figure_shows():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(5, 7)) * 1e3
    z[1, 2] = np.nan
    fig = go.Figure([go.Heatmap(z=z), go.Scatter(x=np.arange(40.0), y=rng.random(40), text=["a"] * 40),
                     go.Scatter(x=[0.123456789, 2.0], y=[1 / 3, 7])])
    spec, template = compact_spec(fig)
    assert template is not None and "template" not in spec["layout"]  # the page holds it once

    def decode(a):
        return np.frombuffer(base64.b64decode(a["bdata"]), dtype=np.dtype(a["dtype"]))

    hz = spec["data"][0]["z"]
    assert hz["dtype"] == "f4"
    got = decode(hz).reshape(5, 7)
    # float32 keeps 24 bits: relative error at most 2^-24 per value; NaN stays NaN
    assert np.array_equal(np.isnan(got), np.isnan(z))
    ok = ~np.isnan(z)
    assert np.all(np.abs(got[ok] - z[ok]) <= 2.0 ** -24 * np.abs(z[ok]))
    x = spec["data"][1]["x"]
    assert x["dtype"] in ("i1", "u1") and list(decode(x)) == list(range(40))  # whole numbers: the narrowest int
    assert spec["data"][2]["x"] == [0.123457, 2] and spec["data"][2]["y"] == [0.333333, 7]  # 6 significant digits


def test_a_page_holds_each_template_once():
    figs = [go.Figure(go.Scatter(y=[i, i + 1])) for i in range(3)]
    html = render_html([Section("s", panels=[Panel(f"p{i}", figure=f) for i, f in enumerate(figs)])])
    assert html.count('data-template="template-1"') == 3 and html.count('id="template-1"') == 1
    assert 'id="template-2"' not in html


# ----------------------------------------------------------------------------- the report read back


def test_a_report_folder_reads_back_as_its_report(tmp_path):
    from interp_norm.report.reproduce import Report, write_report

    tables = {"collapse_thresholds": pd.DataFrame(dict(variant=["Pre-Norm", "QKV-Norm"], layer=["all", "0"],
                                                       level_measured=[0.2, np.nan])),
              "model_card": pd.DataFrame(dict(checkpoint=["pre"], id_acc=[0.9]))}
    ck = pd.DataFrame(dict(checkpoint=["pre"], label=["Pre-Norm"], attn_norm=["pre"]))
    report = Report(tables=tables, checkpoints=ck, timings={"evaluate": 1.5}, notes=["a note"])
    with pytest.MonkeyPatch.context() as mp:  # run facts read torch's thread count; not what is tested here
        mp.setattr("interp_norm.report.reproduce.run_facts", lambda r: {"notes": list(r.notes)})
        write_report(report, tmp_path / "r", dashboard=False)
    back = report_from_folder(tmp_path / "r")
    assert set(back.tables) == set(tables) and back.notes == ["a note"]
    pd.testing.assert_frame_equal(back.tables["collapse_thresholds"].astype({"layer": str}), tables["collapse_thresholds"])
    pd.testing.assert_frame_equal(back.checkpoints, ck)
    assert back.timings["evaluate"] == 1.5
    with pytest.raises(OutputDirError, match="no run.json"):
        report_from_folder(tmp_path)


# ----------------------------------------------------------------------------- figure fixes checked without a browser


def test_circuit_edges_end_on_a_drawn_port():
    table = pd.DataFrame(dict(sender=["a0.h1", "a0.h1", "embed"], receiver=["a1.h0.q", "a1.h0.v", "a0.h1.k"],
                              score=[1.0, 2.0, 3.0], checkpoint="pre"))
    fig = plots.plot_circuit_graph(table, n_layers=2, n_heads=2)
    ports = [t for t in fig.data if t.name == "ports"][0]
    drawn = {(round(x, 9), round(y, 9)) for x, y in zip(ports.x, ports.y)}
    ends = [(round(t.x[1], 9), round(t.y[1], 9)) for t in fig.data if t.text and "->" in str(t.text)]
    assert len(ends) == 3 and set(ends) == drawn and sorted(ports.text) == ["k", "q", "v"]


def test_patching_colours_span_the_data_with_white_at_zero():
    from interp_norm.report.plots.circuits import _colour_range, _diverging

    assert _colour_range(np.array([0.1, 0.7, np.nan]), unit=True) == (0.0, 1.0)  # 0…1, never −1…1
    assert _colour_range(np.array([-0.2, 1.3]), unit=True) == (-0.2, 1.3)
    scale = _diverging(-0.2, 1.3)
    white = [c for p, c in scale if math.isclose(p, 0.2 / 1.5)]
    assert white == ["rgb(247,247,247)"] and scale[-1] == [1, "rgb(33,102,172)"]  # deepest blue at the top


def test_subspace_heatmaps_leave_no_block_blank():
    from interp_norm.report.plots.geometry import _rect

    comps, reads = ["tok", "pos", "L0H0"], ["L0H0.q", "L0H0.k"]
    rows = [dict(a=a, b=b, min_angle=10.0 * (i + j)) for i, a in enumerate(comps) for j, b in enumerate(comps) if i < j]
    rows += [dict(a=a, b=r, min_angle=5.0) for a in comps for r in reads]  # reads meet the components only
    mat = _rect(pd.DataFrame(rows), "min_angle")
    assert list(mat.index) == comps and list(mat.columns) == comps + reads
    off_diagonal = mat.to_numpy()[~np.eye(3, 5, dtype=bool)]
    assert not np.isnan(off_diagonal).any()


# ----------------------------------------------------------------------------- docs/dashboard.png


def test_docs_picture_records_a_page_whose_figures_are_its_sections():
    sys.path.insert(0, str(ROOT / "scripts"))
    from dashboard_screenshot import read_png_text

    facts = read_png_text((ROOT / "docs" / "dashboard.png").read_bytes())
    sections = json.loads(facts["interp_norm:sections"])
    anchors = [a for a, _ in sections]
    assert int(facts["interp_norm:figures"]) == sum(n for _, n in sections) >= 20
    assert int(facts["interp_norm:page_bytes"]) <= 4_000_000
    # drawn by the current section order: the known anchors in PAGE_ORDER's order, the paper's chain present
    known = [PAGE_ORDER.index(a) for a in anchors if a in PAGE_ORDER]
    assert known == sorted(known) and anchors[0] in ("verdicts", "models")
    assert {"models", "circuits", "noise", "collapse", "geometry"} <= set(anchors)
