"""Everything also runs on a TransformerLens 4.3 ``TransformerBridge.boot_native`` model."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from transformer_lens import patching
from transformer_lens.config import TransformerBridgeConfig
from transformer_lens.model_bridge import TransformerBridge

from interp_norm import AdditionTask
from interp_norm.circuits import (
    Circuit,
    LogitDiff,
    activation_patch,
    attribution_patch,
    edge_attribution,
    faithfulness,
    make_pairs,
    sparse_attention_events,
)
from interp_norm.errors import PatchingError
from interp_norm.core.hook_names import act_name


@pytest.fixture(scope="module")
def bridge():
    cfg = TransformerBridgeConfig(
        d_model=32, d_head=8, n_heads=4, n_layers=2, n_ctx=24, d_vocab=17, d_mlp=64, act_fn="relu",
        normalization_type="LNPre", seed=0,
    )
    return TransformerBridge.boot_native(cfg).eval()


@pytest.fixture(scope="module")
def pairs():
    return make_pairs(AdditionTask.preset("cpu"), 4, "id", seed=2)


@pytest.mark.parametrize("act,fn", [
    ("z", patching.get_act_patch_attn_head_out_by_pos),
    ("pattern", patching.get_act_patch_attn_head_pattern_by_pos),
    ("resid_pre", patching.get_act_patch_resid_pre),
    ("k", patching.get_act_patch_attn_head_k_by_pos),
])
def test_batched_patching_equals_transformer_lens_on_the_bridge(bridge, pairs, act, fn):
    metric = LogitDiff(pairs)
    _, cache = bridge.run_with_cache(pairs.clean_tokens)
    with contextlib.redirect_stderr(io.StringIO()), torch.no_grad():
        ref = fn(bridge, pairs.corrupted_tokens, cache, metric.mean)
    ours = activation_patch(bridge, pairs.corrupted_tokens, cache, metric, act, batch_size=16)
    assert ours.method == "exact-hooks"
    assert (ours.values - ref).abs().max() <= 1e-5
    with pytest.raises(PatchingError, match="HookedNormTransformer"):
        activation_patch(bridge, pairs.corrupted_tokens, cache, metric, act, method="incremental")


def test_attribution_on_the_bridge(bridge, pairs):
    """Node EAP works; edge EAP (copies backend) adds up to node EAP, as on our models."""
    metric = LogitDiff(pairs)
    z = attribution_patch(bridge, pairs, metric, "z", by="all", ig_steps=2).effect()
    edges = edge_attribution(bridge, pairs, metric, ig_steps=2)
    out = edges.groupby("sender")["score"].sum()
    for l in range(2):
        for h in range(4):
            assert abs(out[f"a{l}.h{h}"] - float(z[l, h])) < 1e-5
    with pytest.raises(PatchingError, match="copies"):
        edge_attribution(bridge, pairs, metric, backend="split")


@torch.no_grad()
def test_faithfulness_on_the_bridge(bridge, pairs):
    metric = LogitDiff(pairs)
    f = faithfulness(bridge, pairs, [Circuit.full(2, 4), Circuit.empty(2, 4)], metric).set_index(["circuit", "ablation"])
    for abl in ("resample", "mean", "zero"):
        assert f.loc[(0, abl), "faithfulness"] == pytest.approx(1.0, abs=1e-5)
    assert f.loc[(1, "resample"), "metric_circuit"] == pytest.approx(float(metric(bridge(pairs.corrupted_tokens)).mean()), abs=1e-5)


@torch.no_grad()
def test_attention_events_on_the_bridge(bridge, pairs):
    ev = sparse_attention_events(bridge, pairs, threshold=0.3)
    _, cache = bridge.run_with_cache(pairs.clean_tokens)
    assert len(ev) > 0
    for r in ev.itertuples():
        row = cache[act_name("pattern", r.layer)][r.problem, r.head, r.query_pos]
        assert r.key_pos == int(row.argmax()) and r.strength == pytest.approx(float(row.max()))
