"""Direct interference (beyond the paper): change one subspace's component and measure how far each
head's attention moves.

The paper infers interference through the shared norm from Theorem 2 but says it never observed it
directly. Here every layer's input is patched to its clean value plus a change, and for Pre-Norm a
second run freezes ``ln1``'s scale to separate the shared-norm path from the head's linear reads.
Everything runs through the model's own forward pass (hooks), so calibrated models
(``calibration="paper"``) are measured exactly as they compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from interp_norm.errors import GeometryError
from interp_norm.geometry._common import TINY, TokensLike, as_tokens, check_model, run_cached, valid_mask
from interp_norm.geometry.subspaces import effective_read_matrices, positional_subspace, token_subspace
from interp_norm.core.hook_names import act_name
from interp_norm.core.model import HookedNormTransformer

__all__ = ["ScaleComponent", "AddOrthogonal", "Intervention", "default_interventions", "direct_interference"]


@dataclass(frozen=True, eq=False)
class ScaleComponent:
    """Multiply one writer's component (a cached hook, default the token embedding) by ``factor``."""

    hook_name: str = act_name("embed")
    factor: float = 0.5

    @property
    def needs(self) -> tuple[str, ...]:
        return (self.hook_name,)

    def delta(self, model: HookedNormTransformer, cache, layer: int) -> Tensor:
        return (self.factor - 1.0) * cache[self.hook_name]


@dataclass(frozen=True, eq=False)
class AddOrthogonal:
    """Add, at every token, a random vector orthogonal to a subspace (default: the positional one),
    of norm ``rel_norm`` × |x_t| (the residual norm at the layer's input). Seeded; same draw per layer."""

    basis: Optional[Tensor] = None
    rel_norm: float = 0.5
    seed: int = 0

    needs: tuple[str, ...] = field(default=(), init=False)

    def delta(self, model: HookedNormTransformer, cache, layer: int) -> Tensor:
        x = cache[act_name("resid_pre", layer)]
        B = positional_subspace(model) if self.basis is None else torch.as_tensor(self.basis).double()
        if B.shape[1] >= x.shape[-1]:
            raise GeometryError(
                "the subspace spans the whole residual stream, so no vector is orthogonal to it; "
                "pass a smaller basis (e.g. positional_subspace(model, energy=0.9))"
            )
        g = torch.Generator().manual_seed(self.seed)
        v = torch.randn(x.shape, generator=g, dtype=torch.float64)
        v = v - (v @ B) @ B.T
        v = v / v.norm(dim=-1, keepdim=True).clamp_min(TINY)
        return (self.rel_norm * x.double().norm(dim=-1, keepdim=True) * v).to(x.dtype)


Intervention = Union[ScaleComponent, AddOrthogonal]


def default_interventions() -> dict[str, Intervention]:
    """Scale the token-type component by ½ and by 2; add a vector ⊥ the positional subspace (½|x|)."""
    return {
        "tok x0.5": ScaleComponent(act_name("embed"), 0.5),
        "tok x2": ScaleComponent(act_name("embed"), 2.0),
        "orth-pos +0.5|x|": AddOrthogonal(None, 0.5, seed=0),
    }


def _patterns_under(model: HookedNormTransformer, tokens: Tensor, cache, deltas: list[Tensor], freeze_scale: bool) -> list[Tensor]:
    """Attention patterns when every layer's input is its clean value plus ``deltas[l]``; with
    ``freeze_scale`` the Pre-Norm ``ln1`` divides by its *clean* scale (the shared-norm path cut)."""
    captured: dict[int, Tensor] = {}

    def patch(x, hook, l):
        return cache[act_name("resid_pre", l)] + deltas[l].to(x.dtype)

    def grab(x, hook, l):
        captured[l] = x.detach().double()

    def clean_scale(x, hook, l):
        return cache[act_name("scale", l, "ln1")].to(x.dtype)

    fwd = []
    for l in range(model.cfg.n_layers):
        fwd.append((act_name("resid_pre", l), lambda x, hook, l=l: patch(x, hook, l)))
        fwd.append((act_name("pattern", l), lambda x, hook, l=l: grab(x, hook, l)))
        if freeze_scale:
            fwd.append((act_name("scale", l, "ln1"), lambda x, hook, l=l: clean_scale(x, hook, l)))
    with torch.no_grad():
        model.run_with_hooks(tokens, fwd_hooks=fwd)
    return [captured[l] for l in range(model.cfg.n_layers)]


