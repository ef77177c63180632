"""One-kernel stand-ins for a bridge's elementwise modules, for the passes of the attribution re-run.

GPT-2's MLP activation (Hugging Face's ``NewGELUActivation``) is the tanh-approximated GELU written as
eight tensor operations, each a pass over the MLP's hidden activations that the backward keeps; the
bridge's LayerNorm (TransformerLens's normalization bridge) recomputes the norm in Python around its
``hook_scale`` / ``hook_normalized`` points, and its RMSNorm bridge computes those hooks' values and then
runs the Hugging Face module's own Python RMSNorm. Each is one library function --
``F.gelu(approximate="tanh")``, ``F.layer_norm``, ``F.rms_norm`` -- equal to the module up to float
rounding: the same formula, other groupings of the same float operations. On the node-EAP benchmark
these modules were about a quarter of the time left outside the matrix products (docs/benchmarks.md).

A module is replaced only where a probe agrees: its own output on probe inputs equals the candidate's
within the rounding bound of the arithmetic (:func:`_activation_tol`, :func:`_norm_tol`); a module
computing something else (the erf GELU where the tanh one is tried, another epsilon, a bias the
candidate lacks) differs by far more and keeps running. The probe runs once per model and weights
(:func:`~interp_norm.circuits.exact.engine.check_once`'s key). While :func:`fused` is entered each
replaced module's ``forward`` is shadowed on the instance; its ``hook_in`` / ``hook_out`` points still
fire, so hooks there (the residual ``hook_resid_mid`` is a norm's ``hook_in``) see the same tensors;
a module with a hook on any other of its hook points is left alone. Inside :func:`modules_only` every
:func:`fused` runs the modules themselves: for comparing a route with one that never uses the stand-ins
(the edge copies backend) in like arithmetic.
"""

from __future__ import annotations

import math
import weakref
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from interp_norm.anatomy import norm_eps
from interp_norm.circuits.exact.engine import weights_key

#: candidate one-kernel functions for a parameterless activation module, tried in this order
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_erf": F.gelu,
    "silu": F.silu,
    "relu": F.relu,
}
#: probe rows and the scales they are drawn at (small scales make a norm's epsilon visible)
_PROBE_ROWS = 64
_PROBE_SCALES = (1e-3, 1e-2, 1.0, 4.0)


@dataclass(frozen=True)
class Substitute:
    """``module``'s forward is ``forward`` while :func:`fused` is entered (``kind`` names the candidate)."""

    module: torch.nn.Module
    kind: str
    forward: Callable


_MODULES_ONLY: ContextVar[bool] = ContextVar("fused_elementwise_modules_only", default=False)
_PROBED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def substitutes(model, key: Optional[tuple] = None) -> list[Substitute]:
    """The substitutes the probe accepts for ``model``'s blocks and final norm (probed once per weights;
    ``key``: their :func:`~interp_norm.circuits.exact.engine.weights_key`, when the caller has it)."""
    key = weights_key(model) if key is None else key
    hit = _PROBED.get(model)
    if hit is not None and hit[0] == key:
        return hit[1]
    found = probe(model)
    _PROBED[model] = (key, found)
    return found


def probe(model) -> list[Substitute]:
    """Probe every candidate module of ``model`` (see the module docstring); the accepted substitutes."""
    found = []
    ref = next(model.parameters())
    parts = [*getattr(model, "blocks", []), getattr(model, "ln_final", None)]
    seen: set[int] = set()
    for part in parts:
        if not isinstance(part, torch.nn.Module):
            continue
        for m in part.modules():
            if id(m) in seen:
                continue
            seen.add(id(m))
            sub = _norm_substitute(m) if _is_norm_bridge(m) else _activation_substitute(m, ref)
            if sub is not None:
                found.append(sub)
    return found


@contextmanager
def fused(subs: list[Substitute]) -> Iterator[None]:
    """Run the substitutes' modules through their one-kernel forwards (those with no hook inside but
    on ``hook_in`` / ``hook_out``); the modules' own forwards again on exit. Nothing is replaced inside
    :func:`modules_only`."""
    on = [] if _MODULES_ONLY.get() else [s for s in subs if not _hooked_inside(s.module)]
    for s in on:  # the instance's dict: a bridge component forwards attribute writes to the module it wraps
        s.module.__dict__["forward"] = s.forward
    try:
        yield
    finally:
        for s in on:
            s.module.__dict__.pop("forward", None)


