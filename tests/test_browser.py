"""The dashboard in a real browser: Debian's headless Chromium over the DevTools protocol, no network.

Three dashboards, built once per session at tiny sizes: ours (Pre-Norm seeds 0 and 1, Pre-Norm
with the paper's calibration, QKV-Norm under a name full of HTML), one with two Hugging Face
models beside ours, and one of Hugging Face models only. Each is opened at 1000, 1280 and 1400 px
and must show: every figure drawn, 0 console errors, 0 network requests, no legend, title,
annotation or axis title outside its figure's box, no two of them overlapping, one colour per
variant across every figure (Hugging Face models in colours no variant uses), and every legend
entry of one colour told apart by its dash, marker or bar pattern. What is checked is what the
browser measured (element boxes, plotly's resolved trace styles, the DevTools events), not
what the page says about itself.

Skipped only when chromium is missing and we are not in CI (``CI=true`` makes a missing
chromium a failure: ``make test`` installs it).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _devtools import Browser, PageLoad, boxes_overlap, inside

from interp_norm import cli
from interp_norm.report import dashboard as D
from interp_norm.report import reproduce as R
from interp_norm.core.model import ModelConfig
from interp_norm.report.plots._style import VARIANT_COLOURS, base_variant
from interp_norm.core.task import AdditionTask
from interp_norm.training.train import train
from interp_norm.training.config import TrainConfig

pytestmark = pytest.mark.browser

EASY = AdditionTask(train_terms=(2,), interp_terms=(2,), extrap_terms=(3,), n_digits=(1,))
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
WIDTHS = (1000, 1280, 1400)
HOSTILE = 'qkv"><img src=x onerror=alert(1)>'
HF_SUFFIX = " (Hugging Face)"


def find_chromium():
    import shutil

    return os.environ.get("CHROMIUM") or next((p for n in ("chromium", "chromium-browser", "google-chrome")
                                               if (p := shutil.which(n))), None)


@pytest.fixture(scope="session")
def chromium():
    path = find_chromium()
    if path is None:
        if IN_CI:
            pytest.fail("chromium is not installed but CI=true: the browser check must run (make browser installs it)")
        pytest.skip("chromium is not installed (Debian: apt-get install chromium; 'make test' does it)")
    return path


@pytest.fixture(scope="session")
def browser(chromium):
    with Browser(chromium) as b:
        yield b


@pytest.fixture(scope="session")
def dashboards(tmp_path_factory):
    """The three dashboards (built once): ours, Hugging Face + ours, Hugging Face only."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from interp_norm.anatomy import tiny_hf_model

    root = tmp_path_factory.mktemp("dashboards")
    cfg = TrainConfig(lr=3e-3, batch_size=16, steps_per_epoch=5, max_steps=10, log_every=5, eval_every=10,
                      eval_size=16, final_eval_size=16, checkpoint_every=10, grad_clip=1.0, seed=5)
    ours = []
    for name, norm, seed, cal in (("pre", "pre", 0, "none"), ("pre-s1", "pre", 1, "none"), ("pre-cal", "pre", 0, "paper"),
                                  (HOSTILE, "qkv", 0, "none")):
        train(ModelConfig.preset("tiny", attn_norm=norm, seed=seed, calibration=cal), EASY, cfg, root / name, progress=False)
        ours.append(str(root / name))
    R.reproduce(root / "ours", ours, quick=True, progress=False, analyse="all")
    hf = []
    for arch in ("gpt2", "qwen3"):
        tiny_hf_model(arch, seed=6).save_pretrained(root / f"tiny-{arch}")
        hf.append(str(root / f"tiny-{arch}"))
    small = ["--quick", "--no-progress", "--windows", "2", "--n-ctx", "9"]
    assert cli.main(["dashboard", *hf, ours[0], ours[1], "--out", str(root / "mixed"), "--only", "evaluate", "geometry",
                     *small]) == 0
    assert cli.main(["dashboard", *hf, "--out", str(root / "hf"), *small]) == 0
    return {"ours": root / "ours" / "dashboard.html", "mixed": root / "mixed" / "dashboard.html",
            "hf": root / "hf" / "dashboard.html"}


@pytest.fixture(scope="session")
def loads(browser, dashboards) -> dict:
    """Every dashboard at every width, loaded and measured once."""
    return {(kind, w): browser.load(path, w) for kind, path in dashboards.items() for w in WIDTHS}


# ----------------------------------------------------------------------------- the checks (also run on broken pages)


def layout_problems(page: PageLoad) -> list[str]:
    """Legends, titles, annotations and axis titles outside their figure's box, or overlapping."""
    out = []
    for f in page.figures:
        box = f["svg"] or f["box"]
        texts = f["texts"]
        for t in texts:
            if not inside(t["box"], box):
                out.append(f"{f['panel']}: {t['kind']} {t['text'][:40]!r} outside the figure at {page.width} px")
        for i, a in enumerate(texts):
            for b in texts[i + 1:]:
                if boxes_overlap(a["box"], b["box"]):
                    out.append(f"{f['panel']}: {a['kind']} {a['text'][:30]!r} overlaps {b['kind']} {b['text'][:30]!r} "
                               f"at {page.width} px")
    return out


