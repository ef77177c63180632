"""Is the paper's "circuit collapse" a collapse of the circuit? Sparse rows and collapses per role, and
the accuracy cost of norm noise on the circuit's sparse rows vs on as many sparse rows outside it.

Menary et al. (2024, §3.6) count a collapse on *any* sparse attention row (max attention ≥ 95%). Here
every attention row (layer, head, query) of the data is put in one *group*: a cell of the located
circuit (:mod:`~interp_norm.circuits.cell_circuit`) gives its rows its role family
(:func:`role_family`); answer rows of cells outside the circuit are ``outside the circuit``; rows before
``=`` (and the closing ``]``'s own row) are ``outside the answer``. Query 0 (``[`` attends only to
itself) and padding are in no group.

Choices (parameters): noise is q/k norm noise placed ``after_norm`` by default, so that a QKV-Norm
model's per-head norm does not remove it by construction (on Pre-Norm both placements are the same
hook); the matched control is drawn *per layer* (the same number of sparse rows in each layer as the
circuit has there), from sparse rows of any group but the circuit's, so that a difference is not a
difference between layers.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from interp_norm import theory
from interp_norm.circuits._types import device, require_eval
from interp_norm.circuits.cell_circuit import CircuitData, is_digit_class, score_logits
from interp_norm.core import task as T
from interp_norm.core.defaults import SPARSE_THRESHOLD
from interp_norm.core.hook_names import act_name
from interp_norm.errors import PatchingError, check_positive_int
from interp_norm.noise import NormNoise, collapse_decisions

OUTSIDE_CIRCUIT, OUTSIDE_ANSWER = "outside the circuit", "outside the answer"
CIRCUIT, MATCHED = "circuit", "matched outside"


def role_family(role: str, top_class: str) -> str:
    """A coarse role, comparable across seeds: ``spread`` for spread cells, else the family of the
    cell's largest class (``operand digits`` for any digit class, otherwise the class itself)."""
    if str(role).startswith("spread"):
        return "spread"
    return "operand digits" if is_digit_class(str(top_class)) else str(top_class)


def valid_rows(data: CircuitData, n_heads: int) -> Tensor:
    """[batch, head, query]: rows that count (query ≥ 1, not padding)."""
    q = torch.arange(data.tokens.shape[1])
    ok = (data.tokens != T.PAD_ID) & (q[None, :] >= 1)
    return ok[:, None, :].expand(-1, n_heads, -1)


def row_groups(data: CircuitData, circuit: pd.DataFrame, n_layers: int, n_heads: int) -> tuple[list[Tensor], list[str]]:
    """Per layer a [batch, head, query] index into the returned group names (-1: no group).

    ``circuit`` needs ``layer``, ``head``, ``slot`` and ``family`` columns (one row per cell)."""
    names = [OUTSIDE_ANSWER, OUTSIDE_CIRCUIT] + sorted(set(circuit["family"]))
    S = len(data.slots)
    cell = torch.full((n_layers, n_heads, S), names.index(OUTSIDE_CIRCUIT), dtype=torch.long)
    for r in circuit.itertuples():
        cell[int(r.layer), int(r.head), int(r.slot)] = names.index(r.family)
    valid = valid_rows(data, n_heads)
    slot = data.slot[:, None, :].expand(-1, n_heads, -1)
    heads = torch.arange(n_heads)[None, :, None].expand_as(slot)
    out = []
    for l in range(n_layers):
        g = torch.where(slot >= 0, cell[l][heads, slot.clamp(min=0)], torch.full_like(slot, names.index(OUTSIDE_ANSWER)))
        out.append(torch.where(valid, g, torch.full_like(g, -1)))
    return out, names


def circuit_row_gate(data: CircuitData, circuit: pd.DataFrame, n_layers: int, n_heads: int) -> dict[int, Tensor]:
    """Per layer the [batch, head, query] rows of the circuit's cells (a ``NormNoise`` ``row_gate``)."""
    groups, names = row_groups(data, circuit, n_layers, n_heads)
    inside = [i for i, n in enumerate(names) if n not in (OUTSIDE_ANSWER, OUTSIDE_CIRCUIT)]
    return {l: torch.isin(g, torch.tensor(inside, dtype=torch.long)) for l, g in enumerate(groups)}


@torch.no_grad()
def clean_patterns(model, data: CircuitData) -> list[Tensor]:
    """Per layer the clean attention pattern [batch, head, query, key] (on CPU)."""
    names = [act_name("pattern", l) for l in range(model.cfg.n_layers)]
    _, cache = model.run_with_cache(data.tokens.to(device(model)), names_filter=lambda n: n in names)
    return [cache[n].detach().float().cpu() for n in names]


def sparse_gates(patterns: Sequence[Tensor], data: CircuitData, threshold: float = SPARSE_THRESHOLD) -> list[Tensor]:
    """Per layer the sparse rows (max attention ≥ ``threshold``) among the rows that count."""
    return [theory.sparse_mask(p, threshold) & valid_rows(data, p.shape[1]) for p in patterns]


def cell_sparsity(patterns: Sequence[Tensor], data: CircuitData, threshold: float = SPARSE_THRESHOLD) -> pd.DataFrame:
    """Per (layer, head, answer position): rows, mean max attention and share of sparse rows."""
    rows = []
    for l, p in enumerate(patterns):
        top = p.amax(-1)  # [b, h, q]
        for s, pos in enumerate(data.slots):
            at = data.slot == s  # [b, q]
            n = int(at.sum())
            for h in range(p.shape[1]):
                m = top[:, h][at]
                rows.append(dict(layer=l, head=h, position=pos, slot=s, n_rows=n,
                                 max_attention=float(m.mean()) if n else np.nan,
                                 sparse_share=float((m >= threshold).float().mean()) if n else np.nan))
    return pd.DataFrame(rows)


