"""Attribution patching (EAP) and EAP-IG at node and edge level, and exact edge patching.

Attribution patching linearises activation patching: the effect of patching activation ``a``
from the clean run into the corrupted run is estimated by ``(a_clean - a_corr) . dM/da`` with the
gradient taken on the corrupted run (TransformerLens 4.x's "denoising" convention, so estimates
compare directly with :func:`~interp_norm.circuits.patching.activation_patch`). Cost: a clean
and a corrupted forward pass plus one backward pass. EAP-IG (``ig_steps = m > 1``) averages the
gradient over ``m`` points on the straight line between the corrupted and clean token
embeddings, ``alpha = k/m`` for ``k = 0..m-1`` (as Hanna et al.'s ``EAP-IG``; ``m = 1`` is EAP).

Edges (Syed et al.; Hanna et al.) connect *senders* -- the token+position embedding (``embed``),
each head's output ``z_h W_O[h]`` (``a{l}.h{h}``) and each MLP's output (``m{l}``) -- to
*receivers*: each head's query, key and value input separately (``a{l}.h{h}.q`` / ``.k`` /
``.v``), each MLP's input (``m{l}``) and the unembedding (``logits``, the last residual).
Because the residual stream is a sum, a receiver's input is the sum of the senders before it
(plus constant biases), and an edge's score is ``(u_clean - u_corr) . dM/d(input of r)``.

Two backends reach the per-receiver inputs:

* ``"split"``: a twin of our model built with ``use_split_qkv_input=True`` (same weights), whose
  ``hook_q_input/k_input/v_input`` hold one copy of the residual per head; MLP inputs are reached
  by subtracting at ``hook_resid_mid`` and adding back at ``hook_resid_post``.
* ``"copies"``: any TransformerLens-protocol model (e.g. ``TransformerBridge.boot_native``, which
  cannot split its q/k/v inputs): the batch is repeated ``1 + 3*n_heads`` times per pass; copy
  ``1 + 3h + j`` carries the residual seen by head ``h``'s q/k/v input ``j`` and the main copy's
  ``hook_q/k/v`` take head ``h`` from it. Exact, at ``1 + 3*n_heads`` times the compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from interp_norm.circuits.pairs import LogitDiff, PatchingPairs
from interp_norm.circuits.patching import (
    ACTIVATIONS,
    AXES,
    PatchResult,
    _device,
    _grid_cells,
    _require_eval,
    _validate_by,
    hook_name,
)
from interp_norm.errors import PatchingError

MetricFn = Callable[[Tensor], Tensor]
QKV = ("q", "k", "v")


# ----------------------------------------------------------------------------- metric helpers


def _metric_values(metric: MetricFn, logits: Tensor, b: int) -> Tensor:
    """Per-example metric for stacked copies: [R*b] (differentiable)."""
    R = logits.shape[0] // b
    if getattr(metric, "supports_stacked", False):
        return metric(logits)
    outs = [metric(logits[i * b : (i + 1) * b]) for i in range(R)]
    if outs[0].ndim == 0:
        raise PatchingError(
            "attribution needs a per-example metric (logits -> [batch]); a scalar metric cannot be "
            "split across the stacked integration steps"
        )
    return torch.cat(outs)


def _as_pairs(pairs: Any) -> PatchingPairs:
    if not isinstance(pairs, PatchingPairs):
        raise PatchingError("pass a PatchingPairs (see interp_norm.circuits.make_pairs or PatchingPairs(clean, corrupted))")
    return pairs


def _alphas(ig_steps: int) -> Tensor:
    if not isinstance(ig_steps, int) or ig_steps < 1:
        raise PatchingError(f"ig_steps must be a positive integer (1 = EAP), got {ig_steps!r}")
    return torch.arange(ig_steps, dtype=torch.float64) / ig_steps


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
    pairs = _as_pairs(pairs)
    _require_eval(model)
    if activation not in ACTIVATIONS:
        raise PatchingError(f"unknown activation {activation!r}; choose one of {list(ACTIVATIONS)}")
    kind = ACTIVATIONS[activation][0]
    _validate_by(kind, by, activation)
    dev = _device(model)
    metric = metric if metric is not None else LogitDiff(pairs)
    alphas = _alphas(ig_steps)
    cfg = model.cfg
    L, H = cfg.n_layers, cfg.n_heads
    clean, corr = pairs.clean_tokens.to(dev), pairs.corrupted_tokens.to(dev)
    b, n = clean.shape
    names = [hook_name(activation, l) for l in range(L)]
    want = set(names) | {"hook_embed"}
    with torch.no_grad():
        clean_logits, cc = model.run_with_cache(clean, names_filter=lambda nm: nm in want)
        corr_logits, xc = model.run_with_cache(corr, names_filter=lambda nm: nm in want)
        baseline = _metric_values(metric, corr_logits, b).double().cpu()
        clean_val = _metric_values(metric, clean_logits, b).double().cpu()
    e_clean, e_corr = cc["hook_embed"], xc["hook_embed"]
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

        hooks = [("hook_embed", embed_hook)] + [(nm, partial(leaf_hook, nm=nm)) for nm in names]
        with torch.enable_grad():
            logits = model.run_with_hooks(corr.repeat(m, 1), fwd_hooks=hooks)
            total = _metric_values(metric, logits, b).sum()
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
    axes = AXES[(kind, by)]
    sizes = dict(layer=L, pos=n, head=H, dest_pos=n, src_pos=n)
    per_example = est.reshape(b, -1).T + baseline.unsqueeze(0)  # [cells, b]
    values = per_example.mean(-1).view(*[sizes[a] for a in axes])
    cells = _grid_cells(axes, sizes)
    return PatchResult(
        activation=activation, by=by, axis_names=list(axes), values=values.float(),
        index_df=pd.DataFrame(cells.numpy(), columns=list(axes)), per_example=per_example,
        baseline=baseline, clean=clean_val, metric_name=getattr(metric, "name", "metric"),
        method="eap" if ig_steps == 1 else f"eap-ig{ig_steps}",
    )


# ----------------------------------------------------------------------------- edge graph


@dataclass(frozen=True)
class EdgeGraph:
    """Sender and receiver names of a model shape, and which (sender, receiver) pairs are edges."""

    n_layers: int
    n_heads: int

    @property
    def senders(self) -> list[str]:
        out = ["embed"]
        for l in range(self.n_layers):
            out += [f"a{l}.h{h}" for h in range(self.n_heads)] + [f"m{l}"]
        return out

    @property
    def receivers(self) -> list[str]:
        out = []
        for l in range(self.n_layers):
            out += [f"a{l}.h{h}.{j}" for h in range(self.n_heads) for j in QKV] + [f"m{l}"]
        return out + ["logits"]

    def sender_index(self, layer: int, what: str, head: int = 0) -> int:
        """Index of ``embed`` / head ``(layer, head)`` (what='head') / MLP ``layer`` (what='mlp')."""
        if what == "embed":
            return 0
        base = 1 + layer * (self.n_heads + 1)
        return base + head if what == "head" else base + self.n_heads

    def receiver_index(self, layer: int, what: str, head: int = 0, j: int = 0) -> int:
        if what == "logits":
            return self.n_layers * (3 * self.n_heads + 1)
        base = layer * (3 * self.n_heads + 1)
        return base + 3 * head + j if what == "head" else base + 3 * self.n_heads

    def n_senders_before(self, layer: int, what: str) -> int:
        """How many senders are computed before the attention ('attn') or MLP ('mlp') of ``layer``."""
        base = 1 + layer * (self.n_heads + 1)
        return base if what == "attn" else base + self.n_heads

    def valid(self) -> Tensor:
        """[n_senders, n_receivers] bool: u writes into the residual stream before r reads it."""
        U, R = len(self.senders), len(self.receivers)
        v = torch.zeros(U, R, dtype=torch.bool)
        for l in range(self.n_layers):
            r0 = self.receiver_index(l, "head")
            v[: self.n_senders_before(l, "attn"), r0 : r0 + 3 * self.n_heads] = True
            v[: self.n_senders_before(l, "mlp"), self.receiver_index(l, "mlp")] = True
        v[:, -1] = True
        return v

    def edges(self) -> list[tuple[str, str]]:
        s, r, v = self.senders, self.receivers, self.valid()
        return [(s[i], r[j]) for i, j in zip(*np.nonzero(v.numpy()))]


def receiver_node(receiver: str) -> str:
    """``a1.h2.q`` -> ``a1.h2``; MLP and logits receivers are their own node."""
    return receiver.rsplit(".", 1)[0] if receiver.count(".") == 2 else receiver


# ----------------------------------------------------------------------------- edge runner


@torch.no_grad()
def _resid_mid_feeds_mlp_only(model) -> bool:
    """Probe: does a change written at ``blocks.0.hook_resid_mid`` reach the residual stream?

    In our models it does (the hook sits on the residual); in a TransformerBridge the name is an
    alias of ``ln2.hook_in`` and only the MLP sees the change.
    """
    tokens = torch.arange(min(3, model.cfg.d_vocab, model.cfg.n_ctx), device=_device(model)).unsqueeze(0)
    seen: dict[str, Tensor] = {}

    def mid(x: Tensor, hook: Any) -> Tensor:
        seen["mid"] = x.clone()
        return x + 1.0

    def keep(name: str):
        def f(x: Tensor, hook: Any) -> Tensor:
            seen[name] = x.clone()
            return x

        return f

    model.run_with_hooks(tokens, fwd_hooks=[
        ("blocks.0.hook_resid_mid", mid), ("blocks.0.hook_mlp_out", keep("mlp")), ("blocks.0.hook_resid_post", keep("post")),
    ])
    residual = seen["post"] - seen["mlp"]
    if torch.allclose(residual, seen["mid"] + 1.0, atol=1e-4):
        return False
    if torch.allclose(residual, seen["mid"], atol=1e-4):
        return True
    raise PatchingError("cannot tell how this model's hook_resid_mid feeds its residual stream; edge interventions need that")



class _EdgeRunner:
    """Forward passes with per-receiver interventions (see module docstring for the backends)."""

    def __init__(self, model, backend: str = "auto"):
        from interp_norm.model import HookedNormTransformer

        _require_eval(model)
        cfg = model.cfg
        self.model = model
        self.L, self.H = cfg.n_layers, cfg.n_heads
        self.graph = EdgeGraph(self.L, self.H)
        self.valid = self.graph.valid()
        if backend not in ("auto", "split", "copies"):
            raise PatchingError(f"backend must be 'auto', 'split' or 'copies', got {backend!r}")
        ours = isinstance(model, HookedNormTransformer)
        if backend == "auto":
            backend = "split" if ours or getattr(cfg, "use_split_qkv_input", False) else "copies"
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
        self.W_O = torch.stack([model.blocks[l].attn.W_O.detach() for l in range(self.L)])  # [L, H, dh, d]
        self.mid_feeds_mlp_only = _resid_mid_feeds_mlp_only(self.run_model)

    # -- sender outputs --------------------------------------------------------------------
    def senders_from_cache(self, cache) -> Tensor:
        """[U, b, n, d] sender outputs from an ActivationCache of a plain run."""
        outs = [cache["hook_embed"] + cache["hook_pos_embed"]]
        for l in range(self.L):
            z = cache[f"blocks.{l}.attn.hook_z"]
            outs += list(torch.einsum("bphd,hdm->hbpm", z, self.W_O[l].to(z.dtype)))
            outs.append(cache[f"blocks.{l}.hook_mlp_out"])
        return torch.stack(outs)

    def sender_cache(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """(logits, senders [U, b, n, d]) of a plain run."""
        names = {"hook_embed", "hook_pos_embed"} | {f"blocks.{l}.attn.hook_z" for l in range(self.L)} | {
            f"blocks.{l}.hook_mlp_out" for l in range(self.L)
        }
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
        L, H, g = self.L, self.H, self.graph
        B, n = tokens.shape
        copies = self.backend == "copies"
        C = 1 + 3 * H if copies else 1
        G = 1 if weights is None else weights.shape[0]
        if B % G:
            raise PatchingError("rows must split evenly into the weight groups")
        Bg = B // G
        U = len(g.senders)
        # (u_now - ablated_u) for each sender, filled in as the pass computes the senders
        diffs: Optional[Tensor] = None
        embed_now: list[Tensor] = []
        leaf: dict[str, Tensor] = {}
        W_O = self.W_O

        def corr_for(r_slice: slice, u_avail: int) -> Optional[Tensor]:
            """[len(r), B, n, d] corrections for receivers r_slice from the first u_avail senders."""
            if weights is None:
                return None
            w = weights[:, :u_avail, r_slice]
            if not w.any():
                return None
            d = diffs[:u_avail]
            return torch.einsum("gur,ugbnd->rgbnd", w.to(d.dtype), d).reshape(w.shape[-1], B, n, -1)

        def put(u: int, now: Tensor) -> None:
            """Record sender u's output in this pass (only needed when there are corrections)."""
            nonlocal diffs
            if weights is None:
                return
            if diffs is None:
                diffs = now.new_empty(U, G, Bg, n, now.shape[-1])
            diffs[u] = now.view(G, Bg, n, -1) - ablated[u].to(now.dtype)

        def new_leaf(key: str, like: Tensor) -> Tensor:
            t = torch.zeros_like(like, requires_grad=True)
            leaf[key] = t
            return t

        def main(x: Tensor) -> Tensor:
            return x.view(C, B, *x.shape[1:])[0] if copies else x

        def hook_embed(x: Tensor, hook: Any) -> Tensor:
            if embed_mix is not None:
                e_corr, e_clean, al = embed_mix
                m = len(al)
                mix = e_corr.unsqueeze(0) + al.view(m, 1, 1, 1).to(e_corr.dtype) * (e_clean - e_corr).unsqueeze(0)
                x = mix.reshape(1, B, n, -1).expand(C, B, n, mix.shape[-1]).reshape(x.shape)
            embed_now[:] = [main(x)]
            return x

        def hook_pos(x: Tensor, hook: Any) -> Tensor:
            put(0, embed_now[0] + main(x))
            return x

        hooks: list[tuple[str, Callable]] = [("hook_embed", hook_embed), ("hook_pos_embed", hook_pos)]
        for l in range(L):
            r_attn = slice(g.receiver_index(l, "head"), g.receiver_index(l, "head") + 3 * H)
            r_mlp = g.receiver_index(l, "mlp")
            u_attn, u_mlp = g.n_senders_before(l, "attn"), g.n_senders_before(l, "mlp")
            state: dict[str, Any] = {}

            if copies:

                def h_resid_pre(x: Tensor, hook: Any, l=l, r_attn=r_attn, u_attn=u_attn) -> Tensor:
                    xv = x.view(C, B, n, -1)
                    m0 = xv[0]
                    corr = corr_for(r_attn, u_attn)
                    rest = m0.unsqueeze(0).expand(3 * H, B, n, m0.shape[-1])
                    if corr is not None:
                        rest = rest - corr
                    if leaves:
                        rest = rest + new_leaf(f"attn{l}", rest)
                    return torch.cat([m0.unsqueeze(0), rest]).reshape(x.shape)

                hooks.append((f"blocks.{l}.hook_resid_pre", h_resid_pre))
                for j, nm in enumerate(QKV):

                    def h_qkv(x: Tensor, hook: Any, j=j) -> Tensor:
                        xv = x.view(C, B, *x.shape[1:])  # [C, B, n, H, dh]
                        heads = torch.arange(H, device=x.device)
                        picked = xv[1 + 3 * heads + j, :, :, heads]  # [H, B, n, dh]
                        return torch.cat([picked.permute(1, 2, 0, 3).unsqueeze(0), xv[1:]]).reshape(x.shape)

                    hooks.append((f"blocks.{l}.attn.hook_{nm}", h_qkv))
            else:
                for j, nm in enumerate(QKV):

                    def h_input(x: Tensor, hook: Any, l=l, j=j, r_attn=r_attn, u_attn=u_attn, state=state) -> Tensor:
                        # x [B, n, H, d]; corrections for receivers (h, j) over h
                        if "attn" not in state:
                            c = corr_for(r_attn, u_attn)
                            state["attn"] = None if c is None else c.view(H, 3, B, n, -1)
                        c = state["attn"]
                        if c is not None:
                            x = x - c[:, j].permute(1, 2, 0, 3)
                        if leaves:
                            x = x + new_leaf(f"attn{l}.{j}", x)
                        return x

                    hooks.append((f"blocks.{l}.hook_{nm}_input", h_input))

            def h_z(x: Tensor, hook: Any, l=l) -> Tensor:
                if weights is not None:
                    z = main(x)
                    res = torch.einsum("bphd,hdm->hbpm", z, W_O[l].to(z.dtype))
                    base = g.sender_index(l, "head")
                    for h in range(H):
                        put(base + h, res[h])
                return x

            def h_resid_mid(x: Tensor, hook: Any, l=l, r_mlp=r_mlp, u_mlp=u_mlp, state=state) -> Tensor:
                c = corr_for(slice(r_mlp, r_mlp + 1), u_mlp)
                shift = None if c is None else -c[0]
                if leaves:
                    d = new_leaf(f"mlp{l}", main(x))
                    shift = d if shift is None else shift + d
                state["mlp_shift"] = shift
                if shift is None:
                    return x
                if copies:
                    xv = x.view(C, B, n, -1)
                    return torch.cat([(xv[0] + shift).unsqueeze(0), xv[1:]]).reshape(x.shape)
                return x + shift

            def h_mlp_out(x: Tensor, hook: Any, l=l) -> Tensor:
                put(g.sender_index(l, "mlp"), main(x))
                return x

            def h_resid_post(x: Tensor, hook: Any, l=l, state=state) -> Tensor:
                shift = state.get("mlp_shift")
                # the residual path must not see the MLP receiver's shift: undo it, unless the model's
                # hook_resid_mid only feeds the MLP (a TransformerBridge aliases it to ln2.hook_in)
                out_shift = None if shift is None or self.mid_feeds_mlp_only else -shift
                if l == L - 1:
                    c = corr_for(slice(-1, None), U)
                    s2 = None if c is None else -c[0]
                    if leaves:
                        d = new_leaf("logits", main(x))
                        s2 = d if s2 is None else s2 + d
                    if s2 is not None:
                        out_shift = s2 if out_shift is None else out_shift + s2
                if out_shift is None:
                    return x
                if copies:
                    xv = x.view(C, B, n, -1)
                    return torch.cat([(xv[0] + out_shift).unsqueeze(0), xv[1:]]).reshape(x.shape)
                return x + out_shift

            hooks += [
                (f"blocks.{l}.attn.hook_z", h_z),
                (f"blocks.{l}.hook_resid_mid", h_resid_mid),
                (f"blocks.{l}.hook_mlp_out", h_mlp_out),
                (f"blocks.{l}.hook_resid_post", h_resid_post),
            ]
        toks = tokens.repeat(C, 1) if copies else tokens
        logits = self.run_model.run_with_hooks(toks, fwd_hooks=hooks)
        if copies:
            logits = logits.view(C, B, *logits.shape[1:])[0]
        return logits, leaf

    def receiver_grads(self, leaf: dict[str, Tensor], grads: Sequence[Tensor]) -> Tensor:
        """Stack leaf gradients into [R, B, n, d] in receiver order."""
        gd = dict(zip(leaf.keys(), grads))
        L, H = self.L, self.H
        out = []
        for l in range(L):
            if self.backend == "copies":
                a = gd[f"attn{l}"]  # [3H, B, n, d], index 3h + j
                out += list(a)
            else:
                per_j = [gd[f"attn{l}.{j}"] for j in range(3)]  # [B, n, H, d]
                out += [per_j[j][:, :, h] for h in range(H) for j in range(3)]
            out.append(gd[f"mlp{l}"])
        out.append(gd["logits"])
        return torch.stack(out)


