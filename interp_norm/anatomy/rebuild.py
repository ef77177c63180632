"""Attention scores rebuilt from q and k given an :class:`Anatomy`, and the check against the pattern.

The scores an analysis uses are ``scale · q_rot · k_rot`` (after the q/k norms, after RoPE, with
each query head reading its key/value head), optionally soft-capped; never a bridge's
``hook_attn_scores``, which on some architectures holds something else (Gemma 4: the pattern).
:func:`verify_anatomy` is the acceptance check: softmax(masked scores) must equal ``hook_pattern``.

Everything here takes the anatomy as an argument (it is used while the anatomy is being built);
the wrappers that default it to ``anatomy(model)`` live in :mod:`interp_norm.anatomy.scores`.
Positions are 0..n−1 (unpadded sequences, no KV cache): the same positions a bridge uses when
called with a [batch, pos] token tensor.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import replace
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from interp_norm.anatomy._common import canonical, original
from interp_norm.anatomy.describe import Anatomy, LayerAnatomy
from interp_norm.errors import ArchitectureError


def attention_mask(la: LayerAnatomy, n_q: int, n_k: Optional[int] = None, device: Any = "cpu") -> Tensor:
    """Bool [query, key]: which keys each query may read (causal, within the sliding window)."""
    n_k = n_q if n_k is None else n_k
    q = torch.arange(n_q, device=device)[:, None] + (n_k - n_q)
    k = torch.arange(n_k, device=device)[None, :]
    allowed = k <= q
    if la.sliding_window is not None:
        allowed = allowed & (q - k < la.sliding_window)  # HF: kv_idx > q_idx - sliding_window
    return allowed


def masked_softmax(scores: Tensor, mask: Tensor) -> Tensor:
    """softmax over keys of ``scores`` [..., q, k] with disallowed keys at −inf, in float32 or wider."""
    dtype = torch.promote_types(scores.dtype, torch.float32)
    return scores.to(dtype).masked_fill(~mask, -math.inf).softmax(-1)


def rotate(model: Any, la: LayerAnatomy, x: Tensor) -> Tensor:
    """RoPE on canonical q or k [b, p, h, d] from the model's own rotary module (HF's rotate-half)."""
    rotary = original(getattr(model, "rotary_emb", None))
    if rotary is None:
        raise ArchitectureError("the model has rotary q/k but no rotary_emb module to rotate them with")
    hf_attn = original(model.blocks[la.layer]._modules["attn"])
    n = x.shape[1]
    positions = torch.arange(n, device=x.device)[None, :]
    kwargs = {}
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        kwargs["layer_type"] = getattr(hf_attn, "layer_type", None)
    with torch.no_grad():
        cos, sin = rotary(x, positions, **kwargs)
    cos, sin = cos[:, :, None, :].to(x.dtype), sin[:, :, None, :].to(x.dtype)
    r = cos.shape[-1]
    xr, rest = x[..., :r], x[..., r:]
    half = xr.shape[-1] // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], -1)
    return torch.cat([xr * cos + rotated * sin, rest], -1)


def rebuilt_query_key(model: Any, cache: Any, anat: Anatomy, layer: int) -> tuple[Tensor, Tensor]:
    """(q [b, p, n_heads, d], k [b, p, n_kv_heads, d]) exactly as the scores use them: after
    their norm and after RoPE, read from ``cache``."""
    la = anat[layer]
    out = []
    for t in ("q", "k"):
        key = f"{t}_rot" if la.rope_from_hooks else la.used(t)
        name = la.hooks[key]
        if name not in cache:
            raise ArchitectureError(f"the cache lacks {name!r}; run_with_cache without a names_filter that drops it")
        x = canonical(cache[name], la.layouts.get(key, "bphd"), la.n_heads_of(t), la.d_head)
        if la.rope and not la.rope_from_hooks:
            x = rotate(model, la, x)
        out.append(x)
    return out[0], out[1]


def scores_from_qk(model: Any, anat: Anatomy, layer: int, q: Tensor, k: Tensor, *, heads: Optional[Sequence[int]] = None,
                   softcap: bool = True) -> Tensor:
    """Pre-mask scores [b, len(heads), query, key] from rebuilt q [b, p, n_heads, d] and k
    [b, p, n_kv_heads, d], for query ``heads`` (default all: a subset bounds memory).

    Our models: the model's own ``attn.scores`` (calibration included; all heads only). Bridges:
    ``score_scale · q·k`` with each query head reading ``kv_head_of`` its key head, then the soft
    cap if the layer has one (``softcap=False``: before it, what multiplicative noise scales).
    """
    la = anat[layer]
    if anat.kind == "interp_norm":
        if heads is not None and list(heads) != list(range(la.n_heads)):
            raise ArchitectureError("scores of a head subset are only rebuilt for bridges; pass heads=None")
        return model.blocks[layer].attn.scores(q, k)
    heads = list(range(la.n_heads)) if heads is None else list(heads)
    kv = [la.kv_head_of[h] for h in heads]
    scores = torch.einsum("bqhd,bkhd->bhqk", q[:, :, heads], k[:, :, kv]) * la.score_scale
    if softcap and la.softcap:
        scores = torch.tanh(scores / la.softcap) * la.softcap
    return scores


def rebuilt_scores(model: Any, cache: Any, anat: Anatomy, layer: int, softcap: bool = True) -> Tensor:
    """Pre-mask scores [batch, head, query, key] of ``layer``, rebuilt from the cached q and k."""
    q, k = rebuilt_query_key(model, cache, anat, layer)
    return scores_from_qk(model, anat, layer, q, k, softcap=softcap)


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype in (torch.float32, torch.float64) else 1e-2


def layer_check(model: Any, anat: Anatomy, cache: Any, layer: int) -> dict:
    """One layer's row of :func:`interp_norm.anatomy.verify_scores`."""
    la = anat[layer]
    pattern = cache[la.hooks["pattern"]]
    n_q, n_k = pattern.shape[-2:]
    mask = attention_mask(la, n_q, n_k, pattern.device)
    ours = masked_softmax(rebuilt_scores(model, cache, anat, layer), mask)
    err = float((ours - pattern).abs().max())
    hook_err = math.nan
    name = la.hooks.get("attn_scores")
    if name is not None and name in cache:
        hook_err = float((masked_softmax(cache[name], mask) - pattern).abs().max())
    tol = _tolerance(pattern.dtype)
    return dict(
        layer=layer, pattern_error=err, ok=err <= tol, scores_hook=name, scores_hook_error=hook_err,
        scores_hook_ok=bool(hook_err <= tol), tolerance=tol,
    )


