"""AtP* (Kramár et al. 2024): attribution patching with its two failure modes corrected.

Attribution patching (AtP, = EAP at node level) estimates the effect of patching activation ``a``
from the clean into the corrupted run by ``(a_clean - a_corr) . dM/da`` on the corrupted run.
Kramár et al. show two ways it misses important cells, and fix both:

* **Attention saturation (q/k).** A query or key reaches the metric through a softmax. When the
  corrupted pattern is saturated (one weight ~1, the others ~e^-30), the softmax's gradient is ~0,
  so AtP scores a key that would *grab* the attention when patched as ~0 -- while exact patching
  shows a large effect. AtP* recomputes the attention exactly: the pattern ``A'`` the head would
  have with the patched q (one row changes) or k (one column of scores changes, every row
  renormalises), computed with the model's own ``attn.scores`` (so QK-Norm and calibration are
  included), and linearises only from the pattern on: ``estimate = sum (A' - A) * dM/dA``.
* **Cancellation (GradDrop).** When a node's direct and indirect effects cancel at first order,
  ``dM/da ~ 0`` although patching changes ``M``. GradDrop computes ``L`` gradients, the ``l``-th
  with the gradient through layer ``l``'s residual contributions (its ``attn_out`` and
  ``mlp_out``) cut, and scores ``1/(L-1) * sum_l |estimate_l|`` per example, averaged over the
  batch (the paper's ``AtP+GD``). This is an unsigned *magnitude* for ranking cells, to compare
  with ``|exact effect|``; it needs ``L >= 2``.

:func:`atp_star` gives node-level results on the grid of :func:`~interp_norm.circuits.activation_patch`
(``q``/``k`` with the softmax fix; other activations plain AtP, all optionally with GradDrop).
:func:`edge_atp_star` gives edge scores: EAP, with every edge into a query or key rescored through
the exact pattern (the receiver's input moved by ``u_clean - u_corr``, then Pre-Norm, ``W_Q``/``W_K``,
the per-head norm and the softmax recomputed). Both need a :class:`~interp_norm.core.model.HookedNormTransformer`.
"""

from __future__ import annotations

import itertools
from functools import partial
from typing import Any, Callable, Optional, Sequence

import pandas as pd
import torch
from torch import Tensor

from interp_norm.circuits import EdgeGraph, LogitDiff, PatchingPairs, PatchResult, edge_attribution
from interp_norm.circuits.norm_modes import freeze_hooks, mode_label
from interp_norm.errors import PatchingError
from interp_norm.core.hook_names import PATCHABLE, act_name, used_name
from interp_norm.core.nodes import head_input

_MAX_ELEMS = 2**24  # per chunk of the [b, h, t, s, j] key-patch tensor


def _check(model, pairs) -> None:
    from interp_norm.core.model import HookedNormTransformer

    if not isinstance(model, HookedNormTransformer):
        raise PatchingError("AtP* recomputes attention with the model's own attn.scores; it needs a HookedNormTransformer")
    if any(m.training for m in model.modules()):
        raise PatchingError("the model is in training mode; call model.eval() first")
    if not isinstance(pairs, PatchingPairs):
        raise PatchingError("pass a PatchingPairs (see interp_norm.circuits.make_pairs or PatchingPairs(clean, corrupted))")


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _values(metric: Callable, logits: Tensor, b: int) -> Tensor:
    v = metric(logits)
    if v.ndim != 1 or v.shape[0] != b:
        raise PatchingError("AtP* needs a per-example metric (logits -> [batch]), e.g. LogitDiff(pairs)")
    return v


