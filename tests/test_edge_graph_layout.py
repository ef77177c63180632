"""The edge graph's per-layer receiver layout (Gemma 4: k/v head counts per layer, ``k = v`` layers with
no v receiver, KV-sharing layers with q receivers only), against names written out by hand and a
brute-force rule for which pairs are edges: a sender is before a receiver in the order of the pass."""

from __future__ import annotations

import math

import pytest
import torch

from interp_norm.circuits.edge_graph import EdgeGraph
from interp_norm.circuits.edge_layer_input import scalar_paths
from interp_norm.core import nodes
from interp_norm.errors import PatchingError

LAYOUT = ((2, "qkv"), (1, "qk"), (2, "q"), (1, "q"))  # tiny_bridge("gemma4-shared")'s
G = EdgeGraph.of_layers(4, 4, LAYOUT)


def test_receivers_are_each_layers_own():
    q = lambda l: [f"a{l}.h{h}.q" for h in range(4)]  # noqa: E731
    want = (q(0) + ["a0.kv0.k", "a0.kv0.v", "a0.kv1.k", "a0.kv1.v", "m0"] + q(1) + ["a1.kv0.k", "m1"]
            + q(2) + ["m2"] + q(3) + ["m3", "logits"])
    assert G.receivers == want
    assert [G.attn_count(l) for l in range(4)] == [8, 5, 4, 4] and G.max_attn_receivers == 8
    ungrouped = EdgeGraph.of_layers(2, 2, ((2, "qk"), (2, "qkv")))  # k = v without grouping: per head q, k
    assert ungrouped.receivers == ["a0.h0.q", "a0.h0.k", "a0.h1.q", "a0.h1.k", "m0",
                                   "a1.h0.q", "a1.h0.k", "a1.h0.v", "a1.h1.q", "a1.h1.k", "a1.h1.v", "m1", "logits"]


def test_a_uniform_layout_is_the_graph_it_always_was():
    assert EdgeGraph.of_layers(2, 4, [(2, "qkv")] * 2) == EdgeGraph(2, 4, 2)
    assert EdgeGraph.of_layers(2, 4, [(4, "qkv")] * 2) == EdgeGraph(2, 4)
    assert EdgeGraph(2, 4, 2).receivers == nodes.receivers(2, 4, 2) and not EdgeGraph(2, 4).grouped
    assert G.grouped and EdgeGraph(2, 4, 2).n_attn_receivers == 8
    with pytest.raises(PatchingError, match="attn_count"):
        _ = G.n_attn_receivers
    with pytest.raises(PatchingError, match="layout"):
        EdgeGraph.of_layers(2, 4, [(2, "kv")] * 2)


def _when(name: str, reads: bool) -> float:
    """Where in the pass a node writes (sender) or reads (receiver): embed 0; layer l's attention reads
    at 2l + 0.5, its heads write at 2l + 1, its MLP reads at 2l + 1.5 and writes at 2l + 2; logits last."""
    p = nodes.parse(name)
    if p.kind in ("embed", "logits"):
        return 0.0 if p.kind == "embed" else math.inf
    assert p.layer is not None
    if p.kind == "mlp":
        return 2 * p.layer + (1.5 if reads else 2)
    return 2 * p.layer + (0.5 if reads else 1)


def test_edges_are_the_pairs_whose_sender_writes_before_the_receiver_reads():
    v = G.valid()
    for i, u in enumerate(G.senders):
        for j, r in enumerate(G.receivers):
            assert bool(v[i, j]) == (_when(u, False) < _when(r, True)), (u, r)
    assert not any(r.startswith(("a2.kv", "a3.kv")) for _, r in G.edges())  # no edge reaches a shared layer's k/v


def test_receiver_index_finds_every_receiver_and_refuses_what_a_layer_lacks():
    for k, r in enumerate(G.receivers):
        p = nodes.parse(r)
        if p.kind in ("head", "kv"):
            assert G.receiver_index(p.layer, "head", p.head, "qkv".index(p.input)) == k
        elif p.kind == "mlp":
            assert G.receiver_index(p.layer, "mlp") == k
        else:
            assert G.receiver_index(0, "logits") == k
    with pytest.raises(PatchingError, match="no receiver for input v"):
        G.receiver_index(1, "head", 0, 2)
    with pytest.raises(PatchingError, match="no receiver for input k"):
        G.receiver_index(2, "head", 0, 1)


def test_scalar_paths_multiply_the_scalars_between_write_and_read():
    s = [0.6, 1.7, 0.8, 1.3]
    got = scalar_paths(G, s)
    for i, u in enumerate(G.senders):
        start = 0 if u == "embed" else nodes.parse(u).layer
        for j, r in enumerate(G.receivers):
            end = 4 if r == "logits" else nodes.parse(r).layer
            want = math.prod(s[start:end]) if end > start else 1.0
            assert float(got[i, j]) == pytest.approx(want, rel=1e-15), (u, r)
    assert got.dtype == torch.float64
