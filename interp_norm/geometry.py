"""Representation geometry: what Pre-Norm asks of the residual stream, and whether models comply.

Menary et al. (2024), Theorem 2 (digest §2.1): under Pre-Norm a head sees ``x/|x|``, so semantic
subspaces stay independent only if they are **orthogonal spheres** (each component of constant
norm, components mutually orthogonal); otherwise they interfere through the shared norm. Under
QKV-Norm linear independence suffices (Theorem 3). This module measures that geometry on a model
and an input batch, and returns pandas DataFrames (figures live in :mod:`interp_norm.plots_geometry`):

* :func:`norm_spread` — the paper's attended-embedding norm spread (digest §3.6, "90% within ±20%").
* :func:`residual_components`, :func:`subspaces`, :func:`principal_angles`,
  :func:`subspace_angles` — semantic subspaces from the residual decomposition and from what each
  head reads, and the angles between them.
* :func:`sphere_structure`, :func:`orthogonal_spheres` — per-component norm constancy, pairwise
  orthogonality and one orthogonal-spheres score per layer (Theorem 2's two conditions).
* :func:`direct_interference` — beyond the paper: change one subspace's component and measure how far
  the attention of each head moves (the paper says it never observed interference directly).
* :func:`attention_sparsity` — histogram of the max attention per distribution (paper appendix).
* :func:`norm_ellipsoid`, :func:`ellipsoid_table`, :func:`ellipsoid_membership` — Riechers's
  LayerNorm hyperellipsoid (digest §7.2–7.3) and its RMSNorm analogue, checked on cached outputs.
* :func:`run_geometry`, :func:`compare_geometry`, :func:`geometry_summary` — one call for the CLI,
  dashboard and README.

Every analysis that runs the model takes ``cache=``: an ActivationCache of the same tokens holding
:func:`geometry_hook_names` is reused instead of a new forward pass.

Token conventions: position 0 holds ``[`` and is excluded by default (``exclude_bos``), as the paper
does for the norm spread and the sparsity histogram; padding ``*`` is always excluded. Pooled rows in
the tables carry ``<NA>`` in the ``layer``/``head`` column they pool over.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from interp_norm import task as T
from interp_norm.errors import ConfigError, GeometryError, ProblemStringError
from interp_norm.model import HookedNormTransformer, Norm

__all__ = [
    # helpers
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
    # interference
    "ScaleComponent",
    "AddOrthogonal",
    "default_interventions",
    "direct_interference",
    # ellipsoid
    "NormEllipsoid",
    "norm_ellipsoid",
    "norm_modules",
    "module_ellipsoids",
    "ellipsoid_table",
    "ellipsoid_axes",
    "ellipsoid_membership",
    # one call
    "run_geometry",
    "geometry_hook_names",
    "compare_geometry",
    "geometry_summary",
]

TokensLike = Union[Int[Tensor, "batch pos"], "T.Batch"]
_TINY = 1e-12


# ============================================================================= helpers


def _tokens(model: HookedNormTransformer, tokens: TokensLike) -> Int[Tensor, "batch pos"]:
    if isinstance(tokens, T.Batch):
        tokens = tokens.tokens
    if not isinstance(tokens, Tensor):
        raise ProblemStringError(
            f"tokens must be a [batch, pos] integer tensor or a task Batch, got {type(tokens).__name__}; "
            "use task.sample_batch(n).tokens or model.to_tokens([...])"
        )
    if tokens.ndim == 1:
        tokens = tokens.unsqueeze(0)
    if tokens.ndim != 2 or tokens.numel() == 0:
        raise ProblemStringError(f"tokens must be a non-empty [batch, pos] tensor, got shape {tuple(tokens.shape)}")
    return tokens.to(model.W_E.device)


def _check_model(model: HookedNormTransformer) -> None:
    if not isinstance(model, HookedNormTransformer):
        raise ConfigError(
            f"geometry analyses need a HookedNormTransformer, got {type(model).__name__}; "
            "load one with interp_norm's checkpoints or build HookedNormTransformer(ModelConfig(...))"
        )


def _center(model: HookedNormTransformer, center: Union[bool, str]) -> bool:
    """``"auto"``: centre (remove the mean over d_model) iff the model's norms are LayerNorms.

    LayerNorm divides by |Πx| (Π removes the mean), RMSNorm by |x|, so that is the norm a
    Pre-Norm model must keep constant. The choice depends only on ``norm_kind``, not on where the
    norm sits, so a Pre-Norm and a QKV-Norm model of the same kind are measured the same way.
    """
    if center == "auto":
        return model.cfg.norm_kind == "ln"
    if not isinstance(center, bool):
        raise ConfigError(f"center must be True, False or 'auto', got {center!r}")
    return center


def valid_mask(tokens: Int[Tensor, "batch pos"], exclude_bos: bool = True) -> Bool[Tensor, "batch pos"]:
    """True at real tokens: not padding ``*`` and, if ``exclude_bos``, not the opening ``[``."""
    m = tokens != T.PAD_ID
    if exclude_bos:
        m = m & (tokens != T.BOS_ID)
    return m


def _run(model: HookedNormTransformer, tokens: Tensor, names: Iterable[str], cache=None):
    """Forward pass caching only ``names`` (memory stays small on the paper-size model).

    A ``cache`` (ActivationCache or dict from a run on the same tokens) holding all ``names`` is
    reused instead: :func:`run_geometry` runs the model once for every analysis."""
    wanted = set(names)
    if cache is not None:
        have = cache.cache_dict if hasattr(cache, "cache_dict") else cache
        if all(n in have for n in wanted):
            return cache
    missing = sorted(n for n in wanted if n not in model.hook_dict)
    if missing:
        raise ConfigError(f"the model has no hook(s) {missing}; see model.hook_names()")
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in wanted)
    return cache


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


# ============================================================================= norm spread


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
    (digest §5 item 5): the norm is of ``blocks.{l}.hook_resid_pre`` (centred for LayerNorm models,
    see ``center``); with ``exclude_bos`` the ``[`` token is dropped both as key and as query row.
    """
    _check_model(model)
    tokens = _tokens(model, tokens)
    ctr = _center(model, center)
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    names = [f"blocks.{l}.hook_resid_pre" for l in range(n_layers)] + [
        f"blocks.{l}.attn.hook_pattern" for l in range(n_layers)
    ]
    cache = _run(model, tokens, names, cache)
    keep = valid_mask(tokens, exclude_bos)
    if not keep.any():
        raise GeometryError("no tokens left after excluding padding and '['; pass sequences with content")
    bi, pi = keep.nonzero(as_tuple=True)
    frames = []
    for l in range(n_layers):
        x = cache[f"blocks.{l}.hook_resid_pre"].double()
        if ctr:
            x = x - x.mean(-1, keepdim=True)
        norms = x.norm(dim=-1)[bi, pi].cpu().numpy()
        pat = cache[f"blocks.{l}.attn.hook_pattern"].double()
        w = torch.einsum("bhqk,bq->bhk", pat, keep.double())  # attention received from valid rows
        for h in range(n_heads):
            wh = w[bi, h, pi].cpu().numpy()
            med = weighted_quantile(norms, wh, 0.5) if wh.sum() > 0 else float("nan")
            frames.append(
                pd.DataFrame(
                    dict(
                        layer=l,
                        head=h,
                        batch=bi.cpu().numpy(),
                        pos=pi.cpu().numpy(),
                        token=tokens[bi, pi].cpu().numpy(),
                        norm=norms,
                        weight=wh,
                        rel=norms / med - 1.0,
                    )
                )
            )
    return pd.concat(frames, ignore_index=True)


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


# ============================================================================= attention sparsity


def max_attention(model: HookedNormTransformer, tokens: TokensLike, *, exclude_bos: bool = True, cache=None) -> pd.DataFrame:
    """max_t a_t for every attention distribution: one row per (layer, head, sequence, query row).

    Padding rows are dropped; with ``exclude_bos`` so is row 0 (``[`` can only attend to itself).
    """
    _check_model(model)
    tokens = _tokens(model, tokens)
    n_layers = model.cfg.n_layers
    cache = _run(model, tokens, [f"blocks.{l}.attn.hook_pattern" for l in range(n_layers)], cache)
    rows = valid_mask(tokens, exclude_bos)
    bi, qi = rows.nonzero(as_tuple=True)
    frames = []
    for l in range(n_layers):
        pat = cache[f"blocks.{l}.attn.hook_pattern"]  # b h q k
        m, am = pat.max(dim=-1)  # b h q
        for h in range(model.cfg.n_heads):
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
    if not isinstance(bins, int) or bins < 1:
        raise GeometryError(f"bins must be a positive integer, got {bins!r}")
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


def sparsity_summary(max_attn: pd.DataFrame, *, sparse: float = 0.95, nonsparse: float = 0.70) -> pd.DataFrame:
    """Per layer and pooled (layer = <NA>): share of sparse (max ≥ ``sparse``, paper 95%) and
    non-sparse (max < ``nonsparse``, paper 70%) distributions, mean and median max attention."""

    def row(g: pd.DataFrame, layer) -> dict:
        m = g["max_attn"].to_numpy()
        return dict(layer=layer, n=len(m), mean=m.mean(), median=np.median(m),
                    frac_sparse=(m >= sparse).mean(), frac_nonsparse=(m < nonsparse).mean())

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


# ============================================================================= subspaces


def orthonormal_basis(
    M: Float[Tensor, "d m"], *, energy: Optional[float] = None, rtol: float = 1e-6
) -> Float[Tensor, "d k"]:
    """Orthonormal basis [d, k] of the column space of M (float64), from its SVD.

    Keeps singular directions with s > rtol·s_max; with ``energy`` in (0, 1] keeps only the fewest
    leading directions holding that share of Σs² (the *effective* subspace of a data cloud: learned
    components are never exactly low-rank). Uncentred on purpose: a sphere about the origin of its
    subspace spans that subspace, while centring would drop the direction of its mean.
    """
    if energy is not None and not (0 < energy <= 1):
        raise GeometryError(f"energy must lie in (0, 1], got {energy!r}")
    M = torch.as_tensor(M).detach().double().cpu()
    if M.ndim != 2:
        raise GeometryError(f"expected a matrix [d, m], got shape {tuple(M.shape)}")
    if M.shape[1] > 4 * M.shape[0]:  # many samples: eigen-decompose the d×d Gram matrix instead
        evals, evecs = torch.linalg.eigh(M @ M.T)
        s = evals.clamp_min(0).sqrt().flip(0)
        U = evecs.flip(1)
    else:
        U, s, _ = torch.linalg.svd(M, full_matrices=False)
    if s.numel() == 0 or s[0] <= 0:
        return torch.zeros(M.shape[0], 0, dtype=torch.float64)
    k = int((s > rtol * s[0]).sum())
    if energy is not None:
        cum = torch.cumsum(s[:k] ** 2, 0) / (s[:k] ** 2).sum()
        k = min(k, int((cum < energy - 1e-12).sum()) + 1)
    return U[:, :k].contiguous()


def principal_angles(A: Float[Tensor, "d ka"], B: Float[Tensor, "d kb"]) -> Float[Tensor, " k"]:
    """Principal angles (radians, ascending) between the column spaces of A and B.

    Björck–Golub: orthonormalise both, then the singular values of Q_Aᵀ Q_B are the cosines.
    Returns min(rank A, rank B) angles.
    """
    QA, QB = orthonormal_basis(A), orthonormal_basis(B)
    if QA.shape[0] != QB.shape[0]:
        raise GeometryError(f"subspaces live in different spaces (d={QA.shape[0]} vs d={QB.shape[0]})")
    if QA.shape[1] == 0 or QB.shape[1] == 0:
        raise GeometryError("a subspace is empty (all-zero matrix); principal angles are undefined")
    s = torch.linalg.svdvals(QA.T @ QB).clamp(0.0, 1.0)
    return torch.arccos(s).sort().values


def residual_components(
    model: HookedNormTransformer,
    tokens: TokensLike,
    layer: int,
    *,
    granularity: str = "head",
    include_bias: bool = True,
    cache=None,
) -> dict[str, Float[Tensor, "batch pos d_model"]]:
    """The residual stream at the input of ``layer`` split into its writers (they sum to it exactly).

    ``tok`` (hook_embed), ``pos`` (hook_pos_embed), then for every earlier layer l either each head's
    output ``L{l}H{h}`` (= z @ W_O, from hook_z) with all b_O in ``attn_bias`` (``granularity="head"``),
    or the whole ``L{l}.attn`` output (``"layer"``); and ``L{l}.mlp``. ``layer = n_layers`` is the
    input to ``ln_final``. ``include_bias=False`` drops the constant ``attn_bias`` (the sum then misses it).
    """
    _check_model(model)
    tokens = _tokens(model, tokens)
    n_layers = model.cfg.n_layers
    if not isinstance(layer, int) or not 0 <= layer <= n_layers:
        raise ConfigError(f"layer must be an integer in [0, {n_layers}] (n_layers = ln_final input), got {layer!r}")
    if granularity not in ("head", "layer"):
        raise ConfigError(f"granularity must be 'head' or 'layer', got {granularity!r}")
    names = ["hook_embed", "hook_pos_embed"]
    for l in range(layer):
        names += [f"blocks.{l}.attn.hook_z", f"blocks.{l}.hook_attn_out", f"blocks.{l}.hook_mlp_out"]
    cache = _run(model, tokens, names, cache)
    comps = {"tok": cache["hook_embed"], "pos": cache["hook_pos_embed"]}
    bias = torch.zeros_like(comps["tok"])
    for l in range(layer):
        a = model.blocks[l].attn
        if granularity == "head":
            z = cache[f"blocks.{l}.attn.hook_z"]
            res = torch.einsum("bphd,hdm->bphm", z, a.W_O.detach())
            for h in range(model.cfg.n_heads):
                comps[f"L{l}H{h}"] = res[:, :, h]
            bias = bias + a.b_O.detach()
        else:
            comps[f"L{l}.attn"] = cache[f"blocks.{l}.hook_attn_out"]
        comps[f"L{l}.mlp"] = cache[f"blocks.{l}.hook_mlp_out"]
    if include_bias and granularity == "head" and layer > 0:
        comps["attn_bias"] = bias
    return {k: v.detach() for k, v in comps.items()}


def component_subspaces(
    components: Mapping[str, Tensor],
    mask: Optional[Bool[Tensor, "batch pos"]] = None,
    *,
    energy: Optional[float] = 0.9,
) -> dict[str, Float[Tensor, "d k"]]:
    """The subspace each component occupies: the leading directions holding ``energy`` of its Σ|c|²."""
    out = {}
    for name, c in components.items():
        X = c[mask] if mask is not None else c.reshape(-1, c.shape[-1])
        out[name] = orthonormal_basis(X.T, energy=energy)
    return out


def effective_read_matrices(model: HookedNormTransformer, layer: int) -> dict[tuple[int, str], Float[Tensor, "d_model d_head"]]:
    """What each head reads from the residual stream: q = x·M_q/s, with norm gains folded in.

    Pre-Norm: M = Π·diag(g)·W (g = the q/k/v gain row; Π removes the mean for LayerNorm, identity for
    RMSNorm). Other variants: M = W (a QKV/QK gain acts after the projection and cannot change
    which residual directions are read). Keys ``(head, "q"|"k"|"v")``.
    """
    _check_model(model)
    cfg = model.cfg
    block = model.blocks[layer]
    a = block.attn
    Ws = {"q": a.W_Q.detach().double(), "k": a.W_K.detach().double(), "v": a.W_V.detach().double()}
    gains = {"q": None, "k": None, "v": None}
    if cfg.attn_norm == "pre":
        w = block.ln1.w.detach().double()
        gains = {n: (w[i] if w.ndim == 2 else w) for i, n in enumerate("qkv")}
    d = cfg.d_model
    P = torch.eye(d, dtype=torch.float64)
    if cfg.attn_norm == "pre" and cfg.norm_kind == "ln":
        P = P - torch.full((d, d), 1.0 / d, dtype=torch.float64)
    out = {}
    for h in range(cfg.n_heads):
        for n, W in Ws.items():
            M = W[h]
            if gains[n] is not None:
                M = P @ (gains[n][:, None] * M)
            out[(h, n)] = M
    return out


def head_read_subspaces(
    model: HookedNormTransformer, *, layers: Optional[Sequence[int]] = None, energy: Optional[float] = None
) -> dict[str, Float[Tensor, "d k"]]:
    """Column spaces of each head's effective W_Q/W_K/W_V (``L{l}H{h}.q`` …); see :func:`effective_read_matrices`."""
    layers = range(model.cfg.n_layers) if layers is None else layers
    out = {}
    for l in layers:
        for (h, n), M in effective_read_matrices(model, l).items():
            out[f"L{l}H{h}.{n}"] = orthonormal_basis(M, energy=energy)
    return out


def positional_subspace(model: HookedNormTransformer, *, energy: Optional[float] = None) -> Float[Tensor, "d k"]:
    """Span of the positional embeddings.

    Sinusoidal: the first 2·n_freq coordinate axes, which the encoding fills at every position and
    offset by construction (an SVD of a few positions would miss the nearly collinear slow
    frequencies, and ``energy`` is ignored). Learned: the span of W_pos (up to n_ctx dimensions); if
    that fills d_model, pass ``energy`` (e.g. 0.9) to keep the effective subspace.
    """
    _check_model(model)
    if model.cfg.pos_embed == "sinusoidal":
        return torch.eye(model.cfg.d_model, dtype=torch.float64)[:, : 2 * model.cfg.n_freq]
    with torch.no_grad():
        return orthonormal_basis(model.W_pos_embed.detach().T, energy=energy)


def token_subspace(model: HookedNormTransformer, *, energy: Optional[float] = None) -> Float[Tensor, "d k"]:
    """Span of the token embeddings W_E (at most d_vocab = 17 dimensions)."""
    _check_model(model)
    return orthonormal_basis(model.W_E.detach().T, energy=energy)


def _factored_basis(Z: Float[Tensor, "n r"], W: Float[Tensor, "r d"], energy: Optional[float], rtol: float = 1e-6) -> Tensor:
    """:func:`orthonormal_basis` of the rows of Z·W without forming the n×d product (heads: z·W_O).

    (ZW)ᵀ(ZW) = AᵀA with A = Lᵀ W, L L ᵀ = ZᵀZ, so the right singular vectors of the small r×d
    matrix A span the component with the same singular values."""
    Z, W = Z.double(), W.double()
    e, V = torch.linalg.eigh(Z.T @ Z)
    A = (V * e.clamp_min(0).sqrt()).T @ W
    _, sv, Vt = torch.linalg.svd(A, full_matrices=False)
    return orthonormal_basis(Vt.T * sv, energy=energy, rtol=rtol)


def subspaces(
    model: HookedNormTransformer,
    tokens: TokensLike,
    *,
    layer: Optional[int] = None,
    energy: Optional[float] = 0.9,
    read_energy: Optional[float] = None,
    include_reads: bool = True,
    exclude_bos: bool = True,
    cache=None,
) -> dict[str, Float[Tensor, "d k"]]:
    """All semantic subspaces: the components of the residual at ``layer`` (default: the ln_final
    input, which holds every writer; see :func:`residual_components` and
    :func:`component_subspaces`) and, with ``include_reads``, every head's read spaces
    (``L{l}H{h}.q/k/v``, :func:`head_read_subspaces`). Empty subspaces are dropped."""
    _check_model(model)
    tokens = _tokens(model, tokens)
    n_layers = model.cfg.n_layers
    layer = n_layers if layer is None else layer
    if not isinstance(layer, int) or not 0 <= layer <= n_layers:
        raise ConfigError(f"layer must be an integer in [0, {n_layers}] (n_layers = ln_final input), got {layer!r}")
    mask = valid_mask(tokens, exclude_bos)
    names = ["hook_embed", "hook_pos_embed"]
    for l in range(layer):
        names += [f"blocks.{l}.attn.hook_z", f"blocks.{l}.hook_mlp_out"]
    cache = _run(model, tokens, names, cache)
    out = {"tok": orthonormal_basis(cache["hook_embed"][mask].T, energy=energy),
           "pos": orthonormal_basis(cache["hook_pos_embed"][mask].T, energy=energy)}
    bias = torch.zeros(model.cfg.d_model, dtype=torch.float64)
    for l in range(layer):
        a = model.blocks[l].attn
        z = cache[f"blocks.{l}.attn.hook_z"][mask]  # n h dh
        for h in range(model.cfg.n_heads):
            out[f"L{l}H{h}"] = _factored_basis(z[:, h], a.W_O[h].detach(), energy)
        out[f"L{l}.mlp"] = orthonormal_basis(cache[f"blocks.{l}.hook_mlp_out"][mask].T, energy=energy)
        bias = bias + a.b_O.detach().double()
    if layer > 0:
        out["attn_bias"] = orthonormal_basis(bias[:, None])
    out = {k: v for k, v in out.items() if v.shape[1] > 0}
    if include_reads:
        out.update(head_read_subspaces(model, energy=read_energy))
    return out


def subspace_angles(
    bases: Mapping[str, Float[Tensor, "d k"]],
    *,
    pairs: Optional[Sequence[tuple[str, str]]] = None,
    progress: bool = False,
) -> pd.DataFrame:
    """Principal angles (degrees) between every pair of subspaces (or the given ``pairs``).

    ``overlap`` = mean cos² over the min(dim) angles = |Q_aᵀQ_b|²_F / min(k_a, k_b): 0 for orthogonal
    subspaces, 1 when one contains the other. Random subspaces of dims k_a ≤ k_b in R^d give ≈ k_b/d.
    Bases must be orthonormal (as :func:`orthonormal_basis` returns); empty ones are skipped.
    Pairs of equal shape are solved as one batched SVD.
    """
    cols = ["a", "b", "dim_a", "dim_b", "min_angle", "mean_angle", "max_angle", "overlap"]
    names = [n for n in bases if bases[n].shape[1] > 0]
    if pairs is None:
        pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
    unknown = sorted({x for p in pairs for x in p} - set(bases))
    if unknown:
        raise GeometryError(f"unknown subspace name(s) {unknown[:5]}; known: {list(bases)[:10]}...")
    pairs = [(a, b) for a, b in pairs if bases[a].shape[1] > 0 and bases[b].shape[1] > 0]
    if not pairs:
        return pd.DataFrame(columns=cols)
    dims = {n: bases[n].shape[1] for n in {x for p in pairs for x in p}}
    d = next(iter(bases.values())).shape[0]
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (a, b) in enumerate(pairs):
        groups.setdefault((dims[a], dims[b]), []).append(i)
    res = np.zeros((len(pairs), 4))
    for (ka, kb), idx in tqdm(groups.items(), desc="subspace angles", disable=not progress):
        # memory per batch: P·d·(ka+kb) for the stacked bases, P·max(ka, kb)² for the SVD workspace
        step = max(1, (1 << 21) // (max(ka, kb) ** 2 + d * (ka + kb)))
        for s0 in range(0, len(idx), step):
            part = idx[s0 : s0 + step]
            QA = torch.stack([torch.as_tensor(bases[pairs[i][0]]).double() for i in part])
            QB = torch.stack([torch.as_tensor(bases[pairs[i][1]]).double() for i in part])
            if QA.shape[1] != d or QB.shape[1] != d:
                raise GeometryError("subspaces live in spaces of different dimension; pass bases of one model")
            sv = torch.linalg.svdvals(QA.transpose(1, 2) @ QB).clamp(0.0, 1.0)  # P × min(ka, kb)
            ang = torch.rad2deg(torch.arccos(sv))
            res[part] = torch.stack([ang.min(1).values, ang.mean(1), ang.max(1).values, (sv**2).mean(1)], 1).numpy()
    df = pd.DataFrame(dict(a=[p[0] for p in pairs], b=[p[1] for p in pairs], dim_a=[dims[p[0]] for p in pairs],
                           dim_b=[dims[p[1]] for p in pairs]))
    df[["min_angle", "mean_angle", "max_angle", "overlap"]] = res
    return df[cols]


def head_read_fractions(
    model: HookedNormTransformer, bases: Mapping[str, Float[Tensor, "d k"]], *, layers: Optional[Sequence[int]] = None
) -> pd.DataFrame:
    """Share of each head's effective W_Q/W_K/W_V (Frobenius energy) lying in each subspace.

    1 means the head reads only that subspace (e.g. a positional head has q/k fractions ≈ 1 in
    ``pos``). Shares over non-orthogonal subspaces need not sum to 1.
    """
    layers = range(model.cfg.n_layers) if layers is None else layers
    rows = []
    for l in layers:
        for (h, n), M in effective_read_matrices(model, l).items():
            tot = float((M**2).sum())
            for name, Q in bases.items():
                frac = float(((Q.T @ M) ** 2).sum()) / tot if tot > 0 else float("nan")
                rows.append(dict(layer=l, head=h, which=n, subspace=name, fraction=frac))
    return pd.DataFrame(rows)


# ============================================================================= orthogonal spheres


def _stream_sphere_stats(
    chunks: Iterable[Float[Tensor, "k c d"]], members: Bool[Tensor, "k g"], center: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Accumulate, over token chunks, per-component norms [k, n], Σ_t |cos| and Σ_t cos [k, k], and
    the norm of the sum of each member group [g, n]. Streaming keeps memory at one chunk."""
    norms, totals = [], []
    abs_sum = sum_ = None
    n = 0
    for X in chunks:
        X = X.double()
        if center:
            X = X - X.mean(-1, keepdim=True)
        nr = X.norm(dim=-1)  # k c
        U = (X / nr.clamp_min(_TINY).unsqueeze(-1)).float()
        c = torch.einsum("itd,jtd->ijt", U, U).double()
        abs_sum = c.abs().sum(-1) if abs_sum is None else abs_sum + c.abs().sum(-1)
        sum_ = c.sum(-1) if sum_ is None else sum_ + c.sum(-1)
        norms.append(nr)
        totals.append(torch.einsum("kg,kcd->gcd", members.double(), X).norm(dim=-1))
        n += X.shape[1]
    if n == 0:
        raise GeometryError("no tokens left after masking; pass sequences with content")
    return torch.cat(norms, 1), abs_sum / n, sum_ / n, torch.cat(totals, 1)


def _sphere_tables(
    names: Sequence[str], norms: Tensor, mac: Tensor, mc: Tensor, total: Tensor, weighting: str
) -> dict[str, pd.DataFrame]:
    mean = norms.mean(1)
    energy = (norms**2).mean(1)
    alive = mean > _TINY * max(float(mean.max()), 1.0)
    cv = torch.where(alive, norms.std(1, unbiased=False) / mean.clamp_min(_TINY), torch.full_like(mean, float("nan")))
    share = energy / energy.sum().clamp_min(_TINY)
    w = share.clone() if weighting == "energy" else alive.double() / max(int(alive.sum()), 1)
    w = torch.where(alive, w, torch.zeros_like(w))
    w = w / w.sum().clamp_min(_TINY)
    constancy = float(np.clip(1.0 - float((w[alive] * cv[alive]).sum()), 0.0, 1.0))
    pair_rows = []
    num = den = 0.0
    k = len(names)
    for i in range(k):
        for j in range(i + 1, k):
            if not (alive[i] and alive[j]):
                continue
            pair_rows.append(dict(a=names[i], b=names[j], mean_abs_cos=float(mac[i, j]), mean_cos=float(mc[i, j])))
            num += float(w[i] * w[j] * mac[i, j])
            den += float(w[i] * w[j])
    orthogonality = 1.0 - num / den if den > 0 else 1.0
    comp_df = pd.DataFrame(dict(component=list(names), mean_norm=mean.numpy(), cv=cv.numpy(),
                                energy_share=share.numpy(), weight=w.numpy()))
    pairs_df = pd.DataFrame(pair_rows, columns=["a", "b", "mean_abs_cos", "mean_cos"])
    score_df = pd.DataFrame([dict(n_components=int(alive.sum()), constancy=constancy, orthogonality=orthogonality,
                                  score=constancy * orthogonality,
                                  resid_norm_cv=float(total.std(unbiased=False) / total.mean().clamp_min(_TINY)),
                                  weighting=weighting)])
    return {"components": comp_df, "pairs": pairs_df, "scores": score_df}


def _chunk_size(k: int, d: int, chunk: Optional[int]) -> int:
    auto = max(1, min((1 << 22) // max(k * k, 1), (1 << 23) // max(k * d, 1)))
    return auto if chunk is None else max(1, min(chunk, auto))


def sphere_structure(
    components: Mapping[str, Float[Tensor, "... d"]],
    mask: Optional[Bool[Tensor, "..."]] = None,
    *,
    weighting: str = "energy",
    center: bool = False,
    chunk: Optional[int] = None,
) -> dict[str, pd.DataFrame]:
    """How far components are from Theorem 2's orthogonal spheres (pure function of tensors).

    Per component: ``cv`` = std/mean of |c| over tokens (0 on a sphere), ``energy_share`` = E|c|² over
    the sum. Per pair: ``mean_abs_cos`` = E_t |cos(c_i(t), c_j(t))| (0 if orthogonal). Score:

        constancy     = clip(1 − Σ_i w_i cv_i, 0, 1)
        orthogonality = 1 − Σ_{i<j} w_i w_j |cos|_ij / Σ_{i<j} w_i w_j
        score         = constancy · orthogonality      (1 ⇔ orthogonal spheres)

    with w_i the energy share (``weighting="energy"``, default: a tiny component cannot disturb |x|
    much) or 1/k (``"uniform"``). The product is 1 only when both conditions hold and drops with
    either. ``resid_norm_cv`` is the CV of the summed vector's norm: what a Pre-Norm head actually
    divides by. Zero components (e.g. an untrained bias) get cv NaN and weight 0.
    ``center`` removes each vector's mean over d (LayerNorm's spheres live ⊥ 1). Note that
    independent random directions in R^d have E|cos| ≈ √(2/(πd)), so a real model's orthogonality
    is compared between variants, not with 1.
    """
    if weighting not in ("energy", "uniform"):
        raise GeometryError(f"weighting must be 'energy' or 'uniform', got {weighting!r}")
    names = list(components)
    if not names:
        raise GeometryError("no components given")
    X = torch.stack([torch.as_tensor(components[n]).detach() for n in names])  # k ... d
    if mask is not None:
        X = X[:, mask]
    X = X.reshape(len(names), -1, X.shape[-1])
    step = _chunk_size(X.shape[0], X.shape[-1], chunk)
    chunks = (X[:, s : s + step] for s in range(0, X.shape[1], step))
    norms, mac, mc, total = _stream_sphere_stats(chunks, torch.ones(len(names), 1, dtype=torch.bool), center)
    return _sphere_tables(names, norms, mac, mc, total[0], weighting)


def orthogonal_spheres(
    model: HookedNormTransformer,
    tokens: TokensLike,
    *,
    layers: Optional[Sequence[int]] = None,
    weighting: str = "energy",
    granularity: str = "head",
    include_bias: bool = True,
    exclude_bos: bool = True,
    center: Union[bool, str] = "auto",
    chunk: Optional[int] = None,
    cache=None,
) -> dict[str, pd.DataFrame]:
    """:func:`sphere_structure` of the residual decomposition (:func:`residual_components`) at each
    layer's input.

    ``layers`` default: 0..n_layers (n_layers = the input of ``ln_final``, also a norm). Returns
    ``{"components", "pairs", "scores"}`` with a ``layer`` column. All layers share one streamed pass
    over the tokens (pairwise cosines of a component pair do not depend on the layer). Compare
    variants with :func:`compare_geometry`.
    """
    _check_model(model)
    if weighting not in ("energy", "uniform"):
        raise GeometryError(f"weighting must be 'energy' or 'uniform', got {weighting!r}")
    if granularity not in ("head", "layer"):
        raise ConfigError(f"granularity must be 'head' or 'layer', got {granularity!r}")
    tokens = _tokens(model, tokens)
    cfg = model.cfg
    n_layers = cfg.n_layers
    layers = list(range(n_layers + 1)) if layers is None else list(layers)
    bad = [l for l in layers if not (isinstance(l, int) and 0 <= l <= n_layers)]
    if bad or not layers:
        raise ConfigError(f"layers must be integers in [0, {n_layers}] (n_layers = ln_final input), got {layers!r}")
    ctr = _center(model, center)
    top = max(layers)
    names = ["hook_embed", "hook_pos_embed"]
    for l in range(top):
        names += [f"blocks.{l}.attn.hook_z", f"blocks.{l}.hook_attn_out", f"blocks.{l}.hook_mlp_out"]
    cache = _run(model, tokens, names, cache)
    mask = valid_mask(tokens, exclude_bos)
    bi, pi = mask.nonzero(as_tuple=True)
    if bi.numel() == 0:
        raise GeometryError("no tokens left after excluding padding and '['; pass sequences with content")

    # every distinct component once; "attn_bias@j" is the summed b_O seen by layer j
    comp_names: list[str] = ["tok", "pos"]
    written_by: list[int] = [0, 0]  # first layer whose input contains the component
    for l in range(top):
        if granularity == "head":
            comp_names += [f"L{l}H{h}" for h in range(cfg.n_heads)]
            written_by += [l + 1] * cfg.n_heads
        else:
            comp_names.append(f"L{l}.attn")
            written_by.append(l + 1)
        comp_names.append(f"L{l}.mlp")
        written_by.append(l + 1)
    bias_layers = [j for j in layers if j > 0] if (include_bias and granularity == "head") else []
    comp_names += [f"attn_bias@{j}" for j in bias_layers]
    k = len(comp_names)
    members = torch.zeros(k, len(layers), dtype=torch.bool)
    for gi, j in enumerate(layers):
        for ci, (nm, wb) in enumerate(zip(comp_names, written_by)):
            members[ci, gi] = wb <= j
        if j in bias_layers:
            members[len(written_by) + bias_layers.index(j), gi] = True
    cum_bias = torch.cumsum(torch.stack([b.attn.b_O.detach() for b in model.blocks[:top]]), 0) if top else None

    def chunks():
        step = _chunk_size(k, cfg.d_model, chunk)
        for s in range(0, bi.numel(), step):
            b, p = bi[s : s + step], pi[s : s + step]
            parts = [cache["hook_embed"][b, p], cache["hook_pos_embed"][b, p]]
            for l in range(top):
                if granularity == "head":
                    z = cache[f"blocks.{l}.attn.hook_z"][b, p]  # c h dh
                    parts += list(torch.einsum("chd,hdm->hcm", z, model.blocks[l].attn.W_O.detach()))
                else:
                    parts.append(cache[f"blocks.{l}.hook_attn_out"][b, p])
                parts.append(cache[f"blocks.{l}.hook_mlp_out"][b, p])
            for j in bias_layers:
                parts.append(cum_bias[j - 1].expand(b.numel(), -1))
            yield torch.stack(parts)

    with torch.no_grad():
        norms, mac, mc, total = _stream_sphere_stats(chunks(), members, ctr)
    out: dict[str, list] = {"components": [], "pairs": [], "scores": []}
    for gi, j in enumerate(layers):
        idx = members[:, gi].nonzero().flatten()
        nm = [comp_names[i].split("@")[0] for i in idx.tolist()]
        res = _sphere_tables(nm, norms[idx], mac[idx][:, idx], mc[idx][:, idx], total[gi], weighting)
        for key, df in res.items():
            out[key].append(df.assign(layer=j))
    return {key: pd.concat(v, ignore_index=True)[["layer", *[c for c in v[0].columns if c != "layer"]]]
            for key, v in out.items()}


# ============================================================================= direct interference


@dataclass(frozen=True, eq=False)
class ScaleComponent:
    """Multiply one writer's component (a cached hook, default the token embedding) by ``factor``."""

    hook_name: str = "hook_embed"
    factor: float = 0.5

    @property
    def needs(self) -> tuple[str, ...]:
        return (self.hook_name,)

    def delta(self, model: HookedNormTransformer, cache, layer: int) -> Tensor:
        return (self.factor - 1.0) * cache[self.hook_name]


@dataclass(frozen=True, eq=False)
class AddOrthogonal:
    """Add, at every token, a random vector orthogonal to a subspace (default: the positional one),
    of norm ``rel_norm`` × |x_t| (the residual norm at the layer's input). Seeded; same draw per layer."""

    basis: Optional[Tensor] = None
    rel_norm: float = 0.5
    seed: int = 0

    needs: tuple[str, ...] = field(default=(), init=False)

    def delta(self, model: HookedNormTransformer, cache, layer: int) -> Tensor:
        x = cache[f"blocks.{layer}.hook_resid_pre"]
        B = positional_subspace(model) if self.basis is None else torch.as_tensor(self.basis).double()
        if B.shape[1] >= x.shape[-1]:
            raise GeometryError(
                "the subspace spans the whole residual stream, so no vector is orthogonal to it; "
                "pass a smaller basis (e.g. positional_subspace(model, energy=0.9))"
            )
        g = torch.Generator().manual_seed(self.seed)
        v = torch.randn(x.shape, generator=g, dtype=torch.float64)
        v = v - (v @ B) @ B.T
        v = v / v.norm(dim=-1, keepdim=True).clamp_min(_TINY)
        return (self.rel_norm * x.double().norm(dim=-1, keepdim=True) * v).to(x.dtype)


Intervention = Union[ScaleComponent, AddOrthogonal]


def default_interventions() -> dict[str, Intervention]:
    """Scale the token-type component by ½ and by 2; add a vector ⊥ the positional subspace (½|x|)."""
    return {
        "tok x0.5": ScaleComponent("hook_embed", 0.5),
        "tok x2": ScaleComponent("hook_embed", 2.0),
        "orth-pos +0.5|x|": AddOrthogonal(None, 0.5, seed=0),
    }


def _patterns_under(model: HookedNormTransformer, tokens: Tensor, cache, deltas: list[Tensor], freeze_scale: bool) -> list[Tensor]:
    """Attention patterns when every layer's input is its clean value plus ``deltas[l]``; with
    ``freeze_scale`` the Pre-Norm ``ln1`` divides by its *clean* scale (the shared-norm path cut)."""
    captured: dict[int, Tensor] = {}

    def patch(x, hook, l):
        return cache[f"blocks.{l}.hook_resid_pre"] + deltas[l].to(x.dtype)

    def grab(x, hook, l):
        captured[l] = x.detach().double()

    def clean_scale(x, hook, l):
        return cache[f"blocks.{l}.ln1.hook_scale"].to(x.dtype)

    fwd = []
    for l in range(model.cfg.n_layers):
        fwd.append((f"blocks.{l}.hook_resid_pre", lambda x, hook, l=l: patch(x, hook, l)))
        fwd.append((f"blocks.{l}.attn.hook_pattern", lambda x, hook, l=l: grab(x, hook, l)))
        if freeze_scale:
            fwd.append((f"blocks.{l}.ln1.hook_scale", lambda x, hook, l=l: clean_scale(x, hook, l)))
    with torch.no_grad():
        model.run_with_hooks(tokens, fwd_hooks=fwd)
    return [captured[l] for l in range(model.cfg.n_layers)]


def direct_interference(
    model: HookedNormTransformer,
    tokens: TokensLike,
    interventions: Optional[Mapping[str, Intervention]] = None,
    *,
    exclude_bos: bool = True,
    progress: bool = False,
    cache=None,
) -> pd.DataFrame:
    """How far each head's attention moves when one subspace's component changes (beyond the paper).

    For every layer at once, the layer's input is replaced by its *clean* value plus the
    intervention's delta (``blocks.{l}.hook_resid_pre``), so each layer sees only the direct change,
    not changes propagated from earlier layers. Per (intervention, layer, head): ``mean_tv`` /
    ``max_tv`` = mean / max over valid query rows of the total-variation distance ½Σ_t|Δa_t|, and
    ``max_abs`` = max |Δa_t|. ``pos_read_q/k`` and ``tok_read_q/k`` are the shares of the head's
    effective W_Q/W_K in the positional / token-embedding subspace (a positional head has ≈ 1 in pos),
    so heads that read *another* subspace than the one changed can be picked out. Theory: Pre-Norm
    heads move through the shared norm; QKV-Norm heads that do not read the changed subspace do not.

    Trained heads read several subspaces, so the change is also split by path (Pre-Norm only): a
    second run holds ``ln1``'s scale at its clean value. ``mean_tv_direct`` = change with the scale
    frozen (through the head's linear reads alone); ``mean_tv_norm`` = TV between the full and the
    frozen run (what the shared norm adds: Theorem 2's interference). Without a shared norm
    (QKV/QK/No-Norm) there is no such path: ``mean_tv_direct`` = ``mean_tv`` and ``mean_tv_norm`` = 0.
    The two parts are distances, not a sum: they can partly cancel (scaling a component up raises
    the scores it feeds while the larger norm lowers every score).
    An intervention is any object with ``needs`` (cached hook names) and ``delta(model, cache, layer)``.
    """
    _check_model(model)
    tokens = _tokens(model, tokens)
    interventions = default_interventions() if interventions is None else dict(interventions)
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    needs = {f"blocks.{l}.hook_resid_pre" for l in range(n_layers)} | {f"blocks.{l}.attn.hook_pattern" for l in range(n_layers)}
    for iv in interventions.values():
        needs |= set(iv.needs)
    shared_norm = model.cfg.attn_norm == "pre"
    if shared_norm:
        needs |= {f"blocks.{l}.ln1.hook_scale" for l in range(n_layers)}
    cache = _run(model, tokens, needs, cache)
    rows_mask = valid_mask(tokens, exclude_bos)
    if not rows_mask.any():
        raise GeometryError("no query rows left after excluding padding and '['")
    bases = {"pos": positional_subspace(model), "tok": token_subspace(model)}
    reads = {}
    for l in range(n_layers):
        for (h, n), M in effective_read_matrices(model, l).items():
            if n == "v":
                continue
            tot = float((M**2).sum())
            for s, Q in bases.items():
                reads[(l, h, f"{s}_read_{n}")] = float(((Q.T @ M) ** 2).sum()) / tot if tot > 0 else float("nan")
    rows = []
    for name, iv in tqdm(interventions.items(), desc="interference", disable=not progress):
        with torch.no_grad():
            deltas = [iv.delta(model, cache, l) for l in range(n_layers)]
        full = _patterns_under(model, tokens, cache, deltas, freeze_scale=False)
        frozen = _patterns_under(model, tokens, cache, deltas, freeze_scale=True) if shared_norm else full
        for l in range(n_layers):
            clean = cache[f"blocks.{l}.attn.hook_pattern"].double()
            d = (full[l] - clean).abs()  # b h q k
            tv = 0.5 * d.sum(-1)  # b h q
            tv_direct = 0.5 * (frozen[l] - clean).abs().sum(-1)
            tv_norm = 0.5 * (full[l] - frozen[l]).abs().sum(-1)
            for h in range(n_heads):
                t = tv[:, h][rows_mask]
                rows.append(dict(intervention=name, layer=l, head=h, mean_tv=float(t.mean()), max_tv=float(t.max()),
                                 max_abs=float(d[:, h][rows_mask].max()),
                                 mean_tv_direct=float(tv_direct[:, h][rows_mask].mean()),
                                 mean_tv_norm=float(tv_norm[:, h][rows_mask].mean()),
                                 **{k[2]: v for k, v in reads.items() if k[0] == l and k[1] == h}))
    return pd.DataFrame(rows)


# ============================================================================= LayerNorm ellipsoid


@dataclass(frozen=True, eq=False)
class NormEllipsoid:
    """The image of a LayerNorm/RMSNorm with gain g and bias b (Riechers 2024; digest §7.2).

    LayerNorm: outputs y lie in the hyperplane through ``center`` = b with unit ``normal`` ∝ 1/g
    (Σ_n (y_n − b_n)/g_n = 0), inside the (N−1)-dim ellipsoid zᵀ Q z ≤ N (z = y − b) with
    Q = Π₂ diag(1/g²) Π₂, Π₂ = I − α̂α̂ᵀ. ``axes`` [N−1, N] (rows) are Q's eigenvectors with nonzero
    eigenvalue λ, ``semi_axes`` = √(N/λ), longest first. RMSNorm: no hyperplane (``normal`` None),
    Q = diag(1/g²), N axes of length √N·|g_n|. ``membership(y)`` = zᵀQz/N = σ²/(σ²+ε) < 1 for any output.
    """

    kind: str
    gain: Tensor
    center: Tensor
    normal: Optional[Tensor]
    axes: Tensor
    semi_axes: Tensor
    quad: Tensor

    @property
    def dim(self) -> int:
        return int(self.gain.numel())

    def membership(self, y: Float[Tensor, "... N"]) -> Float[Tensor, "..."]:
        """zᵀQz/N with z = y − b, computed as |Π₂z / g|²/N (O(N) per vector, same value)."""
        z = torch.as_tensor(y).double() - self.center
        if self.normal is not None:
            z = z - (z @ self.normal).unsqueeze(-1) * self.normal
        return ((z / self.gain) ** 2).sum(-1) / self.dim

    def plane_residual(self, y: Float[Tensor, "... N"]) -> Float[Tensor, "..."]:
        """(y − b)·α̂: 0 on the hyperplane (always 0 for RMSNorm)."""
        z = torch.as_tensor(y).double() - self.center
        if self.normal is None:
            return torch.zeros(z.shape[:-1], dtype=torch.float64)
        return z @ self.normal


def norm_ellipsoid(gain: Tensor, bias: Optional[Tensor] = None, kind: str = "ln") -> NormEllipsoid:
    """Principal axes of the norm's image; raises :class:`GeometryError` for zero gains.

    The (N−1)-dim eigenproblem is solved in an orthonormal basis of the hyperplane (same nonzero
    spectrum as Π₂ diag(1/g²) Π₂, without having to guess which eigenvalue is the structural zero).
    """
    if kind not in ("ln", "rms"):
        raise GeometryError(f"kind must be 'ln' (LayerNorm) or 'rms' (RMSNorm), got {kind!r}")
    g = torch.as_tensor(gain).detach().double().cpu().reshape(-1)
    N = g.numel()
    if N < (2 if kind == "ln" else 1):
        raise GeometryError(f"a {kind} norm over {N} dimension(s) has no ellipsoid; need N >= 2 for LayerNorm")
    zero = (g == 0).nonzero().flatten().tolist()
    if zero:
        raise GeometryError(
            f"the gain is zero in {len(zero)} dimension(s) {zero[:10]}; the image then collapses to a lower-"
            "dimensional ellipsoid (Riechers treats this with a Drazin inverse, not implemented). "
            "Drop those dimensions (gain[gain != 0]) or perturb them before calling norm_ellipsoid"
        )
    if not torch.isfinite(g).all():
        raise GeometryError("the gain has non-finite entries")
    b = torch.zeros(N, dtype=torch.float64) if bias is None else torch.as_tensor(bias).detach().double().cpu().reshape(-1)
    if b.numel() != N:
        raise GeometryError(f"bias has {b.numel()} entries but the gain has {N}")
    Ginv2 = torch.diag(1.0 / g**2)
    if kind == "rms":
        lam, V = torch.linalg.eigh(Ginv2)
        normal, quad = None, Ginv2
    else:
        alpha = 1.0 / g
        normal = alpha / alpha.norm()
        P2 = torch.eye(N, dtype=torch.float64) - torch.outer(normal, normal)
        quad = P2 @ Ginv2 @ P2
        # orthonormal basis of the hyperplane ⊥ normal: the complement from a full QR
        Qf, _ = torch.linalg.qr(torch.cat([normal[:, None], torch.eye(N, dtype=torch.float64)], 1), mode="complete")
        B = Qf[:, 1:N]
        lam, W = torch.linalg.eigh(B.T @ Ginv2 @ B)
        V = B @ W
    semi = torch.sqrt(N / lam)
    order = torch.argsort(semi, descending=True)
    return NormEllipsoid(kind=kind, gain=g, center=b, normal=normal, axes=V[:, order].T.contiguous(),
                         semi_axes=semi[order], quad=quad)


def norm_modules(model: HookedNormTransformer) -> dict[str, Norm]:
    """Every residual-stream norm: ``blocks.{l}.ln1`` (Pre-Norm only), ``blocks.{l}.ln2``, ``ln_final``."""
    out = {}
    for l, block in enumerate(model.blocks):
        if hasattr(block, "ln1"):
            out[f"blocks.{l}.ln1"] = block.ln1
        out[f"blocks.{l}.ln2"] = block.ln2
    out["ln_final"] = model.ln_final
    return out


def module_ellipsoids(module: Norm) -> list[NormEllipsoid]:
    """One ellipsoid per gain row (the Pre-Norm ``ln1`` has separate q/k/v gains on one shared scale)."""
    if not isinstance(module, Norm):
        raise ConfigError(f"expected an interp_norm Norm module, got {type(module).__name__}")
    w = module.w.detach()
    rows = [w[i] for i in range(w.shape[0])] if w.ndim == 2 else [w]
    b = module.b.detach() if module.b is not None else None
    return [norm_ellipsoid(r, b, module.kind) for r in rows]


_GAIN_ROW_NAMES = {3: ("q", "k", "v")}


def _row_name(n_rows: int, i: int) -> str:
    return _GAIN_ROW_NAMES.get(n_rows, tuple(str(j) for j in range(n_rows)))[i] if n_rows > 1 else "all"


def ellipsoid_table(model: HookedNormTransformer) -> pd.DataFrame:
    """One row per norm module and gain row: kind, N, semi-axis range, axis ratio, tilt of the
    hyperplane (``normal_cos_ones`` = |α̂·1̂|, 1 for equal gains) and |b|."""
    _check_model(model)
    rows = []
    for name, mod in norm_modules(model).items():
        ells = module_ellipsoids(mod)
        for i, e in enumerate(ells):
            s = e.semi_axes
            ones = torch.full((e.dim,), 1.0 / math.sqrt(e.dim), dtype=torch.float64)
            rows.append(dict(module=name, gain_row=_row_name(len(ells), i), kind=e.kind, N=e.dim,
                             n_axes=int(s.numel()), max_semi_axis=float(s.max()), min_semi_axis=float(s.min()),
                             median_semi_axis=float(s.median()), axis_ratio=float(s.max() / s.min()),
                             normal_cos_ones=float((e.normal @ ones).abs()) if e.normal is not None else float("nan"),
                             center_norm=float(e.center.norm()), radius_at_unit_gain=math.sqrt(e.dim)))
    return pd.DataFrame(rows)


def ellipsoid_axes(model: HookedNormTransformer) -> pd.DataFrame:
    """Long table of every semi-axis length (module, gain_row, axis, semi_axis) for spectrum plots."""
    rows = []
    for name, mod in norm_modules(model).items():
        ells = module_ellipsoids(mod)
        for i, e in enumerate(ells):
            for a, s in enumerate(e.semi_axes.tolist()):
                rows.append(dict(module=name, gain_row=_row_name(len(ells), i), axis=a, semi_axis=s))
    return pd.DataFrame(rows)


def ellipsoid_membership(
    model: HookedNormTransformer, tokens: TokensLike, *, exclude_bos: bool = False, cache=None
) -> pd.DataFrame:
    """Check cached norm outputs against the ellipsoid: membership must equal 1 − ε/scale² < 1.

    Uses ``{module}.hook_normalized`` (full output after gain and bias; for the Pre-Norm ``ln1`` with
    separate gains it is the pre-gain vector, so each gain row is applied here) and ``hook_scale``
    = √(σ²+ε). Per module and gain row: membership statistics, the predicted value's statistics,
    the largest |membership − predicted| and the largest |plane residual| relative to |y − b|.
    ``max_abs_err`` is the check (≈ 3e-7 from float32 activations): when σ² ≫ ε the membership is
    within that rounding of 1, so ``membership_max`` can print as 1.0000001.
    """
    _check_model(model)
    tokens = _tokens(model, tokens)
    mods = norm_modules(model)
    names = [f"{m}.hook_normalized" for m in mods] + [f"{m}.hook_scale" for m in mods]
    cache = _run(model, tokens, names, cache)
    mask = valid_mask(tokens, exclude_bos)
    rows = []
    for name, mod in mods.items():
        out = cache[f"{name}.hook_normalized"].double()[mask]
        scale = cache[f"{name}.hook_scale"].double()[mask][..., 0]
        pred = 1.0 - mod.eps / scale**2
        ells = module_ellipsoids(mod)
        separate = mod.n_gains > 1
        for i, e in enumerate(ells):
            y = out * e.gain if separate else out  # separate gains: hook_normalized is before the gains
            m = e.membership(y)
            z = (y - e.center).norm(dim=-1).clamp_min(_TINY)
            rows.append(dict(module=name, gain_row=_row_name(len(ells), i), kind=e.kind, n=int(m.numel()),
                             eps=mod.eps, membership_mean=float(m.mean()), membership_min=float(m.min()),
                             membership_max=float(m.max()), predicted_mean=float(pred.mean()),
                             max_abs_err=float((m - pred).abs().max()),
                             max_plane_residual=float((e.plane_residual(y).abs() / z).max())))
    return pd.DataFrame(rows)


# ============================================================================= one call


def geometry_hook_names(model: HookedNormTransformer) -> list[str]:
    """Every hook the analyses here read (cache them once and pass ``cache=`` to each analysis)."""
    names = ["hook_embed", "hook_pos_embed"]
    for l in range(model.cfg.n_layers):
        names += [f"blocks.{l}.{n}" for n in ("hook_resid_pre", "attn.hook_pattern", "attn.hook_z",
                                               "hook_attn_out", "hook_mlp_out")]
    for m in norm_modules(model):
        names += [f"{m}.hook_normalized", f"{m}.hook_scale"]
    return names


def _sample_tokens(model: HookedNormTransformer, task, tokens, n: int, split: str, seed: int) -> Tensor:
    if tokens is not None:
        return _tokens(model, tokens)
    if task is None:
        raise ConfigError("run_geometry needs a task (AdditionTask) or tokens; pass task=AdditionTask.preset('cpu') or tokens=...")
    return _tokens(model, task.sample_batch(n, split, seed=seed).tokens)


def run_geometry(
    model: HookedNormTransformer,
    task=None,
    *,
    tokens: Optional[TokensLike] = None,
    n: int = 256,
    split: str = "id",
    seed: int = 0,
    coverage: float = 0.9,
    tolerance: float = 0.2,
    bins: int = 20,
    energy: float = 0.9,
    weighting: str = "energy",
    interventions: Optional[Mapping[str, Intervention]] = None,
    progress: bool = False,
) -> dict[str, pd.DataFrame]:
    """Every geometry analysis on one batch (``n`` problems of ``split``, or the given ``tokens``).

    Keys: ``norm_spread``, ``sparsity_hist``, ``sparsity_summary``, ``sphere_components``,
    ``sphere_pairs``, ``sphere_scores``, ``subspace_angles``, ``head_reads``, ``interference``,
    ``ellipsoids``, ``ellipsoid_axes``, ``ellipsoid_membership``. ``subspace_angles`` holds every
    component–component and component–read pair (head read spaces among themselves are skipped:
    ~65k large SVDs on the paper-size model; call :func:`subspace_angles` for them).
    """
    _check_model(model)
    tokens = _sample_tokens(model, task, tokens, n, split, seed)
    steps = tqdm(total=8, desc="geometry", disable=not progress)
    cache = _run(model, tokens, geometry_hook_names(model))  # one forward pass for every analysis
    steps.update()
    out: dict[str, pd.DataFrame] = {}
    out["norm_spread"] = norm_spread(model, tokens, coverage=coverage, tolerance=tolerance, cache=cache)
    steps.update()
    mx = max_attention(model, tokens, cache=cache)
    out["sparsity_hist"] = sparsity_histogram(mx, bins=bins)
    out["sparsity_summary"] = sparsity_summary(mx)
    steps.update()
    sph = orthogonal_spheres(model, tokens, weighting=weighting, cache=cache)
    out["sphere_components"], out["sphere_pairs"], out["sphere_scores"] = sph["components"], sph["pairs"], sph["scores"]
    steps.update()
    bases = subspaces(model, tokens, energy=energy, cache=cache)
    is_read = {k: k.endswith((".q", ".k", ".v")) for k in bases}
    names = list(bases)
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :] if not (is_read[a] and is_read[b])]
    out["subspace_angles"] = subspace_angles(bases, pairs=pairs)
    comp_bases = {k: v for k, v in bases.items() if not is_read[k]}
    out["head_reads"] = head_read_fractions(model, comp_bases)
    steps.update()
    out["interference"] = direct_interference(model, tokens, interventions, cache=cache)
    steps.update()
    out["ellipsoids"] = ellipsoid_table(model)
    out["ellipsoid_axes"] = ellipsoid_axes(model)
    steps.update()
    out["ellipsoid_membership"] = ellipsoid_membership(model, tokens, cache=cache)
    steps.update()
    steps.close()
    return out


