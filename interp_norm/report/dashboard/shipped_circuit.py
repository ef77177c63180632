"""Panels of "The addition circuit" from the shipped set's kept tables (:mod:`interp_norm.report.shipped_circuit`):
per variant the circuit's size, its cells by role, layer and answer position, the size-vs-accuracy
curves, and noise on the circuit vs on a matched control, with the seed tables' intervals.

Head indices mean nothing across seeds, so cells are summed over heads: a variant's map shows, per
(layer, answer position), the circuit cells a seed has there on average, by role family.
"""

from __future__ import annotations

from typing import Callable, Optional

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from interp_norm.report.dashboard.page import Panel
from interp_norm.report.plots._style import bar_style, escape, line_style, variant_label
from interp_norm.report.shipped_circuit import SOURCE

ARMS = ("pre", "qkv", "pre-cal", "qkv-cal")
#: Noise arms in the order shown: the matched pair, then the unmatched-kind reference.
ROWS = ("circuit", "matched outside", "circuit (position-matched)", "matched outside (same position)",
        "circuit (every sparse row)", "matched outside (layer only)")
_SLOTS = ("sign", "10^4", "thousands", "hundreds", "tens", "units", "end")


def arm_of(checkpoint: str) -> str:
    return str(checkpoint).split("-s")[0]


def arm_label(arm: str) -> str:
    """``Pre-Norm`` / ``Pre-Norm (pre-cal)``: the variant with the recipe, as the other figures label it."""
    return variant_label(arm, arm.split("-")[0])


def _fmt(m: float, lo: float, hi: float) -> str:
    return "—" if pd.isna(m) else f"{m:.1f}" if pd.isna(lo) else f"{m:.1f} [{lo:.1f}, {hi:.1f}]"


def verification_view(v: pd.DataFrame) -> pd.DataFrame:
    """Per arm and ablation: circuit size and what it keeps, mean over seeds with every seed's share."""
    v = v.assign(arm=v["checkpoint"].map(arm_of))
    rows = []
    for (arm, abl), g in v.groupby(["arm", "ablation"], sort=False):
        rows.append({"variant": arm_label(str(arm)), "ablation": abl, "seeds": len(g),
                     "cells at 90% (share, %)": f"{100 * g['share_of_cells'].mean():.1f}",
                     "per seed (%)": ", ".join(f"{100 * x:.0f}" for x in g["share_of_cells"]),
                     "accuracy kept": f"{g['accuracy_kept'].mean():.2f}", "faithfulness": f"{g['faithfulness'].mean():.2f}"})
    return pd.DataFrame(rows)


def plot_role_map(cells: pd.DataFrame) -> go.Figure:
    """Per variant a heatmap: circuit cells per seed at each (layer, answer position), summed over heads;
    the hover lists them by role family."""
    cells = cells.assign(arm=cells["checkpoint"].map(arm_of))
    arms = [a for a in ARMS if a in set(cells["arm"])]
    slots = [s for s in _SLOTS if s in set(cells["position"])] + sorted(set(cells["position"]) - set(_SLOTS))
    layers = sorted(set(cells["layer"]))
    fig = make_subplots(rows=1, cols=len(arms), subplot_titles=[escape(arm_label(a)) for a in arms],
                        shared_yaxes=True, horizontal_spacing=0.04)
    zmax = 0.0
    for i, arm in enumerate(arms):
        c = cells[cells["arm"] == arm]
        seeds = c["checkpoint"].nunique()
        fam = c.groupby(["layer", "position", "family"]).size() / seeds
        z = [[float(fam.loc[(l, s)].sum()) if (l, s) in fam.index.droplevel(2) else 0.0 for s in slots] for l in layers]
        text = [["<br>".join(f"{escape(f)}: {n:.1f}" for f, n in fam.loc[(l, s)].items())
                 if (l, s) in fam.index.droplevel(2) else "none" for s in slots] for l in layers]
        zmax = max(zmax, max(map(max, z)))
        fig.add_trace(go.Heatmap(z=z, x=slots, y=[f"layer {l}" for l in layers], text=text, coloraxis="coloraxis",
                                 hovertemplate="%{y}, %{x}: %{z:.1f} cells per seed<br>%{text}<extra>"
                                               + escape(arm_label(arm)) + "</extra>"), row=1, col=i + 1)
    fig.update_layout(coloraxis=dict(colorscale="Blues", cmin=0, cmax=zmax, colorbar_title="cells / seed"),
                      template="plotly_white", height=340)
    fig.update_xaxes(title_text="answer position")
    return fig


