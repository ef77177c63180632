"""The geometry of one of our models (:class:`~interp_norm.core.model.HookedNormTransformer`): the
backend :func:`interp_norm.geometry.run_geometry` picks for it.

One forward pass caches :func:`geometry_hook_names`; each analysis then reads that cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import pandas as pd
from torch import Tensor
from tqdm.auto import tqdm

from interp_norm.core.hook_names import act_name
from interp_norm.core.model import HookedNormTransformer
from interp_norm.core.task import task_for
from interp_norm.errors import ConfigError
from interp_norm.geometry._common import TokensLike, as_tokens, check_model, run_cached
from interp_norm.geometry.ellipsoid import ellipsoid_axes, ellipsoid_membership, ellipsoid_table, norm_hook_names
from interp_norm.geometry.interference import Intervention, direct_interference
from interp_norm.geometry.sparsity import max_attention, sparsity_histogram, sparsity_summary
from interp_norm.geometry.spheres import orthogonal_spheres
from interp_norm.geometry.spread import norm_spread
from interp_norm.geometry.subspaces import head_read_fractions, subspace_angles, subspaces

__all__ = ["GeometrySpec", "geometry_hook_names", "ours_geometry", "sample_tokens", "spread_and_sparsity"]


def geometry_hook_names(model: HookedNormTransformer) -> list[str]:
    """Every hook the analyses here read (cache them once and pass ``cache=`` to each analysis)."""
    per_layer = ("resid_pre", "pattern", "z", "attn_out", "mlp_out")
    names = [act_name("embed"), act_name("pos_embed")]
    names += [act_name(k, l) for l in range(model.cfg.n_layers) for k in per_layer]
    return names + norm_hook_names(model)


def sample_tokens(model: HookedNormTransformer, task, tokens, n: int, split: str, seed: int) -> Tensor:
    if tokens is not None:
        return as_tokens(model, tokens)
    task = task_for(model, task, who="run_geometry (without tokens=)", stacklevel=4)
    return as_tokens(model, task.sample_batch(n, split, seed=seed).tokens)


def spread_and_sparsity(model: Any, tokens: Tensor, cache, *, coverage: float, tolerance: float, bins: int,
                         steps: tqdm) -> dict[str, pd.DataFrame]:
    """``norm_spread``, ``sparsity_hist`` and ``sparsity_summary`` from the cache (two progress
    steps): the analyses our models and bridges share, written once for both runners."""
    out = {"norm_spread": norm_spread(model, tokens, coverage=coverage, tolerance=tolerance, cache=cache)}
    steps.update()
    mx = max_attention(model, tokens, cache=cache)
    out["sparsity_hist"] = sparsity_histogram(mx, bins=bins)
    out["sparsity_summary"] = sparsity_summary(mx)
    steps.update()
    return out


@dataclass(frozen=True)
class GeometrySpec:
    """The analyses' options :func:`~interp_norm.geometry.run_geometry` passes to :func:`ours_geometry` (and the
    first three to :func:`~interp_norm.geometry.bridge_geometry`).

    ``coverage``/``tolerance``: the norm spread (:func:`~interp_norm.geometry.norm_spread`: the smallest relative
    deviation holding ``coverage`` of the attention weight, and the share within ±``tolerance``); ``bins`` of
    the sparsity histogram; ``energy`` kept by each component's subspace; ``weighting`` of the
    orthogonal-spheres score; ``interventions`` of the interference analysis (None: its defaults).
    """

    coverage: float = 0.9
    tolerance: float = 0.2
    bins: int = 20
    energy: float = 0.9
    weighting: str = "energy"
    interventions: Optional[Mapping[str, Intervention]] = None


def ours_geometry(
    model: HookedNormTransformer,
    task=None,
    *,
    tokens: Optional[TokensLike] = None,
    n: int = 256,
    split: str = "id",
    seed: int = 0,
    spec: GeometrySpec = GeometrySpec(),
    progress: bool = False,
    window_batch: Optional[int] = None,
) -> dict[str, pd.DataFrame]:
    """:func:`~interp_norm.geometry.run_geometry` on one of our models (its docstring has the tables);
    the batch runs in one pass, so ``window_batch`` (a bridge's) is refused."""
    if window_batch is not None:
        raise ConfigError(f"window_batch={window_batch!r} applies to Hugging Face models (TransformerBridges); "
                          "our models run the batch in one pass: drop window_batch")
    check_model(model)
    tokens = sample_tokens(model, task, tokens, n, split, seed)
    steps = tqdm(total=8, desc="geometry", disable=not progress)
    cache = run_cached(model, tokens, geometry_hook_names(model))  # one forward pass for every analysis
    steps.update()
    out: dict[str, pd.DataFrame] = spread_and_sparsity(model, tokens, cache, coverage=spec.coverage,
                                                       tolerance=spec.tolerance, bins=spec.bins, steps=steps)
    sph = orthogonal_spheres(model, tokens, weighting=spec.weighting, cache=cache)
    out["sphere_components"], out["sphere_pairs"], out["sphere_scores"] = sph["components"], sph["pairs"], sph["scores"]
    steps.update()
    bases = subspaces(model, tokens, energy=spec.energy, cache=cache)
    is_read = {k: k.endswith((".q", ".k", ".v")) for k in bases}
    names = list(bases)
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :] if not (is_read[a] and is_read[b])]
    out["subspace_angles"] = subspace_angles(bases, pairs=pairs)
    comp_bases = {k: v for k, v in bases.items() if not is_read[k]}
    out["head_reads"] = head_read_fractions(model, comp_bases)
    steps.update()
    out["interference"] = direct_interference(model, tokens, spec.interventions, cache=cache)
    steps.update()
    out["ellipsoids"] = ellipsoid_table(model)
    out["ellipsoid_axes"] = ellipsoid_axes(model)
    steps.update()
    out["ellipsoid_membership"] = ellipsoid_membership(model, tokens, cache=cache)
    steps.update()
    steps.close()
    return out


