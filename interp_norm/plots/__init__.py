"""One function per figure: DataFrames in, plotly figures out (the dashboard and the notebooks share them).

Figures only draw tables that analyses computed; nothing here runs a model. By concern:

* :mod:`~interp_norm.plots.models` -- model card, accuracy per split, training curves;
* :mod:`~interp_norm.plots.attention` -- attention patterns and the attention explorer;
* :mod:`~interp_norm.plots.circuits` -- patching heatmaps, the one circuit drawer, MIB faithfulness;
* :mod:`~interp_norm.plots.noise` -- accuracy and circuit collapse under norm noise;
* :mod:`~interp_norm.plots.seeds` -- variant A vs B over seeds, dot-and-range (the seed tables);
* :mod:`~interp_norm.plots.geometry` -- norm spread, spheres, subspaces, interference, ellipsoids.

Everything is re-exported here (``from interp_norm import plots``). Two table builders that used
to live here are still reachable under their old names: :func:`model_card` (now
:mod:`interp_norm.card`) and :func:`attention_patterns`, which runs the model and so lives in
:mod:`interp_norm.circuits.attention_maps` (loaded on first use).

Labels that come from users (checkpoint names, problem strings) are HTML-escaped before they
reach plotly, which would otherwise interpret tags like ``<b>`` inside them.
"""

from __future__ import annotations

from typing import Any

from interp_norm.card import PAPER_PER_TOKEN_ACCURACY, model_card
from interp_norm.plots._style import SPLITS, VARIANT_LABELS, escape, member_style, variant_colour, variant_label
from interp_norm.plots.attention import plot_attention_explorer, plot_attention_pattern, plot_attention_patterns
from interp_norm.plots.circuits import (
    draw_circuit,
    plot_attention_map,
    plot_attribution_agreement,
    plot_attribution_scatter,
    plot_circuit_graph,
    plot_faithfulness,
    plot_faithfulness_bars,
    plot_patching_heatmap,
)
from interp_norm.plots import geometry
from interp_norm.plots.geometry import *  # noqa: F401,F403  (its __all__: the geometry figures, listed once there)
from interp_norm.plots.models import plot_accuracy_by_split, plot_model_card, plot_training_curves
from interp_norm.plots.noise import plot_accuracy_vs_noise, plot_collapse_thresholds, plot_collapse_vs_noise, plot_temperature
from interp_norm.plots.seeds import plot_matched_id, plot_seed_comparisons

__all__ = [
    "PAPER_PER_TOKEN_ACCURACY",
    "VARIANT_LABELS",
    "SPLITS",
    "escape",
    "variant_label",
    "variant_colour",
    "member_style",
    # model card
    "model_card",
    "plot_model_card",
    "plot_accuracy_by_split",
    "plot_training_curves",
    # attention
    "attention_patterns",
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


def __getattr__(name: str) -> Any:
    # attention_patterns runs a model: it lives with the analyses and is loaded only when asked for
    if name == "attention_patterns":
        from interp_norm.circuits.attention_maps import attention_patterns

        return attention_patterns
    raise AttributeError(f"module 'interp_norm.plots' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
