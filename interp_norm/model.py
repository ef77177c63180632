"""Hooked decoder-only transformers whose attention normalisation is a choice.

Read top to bottom like nanoGPT's ``model.py``: config, norms, embedding, attention, MLP, block,
output head, model. Hook names and weight shapes follow TransformerLens's HookedTransformer
(``blocks.{l}.attn.hook_q``, ``W_Q`` shaped ``[n_heads, d_model, d_head]``), so
``transformer_lens.patching`` and ``ActivationCache`` work on these models unchanged. Where TL would
fail silently or vaguely on them (wrong hook names, hooks that never fire, the final norm, logit
attribution through the MLP head), :mod:`interp_norm.tl_api` refuses with a typed error or corrects it.

Attention normalisation (``ModelConfig.attn_norm``), after Menary et al. (2024), formulation table:

=========  ===============================================  ==================================
``pre``    w = N(x)ᵀ W_QK N(y),  v = W_V N(y)               the paper's Pre-Norm baseline
``qkv``    w = N(W_Q x)ᵀ N(W_K y),  v = N(W_V y)            the paper's QKV-Norm (per head)
``qk``     w = N(W_Q x)ᵀ N(W_K y),  v = W_V y               QK-Norm (Qwen3, Gemma 3, OLMo 2)
``none``   w = xᵀ W_QK y,  v = W_V y                        No-Norm
=========  ===============================================  ==================================

Choices the paper leaves open (digest §5), each a config field:

* ``norm_kind``: N is RMSNorm (``"rms"``, the paper's "VECNORM", default) or LayerNorm (``"ln"``);
  attention norms carry a learnable gain and no bias (the paper's Eq. 2). The feed-forward blocks
  and the output head always use a Pre-LayerNorm *with* bias, as in the paper.
* ``pre_norm_gains``: the paper gives Pre-Norm separate query/key/value gains (``"separate"``,
  default); ``"shared"`` is the usual single ``ln1``. The scale is shared either way.
* ``qkv_gain``: QKV-Norm gains per head (``"per_head"``, default; the paper's ``HEAD_VECNORM``)
  or one gain vector shared by all heads (``"shared"``).
* ``attn_scale``: scores are divided by it (default √d_head for every variant). The paper instead
  calibrates a fixed "Checkpoint" factor so that scores have std 0.1 on the first batch; with
  √d_head, scores start with std ≈ 1 for every variant, which is what makes them comparable here.
* No biases on q, k, v (the paper's Theorem 12 argument); ``W_O`` has a bias ``b_O``.
* ``pos_embed``: the paper's sinusoidal encoding with trainable frequencies (periods 3–1000,
  log-spaced, filling the first 2·n_freq dimensions) and a random position offset in
  [0, ``max_pos_offset``] per sequence during training (offset 0 in eval), or ``"learned"``
  (TransformerLens's standard learned positions, no offset).
* ``head``: the paper's output head, LayerNorm → MLP with ReLU hidden layers → logits (``"mlp"``),
  or a plain unembedding ``W_U`` (``"unembed"``).
* ``calibration``: ``"none"`` (default) scales the initialisation so each variant starts at
  comparable activation sizes (see ``_init_weights``) and divides scores by ``attn_scale``.
  ``"paper"`` adds the paper's "Checkpoint" layers (digest §3.3), :class:`Calibration` below: each
  multiplies its input by a factor fitted on the first training batch so that the output has a
  fixed std, then frozen and saved with the weights. They sit on the token embedding (std
  ``calib_type_std`` 0.5), the embedding x = x_type + x_pos (``calib_embed_std`` 1.0), each of the
  three inputs to W_Q/W_K/W_V (``calib_attn_input_std`` 1.0), the scores (``calib_score_std`` 0.1,
  on top of ``attn_scale``) and each residual update Δx of attention and MLP, relative to the std
  of the residual it is added to (``calib_update_std`` 0.05). Choice: stds are taken over
  non-padding positions (and causal, non-padding query/key pairs for the scores); the paper does
  not say whether its Keras layers masked padding.
"""

from __future__ import annotations

import importlib
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Optional, Sequence

import einops
import torch
import torch.nn as nn
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens import ActivationCache
from transformer_lens.config.transformer_lens_config import TransformerLensConfig
from transformer_lens.FactoredMatrix import FactoredMatrix
from transformer_lens.hook_points import HookPoint
from transformer_lens.HookedRootModule import HookedRootModule

from interp_norm import task as T
from interp_norm.errors import ConfigError, ProblemStringError
from interp_norm.hooks import ATTN_NORMS
from interp_norm.tl_api import DLA_REFUSAL, NormActivationCache, check_hooks, check_names_filter, dormant_hooks

NORM_KINDS = ("rms", "ln")
CALIBRATIONS = ("none", "paper")


# ----------------------------------------------------------------------------- config


