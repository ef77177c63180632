"""Norm noise: hooks that jitter L2 norms, accuracy under noise, and circuit collapse.

Menary et al. (2024) model Pre-Norm interference as multiplicative noise on the L2 norms of
queries, keys and values (§2.3). This package turns that model into instruments, one
implementation for every model (ours and TransformerLens bridges, asked through :mod:`interp_norm.anatomy`):

* :mod:`~interp_norm.noise.kernels` — the one seeded generator, the κ streams and the factor a norm
  leaves of noise before it; κ comes from :func:`interp_norm.theory.sample_kappa`, the one sampler.
* :mod:`~interp_norm.noise.norm_noise` — :class:`NormNoise`, the hooks (a context manager or a hook
  list) on any model; its per-head core :class:`HeadNoise` (:mod:`~interp_norm.noise.head_noise`)
  places the noise through the model's anatomy.
* :mod:`~interp_norm.noise.bridge_collapse` — :func:`bridge_collapse`: the collapse protocol on a
  TransformerBridge, rebuilt from cached q and k in blocks (real models are large).
* :mod:`~interp_norm.noise.accuracy` — :func:`run_noise`: per-token accuracy vs noise level, all
  layers at once, mean ± standard error over datasets, with the paper's sparse-only /
  non-sparse-only variants.
* :mod:`~interp_norm.noise.collapse` — :func:`run_collapse`: the paper's circuit-collapse protocol
  from one clean cache, options in a :class:`CollapseSpec`, the theory's prediction beside every
  measured rate; :func:`collapse_thresholds` gives the noise level where 1% of sparse rows collapse.
  ``measured`` vs ``predicted`` there is a check of the code (a Monte Carlo of the event whose
  probability the theory integrates exactly, on the same clean scores).
* :mod:`~interp_norm.noise.forward` — :func:`measure_forward_collapse`: collapse seen in the model's
  real noisy forward pass (all layers noised, downstream effects included) beside the per-layer
  prediction: a test of the theory.
* :mod:`~interp_norm.noise.temperature` — :func:`temperature_sweep`: collapse level and sparse-row
  fraction vs a score multiplier c (temperature 1/c).

* :mod:`~interp_norm.noise.head_collapse` — :func:`run_collapse_with_heads`: the 1% collapse level per
  head, each head's share of the sparse rows and the effective number of heads behind a pooled level.
* :mod:`~interp_norm.noise.decomposition` — :func:`run_noise_decomposition`: the accuracy drop
  under noise on q, k, v alone, all, same-size noise in a random direction, one κ per token.
* :mod:`~interp_norm.noise.consequence` — :func:`run_collapse_consequence`: accuracy of problems
  in which a sparse row collapsed vs those in which none did, at the same noise, with intervals.

Controls: ``noised="nonsparse_matched"`` in :func:`run_noise` noises as many non-sparse rows as
there are sparse ones (:func:`matched_row_gates`), so sparse-only vs non-sparse-only is a fair contrast.

Every function returns tensors or DataFrames; nothing here prints, plots or writes files.
"""

from interp_norm.core.defaults import NOISED_ROWS, VARIANT_LABELS
from interp_norm.noise._validate import TARGETS
from interp_norm.core.defaults import PLACEMENTS
from interp_norm.noise.accuracy import MATCHED, NOISE_GROUPS, AccuracyNoiseSpec, accuracy_under_noise, clean_row_gates, matched_row_gates, noised_row_counts, run_noise
from interp_norm.core.defaults import DEFAULT_NOISE_LEVELS
from interp_norm.noise.collapse import CollapseSpec, CollapseTableSpec, LayerCollapse, collapse_decisions, collapse_from_scores, collapse_noise_draws, collapse_thresholds, measure_collapse, run_collapse
from interp_norm.core.defaults import DEFAULT_COLLAPSE_LEVELS
from interp_norm.noise.consequence import (
    CONSEQUENCE_LEVELS,
    ConsequenceSpec,
    bootstrap_ratios,
    cluster_bootstrap,
    collapse_consequence,
    percentile_interval,
    run_collapse_consequence,
)
from interp_norm.noise.decomposition import (
    DECOMPOSITION_LEVELS,
    DECOMPOSITION_MODES,
    DecompositionSpec,
    noise_decomposition,
    run_noise_decomposition,
)
from interp_norm.noise.forward import forward_collapse_decisions, measure_forward_collapse, run_forward_collapse
from interp_norm.noise.norm_noise import NoiseControls, NormNoise, norm_noise_hooks
from interp_norm.noise.kernels import effective_factor, unit_noise
from interp_norm.noise.head_noise import DrawSpec, HeadNoise, seeded_sampler
from interp_norm.noise.kernels import effective_factors, seeded_generator
from interp_norm.noise.bridge_collapse import BridgeCollapseSpec, bridge_collapse, collapse_chunks, collapse_kappa
from interp_norm.noise.head_collapse import (
    beside_thresholds,
    effective_heads,
    head_collapse_table,
    head_summary,
    measure_head_collapse,
    run_collapse_with_heads,
    run_head_collapse,
)
from interp_norm.noise.temperature import DEFAULT_MULTIPLIERS, run_temperature_sweep, temperature_sweep

__all__ = [
    "TARGETS",
    "PLACEMENTS",
    "NOISED_ROWS",
    "DEFAULT_NOISE_LEVELS",
    "DEFAULT_COLLAPSE_LEVELS",
    "VARIANT_LABELS",
    "NormNoise",
    "NoiseControls",
    "HeadNoise",
    "DrawSpec",
    "BridgeCollapseSpec",
    "AccuracyNoiseSpec",
    "CollapseTableSpec",
    "DecompositionSpec",
    "ConsequenceSpec",
    "seeded_sampler",
    "seeded_generator",
    "effective_factors",
    "bridge_collapse",
    "collapse_chunks",
    "collapse_kappa",
    "norm_noise_hooks",
    "unit_noise",
    "effective_factor",
    "clean_row_gates",
    "accuracy_under_noise",
    "run_noise",
    "CollapseSpec",
    "collapse_from_scores",
    "collapse_noise_draws",
    "LayerCollapse",
    "collapse_decisions",
    "measure_collapse",
    "run_collapse",
    "collapse_thresholds",
    # controls: matched-count noise, collapse in the forward pass, the temperature sweep
    "MATCHED",
    "NOISE_GROUPS",
    "matched_row_gates",
    "noised_row_counts",
    "forward_collapse_decisions",
    "measure_forward_collapse",
    "run_forward_collapse",
    "DEFAULT_MULTIPLIERS",
    "temperature_sweep",
    "run_temperature_sweep",
    # controls: collapse per head, the noise-drop decomposition, the consequence of collapse
    "effective_heads",
    "head_collapse_table",
    "head_summary",
    "beside_thresholds",
    "measure_head_collapse",
    "run_head_collapse",
    "run_collapse_with_heads",
    "DECOMPOSITION_LEVELS",
    "DECOMPOSITION_MODES",
    "noise_decomposition",
    "run_noise_decomposition",
    "CONSEQUENCE_LEVELS",
    "bootstrap_ratios",
    "percentile_interval",
    "cluster_bootstrap",
    "collapse_consequence",
    "run_collapse_consequence",
]
