"""Collapse and noise tied to the addition circuit: the row gates against an explicit walk over each
problem's text, the per-group counts against sparse rows counted from the pattern row by row."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from interp_norm.circuits.cell_circuit import circuit_data
from interp_norm.circuits.circuit_collapse import (
    CIRCUIT,
    MATCHED,
    circuit_noise_cost,
    circuit_row_gate,
    clean_patterns,
    collapse_by_role,
    matched_gate,
    role_family,
    sparse_gates,
)
from interp_norm.core.defaults import SPARSE_THRESHOLD
from interp_norm.core.task import AdditionTask
from tests._models import sharpened_model

TASK = AdditionTask.preset("cpu")
PLACES = ("units", "tens", "hundreds", "thousands")


def answer_rows(text: str) -> dict[int, str]:
    """{position: answer position name} of each row that predicts an answer character, from the text."""
    eq, last = text.index("="), len(text) - 1
    return {p: "sign" if text[p + 1] == "N" else "end" if text[p + 1] == "]" else PLACES[(last - 1) - (p + 1)]
            for p in range(eq, last)}


@pytest.fixture(scope="module")
def setup():
    model = sharpened_model("pre")
    data = circuit_data(TASK.sample_problems(12, "id", seed=5), seed=1)
    names = list(data.slots)
    cells = [(0, 1, names[0], "operand digits"), (1, 0, names[-1], "="), (1, 2, names[len(names) // 2], "spread")]
    circuit = pd.DataFrame([dict(layer=l, head=h, position=p, slot=names.index(p), family=f) for l, h, p, f in cells])
    return model, data, circuit


def test_the_gate_selects_exactly_the_circuit_rows(setup):
    model, data, circuit = setup
    L, H = model.cfg.n_layers, model.cfg.n_heads
    gate = circuit_row_gate(data, circuit, L, H)
    kept = {(r.layer, r.head, r.position) for r in circuit.itertuples()}
    for b, p in enumerate(data.problems):
        rows = answer_rows(p.text)
        for l in range(L):
            for h in range(H):
                for q in range(data.tokens.shape[1]):
                    want = q in rows and (l, h, rows[q]) in kept
                    assert bool(gate[l][b, h, q]) == want, (p.text, l, h, q)
    assert sum(int(g.sum()) for g in gate.values()) > 0


def test_matched_gate_draws_the_same_count_per_layer_from_the_pool():
    g = torch.Generator().manual_seed(0)
    inside = {0: torch.rand(4, 3, 7, generator=g) < 0.2, 1: torch.zeros(4, 3, 7, dtype=torch.bool)}
    pool = {l: (torch.rand(4, 3, 7, generator=g) < 0.6) & ~inside[l] for l in (0, 1)}
    got = matched_gate(inside, pool, torch.Generator().manual_seed(1))
    for l in (0, 1):
        assert int(got[l].sum()) == min(int(inside[l].sum()), int(pool[l].sum()))
        assert not (got[l] & ~pool[l]).any()
    small = {0: torch.zeros(2, 1, 3, dtype=torch.bool)}
    small[0][0, 0, 0] = True
    none = matched_gate({0: torch.ones(2, 1, 3, dtype=torch.bool)}, small, torch.Generator())
    assert int(none[0].sum()) == 1  # a pool smaller than the circuit gives all it has


@torch.no_grad()
def test_collapse_groups_partition_the_sparse_rows(setup):
    model, data, circuit = setup
    got = collapse_by_role(model, data, circuit, levels=(0.2,), n_draws=4)
    # sparse rows counted row by row from each problem's own run (query >= 1, no padding)
    want = 0
    for p in data.problems:
        _, cache = model.run_with_cache(torch.tensor([[*map(int, data.tokens[data.problems.index(p)])]])[:, :len(p.text)])
        for l in range(model.cfg.n_layers):
            pat = cache[f"blocks.{l}.attn.hook_pattern"][0]
            want += int((pat[:, 1:].amax(-1) >= SPARSE_THRESHOLD).sum())
    assert int(got["n_sparse"].sum()) == want > 0
    assert got["share_of_sparse"].sum() == pytest.approx(1.0)
    assert set(got["group"]) >= {"operand digits", "=", "spread", "outside the circuit", "outside the answer"}
    total_rows = sum(model.cfg.n_heads * (len(p.text) - 1) for p in data.problems) * model.cfg.n_layers
    assert int(got["n_rows"].sum()) == total_rows
    assert (got["collapse_rate"].dropna().between(0, 1)).all()


def test_noise_cost_noises_matched_counts(setup):
    model, data, circuit = setup
    L, H = model.cfg.n_layers, model.cfg.n_heads
    gate = circuit_row_gate(data, circuit, L, H)
    sparse = sparse_gates(clean_patterns(model, data), data)
    n_in = sum(int((gate[l] & sparse[l]).sum()) for l in range(L))
    got = circuit_noise_cost(model, data, circuit, levels=(0.2,), n_draws=2)
    assert set(got["rows"]) == {CIRCUIT, MATCHED} and len(got) == 4
    assert (got.loc[got["rows"] == CIRCUIT, "n_noised"] == n_in).all()
    assert (got.loc[got["rows"] == MATCHED, "n_noised"] <= n_in).all()
    assert got["accuracy_clean"].nunique() == 1


def test_role_family():
    assert role_family("reads units digits", "units digits") == "operand digits"
    assert role_family("reads = and earlier answer", "=") == "="
    assert role_family("spread (most on [)", "[") == "spread"
