"""Per-example metrics of clean/corrupted pairs: logit difference, correct-token probability, KL to clean.

Metrics map logits ``[batch, pos, vocab]`` to per-example values ``[batch]`` (take ``.mean()``
for TransformerLens's scalar convention). They also accept logits of ``R`` stacked copies of the
batch, ``[R*batch, pos, vocab]``, and return ``[R*batch]``: batched patching evaluates many patch
cells in one forward pass that way. ``read_positions`` / ``read_mask`` tell the patching engine
which positions a metric reads, so it can skip computing the others.
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from interp_norm.core import task as T
from interp_norm.circuits._types import device
from interp_norm.circuits.pairs import PatchingPairs, Positions
from interp_norm.errors import PatchingError


class PairMetric:
    """Base class: per-example metric over the scored positions of a :class:`PatchingPairs`.

    ``positions``: ``"diff"`` (default) scores the answer positions where clean and corrupted
    answers differ; ``"answer"`` all answer positions; an int ``j`` only the logits predicting
    answer token ``j`` (0 = the first answer token, predicted at ``=``); or a bool mask
    ``[batch, pos]``. A row's value is the mean over its scored positions.
    """

    name = "metric"
    higher_is_better = True
    supports_stacked = True

    def __init__(self, pairs: PatchingPairs, positions: Positions = "diff"):
        self.pairs = pairs
        mask = _position_mask(pairs, positions)
        self.mask = mask
        self.batch = mask.shape[0]
        self.read_mask = mask  # [batch, pos]: what each example's value reads
        self.read_positions = mask.any(0)  # [pos]
        self.cols = self.read_positions.nonzero().flatten()  # positions actually read
        m = mask[:, self.cols].to(torch.float32)
        self.weights = m / m.sum(-1, keepdim=True)  # [batch, n_cols]
        self.correct = pairs.clean_next[:, self.cols]
        self.wrong = pairs.corrupted_next[:, self.cols]

    def _gather(self, logits: Tensor) -> Tensor:
        """[R*batch, pos, vocab] -> [R, batch, n_cols, vocab] (positions read only)."""
        if logits.ndim != 3 or logits.shape[0] % self.batch:
            raise PatchingError(
                f"{self.name} expects logits [k*{self.batch}, pos, vocab] for this batch of {self.batch} pairs, "
                f"got {tuple(logits.shape)}"
            )
        lg = logits[:, self.cols.to(logits.device)]
        return lg.view(-1, self.batch, *lg.shape[1:])

    def _values(self, lg: Tensor) -> Tensor:  # [R, batch, cols, vocab] -> [R, batch, cols]
        raise NotImplementedError

    def __call__(self, logits: Float[Tensor, "rb pos vocab"]) -> Float[Tensor, " rb"]:
        lg = self._gather(logits)
        v = self._values(lg)
        w = self.weights.to(v.device, v.dtype)
        return (v * w).sum(-1).reshape(-1)

    def mean(self, logits: Tensor) -> Tensor:
        """TransformerLens's convention: a scalar (batch mean)."""
        return self(logits).mean()

    def select(self, rows: Sequence[int]) -> "PairMetric":
        """The same metric for a sub-batch of the pairs (lets long analyses run in chunks)."""
        rows = list(rows)
        return type(self)(self.pairs[rows], self.mask[rows])


class LogitDiff(PairMetric):
    """logit(clean answer token) - logit(corrupted answer token): + means the clean answer wins."""

    name = "logit_diff"

    def _values(self, lg: Tensor) -> Tensor:
        c = self.correct.to(lg.device).unsqueeze(0).unsqueeze(-1).expand(lg.shape[0], -1, -1, 1)
        w = self.wrong.to(lg.device).unsqueeze(0).unsqueeze(-1).expand(lg.shape[0], -1, -1, 1)
        return (lg.gather(-1, c) - lg.gather(-1, w)).squeeze(-1)


class CorrectProb(PairMetric):
    """Softmax probability of the clean answer token."""

    name = "correct_prob"

    def _values(self, lg: Tensor) -> Tensor:
        c = self.correct.to(lg.device).unsqueeze(0).unsqueeze(-1).expand(lg.shape[0], -1, -1, 1)
        return lg.softmax(-1).gather(-1, c).squeeze(-1)


class KLToClean(PairMetric):
    """KL(clean distribution || patched distribution) at the scored positions: 0 = clean behaviour.

    Lower is better (``higher_is_better = False``), so a patch that restores the clean run
    *lowers* it; the normalised recovery (clean - corrupted scale) still reads 1 = restored.
    """

    name = "kl_to_clean"
    higher_is_better = False

    def __init__(self, pairs: PatchingPairs, clean_logits: Tensor, positions: Positions = "diff"):
        super().__init__(pairs, positions)
        if clean_logits.shape[:2] != pairs.clean_tokens.shape:
            raise PatchingError(
                f"clean_logits {tuple(clean_logits.shape)} do not match the pairs' tokens {tuple(pairs.clean_tokens.shape)}"
            )
        self.clean_logits = clean_logits.detach()
        self.clean_logp = self.clean_logits[:, self.cols].log_softmax(-1)

    def select(self, rows: Sequence[int]) -> "KLToClean":
        rows = list(rows)
        return KLToClean(self.pairs[rows], self.clean_logits[rows], self.mask[rows])

    def _values(self, lg: Tensor) -> Tensor:
        ref = self.clean_logp.to(lg.device, lg.dtype).unsqueeze(0)
        return (ref.exp() * (ref - lg.log_softmax(-1))).sum(-1)


