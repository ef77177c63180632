"""Every edge receiver's gradient from one plain backward pass of a Pre-Norm bridge.

EAP scores edge ``u -> r`` with ``dM/d(input of r)``, the gradient at receiver ``r``'s own copy of the
residual. The ``copies`` backend of :class:`~interp_norm.circuits.edges.EdgeRunner` gets it by running
``1 + 3 x n_heads`` copies of every row through the whole model (37x the rows on GPT-2 small), though a
copy is read only by its own head's q, k or v projection. Here one pass of the rows themselves does:
in a Pre-Norm block a head's q input is ``W_Q[h] . norm(x)`` (x the block's residual), so

    dM/d(q input of head h) = J_norm(x)^T  W_Q[h]^T  dM/d(q_h)

with ``dM/d(q_h)`` the gradient at the q projection's output (before any q/k norm or rotation: those
stay inside the backward), ``W_Q[h]`` the projection's rows of head ``h`` and ``J_norm(x)^T`` applied
by autograd through the block's own norm module on a batch of the receivers' vectors. Likewise a
k/v head's k and v inputs, the MLP's (its norm, the gradient at the MLP's input) and the logits'
(the final norm, the gradient at the unembedding's input).

It applies where that identity is what the model computes; :func:`fast_receivers` checks each
block on the pass itself (the projection input equals the norm of the residual, the projection
is affine with the weight read here) and returns None otherwise -- post-norm heads (OLMo-2),
frozen norms or patterns, a hook on the model -- and the copies backend runs. The pass runs the
bridge's GELU and norms through the one-kernel stand-ins node EAP's re-run uses (``subs``,
:mod:`~interp_norm.circuits.exact.fused_elementwise`: each probed equal to its module within rounding);
the receivers' norm Jacobians are still checked against the model's own norm modules.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

import torch
from torch import Tensor

from interp_norm.anatomy import capabilities, norm_eps
from interp_norm.circuits._types import metric_values
from interp_norm.circuits.attribution import _logits_at, _read_columns
from interp_norm.circuits.edge_senders import capture_hooks, sender_names
from interp_norm.circuits.exact.block_steps import _has_hooks
from interp_norm.circuits.exact.fused_elementwise import Substitute, fused
from interp_norm.circuits.norm_modes import quiet
from interp_norm.core.hook_names import act_name
from interp_norm.core.nodes import QKV


def _parts(model) -> Optional[list]:
    """Per block: (pre-attention norm, (q, k, v) projection modules, pre-MLP norm), or None if the
    bridge is not laid out so."""
    out = []
    for blk in model.blocks:
        attn = getattr(blk, "attn", None)
        projs = [getattr(attn, j, None) for j in QKV]
        norms = (getattr(blk, "ln1", None), getattr(blk, "ln2", None))
        if any(not isinstance(m, torch.nn.Module) for m in (*projs, *norms, getattr(blk, "mlp", None))):
            return None
        if any(not isinstance(getattr(getattr(p, "original_component", None), "weight", None), Tensor) for p in projs):
            return None
        out.append((norms[0], projs, norms[1]))
    return out if isinstance(getattr(model, "ln_final", None), torch.nn.Module) else None


def applies(model, runner, norm: str, pattern: str) -> bool:
    """Can :func:`fast_receivers` replace the copies backend here (it still checks each pass)?"""
    if norm != "live" or pattern != "live" or runner.backend != "copies" or runner.has_post_norms:
        return False
    if not capabilities(model).hf_original or _has_hooks(model):
        return False
    # every layer's q, k and v projections read its own residual (no KV sharing, no v = k): _head_vectors
    if any(runner.graph.layer_layout(l)[1] != "qkv" for l in range(runner.L)):
        return False
    return _parts(model) is not None


def fast_receivers(model, runner, tokens: Tensor, embed_mix: tuple[Tensor, Tensor, Tensor], metric: Any,
                   br: int, *, capture: Optional[dict] = None,
                   subs: Sequence[Substitute] = ()) -> Optional[Iterator[Tensor]]:
    """Gradients of ``metric`` (summed over rows) at every receiver's input, in
    :attr:`EdgeGraph.receivers` order as blocks of ``[receivers, rows, n, d]`` (:func:`_assemble`), for the corrupted ``tokens`` [br, n] at the integration points
    of ``embed_mix``; None where a block is not what this module assumes. ``capture``: filled with the
    sender activations (:func:`~interp_norm.circuits.edge_senders.sender_names`) of the first
    integration point's rows -- the corrupted run itself where that point is 0. ``subs``: stand-ins the
    pass runs for the modules they replace."""
    parts = _parts(model)
    assert parts is not None
    e_corr, e_clean, al = embed_mix
    m = len(al)
    seen: dict[str, Tensor] = {}

    def embed(x: Tensor, hook: Any) -> Tensor:
        mix = e_corr.unsqueeze(0) + al.view(m, 1, 1, 1).to(e_corr.dtype) * (e_clean - e_corr).unsqueeze(0)
        if capture is not None:
            capture[act_name("embed")] = mix[0].detach()
        return mix.reshape(x.shape)

    hooks: list[tuple[str, Any]] = [(act_name("embed"), embed)]
    if capture is not None:
        hooks += capture_hooks(sender_names(runner)[1:], capture, rows=br)
    cols, n = _read_columns(model, metric, br, tokens.shape[1], full=True)
    with fused(list(subs)):  # entered before the capture hooks go on the norms (fused skips hooked modules)
        handles = _capture(model, parts, seen)  # before _logits_at's hooks: "uin" is the whole unembedding input
        try:
            with torch.enable_grad(), quiet(), _logits_at(model, cols, n, n):  # unembed the read positions only
                logits = model.run_with_hooks(tokens.repeat(m, 1), fwd_hooks=hooks)
        finally:
            for h in handles:
                h.remove()
    if not _wired(model, parts, seen):
        return None
    keys = [f"{j}.{l}" for l in range(len(parts)) for j in QKV] + [f"mlp.{l}" for l in range(len(parts))] + ["yf"]
    with torch.enable_grad():
        total = metric_values(metric, logits, br).sum()
        got = torch.autograd.grad(total, [seen[k] for k in keys], allow_unused=True)
    if any(g is None for g in got):  # a captured tensor the model did not go on with
        return None
    return _assemble(model, runner, parts, seen, dict(zip(keys, got)))


def _capture(model, parts: list, seen: dict) -> list:
    """Module hooks recording, in the next pass, each norm's input and output, each projection's
    input and output and the MLP's and unembedding's inputs (the tensors the model goes on with)."""

    def out_hook(key_in: str, key_out: str):
        def hook(module, args, out):
            seen[key_in], seen[key_out] = args[0] if args else None, out

        return hook

    def in_hook(key: str):
        def hook(module, args):
            seen[key] = args[0] if args else None

        return hook

    handles = [model.ln_final.register_forward_hook(out_hook("xf", "yf")),
               model.unembed.register_forward_pre_hook(in_hook("uin"))]
    for l, (ln1, projs, ln2) in enumerate(parts):
        handles += [ln1.register_forward_hook(out_hook(f"x1.{l}", f"y1.{l}")),
                    ln2.register_forward_hook(out_hook(f"x2.{l}", f"y2.{l}")),
                    model.blocks[l].mlp.register_forward_pre_hook(in_hook(f"mlp.{l}"))]
        handles += [p.register_forward_hook(out_hook(f"{j}in.{l}", f"{j}.{l}")) for j, p in zip(QKV, projs)]
    return handles


def _wired(model, parts: list, seen: dict) -> bool:
    """Each block's q/k/v projections read its first norm's output, its MLP its second norm's, the
    unembedding the final norm's (the same tensors, or equal), and every hook fired."""
    need = ["xf", "yf", "uin"] + [f"{k}.{l}" for l in range(len(parts))
                                  for k in ("x1", "y1", "x2", "y2", "mlp", "q", "k", "v", "qin", "kin", "vin")]
    if any(k not in seen or not torch.is_tensor(seen[k]) for k in need) or not torch.equal(seen["uin"], seen["yf"]):
        return False
    with torch.no_grad():
        for l in range(len(parts)):
            y1 = seen[f"y1.{l}"]
            if any(not torch.equal(seen[f"{j}in.{l}"], y1) for j in QKV):
                return False
            if not torch.equal(seen[f"y2.{l}"], seen[f"mlp.{l}"]):
                return False
            for j, proj in zip(QKV, parts[l][1]):  # the projection is the affine map of the weight read here
                lin, out = proj.original_component, seen[f"{j}.{l}"]  # (on the first row: a map, not the data)
                want = torch.nn.functional.linear(y1[:1], lin.weight, getattr(lin, "bias", None))
                if out.shape[0] != y1.shape[0] or out[:1].numel() != want.numel() or not torch.allclose(
                        out[:1].reshape(want.shape), want, rtol=1e-4, atol=1e-5):
                    return False
        return True