@dataclass
class ModelConfig(TransformerLensConfig):
    """Everything that defines an architecture. A ``TransformerLensConfig`` so TL tools accept it."""

    d_model: int = 64
    d_head: int = 16
    n_layers: int = 2
    n_ctx: int = 48
    n_heads: int = 4
    d_mlp: Optional[int] = 256
    d_vocab: int = T.D_VOCAB
    device: Optional[str] = "cpu"
    attn_norm: str = "pre"
    norm_kind: str = "rms"
    pre_norm_gains: str = "separate"
    qkv_gain: str = "per_head"
    attn_scale: Optional[float] = None
    pos_embed: str = "sinusoidal"
    n_freq: int = 16
    min_period: float = 3.0
    max_period: float = 1000.0
    max_pos_offset: int = 50
    head: str = "mlp"
    head_hidden: tuple[int, ...] = (512, 512)
    init_embed_std: float = 0.5
    seed: int = 0
    act_fn: str = "relu"
    eps: float = 1e-5
    calibration: str = "none"
    calib_type_std: float = 0.5
    calib_embed_std: float = 1.0
    calib_attn_input_std: float = 1.0
    calib_score_std: float = 0.1
    calib_update_std: float = 0.05

    def __post_init__(self) -> None:
        self.validate()
        super().__post_init__()
        if self.attn_scale is None:
            self.attn_scale = math.sqrt(self.d_head)
        self.head_hidden = tuple(self.head_hidden)
        # TL fields read by TL tools (ActivationCache.apply_ln_to_stack, utilities).
        if self.attn_norm == "pre":
            self.normalization_type = "LN" if self.norm_kind == "ln" else "RMS"
        else:
            self.normalization_type = None
        self.uses_rms_norm = self.norm_kind == "rms"
        self.positional_embedding_type = "standard" if self.pos_embed == "learned" else "sinusoidal"

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the bad field and the fix."""
        if self.n_heads == -1:  # TransformerLens's convention: derive n_heads = d_model / d_head
            if isinstance(self.d_model, int) and isinstance(self.d_head, int) and self.d_head > 0:
                if self.d_model % self.d_head:
                    raise ConfigError(
                        f"d_model={self.d_model} is not divisible by d_head={self.d_head}, so n_heads cannot be "
                        "derived; set n_heads explicitly (the paper's heads need not tile d_model) or pick "
                        "d_model as a multiple of d_head"
                    )
                self.n_heads = self.d_model // self.d_head
        for name in ("d_model", "d_head", "n_layers", "n_ctx", "n_heads", "d_vocab", "n_freq"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if self.d_mlp is not None and (not isinstance(self.d_mlp, int) or self.d_mlp < 1):
            raise ConfigError(f"d_mlp must be a positive integer, got {self.d_mlp!r}")
        if self.attn_norm not in ATTN_NORMS:
            raise ConfigError(f"unknown attn_norm {self.attn_norm!r}; choose one of {ATTN_NORMS}")
        if self.norm_kind not in NORM_KINDS:
            raise ConfigError(f"unknown norm_kind {self.norm_kind!r}; choose one of {NORM_KINDS}")
        if self.pre_norm_gains not in ("separate", "shared"):
            raise ConfigError(f"pre_norm_gains must be 'separate' or 'shared', got {self.pre_norm_gains!r}")
        if self.qkv_gain not in ("per_head", "shared"):
            raise ConfigError(f"qkv_gain must be 'per_head' or 'shared', got {self.qkv_gain!r}")
        if self.pos_embed not in ("sinusoidal", "learned"):
            raise ConfigError(f"pos_embed must be 'sinusoidal' or 'learned', got {self.pos_embed!r}")
        if self.head not in ("mlp", "unembed"):
            raise ConfigError(f"head must be 'mlp' or 'unembed', got {self.head!r}")
        if self.pos_embed == "sinusoidal" and 2 * self.n_freq > self.d_model:
            raise ConfigError(
                f"the sinusoidal encoding fills 2*n_freq={2 * self.n_freq} dimensions but d_model is "
                f"{self.d_model}; lower n_freq to at most {self.d_model // 2} or raise d_model"
            )
        if self.norm_kind == "ln" and self.d_head < 2 and self.attn_norm in ("qk", "qkv"):
            raise ConfigError("a LayerNorm over a 1-dimensional head is constant; use d_head >= 2 or norm_kind='rms'")
        if self.max_pos_offset < 0:
            raise ConfigError(f"max_pos_offset must be >= 0, got {self.max_pos_offset}")
        if any((not isinstance(h, int)) or h < 1 for h in self.head_hidden):
            raise ConfigError(f"head_hidden must be positive integers, got {self.head_hidden!r}")
        if self.attn_scale is not None and not (self.attn_scale > 0 and math.isfinite(self.attn_scale)):
            raise ConfigError(f"attn_scale must be a positive number, got {self.attn_scale!r}")
        if not (self.eps >= 0):
            raise ConfigError(f"eps must be >= 0, got {self.eps!r}")
        if self.calibration not in CALIBRATIONS:
            raise ConfigError(f"calibration must be one of {CALIBRATIONS} ('paper': the paper's Checkpoint layers), got {self.calibration!r}")
        for name in ("calib_type_std", "calib_embed_std", "calib_attn_input_std", "calib_score_std", "calib_update_std"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ConfigError(f"{name} must be a positive number, got {v!r}")

    PRESETS = {
        # The paper's Baseline (model spec table): 10 layers, d 512, 12 heads of 64, d_ff 512.
        "paper": dict(d_model=512, d_head=64, n_heads=12, n_layers=10, d_mlp=512, n_freq=32, head_hidden=(512, 512), n_ctx=64, seed=100),
        # Trains to >95% per-token accuracy on the cpu task preset on 2 cores (see README).
        "cpu": dict(d_model=64, d_head=16, n_heads=4, n_layers=3, d_mlp=256, n_freq=16, head_hidden=(128,), n_ctx=40),
        # For tests: builds and runs in milliseconds.
        "tiny": dict(d_model=32, d_head=8, n_heads=4, n_layers=2, d_mlp=64, n_freq=8, head_hidden=(32,), n_ctx=40),
    }

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        if name not in cls.PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    # Our own fields (not TL's); persisted in checkpoints.
    _OWN_FIELDS = (
        "d_model", "d_head", "n_layers", "n_ctx", "n_heads", "d_mlp", "d_vocab", "attn_norm", "norm_kind",
        "pre_norm_gains", "qkv_gain", "attn_scale", "pos_embed", "n_freq", "min_period", "max_period",
        "max_pos_offset", "head", "head_hidden", "init_embed_std", "seed", "eps", "use_attn_result",
        "use_split_qkv_input", "calibration", "calib_type_std", "calib_embed_std", "calib_attn_input_std",
        "calib_score_std", "calib_update_std",
    )
    # Fields added after format 1 checkpoints were written; left out of to_dict() at their default so
    # older checkpoints (and resumes of runs started before them) compare equal.
    _LATER_DEFAULTS = dict(calibration="none", calib_type_std=0.5, calib_embed_std=1.0, calib_attn_input_std=1.0,
                           calib_score_std=0.1, calib_update_std=0.05)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self._OWN_FIELDS}
        d["head_hidden"] = list(d["head_hidden"])
        if d["calibration"] == "none":
            for k, v in self._LATER_DEFAULTS.items():
                if d[k] == v:
                    del d[k]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":  # type: ignore[override]
        unknown = sorted(set(d) - set(cls._OWN_FIELDS))
        if unknown:
            raise ConfigError(f"unknown model config fields {unknown}; known fields: {list(cls._OWN_FIELDS)}")
        return cls(**d)

    def replace(self, **changes: Any) -> "ModelConfig":
        return ModelConfig.from_dict({**self.to_dict(), **changes})


# ----------------------------------------------------------------------------- norms


class Norm(nn.Module):
    """RMSNorm or LayerNorm over the last dimension, with hooks like TransformerLens's.

    ``hook_scale`` is the divisor (``sqrt(mean(x²)+eps)`` for RMS, ``sqrt(var+eps)`` for LN) and
    ``hook_normalized`` the output after gain and bias. ``n_gains > 1`` gives the paper's separate
    query/key/value gains on one shared normalisation (Pre-Norm); then ``hook_normalized`` is the
    vector before the gains and :meth:`forward` returns one tensor per gain.
    """

    def __init__(self, length: int, kind: str, eps: float, bias: bool = False, n_gains: int = 1):
        super().__init__()
        self.kind, self.eps, self.n_gains = kind, eps, n_gains
        self.w = nn.Parameter(torch.ones(n_gains, length) if n_gains > 1 else torch.ones(length))
        self.b = nn.Parameter(torch.zeros(length)) if bias else None
        self.hook_scale = HookPoint()  # [..., 1]
        self.hook_normalized = HookPoint()  # [..., length]

    def forward(self, x: Float[Tensor, "... d"]) -> Any:
        if self.kind == "ln":
            x = x - x.mean(-1, keepdim=True)
        scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        x = x / scale
        if self.n_gains > 1:
            x = self.hook_normalized(x)
            return tuple(x * self.w[i] for i in range(self.n_gains))
        x = x * self.w
        if self.b is not None:
            x = x + self.b
        return self.hook_normalized(x)


class HeadNorm(nn.Module):
    """Per-head normalisation of q, k or v after the projection (QKV-Norm / QK-Norm).

    Hooks ``hook_{name}_scale`` ([batch, pos, head, 1]) and ``hook_{name}_normed`` live on the
    parent attention module so they read ``blocks.{l}.attn.hook_q_scale`` like the issue asks.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind, self.eps = cfg.norm_kind, cfg.eps
        shape = (cfg.n_heads, cfg.d_head) if cfg.qkv_gain == "per_head" else (cfg.d_head,)
        self.w = nn.Parameter(torch.ones(shape))

    def forward(self, x: Float[Tensor, "b p h d"], hook_scale: HookPoint, hook_normed: HookPoint) -> Float[Tensor, "b p h d"]:
        if self.kind == "ln":
            x = x - x.mean(-1, keepdim=True)
        scale = hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return hook_normed(x / scale * self.w)


