"""The paper's multi-term addition/subtraction task (Menary et al. 2024, appendix "experimental setup").

A problem is ``[453+16+17-N846=1332]``: 17 character tokens, ``N`` marks a negative integer,
``+``/``-`` are the operators, digits are written most-significant first with no padding, ``[``
opens and ``]`` closes the sequence, and batches are right-padded with the mask token ``*``.

The model is trained by next-token prediction, but only the *answer* is scored: the logits at
position ``p`` are scored when token ``p+1`` is an answer digit (or ``N``) or the closing ``]``.
:func:`answer_mask` derives that mask from the tokens alone, so every consumer (loss, accuracy,
patching metrics) agrees on it.

Sampling follows the paper and the authors' predecessor code: the number of terms N is uniform
over a list, each integer's length L is uniform over a list, the leading digit is 1-9, the sign
is +/- with probability 1/2, and each operator is ``+``/``-`` with probability 1/2.
"""

from __future__ import annotations

import random
import re
import warnings
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from interp_norm.errors import ConfigError, OutOfDistributionWarning, ProblemStringError, TaskMismatchWarning, check_positive_int

VOCAB: tuple[str, ...] = tuple("0123456789+-=N[]*")
TOKEN_TO_ID: dict[str, int] = {c: i for i, c in enumerate(VOCAB)}
D_VOCAB = len(VOCAB)
BOS, EOS, PAD, EQ, NEG = "[", "]", "*", "=", "N"
BOS_ID, EOS_ID, PAD_ID, EQ_ID, NEG_ID = (TOKEN_TO_ID[c] for c in (BOS, EOS, PAD, EQ, NEG))
PLUS_ID, MINUS_ID = TOKEN_TO_ID["+"], TOKEN_TO_ID["-"]
DIGIT_IDS = tuple(range(10))

_TERM = r"N?[1-9][0-9]*|0"
_QUESTION_RE = re.compile(rf"^(?:{_TERM})(?:[+-](?:{_TERM}))*$")


@dataclass(frozen=True)
class Problem:
    """One problem: its signed integer terms and the operators between them."""

    terms: tuple[int, ...]
    ops: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.ops) != len(self.terms) - 1 or any(o not in "+-" for o in self.ops):
            raise ProblemStringError(
                f"a problem with {len(self.terms)} terms needs {len(self.terms) - 1} operators "
                f"from '+'/'-', got {self.ops!r}"
            )

    @property
    def result(self) -> int:
        total = self.terms[0]
        for op, t in zip(self.ops, self.terms[1:]):
            total = total + t if op == "+" else total - t
        return total

    @property
    def question(self) -> str:
        """``[453+16+17-N846=``: what the model is given."""
        body = format_int(self.terms[0])
        for op, t in zip(self.ops, self.terms[1:]):
            body += op + format_int(t)
        return BOS + body + EQ

    @property
    def answer(self) -> str:
        """``1332]``: what the model must produce."""
        return format_int(self.result) + EOS

    @property
    def text(self) -> str:
        return self.question + self.answer

    def __str__(self) -> str:
        return self.text


def format_int(x: int) -> str:
    """The paper writes negative integers with an ``N`` prefix: -846 -> ``N846``."""
    return ("N" if x < 0 else "") + str(abs(x))


def parse_int(s: str) -> int:
    return -int(s[1:]) if s.startswith("N") else int(s)


