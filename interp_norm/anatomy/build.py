"""Tiny random Hugging Face models built offline from a config, and bridges around them.

Nothing is downloaded: each architecture is instantiated from its ``transformers`` config class
at toy size, so tests and tutorials can exercise the real modelling code of GPT-2 (Pre-LN),
Llama (Pre-RMSNorm, grouped k/v heads), Qwen3 (per-head RMS QK-Norm before RoPE), OLMo-2 (RMS
QK-Norm over all heads at once, post-norm blocks) and Gemma 4 (per-head q, k and gainless v
norms, score scale 1.0, sliding and full layers with partial "proportional" RoPE; "gemma4-shared"
adds the E2B/31B features: KV-sharing layers and k = v full layers). GPT-2 has no grouped-query
attention, so its k/v heads equal its query heads.

The HF initialisation (std 0.02) gives nearly uniform attention, which makes collapse tests
meaningless; :func:`tiny_hf_model` re-initialises every matrix with std ``1/√fan_in`` and moves
every gain and bias away from its init (so gains are tested too), seeded.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from interp_norm.errors import ArchitectureError

#: Architectures :func:`tiny_hf_model` can build, with what they exercise.
ARCHITECTURES: dict[str, str] = {
    "gpt2": "Pre-LayerNorm, learned positions, joint QKV projection, no GQA",
    "llama": "Pre-RMSNorm, RoPE, grouped k/v heads",
    "qwen3": "Pre-RMSNorm + per-head RMS QK-Norm before RoPE, grouped k/v heads",
    "olmo2": "RMS QK-Norm over all heads at once, post-norm blocks, RoPE, grouped k/v heads",
    "gemma4": "per-head q/k norms with gain + gainless v norm, score scale 1.0, sliding + full layers, partial RoPE",
    "gemma4-shared": "Gemma 4 with the E2B/31B features: KV-sharing last layers, k = v full layers with wider heads "
                     "and one k/v head, per-layer embeddings (4 layers)",
}


def tiny_config(arch: str, *, n_layers: Optional[int] = None, d_model: int = 64, n_heads: int = 4, n_kv_heads: int = 2,
                d_head: int = 16, vocab: int = 128, n_ctx: int = 64, sliding_window: int = 4) -> Any:
    """The ``transformers`` config of a tiny ``arch`` model (see :data:`ARCHITECTURES`)."""
    import transformers as tf

    if n_layers is None:
        n_layers = 4 if arch == "gemma4-shared" else 2
    special: dict[str, Any] = dict(pad_token_id=0, eos_token_id=1, bos_token_id=2)  # inside the tiny vocabulary
    common: dict[str, Any] = dict(vocab_size=vocab, hidden_size=d_model, intermediate_size=2 * d_model, num_hidden_layers=n_layers,
                  num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, max_position_embeddings=n_ctx, **special)
    if arch == "gpt2":
        return tf.GPT2Config(vocab_size=vocab, n_embd=d_model, n_layer=n_layers, n_head=n_heads, n_positions=n_ctx,
                             n_inner=2 * d_model, **special)
    if arch == "llama":
        return tf.LlamaConfig(**common, head_dim=d_head)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=d_head)
    if arch == "olmo2":
        if d_model != n_heads * d_head:
            raise ArchitectureError(f"OLMo-2 has head_dim = hidden_size / n_heads; use d_head={d_model // n_heads}")
        return tf.Olmo2Config(**common)
    if arch in ("gemma4", "gemma4-shared"):
        if not hasattr(tf, "Gemma4TextConfig"):
            raise ArchitectureError(f"transformers {tf.__version__} has no Gemma 4; upgrade transformers")
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
        extra: dict = dict(global_head_dim=d_head)
        if arch == "gemma4-shared":
            if n_layers < 4:
                raise ArchitectureError("gemma4-shared needs n_layers >= 4 (the last half share keys and values)")
            extra = dict(global_head_dim=2 * d_head, num_global_key_value_heads=1, attention_k_eq_v=True,
                         num_kv_shared_layers=n_layers // 2)
        return tf.Gemma4TextConfig(**common, head_dim=d_head, layer_types=types, sliding_window=sliding_window,
                                   hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab, **extra)
    raise ArchitectureError(f"unknown tiny architecture {arch!r}; choose one of {sorted(ARCHITECTURES)}")


@torch.no_grad()
def _reinit(model: nn.Module, seed: int) -> None:
    """Matrices ~ N(0, 1/fan_in) (embeddings N(0, 1)); vectors (gains, biases) += N(0, 0.2²)."""
    g = torch.Generator().manual_seed(seed)
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.ndim >= 2:
                # Conv1D (GPT-2) stores [in, out]; Linear [out, in]; Embedding rows are tokens
                conv1d = type(module).__name__ == "Conv1D"
                std = 1.0 if isinstance(module, nn.Embedding) else 1 / math.sqrt(p.shape[0] if conv1d else p.shape[-1])
                p.copy_(torch.randn(p.shape, generator=g) * std)
            else:
                p.add_(0.2 * torch.randn(p.shape, generator=g))


def sharpen(hf_model: nn.Module, factor: float) -> nn.Module:
    """Multiply every attention's score factor (``scaling``) by ``factor``, in place.

    Random weights give diffuse attention, so a collapse experiment on them has almost no sparse
    rows; a sharper softmax gives the many near-one-hot rows trained models have. The HF eager
    attention multiplies q·k by ``self.scaling``, which :func:`~interp_norm.anatomy.anatomy` reads
    and checks against the pattern, so the change is seen consistently (GPT-2: the query
    projection is scaled instead, see below).
    """
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
        raise ArchitectureError(f"sharpen factor must be a positive number, got {factor!r}")
    found = 0
    for module in hf_model.modules():
        if not (isinstance(getattr(module, "scaling", None), (int, float)) and hasattr(module, "layer_idx")):
            continue
        found += 1
        c_attn, d = getattr(module, "c_attn", None), getattr(module, "embed_dim", None)
        if c_attn is not None and isinstance(d, int):
            # GPT-2: TransformerLens' bridge recomputes attention with 1/√d_head and ignores
            # `scaling` (found by anatomy's pattern check), so scale the query projection instead
            with torch.no_grad():
                c_attn.weight[:, :d] *= factor
                c_attn.bias[:d] *= factor
        else:
            module.scaling = float(module.scaling) * factor  # type: ignore[assignment, arg-type]  # checked above
    if not found:
        raise ArchitectureError(f"{type(hf_model).__name__} has no attention module with a numeric 'scaling'")
    return hf_model


def tiny_hf_model(arch: str, *, seed: int = 0, reinit: bool = True, sharpness: float = 1.0, **config_kw: Any) -> nn.Module:
    """A tiny random ``*ForCausalLM`` (eager attention, eval mode) of ``arch``, seeded;
    ``sharpness`` multiplies every attention's score factor (:func:`sharpen`)."""
    import transformers as tf

    cfg = tiny_config(arch, **config_kw)
    cls = {"gpt2": tf.GPT2LMHeadModel, "llama": tf.LlamaForCausalLM, "qwen3": tf.Qwen3ForCausalLM,
           "olmo2": tf.Olmo2ForCausalLM, "gemma4": getattr(tf, "Gemma4ForCausalLM", None),
           "gemma4-shared": getattr(tf, "Gemma4ForCausalLM", None)}[arch]
    assert cls is not None  # tiny_config refuses an architecture this transformers lacks
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg)
    if reinit:
        _reinit(model, seed)
    if sharpness != 1.0:
        sharpen(model, sharpness)
    return model.eval()