@contextmanager
def modules_only() -> Iterator[None]:
    """While entered, :func:`fused` replaces nothing: the attribution passes run the modules' own forwards
    (their arithmetic, rounding for rounding), e.g. to compare the edge one-pass route with the copies
    backend in like arithmetic."""
    token = _MODULES_ONLY.set(True)
    try:
        yield
    finally:
        _MODULES_ONLY.reset(token)


def _hooked_inside(module: torch.nn.Module) -> bool:
    for name, m in module.named_modules():
        if name in ("hook_in", "hook_out") or not hasattr(m, "fwd_hooks"):
            continue
        if getattr(m, "fwd_hooks", None) or getattr(m, "bwd_hooks", None) or m._forward_hooks or m._forward_pre_hooks:
            return True
    return False


# -- activations ---------------------------------------------------------------------------------
def _activation_substitute(m: torch.nn.Module, ref: Tensor) -> Optional[Substitute]:
    """A parameterless leaf module outside ``torch.nn`` (already one kernel there) and not a hook point,
    equal on the probe (in the dtype and on the device of ``ref``, a model parameter) to one of :data:`ACTIVATIONS`."""
    if (next(m.children(), None) is not None or next(m.parameters(), None) is not None
            or next(m.buffers(), None) is not None or type(m).__module__.startswith("torch.")
            or hasattr(m, "fwd_hooks") or hasattr(m, "original_component")):
        return None
    x = _probe_input(None, ref)
    try:
        with torch.no_grad():
            y = m(x)
    except Exception:  # noqa: BLE001 -- not a one-tensor elementwise module: it keeps running
        return None
    if not torch.is_tensor(y) or y.shape != x.shape:
        return None
    tol = _activation_tol(x)
    for kind, fn in ACTIVATIONS.items():
        if bool(((y - fn(x)).abs() <= tol).all()):
            return Substitute(m, kind, fn)
    return None


def _activation_tol(x: Tensor) -> Tensor:
    """Rounding bound of an elementwise activation written as a few float operations, per element: the
    tanh-GELU is 0.5 x (1 + tanh(c (x + a x^3))); its inner argument carries <= 4 roundings (relative),
    which tanh damps by u sech^2(u) <= 0.45, tanh, the sum and the products add one each -- about 5
    unit roundoffs of |x| (2.5 eps |x|) per computation, two computations compared, and one eps of
    slack for the vectorized tanh/exp: 8 eps (|x| + 1) (the ``+ 1`` keeps it positive at 0). The erf and
    tanh GELUs differ by up to ~2e-4 at |x| ~ 2, i.e. 5e2 times this bound in float32."""
    eps = torch.finfo(x.dtype).eps
    return 8 * eps * (x.abs() + 1)


# -- norms ---------------------------------------------------------------------------------------
def _is_norm_bridge(m: torch.nn.Module) -> bool:
    """A bridge component around a norm: hook points ``hook_in`` / ``hook_out`` / ``hook_normalized``."""
    return all(hasattr(m, h) for h in ("hook_in", "hook_out", "hook_normalized")) and hasattr(m, "original_component")


def _norm_candidates(m: Any) -> list[tuple[str, Callable[[Tensor], Tensor]]]:
    """One-kernel norms the bridge component ``m`` may compute: its wrapped module's weight, bias and
    epsilon, as LayerNorm or RMSNorm (the weight as stored, or ``1 + weight`` as Gemma stores it)."""
    oc = m.original_component
    w, b = getattr(oc, "weight", None), getattr(oc, "bias", None)
    if not isinstance(w, torch.Tensor) or w.ndim != 1:
        return []
    eps = norm_eps(oc)
    if eps is None:
        return []
    shape = tuple(w.shape)
    b = b if isinstance(b, torch.Tensor) else None
    return [
        ("layer_norm", lambda x: F.layer_norm(x, shape, w, b, eps)),
        ("rms_norm", lambda x: rms_norm(x, w, eps)),
        ("rms_norm_offset", lambda x: rms_norm(x, 1.0 + w, eps)),
    ]


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """``F.rms_norm(x, w.shape, w, eps)``; where autograd records it, through :class:`_RMSNorm` (the same
    forward operations, a shorter backward)."""
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _RMSNorm.apply(x, w, eps)
    return F.rms_norm(x, tuple(w.shape), w, eps)


