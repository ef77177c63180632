"""The model's building blocks, top to bottom: norms, calibration, embeddings, attention, MLP, block, head.

Each module fires TransformerLens-named hook points (``hook_q``, ``hook_pattern``, ``hook_z`` ...);
the attention exposes its steps (:meth:`Attention.project`, :meth:`Attention.normalize`,
:meth:`Attention.scores`, :meth:`Attention.out`) and the block its residual updates
(:meth:`TransformerBlock.attn_update`, :meth:`TransformerBlock.mlp_update`), so analyses call the
model's own code instead of re-deriving it. See :mod:`interp_norm.core.config` for the choices.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator, Optional

import einops
import torch
import torch.nn as nn
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor
from transformer_lens.hook_points import HookPoint

from interp_norm.core.config import ModelConfig
from interp_norm.errors import ConfigError


# ----------------------------------------------------------------------------- norms


class Norm(nn.Module):
    """RMSNorm or LayerNorm over the last dimension, with hooks like TransformerLens's.

    ``hook_scale`` is the divisor (``sqrt(mean(x²)+eps)`` for RMS, ``sqrt(var+eps)`` for LN) and
    ``hook_normalized`` the output after gain and bias. ``n_gains > 1`` gives the paper's separate
    query/key/value gains on one shared normalisation (Pre-Norm); then ``hook_normalized`` is the
    vector before the gains and :meth:`forward` returns one tensor per gain.

    Unhooked it runs as one fused kernel (``F.layer_norm`` / ``F.rms_norm``, with a fused backward:
    a training step as fast as a plain PyTorch model's, ``benchmarks/bench_train_step.py``); the
    divisor is computed explicitly only when a hook sits on ``hook_scale`` (:func:`_unit_by_hooked_scale`).
    """

    def __init__(self, length: int, kind: str, eps: float, bias: bool = False, n_gains: int = 1):
        super().__init__()
        self.kind, self.eps, self.n_gains = kind, eps, n_gains
        self.w = nn.Parameter(torch.ones(n_gains, length) if n_gains > 1 else torch.ones(length))
        self.b = nn.Parameter(torch.zeros(length)) if bias else None
        self.hook_scale = HookPoint()  # [..., 1]
        self.hook_normalized = HookPoint()  # [..., length]

    def forward(self, x: Float[Tensor, "... d"]) -> Any:
        unit = _unit_by_hooked_scale(self.hook_scale, x, self.kind, self.eps)  # None: one fused kernel
        if self.n_gains > 1:
            y = self.hook_normalized(unit_norm(x, self.kind, self.eps) if unit is None else unit)
            return tuple(y * self.w[i] for i in range(self.n_gains))
        if unit is None:
            return self.hook_normalized(_gained_norm(x, self.kind, self.eps, self.w, self.b))
        y = unit * self.w
        return self.hook_normalized(y if self.b is None else y + self.b)


def unit_norm(x: Tensor, kind: str, eps: float) -> Tensor:
    """``x`` normalised over the last axis (LayerNorm or RMS), before any gain: one fused kernel."""
    return F.layer_norm(x, x.shape[-1:], eps=eps) if kind == "ln" else F.rms_norm(x, x.shape[-1:], eps=eps)


def _gained_norm(x: Tensor, kind: str, eps: float, w: Tensor, b: Optional[Tensor]) -> Tensor:
    """``unit_norm(x) * w (+ b)``, the gain inside the kernel where its shape allows (not per-head gains)."""
    if w.shape != x.shape[-1:]:
        y = unit_norm(x, kind, eps) * w
    elif kind == "ln":
        return F.layer_norm(x, x.shape[-1:], w, b, eps)
    else:
        y = F.rms_norm(x, x.shape[-1:], w, eps)
    return y if b is None else y + b


def _unit_by_hooked_scale(hook: HookPoint, x: Tensor, kind: str, eps: float) -> Optional[Tensor]:
    """``x`` (centred for LayerNorm) divided by the scale a hook on ``hook_scale`` gave back, or None
    when no hook changes the scale (then the norm runs as one fused kernel).

    Without hooks the scale is not computed at all. With hooks it is computed explicitly
    (``sqrt(mean(x²) + eps)``) and the hook runs on it; if the hook only read it (the same tensor
    back, not modified in place, no backward hook, which needs the divisor on the gradient's path),
    None again: caching a scale leaves the output bit-identical to an unhooked run, and patching or
    noising it takes effect.
    """
    bwd = hook._backward_hooks or hook._backward_pre_hooks
    if not (hook._forward_hooks or hook._forward_pre_hooks or bwd):
        return None
    if kind == "ln":
        x = x - x.mean(-1, keepdim=True)
    scale = (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    version = scale._version
    out = hook(scale)
    return None if out is scale and scale._version == version and not bwd else x / out


class HeadNorm(nn.Module):
    """Per-head normalisation of q, k or v after the projection (QKV-Norm / QK-Norm).

    Hooks ``hook_{name}_scale`` ([batch, pos, head, 1]) and ``hook_{name}_normed`` live on the
    parent attention module, so their names read ``blocks.{l}.attn.hook_q_scale`` as TransformerLens spells
    its attention hooks.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind, self.eps = cfg.norm_kind, cfg.eps
        shape = (cfg.n_heads, cfg.d_head) if cfg.qkv_gain == "per_head" else (cfg.d_head,)
        self.w = nn.Parameter(torch.ones(shape))

    def forward(self, x: Float[Tensor, "b p h d"], hook_scale: HookPoint, hook_normed: HookPoint) -> Float[Tensor, "b p h d"]:
        unit = _unit_by_hooked_scale(hook_scale, x, self.kind, self.eps)  # None: one fused kernel
        return hook_normed(_gained_norm(x, self.kind, self.eps, self.w, None) if unit is None else unit * self.w)


#: The non-padding mask ``[batch, pos]`` of the batch the Checkpoint factors are being fitted on, while
#: :func:`fitting_calibration` is active (in this thread / context only); None otherwise.
_FITTING: ContextVar[Optional[Tensor]] = ContextVar("interp_norm_calibration_fitting", default=None)


@contextmanager
def fitting_calibration(valid: Tensor) -> Iterator[None]:
    """While active, every :class:`Calibration` layer a forward pass reaches fits its factor on the
    batch passing through (``valid``: its non-padding mask); on exit, even by an exception, the
    factors are frozen again. The one switch of calibration mode: no module attribute changes."""
    token = _FITTING.set(valid)
    try:
        yield
    finally:
        _FITTING.reset(token)


class Calibration(nn.Module):
    """The paper's "Checkpoint" layer: ``x * factor``, the factor fitted once so the output std is ``std``.

    Inside :func:`fitting_calibration` (what :meth:`HookedNormTransformer.calibrate` uses), each layer
    sets its factor from the batch passing through (``std / std(measure)``, over the entries the
    fitting mask marks valid); otherwise the factor is a frozen buffer saved with the weights.
    ``kind="update"`` measures Δx relative to the residual it is added to; ``kind="scores"`` measures
    causal, non-padding query/key pairs.
    """

    factor: Tensor  # a buffer

    def __init__(self, std: float, kind: str = "vector"):
        super().__init__()
        self.std, self.kind = float(std), kind
        self.register_buffer("factor", torch.ones(()))

    def _std(self, x: Tensor, valid: Tensor) -> Tensor:
        if self.kind == "scores":  # [b, h, q, k]: causal pairs whose query and key are both real tokens
            n = x.shape[-1]
            keep = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
            keep = keep & valid[:, None, :n, None] & valid[:, None, None, :n]
            return x.masked_select(keep.expand_as(x)).std()
        return x[valid[:, : x.shape[1]]].std()

    def forward(self, x: Tensor, measure: Optional[Tensor] = None, relative_to: Optional[Tensor] = None) -> Tensor:
        valid = _FITTING.get()
        if valid is not None:
            target = self.std * (self._std(relative_to, valid) if relative_to is not None else 1.0)
            self.factor.fill_(float(target / self._std(measure if measure is not None else x, valid)))
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

    mask: Tensor  # a buffer

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
        return self.scale_scores(torch.einsum(spec, q, k))

    def scale_scores(self, qk: Tensor) -> Tensor:
        """``q · k`` to the scores: divided by ``attn_scale``, then the score calibration (if any)."""
        assert self.cfg.attn_scale is not None  # ModelConfig sets it (√d_head by default)
        scores = qk / self.cfg.attn_scale
        if self.cfg.calibration == "paper":
            scores = self.calib_scores(scores)
        return scores

    def forward(self, x_q: Tensor, x_k: Tensor, x_v: Tensor) -> Float[Tensor, "batch pos d_model"]:
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
        if cfg.d_mlp is None:
            raise ConfigError("the model's blocks have an MLP: set d_mlp")
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

    # set in __init__ by name (setattr)
    hook_resid_pre: HookPoint
    hook_q_input: HookPoint
    hook_k_input: HookPoint
    hook_v_input: HookPoint
    hook_attn_out: HookPoint
    hook_resid_mid: HookPoint
    hook_mlp_out: HookPoint
    hook_resid_post: HookPoint

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
            return tuple(o[i] if isinstance(o, tuple) else o for i, o in enumerate(outs))
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

    layers: list[nn.Linear]  # an nn.ModuleList, typed by what it holds

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind = cfg.head
        if cfg.head == "unembed":
            self.W_U = nn.Parameter(torch.empty(cfg.d_model, cfg.d_vocab))
            self.b_U = nn.Parameter(torch.zeros(cfg.d_vocab))
            return
        sizes = (cfg.d_model, *cfg.head_hidden, cfg.d_vocab)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))  # type: ignore[assignment]
        self.hooks = nn.ModuleList(HookPoint() for _ in cfg.head_hidden)  # head.hooks.{i}: post-ReLU

    def forward(self, x: Float[Tensor, "b p d"]) -> Float[Tensor, "b p vocab"]:
        if self.kind == "unembed":
            return x @ self.W_U + self.b_U
        for layer, hook in zip(self.layers[:-1], self.hooks):
            x = hook(F.relu(layer(x)))
        return self.layers[-1](x)


__all__ = ["Norm", "HeadNorm", "Calibration", "fitting_calibration", "SinusoidalPosEmbed", "Attention", "MLP", "TransformerBlock", "OutputHead"]
