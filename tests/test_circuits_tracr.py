"""The tracr-compiled programs, loaded without JAX as TransformerLens bridges: each computes its
RASP program (the interpreter's outputs, saved at compile time) on all 300 saved inputs, its
compiler-given circuit is a valid edge set, and exact patching finds every circuit node."""

from __future__ import annotations

import math

import pytest
import torch

from interp_norm.circuits.benchmark.suite import run_benchmark
from interp_norm.circuits.benchmark.tracr_suite import TRACR_PROGRAMS, TRACR_SUITE, TracrMetric, load_tracr
from interp_norm.errors import PatchingError


@pytest.mark.parametrize("name", TRACR_PROGRAMS)
def test_the_bridge_computes_the_rasp_program_on_300_inputs(name):
    g = TRACR_SUITE[name]
    x, y = g.reference()
    assert len(x) >= 200
    with torch.no_grad():
        logits = load_tracr(name)(x)
    if g.spec["output"] == "numerical":
        assert (logits[:, 1:, 0] - y[:, 1:]).abs().max() < 1e-2
    else:
        assert torch.equal(logits[:, 1:].argmax(-1), y[:, 1:].long())


@pytest.mark.parametrize("name", TRACR_PROGRAMS)
def test_the_compiler_circuit_is_a_valid_edge_set(name):
    g = TRACR_SUITE[name]
    c = g.circuit()
    assert set(g.nodes) | g.fixed_nodes == c.components
    assert g.token_edges and all(r == "logits" or r.rsplit(".", 1)[0] in c.components or r in c.components for _, r in g.token_edges)
    assert (g.token_edges | g.fixed_edges) == set(c.edges)


def test_exact_patching_finds_every_tracr_circuit_node():
    df = run_benchmark([f"tracr:{n}" for n in TRACR_PROGRAMS], methods=("exact",), n_pairs=16)
    nodes = df[df.level == "node"]
    assert len(nodes) == len(TRACR_PROGRAMS) and (nodes.recall == 1.0).all()
    for _, r in nodes.iterrows():  # AUROC is undefined when every component is in the circuit
        assert r.auroc == 1.0 or (math.isnan(r.auroc) and r.n_candidates == r.n_true), r


def test_tracr_metric_on_stacked_copies_equals_each_copy():
    g = TRACR_SUITE["sort"]
    pairs = g.make_pairs(6, seed=1)
    met = g.metric(pairs)
    with torch.no_grad():
        lc, lx = load_tracr("sort")(pairs.clean_tokens), load_tracr("sort")(pairs.corrupted_tokens)
    both = met(torch.cat([lc, lx]))
    assert torch.allclose(both, torch.cat([met(lc), met(lx)]))
    assert torch.allclose(met(lc), torch.ones(6, dtype=both.dtype), atol=1e-5)  # one-hot outputs: gap 2
    assert isinstance(met.select([0, 2]), TracrMetric) and met.select([0, 2])(lc[[0, 2]]).shape == (2,)


def test_unknown_program():
    with pytest.raises(PatchingError, match="unknown tracr program"):
        load_tracr("nope")
