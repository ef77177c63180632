"""Clean/corrupted pairs for addition: the inputs of every circuit tool.

A pair is a clean problem and a copy with one operand digit (or one operator) changed such that
the token length stays the same and the answer changes. Both sequences are teacher-forced with
their own answers, so position ``p`` plays the same role in both and only the corrupted token and
the answer tokens differ. The metrics evaluated on pairs are in :mod:`~interp_norm.circuits.metrics`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import pandas as pd
import torch
from jaxtyping import Bool, Int
from torch import Tensor

from interp_norm.core import task as T
from interp_norm.errors import PatchingError, check_positive_int

Positions = Union[str, int, Tensor]


# ----------------------------------------------------------------------------- pairs


@dataclass
class PatchingPairs:
    """Clean and corrupted token batches of equal shape, plus which logit positions are scored.

    ``score_mask[b, p]`` is True where the logits at ``p`` are scored; by default the answer
    positions (:func:`interp_norm.core.task.answer_mask` of the clean tokens) whose next token differs
    between clean and corrupted -- elsewhere a logit difference is zero by construction.
    Pass your own ``score_mask`` for token sequences that are not addition problems.
    """

    clean_tokens: Int[Tensor, "batch pos"]
    corrupted_tokens: Int[Tensor, "batch pos"]
    # None at construction means "the default"; __post_init__ always sets it
    score_mask: Bool[Tensor, "batch pos"] = None  # type: ignore[assignment]
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
            row: dict[str, Any] = {"pair": i}
            if self.clean_problems is not None and self.corrupted_problems is not None:
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
        return cls(clean_t, corr_t, score_mask, cp, xp, None)  # type: ignore[arg-type]  # None: the default mask


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
    options: list[tuple[str, int, Optional[int]]] = []
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
            assert p is not None  # digit options carry their place
            s = _digits_of(terms[idx])
            k = len(s) - 1 - p  # index in the string, most significant first
            old = s[k]
            digits = [d for d in "0123456789" if d != old and not (k == 0 and d == "0")]
            rng.shuffle(digits)
            cands = []
            for d in digits:
                new_s = s[:k] + d + s[k + 1 :]
                new_t = int(new_s) * (-1 if terms[idx] < 0 else 1)
                changed = list(terms)
                changed[idx] = new_t
                cands.append((tuple(changed), tuple(ops), old, d))
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
            assert place is not None  # a digit corruption has a place
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


MAX_TRIES_PER_PAIR = 200  # draws per requested pair before make_pairs gives up on the constraints


def make_pairs(
    task: Any, n: int, split: Union[str, T.Split] = "id", seed: int = 0, corrupt: str = "digit",
    *, term: Optional[int] = None, place: Optional[int] = None, op: Optional[int] = None,
    aligned: bool = False,
) -> PatchingPairs:
    """``n`` seeded clean/corrupted pairs from a split.

    ``aligned=True`` makes every pair share one token layout (same number of terms, digits per
    term, signs, answer length and corrupted position), so position ``p`` means the same thing in
    every row -- what per-position patching tables need to be readable. It draws the first
    problem from the split, then problems of the same shape.

    ``task``: an :class:`~interp_norm.core.task.AdditionTask`, or a model, whose own task is used
    (``make_pairs(model, 32)``).
    """
    if not isinstance(task, T.AdditionTask) and hasattr(task, "cfg"):
        task = T.task_for(task, None, who="make_pairs")
    elif not isinstance(task, T.AdditionTask):
        raise PatchingError(f"make_pairs needs an AdditionTask or a model that knows its task, got {type(task).__name__}")
    check_positive_int(n, "n", PatchingError)
    rng = random.Random(seed)
    clean: list[T.Problem] = []
    corr: list[T.Problem] = []
    recs: list[dict] = []
    template: Optional[T.Problem] = None
    fixed: dict = dict(term=term, place=place, op=op)
    tries = 0
    while len(clean) < n:
        tries += 1
        if tries > MAX_TRIES_PER_PAIR * n:
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


def as_pairs(pairs) -> PatchingPairs:
    """``pairs`` itself, or a PatchingError saying how to build one."""
    if not isinstance(pairs, PatchingPairs):
        raise PatchingError("pass a PatchingPairs (see interp_norm.circuits.make_pairs or PatchingPairs(clean, corrupted))")
    return pairs


__all__ = ["PatchingPairs", "make_pairs", "corrupt_problem", "problem_format", "as_pairs", "Positions"]