def _colour(t: dict) -> str:
    c = t["line_color"] if t["type"] == "scatter" and "lines" in t["mode"] else t["marker_color"]
    return (c or "").lower()


def colour_problems(page: PageLoad) -> tuple[list[str], dict]:
    """Traces of a variant in another colour than the variant's; Hugging Face models in a variant's
    colour or sharing one. Returns (problems, {variant: {figure ids}})."""
    out, seen = [], {}
    variant_colours = {c.lower() for c in VARIANT_COLOURS.values()}
    for f in page.figures:
        hf: dict = {}
        for t in f["traces"]:
            c = _colour(t)
            if t["type"] not in ("scatter", "bar", "box") or not c or not t["name"]:
                continue
            v = base_variant(t["name"]) or base_variant(t["legendgroup"])
            if v is not None:
                seen.setdefault(v, set()).add(f["id"])
                if c != VARIANT_COLOURS[v].lower():
                    out.append(f"{f['panel']}: {t['name']!r} is {c}, {v} is {VARIANT_COLOURS[v]}")
            elif t["name"].endswith(HF_SUFFIX):
                if c in variant_colours:
                    out.append(f"{f['panel']}: Hugging Face model {t['name']!r} in a variant's colour {c}")
                hf.setdefault(c, set()).add(t["name"])
        out += [f"{f['panel']}: {sorted(n)} share {c}" for c, n in hf.items() if len(n) > 1]
    return out, seen


def _signature(t: dict) -> tuple:
    return (t["dash"] if "lines" in t["mode"] else None, t["symbol"] if "markers" in t["mode"] else None,
            (t["pattern"], t["fillmode"]) if t["type"] == "bar" else None)


def style_problems(page: PageLoad) -> tuple[list[str], int]:
    """Legend entries of one colour (seeds, recipes, placements of a variant) that share dash,
    marker and pattern. Returns (problems, number of figures with several entries of one colour)."""
    out, crowded = [], 0
    for f in page.figures:
        groups: dict = {}
        for t in f["traces"]:
            if t["showlegend"] and t["name"] and _colour(t):
                groups.setdefault(_colour(t), {}).setdefault(t["name"], _signature(t))
        if any(len(g) > 1 for g in groups.values()):
            crowded += 1
        for c, g in groups.items():
            by_sig: dict = {}
            for name, sig in g.items():
                by_sig.setdefault(sig, []).append(name)
            out += [f"{f['panel']}: {names} look alike ({c}, {sig})" for sig, names in by_sig.items() if len(names) > 1]
    return out, crowded


# ----------------------------------------------------------------------------- the dashboards


def test_every_figure_renders_with_no_console_error_and_no_request(loads):
    for (kind, w), page in loads.items():
        st = page.measure["status"]
        assert page.complete and st.get("expected") == st.get("rendered") == str(len(page.figures)), (kind, w, st)
        assert len(page.figures) >= {"ours": 20, "mixed": 8, "hf": 2}[kind], (kind, len(page.figures))
        assert page.console_errors == [], (kind, w, page.console_errors)
        assert page.requests == [], (kind, w, page.requests)
        assert page.measure["scroll_width"] <= w, (kind, w, "the page scrolls sideways")
        assert not page.measure["title"].startswith(D.ERROR_MARKER)


def test_no_legend_or_title_outside_its_figure_or_overlapping(loads):
    problems = [p for page in loads.values() for p in layout_problems(page)]
    assert problems == [], "\n".join(problems[:30])
    n_texts = sum(len(f["texts"]) for page in loads.values() for f in page.figures)
    assert n_texts > 300  # titles, legends, subplot titles, axis titles were all measured


def test_one_colour_per_variant_and_real_models_in_their_own(loads):
    for (kind, w), page in loads.items():
        problems, seen = colour_problems(page)
        assert problems == [], (kind, w, problems[:10])
        if kind == "ours":
            assert {"Pre-Norm", "QKV-Norm"} <= set(seen) and len(seen["Pre-Norm"]) >= 12, seen
        hf = {t["name"] for f in page.figures for t in f["traces"] if t["name"].endswith(HF_SUFFIX)}
        if kind != "ours":
            assert len(hf) == 2, (kind, hf)  # both models drawn, so the distinct-colour check had work to do


def test_seeds_and_recipes_are_told_apart_by_dash_or_marker(loads):
    for (kind, w), page in loads.items():
        problems, crowded = style_problems(page)
        assert problems == [], (kind, w, problems[:10])
        if kind == "ours":  # pre, pre-s1 and pre-cal share blue: most figures had to tell them apart
            assert crowded >= 12, crowded