def collapse_by_role(model, data: CircuitData, circuit: pd.DataFrame, *, levels: Sequence[float] = (0.11, 0.2),
                     n_draws: int = 16, placement: str = "after_norm", seed: int = 0) -> pd.DataFrame:
    """Per group (role family, outside the circuit, outside the answer) and noise level: its rows,
    sparse rows, the share of its rows that are sparse, its share of all sparse rows, its loose collapse
    rate (over sparse rows and draws) and its share of all collapses (the paper's per-layer protocol,
    :func:`~interp_norm.noise.collapse_decisions`)."""
    require_eval(model)
    check_positive_int(n_draws, "n_draws", PatchingError)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    groups, names = row_groups(data, circuit, L, H)
    decisions = collapse_decisions(model, data.tokens, tuple(levels), n_draws=n_draws, placement=placement, seed=seed)
    G = len(names)
    n_rows = torch.stack([torch.bincount(g[g >= 0], minlength=G) for g in groups]).sum(0)
    n_sparse = torch.zeros(G)
    collapses = torch.zeros(len(levels), G, dtype=torch.float64)
    for lc in decisions:
        b, h, q = lc.rows.unbind(-1)
        gid = groups[lc.layer][b, h, q]
        n_sparse += torch.bincount(gid, minlength=G).float()
        per_row = lc.loose.double().mean(1)  # [level, R]: collapse probability of each row
        for i in range(len(levels)):
            collapses[i] += torch.bincount(gid, weights=per_row[i], minlength=G)
    out = []
    for i, level in enumerate(levels):
        total_c, total_s = float(collapses[i].sum()), float(n_sparse.sum())
        for g, name in enumerate(names):
            ns = float(n_sparse[g])
            out.append(dict(group=name, in_circuit=g >= 2, level=float(level), n_rows=int(n_rows[g]), n_sparse=int(ns),
                            sparse_share_of_rows=ns / int(n_rows[g]) if n_rows[g] else np.nan,
                            share_of_sparse=ns / total_s if total_s else np.nan,
                            collapse_rate=float(collapses[i, g]) / ns if ns else np.nan,
                            collapses=float(collapses[i, g]),
                            share_of_collapses=float(collapses[i, g]) / total_c if total_c else np.nan))
    return pd.DataFrame(out)


def matched_gate(inside: dict[int, Tensor], pool: dict[int, Tensor], generator: torch.Generator) -> dict[int, Tensor]:
    """Per layer as many rows drawn at random from ``pool`` as ``inside`` has there (all of the pool if it
    has fewer)."""
    out = {}
    for l, g in inside.items():
        idx = pool[l].flatten().nonzero().squeeze(-1)
        take = idx[torch.randperm(len(idx), generator=generator)[: int(g.sum())]]
        m = torch.zeros(pool[l].numel(), dtype=torch.bool)
        m[take] = True
        out[l] = m.view_as(pool[l])
    return out


@torch.no_grad()
def _accuracy(model, data: CircuitData, noise) -> float:
    tokens = data.tokens.to(device(model))
    logits = model(tokens) if noise is None else model.run_with_hooks(tokens, fwd_hooks=noise.hooks())
    return float(score_logits(data, logits[None])[0][0])


def circuit_noise_cost(model, data: CircuitData, circuit: pd.DataFrame, *, levels: Sequence[float] = (0.11, 0.2),
                       n_draws: int = 4, placement: str = "after_norm", seed: int = 0) -> pd.DataFrame:
    """Accuracy lost (points, per-token on answer rows) to q/k norm noise on the circuit's sparse rows
    only, vs on a matched count of sparse rows outside the circuit (:func:`matched_gate`; a fresh subset
    per draw). One row per (level, rows, draw), with the number of rows noised per run."""
    require_eval(model)
    check_positive_int(n_draws, "n_draws", PatchingError)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    sparse = sparse_gates(clean_patterns(model, data), data)
    gate = circuit_row_gate(data, circuit, L, H)
    inside = {l: gate[l] & sparse[l] for l in range(L)}
    pool = {l: sparse[l] & ~gate[l] for l in range(L)}
    clean = _accuracy(model, data, None)
    rows = []
    for d in range(n_draws):
        control = matched_gate(inside, pool, torch.Generator().manual_seed(seed * 1000 + d))
        for level in levels:
            for name, g in ((CIRCUIT, inside), (MATCHED, control)):
                dev = {l: m.to(device(model)) for l, m in g.items()}
                noise = NormNoise(model, float(level), ("q", "k"), placement=placement, seed=seed * 1000 + d, row_gate=dev)
                acc = _accuracy(model, data, noise)
                rows.append(dict(level=float(level), rows=name, draw=d, n_noised=int(sum(int(m.sum()) for m in g.values())),
                                 accuracy_clean=clean, accuracy=acc, drop=100 * (clean - acc)))
    return pd.DataFrame(rows)


__all__ = ["CIRCUIT", "MATCHED", "OUTSIDE_ANSWER", "OUTSIDE_CIRCUIT", "cell_sparsity", "circuit_noise_cost",
           "circuit_row_gate", "clean_patterns", "collapse_by_role", "matched_gate", "role_family", "row_groups",
           "sparse_gates", "valid_rows"]
