"""Attribution patching (EAP) and EAP-IG at node level, and how well an estimate ranks like exact patching.

Attribution patching linearises activation patching: the effect of patching activation ``a``
from the clean run into the corrupted run is estimated by ``(a_clean - a_corr) . dM/da`` with the
gradient taken on the corrupted run (TransformerLens 4.x's "denoising" convention, so estimates
compare directly with :func:`~interp_norm.circuits.patching.activation_patch`). Cost: a clean
and a corrupted forward pass plus one backward pass. EAP-IG (``ig_steps = m > 1``) averages the
gradient over ``m`` points on the straight line between the corrupted and clean token
embeddings, ``alpha = k/m`` for ``k = 0..m-1`` (as Hanna et al.'s ``EAP-IG``; ``m = 1`` is EAP).

Edge-level scores (sender -> receiver) are in :mod:`~interp_norm.circuits.edge_scores`.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Optional, Union

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from interp_norm.circuits._types import (
    MetricFn,
    PatchResult,
    check_by,
    device,
    grid_cells,
    ig_alphas,
    metric_values,
    require_eval,
)
from interp_norm.circuits.metrics import LogitDiff
from interp_norm.circuits.pairs import PatchingPairs, as_pairs
from interp_norm.errors import PatchingError
from interp_norm.hooks import PATCHABLE, act_name


# ----------------------------------------------------------------------------- node level


def attribution_patch(
    model,
    pairs: PatchingPairs,
    metric: Optional[MetricFn] = None,
    activation: str = "z",
    *,
    by: str = "pos",
    ig_steps: int = 1,
    batch_size: int = 1024,
) -> PatchResult:
    """EAP (``ig_steps=1``) or EAP-IG estimate of :func:`activation_patch` for every cell.

    Returns a :class:`PatchResult` on the same grid as exact patching, whose ``effect()`` is the
    estimated change of the metric (and ``values`` = corrupted baseline + that estimate).
    ``batch_size`` bounds the rows (integration steps x examples) per forward/backward pass.
    """
    pairs = as_pairs(pairs)
    require_eval(model)
    axes = check_by(activation, by)
    kind = PATCHABLE[activation]
    dev = device(model)
    metric = metric if metric is not None else LogitDiff(pairs)
    alphas = ig_alphas(ig_steps)
    cfg = model.cfg
    L, H = cfg.n_layers, cfg.n_heads
    clean, corr = pairs.clean_tokens.to(dev), pairs.corrupted_tokens.to(dev)
    b, n = clean.shape
    names = [act_name(activation, l) for l in range(L)]
    embed = act_name("embed")
    want = set(names) | {embed}
    with torch.no_grad():
        clean_logits, cc = model.run_with_cache(clean, names_filter=lambda nm: nm in want)
        corr_logits, xc = model.run_with_cache(corr, names_filter=lambda nm: nm in want)
        baseline = metric_values(metric, corr_logits, b).double().cpu()
        clean_val = metric_values(metric, clean_logits, b).double().cpu()
    e_clean, e_corr = cc[embed], xc[embed]
    grads = {nm: torch.zeros_like(cc[nm], dtype=torch.float64) for nm in names}
    steps_per_pass = max(1, batch_size // b)
    for s0 in range(0, ig_steps, steps_per_pass):
        al = alphas[s0 : s0 + steps_per_pass].to(dev, e_clean.dtype)
        m = len(al)
        deltas: dict[str, Tensor] = {}

        def embed_hook(act: Tensor, hook: Any, al=al, m=m) -> Tensor:
            mix = e_corr.unsqueeze(0) + al.view(m, 1, 1, 1) * (e_clean - e_corr).unsqueeze(0)
            return mix.reshape(act.shape)

        def leaf_hook(act: Tensor, hook: Any, nm: str) -> Tensor:
            d = torch.zeros_like(act, requires_grad=True)
            deltas[nm] = d  # keyed by our name: a bridge's hook.name is its canonical alias
            return act + d

        hooks = [(embed, embed_hook)] + [(nm, partial(leaf_hook, nm=nm)) for nm in names]
        with torch.enable_grad():
            logits = model.run_with_hooks(corr.repeat(m, 1), fwd_hooks=hooks)
            total = metric_values(metric, logits, b).sum()
            gs = torch.autograd.grad(total, [deltas[nm] for nm in names], allow_unused=True)
        for nm, g in zip(names, gs):
            if g is not None:
                grads[nm] += g.view(m, b, *g.shape[1:]).sum(0).double()
    # score per cell: (clean - corrupted) . mean gradient, summed over the axes the cell covers
    per_layer = []
    for nm in names:
        prod = (cc[nm].double() - xc[nm].double()) * grads[nm] / ig_steps  # [b, ...]
        if kind == "resid":
            s = prod.sum(-1)  # [b, pos]
            s = s if by == "pos" else s.sum(-1, keepdim=True)
        elif kind == "head":
            s = prod.sum(-1)  # [b, pos, head]
            s = s if by == "pos" else s.sum(1)  # [b, head]
        else:  # pattern [b, head, dest, src]
            s = {"pos": prod.sum(-1), "all": prod.sum((-1, -2)), "dest_src": prod}[by]
        per_layer.append(s)
    est = torch.stack(per_layer, 1)  # [b, layer, ...]
    if kind == "resid" and by == "all":
        est = est[..., 0]
    sizes = dict(layer=L, pos=n, head=H, dest_pos=n, src_pos=n)
    per_example = est.reshape(b, -1).T + baseline.unsqueeze(0)  # [cells, b]
    values = per_example.mean(-1).view(*[sizes[a] for a in axes])
    cells = grid_cells(axes, sizes)
    return PatchResult(
        activation=activation, by=by, axis_names=list(axes), values=values.float(),
        index_df=pd.DataFrame(cells.numpy(), columns=list(axes)), per_example=per_example,
        baseline=baseline, clean=clean_val, metric_name=getattr(metric, "name", "metric"),
        method="eap" if ig_steps == 1 else f"eap-ig{ig_steps}",
    )


# ----------------------------------------------------------------------------- agreement


def compare_scores(approx: Union[PatchResult, pd.DataFrame], exact: Union[PatchResult, pd.DataFrame], k: int = 10) -> pd.DataFrame:
    """How well an estimate ranks like exact patching: one row with pearson, spearman,
    top-k overlap (|score|), sign agreement over the top-k exact cells, and max |diff|.

    Accepts two :class:`PatchResult` (compares ``effect()``) or two edge DataFrames (``score``,
    matched on sender/receiver).
    """
    if isinstance(approx, PatchResult):
        a = approx.effect().reshape(-1).double().numpy()
        e = exact.effect().reshape(-1).double().numpy()
    else:
        j = exact[["sender", "receiver", "score"]].merge(approx[["sender", "receiver", "score"]], on=["sender", "receiver"], suffixes=("_e", "_a"))
        a, e = j["score_a"].to_numpy(), j["score_e"].to_numpy()
    if len(a) != len(e) or len(a) == 0:
        raise PatchingError("the two results cover different cells; compare results of the same sweep")
    k = min(k, len(a))
    pear = float(np.corrcoef(a, e)[0, 1]) if a.std() > 0 and e.std() > 0 else float("nan")
    ra, re = pd.Series(a).rank().to_numpy(), pd.Series(e).rank().to_numpy()
    spear = float(np.corrcoef(ra, re)[0, 1]) if ra.std() > 0 and re.std() > 0 else float("nan")
    top_a = set(np.argsort(-np.abs(a), kind="stable")[:k])
    top_e = np.argsort(-np.abs(e), kind="stable")[:k]
    overlap = len(top_a & set(top_e)) / k
    sign = float(np.mean(np.sign(a[top_e]) == np.sign(e[top_e])))
    return pd.DataFrame([dict(n=len(a), pearson=pear, spearman=spear, k=k, topk_overlap=overlap,
                              topk_sign_agreement=sign, max_abs_diff=float(np.abs(a - e).max()))])


__all__ = ["attribution_patch", "compare_scores"]
