"""The incremental patching engine: recompute only the rows a patch can change, with the model's own steps.

A patch in layer ``l`` at positions ``>= p`` cannot change anything before layer ``l`` or at
positions ``< p`` (causal attention). So a chunk of ``K`` patch cells -- ``K`` stacked copies of
the corrupted batch, each patched in its own cell -- starts from the corrupted run at the patched
layer and stage. Each later layer recomputes only the *rows* (copy, example, position) whose input
or attended keys/values changed and that can still reach a position the metric reads (in the last
layer: exactly the read positions). Attention rows attend to their own (copy, example)'s keys and
values: the corrupted run's, with the changed rows replaced. Only changed rows are kept between layers.

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
_ATTENTION = (None, "q", "k", "v")  # stages before the scores: the attention is recomputed
_BEFORE_Z = (None, "q", "k", "v", "pattern", "z")  # the attention output is recomputed
_CHECKED: "weakref.WeakSet" = weakref.WeakSet()  # models whose wiring matched model(tokens)

#: ``patch(rows, idx)`` returns the stage values of rows ``idx = (copy, example, position)`` patched.
RowPatch = Callable[[Tensor, tuple], Tensor]


def causal_softmax(scores: Tensor, causal: Tensor) -> Tensor:
    """Softmax over the last axis with ``~causal`` entries masked out (zero weight)."""
    m = scores.masked_fill(~causal, float("-inf")).amax(-1, keepdim=True)
    e = (scores - m).exp() * causal
    return e / e.sum(-1, keepdim=True)


def _from_first(mask: Tensor) -> Tensor:
    """True at and after the first True along the last axis."""
    return mask.cumsum(-1) > 0


def _until_last(mask: Tensor) -> Tensor:
    """True at and before the last True along the last axis."""
    return mask.flip(-1).cumsum(-1).flip(-1) > 0


class IncrementalEngine:
    """The corrupted run of ``tokens`` and the row-incremental re-runs of patched copies of it.

    ``read_mask`` [batch, pos]: the logits positions the metric reads (None: all). ``acts[l][stage]``
    holds the corrupted run's activations (``q``/``k``/``v`` as hooked, before any per-head norm;
    ``*_used`` after it). :meth:`run` returns the logits of K patched copies.
    """

    def __init__(self, model, tokens: Tensor, read_mask: Optional[Tensor] = None):
        self.model = model
        self.L = model.cfg.n_layers
        self.b, self.n = tokens.shape
        dev = tokens.device
        read = torch.ones(self.b, self.n, dtype=torch.bool, device=dev) if read_mask is None else read_mask
        read = read.to(dev, torch.bool).expand(self.b, self.n)
        # positions after the last one the metric reads cannot influence it
        any_read = read.any(0).nonzero().flatten()
        self.n_eff = ne = int(any_read.max()) + 1 if any_read.numel() else self.n
        self.need_last = read[:, :ne]  # [b, ne]: rows whose logits the metric reads
        self.need = _until_last(self.need_last)  # rows at or before an example's last read row
        self.causal = torch.ones(self.n, self.n, dtype=torch.bool, device=dev).tril()
        with torch.no_grad():
            resid = model(tokens, stop_at_layer=0)
            self.acts: list[dict[str, Tensor]] = []
            for blk in model.blocks:
                self.acts.append(self._block(blk, resid))
                resid = self.acts[-1]["resid_post"]
            self.logits = model(resid, start_at_layer=self.L)
            if model not in _CHECKED:
                self._check(tokens)
        self.c = [{k: (v[:, :, :ne, :ne] if k == "pattern" else v[:, :ne]) for k, v in a.items()} for a in self.acts]

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

    def _block(self, blk, resid: Tensor) -> dict[str, Tensor]:
        """Every stage of one block on whole sequences [b, n, ...]."""
        attn = blk.attn
        xs = self._attn_inputs(blk, resid)
        a = {"resid_pre": resid}
        for t, x in zip("qkv", xs):
            a[t] = attn.project(x, t)
            a[f"{t}_used"] = attn.normalize(a[t], t)
        n = resid.shape[1]
        # as the model's forward computes it, so clean and corrupted activations that agree in the
        # model agree here bit for bit (cells where they agree need no forward pass)
        a["pattern"] = attn.scores(a["q_used"], a["k_used"]).masked_fill(~self.causal[:n, :n], float("-inf")).softmax(-1)
        a["z"] = torch.einsum("bhqk,bkhd->bqhd", a["pattern"], a["v_used"])
        a["attn_out"] = self._attn_update(blk, attn.out(a["z"]), resid)
        a["resid_mid"] = resid + a["attn_out"]
        a["mlp_out"] = blk.mlp_update(a["resid_mid"])
        a["resid_post"] = a["resid_mid"] + a["mlp_out"]
        return a

    def _check(self, tokens: Tensor) -> None:
        ref = self.model(tokens)
        err = float((self.logits - ref).abs().max())
        if not err <= 1e-4 * (float(ref.abs().max()) + 1.0):
            raise PatchingError(
                f"the incremental patching engine disagrees with model(tokens) by {err:.3g}: the model's block is "
                "wired differently from attention + MLP with residual sums -- use method='hooks'"
            )
        _CHECKED.add(self.model)

    # -- rows ----------------------------------------------------------------------------------
    def _rows(self, c: dict, X: Optional[Tensor], D: Optional[Tensor], mask: Tensor) -> Tensor:
        """resid_pre rows ``mask`` [K, b, n]: the corrupted run's, with the changed rows ``X``
        (rows of ``D``, in ``D``'s order) in place."""
        if X is not None and torch.equal(mask, D):
            return X
        _, bidx, ridx = mask.nonzero(as_tuple=True)
        out = c["resid_pre"][bidx, ridx]
        if X is not None:
            slot = torch.full(D.shape, -1, dtype=torch.long, device=D.device)
            slot[D] = torch.arange(len(X), device=D.device)
            s = slot[mask]
            hit = s >= 0
            out[hit] = X[s[hit]]
        return out

    def _attend(self, attn, q_rows: Tensor, idx: tuple, k_g: Tensor, v_g: Tensor, g_of: Tensor, slot: Tensor) -> Tensor:
        """z [M, h, dh] of query rows ``idx`` against their own group's keys/values ``k_g``/``v_g``
        [g, keys, h, dh]. The rows are packed per group (``g_of``, ``slot``) into a zero-padded block:
        recomputed rows are a small ragged subset of copies x examples x positions."""
        g, nk = k_g.shape[:2]
        w = int(slot.max()) + 1
        q = q_rows.new_zeros(g, w, *q_rows.shape[1:])
        q[g_of, slot] = q_rows
        pos = idx[2].new_zeros(g, w)  # padding rows: position 0 (a valid, discarded softmax)
        pos[g_of, slot] = idx[2]
        pattern = causal_softmax(attn.scores(q, k_g), self.causal[pos, :nk].unsqueeze(1))  # [g, h, w, keys]
        return torch.einsum("ghwk,gkhd->gwhd", pattern, v_g)[g_of, slot]

    def _layer(
        self, l: int, X: Optional[Tensor], D: Optional[Tensor], last: bool,
        S: Optional[str] = None, patch: Optional[RowPatch] = None, P: Optional[Tensor] = None,
    ) -> tuple[Optional[Tensor], Tensor]:
        """One block for K copies. ``D`` [K, b, n] marks the resid_pre rows that differ from the
        corrupted run and ``X`` holds them; or the patch enters here at stage ``S``, changing rows
        ``P`` [K, b, n] through ``patch``. Returns (resid_post rows, their mask [K, b, n])."""
        blk, c = self.model.blocks[l], self.c[l]
        attn = blk.attn
        need = self.need_last if last else self.need
        if S == "resid_pre":  # the patched rows become the changed input of an ordinary layer
            D = P & self.need
            pidx = D.nonzero(as_tuple=True)
            X, S = patch(c["resid_pre"][pidx[1], pidx[2]], pidx), None
        if S is None:
            A = _from_first(D) & need  # query rows at or after a changed key/value row
        elif S in ("k", "v"):
            A = _from_first(P) & need
        else:
            A = P & need
        if not A.any():
            return None, A
        idx = kidx, bidx, ridx = A.nonzero(as_tuple=True)
        # resid_pre rows A: changed ones from X, the others from the corrupted run
        xA = self._rows(c, X, D, A) if S is None else c["resid_pre"][bidx, ridx]

        if S in _ATTENTION:
            keys, g_of, counts = torch.unique_consecutive(kidx * self.b + bidx, return_inverse=True, return_counts=True)
            slot = torch.arange(len(kidx), device=A.device) - (counts.cumsum(0) - counts)[g_of]
            gk, ge = keys // self.b, keys % self.b
            seen = _until_last(A)  # a key row matters only to query rows at or after it
            nk = int(ridx.max()) + 1
            k_g = c["k_used"][:, :nk].index_select(0, ge)  # [g, keys, h, dh]
            v_g = c["v_used"][:, :nk].index_select(0, ge)
            x_q = None
            if S is None:
                kv = D & self.need & seen
                if kv.any():
                    same = torch.equal(kv, A)
                    xs = self._attn_inputs(blk, xA if same else self._rows(c, X, D, kv))
                    x_q = xs[0] if same else None
                    sel = kv[gk, ge, :nk]  # same order as kv's rows: groups are sorted by (copy, example)
                    k_g[sel] = attn.normalize(attn.project(xs[1].unsqueeze(0), "k")[0], "k")
                    v_g[sel] = attn.normalize(attn.project(xs[2].unsqueeze(0), "v")[0], "v")
                if x_q is None:
                    x_q = self._attn_inputs(blk, xA)[0]
                q_rows = attn.normalize(attn.project(x_q.unsqueeze(0), "q")[0], "q")
            elif S == "q":
                q_rows = attn.normalize(patch(c["q"][bidx, ridx], idx), "q")
            else:  # the patched key/value rows replace the corrupted ones
                Pk = P & seen
                pidx = Pk.nonzero(as_tuple=True)
                new = attn.normalize(patch(c[S][pidx[1], pidx[2]], pidx), S)
                (k_g if S == "k" else v_g)[Pk[gk, ge, :nk]] = new
                q_rows = c["q_used"][bidx, ridx]
            z = self._attend(attn, q_rows, idx, k_g, v_g, g_of, slot)
        elif S == "pattern":
            pattern = patch(c["pattern"][bidx, :, ridx], idx)  # [M, h, keys]
            z = torch.einsum("mhk,mkhd->mhd", pattern, c["v_used"][bidx])
        elif S == "z":
            z = patch(c["z"][bidx, ridx], idx)

        if S in _BEFORE_Z:
            attn_out = self._attn_update(blk, attn.out(z.unsqueeze(0))[0], xA)
        elif S == "attn_out":
            attn_out = patch(c["attn_out"][bidx, ridx], idx)
        if S in _BEFORE_Z or S == "attn_out":
            resid_mid = xA + attn_out
        elif S == "resid_mid":
            resid_mid = patch(c["resid_mid"][bidx, ridx], idx)
        elif S == "mlp_out":
            resid_mid = c["resid_mid"][bidx, ridx]
        else:  # resid_post
            return patch(c["resid_post"][bidx, ridx], idx), A
        if S == "mlp_out":
            mlp_out = patch(c["mlp_out"][bidx, ridx], idx)
        else:
            mlp_out = blk.mlp_update(resid_mid.unsqueeze(0))[0]
        return resid_mid + mlp_out, A

    # -- entry point ---------------------------------------------------------------------------
    @torch.no_grad()
    def run(self, layer: int, stage: str, patch: RowPatch, P: Tensor) -> Optional[Tensor]:
        """Logits [K, b, n, vocab] of K copies patched at ``layer``/``stage``, or None if no read row changes.

        ``P`` [K, b, n_eff] marks the rows each copy's patch changes, per example (an example whose
        clean and corrupted values agree in the cell is left out: the patch cannot change it);
        ``patch(rows, idx)`` patches the stage values of rows ``idx`` = (copy, example, position):
        ``[M, ...]`` slices of the activation (for ``pattern``: ``[M, n_heads, n_eff]`` query rows).
        """
        if stage not in STAGES:
            raise PatchingError(f"unknown stage {stage!r}; choose one of {STAGES}")
        X, D = None, None
        for l in range(layer, self.L):
            entry = l == layer
            X, D = self._layer(l, X, D, l == self.L - 1, stage if entry else None, patch if entry else None, P)
            if X is None:
                return None
        out = self.logits.unsqueeze(0).expand(P.shape[0], *self.logits.shape).clone()
        out[:, :, : self.n_eff][D] = self.model(X.unsqueeze(0), start_at_layer=self.L)[0]
        return out


__all__ = ["IncrementalEngine", "STAGES", "causal_softmax"]
