"""scripts/recheck_circuits.py's pieces against hand-worked problems and the package's own draw."""

from __future__ import annotations

import sys

import pytest
import torch

from interp_norm.core import task as T

from _models import make_model
from _scripts import load_script



@pytest.fixture(scope="module")
def rc():
    yield load_script("recheck_circuits")
    sys.modules.pop("recheck_circuits", None)


def test_answer_positions_and_key_classes_by_hand(rc):
    # [12+N7=5]: '=' at 6 predicts the units digit 5, row 7 predicts ']'
    assert rc.answer_rows("[12+N7=5]") == [(6, "units"), (7, "end")]
    assert rc.key_classes("[12+N7=5]") == ["[", "tens digits", "units digits", "operators", "operand signs",
                                           "units digits", "=", "earlier answer", "]"]
    # [3-45=N42]: '=' predicts N, then tens, units, end; answer tokens are earlier answer
    assert rc.answer_rows("[3-45=N42]") == [(5, "sign"), (6, "tens"), (7, "units"), (8, "end")]
    assert rc.key_classes("[3-45=N42]")[5:] == ["=", "earlier answer", "earlier answer", "earlier answer", "]"]


@pytest.mark.parametrize("masses, role", [
    ({"=": 0.7, "[": 0.3}, "reads ="),
    ({"=": 0.4, "[": 0.25, "operators": 0.35}, "reads = and operators"),
    ({"tens digits": 0.35, "units digits": 0.3, "=": 0.15, "[": 0.2}, "reads tens digits and units digits"),
    ({"tens digits": 0.4, "units digits": 0.15, "hundreds digits": 0.1, "=": 0.35}, "reads tens digits and ="),
    ({"tens digits": 0.45, "units digits": 0.19, "=": 0.18, "[": 0.18}, "reads operand digits"),
    ({"tens digits": 0.3, "=": 0.19, "[": 0.19, "operators": 0.16, "operand signs": 0.16}, "spread (most on tens digits)"),
])
def test_role_rule_branches(rc, masses, role):
    assert rc.role_of(masses, rc.Rule()) == role


def test_source_draw_matches_the_package_draw(rc):
    from interp_norm.circuits.cell_circuit import circuit_data

    problems = T.AdditionTask.preset("cpu").sample_problems(64, "id", seed=0)
    mine = rc.draw_sources(problems, seed=1)
    theirs = circuit_data(problems, seed=1).source_problems
    assert [p.text for p in mine] == [p.text for p in theirs]


def test_kept_accuracy_identities(rc):
    """Keeping every cell, or resampling from the clean run itself, changes nothing; the full accuracy is the
    task's masked per-token accuracy."""
    model = make_model(0)
    problems = T.AdditionTask.preset("cpu").sample_problems(8, "id", seed=2)
    width = max(len(p.text) for p in problems)
    tokens = T.pad_batch([T.encode(p.text) for p in problems], width)
    source = T.pad_batch([T.encode(p.text) for p in rc.draw_sources(problems, seed=3)], width)
    rows = [rc.answer_rows(p.text) for p in problems]
    every = {(l, h, pos) for rs in rows for _, pos in rs
             for l in range(model.cfg.n_layers) for h in range(model.cfg.n_heads)}
    with torch.no_grad():
        pred = model(tokens).argmax(-1)
    mask = T.answer_mask(tokens)
    expected = int(((pred == T.next_tokens(tokens)) & mask).sum()) / int(mask.sum())  # counts: exact
    full, kept = rc.kept_accuracy(model, tokens, source, rows, every)
    assert full == expected and kept == full
    assert rc.kept_accuracy(model, tokens, tokens, rows, set()) == (full, full)
