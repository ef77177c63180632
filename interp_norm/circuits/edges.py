"""The edge graph of a model (senders -> receivers) and forward passes that intervene on single edges.

Edges (Syed et al.; Hanna et al.) connect *senders* -- the token+position embedding (``embed``),
each head's output ``z_h W_O[h]`` (``a{l}.h{h}``) and each MLP's output (``m{l}``) -- to
*receivers*: each head's query, key and value input separately (``a{l}.h{h}.q`` / ``.k`` /
``.v``), each MLP's input (``m{l}``) and the unembedding (``logits``, the last residual).
Because the residual stream is a sum, a receiver's input is the sum of the senders before it
(plus constant biases), so an intervention on edge ``u -> r`` shifts ``r``'s input alone.

:class:`EdgeRunner` reaches the per-receiver inputs with one of two backends:

* ``"split"``: a twin of our model built with ``use_split_qkv_input=True`` (same weights), whose
  ``hook_q_input/k_input/v_input`` hold one copy of the residual per head; MLP inputs are reached
  by subtracting at ``hook_resid_mid`` and adding back at ``hook_resid_post``.
* ``"copies"``: any TransformerLens-protocol model (e.g. ``TransformerBridge.boot_native``, which
  cannot split its q/k/v inputs): the batch is repeated ``1 + 3*n_heads`` times per pass; copy
  ``1 + 3h + j`` carries the residual seen by head ``h``'s q/k/v input ``j`` and the main copy's
  ``hook_q/k/v`` take head ``h`` from it. Exact, at ``1 + 3*n_heads`` times the compute. With
  grouped k/v heads (Llama, Qwen3) the copies are one per query head and two per k/v head, and the
  main copy's ``hook_k/v`` (``[.., n_kv_heads, d_head]``) take k/v head ``g`` from its copy: the
  grouped weights are used as they are. Per layer, the copies are that layer's receivers
  (:class:`~interp_norm.circuits.edge_graph.EdgeGraph`'s layout; a pass carries as many as the
  layer with the most): a Gemma 4 ``k = v`` layer has no v hook, its k copy feeds keys and values;
  a KV-sharing layer has q copies alone, and reads the keys and values the source layer made from
  its own (corrected) k/v copies -- the model's cache carries an edge into the source's k/v receiver
  to every layer sharing it, and autograd carries their gradients back to it.

Gemma 4's per-layer-input branch is part of its layer's MLP node (sender and receiver;
:mod:`~interp_norm.circuits.edge_layer_input`, which also decides which bridges have edges).

A head's output is ``z_h W_O[h]`` through the block's update calibration (models with
``cfg.calibration == "paper"`` scale what attention adds to the residual), so the head outputs
sum to ``hook_attn_out`` minus the scaled bias.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from interp_norm.core import nodes
from interp_norm.anatomy import capabilities, original
from interp_norm.circuits._types import device, require_eval
from interp_norm.circuits.edge_graph import EdgeGraph
from interp_norm.circuits.edge_layer_input import Branch, check_hf_bridge, layer_scalars, scalar_paths
from interp_norm.circuits.edge_senders import block_or_final, capture_hooks, run_until, sender_blocks, sender_names
from interp_norm.circuits.edge_post_norm import (held_scale_head_deltas, linearised_head_deltas, post_attention_norms,
                                                 single_head_changes)
from interp_norm.errors import PatchingError
from interp_norm.core.hook_names import act_name
from interp_norm.core.nodes import QKV, receiver_node
from interp_norm.core.model import HookedNormTransformer



# ----------------------------------------------------------------------------- edge runner


@torch.no_grad()
def prune_edges(edges: set) -> set:
    """Keep the edges on some embed -> ... -> logits path: drop, until nothing changes, every edge
    whose sender is not reached from the embedding or whose receiver node reaches no logits.
    (The same rule as MIB's ``Graph.prune``.)"""
    edges = set(edges)
    while True:
        entered = {receiver_node(r) for _, r in edges} | {nodes.EMBED}
        leaves = {u for u, _ in edges} | {nodes.LOGITS}
        keep = {(u, r) for u, r in edges if u in entered and receiver_node(r) in leaves}
        if keep == edges:
            return edges
        edges = keep


def _resid_mid_feeds_mlp_only(model, branch: Branch = None, scalar: float = 1.0) -> bool:
    """Probe: does a change written at layer 0's ``hook_resid_mid`` reach the residual stream?

    In our models it does (the hook sits on the residual); in a TransformerBridge the name is an
    alias of ``ln2.hook_in`` and only the MLP sees the change. ``branch``: layer 0 also adds a
    per-layer-input term (Gemma 4), part of what the MLP node writes; ``scalar``: its ``layer_scalar``.
    """
    tokens = torch.arange(min(3, model.cfg.d_vocab, model.cfg.n_ctx), device=device(model)).unsqueeze(0)
    seen: dict[str, Tensor] = {}

    def mid(x: Tensor, hook: Any) -> Tensor:
        seen["mid"] = x.clone()
        return x + 1.0

    def keep(name: str):
        def f(x: Tensor, hook: Any) -> Tensor:
            seen[name] = x.clone()
            return x

        return f

    run_until(model, tokens, [  # block 0 alone: the rest of the pass tells nothing here
        (act_name("resid_mid", 0), mid), (act_name("mlp_out", 0), keep("mlp")), (act_name("resid_post", 0), keep("post")),
    ] + ([(branch[1], keep("branch"))] if branch else []), block_or_final(model, 1))
    residual = seen["post"] / scalar - seen["mlp"] - (seen["branch"] if branch else 0)
    if torch.allclose(residual, seen["mid"] + 1.0, atol=1e-4):
        return False
    if torch.allclose(residual, seen["mid"], atol=1e-4):
        return True
    raise PatchingError("cannot tell how this model's hook_resid_mid feeds its residual stream; edge interventions need that")


@torch.no_grad()
def _fires(model, name: str) -> bool:
    """Whether embedding-stage hook ``name`` fires before the first block (a rotary bridge has ``hook_pos_embed`` but never calls it)."""
    if name not in getattr(model, "hook_dict", {}):
        return False
    tokens = torch.arange(min(3, model.cfg.d_vocab, model.cfg.n_ctx), device=device(model)).unsqueeze(0)
    seen: dict = {}
    run_until(model, tokens, capture_hooks([name], seen), block_or_final(model, 0))
    return name in seen


def out_weight(model, layer: int, la: Any = None) -> Tensor:
    """[H, d_head, d_model] output weight of attention ``layer``, detached. A bridge's ``W_O`` splits with the
    config's d_head; a layer with its own (``la``, its anatomy: Gemma 4's global layers) has its wrapped
    projection read instead."""
    attn = model.blocks[layer].attn
    if la is None or la.d_head == model.cfg.d_head:
        return attn.W_O.detach()
    w = original(attn).o_proj.weight.detach()  # [d_model, H * d_head]
    return w.view(w.shape[0], la.n_heads, la.d_head).permute(1, 2, 0)


class EdgeRunner:
    """Forward passes with per-receiver interventions (see module docstring for the backends)."""

    def __init__(self, model, backend: str = "auto"):
        require_eval(model)
        cfg = model.cfg
        self.model = model
        self.L, self.H = cfg.n_layers, cfg.n_heads
        layout, anat, self.branch = check_hf_bridge(model)  # branch: Gemma 4's per-layer-input term, part of m{l}
        self.post_norms = [None] * self.L if anat is None else post_attention_norms(model, anat)
        self.graph = EdgeGraph(self.L, self.H) if layout is None else EdgeGraph.of_layers(self.L, self.H, layout)
        self.valid = self.graph.valid()
        scalars = layer_scalars(model)  # Gemma 4's layer_scalar: each edge's factor (None: all 1)
        self.scale = None if scalars is None else scalar_paths(self.graph, scalars)
        if backend not in ("auto", "split", "copies"):
            raise PatchingError(f"backend must be 'auto', 'split' or 'copies', got {backend!r}")
        ours = capabilities(model).full_vocabulary  # our config rebuilds a twin with per-head q/k/v inputs
        if backend == "auto":
            split = ours or getattr(cfg, "use_split_qkv_input", False)
            backend = "split" if split and not self.graph.grouped else "copies"
        if backend == "split" and self.graph.grouped:
            raise PatchingError("backend='split' gives every head its own q, k and v input; with grouped k/v heads (or layers "
                                "without k/v inputs of their own) use backend='copies'")
        if backend == "split" and not ours and not getattr(cfg, "use_split_qkv_input", False):
            raise PatchingError(
                "backend='split' needs per-head q/k/v input hooks (use_split_qkv_input); this model has none -- use backend='copies'"
            )
        self.backend = backend
        self.run_model = model
        if backend == "split" and ours and not cfg.use_split_qkv_input:
            p0 = next(model.parameters())
            twin = HookedNormTransformer(cfg.replace(use_split_qkv_input=True)).to(p0.device, p0.dtype)
            twin.load_state_dict(model.state_dict())
            self.run_model = twin.eval()
        self.W_O = [out_weight(model, l, None if anat is None else anat.layers[l]) for l in range(self.L)]  # per layer [H, dh, d] (dh may differ per layer)
        self.b_O = [getattr(model.blocks[l].attn, "b_O", None) for l in range(self.L)]
        self.last_sums: dict[int, Tensor] = {}  # post-norm layers' pre-norm attention outputs in the last run
        # what attention adds to the residual is attn.out(z) through the block's update calibration
        self.update_calib = [getattr(blk, "calib_attn_out", None) for blk in model.blocks]
        self.mid_feeds_mlp_only = _resid_mid_feeds_mlp_only(self.run_model, self.branch[0], 1.0 if scalars is None else scalars[0])
        # rotary models (a Llama/Qwen3 bridge) never fire hook_pos_embed: the embed sender is the token embedding
        self.has_pos = ours or _fires(self.run_model, act_name("pos_embed"))

    # -- sender outputs --------------------------------------------------------------------
    def senders_from_cache(self, cache) -> Tensor:
        """[U, b, n, d] sender outputs from an ActivationCache of a plain run."""
        return torch.cat([out for _, out in sender_blocks(self, cache)])

    @property
    def sender_names(self) -> set[str]:
        """The hooks :meth:`senders_from_cache` reads."""
        return set(sender_names(self))

    def head_outputs(self, layer: int, z: Tensor) -> Tensor:
        """[H, b, n, d]: what each head of ``layer`` adds to the residual stream, from its ``z``."""
        res = torch.einsum("bphd,hdm->hbpm", z, self.W_O[layer].to(z.dtype))
        calib = self.update_calib[layer]
        return res if calib is None else calib(res)

    @property
    def has_post_norms(self) -> bool:
        return any(p is not None for p in self.post_norms)

    def linearised(self, delta: Tensor, sums: dict[int, Tensor], held: bool = False) -> Tensor:
        """``delta`` [U, B, n, d] of sender differences with each post-norm layer's head rows replaced by
        the norm's Jacobian at ``sums[l]`` (that layer's pre-norm attention output [B, n, d] in the run
        differentiated, :attr:`last_sums`) applied to them: their first-order change of the residual.
        ``held`` (``norm="frozen"``): the Jacobian with the norm's scale held at its value at ``sums[l]``,
        the scale the freeze hooks hold in that run's backward (:func:`held_scale_head_deltas`)."""
        through = held_scale_head_deltas if held else linearised_head_deltas
        out = delta.clone()
        for l, norm in enumerate(self.post_norms):
            if norm is not None:
                hs = slice(self.graph.sender_index(l, "head"), self.graph.sender_index(l, "head") + self.H)
                out[hs] = through(norm, delta[hs], sums[l])
        return out

    def sender_cache(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """(logits, senders [U, b, n, d]) of a plain run."""
        names = self.sender_names
        with torch.no_grad():
            logits, cache = self.model.run_with_cache(tokens, names_filter=lambda nm: nm in names)
        return logits, self.senders_from_cache(cache)

    # -- one intervened pass ---------------------------------------------------------------
    def run(
        self,
        tokens: Tensor,
        weights: Optional[Tensor] = None,
        ablated: Optional[Tensor] = None,
        leaves: bool = False,
        embed_mix: Optional[tuple[Tensor, Tensor, Tensor]] = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Logits of ``tokens`` [B, n] with receiver inputs corrected by ablated senders.

        ``weights`` [G, U, R] (G groups of B // G rows, one circuit/edge set each) and ``ablated``
        [U, B // G, n, d]: receiver ``r`` of group ``g`` sees its input minus
        ``sum_u weights[g, u, r] * (u_now - ablated_u)``, where ``u_now`` is sender ``u``'s output
        in this very pass. ``leaves``: add zero tensors requiring grad at every receiver input and
        return them (``[R, B, n, d]`` after stacking) to read ``dM/d(receiver input)``.
        ``embed_mix`` = (e_corr, e_clean, alphas [m]): the token embedding of the m blocks of
        rows is ``e_corr + alpha (e_clean - e_corr)`` (integrated gradients).
        """
        edge_pass = _EdgePass(self, tokens.shape, weights, ablated, leaves=leaves, embed_mix=embed_mix)
        toks = tokens.repeat(edge_pass.C, 1) if edge_pass.copies else tokens
        logits = self.run_model.run_with_hooks(toks, fwd_hooks=edge_pass.hooks())
        self.last_sums = edge_pass.sums
        if edge_pass.copies:
            logits = logits.view(edge_pass.C, edge_pass.B, *logits.shape[1:])[0]
        return logits, edge_pass.leaf

    def receiver_grads(self, leaf: dict[str, Tensor], grads: Sequence[Tensor]) -> Tensor:
        """Stack leaf gradients into [R, B, n, d] in receiver order."""
        gd = dict(zip(leaf.keys(), grads))
        L, H = self.L, self.H
        out = []
        for l in range(L):
            if self.backend == "copies":
                a = gd[f"attn{l}"]  # [A, B, n, d] in receiver order
                out += list(a)
            else:
                per_j = [gd[f"attn{l}.{j}"] for j in range(3)]  # [B, n, H, d]
                out += [per_j[j][:, :, h] for h in range(H) for j in range(3)]
            out.append(gd[f"mlp{l}"])
        out.append(gd["logits"])
        return torch.stack(out)



class _EdgePass:
    """The state of one :meth:`EdgeRunner.run` pass and its hooks (bound methods, per layer via
    ``functools.partial``): sender differences filled in as the pass computes them, the leaves."""

    def __init__(self, runner: EdgeRunner, shape: torch.Size, weights: Optional[Tensor], ablated: Optional[Tensor],
                 *, leaves: bool, embed_mix: Optional[tuple[Tensor, Tensor, Tensor]]):
        self.runner, self.graph = runner, runner.graph
        self.L, self.H = runner.L, runner.H
        self.B, self.n = shape
        self.copies = runner.backend == "copies"
        self.C = 1 + self.graph.max_attn_receivers if self.copies else 1
        self.G = 1 if weights is None else weights.shape[0]
        if self.B % self.G:
            raise PatchingError("rows must split evenly into the weight groups")
        self.Bg = self.B // self.G
        self.U = len(self.graph.senders)
        self.weights, self.ablated, self.leaves, self.embed_mix = weights, ablated, leaves, embed_mix
        # (u_now - ablated_u) for each sender, filled in as the pass computes the senders
        self.diffs: Optional[Tensor] = None
        self.embed_now: Optional[Tensor] = None
        self.leaf: dict[str, Tensor] = {}
        self.attn_corr: dict[int, Optional[Tensor]] = {}  # split backend: layer -> [H, 3, B, n, d], once per layer
        self.mlp_shift: dict[int, Optional[Tensor]] = {}  # layer -> the MLP receiver's shift, undone at resid_post
        self.mlp_now: dict[int, Tensor] = {}  # layer -> its MLP's output, until its per-layer-input branch adds to it
        self.sums: dict[int, Tensor] = {}  # post-norm layer -> its pre-norm attention output (detached)

    def hooks(self) -> list[tuple[str, Callable]]:
        g = self.graph
        hooks: list[tuple[str, Callable]] = [(act_name("embed"), self.hook_embed)]
        if self.runner.has_pos:
            hooks.append((act_name("pos_embed"), self.hook_pos))
        for l in range(self.L):
            r_attn, u_attn = g.attn_receivers(l), g.n_senders_before(l, "attn")
            if self.copies:
                hooks.append((act_name("resid_pre", l), partial(self.h_resid_pre, l=l, r_attn=r_attn, u_attn=u_attn)))
                hooks += [(act_name(QKV[j], l), partial(self.h_qkv, copies=c)) for j, c in self.copy_of(l).items()]
            else:
                hooks += [(act_name(f"{nm}_input", l), partial(self.h_input, l=l, j=j, r_attn=r_attn, u_attn=u_attn))
                          for j, nm in enumerate(QKV)]
            hooks += [
                (act_name("z", l), partial(self.h_z, l=l)),
                (act_name("resid_mid", l), partial(self.h_resid_mid, l=l)),
                (act_name("mlp_out", l), partial(self.h_mlp_out, l=l)),
                (act_name("resid_post", l), partial(self.h_resid_post, l=l)),
            ]
            b = self.runner.branch[l]
            if b:
                hooks += [(b[0], partial(self.h_branch_in, l=l)), (b[1], partial(self.h_branch_out, l=l))]
        return hooks

    # -- bookkeeping -----------------------------------------------------------------------
    def copy_of(self, layer: int) -> dict[int, list[int]]:
        """Copies backend: for each input j (q/k/v) ``layer`` reads, the copy carrying each index of that
        input's head axis (a layer without v -- or k and v -- projections of its own has no hook there)."""
        slots = self.graph.attn_slots(layer)
        kv, inputs = self.graph.layer_layout(layer)
        js = ["qkv".index(c) for c in inputs]
        return {j: [1 + slots.index((j, i)) for i in range(self.H if j == 0 else kv)] for j in js}

    def corr_for(self, r_slice: slice, u_avail: int) -> Optional[Tensor]:
        """[len(r), B, n, d] corrections for receivers r_slice from the first u_avail senders."""
        if self.weights is None:
            return None
        w = self.weights[:, :u_avail, r_slice]
        if not w.any():
            return None
        assert self.diffs is not None  # every sender before a receiver ran earlier in the pass
        d = self.diffs[:u_avail]
        wd = w.to(d.dtype)
        if self.runner.scale is not None:  # the layer scalars on each edge's path
            wd = wd * self.runner.scale[:u_avail, r_slice].to(d.device, d.dtype)
        return torch.einsum("gur,ugbnd->rgbnd", wd, d).reshape(w.shape[-1], self.B, self.n, -1)

    def put(self, u: int, now: Tensor, diff: bool = False) -> None:
        """Record sender u's output in this pass (only needed when there are corrections); ``diff``:
        ``now`` is already its change (``u_now - ablated_u``)."""
        if self.weights is None:
            return
        assert self.ablated is not None
        if self.diffs is None:
            self.diffs = now.new_empty(self.U, self.G, self.Bg, self.n, now.shape[-1])
        now = now.view(self.G, self.Bg, self.n, -1)
        self.diffs[u] = now if diff else now - self.ablated[u].to(now.dtype)

    def new_leaf(self, key: str, like: Tensor) -> Tensor:
        t = torch.zeros_like(like, requires_grad=True)
        self.leaf[key] = t
        return t

    def main(self, x: Tensor) -> Tensor:
        return x.view(self.C, self.B, *x.shape[1:])[0] if self.copies else x

    def shift_main(self, x: Tensor, shift: Optional[Tensor]) -> Tensor:
        """``x`` with ``shift`` added to the main copy (all of ``x`` on the split backend)."""
        if shift is None:
            return x
        if self.copies:
            xv = x.view(self.C, self.B, self.n, -1)
            return torch.cat([(xv[0] + shift).unsqueeze(0), xv[1:]]).reshape(x.shape)
        return x + shift

    # -- hooks -----------------------------------------------------------------------------
    def hook_embed(self, x: Tensor, hook: Any) -> Tensor:
        B, n, C = self.B, self.n, self.C
        if self.embed_mix is not None:
            e_corr, e_clean, al = self.embed_mix
            m = len(al)
            mix = e_corr.unsqueeze(0) + al.view(m, 1, 1, 1).to(e_corr.dtype) * (e_clean - e_corr).unsqueeze(0)
            x = mix.reshape(1, B, n, -1).expand(C, B, n, mix.shape[-1]).reshape(x.shape)
        self.embed_now = self.main(x)
        if not self.runner.has_pos:
            self.put(0, self.embed_now)
        return x

    def hook_pos(self, x: Tensor, hook: Any) -> Tensor:
        assert self.embed_now is not None  # hook_embed fires first
        self.put(0, self.embed_now + self.main(x))
        return x

    def h_resid_pre(self, x: Tensor, hook: Any, *, l: int, r_attn: slice, u_attn: int) -> Tensor:
        """Copies backend: copy ``1 + i`` carries the layer's attention receiver i's input, corrected (copies
        past the layer's receivers, where another layer has more, carry the main copy's)."""
        B, n = self.B, self.n
        m0 = x.view(self.C, B, n, -1)[0]
        corr = self.corr_for(r_attn, u_attn)
        A = r_attn.stop - r_attn.start
        rest = m0.unsqueeze(0).expand(A, B, n, m0.shape[-1])
        if corr is not None:
            rest = rest - corr
        if self.leaves:
            rest = rest + self.new_leaf(f"attn{l}", rest)
        pad = [m0.unsqueeze(0).expand(self.C - 1 - A, B, n, m0.shape[-1])] if A < self.C - 1 else []
        return torch.cat([m0.unsqueeze(0), rest, *pad]).reshape(x.shape)

    def h_qkv(self, x: Tensor, hook: Any, *, copies: list[int]) -> Tensor:
        """Copies backend: the main copy's q/k/v of (k/v) head i come from copy ``copies[i]``, receiver (j, i)'s."""
        xv = x.view(self.C, self.B, *x.shape[1:])  # [C, B, n, heads of input j, dh]
        copies = torch.tensor(copies, device=x.device)  # type: ignore[assignment]  # the same indices, on x's device
        picked = xv[copies, :, :, torch.arange(len(copies), device=x.device)]  # [heads, B, n, dh]
        return torch.cat([picked.permute(1, 2, 0, 3).unsqueeze(0), xv[1:]]).reshape(x.shape)

    def h_input(self, x: Tensor, hook: Any, *, l: int, j: int, r_attn: slice, u_attn: int) -> Tensor:
        """Split backend: x [B, n, H, d]; corrections for receivers (h, j) over h."""
        if l not in self.attn_corr:
            c = self.corr_for(r_attn, u_attn)
            self.attn_corr[l] = None if c is None else c.view(self.H, 3, self.B, self.n, -1)
        c = self.attn_corr[l]
        if c is not None:
            x = x - c[:, j].permute(1, 2, 0, 3)
        if self.leaves:
            x = x + self.new_leaf(f"attn{l}.{j}", x)
        return x

    def h_z(self, x: Tensor, hook: Any, *, l: int) -> Tensor:
        norm, bias = self.runner.post_norms[l], self.runner.b_O[l]
        bias = None if bias is None else bias.detach()
        if norm is not None:
            res = self.runner.head_outputs(l, self.main(x).detach())
            self.sums[l] = res.sum(0) if bias is None else res.sum(0) + bias.to(res.dtype)
        if self.weights is not None:
            res = self.runner.head_outputs(l, self.main(x))
            base = self.graph.sender_index(l, "head")
            if norm is not None:  # each head's exact single-head change through the post-norm
                assert self.ablated is not None
                shape = (self.H, self.G, self.Bg, self.n, -1)
                res = single_head_changes(norm, res.view(shape), self.ablated[base : base + self.H].unsqueeze(1),
                                          bias).reshape(res.shape)
                for h in range(self.H):
                    self.put(base + h, res[h], diff=True)
            else:
                for h in range(self.H):
                    self.put(base + h, res[h])
        return x

    def h_resid_mid(self, x: Tensor, hook: Any, *, l: int) -> Tensor:
        r_mlp = self.graph.receiver_index(l, "mlp")
        c = self.corr_for(slice(r_mlp, r_mlp + 1), self.graph.n_senders_before(l, "mlp"))
        shift = None if c is None else -c[0]
        if self.leaves:
            d = self.new_leaf(f"mlp{l}", self.main(x))
            shift = d if shift is None else shift + d
        self.mlp_shift[l] = shift
        return self.shift_main(x, shift)

    def h_mlp_out(self, x: Tensor, hook: Any, *, l: int) -> Tensor:
        if self.runner.branch[l]:  # the sender is complete once the per-layer-input branch has written
            self.mlp_now[l] = self.main(x)
        else:
            self.put(self.graph.sender_index(l, "mlp"), self.main(x))
        return x

    def h_branch_in(self, x: Tensor, hook: Any, *, l: int) -> Tensor:
        """The per-layer-input branch reads the MLP receiver's input: the same shift as the MLP's (where the
        shift at ``hook_resid_mid`` reached only the MLP, as on a TransformerBridge)."""
        return self.shift_main(x, self.mlp_shift.get(l)) if self.runner.mid_feeds_mlp_only else x

    def h_branch_out(self, x: Tensor, hook: Any, *, l: int) -> Tensor:
        self.put(self.graph.sender_index(l, "mlp"), self.mlp_now.pop(l) + self.main(x))
        return x

    def h_resid_post(self, x: Tensor, hook: Any, *, l: int) -> Tensor:
        shift = self.mlp_shift.get(l)
        # the residual path must not see the MLP receiver's shift: undo it, unless the model's
        # hook_resid_mid only feeds the MLP (a TransformerBridge aliases it to ln2.hook_in)
        out_shift = None if shift is None or self.runner.mid_feeds_mlp_only else -shift
        if l == self.L - 1:
            c = self.corr_for(slice(-1, None), self.U)
            s2 = None if c is None else -c[0]
            if self.leaves:
                d = self.new_leaf("logits", self.main(x))
                s2 = d if s2 is None else s2 + d
            if s2 is not None:
                out_shift = s2 if out_shift is None else out_shift + s2
        return self.shift_main(x, out_shift)


__all__ = ["EdgeGraph", "EdgeRunner", "receiver_node", "QKV"]
