"""The addition task: sampling, encoding, parsing and masks, against Python's own arithmetic."""

from __future__ import annotations

import random
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from interp_norm.errors import ConfigError, ProblemStringError
from interp_norm.core.task import (
    EQ_ID,
    PAD_ID,
    VOCAB,
    AdditionTask,
    Problem,
    answer_mask,
    decode,
    encode,
    next_token_targets,
    parse_problem,
)


def test_paper_example():
    p = parse_problem("[453+16+17-N846=")
    assert p.terms == (453, 16, 17, -846) and p.ops == ("+", "+", "-")
    assert p.answer == "1332]"
    assert p.text == "[453+16+17-N846=1332]"
    assert len(VOCAB) == 17


def test_splits_follow_the_paper():
    task = AdditionTask()
    assert task.split("id").n_terms == (3, 4, 6) and task.split("interp").n_terms == (5,)
    assert task.split("extrap").n_terms == (7, 8, 9) and task.split("id").n_digits == (2, 3)
    for split in ("id", "interp", "extrap"):
        for p in task.sample_problems(300, split, seed=1):
            assert len(p.terms) in task.split(split).n_terms
            assert all(len(str(abs(t))) in (2, 3) for t in p.terms)


def test_sampling_is_uniform_enough_and_seeded():
    task = AdditionTask()
    probs = task.sample_problems(4000, "id", seed=7)
    assert probs == task.sample_problems(4000, "id", seed=7)
    signs = [t < 0 for p in probs for t in p.terms]
    ops = [o == "+" for p in probs for o in p.ops]
    assert abs(sum(signs) / len(signs) - 0.5) < 0.03
    assert abs(sum(ops) / len(ops) - 0.5) < 0.03
    lead = [str(abs(t))[0] for p in probs for t in p.terms]
    assert "0" not in lead


def test_answer_mask_marks_answer_digits_and_eos():
    batch = AdditionTask().make_batch(["[12+N7=", "[453+16+17-N846="])
    toks = batch.tokens
    mask = answer_mask(toks)
    for row, p in zip(range(len(toks)), batch.problems):
        eq = int((toks[row] == EQ_ID).nonzero()[0])
        scored = mask[row].nonzero().flatten().tolist()
        assert scored == list(range(eq, eq + len(p.answer)))
        predicted = "".join(VOCAB[int(toks[row, i + 1])] for i in scored)
        assert predicted == p.answer
    tgt = next_token_targets(toks)
    assert ((tgt != -100) == mask).all()
    assert (toks[:, -1] == PAD_ID).any()


def test_test_sets_are_fixed_and_distinct_per_split():
    task = AdditionTask.preset("cpu")
    a, b = task.test_set("id", 64, seed=1), task.test_set("id", 64, seed=1)
    assert torch.equal(a.tokens, b.tokens)
    assert task.test_set("interp", 64, seed=1).problems != a.problems


@pytest.mark.parametrize(
    "bad, match",
    [
        ("", "empty"),
        ("[12+a=", "vocabulary"),
        ("12+-3=", "two operators"),
        ("12+3", "lacks '='"),
        ("012+3=", "leading zero"),
        ("N+3=", "N"),
        ("12+3=16]", "arithmetic"),
        ("12+3==", "more than one"),
        ("+3=", "operator"),
        ("[7 + 3 =", "spaces"),
        ("[7 + 3 =", r"write '\[7\+3='"),
        ("[-7+3=", r"negative number is written with N.*write '\[N7\+3='"),
        ("-12-N5=", r"write 'N12-N5='"),
        ("12\t+3=", "spaces"),
    ],
)
def test_bad_problem_strings_raise_typed_errors(bad, match):
    with pytest.raises(ProblemStringError, match=match):
        parse_problem(bad)


def test_spaces_get_the_fix_not_a_hint_about_negatives():
    with pytest.raises(ProblemStringError) as e:
        parse_problem("[7 + 3 =")
    msg = str(e.value)
    assert "negative" not in msg and "'[7+3='" in msg
    assert parse_problem("[7+3=").answer == parse_problem("7+3=").answer  # the suggested fix parses


def test_bad_task_config():
    with pytest.raises(ConfigError):
        AdditionTask(train_terms=())
    with pytest.raises(ConfigError):
        AdditionTask(n_digits=(0,))
    with pytest.raises(ConfigError, match="split"):
        AdditionTask().split("test")
    with pytest.raises(ConfigError, match="positive"):
        AdditionTask().sample_problems(0)


def test_max_len_bounds_every_sample():
    task = AdditionTask.preset("cpu")
    for split in ("id", "interp", "extrap"):
        batch = task.sample_batch(500, split, seed=2)
        assert (batch.tokens != PAD_ID).sum(-1).max() <= task.split(split).max_len()


# ---- property-based -----------------------------------------------------------------------

terms_st = st.lists(st.integers(-99999, 99999), min_size=1, max_size=9)


@given(terms=terms_st, data=st.data())
@settings(max_examples=200, deadline=None)
def test_generated_answer_equals_python_arithmetic(terms, data):
    ops = tuple(data.draw(st.sampled_from("+-")) for _ in terms[1:])
    p = Problem(tuple(terms), ops)
    expr = str(terms[0]) + "".join(f"{o}({t})" for o, t in zip(ops, terms[1:]))
    assert p.result == eval(expr)  # noqa: S307 - Python's own arithmetic as the oracle
    parsed = parse_problem(p.question)
    assert parsed == p
    assert decode(encode(p.text)) == p.text
    assert parse_problem(p.text) == p


@given(seed=st.integers(0, 2**31 - 1))
@settings(max_examples=50, deadline=None)
def test_sampled_problems_round_trip(seed):
    task = AdditionTask()
    p = task.sample_problem(random.Random(seed), "extrap")
    assert parse_problem(p.question) == p
    assert decode(encode(p.text)) == p.text


@given(text=st.text(alphabet=list(VOCAB) + ["a", " ", "x"], max_size=25))
@settings(max_examples=300, deadline=None)
def test_random_strings_are_accepted_or_raise_the_typed_error(text):
    valid = re.fullmatch(r"\[?(N?[1-9][0-9]*|0)([+-](N?[1-9][0-9]*|0))*=", text.strip()) is not None
    try:
        parse_problem(text)
    except ProblemStringError:
        assert not valid
    else:
        assert valid or "=" in text  # full problems with a correct answer are valid too
