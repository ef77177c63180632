"""Attribution patching (EAP / EAP-IG) against finite differences, exact patching and its own identities."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from interp_norm import AdditionTask, HookedNormTransformer, ModelConfig
from interp_norm.circuits import (
    EdgeGraph,
    LogitDiff,
    activation_patch,
    attribution_patch,
    compare_scores,
    edge_attribution,
    exact_edge_patch,
    make_pairs,
)
from interp_norm.errors import PatchingError

EPS = 1e-4


@pytest.fixture(scope="module")
def pairs():
    return make_pairs(AdditionTask.preset("cpu-small"), 6, "id", seed=7, aligned=True)


def model64(attn_norm="pre", **kw):
    return HookedNormTransformer(ModelConfig.preset("tiny", attn_norm=attn_norm, seed=3, **kw)).double().eval()


@pytest.mark.parametrize("act,by", [("z", "pos"), ("v", "pos"), ("pattern", "pos"), ("resid_mid", "pos"), ("q", "all")])
def test_node_attribution_is_the_finite_difference_of_exact_patching(act, by, pairs):
    """EAP = d/d(eps) of patching corr + eps*(clean - corr): exact patching with a nudged 'clean' cache."""
    model = model64("qkv")
    metric = LogitDiff(pairs)
    _, clean = model.run_with_cache(pairs.clean_tokens)
    _, corr = model.run_with_cache(pairs.corrupted_tokens)
    nudged = {k: corr[k] + EPS * (clean[k] - corr[k]) for k in clean.keys()}
    fd = activation_patch(model, pairs.corrupted_tokens, nudged, metric, act, by=by)
    eap = attribution_patch(model, pairs, metric, act, by=by)
    fd_effect = (fd.per_example.mean(-1) - fd.baseline.mean()).view_as(fd.values) / EPS
    scale = float(fd_effect.abs().max())
    assert scale > 1e-3
    assert (eap.effect().double() - fd_effect).abs().max() <= 2e-3 * scale


def test_edge_attribution_is_the_finite_difference_of_edge_patching(pairs):
    model = model64("pre")
    metric = LogitDiff(pairs)
    eap = edge_attribution(model, pairs, metric)
    for backend in ("split", "copies"):
        fd = exact_edge_patch(model, pairs, metric, scale=EPS, backend=backend)
        j = eap.merge(fd, on=["sender", "receiver"], suffixes=("", "_fd"))
        assert len(j) == len(EdgeGraph(2, 4).edges())
        scale = j["score"].abs().max()
        assert (j["score"] - j["score_fd"] / EPS).abs().max() <= 2e-3 * scale, backend


def test_backends_agree_and_nodes_are_sums_of_their_out_edges(pairs):
    """split vs copies backends; and EAP's edge scores out of a node add up to its node score."""
    model = HookedNormTransformer(ModelConfig.preset("tiny", attn_norm="qk", seed=1)).eval()
    metric = LogitDiff(pairs)
    split = edge_attribution(model, pairs, metric, ig_steps=3, backend="split")
    copies = edge_attribution(model, pairs, metric, ig_steps=3, backend="copies")
    j = split.merge(copies, on=["sender", "receiver"])
    assert (j.score_x - j.score_y).abs().max() < 1e-6
    out = split.groupby("sender")["score"].sum()
    z = attribution_patch(model, pairs, metric, "z", by="all", ig_steps=3).effect()  # [layer, head]
    mlp = attribution_patch(model, pairs, metric, "mlp_out", by="all", ig_steps=3).effect()  # [layer]
    emb = attribution_patch(model, pairs, metric, "resid_pre", by="all", ig_steps=3).effect()[0]
    for l in range(2):
        for h in range(4):
            assert abs(out[f"a{l}.h{h}"] - float(z[l, h])) < 1e-5
        assert abs(out[f"m{l}"] - float(mlp[l])) < 1e-5
    assert abs(out["embed"] - float(emb)) < 1e-5


def test_edges_on_a_calibrated_model(pairs):
    """With the paper's Checkpoint factors a head adds factor * z W_O to the residual: edge scores
    still add up to node scores and still are the derivative of exact edge patching."""
    model = HookedNormTransformer(ModelConfig.preset("tiny", attn_norm="qkv", calibration="paper", seed=2,
                                                     calib_update_std=0.5)).double().eval()
    model.calibrate(make_pairs(AdditionTask.preset("cpu"), 16, "id", seed=11).clean_tokens)
    assert abs(float(model.blocks[0].calib_attn_out.factor) - 1.0) > 0.1
    metric = LogitDiff(pairs)
    eap = edge_attribution(model, pairs, metric)
    out = eap.groupby("sender")["score"].sum()
    z = attribution_patch(model, pairs, metric, "z", by="all").effect()
    for l in range(2):
        for h in range(4):
            assert abs(out[f"a{l}.h{h}"] - float(z[l, h])) < 1e-7
    fd = exact_edge_patch(model, pairs, metric, scale=EPS)
    j = eap.merge(fd, on=["sender", "receiver"], suffixes=("", "_fd"))
    assert (j["score"] - j["score_fd"] / EPS).abs().max() <= 2e-3 * j["score"].abs().max()


