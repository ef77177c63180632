"""reproduce + dashboard: the report folder, the offline HTML, escaping, the CLI, and the figure data.

Tiny models trained for a few steps stand in for the shipped checkpoints (tests never need data/).
Each figure check compares against an independent computation (the model's own cache, a pivot
done by hand), never against the code's output.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from interp_norm import cli
from interp_norm.circuits.attention_maps import attention_patterns
from interp_norm.report import plots
from interp_norm.report import dashboard as D
from interp_norm.report import reproduce as R
from interp_norm.errors import CheckpointNotFoundError, ConfigError, OutputDirError
from interp_norm.core.model import ModelConfig
from interp_norm.core.task import AdditionTask, encode
from interp_norm.training.train import train
from interp_norm.training.config import TrainConfig

EASY = AdditionTask(train_terms=(2,), interp_terms=(2,), extrap_terms=(3,), n_digits=(1,))
HOSTILE = '<img src=x onerror="alert(1)">'


def make_checkpoints(root: Path) -> dict[str, Path]:
    """A Pre-Norm and a QKV-Norm tiny model (the second under a name full of HTML), 12 steps each."""
    cfg = TrainConfig(lr=3e-3, batch_size=16, steps_per_epoch=6, max_steps=12, log_every=4, eval_every=12,
                      eval_size=16, final_eval_size=16, checkpoint_every=12, grad_clip=1.0, seed=3)
    out = {}
    for name, norm in (("pre", "pre"), (HOSTILE, "qkv")):
        path = root / name
        train(ModelConfig.preset("tiny", attn_norm=norm), EASY, cfg, path, progress=False)
        out[name] = path
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return make_checkpoints(tmp_path_factory.mktemp("ckpts"))


@pytest.fixture(scope="module")
def run(ckpts, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    report = R.reproduce(out, [str(p) for p in ckpts.values()], quick=True, progress=False)
    return report, out


# ----------------------------------------------------------------------------- the report folder


def test_report_folder_has_every_table_as_csv_and_one_dashboard(run):
    report, out = run
    expected = {"evaluation", "model_card", "training_curves", "noise_accuracy", "collapse", "collapse_thresholds",
                "geometry_norm_spread", "geometry_sparsity_hist", "geometry_sphere_scores", "geometry_subspace_angles",
                "geometry_ellipsoid_axes", "circuits_patching", "circuits_circuit", "circuits_faithfulness",
                "circuits_edges", "attention_patterns", "collapse_heads"}
    assert expected <= set(report.tables)
    for key, df in report.tables.items():
        back = pd.read_csv(out / f"{key}.csv")
        assert back.shape == df.shape, key
        assert list(back.columns) == [str(c) for c in df.columns], key
    assert (out / "dashboard.html").stat().st_size > 1_000_000  # plotly.js is inside
    timings = pd.read_csv(out / "timings.csv")
    assert {"evaluate", "noise", "collapse", "geometry", "circuits", "total"} <= set(timings["stage"])
    facts = json.loads((out / "run.json").read_text())
    assert facts["seconds"] > 0 and len(facts["checkpoints"]) == 2


def test_both_models_are_analysed_and_labelled(run):
    report, _ = run
    T = report.tables
    labels = set(report.checkpoints["label"])
    assert labels == {"Pre-Norm", f"QKV-Norm ({HOSTILE})"}
    # QKV-Norm also gets the 'noise after the norm' noise and collapse series; Pre-Norm has one placement
    qkv = report.checkpoints[report.checkpoints["attn_norm"] == "qkv"]["label"].iloc[0]
    assert set(T["noise_accuracy"]["variant"]) == {*report.checkpoints["label"], f"{qkv}, noise after norm"}
    assert set(T["collapse"]["variant"]) == {*report.checkpoints["label"], f"{qkv}, noise after norm"}
    assert set(T["collapse"][T["collapse"]["variant"] == qkv]["placement"]) == {"before_norm"}


def test_model_card_matches_configs_and_evaluation(run, ckpts):
    report, _ = run
    card = report.tables["model_card"].set_index("checkpoint")
    ev = report.tables["evaluation"]
    from interp_norm import load_with_info

    for name, path in ckpts.items():
        model, info = load_with_info(path)
        row = card.loc[name]
        assert row["attn_norm"] == info.model_cfg.attn_norm and row["n_layers"] == info.model_cfg.n_layers
        assert row["n_params"] == sum(p.numel() for p in model.parameters())
        assert row["steps"] == 12 and row["examples"] == 12 * 16
        for split in ("id", "interp", "extrap"):
            mine = ev[(ev["checkpoint"] == name) & (ev["split"] == split)]["per_token_acc"].iloc[0]
            assert row[f"{split}_acc"] == pytest.approx(mine)
            paper = plots.PAPER_PER_TOKEN_ACCURACY[info.model_cfg.attn_norm][split]
            assert row[f"paper_{split}_acc"] == paper


def test_attention_table_equals_the_models_own_cache(ckpts):
    from interp_norm import load_with_info

    model, _ = load_with_info(ckpts["pre"])
    problems = ["[3+N4=", "[7-2=5]"]
    df = attention_patterns(model, problems, name="pre")
    for i, text in enumerate(["[3+N4=N1]", "[7-2=5]"]):
        _, cache = model.run_with_cache(encode(text)[None])
        g = df[df["problem"] == i]
        assert g["text"].iloc[0] == text
        for l in range(model.cfg.n_layers):
            pat = cache[f"blocks.{l}.attn.hook_pattern"][0]
            for h in range(model.cfg.n_heads):
                gg = g[(g["layer"] == l) & (g["head"] == h)]
                mat = torch.zeros(len(text), len(text), dtype=torch.float64)
                qi, ki = torch.as_tensor(np.array(gg["query"])), torch.as_tensor(np.array(gg["key"]))
                mat[qi, ki] = torch.as_tensor(np.array(gg["weight"], dtype=np.float64))
                torch.testing.assert_close(mat, pat[h].double(), atol=1e-6, rtol=0)
        assert list(g["q_token"].iloc[:3]) == [text[0], text[1], text[1]]  # tril order: (0,0), (1,0), (1,1)


def test_attention_explorer_shows_one_heatmap_per_choice(ckpts):
    from interp_norm import load_with_info

    model, _ = load_with_info(ckpts["pre"])
    df = attention_patterns(model, ["[3+N4=", "[1+1="], name="pre")
    fig = plots.plot_attention_explorer(df)
    ex = fig.layout.meta["explorer"]
    L, H = model.cfg.n_layers, model.cfg.n_heads
    assert len(fig.data) == 2 * L * H == len(ex["index"])
    assert [t.visible for t in fig.data].count(True) == 1
    text = "[1+1=2]"
    _, cache = model.run_with_cache(encode(text)[None])
    tr = fig.data[ex["index"][f"0,1,{L - 1},{H - 1}"]]
    z = np.array(tr.z, dtype=float)
    want = cache[f"blocks.{L - 1}.attn.hook_pattern"][0, H - 1].double().numpy()
    lower = np.tril(np.ones_like(want, dtype=bool))
    np.testing.assert_allclose(z[lower], want[lower], atol=1e-4)
    assert np.isnan(z[~lower]).all()
    assert list(tr.x) == [f"{c}·{i}" for i, c in enumerate(text)]


def test_bad_problem_string_is_a_typed_error(ckpts):
    from interp_norm import load_with_info
    from interp_norm.errors import ProblemStringError

    model, _ = load_with_info(ckpts["pre"])
    with pytest.raises(ProblemStringError):
        attention_patterns(model, ["<script>"])


# ----------------------------------------------------------------------------- the HTML


def _without_plotlyjs(html: str) -> str:
    """The page without its plotly.js (embedded once, gzipped and base64-encoded: the packed text is the
    gzip of plotly.py's own bundle)."""
    import base64
    import gzip

    from plotly.offline import get_plotlyjs

    from interp_norm.report.dashboard.page import PLOTLY_ID, packed_plotlyjs

    js = packed_plotlyjs()
    assert html.count(js) == 1, "plotly.js must be embedded exactly once"
    assert gzip.decompress(base64.b64decode(js)).decode("utf-8") == get_plotlyjs()
    assert f'<script type="application/octet-stream" id="{PLOTLY_ID}">{js}</script>' in html
    return html.replace(js, "")


def test_dashboard_is_offline_and_embeds_plotly_once(run):
    _, out = run
    html = (out / "dashboard.html").read_text(encoding="utf-8")
    rest = _without_plotlyjs(html)
    assert not re.search(r"<script[^>]*\bsrc\s*=", rest, re.I)
    assert not re.search(r"<link[^>]*\bhref\s*=\s*\"https?:", rest, re.I)
    assert "cdn.plot.ly" not in rest and "https://" not in rest and "http://" not in rest


def test_user_text_is_escaped_everywhere(run):
    _, out = run
    rest = _without_plotlyjs((out / "dashboard.html").read_text(encoding="utf-8"))
    assert "<img" not in rest and 'onerror="' not in rest
    assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in rest  # shown, escaped, in the model card
    # no figure JSON can close its script block
    for block in re.findall(r'<script type="application/json" id="[^"]+">(.*?)</script>', rest, re.S):
        assert "<" not in block and ">" not in block


def test_every_figure_has_its_json_and_the_json_has_data(run):
    _, out = run
    rest = _without_plotlyjs((out / "dashboard.html").read_text(encoding="utf-8"))
    divs = re.findall(r'<div class="figure" id="(fig-\d+)" data-fig="(fig-\d+-json)"', rest)
    blocks = dict(re.findall(r'<script type="application/json" id="(fig-\d+-json)">(.*?)</script>', rest, re.S))
    assert len(divs) >= 15 and len(divs) == len(blocks)
    for fid, jid in divs:
        spec = json.loads(blocks[jid])
        assert spec["data"], fid
    # the dashboard's attention explorer drops the notebook dropdown and gets page selectors
    assert 'data-kind="attention"' in rest and 'class="selectors"' in rest


def test_strict_build_raises_instead_of_skipping(run):
    report, _ = run
    broken = R.Report(tables={"noise_accuracy": pd.DataFrame({"x": [1]})}, checkpoints=report.checkpoints)
    sections, problems = D.figure_sections(broken)
    assert problems and "Accuracy vs noise" in problems[0]
    with pytest.raises(ConfigError):
        D.figure_sections(broken, strict=True)
    sections, problems = D.figure_sections(report, strict=True)  # the real report builds every figure
    assert not problems


# ----------------------------------------------------------------------------- errors and CLI


def test_unwritable_out_fails_before_any_work(tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    for bad in (blocker, blocker / "sub"):
        # the checkpoint does not exist either: the output error must come first
        with pytest.raises(OutputDirError):
            R.reproduce(bad, ["no/such/checkpoint"], quick=True, progress=False)
    with pytest.raises(CheckpointNotFoundError):
        R.reproduce(tmp_path / "ok", ["no/such/checkpoint"], quick=True, progress=False)
    with pytest.raises(OutputDirError):
        R.make_dashboard(["no/such/checkpoint"], tmp_path, quick=True, progress=False)  # a folder, not a file


def test_settings_and_selection_errors_are_typed(ckpts):
    with pytest.raises(ConfigError):
        R.Settings(eval_size=0)
    with pytest.raises(ConfigError):
        R.Settings(analyses=("evaluate", "astrology"))
    with pytest.raises(ConfigError):
        R.run_analyses([str(ckpts["pre"])], R.Settings.quick(analyses=("evaluate",)), analyse=["qkv"], progress=False)


def test_cli_reproduce_and_dashboard(ckpts, tmp_path, capsys):
    pre = str(ckpts["pre"])
    code = cli.main(["reproduce", pre, "--out", str(tmp_path / "rep"), "--quick", "--no-progress",
                     "--only", "evaluate", "attention", "--problems", "[1+2=", "[3-N4="])
    assert code == 0
    printed = capsys.readouterr().out  # the count it prints is the CSVs it wrote
    n = int(re.search(r"wrote (\d+) analysis tables, timings.csv, checkpoints.csv, run.json", printed).group(1))
    assert n + 2 == len(list((tmp_path / "rep").glob("*.csv")))
    att = pd.read_csv(tmp_path / "rep" / "attention_patterns.csv")
    assert set(att["text"]) == {"[1+2=3]", "[3-N4=7]"}
    assert not (tmp_path / "rep" / "noise_accuracy.csv").exists()
    code = cli.main(["dashboard", pre, "--out", str(tmp_path / "d"), "--quick", "--no-progress", "--only", "evaluate"])
    assert code == 0 and (tmp_path / "d" / "dashboard.html").stat().st_size > 1_000_000
    capsys.readouterr()
    (tmp_path / "f").write_text("x")
    assert cli.main(["reproduce", pre, "--out", str(tmp_path / "f"), "--quick", "--no-progress"]) == 2
    assert "error" in capsys.readouterr().err
    assert cli.main(["dashboard", "no/such/ckpt", "--out", str(tmp_path / "e"), "--quick", "--no-progress"]) == 2
    assert cli.main(["reproduce", pre, "--out", str(tmp_path / "g"), "--problems", "[1+x="]) == 2


# ----------------------------------------------------------------------------- figure builders


def test_patching_heatmap_grid_is_the_hand_pivot():
    rows = []
    for l in range(2):
        for p in range(3):
            rows.append(dict(activation="resid_pre", by="pos", layer=l, pos=p, normalized=l * 10 + p))
        for h in range(4):
            rows.append(dict(activation="z", by="all", layer=l, head=h, normalized=-(l * 10 + h) / 40))
    df = pd.DataFrame(rows)
    fig = plots.plot_patching_heatmap(df, pos_labels=list("[1+"))
    resid, z = fig.data
    np.testing.assert_array_equal(np.array(resid.z), [[0, 1, 2], [10, 11, 12]])
    assert list(resid.x) == ["[·0", "1·1", "+·2"] and list(resid.y) == ["L0", "L1"]
    np.testing.assert_allclose(np.array(z.z), [[0, -1 / 40, -2 / 40, -3 / 40], [-10 / 40, -11 / 40, -12 / 40, -13 / 40]])
    assert list(z.x) == ["H0", "H1", "H2", "H3"]
    with pytest.raises(ConfigError):
        plots.plot_patching_heatmap(df.drop(columns="layer"))


def _row_domains(fig):
    """(height px, sorted distinct y domains) of a subplot figure."""
    return fig.layout.height, sorted({tuple(fig.layout[k].domain) for k in fig.layout if k.startswith("yaxis")})


@pytest.mark.parametrize("n", [2, 12])
def test_figures_with_many_rows_keep_their_panels_apart_and_readable(n):
    """Ten checkpoints in one report (or a 28-layer model) once broke plotly's vertical-spacing limit."""
    patch = pd.DataFrame([dict(activation="resid_pre", by="pos", layer=l, pos=p, normalized=0.1 * p,
                               variant=f"Pre-Norm (seed {v})") for v in range(n) for l in range(2) for p in range(3)])
    collapse = pd.DataFrame([dict(variant="Pre-Norm", layer=l, definition=d, level=lv, measured=0.0, predicted=0.0)
                             for l in range(n) for d in ("loose", "strict") for lv in (0.1, 0.2)])
    attention = pd.DataFrame([dict(model="m", problem="[1=", text="[1=", layer=l, head=h, query=q, key=k,
                                   weight=1.0 if k == q else 0.0)
                              for l in range(n) for h in range(2) for q in range(2) for k in range(q + 1)])
    for fig in (plots.plot_patching_heatmap(patch), plots.plot_collapse_vs_noise(collapse, layer=None, target=None),
                plots.plot_attention_patterns(attention)):
        height, doms = _row_domains(fig)
        assert len(doms) == n
        for (_, hi), (lo2, _) in zip(doms, doms[1:]):
            assert lo2 - hi >= 20 / height, "rows touch"  # a gap for the next panel's title
        assert min(hi - lo for lo, hi in doms) * height >= 150, "panels shrank"


def test_fit_layout_puts_every_legend_below_with_its_rows_reserved_and_ignores_named_heatmaps():
    import plotly.graph_objects as go

    from interp_norm.report.plots._style import fit_layout, legend_rows

    # 24 entries "series 00".."series 23" (9 characters): 46 px of swatch + 9 x 7.5 px = 113.5 px each,
    # so 7 fit in the 880 px a 1000 px window leaves (8 would need 908): 4 rows
    names = [f"series {i:02d}" for i in range(24)]
    assert legend_rows(names, 880) == 4
    lines = go.Figure([go.Scatter(x=[0, 1], y=[i, i], name=n) for i, n in enumerate(names)]).update_layout(height=400)
    fit_layout(lines)
    assert lines.layout.legend.orientation == "h" and lines.layout.legend.yanchor == "bottom"
    assert lines.layout.height == 400 + 22 * 4 + 12 and lines.layout.margin.b >= 72 + 22 * 4
    # a long title wraps; a short one does not
    long = fit_layout(go.Figure(go.Scatter(y=[1])).update_layout(title="word " * 60))
    assert long.layout.title.text.count("<br>") >= 2
    assert "<br>" not in fit_layout(go.Figure(go.Scatter(y=[1])).update_layout(title="short")).layout.title.text
    # the attention explorer: one named heatmap per (model, problem, layer, head), none in the legend
    maps = go.Figure([go.Heatmap(z=[[0, 1]], name=f"L{i}H0", visible=i == 0) for i in range(120)]).update_layout(height=620)
    assert fit_layout(maps).layout.height == 620 and maps.layout.legend.orientation is None


def test_seed_and_recipe_styles_tell_the_shipped_checkpoints_apart():
    from interp_norm.report.plots._style import SEED_DASHES, member_key, member_style, variant_colour

    # read from the names, by hand
    assert member_key("Pre-Norm") == (0, "", False)
    assert member_key("Pre-Norm (pre-s1)") == (1, "", False)
    assert member_key("Pre-Norm (pre-cal-s1)") == (1, "cal", False)
    assert member_key("QKV-Norm (qkv-s3), noise after norm") == (3, "", True)
    assert member_key("qkv-30k") == (0, "30k", False)
    names = ["pre", "pre-s1", "pre-cal", "pre-cal-s1"] + [f"pre-s{s}" for s in range(2, 6)] + [f"pre-cal-s{s}" for s in range(2, 6)]
    looks = {(member_style(n)["dash"], member_style(n)["symbol"]) for n in names}
    assert len(looks) == len(names)
    assert [member_style(f"pre-s{s}")["dash"] for s in range(1, 6)] == list(SEED_DASHES[1:6])
    assert member_style("pre")["dash"] == "solid" and member_style("pre-cal")["symbol"] == "circle-open"
    after = member_style("QKV-Norm, noise after norm")
    assert after["symbol"] != member_style("QKV-Norm")["symbol"]
    assert {variant_colour(plots.variant_label(n, "pre")) for n in names} == {"#1f77b4"}
    assert {(member_style(plots.variant_label(n, "pre"))["symbol"]) for n in names} == {s for _, s in looks}


def test_circuit_graph_draws_the_strongest_edges_left_to_right():
    edges = pd.DataFrame(dict(
        source=["embed", "a0.1", "a0.1", "m0", "a1.0", "embed"],
        target=["a0.1", "a1.0", "m0", "logits", "logits", "m0"],
        score=[0.5, -2.0, 0.01, 1.0, 3.0, -0.2],
    ))
    fig = plots.plot_circuit_graph(edges, max_edges=4)
    lines = [t for t in fig.data if t.mode == "lines"]
    nodes = [t for t in fig.data if t.mode == "markers+text"][0]
    assert len(lines) == 4
    drawn = {(t.hovertemplate.split("<br>")[0]) for t in lines}
    assert drawn == {"a1.0 → logits", "a0.1 → a1.0", "m0 → logits", "embed → a0.1"}
    x = dict(zip(nodes.text, nodes.x))
    assert x["embed"] < x["a0.1"] < x["m0"] < x["a1.0"] < x["logits"]
    widths = {t.hovertemplate.split("<br>")[0]: t.line.width for t in lines}
    assert widths["a1.0 → logits"] > widths["a0.1 → a1.0"] > widths["embed → a0.1"]
    assert "214,39,40" in [t for t in lines if t.hovertemplate.startswith("a0.1 → a1.0")][0].line.color  # negative: red


def test_circuit_edge_table_is_drawn_as_that_circuit():
    table = pd.DataFrame(dict(sender=["embed", "a0.h1", "m0"], receiver=["a0.h1.q", "m0", "logits"], score=[0.5, -1.0, 2.0]))
    fig = plots.plot_circuit_graph(table, n_layers=2, n_heads=2)
    lines = [t for t in fig.data if t.mode == "lines+markers" and t.x[0] is not None]
    assert sorted(t.text.split(":")[0] for t in lines) == ["a0.h1 -> m0", "embed -> a0.h1.q", "m0 -> logits"]
    width = {t.text.split(":")[0]: t.line.width for t in lines}
    assert width["m0 -> logits"] > width["a0.h1 -> m0"] > width["embed -> a0.h1.q"]  # |2| > |-1| > |0.5|
    with pytest.raises(ConfigError):
        plots.plot_circuit_graph(table)  # sizes unknown
    from interp_norm.errors import PatchingError

    with pytest.raises(PatchingError):  # an edge the model cannot have (a later layer feeding an earlier one)
        plots.plot_circuit_graph(table.assign(sender=["a1.h0", "a0.h1", "m0"]), n_layers=2, n_heads=2)


def test_model_card_figure_shows_percentages():
    card = pd.DataFrame([dict(checkpoint=HOSTILE, attn_norm="qkv", id_acc=0.5, paper_id_acc=0.9099, steps=12)])
    fig = plots.plot_model_card(card)
    cells = fig.data[0].cells.values
    assert cells[0] == [plots.escape(HOSTILE)] and cells[2] == ["50.0%"] and cells[3] == ["91.0%"]
    bars = plots.plot_accuracy_by_split(card.assign(interp_acc=0.4, extrap_acc=0.3, paper_interp_acc=0.8254,
                                                    paper_extrap_acc=0.4676))
    assert list(bars.data[0].y) == [0.5, 0.4, 0.3]
    assert [t.name for t in bars.data][1] == "paper (Menary et al. 2024): QKV-Norm"


# ----------------------------------------------------------------------------- one look across figures


def _figure_specs(out: Path) -> list[dict]:
    rest = _without_plotlyjs((out / "dashboard.html").read_text(encoding="utf-8"))
    return [json.loads(b) for b in re.findall(r'<script type="application/json" id="fig-\d+-json">(.*?)</script>', rest, re.S)]


def _trace_colour(t: dict):
    if t.get("type", "scatter") == "scatter" and "lines" in t.get("mode", "lines"):
        return (t.get("line") or {}).get("color")
    return (t.get("marker") or {}).get("color")


def test_every_variant_has_one_colour_in_every_figure_and_legends_are_short(run):
    """Without a browser: each trace that names a variant carries that variant's colour (a seed or
    'noise after norm' suffix keeps it), and no legend lists more than 20 entries."""
    from interp_norm.report.plots._style import VARIANT_COLOURS, base_variant

    _, out = run
    seen: dict = {}
    for i, spec in enumerate(_figure_specs(out)):
        shown = [t for t in spec["data"] if t.get("showlegend", True) and t.get("type") in (None, "scatter", "bar", "box", "histogram")]
        assert len(shown) <= 20, f"figure {i}: {len(shown)} legend entries"
        for t in spec["data"]:
            if t.get("type") not in (None, "scatter", "bar", "box", "histogram"):
                continue
            v = base_variant(t.get("name", "")) or base_variant(t.get("legendgroup", ""))
            c = _trace_colour(t)
            if v is not None and isinstance(c, str):
                seen.setdefault(v, set()).add((c.lower(), i))
    # the HOSTILE-named QKV-Norm checkpoint and the 'noise after norm' series count as QKV-Norm
    assert set(seen) == {"Pre-Norm", "QKV-Norm"}
    for v, uses in seen.items():
        assert {c for c, _ in uses} == {VARIANT_COLOURS[v].lower()}, v
        assert len({i for _, i in uses}) >= 6, (v, "should appear in many figures")


def test_base_variant_reads_derived_labels():
    from interp_norm.report.plots._style import base_variant, variant_colour

    assert base_variant("QKV-Norm, noise after norm") == "QKV-Norm"
    assert base_variant("QK-Norm (qk-s3)") == "QK-Norm" and base_variant("qkv") == "QKV-Norm"
    assert base_variant("QKV-Norm (&lt;img&gt;)") == "QKV-Norm" and base_variant("gpt2") is None
    assert variant_colour("gpt2") == variant_colour("gpt2") and variant_colour("gpt2") not in {
        variant_colour(v) for v in ("Pre-Norm", "QKV-Norm", "QK-Norm", "No-Norm")}


def test_models_text_states_what_these_models_show():
    from interp_norm.report.dashboard.sections import models_finding

    card = pd.DataFrame([dict(checkpoint="pre", attn_norm="pre", id_acc=0.99, extrap_acc=0.50),
                         dict(checkpoint="pre-s1", attn_norm="pre", id_acc=0.97, extrap_acc=0.60),
                         dict(checkpoint="qkv", attn_norm="qkv", id_acc=0.98, extrap_acc=0.70)])
    text = models_finding(card)
    # by hand: Pre-Norm's mean extrapolation is 55.0%, QKV-Norm's 70.0%: the opposite of the paper
    assert "QKV-Norm is better than Pre-Norm here (70.0% vs 55.0%)" in text and "opposite" in text
    worse = models_finding(card.assign(extrap_acc=[0.8, 0.8, 0.4]))
    assert "QKV-Norm is worse" in worse and "agree" in worse


def test_unreached_collapse_levels_sit_in_a_labelled_band_not_at_a_level():
    th = pd.DataFrame(dict(variant=["Pre-Norm", "QKV-Norm"], layer=[0, 0], definition="loose", target=0.01,
                           level_measured=[0.3, np.nan], level_predicted=[0.31, np.nan]))
    fig = plots.plot_collapse_thresholds(th, max_level=0.5)
    pre = {t.name: t for t in fig.data if t.name and t.name.startswith("Pre-Norm")}
    assert list(pre["Pre-Norm"].y) == [0.3] and list(pre["Pre-Norm: theory"].y) == [0.31]
    band = [s for s in fig.layout.shapes if s.type == "rect"][0]
    assert band.y0 > 0.5  # the band of unreached levels lies above every tested level
    qkv = [t for t in fig.data if t.name and t.name.startswith("QKV-Norm")]
    assert all(band.y0 < t.y[0] < band.y1 and "not reached" in t.text[0] for t in qkv)
    assert any("not reached" in (a.text or "") for a in fig.layout.annotations)
    # two series side by side in one layer: different x, the same layer tick
    assert pre["Pre-Norm"].x[0] != qkv[0].x[0] and abs(pre["Pre-Norm"].x[0] - qkv[0].x[0]) < 1


def test_attention_map_heatmap_is_the_hand_pivot_of_its_table():
    am = pd.DataFrame(dict(variant="Pre-Norm", split="id", query=["ans.p0", "ans.p0", "ans.p1", "eos"],
                           layer=[1, 1, 0, 1], head=[2, 2, 3, 2], key=["=", "ans.sign", "=", "ans.p1"],
                           frequency=[0.25, 0.5, 0.75, 0.125]))
    fig = plots.plot_attention_map(am)
    hm = fig.data[0]
    assert list(hm.y) == ["L0H3", "L1H2"] and list(hm.x) == ["ans.p0", "ans.p1", "eos"]
    z = np.array(hm.z, dtype=float)
    # by hand: L1H2 from ans.p0 attends to ans.sign in 50% (its most frequent key), from eos to ans.p1 in 12.5%
    # a (head, position) the table does not list had no sparse event: 0%, marked "–" (not a blank cell)
    np.testing.assert_array_equal(z, [[0, 0.75, 0], [0.5, 0, 0.125]])
    assert hm.text[1][0] == "ans.sign" and hm.text[0][1] == "=" and hm.text[0][0] == hm.text[1][1] == "–"


def test_faithfulness_bars_and_agreement_dots_show_the_table_values():
    f = pd.DataFrame(dict(variant=["Pre-Norm", "Pre-Norm", "Pre-Norm (pre-s1)"], ablation=["resample", "mean", "resample"],
                          n_edges=[21, 21, 19], faithfulness=[0.96, 0.77, 0.5]))
    bars = plots.plot_faithfulness_bars(f)
    assert [list(t.y) for t in bars.data] == [[0.96, 0.77], [0.5]]
    assert bars.data[0].marker.pattern.shape != bars.data[1].marker.pattern.shape  # seed 0 vs seed 1
    e = pd.DataFrame(dict(variant=["QKV-Norm"], method=["eap"], pearson=[0.9], spearman=[0.8], topk_overlap=[0.7], k=[10]))
    dots = plots.plot_attribution_agreement(e)
    assert list(dots.data[0].y) == [0.9, 0.8, 0.7]
    heads = pd.DataFrame(dict(variant=["Pre-Norm"] * 2 + ["Pre-Norm (pre-s1)"] * 2 + ["QKV-Norm"] * 2, method="eap",
                              layer=[0, 1] * 3, head=0, exact=[0.5, -0.25, 0.1, 0.2, 1.5, 0.0],
                              attribution=[0.4, -0.3, 0.1, 0.25, 0.9, 0.05]))
    scatter = plots.plot_attribution_scatter(pd.concat([heads, heads.assign(method="eap-ig5")]))
    series = [t for t in scatter.data if t.showlegend is not False and t.mode == "markers"]
    assert [t.name for t in series] == ["Pre-Norm", "Pre-Norm (pre-s1)", "QKV-Norm"]  # one dot per head, per model
    assert list(series[2].x) == [1.5, 0.0] and list(series[2].y) == [0.9, 0.05] and list(series[2].text) == ["L0H0", "L1H0"]
    assert series[0].marker.color == series[1].marker.color != series[2].marker.color  # one colour per variant
    assert series[0].marker.symbol != series[1].marker.symbol  # seeds by marker
    assert len([t for t in scatter.data if t.mode == "lines"]) == 2  # the diagonal in each method's panel
    with pytest.raises(ConfigError):
        plots.plot_attribution_scatter(heads.drop(columns="exact"))
    with pytest.raises(ConfigError):
        plots.plot_faithfulness_bars(f.drop(columns="faithfulness"))


def test_circuit_edges_into_k_and_v_of_one_head_end_apart_in_colours_no_variant_uses():
    from interp_norm.report.plots._style import VARIANT_COLOURS

    table = pd.DataFrame(dict(sender=["a0.h1", "a0.h1", "a0.h1"], receiver=["a1.h0.q", "a1.h0.k", "a1.h0.v"],
                              score=[1.0, 2.0, 3.0], checkpoint="pre-s1"))
    fig = plots.plot_circuit_graph(table, n_layers=2, n_heads=2)
    edges = {t.text.split(":")[0]: t for t in fig.data if t.text and "->" in str(t.text)}
    ends = {r.rsplit(".", 1)[1]: e.x[1] for r, e in ((k.split(" -> ")[1], e) for k, e in edges.items())}
    assert ends["q"] < ends["k"] < ends["v"]  # three ports under head a1.h0 at x = 0
    colours = {e.line.color for e in edges.values()}
    assert len(colours) == 3 and not colours & set(VARIANT_COLOURS.values())
    assert all(list(e.marker.symbol) == ["circle", "arrow"] for e in edges.values())  # arrowheads at the receiver
    assert "pre-s1" in fig.layout.title.text
    labels = {a.text for a in fig.layout.annotations}
    assert {"a0.h1", "a1.h0"} <= labels


def test_dashboard_without_csvs_or_with_only_hugging_face_models():
    from interp_norm.report.dashboard.sections import figure_sections

    card = pd.DataFrame([dict(checkpoint="pre", attn_norm="pre", id_acc=0.9)])
    ours = SimpleNamespace(tables={"model_card": card}, checkpoints=pd.DataFrame(), timings={}, notes=[])

    def caption(csv):
        return " ".join(p.caption for s in figure_sections(ours, csv=csv)[0] for p in s.panels)

    assert "model_card.csv" in caption(True) and "model_card.csv" not in caption(False)
    layers = pd.DataFrame(dict(model=["gpt2", "gpt2"], layer=[0, 1], spread=[0.1, 0.2], frac_sparse=[0.0005, 0.001]))
    hf = SimpleNamespace(tables={"real_layers": layers}, checkpoints=pd.DataFrame(), timings={}, notes=[])
    sections, problems = figure_sections(hf, strict=True)
    assert [s.anchor for s in sections] == ["real-models"] and not problems
    assert D.page_title(hf) == "gpt2: interp_norm dashboard"
    html = D.dashboard_html(hf, csv_links=False)
    assert "Hugging Face models: gpt2" in html and 'id="models"' not in html
    assert "on text windows instead" in html  # tables without an input column were measured on text
    mixed = pd.concat([layers.assign(input="text"), layers.assign(model="tiny", input="random token ids")])
    assert "on text windows (tiny: random token ids" in D.dashboard_html(
        SimpleNamespace(tables={"real_layers": mixed}, checkpoints=pd.DataFrame(), timings={}, notes=[]), csv_links=False)
    fig = sections[0].panels[0].figure
    assert fig.layout.yaxis.tickformat.endswith("%")  # fractions as percentages, not "500µ"


def test_wide_tables_are_split_into_blocks_that_repeat_the_row_names():
    df = pd.DataFrame({"variant": ["a", "b"], "layer": [0, 1], **{f"c{i}": [i, i + 0.5] for i in range(20)}})
    html = D.table_html(df, max_cols=8)
    tables = re.findall(r"<table.*?</table>", html, re.S)
    assert len(tables) == 4  # 20 value columns, 6 per block
    heads = [re.findall(r"<th>(.*?)</th>", t) for t in tables]
    assert all(h[:2] == ["variant", "layer"] for h in heads)
    assert [c for h in heads for c in h[2:]] == [f"c{i}" for i in range(20)]


def test_page_title_fits_what_was_analysed(run):
    report, _ = run
    assert D.page_title(report) == "Pre-Norm vs QKV-Norm: interp_norm dashboard"
    one = SimpleNamespace(checkpoints=report.checkpoints.iloc[:1])
    assert D.page_title(one) == "Pre-Norm: interp_norm dashboard"


def test_models_text_keeps_the_two_score_scalings_apart():
    from interp_norm.report.dashboard.sections import models_finding

    card = pd.DataFrame([dict(checkpoint="pre", attn_norm="pre", calibration="none", id_acc=0.9, extrap_acc=0.70),
                         dict(checkpoint="qkv", attn_norm="qkv", calibration="none", id_acc=0.9, extrap_acc=0.80),
                         dict(checkpoint="pre-cal", attn_norm="pre", calibration="paper", id_acc=0.8, extrap_acc=0.68),
                         dict(checkpoint="qkv-cal", attn_norm="qkv", calibration="paper", id_acc=0.8, extrap_acc=0.66)])
    text = models_finding(card)
    # by hand, never pooled across scalings: 80.0 vs 70.0 without calibration, 66.0 vs 68.0 with it
    assert "QKV-Norm is better than Pre-Norm here (80.0% vs 70.0%)" in text
    assert "Checkpoint calibration, extrapolating, QKV-Norm is worse than Pre-Norm here (66.0% vs 68.0%): agreeing" in text