def compare_geometry(
    models: Mapping[str, HookedNormTransformer], task=None, *, tokens: Optional[TokensLike] = None, **kwargs
) -> dict[str, pd.DataFrame]:
    """:func:`run_geometry` on several models (e.g. ``{"pre": m1, "qkv": m2}``) on the same batch;
    the tables are concatenated with a leading ``variant`` column (Pre-Norm vs QKV-Norm side by side)."""
    if not models:
        raise ConfigError("compare_geometry needs at least one model, e.g. {'pre': model_a, 'qkv': model_b}")
    for m in models.values():
        _check_model(m)
    n, split, seed = kwargs.pop("n", 256), kwargs.pop("split", "id"), kwargs.pop("seed", 0)
    first = next(iter(models.values()))
    toks = _sample_tokens(first, task, tokens, n, split, seed)
    per = {name: run_geometry(m, tokens=toks, **kwargs) for name, m in models.items()}
    keys = next(iter(per.values())).keys()
    return {k: pd.concat([df[k].assign(variant=v) for v, df in per.items()], ignore_index=True)
            .pipe(lambda d: d[["variant", *[c for c in d.columns if c != "variant"]]]) for k in keys}


def geometry_summary(
    results: Mapping[str, pd.DataFrame], *, per_layer: bool = True, top_bin: Optional[float] = None
) -> pd.DataFrame:
    """The README table. Works on :func:`run_geometry` or :func:`compare_geometry` output.

    ``per_layer=True``: one row per (variant, layer) with the pooled norm ``spread`` and
    ``within_tol`` share, sparsity shares (``frac_top_bin`` = share of max attention in the
    histogram's top bin: the paper's "peak at 1"), the orthogonal-spheres ``score`` and its terms,
    and the mean attention change per intervention (``tv[<name>]``) and its shared-norm part
    (``tv_norm[<name>]``, see :func:`direct_interference`). Layer n_layers (the ln_final
    input) only has sphere columns. ``per_layer=False``: one row per variant: spread and sphere
    columns averaged over the attention layers 0..n_layers−1 (``max_spread`` the worst layer),
    sparsity shares of all distributions pooled, tv columns averaged over heads and layers.
    """
    if not per_layer:
        return _overall_summary(results, top_bin)
    has_v = "variant" in results["norm_spread"].columns
    keys = ["variant", "layer"] if has_v else ["layer"]
    ns = results["norm_spread"]
    ns = ns[ns["head"].isna()][keys + ["spread", "within_tol"]]
    ss = results["sparsity_summary"]
    ss = ss[ss["layer"].notna()][keys + ["frac_sparse", "frac_nonsparse", "median"]].rename(columns={"median": "median_max_attn"})
    h = results["sparsity_hist"]
    h = h[h["layer"].notna()]
    top = h[h["bin"] == h["bin"].max()] if top_bin is None else h[h["lo"] >= top_bin]
    top = top.groupby(keys, as_index=False)["fraction"].sum().rename(columns={"fraction": "frac_top_bin"})
    sc = results["sphere_scores"][keys + ["score", "constancy", "orthogonality", "resid_norm_cv"]]
    it = results["interference"].pivot_table(index=keys, columns="intervention", values=["mean_tv", "mean_tv_norm"],
                                             aggfunc="mean")
    it.columns = [f"{'tv' if v == 'mean_tv' else 'tv_norm'}[{c}]" for v, c in it.columns]
    it = it.reset_index()
    out = sc
    for df in (ns, ss, top, it):
        df = df.copy()
        df["layer"] = df["layer"].astype(int)
        out = out.merge(df, on=keys, how="outer")
    return out.sort_values(keys).reset_index(drop=True)


