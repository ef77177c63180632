"""Accuracy metrics against brute-force loops written from the paper's definitions."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from interp_norm.core import task as T
from interp_norm.errors import ConfigError
from interp_norm.core.scoring import count_correct, evaluate, exact_match_accuracy, per_token_accuracy, trim_padding
from interp_norm.core.model import HookedNormTransformer, ModelConfig
from interp_norm.core.task import AdditionTask

TASK = AdditionTask.preset("cpu")


def brute_force_per_token(model, tokens, include_eos=True):
    """Loop over every position: score p iff it is at/after '=' and token p+1 is not padding."""
    with torch.no_grad():
        logits = model(tokens)
    right = total = 0
    for b in range(tokens.shape[0]):
        seq = tokens[b].tolist()
        eq = seq.index(T.EQ_ID)
        for p in range(eq, len(seq) - 1):
            nxt = seq[p + 1]
            if nxt == T.PAD_ID or (not include_eos and nxt == T.EOS_ID):
                continue
            total += 1
            right += int(int(logits[b, p].argmax()) == nxt)
    return right / total


def brute_force_exact_match(model, problems):
    """Greedy decoding one problem at a time, one token at a time."""
    right = 0
    for p in problems:
        seq = T.encode(p.question).tolist()
        out = ""
        while len(seq) < model.cfg.n_ctx:
            nxt = int(model(torch.tensor([seq]))[0, -1].argmax())
            seq.append(nxt)
            out += T.VOCAB[nxt]
            if nxt == T.EOS_ID:
                break
        right += out == p.answer
    return right / len(problems)


class Oracle(HookedNormTransformer):
    """Knows arithmetic: predicts the true next answer token, except the last digit when result % 3 == 0.

    Its logits come from the tokens alone, so the expected metrics are known in closed form.
    """

    def forward(self, tokens, return_type="logits", pos_offset=None):
        logits = torch.zeros(*tokens.shape, self.cfg.d_vocab)
        for b, seq in enumerate(tokens.tolist()):
            if T.EQ_ID not in seq:
                continue
            eq = seq.index(T.EQ_ID)
            prob = T.parse_problem(T.decode(seq[: eq + 1]))
            ans = prob.answer
            if prob.result % 3 == 0:  # wrong last digit: 9 -> 8, else +1
                d = ans[-2]
                ans = ans[:-2] + ("8" if d == "9" else str(int(d) + 1)) + "]"
            for p in range(eq, len(seq)):
                k = p - eq
                logits[b, p, T.TOKEN_TO_ID[ans[k]] if k < len(ans) else T.PAD_ID] = 1.0
        return logits


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = HookedNormTransformer(ModelConfig.preset("tiny", seed=5)).eval()
    with torch.no_grad():  # a random model predicts one token everywhere; spread its guesses
        m.head.layers[-1].bias.copy_(torch.randn(17) * 2)
    return m


def test_per_token_accuracy_matches_position_loop(model):
    batch = TASK.test_set("extrap", size=64, seed=3)
    for eos in (True, False):
        expected = brute_force_per_token(model, batch.tokens, include_eos=eos)
        got = per_token_accuracy(model, batch.tokens, include_eos=eos, batch_size=7)
        assert got == pytest.approx(expected, abs=1e-12)
    assert 0 < per_token_accuracy(model, batch) < 1  # the test is not trivially 0 or 1


def test_evaluate_matches_brute_force_on_an_oracle():
    oracle = Oracle(ModelConfig.preset("tiny")).eval()
    df = evaluate(oracle, TASK, splits=("id", "extrap"), size=48, seed=2, batch_size=10)
    assert df["split"].tolist() == ["id", "extrap"] and df["n"].tolist() == [48, 48]
    for _, row in df.iterrows():
        batch = TASK.test_set(row.split, size=48, seed=2)
        wrong = [p for p in batch.problems if p.result % 3 == 0]
        assert 0 < len(wrong) < 48
        assert row.exact_match == pytest.approx(1 - len(wrong) / 48)
        assert row.exact_match == pytest.approx(brute_force_exact_match(oracle, batch.problems))
        n_tok = sum(len(p.answer) for p in batch.problems)
        assert row.n_tokens == n_tok
        assert row.per_token_acc == pytest.approx(1 - len(wrong) / n_tok)
        assert row.per_token_acc_no_eos == pytest.approx(1 - len(wrong) / (n_tok - 48))
        # logits are one-hot with value 1: each scored token's loss is log(16 + e) - 1 when right
        loss_right, loss_wrong = math.log(16 + math.e) - 1, math.log(16 + math.e)
        assert row.loss == pytest.approx(((n_tok - len(wrong)) * loss_right + len(wrong) * loss_wrong) / n_tok)


def test_exact_match_of_a_real_model_matches_greedy_loop(model):
    problems = TASK.test_set("id", size=24, seed=9).problems
    assert exact_match_accuracy(model, problems, batch_size=5) == brute_force_exact_match(model, problems)


def test_evaluate_is_deterministic_and_can_skip_generation(model):
    a = evaluate(model, TASK, size=32, exact_match=False)
    b = evaluate(model, TASK, size=32, exact_match=False)
    assert a.equals(b) and a["exact_match"].isna().all()
    assert list(a.columns) == ["split", "n", "n_tokens", "per_token_acc", "per_token_acc_no_eos", "exact_match", "loss"]


def test_loss_column_matches_model_loss(model):
    batch = TASK.test_set("id", size=40, seed=1)
    df = evaluate(model, TASK, splits=("id",), size=40, seed=1, exact_match=False)
    with torch.no_grad():
        logits = model(batch.tokens)
    tgt = batch.targets
    expected = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=-100)
    assert df.loss[0] == pytest.approx(float(expected), rel=1e-5)


def test_bad_inputs_raise_config_errors(model):
    with pytest.raises(ConfigError, match="size"):
        evaluate(model, TASK, size=0)
    with pytest.raises(ConfigError, match="unknown split"):
        evaluate(model, TASK, splits=("ood",), size=4)
    with pytest.raises(ConfigError, match="batch_size"):
        per_token_accuracy(model, TASK.test_set("id", 4).tokens, batch_size=0)
    with pytest.raises(ConfigError, match="n_ctx"):
        evaluate(model, AdditionTask.preset("paper"), size=4)


def test_count_correct_matches_position_loop(model):
    """The one answer-token count (training loop, evaluation) against the brute-force position loop."""
    batch = TASK.test_set("interp", size=40, seed=4)
    with torch.no_grad():
        logits = model(batch.tokens)
    for eos in (True, False):
        right, total = count_correct(logits, batch.tokens, include_eos=eos)
        assert right / total == pytest.approx(brute_force_per_token(model, batch.tokens, include_eos=eos), abs=1e-12)
        n_answer = sum(len(p.answer) - (0 if eos else 1) for p in batch.problems)  # ']' is the answer's last char
        assert total == n_answer


def test_trim_padding_drops_only_columns_that_are_padding_everywhere():
    batch = TASK.test_set("extrap", size=16, seed=2)
    wide = T.pad_batch(list(batch.tokens), length=batch.tokens.shape[1] + 5)
    trimmed = trim_padding(wide)
    longest = max(len(T.encode(p.question + p.answer)) for p in batch.problems)
    assert trimmed.shape == (16, longest) and torch.equal(trimmed, wide[:, :longest])
    assert (wide[:, longest:] == T.PAD_ID).all() and not (trimmed[:, -1] == T.PAD_ID).all()
