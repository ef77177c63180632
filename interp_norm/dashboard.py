"""The offline dashboard: every figure of a :class:`~interp_norm.reproduce.Report` in one HTML file.

Self-contained: plotly.js is embedded once (no CDN, no network), each figure's JSON sits in a
``<script type="application/json">`` block, and a small script draws them. All user text
(checkpoint names, problem strings, table cells) is HTML-escaped; figure JSON has ``<``, ``>``
and ``&`` escaped so no string can close its ``<script>`` block.

The page reports on itself, which is what the browser test reads: ``#render-status`` carries
``data-expected`` / ``data-rendered`` / ``data-errors`` and the page title gains ``[JS ERROR]`` if
any script error or failed figure occurs (``window.onerror`` is installed before plotly.js).
"""

from __future__ import annotations

import argparse
import html
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import pandas as pd
import plotly.graph_objects as go

from interp_norm import plots
from interp_norm.errors import ConfigError, OutputDirError

__all__ = [
    "Panel",
    "Section",
    "figure_sections",
    "render_html",
    "dashboard_html",
    "write_dashboard",
    "make_dashboard",
    "BrowserCheck",
    "browser_check",
    "find_chromium",
    "register_cli",
]

ERROR_MARKER = "[JS ERROR]"


@dataclass
class Panel:
    """One figure (plotly) or one table (DataFrame) with a caption."""

    title: str
    figure: Optional[go.Figure] = None
    table: Optional[pd.DataFrame] = None
    caption: str = ""
    kind: str = "figure"  # "figure", "table" or "attention" (the explorer with selectors)


@dataclass
class Section:
    title: str
    intro: str = ""
    panels: list[Panel] = field(default_factory=list)
    anchor: str = ""


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _escape_variants(df: pd.DataFrame, cols: Sequence[str] = ("variant",)) -> pd.DataFrame:
    df = df.copy()
    for c in cols:
        if c in df.columns:
            df[c] = df[c].map(lambda v: v if v is None or (isinstance(v, float) and math.isnan(v)) else _esc(v))
    return df


# ----------------------------------------------------------------------------- figures from a report


