"""Attention sparsity: the histogram of each attention row's largest weight (the paper's appendix).

The paper finds Pre-Norm's distributions sharply peaked at 1 and QKV-Norm's weighted towards low
values; the noise experiments split rows at the same sparse / non-sparse thresholds
(:data:`~interp_norm.core.defaults.SPARSE_THRESHOLD`, :data:`~interp_norm.core.defaults.NONSPARSE_THRESHOLD`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from interp_norm.errors import GeometryError, check_positive_int
from interp_norm.geometry._common import TokensLike, as_tokens, check_model, run_cached, valid_mask
from interp_norm.geometry.bridge import bridge_pattern_hooks, position_mask
from interp_norm.anatomy import kind_of
from interp_norm.core.defaults import NONSPARSE_THRESHOLD, SPARSE_THRESHOLD
from interp_norm.core.hook_names import act_name
from interp_norm.core.model import HookedNormTransformer

__all__ = ["max_attention", "sparsity_histogram", "sparsity_summary", "attention_sparsity", "VERY_SPARSE_THRESHOLD"]

#: A stricter cut than the paper's 95%: rows whose max attention is at least 0.99 (``frac_very_sparse``).
#: A QKV-Norm head's score range is bounded by its gains, so few of its rows get this close to one-hot.
VERY_SPARSE_THRESHOLD = 0.99


def max_attention(model: HookedNormTransformer, tokens: TokensLike, *, exclude_bos: bool = True, cache=None) -> pd.DataFrame:
    """max_t a_t for every attention distribution: one row per (layer, head, sequence, query row).

    Padding rows are dropped; with ``exclude_bos`` so is row 0 (``[`` can only attend to itself).
    On a ``TransformerBridge`` the pattern is the anatomy's verified ``pattern`` hook (softmax of
    the scores rebuilt from q and k reproduces it) and ``exclude_bos`` drops position 0.
    """
    tokens = as_tokens(model, tokens)
    if kind_of(model) == "bridge":
        names, rows = bridge_pattern_hooks(model), position_mask(tokens, exclude_bos)
    else:
        check_model(model)
        names = [act_name("pattern", l) for l in range(model.cfg.n_layers)]
        rows = valid_mask(tokens, exclude_bos)
    cache = run_cached(model, tokens, names, cache)
    bi, qi = rows.nonzero(as_tuple=True)
    frames = []
    for l, name in enumerate(names):
        pat = cache[name]  # b h q k
        m, am = pat.max(dim=-1)  # b h q
        for h in range(pat.shape[1]):
            frames.append(
                pd.DataFrame(dict(layer=l, head=h, batch=bi.cpu().numpy(), query=qi.cpu().numpy(),
                                  max_attn=m[bi, h, qi].double().cpu().numpy(),
                                  argmax=am[bi, h, qi].cpu().numpy()))
            )
    return pd.concat(frames, ignore_index=True)


def sparsity_histogram(max_attn: pd.DataFrame, *, bins: int = 20, per_head: bool = False) -> pd.DataFrame:
    """Histogram of ``max_attn`` on [0, 1] per layer (and per head), plus pooled rows (layer = <NA>).

    ``fraction`` is the share of distributions in the bin within its group; the last bin includes 1.
    The paper: Pre-Norm is sharply peaked in the top bin, QKV-Norm weighted towards low values.
    """
    check_positive_int(bins, "bins", GeometryError)
    edges = np.linspace(0.0, 1.0, bins + 1)
    keys = ["layer", "head"] if per_head else ["layer"]
    out = []

    def hist(vals: np.ndarray, **key) -> None:
        counts, _ = np.histogram(np.clip(vals, 0.0, 1.0), bins=edges)
        n = max(int(counts.sum()), 1)
        for i in range(bins):
            out.append(dict(**key, bin=i, lo=edges[i], hi=edges[i + 1], count=int(counts[i]), fraction=counts[i] / n))

    for k, g in max_attn.groupby(keys, sort=True):
        k = k if isinstance(k, tuple) else (k,)
        hist(g["max_attn"].to_numpy(), **dict(zip(keys, k)))
    if per_head:
        for h, g in max_attn.groupby("head", sort=True):
            hist(g["max_attn"].to_numpy(), layer=pd.NA, head=h)
    else:
        hist(max_attn["max_attn"].to_numpy(), layer=pd.NA)
    df = pd.DataFrame(out)
    for k in keys:
        df[k] = df[k].astype("Int64")
    return df


def sparsity_summary(
    max_attn: pd.DataFrame, *, sparse: float = SPARSE_THRESHOLD, nonsparse: float = NONSPARSE_THRESHOLD,
    very_sparse: float = VERY_SPARSE_THRESHOLD,
) -> pd.DataFrame:
    """Per layer and pooled (layer = <NA>): share of sparse (max ≥ ``sparse``, paper 95%) and
    non-sparse (max < ``nonsparse``, paper 70%) distributions, mean and median max attention, and
    ``frac_very_sparse``: the share with max ≥ ``very_sparse`` (0.99), a sharper sign of one-hot rows."""

    def row(g: pd.DataFrame, layer) -> dict:
        m = g["max_attn"].to_numpy()
        return dict(layer=layer, n=len(m), mean=m.mean(), median=np.median(m),
                    frac_sparse=(m >= sparse).mean(), frac_nonsparse=(m < nonsparse).mean(),
                    frac_very_sparse=(m >= very_sparse).mean())

    rows = [row(g, l) for l, g in max_attn.groupby("layer", sort=True)] + [row(max_attn, pd.NA)]
    df = pd.DataFrame(rows)
    df["layer"] = df["layer"].astype("Int64")
    return df


def attention_sparsity(
    model: HookedNormTransformer,
    tokens: TokensLike,
    *,
    bins: int = 20,
    per_head: bool = False,
    exclude_bos: bool = True,
    cache=None,
) -> pd.DataFrame:
    """The paper's max-attention histogram; see :func:`max_attention` and :func:`sparsity_histogram`."""
    mx = max_attention(model, tokens, exclude_bos=exclude_bos, cache=cache)
    return sparsity_histogram(mx, bins=bins, per_head=per_head)
