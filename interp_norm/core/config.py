"""The model's configuration: every architectural choice, with the paper's defaults.

Choices the paper (Menary et al. 2024, arXiv 2406.17837) leaves open, each a config field:

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
  ``"paper"`` adds the paper's "Checkpoint" layers (its experimental set-up), :class:`Calibration` below: each
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

import math
from dataclasses import dataclass
from typing import Any, Optional

from transformer_lens.config.transformer_lens_config import TransformerLensConfig

from interp_norm.core import task as T
from interp_norm.core.defaults import ATTN_NORMS
from interp_norm.errors import ConfigError, check_positive_int

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
            check_positive_int(getattr(self, name), name)
        if self.d_mlp is not None:
            check_positive_int(self.d_mlp, "d_mlp")
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
    def from_dict(cls, d: dict) -> "ModelConfig":
        unknown = sorted(set(d) - set(cls._OWN_FIELDS))
        if unknown:
            raise ConfigError(f"unknown model config fields {unknown}; known fields: {list(cls._OWN_FIELDS)}")
        return cls(**d)

    def replace(self, **changes: Any) -> "ModelConfig":
        return ModelConfig.from_dict({**self.to_dict(), **changes})


__all__ = ["ModelConfig", "ATTN_NORMS", "NORM_KINDS", "CALIBRATIONS"]
