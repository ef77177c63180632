"""Which nonlinearities an attribution method differentiates through: the norms' scales, the attention patterns.

Attribution linearises the model around the run it differentiates. ``norm="live"`` (the default)
differentiates through every normalisation's scale (the LayerNorm / RMSNorm divisor);
``norm="frozen"`` holds each scale constant in the backward pass (detached), so the gradient
flows through the normalised *direction* only (for LayerNorm, through the centring too), as
circuit-tracer and GIM do. ``pattern="frozen"`` detaches every attention pattern, so the gradient
reaches queries and keys through nothing (their scores are 0) and values through the fixed mixing.

Choice (the paper, Menary et al. 2024 sec. 5, patches exactly and does not linearise): a scale is
frozen at its value *in the run being differentiated* -- the corrupted run, or each integration
point of EAP-IG -- not replaced by the clean run's scale. The forward values (and so the corrupted
baseline) stay those of the model; only the backward changes. Holding the clean run's scale in the
corrupted forward would make the baseline another function's.

On our models the frozen scales are every ``hook_scale`` of ``ln1`` (Pre-Norm), ``ln2`` and
``ln_final``, and the per-head ``hook_{q,k,v}_scale`` of QK-/QKV-Norm: a hook that returns a
different tensor at a norm's ``hook_scale`` is what the norm divides by
(:func:`interp_norm.core.components._unit_by_hooked_scale`). TransformerBridges are refused with a
typed error for now (their norms run inside the Hugging Face modules).
"""

from __future__ import annotations

from typing import Any, Callable

from interp_norm.core.hook_names import act_name
from interp_norm.errors import PatchingError

MODES = ("live", "frozen")


def check_modes(norm: str, pattern: str) -> None:
    """A :class:`PatchingError` unless both modes are ``"live"`` or ``"frozen"``."""
    for what, v in (("norm", norm), ("pattern", pattern)):
        if v not in MODES:
            raise PatchingError(f"{what} must be 'live' or 'frozen', got {v!r}")


def norm_scale_names(model) -> list[str]:
    """Every normalisation scale hook of one of our models, bottom to top."""
    cfg = model.cfg
    names = []
    for l in range(cfg.n_layers):
        if cfg.attn_norm == "pre":
            names.append(act_name("scale", l, "ln1"))
        names += [act_name(f"{t}_scale", l) for t in (cfg.attn_norm if cfg.attn_norm in ("qk", "qkv") else "")]
        names.append(act_name("scale", l, "ln2"))
    return names + [act_name("scale")]


def _detach(act: Any, hook: Any) -> Any:
    return act.detach()


def freeze_hooks(model, norm: str = "live", pattern: str = "live") -> list[tuple[str, Callable]]:
    """Forward hooks that detach the norms' scales (``norm="frozen"``) and the attention patterns
    (``pattern="frozen"``) at their values in the run they fire in. Put them before any hook that
    reads or edits the same activations (a leaf added at ``hook_pattern`` then still gets its gradient).
    Empty for ``live``/``live``: the model runs as without them."""
    from interp_norm.anatomy import kind_of

    check_modes(norm, pattern)
    if norm == pattern == "live":
        return []
    if kind_of(model) != "interp_norm":
        raise PatchingError(
            f"norm={norm!r}, pattern={pattern!r} is implemented for interp_norm's HookedNormTransformer only, "
            "not for a TransformerBridge; use norm='live', pattern='live' on bridges"
        )
    names = norm_scale_names(model) if norm == "frozen" else []
    if pattern == "frozen":
        names += [act_name("pattern", l) for l in range(model.cfg.n_layers)]
    return [(nm, _detach) for nm in names]


def mode_label(norm: str, pattern: str) -> str:
    """``""`` for live/live, else a suffix like ``"+frozen-norm"`` for method names."""
    return "".join(f"+frozen-{w}" for w, v in (("norm", norm), ("pattern", pattern)) if v == "frozen")


__all__ = ["MODES", "check_modes", "freeze_hooks", "norm_scale_names", "mode_label"]
