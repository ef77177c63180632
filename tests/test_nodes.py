"""The circuit node vocabulary (interp_norm.core.nodes): names built and parsed in one place.

Expected names are written out by hand here (EAP-IG/MIB's spelling), never produced by the module.
"""

from __future__ import annotations

import pytest

from interp_norm.core import nodes
from interp_norm.circuits.edges import EdgeGraph


def test_names_are_mibs():
    assert nodes.head(2, 3) == "a2.h3" and nodes.mlp(1) == "m1" and nodes.head_input(0, 1, "k") == "a0.h1.k"
    assert nodes.senders(2, 2) == ["embed", "a0.h0", "a0.h1", "m0", "a1.h0", "a1.h1", "m1"]
    assert nodes.receivers(1, 2) == ["a0.h0.q", "a0.h0.k", "a0.h0.v", "a0.h1.q", "a0.h1.k", "a0.h1.v", "m0", "logits"]
    assert nodes.components(2, 1) == ["a0.h0", "a1.h0", "m0", "m1"]
    assert EdgeGraph(2, 2).senders == nodes.senders(2, 2) and EdgeGraph(1, 2).receivers == nodes.receivers(1, 2)


@pytest.mark.parametrize("name, kind, layer, head, inp, node, reads", [
    ("embed", "embed", None, None, None, "embed", None),
    ("logits", "logits", None, None, None, "logits", "logits"),
    ("a12.h3", "head", 12, 3, None, "a12.h3", None),
    ("a1.h10.v", "head", 1, 10, "v", "a1.h10", "v"),
    ("m7", "mlp", 7, None, None, "m7", "mlp"),
])
def test_parse_reads_back_every_form(name, kind, layer, head, inp, node, reads):
    n = nodes.parse(name)
    assert (n.kind, n.layer, n.head, n.input) == (kind, layer, head, inp)
    if reads is not None:  # receivers
        assert nodes.receiver_node(name) == node and nodes.receiver_input(name) == reads


@pytest.mark.parametrize("bad", ["a1", "a1.h", "h1.a2", "m", "a1.h2.x", "L1H2", "mlp3", " embed", "a-1.h0"])
def test_anything_else_is_refused(bad):
    with pytest.raises(ValueError, match="not a circuit node name"):
        nodes.parse(bad)
    with pytest.raises(ValueError):
        nodes.head_input(0, 0, "o")
