"""Circuits and faithfulness: full = 1, empty = the ablated baseline (computed independently), node
circuits = ablating nodes with plain hooks, selection and pruning, drawing."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from interp_norm import AdditionTask, HookedNormTransformer, ModelConfig
from interp_norm.circuits import (
    Circuit,
    LogitDiff,
    activation_patch,
    edge_attribution,
    faithfulness,
    make_pairs,
)
from interp_norm.errors import PatchingError
from interp_norm.core.hook_names import act_name
from interp_norm.report.plots import draw_circuit

from _models import forward_rtol


def make_model(seed=0, **kw):
    model = HookedNormTransformer(ModelConfig.preset("tiny", seed=seed, **kw)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".w", ".b", "b_O", "b_in", "b_out")):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def setup():
    model = make_model(attn_norm="pre")
    pairs = make_pairs(AdditionTask.preset("cpu"), 6, "id", seed=3, aligned=True)
    return model, pairs


def _metric_tol(model, logits) -> float:
    """Rounding bound on a logit difference: the circuit runner sums the senders in another order than
    the forward, each logit is exact up to `forward_rtol` of the logits' scale, a difference has two."""
    return 2 * forward_rtol(model.cfg) * float(logits.abs().max())


@pytest.mark.numerics
@torch.no_grad()
def test_full_and_empty_circuits(setup):
    model, pairs = setup
    metric = LogitDiff(pairs)
    L, H = 2, 4
    f = faithfulness(model, pairs, [Circuit.full(L, H), Circuit.empty(L, H)], metric).set_index(["circuit", "ablation"])
    clean_logits = model(pairs.clean_tokens)
    m_clean = float(metric(clean_logits).mean())
    tol = _metric_tol(model, clean_logits)
    for abl in ("resample", "mean", "zero"):
        # faithfulness = (circuit - empty) / (clean - empty): two metric errors over the denominator
        ftol = 2 * tol / abs(f.loc[(0, abl), "metric_clean"] - f.loc[(0, abl), "metric_empty"])
        assert f.loc[(0, abl), "faithfulness"] == pytest.approx(1.0, abs=ftol)
        assert f.loc[(0, abl), "metric_circuit"] == pytest.approx(m_clean, abs=tol)
        assert f.loc[(1, abl), "faithfulness"] == pytest.approx(0.0, abs=1e-6)  # the same run twice: exact
    # the empty circuit is the ablated model, computed here without the circuit machinery
    corrupted = float(metric(model(pairs.corrupted_tokens)).mean())
    assert f.loc[(1, "resample"), "metric_circuit"] == pytest.approx(corrupted, abs=tol)
    b_O = sum(blk.attn.b_O for blk in model.blocks)  # all that is left when every sender is zero
    zero_logits = model.head(model.ln_final(b_O.expand(*pairs.clean_tokens.shape, -1)))
    assert f.loc[(1, "zero"), "metric_circuit"] == pytest.approx(float(metric(zero_logits).mean()), abs=tol)
    _, cache = model.run_with_cache(pairs.clean_tokens)
    final = cache[act_name("resid_post", 1)].mean(0, keepdim=True).expand_as(cache[act_name("resid_post", 1)])
    mean_logits = model.head(model.ln_final(final))
    assert f.loc[(1, "mean"), "metric_circuit"] == pytest.approx(float(metric(mean_logits).mean()), abs=tol)


@pytest.mark.numerics
@torch.no_grad()
def test_full_and_empty_circuits_of_a_calibrated_model(setup):
    """Head outputs include the block's calibration factor: ablating every edge to its corrupted
    value reproduces the corrupted run, keeping all reproduces the clean one."""
    _, pairs = setup
    model = HookedNormTransformer(ModelConfig.preset("tiny", attn_norm="pre", calibration="paper", calib_update_std=0.5)).eval()
    model.calibrate(make_pairs(AdditionTask.preset("cpu"), 16, "id", seed=11).clean_tokens)
    metric = LogitDiff(pairs)
    f = faithfulness(model, pairs, [Circuit.full(2, 4), Circuit.empty(2, 4)], metric, ablations=["resample", "mean"])
    f = f.set_index(["circuit", "ablation"])
    clean_logits = model(pairs.clean_tokens)
    tol = _metric_tol(model, clean_logits)
    assert f.loc[(0, "resample"), "metric_circuit"] == pytest.approx(float(metric(clean_logits).mean()), abs=tol)
    assert f.loc[(1, "resample"), "metric_circuit"] == pytest.approx(float(metric(model(pairs.corrupted_tokens)).mean()), abs=tol)
    # every sender at its clean-batch mean: the last residual is the mean one (the senders sum to it)
    _, cache = model.run_with_cache(pairs.clean_tokens)
    last = cache[act_name("resid_post", 1)]
    mean_logits = model(last.mean(0, keepdim=True).expand_as(last), start_at_layer=2)
    assert f.loc[(1, "mean"), "metric_circuit"] == pytest.approx(float(metric(mean_logits).mean()), abs=tol)