def _grads(model, tokens: Tensor, metric: Callable, names: list[str], drop: Optional[int] = None,
           frozen: Sequence = ()) -> tuple[dict, Tensor]:
    """Per-example metric gradients at hooks ``names`` on ``tokens``; with ``drop = l`` the
    gradient through layer l's attention and MLP outputs is cut (GradDrop); ``frozen``: the
    norm-mode hooks (:func:`~interp_norm.circuits.norm_modes.freeze_hooks`), run before the leaves.
    Rows are independent, so the gradient of the summed metric holds each example's own gradient."""
    leaves: dict[str, Tensor] = {}

    def leaf(x: Tensor, hook: Any, nm: str) -> Tensor:
        d = torch.zeros_like(x, requires_grad=True)
        leaves[nm] = d
        return x + d

    def cut(x: Tensor, hook: Any) -> Tensor:
        return x.detach()

    hooks: list[tuple[str, Callable]] = [*frozen] + [(nm, partial(leaf, nm=nm)) for nm in names]
    if drop is not None:
        hooks += [(act_name("attn_out", drop), cut), (act_name("mlp_out", drop), cut)]
    with torch.enable_grad():
        logits = model.run_with_hooks(tokens, fwd_hooks=hooks)
        vals = _values(metric, logits, tokens.shape[0])
        gs = torch.autograd.grad(vals.sum(), [leaves[nm] for nm in names], allow_unused=True)
    out = {nm: (torch.zeros_like(leaves[nm]) if g is None else g).detach().double() for nm, g in zip(names, gs)}
    return out, vals.detach().double()


def _softmax(scores: Tensor) -> Tensor:
    """Causal softmax over the last axis of [..., q, k] scores (the model's mask: key <= query)."""
    n_q, n_k = scores.shape[-2:]
    causal = torch.ones(n_q, n_k, dtype=torch.bool, device=scores.device).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1)


def _qk_estimate(attn, which: str, by: str, *, q_c: Tensor, k_c: Tensor, q_x: Tensor, k_x: Tensor, G: Tensor) -> Tensor:
    """AtP* estimate for patching the used q or k (clean into corrupted), per example.

    ``q_*``/``k_*`` [b, n, h, dh] (after any per-head norm), ``G = dM/dA`` [b, h, n, n].
    Returns [b, n, h] (``by="pos"``) or [b, h] (``by="all"``).
    """
    with torch.no_grad():
        A = _softmax(attn.scores(q_x, k_x).double())
        if which == "q":  # a patched query changes only its own row
            dA = _softmax(attn.scores(q_c, k_x).double()) - A
            est = (dA * G).sum(-1)  # [b, h, n]
            return est.sum(-1) if by == "all" else est.transpose(1, 2)
        if by == "all":  # every key patched: one new pattern
            return ((_softmax(attn.scores(q_x, k_c).double()) - A) * G).sum((-1, -2))
        S = attn.scores(q_x, k_x).double()  # [b, h, s, j]
        S_mix = attn.scores(q_x, k_c).double()  # [b, h, s, t] = q_x[s] . k_c[t]
        b, h, n, _ = S.shape
        eye = torch.eye(n, dtype=torch.bool, device=S.device)  # [t, j]
        out = []
        step = max(1, _MAX_ELEMS // (h * n**3))
        for i in range(0, b, step):
            # row s of the pattern when key t is patched: score (s, t) replaced, [b, h, t, s, j]
            X = torch.where(eye[:, None, :], S_mix[i : i + step].transpose(-1, -2).unsqueeze(-1), S[i : i + step].unsqueeze(2))
            dA = _softmax(X) - A[i : i + step].unsqueeze(2)
            out.append((dA * G[i : i + step].unsqueeze(2)).sum((-1, -2)))  # [b, h, t]
        return torch.cat(out).transpose(1, 2)


def _cache(model, tokens: Tensor, names: set[str]):
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens, names_filter=lambda nm: nm in names)
    return logits, cache