def verify_anatomy(model: Any, anat: Anatomy, cache: Any, tokens: Tensor, strict: bool = True) -> Anatomy:
    """The anatomy with ``scores_hook`` and ``pattern_error`` filled in from a cache of ``tokens``."""
    layers = []
    for la in anat.layers:
        row = layer_check(model, anat, cache, la.layer)
        if strict and not row["ok"]:
            raise ArchitectureError(
                f"layer {la.layer}: softmax of the scores rebuilt from q and k differs from {la.hooks['pattern']!r} "
                f"by {row['pattern_error']:.3g} (tolerance {row['tolerance']:g}); the anatomy "
                f"(placement={la.placement}, scale={la.score_scale:g}, rope={la.rope}, window={la.sliding_window}) "
                "misses something this architecture does"
            )
        status = "absent" if row["scores_hook"] is None else ("pre_softmax" if row["scores_hook_ok"] else "not_pre_softmax")
        layers.append(replace(la, scores_hook=status, pattern_error=row["pattern_error"], pattern_ok=row["ok"]))
    return replace(anat, layers=tuple(layers))


__all__ = ["attention_mask", "masked_softmax", "rotate", "rebuilt_query_key", "scores_from_qk", "rebuilt_scores",
           "layer_check", "verify_anatomy"]
