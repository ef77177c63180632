"""MIB metrics against brute force: a 1-layer, 1-head model has 8 edges, so every one of the 256
circuits can be run by a hand-written forward pass (no hooks, no edge runner), and CPR/CMD are
recomputed from those numbers with an explicit top-k, prune and trapezoid loop."""

from __future__ import annotations

import itertools
import math
import random

import pandas as pd
import pytest
import torch

from interp_norm import AdditionTask
from interp_norm.circuits import Circuit, EdgeGraph, LogitDiff, edge_attribution, faithfulness, make_pairs
from interp_norm.circuits.benchmark.mib import (
    MIB_FRACTIONS,
    area_under,
    cpr_cmd,
    faithfulness_curve,
    from_mib_json,
    to_mib_json,
)
from interp_norm.errors import PatchingError
from tests._models import make_model

EDGES = [  # every edge of a 1-layer, 1-head model, written out by hand
    ("embed", "a0.h0.q"), ("embed", "a0.h0.k"), ("embed", "a0.h0.v"), ("embed", "m0"), ("a0.h0", "m0"),
    ("embed", "logits"), ("a0.h0", "logits"), ("m0", "logits"),
]


@torch.no_grad()
def hand_forward(model, clean, corr, circuit) -> torch.Tensor:
    """Logits of the clean input where every edge outside ``circuit`` carries the corrupted value."""
    blk = model.blocks[0]
    attn = blk.attn

    def head_out(e_q, e_k, e_v):
        if model.cfg.attn_norm == "pre":
            xq, xk, xv = blk.ln1(e_q)[0], blk.ln1(e_k)[1], blk.ln1(e_v)[2]
        else:
            xq, xk, xv = e_q, e_k, e_v
        return attn(xq, xk, xv) - attn.b_O  # the sender is z W_O; b_O is a constant of the residual

    e_c, e_x = model.embed(clean), model.embed(corr)
    h_x = head_out(e_x, e_x, e_x)
    m_x = blk.mlp_update(e_x + h_x + attn.b_O)
    pick = lambda u, r, now, old: now if (u, r) in circuit else old  # noqa: E731
    h = head_out(*(pick("embed", f"a0.h0.{j}", e_c, e_x) for j in "qkv"))
    m = blk.mlp_update(pick("embed", "m0", e_c, e_x) + pick("a0.h0", "m0", h, h_x) + attn.b_O)
    resid = pick("embed", "logits", e_c, e_x) + pick("a0.h0", "logits", h, h_x) + attn.b_O + pick("m0", "logits", m, m_x)
    return model.head(model.ln_final(resid))


@pytest.fixture(scope="module", params=["pre", "qk"])
def brute(request):
    model = make_model(seed=3, n_layers=1, n_heads=1, attn_norm=request.param).double()  # float64: compare to 1e-9
    pairs = make_pairs(AdditionTask.preset("cpu"), 6, "id", seed=1, aligned=True)
    metric = LogitDiff(pairs)
    clean, corr = pairs.clean_tokens, pairs.corrupted_tokens
    with torch.no_grad():
        m_clean = float(metric(model(clean)).mean())
    m_empty = float(metric(hand_forward(model, clean, corr, set())).mean())
    f = {}
    for bits in itertools.product((0, 1), repeat=len(EDGES)):
        c = frozenset(e for e, b in zip(EDGES, bits) if b)
        m = float(metric(hand_forward(model, clean, corr, c)).mean())
        f[c] = (m - m_empty) / (m_clean - m_empty)
    return model, pairs, metric, f


def test_the_hand_edge_list_is_the_models_edge_graph():
    assert sorted(EdgeGraph(1, 1).edges()) == sorted(EDGES)


def test_every_subset_faithfulness_matches_the_hand_forward(brute):
    model, pairs, metric, f = brute
    subsets = list(f)
    circuits = [Circuit(1, 1, c) for c in subsets]
    got = faithfulness(model, pairs, circuits, metric, ablations=("resample",))["faithfulness"].to_numpy()
    want = [f[c] for c in subsets]
    assert got == pytest.approx(want, abs=1e-9)


