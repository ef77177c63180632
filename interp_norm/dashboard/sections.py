"""The dashboard's sections: which figure and table shows which report table, with captions.

Each figure is built by :mod:`interp_norm.plots` from a table of the report; a figure whose table
is missing is left out, one that fails to build becomes a note on the page.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import pandas as pd
import plotly.graph_objects as go

from interp_norm import plots
from interp_norm.dashboard.page import Panel, Section, _esc, _escape_variants
from interp_norm.errors import ConfigError

__all__ = ["figure_sections"]


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
    from interp_norm.dashboard.real_models import real_model_section

    real = real_model_section(report, panel)
    if real is not None:
        sections.append(real)
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