@pytest.mark.numerics
@torch.no_grad()
def test_node_circuit_equals_ablating_the_other_nodes_with_hooks(setup):
    model, pairs = setup
    metric = LogitDiff(pairs)
    keep = {"a0.h1", "a1.h2", "m0"}
    circuit = Circuit.from_nodes(keep, 2, 4)
    f = faithfulness(model, pairs, circuit, metric).set_index("ablation")
    _, clean = model.run_with_cache(pairs.clean_tokens)
    _, corr = model.run_with_cache(pairs.corrupted_tokens)
    for abl in ("resample", "mean", "zero"):
        def value(name):
            if abl == "resample":
                return corr[name]
            if abl == "mean":
                return clean[name].mean(0, keepdim=True).expand_as(clean[name])
            return torch.zeros_like(clean[name])

        hooks = []
        for l in range(2):
            drop = [h for h in range(4) if f"a{l}.h{h}" not in keep]
            zname = act_name("z", l)

            def hz(z, hook, drop=drop, zname=zname):
                z = z.clone()
                z[:, :, drop] = value(zname)[:, :, drop]
                return z

            hooks.append((zname, hz))
            if f"m{l}" not in keep:
                mname = act_name("mlp_out", l)
                hooks.append((mname, lambda x, hook, mname=mname: value(mname)))
        logits = model.run_with_hooks(pairs.clean_tokens, fwd_hooks=hooks)
        ref = float(metric(logits).mean())
        assert f.loc[abl, "metric_circuit"] == pytest.approx(ref, abs=_metric_tol(model, logits)), abl


def test_selection_pruning_and_node_scores(setup):
    model, pairs = setup
    df = pd.DataFrame(dict(
        sender=["embed", "a0.h0", "a1.h0", "a0.h3", "m0"],
        receiver=["a0.h0.v", "a1.h0.q", "logits", "a1.h1.k", "logits"],
        score=[0.5, -0.4, 0.3, 0.9, 0.01],
    ))
    c = Circuit.from_edge_scores(df, 2, 4, top_n=4)
    # a0.h3 -> a1.h1.k is dangling (a0.h3 has no input, a1.h1 no output): pruned
    assert c.edges == {("embed", "a0.h0.v"), ("a0.h0", "a1.h0.q"), ("a1.h0", "logits")}
    assert c.components == {"a0.h0", "a1.h0"} and c.scores[("a0.h0", "a1.h0.q")] == -0.4
    assert len(Circuit.from_edge_scores(df, 2, 4, threshold=0.35, prune=False)) == 3
    assert len(Circuit.from_edge_scores(df, 2, 4, threshold=0.35, absolute=False, prune=False)) == 2
    z_all = activation_patch(model, pairs, activation="z", by="all")
    eff = z_all.effect().abs()
    top = Circuit.from_node_scores(z_all, 2, 4, top_n=2)
    l, h = divmod(int(eff.flatten().argmax()), 4)
    assert len(top.components) == 2 and f"a{l}.h{h}" in top.components
    mlps = Circuit.from_node_scores(activation_patch(model, pairs, activation="mlp_out", by="all"), 2, 4, top_n=1)
    assert len(mlps.components) == 1 and next(iter(mlps.components)).startswith("m")


def test_edge_circuit_from_attribution_and_drawing(setup):
    model, pairs = setup
    edges = edge_attribution(model, pairs)
    c = Circuit.from_edge_scores(edges, 2, 4, top_n=8)
    assert len(c) >= 8 and ("embed" in c.nodes and "logits" in c.nodes)
    f = faithfulness(model, pairs, c)
    assert list(f.ablation) == ["resample", "mean", "zero"] and f.faithfulness.notna().all()
    fig = draw_circuit(c)
    # one line per edge, the nodes, the legend, then a stub per q/k/v port an edge ends at and the ports' markers
    ports = {tuple(r.rsplit(".", 1)) for _, r in c.edges if r.count(".") == 2 and r.endswith((".q", ".k", ".v"))}
    assert len(fig.data) == len(c) + 1 + 5 + len(ports) + bool(ports)
    assert {a.text for a in fig.layout.annotations} == c.nodes  # node labels are annotations above the edges


def test_circuit_errors(setup):
    model, pairs = setup
    with pytest.raises(PatchingError, match="do not exist"):
        Circuit(2, 4, frozenset({("a1.h0", "a0.h0.q")}))
    with pytest.raises(PatchingError, match="exactly one"):
        Circuit.from_edge_scores(pd.DataFrame(dict(sender=[], receiver=[], score=[])), 2, 4)
    with pytest.raises(PatchingError, match="unknown nodes"):
        Circuit.from_nodes({"a5.h0"}, 2, 4)
    with pytest.raises(PatchingError, match="node circuits"):
        Circuit.from_node_scores(activation_patch(model, pairs, activation="resid_pre"), 2, 4, top_n=1)
    with pytest.raises(PatchingError, match="3 layers"):
        faithfulness(model, pairs, Circuit.full(3, 4))
    with pytest.raises(PatchingError, match="unknown ablation"):
        faithfulness(model, pairs, Circuit.full(2, 4), ablations=("noise",))
