"""The dashboard section comparing a real (Hugging Face) model's layers beside ours.

Reads two report tables written by ``interp-norm dashboard`` when it is given a Hugging Face model:
``real_layers`` (per model and layer: norm spread, sparse fraction, ... from
:func:`~interp_norm.geometry.geometry_summary` of :func:`~interp_norm.geometry.bridge_geometry`)
and ``real_anatomy`` (:meth:`~interp_norm.anatomy.Anatomy.table`). Our models' per-layer numbers
come from the report's own ``geometry_*`` tables when they are there. Layers are placed on a
relative depth axis (0 = first layer, 1 = last) because the models differ in depth.
"""

from __future__ import annotations

from typing import Any, Optional

import pandas as pd
import plotly.graph_objects as go

from interp_norm.report.dashboard.page import Panel, Section, _esc

__all__ = ["real_model_section", "layer_comparison", "display_name", "measured_on"]

#: (column, axis title) of the per-layer figures.
METRICS = (("frac_sparse", "share of sparse attention rows (max ≥ 0.95)"),
           ("spread", "norm spread (90% of attended norms within ±spread)"))


def layer_comparison(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per (model, layer): ``model``, ``source`` ("ours"/"hugging face"), ``layer``,
    ``depth`` (layer / (n_layers − 1)) and the :data:`METRICS` columns."""
    frames = []
    real = tables.get("real_layers")
    if real is not None and len(real):
        frames.append(real.assign(source="hugging face", model=real["model"].map(display_name)))
    ours = _our_layers(tables)
    if ours is not None:
        frames.append(ours.assign(source="ours"))
    if not frames:
        return pd.DataFrame(columns=["model", "source", "layer", "depth", *[m for m, _ in METRICS]])
    df = pd.concat(frames, ignore_index=True)
    df = df[df["spread"].notna() | df["frac_sparse"].notna()].copy()
    top = df.groupby("model")["layer"].transform("max").clip(lower=1)
    df["depth"] = df["layer"] / top
    return df[["model", "source", "layer", "depth", *[m for m, _ in METRICS]]].reset_index(drop=True)


def measured_on(real: Optional[pd.DataFrame]) -> str:
    """What the Hugging Face models read, from ``real_layers``' ``input`` column: "on text windows", or
    "on random token ids" naming the models without a tokenizer (tables without the column: text)."""
    if real is None or "input" not in real.columns:
        return "on text windows"
    by_model = real.assign(model=real["model"].map(display_name)).groupby("model", sort=False)["input"].first()
    random = [m for m, v in by_model.items() if v != "text"]
    if not random:
        return "on text windows"
    names = ", ".join(random)
    if len(random) == len(by_model):
        return f"on random token ids ({names}: no tokenizer, so no text)"
    return f"on text windows ({names}: random token ids, no tokenizer)"


def display_name(spec: Any) -> str:
    """A Hugging Face model's name for the page: a local folder by its own name (``tiny-gpt2``, not
    the path it was loaded from), a hub name as it is (``Qwen/Qwen3-0.6B``)."""
    from pathlib import Path

    s = str(spec)
    try:
        return Path(s).name if ("/" in s or "\\" in s) and Path(s).exists() else s
    except OSError:
        return s


def _our_layers(tables: dict[str, pd.DataFrame]) -> Optional[pd.DataFrame]:
    ns, ss = tables.get("geometry_norm_spread"), tables.get("geometry_sparsity_summary")
    if ns is None or ss is None or "variant" not in ns.columns:
        return None
    ns = ns[ns["head"].isna()][["variant", "layer", "spread"]]
    ss = ss[ss["layer"].notna()][["variant", "layer", "frac_sparse"]]
    out = ns.merge(ss, on=["variant", "layer"], how="outer").rename(columns={"variant": "model"})
    out["layer"] = out["layer"].astype(int)
    return out


def _figure(df: pd.DataFrame, column: str, title: str) -> go.Figure:
    """One line per model along relative depth: ours in their variant's colour and seed's dash and
    marker, Hugging Face models in colours no variant uses (:func:`~interp_norm.report.plots._style.colour_map`), dashed."""
    from interp_norm.report.plots._style import colour_map, line_style

    hf = colour_map(df.loc[df["source"] != "ours", "model"])
    fig = go.Figure()
    for (model, source), g in df.groupby(["model", "source"], sort=False):
        g = g.sort_values("depth")
        if source == "ours":
            st = line_style(model, width=2, size=7)
        else:
            st = line_style(model, width=2.5, size=8, colour=hf[str(model)])
            st["line"]["dash"] = "dash"
            st["marker"]["symbol"] = "diamond-wide"
        fig.add_trace(go.Scatter(x=g["depth"], y=g[column], mode="lines+markers", name=_esc(model) + ("" if source == "ours"
                                 else " (Hugging Face)"), **st,
                                 hovertemplate=f"{_esc(model)}<br>layer %{{customdata}}<br>%{{y:.2%}}<extra></extra>",
                                 customdata=g["layer"]))
    fig.update_layout(title=title, xaxis_title="relative depth (0 = first layer, 1 = last)",
                      yaxis_title=dict(frac_sparse="sparse rows", spread="spread").get(column, column),
                      height=420, legend_title="model")
    fig.update_yaxes(tickformat=".2~%", rangemode="tozero")
    return fig


def real_model_section(report: Any, panel: Any) -> Optional[Section]:
    """The section, or None when the report has no real-model tables. ``panel(title, build)`` is the
    dashboard's figure builder (a failing figure becomes a note)."""
    T = report.tables
    if "real_layers" not in T and "real_anatomy" not in T:
        return None
    ours = len(getattr(report, "checkpoints", ())) > 0
    s = Section("Real models beside ours" if ours else "Hugging Face models",
                "Hugging Face models (through TransformerLens bridges) measured like ours: the share of "
                f"sparse attention rows and the norm spread per layer, {measured_on(T.get('real_layers'))} instead of addition "
                "problems (ours: their variant's colour; Hugging Face models: dashed, diamonds, colours no variant uses). The anatomy says where each model normalises "
                "q, k and v: GPT-2/Llama are Pre-Norm, Qwen3/OLMo-2 QK-Norm, Gemma 4 QKV-Norm.", anchor="real-models")
    df = layer_comparison(T)
    if len(df):
        for column, title in METRICS:
            s.panels.append(panel(title[0].upper() + title[1:], lambda c=column, t=title: _figure(df, c, t)))
    if "real_anatomy" in T:
        cols = [c for c in ("model", "architecture", "layer", "placement", "n_heads", "n_kv_heads", "d_head",
                            "pre_norm", "q_norm", "k_norm", "v_norm", "score_scale", "rope", "sliding_window",
                            "scores_hook", "pattern_error") if c in T["real_anatomy"].columns]
        anatomy = T["real_anatomy"].assign(model=T["real_anatomy"]["model"].map(display_name)) if "model" in cols else T["real_anatomy"]
        s.panels.append(Panel("Attention anatomy", table=anatomy[cols], kind="table",
                              caption="Per layer: where the norms sit, their kind/axis/gain, grouped k/v heads, "
                                      "the score scale, and max |softmax(scores rebuilt from q, k) − pattern|."))
    s.panels = [p for p in s.panels if p is not None]
    return s