def _through_norm(norm: torch.nn.Module, x: Tensor, vecs: Tensor, own: bool = False) -> Tensor:
    """``J_norm(x)^T v`` for each of ``vecs`` [k, rows, n, d]. A LayerNorm or RMSNorm by its closed
    form, checked on the first vector against autograd through the model's norm; otherwise (or if the
    check fails: another gain convention, say) the norm run once and its vector-Jacobian product
    mapped over the k vectors. ``own``: ``vecs`` is the caller's to overwrite (no copy of its size)."""
    with torch.enable_grad(), quiet():
        vjp = torch.func.vjp(norm, x.detach())[1]
        first = _closed_form(norm, x.detach(), vecs[:1].clone())
        if first is not None:
            (ref,) = vjp(vecs[0].to(x.dtype))
            if torch.allclose(first[0], ref.detach(), rtol=1e-4, atol=1e-6 * float(ref.detach().abs().max())):
                mine = vecs if own and vecs.dtype == torch.float32 else vecs.to(torch.float32, copy=True)
                closed = _closed_form(norm, x.detach(), mine)
                assert closed is not None
                return closed.to(x.dtype)
        (g,) = torch.func.vmap(vjp)(vecs.to(x.dtype))
    return g


def _closed_form(norm: torch.nn.Module, x: Tensor, u: Tensor) -> Optional[Tensor]:
    """The transposed Jacobian of ``w * (x - mean) / std + b`` (LayerNorm) or ``w * x / rms`` (RMSNorm)
    at ``x`` applied to ``u`` [k, rows, n, d] (float32, overwritten: a few passes over it, no
    temporaries of its size), read from the wrapped module's weight and epsilon; None if it has
    neither."""
    mod = getattr(norm, "original_component", norm)
    w = getattr(mod, "weight", None)
    eps = norm_eps(mod)
    if not isinstance(w, Tensor) or eps is None:
        return None
    xf = x.float()
    layer = isinstance(mod, torch.nn.LayerNorm) or getattr(mod, "bias", None) is not None
    xc = xf - xf.mean(-1, keepdim=True) if layer else xf
    r = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    xh = xc * r
    u.mul_(w.detach().float())
    proj = torch.einsum("kbnd,bnd->kbn", u, xh).div_(u.shape[-1]).unsqueeze(-1)  # mean(u * xh)
    if layer:
        u.sub_(u.mean(-1, keepdim=True))
    return u.addcmul_(xh, proj, value=-1).mul_(r)