# ----------------------------------------------------------------------------- edge attribution


def edge_attribution(
    model,
    pairs: PatchingPairs,
    metric: Optional[MetricFn] = None,
    *,
    ig_steps: int = 1,
    backend: str = "auto",
    batch_size: Optional[int] = None,
    memory_mb: int = 1024,
    progress: bool = False,
) -> pd.DataFrame:
    """EAP / EAP-IG score of every edge: ``(u_clean - u_corr) . mean dM/d(input of r)``, batch mean.

    One row per edge with ``sender``, ``receiver``, ``receiver_node``, ``input`` (q/k/v/mlp/
    logits), layers and heads, ``score`` and ``abs_score``, sorted by ``abs_score``.
    Examples x integration steps per forward/backward pass: ``batch_size``, or by default as
    many as fit a rough ``memory_mb`` budget (each example carries ~3 x n_heads residual copies).
    """
    pairs = _as_pairs(pairs)
    dev = _device(model)
    metric = metric if metric is not None else LogitDiff(pairs)
    runner = _EdgeRunner(model, backend)
    alphas = _alphas(ig_steps)
    clean, corr = pairs.clean_tokens.to(dev), pairs.corrupted_tokens.to(dev)
    b, n = clean.shape
    _, s_clean = runner.sender_cache(clean)
    _, s_corr = runner.sender_cache(corr)
    with torch.no_grad():
        e_clean = runner.model.run_with_cache(clean, names_filter=lambda nm: nm == "hook_embed")[1]["hook_embed"]
        e_corr = runner.model.run_with_cache(corr, names_filter=lambda nm: nm == "hook_embed")[1]["hook_embed"]
    # rows per pass: every example costs ~3*n_heads residual copies (split q/k/v inputs) or
    # 1 + 3*n_heads batch copies; chunk the examples too when the metric can be split
    cost = 3 * runner.H if runner.backend == "split" else 1 + 3 * runner.H
    if batch_size is None:  # ~16 saved tensors of [n, d_model] per layer and residual copy
        per_example = cost * n * model.cfg.d_model * model.cfg.n_layers * 16 * 4
        per_pass = max(1, int(memory_mb * 2**20 // per_example))
    else:
        per_pass = max(1, batch_size // cost)
    if per_pass < b and hasattr(metric, "select"):
        chunks = [list(range(i, min(b, i + per_pass))) for i in range(0, b, per_pass)]
    else:
        chunks = [list(range(b))]
    delta = (s_clean - s_corr).double()  # [U, b, n, d]
    scores = torch.zeros(delta.shape[0], len(runner.graph.receivers), dtype=torch.float64)
    work = [(rows, s0) for rows in chunks for s0 in range(0, ig_steps, max(1, per_pass // len(rows)))]
    for rows, s0 in tqdm(work, disable=not progress, desc="edge attribution"):
        br = len(rows)
        sub = metric if len(chunks) == 1 else metric.select(rows)
        al = alphas[s0 : s0 + max(1, per_pass // br)].to(dev)
        m = len(al)
        idx = torch.tensor(rows, device=dev)
        with torch.enable_grad():
            logits, leaf = runner.run(corr[idx].repeat(m, 1), leaves=True, embed_mix=(e_corr[idx], e_clean[idx], al))
            total = _metric_values(sub, logits, br).sum()
            grads = torch.autograd.grad(total, list(leaf.values()))
        g = runner.receiver_grads(leaf, grads).double()  # [R, m*br, n, d]
        g = g.view(g.shape[0], m, br, n, -1).sum(1)
        scores += torch.einsum("ubnd,rbnd->ur", delta[:, idx.cpu()].to(g.device), g).cpu()
    scores = scores / (b * ig_steps) * runner.valid
    return _edge_frame(runner.graph, scores, runner.valid, method="eap" if ig_steps == 1 else f"eap-ig{ig_steps}")


def _parse_node(name: str) -> tuple[Optional[int], Optional[int]]:
    if name in ("embed", "logits"):
        return None, None
    if name.startswith("a"):
        l, h = name[1:].split(".h")
        return int(l), int(h.split(".")[0])
    return int(name[1:]), None


def _edge_frame(graph: EdgeGraph, scores: Tensor, valid: Tensor, method: str) -> pd.DataFrame:
    S, R = graph.senders, graph.receivers
    ui, ri = np.nonzero(valid.numpy())
    vals = scores.detach().cpu().numpy()[ui, ri]
    rows = []
    for u, r, v in zip(ui, ri, vals):
        s, rc = S[u], R[r]
        sl, sh = _parse_node(s)
        rl, rh = _parse_node(rc)
        inp = rc.rsplit(".", 1)[1] if rc.count(".") == 2 else ("mlp" if rc.startswith("m") else "logits")
        rows.append(dict(sender=s, receiver=rc, receiver_node=receiver_node(rc), input=inp,
                         sender_layer=sl, sender_head=sh, receiver_layer=rl, receiver_head=rh, score=float(v)))
    df = pd.DataFrame(rows)
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
    pairs = _as_pairs(pairs)
    dev = _device(model)
    metric = metric if metric is not None else LogitDiff(pairs)
    runner = _EdgeRunner(model, backend)
    graph = runner.graph
    clean, corr = pairs.clean_tokens.to(dev), pairs.corrupted_tokens.to(dev)
    b, n = clean.shape
    _, s_clean = runner.sender_cache(clean)
    corr_logits, s_corr = runner.sender_cache(corr)
    base = _metric_values(metric, corr_logits, b).double()
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
        vals = _metric_values(metric, logits, b).view(G, b).double().mean(-1) - base.mean()
        for k, (u, r) in enumerate(chunk):
            scores[u, r] = vals[k]
    mask = torch.zeros_like(valid)
    for u, r in pairs_idx:
        mask[u, r] = True
    return _edge_frame(graph, scores, mask, method="exact" if scale == 1.0 else f"exact-scale{scale:g}")


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


__all__ = [
    "attribution_patch",
    "edge_attribution",
    "exact_edge_patch",
    "compare_scores",
    "EdgeGraph",
    "receiver_node",
]