class Calibration(nn.Module):
    """The paper's "Checkpoint" layer: ``x * factor``, the factor fitted once so the output std is ``std``.

    While :meth:`HookedNormTransformer.calibrate` runs, each layer sets its factor from the batch
    passing through (``std / std(measure)``, over the valid entries given by ``valid``); afterwards
    the factor is a frozen buffer saved with the weights. ``kind="update"`` measures Δx relative to
    the residual it is added to; ``kind="scores"`` measures causal, non-padding query/key pairs.
    """

    def __init__(self, std: float, kind: str = "vector"):
        super().__init__()
        self.std, self.kind = float(std), kind
        self.register_buffer("factor", torch.ones(()))
        self.valid: Optional[Tensor] = None  # [batch, pos] non-padding mask while calibrating, else None

    def _std(self, x: Tensor) -> Tensor:
        if self.kind == "scores":  # [b, h, q, k]: causal pairs whose query and key are both real tokens
            v = self.valid
            n = x.shape[-1]
            keep = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
            keep = keep & v[:, None, :n, None] & v[:, None, None, :n]
            return x.masked_select(keep.expand_as(x)).std()
        return x[self.valid[:, : x.shape[1]]].std()

    def forward(self, x: Tensor, measure: Optional[Tensor] = None, relative_to: Optional[Tensor] = None) -> Tensor:
        if self.valid is not None:
            target = self.std * (self._std(relative_to) if relative_to is not None else 1.0)
            self.factor.fill_(float(target / self._std(measure if measure is not None else x)))
        return x * self.factor


# ----------------------------------------------------------------------------- embeddings


