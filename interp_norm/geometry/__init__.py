"""Representation geometry: what Pre-Norm asks of the residual stream, and whether models comply.

Menary et al. 2024, arXiv 2406.17837, Theorem 2: under Pre-Norm a head sees ``x/|x|``, so semantic
subspaces stay independent only if they are **orthogonal spheres** (each component of constant
norm, components mutually orthogonal); otherwise they interfere through the shared norm. Under
QKV-Norm linear independence suffices (Theorem 3). This package measures that geometry on a model
and an input batch and returns pandas DataFrames (figures live in :mod:`interp_norm.report.plots`).
One module per question:

* :mod:`.spread` — :func:`norm_spread`: the paper's attended-embedding norm spread (its
  experiments: "90% within ±20%").
* :mod:`.sparsity` — :func:`attention_sparsity`, :func:`sparsity_summary`: histogram of the max
  attention per distribution (paper appendix), shares above/below the sparse thresholds.
* :mod:`.subspaces` — :func:`residual_components`, :func:`subspaces`, :func:`principal_angles`,
  :func:`subspace_angles`: semantic subspaces from the residual decomposition and from what each
  head reads, and the angles between them.
* :mod:`.spheres` — :func:`sphere_structure`, :func:`orthogonal_spheres`: per-component norm
  constancy, pairwise orthogonality and one orthogonal-spheres score per layer (Theorem 2's two conditions).
* :mod:`.interference` — :func:`direct_interference`: beyond the paper, change one subspace's
  component and measure how far the attention of each head moves.
* :mod:`.ellipsoid` — :func:`norm_ellipsoid`, :func:`ellipsoid_table`, :func:`ellipsoid_membership`:
  Riechers's LayerNorm hyperellipsoid (Riechers 2024) and its RMSNorm analogue, checked on cached outputs.
* :mod:`.bridge` — the same analyses on a TransformerLens 4 ``TransformerBridge`` (GPT-2, Qwen3,
  OLMo-2, Gemma 4 ...): :func:`bridge_norms` finds every norm (attention q/k/v norms included) from
  the anatomy and the module tree; ``norm_spread``, ``max_attention``/``attention_sparsity`` and the
  ``ellipsoid_*`` functions accept a bridge; :func:`bridge_geometry` is its one call.
* :mod:`.run` — :func:`run_geometry`, :func:`compare_geometry`, :func:`geometry_summary`: one call
  for the CLI, dashboard and README, on any model; it picks the backend once (:mod:`.run_ours` for
  ours, :mod:`.run_bridge` for a bridge).

``_common`` holds what they share (model check, token input, the valid-token mask, the one cached
forward pass). Every analysis that runs the model takes ``cache=``: an ActivationCache of the same
tokens holding :func:`geometry_hook_names` is reused instead of a new forward pass. Hook names come
from :mod:`interp_norm.core.hook_names`; weights are read through the model's own steps (``attn.project``,
the update Checkpoints), so models with ``calibration="paper"`` are measured as they compute.

Token conventions: position 0 holds ``[`` and is excluded by default (``exclude_bos``), as the paper
does for the norm spread and the sparsity histogram; padding ``*`` is always excluded. Pooled rows in
the tables carry ``<NA>`` in the ``layer``/``head`` column they pool over.
"""

from __future__ import annotations

from interp_norm.geometry._common import TokensLike, valid_mask
from interp_norm.geometry.bridge import BridgeNorm, bridge_norms, bridge_tokens
from interp_norm.geometry.ellipsoid import (
    NormEllipsoid,
    ellipsoid_axes,
    ellipsoid_membership,
    ellipsoid_table,
    module_ellipsoids,
    norm_ellipsoid,
    norm_hook_names,
    norm_modules,
)
from interp_norm.geometry.interference import (
    AddOrthogonal,
    Intervention,
    ScaleComponent,
    default_interventions,
    direct_interference,
)
from interp_norm.geometry.run import bridge_geometry, compare_geometry, geometry_hook_names, geometry_summary, run_geometry
from interp_norm.geometry.sparsity import attention_sparsity, max_attention, sparsity_histogram, sparsity_summary
from interp_norm.geometry.spheres import SpheresSpec, orthogonal_spheres, sphere_structure
from interp_norm.geometry.spread import attended_norms, norm_spread, summarize_norm_spread, weighted_quantile
from interp_norm.geometry.subspaces import (
    component_subspaces,
    effective_read_matrices,
    head_read_fractions,
    head_read_subspaces,
    orthonormal_basis,
    positional_subspace,
    principal_angles,
    residual_components,
    subspace_angles,
    subspaces,
    token_subspace,
)

# Also importable from here, as before the split: TokensLike, Intervention (type aliases) and
# norm_hook_names (new: the norm hooks ellipsoid_membership reads).
__all__ = [
    # helpers
    "TokensLike",
    "valid_mask",
    "weighted_quantile",
    # norm spread
    "attended_norms",
    "summarize_norm_spread",
    "norm_spread",
    # sparsity
    "max_attention",
    "sparsity_histogram",
    "sparsity_summary",
    "attention_sparsity",
    # subspaces
    "orthonormal_basis",
    "principal_angles",
    "residual_components",
    "component_subspaces",
    "effective_read_matrices",
    "head_read_subspaces",
    "positional_subspace",
    "token_subspace",
    "subspaces",
    "subspace_angles",
    "head_read_fractions",
    # orthogonal spheres
    "sphere_structure",
    "orthogonal_spheres",
    "SpheresSpec",
    # interference
    "Intervention",
    "ScaleComponent",
    "AddOrthogonal",
    "default_interventions",
    "direct_interference",
    # ellipsoid
    "NormEllipsoid",
    "norm_ellipsoid",
    "norm_modules",
    "norm_hook_names",
    "module_ellipsoids",
    "ellipsoid_table",
    "ellipsoid_axes",
    "ellipsoid_membership",
    # bridges (Hugging Face models)
    "BridgeNorm",
    "bridge_norms",
    "bridge_tokens",
    "bridge_geometry",
    # one call
    "run_geometry",
    "geometry_hook_names",
    "compare_geometry",
    "geometry_summary",
]