def figure_sections(report: Any, strict: bool = False) -> tuple[list[Section], list[str]]:
    """The dashboard's sections from a report's tables; returns ``(sections, problems)``.

    A figure whose table is missing is left out; a figure that fails to build is replaced by a
    note (``strict=True`` raises instead, for tests).
    """
    T: dict[str, pd.DataFrame] = report.tables
    problems: list[str] = []

    def panel(title: str, build: Callable[[], go.Figure], caption: str = "", kind: str = "figure") -> Optional[Panel]:
        try:
            return Panel(title, figure=build(), caption=caption, kind=kind)
        except Exception as e:
            if strict:
                raise
            problems.append(f"{title}: {type(e).__name__}: {e}")
            return None

    sections: list[Section] = []

    # --- model card
    s = Section("Models", "What was trained and how well it does, next to the paper's numbers "
                "(Menary et al. 2024 train a 10-layer d=512 model for 2 GPU-days; ours are CPU-sized, so "
                "compare the shape: Pre-Norm ≈ QKV-Norm in-distribution, QKV-Norm worse when extrapolating).",
                anchor="models")
    if "model_card" in T:
        s.panels.append(Panel("Model card", table=_compact_card(T["model_card"]), kind="table",
                              caption="Per-token accuracy (teacher-forced, answer tokens including ']'), "
                                      "exact match (greedy generation); paper_*: the paper's per-token accuracy."))
        s.panels.append(panel("Accuracy per split", lambda: plots.plot_accuracy_by_split(T["model_card"])))
    if "training_curves" in T:
        s.panels.append(panel("Training loss", lambda: plots.plot_training_curves(T["training_curves"], "loss")))
    sections.append(s)

    # --- attention
    if "attention_patterns" in T:
        s = Section("Attention patterns", "Pick a model, a problem, a layer and a head. Rows are query "
                    "tokens, columns the tokens they attend to (label·position).", anchor="attention")
        s.panels.append(panel("Attention explorer", lambda: _explorer(T["attention_patterns"]), kind="attention"))
        sections.append(s)

    # --- circuits
    circ = {k[len("circuits_"):]: v for k, v in T.items() if k.startswith("circuits_")}
    if circ:
        s = Section("Circuits", "Activation patching from a clean into a corrupted run (one operand digit "
                    "changed; metric: logit difference of the clean vs corrupted answer): 1 = patching this "
                    "activation restores the clean answer, 0 = no effect. The circuit keeps the strongest edges "
                    "by EAP-IG (attribution patching with integrated gradients); faithfulness is the share of the "
                    "metric it recovers when every other edge is ablated.", anchor="circuits")
        pt = circ.get("patching")
        if pt is not None and len(pt):
            labels = _template_labels(pt)
            resid = pt[pt["activation"].isin(["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"])]
            heads = pt[~pt.index.isin(resid.index)]
            if len(resid):
                s.panels.append(panel("Patching the residual stream", lambda: plots.plot_patching_heatmap(
                    _escape_variants(resid), pos_labels=labels,
                    title="Activation patching per layer and position (rows: models)")))
            if len(heads):
                s.panels.append(panel("Patching attention heads", lambda: plots.plot_patching_heatmap(
                    _escape_variants(heads), pos_labels=labels,
                    title="Activation patching of head outputs z: per position (left) and whole head (right)")))
        ct = circ.get("circuit")
        if ct is not None and len(ct):
            for v, g in ct.groupby("variant", sort=False):
                s.panels.append(panel(f"Circuit graph: {v}", lambda g=g, v=v: plots.plot_circuit_graph(
                    g, title=f"{_esc(v)}: circuit of {len(g)} edges (EAP-IG top edges, pruned)")))
        if "faithfulness" in circ:
            f = circ["faithfulness"]
            cols = [c for c in ("variant", "ablation", "n_edges", "n_components", "faithfulness", "metric_circuit",
                                "metric_clean", "metric_empty", "metric_corrupted") if c in f.columns]
            s.panels.append(Panel("Faithfulness", table=f[cols], kind="table",
                                  caption="faithfulness = (circuit − all ablated) / (clean − all ablated), per ablation."))
        if "eap_vs_exact" in circ:
            e = circ["eap_vs_exact"]
            s.panels.append(Panel("Attribution vs exact patching", table=e[[c for c in e.columns if c != "checkpoint"]],
                                  kind="table", caption="How well EAP / EAP-IG rank heads like exact patching (z, per position)."))
        if "attention_map" in circ:
            am = circ["attention_map"]
            if "frequency" in am.columns:
                am = am.sort_values("frequency", ascending=False).groupby("variant", sort=False).head(12)
            s.panels.append(Panel("Sparse attention from the answer positions", table=am[[c for c in am.columns if c != "checkpoint"]],
                                  kind="table", caption="Which heads attend (max weight ≥ 95%) to which token role when "
                                                        "predicting each answer token; the most frequent per model."))
        sections.append(s)

    # --- noise and collapse
    if "noise_accuracy" in T or "collapse" in T:
        s = Section("Norm noise and circuit collapse",
                    "Multiplicative noise (1+κ) on the norms of queries, keys and values (all layers at once "
                    "for accuracy; each layer on its clean inputs for collapse). Under QKV-Norm the per-head norm "
                    "removes noise placed before it, so its curves stay flat; the 'noise after norm' series asks "
                    "how fragile its attention would be otherwise. Dashed: the theory's prediction.", anchor="noise")
        if "noise_accuracy" in T:
            s.panels.append(panel("Accuracy vs noise", lambda: plots.plot_accuracy_vs_noise(
                _escape_variants(T["noise_accuracy"])).update_layout(height=560)))
        if "collapse" in T:
            s.panels.append(panel("Collapse vs noise", lambda: plots.plot_collapse_vs_noise(
                _escape_variants(T["collapse"])).update_layout(height=560)))
        if "collapse_thresholds" in T:
            th = T["collapse_thresholds"]
            s.panels.append(panel("1% collapse levels", lambda: plots.plot_collapse_thresholds(_escape_variants(th))))
        sections.append(s)

    # --- geometry
    geo = {k[len("geometry_"):]: v for k, v in T.items() if k.startswith("geometry_")}
    if geo:
        s = Section("Geometry", "What Pre-Norm asks of the residual stream (orthogonal spheres, Theorem 2) "
                    "and whether the models comply; the LayerNorm/RMSNorm image ellipsoids (Riechers 2024).",
                    anchor="geometry")
        if "norm_spread" in geo:
            s.panels.append(panel("Norm spread by layer", lambda: plots.plot_norm_spread(
                _escape_variants(geo["norm_spread"])).update_xaxes(tickmode="linear", dtick=1)))
        if "sparsity_hist" in geo:
            s.panels.append(panel("Max-attention histograms", lambda: plots.plot_attention_sparsity(_escape_variants(geo["sparsity_hist"]))))
        if "sphere_scores" in geo:
            s.panels.append(panel("Orthogonal spheres", lambda: plots.plot_sphere_scores(
                _escape_variants(geo["sphere_scores"])).update_xaxes(tickmode="linear", dtick=1)))
        if "sphere_pairs" in geo:
            sp = geo["sphere_pairs"]
            layer = int(sp["layer"].max())
            s.panels.append(panel("Component overlap", lambda: _side_by_side(
                [(v, plots.plot_component_cosines(g, layer)) for v, g in sp.groupby("variant", sort=False)],
                f"Mean |cos| between the residual components at the input of layer {layer} "
                "(orthogonal spheres need ≈ 0 off the diagonal)")))
        if "subspace_angles" in geo:
            sa = geo["subspace_angles"]
            s.panels.append(panel("Subspace angles", lambda: _side_by_side(
                [(v, plots.plot_subspace_angles(g)) for v, g in sa.groupby("variant", sort=False)],
                "Smallest principal angle (degrees) between subspaces: components and each head's q/k/v read spaces")))
        if "interference" in geo:
            it = geo["interference"]
            n_rows = max(1, it["intervention"].nunique()) if "intervention" in it else 1
            s.panels.append(panel("Direct interference", lambda: plots.plot_interference(_escape_variants(it)).update_layout(
                height=180 + 200 * n_rows)))
        if "ellipsoid_axes" in geo:
            s.panels.append(panel("Norm ellipsoid axes", lambda: plots.plot_ellipsoid_axes(_escape_variants(geo["ellipsoid_axes"]))))
        if "summary" in geo:
            s.panels.append(Panel("Geometry summary", table=geo["summary"], kind="table"))
        sections.append(s)
    return sections, problems