class _RMSNorm(torch.autograd.Function):
    """y = w x r with r = (mean(x^2) + eps)^-1/2, forward as ``F.rms_norm`` computes it on CPU (pow, mean,
    rsqrt, two products: the same roundings), backward by hand: dx = r (t - x_hat mean(t x_hat)) with
    t = w g, x_hat = x r; dw = sum of g x_hat. ``F.rms_norm`` is decomposed on CPU and autograd's backward
    through its pieces took 0.90 ms against 0.29 ms for this one on [8, 14, 768] (fwd + bwd)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, eps: float) -> Tensor:
        r = x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
        xh = x * r
        ctx.save_for_backward(xh, r, w)
        return xh * w

    @staticmethod
    def backward(ctx, g: Tensor):
        xh, r, w = ctx.saved_tensors
        gx = gw = None
        if ctx.needs_input_grad[1]:
            gw = (g * xh).reshape(-1, xh.shape[-1]).sum(0)
        if ctx.needs_input_grad[0]:
            t = g * w
            gx = t.sub_(xh * (t * xh).mean(-1, keepdim=True)).mul_(r)
        return gx, gw, None


def _norm_substitute(m: Any) -> Optional[Substitute]:
    cands = _norm_candidates(m)
    if not cands:
        return None
    w = m.original_component.weight
    x = _probe_input(w.shape[0], w)
    try:
        with torch.no_grad():
            y = m(x)
    except Exception:  # noqa: BLE001 -- a norm bridge this probe cannot call keeps running
        return None
    if not torch.is_tensor(y) or y.shape != x.shape:
        return None
    for kind, fn in cands:
        with torch.no_grad():
            want = fn(x)
        if bool(((y - want).abs() <= _norm_tol(x, m)).all()):
            return Substitute(m, kind, _norm_forward(m, fn))
    return None


def _norm_forward(m: Any, fn: Callable[[Tensor], Tensor]) -> Callable:
    def forward(hidden_states: Tensor, **kwargs) -> Tensor:
        return m.hook_out(fn(m.hook_in(hidden_states)))

    return forward


def _norm_tol(x: Tensor, m: Any) -> Tensor:
    """Rounding bound of a norm y = w (x - mean) / sqrt(var + eps) + b of width d, per element: the
    mean and the variance are sums of d terms (cascaded sums: ~log2(d) roundings each, relative to the
    sum of magnitudes), the normalized value carries them and ~4 more (subtract, sqrt or rsqrt, divide,
    scale), the affine map two: (log2(d) + 8) unit roundoffs of |w x_hat| + |b|, two computations
    compared: (log2(d) + 8) eps (|w| (|x_hat| + 1) + |b| + 1), with x_hat = (|x| + |mean|) / std (the
    centring's cancellation included; it bounds the normalized value of either norm). Another epsilon (1e-5 vs 1e-6) shifts the rows the probe draws at
    scale 1e-3 by ~40%."""
    oc = m.original_component
    eps = torch.finfo(x.dtype).eps
    d = x.shape[-1]
    w = oc.weight.detach().abs()
    b = oc.bias.detach().abs() if isinstance(getattr(oc, "bias", None), torch.Tensor) else 0.0
    xf = x.double()
    mean = xf.mean(-1, keepdim=True)
    xhat = ((xf.abs() + mean.abs()) / (xf - mean).pow(2).mean(-1, keepdim=True).sqrt()).to(x.dtype)
    return (math.log2(d) + 8) * eps * (w * (xhat + 1) + b + 1)


def _probe_input(width: Optional[int], like: Tensor) -> Tensor:
    """[rows, width] (width 256 for an activation) of a fixed generator: normal rows at several scales,
    some with a large mean (a norm's centring shows), spanning the activation range up to |x| ~ 16."""
    g = torch.Generator().manual_seed(0)
    n = width or 256
    rows = []
    for s in _PROBE_SCALES:
        z = torch.randn(_PROBE_ROWS // len(_PROBE_SCALES), n, generator=g, dtype=torch.float64)
        rows.append(s * (z + torch.linspace(-1.0, 1.0, len(z), dtype=torch.float64).unsqueeze(1) * 3))
    return torch.cat(rows).to(like.device, like.dtype)


__all__ = ["ACTIVATIONS", "Substitute", "fused", "modules_only", "probe", "rms_norm", "substitutes"]
