"""The dashboard in a real browser: Debian's headless Chromium, no network.

Fails on any JavaScript error, on any figure that drew no SVG, if the attention selectors do not
show the chosen heatmap, or if the screenshot is blank. Skipped only when chromium is missing and
we are not in CI (``CI=true`` makes a missing chromium a failure: ``make test`` installs it).
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import pytest
from _browser import ERROR_MARKER, browser_check, find_chromium

from interp_norm import dashboard as D
from interp_norm import reproduce as R
from interp_norm.model import ModelConfig
from interp_norm.task import AdditionTask
from interp_norm.train import TrainConfig, train

pytestmark = pytest.mark.browser

EASY = AdditionTask(train_terms=(2,), interp_terms=(2,), extrap_terms=(3,), n_digits=(1,))
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="module")
def chromium():
    path = find_chromium()
    if path is None:
        if IN_CI:
            pytest.fail("chromium is not installed but CI=true: the browser check must run (make browser installs it)")
        pytest.skip("chromium is not installed (Debian: apt-get install chromium; 'make test' does it)")
    return path


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser")
    cfg = TrainConfig(lr=3e-3, batch_size=16, steps_per_epoch=5, max_steps=10, log_every=5, eval_every=10,
                      eval_size=16, final_eval_size=16, checkpoint_every=10, grad_clip=1.0, seed=5)
    paths = []
    for name, norm in (("pre", "pre"), ('qkv"><script>alert(1)</script>', "qkv")):
        train(ModelConfig.preset("tiny", attn_norm=norm), EASY, cfg, root / name, progress=False)
        paths.append(str(root / name))
    R.reproduce(root / "report", paths, quick=True, progress=False)
    return root / "report" / "dashboard.html"


def read_png(path: Path) -> tuple[int, int, int, list[bytes]]:
    """Minimal PNG decoder (8-bit, non-interlaced, as Chromium writes): width, height, bytes/pixel, rows."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, b""
    while pos < len(data):
        n, typ = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + n]
        pos += 12 + n
        if typ == b"IHDR":
            w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", chunk)
        elif typ == b"IDAT":
            idat += chunk
    assert depth == 8 and interlace == 0 and ctype in (2, 6)
    bpp = 3 if ctype == 2 else 4
    raw, stride = zlib.decompress(idat), w * bpp
    rows, prev, i = [], bytearray(stride), 0
    for _ in range(h):
        f, line = raw[i], bytearray(raw[i + 1:i + 1 + stride])
        i += 1 + stride
        for x in range(stride):
            a = line[x - bpp] if x >= bpp else 0
            b, c = prev[x], (prev[x - bpp] if x >= bpp else 0)
            if f == 1:
                line[x] = (line[x] + a) & 255
            elif f == 2:
                line[x] = (line[x] + b) & 255
            elif f == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return w, h, bpp, rows


def test_dashboard_renders_every_figure_without_js_errors(chromium, page, tmp_path):
    shot = tmp_path / "shot.png"
    check = browser_check(page, screenshot=shot, window=(1300, 1600), chromium=chromium)
    assert check.errors == 0, check.error_messages
    assert not check.title.startswith(ERROR_MARKER)
    assert check.complete
    n_divs = check.dom.count('data-fig="fig-')
    assert n_divs >= 15
    assert check.expected == check.rendered == len(check.figures) == n_divs
    for fid, attrs in check.figures.items():
        assert int(attrs.get("data-rendered", 0)) > 0, f"{fid} drew no svg"
        assert "data-error" not in attrs, attrs.get("data-error")
    assert check.ok
    # the injected name is text, not markup: no script element it could have created
    assert "<script>alert(1)</script>" not in check.dom
    # the attention selectors show exactly the chosen heatmap
    explorer = [a for a in check.figures.values() if a.get("data-kind") == "attention"]
    assert len(explorer) == 1 and explorer[0].get("data-selftest") == "ok", explorer
    # one colour per variant across every figure (as the browser resolved it), and no legend scrolls
    from interp_norm.plots._style import VARIANT_COLOURS, base_variant

    seen: dict = {}
    for fid, attrs in check.figures.items():
        assert attrs.get("data-legend-overflow") == "0", f"{fid}: its legend overflows into a scroll box"
        for name, group, colour in json.loads(attrs.get("data-traces", "[]")):
            variant = base_variant(name) or base_variant(group)
            if variant is not None:
                seen.setdefault(variant, set()).add((colour.lower(), fid))
    assert {"Pre-Norm", "QKV-Norm"} <= set(seen), seen
    for variant, uses in seen.items():
        colours = {c for c, _ in uses}
        assert colours == {VARIANT_COLOURS[variant].lower()}, (variant, sorted(uses))
    assert len({f for uses in seen.values() for _, f in uses}) >= 8  # checked across many figures
    assert check.wide_tables == 0, "a table is wider than its panel"
    # a non-blank screenshot: many colours and plenty of non-background pixels
    w, h, bpp, rows = read_png(shot)
    assert (w, h) == (1300, 1600)
    colours, inked = set(), 0
    for row in rows[::8]:
        for x in range(0, w * bpp, 8 * bpp):
            px = row[x:x + 3]
            colours.add(px)
            inked += max(px) - min(px) > 30 or max(px) < 200  # coloured or dark
    assert len(colours) > 50 and inked > 0.05 * (h // 8) * (w // 8)


def test_the_check_sees_an_overflowing_legend_and_trace_colours(chromium, tmp_path):
    """Negative control for the legend and colour checks: 40 traces in one legend must scroll."""
    import plotly.graph_objects as go

    fig = go.Figure([go.Scatter(x=[0, 1], y=[i, i], name=f"Pre-Norm series {i}", line=dict(color="#ff0000"))
                     for i in range(40)]).update_layout(height=300)
    p = tmp_path / "crowded.html"
    p.write_text(D.render_html([D.Section("s", panels=[D.Panel("crowded", figure=fig)])]), encoding="utf-8")
    check = browser_check(p, chromium=chromium, budget_ms=5000)
    attrs = check.figures["fig-1"]
    assert int(attrs["data-legend-overflow"]) >= 1
    assert {c for _, _, c in json.loads(attrs["data-traces"])} == {"#ff0000"}


def test_the_check_catches_a_broken_page(chromium, tmp_path):
    """Negative control: a script error and a figure that cannot be drawn are both reported."""
    import plotly.graph_objects as go

    good = D.Panel("ok", figure=go.Figure(go.Scatter(x=[1, 2], y=[3, 4])))
    html = D.render_html([D.Section("s", panels=[good])])
    broken = html.replace("</body>", "<script>undefinedFunction();</script></body>")
    p = tmp_path / "broken.html"
    p.write_text(broken, encoding="utf-8")
    check = browser_check(p, chromium=chromium, budget_ms=5000)
    assert check.errors >= 1 and check.title.startswith(ERROR_MARKER) and not check.ok
    # a figure whose JSON is damaged fails on its own
    bad_json = html.replace('<script type="application/json" id="fig-1-json">{', '<script type="application/json" id="fig-1-json">{{')
    p.write_text(bad_json, encoding="utf-8")
    check = browser_check(p, chromium=chromium, budget_ms=5000)
    assert check.errors >= 1 and check.rendered == 0 and "data-error" in check.figures["fig-1"]