def _compact_card(card: pd.DataFrame) -> pd.DataFrame:
    """The model card with the architecture in one column (``3L·4H·64d``; the CSV has every field), to fit the page."""
    shape_cols = ["n_layers", "n_heads", "d_model", "d_head", "d_mlp"]
    if not set(shape_cols) <= set(card.columns):
        return card
    card = card.copy()
    shape = [f"{r.n_layers}L·{r.n_heads}H·{r.d_model}d" for r in card.itertuples()]
    at = list(card.columns).index("n_layers")
    card = card.drop(columns=shape_cols + [c for c in ("task_terms",) if c in card.columns])
    card.insert(at, "shape", shape)
    return card


def _titled(fig: go.Figure, title: str) -> go.Figure:
    fig.update_layout(title=title)
    return fig


def _side_by_side(figs: Sequence[tuple[str, go.Figure]], title: str, cols: int = 2) -> go.Figure:
    """Heatmap figures (one per model) as panels of one figure sharing the first one's colour scale."""
    from plotly.subplots import make_subplots

    if not figs:
        raise ConfigError("no figures to combine")
    rows = -(-len(figs) // cols)
    ncols = min(cols, len(figs))
    out = make_subplots(rows=rows, cols=ncols, subplot_titles=[_esc(v) for v, _ in figs],
                        horizontal_spacing=0.12, vertical_spacing=0.14 if rows > 1 else 0.1)
    for i, (_, f) in enumerate(figs):
        for tr in f.data:
            out.add_trace(tr, row=i // ncols + 1, col=i % ncols + 1)
    first = figs[0][1].layout
    if first.coloraxis is not None:
        out.update_layout(coloraxis=first.coloraxis)
    out.update_yaxes(autorange="reversed", tickfont=dict(size=8))
    out.update_xaxes(tickfont=dict(size=8))
    out.update_layout(title=title, height=max(420, 460 * rows))
    return out


def _explorer(patterns: pd.DataFrame) -> go.Figure:
    df = patterns.copy()
    df["model"] = df["model"].astype(str)
    return plots.plot_attention_explorer(df)


def _template_labels(pt: pd.DataFrame) -> Optional[list[str]]:
    if "template" not in pt.columns:
        return None
    t = pt["template"].dropna()
    return list(str(t.iloc[0])) if len(t) and str(t.iloc[0]) else None


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
table.data{border-collapse:collapse;font-size:12px;width:100%;display:block;overflow-x:auto}
table.data th,table.data td{border:1px solid #ddd;padding:3px 6px;text-align:right;white-space:nowrap}
table.data th{background:#eef2f8} table.data td.s{text-align:left}
.selectors label{margin-right:14px;font-size:14px} .selectors select{margin-left:4px}
.note{color:#8a4b00;font-size:13px} footer{color:#666;font-size:12px;max-width:1280px;margin:0 auto;padding:0 24px 30px}
#render-status{font-size:12px;color:#666}
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
""" % {"marker": ERROR_MARKER}

_DRAW_JS = """
(function () {
  var figs = document.querySelectorAll('div.figure[data-fig]');
  var st = document.getElementById('render-status');
  var done = 0, ok = 0;
  st.setAttribute('data-expected', String(figs.length));
  function finish() {
    done += 1;
    st.setAttribute('data-rendered', String(ok));
    if (done === figs.length) {
      st.setAttribute('data-complete', '1');
      st.textContent = ok + ' of ' + figs.length + ' figures rendered' + (window.__errors.length ? ', ' + window.__errors.length + ' errors' : '');
    }
  }
  function fail(div, err) { div.setAttribute('data-error', String(err)); __markError('figure ' + div.id + ': ' + err); finish(); }
  figs.forEach(function (div) {
    try {
      var spec = JSON.parse(document.getElementById(div.getAttribute('data-fig')).textContent);
      var cfg = {responsive: true, displaylogo: false, toImageButtonOptions: {format: 'png'}};
      Plotly.newPlot(div, spec.data, spec.layout, cfg).then(function () {
        var n = div.querySelectorAll('svg.main-svg').length;
        if (n === 0) { fail(div, 'no svg drawn'); return; }
        div.setAttribute('data-rendered', String(n)); ok += 1;
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
})();
"""


def _json_for_script(fig: go.Figure) -> str:
    """Figure JSON that is safe inside <script>: no '<', '>' or '&' survive unescaped."""
    s = fig.to_json()
    return s.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


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
    return _esc(v), True


def table_html(df: pd.DataFrame, max_rows: int = 200) -> str:
    """An escaped HTML table (numbers formatted, strings left-aligned)."""
    head = "".join(f"<th>{_esc(c)}</th>" for c in df.columns)
    rows = []
    for rec in df.head(max_rows).itertuples(index=False):
        cells = []
        for c, v in zip(df.columns, rec):
            text, is_str = _fmt_cell(v, str(c))
            cells.append(f'<td class="s">{text}</td>' if is_str else f"<td>{text}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    more = f'<p class="caption">{len(df) - max_rows} more rows in the CSV.</p>' if len(df) > max_rows else ""
    return f'<table class="data"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>{more}'


def render_html(
    sections: Sequence[Section],
    title: str = "interp_norm dashboard",
    subtitle: str = "",
    facts: Optional[dict] = None,
    notes: Sequence[str] = (),
    csv_links: Sequence[str] = (),
) -> str:
    """The self-contained page: CSS, error hooks, plotly.js (once), figures as JSON, the draw script."""
    from plotly.offline import get_plotlyjs

    body, nav, n = [], [], 0
    for si, sec in enumerate(sections):
        anchor = sec.anchor or f"section-{si}"
        nav.append(f'<a href="#{_esc(anchor)}">{_esc(sec.title)}</a>')
        parts = [f'<section id="{_esc(anchor)}"><h2>{_esc(sec.title)}</h2>']
        if sec.intro:
            parts.append(f'<p class="caption">{_esc(sec.intro)}</p>')
        for p in sec.panels:
            if p is None:
                continue
            parts.append(f'<div class="panel"><h3>{_esc(p.title)}</h3>')
            if p.table is not None:
                parts.append(table_html(p.table))
            if p.figure is not None:
                n += 1
                fid = f"fig-{n}"
                fig = go.Figure(p.figure)
                if p.kind == "attention":
                    fig.layout.updatemenus = ()  # the page's selectors replace the notebook dropdown
                    parts.append(f'<div class="selectors" id="{fid}-selectors"></div>')
                parts.append(f'<div class="figure" id="{fid}" data-fig="{fid}-json" data-kind="{_esc(p.kind)}"></div>')
                parts.append(f'<script type="application/json" id="{fid}-json">{_json_for_script(fig)}</script>')
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
        f"<script>{get_plotlyjs()}</script></head><body>"
        f"<header><h1>{_esc(title)}</h1><p>{_esc(subtitle)}</p><p>{fact_html}</p></header>"
        f"<nav>{''.join(nav)}<span id=\"render-status\" data-expected=\"{n}\" data-rendered=\"0\" data-errors=\"0\">"
        "rendering…</span></nav>"
        f"<main>{note_html}{''.join(body)}</main><footer>{links}<p>Generated by interp_norm "
        "(offline: plotly.js is embedded; no network access is needed).</p></footer>"
        f"<script>{_DRAW_JS}</script></body></html>\n"
    )


def dashboard_html(report: Any, title: str = "Pre-Norm vs QKV-Norm: interp_norm dashboard", strict: bool = False,
                   csv_links: bool = True) -> str:
    """The dashboard of a :class:`~interp_norm.reproduce.Report` as one HTML string."""
    sections, problems = figure_sections(report, strict=strict)
    facts: dict[str, Any] = {}
    if len(report.checkpoints):
        facts["checkpoints"] = ", ".join(map(str, report.checkpoints["checkpoint"]))
    total = report.timings.get("total")
    if total:
        facts["analysis time"] = f"{total:.0f} s"
    facts["generated"] = time.strftime("%Y-%m-%d %H:%M")
    links = [f"{k}.csv" for k in report.tables] if csv_links else []
    subtitle = ("Mechanistic interpretability of attention normalisation (Menary, Kaski & Freitas 2024): circuits, "
                "norm noise and circuit collapse, and residual-stream geometry, on small addition transformers.")
    return render_html(sections, title=title, subtitle=subtitle, facts=facts,
                       notes=[*report.notes, *[f"figure skipped: {p}" for p in problems]], csv_links=links)


def write_dashboard(report: Any, path: Union[str, os.PathLike], **kwargs: Any) -> Path:
    """Write :func:`dashboard_html` to ``path`` (its folder is created; :class:`OutputDirError` if impossible)."""
    from interp_norm.checkpoints import ensure_writable_dir

    path = Path(path)
    if path.is_dir():
        raise OutputDirError(f"{str(path)!r} is a folder; give a file name such as dashboard.html")
    ensure_writable_dir(path.parent if str(path.parent) else Path("."))
    html_text = dashboard_html(report, **kwargs)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(html_text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        raise OutputDirError(f"cannot write {str(path)!r} ({e.strerror or e}); choose a writable path") from None
    return path


def make_dashboard(
    checkpoints: Sequence[str],
    out: Union[str, os.PathLike] = "dashboard.html",
    *,
    quick: bool = False,
    settings: Any = None,
    analyse: Any = None,
    progress: bool = True,
    threads: Optional[int] = 1,
) -> Path:
    """Analyse any checkpoints and write their dashboard (one HTML file; no CSVs)."""
    from interp_norm.reproduce import Settings, run_analyses

    if isinstance(checkpoints, (str, os.PathLike)):
        checkpoints = [str(checkpoints)]
    out = Path(out)
    if out.is_dir():
        raise OutputDirError(f"--out {str(out)!r} is a folder; give a file name such as dashboard.html")
    from interp_norm.checkpoints import ensure_writable_dir

    ensure_writable_dir(out.parent if str(out.parent) else Path("."))  # before any work
    settings = settings or (Settings.quick() if quick else Settings.full())
    report = run_analyses(list(checkpoints), settings, analyse=analyse, progress=progress, threads=threads)
    return write_dashboard(report, out, csv_links=False)


# ----------------------------------------------------------------------------- browser check


@dataclass
class BrowserCheck:
    """What headless Chromium saw: counts from ``#render-status`` and each figure's ``data-*`` marks."""

    title: str
    expected: int
    rendered: int
    errors: int
    error_messages: str
    complete: bool
    figures: dict[str, dict[str, str]]  # figure id -> its data-* attributes
    dom: str

    @property
    def ok(self) -> bool:
        return (self.complete and self.errors == 0 and not self.title.startswith(ERROR_MARKER)
                and self.expected == self.rendered == len(self.figures)
                and all(int(f.get("data-rendered", "0") or 0) > 0 for f in self.figures.values()))


def find_chromium() -> Optional[str]:
    """Debian's ``chromium`` (or ``chromium-browser`` / ``$CHROMIUM``), if installed."""
    import shutil

    env = os.environ.get("CHROMIUM")
    if env:
        return env
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def chromium_command(chromium: str, profile: str, extra: Sequence[str]) -> list[str]:
    """Headless, sandbox-free, network-free Chromium (every host resolves to nothing)."""
    return [
        chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio",
        "--host-resolver-rules=MAP * ~NOTFOUND", f"--user-data-dir={profile}", *extra,
    ]


def _attrs(tag: str) -> dict[str, str]:
    import re

    return {k: html.unescape(v) for k, v in re.findall(r'([\w-]+)="([^"]*)"', tag)}


def browser_check(
    path: Union[str, os.PathLike],
    *,
    screenshot: Optional[Union[str, os.PathLike]] = None,
    window: tuple[int, int] = (1300, 2000),
    selftest: bool = True,
    chromium: Optional[str] = None,
    budget_ms: int = 20000,
    timeout: float = 180,
) -> BrowserCheck:
    """Open a dashboard in headless Chromium and report what rendered (and optionally screenshot it).

    Uses ``--dump-dom`` after ``budget_ms`` of virtual time: the page's own error hooks and
    ``#render-status`` say whether any script failed and how many figures drew an SVG.
    """
    import re
    import subprocess
    import tempfile

    chromium = chromium or find_chromium()
    if chromium is None:
        raise FileNotFoundError("chromium is not installed (Debian: apt-get install chromium)")
    url = Path(path).resolve().as_uri() + ("#selftest" if selftest else "")
    with tempfile.TemporaryDirectory(prefix="interp-norm-chromium-") as tmp:
        profile = str(Path(tmp) / "dom")
        common = [f"--virtual-time-budget={budget_ms}", f"--window-size={window[0]},{window[1]}"]
        run = subprocess.run(chromium_command(chromium, profile, [*common, "--dump-dom", url]),
                             capture_output=True, text=True, timeout=timeout)
        dom = run.stdout
        if run.returncode != 0 or "<html" not in dom:
            raise RuntimeError(f"chromium failed (exit {run.returncode}): {run.stderr[-2000:]}")
        if screenshot is not None:
            shot = Path(screenshot).resolve()
            run2 = subprocess.run(chromium_command(chromium, str(Path(tmp) / "shot"), [*common, f"--screenshot={shot}", url]),
                                  capture_output=True, text=True, timeout=timeout)
            if run2.returncode != 0 or not shot.is_file():
                raise RuntimeError(f"chromium screenshot failed (exit {run2.returncode}): {run2.stderr[-2000:]}")
    m = re.search(r"<title>(.*?)</title>", dom, re.S)
    title = html.unescape(m.group(1)) if m else ""
    st = re.search(r'<span id="render-status"[^>]*>', dom)
    a = _attrs(st.group(0)) if st else {}
    figures = {}
    for tag in re.findall(r'<div [^>]*class="figure[^"]*"[^>]*>', dom):
        fa = _attrs(tag)
        figures[fa.get("id", f"?{len(figures)}")] = fa
    return BrowserCheck(
        title=title, expected=int(a.get("data-expected", -1)), rendered=int(a.get("data-rendered", -1)),
        errors=int(a.get("data-errors", -1)), error_messages=a.get("data-error-messages", ""),
        complete=a.get("data-complete") == "1", figures=figures, dom=dom,
    )


# ----------------------------------------------------------------------------- CLI


HELP = "analyse any checkpoints and write their offline HTML dashboard"


def add_cli(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """``interp-norm dashboard CKPT [CKPT ...]`` (cli.py's ``command`` protocol)."""
    from interp_norm.reproduce import _analyse_arg, add_settings_arguments, settings_from_args

    p.add_argument("ckpt", nargs="+", help="checkpoint or run folders, or pretrained names (see 'interp-norm list')")
    p.add_argument("--out", default="dashboard.html", help="HTML file to write (default: dashboard.html)")
    add_settings_arguments(p)

    def run(args: argparse.Namespace) -> int:
        settings = settings_from_args(args)
        t = time.perf_counter()
        path = make_dashboard(args.ckpt, args.out, settings=settings, analyse=_analyse_arg(args),
                              progress=not args.no_progress, threads=args.threads)
        print(f"wrote {path} in {time.perf_counter() - t:.0f} s")
        return 0

    return run


def register_cli(command: Optional[Callable] = None) -> None:
    """Register ``dashboard`` with cli.py's ``command`` decorator (idempotent)."""
    if command is None:
        from interp_norm.cli import command
    command("dashboard", help=HELP)(add_cli)