def atp_star(
    model, pairs: PatchingPairs, metric: Optional[Callable] = None, activation: str = "k", *,
    by: str = "pos", qk_fix: bool = True, grad_drop: bool = False, norm: str = "live", pattern: str = "live",
) -> PatchResult:
    """AtP* estimate of :func:`~interp_norm.circuits.activation_patch` for every cell of ``activation``.

    ``activation``: ``q``/``k`` (softmax recomputed when ``qk_fix``), or ``z``, ``v``,
    ``resid_pre``/``resid_mid``/``resid_post``, ``attn_out``, ``mlp_out`` (plain AtP). ``by``:
    ``"pos"`` or ``"all"``. With ``grad_drop`` the result's ``effect()`` is the GradDrop magnitude
    (>= 0); otherwise it is the signed estimate (``qk_fix=False, grad_drop=False`` is plain AtP).
    ``norm`` / ``pattern`` = ``"frozen"`` hold the norms' scales / the attention patterns constant in
    the backward pass (:mod:`~interp_norm.circuits.norm_modes`); the softmax fix still recomputes the
    patched head's own pattern exactly, and linearises from that pattern on with the modes chosen.
    """
    _check(model, pairs)
    frozen = freeze_hooks(model, norm, pattern)
    kind = PATCHABLE.get(activation)
    if kind not in ("resid", "head"):
        raise PatchingError(f"atp_star covers q, k, v, z and the residual activations, not {activation!r}")
    if by not in ("pos", "all"):
        raise PatchingError(f"by must be 'pos' or 'all', got {by!r}")
    cfg = model.cfg
    L, H = cfg.n_layers, cfg.n_heads
    if grad_drop and L < 2:
        raise PatchingError("GradDrop averages over the other layers (1/(L-1)); it needs a model with at least 2 layers")
    dev = _device(model)
    metric = metric if metric is not None else LogitDiff(pairs)
    clean, corr = pairs.clean_tokens.to(dev), pairs.corrupted_tokens.to(dev)
    b, n = clean.shape
    fix = qk_fix and activation in ("q", "k")
    names = [act_name(activation, l) for l in range(L)]
    qk = {used_name(cfg.attn_norm, t, l) for l in range(L) for t in "qk"} if fix else set()
    clean_logits, cc = _cache(model, clean, set(names) | qk)
    _, xc = _cache(model, corr, set(names) | qk)
    grad_names = [act_name("pattern", l) for l in range(L)] if fix else names
    drops: list[Optional[int]] = list(range(L)) if grad_drop else [None]
    total: Optional[Tensor] = None
    for drop in drops:
        grads, base = _grads(model, corr, metric, grad_names, drop, frozen)
        per_layer = []
        for l in range(L):
            if fix:
                q_c, k_c = cc[used_name(cfg.attn_norm, "q", l)], cc[used_name(cfg.attn_norm, "k", l)]
                q_x, k_x = xc[used_name(cfg.attn_norm, "q", l)], xc[used_name(cfg.attn_norm, "k", l)]
                est = _qk_estimate(model.blocks[l].attn, activation, by, q_c=q_c, k_c=k_c, q_x=q_x, k_x=k_x, G=grads[grad_names[l]])
            else:
                prod = ((cc[names[l]].double() - xc[names[l]].double()) * grads[names[l]]).sum(-1)  # [b, n(, h)]
                est = prod.sum(1) if by == "all" else prod
            per_layer.append(est)
        est = torch.stack(per_layer, 1)  # [b, L, ...]
        est = est.abs() if grad_drop else est
        total = est if total is None else total + est
    assert total is not None  # drops holds at least one entry
    est = total / (L - 1) if grad_drop else total
    axes = {("head", "pos"): ("layer", "pos", "head"), ("head", "all"): ("layer", "head"),
            ("resid", "pos"): ("layer", "pos"), ("resid", "all"): ("layer",)}[(kind, by)]
    sizes = dict(layer=L, pos=n, head=H)
    cells = list(itertools.product(*[range(sizes[a]) for a in axes]))
    per_example = est.reshape(b, -1).T.cpu() + base.cpu().unsqueeze(0)
    with torch.no_grad():
        clean_val = _values(metric, clean_logits, b).double().cpu()
    method = ("atp" if not (fix or grad_drop) else ("atp*" if fix else "atp") + ("-gd" if grad_drop else "")) + mode_label(norm, pattern)
    return PatchResult(
        activation=activation, by=by, axis_names=list(axes), values=per_example.mean(-1).view(*[sizes[a] for a in axes]).float(),
        index_df=pd.DataFrame(cells, columns=list(axes)), per_example=per_example, baseline=base.cpu(),
        clean=clean_val, metric_name=getattr(metric, "name", "metric"), method=method,
    )


# ----------------------------------------------------------------------------- edges


