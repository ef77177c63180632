"""The one hook vocabulary: every hook name (shared constants live in :mod:`interp_norm.core.defaults`).

Analyses never spell ``f"blocks.{l}..."`` themselves: they ask :func:`act_name` (TransformerLens's
``get_act_name`` extended with our attention-norm hooks), and the q/k/v that the attention scores
and values *actually use* come from :func:`used_name`, the single place that knows where the
per-head norms sit. ``tests/test_architecture.py`` greps the package for hand-built names.

Names (HookedTransformer's, plus the QK/QKV-Norm ones)::

    act_name("resid_pre", 2)  -> "blocks.2.hook_resid_pre"
    act_name("q", 0)          -> "blocks.0.attn.hook_q"          (right after W_Q, before any norm)
    act_name("q_normed", 0)   -> "blocks.0.attn.hook_q_normed"   (after QK/QKV-Norm)
    act_name("scale", 1, "ln1") -> "blocks.1.ln1.hook_scale"
    act_name("scale")         -> "ln_final.hook_scale"
"""

from __future__ import annotations

from typing import Optional

from transformer_lens.utilities import get_act_name

from interp_norm.errors import HookNameError

# Per-head norm hooks live on the attention module: blocks.{l}.attn.hook_{q,k,v}_{normed,scale}.
_HEAD_NORM_KINDS = tuple(f"{t}_{s}" for t in "qkv" for s in ("normed", "scale"))
_BLOCK_KINDS = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "q_input", "k_input", "v_input")
_ATTN_KINDS = ("q", "k", "v", "z", "pattern", "attn_scores", "result")
_MLP_KINDS = ("pre", "post")
_NORMS = ("ln1", "ln2")
#: Activations a patching experiment can target, with the axis kind of their cells.
PATCHABLE: dict[str, str] = {
    "resid_pre": "resid", "resid_mid": "resid", "resid_post": "resid", "attn_out": "resid", "mlp_out": "resid",
    "z": "head", "q": "head", "k": "head", "v": "head", "pattern": "pattern",
}


def act_name(kind: str, layer: Optional[int] = None, sub: Optional[str] = None) -> str:
    """Full hook name of activation ``kind`` in ``layer`` (``sub``: ``"ln1"``/``"ln2"`` for norm hooks).

    Raises :class:`HookNameError` for a kind this vocabulary does not know, naming the known ones.
    """
    if kind in ("embed", "pos_embed") and layer is None:
        return f"hook_{kind}"
    if kind in ("scale", "normalized"):
        if layer is None:
            return get_act_name(kind)
        if sub not in _NORMS:
            raise HookNameError(f"act_name({kind!r}, {layer}) needs sub='ln1' or 'ln2' (which norm of the block)")
        return get_act_name(kind, layer, sub)
    if layer is None:
        raise HookNameError(f"act_name({kind!r}) needs a layer: blocks.{{layer}} hooks exist once per block")
    if kind in _HEAD_NORM_KINDS:
        return f"{get_act_name('z', layer).rsplit('.', 1)[0]}.hook_{kind}"
    if kind in _BLOCK_KINDS or kind in _ATTN_KINDS or kind in _MLP_KINDS:
        return get_act_name(kind, layer)
    known = ("embed", "pos_embed", "scale", "normalized") + _BLOCK_KINDS + _ATTN_KINDS + _MLP_KINDS + _HEAD_NORM_KINDS
    raise HookNameError(f"unknown activation kind {kind!r}; choose one of {list(known)}")


def norm_name(layer: Optional[int], which: str = "ln1") -> str:
    """Module path of a residual-stream norm: ``blocks.{l}.ln1`` / ``blocks.{l}.ln2``, or ``ln_final``."""
    return act_name("scale", layer, which).rsplit(".", 1)[0]


# ----------------------------------------------------------------------------- where the norms sit


def normalised_targets(attn_norm: str) -> tuple[str, ...]:
    """Which of q, k, v pass through a per-head norm after their projection."""
    return {"qkv": ("q", "k", "v"), "qk": ("q", "k")}.get(attn_norm, ())


def is_normalised(attn_norm: str, target: str) -> bool:
    """Whether a per-head norm sits between ``W_{target}`` and the scores/values."""
    return target in normalised_targets(attn_norm)


def used_name(attn_norm: str, target: str, layer: int) -> str:
    """The hook holding the q/k/v that the attention actually uses (after its norm, if it has one)."""
    if target not in ("q", "k", "v"):
        raise HookNameError(f"target must be 'q', 'k' or 'v', got {target!r}")
    return act_name(f"{target}_normed" if is_normalised(attn_norm, target) else target, layer)


def noise_site(attn_norm: str, target: str, layer: int, placement: str = "before_norm") -> str:
    """Where multiplicative norm noise on ``target`` enters: before the per-head norm (the raw
    projection, the paper's setting) or after it (what the scores use). ``target="scale"`` is the
    Pre-Norm's shared ``ln1`` scale."""
    if target == "scale":
        return act_name("scale", layer, "ln1")
    if placement == "after_norm":
        return used_name(attn_norm, target, layer)
    return act_name(target, layer)


__all__ = [
    "PATCHABLE",
    "act_name", "norm_name", "normalised_targets", "is_normalised", "used_name", "noise_site",
]
