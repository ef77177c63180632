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
hook). The matched control is drawn per *stratum*: the same layer and, by default, the same row kind
(answer rows, or rows outside the answer), from sparse rows outside the circuit. Circuit rows are
answer rows, while most sparse rows outside the circuit are question rows; matching only the layer
would compare answer rows with question rows. Where a stratum's pool is shorter than the circuit's
rows there (``shortfall``), ``"shrink"`` (the default) noises as many circuit rows as the pool has,
drawn at random, so both arms noise equal counts in every stratum; ``"report"`` noises every circuit
row and all of the pool, and the shortfall is reported. Equal counts are the default because a
smaller control alone makes the circuit look costlier. Every run reports its rows noised per arm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

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
#: Reference arms: every sparse row of the circuit, and the control matched on the layer only.
CIRCUIT_ALL, MATCHED_LAYER = "circuit (every sparse row)", "matched outside (layer only)"
#: What the control is matched on besides the layer; how a short pool is handled.
MATCH_ON, SHORTFALL = ("row kind", "answer position", "layer"), ("shrink", "report")
ANSWER, OUTSIDE = 0, 1  # row kinds (:func:`row_kinds`)


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


def row_kinds(data: CircuitData, n_heads: int, match_on: str = "row kind") -> Tensor:
    """[batch, head, query] stratum of each row besides its layer (-1: a row that does not count).

    ``row kind``: :data:`ANSWER` for answer rows, :data:`OUTSIDE` for rows before ``=`` and the closing
    ``]``'s own row; ``answer position``: the answer position's index, and ``len(data.slots)`` outside
    the answer; ``layer``: 0 for every row."""
    if match_on not in MATCH_ON:
        raise PatchingError(f"match_on must be one of {MATCH_ON}, got {match_on!r}")
    slot = data.slot[:, None, :].expand(-1, n_heads, -1)
    if match_on == "row kind":
        kind = torch.where(slot >= 0, ANSWER, OUTSIDE)
    elif match_on == "answer position":
        kind = torch.where(slot >= 0, slot, len(data.slots))
    else:
        kind = torch.zeros_like(slot)
    return torch.where(valid_rows(data, n_heads), kind, torch.full_like(kind, -1))


@dataclass
class MatchedRows:
    """One draw of the matched control: the circuit rows noised, the control rows noised (per layer, as
    ``NormNoise`` ``row_gate`` masks) and per (layer, stratum) the counts behind them."""

    circuit: dict[int, Tensor]
    control: dict[int, Tensor]
    counts: pd.DataFrame


def _take(mask: Tensor, k: int, generator: torch.Generator) -> Tensor:
    """``k`` of the rows of ``mask`` drawn uniformly without replacement (a flat bool mask)."""
    idx = mask.flatten().nonzero().squeeze(-1)
    out = torch.zeros(mask.numel(), dtype=torch.bool)
    out[idx[torch.randperm(len(idx), generator=generator)[:k]]] = True
    return out


def matched_gate(inside: dict[int, Tensor], pool: dict[int, Tensor], generator: torch.Generator, *,
                 strata: Optional[dict[int, Tensor]] = None, shortfall: str = "shrink") -> MatchedRows:
    """Per layer and stratum (``strata[l]``: a label per row, -1 outside every stratum; ``None``: one per
    layer) as many rows of ``pool`` as ``inside`` has there, drawn at random. Where the pool is short,
    ``shrink`` draws as many of ``inside``'s rows as the pool has (equal counts), ``report`` keeps every
    row of ``inside`` and takes all of the pool (``counts["shortfall"]`` says by how much it is short)."""
    if shortfall not in SHORTFALL:
        raise PatchingError(f"shortfall must be one of {SHORTFALL}, got {shortfall!r}")
    circ, ctrl, rows = {}, {}, []
    for l, g in inside.items():
        lab = strata[l] if strata is not None else torch.zeros(g.shape, dtype=torch.long)
        c, m = torch.zeros(g.numel(), dtype=torch.bool), torch.zeros(g.numel(), dtype=torch.bool)
        for k in sorted(set(lab[g | pool[l]].tolist()) - {-1}):
            n_in, n_pool = int((g & (lab == k)).sum()), int((pool[l] & (lab == k)).sum())
            n = min(n_in, n_pool)
            m |= _take(pool[l] & (lab == k), n, generator)
            c |= _take(g & (lab == k), n if shortfall == "shrink" else n_in, generator)
            rows.append(dict(layer=l, stratum=k, n_inside=n_in, n_pool=n_pool, n_circuit=int(n if shortfall == "shrink"
                             else n_in), n_control=n, shortfall=max(0, n_in - n_pool)))
        circ[l], ctrl[l] = c.view_as(g), m.view_as(g)
    cols = ["layer", "stratum", "n_inside", "n_pool", "n_circuit", "n_control", "shortfall"]
    return MatchedRows(circ, ctrl, pd.DataFrame(rows, columns=cols))