def test_full_model_is_one_and_empty_circuit_is_zero(brute):
    model, pairs, metric, f = brute
    assert f[frozenset(EDGES)] == pytest.approx(1.0, abs=1e-9)
    assert f[frozenset()] == 0.0
    curve = faithfulness_curve(model, pairs, _scores(random.Random(0)), metric, fractions=(0.5, 1.0))
    assert curve["faithfulness"].iloc[-1] == pytest.approx(1.0, abs=1e-9)
    curve0 = faithfulness_curve(model, pairs, _scores(random.Random(0)), metric, fractions=(0.001, 1.0))
    assert curve0["n_edges"].iloc[0] == 0 and curve0["faithfulness"].iloc[0] == pytest.approx(0.0, abs=1e-9)


def _scores(rng: random.Random, zeros: int = 0) -> pd.DataFrame:
    vals = [rng.uniform(-1, 1) for _ in EDGES]
    for i in rng.sample(range(len(EDGES)), zeros):
        vals[i] = 0.0
    return pd.DataFrame(dict(sender=[u for u, _ in EDGES], receiver=[r for _, r in EDGES], score=vals))


def _hand_prune(edges: set) -> set:
    node_of = lambda r: r.rsplit(".", 1)[0] if r.count(".") == 2 else r  # noqa: E731
    while True:
        nodes = {"embed", "a0.h0", "m0"}
        in_graph = {n for n in nodes if any(u == n for u, _ in edges) and (n == "embed" or any(node_of(r) == n for _, r in edges))}
        kept = {(u, r) for u, r in edges if u in in_graph and (r == "logits" or node_of(r) in in_graph)}
        if kept == edges:
            return kept
        edges = kept


def _hand_cpr_cmd(f: dict, scores: pd.DataFrame, fractions, absolute: bool) -> tuple[float, float]:
    keyed = [(abs(s) if absolute else s, i) for i, s in enumerate(scores["score"])]
    order = [i for _, i in sorted(keyed, key=lambda t: (-t[0], t[1]))]
    ys = []
    for p in fractions:
        k = math.floor(p * len(EDGES))
        top = {(scores["sender"][i], scores["receiver"][i]) for i in order[:k]}
        ys.append(f[frozenset(_hand_prune(top))])
    cpr = cmd = 0.0
    for i in range(len(fractions) - 1):
        w = fractions[i + 1] - fractions[i]
        cpr += w * (ys[i] + ys[i + 1]) / 2
        cmd += w * (abs(1 - ys[i]) + abs(1 - ys[i + 1])) / 2
    return cpr, cmd


@pytest.mark.parametrize("fractions", [MIB_FRACTIONS, tuple(k / 8 for k in range(1, 9)), (0.3, 0.6, 0.7, 1.0)])
def test_cpr_and_cmd_equal_brute_force(brute, fractions):
    model, pairs, metric, f = brute
    rng = random.Random(7)
    tables = {f"random{i}": _scores(rng, zeros=i) for i in range(3)}
    tables["eap"] = edge_attribution(model, pairs, metric)
    for absolute in (True, False):
        curve = faithfulness_curve(model, pairs, tables, metric, fractions=fractions, absolute=absolute)
        summary = cpr_cmd(curve).set_index("method")
        for name, df in tables.items():
            cpr, cmd = _hand_cpr_cmd(f, df.reset_index(drop=True), fractions, absolute)
            assert summary.loc[name, "cpr"] == pytest.approx(cpr, abs=1e-9), (name, absolute)
            assert summary.loc[name, "cmd"] == pytest.approx(cmd, abs=1e-9), (name, absolute)


def test_area_under_is_the_trapezoid_rule():
    assert area_under([0.0, 1.0, 3.0], [1.0, 3.0, 3.0]) == pytest.approx(2.0 + 6.0)
    assert area_under([1.0, math.e], [2.0, 2.0], log_scale=True) == pytest.approx(2.0)
    assert area_under(MIB_FRACTIONS, [1.0] * 10) == pytest.approx(0.999)


