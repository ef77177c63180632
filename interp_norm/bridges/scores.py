"""Attention scores rebuilt from q and k, checked against the model's own pattern.

The scores an analysis uses are ``scale · q_rot · k_rot`` (after the q/k norms, after RoPE, with
each query head reading its key/value head), optionally soft-capped; never a bridge's
``hook_attn_scores``, which on some architectures holds something else (Gemma 4: the pattern).
:func:`verify_scores` is the acceptance check: softmax(masked scores) must equal ``hook_pattern``.

Positions are 0..n−1 (unpadded sequences, no KV cache): the same positions a bridge uses when
called with a [batch, pos] token tensor.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import replace
from typing import Any, Optional

import pandas as pd
import torch
from torch import Tensor

from interp_norm.bridges.bridge_anatomy import original
from interp_norm.bridges.describe import Anatomy, ArchitectureError, LayerAnatomy, anatomy


def canonical(x: Tensor, layout: str, heads: int, d_head: int) -> Tensor:
    """A hook tensor in ``layout`` ("bphd", "bhpd", "flat") as [batch, pos, head, d_head]."""
    if layout == "bphd":
        return x
    if layout == "bhpd":
        return x.transpose(1, 2)
    if layout == "flat":
        return x.unflatten(-1, (heads, d_head))
    raise ArchitectureError(f"unknown hook layout {layout!r}")


def from_canonical(x: Tensor, layout: str) -> Tensor:
    """Inverse of :func:`canonical`: [batch, pos, head, d_head] back to the hook's own layout."""
    if layout == "bphd":
        return x
    if layout == "bhpd":
        return x.transpose(1, 2)
    if layout == "flat":
        return x.flatten(-2)
    raise ArchitectureError(f"unknown hook layout {layout!r}")


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


def _rotate(model: Any, la: LayerAnatomy, x: Tensor) -> Tensor:
    """RoPE on canonical q or k [b, p, h, d] from the model's own rotary module (HF's rotate-half)."""
    rotary = original(getattr(model, "rotary_emb", None))
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


def query_key(model: Any, cache: Any, layer: int, anat: Optional[Anatomy] = None) -> tuple[Tensor, Tensor]:
    """(q [b, p, n_heads, d], k [b, p, n_kv_heads, d]) exactly as the scores use them: after
    their norm and after RoPE."""
    la = (anat or anatomy(model))[layer]
    out = []
    for t in ("q", "k"):
        key = f"{t}_rot" if la.rope_from_hooks else la.used(t)
        name = la.hooks[key]
        if name not in cache:
            raise ArchitectureError(f"the cache lacks {name!r}; run_with_cache without a names_filter that drops it")
        x = canonical(cache[name], la.layouts.get(key, "bphd"), la.n_heads_of(t), la.d_head)
        if la.rope and not la.rope_from_hooks:
            x = _rotate(model, la, x)
        out.append(x)
    return out[0], out[1]


def attention_scores(model: Any, cache: Any, layer: int, anat: Optional[Anatomy] = None, softcap: bool = True) -> Tensor:
    """Pre-mask scores [batch, head, query, key] of ``layer``, rebuilt from the cached q and k.

    On our models this is ``attn.scores(q_used, k_used)`` (the model's own step, calibration
    included); on a bridge ``score_scale · q·k`` with grouped key heads mapped by
    ``kv_head_of``, then the soft cap if the layer has one (``softcap=False``: before it, what
    multiplicative noise on q and k scales). Apply :func:`attention_mask` before a softmax.
    """
    anat = anat or anatomy(model)
    la = anat[layer]
    q, k = query_key(model, cache, layer, anat)
    if anat.kind == "interp_norm":
        return model.blocks[layer].attn.scores(q, k)
    k = k[:, :, list(la.kv_head_of)]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * la.score_scale
    if softcap and la.softcap:
        scores = torch.tanh(scores / la.softcap) * la.softcap
    return scores


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype in (torch.float32, torch.float64) else 1e-2


def _layer_check(model: Any, anat: Anatomy, cache: Any, layer: int) -> dict:
    la = anat[layer]
    pattern = cache[la.hooks["pattern"]]
    n_q, n_k = pattern.shape[-2:]
    mask = attention_mask(la, n_q, n_k, pattern.device)
    ours = masked_softmax(attention_scores(model, cache, layer, anat), mask)
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
        row = _layer_check(model, anat, cache, la.layer)
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


@torch.no_grad()
def verify_scores(model: Any, tokens: Tensor, anat: Optional[Anatomy] = None) -> pd.DataFrame:
    """Per layer: max |softmax(masked rebuilt scores) − hook_pattern| (``pattern_error``, ``ok``)
    and the same for the model's ``hook_attn_scores`` (``scores_hook_error``, ``scores_hook_ok``)."""
    anat = anat or anatomy(model)
    wanted = {h for la in anat.layers for h in la.hooks.values() if h}
    _, cache = model.run_with_cache(tokens, names_filter=lambda name: name in wanted)
    return pd.DataFrame([_layer_check(model, anat, cache, l) for l in range(anat.n_layers)])


__all__ = ["canonical", "from_canonical", "attention_mask", "masked_softmax", "query_key", "attention_scores",
           "verify_anatomy", "verify_scores"]
