"""The geometry of a TransformerBridge (a Hugging Face model): the backend
:func:`interp_norm.geometry.run_geometry` picks for it."""

from __future__ import annotations

from typing import Any, Optional

import pandas as pd
from tqdm.auto import tqdm

from interp_norm.core.specs import with_overrides
from interp_norm.geometry._common import TokensLike, as_tokens
from interp_norm.geometry.bridge import bridge_ellipsoid_axes, bridge_ellipsoid_table, bridge_norms, bridge_tokens
from interp_norm.geometry.run_ours import GeometrySpec

__all__ = ["bridge_geometry"]


def bridge_geometry(
    model: Any,
    *,
    tokens: Optional[TokensLike] = None,
    n: int = 8,
    n_ctx: int = 32,
    seed: int = 0,
    spec: Optional[GeometrySpec] = None,
    progress: bool = False,
    window_batch: Optional[int] = None,
    **overrides: Any,
) -> dict[str, pd.DataFrame]:
    """The geometry of a ``TransformerBridge``: ``norm_spread``, ``sparsity_hist``,
    ``sparsity_summary``, ``ellipsoids``, ``ellipsoid_axes``, ``ellipsoid_membership`` (every norm,
    attention q/k/v norms included) and ``anatomy`` (:meth:`~interp_norm.anatomy.Anatomy.table`).

    ``tokens`` default: ``n`` windows of ``n_ctx`` tokens of the shipped sample text, or random
    ordinary ids for a model without a tokenizer (:func:`~interp_norm.geometry.bridge.bridge_tokens`).
    The orthogonal-spheres, subspace and interference analyses read our model's weight steps and
    residual decomposition, which a bridge does not expose; they are not run here. Of the options
    (:class:`~interp_norm.geometry.run_ours.GeometrySpec`: ``spec`` and/or its fields as keywords) only
    ``coverage``, ``tolerance`` and ``bins`` are read.

    Memory: one early-stopped forward (no logits) per block of ``window_batch`` windows (None:
    :data:`~interp_norm.core.defaults.WINDOW_BATCH`, 8; ≥ the windows: one pass), the blocks in lockstep
    layer by layer; each block's hooks of a layer are reduced to per-row values before the next block
    runs (:func:`~interp_norm.geometry.bridge_sweep.bridge_sweep`), so the peak is the weights plus one
    block's hooks of one layer plus those per-row values, while every table is the one a single pass gives.
    """
    from interp_norm.anatomy import anatomy
    from interp_norm.core.defaults import WINDOW_BATCH
    from interp_norm.errors import GeometryError, check_positive_int
    from interp_norm.geometry.bridge_sweep import bridge_sweep

    sp = with_overrides(GeometrySpec, spec, overrides, who="bridge_geometry")
    window_batch = WINDOW_BATCH if window_batch is None else window_batch
    check_positive_int(window_batch, "window_batch", GeometryError, "windows per forward pass")

    toks = as_tokens(model, tokens if tokens is not None else bridge_tokens(model, n, n_ctx, seed))
    norms = bridge_norms(model)
    steps = tqdm(total=4, desc="geometry", disable=not progress)
    out: dict[str, pd.DataFrame] = {"anatomy": anatomy(model).table()}
    steps.update()
    swept = bridge_sweep(model, toks, norms, coverage=sp.coverage, tolerance=sp.tolerance, bins=sp.bins,
                         window_batch=window_batch, steps=steps)
    out.update({k: swept[k] for k in ("norm_spread", "sparsity_hist", "sparsity_summary")})
    out["ellipsoids"] = bridge_ellipsoid_table(model, norms)
    out["ellipsoid_axes"] = bridge_ellipsoid_axes(model, norms)
    out["ellipsoid_membership"] = swept["ellipsoid_membership"]
    steps.update()
    steps.close()
    return out
