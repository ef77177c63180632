"""Attention-circuit maps: token roles by hand, sparse events against a brute-force loop, aggregation."""

from __future__ import annotations

import pytest
import torch

from interp_norm import AdditionTask, HookedNormTransformer, ModelConfig
from interp_norm.circuits import attention_map, attention_map_split, sparse_attention_events, token_roles
from interp_norm.errors import PatchingError
from interp_norm.core.hook_names import act_name
from interp_norm.core.task import parse_problem

from _models import forward_rtol

TASK = AdditionTask.preset("cpu")


def test_token_roles_by_hand():
    p = parse_problem("[12-N7=")  # 12 - (-7) = 19
    labels = [r["label"] for r in token_roles(p)]
    assert "".join(p.text) == "[12-N7=19]"
    assert labels == ["bos", "t0.p1", "t0.p0", "op0", "t1.sign", "t1.p0", "=", "ans.p1", "ans.p0", "eos"]
    neg = [r["label"] for r in token_roles(parse_problem("[3-45="))]  # N42
    assert neg[-4:] == ["ans.sign", "ans.p1", "ans.p0", "eos"]


@pytest.mark.numerics
@torch.no_grad()
def test_events_match_a_brute_force_loop():
    model = HookedNormTransformer(ModelConfig.preset("tiny", attn_norm="none", seed=2)).eval()
    with torch.no_grad():  # sharpen attention so some heads pass a moderate threshold
        for blk in model.blocks:
            blk.attn.W_Q.mul_(4.0)
    problems = TASK.sample_problems(12, "id", seed=1)
    thr = 0.6
    ev = sparse_attention_events(model, problems, threshold=thr)
    assert len(ev) > 0
    expected = {}
    for i, p in enumerate(problems):
        tokens = model.to_tokens(p.text)
        _, cache = model.run_with_cache(tokens)
        roles = token_roles(p)
        eq = p.question.index("=")
        for j in range(len(p.answer)):
            q = eq + j
            for l in range(2):
                row = cache[act_name("pattern", l)][0, :, q]  # [head, key]
                for h in range(4):
                    if row[h].max() >= thr:
                        expected[(i, roles[q + 1]["label"], l, h, roles[int(row[h].argmax())]["label"])] = float(row[h].max())
    got = {(r.problem, r.query, r.layer, r.head, r.key): r.strength for r in ev.itertuples()}
    assert got.keys() == expected.keys()
    # one problem at a time vs a padded batch: the same arithmetic up to float32 rounding (patterns <= 1)
    assert max(abs(got[k] - expected[k]) for k in got) <= forward_rtol(model.cfg)


@torch.no_grad()
def test_aggregation_and_split_batching():
    model = HookedNormTransformer(ModelConfig.preset("tiny", attn_norm="none", seed=2)).eval()
    for blk in model.blocks:
        blk.attn.W_Q.mul_(4.0)
    problems = TASK.sample_problems(40, "interp", seed=9)
    ev = sparse_attention_events(model, problems, threshold=0.6)
    agg = attention_map(model, problems, threshold=0.6)
    for r in agg.itertuples():
        sel = ev[(ev["query"] == r.query) & (ev["layer"] == r.layer) & (ev["head"] == r.head) & (ev["key"] == r.key)]
        n_q = sum(1 for p in problems for j in range(len(p.answer)) if token_roles(p)[p.question.index("=") + j + 1]["label"] == r.query)
        assert r.count == len(sel) and r.n_queries == n_q
        assert r.frequency == pytest.approx(len(sel) / n_q) and r.mean_strength == pytest.approx(sel.strength.mean())
    split = attention_map_split(model, TASK, "interp", n=40, batch_size=16, seed=9, threshold=0.6)
    assert (split["split"] == "interp").all()
    pd_cols = ["query", "layer", "head", "key", "count", "n_queries"]
    assert split[pd_cols].reset_index(drop=True).equals(agg[pd_cols].reset_index(drop=True))
    by_index = attention_map(model, problems, threshold=0.6, query="index")
    assert set(by_index["query"]) <= {f"a{j}" for j in range(6)}
    assert by_index["count"].sum() == agg["count"].sum()


def test_attention_errors():
    model = HookedNormTransformer(ModelConfig.preset("tiny")).eval()
    with pytest.raises(PatchingError, match="threshold"):
        attention_map(model, ["[1+2="], threshold=1.5)
    with pytest.raises(PatchingError, match="context"):
        attention_map(model, ["[" + "+".join(["99"] * 12) + "="])
    with pytest.raises(PatchingError, match="query"):
        attention_map(model, ["[1+2="], query="pos")
