"""The model adapter layer: what every analysis asks about a model, whatever its kind.

One :class:`Anatomy` per model -- ours (:class:`~interp_norm.core.model.HookedNormTransformer`) or a
TransformerLens 4 bridge of a Hugging Face model -- says per layer where q, k, v sit before/after
their norms and RoPE, the norm's kind/axis/gain, the score scale, grouped k/v heads, sliding windows,
Gemma 4's KV sharing, and whether ``hook_attn_scores`` can be trusted.
Analyses ask the anatomy instead of branching on the model's kind.

* :func:`anatomy` (``model_anatomy``; types in ``describe``, bridges in ``bridge_anatomy``), cached per model;
  :func:`kind_of` the model's kind without a probe (the one place kinds are told apart);
  :func:`capabilities` what an analysis may ask of it beyond its hooks (engines, full hook vocabulary).
* :func:`attention_scores` / :func:`verify_scores` (``scores``, maths in ``rebuild``): scores rebuilt
  from q and k, and the check softmax(masked scores) == ``hook_pattern``.
* :func:`tiny_hf_model` / :func:`bridge_from_hf` / :func:`tiny_bridge` (``build``): offline tiny models.
* :func:`load` / :func:`load_with_info` (``loading``; public as ``interp_norm.load``): any model from one spec;
  :func:`spec_kind` which kind a spec loads as, without loading it.
* :func:`sample_text`, :func:`text_tokens`, :func:`random_tokens` (``text``).

What is verified per architecture on tiny random models (transformers 5.24, TransformerLens 4.3;
tests/test_anatomy*.py): bridge logits == HF logits, softmax(rebuilt scores) == hook_pattern,
noise at level 0 bit-identical, noise before a per-head norm removed, collapse decisions from
clean scores == brute-force re-runs.

  architecture  placement   q/k norm (v norm)                scale   hook_attn_scores  notes
  GPT-2         pre (LN)    -                                1/√d    pre-softmax       no GQA
  Llama         pre (RMS)   -                                1/√d    pre-softmax       RoPE, GQA
  Qwen3         qk          RMS per head, gain               1/√d    pre-softmax       norm before RoPE, GQA
  OLMo-2        qk          RMS over all heads, gain         1/√d    pre-softmax       no pre-norm, post-norm
  Gemma 4       qkv         RMS per head, gain (v: no gain)  1.0     = the pattern     rotation recomputed,
                                                                                       sliding window, KV
                                                                                       sharing, k = v layers
  ours          any of 4    RMS/LN per head, gain            model's pre-softmax       calibration included

Modules, lowest first (imports only go down): ``_common`` (layouts, HF originals) -> ``describe``
(types, norm identification, our models) -> ``rebuild`` (scores given an anatomy) ->
``bridge_anatomy`` -> ``model_anatomy`` (:func:`anatomy`, cached) -> ``scores``; ``build``,
``loading`` and ``text`` beside them. ``ArchitectureError`` lives in :mod:`interp_norm.errors`.
Submodules load lazily (PEP 562): ``import interp_norm.anatomy`` imports none of them.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ArchitectureError": "describe", "NormSpec": "describe", "LayerAnatomy": "describe", "Anatomy": "describe",
    "anatomy": "model_anatomy", "kind_of": "model_anatomy", "capabilities": "model_anatomy",
    "Capabilities": "model_anatomy", "identify_norm": "describe",
    "canonical": "scores", "attention_mask": "scores", "masked_softmax": "scores", "query_key": "scores",
    "attention_scores": "scores", "verify_scores": "scores",
    "ARCHITECTURES": "build", "tiny_config": "build", "tiny_hf_model": "build", "bridge_from_hf": "build",
    "tiny_bridge": "build", "tiny_gemma4_conditional": "build", "sharpen": "build",
    "load": "loading", "load_with_info": "loading", "spec_kind": "loading", "BridgeInfo": "loading",
    "folder_kind": "loading",
    "wrapped": "_common", "original": "_common", "from_canonical": "_common", "norm_eps": "_common",
    "sample_text": "text", "random_tokens": "text", "text_tokens": "text",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"interp_norm.anatomy.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'interp_norm.anatomy' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = sorted(_EXPORTS)