def _overall_summary(results: Mapping[str, pd.DataFrame], top_bin: Optional[float]) -> pd.DataFrame:
    per = geometry_summary(results, per_layer=True, top_bin=top_bin)
    has_v = "variant" in per.columns
    if not has_v:
        per = per.assign(variant="model")
    attn = per[per["spread"].notna()]  # attention layers only
    agg = attn.groupby("variant", sort=False).agg(
        mean_spread=("spread", "mean"), max_spread=("spread", "max"), within_tol=("within_tol", "mean"),
        sphere_score=("score", "mean"), constancy=("constancy", "mean"), orthogonality=("orthogonality", "mean"),
        resid_norm_cv=("resid_norm_cv", "mean"),
        **{c: (c, "mean") for c in per.columns if c.startswith(("tv[", "tv_norm["))},
    )
    ss = results["sparsity_summary"]
    ss = ss[ss["layer"].isna()]
    h = results["sparsity_hist"]
    h = h[h["layer"].isna()]
    h = h[h["bin"] == h["bin"].max()] if top_bin is None else h[h["lo"] >= top_bin]
    if not has_v:
        ss, h = ss.assign(variant="model"), h.assign(variant="model")
    agg = agg.join(ss.set_index("variant")[["frac_sparse", "frac_nonsparse", "median"]]
                   .rename(columns={"median": "median_max_attn"}))
    agg = agg.join(h.groupby("variant")["fraction"].sum().rename("frac_top_bin"))
    out = agg.reset_index()
    return out if has_v else out.drop(columns="variant")