def _position_mask(pairs: PatchingPairs, positions: Positions) -> Tensor:
    if isinstance(positions, Tensor):
        m = positions.to(torch.bool)
        if m.ndim == 1:
            m = m.expand(len(pairs), -1)
        if m.shape != pairs.clean_tokens.shape:
            raise PatchingError(f"a positions mask must be [batch, pos] = {tuple(pairs.clean_tokens.shape)}")
        m = m.clone()
    elif positions == "diff":
        m = pairs.score_mask.clone()
    elif positions == "answer":
        m = pairs.answer_mask | pairs.score_mask
    elif isinstance(positions, int) and not isinstance(positions, bool):
        eq = (pairs.clean_tokens == T.EQ_ID).long().argmax(-1)
        has_eq = (pairs.clean_tokens == T.EQ_ID).any(-1)
        if not has_eq.all():
            raise PatchingError("positions=j needs addition problems with '='; pass a bool mask instead")
        pos = eq + positions
        am = pairs.answer_mask
        ok = (pos < pairs.n_pos) & am.gather(1, pos.clamp(max=pairs.n_pos - 1).unsqueeze(1)).squeeze(1)
        if not ok.all() or positions < 0:
            bad = (~ok).nonzero().flatten().tolist()
            raise PatchingError(
                f"answer position {positions} does not exist for pairs {bad[:5]} (their answers are shorter); "
                "use aligned pairs or a smaller answer index"
            )
        m = torch.zeros_like(pairs.clean_tokens, dtype=torch.bool)
        m[torch.arange(len(pairs)), pos] = True
    else:
        raise PatchingError(f"positions must be 'diff', 'answer', an answer index or a bool mask, got {positions!r}")
    if not m.any(-1).all():
        raise PatchingError("some pairs have no scored position under this positions choice")
    return m


def logit_diff(pairs: PatchingPairs, positions: Positions = "diff") -> LogitDiff:
    return LogitDiff(pairs, positions)


def correct_prob(pairs: PatchingPairs, positions: Positions = "diff") -> CorrectProb:
    return CorrectProb(pairs, positions)


def kl_to_clean(pairs: PatchingPairs, clean_logits: Tensor, positions: Positions = "diff") -> KLToClean:
    return KLToClean(pairs, clean_logits, positions)


from interp_norm.core.defaults import CIRCUIT_METRICS as METRICS  # noqa: E402


@torch.no_grad()
def make_metric(name: Union[str, Callable], pairs: PatchingPairs, model=None, positions: Positions = "diff") -> Callable:
    """A metric by name (``logit_diff`` / ``correct_prob`` / ``kl_to_clean``), or the callable itself."""
    if callable(name):
        return name
    if name == "logit_diff":
        return LogitDiff(pairs, positions)
    if name == "correct_prob":
        return CorrectProb(pairs, positions)
    if name == "kl_to_clean":
        if model is None:
            raise PatchingError("kl_to_clean needs the model to compute the clean distribution")
        return KLToClean(pairs, model(pairs.clean_tokens.to(device(model))), positions)
    raise PatchingError(f"unknown metric {name!r}; choose one of {METRICS} or pass a callable logits -> [batch]")


@torch.no_grad()
def answer_metrics(model, pairs: PatchingPairs) -> pd.DataFrame:
    """Clean and corrupted runs scored per answer position: logit diff, correct prob, KL to clean.

    One row per (answer index j, run). Answer index j counts from the first answer token; rows
    use the pairs where that position exists and its tokens differ (``n`` says how many).
    """
    dev = device(model)
    clean_logits = model(pairs.clean_tokens.to(dev))
    corr_logits = model(pairs.corrupted_tokens.to(dev))
    eq = (pairs.clean_tokens == T.EQ_ID).long().argmax(-1)
    rows = []
    n_ans = int(pairs.answer_mask.sum(-1).max())
    for j in range(n_ans):
        pos = eq + j
        m = torch.zeros_like(pairs.score_mask)
        valid = pos < pairs.n_pos
        m[torch.arange(len(pairs))[valid], pos[valid]] = True
        m &= pairs.score_mask
        keep = m.any(-1)
        if not keep.any():
            continue
        sub = pairs[keep.nonzero().flatten()]
        mm = m[keep]
        metrics = [LogitDiff(sub, mm), CorrectProb(sub, mm), KLToClean(sub, clean_logits[keep], mm)]
        for run, lg in (("clean", clean_logits[keep]), ("corrupted", corr_logits[keep])):
            row = dict(answer_index=j, run=run, n=int(keep.sum()))
            for met in metrics:
                row[met.name] = float(met(lg).mean())
            rows.append(row)
    return pd.DataFrame(rows)


__all__ = [
    "PairMetric", "LogitDiff", "CorrectProb", "KLToClean", "logit_diff", "correct_prob", "kl_to_clean",
    "make_metric", "answer_metrics", "METRICS",
]