def _attn_input(block, x: Tensor, which: str) -> Tensor:
    """What ``attn.project(., which)`` receives from residual ``x``: Pre-Norm's ``ln1`` (its
    separate q/k/v gains) or the residual itself."""
    if block.cfg.attn_norm != "pre":
        return x
    y = block.ln1(x)
    return y["qkv".index(which)] if isinstance(y, tuple) else y


def _senders(model, cache) -> Tensor:
    """[U, b, n, d] sender outputs in :class:`EdgeGraph` order: embed, then per layer each head's
    ``z W_O[h]`` and the MLP output."""
    outs = [cache[act_name("embed")] + cache[act_name("pos_embed")]]
    for l, blk in enumerate(model.blocks):
        z = cache[act_name("z", l)]
        outs += list(torch.einsum("bphd,hdm->hbpm", z, blk.attn.W_O))
        outs.append(cache[act_name("mlp_out", l)])
    return torch.stack(outs)


def edge_atp_star(model, pairs: PatchingPairs, metric: Optional[Callable] = None, *, norm: str = "live",
                  pattern: str = "live") -> pd.DataFrame:
    """EAP edge scores with every edge into a query or key rescored by AtP*'s exact softmax.

    Same columns as :func:`~interp_norm.circuits.edge_attribution` (``method="atp*"``). An edge
    ``u -> a{l}.h{h}.q`` moves head h's query input by ``u_clean - u_corr`` at every position;
    its score is ``sum (A' - A) * dM/dA`` over head h's pattern, batch mean. ``norm`` / ``pattern``
    as in :func:`atp_star` (the gradients ``dM/dA`` and the EAP scores of the other edges take them;
    the rescored pattern ``A'`` is recomputed through the live norms).
    """
    _check(model, pairs)
    frozen = freeze_hooks(model, norm, pattern)
    metric = metric if metric is not None else LogitDiff(pairs)
    df = edge_attribution(model, pairs, metric, ig_steps=1, norm=norm, pattern=pattern)
    cfg = model.cfg
    L, H = cfg.n_layers, cfg.n_heads
    dev = _device(model)
    clean, corr = pairs.clean_tokens.to(dev), pairs.corrupted_tokens.to(dev)
    names = {act_name("embed"), act_name("pos_embed")} | {act_name(k, l) for l in range(L) for k in ("z", "mlp_out", "resid_pre")}
    names |= {used_name(cfg.attn_norm, t, l) for l in range(L) for t in "qk"}
    _, cc = _cache(model, clean, names)
    _, xc = _cache(model, corr, names)
    grads, _ = _grads(model, corr, metric, [act_name("pattern", l) for l in range(L)], frozen=frozen)
    with torch.no_grad():
        delta = _senders(model, cc) - _senders(model, xc)  # [U, b, n, d]
        graph = EdgeGraph(L, H)
        new: dict[tuple[str, str], float] = {}
        for l in range(L):
            attn, resid = model.blocks[l].attn, xc[act_name("resid_pre", l)]
            q_x, k_x = xc[used_name(cfg.attn_norm, "q", l)], xc[used_name(cfg.attn_norm, "k", l)]
            A = _softmax(attn.scores(q_x, k_x).double())
            G = grads[act_name("pattern", l)]
            for u in range(graph.n_senders_before(l, "attn")):
                x = resid + delta[u]
                for which in "qk":
                    v = attn.normalize(attn.project(_attn_input(model.blocks[l], x, which), which), which)
                    S = attn.scores(v, k_x) if which == "q" else attn.scores(q_x, v)
                    est = ((_softmax(S.double()) - A) * G).sum((-1, -2)).mean(0)  # [h]
                    for h in range(H):
                        new[(graph.senders[u], head_input(l, h, which))] = float(est[h])
    keys = list(zip(df["sender"], df["receiver"]))
    df = df.assign(score=[new.get(k, s) for k, s in zip(keys, df["score"])])
    df["abs_score"] = df["score"].abs()
    df["method"] = "atp*" + mode_label(norm, pattern)
    return df.sort_values("abs_score", ascending=False, kind="stable").reset_index(drop=True)


__all__ = ["atp_star", "edge_atp_star"]
