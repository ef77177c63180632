"""Edge scores: EAP / EAP-IG estimates for every edge, and exact single-edge patching to check them.

An edge's EAP score is ``(u_clean - u_corr) . dM/d(input of r)`` with the gradient on the corrupted
run (EAP-IG: averaged over the line from the corrupted to the clean embedding, as in
:mod:`~interp_norm.circuits.attribution`); exact edge patching runs the corrupted input with
receiver ``r`` seeing sender ``u``'s clean output. Edges and the intervening passes are in
:mod:`~interp_norm.circuits.edges`.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterable, Iterator, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from interp_norm.circuits import edge_grads, edge_senders
from interp_norm.circuits._types import MetricFn, device, ig_alphas, metric_values
from interp_norm.core import nodes
from interp_norm.circuits.edges import EdgeGraph, EdgeRunner
from interp_norm.circuits.exact.fused_elementwise import substitutes
from interp_norm.circuits.metrics import LogitDiff
from interp_norm.circuits.norm_modes import freeze_hooks, mode_label, quiet
from interp_norm.circuits.pairs import PatchingPairs, as_pairs
from interp_norm.errors import PatchingError


#: Rough memory for one forward/backward pass of edge attribution when ``batch_size`` is not given.
PASS_MEMORY_MB = 1024


def edge_attribution(
    model,
    pairs: PatchingPairs,
    metric: Optional[MetricFn] = None,
    *,
    ig_steps: int = 1,
    backend: str = "auto",
    batch_size: Optional[int] = None,
    progress: bool = False,
    norm: str = "live",
    pattern: str = "live",
) -> pd.DataFrame:
    """EAP / EAP-IG score of every edge: ``(u_clean - u_corr) . mean dM/d(input of r)``, batch mean.

    One row per edge with ``sender``, ``receiver``, ``receiver_node``, ``input`` (q/k/v/mlp/
    logits), layers and heads, ``score`` and ``abs_score``, sorted by ``abs_score``.
    Examples x integration steps per forward/backward pass: ``batch_size``, or by default as
    many as fit a rough :data:`PASS_MEMORY_MB` budget (each example carries ~3 x n_heads residual copies).
    ``norm`` / ``pattern`` = ``"frozen"``: the norms' scales / the attention patterns held constant in
    the backward pass at their values in the run differentiated (:mod:`~interp_norm.circuits.norm_modes`;
    bridges as there); edges into queries and keys then score 0 with frozen patterns.
    On a Pre-Norm bridge (``backend="auto"``) every receiver's gradient comes from one plain backward
    pass (:mod:`~interp_norm.circuits.edge_grads`, its GELU and norms through node EAP's one-kernel
    stand-ins, :mod:`~interp_norm.circuits.exact.fused_elementwise`); ``backend="copies"`` forces the
    receiver copies.
    Grouped k/v heads: one k and one v receiver per k/v head. Gemma 4: each layer has the receivers its
    projections read (:mod:`~interp_norm.circuits.edge_layer_input`) -- a ``k = v`` layer's ``k`` receiver
    feeds its keys and values, a KV-sharing layer has q receivers only and its keys and values move with
    the source layer's k/v receivers. Post-norm heads (OLMo-2, Gemma 4): the sender's difference is taken
    through the norm's Jacobian at the run differentiated (each integration point for EAP-IG;
    :mod:`~interp_norm.circuits.edge_post_norm`); with ``norm="frozen"`` through the norm with its scale
    held at that run's value, the scale the freeze hooks hold in the backward, so the whole estimate is
    the derivative of the frozen-scale model.
    """
    pairs = as_pairs(pairs)
    dev = device(model)
    metric = metric if metric is not None else LogitDiff(pairs)
    clean, corr = pairs.clean_tokens.to(dev), pairs.corrupted_tokens.to(dev)
    frozen = freeze_hooks(model, norm, pattern, tokens=clean)  # validates the modes before the runner's set-up
    runner = EdgeRunner(model, backend)
    if frozen:  # the runner may run a twin of the model (backend 'split'): the hooks go on the model it runs
        frozen = freeze_hooks(runner.run_model, norm, pattern, tokens=clean)
    alphas = ig_alphas(ig_steps)
    b, n = clean.shape
    # rows per pass: every example costs ~3*n_heads residual copies (split q/k/v inputs) or
    # 1 + 3*n_heads batch copies; chunk the examples too when the metric can be split
    A = runner.graph.max_attn_receivers  # the split backend's graphs have one count for every layer
    cost = A if runner.backend == "split" else 1 + A
    if batch_size is None:  # ~16 saved tensors of [n, d_model] per layer and residual copy
        per_example = cost * n * model.cfg.d_model * model.cfg.n_layers * 16 * 4
        per_pass = max(1, int(PASS_MEMORY_MB * 2**20 // per_example))
    else:
        per_pass = max(1, batch_size // cost)
    if per_pass < b and hasattr(metric, "select"):
        chunks = [list(range(i, min(b, i + per_pass))) for i in range(0, b, per_pass)]
    else:
        chunks = [list(range(b))]
    fast = backend == "auto" and edge_grads.applies(model, runner, norm, pattern)
    if fast:  # one plain pass per chunk: the receivers' rows are the rows themselves
        per_pass = max(per_pass * cost, b)
        chunks = [list(range(b))]
    work = [(rows, s0) for rows in chunks for s0 in range(0, ig_steps, max(1, per_pass // len(rows)))]
    scores = _score_passes(runner, (clean, corr), metric, (alphas, per_pass, len(chunks)), work, frozen, fast=fast,
                           held=norm == "frozen", progress=progress)
    scores = scores / (b * ig_steps) * runner.valid
    if runner.scale is not None:  # the layer scalars on each edge's path
        scores = scores * runner.scale.to(scores.dtype)
    method = ("eap" if ig_steps == 1 else f"eap-ig{ig_steps}") + mode_label(norm, pattern)
    return edge_frame(runner.graph, scores, runner.valid, method=method)


def _score_passes(runner: EdgeRunner, tokens: tuple[Tensor, Tensor], metric: MetricFn, plan: tuple, work: list,
                  frozen: list, *, fast: bool, held: bool, progress: bool) -> Tensor:
    """[U, R] summed scores of the passes in ``work`` ((rows, first integration step) each; ``plan`` =
    (alphas, rows per pass, number of row chunks); ``held``: post-norms' scales frozen, as ``frozen`` holds them). On the one-pass route the corrupted senders are
    read off its first pass (integration point 0 is the corrupted input), the embedding alone run
    before it; else (or if that pass falls back to the copies) a corrupted sender run."""
    (clean, corr), (alphas, per_pass, n_chunks) = tokens, plan
    model, dev, b = runner.model, corr.device, clean.shape[0]
    subs = substitutes(model) if fast else []  # the one-pass route's stand-ins, in its sender runs too
    s_clean, e_clean = edge_senders.sender_run(runner, clean, subs)
    if fast:
        e_corr, delta = edge_senders.embedding(runner, corr), None
    else:
        s_corr, e_corr = edge_senders.sender_run(runner, corr)
        delta = s_clean.sub_(s_corr)  # [U, b, n, d]
    scores = torch.zeros(len(runner.graph.senders), len(runner.graph.receivers), dtype=torch.float64)
    for rows, s0 in tqdm(work, disable=not progress, desc="edge attribution"):
        br = len(rows)
        sub = metric if n_chunks == 1 else metric.select(rows)  # type: ignore[attr-defined]  # chunked: it has one
        al = alphas[s0 : s0 + max(1, per_pass // br)].to(dev)
        idx = torch.tensor(rows, device=dev)
        seen: Optional[dict] = {} if delta is None and s0 == 0 and br == b else None
        g: Union[Tensor, Iterator[Tensor], None] = None
        if fast:
            g = edge_grads.fast_receivers(model, runner, corr[idx], (e_corr[idx], e_clean[idx], al), sub, br, capture=seen,
                                          subs=subs)
        if delta is None:  # the one-pass route's first pass: its senders, unless it fell back
            read = g is not None and seen is not None and all(nm in seen for nm in edge_senders.sender_names(runner))
            if read:
                delta = edge_senders.subtract_senders(runner, s_clean, seen)  # type: ignore[arg-type]  # read: not None
            else:
                delta = s_clean.sub_(edge_senders.sender_run(runner, corr, subs)[0])
        if g is None:  # the copies backend, or a block the one-pass path cannot read
            g = _copies_grads(runner, frozen, corr[idx], (e_corr[idx], e_clean[idx], al), sub, br)
        d = delta if br == b else delta[:, idx.to(delta.device)]
        scores += _pass_scores(runner, d, g, len(al), held=held)
    return scores


def _copies_grads(runner: EdgeRunner, frozen: list, tokens: Tensor, embed_mix: tuple, metric: MetricFn, br: int) -> Tensor:
    """[R, m*br, n, d] receiver gradients from one pass of the runner's receiver copies (leaves)."""
    m = len(embed_mix[2])
    with torch.enable_grad(), runner.run_model.hooks(fwd_hooks=frozen), quiet():
        logits, leaf = runner.run(tokens.repeat(m, 1), leaves=True, embed_mix=embed_mix)
        total = metric_values(metric, logits, br).sum()
        grads = torch.autograd.grad(total, list(leaf.values()), allow_unused=bool(frozen))
    # with frozen patterns nothing reaches the query and key inputs: their gradient is 0
    filled = [torch.zeros_like(x) if g is None else g for x, g in zip(leaf.values(), grads)]
    return runner.receiver_grads(leaf, filled)


def _pass_scores(runner: EdgeRunner, d: Tensor, g: Union[Tensor, Iterable[Tensor]], m: int, held: bool = False) -> Tensor:
    """[U, R] sum over one pass's rows of ``d . g``: sender differences [U, br, n, d] against receiver
    gradients [R, m*br, n, d] (m integration points; or their blocks in receiver order, per layer its
    attention receivers and its MLP, then the logits: :func:`edge_grads.fast_receivers`); post-norm
    heads' differences go through the norm's Jacobian at each row's point of the pass (``held``: with
    the norm's scale held there, :meth:`EdgeRunner.linearised`). Only valid
    edges (a receiver's block of senders before it) and positions where some sender differs
    (elsewhere ``d`` is exactly 0) are summed. The products run in float32 (float64 for a float64
    model), within :func:`product_bound` of exact."""
    graph = runner.graph
    if isinstance(g, Tensor):
        if runner.has_post_norms:
            moved = runner.linearised(d.double().repeat(1, m, 1, 1), runner.last_sums, held=held)
            return torch.einsum("ubnd,rbnd->ur", moved, g.double()).cpu()
        spans = [graph.attn_receivers(l) for l in range(runner.L)]  # per layer its attention receivers, then its MLP
        g = [blk for a in spans for blk in (g[a], g[a.stop : a.stop + 1])] + [g[-1:]]
    blocks = iter(g)
    first = next(blocks)
    dt = torch.promote_types(first.dtype, torch.float32)
    keep = d.any(-1).any(1).any(0).nonzero().flatten().tolist()  # any() of floats: no bool copy of d
    out, r0 = torch.zeros(d.shape[0], len(graph.receivers), dtype=dt, device=d.device), 0
    if not keep:
        return out.double().cpu()
    if keep[-1] - keep[0] + 1 == len(keep):  # a run of positions (a causal model: from the first change on): views
        pick: Callable[[Tensor], Tensor] = lambda t: t[:, :, keep[0] : keep[-1] + 1]  # noqa: E731
    else:
        pick = lambda t: t.index_select(2, torch.tensor(keep, device=t.device))  # noqa: E731
    dsel = pick(d.to(dt))
    rows = [dsel[:, i].flatten(1) for i in range(d.shape[1])]  # per row [U, positions * d]: no copy of d
    for k, blk in enumerate(itertools.chain([first], blocks)):
        u = graph.n_senders_before(k // 2, "mlp" if k % 2 else "attn") if k < 2 * runner.L else d.shape[0]
        gk = pick(blk.to(dt) if m == 1 else blk.to(dt).view(blk.shape[0], m, -1, *blk.shape[2:]).sum(1))
        acc = out[:u, r0 : r0 + len(gk)]
        for i, di in enumerate(rows):
            acc.addmm_(di[:u], gk[:, i].flatten(1).T)
        r0 += len(gk)
    return out.double().cpu()


def product_bound(terms: int, dtype: torch.dtype) -> float:
    """``gamma_K = K u / (1 - K u)``: a sum of ``K`` products in ``dtype`` (unit roundoff ``u``) is within
    ``gamma_K * sum |d_k g_k|`` of the exact sum (Higham, *Accuracy and Stability*, eq. 3.5), whatever
    order the matrix product adds them in."""
    ku = terms * torch.finfo(dtype).eps / 2
    return ku / (1 - ku)


def _node_columns(names: list[str], prefix: str) -> dict[str, np.ndarray]:
    """Per node name its ``{prefix}_layer`` / ``{prefix}_head`` (NaN where it has none)."""
    parsed = [nodes.parse(nm) for nm in names]
    nan = float("nan")
    return {f"{prefix}_layer": np.array([nan if p.layer is None else p.layer for p in parsed], dtype=float),
            f"{prefix}_head": np.array([nan if p.head is None else p.head for p in parsed], dtype=float)}


def edge_frame(graph: EdgeGraph, scores: Tensor, valid: Tensor, method: str) -> pd.DataFrame:
    """One row per valid (sender, receiver) with its names, layers, heads and score; sorted by ``abs_score``."""
    S, R = np.array(graph.senders, dtype=object), np.array(graph.receivers, dtype=object)
    ui, ri = np.nonzero(valid.numpy())
    vals = scores.detach().cpu().double().numpy()[ui, ri]
    sc, rc = _node_columns(list(S), "sender"), _node_columns(list(R), "receiver")
    r_node = np.array([nodes.receiver_node(r) for r in R], dtype=object)
    r_input = np.array([nodes.receiver_input(r) for r in R], dtype=object)
    df = pd.DataFrame(dict(sender=S[ui], receiver=R[ri], receiver_node=r_node[ri], input=r_input[ri],
                           sender_layer=sc["sender_layer"][ui], sender_head=sc["sender_head"][ui],
                           receiver_layer=rc["receiver_layer"][ri], receiver_head=rc["receiver_head"][ri], score=vals))
    df["abs_score"] = df["score"].abs()
    df["method"] = method
    return df.sort_values("abs_score", ascending=False, kind="stable").reset_index(drop=True)


@torch.no_grad()
def exact_edge_patch(
    model,
    pairs: PatchingPairs,
    metric: Optional[MetricFn] = None,
    edges: Optional[Sequence[tuple[str, str]]] = None,
    *,
    scale: float = 1.0,
    backend: str = "auto",
    batch_size: int = 512,
    progress: bool = False,
) -> pd.DataFrame:
    """Exact effect of patching single edges: the corrupted run, except that receiver ``r`` sees
    sender ``u``'s clean output instead of its corrupted one (``scale`` < 1 moves it only that
    fraction of the way -- ``scale -> 0`` gives the finite-difference derivative EAP estimates).

    Same columns as :func:`edge_attribution`, with ``score`` = patched minus corrupted metric.
    """
    pairs = as_pairs(pairs)
    dev = device(model)
    metric = metric if metric is not None else LogitDiff(pairs)
    runner = EdgeRunner(model, backend)
    graph = runner.graph
    clean, corr = pairs.clean_tokens.to(dev), pairs.corrupted_tokens.to(dev)
    b, n = clean.shape
    _, s_clean = runner.sender_cache(clean)
    corr_logits, s_corr = runner.sender_cache(corr)
    base = metric_values(metric, corr_logits, b).double()
    target = s_corr + scale * (s_clean - s_corr)  # what the receiver should see from u
    S, R = graph.senders, graph.receivers
    valid = runner.valid
    if edges is None:
        pairs_idx = [tuple(x) for x in np.argwhere(valid.numpy())]
    else:
        si, ri = {s: i for i, s in enumerate(S)}, {r: i for i, r in enumerate(R)}
        try:
            pairs_idx = [(si[u], ri[r]) for u, r in edges]
        except KeyError as e:
            raise PatchingError(f"unknown node {e.args[0]!r}; senders are like 'embed', 'a0.h1', 'm0' and receivers like 'a1.h0.q', 'm1', 'logits'") from None
        bad = [(S[u], R[r]) for u, r in pairs_idx if not valid[u, r]]
        if bad:
            raise PatchingError(f"not edges (the sender is not before the receiver): {bad[:3]}")
    scores = torch.zeros(valid.shape, dtype=torch.float64)
    G_max = 1 if runner.backend == "copies" else max(1, batch_size // (b * runner.H))
    for i in tqdm(range(0, len(pairs_idx), G_max), disable=not progress, desc="exact edge patching"):
        chunk = pairs_idx[i : i + G_max]
        G = len(chunk)
        w = torch.zeros(G, *valid.shape, dtype=torch.bool)
        for k, (u, r) in enumerate(chunk):
            w[k, u, r] = True
        logits, _ = runner.run(corr.repeat(G, 1), weights=w.to(dev), ablated=target)
        vals = metric_values(metric, logits, b).view(G, b).double().mean(-1) - base.mean()
        for k, (u, r) in enumerate(chunk):
            scores[u, r] = vals[k]
    mask = torch.zeros_like(valid)
    for u, r in pairs_idx:
        mask[u, r] = True
    return edge_frame(graph, scores, mask, method="exact" if scale == 1.0 else f"exact-scale{scale:g}")


__all__ = ["edge_attribution", "exact_edge_patch", "edge_frame", "product_bound"]
