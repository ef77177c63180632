"""The dashboard panels of each registered analysis (:data:`interp_norm.report.registry.REGISTRY`'s ``figure``).

Each builder is ``build(tables, panel, csv) -> [Section, ...]``: the report's tables in, the sections
its panels belong to out (panels of several analyses that name one section anchor are shown together,
see :func:`interp_norm.report.dashboard.sections.figure_sections`). ``panel(title, build_figure, caption,
kind)`` builds a figure panel (None if the figure fails; the page notes why); ``csv``: whether the
tables are written beside the page (captions point at them only then). A figure whose table is
missing is left out.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import pandas as pd
import plotly.graph_objects as go

from interp_norm.report import plots
from interp_norm.report.dashboard.page import Panel, Section, _esc, _escape_variants
from interp_norm.report.plots.geometry import TICK_PX

__all__ = ["SECTIONS", "section", "models", "attention", "circuits", "noise", "collapse", "forward_collapse",
           "temperature", "geometry", "noise_decomposition", "collapse_consequence", "models_finding"]

#: Title and introduction of the sections several analyses share, by anchor.
SECTIONS: dict[str, tuple[str, str]] = {
    "attention": ("Attention patterns", "Pick a model, a problem, a layer and a head. Rows are query "
                  "tokens, columns the tokens they attend to (label·position)."),
    "circuits": ("Circuits", "Activation patching from a clean into a corrupted run (one operand digit "
                 "changed; metric: logit difference of the clean vs corrupted answer): 1 = patching this "
                 "activation restores the clean answer, 0 = no effect. The circuit keeps the strongest edges "
                 "by EAP-IG (attribution patching with integrated gradients); faithfulness is the share of the "
                 "metric it recovers when every other edge is ablated."),
    "noise": ("Norm noise",
              "Multiplicative noise (1+κ) on the norms of queries, keys and values, in all layers at once. Under "
              "QKV-Norm the per-head norm removes noise placed before it, so its curves stay flat; the 'noise after "
              "norm' series asks how fragile its attention would be otherwise."),
    "collapse": ("Circuit collapse",
                 "A sparse attention row (max weight ≥ 95%) collapses when noise moves its argmax (loose) or drops "
                 "its max below 95% (strict); each layer is noised on its clean inputs. Wide pale lines: the theory's "
                 "prediction, computed from the clean scores alone."),
    "controls": ("Controls", "Tests of the collapse theory against something it does not compute itself, and "
                 "the mechanism behind the collapse level. The matched-count control is the fourth panel of "
                 "'Accuracy vs noise' above: noising as many non-sparse rows as there are sparse ones."),
    "controls-23": ("Whose collapse, and what noise costs", "Which heads a pooled collapse level rests on, "
                    "which part of the noise costs the accuracy, and whether the problems in which a sparse "
                    "row collapsed are the ones that fail."),
    "geometry": ("Geometry", "What Pre-Norm asks of the residual stream (orthogonal spheres, Theorem 2) "
                 "and whether the models comply; the LayerNorm/RMSNorm image ellipsoids (Riechers 2024)."),
}


def section(anchor: str, panels: list[Optional[Panel]]) -> list[Section]:
    """``[Section]`` with the shared title and introduction of ``anchor`` (none if no panel was built)."""
    title, intro = SECTIONS[anchor]
    built = [p for p in panels if p is not None]
    return [Section(title, intro, built, anchor=anchor)] if built else []


Build = Callable[..., Optional[Panel]]


def models(T: dict, panel: Build, csv: bool = True) -> list[Section]:
    """The model card (evaluation beside the paper's numbers), accuracy per split, training loss."""
    panels: list[Optional[Panel]] = []
    if "model_card" in T:
        panels.append(Panel("Model card", table=_compact_card(T["model_card"]), kind="table", fold=False,
                            caption="One column per checkpoint. Per-token accuracy (teacher-forced, answer tokens "
                                    "including ']'), exact match (greedy generation); paper_*: the paper's per-token "
                                    "accuracy." + (" Every field is in model_card.csv." if csv else "")))
        panels.append(panel("Accuracy per split", lambda: plots.plot_accuracy_by_split(T["model_card"])))
    if "training_curves" in T:
        panels.append(panel("Training loss", lambda: plots.plot_training_curves(T["training_curves"], "loss")))
    built = [p for p in panels if p is not None]
    if not built:  # a dashboard of Hugging Face models only has no models of ours to describe
        return []
    return [Section("Models", "What was trained and how well it does, next to the paper's numbers (Menary et al. "
                    "2024 train a 10-layer d=512 model for 2 GPU-days; these are CPU-sized). "
                    + models_finding(T.get("model_card")), built, anchor="models")]


def attention(T: dict, panel: Build, csv: bool = True) -> list[Section]:
    if "attention_patterns" not in T:
        return []
    return section("attention", [panel("Attention explorer", lambda: _explorer(T["attention_patterns"]),
                                       kind="attention")])


def circuits(T: dict, panel: Build, csv: bool = True) -> list[Section]:
    circ = {k[len("circuits_"):]: v for k, v in T.items() if k.startswith("circuits_")}
    if not circ:
        return []
    panels: list[Optional[Panel]] = []
    pt = circ.get("patching")
    if pt is not None and len(pt):
        labels = _template_labels(pt)
        resid = pt[pt["activation"].isin(["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"])]
        heads = pt[~pt.index.isin(resid.index)]
        if len(resid):
            panels.append(panel("Patching the residual stream", lambda: _label_heatmap_axes(plots.plot_patching_heatmap(
                _escape_variants(resid), pos_labels=labels,
                title="Activation patching per layer and position (rows: models)"))))
        if len(heads):
            panels.append(panel("Patching attention heads", lambda: _label_heatmap_axes(plots.plot_patching_heatmap(
                _escape_variants(heads), pos_labels=labels,
                title="Activation patching of head outputs z: per position (left) and whole head (right)"),
                row_height=max(300, 60 + 22 * _n_head_rows(heads)))))
    ct = circ.get("circuit")
    if ct is not None and len(ct):
        for v, g in ct.groupby("variant", sort=False):
            name = str(g["checkpoint"].iloc[0]) if "checkpoint" in g.columns else str(v)
            panels.append(panel(f"Circuit graph: {v} (checkpoint {name})", lambda g=g, v=v, name=name: _full_width(
                plots.plot_circuit_graph(g, title=f"{_esc(v)} (checkpoint {_esc(name)}): circuit of {len(g)} edges "
                                                  "(EAP-IG top edges, pruned)")),
                caption=_edge_scale(g)))
    where = " (circuits_{}.csv)" if csv else ""
    if "faithfulness" in circ:
        panels.append(panel("Faithfulness", lambda: plots.plot_faithfulness_bars(_escape_variants(circ["faithfulness"])),
                            caption="faithfulness = (circuit − all ablated) / (clean − all ablated), per ablation of "
                                    "the edges outside the circuit" + where.format("faithfulness") + "."))
    if "eap_vs_exact_heads" in circ:
        panels.append(panel("Attribution vs exact patching", lambda: plots.plot_attribution_scatter(
            _escape_variants(circ["eap_vs_exact_heads"])),
            caption="Each dot is one head: the effect of patching its whole z exactly (x) and the EAP / EAP-IG "
                    "estimate of it (y); on the diagonal the estimate is exact" + where.format("eap_vs_exact_heads")
                    + ". Correlations over every head and position" + where.format("eap_vs_exact") + "."))
    elif "eap_vs_exact" in circ:  # a report written before the per-head table existed
        panels.append(panel("Attribution vs exact patching", lambda: plots.plot_attribution_agreement(
            _escape_variants(circ["eap_vs_exact"])),
            caption="How well EAP / EAP-IG rank heads like exact patching (z, per position): correlation over every "
                    "head and position, and the overlap of the top k" + where.format("eap_vs_exact") + "."))
    if "attention_map" in circ:
        panels.append(panel("Sparse attention from the answer positions", lambda: plots.plot_attention_map(
            _escape_variants(circ["attention_map"])),
            caption="Which heads attend (max weight ≥ 95%) to which token role when predicting each answer token: "
                    "the most frequent key per head and query position" + where.format("attention_map") + "."))
    return section("circuits", panels)


def noise(T: dict, panel: Build, csv: bool = True) -> list[Section]:
    if "noise_accuracy" not in T:
        return []
    return section("noise", [panel("Accuracy vs noise", lambda: plots.plot_accuracy_vs_noise(
        _escape_variants(T["noise_accuracy"])))])


def collapse(T: dict, panel: Build, csv: bool = True) -> list[Section]:
    """Collapse vs noise and the 1% levels; the effective number of heads behind each pooled level."""
    panels: list[Optional[Panel]] = []
    if "collapse" in T:
        panels.append(panel("Collapse vs noise", lambda: plots.plot_collapse_vs_noise(_escape_variants(T["collapse"]))))
    if "collapse_thresholds" in T:
        th = T["collapse_thresholds"]
        top = float(T["collapse"]["level"].max()) if "collapse" in T and len(T["collapse"]) else None
        panels.append(panel("1% collapse levels", lambda: plots.plot_collapse_thresholds(_escape_variants(th),
                                                                                         max_level=top)))
    out = section("collapse", panels)
    th = T.get("collapse_thresholds")
    if th is not None and "effective_heads" in th.columns:
        v = th[(th["layer"].astype(str) == "all") & (th["definition"] == "loose")]
        out += section("controls-23", [Panel("Effective number of heads behind each pooled 1% level", kind="table",
                                             table=v[[c for c in ("variant", "level_measured", "n_sparse",
                                                                  "effective_heads", "top_layer", "top_head",
                                                                  "top_share") if c in v.columns]],
                                             caption="effective_heads = 1/Σ share² over the (layer, head) shares of "
                                                     "the sparse rows (2 for two equal heads, 1 for one). Per head: "
                                                     "collapse_heads.csv.")])
    return out


def forward_collapse(T: dict, panel: Build, csv: bool = True) -> list[Section]:
    if "forward_collapse" not in T:
        return []
    return section("controls", [panel("Collapse in the real noisy forward pass", lambda: plots.plot_collapse_vs_noise(
        _escape_variants(T["forward_collapse"]),
        title="Collapse seen in the real forward pass (all layers noised at once) vs the per-layer theory"),
        caption="Measured: sparse rows of the clean run whose argmax moved in the actual noisy run "
                "(downstream layers see upstream noise). Wide pale lines: the theory applied to each layer's clean "
                "scores. A gap is evidence about the model (noise compounds across layers), not a bug.")])


def temperature(T: dict, panel: Build, csv: bool = True) -> list[Section]:
    """The temperature figure, and the same-rows / new-rows split of its collapse levels."""
    tp = T.get("temperature")
    if tp is None:
        return []
    out = section("controls", [panel("Attention temperature", lambda: plots.plot_temperature(_escape_variants(tp)),
                                     caption="Scores multiplied by c before the softmax: sharper attention makes "
                                             "more rows sparse and lets smaller noise flip them.")])
    if "n_same" in tp.columns:
        v = tp[tp["layer"].astype(str) == "all"]
        out += section("controls-23", [Panel("Temperature: the same rows vs the newly sparse rows", kind="table", table=v[[
            "variant", "c", "n_same", "collapse_level_same_loose", "n_new", "collapse_level_new_loose"]],
            caption="For a fixed row, scaling its scores by c > 0 never changes which key wins under multiplicative "
                    "noise (an identity): the rows sparse at c = 1 keep their level; only newly counted rows differ.")])
    return out


def noise_decomposition(T: dict, panel: Build, csv: bool = True) -> list[Section]:
    if "noise_decomposition" not in T:
        return []
    d = T["noise_decomposition"]
    return section("controls-23", [Panel("Accuracy lost to 1% noise, by what is noised", kind="table", table=d[[
        "variant", "level", "mode", "drop", "drop_se", "clean_accuracy"]], caption="drop in points (clean − noisy, "
        "mean ± se over datasets). random: same-size noise x + κ‖x‖u in a random direction; shared: one κ per "
        "token for every head and q, k, v. noise_decomposition.csv.")])


def collapse_consequence(T: dict, panel: Build, csv: bool = True) -> list[Section]:
    if "collapse_consequence" not in T:
        return []
    c = T["collapse_consequence"]
    return section("controls-23", [Panel("Accuracy when a sparse row collapsed vs when none did", kind="table", table=c[[
        "variant", "level", "group", "n_pairs", "accuracy", "accuracy_lo", "accuracy_hi", "drop", "drop_lo",
        "drop_hi"]], caption="Noise on q, k of sparse rows only; (problem, draw) pairs with ≥ 1 collapsed sparse row "
        "vs none; 95% bootstrap intervals over problems. collapse_consequence.csv.")])


def geometry(T: dict, panel: Build, csv: bool = True) -> list[Section]:
    geo = {k[len("geometry_"):]: v for k, v in T.items() if k.startswith("geometry_")}
    if not geo:
        return []
    where = " (every checkpoint: geometry_{}.csv)." if csv else "."
    panels: list[Optional[Panel]] = []
    if "norm_spread" in geo:
        panels.append(panel("Norm spread by layer", lambda: plots.plot_norm_spread(
            _escape_variants(geo["norm_spread"])).update_xaxes(tickmode="linear", dtick=1)))
    if "sparsity_hist" in geo:
        panels.append(panel("Max-attention histograms", lambda: plots.plot_attention_sparsity(
            _escape_variants(geo["sparsity_hist"]))))
    if "sphere_scores" in geo:
        panels.append(panel("Orthogonal spheres", lambda: plots.plot_sphere_scores(
            _escape_variants(geo["sphere_scores"])).update_xaxes(tickmode="linear", dtick=1)))
    if "sphere_pairs" in geo:
        sp, shown = _first_per_variant(geo["sphere_pairs"])
        layer = int(sp["layer"].max())
        panels.append(panel("Component overlap", lambda: plots.plot_component_cosines(_escape_variants(sp), layer),
                            caption=shown + where.format("sphere_pairs")))
    if "subspace_angles" in geo:
        sa, shown = _first_per_variant(geo["subspace_angles"])
        panels.append(panel("Subspace angles", lambda: plots.plot_subspace_angles(_escape_variants(sa)),
                            caption=shown + where.format("subspace_angles")))
    if "interference" in geo:
        panels.append(panel("Direct interference", lambda: plots.plot_interference(_escape_variants(geo["interference"]))))
    if "ellipsoid_axes" in geo:
        panels.append(panel("Norm ellipsoid axes", lambda: plots.plot_ellipsoid_axes(
            _escape_variants(geo["ellipsoid_axes"]))))
    if "summary" in geo:
        panels.append(Panel("Geometry summary", table=geo["summary"], kind="table",
                            caption="Long tables are split into blocks of columns, each repeating the model and "
                                    "layer" + ("; every column is in geometry_summary.csv." if csv else ".")))
    return section("geometry", panels)


# ----------------------------------------------------------------------------- helpers of the panels


def models_finding(card: Optional[pd.DataFrame]) -> str:
    """What THESE models show, from the model card (means over seeds, each score scaling apart):
    the in-distribution spread, which variant is best and worst when extrapolating, and the Pre-Norm
    vs QKV-Norm gap set against the paper's."""
    from interp_norm.report.card import PAPER_PER_TOKEN_ACCURACY, SPLITS
    from interp_norm.core.defaults import VARIANT_LABELS

    if card is None or not len(card) or "attn_norm" not in card.columns:
        return ""
    splits = [sp for sp in SPLITS if f"{sp}_acc" in card.columns and card[f"{sp}_acc"].notna().any()]
    if not splits:
        return ""
    card = card.assign(calibration=card["calibration"] if "calibration" in card.columns else "none")
    acc = card.groupby(["attn_norm", "calibration"], sort=False)[[f"{sp}_acc" for sp in splits]].mean()
    calibrations = list(dict.fromkeys(acc.index.get_level_values(1)))

    def name(key: tuple) -> str:
        a, cal = key
        return VARIANT_LABELS.get(a, str(a)) + (" with Checkpoint calibration" if cal != "none" and len(calibrations) > 1 else "")

    seeds = " (means over seeds)" if card.duplicated(["attn_norm", "calibration"]).any() else ""
    if len(acc) == 1:
        key = acc.index[0]
        return f"This model ({name(key)}), per-token accuracy: " + ", ".join(
            f"{sp} {acc.loc[key, f'{sp}_acc']:.1%}" for sp in splits) + "."
    out = []
    if "id_acc" in acc:
        lo, hi = acc["id_acc"].min(), acc["id_acc"].max()
        out.append(f"In-distribution these models reach {lo:.1%}–{hi:.1%} per-token accuracy{seeds}")
    last = "extrap" if "extrap" in splits else splits[-1]
    col = acc[f"{last}_acc"]
    word = {"extrap": "extrapolating", "interp": "interpolating", "id": "in-distribution"}[last]
    out.append(f"{word}, {name(col.idxmax())} is best ({col.max():.1%}) and {name(col.idxmin())} worst ({col.min():.1%})")
    text = "; ".join(out) + "."
    if last != "extrap":
        return text
    pp, pq = PAPER_PER_TOKEN_ACCURACY["pre"]["extrap"], PAPER_PER_TOKEN_ACCURACY["qkv"]["extrap"]
    for cal in calibrations:
        if ("pre", cal) in col.index and ("qkv", cal) in col.index:
            p, q = col[("pre", cal)], col[("qkv", cal)]
            scaling = (" With the paper's Checkpoint calibration" if cal != "none" else
                       " With 1/√d_head scores" if len(calibrations) > 1 else "")
            same = (q < p) == (pq < pp)
            text += (f"{scaling}{',' if scaling else ''} extrapolating, QKV-Norm is {'worse' if q < p else 'better'} than "
                     f"Pre-Norm here ({q:.1%} vs {p:.1%}): {'agreeing with' if same else 'the opposite of'} the "
                     f"paper ({pq:.1%} vs {pp:.1%}).")
    return text


def _compact_card(card: pd.DataFrame) -> pd.DataFrame:
    """The model card for the page: the architecture in one row (``3L·4H·64d``), one column per
    checkpoint (a field per row), so that it fits the page without horizontal scrolling."""
    shape_cols = ["n_layers", "n_heads", "d_model", "d_head", "d_mlp"]
    card = card.copy()
    if set(shape_cols) <= set(card.columns):
        shape = [f"{r.n_layers}L·{r.n_heads}H·{r.d_model}d" for r in card.itertuples()]
        at = list(card.columns).index("n_layers")
        card = card.drop(columns=shape_cols + [c for c in ("task_terms",) if c in card.columns])
        card.insert(at, "shape", shape)
    if "checkpoint" not in card.columns:
        return card
    fields = [c for c in card.columns if c != "checkpoint"]

    def cell(v: Any, f: str) -> Any:  # accuracies as percentages (the table's formatting keys off columns)
        if (f.endswith("_acc") or f.endswith("_exact")) and isinstance(v, float) and v == v:
            return f"{100 * v:.1f}%"
        return v

    rows = [{"field": f, **{ck: cell(v, f) for ck, v in zip(card["checkpoint"].astype(str), card[f])}} for f in fields]
    return pd.DataFrame(rows, columns=["field", *dict.fromkeys(card["checkpoint"].astype(str))])


def _first_per_variant(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The rows of the first checkpoint of each variant (its other seeds and recipes repeat the picture at the
    size of a page), and a sentence saying which are shown."""
    from interp_norm.report.plots._style import base_variant

    if "variant" not in df.columns:
        return df, ""
    names = list(dict.fromkeys(df["variant"].astype(str)))
    keep = list({(base_variant(v) or v): v for v in reversed(names)}.values())[::-1]
    keep = [v for v in names if v in set(keep)]
    if len(keep) == len(names):
        return df, ""
    return df[df["variant"].astype(str).isin(keep)], ("One checkpoint per variant: " + ", ".join(keep)
                                                      + f" (of {len(names)})")


def _n_head_rows(heads: pd.DataFrame) -> int:
    if not {"layer", "head"} <= set(heads.columns):
        return 4
    h = heads.dropna(subset=["head"])
    return max(1, len(h.drop_duplicates(["layer", "head"]))) if len(h) else 4


def _label_heatmap_axes(fig: go.Figure, row_height: int = 0) -> go.Figure:
    """Axis titles on every patching panel and a label on every row and column (layers, heads, positions)."""
    for tr in fig.data:
        if tr.type != "heatmap":
            continue
        xa = fig.layout["xaxis" + (tr.xaxis or "x")[1:]]
        ya = fig.layout["yaxis" + (tr.yaxis or "y")[1:]]
        x = [str(v) for v in tr.x] if tr.x is not None else []
        y = [str(v) for v in tr.y] if tr.y is not None else []
        heads_on_x = bool(x) and all(v.startswith("H") for v in x)
        xa.update(tickmode="array", tickvals=x, ticktext=x, tickfont=dict(size=TICK_PX),
                  title=dict(text="head" if heads_on_x else "position (token·index)" if x != ["all"] else "",
                             font=dict(size=10)))
        per_head = bool(y) and all("H" in v for v in y)
        ya.update(tickmode="array", tickvals=y, ticktext=y, tickfont=dict(size=TICK_PX),
                  title=dict(text="layer·head" if per_head else "layer", font=dict(size=10)))
    if row_height:
        lay = fig.layout.to_plotly_json()
        rows = len({tuple(v.get("domain", ())) for k, v in lay.items() if k.startswith("yaxis")})
        fig.update_layout(height=max(fig.layout.height or 0, row_height * max(1, rows)))
    return fig


def _full_width(fig: go.Figure) -> go.Figure:
    """Let a figure fill its panel (the circuit drawer sizes itself for notebooks)."""
    fig.update_layout(width=None, autosize=True)
    return fig


def _edge_scale(g: pd.DataFrame) -> str:
    """The circuit graph's edge-width scale, from its scores."""
    if "score" not in g.columns or not g["score"].notna().any():
        return "All edges drawn at one width (no scores)."
    a = g["score"].abs()
    return (f"Line width ∝ |EAP-IG score|: the thickest edge has |score| {a.max():.3g}, the thinnest {a.min():.3g} "
            f"(median {a.median():.3g}). Colour: the input the edge enters (q, k, v, MLP, logits).")


def _explorer(patterns: pd.DataFrame) -> go.Figure:
    df = patterns.copy()
    df["model"] = df["model"].astype(str)
    return plots.plot_attention_explorer(df)


def _template_labels(pt: pd.DataFrame) -> Optional[list[str]]:
    if "template" not in pt.columns:
        return None
    t = pt["template"].dropna()
    return list(str(t.iloc[0])) if len(t) and str(t.iloc[0]) else None

