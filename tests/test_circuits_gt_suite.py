"""The ground-truth suite: every hand-weighted model computes its function, its circuit alone
suffices and each circuit node is needed, the shipped JSON equals the construction, and exact
patching ranks every circuit node above every other component (AUROC 1)."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
import torch

from interp_norm.circuits import Circuit
from interp_norm.circuits.benchmark.suite import auroc, run_benchmark, score_model
from interp_norm.circuits.benchmark.ground_truth import SUITE, make_gt_pairs, sample_inputs
from interp_norm.errors import PatchingError

DATA = Path(__file__).resolve().parents[1] / "data" / "ground_truth"
NAMES = list(SUITE)


@torch.no_grad()
def _agreement(model, name: str, n: int = 300) -> tuple[int, int]:
    """(inputs where every defined position is predicted right, inputs with a defined position)."""
    x = sample_inputs(name, n, seed=11)
    pred = model(x).argmax(-1)
    right = defined = 0
    for i in range(n):
        ref = SUITE[name].reference(x[i].tolist())
        cells = [(p, r) for p, r in enumerate(ref) if r is not None]
        if cells:
            defined += 1
            right += all(int(pred[i, p]) == r for p, r in cells)
    return right, defined


@pytest.mark.parametrize("name", NAMES)
def test_each_model_computes_its_function_on_at_least_200_inputs(name):
    right, defined = _agreement(SUITE[name].build(), name)
    assert defined >= 200 and right == defined


@pytest.mark.parametrize("name", NAMES)
def test_the_circuit_alone_suffices_and_each_node_is_needed(name):
    """Silence every distractor's output (W_O / W_out) -> the function survives; silence one
    circuit node -> it breaks. Independent of any discovery method."""
    g = SUITE[name]

    def silenced(nodes):
        model = g.build()
        with torch.no_grad():
            for node in nodes:
                if node.startswith("a"):
                    l, h = map(int, node[1:].split(".h"))
                    model.blocks[l].attn.W_O[h].zero_()
                else:
                    mlp = model.blocks[int(node[1:])].mlp
                    mlp.W_out.zero_()
                    mlp.b_out.zero_()
        return model

    others = [n for n in ("a0.h0", "a0.h1", "a1.h0", "a1.h1", "m0", "m1") if n not in g.nodes]
    right, defined = _agreement(silenced(others), name)
    assert right == defined
    for node in g.nodes:
        right, defined = _agreement(silenced([node]), name)
        assert right < 0.5 * defined, node


@pytest.mark.parametrize("name", NAMES)
def test_pairs_are_answered_as_built(name):
    model, pairs = SUITE[name].build(), make_gt_pairs(name, 32, seed=0)
    with torch.no_grad():
        for toks in (pairs.clean_tokens, pairs.corrupted_tokens):
            assert torch.equal(model(toks).argmax(-1)[:, -2], toks[:, -1])


@pytest.mark.parametrize("name", NAMES)
def test_the_shipped_json_states_the_construction(name):
    g = SUITE[name]
    assert json.loads((DATA / f"{name}.json").read_text()) == json.loads(json.dumps(g.spec()))
    circuit = g.circuit()  # every stated edge exists in the model's edge graph
    assert circuit.components == set(g.nodes)
    assert g.token_edges | g.fixed_edges == set(circuit.edges)
    assert f"| {name} |" in (DATA / "README.md").read_text()


def test_exact_patching_recovers_every_ground_truth_node_with_auroc_1():
    df = run_benchmark(NAMES, methods=("exact",), n_pairs=16)
    nodes = df[df.level == "node"]
    assert len(nodes) == len(SUITE)
    assert (nodes.auroc == 1.0).all() and (nodes.recall == 1.0).all(), nodes


def test_auroc_is_the_probability_a_positive_outranks_a_negative():
    rng = random.Random(0)
    for _ in range(20):
        s = [rng.choice([0.0, 0.5, 1.0, 2.0]) for _ in range(9)]
        y = [rng.random() < 0.4 for _ in range(9)]
        pairs = [(a, b) for (a, ya), (b, yb) in itertools.product(zip(s, y), repeat=2) if ya and not yb]
        want = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in pairs) / len(pairs) if pairs else float("nan")
        got = auroc(s, y)
        assert got == pytest.approx(want, nan_ok=True)


def test_benchmark_input_errors():
    with pytest.raises(PatchingError, match="unknown suite models"):
        run_benchmark(models=["nope"])
    with pytest.raises(PatchingError, match="unknown methods"):
        score_model(SUITE["prev_token"], methods=("acdc",))
    with pytest.raises(PatchingError):
        Circuit(2, 2, frozenset({("a1.h0", "a0.h0.q")}))  # edges must go forward
