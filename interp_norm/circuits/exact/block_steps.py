"""One transformer block's steps, in the two arithmetics of the patching engine.

With ``fast=False`` every step is the model's own: ``blk.ln1`` / ``ln2``, ``attn.project`` /
``normalize`` / ``scores`` / ``out``, the block's update calibration and ``blk.mlp_update``. With
``fast=True``, and only when no hook is on the model (a fused kernel would bypass it), the same
functions run as fused CPU kernels on the model's weights: q, k and v as one
``[d_model, 3 * n_heads * d_head]`` matmul (separate Pre-Norm gains folded into it), ``W_O`` and the
MLP as ``addmm``, and the softmax on a key axis padded to a multiple of 16 (``Tensor.softmax`` is
~10x slower on 12 or 14 keys). They round differently (~1e-7 relative) and make a recomputed row
cheaper than a row of the model's own forward pass (``benchmarks/bench_patching.py``, ``row cost``).
Both use the model's own norms (one fused kernel each when unhooked, :class:`interp_norm.core.components.Norm`),
calibration layers and score scaling (``attn.scale_scores``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from interp_norm.core.components import unit_norm


def causal_softmax(scores: Tensor, causal: Tensor) -> Tensor:
    """Softmax over the last axis with ``~causal`` entries masked out (zero weight)."""
    m = scores.masked_fill(~causal, float("-inf")).amax(-1, keepdim=True)
    e = (scores - m).exp_().mul_(causal)
    return e.div_(e.sum(-1, keepdim=True))


def padded_softmax(scores: Tensor, causal: Tensor) -> Tensor:
    """:func:`causal_softmax` through ``Tensor.softmax`` on a key axis padded with ``-inf`` to a
    multiple of 16 (its vectorised CPU kernel; on 12 or 14 keys it is ~10x slower)."""
    nk = scores.shape[-1]
    pad = -nk % 16
    x = scores.masked_fill(~causal, float("-inf"))
    if not pad:
        return x.softmax(-1)
    return F.pad(x, (0, pad), value=float("-inf")).softmax(-1)[..., :nk]


def _has_hooks(model) -> bool:
    """Does any hook point of the model carry a forward hook (a user's, or TransformerLens's)?"""
    return any(hp._forward_hooks or hp._forward_pre_hooks for hp in model.hook_dict.values())


class BlockSteps:
    """The steps of ``model``'s blocks: the model's own (``fast=False``), or fused kernels equal to
    them up to rounding (``fast=True`` and no hook on the model; :attr:`fast` says which ran)."""

    def __init__(self, model, fast: bool):
        self.model = model
        self.fast = fast and not _has_hooks(model)
        self._fused = [self._fuse(blk) for blk in model.blocks] if self.fast else None

    def _attn_inputs(self, blk, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The inputs of W_Q, W_K, W_V: the residual, or the Pre-Norm's ``ln1`` of it (one per gain)."""
        ln1 = getattr(blk, "ln1", None)
        if ln1 is None:
            return x, x, x
        out = ln1(x)
        return out if isinstance(out, tuple) else (out, out, out)

    def _fuse(self, blk) -> Optional[dict]:
        """The block's weights laid out for plain 2-D matmuls (None: this block keeps the model's steps)."""
        from interp_norm.core.components import MLP  # our MLP's arithmetic is what the fused kernel repeats

        attn, cfg = blk.attn, self.model.cfg
        if cfg.use_attn_result or type(blk.mlp) is not MLP:
            return None
        d = cfg.d_model
        w = {t: getattr(attn, f"W_{t.upper()}").detach().permute(1, 0, 2).reshape(d, -1) for t in "qkv"}
        w["qkv"] = torch.cat([w["q"], w["k"], w["v"]], 1)
        ln1 = getattr(blk, "ln1", None)
        if ln1 is not None and ln1.n_gains == 3 and ln1.b is None and cfg.calibration != "paper":
            # x_normed * g_t @ W_t == x_normed @ (diag(g_t) W_t)
            w["qkv_gained"] = torch.cat([ln1.w[i].detach()[:, None] * w[t] for i, t in enumerate("qkv")], 1)
        w["o"] = attn.W_O.detach().reshape(-1, d)
        return w

    def _qkv(self, l: int, resid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v (as hooked: before any per-head norm) [..., h, dh] of block ``l``'s input ``resid`` [..., d]."""
        blk = self.model.blocks[l]
        attn, w = blk.attn, self._fused and self._fused[l]
        if w and "qkv_gained" in w:  # separate Pre-Norm gains folded into the weights: one matmul
            y = unit_norm(resid, blk.ln1.kind, blk.ln1.eps).reshape(-1, resid.shape[-1])
            return self._split_qkv(attn, y @ w["qkv_gained"], resid.shape[:-1])
        xs = self._attn_inputs(blk, resid)
        if not w:
            if resid.ndim == 2:
                return tuple(attn.project(x.unsqueeze(0), t)[0] for x, t in zip(xs, "qkv"))
            return tuple(attn.project(x, t) for x, t in zip(xs, "qkv"))
        if self.model.cfg.calibration == "paper":
            xs = tuple(getattr(attn, f"calib_{t}_in")(x) for x, t in zip(xs, "qkv"))
        elif xs[0] is xs[1] is xs[2]:  # one input: one matmul
            return self._split_qkv(attn, xs[0].reshape(-1, xs[0].shape[-1]) @ w["qkv"], resid.shape[:-1])
        h, dh = attn.W_Q.shape[::2]
        return tuple((x.reshape(-1, x.shape[-1]) @ w[t]).view(*resid.shape[:-1], h, dh) for x, t in zip(xs, "qkv"))

    @staticmethod
    def _split_qkv(attn, y: Tensor, lead) -> tuple[Tensor, Tensor, Tensor]:
        h, dh = attn.W_Q.shape[::2]
        y = y.view(*lead, 3, h, dh)
        return y.select(-3, 0), y.select(-3, 1), y.select(-3, 2)

    def _out(self, l: int, z: Tensor) -> Tensor:
        """``attn.out(z)`` for z [..., h, dh]."""
        attn, w = self.model.blocks[l].attn, self._fused and self._fused[l]
        if not w:
            return attn.out(z.unsqueeze(0))[0] if z.ndim == 3 else attn.out(z)
        return torch.addmm(attn.b_O, z.reshape(-1, w["o"].shape[0]), w["o"]).view(*z.shape[:-2], -1)

    def _mlp(self, l: int, x: Tensor) -> Tensor:
        """``blk.mlp_update(x)`` for x [..., d]."""
        blk = self.model.blocks[l]
        if not (self._fused and self._fused[l]):
            return blk.mlp_update(x.unsqueeze(0))[0] if x.ndim == 2 else blk.mlp_update(x)
        mlp = blk.mlp
        hid = torch.addmm(mlp.b_in, blk.ln2(x).reshape(-1, x.shape[-1]), mlp.W_in).relu_()
        out = torch.addmm(mlp.b_out, hid, mlp.W_out).view_as(x)
        calib = getattr(blk, "calib_mlp_out", None)
        return out if calib is None else calib(out, relative_to=x)

    def _softmax(self, scores: Tensor, causal: Tensor) -> Tensor:
        """The causal softmax of this arithmetic: padded for ``Tensor.softmax`` in fast mode."""
        return padded_softmax(scores, causal) if self.fast else causal_softmax(scores, causal)

    @staticmethod
    def _attn_update(blk, out: Tensor, resid: Tensor) -> Tensor:
        """What the attention adds to the residual: ``attn.out(z)`` through the block's update calibration."""
        calib = getattr(blk, "calib_attn_out", None)
        return out if calib is None else calib(out, relative_to=resid)


__all__ = ["BlockSteps", "causal_softmax", "padded_softmax"]
