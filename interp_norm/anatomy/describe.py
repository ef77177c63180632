"""What a model's attention looks like: the anatomy types, norm identification, our models' anatomy.

:func:`~interp_norm.anatomy.anatomy` (:mod:`interp_norm.anatomy.model_anatomy`) describes every
attention layer of our :class:`HookedNormTransformer` (:func:`own_anatomy`, from its config,
:mod:`interp_norm.core.hook_names` and its module tree) and of a TransformerLens 4
``TransformerBridge`` around a Hugging Face model (from the bridge's config and the wrapped HF
module tree: the ``q_norm``/``k_norm``/``v_norm`` children of each attention, identified by what
they compute, and their weight shapes). Nothing is read from a per-architecture table.

Hook names are never spelled here: they are read from the ``HookPoint`` objects of the module tree
(``.name``), or for our models from :mod:`interp_norm.core.hook_names`. The bridge part lives in
:mod:`interp_norm.anatomy.bridge_anatomy`.

Why a probe forward: a bridge's hook does not always mean what its name says (on Gemma 4,
``hook_attn_scores`` fires the post-softmax pattern; ``hook_rot_q`` exists but never fires), and
hook tensors come in three layouts ([b, p, h, d], [b, h, p, d], [b, p, h·d]) that cannot be told
apart when the sequence length equals the head count. So :func:`anatomy` runs one short random
sequence whose length differs from every head count, records which hooks fire and in which
layout, checks that each "normed" hook really holds norm(q) of the raw hook, and checks that the
scores it rebuilds from q and k reproduce the model's own attention pattern
(:mod:`interp_norm.anatomy.rebuild`). A model that fails gets an :class:`ArchitectureError`
(defined in :mod:`interp_norm.errors`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import pandas as pd
import torch
from torch import nn

from interp_norm.anatomy._common import norm_eps
from interp_norm.core import hook_names as H
from interp_norm.errors import ArchitectureError

TARGETS = ("q", "k", "v")
LAYOUTS = ("bphd", "bhpd", "flat")
PLACEMENTS = ("pre", "qk", "qkv", "none")
#: Hook keys of :attr:`LayerAnatomy.hooks` (values are full hook names, or None where absent).
HOOK_KEYS = ("q", "k", "v", "q_normed", "k_normed", "v_normed", "q_rot", "k_rot", "attn_scores", "pattern", "z")


@dataclass(frozen=True)
class NormSpec:
    """One normalisation: what it computes (identified from its output, not its class name).

    ``kind`` "rms" (x/rms(x)·g) or "ln" ((x−mean)/std·g + b); ``axis`` "per_head" (over each
    head's d_head entries), "all_heads" (over the concatenated heads, OLMo-2) or "residual"
    (over d_model, a Pre-Norm); ``gain``/``bias`` whether it has learnable ones; ``module`` its
    path in the model.
    """

    kind: str
    axis: str
    gain: bool
    bias: bool
    eps: float
    module: str


@dataclass(frozen=True)
class LayerAnatomy:
    """One attention layer. ``hooks[key]`` is a hook name (see :data:`HOOK_KEYS`) or None;
    ``layouts[key]`` how that hook's tensor is laid out ("bphd", "bhpd" or "flat" = [b, p, h·d]).

    ``score_scale`` multiplies q·k (1/√d_head for most models, 1.0 for Gemma 4); ``softcap`` the
    tanh cap on scores (Gemma 2) or None; ``rope`` whether q and k are rotated, ``rope_from_hooks``
    whether the rotated ones are read from ``q_rot``/``k_rot`` (else recomputed from the model's
    rotary module); ``sliding_window`` the local-attention width or None. ``scores_hook`` says
    what ``hooks["attn_scores"]`` holds: "pre_softmax" (softmax of it is the pattern),
    "not_pre_softmax" (do not use it), "absent", or "unverified". ``kv_layer``/``v_from_k``
    describe Gemma 4's KV sharing and shared k/v projection; then ``hooks["k"]`` etc. name the
    hooks that really hold the keys and values this layer reads.
    """

    layer: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    placement: str
    norms: Mapping[str, Optional[NormSpec]]
    pre_norm: Optional[NormSpec]
    post_norm: Optional[NormSpec]
    hooks: Mapping[str, Optional[str]]
    layouts: Mapping[str, str]
    score_scale: float
    softcap: Optional[float] = None
    rope: bool = False
    rope_from_hooks: bool = False
    sliding_window: Optional[int] = None
    scores_hook: str = "unverified"
    pattern_error: Optional[float] = None  # max |softmax(our scores) − pattern| on the probe
    pattern_ok: Optional[bool] = None  # pattern_error within the dtype's tolerance (None: not checked)
    kv_layer: Optional[int] = None  # layer whose k/v this one reads (Gemma 4 KV sharing); None = itself
    v_from_k: bool = False  # no v projection: v = v_norm(raw k) (Gemma 4 "k = v" global layers)

    @property
    def shares_kv(self) -> bool:
        """Whether this layer reads another layer's keys and values (hooks k/v are that layer's)."""
        return self.kv_layer is not None and self.kv_layer != self.layer

    @property
    def kv_head_of(self) -> tuple[int, ...]:
        """Key/value head read by each query head (HF's ``repeat_kv``: consecutive groups)."""
        group = self.n_heads // self.n_kv_heads
        return tuple(h // group for h in range(self.n_heads))

    def n_heads_of(self, target: str) -> int:
        """Heads of q (``n_heads``) or of k/v (``n_kv_heads``)."""
        return self.n_heads if target == "q" else self.n_kv_heads

    def used(self, target: str) -> str:
        """Hook key of the q/k/v the attention uses before any rotation: normed if there is a norm."""
        return f"{target}_normed" if self.norms.get(target) is not None else target


@dataclass(frozen=True)
class Anatomy:
    """The attention anatomy of a whole model: ``kind`` "interp_norm" or "bridge"."""

    kind: str
    architecture: str
    layers: tuple[LayerAnatomy, ...]
    notes: tuple[str, ...] = field(default=())

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer: int) -> LayerAnatomy:
        if not isinstance(layer, int) or not 0 <= layer < len(self.layers):
            raise ArchitectureError(f"layer {layer!r} is out of range; this model has {len(self.layers)} attention layers")
        return self.layers[layer]

    def table(self) -> pd.DataFrame:
        """One row per layer: the anatomy as a DataFrame (for reports and the README table)."""
        rows = []
        for la in self.layers:
            row = dict(
                architecture=self.architecture, layer=la.layer, placement=la.placement,
                n_heads=la.n_heads, n_kv_heads=la.n_kv_heads, d_head=la.d_head,
                pre_norm=None if la.pre_norm is None else la.pre_norm.kind,
                score_scale=la.score_scale, rope=la.rope, rope_from_hooks=la.rope_from_hooks,
                sliding_window=la.sliding_window, kv_layer=la.layer if la.kv_layer is None else la.kv_layer,
                v_from_k=la.v_from_k, scores_hook=la.scores_hook, pattern_error=la.pattern_error,
            )
            for t in TARGETS:
                n = la.norms.get(t)
                row[f"{t}_norm"] = None if n is None else f"{n.kind}/{n.axis}/{'gain' if n.gain else 'no-gain'}"
            rows.append(row)
        return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- identifying a norm


def identify_norm(module: nn.Module, dim: int, path: str, axis: str, seed: int = 0) -> NormSpec:
    """Which normalisation ``module`` computes over a last dimension of size ``dim``.

    Feeds random rows through it and fits y = x̂·g + b per column for x̂ the RMS- and the
    LayerNorm-normalised input: the kind whose fit is exact is the one it computes (so Gemma's
    ``(1 + w)`` gains and parameter-free norms are recognised alike). Raises
    :class:`ArchitectureError` if neither fits.
    """
    eps = norm_eps(module) or 0.0
    p = next(iter(module.parameters()), None)
    dtype = p.dtype if p is not None and p.is_floating_point() else torch.float32
    device = p.device if p is not None else "cpu"
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(16, dim, generator=g) * 3 + torch.randn(1, dim, generator=g)).to(torch.float64)
    with torch.no_grad():
        y = module(x.to(dtype=dtype, device=device)).to("cpu", torch.float64)
    if y.shape != x.shape:
        raise ArchitectureError(f"norm {path!r} maps [16, {dim}] to {tuple(y.shape)}; cannot identify it")
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
    fits = {}
    for kind in ("rms", "ln"):
        xc = x - x.mean(-1, keepdim=True) if kind == "ln" else x
        xhat = xc / (xc.pow(2).mean(-1, keepdim=True) + eps).sqrt()
        # per column: least squares of y[:, j] on [xhat[:, j], 1]
        A = torch.stack([xhat, torch.ones_like(xhat)], -1).permute(1, 0, 2)  # [dim, 16, 2]
        sol = torch.linalg.lstsq(A, y.T.unsqueeze(-1)).solution[..., 0]  # [dim, 2]
        resid = (A @ sol.unsqueeze(-1))[..., 0] - y.T
        fits[kind] = (float(resid.abs().max() / (y.abs().max() + 1e-12)), sol)
    kind = min(fits, key=lambda k: fits[k][0])
    if fits[kind][0] > tol:
        raise ArchitectureError(
            f"module {path!r} ({type(module).__name__}) is neither an RMSNorm nor a LayerNorm over its last "
            f"dimension (relative fit errors: rms {fits['rms'][0]:.2g}, ln {fits['ln'][0]:.2g}); interp_norm "
            "cannot say what it does to q, k or v"
        )
    params = [q for q in module.parameters()]
    has_gain = any(q.numel() == dim for q in params)
    has_bias = sum(q.numel() == dim for q in params) >= 2 or float(fits[kind][1][:, 1].abs().max()) > 1e-6
    return NormSpec(kind=kind, axis=axis, gain=has_gain, bias=has_bias, eps=eps, module=path)


