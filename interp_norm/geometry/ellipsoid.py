"""The image of a LayerNorm/RMSNorm: a hyperellipsoid (Riechers 2024).

A LayerNorm with gain g and bias b maps every input onto an (N−1)-dim ellipsoid in a tilted
hyperplane; RMSNorm onto an N-dim one. This computes its axes from the weights and checks cached
norm outputs against it (a test of both the formula and the model's hooks).
"""

from __future__ import annotations

import math
from typing import Optional

import pandas as pd
import torch

from interp_norm.errors import ConfigError
from interp_norm.geometry._common import TINY, TokensLike, as_tokens, check_model, run_cached, valid_mask
from interp_norm.geometry.norm_image import NormEllipsoid, norm_ellipsoid
from interp_norm.core.hook_names import act_name, norm_name
from interp_norm.core.model import HookedNormTransformer, Norm

__all__ = [
    "NormEllipsoid", "norm_ellipsoid", "norm_modules", "module_ellipsoids", "norm_hook_names",
    "ellipsoid_table", "ellipsoid_axes", "ellipsoid_membership",
]


def _norm_sites(model: HookedNormTransformer) -> list[tuple[Optional[int], Optional[str], Norm]]:
    """(layer, which, module) of every residual-stream norm, in forward order (layer None: ln_final)."""
    sites: list[tuple[Optional[int], Optional[str], Norm]] = []
    for l, block in enumerate(model.blocks):
        if hasattr(block, "ln1"):
            sites.append((l, "ln1", block.ln1))
        sites.append((l, "ln2", block.ln2))
    sites.append((None, None, model.ln_final))
    return sites


def norm_modules(model: HookedNormTransformer) -> dict[str, Norm]:
    """Every residual-stream norm by module path: each block's ``ln1`` (Pre-Norm only) and ``ln2``, then ``ln_final``."""
    return {norm_name(l, w): mod for l, w, mod in _norm_sites(model)}


def norm_hook_names(model: HookedNormTransformer) -> list[str]:
    """``hook_normalized`` and ``hook_scale`` of every norm in :func:`norm_modules` (what
    :func:`ellipsoid_membership` reads)."""
    return [act_name(kind, l, w) for l, w, _ in _norm_sites(model) for kind in ("normalized", "scale")]


def module_ellipsoids(module: Norm) -> list[NormEllipsoid]:
    """One ellipsoid per gain row (the Pre-Norm ``ln1`` has separate q/k/v gains on one shared scale)."""
    if not isinstance(module, Norm):
        raise ConfigError(f"expected an interp_norm Norm module, got {type(module).__name__}")
    w = module.w.detach()
    rows = [w[i] for i in range(w.shape[0])] if w.ndim == 2 else [w]
    b = module.b.detach() if module.b is not None else None
    return [norm_ellipsoid(r, b, module.kind) for r in rows]


_GAIN_ROW_NAMES = {3: ("q", "k", "v")}


def _row_name(n_rows: int, i: int) -> str:
    return _GAIN_ROW_NAMES.get(n_rows, tuple(str(j) for j in range(n_rows)))[i] if n_rows > 1 else "all"


def ellipsoid_table(model: HookedNormTransformer) -> pd.DataFrame:
    """One row per norm module and gain row: kind, N, semi-axis range, axis ratio, tilt of the
    hyperplane (``normal_cos_ones`` = |α̂·1̂|, 1 for equal gains) and |b|. On a ``TransformerBridge``:
    every norm, attention q/k/v norms included (:func:`~interp_norm.geometry.bridge.bridge_norms`)."""
    from interp_norm.anatomy import kind_of
    from interp_norm.geometry.bridge import bridge_ellipsoid_table

    if kind_of(model) == "bridge":
        return bridge_ellipsoid_table(model)
    check_model(model)
    rows = []
    for name, mod in norm_modules(model).items():
        ells = module_ellipsoids(mod)
        for i, e in enumerate(ells):
            s = e.semi_axes
            ones = torch.full((e.dim,), 1.0 / math.sqrt(e.dim), dtype=torch.float64)
            rows.append(dict(module=name, gain_row=_row_name(len(ells), i), kind=e.kind, N=e.dim,
                             n_axes=int(s.numel()), max_semi_axis=float(s.max()), min_semi_axis=float(s.min()),
                             median_semi_axis=float(s.median()), axis_ratio=float(s.max() / s.min()),
                             normal_cos_ones=float((e.normal @ ones).abs()) if e.normal is not None else float("nan"),
                             center_norm=float(e.center.norm()), radius_at_unit_gain=math.sqrt(e.dim)))
    return pd.DataFrame(rows)