class SinusoidalPosEmbed(nn.Module):
    """Sinusoidal positions with trainable frequencies (the paper's x_pos).

    Periods start log-spaced between ``min_period`` and ``max_period`` tokens; the encoding fills
    the first 2·n_freq dimensions and the rest are zero, so |x_pos| is constant (√n_freq).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        periods = torch.exp(torch.linspace(math.log(cfg.min_period), math.log(cfg.max_period), cfg.n_freq))
        self.freqs = nn.Parameter(2 * math.pi / periods)
        self.d_model = cfg.d_model

    def forward(self, positions: Float[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_model"]:
        angles = positions.unsqueeze(-1).float() * self.freqs
        enc = torch.cat([angles.sin(), angles.cos()], dim=-1)
        return F.pad(enc, (0, self.d_model - enc.shape[-1]))


# ----------------------------------------------------------------------------- attention


class Attention(nn.Module):
    """Multi-head causal self-attention with the normalisation placement of ``cfg.attn_norm``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        h, d, dh = cfg.n_heads, cfg.d_model, cfg.d_head
        self.W_Q = nn.Parameter(torch.empty(h, d, dh))
        self.W_K = nn.Parameter(torch.empty(h, d, dh))
        self.W_V = nn.Parameter(torch.empty(h, d, dh))
        self.W_O = nn.Parameter(torch.empty(h, dh, d))
        self.b_O = nn.Parameter(torch.zeros(d))
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        if cfg.attn_norm in ("qk", "qkv"):
            self.q_norm, self.k_norm = HeadNorm(cfg), HeadNorm(cfg)
            self.hook_q_scale, self.hook_q_normed = HookPoint(), HookPoint()
            self.hook_k_scale, self.hook_k_normed = HookPoint(), HookPoint()
        if cfg.attn_norm == "qkv":
            self.v_norm = HeadNorm(cfg)
            self.hook_v_scale, self.hook_v_normed = HookPoint(), HookPoint()
        self.hook_attn_scores = HookPoint()  # [batch, head, query_pos, key_pos]
        self.hook_pattern = HookPoint()
        self.hook_z = HookPoint()  # [batch, pos, head, d_head]
        self.hook_result = HookPoint()  # [batch, pos, head, d_model], only if cfg.use_attn_result
        self.register_buffer("mask", torch.tril(torch.ones(cfg.n_ctx, cfg.n_ctx, dtype=torch.bool)), persistent=False)
        if cfg.calibration == "paper":
            self.calib_q_in, self.calib_k_in, self.calib_v_in = (Calibration(cfg.calib_attn_input_std) for _ in range(3))
            self.calib_scores = Calibration(cfg.calib_score_std, kind="scores")

    # The steps of the forward pass, public so analyses call them instead of re-deriving them.
    def project(self, x: Tensor, which: str) -> Float[Tensor, "b p h dh"]:
        """q, k or v before any per-head norm (``x``: [b, p, d], or [b, p, h, d] split per head)."""
        W = {"q": self.W_Q, "k": self.W_K, "v": self.W_V}[which]
        if self.cfg.calibration == "paper":
            x = getattr(self, f"calib_{which}_in")(x)
        if x.ndim == 4:  # split per-head input [b, p, h, d] (use_split_qkv_input)
            return torch.einsum("bphd,hde->bphe", x, W)
        return torch.einsum("bpd,hde->bphe", x, W)

    def normalize(self, x: Float[Tensor, "b p h dh"], which: str) -> Float[Tensor, "b p h dh"]:
        """The per-head norm of ``which`` (identity where this variant has none): what the attention uses."""
        norm = getattr(self, f"{which}_norm", None)
        if norm is None:
            return x
        return norm(x, getattr(self, f"hook_{which}_scale"), getattr(self, f"hook_{which}_normed"))

    def scores(self, q: Float[Tensor, "... q h dh"], k: Float[Tensor, "... k h dh"]) -> Float[Tensor, "... h q k"]:
        """Pre-softmax scores of the q and k the attention uses, before the causal mask."""
        spec = "bqhd,bkhd->bhqk" if q.ndim == 4 else "...qhd,...khd->...hqk"
        scores = torch.einsum(spec, q, k) / self.cfg.attn_scale
        if self.cfg.calibration == "paper":
            scores = self.calib_scores(scores)
        return scores

    def forward(self, x_q: Tensor, x_k: Tensor, x_v: Tensor) -> Float[Tensor, "batch pos d_model"]:
        cfg = self.cfg
        q = self.normalize(self.hook_q(self.project(x_q, "q")), "q")
        k = self.normalize(self.hook_k(self.project(x_k, "k")), "k")
        v = self.normalize(self.hook_v(self.project(x_v, "v")), "v")
        n = q.shape[1]
        scores = self.hook_attn_scores(self.scores(q, k).masked_fill(~self.mask[:n, :n], float("-inf")))
        pattern = self.hook_pattern(scores.softmax(dim=-1))
        z = self.hook_z(torch.einsum("bhqk,bkhd->bqhd", pattern, v))
        return self.out(z)

    def out(self, z: Float[Tensor, "b p h dh"]) -> Float[Tensor, "b p d_model"]:
        """z through W_O (summed over heads) plus b_O; fires ``hook_result`` if ``use_attn_result``."""
        if self.cfg.use_attn_result:
            result = self.hook_result(torch.einsum("bqhd,hdm->bqhm", z, self.W_O))
            return result.sum(dim=2) + self.b_O
        return torch.einsum("bqhd,hdm->bqm", z, self.W_O) + self.b_O

    @property
    def W_QK(self) -> Tensor:
        """[n_heads, d_model, d_model]: w = xᵀ W_QK y before any q/k normalisation."""
        return self.W_Q @ self.W_K.transpose(-1, -2)

    @property
    def W_OV(self) -> Tensor:
        """[n_heads, d_model, d_model] in HookedTransformer's row-vector convention (x @ W_OV)."""
        return self.W_V @ self.W_O


# ----------------------------------------------------------------------------- MLP and block


