"""The one collapse decision kernel: does scaling q and k per vector move a row's argmax?

Scaling q by f_q and key t by f_t turns the score w_t into f_q·f_t·w_t exactly (RoPE rotates each
vector by an orthogonal map, which commutes with a scalar factor), so a noised row is that product
and a layer's rows are judged on its clean scores without re-running the model (the paper's
"noise every layer independently", Menary et al. 2024). Used by the per-layer protocol on our
models (:func:`interp_norm.noise.collapse.collapse_from_scores`) and on any described model
(:mod:`interp_norm.noise.bridge_collapse`); :func:`rate_table` is both protocols' table of rates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import pandas as pd
import torch
from torch import Tensor

from interp_norm import theory


def cap(x: Tensor, softcap: Optional[float]) -> Tensor:
    """tanh soft cap of scores (Gemma 2); identity when ``softcap`` is None or 0."""
    return torch.tanh(x / softcap) * softcap if softcap else x


def row_decisions(w: Tensor, fq: Tensor, fk: Tensor, base: Tensor, softcap: Optional[float], strict_threshold: float,
                  *, max_elements: int, prune: bool = True) -> tuple[Tensor, Tensor]:
    """(loose, strict) [D, R] for clean rows ``w`` [R, K] (−inf masked) under query factors ``fq``
    [D, R] and key factors ``fk`` [D, F] (a flat table: key t of row r is column ``base[r] + t``),
    in blocks of at most ``max_elements`` numbers.

    Noised row = fq·fk·w (first maximum wins, as ``torch.argmax``); strict also needs
    softmax(cap(noised))[new top] ≥ ``strict_threshold`` (the cap is monotone: it never moves the
    argmax). Speed, when every factor is positive: fq cancels from the argmax, and with key factors
    within [lo, hi] > 0 a key t can beat t* only if max_f f·w_t ≥ min_f f·w_t* (f in [lo, hi]),
    so only those (row, key) "candidate" pairs are kept — a ragged list, not a [R, K_max]
    block, so a few rows with many candidates cost only their own pairs, and rows whose only
    candidate is t* cost nothing. The argmax moves iff some candidate t has fk_t·w_t > fk_t*·w_t*,
    or = with t before t* (the first-maximum rule). ``prune=False`` always takes the whole noised
    row (the general case below): the same decisions with no shortcut, in the exact floating-point
    operations of the per-layer protocol's earlier kernel, which our models' tables keep.
    """
    R = w.shape[0]
    D = fq.shape[0]
    loose = torch.zeros(D, R, dtype=torch.bool)
    strict = torch.zeros(D, R, dtype=torch.bool)
    if R == 0 or D == 0:
        return loose, strict
    rows = _Rows.build(w, fq, fk, base, softcap=softcap, strict_threshold=strict_threshold, max_elements=max_elements)
    lo, hi = (float(fk.min()), float(fk.max())) if fk.numel() else (1.0, 1.0)
    if not prune or not (lo > 0 and bool((fq > 0).all())):
        rows.whole(loose, strict)  # general case (a factor ≤ 0 can reverse a row's order)
    else:
        rows.pruned(loose, strict, lo, hi)
    return loose, strict


@dataclass
class _Rows:
    """What both paths of :func:`row_decisions` read: its arguments, each row's clean top key ``tstar`` and
    score ``wstar``, the masked keys and the scores with them zeroed (``w0``)."""

    w: Tensor
    fq: Tensor
    fk: Tensor
    base: Tensor
    softcap: Optional[float]
    strict_threshold: float
    max_elements: int
    tstar: Tensor
    wstar: Tensor
    masked_w: Tensor
    w0: Tensor
    all_keys: Tensor

    @classmethod
    def build(cls, w: Tensor, fq: Tensor, fk: Tensor, base: Tensor, *, softcap: Optional[float],
              strict_threshold: float, max_elements: int) -> "_Rows":
        tstar = w.argmax(-1)
        masked_w = torch.isneginf(w)
        return cls(w, fq, fk, base, softcap, strict_threshold, max_elements, tstar=tstar,
                   wstar=w.gather(-1, tstar[:, None])[:, 0], masked_w=masked_w, w0=w.masked_fill(masked_w, 0.0),
                   all_keys=torch.arange(w.shape[1]))

    def strict_at(self, dd: Tensor, rr: Tensor) -> Tensor:
        """Strict decisions of (draw, row) pairs whose argmax moved, from their whole noised rows."""
        K = self.w.shape[1]
        out = torch.empty(len(dd), dtype=torch.bool)
        step = max(1, self.max_elements // K)
        for i in range(0, len(dd), step):
            d, r = dd[i:i + step], rr[i:i + step]
            row = (self.w0[r] * self.fk[d[:, None], self.base[r][:, None] + self.all_keys]
                   * self.fq[d, r, None]).masked_fill(self.masked_w[r], -math.inf)
            capped = cap(row, self.softcap)
            out[i:i + step] = torch.exp(capped.max(-1).values - torch.logsumexp(capped, -1)) >= self.strict_threshold
        return out

    def whole(self, loose: Tensor, strict: Tensor) -> None:
        """The general case: the whole noised row, in blocks of draws."""
        w, fq, fk = self.w, self.fq, self.fk
        R, K = w.shape
        D = fq.shape[0]
        minus_inf = torch.zeros_like(w).masked_fill(self.masked_w, -math.inf)
        cols = self.base[:, None] + self.all_keys
        step = max(1, self.max_elements // (R * K))
        for d0 in range(0, D, step):
            d1 = min(D, d0 + step)
            noised = fk[d0:d1].index_select(1, cols.reshape(-1)).view(d1 - d0, R, K)
            moved = noised.mul_(self.w0).mul_(fq[d0:d1, :, None]).add_(minus_inf).argmax(-1) != self.tstar
            loose[d0:d1] = moved
            dd, rr = moved.nonzero(as_tuple=True)
            strict[d0 + dd, rr] = self.strict_at(d0 + dd, rr)

    def pruned(self, loose: Tensor, strict: Tensor, lo: float, hi: float) -> None:
        """Every factor positive, key factors in [lo, hi]: only the candidate (row, key) pairs (see
        :func:`row_decisions`)."""
        w, fq, fk, base, tstar, wstar = self.w, self.fq, self.fk, self.base, self.tstar, self.wstar
        R, K = w.shape
        D = fq.shape[0]
        max_elements, strict_threshold = self.max_elements, self.strict_threshold
        best = torch.where(w >= 0, w * hi, w * lo)  # largest f·w_t over the factor range (−inf stays −inf)
        floor = torch.where(wstar >= 0, wstar * lo, wstar * hi)  # smallest f·w_t*: the top's noised score is above it
        cand = best >= floor[:, None]  # t* included; masked (−inf) keys never qualify
        count = cand.sum(-1)
        cand &= (count >= 2)[:, None]  # a row whose only candidate is t* never moves
        # strict without the far keys: with x = fq·fk·w, M = max_t fk_t·w_t ≥ floor and fq ≥ q_lo (its row
        # minimum, > 0), Σ_{t not candidate} exp(x_t − max x) ≤ far[r]·exp(q_lo·(floor − M))
        q_lo = fq.min(0).values
        far = torch.exp(q_lo[:, None] * (best - floor[:, None])).masked_fill_(cand | self.masked_w, 0.0).sum(-1)
        del best
        pr, pk = cand.nonzero(as_tuple=True)  # [P] candidate pairs (t* included), by row then key
        del cand
        if not len(pr):
            return
        ptr = torch.zeros(R + 1, dtype=torch.long)
        ptr[1:] = torch.bincount(pr, minlength=R).cumsum(0)
        before = (pk < tstar[pr])[:, None]
        wp = w[pr, pk]
        pair_col, star_col = base[pr] + pk, base + tstar
        fkT = fk.T  # [F, D]: one pair's factors over draws are one row
        step = max(1, max_elements // len(pr))
        for d0 in range(0, D, step):
            d1 = min(D, d0 + step)
            f = fkT[:, d0:d1].contiguous()
            v = f.index_select(0, pair_col).mul_(wp[:, None])  # [P, d]
            vs = f.index_select(0, star_col).mul_(wstar[:, None]).index_select(0, pr)  # [P, d]: the row's top
            beats = (v > vs).logical_or_(v.eq_(vs).logical_and_(before))  # t* vs itself: False
            del v, vs, f
            moved = torch.zeros(R, d1 - d0).index_add_(0, pr, beats.to(torch.float32)) > 0  # [R, d]
            del beats
            rr, dd = moved.nonzero(as_tuple=True)
            loose[d0:d1] = moved.T
            dd = dd + d0
            if self.softcap or not len(rr):  # the cap is not a scale: compute the whole row
                strict[dd, rr] = self.strict_at(dd, rr)
                continue
            for i in range(0, len(rr), max(1, max_elements // K)):  # (draw, row) hits, ragged over their candidates
                hr, hd = rr[i:i + max_elements // K or 1], dd[i:i + max_elements // K or 1]
                n_c = ptr[hr + 1] - ptr[hr]
                hit = torch.repeat_interleave(torch.arange(len(hr)), n_c)
                start = torch.repeat_interleave(ptr[hr] - (n_c.cumsum(0) - n_c), n_c)
                pair = start + torch.arange(len(hit))
                y = fk[hd[hit], pair_col[pair]] * wp[pair]  # fq cancels from the max and scales the exponent
                top = torch.full((len(hr),), -math.inf, dtype=y.dtype).scatter_reduce_(0, hit, y, "amax")
                fqh = fq[hd, hr]
                s_c = torch.zeros(len(hr), dtype=y.dtype).index_add_(0, hit, torch.exp(fqh[hit] * (y - top[hit])))
                sure = 1.0 / (s_c + far[hr] * torch.exp(q_lo[hr] * (floor[hr] - top))) >= strict_threshold
                unsure = ~sure & (1.0 / s_c >= strict_threshold)  # the far keys could decide: compute the whole row
                strict[hd[sure], hr[sure]] = True
                if bool(unsure.any()):
                    strict[hd[unsure], hr[unsure]] = self.strict_at(hd[unsure], hr[unsure])


def rate_table(
    per_layer: list[tuple], levels: tuple[float, ...], n_draws: int, columns: dict,
    *, pool_extra: Optional[Callable[[list], dict]] = None,
) -> pd.DataFrame:
    """Tidy rate table from ``(layer, level index, definition, per-row rates, per-row predictions,
    strict samples[, extra columns])`` items: one row per item plus pooled ``layer == "all"`` rows per
    (level, definition). ``measured``/``se`` (clustered by row), ``predicted``, ``mc_se``, ``z`` as in
    :func:`~interp_norm.noise.collapse.measure_collapse`; ``columns`` are constant leading columns (variant, placement, ...). The one
    rate table of every collapse measurement (ours and :func:`~interp_norm.noise.bridge_collapse`, whose
    items carry ``head``/``theory`` as extra columns and whose pooled rows get ``pool_extra(items)``)."""

    def summarise(layer, i, definition, rates: Tensor, pred: Tensor, ns: float, *, extra: Optional[dict] = None) -> dict:
        return dict(columns, layer=layer, **(extra or {}), level=levels[i], definition=definition,
                    **theory.rate_summary(rates, pred, n_draws, ns))

    rows = [summarise(*item[:6], extra=item[6] if len(item) > 6 else None) for item in per_layer]
    for i in range(len(levels)):
        for definition in ("loose", "strict"):
            items = [it for it in per_layer if it[1] == i and it[2] == definition]
            if not items:
                continue
            rates = torch.cat([it[3] for it in items])
            pred = torch.cat([it[4] for it in items])
            rows.append(summarise("all", i, definition, rates, pred, items[0][5],
                                  extra=pool_extra(items) if pool_extra else None))
    df = pd.DataFrame(rows)
    if len(df):
        df["layer"] = df["layer"].astype(object)
    return df


__all__ = ["cap", "row_decisions", "rate_table"]
