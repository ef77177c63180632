"""Semantic subspaces and the angles between them.

Theorem 3 of the paper: under QKV-Norm, subspaces need only be linearly independent. Here the
residual stream is split into its writers (embeddings, heads, MLPs), each writer's subspace is the
span of its outputs over a batch, each head's read space the span of its effective W_Q/W_K/W_V, and
principal angles measure how independent they are.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor
from tqdm.auto import tqdm

from interp_norm.errors import ConfigError, GeometryError
from interp_norm.geometry._common import (
    TokensLike,
    as_tokens,
    attn_write,
    check_model,
    projection_matrices,
    run_cached,
    valid_mask,
    writer_hooks,
)
from interp_norm.core.hook_names import act_name
from interp_norm.core.model import HookedNormTransformer

__all__ = [
    "orthonormal_basis", "principal_angles", "residual_components", "component_subspaces",
    "effective_read_matrices", "head_read_subspaces", "positional_subspace", "token_subspace",
    "subspaces", "subspace_angles", "head_read_fractions",
]


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


def _input_layer(model: HookedNormTransformer, layer) -> int:
    n_layers = model.cfg.n_layers
    if not isinstance(layer, int) or not 0 <= layer <= n_layers:
        raise ConfigError(f"layer must be an integer in [0, {n_layers}] (n_layers = ln_final input), got {layer!r}")
    return layer


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
    For ``calibration="paper"`` models the head outputs and b_O carry the block's update Checkpoint factor.
    """
    check_model(model)
    tokens = as_tokens(model, tokens)
    layer = _input_layer(model, layer)
    if granularity not in ("head", "layer"):
        raise ConfigError(f"granularity must be 'head' or 'layer', got {granularity!r}")
    cache = run_cached(model, tokens, writer_hooks(layer), cache)
    comps = {"tok": cache[act_name("embed")], "pos": cache[act_name("pos_embed")]}
    bias = torch.zeros_like(comps["tok"])
    for l in range(layer):
        a = model.blocks[l].attn
        if granularity == "head":
            z = cache[act_name("z", l)]
            res = attn_write(model, l, torch.einsum("bphd,hdm->bphm", z, a.W_O.detach()))
            for h in range(model.cfg.n_heads):
                comps[f"L{l}H{h}"] = res[:, :, h]
            bias = bias + attn_write(model, l, a.b_O.detach())
        else:
            comps[f"L{l}.attn"] = cache[act_name("attn_out", l)]
        comps[f"L{l}.mlp"] = cache[act_name("mlp_out", l)]
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
    which residual directions are read). W is taken from the attention's own ``project`` step, so it
    includes the input Checkpoint factor of ``calibration="paper"`` models. Keys ``(head, "q"|"k"|"v")``.
    """
    check_model(model)
    cfg = model.cfg
    block = model.blocks[layer]
    Ws = projection_matrices(model, layer)
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
    check_model(model)
    if model.cfg.pos_embed == "sinusoidal":
        return torch.eye(model.cfg.d_model, dtype=torch.float64)[:, : 2 * model.cfg.n_freq]
    with torch.no_grad():
        return orthonormal_basis(model.W_pos_embed.detach().T, energy=energy)


def token_subspace(model: HookedNormTransformer, *, energy: Optional[float] = None) -> Float[Tensor, "d k"]:
    """Span of the token embeddings W_E (at most d_vocab = 17 dimensions)."""
    check_model(model)
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
    check_model(model)
    tokens = as_tokens(model, tokens)
    layer = _input_layer(model, model.cfg.n_layers if layer is None else layer)
    mask = valid_mask(tokens, exclude_bos)
    cache = run_cached(model, tokens, writer_hooks(layer, ("z", "mlp_out")), cache)
    out = {"tok": orthonormal_basis(cache[act_name("embed")][mask].T, energy=energy),
           "pos": orthonormal_basis(cache[act_name("pos_embed")][mask].T, energy=energy)}
    bias = torch.zeros(model.cfg.d_model, dtype=torch.float64)
    for l in range(layer):
        a = model.blocks[l].attn
        z = cache[act_name("z", l)][mask]  # n h dh
        for h in range(model.cfg.n_heads):
            out[f"L{l}H{h}"] = _factored_basis(z[:, h], attn_write(model, l, a.W_O[h].detach()), energy)
        out[f"L{l}.mlp"] = orthonormal_basis(cache[act_name("mlp_out", l)][mask].T, energy=energy)
        bias = bias + attn_write(model, l, a.b_O.detach().double())
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