def parse_problem(text: str) -> Problem:
    """Parse a question ``"[453+16+17-N846="`` (the ``[`` is optional) or a full ``"[...=1332]"``.

    The answer part, if present, is checked against the arithmetic. Raises
    :class:`ProblemStringError` naming what is wrong and how to write it instead.
    """
    if not isinstance(text, str):
        raise ProblemStringError(f"a problem must be a string like '12+N7=', got {type(text).__name__}")
    s = text.strip()
    if not s or s in (BOS, BOS + EQ):
        raise ProblemStringError("the problem string is empty; write one like '[12+N7='")
    if any(c.isspace() for c in s):
        raise ProblemStringError(
            f"problem {text!r} contains spaces; the tokens are single characters with no spaces "
            f"between them: write {''.join(s.split())!r}"
        )
    bad = sorted({c for c in s if c not in TOKEN_TO_ID})
    if bad:
        raise ProblemStringError(
            f"problem {text!r} contains {''.join(bad)!r}, which is not in the vocabulary "
            f"{''.join(VOCAB)!r}; write negative numbers as N7, not -7 after an operator"
        )
    if PAD in s:
        raise ProblemStringError(f"problem {text!r} contains the mask token '*'; remove it")
    if s.startswith(BOS):
        s = s[1:]
    if BOS in s:
        raise ProblemStringError(f"problem {text!r} has '[' inside it; '[' may only open the problem")
    answer = None
    if EQ in s:
        if s.count(EQ) > 1:
            raise ProblemStringError(f"problem {text!r} has more than one '='")
        s, answer = s.split(EQ)
    else:
        raise ProblemStringError(f"problem {text!r} lacks '='; end the question with '=', e.g. '[12+N7='")
    if not s:
        raise ProblemStringError(f"problem {text!r} has no terms before '='")
    if re.search(r"[+-]{2}", s):
        raise ProblemStringError(
            f"problem {text!r} has two operators in a row; write a negative term with N, e.g. '3-N4'"
        )
    if re.search(r"(^|[+\-N])0[0-9]", s):
        raise ProblemStringError(f"problem {text!r} has a number with a leading zero; write '7', not '07'")
    if re.search(r"N($|[+\-N])", s) or "N0" in s:
        raise ProblemStringError(
            f"problem {text!r} has an 'N' not followed by a non-zero number; 'N' marks a negative integer, e.g. N7"
        )
    if s[0] == "-":
        raise ProblemStringError(
            f"problem {text!r} starts with '-'; a negative number is written with N, not '-': "
            f"write {(BOS if text.strip().startswith(BOS) else '') + 'N' + s[1:] + EQ!r}"
        )
    if s[0] in "+-" or s[-1] in "+-":
        raise ProblemStringError(f"problem {text!r} starts or ends with an operator; terms go on both sides")
    if not _QUESTION_RE.match(s):
        raise ProblemStringError(f"problem {text!r} is not of the form 'a+b-Nc=' (digits, N, + and - only)")
    pieces = re.split(r"([+-])", s)
    problem = Problem(tuple(parse_int(t) for t in pieces[0::2]), tuple(pieces[1::2]))
    if answer:
        expected = problem.answer
        if answer not in (expected, expected[:-1]):
            raise ProblemStringError(
                f"problem {text!r} gives the answer {answer!r}, but the arithmetic gives {expected[:-1]!r}"
            )
    return problem


def encode(text: str) -> Int[Tensor, " pos"]:
    """Characters to token ids (no validation beyond the vocabulary; see :func:`parse_problem`)."""
    try:
        return torch.tensor([TOKEN_TO_ID[c] for c in text], dtype=torch.long)
    except KeyError as e:
        raise ProblemStringError(
            f"{text!r} contains {e.args[0]!r}, which is not in the vocabulary {''.join(VOCAB)!r}"
        ) from None


def decode(ids: Iterable[int] | Tensor, strip_pad: bool = True) -> str:
    """Token ids to characters; trailing mask tokens are dropped unless ``strip_pad=False``."""
    if isinstance(ids, Tensor):
        ids = ids.tolist()
    text = "".join(VOCAB[int(i)] for i in ids)
    return text.rstrip(PAD) if strip_pad else text


