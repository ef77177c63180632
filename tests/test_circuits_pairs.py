"""Clean/corrupted pairs and per-example metrics against explicit formulas."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from interp_norm import AdditionTask, HookedNormTransformer, ModelConfig
from interp_norm.circuits import (
    CorrectProb,
    KLToClean,
    LogitDiff,
    PatchingPairs,
    answer_metrics,
    corrupt_problem,
    make_metric,
    make_pairs,
    problem_format,
)
from interp_norm.errors import PatchingError
from interp_norm.core.task import Problem, parse_problem

TASK = AdditionTask.preset("cpu")


def test_digit_pairs_keep_length_change_answer_and_one_question_token():
    pairs = make_pairs(TASK, 40, "id", seed=3)
    recs = pairs.corruptions
    for i, (c, x) in enumerate(zip(pairs.clean_problems, pairs.corrupted_problems)):
        assert len(c.text) == len(x.text) and c.result != x.result
        diff = [k for k, (a, b) in enumerate(zip(c.question, x.question)) if a != b]
        assert diff == [recs.position[i]], (c.text, x.text)
        assert c.question[diff[0]] == recs.clean_token[i] and x.question[diff[0]] == recs.corrupted_token[i]
        assert c.question[diff[0]].isdigit()
        # the recorded term and place point at that digit (place 0 = units)
        t = recs.term[i]
        digits = str(abs(c.terms[t]))
        assert digits[len(digits) - 1 - recs.place[i]] == recs.clean_token[i]
        assert parse_problem(x.text) == x  # a valid problem with a consistent answer


def test_operator_pairs_flip_one_operator():
    pairs = make_pairs(TASK, 20, "id", seed=1, corrupt="operator")
    for c, x, op in zip(pairs.clean_problems, pairs.corrupted_problems, pairs.corruptions.op):
        assert c.terms == x.terms
        assert [a != b for a, b in zip(c.ops, x.ops)] == [k == op for k in range(len(c.ops))]


def test_aligned_pairs_share_layout_and_corrupted_position():
    pairs = make_pairs(TASK, 16, "extrap", seed=2, aligned=True)
    formats = {problem_format(p) for p in pairs.clean_problems}
    assert len(formats) == 1
    assert pairs.corruptions.position.nunique() == 1 and pairs.corruptions.term.nunique() == 1
    assert (pairs.clean_tokens != 16).all()  # no padding needed: all the same length


def test_fixed_term_and_place():
    pairs = make_pairs(AdditionTask(), 10, "id", seed=0, term=1, place=1)
    assert set(pairs.corruptions.term) == {1} and set(pairs.corruptions.place) == {1}


def test_corrupt_problem_never_changes_length():
    rng = random.Random(0)
    p = Problem((95, 5), ("+",))  # 95+5=100: most single-digit changes shorten the answer
    for _ in range(20):
        out = corrupt_problem(p, rng)
        if out is not None:
            q, _ = out
            assert len(q.answer) == len(p.answer) and q.result != p.result


def test_score_mask_marks_differing_answer_tokens():
    pairs = PatchingPairs.from_problems(["[12+7=", "[3+45="], ["[12+8=", "[3+46="])
    # 12+7=19 vs 12+8=20: both answer digits differ; 3+45=48 vs 3+46=49: only the last
    expected = torch.zeros_like(pairs.score_mask)
    eq0, eq1 = "[12+7=".index("="), "[3+45=".index("=")
    expected[0, eq0] = expected[0, eq0 + 1] = True
    expected[1, eq1 + 1] = True
    assert torch.equal(pairs.score_mask, expected)


def _explicit(pairs, logits, kind, clean_logits=None):
    """Loop-by-loop reference values."""
    out = []
    for i in range(len(pairs)):
        vals = []
        for p in range(pairs.n_pos):
            if not pairs.score_mask[i, p]:
                continue
            c, w = int(pairs.clean_tokens[i, p + 1]), int(pairs.corrupted_tokens[i, p + 1])
            if kind == "ld":
                vals.append(float(logits[i, p, c] - logits[i, p, w]))
            elif kind == "prob":
                vals.append(float(logits[i, p].softmax(-1)[c]))
            else:
                ref = clean_logits[i, p].log_softmax(-1)
                vals.append(float(F.kl_div(logits[i, p].log_softmax(-1), ref, log_target=True, reduction="sum")))
        out.append(sum(vals) / len(vals))
    return torch.tensor(out)


def test_metrics_match_explicit_formulas_and_stack():
    pairs = make_pairs(TASK, 6, "id", seed=4)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(pairs), pairs.n_pos, 17, generator=g)
    clean_logits = torch.randn(len(pairs), pairs.n_pos, 17, generator=g)
    for metric, kind in ((LogitDiff(pairs), "ld"), (CorrectProb(pairs), "prob"), (KLToClean(pairs, clean_logits), "kl")):
        ref = _explicit(pairs, logits, kind, clean_logits)
        assert torch.allclose(metric(logits), ref, atol=1e-5), metric.name
        stacked = metric(torch.cat([logits, clean_logits]))  # two copies of the batch
        assert torch.allclose(stacked[: len(pairs)], ref, atol=1e-5)
        assert torch.allclose(stacked[len(pairs):], metric(clean_logits), atol=1e-6)
    assert torch.allclose(KLToClean(pairs, clean_logits)(clean_logits), torch.zeros(len(pairs)), atol=1e-6)


def test_answer_index_positions():
    pairs = make_pairs(TASK, 5, "id", seed=0, aligned=True)
    logits = torch.randn(len(pairs), pairs.n_pos, 17)
    eq = pairs.clean_problems[0].question.index("=")
    m = LogitDiff(pairs, positions=0)
    c, w = pairs.clean_tokens[:, eq + 1], pairs.corrupted_tokens[:, eq + 1]
    ref = logits[torch.arange(len(pairs)), eq].gather(-1, c[:, None])[:, 0] - logits[torch.arange(len(pairs)), eq].gather(-1, w[:, None])[:, 0]
    assert torch.allclose(m(logits), ref)
    with pytest.raises(PatchingError, match="answer position 9"):
        LogitDiff(pairs, positions=9)


def test_answer_metrics_table_and_make_metric():
    model = HookedNormTransformer(ModelConfig.preset("tiny")).eval()
    pairs = make_pairs(TASK, 6, "id", seed=0, aligned=True)
    df = answer_metrics(model, pairs)
    assert set(df.run) == {"clean", "corrupted"} and {"logit_diff", "correct_prob", "kl_to_clean"} <= set(df.columns)
    assert (df[df.run == "clean"].kl_to_clean.abs() < 1e-6).all()
    assert make_metric("kl_to_clean", pairs, model).name == "kl_to_clean"
    with pytest.raises(PatchingError, match="unknown metric"):
        make_metric("accuracy", pairs)


def test_bad_pairs_raise():
    with pytest.raises(PatchingError, match="differ in length"):
        PatchingPairs.from_problems(["[12+7="], ["[12+17="])
    with pytest.raises(PatchingError, match="same"):
        PatchingPairs(torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 6, dtype=torch.long))
    with pytest.raises(PatchingError, match="no scored position"):
        PatchingPairs.from_problems(["[12+7="], ["[17+2="])  # same answer
    with pytest.raises(PatchingError, match="positive integer"):
        make_pairs(TASK, 0)
    sub = make_pairs(TASK, 6, seed=0)[[0, 2]]
    assert len(sub) == 2 and len(sub.to_dataframe()) == 2
