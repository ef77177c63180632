"""The dashboard page: panels and sections rendered as one self-contained HTML file.

Self-contained: plotly.js is embedded once (no CDN, no network), gzipped (the browser unpacks it,
:func:`packed_plotlyjs`); each figure's JSON sits in a ``<script type="application/json">`` block, its
numbers shrunk and the plotly template held once for all (:func:`compact_spec`), and a small script
draws them. Tables of more than :data:`FOLD_ROWS` rows sit behind a closed "data" fold. All user text
(checkpoint names, problem strings, table cells) is HTML-escaped; figure JSON has ``<``, ``>``
and ``&`` escaped so no string can close its ``<script>`` block.

The page reports on itself, which is what the browser test reads: ``#render-status`` carries
``data-expected`` / ``data-rendered`` / ``data-errors`` and the page title gains ``[JS ERROR]`` if
any script error or failed figure occurs (``window.onerror`` is installed before plotly.js).
"""

from __future__ import annotations

import functools
import html
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import pandas as pd
import plotly.graph_objects as go

__all__ = ["ERROR_MARKER", "PLOTLY_ID", "Panel", "Section", "render_html", "table_html", "packed_plotlyjs",
           "compact_spec"]

ERROR_MARKER = "[JS ERROR]"


@dataclass
class Panel:
    """One figure (plotly) or one table (DataFrame) with a caption."""

    title: str
    figure: Optional[go.Figure] = None
    table: Optional[pd.DataFrame] = None
    caption: str = ""
    kind: str = "figure"  # "figure", "table" or "attention" (the explorer with selectors)
    #: Whether the table sits behind a closed "data" fold (None: when it has more than :data:`FOLD_ROWS` rows,
    #: or when the panel also has a figure, which is what to read; the table is its data).
    fold: Optional[bool] = None


#: Tables longer than this are folded away (the page is read through its figures; the rows stay one click away).
FOLD_ROWS = 12


@dataclass
class Section:
    title: str
    intro: str = ""
    panels: list[Panel] = field(default_factory=list)
    anchor: str = ""
    #: One sentence of what to look at, read off the data shown (:mod:`interp_norm.report.dashboard.story`).
    lead: str = ""


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _escape_variants(df: pd.DataFrame, cols: Sequence[str] = ("variant",)) -> pd.DataFrame:
    df = df.copy()
    for c in cols:
        if c in df.columns:
            df[c] = df[c].map(lambda v: v if v is None or (isinstance(v, float) and math.isnan(v)) else _esc(v))
    return df



# ----------------------------------------------------------------------------- HTML


