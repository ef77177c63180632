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
(:func:`interp_norm.core.components._unit_by_hooked_scale`). On a TransformerBridge they are every
normalisation bridge's ``hook_scale`` (pre- and post-norms, Qwen3's and OLMo-2's q/k norms, the
final norm): TransformerLens 4 rebuilds a norm's output from an edited scale (``x_centred / scale``
times the gain), which is checked once per model by doubling each scale and seeing the logits
move. Norms that have no ``hook_scale`` (Gemma 4's RMSNorms: their scale runs inside the Hugging
Face module) are frozen between the component's ``hook_in`` and ``hook_out``: the output keeps its
value and its gradient is ``g * w / s`` with ``s`` the detached RMS of the input (``y.detach() + (x -
x.detach()) * w / s``), after checking once per model that each such norm computes ``x * w / s``
and that its ``hook_out`` reaches the logits. Gemma 4's ``per_layer_projection_norm``, which the
bridge does not wrap, stays live: it reads only the embedding, so no node after it sees its
gradient. Other norms without ``hook_scale`` are refused with a typed error, and so are frozen
patterns where a ``hook_pattern`` edit does not reach the logits.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor

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


def freeze_hooks(model, norm: str = "live", pattern: str = "live", tokens: Optional[Tensor] = None) -> list[tuple[str, Callable]]:
    """Forward hooks that detach the norms' scales (``norm="frozen"``) and the attention patterns
    (``pattern="frozen"``) at their values in the run they fire in. Put them before any hook that
    reads or edits the same activations (a leaf added at ``hook_pattern`` then still gets its gradient).
    Empty for ``live``/``live``: the model runs as without them. On a TransformerBridge ``tokens``
    (a few input rows) are needed for the once-per-model checks that the edits take effect."""
    from interp_norm.anatomy import capabilities

    check_modes(norm, pattern)
    if norm == pattern == "live":
        return []
    ours = capabilities(model).full_vocabulary  # every norm's hook_scale and hook_pattern fire as computed
    if not ours and tokens is None:
        raise PatchingError("freezing norms or patterns on a TransformerBridge needs tokens to check the hooks with")
    names = []
    hooks: list[tuple[str, Callable]] = []
    if norm == "frozen":
        if ours:
            names = norm_scale_names(model)
        elif _scale_hooks(model):
            names = _bridge_scale_names(model, tokens)  # type: ignore[arg-type]  # not None: checked above
        else:
            hooks = _rms_freezers(model, tokens)  # type: ignore[arg-type]
    if pattern == "frozen":
        pats = [act_name("pattern", l) for l in range(model.cfg.n_layers)]
        if not ours:
            from interp_norm.circuits.exact.patch_cells import check_hooks, check_pattern_hooks_act

            check_hooks(model, pats)
            check_pattern_hooks_act(model, tokens, pats)  # type: ignore[arg-type]  # not None: checked above
        names += pats
    return hooks + [(nm, _detach) for nm in names]


def _scale_hooks(model) -> list[str]:
    suffix = "." + act_name("scale").rsplit(".", 1)[-1]
    return [nm for nm in getattr(model, "hook_dict", {}) if nm.endswith(suffix) or nm == act_name("scale")]


def _bridge_scale_names(model, tokens: Tensor) -> list[str]:
    """Every normalisation ``hook_scale`` of a bridge, each checked once to reach the logits when edited."""
    from interp_norm.circuits.exact.engine import check_once

    names = _scale_hooks(model)

    def check() -> None:
        probe = tokens[:1, : min(tokens.shape[1], 4)]
        with torch.no_grad(), quiet():
            base = model(probe)
            for nm in names:
                with model.hooks(fwd_hooks=[(nm, _double)]):
                    if torch.equal(model(probe), base):
                        raise PatchingError(f"editing {nm!r} does not change this bridge's output, so its norm cannot "
                                            "be frozen there; use norm='live'")

    check_once(model, ("norm scales take effect", tuple(names)), check)
    return names


def _rms_norms(model) -> list[tuple[str, str, Any]]:
    """(hook_in name, hook_out name, Hugging Face module) of every RMSNorm component of a bridge."""
    out = []
    for m in model.modules():
        hf = getattr(m, "original_component", None)
        hin, hout = getattr(m, "hook_in", None), getattr(m, "hook_out", None)
        if type(hf).__name__.endswith("RMSNorm") and hasattr(hf, "variance_epsilon") and hin is not None and hout is not None:
            out.append((hin.name, hout.name, hf))
    return out