def _read_shares(model: HookedNormTransformer) -> dict[tuple[int, int, str], float]:
    """``{(layer, head, "pos_read_q"|...): share}``: how much of each head's effective W_Q/W_K lies in
    the positional / token-embedding subspace (shares of Frobenius energy, scale-free)."""
    bases = {"pos": positional_subspace(model), "tok": token_subspace(model)}
    reads = {}
    for l in range(model.cfg.n_layers):
        for (h, n), M in effective_read_matrices(model, l).items():
            if n == "v":
                continue
            tot = float((M**2).sum())
            for s, Q in bases.items():
                reads[(l, h, f"{s}_read_{n}")] = float(((Q.T @ M) ** 2).sum()) / tot if tot > 0 else float("nan")
    return reads


def direct_interference(
    model: HookedNormTransformer,
    tokens: TokensLike,
    interventions: Optional[Mapping[str, Intervention]] = None,
    *,
    exclude_bos: bool = True,
    progress: bool = False,
    cache=None,
) -> pd.DataFrame:
    """How far each head's attention moves when one subspace's component changes (beyond the paper).

    For every layer at once, the layer's input (its ``hook_resid_pre``) is replaced by its *clean*
    value plus the intervention's delta, so each layer sees only the direct change, not changes
    propagated from earlier layers. Per (intervention, layer, head): ``mean_tv`` /
    ``max_tv`` = mean / max over valid query rows of the total-variation distance ½Σ_t|Δa_t|, and
    ``max_abs`` = max |Δa_t|. ``pos_read_q/k`` and ``tok_read_q/k`` are the shares of the head's
    effective W_Q/W_K in the positional / token-embedding subspace (a positional head has ≈ 1 in pos),
    so heads that read *another* subspace than the one changed can be picked out. Theory: Pre-Norm
    heads move through the shared norm; QKV-Norm heads that do not read the changed subspace do not.

    Trained heads read several subspaces, so the change is also split by path (Pre-Norm only): a
    second run holds ``ln1``'s scale at its clean value. ``mean_tv_direct`` = change with the scale
    frozen (through the head's linear reads alone); ``mean_tv_norm`` = TV between the full and the
    frozen run (what the shared norm adds: Theorem 2's interference). Without a shared norm
    (QKV/QK/No-Norm) there is no such path: ``mean_tv_direct`` = ``mean_tv`` and ``mean_tv_norm`` = 0.
    The two parts are distances, not a sum: they can partly cancel (scaling a component up raises
    the scores it feeds while the larger norm lowers every score).
    An intervention is any object with ``needs`` (cached hook names) and ``delta(model, cache, layer)``.
    """
    check_model(model)
    tokens = as_tokens(model, tokens)
    interventions = default_interventions() if interventions is None else dict(interventions)
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    needs = {act_name("resid_pre", l) for l in range(n_layers)} | {act_name("pattern", l) for l in range(n_layers)}
    for iv in interventions.values():
        needs |= set(iv.needs)
    shared_norm = model.cfg.attn_norm == "pre"
    if shared_norm:
        needs |= {act_name("scale", l, "ln1") for l in range(n_layers)}
    cache = run_cached(model, tokens, needs, cache)
    rows_mask = valid_mask(tokens, exclude_bos)
    if not rows_mask.any():
        raise GeometryError("no query rows left after excluding padding and '['")
    reads = _read_shares(model)
    rows = []
    for name, iv in tqdm(interventions.items(), desc="interference", disable=not progress):
        with torch.no_grad():
            deltas = [iv.delta(model, cache, l) for l in range(n_layers)]
        full = _patterns_under(model, tokens, cache, deltas, freeze_scale=False)
        frozen = _patterns_under(model, tokens, cache, deltas, freeze_scale=True) if shared_norm else full
        for l in range(n_layers):
            clean = cache[act_name("pattern", l)].double()
            d = (full[l] - clean).abs()  # b h q k
            tv = 0.5 * d.sum(-1)  # b h q
            tv_direct = 0.5 * (frozen[l] - clean).abs().sum(-1)
            tv_norm = 0.5 * (full[l] - frozen[l]).abs().sum(-1)
            for h in range(n_heads):
                t = tv[:, h][rows_mask]
                rows.append(dict(intervention=name, layer=l, head=h, mean_tv=float(t.mean()), max_tv=float(t.max()),
                                 max_abs=float(d[:, h][rows_mask].max()),
                                 mean_tv_direct=float(tv_direct[:, h][rows_mask].mean()),
                                 mean_tv_norm=float(tv_norm[:, h][rows_mask].mean()),
                                 **{k[2]: v for k, v in reads.items() if k[0] == l and k[1] == h}))
    return pd.DataFrame(rows)
