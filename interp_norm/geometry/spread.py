"""The paper's attended-embedding norm spread (Menary et al. 2024, arXiv 2406.17837: "90% within ±20%").

A Pre-Norm head divides by |x|; the paper argues trained models keep |x| nearly constant where heads
look. This measures how constant: every key token's residual norm, weighted by the attention it
receives, relative to each head's weighted median.
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np
import pandas as pd
import torch

from interp_norm.errors import GeometryError
from interp_norm.geometry._common import TokensLike, as_tokens, check_model, run_cached, use_center, valid_mask
from interp_norm.geometry.bridge import bridge_pattern_hooks, bridge_resid_hooks, position_mask
from interp_norm.anatomy import kind_of
from interp_norm.core.hook_names import act_name
from interp_norm.core.model import HookedNormTransformer

__all__ = ["weighted_quantile", "attended_norms", "layer_frames", "summarize_norm_spread", "norm_spread"]


def weighted_quantile(values, weights, q) -> np.ndarray:
    """Inverse-CDF weighted quantile: the smallest value v with W(values ≤ v) ≥ q·W(all).

    With integer weights this equals ``np.quantile(np.repeat(values, weights), q,
    method="inverted_cdf")``. No interpolation: the paper's statistic is a coverage ("90% of
    embeddings within ±x%"), and the inverse CDF answers exactly that. Zero-weight values are ignored.
    """
    v = np.asarray(values, dtype=float).ravel()
    w = np.asarray(weights, dtype=float).ravel()
    if v.shape != w.shape:
        raise GeometryError(f"values and weights differ in size ({v.size} vs {w.size})")
    if np.any(w < 0) or not np.all(np.isfinite(w)):
        raise GeometryError("weights must be finite and non-negative")
    keep = w > 0
    v, w = v[keep], w[keep]
    if v.size == 0:
        raise GeometryError("no value has positive weight; is every token padding or '['?")
    qs = np.atleast_1d(np.asarray(q, dtype=float))
    if np.any((qs < 0) | (qs > 1)):
        raise GeometryError(f"quantiles must lie in [0, 1], got {q!r}")
    order = np.argsort(v, kind="stable")
    v, w = v[order], w[order]
    cum = np.cumsum(w)
    total = cum[-1]
    idx = np.searchsorted(cum, qs * total * (1 - 1e-12), side="left")
    out = v[np.clip(idx, 0, v.size - 1)]
    return out if np.ndim(q) else out[0]


def attended_norms(
    model: HookedNormTransformer,
    tokens: TokensLike,
    *,
    exclude_bos: bool = True,
    center: Union[bool, str] = "auto",
    cache=None,
) -> pd.DataFrame:
    """Norm of the residual stream at each attention layer's input, with each head's attention weight.

    One row per (layer, head, sequence, key token). ``weight`` = the attention the token receives from
    all valid query rows of that head (Σ_q pattern[b, h, q, t]); ``rel`` = norm / median_h − 1 where
    median_h is the head's attention-weighted median. Choices for the paper's ambiguous statistic
    (the paper does not say which norm): the norm is of the layer's ``hook_resid_pre`` (centred for LayerNorm models,
    see ``center``); with ``exclude_bos`` the ``[`` token is dropped both as key and as query row.
    On a ``TransformerBridge`` the norm is of each block's ``hook_resid_pre`` (centred iff its
    Pre-Norm is a LayerNorm), the weights come from the anatomy's verified pattern, and
    ``exclude_bos`` drops position 0.
    """
    if kind_of(model) == "bridge":
        from interp_norm.anatomy import anatomy

        tokens = as_tokens(model, tokens)
        pre = anatomy(model)[0].pre_norm
        ctr = (pre is not None and pre.kind == "ln") if center == "auto" else use_center(model, center)
        resid, patterns = bridge_resid_hooks(model), bridge_pattern_hooks(model)
        keep = position_mask(tokens, exclude_bos)
    else:
        check_model(model)
        tokens = as_tokens(model, tokens)
        ctr = use_center(model, center)
        resid = [act_name("resid_pre", l) for l in range(model.cfg.n_layers)]
        patterns = [act_name("pattern", l) for l in range(model.cfg.n_layers)]
        keep = valid_mask(tokens, exclude_bos)
    cache = run_cached(model, tokens, resid + patterns, cache)
    if not keep.any():
        raise GeometryError("no tokens left after excluding padding and '['; pass sequences with content")
    bi, pi = keep.nonzero(as_tuple=True)
    frames = []
    for l, (r_name, p_name) in enumerate(zip(resid, patterns)):
        x = cache[r_name].double()
        if ctr:
            x = x - x.mean(-1, keepdim=True)
        norms = x.norm(dim=-1)[bi, pi].cpu().numpy()
        pat = cache[p_name].double()
        w = torch.einsum("bhqk,bq->bhk", pat, keep.double())  # attention received from valid rows
        frames += layer_frames(l, tokens, bi, pi, norms, w[bi, :, pi].cpu().numpy())
    return pd.concat(frames, ignore_index=True)


def layer_frames(layer: int, tokens: torch.Tensor, bi: torch.Tensor, pi: torch.Tensor, norms: np.ndarray,
                 weights: np.ndarray) -> list[pd.DataFrame]:
    """:func:`attended_norms`' rows of one layer, one frame per head, from the kept positions (``bi``,
    ``pi``), their residual ``norms`` and the attention each receives per head (``weights`` [rows, heads]):
    the small per-position inputs, so a caller can gather them a block of windows at a time."""
    frames = []
    for h in range(weights.shape[1]):
        wh = weights[:, h]
        med = weighted_quantile(norms, wh, 0.5) if wh.sum() > 0 else float("nan")
        frames.append(pd.DataFrame(dict(layer=layer, head=h, batch=bi.cpu().numpy(), pos=pi.cpu().numpy(),
                                        token=tokens[bi, pi].cpu().numpy(), norm=norms, weight=wh,
                                        rel=norms / med - 1.0)))
    return frames


def _quantile_cols(quantiles: Sequence[float]) -> list[str]:
    return [f"q{100 * q:g}" for q in quantiles]


def summarize_norm_spread(
    norms: pd.DataFrame,
    *,
    coverage: float = 0.9,
    quantiles: Sequence[float] = (0.05, 0.25, 0.5, 0.75, 0.95),
    tolerance: float = 0.2,
) -> pd.DataFrame:
    """Per-(layer, head) and per-layer statistics of ``rel`` from :func:`attended_norms`.

    ``spread`` = the smallest s such that at least ``coverage`` of the attention weight lies within
    ``|rel| ≤ s`` (the paper's "90% of embeddings within ±s"); ``within_tol`` = the weight fraction
    with ``|rel| ≤ tolerance`` (paper: ±20% covers 90% for Pre-Norm). Quantiles ``q5`` … are weighted
    quantiles of ``rel``. Per-layer rows (``head`` = <NA>) pool the heads with each head's weights
    normalised to sum 1, so every head counts equally and each head's deviations are from its own median.
    """
    if not 0 < coverage <= 1:
        raise GeometryError(f"coverage must lie in (0, 1], got {coverage!r}")
    qcols = _quantile_cols(quantiles)
    rows = []

    def stats(rel: np.ndarray, w: np.ndarray) -> dict:
        ok = np.isfinite(rel) & (w > 0)
        rel, w = rel[ok], w[ok]
        if w.sum() <= 0:
            return dict(zip(qcols, [np.nan] * len(qcols)), spread=np.nan, within_tol=np.nan)
        d = dict(zip(qcols, np.atleast_1d(weighted_quantile(rel, w, list(quantiles)))))
        d["spread"] = float(weighted_quantile(np.abs(rel), w, coverage))
        d["within_tol"] = float(w[np.abs(rel) <= tolerance].sum() / w.sum())
        return d

    for (layer, head), g in norms.groupby(["layer", "head"], sort=True):
        med = weighted_quantile(g["norm"], g["weight"], 0.5) if g["weight"].sum() > 0 else np.nan
        rows.append(
            dict(layer=layer, head=head, n_tokens=len(g), weight=g["weight"].sum(), median_norm=med,
                 **stats(g["rel"].to_numpy(), g["weight"].to_numpy()))
        )
    for layer, g in norms.groupby("layer", sort=True):
        tot = g.groupby("head")["weight"].transform("sum").to_numpy()
        w = np.where(tot > 0, g["weight"].to_numpy() / np.where(tot > 0, tot, 1), 0.0)
        rows.append(
            dict(layer=layer, head=pd.NA, n_tokens=len(g), weight=g["weight"].sum(), median_norm=np.nan,
                 **stats(g["rel"].to_numpy(), w))
        )
    out = pd.DataFrame(rows)
    out["head"] = out["head"].astype("Int64")
    out["coverage"], out["tolerance"] = coverage, tolerance
    return out.sort_values(["layer", "head"], na_position="last", kind="stable").reset_index(drop=True)


def norm_spread(
    model: HookedNormTransformer,
    tokens: TokensLike,
    *,
    coverage: float = 0.9,
    quantiles: Sequence[float] = (0.05, 0.25, 0.5, 0.75, 0.95),
    tolerance: float = 0.2,
    exclude_bos: bool = True,
    center: Union[bool, str] = "auto",
    cache=None,
) -> pd.DataFrame:
    """The paper's attended-embedding norm spread; see :func:`attended_norms` and :func:`summarize_norm_spread`."""
    df = attended_norms(model, tokens, exclude_bos=exclude_bos, center=center, cache=cache)
    return summarize_norm_spread(df, coverage=coverage, quantiles=quantiles, tolerance=tolerance)
