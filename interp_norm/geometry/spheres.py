"""Orthogonal spheres: Theorem 2's condition for Pre-Norm (Menary et al. 2024, arXiv 2406.17837).

A Pre-Norm head sees x/|x|, so semantic subspaces stay independent only if each component of the
residual stream has constant norm and the components are mutually orthogonal. This scores both
conditions per layer on the residual decomposition (embeddings, each head, each MLP).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from interp_norm.errors import ConfigError, GeometryError
from interp_norm.geometry._common import (
    TINY,
    TokensLike,
    as_tokens,
    attn_write,
    check_model,
    run_cached,
    use_center,
    valid_mask,
    writer_hooks,
)
from interp_norm.core.hook_names import act_name
from interp_norm.core.model import HookedNormTransformer
from interp_norm.core.specs import with_overrides

__all__ = ["sphere_structure", "SpheresSpec", "orthogonal_spheres"]


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
        U = (X / nr.clamp_min(TINY).unsqueeze(-1)).float()
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
    alive = mean > TINY * max(float(mean.max()), 1.0)
    cv = torch.where(alive, norms.std(1, unbiased=False) / mean.clamp_min(TINY), torch.full_like(mean, float("nan")))
    share = energy / energy.sum().clamp_min(TINY)
    w = share.clone() if weighting == "energy" else alive.double() / max(int(alive.sum()), 1)
    w = torch.where(alive, w, torch.zeros_like(w))
    w = w / w.sum().clamp_min(TINY)
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
                                  resid_norm_cv=float(total.std(unbiased=False) / total.mean().clamp_min(TINY)),
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


@dataclass(frozen=True)
class SpheresSpec:
    """The options of :func:`orthogonal_spheres` (also taken as keywords; an unknown one: ConfigError).

    ``layers`` default: 0..n_layers (n_layers = the input of ``ln_final``, also a norm); ``weighting`` as
    :func:`sphere_structure`; ``granularity`` "head" (one component per head's write, plus the summed
    ``b_O`` as ``attn_bias`` when ``include_bias``) or "layer" (one per attention layer); ``exclude_bos`` drops
    the ``[`` position; ``center`` (True, False or "auto": the model's norm decides) as :func:`sphere_structure`;
    ``chunk`` tokens per streamed block (None: automatic).
    """

    layers: Optional[Sequence[int]] = None
    weighting: str = "energy"
    granularity: str = "head"
    include_bias: bool = True
    exclude_bos: bool = True
    center: Union[bool, str] = "auto"
    chunk: Optional[int] = None


@dataclass
class _Decomposition:
    """The residual components of one cached run up to layer ``top``'s input: ``names`` (the summed ``b_O``
    seen by layer j is ``attn_bias@j``), ``written_by`` (first layer whose input holds each one), streamed
    a block of tokens at a time by :meth:`chunks`."""

    model: HookedNormTransformer
    cache: Any
    top: int
    granularity: str
    bias_layers: list[int]
    names: list[str]
    written_by: list[int]
    cum_bias: Optional[Tensor]

    @classmethod
    def build(cls, model: HookedNormTransformer, cache: Any, top: int, granularity: str,
              bias_layers: list[int]) -> "_Decomposition":
        """Every distinct component once, with the cumulative output bias of the attention layers."""
        names: list[str] = ["tok", "pos"]
        written_by: list[int] = [0, 0]
        for l in range(top):
            if granularity == "head":
                names += [f"L{l}H{h}" for h in range(model.cfg.n_heads)]
                written_by += [l + 1] * model.cfg.n_heads
            else:
                names.append(f"L{l}.attn")
                written_by.append(l + 1)
            names.append(f"L{l}.mlp")
            written_by.append(l + 1)
        names += [f"attn_bias@{j}" for j in bias_layers]
        cum_bias = (torch.cumsum(torch.stack([attn_write(model, l, model.blocks[l].attn.b_O.detach())
                                              for l in range(top)]), 0) if top else None)
        return cls(model, cache, top, granularity, bias_layers, names, written_by, cum_bias)

    def members(self, layers: list[int]) -> Tensor:
        """[component, layer group]: whether layer ``layers[g]``'s input holds the component."""
        members = torch.zeros(len(self.names), len(layers), dtype=torch.bool)
        for gi, j in enumerate(layers):
            for ci, wb in enumerate(self.written_by):
                members[ci, gi] = wb <= j
            if j in self.bias_layers:
                members[len(self.written_by) + self.bias_layers.index(j), gi] = True
        return members

    def chunks(self, bi: Tensor, pi: Tensor, step: int) -> Iterator[Tensor]:
        """[component, token, d_model] of the tokens (``bi``, ``pi``), ``step`` tokens at a time."""
        model, cache = self.model, self.cache
        embed, pos_embed = cache[act_name("embed")], cache[act_name("pos_embed")]
        for s in range(0, bi.numel(), step):
            b, p = bi[s : s + step], pi[s : s + step]
            parts = [embed[b, p], pos_embed[b, p]]
            for l in range(self.top):
                if self.granularity == "head":
                    z = cache[act_name("z", l)][b, p]  # c h dh
                    parts += list(attn_write(model, l, torch.einsum("chd,hdm->hcm", z, model.blocks[l].attn.W_O.detach())))
                else:
                    parts.append(cache[act_name("attn_out", l)][b, p])
                parts.append(cache[act_name("mlp_out", l)][b, p])
            for j in self.bias_layers:  # bias layers are > 0, so top > 0 and cum_bias exists
                parts.append(self.cum_bias[j - 1].expand(b.numel(), -1))  # type: ignore[index]
            yield torch.stack(parts)


def orthogonal_spheres(
    model: HookedNormTransformer,
    tokens: TokensLike,
    spec: Optional[SpheresSpec] = None,
    *,
    cache=None,
    **overrides: Any,
) -> dict[str, pd.DataFrame]:
    """:func:`sphere_structure` of the residual decomposition
    (:func:`~interp_norm.geometry.residual_components`) at each layer's input.

    Options: :class:`SpheresSpec` (``spec`` and/or its fields as keywords); ``cache`` a run's cache to reuse.
    Returns ``{"components", "pairs", "scores"}`` with a ``layer`` column. All layers share one streamed pass
    over the tokens (pairwise cosines of a component pair do not depend on the layer). Compare
    variants with :func:`~interp_norm.geometry.compare_geometry`.
    """
    sp = with_overrides(SpheresSpec, spec, overrides, who="orthogonal_spheres")
    check_model(model)
    if sp.weighting not in ("energy", "uniform"):
        raise GeometryError(f"weighting must be 'energy' or 'uniform', got {sp.weighting!r}")
    if sp.granularity not in ("head", "layer"):
        raise ConfigError(f"granularity must be 'head' or 'layer', got {sp.granularity!r}")
    tokens = as_tokens(model, tokens)
    n_layers = model.cfg.n_layers
    layers = list(range(n_layers + 1)) if sp.layers is None else list(sp.layers)
    bad = [l for l in layers if not (isinstance(l, int) and 0 <= l <= n_layers)]
    if bad or not layers:
        raise ConfigError(f"layers must be integers in [0, {n_layers}] (n_layers = ln_final input), got {layers!r}")
    ctr = use_center(model, sp.center)
    top = max(layers)
    cache = run_cached(model, tokens, writer_hooks(top), cache)
    mask = valid_mask(tokens, sp.exclude_bos)
    bi, pi = mask.nonzero(as_tuple=True)
    if bi.numel() == 0:
        raise GeometryError("no tokens left after excluding padding and '['; pass sequences with content")
    bias_layers = [j for j in layers if j > 0] if (sp.include_bias and sp.granularity == "head") else []
    dec = _Decomposition.build(model, cache, top, sp.granularity, bias_layers)
    members = dec.members(layers)
    with torch.no_grad():
        step = _chunk_size(len(dec.names), model.cfg.d_model, sp.chunk)
        norms, mac, mc, total = _stream_sphere_stats(dec.chunks(bi, pi, step), members, ctr)
    out: dict[str, list] = {"components": [], "pairs": [], "scores": []}
    for gi, j in enumerate(layers):
        idx = members[:, gi].nonzero().flatten()
        nm = [dec.names[i].split("@")[0] for i in idx.tolist()]
        res = _sphere_tables(nm, norms[idx], mac[idx][:, idx], mc[idx][:, idx], total[gi], sp.weighting)
        for key, df in res.items():
            out[key].append(df.assign(layer=j))
    return {key: pd.concat(v, ignore_index=True)[["layer", *[c for c in v[0].columns if c != "layer"]]]
            for key, v in out.items()}
