"""Clean/corrupted pairs for addition and the per-example metrics every circuit tool evaluates.

A pair is a clean problem and a copy with one operand digit (or one operator) changed such that
the token length stays the same and the answer changes. Both sequences are teacher-forced with
their own answers, so position ``p`` plays the same role in both and only the corrupted token and
the answer tokens differ.

Metrics map logits ``[batch, pos, vocab]`` to per-example values ``[batch]`` (take ``.mean()``
for TransformerLens's scalar convention). They also accept logits of ``R`` stacked copies of the
batch, ``[R*batch, pos, vocab]``, and return ``[R*batch]``: batched patching evaluates many patch
cells in one forward pass that way. ``read_positions`` tells the patching engine which positions
a metric reads, so it can skip computing the others.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from interp_norm import task as T
from interp_norm.errors import PatchingError

Positions = Union[str, int, Tensor]


# ----------------------------------------------------------------------------- pairs


@dataclass
class PatchingPairs:
    """Clean and corrupted token batches of equal shape, plus which logit positions are scored.

    ``score_mask[b, p]`` is True where the logits at ``p`` are scored; by default the answer
    positions (:func:`interp_norm.task.answer_mask` of the clean tokens) whose next token differs
    between clean and corrupted -- elsewhere a logit difference is zero by construction.
    Pass your own ``score_mask`` for token sequences that are not addition problems.
    """

    clean_tokens: Int[Tensor, "batch pos"]
    corrupted_tokens: Int[Tensor, "batch pos"]
    score_mask: Optional[Bool[Tensor, "batch pos"]] = None
    clean_problems: Optional[list] = None
    corrupted_problems: Optional[list] = None
    corruptions: Optional[pd.DataFrame] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        c, x = self.clean_tokens, self.corrupted_tokens
        if not isinstance(c, Tensor) or not isinstance(x, Tensor):
            raise PatchingError("clean_tokens and corrupted_tokens must be integer tensors [batch, pos]")
        if c.ndim == 1:
            c, x = c.unsqueeze(0), x.unsqueeze(0)
        if c.shape != x.shape or c.ndim != 2:
            raise PatchingError(
                f"clean tokens {tuple(c.shape)} and corrupted tokens {tuple(x.shape)} must have the same "
                "[batch, pos] shape; corrupt a token without changing the length"
            )
        if c.dtype not in (torch.long, torch.int32, torch.int64) or x.dtype != c.dtype:
            raise PatchingError("tokens must be integer tensors (use task.encode / model.to_tokens)")
        self.clean_tokens, self.corrupted_tokens = c.long(), x.long()
        if self.score_mask is None:
            am = T.answer_mask(self.clean_tokens) & T.answer_mask(self.corrupted_tokens)
            nxt_c = torch.roll(self.clean_tokens, -1, dims=1)
            nxt_x = torch.roll(self.corrupted_tokens, -1, dims=1)
            self.score_mask = am & (nxt_c != nxt_x)
        else:
            sm = torch.as_tensor(self.score_mask, dtype=torch.bool)
            if sm.ndim == 1:
                sm = sm.expand(c.shape[0], -1)
            if sm.shape != c.shape:
                raise PatchingError(f"score_mask must be [batch, pos] = {tuple(c.shape)}, got {tuple(sm.shape)}")
            self.score_mask = sm.to(c.device)
        missing = (~self.score_mask.any(-1)).nonzero().flatten().tolist()
        if missing:
            raise PatchingError(
                f"pairs {missing[:5]} have no scored position (clean and corrupted answers agree); "
                "corrupt a token that changes the answer, or pass score_mask"
            )

    def __len__(self) -> int:
        return self.clean_tokens.shape[0]

    @property
    def n_pos(self) -> int:
        return self.clean_tokens.shape[1]

    @property
    def clean_next(self) -> Int[Tensor, "batch pos"]:
        """Token each position predicts in the clean sequence (the last column repeats PAD)."""
        return T.next_tokens(self.clean_tokens)

    @property
    def corrupted_next(self) -> Int[Tensor, "batch pos"]:
        return T.next_tokens(self.corrupted_tokens)

    @property
    def answer_mask(self) -> Bool[Tensor, "batch pos"]:
        return T.answer_mask(self.clean_tokens)

    def to(self, device: Union[str, torch.device]) -> "PatchingPairs":
        return PatchingPairs(
            self.clean_tokens.to(device), self.corrupted_tokens.to(device), self.score_mask.to(device),
            self.clean_problems, self.corrupted_problems, self.corruptions,
        )

    def __getitem__(self, idx: Union[slice, Sequence[int], Tensor]) -> "PatchingPairs":
        """A sub-batch (keeps problems and corruption records in step)."""
        if isinstance(idx, slice):
            rows = list(range(len(self)))[idx]
        else:
            rows = [int(i) for i in (idx.tolist() if isinstance(idx, Tensor) else idx)]
        sel = torch.tensor(rows, dtype=torch.long)
        pick = lambda xs: None if xs is None else [xs[i] for i in rows]  # noqa: E731
        corr = None if self.corruptions is None else self.corruptions.iloc[rows].reset_index(drop=True)
        return PatchingPairs(
            self.clean_tokens[sel], self.corrupted_tokens[sel], self.score_mask[sel],
            pick(self.clean_problems), pick(self.corrupted_problems), corr,
        )

    def to_dataframe(self) -> pd.DataFrame:
        """One row per pair: the two problems and what was corrupted."""
        rows = []
        for i in range(len(self)):
            row = {"pair": i}
            if self.clean_problems is not None:
                row["clean"] = self.clean_problems[i].text
                row["corrupted"] = self.corrupted_problems[i].text
            else:
                row["clean"] = T.decode(self.clean_tokens[i])
                row["corrupted"] = T.decode(self.corrupted_tokens[i])
            row["n_scored"] = int(self.score_mask[i].sum())
            rows.append(row)
        df = pd.DataFrame(rows)
        if self.corruptions is not None:
            df = pd.concat([df, self.corruptions.reset_index(drop=True)], axis=1)
        return df

    @classmethod
    def from_problems(
        cls, clean: Sequence[Union[T.Problem, str]], corrupted: Sequence[Union[T.Problem, str]],
        score_mask: Optional[Tensor] = None,
    ) -> "PatchingPairs":
        """Pairs from problem objects or strings like ``"[12+7="`` (answers are filled in)."""
        if len(clean) != len(corrupted) or not clean:
            raise PatchingError(f"need equally many clean and corrupted problems, got {len(clean)} and {len(corrupted)}")
        cp = [p if isinstance(p, T.Problem) else T.parse_problem(p) for p in clean]
        xp = [p if isinstance(p, T.Problem) else T.parse_problem(p) for p in corrupted]
        for i, (a, b) in enumerate(zip(cp, xp)):
            if len(a.text) != len(b.text):
                raise PatchingError(
                    f"pair {i}: {a.text!r} and {b.text!r} differ in length; corrupt a digit or operator "
                    "so that the problem and the answer keep their lengths"
                )
        n = max(len(p.text) for p in cp)
        clean_t = T.pad_batch([T.encode(p.text) for p in cp], n)
        corr_t = T.pad_batch([T.encode(p.text) for p in xp], n)
        return cls(clean_t, corr_t, score_mask, cp, xp, None)


# ----------------------------------------------------------------------------- making pairs


def _digits_of(term: int) -> str:
    return str(abs(term))


def corrupt_problem(
    problem: T.Problem, rng: random.Random, corrupt: str = "digit",
    term: Optional[int] = None, place: Optional[int] = None, op: Optional[int] = None,
) -> Optional[tuple[T.Problem, dict]]:
    """A corrupted copy of ``problem`` with the same text length and a different answer, or None.

    ``corrupt="digit"`` changes one digit of one operand (``term`` index from 0, ``place`` 0 =
    units); a leading digit never becomes 0 so the length is kept. ``corrupt="operator"`` flips
    operator ``op`` (0 = between term 0 and 1). Unset choices are drawn at random.
    """
    terms, ops = list(problem.terms), list(problem.ops)
    options = []
    if corrupt in ("digit", "any"):
        ts = [term] if term is not None else list(range(len(terms)))
        for t in ts:
            if not 0 <= t < len(terms):
                continue
            L = len(_digits_of(terms[t]))
            ps = [place] if place is not None else list(range(L))
            options += [("digit", t, p) for p in ps if 0 <= p < L]
    if corrupt in ("operator", "any"):
        os_ = [op] if op is not None else list(range(len(ops)))
        options += [("operator", o, None) for o in os_ if 0 <= o < len(ops)]
    if corrupt not in ("digit", "operator", "any"):
        raise PatchingError(f"corrupt must be 'digit', 'operator' or 'any', got {corrupt!r}")
    rng.shuffle(options)
    for kind, idx, p in options:
        if kind == "operator":
            new_ops = list(ops)
            new_ops[idx] = "-" if ops[idx] == "+" else "+"
            cands = [(tuple(terms), tuple(new_ops), ops[idx], new_ops[idx])]
        else:
            s = _digits_of(terms[idx])
            k = len(s) - 1 - p  # index in the string, most significant first
            old = s[k]
            digits = [d for d in "0123456789" if d != old and not (k == 0 and d == "0")]
            rng.shuffle(digits)
            cands = []
            for d in digits:
                new_s = s[:k] + d + s[k + 1 :]
                new_t = int(new_s) * (-1 if terms[idx] < 0 else 1)
                nt = list(terms)
                nt[idx] = new_t
                cands.append((tuple(nt), tuple(ops), old, d))
        for nt, nops, old, new in cands:
            q = T.Problem(nt, nops)
            if len(q.text) == len(problem.text) and q.result != problem.result and len(q.answer) == len(problem.answer):
                pos = _corrupted_position(problem, kind, idx, p)
                return q, dict(kind=kind, term=idx if kind == "digit" else None, place=p,
                               op=idx if kind == "operator" else None, position=pos, clean_token=old, corrupted_token=new)
    return None


def _corrupted_position(problem: T.Problem, kind: str, idx: int, place: Optional[int]) -> int:
    """Token position of the corrupted character in ``[question=answer]``."""
    pos = 1  # after '['
    for i, t in enumerate(problem.terms):
        s = T.format_int(t)
        if kind == "digit" and i == idx:
            return pos + len(s) - 1 - place
        pos += len(s)
        if i < len(problem.ops):
            if kind == "operator" and i == idx:
                return pos
            pos += 1
    raise PatchingError("corruption index out of range")  # pragma: no cover


def problem_format(problem: T.Problem) -> str:
    """Token-role signature: digits -> 'd', operators -> 'o'; equal signatures align position by position."""
    return "".join("d" if c.isdigit() else "o" if c in "+-" else c for c in problem.text)


def _sample_like(template: T.Problem, rng: random.Random) -> T.Problem:
    """A random problem with the same number of terms, digits per term and signs as ``template``."""
    terms = []
    for t in template.terms:
        L = len(_digits_of(t))
        mag = rng.randint(10 ** (L - 1), 10**L - 1) if L > 1 else rng.randint(1, 9)
        terms.append(-mag if t < 0 else mag)
    ops = tuple(rng.choice("+-") for _ in template.ops)
    return T.Problem(tuple(terms), ops)


def make_pairs(
    task: T.AdditionTask, n: int, split: Union[str, T.Split] = "id", seed: int = 0, corrupt: str = "digit",
    *, term: Optional[int] = None, place: Optional[int] = None, op: Optional[int] = None,
    aligned: bool = False, max_tries: int = 200,
) -> PatchingPairs:
    """``n`` seeded clean/corrupted pairs from a split.

    ``aligned=True`` makes every pair share one token layout (same number of terms, digits per
    term, signs, answer length and corrupted position), so position ``p`` means the same thing in
    every row -- what per-position patching tables need to be readable. It draws the first
    problem from the split, then problems of the same shape.
    """
    if not isinstance(n, int) or n < 1:
        raise PatchingError(f"n must be a positive integer, got {n!r}")
    rng = random.Random(seed)
    clean, corr, recs = [], [], []
    template: Optional[T.Problem] = None
    fixed: dict = dict(term=term, place=place, op=op)
    tries = 0
    while len(clean) < n:
        tries += 1
        if tries > max_tries * n:
            raise PatchingError(
                f"could only build {len(clean)} of {n} pairs after {tries - 1} draws; relax term/place/op "
                "or aligned=True, or use a split with more digits"
            )
        p = _sample_like(template, rng) if (aligned and template is not None) else task.sample_problem(rng, split)
        if aligned and template is not None and problem_format(p) != problem_format(template):
            continue
        out = corrupt_problem(p, rng, corrupt, **fixed)
        if out is None:
            continue
        q, rec = out
        if aligned and template is None:
            template = p
            fixed = dict(term=rec["term"], place=rec["place"], op=rec["op"])
            corrupt = rec["kind"]
        clean.append(p)
        corr.append(q)
        recs.append(rec)
    pairs = PatchingPairs.from_problems(clean, corr)
    pairs.corruptions = pd.DataFrame(recs)
    return pairs


# ----------------------------------------------------------------------------- metrics


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


METRICS = ("logit_diff", "correct_prob", "kl_to_clean")


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
        return KLToClean(pairs, model(pairs.clean_tokens.to(_device(model))), positions)
    raise PatchingError(f"unknown metric {name!r}; choose one of {METRICS} or pass a callable logits -> [batch]")


def _device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


@torch.no_grad()
def answer_metrics(model, pairs: PatchingPairs) -> pd.DataFrame:
    """Clean and corrupted runs scored per answer position: logit diff, correct prob, KL to clean.

    One row per (answer index j, run). Answer index j counts from the first answer token; rows
    use the pairs where that position exists and its tokens differ (``n`` says how many).
    """
    dev = _device(model)
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
    "PatchingPairs",
    "make_pairs",
    "corrupt_problem",
    "problem_format",
    "PairMetric",
    "LogitDiff",
    "CorrectProb",
    "KLToClean",
    "logit_diff",
    "correct_prob",
    "kl_to_clean",
    "make_metric",
    "answer_metrics",
    "METRICS",
]