def test_chunked_edge_attribution_equals_one_pass(pairs):
    model = HookedNormTransformer(ModelConfig.preset("tiny", seed=4)).eval()
    one = edge_attribution(model, pairs, ig_steps=3)
    chunked = edge_attribution(model, pairs, ig_steps=3, batch_size=30)  # 2 examples x 1 step per pass
    j = one.merge(chunked, on=["sender", "receiver"])
    assert (j.score_x - j.score_y).abs().max() < 1e-6


def test_integrated_gradients_are_complete():
    """IG over the input embedding sums to M(clean) - M(corrupted) as the steps grow; EAP does not."""
    # pairs whose total effect is not a near-cancellation along the path (the fixture's seed 7 is
    # one: |total| 0.014 while the path's own variation is ~18x that, so 64 steps are not enough)
    pairs = make_pairs(AdditionTask.preset("cpu"), 6, "id", seed=11, aligned=True)
    model = model64("pre")
    metric = LogitDiff(pairs)
    exact = activation_patch(model, pairs, activation="resid_pre", by="all")
    total = float(exact.clean.mean() - exact.baseline.mean())
    assert abs(float(exact.effect()[0]) - total) < 1e-6  # patching all of layer 0's input = the clean run
    err = {m: abs(float(attribution_patch(model, pairs, metric, "resid_pre", by="all", ig_steps=m).effect()[0]) - total)
           for m in (1, 8, 64)}
    assert err[64] < err[8] < err[1] and err[64] < 0.03 * abs(total)


def test_eap_tracks_exact_patching_on_a_tiny_model(pairs):
    model = HookedNormTransformer(ModelConfig.preset("tiny", seed=0)).eval()
    metric = LogitDiff(pairs)
    exact = activation_patch(model, pairs, None, metric, "z")
    row = compare_scores(attribution_patch(model, pairs, metric, "z"), exact, k=5).iloc[0]
    assert row.pearson > 0.9 and row.topk_overlap >= 0.6
    edges = compare_scores(edge_attribution(model, pairs, metric), exact_edge_patch(model, pairs, metric), k=10).iloc[0]
    assert edges.pearson > 0.8


def test_compare_scores_against_numpy():
    a = pd.DataFrame(dict(sender=list("abcd"), receiver=["logits"] * 4, score=[1.0, -2.0, 3.0, 0.1]))
    e = pd.DataFrame(dict(sender=list("dcba"), receiver=["logits"] * 4, score=[0.0, 2.5, -1.5, 1.2]))
    row = compare_scores(a, e, k=2).iloc[0]
    av, ev = np.array([1.0, -2.0, 3.0, 0.1]), np.array([1.2, -1.5, 2.5, 0.0])
    assert row.pearson == pytest.approx(np.corrcoef(av, ev)[0, 1])
    assert row.spearman == pytest.approx(1.0)
    assert row.topk_overlap == 1.0 and row.topk_sign_agreement == 1.0
    assert row.max_abs_diff == pytest.approx(0.5)


def test_edge_graph_counts():
    g = EdgeGraph(2, 4)
    assert len(g.senders) == 1 + 2 * 5 and len(g.receivers) == 2 * 13 + 1
    # layer-0 attention reads only the embedding; m0 also reads layer-0 heads; logits read everything
    v = g.valid()
    assert v[:, g.receiver_index(0, "head")].sum() == 1
    assert v[:, g.receiver_index(0, "mlp")].sum() == 5
    assert v[:, -1].all()


def test_attribution_errors(pairs):
    model = HookedNormTransformer(ModelConfig.preset("tiny")).eval()
    with pytest.raises(PatchingError, match="ig_steps"):
        attribution_patch(model, pairs, ig_steps=0)
    with pytest.raises(PatchingError, match="PatchingPairs"):
        edge_attribution(model, pairs.clean_tokens)
    with pytest.raises(PatchingError, match="backend"):
        edge_attribution(model, pairs, backend="fast")
    with pytest.raises(PatchingError, match="unknown node"):
        exact_edge_patch(model, pairs, edges=[("a9.h0", "logits")])
    with pytest.raises(PatchingError, match="not edges"):
        exact_edge_patch(model, pairs, edges=[("a1.h0", "a0.h0.q")])