def _gain_over_scale(hf: Any, x: Tensor) -> Tensor:
    """``w / s`` of an RMSNorm ``x * w / s``, ``s = sqrt(mean(x^2) + eps)`` over the last axis (float32 or wider)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    inv = (xf.pow(2).mean(-1, keepdim=True) + hf.variance_epsilon).pow(-0.5)
    w = getattr(hf, "weight", None) if getattr(hf, "with_scale", True) else None
    return inv if w is None else inv * w.detach().to(xf.dtype)


def _rms_freezers(model, tokens: Tensor) -> list[tuple[str, Callable]]:
    """Hooks freezing the scale of every RMSNorm component without ``hook_scale``, each checked once
    to compute ``x * w / s`` and to reach the logits when its output is edited."""
    from interp_norm.circuits.exact.engine import check_once

    norms = _rms_norms(model)
    if not norms:
        raise PatchingError("this bridge's norms have neither a hook_scale nor an RMSNorm component with hook_in and "
                            "hook_out to freeze them at; use norm='live'")
    seen: dict[str, Tensor] = {}
    grabs: dict[str, Any] = {}

    def keep(act: Tensor, hook: Any, nm: str, hf: Any) -> Tensor:
        """Read the input the norm module is called with, not ``act``: a hook added after this one at
        ``hook_in`` (an edge receiver's shift at a bridge's ``hook_resid_mid``) may replace it."""
        def grab(module: Any, args: tuple) -> None:
            seen[nm] = args[0]
            grabs.pop(nm).remove()

        if nm in grabs:  # a pass that stopped between hook_in and the norm
            grabs.pop(nm).remove()
        grabs[nm] = hf.register_forward_pre_hook(grab)
        return act

    def freeze(act: Tensor, hook: Any, nm: str, hf: Any) -> Tensor:
        x = seen.pop(nm)
        ratio = _gain_over_scale(hf, x.detach())
        return act.detach() + ((x - x.detach()) * ratio).to(act.dtype)

    check_once(model, ("rms norms freeze", tuple(n for n, _, _ in norms)), lambda: _check_rms(model, tokens, norms))
    hooks: list[tuple[str, Callable]] = []
    for hin, hout, hf in norms:
        hooks += [(hin, partial(keep, nm=hin, hf=hf)), (hout, partial(freeze, nm=hin, hf=hf))]
    return hooks


def _check_rms(model, tokens: Tensor, norms: list) -> None:
    """Each norm's output is ``x * w / s`` of its input (to float32 rounding) and editing it moves the logits."""
    probe = tokens[:1, : min(tokens.shape[1], 4)]
    got: dict[str, Tensor] = {}

    def rec(act: Tensor, hook: Any, nm: str) -> None:
        got[nm] = act.detach().clone()

    with torch.no_grad():
        base = model.run_with_hooks(probe, fwd_hooks=[(nm, partial(rec, nm=nm)) for hin, hout, _ in norms for nm in (hin, hout)])
        for hin, hout, hf in norms:
            x, y = got.get(hin), got.get(hout)
            if x is None or y is None or x.shape != y.shape:
                raise PatchingError(f"{hout!r} does not hold the output of the norm whose input {hin!r} holds; "
                                    "its scale cannot be frozen -- use norm='live'")
            want = x.to(torch.float32) * _gain_over_scale(hf, x)
            if float((want - y.float()).abs().max()) > 64 * torch.finfo(torch.float32).eps * (float(want.abs().max()) + 1):
                raise PatchingError(f"the norm at {hout!r} does not compute x * w / sqrt(mean(x^2) + eps); "
                                    "its scale cannot be frozen -- use norm='live'")
            with model.hooks(fwd_hooks=[(hout, _double)]):
                if torch.equal(model(probe), base):
                    raise PatchingError(f"editing {hout!r} does not change this bridge's output, so its norm cannot "
                                        "be frozen there; use norm='live'")


def _double(act: Tensor, hook: Any) -> Tensor:
    return act * 2


@contextmanager
def quiet() -> Iterator[None]:
    """TransformerLens 4 warns on every call that an edited ``hook_scale`` rebuilds the norm's output
    (rounding-level differences from the Hugging Face kernel): that rebuilding is the point here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="A forward hook edited hook_scale")
        yield


def mode_label(norm: str, pattern: str) -> str:
    """``""`` for live/live, else a suffix like ``"+frozen-norm"`` for method names."""
    return "".join(f"+frozen-{w}" for w, v in (("norm", norm), ("pattern", pattern)) if v == "frozen")


__all__ = ["MODES", "check_modes", "freeze_hooks", "norm_scale_names", "mode_label", "quiet"]