def pad_batch(seqs: Sequence[Tensor], length: int | None = None) -> Int[Tensor, "batch pos"]:
    """Right-pad 1-D token tensors with ``*`` (the paper's mask token)."""
    n = max(len(s) for s in seqs) if length is None else length
    out = torch.full((len(seqs), n), PAD_ID, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


def next_tokens(tokens: Int[Tensor, "batch pos"]) -> Int[Tensor, "batch pos"]:
    """The token each position predicts (position p -> token p+1); the last column is padding."""
    nxt = torch.full_like(tokens, PAD_ID)
    nxt[:, :-1] = tokens[:, 1:]
    return nxt


def answer_mask(tokens: Int[Tensor, "batch pos"]) -> Bool[Tensor, "batch pos"]:
    """True at positions whose logits predict an answer token (digits, ``N`` or ``]``).

    Position p predicts token p+1; it is scored when p is at or after ``=`` and token p+1 is
    not padding. This is the paper's masked per-token accuracy, derived from the tokens alone.
    """
    after_eq = (tokens == EQ_ID).long().cumsum(-1) > 0  # p at or after '='
    return after_eq & (next_tokens(tokens) != PAD_ID)


def next_token_targets(tokens: Int[Tensor, "batch pos"], ignore_index: int = -100) -> Int[Tensor, "batch pos"]:
    """Next-token targets with everything outside :func:`answer_mask` set to ``ignore_index``."""
    return next_tokens(tokens).masked_fill(~answer_mask(tokens), ignore_index)


@dataclass
class Batch:
    """A padded batch: ``tokens`` hold ``[question=answer]*...``; see :func:`answer_mask`."""

    tokens: Int[Tensor, "batch pos"]
    problems: list[Problem]

    @property
    def answer_mask(self) -> Bool[Tensor, "batch pos"]:
        return answer_mask(self.tokens)

    @property
    def targets(self) -> Int[Tensor, "batch pos"]:
        return next_token_targets(self.tokens)

    @property
    def questions(self) -> list[str]:
        return [p.question for p in self.problems]

    def __len__(self) -> int:
        return len(self.problems)


@dataclass(frozen=True)
class Split:
    """Which problems a split holds: numbers of terms and digits per integer, each drawn uniformly."""

    name: str
    n_terms: tuple[int, ...]
    n_digits: tuple[int, ...]

    def max_len(self) -> int:
        """Longest token sequence ``[...=answer]`` this split can produce."""
        n, L = max(self.n_terms), max(self.n_digits)
        question = 1 + n * (L + 1) + (n - 1) + 1  # '[', terms with 'N', operators, '='
        biggest = n * (10**L - 1)
        return question + len(format_int(-biggest)) + 1


def _as_tuple(name: str, xs: Sequence[int] | int) -> tuple[int, ...]:
    xs = (xs,) if isinstance(xs, int) else tuple(xs)
    if not xs or any((not isinstance(x, int)) or x < 1 for x in xs):
        raise ConfigError(f"{name} must be a non-empty list of positive integers, got {xs!r}")
    return xs


@dataclass
class AdditionTask:
    """The task and its three splits: in-distribution, interpolation and extrapolation.

    The paper's defaults: train/ID N in {3,4,6}, interpolation N=5, extrapolation N in {7,8,9},
    L in {2,3} everywhere ("OOD here means more terms, not longer integers").
    """

    train_terms: tuple[int, ...] = (3, 4, 6)
    interp_terms: tuple[int, ...] = (5,)
    extrap_terms: tuple[int, ...] = (7, 8, 9)
    n_digits: tuple[int, ...] = (2, 3)
    splits: dict[str, Split] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.train_terms = _as_tuple("train_terms", self.train_terms)
        self.interp_terms = _as_tuple("interp_terms", self.interp_terms)
        self.extrap_terms = _as_tuple("extrap_terms", self.extrap_terms)
        self.n_digits = _as_tuple("n_digits", self.n_digits)
        self.splits = {
            "id": Split("id", self.train_terms, self.n_digits),
            "interp": Split("interp", self.interp_terms, self.n_digits),
            "extrap": Split("extrap", self.extrap_terms, self.n_digits),
        }

    PRESETS = {
        "paper": dict(train_terms=(3, 4, 6), interp_terms=(5,), extrap_terms=(7, 8, 9), n_digits=(2, 3)),
        # Sized for 2 CPU cores (measured): 2-digit terms, train N ∈ {2, 3, 5} so both
        # odd and even term counts are seen, interpolation N = 4 inside the trained range,
        # extrapolation N ∈ {6, 7} beyond it. The longest problem is 35 tokens (n_ctx 40).
        "cpu": dict(train_terms=(2, 3, 5), interp_terms=(4,), extrap_terms=(6, 7), n_digits=(2,)),
        # The previous cpu preset (1-digit terms, N ∈ {2, 4} -> 3 -> {5, 6}): learnable in minutes, but
        # too easy for attention to become sparse (README, "Reference checkpoints").
        "cpu-small": dict(train_terms=(2, 4), interp_terms=(3,), extrap_terms=(5, 6), n_digits=(1,)),
    }

    @classmethod
    def preset(cls, name: str) -> "AdditionTask":
        if name not in cls.PRESETS:
            raise ConfigError(f"unknown task preset {name!r}; choose one of {sorted(cls.PRESETS)}")
        return cls(**cls.PRESETS[name])

    def to_dict(self) -> dict:
        return dict(
            train_terms=list(self.train_terms),
            interp_terms=list(self.interp_terms),
            extrap_terms=list(self.extrap_terms),
            n_digits=list(self.n_digits),
        )

    @classmethod
    def from_dict(cls, d: dict) -> "AdditionTask":
        keys = ("train_terms", "interp_terms", "extrap_terms", "n_digits")
        missing = [k for k in keys if k not in d]
        if missing:
            raise ConfigError(f"task config lacks {missing}; expected keys {list(keys)}")
        return cls(**{k: tuple(d[k]) for k in keys})

    def describe(self) -> str:
        """How to build this task and what it holds, for messages:
        ``AdditionTask.preset('cpu') (2-digit terms; 2, 3 or 5 terms in training, interpolation 4, extrapolation 6 or 7)``."""
        d = self.to_dict()
        name = next((n for n, kw in self.PRESETS.items() if {k: list(v) for k, v in kw.items()} == d), None)
        if name == "paper":
            call, prefix = "AdditionTask()", "the paper's task: "
        elif name is not None:
            call, prefix = f"AdditionTask.preset({name!r})", ""
        else:
            call, prefix = "AdditionTask(" + ", ".join(f"{k}={tuple(v)}" for k, v in d.items()) + ")", ""
        return (f"{call} ({prefix}{_or(self.n_digits)}-digit terms; {_or(self.train_terms)} terms in training, "
                f"interpolation {_or(self.interp_terms)}, extrapolation {_or(self.extrap_terms)})")

    def out_of_distribution(self, problem: Problem) -> list[str]:
        """What puts ``problem`` outside the training split (empty if nothing): its number of terms
        (naming the task's split that holds it, if any) and term lengths the training never drew."""
        train = self.splits["id"]
        reasons = []
        n = len(problem.terms)
        if n not in train.n_terms:
            held = [s.name for s in self.splits.values() if n in s.n_terms]
            where = f", its {_SPLIT_NAMES[held[0]]} split" if held else ""
            reasons.append(f"{n} terms (training had {_or(train.n_terms)}{where})")
        digits = sorted({len(str(abs(t))) for t in problem.terms} - set(train.n_digits))
        if digits:
            reasons.append(f"{_or(digits)}-digit terms (training had {_or(train.n_digits)}-digit terms only)")
        return reasons

    def split(self, name: str | Split) -> Split:
        if isinstance(name, Split):
            return name
        if name == "train":
            name = "id"
        if name not in self.splits:
            raise ConfigError(f"unknown split {name!r}; choose one of {sorted(self.splits)} (or 'train')")
        return self.splits[name]

    def max_len(self) -> int:
        """The longest sequence any split can produce: the context a model needs."""
        return max(s.max_len() for s in self.splits.values())

    def sample_problem(self, rng: random.Random, split: str | Split = "id") -> Problem:
        sp = self.split(split)
        n = rng.choice(sp.n_terms)
        terms = []
        for _ in range(n):
            L = rng.choice(sp.n_digits)
            mag = rng.randint(10 ** (L - 1), 10**L - 1)
            terms.append(mag if rng.random() < 0.5 else -mag)
        ops = tuple(rng.choice("+-") for _ in range(n - 1))
        return Problem(tuple(terms), ops)

    def sample_problems(self, n: int, split: str | Split = "id", seed: int | random.Random = 0) -> list[Problem]:
        check_positive_int(n, "the number of problems")
        rng = seed if isinstance(seed, random.Random) else random.Random(seed)
        return [self.sample_problem(rng, split) for _ in range(n)]

    def make_batch(self, problems: Sequence[Problem | str], length: int | None = None) -> Batch:
        probs = [p if isinstance(p, Problem) else parse_problem(p) for p in problems]
        return Batch(pad_batch([encode(p.text) for p in probs], length), probs)

    def sample_batch(
        self, n: int, split: str | Split = "id", seed: int | random.Random = 0, length: int | None = None
    ) -> Batch:
        """``n`` seeded problems from a split, tokenised and right-padded with ``*``."""
        return self.make_batch(self.sample_problems(n, split, seed), length)

    def test_set(self, split: str | Split = "id", size: int = 2048, seed: int = 1234) -> Batch:
        """A fixed, seeded evaluation set (seeds are offset per split so splits never share draws)."""
        sp = self.split(split)
        offset = {"id": 0, "interp": 1, "extrap": 2}.get(sp.name, 3)
        return self.sample_batch(size, sp, seed=10_000 * seed + offset)


_SPLIT_NAMES = {"id": "in-distribution", "interp": "interpolation", "extrap": "extrapolation"}


def _or(xs: Sequence[int]) -> str:
    """(2, 3, 5) -> '2, 3 or 5'."""
    s = [str(x) for x in xs]
    return s[0] if len(s) == 1 else ", ".join(s[:-1]) + " or " + s[-1]


def _model_name(model: object) -> str:
    name = getattr(model, "name", None)
    return f"model {name!r}" if name else "this model"


def task_for(model: object, task: "AdditionTask | None" = None, *, who: str = "this analysis",
             stacklevel: int = 3) -> AdditionTask:
    """The task an analysis of ``model`` runs on: ``task`` if given, else the model's own.

    A model loaded from a checkpoint (``interp_norm.load``, ``from_pretrained``)
    or returned by ``train`` carries the task it was trained on as ``model.task``. A ``task`` other
    than that one still runs, with a :class:`~interp_norm.errors.TaskMismatchWarning` naming both
    (the numbers then describe problems the model never learnt: ``AdditionTask()``, the paper's task,
    on a model trained on the cpu preset reads 0.37 per-token accuracy instead of 0.90). No task
    given and none known: a :class:`ConfigError` saying how to pass one.
    """
    own = getattr(model, "task", None)
    if task is None:
        if not isinstance(own, AdditionTask):
            raise ConfigError(
                f"{who} needs a task, and {_model_name(model)} does not know its own (it was built from a config, "
                "not loaded from a checkpoint); pass task=AdditionTask.preset('cpu') (the task of the shipped "
                "checkpoints) or task=AdditionTask() (the paper's), or set model.task once"
            )
        return own
    if not isinstance(task, AdditionTask):
        hint = ("; the task comes second, so pass levels by name (levels=[...])"
                if isinstance(task, (list, tuple, float, int)) else "")
        raise ConfigError(f"task must be an AdditionTask, got {type(task).__name__}{hint}")
    if isinstance(own, AdditionTask) and task != own:
        warnings.warn(
            f"{_model_name(model)} was trained on {own.describe()}; you passed {task.describe()}. {who} runs on "
            "problems the model never learnt; leave the task out to use the model's own",
            TaskMismatchWarning, stacklevel=stacklevel,
        )
    return task


def warn_out_of_distribution(model: object, problems: Sequence[Problem], stacklevel: int = 3) -> None:
    """One :class:`~interp_norm.errors.OutOfDistributionWarning` naming the problems outside the
    training split of ``model.task`` and why (nothing if the model has no task, or all are inside)."""
    task = getattr(model, "task", None)
    if not isinstance(task, AdditionTask):
        return
    bad = [(p, r) for p in problems if (r := task.out_of_distribution(p))]
    if not bad:
        return
    shown = "; ".join(f"{p.question!r} has {' and '.join(r)}" for p, r in bad[:3])
    more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
    warnings.warn(
        f"{shown}{more}: {_model_name(model)} was trained on {task.describe()}, so these answers are "
        "extrapolation, not what it learnt",
        OutOfDistributionWarning, stacklevel=stacklevel,
    )


__all__ = [
    "task_for",
    "warn_out_of_distribution",
    "VOCAB",
    "TOKEN_TO_ID",
    "D_VOCAB",
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "EQ_ID",
    "NEG_ID",
    "Problem",
    "Split",
    "Batch",
    "AdditionTask",
    "parse_problem",
    "format_int",
    "encode",
    "decode",
    "pad_batch",
    "answer_mask",
    "next_tokens",
    "next_token_targets",
]