def plot_shipped_curves(curve: pd.DataFrame) -> go.Figure:
    """Per-token accuracy kept against the share of cells kept, one line per checkpoint (variant colour,
    seed dash)."""
    fig = go.Figure()
    for name, g in curve.groupby("checkpoint", sort=False):
        label = variant_label(str(name), arm_of(str(name)).split("-")[0])
        fig.add_trace(go.Scatter(x=g["share_of_cells"], y=g["accuracy_kept"], mode="lines", name=escape(label),
                                 legendgroup=arm_of(str(name)), **{k: v for k, v in line_style(label, width=1.5).items()
                                                                   if k == "line"},
                                 hovertemplate="%{x:.2f} of cells: %{y:.3f}<extra>" + escape(label) + "</extra>"))
    fig.add_hline(y=0.9, line_dash="dot")
    fig.update_layout(xaxis_title="cells kept, in order of necessity (share of all cells)",
                      yaxis_title="share of full accuracy kept", template="plotly_white")
    return fig


def plot_noise_cost(cost: pd.DataFrame) -> go.Figure:
    """Per noise level and variant, the accuracy each row set's noise costs: a dot per seed (mean over
    draws), a bar for the mean over seeds."""
    cost = cost.assign(arm=cost["checkpoint"].map(arm_of))
    per = cost.groupby(["level", "arm", "rows", "checkpoint"], sort=False)["drop"].mean().reset_index()
    levels = sorted(set(per["level"]))
    fig = make_subplots(rows=len(levels), cols=1, subplot_titles=[f"q/k noise {x:.0%}" for x in levels],
                        shared_xaxes=True, vertical_spacing=0.12)
    for r, level in enumerate(levels):
        at = per[per["level"] == level]
        for arm in [a for a in ARMS if a in set(at["arm"])]:
            g = at[at["arm"] == arm]
            label = arm_label(arm)
            x = [[label] * len(ROWS), list(ROWS)]
            means = g.groupby("rows")["drop"].mean().reindex(ROWS)
            fig.add_trace(go.Bar(x=x, y=means.to_numpy(), name=escape(label), legendgroup=arm, showlegend=r == 0,
                                 marker=bar_style(label), opacity=0.5,
                                 hovertemplate="%{x}: mean %{y:.2f} points<extra></extra>"), row=r + 1, col=1)
            fig.add_trace(go.Scatter(x=[[label] * len(g), list(g["rows"])], y=g["drop"], mode="markers",
                                     marker=line_style(label, size=6)["marker"], legendgroup=arm,
                                     showlegend=False, text=g["checkpoint"],
                                     hovertemplate="%{text}: %{y:.2f} points<extra></extra>"), row=r + 1, col=1)
    fig.update_yaxes(title_text="accuracy lost (points)")
    fig.update_layout(template="plotly_white", barmode="overlay", height=360 * len(levels))
    return fig


