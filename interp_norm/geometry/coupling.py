"""Coupling through the shared norm: how a head's attention moves when a residual component is scaled.

Menary et al. 2024 (§3, the title claim): in Pre-Norm every head reads the residual stream through one
norm whose scale depends on *all* components, so scaling a component a head does not read still moves
its attention (through the shared scale); a per-head QKV-Norm normalises what the head reads, so it
does not. This measures that directly, per head of one layer:

* **total**: the residual x at the layer's input becomes x' = x + (factor − 1)·P_U x (the component in
  the orthonormal subspace U scaled by ``factor``); the head's pattern on x' against its pattern on x.
* **direct**: x' with every norm scale the layer's attention uses (``ln1``'s, the per-head q and k
  scales) held at its value on x: what the head's own reads of the change do.
* **norm**: x with those scales taken from x': what the change does only through the norms' scales.
* **controls**: the same with U replaced by random orthonormal subspaces of U's dimension, the
  perturbation rescaled per token to the norm of the component's one (equal-norm random directions).

The change is the total-variation distance between the two attention rows, averaged over batch and
query positions from ``first_query`` on (position 0 attends only to itself). The choice of TV (rather
than KL) and of a multiplicative ``factor`` are parameters of the measure, not the paper's.
"""

from __future__ import annotations

from typing import Optional

import pandas as pd
import torch
from torch import Tensor

from interp_norm.core.hook_names import act_name
from interp_norm.errors import ConfigError

__all__ = ["norm_coupling", "scale_hook_names"]


def scale_hook_names(model, layer: int) -> list[str]:
    """The norm scales the attention of ``layer`` computes its pattern from (those the model has)."""
    names = [act_name("scale", layer, "ln1"), act_name("q_scale", layer), act_name("k_scale", layer)]
    return [n for n in names if n in model.hook_dict]


def _pattern(model, x: Tensor, layer: int, scales: Optional[dict] = None) -> tuple[Tensor, dict]:
    """(pattern [b, h, q, k] of ``layer`` on residual ``x``, the scales it computed); ``scales`` replaces them."""
    seen: dict = {}

    def read(t, hook):
        seen[hook.name] = t.detach().clone()
        return scales[hook.name] if scales is not None else t

    out: dict = {}
    hooks = [(n, read) for n in scale_hook_names(model, layer)]
    hooks.append((act_name("pattern", layer), lambda t, hook: out.__setitem__("p", t.detach())))
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        model(x, start_at_layer=layer, stop_at_layer=layer + 1)
    return out["p"], seen


def _tv(p: Tensor, q: Tensor, first_query: int) -> Tensor:
    """Mean TV distance per head: 0.5·Σ_k |p − q| averaged over batch and query rows >= first_query."""
    return 0.5 * (p - q).abs().sum(-1)[:, :, first_query:].mean(dim=(0, 2))


def _orthonormal(basis: Tensor) -> Tensor:
    q, _ = torch.linalg.qr(basis)
    return q


def _paths(model, x: Tensor, delta: Tensor, layer: int, first_query: int) -> dict[str, Tensor]:
    clean, clean_scales = _pattern(model, x, layer)
    total, moved_scales = _pattern(model, x + delta, layer)
    direct, _ = _pattern(model, x + delta, layer, clean_scales)
    norm, _ = _pattern(model, x, layer, moved_scales)
    return {name: _tv(p, clean, first_query) for name, p in (("total", total), ("direct", direct), ("norm", norm))}


def norm_coupling(model, tokens: Tensor, layer: int, basis: Tensor, *, factor: float = 0.5, n_controls: int = 4,
                  first_query: int = 1, seed: int = 0) -> pd.DataFrame:
    """Per head of ``layer``: the attention change when the residual component in ``basis`` is scaled
    by ``factor``, split into direct and shared-norm paths, with random-subspace controls.

    ``basis``: [d_model, k] spanning the component (orthonormalised here). Returns one row per
    (subspace, head, path) with ``tv`` (mean total-variation distance) and ``delta_norm`` (mean
    per-token norm of the perturbation); ``subspace`` is ``"component"`` or ``"random {i}"``.
    """
    if not 0 <= layer < model.cfg.n_layers:
        raise ConfigError(f"layer {layer} is outside the model's 0..{model.cfg.n_layers - 1}; pick one of them")
    if basis.ndim != 2 or basis.shape[0] != model.cfg.d_model or not 0 < basis.shape[1] < model.cfg.d_model:
        raise ConfigError(f"basis must be [d_model={model.cfg.d_model}, k] with 0 < k < d_model, got "
                          f"{tuple(basis.shape)}; pass the component's directions as columns")
    u = _orthonormal(basis.to(torch.float32))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=act_name("resid_pre", layer), stop_at_layer=layer + 1)
    x = cache[act_name("resid_pre", layer)]
    delta = (factor - 1.0) * (x @ u) @ u.T
    size = delta.norm(dim=-1, keepdim=True)
    g = torch.Generator().manual_seed(seed)
    subspaces = [("component", delta)]
    for i in range(n_controls):
        r = _orthonormal(torch.randn(model.cfg.d_model, u.shape[1], generator=g))
        d = (x @ r) @ r.T
        subspaces.append((f"random {i}", d * size / d.norm(dim=-1, keepdim=True).clamp_min(1e-30)))
    rows = []
    for name, d in subspaces:
        for path, tv in _paths(model, x, d, layer, first_query).items():
            rows += [dict(layer=layer, head=h, subspace=name, path=path, tv=float(tv[h]),
                          delta_norm=float(d.norm(dim=-1).mean())) for h in range(len(tv))]
    return pd.DataFrame(rows)
