"""Collapse and noise tied to the addition circuit: the row gates against an explicit walk over each
problem's text, the per-group counts against sparse rows counted from the pattern row by row."""

from __future__ import annotations

import itertools

import pandas as pd
import pytest
import torch

from interp_norm.circuits.cell_circuit import circuit_data
from interp_norm.circuits.circuit_collapse import (
    CIRCUIT,
    CIRCUIT_ALL,
    MATCHED,
    MATCHED_LAYER,
    circuit_noise_cost,
    circuit_row_gate,
    clean_patterns,
    collapse_by_role,
    matched_gate,
    role_family,
    row_kinds,
    sparse_gates,
)
from interp_norm.core.defaults import SPARSE_THRESHOLD
from interp_norm.core.task import AdditionTask
from interp_norm.errors import PatchingError
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


def brute_counts(inside, pool, strata):
    """{(layer, stratum): (rows inside, rows in the pool)} by a walk over every row."""
    out: dict = {}
    for l, g in inside.items():
        for idx in itertools.product(*map(range, g.shape)):
            k = int(strata[l][idx])
            if k < 0:
                continue
            a, b = out.get((l, k), (0, 0))
            out[(l, k)] = (a + bool(g[idx]), b + bool(pool[l][idx]))
    return out


def count_in(mask, strata, l, k):
    return sum(bool(mask[i]) and int(strata[l][i]) == k for i in itertools.product(*map(range, mask.shape)))


@pytest.fixture
def constructed():
    """Two layers of [batch 4, head 3, query 7] rows; stratum 0 rows are few outside the circuit."""
    g = torch.Generator().manual_seed(0)
    strata = {l: torch.randint(-1, 3, (4, 3, 7), generator=g) for l in (0, 1)}
    inside = {l: torch.rand(4, 3, 7, generator=g) < 0.3 for l in (0, 1)}
    pool = {l: (torch.rand(4, 3, 7, generator=g) < torch.where(strata[l] == 0, 0.05, 0.8)) & ~inside[l] for l in (0, 1)}
    return inside, pool, strata


def test_matched_gate_equal_counts_per_layer_and_stratum(constructed):
    inside, pool, strata = constructed
    want = brute_counts(inside, pool, strata)
    assert any(n_in > n_pool for n_in, n_pool in want.values())  # a short pool is exercised
    assert any(n_pool > n_in > 0 for n_in, n_pool in want.values())
    got = matched_gate(inside, pool, torch.Generator().manual_seed(1), strata=strata, shortfall="shrink")
    for (l, k), (n_in, n_pool) in want.items():
        n = min(n_in, n_pool)
        assert count_in(got.circuit[l], strata, l, k) == count_in(got.control[l], strata, l, k) == n
        row = got.counts[(got.counts["layer"] == l) & (got.counts["stratum"] == k)].iloc[0]
        assert (row["n_inside"], row["n_pool"], row["shortfall"]) == (n_in, n_pool, max(0, n_in - n_pool))
    for l in (0, 1):
        assert not (got.control[l] & ~pool[l]).any() and not (got.circuit[l] & ~inside[l]).any()
        assert not ((got.control[l] | got.circuit[l]) & (strata[l] < 0)).any()


def test_matched_gate_report_keeps_every_circuit_row(constructed):
    inside, pool, strata = constructed
    want = brute_counts(inside, pool, strata)
    got = matched_gate(inside, pool, torch.Generator().manual_seed(2), strata=strata, shortfall="report")
    for (l, k), (n_in, n_pool) in want.items():
        assert count_in(got.control[l], strata, l, k) == min(n_in, n_pool)
        assert count_in(got.circuit[l], strata, l, k) == n_in
    assert int(got.counts["shortfall"].sum()) == sum(max(0, a - b) for a, b in want.values()) > 0
    # without strata: one stratum per layer, the whole layer's counts
    flat = matched_gate(inside, pool, torch.Generator().manual_seed(3), shortfall="report")
    for l in (0, 1):
        assert int(flat.control[l].sum()) == min(int(inside[l].sum()), int(pool[l].sum()))
    with pytest.raises(PatchingError, match="shortfall must be one of"):
        matched_gate(inside, pool, torch.Generator(), shortfall="pad")


