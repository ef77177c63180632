"""Geometry on a TransformerLens 4 ``TransformerBridge`` (GPT-2, Llama, Qwen3, OLMo-2, Gemma 4 ...).

The analyses of this package read our model's hooks and weight steps; a bridge has neither, so this
module finds what they need from :func:`interp_norm.anatomy.anatomy` and the bridge's module tree:

* every **norm** of the model (residual Pre/Post-Norms, the final norm, and the attention q/k/v norms:
  Qwen3's per-head RMSNorm, OLMo-2's RMSNorm over all heads, Gemma 4's gainless v-norm, GPT-2's
  LayerNorms), each with the ``hook_in``/``hook_out`` HookPoints of its bridge component. A module is
  a norm when it *computes* one (:func:`~interp_norm.anatomy.identify_norm`), not by its class name;
  its effective gain and bias are fitted from what it computes (so Gemma-2-style ``1 + w`` gains are
  read right), and its ellipsoid (Riechers 2024) is :func:`~interp_norm.geometry.norm_ellipsoid`.
* the **attention pattern** from the anatomy's ``pattern`` hook, which the anatomy verified equals
  softmax of the scores rebuilt from q and k (never ``hook_attn_scores``: on Gemma 4 it is not what
  its name says);
* the **residual stream** each attention layer reads (the block's ``hook_resid_pre``).

Hook names are read from ``HookPoint.name`` of the module tree; none is spelled here. Positions are
all real tokens (no padding in text windows); ``exclude_bos`` drops position 0, as for our models.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

import pandas as pd
import torch
from torch import Tensor, nn

from interp_norm.errors import GeometryError
from interp_norm.geometry._common import TINY
from interp_norm.geometry.norm_image import NormEllipsoid, norm_ellipsoid

__all__ = [
    "BridgeNorm", "bridge_norms", "bridge_tokens", "bridge_pattern_hooks", "bridge_resid_hooks",
    "bridge_ellipsoid_table", "bridge_ellipsoid_axes", "bridge_ellipsoid_membership", "position_mask",
    "membership_rows", "membership_summary", "membership_table",
]


def _hook_name(component: Any, attr: str) -> Optional[str]:
    """The name of the HookPoint ``component.<attr>`` (aliases resolve), or None."""
    from transformer_lens.hook_points import HookPoint

    try:
        hp = getattr(component, attr)
    except AttributeError:
        return None
    return hp.name if isinstance(hp, HookPoint) and isinstance(hp.name, str) else None


@dataclass(frozen=True, eq=False)
class BridgeNorm:
    """One normalisation of a bridge: where it sits (``layer`` None outside the blocks), its ``role``
    ("q_norm"/"k_norm"/"v_norm" for attention norms, "residual" otherwise), what it computes
    (``kind``, ``axis``, ``eps``), its fitted ``ellipsoid`` and the hooks holding its input/output.

    A norm the bridge does not wrap in a component (Gemma 4's ``per_layer_projection_norm``) has
    ``hook_in``/``hook_out`` None and is named by its HF path; its input and output are read with a
    torch forward hook on ``module``."""

    name: str
    layer: Optional[int]
    role: str
    kind: str
    axis: str
    eps: float
    ellipsoid: NormEllipsoid
    hook_in: Optional[str]
    hook_out: Optional[str]
    module: Optional[nn.Module] = None

    @property
    def dim(self) -> int:
        return self.ellipsoid.dim


@torch.no_grad()
def _fit_affine(module: nn.Module, dim: int, kind: str, eps: float, bias: bool) -> tuple[Tensor, Optional[Tensor]]:
    """Effective gain (and bias) per column: least squares of the module's output on x̂ (and 1).

    Exact up to float rounding for any module :func:`identify_norm` accepted; reading what the
    module computes instead of its ``weight`` catches ``(1 + w)`` gains and scale-free norms alike.
    """
    p = next(iter(module.parameters()), None)
    dtype = p.dtype if p is not None and p.is_floating_point() else torch.float32
    device = p.device if p is not None else "cpu"
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, dim, generator=g) * 2 + torch.randn(1, dim, generator=g)).double()
    y = module(x.to(dtype=dtype, device=device)).to("cpu", torch.float64)
    xc = x - x.mean(-1, keepdim=True) if kind == "ln" else x
    xhat = xc / (xc.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    if not bias:
        return (xhat * y).sum(0) / (xhat * xhat).sum(0), None
    A = torch.stack([xhat, torch.ones_like(xhat)], -1).permute(1, 0, 2)  # [dim, rows, 2]
    sol = torch.linalg.lstsq(A, y.T.unsqueeze(-1)).solution[..., 0]
    return sol[:, 0], sol[:, 1]


def bridge_norms(model: Any) -> list[BridgeNorm]:
    """Every norm of the bridge, in module order (see the module docstring).

    The attention norms are the anatomy's (their axis per head or over all heads, gainless ones
    included); any other bridge component whose HF module has only vector parameters and computes an
    RMS/LayerNorm over them is a residual norm. Raises :class:`GeometryError` if a norm has no
    ``hook_in``/``hook_out``.
    """
    from interp_norm.anatomy import anatomy, identify_norm, original, wrapped

    anat = anatomy(model)
    attn_norms: dict[int, tuple] = {}
    for la in anat.layers:  # a KV-sharing layer's k/v norms are its source layer's (met first)
        for t, spec in la.norms.items():
            if spec is not None:
                comp = model.get_submodule(spec.module)
                attn_norms.setdefault(id(original(comp)), (la.layer, t, spec, la))
    layer_of: dict[int, int] = {}
    for l, block in enumerate(model.blocks):
        for _, m in block.named_modules():
            layer_of.setdefault(id(m), l)
    out: list[BridgeNorm] = []
    seen: set[int] = set()
    for path, comp in model.named_modules():
        orig = wrapped(comp)
        if orig is None or id(orig) in seen:
            continue
        if id(orig) in attn_norms:
            l, t, spec, la = attn_norms[id(orig)]
            dim = la.d_head if spec.axis == "per_head" else la.n_heads_of(t) * la.d_head
            role, kind, axis, eps, has_bias = f"{t}_norm", spec.kind, spec.axis, spec.eps, spec.bias
        else:
            params = list(orig.parameters())
            if not params or any(p.ndim != 1 for p in params) or len({p.numel() for p in params}) != 1:
                continue
            dim = params[0].numel()
            try:
                spec = identify_norm(orig, dim, path, "residual")
            except Exception:
                continue
            l, role, kind, axis, eps, has_bias = layer_of.get(id(comp)), "residual", spec.kind, spec.axis, spec.eps, spec.bias
        seen.add(id(orig))
        hin, hout = _hook_name(comp, "hook_in"), _hook_name(comp, "hook_out")
        if hin is None or hout is None:
            raise GeometryError(f"norm {path!r} has no hook_in/hook_out HookPoint; its outputs cannot be checked")
        gain, bias = _fit_affine(orig, dim, kind, eps, has_bias)
        out.append(BridgeNorm(name=hin.rsplit(".", 1)[0], layer=l, role=role, kind=kind, axis=axis, eps=eps,
                              ellipsoid=norm_ellipsoid(gain, bias, kind), hook_in=hin, hook_out=hout, module=orig))
    hf = getattr(model, "original_model", None)
    for path, m in (hf.named_modules() if isinstance(hf, nn.Module) else ()):
        if id(m) in seen or wrapped(m) is not None or not isinstance(m, nn.Module):
            continue
        params = list(m.parameters())
        if not params or any(p.ndim != 1 for p in params) or len({p.numel() for p in params}) != 1:
            continue
        try:
            spec = identify_norm(m, params[0].numel(), path, "residual")
        except Exception:
            continue
        seen.add(id(m))
        gain, bias = _fit_affine(m, params[0].numel(), spec.kind, spec.eps, spec.bias)
        out.append(BridgeNorm(name=path.replace("._original_component", ""), layer=None, role="unhooked",
                              kind=spec.kind, axis="other", eps=spec.eps, ellipsoid=norm_ellipsoid(gain, bias, spec.kind),
                              hook_in=None, hook_out=None, module=m))
    return out


def bridge_tokens(model: Any, n: int = 8, n_ctx: int = 32, seed: int = 0) -> Tensor:
    """Input for a text model: ``n`` windows of the shipped sample text if the bridge has a
    tokenizer, else seeded random ordinary token ids (tiny models built from a config have none),
    with a warning saying so: numbers measured on random ids describe no text."""
    from interp_norm.anatomy import random_tokens, text_tokens
    from interp_norm.anatomy.bridge_anatomy import probe_tokens

    name = getattr(getattr(model, "cfg", None), "model_name", None) or "this model"
    if getattr(model, "tokenizer", None) is not None:
        try:
            return text_tokens(model, n_ctx=n_ctx, max_windows=n)
        except Exception as e:  # noqa: BLE001 - any tokenizer failure: say it, then fall back
            why = f"its tokenizer failed on the sample text ({e})"
    else:
        why = ("it has no tokenizer (none was saved beside the weights: copy tokenizer.json / "
               "tokenizer_config.json into the model folder to measure text instead)")
    warnings.warn(f"{name!r}: analysing {n} windows of seeded random token ids, not text, because {why}",
                  stacklevel=3)
    try:
        return probe_tokens(model, n, n_ctx, seed)
    except Exception:
        return random_tokens(model, n, n_ctx, seed)


def bridge_pattern_hooks(model: Any) -> list[str]:
    """The verified attention-pattern hook of every layer (from the anatomy)."""
    from interp_norm.anatomy import anatomy

    return [la.hooks["pattern"] for la in anatomy(model).layers]


def bridge_resid_hooks(model: Any) -> list[str]:
    """The residual stream each block reads (``hook_resid_pre``), per layer."""
    names = [_hook_name(block, "hook_resid_pre") for block in model.blocks]
    if any(n is None for n in names):
        raise GeometryError("the bridge's blocks have no hook_resid_pre; cannot measure the residual norms")
    return names  # type: ignore[return-value]


def position_mask(tokens: Tensor, exclude_bos: bool) -> Tensor:
    """True at every position of text windows, except position 0 with ``exclude_bos``."""
    m = torch.ones(tokens.shape, dtype=torch.bool, device=tokens.device)
    if exclude_bos:
        m[:, 0] = False
    return m


def bridge_ellipsoid_table(model: Any, norms: Optional[list[BridgeNorm]] = None) -> pd.DataFrame:
    """:func:`~interp_norm.geometry.ellipsoid_table` for a bridge: one row per norm."""
    import math

    rows = []
    for nm in norms if norms is not None else bridge_norms(model):
        e, s = nm.ellipsoid, nm.ellipsoid.semi_axes
        ones = torch.full((e.dim,), 1.0 / math.sqrt(e.dim), dtype=torch.float64)
        rows.append(dict(module=nm.name, layer=nm.layer, role=nm.role, axis=nm.axis, gain_row="all", kind=e.kind,
                         N=e.dim, n_axes=int(s.numel()), max_semi_axis=float(s.max()), min_semi_axis=float(s.min()),
                         median_semi_axis=float(s.median()), axis_ratio=float(s.max() / s.min()),
                         normal_cos_ones=float((e.normal @ ones).abs()) if e.normal is not None else float("nan"),
                         center_norm=float(e.center.norm()), radius_at_unit_gain=math.sqrt(e.dim)))
    df = pd.DataFrame(rows)
    if len(df):
        df["layer"] = df["layer"].astype("Int64")
    return df


def bridge_ellipsoid_axes(model: Any, norms: Optional[list[BridgeNorm]] = None) -> pd.DataFrame:
    """Every semi-axis length of every norm (module, role, axis index, semi_axis)."""
    rows = [dict(module=nm.name, role=nm.role, gain_row="all", axis=a, semi_axis=s)
            for nm in (norms if norms is not None else bridge_norms(model))
            for a, s in enumerate(nm.ellipsoid.semi_axes.tolist())]
    return pd.DataFrame(rows)


def bridge_ellipsoid_membership(model: Any, tokens: Tensor, *, cache=None,
                                norms: Optional[list[BridgeNorm]] = None) -> pd.DataFrame:
    """Every norm's outputs checked against its ellipsoid: membership zᵀQz/N must equal
    σ²/(σ²+ε) = 1 − ε/(σ²+ε), with σ² of the norm's *input* (mean square for RMSNorm, variance for
    LayerNorm) read from ``hook_in`` — an independent route to the same number. ``max_abs_err`` is
    the check; ``max_plane_residual`` (LayerNorm) the distance from the hyperplane relative to |y − b|.
    Norms that do not fire on this input (none on the shipped architectures) get ``n`` = 0.
    """
    norms = norms if norms is not None else bridge_norms(model)
    wanted = {h for nm in norms for h in (nm.hook_in, nm.hook_out) if h is not None}
    unhooked = [nm for nm in norms if nm.hook_in is None]
    seen: dict[str, tuple[Tensor, Tensor]] = {}
    handles = []
    for nm in unhooked:
        def keep(mod, args, out, name=nm.name):
            seen[name] = (args[0].detach(), out.detach())
        handles.append(nm.module.register_forward_hook(keep))
    try:
        with torch.no_grad():
            if cache is None or not all(h in cache for h in wanted):
                _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in wanted)
            elif unhooked:
                model(tokens)
    finally:
        for h in handles:
            h.remove()
    parts = {}
    for nm in norms:
        if nm.hook_in is None:
            pair = seen.get(nm.name)
        elif nm.hook_in in cache and nm.hook_out in cache:
            pair = (cache[nm.hook_in], cache[nm.hook_out])
        else:
            pair = None
        if pair is not None:
            parts[nm.name] = [membership_rows(nm, *pair)]
    return membership_table(norms, parts)


def membership_table(norms: list[BridgeNorm], parts: dict[str, list]) -> pd.DataFrame:
    """The table of :func:`bridge_ellipsoid_membership` from each norm's :func:`membership_rows` of its
    blocks of windows (``parts`` by norm name; a norm without parts did not fire: ``n`` = 0)."""
    rows = []
    for nm in norms:
        row = dict(module=nm.name, layer=nm.layer, role=nm.role, axis=nm.axis, gain_row="all", kind=nm.kind,
                   N=nm.dim, eps=nm.eps)
        rows.append(membership_summary(nm, row, parts[nm.name]) if parts.get(nm.name) else dict(row, n=0))
    df = pd.DataFrame(rows)
    df["layer"] = df["layer"].astype("Int64")
    return df


def membership_rows(nm: BridgeNorm, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per normalised vector of ``nm`` (input ``x``, output ``y``, any leading shape): membership zᵀQz/N,
    its prediction σ²/(σ²+ε) and the plane residual relative to |y − b| (float64, row order of
    ``reshape(-1, N)``): the small per-row inputs of :func:`bridge_ellipsoid_membership`."""
    x, y = x.double(), y.double()
    if x.shape[-1] != nm.dim or y.shape[-1] != nm.dim:
        raise GeometryError(f"{nm.name}: hook tensors {tuple(x.shape)} / {tuple(y.shape)} do not end in the "
                            f"norm's dimension {nm.dim}")
    x, y = x.reshape(-1, nm.dim), y.reshape(-1, nm.dim)
    xc = x - x.mean(-1, keepdim=True) if nm.kind == "ln" else x
    var = xc.pow(2).mean(-1)
    pred = var / (var + nm.eps)
    m = nm.ellipsoid.membership(y)
    z = (y - nm.ellipsoid.center).norm(dim=-1).clamp_min(TINY)
    return m, pred, nm.ellipsoid.plane_residual(y).abs() / z


def membership_summary(nm: BridgeNorm, row: dict, parts: list[tuple[Tensor, Tensor, Tensor]]) -> dict:
    """One row of :func:`bridge_ellipsoid_membership` from :func:`membership_rows` of blocks of windows
    (concatenated in order: the statistics of one pass)."""
    m, pred, plane = (torch.cat([p[i] for p in parts]) for i in range(3))
    return dict(row, n=int(m.numel()), membership_mean=float(m.mean()), membership_min=float(m.min()),
                membership_max=float(m.max()), predicted_mean=float(pred.mean()),
                max_abs_err=float((m - pred).abs().max()), max_plane_residual=float(plane.max()))