def test_the_page_text_is_escaped_and_names_what_it_shows(loads, dashboards):
    from plotly.offline import get_plotlyjs

    html = dashboards["ours"].read_text(encoding="utf-8").replace(get_plotlyjs(), "")
    assert "<img" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html  # shown as text, never as markup
    mixed, hf = dashboards["mixed"].read_text(encoding="utf-8"), dashboards["hf"].read_text(encoding="utf-8")
    for page in (mixed, hf):
        assert "Hugging Face models: tiny-gpt2, tiny-qwen3" in page and ".csv" not in page.split("<footer>")[1]
        assert "model_card.csv" not in page
    assert 'id="models"' in mixed and 'id="models"' not in hf  # no empty Models section without our models
    assert loads[("hf", 1000)].measure["title"].startswith("tiny-gpt2 vs tiny-qwen3")


# ----------------------------------------------------------------------------- negative controls


def _page(tmp_path: Path, figs: list, name: str, extra_js: str = "") -> Path:
    html = D.render_html([D.Section("s", panels=[D.Panel(f"panel {i}", figure=f) for i, f in enumerate(figs)])])
    if extra_js:
        html = html.replace("</body>", f"<script>{extra_js}</script></body>")
    p = tmp_path / f"{name}.html"
    p.write_text(html, encoding="utf-8")
    return p


def test_the_checks_catch_clipped_legends_overlaps_lookalikes_errors_and_requests(browser, tmp_path):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    # a right-hand legend of long names in a narrow figure is cut at the figure's edge
    wide = go.Figure([go.Scatter(x=[0, 1], y=[i, i], name=f"Pre-Norm (pre-s{i}): a very long legend entry " * 2,
                                 line=dict(color="#1f77b4", dash="dash" if i else "solid")) for i in range(2)])
    wide.update_layout(width=500, height=300, margin=dict(r=10))
    # two subplot titles too long for their panels run into each other
    crowded = make_subplots(rows=1, cols=2, subplot_titles=["a subplot title much too long for its panel " * 2] * 2)
    crowded.add_trace(go.Scatter(y=[1, 2]), row=1, col=1)
    crowded.add_trace(go.Scatter(y=[1, 2]), row=1, col=2)
    # two seeds in one colour and one style; QKV-Norm in the wrong red; a Hugging Face model in blue
    alike = go.Figure([go.Scatter(y=[1, 2], name="Pre-Norm", line=dict(color="#1f77b4")),
                       go.Scatter(y=[2, 3], name="Pre-Norm (pre-s1)", line=dict(color="#1f77b4")),
                       go.Scatter(y=[3, 4], name="QKV-Norm", line=dict(color="#ff0000")),
                       go.Scatter(y=[4, 5], name="gpt2" + HF_SUFFIX, line=dict(color="#1f77b4", dash="dot"))])
    js = "console.error('boom'); fetch('http://example.invalid/x.js').catch(function () {});"
    page = browser.load(_page(tmp_path, [wide, crowded, alike], "broken", js), 1000)
    layout = layout_problems(page)
    assert any("panel 0: legend" in p and "outside" in p for p in layout), layout
    assert any("panel 1: annotation" in p and "overlaps annotation" in p for p in layout), layout
    styles, _ = style_problems(page)
    assert any("'Pre-Norm', 'Pre-Norm (pre-s1)'" in p for p in styles), styles
    colours, _ = colour_problems(page)
    assert any("'QKV-Norm' is #ff0000" in p for p in colours) and any("gpt2" in p for p in colours), colours
    assert any("boom" in e for e in page.console_errors), page.console_errors
    assert any("example.invalid" in r for r in page.requests), page.requests
    # an uncaught exception and a figure whose JSON is damaged are seen too
    p = _page(tmp_path, [alike], "throws", "undefinedFunction();")
    p.write_text(p.read_text().replace('id="fig-1-json">{', 'id="fig-1-json">{{'), encoding="utf-8")
    page = browser.load(p, 1000)
    assert any("undefinedFunction" in e for e in page.console_errors), page.console_errors
    assert page.measure["status"].get("rendered") == "0"


def test_dashboard_screenshots_are_not_blank(browser, dashboards, tmp_path):
    """A screenshot at each width has many colours and plenty of ink (set INTERP_NORM_SCREENSHOTS=folder to keep them)."""
    import struct
    import zlib

    keep = os.environ.get("INTERP_NORM_SCREENSHOTS")
    for w in WIDTHS:
        browser.load(dashboards["ours"], w)
        shot = browser.screenshot((Path(keep) if keep else tmp_path) / f"dashboard-{w}.png", 0, 1600)
        data = shot.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = struct.unpack(">II", data[16:24])
        assert (width, height) == (w, 1600)
        pos, idat = 8, b""
        while pos < len(data):
            n, typ = struct.unpack(">I4s", data[pos:pos + 8])
            idat += data[pos + 8:pos + 8 + n] if typ == b"IDAT" else b""
            pos += 12 + n
        raw = zlib.decompress(idat)
        assert len(set(raw[i:i + 3] for i in range(0, len(raw), 997))) > 50  # not one flat colour