def test_matched_gate_draws_uniformly_within_a_stratum():
    """Two of five pool rows per draw: each is taken with probability 2/5 (binomial, 2 000 draws, 5 sigma)."""
    inside = {0: torch.tensor([True, True, False, False, False, False, False])}
    pool = {0: ~inside[0]}
    gen, n = torch.Generator().manual_seed(4), 2000
    freq = sum(matched_gate(inside, pool, gen).control[0].double() for _ in range(n)) / n
    sigma = (0.4 * 0.6 / n) ** 0.5
    assert (freq[2:] - 0.4).abs().max() < 5 * sigma and freq[:2].sum() == 0


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
    """The matched pair noises, per layer, min(circuit sparse rows, sparse answer rows outside the circuit)
    answer rows each, counted row by row from each problem's text; layer 1's pool is short by 2 rows."""
    model, data, _ = setup
    L, H = model.cfg.n_layers, model.cfg.n_heads
    kept = {(0, 2, "tens"), (0, 0, "sign"), (1, 3, "end"), (1, 0, "hundreds"), (1, 2, "end")}
    circuit = pd.DataFrame([dict(layer=l, head=h, position=p, slot=list(data.slots).index(p), family="=")
                            for l, h, p in sorted(kept)])
    sparse = sparse_gates(clean_patterns(model, data), data)
    got = circuit_noise_cost(model, data, circuit, levels=(0.2,), n_draws=2)
    assert set(got["rows"]) == {CIRCUIT, MATCHED, CIRCUIT_ALL, MATCHED_LAYER} and len(got) == 8
    want, short, n_in = 0, 0, 0
    for l in range(L):
        n_c = n_p = 0
        for b, p in enumerate(data.problems):
            for q, pos in answer_rows(p.text).items():
                for h in range(H):
                    n_c += bool(sparse[l][b, h, q]) and (l, h, pos) in kept
                    n_p += bool(sparse[l][b, h, q]) and (l, h, pos) not in kept
        want, short, n_in = want + min(n_c, n_p), short + max(0, n_c - n_p), n_in + n_c
    pair = got[got["rows"].isin([CIRCUIT, MATCHED])]
    assert (pair["n_noised"] == want).all() and (pair["n_answer_rows"] == want).all() and want > 0
    assert (pair["shortfall"] == short).all() and short > 0
    assert (got.loc[got["rows"] == CIRCUIT_ALL, "n_noised"] == n_in).all()
    assert (got.loc[got["rows"] == MATCHED_LAYER, "n_noised"] <= n_in).all()
    assert got["accuracy_clean"].nunique() == 1
    with pytest.raises(PatchingError, match="match_on must be one of"):
        circuit_noise_cost(model, data, circuit, levels=(0.2,), n_draws=1, match_on="head")


def test_role_family():
    assert role_family("reads units digits", "units digits") == "operand digits"
    assert role_family("reads = and earlier answer", "=") == "="
    assert role_family("spread (most on [)", "[") == "spread"


def test_row_kinds_follow_the_text(setup):
    """Strata by row kind and by answer position, against a walk over each problem's text."""
    model, data, _ = setup
    H = model.cfg.n_heads
    kind, pos = row_kinds(data, H), row_kinds(data, H, "answer position")
    slots = list(data.slots)
    for b, p in enumerate(data.problems):
        rows = answer_rows(p.text)
        for q in range(data.tokens.shape[1]):
            want_kind = -1 if q == 0 or q >= len(p.text) else 0 if q in rows else 1
            want_pos = -1 if want_kind < 0 else slots.index(rows[q]) if q in rows else len(slots)
            assert (kind[b, :, q] == want_kind).all() and (pos[b, :, q] == want_pos).all(), (p.text, q)
    assert (row_kinds(data, H, "layer")[kind >= 0] == 0).all()
    with pytest.raises(PatchingError, match="match_on must be one of"):
        row_kinds(data, H, "head")