def tiny_gemma4_conditional(*, seed: int = 0, **config_kw: Any) -> nn.Module:
    """A tiny ``Gemma4ForConditionalGeneration`` — the class real Gemma 4 checkpoints load as — with
    the "gemma4-shared" text decoder and a one-layer vision tower; media token ids 120–126."""
    import transformers as tf

    text = tiny_config("gemma4-shared", **config_kw)
    vision = tf.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=2, head_dim=16, position_embedding_size=64)
    media: dict[str, Any] = dict(image_token_id=120, boi_token_id=121, eoi_token_id=122, video_token_id=123, boa_token_id=124,
                 eoa_token_index=125, audio_token_id=126)
    cfg = tf.Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None, **media)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = tf.Gemma4ForConditionalGeneration(cfg)
    _reinit(model, seed)
    return model.eval()


def bridge_from_hf(hf_model: nn.Module, tokenizer: Optional[Any] = None, name: str = "local") -> Any:
    """A TransformerLens 4 ``TransformerBridge`` around an HF model already in memory.

    The bridge wraps ``hf_model`` in place (its submodules are replaced by bridge components); keep
    a ``copy.deepcopy`` if the untouched HF model is needed. Attention is switched to eager so the
    pattern hooks fire.
    """
    from transformer_lens.factories.architecture_adapter_factory import SUPPORTED_ARCHITECTURES
    from transformer_lens.model_bridge.sources import build_bridge_from_module
    from transformer_lens.model_bridge.sources._hf_format import determine_architecture_from_hf_config
    from transformer_lens.utilities.attn_implementation import force_eager_attention

    arch = type(hf_model).__name__
    if arch not in SUPPORTED_ARCHITECTURES:
        try:
            arch = determine_architecture_from_hf_config(hf_model.config)
        except ValueError as e:
            raise ArchitectureError(f"TransformerLens has no bridge for {type(hf_model).__name__}: {e}") from None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ArchitectureError(f"TransformerLens {_tl_version()} has no bridge for architecture {arch!r}")
    force_eager_attention(hf_model)
    bridge = build_bridge_from_module(hf_model, arch, hf_config=hf_model.config, tokenizer=tokenizer, model_name=name)
    return bridge.eval()


def _tl_version() -> str:
    from importlib.metadata import version

    return version("transformer-lens")


def tiny_bridge(arch: str, *, seed: int = 0, sharpness: float = 1.0, **config_kw: Any) -> Any:
    """:func:`tiny_hf_model` wrapped by :func:`bridge_from_hf`."""
    return bridge_from_hf(tiny_hf_model(arch, seed=seed, sharpness=sharpness, **config_kw), name=f"tiny-{arch}")


__all__ = ["ARCHITECTURES", "tiny_config", "tiny_hf_model", "sharpen", "tiny_gemma4_conditional", "bridge_from_hf", "tiny_bridge"]
