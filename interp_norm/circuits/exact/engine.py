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

Two arithmetics, one wiring (:mod:`interp_norm.circuits.exact.block_steps`): with ``exact_pattern=True``
the model's own steps, so the corrupted run's activations equal ``model.run_with_cache``'s bit for
bit; otherwise, when no hook is on the model, fused CPU kernels equal to them up to rounding. In fast
mode recomputed rows also attend against each example's corrupted keys and values shared by all its
copies, with the changed rows as per-pair corrections (:meth:`IncrementalEngine._attend_shared`),
where that moves fewer rows than a copy of the keys per (copy, example). The engine adds the wiring
between the steps: ``pattern @ v`` and the two residual sums. Once per model and arithmetic the
corrupted run is compared with ``model(tokens)`` (again whenever the weights change:
:func:`weights_key`), so a block wired differently is refused (:class:`~interp_norm.errors.EngineRefusal`)
instead of giving wrong numbers. The rows passed between the steps are named row sets
(:mod:`interp_norm.circuits.exact.engine_rows`).
"""

from __future__ import annotations

import weakref
from typing import Callable, Hashable, Optional

import torch
from torch import Tensor

from interp_norm.circuits.exact.block_steps import BlockSteps, causal_softmax, padded_softmax
from interp_norm.circuits.exact.engine_rows import (
    Changed,
    Entry,
    KVChanges,
    LayerRows,
    QueryRows,
    Replaced,
    RowPatch,
    cat_rows,
    from_first,
    until_last,
)
from interp_norm.errors import EngineRefusal, PatchingError

#: Stages of one block, in computation order; a patch enters at one of them.
STAGES = ("resid_pre", "q", "k", "v", "pattern", "z", "attn_out", "resid_mid", "mlp_out", "resid_post")
_BEFORE_SCORES = ("q", "k", "v")  # entering copies whose attention is recomputed
_BEFORE_OUT = ("q", "k", "v", "pattern", "z")  # ... whose attention output is recomputed
#: model -> {wiring: :func:`weights_key` when that wiring's check last passed} (see :func:`check_once`)
_CHECKED: "weakref.WeakKeyDictionary[torch.nn.Module, dict[Hashable, tuple]]" = weakref.WeakKeyDictionary()


def check_once(model, wiring: Hashable, check: Callable[[], None], key: Optional[tuple] = None) -> None:
    """Run ``check`` (it raises :class:`~interp_norm.errors.EngineRefusal` on a mismatch) unless it
    already passed for ``model`` with this ``wiring`` and these weights (:func:`weights_key`; ``key``: that
    key, when the caller has it already): a re-implementation of the model's forward is compared with the
    model once, not on every call."""
    key = weights_key(model) if key is None else key
    if _CHECKED.get(model, {}).get(wiring) != key:
        check()
        _CHECKED.setdefault(model, {})[wiring] = key


def weights_key(model) -> tuple:
    """What changes when the model's weights do, cheaply: per parameter and buffer, the tensor, its
    storage, shape and version counter (bumped by every in-place write: an optimizer step,
    ``load_state_dict``, ``p.add_()``); an inference-mode tensor, which has no version counter, by its
    sum. The wiring check is redone when this key changes, so a model retrained or reloaded after a
    check is checked again."""
    key = []
    for t in (*model.parameters(), *model.buffers()):
        ver = float(t.detach().double().sum()) if t.is_inference() else t._version
        key.append((id(t), t.data_ptr(), tuple(t.shape), ver))
    return tuple(key)


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
        self.need = until_last(self.need_last)  # rows at or before an example's last read row
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
            check_once(model, ("incremental", self.fast), lambda: self._check(tokens))
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
            a[f"{t}_used"] = attn.normalize(y, t)
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
            raise EngineRefusal(
                f"the incremental patching engine disagrees with model(tokens) by {err:.3g}: the model's block is "
                "wired differently from attention + MLP with residual sums -- use method='hooks'"
            )

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

    def _rows(self, l: int, inp: Optional[Changed], mask: Tensor) -> Tensor:
        """resid_pre rows ``mask`` [K, b, n]: the corrupted run's, with the changed rows ``inp`` in place."""
        if inp is not None and torch.equal(mask, inp.mask):
            return inp.values
        out = self._at(l, "resid_pre", mask.nonzero(as_tuple=True))
        if inp is not None:
            D = inp.mask
            slot = torch.full(D.shape, -1, dtype=torch.long, device=D.device)
            slot[D] = torch.arange(len(inp.values), device=D.device)
            s = slot[mask]
            hit = s >= 0
            out[hit] = inp.values[s[hit]]
        return out

    def _mlp_rows(self, l: int, x: Tensor, block: int = 512) -> Tensor:
        """The MLP update of rows [M, d], in blocks: the hidden layer of a block stays in cache."""
        if len(x) <= block:
            return self._mlp(l, x)
        return torch.cat([self._mlp(l, x[i : i + block]) for i in range(0, len(x), block)])

    # -- attention of recomputed rows ---------------------------------------------------------
    def _attend(self, attn, q: Tensor, rows: QueryRows, k_g: Tensor, v_g: Tensor) -> Tensor:
        """z [M, h, dh] of query ``rows`` against their own group's keys/values ``k_g``/``v_g``
        [groups, keys, h, dh]. The rows are packed per group into a zero-padded block: recomputed
        rows are a small ragged subset of copies x examples x positions.

        Fast mode folds the heads into the matrix rows: one ``[w*h, dh] @ [dh, keys*h]`` product per
        group, of which the head-diagonal blocks are the scores (and ``pattern @ v`` likewise with a
        block-diagonal pattern). It does ``h`` times the multiply-adds of per-head products but in
        ``h`` times fewer, larger matrices: several times faster for these 1-7-row blocks."""
        g, nk = k_g.shape[0], k_g.shape[1]
        h, dh = q.shape[1:]
        w = int(rows.slot.max()) + 1
        flat = rows.group * w + rows.slot  # flat (group, slot) index: index_copy/index_select, not 2-d advanced indexing
        qp = q.new_zeros(g * w, h, dh)
        qp.index_copy_(0, flat, q)
        pos = rows.idx[2].new_zeros(g * w)  # padding rows: position 0 (a valid, discarded softmax)
        pos.index_copy_(0, flat, rows.idx[2])
        keys = torch.arange(nk, device=pos.device)
        if not self.fast or w > self.BLOCK_DIAGONAL_MAX_ROWS:
            scores = attn.scores(qp.view(g, w, h, dh), k_g)  # [g, h, w, keys]
            z = self._softmax(scores, keys <= pos.view(g, 1, w, 1)) @ v_g.transpose(1, 2)  # [g, h, w, dh]
            return z.transpose(1, 2).reshape(g * w, h, dh).index_select(0, flat)
        qk = torch.bmm(qp.view(g, w * h, dh), k_g.view(g, nk * h, dh).transpose(1, 2))
        qk = qk.view(g, w, h, nk, h).diagonal(dim1=2, dim2=4).transpose(2, 3)  # [g, w, h, keys]
        pattern = padded_softmax(attn.scale_scores(qk), keys <= pos.view(g, w, 1, 1))
        block = pattern.new_zeros(g, w, h, nk, h)
        block.diagonal(dim1=2, dim2=4).copy_(pattern.transpose(2, 3))
        z = torch.bmm(block.view(g, w * h, nk * h), v_g.reshape(g, nk * h, dh))  # [g, w*h, dh]
        return z.view(g * w, h, dh).index_select(0, flat)

    @staticmethod
    def _seen_changed(rep: Optional[Replaced], rows: QueryRows) -> Optional[Replaced]:
        """``rep`` with :attr:`Replaced.seen` [M, keys]: which of its group's changed key rows each
        query row sees (the keys at or before the row)."""
        if rep is None:
            return None
        seen = rep.mask[rows.idx[0], rows.idx[1], : rows.n_keys] & rows.causal
        return Replaced(rep.mask, rep.values, seen)

    def _attend_shared(self, l: int, q: Tensor, rows: QueryRows, keys: Optional[Replaced], values: Optional[Replaced]) -> Tensor:
        """z [M, h, dh] of query ``rows`` (fast mode) without a copy of the keys per group:
        scores and ``pattern @ v`` against each example's corrupted keys/values as one batched
        product (the rows packed per example), then the group's changed ``keys``/``values`` (with
        their ``seen`` pairs, :meth:`_seen_changed`) as corrections, one per (query row, changed key
        row) pair."""
        attn, c = self.model.blocks[l].attn, self.c[l]
        kidx, bidx, _ = rows.idx
        (M, h, dh), b, dev, nk = q.shape, self.b, q.device, rows.n_keys
        counts = torch.bincount(bidx, minlength=b)
        R = int(counts.max())
        order = torch.argsort(bidx, stable=True)
        slot = torch.empty_like(bidx)
        slot[order] = torch.arange(M, device=dev) - (counts.cumsum(0) - counts)[bidx[order]]
        flat = bidx * R + slot  # each row's place in the [b, R] packing
        Q = q.new_zeros(b * R, h, dh).index_copy_(0, flat, q).view(b, R, h, dh)
        qk = torch.einsum("brhd,bkhd->brhk", Q, c["k_p"][:, :nk]).reshape(b * R, h, nk).index_select(0, flat)

        def pairs(rep: Optional[Replaced]):
            """(row, key) pairs whose key/value is the group's changed one, and that value."""
            if rep is None:
                return None
            i, j = rep.seen.nonzero(as_tuple=True)
            where = torch.full(rep.mask.shape, -1, dtype=torch.long, device=dev)
            where[rep.mask] = torch.arange(len(rep.values), device=dev)
            return i, j, rep.values.index_select(0, where[kidx[i], bidx[i], j])

        kc = pairs(keys)
        if kc is not None:
            i, j, k = kc
            qk[i, :, j] = (q.index_select(0, i) * k).sum(-1)
        pattern = padded_softmax(attn.scale_scores(qk), rows.causal.unsqueeze(1))  # [M, h, keys]
        vc = pairs(values)
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

    def _group_kv(self, l: int, rows: QueryRows, keys: Optional[Replaced], values: Optional[Replaced]) -> tuple[Tensor, Tensor]:
        """Each group's own copy of its example's corrupted keys and values [groups, keys, h, dh],
        the ``keys``/``values`` rows replaced (groups are sorted like the masks' rows)."""
        c, nk, gk, ge = self.c[l], rows.n_keys, rows.group_copy, rows.group_example
        k_g = c["k_p"][:, :nk].index_select(0, ge)
        v_g = c["v_p"][:, :nk].index_select(0, ge)
        if keys is not None:
            k_g[keys.mask[gk, ge, :nk]] = keys.values
        if values is not None:
            v_g[values.mask[gk, ge, :nk]] = values.values
        return k_g, v_g

    def _attend_rows(self, l: int, q: Tensor, rows: QueryRows, kv: KVChanges, shared: Optional[bool] = None) -> Tensor:
        """z [M, h, dh] of query ``rows`` (every head) against keys/values with ``kv``'s rows replaced.
        Fast mode attends against the shared keys plus corrections where that moves fewer rows than
        copies of the keys per group (:attr:`SHARED_KEYS_MAX_PAIRS_PER_ROW`; ``shared`` forces it);
        otherwise (and always with the model's own steps) against per-group copies."""
        keys, values = kv.replaced("k"), kv.replaced("v")
        if self.fast:
            seen_k = self._seen_changed(keys, rows)
            if keys is not None and values is not None and values.mask is keys.mask:  # one mask: its pairs once
                seen_v = Replaced(values.mask, values.values, seen_k.seen)
            else:
                seen_v = self._seen_changed(values, rows)
            if shared is None:
                pairs = sum(int(r.seen.sum()) for r in (seen_k, seen_v) if r is not None)
                copied = 2 * len(rows.group_copy) * rows.n_keys  # key and value rows of the groups' copies
                shared = pairs <= self.SHARED_KEYS_MAX_PAIRS_PER_ROW * copied
            if shared:
                return self._attend_shared(l, q, rows, seen_k, seen_v)
        k_g, v_g = self._group_kv(l, rows, keys, values)
        return self._attend(self.model.blocks[l].attn, q, rows, k_g, v_g)

    def _attend_one_head(self, l: int, q: Tensor, rows: QueryRows, kv: KVChanges, heads: Tensor) -> Tensor:
        """z [M, h, dh] of the entering copies' query ``rows`` when each copy's patch changes one head
        (``heads`` [K]): the other heads' z are the corrupted run's, and only the patched head's
        attention is recomputed, against its group's keys/values with the patched rows replaced."""
        k_g, v_g = self._group_kv(l, rows, kv.replaced("k"), kv.replaced("v"))
        r, hr, hg = torch.arange(len(q), device=q.device), heads[rows.idx[0]], heads[rows.group_copy]
        g = torch.arange(len(hg), device=q.device)
        z1 = self._attend(self.model.blocks[l].attn, q[r, hr].unsqueeze(1), rows, k_g[g, :, hg].unsqueeze(2),
                          v_g[g, :, hg].unsqueeze(2))
        z = self._at(l, "z", rows.idx)
        z[r, hr] = z1[:, 0]
        return z

    def _kv_changes(self, l: int, inp: Optional[Changed], rows: LayerRows, entry: Optional[Entry], seen: Tensor) -> KVChanges:
        """The new q/k/v of the changed input rows that some query row sees (``seen``), and the
        entering copies' patched key/value rows (``entry`` at stage k or v)."""
        attn = self.model.blocks[l].attn
        out = KVChanges()
        kv = None if inp is None else inp.mask & self.need & seen  # changed rows: new keys/values, and queries
        if kv is not None and kv.any():
            x_kv = rows.x if torch.equal(kv, rows.changed) else self._rows(l, inp, kv)
            out.rows = kv
            out.q, out.k, out.v = (attn.normalize(y, t) for y, t in zip(self._qkv(l, x_kv), "qkv"))
        if entry is not None and entry.stage in ("k", "v"):  # the entering copies' patched key/value rows
            out.patched_stage, out.patched = entry.stage, entry.rows & seen
            pidx = out.patched.nonzero(as_tuple=True)
            out.patched_values = attn.normalize(entry.patch(self._at(l, entry.stage, pidx), pidx), entry.stage)
        return out

    def _queries(self, l: int, rows: LayerRows, entry: Optional[Entry], kv: KVChanges) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """Queries of the changed copies' rows (the corrupted run's, new where the input changed) and,
        for a q/k/v patch, of the entering copies' rows (patched for ``q``)."""
        attn = self.model.blocks[l].attn
        q_changed = q_entering = None
        if rows.changed is not None:
            q_changed = self._at(l, "q_used", rows.changed.nonzero(as_tuple=True))
            if kv.q is not None:  # (in the last layer some changed key rows are no query rows)
                q_changed[kv.rows[rows.changed]] = kv.q[rows.changed[kv.rows]]
        stage, ie = None if entry is None else entry.stage, rows.entering_idx
        if stage == "q":
            q_entering = attn.normalize(entry.patch(self._at(l, "q", ie), ie), "q")
        elif stage in ("k", "v"):
            q_entering = self._at(l, "q_used", ie)
        return q_changed, q_entering

    def _attention(self, l: int, inp: Optional[Changed], rows: LayerRows, entry: Optional[Entry]) -> Tensor:
        """z of the changed copies' rows and, for a q/k/v patch, of the entering copies' rows (their
        rows come last). Keys and values are the corrupted run's, with the rows that changed
        (``inp``) or are patched (stage k/v) replaced."""
        stage = None if entry is None else entry.stage
        qmask = rows.union if stage in _BEFORE_SCORES else rows.changed
        queries = QueryRows.of(qmask, self.b)
        kv = self._kv_changes(l, inp, rows, entry, until_last(qmask))  # a key row matters only to query rows at or after it
        q_changed, q_entering = self._queries(l, rows, entry, kv)
        if entry is None or entry.heads is None or q_entering is None:
            return self._attend_rows(l, cat_rows(q_changed, q_entering), queries, kv)
        # entering copies that change one head each; the changed copies' rows (first) beside them
        n_changed = 0 if q_changed is None else len(q_changed)
        changed, entering = queries.split(n_changed)
        z_changed = None
        if n_changed:
            z_changed = self._attend_rows(l, q_changed, changed, kv.only_changed(), shared=True if self.fast else None)
        return cat_rows(z_changed, self._attend_one_head(l, q_entering, entering, kv.only_patched(), entry.heads))

    # -- one block for K copies ------------------------------------------------------------------
    def _layer_rows(self, l: int, inp: Optional[Changed], entry: Optional[Entry], last: bool) -> Optional[LayerRows]:
        """The rows block ``l`` recomputes (None: nothing the metric can see changes)."""
        need = self.need_last if last else self.need
        changed = None if inp is None else from_first(inp.mask) & need  # rows at or after a changed key/value row
        entering = None if entry is None else (from_first(entry.rows) if entry.stage in ("k", "v") else entry.rows) & need
        if changed is not None and not changed.any():
            changed = None
        if entering is not None and not entering.any():
            entering = None  # the entering copies change nothing the metric can see
        if changed is None and entering is None:
            return None
        union = entering if changed is None else (changed if entering is None else changed | entering)
        return LayerRows(
            changed=changed, entering=entering, union=union,
            entering_idx=None if entering is None else entering.nonzero(as_tuple=True),
            x=None if changed is None else self._rows(l, inp, changed),  # resid_pre rows of the changed copies
        )

    def _layer(self, l: int, inp: Optional[Changed], entry: Optional[Entry], last: bool) -> Optional[Changed]:
        """One block for K copies: the input rows ``inp`` differ from the corrupted run, and the copies
        of ``entry`` are patched here. Returns the output rows that differ (None: none the metric sees)."""
        if entry is not None and entry.stage == "resid_pre":  # the patched rows join the changed input
            rows = entry.rows & self.need
            pidx = rows.nonzero(as_tuple=True)
            values = cat_rows(None if inp is None else inp.values, entry.patch(self._at(l, "resid_pre", pidx), pidx))
            inp, entry = Changed(values, rows if inp is None else inp.mask | rows), None
        rows = self._layer_rows(l, inp, entry, last)
        if rows is None:
            return None
        if rows.entering is None:
            entry = None
        z = None
        if rows.changed is not None or (entry is not None and entry.stage in _BEFORE_SCORES):
            z = self._attention(l, inp, rows, entry)
        post = self._block_rest(l, rows, entry, z)
        return Changed(post, rows.union)

    def _block_rest(self, l: int, rows: LayerRows, entry: Optional[Entry], z: Optional[Tensor]) -> Tensor:
        """From ``z`` (the changed rows', then any entering ones') to the block's output rows: the
        changed copies' rows, then the entering copies' from their stage on (a pattern patch
        recomputes its rows' ``z``; a later stage's patch joins where the block computes it)."""
        blk, ie = self.model.blocks[l], rows.entering_idx
        stage = None if entry is None else entry.stage

        def entering(at: str) -> Tensor:  # the corrupted run's values in the entering rows
            return self._at(l, at, ie)

        def patched(at: str) -> Tensor:
            return entry.patch(entering(at), ie)

        if stage == "pattern":
            z = cat_rows(z, self._pattern_z(l, patched("pattern"), ie, entry.heads))
        elif stage == "z":
            z = cat_rows(z, patched("z"))
        x_e = entering("resid_pre") if stage in _BEFORE_OUT or stage == "attn_out" else None
        attn_out = None
        if z is not None:
            attn_out = self._attn_update(blk, self._out(l, z), cat_rows(rows.x, None if stage == "attn_out" else x_e))
        if stage == "attn_out":
            attn_out = cat_rows(attn_out, patched("attn_out"))
        resid_mid = None if attn_out is None else cat_rows(rows.x, x_e) + attn_out
        if stage == "resid_mid":
            resid_mid = cat_rows(resid_mid, patched("resid_mid"))
        post = None if resid_mid is None else resid_mid + self._mlp_rows(l, resid_mid)
        if stage == "mlp_out":
            post = cat_rows(post, entering("resid_mid") + patched("mlp_out"))
        elif stage == "resid_post":
            post = cat_rows(post, patched("resid_post"))
        return post

    def _pattern_z(self, l: int, pattern: Tensor, ie: tuple, heads: Optional[Tensor]) -> Tensor:
        """z of the entering rows ``ie`` from their patched ``pattern`` [M, h, keys] and the corrupted
        values (``heads``: only each copy's one patched head changes)."""
        v = self.c[l]["v_p"].index_select(0, ie[1])  # [M, keys, h, dh]
        if heads is None:
            return (pattern.unsqueeze(2) @ v.transpose(1, 2)).squeeze(2)
        r, hr = torch.arange(len(ie[0]), device=v.device), heads[ie[0]]
        z = self._at(l, "z", ie)
        z[r, hr] = (pattern[r, hr].unsqueeze(1) @ v[r, :, hr]).squeeze(1)
        return z

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
        heads = None if heads is None else heads.to(P.device)
        out: Optional[Changed] = None
        for l in range(lay[0], self.L):
            entry = None
            if l in lay:
                entry = Entry(stage, patch_at(l), P & (layers == l).to(P.device).view(K, 1, 1), heads)
            out = self._layer(l, out, entry, l == self.L - 1)
            if out is not None:  # ... plus the rows each patched copy recomputes
                self.rows_computed += int(out.mask.sum())
            elif l >= lay[-1]:
                return None
        logits = self.logits.unsqueeze(0).expand(K, *self.logits.shape).clone()
        logits[:, :, : self.n_eff][out.mask] = self.model(out.values.unsqueeze(0), start_at_layer=self.L)[0]
        return logits


__all__ = ["IncrementalEngine", "STAGES", "causal_softmax", "check_once", "padded_softmax", "weights_key"]