_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#1f3b63;color:#fff;padding:18px 28px}
header h1{margin:0 0 6px 0;font-size:24px} header p{margin:2px 0;opacity:.9}
nav{background:#fff;border-bottom:1px solid #ddd;padding:8px 28px;position:sticky;top:0;z-index:10}
nav a{margin-right:16px;color:#1f3b63;text-decoration:none;font-weight:600}
main{max-width:1280px;margin:0 auto;padding:10px 24px 40px}
section{margin-top:26px} section h2{border-bottom:2px solid #1f3b63;padding-bottom:4px}
.panel{background:#fff;border:1px solid #e2e2e2;border-radius:6px;margin:14px 0;padding:10px}
.panel h3{margin:4px 0 8px 0;font-size:16px} .caption{color:#555;font-size:13px;margin:4px 0}
.figure{width:100%;min-height:360px}
.tablewrap{overflow-x:auto;max-width:100%} .tablewrap + .tablewrap{margin-top:8px}
table.data{border-collapse:collapse;font-size:12px;max-width:100%}
table.data th,table.data td{border:1px solid #ddd;padding:3px 6px;text-align:right}
table.data td{white-space:nowrap} table.data th{white-space:normal;overflow-wrap:anywhere;vertical-align:bottom}
table.data th{background:#eef2f8} table.data td.s{text-align:left;white-space:normal;min-width:7em;max-width:26em}
.selectors label{margin-right:14px;font-size:14px} .selectors select{margin-left:4px}
.note{color:#8a4b00;font-size:13px} footer{color:#666;font-size:12px;max-width:1280px;margin:0 auto;padding:0 24px 30px}
#render-status{font-size:12px;color:#666}
details.data{margin:6px 0} details.data summary{cursor:pointer;color:#1f3b63;font-size:13px}
p.lead{font-size:15px;margin:6px 0 4px 0}
"""

# Installed before plotly.js so errors while loading it are caught too.
_ERROR_JS = """
window.__errors = [];
function __markError(msg) {
  window.__errors.push(String(msg));
  if (document.title.indexOf('%(marker)s') !== 0) document.title = '%(marker)s ' + document.title;
  var st = document.getElementById('render-status');
  if (st) { st.setAttribute('data-errors', String(window.__errors.length)); st.setAttribute('data-error-messages', window.__errors.join(' | ')); }
}
window.addEventListener('error', function (e) { __markError((e && e.message) || 'script error'); });
(function () {  // console.error counts as an error too (plotly reports some failures only there)
  var orig = console.error;
  console.error = function () { __markError('console.error: ' + Array.prototype.join.call(arguments, ' ')); return orig.apply(console, arguments); };
})();
window.addEventListener('unhandledrejection', function (e) { __markError('unhandled rejection: ' + (e && e.reason)); });
""" % {"marker": ERROR_MARKER}  # noqa: UP031 (the JavaScript is full of braces)

#: The id of the ``<script>`` block holding plotly.js, gzipped and base64-encoded (:func:`packed_plotlyjs`).
PLOTLY_ID = "plotly-js-gzip"

# Unpacks plotly.js in the browser (DecompressionStream: no network, no library) and runs it;
# the figures are drawn once it has run (window.__plotlyReady).
_UNPACK_JS = """
window.__plotlyReady = (function () {
  var block = document.getElementById('%(id)s');
  if (typeof DecompressionStream === 'undefined') return Promise.reject(new Error('this browser cannot unpack the embedded plotly.js (no DecompressionStream; use a current Chromium, Firefox or Safari)'));
  var bin = atob(block.textContent), bytes = new Uint8Array(bin.length);
  for (var i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  var stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream('gzip'));
  return new Response(stream).text().then(function (code) {
    var s = document.createElement('script'); s.textContent = code; document.head.appendChild(s);
    if (typeof Plotly === 'undefined') throw new Error('plotly.js did not load');
  });
})();
""" % {"id": PLOTLY_ID}  # noqa: UP031


@functools.lru_cache(maxsize=1)
def packed_plotlyjs() -> str:
    """plotly.js gzipped and base64-encoded: 4.8 MB of JavaScript becomes 2.0 MB of page, unpacked by the
    browser itself when the page opens (the page stays one offline file)."""
    import base64
    import gzip

    from plotly.offline import get_plotlyjs

    return base64.b64encode(gzip.compress(get_plotlyjs().encode("utf-8"), 9, mtime=0)).decode("ascii")


_DRAW_JS = r"""
window.__plotlyReady.then(function () {
  var figs = document.querySelectorAll('div.figure[data-fig]');
  var st = document.getElementById('render-status');
  var done = 0, ok = 0, templates = {};
  function template(id) {  // each distinct plotly template is on the page once, parsed once
    if (!(id in templates)) templates[id] = JSON.parse(document.getElementById(id).textContent);
    return templates[id];
  }
  st.setAttribute('data-expected', String(figs.length));
  function finish() {
    done += 1;
    st.setAttribute('data-rendered', String(ok));
    if (done === figs.length) {
      var wide = 0;  // tables wider than their panel (they should be split into column blocks instead)
      document.querySelectorAll('.tablewrap').forEach(function (w) { if (w.scrollWidth > w.clientWidth + 1) wide += 1; });
      st.setAttribute('data-wide-tables', String(wide));
      st.setAttribute('data-complete', '1');
      st.textContent = ok + ' of ' + figs.length + ' figures rendered' + (window.__errors.length ? ', ' + window.__errors.length + ' errors' : '');
    }
  }
  // what the browser test reads: does any legend scroll, and which colour did each trace get
  function selfReport(div) {
    var fl = div._fullLayout || {}, over = 0;
    Object.keys(fl).forEach(function (k) {
      if (/^legend\d*$/.test(k) && fl[k] && fl[k]._height > fl[k]._maxHeight + 1) over += 1;
    });
    div.querySelectorAll('.legend rect.scrollbar').forEach(function (r) { if (parseFloat(r.getAttribute('height') || '0') > 0) over += 1; });
    div.setAttribute('data-legend-overflow', String(over));
    var traces = [];
    (div._fullData || []).forEach(function (t) {
      if (t.visible === false || ['scatter', 'bar', 'box', 'histogram'].indexOf(t.type) < 0) return;
      var lines = t.type === 'scatter' && String(t.mode || '').indexOf('lines') >= 0;
      var c = lines ? (t.line && t.line.color) : (t.marker && t.marker.color);
      if (typeof c === 'string') traces.push([String(t.name || ''), String(t.legendgroup || ''), c]);
    });
    div.setAttribute('data-traces', JSON.stringify(traces));
  }
  function fail(div, err) { div.setAttribute('data-error', String(err)); __markError('figure ' + div.id + ': ' + err); finish(); }
  figs.forEach(function (div) {
    try {
      var spec = JSON.parse(document.getElementById(div.getAttribute('data-fig')).textContent);
      var tid = div.getAttribute('data-template');
      if (tid) spec.layout.template = template(tid);
      var cfg = {responsive: true, displaylogo: false, toImageButtonOptions: {format: 'png'}};
      Plotly.newPlot(div, spec.data, spec.layout, cfg).then(function () {
        var n = div.querySelectorAll('svg.main-svg').length;
        if (n === 0) { fail(div, 'no svg drawn'); return; }
        div.setAttribute('data-rendered', String(n)); ok += 1;
        selfReport(div);
        if (div.getAttribute('data-kind') === 'attention') setupExplorer(div, spec.layout.meta.explorer);
        finish();
      }, function (err) { fail(div, err); });
    } catch (err) { fail(div, err); }
  });
  if (figs.length === 0) { st.setAttribute('data-complete', '1'); st.textContent = 'no figures'; }

  function setupExplorer(div, ex) {
    var box = document.getElementById(div.id + '-selectors');
    if (!box || !ex) return;
    var sel = {};
    function add(name, options) {
      var label = document.createElement('label'); label.textContent = name;
      var s = document.createElement('select'); s.setAttribute('data-axis', name);
      options.forEach(function (o, i) { var op = document.createElement('option'); op.value = String(i); op.textContent = o; s.appendChild(op); });
      label.appendChild(s); box.appendChild(label); sel[name] = s; s.addEventListener('change', update);
    }
    function range(n, p) { var a = []; for (var i = 0; i < n; i++) a.push(p + i); return a; }
    // option texts are set with textContent: the escaped names are decoded once for display
    function decode(t) { var d = document.createElement('textarea'); d.innerHTML = t; return d.value; }
    add('model', ex.models.map(decode)); add('problem', ex.problems.map(decode));
    add('layer', range(ex.n_layers, 'layer ')); add('head', range(ex.n_heads, 'head '));
    function update() {
      var key = [sel.model.value, sel.problem.value, sel.layer.value, sel.head.value].join(',');
      var idx = ex.index[key];
      var n = div.data.length, vis = [];
      for (var i = 0; i < n; i++) vis.push(i === idx);
      div.setAttribute('data-selected', idx === undefined ? 'none' : String(idx));
      if (idx === undefined) return Promise.resolve(undefined);
      return Plotly.restyle(div, {visible: vis}).then(function () { return Plotly.relayout(div, {'title.text': ex.labels[idx]}); })
        .then(function () { return idx; })
        .catch(function (err) { __markError('explorer: ' + err); });
    }
    // '#selftest' in the URL: pick the last model/problem/layer/head and record whether exactly
    // that heatmap is shown (the browser test reads data-selftest from the DOM)
    if (window.location.hash === '#selftest') {
      ['model', 'problem', 'layer', 'head'].forEach(function (k) { sel[k].selectedIndex = sel[k].options.length - 1; });
      update().then(function (idx) {
        var shown = [];
        div.data.forEach(function (t, i) { if (t.visible === true) shown.push(i); });
        var title = div.layout.title && div.layout.title.text;
        var ok = idx !== undefined && shown.length === 1 && shown[0] === idx && title === ex.labels[idx];
        div.setAttribute('data-selftest', ok ? 'ok' : 'fail: shown ' + shown.join(',') + ' expected ' + idx);
      });
    }
  }
}, function (err) {
  __markError('plotly.js: ' + (err && err.message || err));
  var st = document.getElementById('render-status');
  st.setAttribute('data-complete', '1'); st.textContent = 'figures not drawn: ' + (err && err.message || err);
});
"""


def _safe_json(obj: Any) -> str:
    """JSON that is safe inside <script>: no '<', '>' or '&' survive unescaped."""
    s = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return s.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def _json_for_script(fig: go.Figure) -> str:
    """The figure's JSON as :func:`compact_spec` shrinks it (template included), safe inside <script>."""
    spec, template = compact_spec(fig)
    if template is not None:
        spec["layout"]["template"] = template
    return _safe_json(spec)


#: Significant digits kept of every number the page draws: a figure shows 3-4 (ticks, hover), so 6 lose nothing seen.
DIGITS = 6


def _shrink_array(a: dict) -> dict:
    """A plotly typed array (``{"dtype", "bdata"[, "shape"]}``) in the smallest dtype that keeps its
    values to :data:`DIGITS` significant digits: integers in the narrowest integer type, floats as float32
    (7 digits; NaN stays NaN)."""
    import base64

    import numpy as np

    v = np.frombuffer(base64.b64decode(a["bdata"]), dtype=np.dtype(a["dtype"]))
    if v.dtype.kind == "f" and v.size and np.isfinite(v).all() and (v == np.round(v)).all() and np.abs(v).max() < 2 ** 31:
        v = v.astype(np.int64)  # whole numbers (layers, steps) stored as floats
    if v.dtype.kind in "iu" and v.size:
        lo, hi = int(v.min()), int(v.max())
        for t in ("i1", "u1", "i2", "u2", "i4", "u4"):
            info = np.iinfo(t)
            if info.min <= lo and hi <= info.max:
                v = v.astype(t)
                break
    elif v.dtype == np.float64:
        v = v.astype(np.float32)
    out = dict(a, dtype=v.dtype.str.lstrip("<|="), bdata=base64.b64encode(v.tobytes()).decode("ascii"))
    return out


def _shrink(x: Any) -> Any:
    """Every number of a figure's JSON to :data:`DIGITS` significant digits, typed arrays in their smallest dtype."""
    if isinstance(x, dict):
        if "bdata" in x and "dtype" in x:
            return _shrink_array(x)
        return {k: _shrink(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_shrink(v) for v in x]
    if isinstance(x, float) and math.isfinite(x):
        return float(f"{x:.{DIGITS}g}")
    return x


def compact_spec(fig: go.Figure) -> tuple[dict, Optional[dict]]:
    """``({"data", "layout"}, template)``: the figure's JSON without its template (the page holds each
    distinct template once; plotly.py repeats ~7 kB of it in every figure), numbers shrunk by :func:`_shrink`."""
    spec = json.loads(fig.to_json())
    template = spec.get("layout", {}).pop("template", None)
    return {"data": _shrink(spec.get("data", [])), "layout": _shrink(spec.get("layout", {}))}, template


def _fmt_cell(v: Any, col: str) -> tuple[str, bool]:
    """(escaped text, is_string)."""
    if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA:
        return "–", False
    if isinstance(v, float):
        if col.endswith("_acc") or col.endswith("_exact") or col in ("accuracy", "per_token_acc", "exact_match"):
            return f"{100 * v:.1f}%", False
        return _esc(f"{v:.4g}"), False
    if isinstance(v, (int,)) or hasattr(v, "dtype"):
        try:
            f = float(v)
            if f.is_integer():
                return _esc(f"{int(f):,}" if abs(f) >= 10_000 else str(int(f))), False
            return _esc(f"{f:.4g}"), False
        except (TypeError, ValueError):
            pass
    if isinstance(v, str) and _NUMBER.match(v):
        return _esc(v), False  # pre-formatted numbers ("99.8%") stay right-aligned
    return _esc(v), True


_NUMBER = re.compile(r"^[-+]?[\d,]*\.?\d+(e[-+]?\d+)?%?$")


def _key_columns(df: pd.DataFrame, limit: int = 3) -> list:
    """The leading columns that name a row (text, or ``layer``/``head``/``split``): repeated in every block."""
    keys = []
    for c in df.columns[:limit]:
        if df[c].dtype == object or str(c) in ("layer", "head", "split", "field", "checkpoint", "variant"):
            keys.append(c)
        else:
            break
    return keys


def table_html(df: pd.DataFrame, max_rows: int = 200, max_cols: int = 11) -> str:
    """An escaped HTML table (numbers formatted, strings left-aligned). A table wider than
    ``max_cols`` columns is split into blocks of columns stacked vertically, each repeating the
    row-naming columns, so it reads without horizontal scrolling."""
    keys = _key_columns(df)
    rest = [c for c in df.columns if c not in keys]
    width = max(1, max_cols - len(keys))
    blocks = [rest[i:i + width] for i in range(0, len(rest), width)] or [[]]
    body = df.head(max_rows)
    out = []
    for block in blocks:
        cols = [*keys, *block]
        head = "".join(f"<th>{_esc(c)}</th>" for c in cols)
        rows = []
        for rec in body[cols].itertuples(index=False):
            cells = []
            for c, v in zip(cols, rec):
                text, is_str = _fmt_cell(v, str(c))
                cells.append(f'<td class="s">{text}</td>' if is_str else f"<td>{text}</td>")
            rows.append("<tr>" + "".join(cells) + "</tr>")
        out.append(f'<div class="tablewrap"><table class="data"><thead><tr>{head}</tr></thead>'
                   f'<tbody>{"".join(rows)}</tbody></table></div>')
    more = f'<p class="caption">{len(df) - max_rows} more rows in the CSV.</p>' if len(df) > max_rows else ""
    return "".join(out) + more


def render_html(
    sections: Sequence[Section],
    title: str = "interp_norm dashboard",
    subtitle: str = "",
    facts: Optional[dict] = None,
    notes: Sequence[str] = (),
    csv_links: Sequence[str] = (),
) -> str:
    """The self-contained page: CSS, error hooks, plotly.js (once), figures as JSON, the draw script."""
    body, nav, n = [], [], 0
    templates: dict[str, str] = {}  # template JSON -> its id: each distinct template once on the page
    for si, sec in enumerate(sections):
        anchor = sec.anchor or f"section-{si}"
        nav.append(f'<a href="#{_esc(anchor)}">{_esc(sec.title)}</a>')
        parts = [f'<section id="{_esc(anchor)}"><h2>{_esc(sec.title)}</h2>']
        if sec.lead:
            parts.append(f'<p class="lead">{_esc(sec.lead)}</p>')
        if sec.intro:
            parts.append(f'<p class="caption">{_esc(sec.intro)}</p>')
        for p in sec.panels:
            if p is None:
                continue
            parts.append(f'<div class="panel"><h3>{_esc(p.title)}</h3>')
            if p.figure is not None:
                n += 1
                fid = f"fig-{n}"
                fig = go.Figure(p.figure)
                if p.kind == "attention":
                    fig.layout.updatemenus = ()  # the page's selectors replace the notebook dropdown
                    parts.append(f'<div class="selectors" id="{fid}-selectors"></div>')
                spec, template = compact_spec(fig)
                tid = templates.setdefault(_safe_json(template), f"template-{len(templates) + 1}") if template else ""
                parts.append(f'<div class="figure" id="{fid}" data-fig="{fid}-json" data-kind="{_esc(p.kind)}" '
                             f'data-template="{tid}"></div>')
                parts.append(f'<script type="application/json" id="{fid}-json">{_safe_json(spec)}</script>')
            if p.table is not None:
                fold = p.fold if p.fold is not None else (len(p.table) > FOLD_ROWS or p.figure is not None)
                table = table_html(p.table)
                parts.append(f'<details class="data"><summary>data: {len(p.table)} rows × {len(p.table.columns)} '
                             f'columns</summary>{table}</details>' if fold else table)
            if p.caption:
                parts.append(f'<p class="caption">{_esc(p.caption)}</p>')
            parts.append("</div>")
        parts.append("</section>")
        body.append("".join(parts))
    fact_html = ""
    if facts:
        fact_html = " · ".join(f"{_esc(k)}: {_esc(v)}" for k, v in facts.items())
    note_html = "".join(f'<p class="note">{_esc(x)}</p>' for x in notes)
    links = ""
    if csv_links:
        links = "<p>Tables (CSV, next to this file): " + ", ".join(
            f'<a href="{_esc(c)}">{_esc(c)}</a>' for c in csv_links) + "</p>"
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><title>{_esc(title)}</title>"
        f"<style>{_CSS}</style><script>{_ERROR_JS}</script>"
        f'<script type="application/octet-stream" id="{PLOTLY_ID}">{packed_plotlyjs()}</script>'
        f"<script>{_UNPACK_JS}</script></head><body>"
        f"<header><h1>{_esc(title)}</h1><p>{_esc(subtitle)}</p><p>{fact_html}</p></header>"
        f"<nav>{''.join(nav)}<span id=\"render-status\" data-expected=\"{n}\" data-rendered=\"0\" data-errors=\"0\">"
        "rendering…</span></nav>"
        f"<main>{note_html}{''.join(body)}</main><footer>{links}<p>Generated by interp_norm "
        "(offline: plotly.js is embedded; no network access is needed).</p></footer>"
        + "".join(f'<script type="application/json" id="{tid}">{t}</script>' for t, tid in templates.items())
        + f"<script>{_DRAW_JS}</script></body></html>\n"
    )