def _computes_a_norm(module: nn.Module) -> bool:
    """Whether a module with only vector parameters behaves as an RMS/LayerNorm (tried, not named)."""
    params = list(module.parameters())
    if not params or any(p.ndim != 1 for p in params):
        return False
    try:
        identify_norm(module, params[0].numel(), "", "per_head")
    except Exception:
        return False
    return True


def _module_path(model: nn.Module, module: nn.Module) -> str:
    for name, m in model.named_modules():
        if m is module:
            return name
    return type(module).__name__


# ----------------------------------------------------------------------------- our models


def own_anatomy(model: Any) -> Anatomy:
    """The :class:`Anatomy` of our :class:`HookedNormTransformer`, from its config and module tree."""
    cfg = model.cfg
    layers = []
    for l, block in enumerate(model.blocks):
        attn = block.attn
        norms: dict[str, Optional[NormSpec]] = {}
        for t in TARGETS:
            mod = getattr(attn, f"{t}_norm", None)
            if (mod is not None) != H.is_normalised(cfg.attn_norm, t):
                raise ArchitectureError(f"layer {l}: attn_norm={cfg.attn_norm!r} but the module tree {'has' if mod is not None else 'lacks'} {t}_norm")
            norms[t] = None if mod is None else NormSpec(cfg.norm_kind, "per_head", True, False, cfg.eps, _module_path(model, mod))
        pre = None
        if cfg.attn_norm == "pre":
            pre = NormSpec(cfg.norm_kind, "residual", True, False, cfg.eps, _module_path(model, block.ln1))
        hooks: dict[str, Optional[str]] = {t: H.act_name(t, l) for t in TARGETS}
        hooks.update({f"{t}_normed": (H.used_name(cfg.attn_norm, t, l) if norms[t] else None) for t in TARGETS})
        hooks.update(q_rot=None, k_rot=None, attn_scores=H.act_name("attn_scores", l),
                     pattern=H.act_name("pattern", l), z=H.act_name("z", l))
        # the scale q·k is multiplied by, read off the model's own step (never cfg.attn_scale by hand)
        unit = torch.zeros(1, 1, cfg.n_heads, cfg.d_head, device=model.W_E.device)
        unit[..., 0] = 1.0
        with torch.no_grad():
            scale = float(attn.scores(unit, unit)[0, 0, 0, 0])
        layers.append(LayerAnatomy(
            layer=l, n_heads=cfg.n_heads, n_kv_heads=cfg.n_heads, d_head=cfg.d_head,
            placement=cfg.attn_norm, norms=norms, pre_norm=pre, post_norm=None, hooks=hooks,
            layouts={k: "bphd" for k in ("q", "k", "v", "q_normed", "k_normed", "v_normed")},
            score_scale=scale, scores_hook="pre_softmax",
        ))
    return Anatomy("interp_norm", f"HookedNormTransformer[{cfg.attn_norm}]", tuple(layers))


__all__ = ["NormSpec", "LayerAnatomy", "Anatomy", "identify_norm", "own_anatomy", "TARGETS", "HOOK_KEYS"]
