"""Accuracy per split: the paper's per-token metric, its variant without ``]``, and exact match.

* ``per_token_acc``: teacher-forced next-token accuracy over the answer tokens including the
  closing ``]`` (the paper's masked categorical accuracy; mask from :func:`task.answer_mask`).
* ``per_token_acc_no_eos``: the same without ``]``, which the paper notes "contributes a
  significant fraction of the metric".
* ``exact_match``: the greedy answer from :meth:`HookedNormTransformer.generate` equals the
  true answer string, ``]`` included (the paper reports no sequence-level metric; we add it).

Evaluation always uses position offset 0 (the random offset is a training augmentation).

The two primitives every accuracy in the package is built from live here: :func:`count_correct`
(answer tokens a batch of logits gets right) and :func:`trim_padding` (drop the padding columns a
batch shares, which carry no scored position). The training loop and the analyses call them
rather than re-deriving the mask.
"""

from __future__ import annotations

from typing import Optional, Sequence

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from interp_norm.core import task as T
from interp_norm.errors import ConfigError, check_positive_int
from interp_norm.core.model import HookedNormTransformer
from interp_norm.core.task import AdditionTask, Batch


def _check_batch_size(batch_size: int) -> None:
    check_positive_int(batch_size, "batch_size")


def trim_padding(tokens: Int[Tensor, "batch pos"]) -> Int[Tensor, "batch pos"]:
    """``tokens`` without the trailing columns that are padding in every row (they score nothing)."""
    return tokens[:, : int((tokens != T.PAD_ID).sum(-1).max())]


def count_correct(
    logits: Float[Tensor, "batch pos vocab"], tokens: Int[Tensor, "batch pos"], include_eos: bool = True
) -> tuple[int, int]:
    """``(correct, total)`` answer tokens of one batch, teacher-forced (argmax == next token).

    Scored positions are :func:`task.answer_mask`'s; ``include_eos=False`` leaves out the
    positions predicting the closing ``]``. ``tokens`` may be trimmed or not, as ``logits`` are.
    """
    targets = T.next_token_targets(tokens.to(logits.device))
    mask = targets != -100
    if not include_eos:
        mask &= targets != T.EOS_ID
    return int(((logits.argmax(-1) == targets) & mask).sum()), int(mask.sum())


@torch.no_grad()
def token_correct_counts(
    model: HookedNormTransformer, tokens: Int[Tensor, "batch pos"], batch_size: int = 512
) -> dict[str, float]:
    """Counts over answer tokens: ``correct``/``total`` (with ``]``), ``*_no_eos``, summed ``loss``."""
    _check_batch_size(batch_size)
    if not isinstance(tokens, Tensor) or tokens.ndim != 2:
        raise ConfigError("tokens must be a [batch, pos] integer tensor, e.g. task.test_set('id').tokens")
    out = dict(correct=0, total=0, correct_no_eos=0, total_no_eos=0, loss=0.0)
    for i in range(0, len(tokens), batch_size):
        chunk = trim_padding(tokens[i : i + batch_size])
        logits = model(chunk)
        chunk = chunk.to(logits.device)
        for suffix, include_eos in (("", True), ("_no_eos", False)):
            right, total = count_correct(logits, chunk, include_eos)
            out["correct" + suffix] += right
            out["total" + suffix] += total
        targets = T.next_token_targets(chunk)
        mask = targets != -100
        out["loss"] += float(torch.nn.functional.cross_entropy(logits[mask], targets[mask], reduction="sum"))
    return out


def per_token_accuracy(
    model: HookedNormTransformer, tokens: Int[Tensor, "batch pos"] | Batch, include_eos: bool = True, batch_size: int = 512
) -> float:
    """Teacher-forced accuracy over answer tokens (``]`` included unless ``include_eos=False``)."""
    if isinstance(tokens, Batch):
        tokens = tokens.tokens
    c = token_correct_counts(model, tokens, batch_size)
    num, den = (c["correct"], c["total"]) if include_eos else (c["correct_no_eos"], c["total_no_eos"])
    return num / den if den else float("nan")


@torch.no_grad()
def exact_match_accuracy(model: HookedNormTransformer, problems: Sequence[T.Problem], batch_size: int = 512) -> float:
    """Fraction of problems whose greedy answer (``]`` included) is exactly right."""
    _check_batch_size(batch_size)
    right = 0
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        questions = T.pad_batch([T.encode(p.question) for p in chunk])
        # the longest true answer bounds the tokens needed to decide a match
        budget = max(len(p.answer) for p in chunk)
        answers = model.generate(questions, max_new_tokens=budget, warn_out_of_distribution=False)  # OOD splits on purpose
        right += sum(a == p.answer for a, p in zip(answers, chunk))
    return right / len(problems)


def evaluate(
    model: HookedNormTransformer,
    task: Optional[AdditionTask] = None,
    splits: Sequence[str] = ("id", "interp", "extrap"),
    *,
    size: int = 2048,
    seed: int = 1234,
    batch_size: int = 512,
    exact_match: bool = True,
    progress: bool = False,
) -> pd.DataFrame:
    """One row per split: ``split, n, n_tokens, per_token_acc, per_token_acc_no_eos, exact_match, loss``.

    The test sets are :meth:`AdditionTask.test_set` (``size`` problems, ``seed``), so two calls
    with the same arguments score the same problems. ``exact_match=False`` skips generation.
    ``task`` defaults to the model's own (``model.task``); another one runs with a warning naming both.
    """
    task = T.task_for(model, task, who="evaluate")
    if isinstance(splits, str):
        splits = (splits,)
    check_positive_int(size, "size")
    need = max(task.split(s).max_len() for s in splits)
    if need > model.cfg.n_ctx:
        raise ConfigError(
            f"the longest problem in splits {list(splits)} has {need} tokens but the model's n_ctx is "
            f"{model.cfg.n_ctx}; evaluate on a task whose problems fit the model"
        )
    rows = []
    for name in tqdm(splits, desc="evaluate", disable=not progress):
        batch = task.test_set(name, size=size, seed=seed)
        c = token_correct_counts(model, batch.tokens, batch_size)
        rows.append(
            dict(
                split=task.split(name).name,
                n=len(batch),
                n_tokens=c["total"],
                per_token_acc=c["correct"] / c["total"],
                per_token_acc_no_eos=c["correct_no_eos"] / c["total_no_eos"] if c["total_no_eos"] else float("nan"),
                exact_match=exact_match_accuracy(model, batch.problems, batch_size) if exact_match else float("nan"),
                loss=c["loss"] / c["total"],
            )
        )
    return pd.DataFrame(rows)


__all__ = ["evaluate", "per_token_accuracy", "exact_match_accuracy", "token_correct_counts", "count_correct", "trim_padding"]
