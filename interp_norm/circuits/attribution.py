"""Attribution patching (EAP) and EAP-IG at node level, and how well an estimate ranks like exact patching.

Attribution patching linearises activation patching: the effect of patching activation ``a``
from the clean run into the corrupted run is estimated by ``(a_clean - a_corr) . dM/da`` with the
gradient taken on the corrupted run (TransformerLens 4.x's "denoising" convention, so estimates
compare directly with :func:`~interp_norm.circuits.exact.patching.activation_patch`). Cost: a clean
and a corrupted forward pass plus one backward pass. EAP-IG (``ig_steps = m > 1``) averages the
gradient over ``m`` points on the straight line between the corrupted and clean token
embeddings, ``alpha = k/m`` for ``k = 0..m-1`` (as Hanna et al.'s ``EAP-IG``; ``m = 1`` is EAP).

Edge-level scores (sender -> receiver) are in :mod:`~interp_norm.circuits.edge_scores`.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Any, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from interp_norm.circuits import attribution_replay as replay
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
from interp_norm.circuits.norm_modes import freeze_hooks, mode_label, quiet
from interp_norm.circuits.pairs import PatchingPairs, as_pairs
from interp_norm.circuits.exact.patch_cells import check_hooks, check_pattern_hooks_act, head_count
from interp_norm.errors import EngineRefusal, PatchingError
from interp_norm.core.hook_names import PATCHABLE, act_name


# ----------------------------------------------------------------------------- node level

#: the activations that are the residual stream itself (a leaf is added to them in place)
_RESIDUAL = ("resid_pre", "resid_mid", "resid_post")


def attribution_patch(
    model,
    pairs: PatchingPairs,
    metric: Optional[MetricFn] = None,
    activation: str = "z",
    *,
    by: str = "pos",
    ig_steps: int = 1,
    batch_size: int = 1024,
    norm: str = "live",
    pattern: str = "live",
) -> PatchResult:
    """EAP (``ig_steps=1``) or EAP-IG estimate of :func:`activation_patch` for every cell.

    Returns a :class:`PatchResult` on the same grid as exact patching, whose ``effect()`` is the
    estimated change of the metric (and ``values`` = corrupted baseline + that estimate).
    ``batch_size`` bounds the rows (integration steps x examples) per forward/backward pass.
    ``norm`` / ``pattern``: ``"frozen"`` holds the norms' scales / the attention patterns constant
    in the backward pass (:mod:`~interp_norm.circuits.norm_modes`).
    """
    return node_attribution(model, pairs, metric, (activation,), by=by, ig_steps=ig_steps, batch_size=batch_size,
                            norm=norm, pattern=pattern)[activation]


def node_attribution(
    model,
    pairs: PatchingPairs,
    metric: Optional[MetricFn] = None,
    activations: Sequence[str] = ("z", "mlp_out"),
    *,
    by: str = "pos",
    ig_steps: int = 1,
    batch_size: int = 1024,
    norm: str = "live",
    pattern: str = "live",
) -> dict[str, PatchResult]:
    """EAP / EAP-IG of several activations from the same passes: ``{activation: PatchResult}``.

    All pairs (and integration steps) go through one batched pass: one clean forward, then one
    forward + backward from the corrupted input whose first integration point (``alpha = 0``) is the
    corrupted run itself, so its activations and baseline come from that pass. On a
    TransformerBridge, when the metric declares the positions it reads (``read_mask``), the input
    stops at the last read position (later positions cannot reach the metric: their scores are 0)
    and the unembedding runs at the read positions only. For per-position activations on a bridge
    with no hook on it, the corrupted pass re-runs the bridge's blocks only from the first position
    where some pair's tokens differ, with the last block at the read positions
    (:mod:`~interp_norm.circuits.attribution_replay`; full passes where the bridge's blocks cannot be
    re-run). (TransformerLens 4.3's ``attribution_patch`` runs a clean forward and a corrupted
    forward + backward per pair.) ``norm`` / ``pattern`` = ``"frozen"``: the norms' scales / the
    attention patterns held constant in the backward pass, at their values in the run differentiated
    (:mod:`~interp_norm.circuits.norm_modes`; then full passes on a bridge).
    """
    pairs = as_pairs(pairs)
    require_eval(model)
    frozen = freeze_hooks(model, norm, pattern, tokens=pairs.clean_tokens.to(device(model)))
    activations = list(dict.fromkeys(activations))
    axes_of = {a: check_by(a, by) for a in activations}
    dev = device(model)
    metric = metric if metric is not None else LogitDiff(pairs)
    alphas = ig_alphas(ig_steps)
    cfg = model.cfg
    L, H = cfg.n_layers, cfg.n_heads
    clean, corr = pairs.clean_tokens.to(dev), pairs.corrupted_tokens.to(dev)
    b, n = clean.shape
    names = {a: [act_name(a, l) for l in range(L)] for a in activations}
    embed = act_name("embed")
    want = {nm for a in activations for nm in names[a]} | {embed}
    check_hooks(model, sorted(want - {embed}))
    for a in activations:
        if PATCHABLE[a] == "pattern":  # a pattern hook fired after the attention ran has gradient 0
            check_pattern_hooks_act(model, clean, names[a])
    cols, ne = _read_columns(model, metric, b, n, any(PATCHABLE[a] == "pattern" for a in activations))
    steps_per_pass = max(1, batch_size // b)
    leaves = sorted(want - {embed})
    inputs = replay.AttributionInputs(clean, corr, metric, names=leaves, embed=embed, alphas=alphas,
                                      steps_per_pass=steps_per_pass)
    found = None
    if not frozen and replay.applies(model, activations):
        try:
            found = replay.prefix_attribution(model, inputs, cols if cols is not None else torch.arange(n, device=dev))
        except EngineRefusal:
            found = None  # a bridge whose blocks cannot be re-run: full passes
    if found is None:
        found = _full_passes(model, inputs, cols=cols, ne=ne, frozen=frozen)
    prods, clean_val, baseline = found
    out = {}
    for a in activations:
        kind, axes = PATCHABLE[a], axes_of[a]
        # k and v of grouped-query attention have the k/v heads (as exact patching sizes them)
        sizes = dict(layer=L, pos=n, head=head_count(kind, [prods[nm] for nm in names[a]], H), dest_pos=n, src_pos=n)
        per_layer = [_cell_scores(kind, by, prods[nm] / ig_steps, n) for nm in names[a]]
        est = torch.stack(per_layer, 1)  # [b, layer, ...]
        if kind == "resid" and by == "all":
            est = est[..., 0]
        per_example = est.reshape(b, -1).T.cpu() + baseline.unsqueeze(0)  # [cells, b]
        values = per_example.mean(-1).view(*[sizes[x] for x in axes])
        out[a] = PatchResult(
            activation=a, by=by, axis_names=list(axes), values=values.float(),
            index_df=pd.DataFrame(grid_cells(axes, sizes).numpy(), columns=list(axes)), per_example=per_example,
            baseline=baseline, clean=clean_val, metric_name=getattr(metric, "name", "metric"),
            method=("eap" if ig_steps == 1 else f"eap-ig{ig_steps}") + mode_label(norm, pattern),
        )
    return out


def _full_passes(model, inputs: replay.AttributionInputs, *, cols: Optional[Tensor], ne: int,
                 frozen: Sequence = ()) -> tuple[dict, Tensor, Tensor]:
    """One clean forward, then forward + backward passes from the corrupted input with zero leaves
    added at every hooked activation: ``{name: (clean - corrupted) x gradient summed over the
    integration points}``, the clean metric values and the corrupted baseline.

    The zero leaf is added in place at the residual stream's hooks (``resid_pre/mid/post``), so the
    gradient at it is the gradient at the residual, whatever else holds the hooked tensor: a bridge's
    ``hook_resid_mid`` is an alias of the second norm's input (``ln2.hook_in``; OLMo-2: the MLP's
    input), and the Hugging Face block keeps that same tensor as the residual it adds the MLP's
    output to -- a leaf added out of place reaches the MLP only, not the residual carried on
    (``tests/test_bridge_attribution_resid.py`` checks against the gradient of a hand-written forward).
    Elsewhere out of place (a tensor there may be saved for the backward pass, e.g. ``hook_pattern``:
    the softmax's output). ``frozen``: hooks (:func:`~interp_norm.circuits.norm_modes.freeze_hooks`)
    that run before the leaves on the differentiated passes. The leaves are ``inputs.names``."""
    clean, corr, metric, leaves, embed = inputs.clean, inputs.corr, inputs.metric, inputs.names, inputs.embed
    alphas, steps_per_pass = inputs.alphas, inputs.steps_per_pass
    b, n = clean.shape
    in_place = {nm for nm in leaves if any(nm == act_name(a, int(nm.split(".")[1])) for a in _RESIDUAL)}
    dev = clean.device
    want = set(leaves) | {embed}
    with torch.no_grad(), _logits_at(model, cols, n, ne):
        clean_logits, cc = model.run_with_cache(clean[:, :ne], names_filter=lambda nm: nm in want)
        clean_val = metric_values(metric, clean_logits, b).double().cpu()
    e_clean = cc[embed]
    grads = {nm: torch.zeros_like(cc[nm], dtype=torch.float64) for nm in leaves}
    xc: dict[str, Tensor] = {}
    baseline = None
    for s0 in range(0, len(alphas), steps_per_pass):
        al = alphas[s0 : s0 + steps_per_pass].to(dev, e_clean.dtype)
        m = len(al)
        deltas: dict[str, Tensor] = {}

        def embed_hook(act: Tensor, hook: Any, al=al, m=m) -> Tensor:
            a = act.view(m, *e_clean.shape)  # the corrupted embedding: alpha = 0 leaves it as it is
            return (a + al.view(m, 1, 1, 1) * (e_clean.unsqueeze(0) - a)).reshape(act.shape)

        def leaf_hook(act: Tensor, hook: Any, nm: str, first: bool) -> Tensor:
            if first:
                xc[nm] = act[:b].detach().clone()  # the rows of alpha = 0: the corrupted run
            d = torch.zeros_like(act, requires_grad=True)
            deltas[nm] = d  # keyed by our name: a bridge's hook.name is its canonical alias
            if nm in in_place:  # every reader of the residual sees d (a bridge's resid_mid: see below)
                return act.add_(d)
            return act + d

        hooks = [(embed, embed_hook), *frozen] + [(nm, partial(leaf_hook, nm=nm, first=s0 == 0)) for nm in leaves]
        with torch.enable_grad(), _logits_at(model, cols, n, ne), quiet():
            logits = model.run_with_hooks(corr[:, :ne].repeat(m, 1), fwd_hooks=hooks)
            vals = metric_values(metric, logits, b)
            if s0 == 0:
                baseline = vals[:b].detach().double().cpu()
            gs = torch.autograd.grad(vals.sum(), [deltas[nm] for nm in leaves], allow_unused=True)
        for nm, g in zip(leaves, gs):
            if g is not None:
                grads[nm] += g.view(m, b, *g.shape[1:]).sum(0).double()
    return {nm: (cc[nm].double() - xc[nm].double()) * grads[nm] for nm in leaves}, clean_val, baseline


def _cell_scores(kind: str, by: str, prod: Tensor, n: int) -> Tensor:
    """(clean - corrupted) x gradient of one layer, summed over what a cell covers; positions the
    input stopped before (the metric reads none of them) score 0."""
    if kind == "resid":
        s = prod.sum(-1)  # [b, pos]
        return torch.nn.functional.pad(s, (0, n - s.shape[1])) if by == "pos" else s.sum(-1, keepdim=True)
    if kind == "head":
        s = prod.sum(-1)  # [b, pos, head]
        return torch.nn.functional.pad(s, (0, 0, 0, n - s.shape[1])) if by == "pos" else s.sum(1)  # [b, head]
    return {"pos": prod.sum(-1), "all": prod.sum((-1, -2)), "dest_src": prod}[by]  # pattern [b, head, dest, src]


def _read_columns(model, metric: MetricFn, b: int, n: int, full: bool) -> tuple[Optional[Tensor], int]:
    """The positions the metric reads (None: all) and how many input positions reach them; only on
    a TransformerBridge (whose unembedding is a module :func:`_logits_at` can wrap)."""
    from interp_norm.anatomy import capabilities

    read = getattr(metric, "read_mask", None)
    if read is None or not capabilities(model).hf_original or not isinstance(getattr(model, "unembed", None), torch.nn.Module):
        return None, n
    cols = torch.as_tensor(read).to(torch.bool).expand(b, n).any(0).nonzero().flatten()
    if len(cols) == 0:
        return None, n
    return cols.to(device(model)), n if full else int(cols.max()) + 1


@contextmanager
def _logits_at(model, cols: Optional[Tensor], n: int, ne: int):
    """Unembed only positions ``cols`` of a pass over the first ``ne`` positions; the logits come out
    as ``[rows, n, vocab]``, zero at the positions not read (differentiable)."""
    if cols is None or (len(cols) == n and ne == n):
        yield
        return

    def pre(module, args, kwargs):
        return (args[0].index_select(1, cols),) + tuple(args[1:]), kwargs

    def post(module, args, out):
        y = out[0] if isinstance(out, tuple) else out
        full = y.new_zeros((y.shape[0], n) + tuple(y.shape[2:])).index_copy_(1, cols, y)  # in place: no second copy
        return (full,) + tuple(out[1:]) if isinstance(out, tuple) else full

    handles = [model.unembed.register_forward_pre_hook(pre, with_kwargs=True), model.unembed.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


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


__all__ = ["attribution_patch", "node_attribution", "compare_scores"]