class MLP(nn.Module):
    """The paper's feed-forward block: one ReLU hidden layer with biases."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.W_in = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp))
        self.b_in = nn.Parameter(torch.zeros(cfg.d_mlp))
        self.W_out = nn.Parameter(torch.empty(cfg.d_mlp, cfg.d_model))
        self.b_out = nn.Parameter(torch.zeros(cfg.d_model))
        self.hook_pre, self.hook_post = HookPoint(), HookPoint()

    def forward(self, x: Float[Tensor, "b p d"]) -> Float[Tensor, "b p d"]:
        pre = self.hook_pre(x @ self.W_in + self.b_in)
        post = self.hook_post(F.relu(pre))
        return post @ self.W_out + self.b_out


class TransformerBlock(nn.Module):
    """Attention (normalised as configured), then x → x + MLP(LayerNorm(x)) as in the paper."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        if cfg.attn_norm == "pre":
            n_gains = 3 if cfg.pre_norm_gains == "separate" else 1
            self.ln1 = Norm(cfg.d_model, cfg.norm_kind, cfg.eps, bias=False, n_gains=n_gains)
        self.attn = Attention(cfg)
        self.ln2 = Norm(cfg.d_model, "ln", cfg.eps, bias=True)
        self.mlp = MLP(cfg)
        for name in ("resid_pre", "q_input", "k_input", "v_input", "attn_out", "resid_mid", "mlp_out", "resid_post"):
            setattr(self, f"hook_{name}", HookPoint())
        if cfg.calibration == "paper":
            self.calib_attn_out = Calibration(cfg.calib_update_std, kind="update")
            self.calib_mlp_out = Calibration(cfg.calib_update_std, kind="update")

    def _attn_inputs(self, resid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        cfg = self.cfg
        if cfg.use_split_qkv_input:  # per-head copies so each head's q/k/v input can be patched alone
            rep = einops.repeat(resid, "b p d -> b p h d", h=cfg.n_heads)
            xs = (self.hook_q_input(rep), self.hook_k_input(rep), self.hook_v_input(rep))
        else:
            xs = (resid, resid, resid)
        if cfg.attn_norm != "pre":
            return xs
        if cfg.pre_norm_gains == "shared" and not cfg.use_split_qkv_input:
            y = self.ln1(resid)
            return y, y, y
        if cfg.use_split_qkv_input:
            outs = [self.ln1(x) for x in xs]
            return tuple(o[i] if isinstance(o, tuple) else o for i, o in enumerate(outs))  # type: ignore[return-value]
        return self.ln1(resid)

    def forward(self, resid: Float[Tensor, "b p d"]) -> Float[Tensor, "b p d"]:
        resid = self.hook_resid_pre(resid)
        resid = self.hook_resid_mid(resid + self.hook_attn_out(self.attn_update(resid)))
        return self.hook_resid_post(resid + self.hook_mlp_out(self.mlp_update(resid)))

    def attn_update(self, resid: Float[Tensor, "b p d"]) -> Float[Tensor, "b p d"]:
        """What the attention adds to ``resid`` (before ``hook_attn_out``)."""
        out = self.attn(*self._attn_inputs(resid))
        return self.calib_attn_out(out, relative_to=resid) if self.cfg.calibration == "paper" else out

    def mlp_update(self, resid: Float[Tensor, "b p d"]) -> Float[Tensor, "b p d"]:
        """What the feed-forward block adds to ``resid`` (before ``hook_mlp_out``)."""
        out = self.mlp(self.ln2(resid))
        return self.calib_mlp_out(out, relative_to=resid) if self.cfg.calibration == "paper" else out


# ----------------------------------------------------------------------------- output head


class OutputHead(nn.Module):
    """The paper's y = MLP(LayerNorm(x)) with ReLU hidden layers, or a plain unembedding ``W_U``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind = cfg.head
        if cfg.head == "unembed":
            self.W_U = nn.Parameter(torch.empty(cfg.d_model, cfg.d_vocab))
            self.b_U = nn.Parameter(torch.zeros(cfg.d_vocab))
            return
        sizes = (cfg.d_model, *cfg.head_hidden, cfg.d_vocab)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        self.hooks = nn.ModuleList(HookPoint() for _ in cfg.head_hidden)  # head.hooks.{i}: post-ReLU

    def forward(self, x: Float[Tensor, "b p d"]) -> Float[Tensor, "b p vocab"]:
        if self.kind == "unembed":
            return x @ self.W_U + self.b_U
        for layer, hook in zip(self.layers[:-1], self.hooks):
            x = hook(F.relu(layer(x)))
        return self.layers[-1](x)


# ----------------------------------------------------------------------------- the model


class HookedNormTransformer(HookedRootModule):
    """Decoder-only transformer for the addition task, hooked like TransformerLens's HookedTransformer.

    ``forward(tokens)`` returns logits ``[batch, pos, d_vocab]``; ``return_type="loss"`` gives the
    paper's masked cross-entropy over answer tokens (see :func:`interp_norm.task.answer_mask`).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise ConfigError(f"HookedNormTransformer needs a ModelConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.W_E = nn.Parameter(torch.empty(cfg.d_vocab, cfg.d_model))
        if cfg.pos_embed == "learned":
            self.W_pos = nn.Parameter(torch.empty(cfg.n_ctx, cfg.d_model))
        else:
            self.pos_embed = SinusoidalPosEmbed(cfg)
        self.hook_embed, self.hook_pos_embed = HookPoint(), HookPoint()
        self.blocks = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.ln_final = Norm(cfg.d_model, "ln", cfg.eps, bias=True)
        self.head = OutputHead(cfg)
        if cfg.calibration == "paper":
            self.calib_type = Calibration(cfg.calib_type_std)
            self.calib_embed = Calibration(cfg.calib_embed_std)
            self.register_buffer("calibrated", torch.zeros((), dtype=torch.bool))
        self._init_weights()
        self.setup()

    # -- init ----------------------------------------------------------------------------------
    @torch.no_grad()
    def _init_weights(self) -> None:
        """Seeded init giving every variant comparable activation sizes at step 0.

        Token embeddings have std ``init_embed_std`` (|x_type| ≈ |x_pos| for the defaults);
        W_Q/W_K/W_V have std 1/√d_model so q entries are O(1) after a norm; W_O and the MLP's
        W_out are scaled by 1/√(2·n_layers) as in GPT-2 so the residual stream grows slowly.
        """
        cfg = self.cfg
        g = torch.Generator().manual_seed(cfg.seed)

        def normal_(p: Tensor, std: float) -> None:
            p.copy_(torch.randn(p.shape, generator=g) * std)

        normal_(self.W_E, cfg.init_embed_std)
        if cfg.pos_embed == "learned":
            normal_(self.W_pos, cfg.init_embed_std)
        depth = 1 / math.sqrt(2 * cfg.n_layers)
        for block in self.blocks:
            a = block.attn
            for W in (a.W_Q, a.W_K, a.W_V):
                normal_(W, 1 / math.sqrt(cfg.d_model))
            normal_(a.W_O, depth / math.sqrt(cfg.n_heads * cfg.d_head))
            normal_(block.mlp.W_in, 1 / math.sqrt(cfg.d_model))
            normal_(block.mlp.W_out, depth / math.sqrt(cfg.d_mlp))
        if cfg.head == "unembed":
            normal_(self.head.W_U, 1 / math.sqrt(cfg.d_model))
        else:
            for layer in self.head.layers:
                normal_(layer.weight, 1 / math.sqrt(layer.in_features))
                layer.bias.zero_()

    # -- forward -------------------------------------------------------------------------------
    def embed(self, tokens: Int[Tensor, "batch pos"], pos_offset: Optional[Tensor] = None) -> Float[Tensor, "batch pos d_model"]:
        cfg = self.cfg
        b, n = tokens.shape
        if n > cfg.n_ctx:
            raise ProblemStringError(
                f"the input has {n} tokens but the model's context is n_ctx={cfg.n_ctx}; "
                "use shorter problems or a model with a larger n_ctx"
            )
        if tokens.dtype not in (torch.long, torch.int32, torch.int64):
            raise ProblemStringError(f"tokens must be an integer tensor, got {tokens.dtype}; use model.to_tokens(...)")
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= cfg.d_vocab):
            raise ProblemStringError(f"token ids must lie in [0, {cfg.d_vocab}); use model.to_tokens(...)")
        tok = self.W_E[tokens]
        if cfg.pos_embed == "learned":
            pos = einops.repeat(self.W_pos[:n], "p d -> b p d", b=b)
        else:
            positions = torch.arange(n, device=tokens.device).expand(b, n)
            if pos_offset is not None:
                positions = positions + pos_offset.view(b, 1).to(tokens.device)
            pos = self.pos_embed(positions)
        if cfg.calibration == "paper":  # x = (c_type·x_type + x_pos)·c_embed, split so resid = embed + pos
            tok = self.calib_type(tok)
            tok, pos = self.calib_embed(tok, measure=tok + pos), self.calib_embed(pos, measure=tok + pos)
        return self.hook_embed(tok) + self.hook_pos_embed(pos)

    # -- the paper's Checkpoint calibration -------------------------------------------------------
    @property
    def is_calibrated(self) -> bool:
        """True for models without Checkpoint layers, and for those whose factors have been fitted."""
        return self.cfg.calibration == "none" or bool(self.calibrated)

    @torch.no_grad()
    def calibrate(self, tokens: Int[Tensor, "batch pos"], pos_offset: Optional[Int[Tensor, " batch"]] = None) -> None:
        """Fit every Checkpoint factor on this batch (in forward order), then freeze them."""
        if self.cfg.calibration == "none":
            raise ConfigError("this model has no Checkpoint layers to calibrate; build it with calibration='paper'")
        layers = [m for m in self.modules() if isinstance(m, Calibration)]
        valid = tokens.to(self.W_E.device) != T.PAD_ID
        for m in layers:
            m.valid = valid
        try:
            self(tokens, pos_offset=pos_offset)
        finally:
            for m in layers:
                m.valid = None
        self.calibrated.fill_(True)

    def calibration_factors(self) -> dict[str, float]:
        """Every Checkpoint factor by module name (empty for models without them)."""
        return {n: float(m.factor) for n, m in self.named_modules() if isinstance(m, Calibration)}

    def forward(
        self,
        input: Int[Tensor, "batch pos"] | Float[Tensor, "batch pos d_model"] | str | Sequence[str],
        return_type: Optional[Literal["logits", "loss", "both"]] = "logits",
        pos_offset: Optional[Int[Tensor, " batch"]] = None,
        *,
        start_at_layer: Optional[int] = None,
        stop_at_layer: Optional[int] = None,
        tokens: Optional[Int[Tensor, "batch pos"]] = None,
        loss_per_token: bool = False,
    ) -> Any:
        """Logits; or the masked answer-token loss; or both. ``pos_offset`` shifts positions per row.

        As HookedTransformer's: with ``start_at_layer=l``, ``input`` is the residual stream entering
        ``blocks[l]`` (pass ``tokens=`` for a loss); with ``stop_at_layer=l`` the residual entering
        ``blocks[l]`` is returned instead of logits. ``loss_per_token=True`` returns the loss at every
        position ([batch, pos], zero where nothing is scored) instead of the mean.
        """
        if start_at_layer is None:
            tokens = input if isinstance(input, Tensor) else self.to_tokens(input)
            if tokens.ndim == 1:
                tokens = tokens.unsqueeze(0)
            tokens = tokens.to(self.W_E.device)
            resid = self.embed(tokens, pos_offset)
        else:
            if not isinstance(input, Tensor) or input.ndim != 3 or input.shape[-1] != self.cfg.d_model:
                raise ConfigError(f"with start_at_layer, input must be the residual stream [batch, pos, {self.cfg.d_model}]")
            resid = input
        for block in self.blocks[start_at_layer:stop_at_layer]:
            resid = block(resid)
        if stop_at_layer is not None:
            return resid
        logits = self.head(self.ln_final(resid))
        if return_type in (None, "logits"):
            return logits if return_type == "logits" else None
        if tokens is None:
            raise ConfigError("a loss needs the tokens: pass tokens= when starting from a residual (start_at_layer)")
        targets = T.next_token_targets(tokens)
        if loss_per_token:
            loss = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="none")
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        return loss if return_type == "loss" else (logits, loss)

    @classmethod
    def from_pretrained(cls, name: str, device: str | torch.device = "cpu", **tl_options: Any) -> "HookedNormTransformer":
        """A shipped checkpoint by name (``"pre"``, ``"qkv"`` ...; see ``interp-norm list``) or a checkpoint folder.

        TransformerLens's entry point; the same model as ``interp_norm.load_pretrained(name)[0]``,
        in eval mode. TL's weight-processing options (``fold_ln`` ...) do not apply: weights load as trained.
        """
        if tl_options:
            raise ConfigError(f"from_pretrained loads weights as trained; TransformerLens options {sorted(tl_options)} are not supported")
        # Users look for the loader on the class, as in TL; it lives one layer up (checkpoints imports this module).
        checkpoints = importlib.import_module("interp_norm.checkpoints")
        return checkpoints.load_any(name, device=device)[0]

    # -- hooks: TransformerLens's API, refusing names that do not exist or never fire ---------------
    def run_with_cache(self, *args: Any, **kwargs: Any) -> tuple[Any, NormActivationCache]:
        """As HookedRootModule's; the cache is an ``ActivationCache`` that knows these models' norms."""
        out, cache = super().run_with_cache(*args, **kwargs)
        if isinstance(cache, ActivationCache):
            cache = cache.cache_dict
        return out, NormActivationCache(cache, self, has_batch_dim=not kwargs.get("remove_batch_dim", False))

    def get_caching_hooks(self, names_filter: Any = None, *args: Any, **kwargs: Any) -> tuple[dict, list, list]:
        """TL's, but listed names must exist and fire (:class:`HookNameError`), and points that never fire are skipped."""
        check_names_filter(self, names_filter)
        cache, fwd, bwd = super().get_caching_hooks(names_filter, *args, **kwargs)
        dormant = dormant_hooks(self)
        return cache, [h for h in fwd if h[0] not in dormant], [h for h in bwd if h[0] not in dormant]

    @contextmanager
    def hooks(self, fwd_hooks: Sequence = (), bwd_hooks: Sequence = (), reset_hooks_end: bool = True, clear_contexts: bool = False) -> Iterator["HookedNormTransformer"]:
        """TL's ``hooks`` context manager (behind ``run_with_hooks`` and ``run_with_cache``); every hook
        name is checked before any hook is added (:func:`interp_norm.tl_api.check_hooks`)."""
        fwd_hooks, bwd_hooks = list(fwd_hooks), list(bwd_hooks)
        check_hooks(self, fwd_hooks + bwd_hooks)
        with super().hooks(fwd_hooks, bwd_hooks, reset_hooks_end, clear_contexts) as model:
            yield model

    def add_hook(self, name: Any, hook: Any, *args: Any, **kwargs: Any) -> None:
        """TL's ``add_hook``, with the same name checks as :meth:`hooks`."""
        check_hooks(self, [(name, hook)])
        super().add_hook(name, hook, *args, **kwargs)

    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """Fire ``hook_result`` (per-head outputs); as HookedTransformer's. Same weights, same function
        up to float rounding (the per-head sum is taken after W_O)."""
        self.cfg.use_attn_result = bool(use_attn_result)

    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        """Fire ``hook_q_input/k_input/v_input`` (one residual copy per head); as HookedTransformer's."""
        self.cfg.use_split_qkv_input = bool(use_split_qkv_input)

    # -- tokens --------------------------------------------------------------------------------
    def to_tokens(self, problems: str | Sequence[str], prepend_bos: bool = True, **_: Any) -> Int[Tensor, "batch pos"]:
        """Problem strings → right-padded token ids. Each string is validated by the task parser."""
        if isinstance(problems, str):
            problems = [problems]
        if len(problems) == 0:
            raise ProblemStringError("no problems given; pass a string like '[12+N7=' or a list of them")
        seqs = []
        for s in problems:
            p = T.parse_problem(s)
            text = s.strip()
            if prepend_bos and not text.startswith(T.BOS):
                text = T.BOS + text
            # keep whatever answer part the user wrote (already checked against the arithmetic)
            seqs.append(T.encode(text if T.EQ in text else p.question))
        tokens = T.pad_batch(seqs)
        self._check_fits(tokens.shape[1])
        return tokens.to(self.W_E.device)

    def _check_fits(self, n: int) -> None:
        if n > self.cfg.n_ctx:
            raise ProblemStringError(
                f"a problem is {n} tokens long but the model's context is n_ctx={self.cfg.n_ctx}; "
                "use fewer terms/digits or a model with a larger n_ctx"
            )

    def to_single_token(self, string: str) -> int:
        """The token id of a one-character string (every token is one character), as TL's."""
        if not isinstance(string, str) or string not in T.TOKEN_TO_ID:
            raise ProblemStringError(f"{string!r} is not a single token; the tokens are the characters {''.join(T.VOCAB)!r}")
        return T.TOKEN_TO_ID[string]

    def to_string(self, tokens: Int[Tensor, "... pos"]) -> str | list[str]:
        if tokens.ndim == 1:
            return T.decode(tokens)
        return [T.decode(t) for t in tokens]

    def to_str_tokens(self, tokens: Int[Tensor, " pos"] | str) -> list[str]:
        if isinstance(tokens, str):
            tokens = self.to_tokens(tokens)[0]
        if tokens.ndim == 2:
            tokens = tokens[0]
        return [T.VOCAB[int(i)] for i in tokens]

    @torch.no_grad()
    def generate(self, problems: str | Sequence[str] | Int[Tensor, "batch pos"], max_new_tokens: Optional[int] = None) -> list[str]:
        """Greedy answers: for ``"[12+N7="`` returns ``"5]"``. Stops at ``]`` (kept in the output)."""
        if isinstance(problems, Tensor):
            tokens = problems.clone()
        else:
            if isinstance(problems, str):
                problems = [problems]
            if len(problems) == 0:
                raise ProblemStringError("no problems given; pass a string like '[12+N7=' or a list of them")
            tokens = T.pad_batch([T.encode(T.parse_problem(s).question) for s in problems])
        tokens = tokens.to(self.W_E.device)
        lengths = (tokens != T.PAD_ID).sum(-1)
        longest = int(lengths.max())
        self._check_fits(longest)
        if longest >= self.cfg.n_ctx:
            raise ProblemStringError(
                f"a problem is {longest} tokens long and fills the model's context n_ctx={self.cfg.n_ctx}, "
                "leaving no room for an answer; use fewer terms/digits or a model with a larger n_ctx"
            )
        budget = max_new_tokens if max_new_tokens is not None else self.cfg.n_ctx - int(lengths.min())
        width = min(self.cfg.n_ctx, int(lengths.max()) + budget)
        if width > tokens.shape[1]:
            tokens = F.pad(tokens, (0, width - tokens.shape[1]), value=T.PAD_ID)
        start = lengths.clone()
        done = torch.zeros(len(tokens), dtype=torch.bool, device=tokens.device)
        rows = torch.arange(len(tokens), device=tokens.device)
        for _ in range(budget):
            active = ~done & (lengths < width)
            if not active.any():
                break
            n = int(lengths[active].max())
            logits = self(tokens[:, :n])
            nxt = logits[rows, (lengths - 1).clamp(max=n - 1)].argmax(-1)
            idx = rows[active]
            tokens[idx, lengths[idx]] = nxt[idx]
            lengths[idx] += 1
            done |= active & (nxt == T.EOS_ID)
        return [T.decode(tokens[i, start[i] : lengths[i]]) for i in range(len(tokens))]

    # -- conveniences ----------------------------------------------------------------------------
    @property
    def W_pos_embed(self) -> Tensor:
        """Positional embeddings of positions 0..n_ctx-1 at offset 0: [n_ctx, d_model]."""
        if self.cfg.pos_embed == "learned":
            return self.W_pos
        return self.pos_embed(torch.arange(self.cfg.n_ctx, device=self.W_E.device).unsqueeze(0))[0]

    @property
    def W_U(self) -> Tensor:
        """[d_model, d_vocab] for ``head='unembed'``. A :class:`ConfigError` (a ValueError, so ``hasattr``
        does not swallow it) for the paper's MLP head, which has no single unembedding."""
        if self.cfg.head != "unembed":
            raise ConfigError("this model has the paper's MLP output head, not a plain unembedding W_U; build it with head='unembed'")
        return self.head.W_U

    def tokens_to_residual_directions(self, tokens: str | int | Tensor) -> Tensor:
        """The residual direction each token's logit reads (``[..., d_model]``), as TL's, for ``head='unembed'``.

        ``ln_final``'s gain is folded in (W_U scaled row-wise), as TL's default ``fold_ln`` does, so
        ``cache.logit_attrs`` dotted with the centred, scaled residual gives logit - b_U - b_ln·W_U.
        The MLP head has no such direction: :class:`ConfigError` saying what to use instead.
        """
        if self.cfg.head != "unembed":
            raise ConfigError(DLA_REFUSAL)
        W = self.ln_final.w[:, None] * self.head.W_U
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        if isinstance(tokens, Tensor) and tokens.numel() > 1:
            return einops.rearrange(W[:, tokens], "d ... -> ... d")
        return W[:, int(tokens)]

    def _stack(self, name: str) -> Tensor:
        return torch.stack([getattr(b.attn, name) for b in self.blocks])

    W_Q = property(lambda self: self._stack("W_Q"), doc="[n_layers, n_heads, d_model, d_head]")
    W_K = property(lambda self: self._stack("W_K"), doc="[n_layers, n_heads, d_model, d_head]")
    W_V = property(lambda self: self._stack("W_V"), doc="[n_layers, n_heads, d_model, d_head]")
    W_O = property(lambda self: self._stack("W_O"), doc="[n_layers, n_heads, d_head, d_model]")

    @property
    def QK(self) -> FactoredMatrix:
        """W_Q W_Kᵀ per head, a TL ``FactoredMatrix`` [n_layers, n_heads, d_model, d_model] (row-vector
        convention: score ∝ x_q QK x_kᵀ), built from the raw weights as in an unfolded HookedTransformer.

        What it means, by variant (``attn_scale`` and the paper's calibration factors always excluded):
        No-Norm scores are x_q QK x_kᵀ / attn_scale. Pre-Norm: QK acts on ln1's output, the normalised
        residual times its query/key gains, which are *not* folded in (scores = (N(x_q)·g_q) QK
        (N(x_k)·g_k)ᵀ / attn_scale; scale W_Q/W_K's rows by ``blocks[l].ln1.w`` to fold them).
        QK/QKV-Norm: the per-head q and k norms act *between* W_Q and W_K, so QK is the bilinear form
        before those norms (hook_q · hook_k), not the one the scores use.
        """
        return FactoredMatrix(self.W_Q, self.W_K.transpose(-2, -1))

    @property
    def OV(self) -> FactoredMatrix:
        """W_V W_O per head, a TL ``FactoredMatrix`` [n_layers, n_heads, d_model, d_model] (x @ OV).

        Raw weights as in :attr:`QK`: Pre-Norm applies it to ln1's output (value gain not folded in),
        QKV-Norm's per-head v norm acts between W_V and W_O; b_O is excluded, as in TL.
        """
        return FactoredMatrix(self.W_V, self.W_O)

    def hook_names(self) -> list[str]:
        return list(self.hook_dict)


__all__ = ["ModelConfig", "HookedNormTransformer", "ATTN_NORMS", "NORM_KINDS", "CALIBRATIONS", "Norm", "Attention", "Calibration"]
