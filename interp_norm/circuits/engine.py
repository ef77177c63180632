"""The incremental patching engine: recompute only the rows a patch can change, with the model's own steps.

A patch in layer ``l`` at positions ``>= p`` cannot change anything before layer ``l`` or at
positions ``< p`` (causal attention). So a chunk of ``K`` patch cells -- ``K`` stacked copies of
the corrupted batch, each patched in its own cell -- starts from the corrupted run. Each layer
recomputes only the *rows* (copy, example, position) whose input or attended keys/values changed
and that can still reach a position the metric reads (in the last layer: exactly the read
positions). Attention rows attend to their own (copy, example)'s keys and values: the corrupted
run's, with the changed rows replaced. Only changed rows are kept between layers.

The copies of a chunk may be patched in different layers (sorted by layer): a copy *enters* in its
layer, at its stage, joining the rows of the copies already changed at the point of the block
where that stage is computed (a ``z`` patch joins at ``attn.out``, an ``mlp_out`` patch after the
MLP, ...). So a chunk costs one pass over the layers, whatever its cells' layers.

The arithmetic is the model's own: ``blk.ln1``, ``attn.project`` / ``normalize`` / ``scores`` /
``out``, the block's update calibration, ``blk.mlp_update`` and ``model(resid, start_at_layer=L)``
for the output head, so norm choices and calibration factors (``cfg.calibration == "paper"``)
apply exactly as in ``model(tokens)``. The engine adds only the wiring between those steps: the
causal softmax (written out: ``Tensor.softmax`` is several times slower on CPU for these short key
axes), ``pattern @ v`` and the two residual sums. The corrupted run is computed with the same
wiring; once per model it is compared with ``model(tokens)``, so a block whose wiring differs is
refused (:class:`PatchingError`) instead of giving wrong numbers.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch
from torch import Tensor

from interp_norm.errors import PatchingError

#: Stages of one block, in computation order; a patch enters at one of them.
STAGES = ("resid_pre", "q", "k", "v", "pattern", "z", "attn_out", "resid_mid", "mlp_out", "resid_post")
_BEFORE_SCORES = ("q", "k", "v")  # entering copies whose attention is recomputed
_BEFORE_OUT = ("q", "k", "v", "pattern", "z")  # ... whose attention output is recomputed
_CHECKED: "weakref.WeakSet" = weakref.WeakSet()  # models whose wiring matched model(tokens)

#: ``patch(rows, idx)`` returns the stage values of rows ``idx = (copy, example, position)`` patched.
RowPatch = Callable[[Tensor, tuple], Tensor]


def causal_softmax(scores: Tensor, causal: Tensor) -> Tensor:
    """Softmax over the last axis with ``~causal`` entries masked out (zero weight)."""
    m = scores.masked_fill(~causal, float("-inf")).amax(-1, keepdim=True)
    e = (scores - m).exp_().mul_(causal)
    return e.div_(e.sum(-1, keepdim=True))


def _from_first(mask: Tensor) -> Tensor:
    """True at and after the first True along the last axis."""
    return mask.cumsum(-1) > 0


def _until_last(mask: Tensor) -> Tensor:
    """True at and before the last True along the last axis."""
    return mask.flip(-1).cumsum(-1).flip(-1) > 0


def _cat(*parts: Optional[Tensor]) -> Optional[Tensor]:
    """Concatenate the parts that exist (rows of earlier copies first); None if none does."""
    parts = [p for p in parts if p is not None]
    return None if not parts else parts[0] if len(parts) == 1 else torch.cat(parts)


class IncrementalEngine:
    """The corrupted run of ``tokens`` and the row-incremental re-runs of patched copies of it.

    ``read_mask`` [batch, pos]: the logits positions the metric reads (None: all). ``acts[l][stage]``
    holds the corrupted run's activations (``q``/``k``/``v`` as hooked, before any per-head norm;
    ``*_used`` after it). ``exact_pattern``: compute the corrupted run's attention pattern exactly as
    the model's forward does, so its activations equal those of ``model.run_with_cache`` bit for bit
    (for comparisons with a clean cache; otherwise the faster softmax, equal up to rounding).
    :meth:`run` returns the logits of K patched copies.
    """

    def __init__(self, model, tokens: Tensor, read_mask: Optional[Tensor] = None, exact_pattern: bool = True):
        self.model = model
        self.L = model.cfg.n_layers
        self.b, self.n = tokens.shape
        self.exact_pattern = exact_pattern
        dev = tokens.device
        read = torch.ones(self.b, self.n, dtype=torch.bool, device=dev) if read_mask is None else read_mask
        read = read.to(dev, torch.bool).expand(self.b, self.n)
        # positions after the last one the metric reads cannot influence it
        any_read = read.any(0).nonzero().flatten()
        self.n_eff = ne = int(any_read.max()) + 1 if any_read.numel() else self.n
        self.need_last = read[:, :ne]  # [b, ne]: rows whose logits the metric reads
        self.need = _until_last(self.need_last)  # rows at or before an example's last read row
        self.causal = torch.ones(self.n, self.n, dtype=torch.bool, device=dev).tril()
        with torch.inference_mode():  # cheaper per op than no_grad; the results are only read
            resid = model(tokens, stop_at_layer=0)
            self.acts: list[dict[str, Tensor]] = []
            # the last layer's MLP and the head only where the metric reads (elsewhere: zeros, never read)
            read_rows = torch.zeros(self.b, self.n, dtype=torch.bool, device=dev)
            read_rows[:, :ne] = self.need_last
            self.read_flat = read_rows.flatten().nonzero().squeeze(1)
            # work done, in block rows: the corrupted run's (the last layer's MLP only where read) ...
            self.rows_computed = self.b * self.n * (self.L - 1) + len(self.read_flat)
            for l, blk in enumerate(model.blocks):
                self.acts.append(self._block(blk, resid, self.read_flat if l == self.L - 1 else None))
                resid = self.acts[-1]["resid_post"]
            d = resid.shape[-1]
            head = model(resid.reshape(-1, d).index_select(0, self.read_flat).unsqueeze(0), start_at_layer=self.L)[0]
            self.logits = head.new_zeros(self.b * self.n, head.shape[-1]).index_copy_(0, self.read_flat, head)
            self.logits = self.logits.view(self.b, self.n, -1)
            if model not in _CHECKED:
                self._check(tokens)
        self.c = []
        for a in self.acts:  # keys and values head-major [b, h, keys, dh]: batched matmuls take them without copies
            self.c.append(dict(k_t=a["k_used"][:, :ne].transpose(1, 2).contiguous(),
                               v_t=a["v_used"][:, :ne].transpose(1, 2).contiguous()))

    # -- the block's wiring, on whole sequences (the corrupted run) and on rows ---------------
    @staticmethod
    def _attn_inputs(blk, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The inputs of W_Q, W_K, W_V: the residual, or the Pre-Norm's ``ln1`` of it (one per gain)."""
        ln1 = getattr(blk, "ln1", None)
        if ln1 is None:
            return x, x, x
        out = ln1(x)
        return out if isinstance(out, tuple) else (out, out, out)

    @staticmethod
    def _attn_update(blk, out: Tensor, resid: Tensor) -> Tensor:
        """What the attention adds to the residual: ``attn.out(z)`` through the block's update calibration."""
        calib = getattr(blk, "calib_attn_out", None)
        return out if calib is None else calib(out, relative_to=resid)

    def _block(self, blk, resid: Tensor, rows: Optional[Tensor] = None) -> dict[str, Tensor]:
        """Every stage of one block on whole sequences [b, n, ...]; with ``rows`` (flat row indices),
        the MLP only there (``mlp_out`` zero elsewhere; ``resid_post`` then only right there)."""
        attn = blk.attn
        xs = self._attn_inputs(blk, resid)
        a = {"resid_pre": resid}
        for t, x in zip("qkv", xs):
            a[t] = attn.project(x, t)
            a[f"{t}_used"] = attn.normalize(a[t], t)
        n = resid.shape[1]
        scores = attn.scores(a["q_used"], a["k_used"])
        if self.exact_pattern:  # as the model's forward computes it
            a["pattern"] = scores.masked_fill(~self.causal[:n, :n], float("-inf")).softmax(-1)
        else:
            a["pattern"] = causal_softmax(scores, self.causal[:n, :n])
        a["z"] = torch.einsum("bhqk,bkhd->bqhd", a["pattern"], a["v_used"])
        a["attn_out"] = self._attn_update(blk, attn.out(a["z"]), resid)
        a["resid_mid"] = mid = resid + a["attn_out"]
        if rows is None:
            a["mlp_out"] = blk.mlp_update(mid)
        else:
            flat = mid.reshape(-1, mid.shape[-1])
            upd = blk.mlp_update(flat.index_select(0, rows).unsqueeze(0))[0]
            a["mlp_out"] = torch.zeros_like(flat).index_copy_(0, rows, upd).view_as(mid)
        a["resid_post"] = a["resid_mid"] + a["mlp_out"]
        return a

    def _check(self, tokens: Tensor) -> None:
        ref = self.model(tokens).reshape(self.b * self.n, -1).index_select(0, self.read_flat)
        err = float((self.logits.reshape(self.b * self.n, -1).index_select(0, self.read_flat) - ref).abs().max())
        if not err <= 1e-4 * (float(ref.abs().max()) + 1.0):
            raise PatchingError(
                f"the incremental patching engine disagrees with model(tokens) by {err:.3g}: the model's block is "
                "wired differently from attention + MLP with residual sums -- use method='hooks'"
            )
        _CHECKED.add(self.model)

    # -- rows ----------------------------------------------------------------------------------
    def _at(self, l: int, stage: str, idx: tuple) -> Tensor:
        """The corrupted run's ``stage`` of layer ``l`` in rows ``idx`` = (copy, example, position)
        (``pattern``: the query rows, [M, h, n_eff]). Flat ``index_select``: several times faster
        than advanced indexing for many rows."""
        c = self.c[l]
        if stage not in c:
            a = self.acts[l][stage]
            if stage == "pattern":
                a = a[..., : self.n_eff].transpose(1, 2).contiguous()
            c[stage] = a.reshape(self.b * self.n, *a.shape[2:])
        return c[stage].index_select(0, idx[1] * self.n + idx[2])

    def _rows(self, l: int, X: Optional[Tensor], D: Optional[Tensor], mask: Tensor) -> Tensor:
        """resid_pre rows ``mask`` [K, b, n]: the corrupted run's, with the changed rows ``X``
        (rows of ``D``, in ``D``'s order) in place."""
        if X is not None and torch.equal(mask, D):
            return X
        out = self._at(l, "resid_pre", mask.nonzero(as_tuple=True))
        if X is not None:
            slot = torch.full(D.shape, -1, dtype=torch.long, device=D.device)
            slot[D] = torch.arange(len(X), device=D.device)
            s = slot[mask]
            hit = s >= 0
            out[hit] = X[s[hit]]
        return out

    @staticmethod
    def _mlp_rows(blk, x: Tensor, block: int = 512) -> Tensor:
        """``blk.mlp_update`` of rows [M, d], in blocks: the hidden layer of a block stays in cache."""
        if len(x) <= block:
            return blk.mlp_update(x.unsqueeze(0))[0]
        return torch.cat([blk.mlp_update(x[i : i + block].unsqueeze(0))[0] for i in range(0, len(x), block)])

    def _attend(self, attn, q_rows: Tensor, idx: tuple, k_g: Tensor, v_g: Tensor, g_of: Tensor, slot: Tensor) -> Tensor:
        """z [M, h, dh] of query rows ``idx`` against their own group's keys/values ``k_g``/``v_g``
        [g, h, keys, dh]. The rows are packed per group (``g_of``, ``slot``) into a zero-padded block:
        recomputed rows are a small ragged subset of copies x examples x positions."""
        g, nk = k_g.shape[0], k_g.shape[2]
        w = int(slot.max()) + 1
        flat = g_of * w + slot  # flat (group, slot) index: index_copy/index_select, not 2-d advanced indexing
        q = q_rows.new_zeros(g * w, *q_rows.shape[1:])
        q.index_copy_(0, flat, q_rows)
        pos = idx[2].new_zeros(g * w)  # padding rows: position 0 (a valid, discarded softmax)
        pos.index_copy_(0, flat, idx[2])
        causal = torch.arange(nk, device=pos.device) <= pos.view(g, 1, w, 1)
        scores = attn.scores(q.view(g, w, *q.shape[1:]), k_g.transpose(1, 2))  # [g, h, w, keys]
        z = causal_softmax(scores, causal) @ v_g  # [g, h, w, dh]
        return z.transpose(1, 2).reshape(g * w, *z.shape[1:2], z.shape[3]).index_select(0, flat)

    def _layer(
        self, l: int, X: Optional[Tensor], D: Optional[Tensor], last: bool,
        S: Optional[str] = None, patch: Optional[RowPatch] = None, P: Optional[Tensor] = None,
    ) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """One block for K copies: rows ``D`` [K, b, n] of its input differ from the corrupted run
        (values ``X``, in ``D``'s order) and copies entering here are patched at stage ``S`` in rows
        ``P``. Entering copies come after all changed ones, so at every stage the rows of the two
        concatenate in (copy, example, position) order. Returns the changed output rows and mask."""
        blk = self.model.blocks[l]
        need = self.need_last if last else self.need
        if S == "resid_pre":  # the patched rows join the changed input
            Pn = P & self.need
            pidx = Pn.nonzero(as_tuple=True)
            X, D, S = _cat(X, patch(self._at(l, "resid_pre", pidx), pidx)), (Pn if D is None else D | Pn), None
        Ap = None if D is None else _from_first(D) & need  # rows at or after a changed key/value row
        Ae = None if S is None else (_from_first(P) if S in ("k", "v") else P) & need
        if Ap is not None and not Ap.any():
            Ap = None
        if Ae is not None and not Ae.any():
            Ae, S = None, None  # the entering copies change nothing the metric can see
        if Ap is None and Ae is None:
            return None, None
        A = Ae if Ap is None else (Ap if Ae is None else Ap | Ae)
        ie = None if Ae is None else Ae.nonzero(as_tuple=True)

        def entering(stage: str) -> Tensor:  # the corrupted run's values in the entering rows
            return self._at(l, stage, ie)

        xA = None if Ap is None else self._rows(l, X, D, Ap)  # resid_pre rows of the changed copies
        z = None
        if Ap is not None or S in _BEFORE_SCORES:
            z = self._attention(l, X, D, xA, Ap, A if S in _BEFORE_SCORES else Ap, S, patch, P, ie)
        if S == "pattern":
            pattern = patch(entering("pattern"), ie)  # [M, h, keys]
            z = _cat(z, (pattern.unsqueeze(2) @ self.c[l]["v_t"].index_select(0, ie[1])).squeeze(2))
        elif S == "z":
            z = _cat(z, patch(entering("z"), ie))
        # the rest of the block: the changed copies' rows, then the entering ones' from their stage on
        x_e = entering("resid_pre") if S in _BEFORE_OUT or S == "attn_out" else None
        attn_out = None
        if z is not None:
            attn_out = self._attn_update(blk, blk.attn.out(z.unsqueeze(0))[0], _cat(xA, None if S == "attn_out" else x_e))
        if S == "attn_out":
            attn_out = _cat(attn_out, patch(entering("attn_out"), ie))
        resid_mid = None if attn_out is None else _cat(xA, x_e) + attn_out
        if S == "resid_mid":
            resid_mid = _cat(resid_mid, patch(entering("resid_mid"), ie))
        post = None if resid_mid is None else resid_mid + self._mlp_rows(blk, resid_mid)
        if S == "mlp_out":
            post = _cat(post, entering("resid_mid") + patch(entering("mlp_out"), ie))
        elif S == "resid_post":
            post = _cat(post, patch(entering("resid_post"), ie))
        return post, A

    def _attention(self, l: int, X, D, xA, Ap, Aatt: Tensor, S, patch, P, ie) -> Tensor:
        """z of the query rows ``Aatt``: the changed copies' rows ``Ap`` (their inputs ``xA``) and,
        for a q/k/v patch, the entering copies' rows ``ie``. Keys and values are the corrupted run's,
        with the rows that changed (``D``) or are patched (``S`` = k/v, rows ``P``) replaced."""
        blk, c = self.model.blocks[l], self.c[l]
        attn = blk.attn
        idx = kidx, bidx, ridx = Aatt.nonzero(as_tuple=True)
        _, g_of, counts = torch.unique_consecutive(kidx * self.b + bidx, return_inverse=True, return_counts=True)
        start = counts.cumsum(0) - counts
        slot = torch.arange(len(kidx), device=Aatt.device) - start[g_of]
        gk, ge = kidx[start], bidx[start]  # each (copy, example) group's copy and example
        seen = _until_last(Aatt)  # a key row matters only to query rows at or after it
        nk = int(ridx.max()) + 1
        k_g = c["k_t"][:, :, :nk].index_select(0, ge)  # [g, h, keys, dh]
        v_g = c["v_t"][:, :, :nk].index_select(0, ge)
        k_new = v_new = q_new = None
        kv = None if D is None else D & self.need & seen  # changed rows: new keys/values, and queries
        if kv is not None and kv.any():
            xs = self._attn_inputs(blk, xA if torch.equal(kv, Ap) else self._rows(l, X, D, kv))
            q_new, k_new, v_new = (attn.normalize(attn.project(x.unsqueeze(0), t)[0], t) for x, t in zip(xs, "qkv"))
        else:
            kv = None
        kmask = vmask = kv
        if S in ("k", "v"):  # the entering copies' patched key/value rows
            Pk = P & seen
            pidx = Pk.nonzero(as_tuple=True)
            new = attn.normalize(patch(self._at(l, S, pidx), pidx), S)
            both = Pk if kv is None else kv | Pk
            if S == "k":
                k_new, kmask = _cat(k_new, new), both
            else:
                v_new, vmask = _cat(v_new, new), both
        if kmask is not None:  # groups are sorted by (copy, example): same order as the mask's rows
            k_g.transpose(1, 2)[kmask[gk, ge, :nk]] = k_new
        if vmask is not None:
            v_g.transpose(1, 2)[vmask[gk, ge, :nk]] = v_new
        q_p = q_e = None
        if Ap is not None:  # the corrupted run's queries, new ones where the input changed
            q_p = self._at(l, "q_used", Ap.nonzero(as_tuple=True))
            if q_new is not None:  # (in the last layer some changed key rows are no query rows)
                q_p[kv[Ap]] = q_new[Ap[kv]]
        if S == "q":
            q_e = attn.normalize(patch(self._at(l, "q", ie), ie), "q")
        elif S in ("k", "v"):
            q_e = self._at(l, "q_used", ie)
        return self._attend(attn, _cat(q_p, q_e), idx, k_g, v_g, g_of, slot)

    # -- entry point ---------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, layers: Tensor, stage: str, patch_at: Callable[[int], RowPatch], P: Tensor) -> Optional[Tensor]:
        """Logits [K, b, n, vocab] of K copies, copy ``k`` patched at ``stage`` of layer ``layers[k]``
        (non-decreasing), or None if no read row changes.

        ``P`` [K, b, n_eff] marks the rows each copy's patch changes, per example (an example whose
        clean and corrupted values agree in the cell is left out: the patch cannot change it);
        ``patch_at(l)(rows, idx)`` patches the stage values of layer ``l`` in rows ``idx`` = (copy,
        example, position): ``[M, ...]`` slices of the activation (``pattern``: ``[M, n_heads, n_eff]``).
        """
        if stage not in STAGES:
            raise PatchingError(f"unknown stage {stage!r}; choose one of {STAGES}")
        K = len(layers)
        lay = layers.tolist()
        X = D = None
        for l in range(lay[0], self.L):
            enter = layers == l
            entering = l in lay
            Pl = P & enter.to(P.device).view(K, 1, 1) if entering else None
            X, D = self._layer(l, X, D, l == self.L - 1, stage if entering else None, patch_at(l) if entering else None, Pl)
            if D is not None:  # ... plus the rows each patched copy recomputes
                self.rows_computed += int(D.sum())
            if X is None and l >= lay[-1]:
                return None
        out = self.logits.unsqueeze(0).expand(K, *self.logits.shape).clone()
        out[:, :, : self.n_eff][D] = self.model(X.unsqueeze(0), start_at_layer=self.L)[0]
        return out


__all__ = ["IncrementalEngine", "STAGES", "causal_softmax"]