def tests_view(within: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({"variant": within["arm"].map(arm_label), "quantity": within["quantity"],
                         "mean [95% CI] (points)": [_fmt(*x) for x in zip(within["mean"], within["ci_lo"], within["ci_hi"])],
                         "p (two-sided)": within["p_value"].map(lambda p: "—" if pd.isna(p) else f"{p:.2g}"),
                         "p (circuit > matched)": within["p_greater"].map(lambda p: "—" if pd.isna(p) else f"{p:.2g}"),
                         "Holm": within["p_holm"].map(lambda p: "—" if pd.isna(p) else f"{p:.2g}"),
                         "per seed": within["values"]})


def comparisons_view(comp: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({"scaling": comp["scaling"], "quantity": comp["comparison"] + " (" + comp["unit"] + ")",
                         "Pre-Norm": [_fmt(*x) for x in zip(comp["mean_a"], comp["ci_lo_a"], comp["ci_hi_a"])],
                         "QKV-Norm": [_fmt(*x) for x in zip(comp["mean_b"], comp["ci_lo_b"], comp["ci_hi_b"])],
                         "Pre − QKV": [_fmt(*x) for x in zip(comp["diff"], comp["diff_lo"], comp["diff_hi"])],
                         "p": comp["p_value"].map(lambda p: "—" if pd.isna(p) else f"{p:.2g}"),
                         "Holm": comp["p_holm"].map(lambda p: "—" if pd.isna(p) else f"{p:.2g}")})


def shipped_panels(T: dict, panel: Callable, csv: bool = True) -> list[Optional[Panel]]:
    """The section's panels from the ``shipped_circuit_*`` tables (none if they are absent)."""
    if "shipped_circuit_verification" not in T:
        return []
    src = f" Source: {SOURCE}" + ("; copied beside this page as shipped_circuit_*.csv." if csv else ".")
    out: list[Optional[Panel]] = [
        Panel("Shipped models: circuit size and verification", kind="table",
              table=verification_view(T["shipped_circuit_verification"]),
              caption="Smallest set of (layer, head, answer position) cells keeping 90% of per-token accuracy with "
                      "every other cell resample-ablated, as a share of all 60 cells (3 layers × 4 heads × 5 answer positions); mean and zero ablation of the "
                      "same cells beside it (accuracy kept, faithfulness: logit-difference share recovered)." + src)]
    if "shipped_circuit_cells" in T:
        out.append(panel("Shipped models: circuit cells by layer and answer position",
                          lambda: plot_role_map(T["shipped_circuit_cells"]),
                          caption="Circuit cells per seed at each layer and answer position (summed over heads: head "
                                  "indices differ between seeds); hover for the role families (a cell 'reads X' when "
                                  "≥ 60% of its attention is on class X, else 'spread')." + src))
    if "shipped_circuit_curve" in T:
        out.append(panel("Shipped models: size vs accuracy", lambda: plot_shipped_curves(T["shipped_circuit_curve"]),
                          caption="One line per checkpoint: cells added in order of single-cell necessity, every other "
                                  "cell resample-ablated; dotted: 90%." + src))
    if "shipped_circuit_noise_cost" in T:
        out.append(panel("Shipped models: noise on the circuit vs a matched control",
                          lambda: plot_noise_cost(T["shipped_circuit_noise_cost"]),
                          caption="q/k norm noise on the circuit's sparse rows only ('circuit') vs on as many sparse "
                                  "answer rows outside it in the same layer ('matched outside'; where a layer has too "
                                  "few, as many circuit rows as it has); the same matched on the answer position too "
                                  "('position-matched' vs 'same position': other heads' rows at the circuit's "
                                  "positions); for reference every sparse circuit row, and a control matched on the "
                                  "layer only (question and answer rows). Bars: mean over seeds; dots: seeds (mean "
                                  "over 8 draws)." + src))
    if "shipped_circuit_noise_cost_seeds" in T:
        out.append(Panel("Shipped models: circuit minus matched control, over seeds", kind="table",
                         table=tests_view(T["shipped_circuit_noise_cost_seeds"]),
                         caption="Student-t 95% interval over 6 seeds, t-test against 0; Holm over the circuit "
                                 "tables' family (docs/findings-tables.md)." + src))
    if "shipped_circuit_comparisons" in T:
        out.append(Panel("Shipped models: Pre-Norm vs QKV-Norm circuits", kind="table",
                         table=comparisons_view(T["shipped_circuit_comparisons"]),
                         caption="Mean [Student-t 95%] per variant over 6 seeds, difference [Welch 95%], exact "
                                 "permutation p, Holm over the same family." + src))
    return out


__all__ = ["comparisons_view", "plot_noise_cost", "plot_role_map", "plot_shipped_curves", "shipped_panels",
           "tests_view", "verification_view"]