def _head_vectors(runner, layer: int, projs: list, grads: list[Tensor]) -> Tensor:
    """[A, rows, n, d]: each attention receiver's ``W[h]^T dM/d(out_h)`` (its head's rows of its
    projection's weight), in :meth:`EdgeGraph.attn_slots` order of ``layer``: one batched product per
    projection, written into the receivers' interleaved slots (each head's product lands in a
    contiguous [rows * n, d] block, so the weights are read as views, not stacked); other slot orders
    stack the heads' rows."""
    Ws = [p.original_component.weight.detach() for p in projs]  # [heads * d_head, d_model]
    dh = Ws[0].shape[0] // runner.H  # this layer's d_head (Gemma 4's global layers have their own)
    slots = runner.graph.attn_slots(layer)
    rows, n = grads[0].shape[:2]
    heads = [W.shape[0] // dh for W in Ws]
    if heads[0] == heads[1] == heads[2] and slots == [(j, h) for h in range(heads[0]) for j in range(3)]:
        out = grads[0].new_empty(heads[0], 3, rows * n, Ws[0].shape[1])
        for j in range(3):
            G = grads[j].reshape(rows * n, heads[0], dh).transpose(0, 1)  # [heads, rows * n, d_head]
            torch.bmm(G, Ws[j].view(heads[0], dh, -1).to(G.dtype), out=out[:, j])
        return out.view(3 * heads[0], rows, n, -1)
    gs = [g.reshape(*g.shape[:2], -1, dh) for g in grads]  # [rows, n, heads, d_head] per input
    G = torch.stack([gs[j][:, :, i] for j, i in slots])  # [A, rows, n, d_head]
    W = torch.stack([Ws[j][i * dh : (i + 1) * dh] for j, i in slots]).to(G.dtype)  # [A, d_head, d_model]
    return torch.bmm(G.flatten(1, 2), W).view(*G.shape[:3], -1)


def _assemble(model, runner, parts: list, seen: dict, grads: dict) -> Iterator[Tensor]:
    """The receivers' gradients in :attr:`EdgeGraph.receivers` order, one block at a time (so that a
    block is scored while it is in cache): per layer its attention receivers
    (:meth:`EdgeGraph.attn_slots`) [A, rows, n, d], its MLP [1, ...]; then the logits [1, ...]."""
    for l, (ln1, projs, ln2) in enumerate(parts):
        vecs = _head_vectors(runner, l, projs, [grads[f"{j}.{l}"] for j in QKV])
        yield _through_norm(ln1, seen[f"x1.{l}"], vecs, own=True)
        yield _through_norm(ln2, seen[f"x2.{l}"], grads[f"mlp.{l}"].unsqueeze(0))
    yield _through_norm(runner.model.ln_final, seen["xf"], grads["yf"].unsqueeze(0))


__all__ = ["applies", "fast_receivers"]
