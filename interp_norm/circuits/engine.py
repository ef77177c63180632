"""The incremental patching engine: recompute only the rows a patch can change, with the model's steps.

A patch in layer ``l`` at positions ``>= p`` cannot change anything before layer ``l`` or at
positions ``< p`` (causal attention). So a chunk of ``K`` patch cells -- ``K`` stacked copies of
the corrupted batch, each patched in its own cell -- starts from the corrupted run. Each layer
recomputes only the *rows* (copy, example, position) whose input or attended keys/values changed
and that can still reach a position the metric reads (in the last layer: exactly the read
positions). Attention rows attend to their own (copy, example)'s keys and values: the corrupted
run's, with the changed rows replaced. Only changed rows are kept between layers. A q/k/v/pattern
cell changes one head, so in its layer only that head's attention is recomputed.

The copies of a chunk may be patched in different layers (sorted by layer): a copy *enters* in its
layer, at its stage, joining the rows of the copies already changed at the point of the block
where that stage is computed (a ``z`` patch joins at ``attn.out``, an ``mlp_out`` patch after the
MLP, ...). So a chunk costs one pass over the layers, whatever its cells' layers.

Two arithmetics, one wiring (:mod:`interp_norm.circuits.block_steps`): with ``exact_pattern=True``
the model's own steps, so the corrupted run's activations equal ``model.run_with_cache``'s bit for
bit; otherwise, when no hook is on the model, fused CPU kernels equal to them up to rounding. In fast
mode recomputed rows also attend against each example's corrupted keys and values shared by all its
copies, with the changed rows as per-pair corrections (:meth:`IncrementalEngine._attend_shared`),
where that moves fewer rows than a copy of the keys per (copy, example). The engine adds the wiring
between the steps: ``pattern @ v`` and the two residual sums. Once per model and arithmetic the
corrupted run is compared with ``model(tokens)``, so a block wired differently is refused
(:class:`PatchingError`) instead of giving wrong numbers.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch
from torch import Tensor

from interp_norm.circuits.block_steps import BlockSteps, causal_softmax, padded_softmax
from interp_norm.errors import PatchingError

#: Stages of one block, in computation order; a patch enters at one of them.
STAGES = ("resid_pre", "q", "k", "v", "pattern", "z", "attn_out", "resid_mid", "mlp_out", "resid_post")
_BEFORE_SCORES = ("q", "k", "v")  # entering copies whose attention is recomputed
_BEFORE_OUT = ("q", "k", "v", "pattern", "z")  # ... whose attention output is recomputed
_CHECKED = {False: weakref.WeakSet(), True: weakref.WeakSet()}  # models whose wiring matched model(tokens), per mode

#: ``patch(rows, idx)`` returns the stage values of rows ``idx = (copy, example, position)`` patched.
RowPatch = Callable[[Tensor, tuple], Tensor]


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


class IncrementalEngine(BlockSteps):
    """The corrupted run of ``tokens`` and the row-incremental re-runs of patched copies of it.

    ``read_mask`` [batch, pos]: the logits positions the metric reads (None: all). ``acts[l][stage]``
    holds the corrupted run's activations (``q``/``k``/``v`` as hooked, before any per-head norm;
    ``*_used`` after it). ``exact_pattern``: compute the corrupted run's attention pattern exactly as
    the model's forward does, so its activations equal those of ``model.run_with_cache`` bit for bit
    (for comparisons with a clean cache; otherwise the faster softmax, equal up to rounding).
    :meth:`run` returns the logits of K patched copies.
    """

    #: fast mode folds the heads into the matrix rows for groups of at most this many query rows
    BLOCK_DIAGONAL_MAX_ROWS = 2
    #: fast mode attends against each example's shared keys plus corrections (:meth:`_attend_shared`)
    #: when its (query row, changed key row) pairs are at most this many per key row that copies of
    #: the keys per group would move; else it copies them (measured: shared is 1.2-1.3x faster on z
    #: and pattern patching, neutral on the rest)
    SHARED_KEYS_MAX_PAIRS_PER_ROW = 1.0

    def __init__(self, model, tokens: Tensor, read_mask: Optional[Tensor] = None, exact_pattern: bool = True):
        super().__init__(model, fast=not exact_pattern)
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
            for l in range(self.L):
                self.acts.append(self._block(l, resid, self.read_flat if l == self.L - 1 else None))
                resid = self.acts[-1]["resid_post"]
            d = resid.shape[-1]
            head = model(resid.reshape(-1, d).index_select(0, self.read_flat).unsqueeze(0), start_at_layer=self.L)[0]
            self.logits = head.new_zeros(self.b * self.n, head.shape[-1]).index_copy_(0, self.read_flat, head)
            self.logits = self.logits.view(self.b, self.n, -1)
            if model not in _CHECKED[self.fast]:
                self._check(tokens)
        self.c = []
        for a in self.acts:  # keys and values [b, keys, h, dh] up to the last read position, contiguous for the gathers
            self.c.append(dict(k_p=a["k_used"][:, :ne].contiguous(), v_p=a["v_used"][:, :ne].contiguous()))

    # -- the block, on whole sequences (the corrupted run) -----------------------------------
    def _block(self, l: int, resid: Tensor, rows: Optional[Tensor] = None) -> dict[str, Tensor]:
        """Every stage of block ``l`` on whole sequences [b, n, ...]; with ``rows`` (flat row indices),
        the MLP only there (``mlp_out`` zero elsewhere; ``resid_post`` then only right there)."""
        blk = self.model.blocks[l]
        attn = blk.attn
        a = {"resid_pre": resid}
        for t, y in zip("qkv", self._qkv(l, resid)):
            a[t] = y
            a[f"{t}_used"] = self._normalize(attn, y, t)
        n = resid.shape[1]
        scores = attn.scores(a["q_used"], a["k_used"])
        if self.exact_pattern:  # as the model's forward computes it
            a["pattern"] = scores.masked_fill(~self.causal[:n, :n], float("-inf")).softmax(-1)
        else:
            a["pattern"] = self._softmax(scores, self.causal[:n, :n])
        a["z"] = torch.einsum("bhqk,bkhd->bqhd", a["pattern"], a["v_used"])
        a["attn_out"] = self._attn_update(blk, self._out(l, a["z"]), resid)
        a["resid_mid"] = mid = resid + a["attn_out"]
        if rows is None:
            a["mlp_out"] = self._mlp(l, mid)
        else:
            flat = mid.reshape(-1, mid.shape[-1])
            upd = self._mlp(l, flat.index_select(0, rows))
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
        _CHECKED[self.fast].add(self.model)

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

    def _mlp_rows(self, l: int, x: Tensor, block: int = 512) -> Tensor:
        """The MLP update of rows [M, d], in blocks: the hidden layer of a block stays in cache."""
        if len(x) <= block:
            return self._mlp(l, x)
        return torch.cat([self._mlp(l, x[i : i + block]) for i in range(0, len(x), block)])

    def _attend(self, attn, q_rows: Tensor, idx: tuple, k_g: Tensor, v_g: Tensor, g_of: Tensor, slot: Tensor) -> Tensor:
        """z [M, h, dh] of query rows ``idx`` against their own group's keys/values ``k_g``/``v_g``
        [g, keys, h, dh]. The rows are packed per group (``g_of``, ``slot``) into a zero-padded block:
        recomputed rows are a small ragged subset of copies x examples x positions.

        Fast mode folds the heads into the matrix rows: one ``[w*h, dh] @ [dh, keys*h]`` product per
        group, of which the head-diagonal blocks are the scores (and ``pattern @ v`` likewise with a
        block-diagonal pattern). It does ``h`` times the multiply-adds of per-head products but in
        ``h`` times fewer, larger matrices: several times faster for these 1-7-row blocks."""
        g, nk = k_g.shape[0], k_g.shape[1]
        h, dh = q_rows.shape[1:]
        w = int(slot.max()) + 1
        flat = g_of * w + slot  # flat (group, slot) index: index_copy/index_select, not 2-d advanced indexing
        q = q_rows.new_zeros(g * w, h, dh)
        q.index_copy_(0, flat, q_rows)
        pos = idx[2].new_zeros(g * w)  # padding rows: position 0 (a valid, discarded softmax)
        pos.index_copy_(0, flat, idx[2])
        keys = torch.arange(nk, device=pos.device)
        if not self.fast or w > self.BLOCK_DIAGONAL_MAX_ROWS:
            scores = attn.scores(q.view(g, w, h, dh), k_g)  # [g, h, w, keys]
            z = self._softmax(scores, keys <= pos.view(g, 1, w, 1)) @ v_g.transpose(1, 2)  # [g, h, w, dh]
            return z.transpose(1, 2).reshape(g * w, h, dh).index_select(0, flat)
        qk = torch.bmm(q.view(g, w * h, dh), k_g.view(g, nk * h, dh).transpose(1, 2))
        qk = qk.view(g, w, h, nk, h).diagonal(dim1=2, dim2=4).transpose(2, 3)  # [g, w, h, keys]
        pattern = padded_softmax(attn.scale_scores(qk), keys <= pos.view(g, w, 1, 1))
        block = pattern.new_zeros(g, w, h, nk, h)
        block.diagonal(dim1=2, dim2=4).copy_(pattern.transpose(2, 3))
        z = torch.bmm(block.view(g, w * h, nk * h), v_g.reshape(g, nk * h, dh))  # [g, w*h, dh]
        return z.view(g * w, h, dh).index_select(0, flat)

    @staticmethod
    def _seen_changed(mask: Optional[Tensor], idx: tuple, causal: Tensor) -> Optional[Tensor]:
        """[M, keys]: which of its group's changed key rows (``mask`` [K, b, n]) each query row ``idx``
        sees (``causal`` [M, keys]: the keys at or before the row)."""
        return None if mask is None else mask[idx[0], idx[1], : causal.shape[1]] & causal

    def _attend_shared(self, l: int, q: Tensor, idx: tuple, causal: Tensor, k_changed: tuple, v_changed: tuple) -> Tensor:
        """z [M, h, dh] of query rows ``idx`` (fast mode) without a copy of the keys per group:
        scores and ``pattern @ v`` against each example's corrupted keys/values as one batched
        product (the rows packed per example), then the group's changed keys/values as
        corrections, one per (query row, changed key row) pair. ``causal`` [M, keys]: the keys at or
        before each row; ``k_changed`` = (mask [K, b, n], :meth:`_seen_changed` of it, values in the
        mask's row order), or Nones."""
        attn, c = self.model.blocks[l].attn, self.c[l]
        kidx, bidx, ridx = idx
        (M, h, dh), b, dev, nk = q.shape, self.b, q.device, causal.shape[1]
        counts = torch.bincount(bidx, minlength=b)
        R = int(counts.max())
        order = torch.argsort(bidx, stable=True)
        slot = torch.empty_like(bidx)
        slot[order] = torch.arange(M, device=dev) - (counts.cumsum(0) - counts)[bidx[order]]
        flat = bidx * R + slot  # each row's place in the [b, R] packing
        Q = q.new_zeros(b * R, h, dh).index_copy_(0, flat, q).view(b, R, h, dh)
        qk = torch.einsum("brhd,bkhd->brhk", Q, c["k_p"][:, :nk]).reshape(b * R, h, nk).index_select(0, flat)

        def changed(mask: Optional[Tensor], seen: Optional[Tensor], values: Optional[Tensor]):
            """(row, key) pairs whose key/value is the group's changed one, and that value."""
            if mask is None:
                return None
            i, j = seen.nonzero(as_tuple=True)
            where = torch.full(mask.shape, -1, dtype=torch.long, device=dev)
            where[mask] = torch.arange(len(values), device=dev)
            return i, j, values.index_select(0, where[kidx[i], bidx[i], j])

        kc = changed(*k_changed)
        if kc is not None:
            i, j, k = kc
            qk[i, :, j] = (q.index_select(0, i) * k).sum(-1)
        pattern = padded_softmax(attn.scale_scores(qk), causal.unsqueeze(1))  # [M, h, keys]
        vc = changed(*v_changed)
        p_old = pattern
        if vc is not None:
            i, j, v = vc
            w = pattern[i, :, j]  # [pairs, h]
            p_old = pattern.clone()
            p_old[i, :, j] = 0
        P = p_old.new_zeros(b * R, h, nk).index_copy_(0, flat, p_old).view(b, R, h, nk)
        z = torch.einsum("brhk,bkhd->brhd", P, c["v_p"][:, :nk]).reshape(b * R, h, dh).index_select(0, flat)
        if vc is not None:
            z.index_add_(0, i, w.unsqueeze(-1) * v)
        return z

    def _layer(
        self, l: int, X: Optional[Tensor], D: Optional[Tensor], last: bool,
        S: Optional[str] = None, patch: Optional[RowPatch] = None, P: Optional[Tensor] = None,
        heads: Optional[Tensor] = None,
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
            z = self._attention(l, X, D, xA, Ap, A if S in _BEFORE_SCORES else Ap, S, patch, P, ie, heads)
        if S == "pattern":
            pattern = patch(entering("pattern"), ie)  # [M, h, keys]
            v = self.c[l]["v_p"].index_select(0, ie[1])  # [M, keys, h, dh]
            if heads is None:
                z_e = (pattern.unsqueeze(2) @ v.transpose(1, 2)).squeeze(2)
            else:  # only the patched head's output changes
                r, hr = torch.arange(len(ie[0]), device=v.device), heads[ie[0]]
                z_e = entering("z")
                z_e[r, hr] = (pattern[r, hr].unsqueeze(1) @ v[r, :, hr]).squeeze(1)
            z = _cat(z, z_e)
        elif S == "z":
            z = _cat(z, patch(entering("z"), ie))
        # the rest of the block: the changed copies' rows, then the entering ones' from their stage on
        x_e = entering("resid_pre") if S in _BEFORE_OUT or S == "attn_out" else None
        attn_out = None
        if z is not None:
            attn_out = self._attn_update(blk, self._out(l, z), _cat(xA, None if S == "attn_out" else x_e))
        if S == "attn_out":
            attn_out = _cat(attn_out, patch(entering("attn_out"), ie))
        resid_mid = None if attn_out is None else _cat(xA, x_e) + attn_out
        if S == "resid_mid":
            resid_mid = _cat(resid_mid, patch(entering("resid_mid"), ie))
        post = None if resid_mid is None else resid_mid + self._mlp_rows(l, resid_mid)
        if S == "mlp_out":
            post = _cat(post, entering("resid_mid") + patch(entering("mlp_out"), ie))
        elif S == "resid_post":
            post = _cat(post, patch(entering("resid_post"), ie))
        return post, A

    def _attention(self, l: int, X, D, xA, Ap, Aatt: Tensor, S, patch, P, ie, heads=None) -> Tensor:
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
        k_new = v_new = q_new = None
        kv = None if D is None else D & self.need & seen  # changed rows: new keys/values, and queries
        if kv is not None and kv.any():
            x_kv = xA if torch.equal(kv, Ap) else self._rows(l, X, D, kv)
            q_new, k_new, v_new = (self._normalize(attn, y, t) for y, t in zip(self._qkv(l, x_kv), "qkv"))
        else:
            kv = None
        kmask = vmask = kv
        Pk = new = None
        if S in ("k", "v"):  # the entering copies' patched key/value rows
            Pk = P & seen
            pidx = Pk.nonzero(as_tuple=True)
            new = self._normalize(attn, patch(self._at(l, S, pidx), pidx), S)
            both = Pk if kv is None else kv | Pk
            if S == "k":
                k_new, kmask = _cat(k_new, new), both
            else:
                v_new, vmask = _cat(v_new, new), both
        q_p = q_e = None
        if Ap is not None:  # the corrupted run's queries, new ones where the input changed
            q_p = self._at(l, "q_used", Ap.nonzero(as_tuple=True))
            if q_new is not None:  # (in the last layer some changed key rows are no query rows)
                q_p[kv[Ap]] = q_new[Ap[kv]]
        if S == "q":
            q_e = self._normalize(attn, patch(self._at(l, "q", ie), ie), "q")
        elif S in ("k", "v"):
            q_e = self._at(l, "q_used", ie)
        one_head = heads is not None and q_e is not None  # entering copies that change one head each
        n_p = 0 if q_p is None else len(q_p)
        G = 0 if n_p == 0 else int(g_of[n_p - 1]) + 1  # the changed copies' groups come first
        if self.fast:  # no copy of the keys per group where the corrections move fewer rows (below)
            idx_s = idx if not one_head else tuple(i[:n_p] for i in idx)
            causal = torch.arange(nk, device=ridx.device) <= idx_s[2].unsqueeze(1)  # [M, keys]
            seen_k = self._seen_changed(kmask, idx_s, causal)
            seen_v = seen_k if vmask is kmask else self._seen_changed(vmask, idx_s, causal)
            shared = one_head  # (the changed copies' rows beside one-head ones: always shared)
            if not one_head:
                pairs = sum(int(m.sum()) for m in (seen_k, seen_v) if m is not None)
                copied = 2 * len(gk) * nk  # key and value rows of the groups' copies
                shared = pairs <= self.SHARED_KEYS_MAX_PAIRS_PER_ROW * copied
        if self.fast and shared:
            k_changed, v_changed = (kmask, seen_k, k_new), (vmask, seen_v, v_new)
            if not one_head:
                return self._attend_shared(l, _cat(q_p, q_e), idx, causal, k_changed, v_changed)
            z_p = None if n_p == 0 else self._attend_shared(l, q_p, idx_s, causal, k_changed, v_changed)
            gk, ge = gk[G:], ge[G:]  # the entering copies' groups: corrupted keys, the patched rows replaced
            k_g = c["k_p"][:, :nk].index_select(0, ge)  # [g, keys, h, dh]
            v_g = c["v_p"][:, :nk].index_select(0, ge)
            if new is not None:
                (k_g if S == "k" else v_g)[Pk[gk, ge, :nk]] = new
        else:
            k_g = c["k_p"][:, :nk].index_select(0, ge)  # [g, keys, h, dh]: each group's own copy
            v_g = c["v_p"][:, :nk].index_select(0, ge)
            if kmask is not None:  # groups are sorted by (copy, example): same order as the mask's rows
                k_g[kmask[gk, ge, :nk]] = k_new
            if vmask is not None:
                v_g[vmask[gk, ge, :nk]] = v_new
            if not one_head:
                return self._attend(attn, _cat(q_p, q_e), idx, k_g, v_g, g_of, slot)
            z_p = None if n_p == 0 else self._attend(attn, q_p, tuple(i[:n_p] for i in idx), k_g[:G], v_g[:G], g_of[:n_p], slot[:n_p])
            gk, k_g, v_g = gk[G:], k_g[G:], v_g[G:]
        # The entering copies (their rows and groups come last) change one head each: the other
        # heads' z are the corrupted run's, and only the patched head's attention is recomputed.
        r, hr, hg = torch.arange(len(q_e), device=q_e.device), heads[ie[0]], heads[gk]
        g = torch.arange(len(hg), device=q_e.device)
        z1 = self._attend(attn, q_e[r, hr].unsqueeze(1), ie, k_g[g, :, hg].unsqueeze(2),
                          v_g[g, :, hg].unsqueeze(2), g_of[n_p:] - G, slot[n_p:])
        z_e = self._at(l, "z", ie)
        z_e[r, hr] = z1[:, 0]
        return _cat(z_p, z_e)

    # -- entry point ---------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, layers: Tensor, stage: str, patch_at: Callable[[int], RowPatch], P: Tensor,
            heads: Optional[Tensor] = None) -> Optional[Tensor]:
        """Logits [K, b, n, vocab] of K copies, copy ``k`` patched at ``stage`` of layer ``layers[k]``
        (non-decreasing), or None if no read row changes.

        ``P`` [K, b, n_eff] marks the rows each copy's patch changes, per example (an example whose
        clean and corrupted values agree in the cell is left out: the patch cannot change it);
        ``patch_at(l)(rows, idx)`` patches the stage values of layer ``l`` in rows ``idx`` = (copy,
        example, position): ``[M, ...]`` slices of the activation (``pattern``: ``[M, n_heads, n_eff]``).
        ``heads`` [K]: the one head copy ``k``'s patch changes (q/k/v/pattern cells of one head); then
        the patched layer recomputes only that head's attention. None: any head may change.
        """
        if stage not in STAGES:
            raise PatchingError(f"unknown stage {stage!r}; choose one of {STAGES}")
        K = len(layers)
        lay = layers.tolist()
        X = D = None
        heads = None if heads is None else heads.to(P.device)
        for l in range(lay[0], self.L):
            enter = layers == l
            entering = l in lay
            Pl = P & enter.to(P.device).view(K, 1, 1) if entering else None
            X, D = self._layer(l, X, D, l == self.L - 1, stage if entering else None, patch_at(l) if entering else None, Pl, heads)
            if D is not None:  # ... plus the rows each patched copy recomputes
                self.rows_computed += int(D.sum())
            if X is None and l >= lay[-1]:
                return None
        out = self.logits.unsqueeze(0).expand(K, *self.logits.shape).clone()
        out[:, :, : self.n_eff][D] = self.model(X.unsqueeze(0), start_at_layer=self.L)[0]
        return out


__all__ = ["IncrementalEngine", "STAGES", "causal_softmax", "padded_softmax"]