def ellipsoid_axes(model: HookedNormTransformer) -> pd.DataFrame:
    """Long table of every semi-axis length (module, gain_row, axis, semi_axis) for spectrum plots."""
    from interp_norm.anatomy import kind_of
    from interp_norm.geometry.bridge import bridge_ellipsoid_axes

    if kind_of(model) == "bridge":
        return bridge_ellipsoid_axes(model)
    rows = []
    for name, mod in norm_modules(model).items():
        ells = module_ellipsoids(mod)
        for i, e in enumerate(ells):
            for a, s in enumerate(e.semi_axes.tolist()):
                rows.append(dict(module=name, gain_row=_row_name(len(ells), i), axis=a, semi_axis=s))
    return pd.DataFrame(rows)


def ellipsoid_membership(
    model: HookedNormTransformer, tokens: TokensLike, *, exclude_bos: bool = False, cache=None
) -> pd.DataFrame:
    """Check cached norm outputs against the ellipsoid: membership must equal 1 − ε/scale² < 1.

    Uses each norm's ``hook_normalized`` (full output after gain and bias; for the Pre-Norm ``ln1`` with
    separate gains it is the pre-gain vector, so each gain row is applied here) and ``hook_scale``
    = √(σ²+ε). Per module and gain row: membership statistics, the predicted value's statistics,
    the largest |membership − predicted| and the largest |plane residual| relative to |y − b|.
    ``max_abs_err`` is the check (≈ 3e-7 from float32 activations): when σ² ≫ ε the membership is
    within that rounding of 1, so ``membership_max`` can print as 1.0000001. On a
    ``TransformerBridge`` every norm is checked the same way, σ² read from its input
    (:func:`~interp_norm.geometry.bridge.bridge_ellipsoid_membership`).
    """
    from interp_norm.anatomy import kind_of
    from interp_norm.geometry.bridge import bridge_ellipsoid_membership

    if kind_of(model) == "bridge":
        return bridge_ellipsoid_membership(model, as_tokens(model, tokens), cache=cache)
    check_model(model)
    tokens = as_tokens(model, tokens)
    cache = run_cached(model, tokens, norm_hook_names(model), cache)
    mask = valid_mask(tokens, exclude_bos)
    rows = []
    for l, which, mod in _norm_sites(model):
        out = cache[act_name("normalized", l, which)].double()[mask]
        scale = cache[act_name("scale", l, which)].double()[mask][..., 0]
        pred = 1.0 - mod.eps / scale**2
        ells = module_ellipsoids(mod)
        separate = mod.n_gains > 1
        for i, e in enumerate(ells):
            y = out * e.gain if separate else out  # separate gains: hook_normalized is before the gains
            m = e.membership(y)
            z = (y - e.center).norm(dim=-1).clamp_min(TINY)
            rows.append(dict(module=norm_name(l, which), gain_row=_row_name(len(ells), i), kind=e.kind,
                             n=int(m.numel()), eps=mod.eps, membership_mean=float(m.mean()),
                             membership_min=float(m.min()), membership_max=float(m.max()),
                             predicted_mean=float(pred.mean()), max_abs_err=float((m - pred).abs().max()),
                             max_plane_residual=float((e.plane_residual(y).abs() / z).max())))
    return pd.DataFrame(rows)
