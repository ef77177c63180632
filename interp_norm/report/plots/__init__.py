"""One function per figure: DataFrames in, plotly figures out (the dashboard and the notebooks share them).

Figures only draw tables that analyses computed; nothing here runs a model. By concern:

* :mod:`~interp_norm.report.plots.models` -- model card, accuracy per split, training curves;
* :mod:`~interp_norm.report.plots.attention` -- attention patterns and the attention explorer;
* :mod:`~interp_norm.report.plots.circuits` -- patching heatmaps, the one circuit drawer, MIB faithfulness;
* :mod:`~interp_norm.report.plots.attribution_error` -- attribution's error against exact patching, split;
* :mod:`~interp_norm.report.plots.noise` -- accuracy and circuit collapse under norm noise;
* :mod:`~interp_norm.report.plots.seeds` -- variant A vs B over seeds, dot-and-range (the seed tables);
* :mod:`~interp_norm.report.plots.geometry` -- norm spread, spheres, subspaces, interference, ellipsoids.

Every figure is importable from here (``from interp_norm.report import plots``).

Labels that come from users (checkpoint names, problem strings) are HTML-escaped before they
reach plotly, which would otherwise interpret tags like ``<b>`` inside them.
"""

from __future__ import annotations

from interp_norm.report.card import PAPER_PER_TOKEN_ACCURACY
from interp_norm.report.plots._style import SPLITS, VARIANT_LABELS, escape, member_style, variant_colour, variant_label
from interp_norm.report.plots.attribution_error import plot_error_budget
from interp_norm.report.plots.attention import plot_attention_explorer, plot_attention_pattern, plot_attention_patterns
from interp_norm.report.plots.circuits import (
    draw_circuit,
    plot_attention_map,
    plot_attribution_agreement,
    plot_attribution_scatter,
    plot_circuit_graph,
    plot_faithfulness,
    plot_faithfulness_bars,
    plot_patching_heatmap,
)
from interp_norm.report.plots import geometry
from interp_norm.report.plots.geometry import *  # noqa: F401,F403  (its __all__: the geometry figures, listed once there)
from interp_norm.report.plots.models import plot_accuracy_by_split, plot_model_card, plot_training_curves
from interp_norm.report.plots.noise import plot_accuracy_vs_noise, plot_collapse_thresholds, plot_collapse_vs_noise, plot_temperature
from interp_norm.report.plots.seeds import plot_matched_id, plot_seed_comparisons

__all__ = [
    "PAPER_PER_TOKEN_ACCURACY",
    "VARIANT_LABELS",
    "SPLITS",
    "escape",
    "variant_label",
    "variant_colour",
    "member_style",
    # model card
    "plot_model_card",
    "plot_accuracy_by_split",
    "plot_training_curves",
    # attention
    "plot_attention_pattern",
    "plot_attention_patterns",
    "plot_attention_explorer",
    # circuits
    "plot_patching_heatmap",
    "plot_circuit_graph",
    "draw_circuit",
    "plot_faithfulness",
    "plot_faithfulness_bars",
    "plot_attribution_agreement",
    "plot_attribution_scatter",
    "plot_attention_map",
    "plot_error_budget",
    # noise
    "plot_accuracy_vs_noise",
    "plot_collapse_vs_noise",
    "plot_collapse_thresholds",
    "plot_temperature",
    # variant A vs B over seeds
    "plot_seed_comparisons",
    "plot_matched_id",
    # geometry
    *geometry.__all__,
]



def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