def test_bad_fractions_and_missing_scores_raise(brute):
    model, pairs, metric, _ = brute
    with pytest.raises(PatchingError, match="fractions"):
        faithfulness_curve(model, pairs, _scores(random.Random(0)), metric, fractions=(0.5, 0.2))
    with pytest.raises(PatchingError, match="no score"):
        to_mib_json(_scores(random.Random(0)).iloc[:-1], model.cfg)


def _eap_ig_edge_names(n_layers: int, n_heads: int) -> set[str]:
    """The edge names EAP-IG's Graph.from_model creates (sequential attention, then MLP)."""
    names, stream = set(), ["input"]
    for l in range(n_layers):
        heads = [f"a{l}.h{h}" for h in range(n_heads)]
        for node in stream:
            names |= {f"{node}->{a}<{x}>" for a in heads for x in "qkv"}
        stream += heads
        names |= {f"{node}->m{l}" for node in stream}
        stream.append(f"m{l}")
    return names | {f"{node}->logits" for node in stream}


def test_mib_json_has_eap_igs_names_and_round_trips():
    model = make_model(seed=0)  # 2 layers x 4 heads
    L, H = model.cfg.n_layers, model.cfg.n_heads
    edges = EdgeGraph(L, H).edges()
    rng = random.Random(1)
    scores = pd.DataFrame(dict(sender=[u for u, _ in edges], receiver=[r for _, r in edges], score=[rng.gauss(0, 1) for _ in edges]))
    circuit = Circuit.from_edge_scores(scores, L, H, top_n=12)
    d = to_mib_json(scores, model.cfg, circuit)
    assert set(d["edges"]) == _eap_ig_edge_names(L, H)
    assert set(d["nodes"]) == {"input", "logits"} | {f"a{l}.h{h}" for l in range(L) for h in range(H)} | {f"m{l}" for l in range(L)}
    assert d["cfg"] == {"n_layers": L, "n_heads": H, "parallel_attn_mlp": False, "d_model": model.cfg.d_model}
    assert sum(e["in_graph"] for e in d["edges"].values()) == len(circuit)
    back = from_mib_json(d).merge(scores, on=["sender", "receiver"], suffixes=("", "_orig"))
    assert len(back) == len(scores) and (back["score"] == back["score_orig"]).all()
    assert {(u, r) for u, r, g in zip(back.sender, back.receiver, back.in_graph) if g} == set(circuit.edges)


def test_faithfulness_figure_from_the_suite_curves():
    """plot_faithfulness draws run_benchmark_mib's curves: one line per (model, method) with the
    curve's points, f = 1 at 100 % of the edges, CPR/CMD of the summary in the legend (one model)."""
    from interp_norm.circuits.benchmark.suite import run_benchmark_mib
    from interp_norm.report.plots import plot_faithfulness

    mib = run_benchmark_mib(["prev_token", "induction"], ["exact", "eap"], n_pairs=8, ig_steps=2)
    fig = plot_faithfulness(mib["curve"], mib["summary"])
    lines = [t for t in fig.data if t.mode == "lines+markers"]
    assert len(lines) == 4 and sum(t.showlegend for t in lines) == 2
    for t in lines:
        assert list(t.x) == pytest.approx([100 * f for f in MIB_FRACTIONS])
        assert t.y[-1] == pytest.approx(1.0, abs=1e-6)
    one = mib["curve"][mib["curve"].model == "induction"]
    fig1 = plot_faithfulness(one.drop(columns="model"), mib["summary"][mib["summary"].model == "induction"].drop(columns="model"))
    for t in fig1.data:
        s = mib["summary"][(mib["summary"].model == "induction") & (mib["summary"].method == t.legendgroup)].iloc[0]
        assert f"CPR {s.cpr:.3f}, CMD {s.cmd:.3f}" in t.name
        g = one[one.method == t.legendgroup].sort_values("fraction")
        assert list(t.y) == pytest.approx(g.faithfulness.tolist())
    with pytest.raises(Exception, match="faithfulness"):
        plot_faithfulness(pd.DataFrame({"method": ["x"]}))