@torch.no_grad()
def _accuracy(model, data: CircuitData, noise) -> float:
    tokens = data.tokens.to(device(model))
    logits = model(tokens) if noise is None else model.run_with_hooks(tokens, fwd_hooks=noise.hooks())
    return float(score_logits(data, logits[None])[0][0])


def _noised(gate: dict[int, Tensor], kinds: Tensor) -> dict:
    """Rows a gate noises: all, answer rows, rows outside the answer."""
    n = sum(int(m.sum()) for m in gate.values())
    n_answer = sum(int((m & (kinds == ANSWER)).sum()) for m in gate.values())
    return dict(n_noised=n, n_answer_rows=n_answer, n_outside_answer=n - n_answer)


def circuit_noise_cost(model, data: CircuitData, circuit: pd.DataFrame, *, levels: Sequence[float] = (0.11, 0.2),
                       n_draws: int = 4, placement: str = "after_norm", seed: int = 0, match_on: str = "row kind",
                       shortfall: str = "shrink") -> pd.DataFrame:
    """Accuracy lost (points, per-token on answer rows) to q/k norm noise on the circuit's sparse rows
    only, vs on as many sparse rows outside it in the same layer and ``match_on`` stratum
    (:func:`matched_gate`, ``shortfall`` for short pools; a fresh draw each time); beside them, for
    reference, :data:`CIRCUIT_ALL` (every sparse circuit row) and :data:`MATCHED_LAYER` (a control
    matched on the layer only, as large as the pool allows). One row per (level, arm, draw): rows noised
    (answer rows and others), the circuit rows its control could not match (``shortfall``) and the
    accuracy."""
    require_eval(model)
    check_positive_int(n_draws, "n_draws", PatchingError)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    sparse = sparse_gates(clean_patterns(model, data), data)
    gate = circuit_row_gate(data, circuit, L, H)
    inside = {l: gate[l] & sparse[l] for l in range(L)}
    pool = {l: sparse[l] & ~gate[l] for l in range(L)}
    strata, kinds = row_kinds(data, H, match_on), row_kinds(data, H)
    clean = _accuracy(model, data, None)
    rows = []
    for d in tqdm(range(n_draws), desc="circuit noise cost", leave=False):
        gen = torch.Generator().manual_seed(seed * 1000 + d)
        m = matched_gate(inside, pool, gen, strata={l: strata for l in range(L)}, shortfall=shortfall)
        ref = matched_gate(inside, pool, gen, shortfall="report")
        short, ref_short = int(m.counts["shortfall"].sum()), int(ref.counts["shortfall"].sum())
        arms = [(CIRCUIT, m.circuit, short), (MATCHED, m.control, short), (CIRCUIT_ALL, inside, ref_short),
                (MATCHED_LAYER, ref.control, ref_short)]
        for level in levels:
            for name, g, short in arms:
                dev = {l: x.to(device(model)) for l, x in g.items()}
                noise = NormNoise(model, float(level), ("q", "k"), placement=placement, seed=seed * 1000 + d, row_gate=dev)
                acc = _accuracy(model, data, noise)
                rows.append(dict(level=float(level), rows=name, draw=d, **_noised(g, kinds), shortfall=short,
                                 accuracy_clean=clean, accuracy=acc, drop=100 * (clean - acc)))
    return pd.DataFrame(rows).assign(match_on=match_on, shortfall_rule=shortfall)


__all__ = ["CIRCUIT", "CIRCUIT_ALL", "MATCHED", "MATCHED_LAYER", "MATCH_ON", "SHORTFALL", "MatchedRows",
           "OUTSIDE_ANSWER", "OUTSIDE_CIRCUIT", "cell_sparsity", "circuit_noise_cost", "circuit_row_gate",
           "clean_patterns", "collapse_by_role", "matched_gate", "role_family", "row_groups", "row_kinds",
           "sparse_gates", "valid_rows"]
