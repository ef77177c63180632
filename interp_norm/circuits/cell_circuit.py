"""The addition circuit at the grain of (layer, head, answer position): located by ablation, verified.

A *cell* is one head's output ``z`` at the rows of one answer position (the rows predicting the
answer's sign, one of its digits by place value, or the closing ``]``). Question rows are never
ablated: the cells cover the computation from ``=`` on, where the answer is read out. A cell is
ablated by replacing its ``z`` rows with

* ``resample``: the same rows of a run on another problem of the same token layout (same terms,
  digits per term, operand signs and answer length; operators and digits drawn afresh), so every
  row means the same thing in both runs;
* ``mean``: the mean of that head's ``z`` over every row of that answer position in the data;
* ``zero``: zeros.

The circuit is grown from the ranking of single-cell necessity (the accuracy lost when that cell
alone is ablated; logit difference breaks ties), or greedily (each step adds the cell that raises the
ablated model's accuracy most), until the model with every other cell ablated keeps ``keep`` (90%)
of the full model's per-token accuracy (Menary et al. 2024, §3: the answer digits and the closing ``]``,
teacher-forced). The logit difference is
logit(clean next token) - logit(resample source's next token), at answer rows where they differ;
it is the same rows for every ablation, so faithfulness is comparable across them.
Roles and the plain-words account are in :mod:`~interp_norm.circuits.cell_roles`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from interp_norm.circuits._types import device, require_eval
from interp_norm.circuits.attention_maps import token_roles
from interp_norm.circuits.pairs import _sample_like, corrupt_problem, problem_format
from interp_norm.core import task as T
from interp_norm.core.hook_names import act_name
from interp_norm.errors import PatchingError, check_positive_int

ABLATIONS = ("resample", "mean", "zero")
GROWTH = ("ranked", "greedy")
PLACE_NAMES = ("units", "tens", "hundreds", "thousands")


def place_name(place: int) -> str:
    return PLACE_NAMES[place] if place < len(PLACE_NAMES) else f"10^{place}"


def _slot_of(label: str, index: int, position_key: str) -> str:
    """Name of the answer position predicting the token labelled ``label`` (token_roles's labels)."""
    if position_key == "index":
        return f"a{index}"
    if label == "ans.sign":
        return "sign"
    if label == "eos":
        return "end"
    return place_name(int(label.split(".p")[1]))


def slot_order(names: Sequence[str]) -> list[str]:
    """Reading order: sign, the digits from the highest place to units, end (or a0, a1, ...)."""
    def key(s: str) -> tuple:
        if s.startswith("a") and s[1:].isdigit():
            return (0, int(s[1:]))
        if s == "sign":
            return (0, 0)
        if s == "end":
            return (2, 0)
        p = PLACE_NAMES.index(s) if s in PLACE_NAMES else int(s.split("^")[1])
        return (1, -p)
    return sorted(set(names), key=key)


@dataclass
class CircuitData:
    """Clean problems, their resample sources and the answer position of every row.

    ``slot[b, p]`` indexes ``slots`` at answer rows and is -1 elsewhere; ``key_label[b]`` holds
    :func:`~interp_norm.circuits.attention_maps.token_roles` of problem ``b`` (what each key is).
    """

    tokens: Tensor
    source: Tensor
    slot: Tensor
    slots: tuple
    problems: list
    source_problems: list
    key_roles: list = field(repr=False)

    @property
    def answer_rows(self) -> Tensor:
        return self.slot >= 0


def resample_problems(problems: Sequence[T.Problem], seed: int = 0, max_tries: int = 500) -> list[T.Problem]:
    """For each problem another one of the same token layout (:func:`problem_format`), seeded.

    Operators and digits are drawn afresh; when no such problem turns up in ``max_tries`` draws
    (a layout that fixes the answer's length tightly) a one-digit corruption of the same length is used.
    """
    rng = random.Random(seed)
    out = []
    for p in problems:
        fmt = problem_format(p)
        for _ in range(max_tries):
            q = _sample_like(p, rng)
            if q != p and problem_format(q) == fmt:
                break
        else:
            got = corrupt_problem(p, rng, "any")
            if got is None:
                raise PatchingError(f"no resample source of the same layout for {p.text!r}; use more digits per term")
            q = got[0]
        out.append(q)
    return out


def circuit_data(problems: Sequence[T.Problem], seed: int = 0, position_key: str = "place") -> CircuitData:
    """:class:`CircuitData` for ``problems`` (answer positions by ``place`` value or by ``index`` from ``=``)."""
    if position_key not in ("place", "index"):
        raise PatchingError(f"position_key must be 'place' or 'index', got {position_key!r}")
    problems = list(problems)
    if not problems:
        raise PatchingError("circuit_data needs at least one problem")
    sources = resample_problems(problems, seed)
    n = max(len(p.text) for p in problems)
    tokens = T.pad_batch([T.encode(p.text) for p in problems], n)
    source = T.pad_batch([T.encode(p.text) for p in sources], n)
    roles = [token_roles(p) for p in problems]
    names = []
    for p, r in zip(problems, roles):
        eq = p.text.index(T.EQ)
        names += [_slot_of(r[i + 1]["label"], i - eq, position_key) for i in range(eq, len(p.text) - 1)]
    slots = tuple(slot_order(names))
    slot = torch.full(tokens.shape, -1, dtype=torch.long)
    for b, (p, r) in enumerate(zip(problems, roles)):
        eq = p.text.index(T.EQ)
        for i in range(eq, len(p.text) - 1):
            slot[b, i] = slots.index(_slot_of(r[i + 1]["label"], i - eq, position_key))
    return CircuitData(tokens, source, slot, slots, problems, sources, roles)


# ----------------------------------------------------------------------------- token classes

GRAINS = ("place", "term")
_FIXED = {"bos": "[", "sign": "operand signs", "operator": "operators", "eq": "=",
          "answer": "earlier answer", "answer_sign": "earlier answer", "eos": "]"}


def token_class(role: dict, grain: str = "place") -> str:
    """The class of one key (a :func:`~interp_norm.circuits.attention_maps.token_roles` entry)."""
    if role["role"] != "operand":
        return _FIXED[role["role"]]
    if grain == "term":
        return f"term {role['term']} {place_name(role['place'])}"
    return f"{place_name(role['place'])} digits"


def is_digit_class(name: str) -> bool:
    return name.endswith(" digits") or name.startswith("term ")


def class_ids(data: "CircuitData", grain: str = "place") -> tuple[torch.Tensor, list[str]]:
    """Per key [batch, pos] the index of its token class in the returned names (-1 for padding)."""
    if grain not in GRAINS:
        raise PatchingError(f"grain must be one of {GRAINS}, got {grain!r}")
    names: list[str] = []
    ids = torch.full(data.tokens.shape, -1, dtype=torch.long)
    for b, roles in enumerate(data.key_roles):
        for k, r in enumerate(roles):
            c = token_class(r, grain)
            if c not in names:
                names.append(c)
            ids[b, k] = names.index(c)
    return ids, names



# ----------------------------------------------------------------------------- ablated runs


@torch.no_grad()
def ablation_sources(model, data: CircuitData, ablation: str) -> list[Tensor]:
    """Per layer, the ``z`` [batch, pos, head, d_head] an ablated cell takes at each row."""
    if ablation not in ABLATIONS:
        raise PatchingError(f"ablation must be one of {ABLATIONS}, got {ablation!r}")
    dev, L = device(model), model.cfg.n_layers
    names = [act_name("z", l) for l in range(L)]
    if ablation == "resample":
        _, cache = model.run_with_cache(data.source.to(dev), names_filter=lambda n: n in names)
        return [cache[n] for n in names]
    _, cache = model.run_with_cache(data.tokens.to(dev), names_filter=lambda n: n in names)
    if ablation == "zero":
        return [torch.zeros_like(cache[n]) for n in names]
    slot = data.slot.to(dev)
    onehot = torch.nn.functional.one_hot(slot.clamp(min=0), len(data.slots)).to(cache[names[0]].dtype)
    onehot = onehot * (slot >= 0).unsqueeze(-1)  # [b, p, S]
    out = []
    for n in names:
        z = cache[n]
        mean = torch.einsum("bps,bphd->shd", onehot, z) / onehot.sum((0, 1)).clamp(min=1)[:, None, None]
        out.append(mean[slot.clamp(min=0)])  # rows outside the answer are never used
    return out


@torch.no_grad()
def ablated_logits(model, data: CircuitData, ablate: Tensor, sources: list[Tensor]) -> Tensor:
    """Logits [K, batch, pos, vocab] of K runs; run k ablates cell (l, h, s) where ``ablate[k, l, h, s]``."""
    dev = device(model)
    K, B = ablate.shape[0], data.tokens.shape[0]
    slot = data.slot.to(dev)
    rows = (slot >= 0)[None, :, :, None]
    idx = slot.clamp(min=0)
    ablate = ablate.to(dev)

    def hook_for(l: int):
        def hook(z: Tensor, hook) -> Tensor:
            m = ablate[:, l].transpose(1, 2)[:, idx] & rows  # [K, b, p, H]
            zz = z.view(K, B, *z.shape[1:])
            return torch.where(m.unsqueeze(-1), sources[l].unsqueeze(0), zz).view_as(z)
        return hook

    hooks = [(act_name("z", l), hook_for(l)) for l in range(model.cfg.n_layers)]
    logits = model.run_with_hooks(data.tokens.to(dev).repeat(K, 1), fwd_hooks=hooks)
    return logits.view(K, B, *logits.shape[1:])


def score_logits(data: CircuitData, logits: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per run: per-token accuracy on the answer rows, and the mean logit difference (clean vs source token)."""
    dev = logits.device
    rows = data.answer_rows.to(dev)
    nxt, alt = T.next_tokens(data.tokens).to(dev), T.next_tokens(data.source).to(dev)
    right = (logits.argmax(-1) == nxt) & rows
    acc = right.flatten(1).sum(-1).double() / rows.sum()
    differ = rows & (nxt != alt)
    lg = logits.gather(-1, nxt.expand(logits.shape[0], -1, -1).unsqueeze(-1)).squeeze(-1)
    lw = logits.gather(-1, alt.expand(logits.shape[0], -1, -1).unsqueeze(-1)).squeeze(-1)
    ld = ((lg - lw) * differ).flatten(1).sum(-1).double() / differ.sum().clamp(min=1)
    return acc.detach().cpu().numpy(), ld.detach().cpu().numpy()


def evaluate(model, data: CircuitData, ablate: Tensor, sources: list[Tensor], *, chunk_rows: int = 4096,
             progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Accuracy and logit difference of K ablated runs, stacked ``chunk_rows`` sequences per pass."""
    per = max(1, chunk_rows // data.tokens.shape[0])
    accs, lds = [], []
    for i in tqdm(range(0, ablate.shape[0], per), disable=not progress, desc="ablated runs", leave=False):
        a, d = score_logits(data, ablated_logits(model, data, ablate[i : i + per], sources))
        accs.append(a)
        lds.append(d)
    return np.concatenate(accs), np.concatenate(lds)


# ----------------------------------------------------------------------------- locating


def cell_table(model, data: CircuitData) -> pd.DataFrame:
    """Every cell (layer, head, answer position) with rows in the data, and its row count."""
    counts = torch.bincount(data.slot[data.answer_rows], minlength=len(data.slots))
    return pd.DataFrame([
        dict(cell=f"L{l}H{h}@{s}", layer=l, head=h, position=s, slot=i, n_rows=int(counts[i]))
        for l in range(model.cfg.n_layers) for h in range(model.cfg.n_heads)
        for i, s in enumerate(data.slots) if counts[i] > 0
    ])


def _masks(model, data: CircuitData, cells: pd.DataFrame, keep: Sequence[Sequence[int]]) -> Tensor:
    """[K, L, H, S]: run k ablates every cell of ``cells`` except the rows ``keep[k]``."""
    L, H, S = model.cfg.n_layers, model.cfg.n_heads, len(data.slots)
    m = torch.zeros(len(keep), L, H, S, dtype=torch.bool)
    lay, hd, sl = (torch.tensor(cells[c].to_numpy()) for c in ("layer", "head", "slot"))
    m[:, lay, hd, sl] = True
    for k, kept in enumerate(keep):
        kept = list(kept)
        if kept:
            m[k, lay[kept], hd[kept], sl[kept]] = False
    return m


def cell_effects(model, data: CircuitData, sources: list[Tensor], *, chunk_rows: int = 4096,
                 progress: bool = False) -> pd.DataFrame:
    """Each cell's necessity: accuracy and logit difference lost when it alone is ablated."""
    cells = cell_table(model, data)
    L, H, S = model.cfg.n_layers, model.cfg.n_heads, len(data.slots)
    m = torch.zeros(len(cells) + 1, L, H, S, dtype=torch.bool)
    for k, r in enumerate(cells.itertuples()):
        m[k + 1, r.layer, r.head, r.slot] = True
    acc, ld = evaluate(model, data, m, sources, chunk_rows=chunk_rows, progress=progress)
    out = cells.assign(accuracy_drop=acc[0] - acc[1:], logit_diff_drop=ld[0] - ld[1:])
    out = out.sort_values(["accuracy_drop", "logit_diff_drop"], ascending=False, kind="stable")
    return out.assign(rank=np.arange(1, len(out) + 1)).reset_index(drop=True)


def _target_size(curve: pd.DataFrame, target: float) -> int:
    ok = curve.index[curve["accuracy"] >= target]
    return int(curve.loc[ok[0], "size"]) if len(ok) else int(curve["size"].max())


def grow_ranked(model, data: CircuitData, effects: pd.DataFrame, sources: list[Tensor], *, chunk_rows: int = 4096,
                progress: bool = False) -> pd.DataFrame:
    """Size-vs-accuracy curve: the top-k cells of the necessity ranking kept, every other cell ablated."""
    keep = [range(k) for k in range(len(effects) + 1)]
    acc, ld = evaluate(model, data, _masks(model, data, effects, keep), sources, chunk_rows=chunk_rows, progress=progress)
    added = [None] + effects["cell"].tolist()
    return pd.DataFrame(dict(size=np.arange(len(keep)), added=added, accuracy=acc, logit_diff=ld))


def grow_greedy(model, data: CircuitData, effects: pd.DataFrame, sources: list[Tensor], target: float, *,
                chunk_rows: int = 4096, progress: bool = False) -> pd.DataFrame:
    """Size-vs-accuracy curve of greedy growth: each step keeps the cell that raises accuracy most
    (logit difference breaks ties), until ``target`` accuracy is reached or every cell is kept."""
    kept: list[int] = []
    acc, ld = evaluate(model, data, _masks(model, data, effects, [[]]), sources, chunk_rows=chunk_rows)
    rows = [dict(size=0, added=None, accuracy=acc[0], logit_diff=ld[0])]
    left = list(range(len(effects)))
    bar = tqdm(total=len(left), disable=not progress, desc="greedy growth", leave=False)
    while left and rows[-1]["accuracy"] < target:
        masks = _masks(model, data, effects, [kept + [c] for c in left])
        acc, ld = evaluate(model, data, masks, sources, chunk_rows=chunk_rows)
        best = int(np.lexsort((-ld, -acc))[0])
        kept.append(left.pop(best))
        rows.append(dict(size=len(kept), added=effects["cell"].iloc[kept[-1]], accuracy=acc[best], logit_diff=ld[best]))
        bar.update(1)
    bar.close()
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class CircuitSpec:
    """How to locate the circuit. ``keep``: share of the full model's per-token accuracy the circuit
    must keep; ``ablation``: how cells outside it are ablated while growing; ``grow``: ``ranked`` or
    ``greedy``; ``position_key``: answer positions by ``place`` value or ``index`` from ``=``."""

    n: int = 512
    split: str = "id"
    seed: int = 0
    keep: float = 0.9
    ablation: str = "resample"
    grow: str = "ranked"
    position_key: str = "place"
    chunk_rows: int = 4096
    progress: bool = False

    def check(self) -> "CircuitSpec":
        check_positive_int(self.n, "n", PatchingError)
        check_positive_int(self.chunk_rows, "chunk_rows", PatchingError)
        if not 0 < self.keep <= 1:
            raise PatchingError(f"keep must be a share of accuracy in (0, 1], got {self.keep!r}")
        if self.ablation not in ABLATIONS:
            raise PatchingError(f"ablation must be one of {ABLATIONS}, got {self.ablation!r}")
        if self.grow not in GROWTH:
            raise PatchingError(f"grow must be one of {GROWTH}, got {self.grow!r}")
        return self


@dataclass
class LocatedCircuit:
    """The located circuit: ``cells`` (its cells, in the order added), ``effects`` (every cell's
    necessity), ``curve`` (size vs accuracy), ``verification`` (per ablation), and the data used."""

    cells: pd.DataFrame
    effects: pd.DataFrame
    curve: pd.DataFrame
    verification: pd.DataFrame
    data: CircuitData = field(repr=False)
    spec: CircuitSpec = field(default_factory=CircuitSpec)


def verify(model, data: CircuitData, cells: pd.DataFrame, all_cells: pd.DataFrame,
           ablations: Sequence[str] = ABLATIONS, *, chunk_rows: int = 4096) -> pd.DataFrame:
    """Per ablation: accuracy and logit difference of the full model, of the circuit (every other cell
    ablated) and of no cell kept; the share of accuracy kept (circuit / full), the share recovered
    (circuit - none) / (full - none), and logit-difference faithfulness, the same ratio of logit differences."""
    key = ["layer", "head", "slot"]
    inside = all_cells.reset_index(drop=True).merge(cells[key].drop_duplicates(), on=key, how="left", indicator=True)
    kept = np.flatnonzero(inside["_merge"].to_numpy() == "both").tolist()
    rows = []
    for ab in ablations:
        src = ablation_sources(model, data, ab)
        m = _masks(model, data, all_cells.reset_index(drop=True), [kept, []])
        acc, ld = evaluate(model, data, torch.cat([torch.zeros_like(m[:1]), m]), src, chunk_rows=chunk_rows)
        rows.append(dict(
            ablation=ab, cells=len(kept), n_cells=len(all_cells), share_of_cells=len(kept) / len(all_cells),
            accuracy_full=acc[0], accuracy_circuit=acc[1], accuracy_none=acc[2], accuracy_kept=acc[1] / acc[0],
            accuracy_recovered=(acc[1] - acc[2]) / (acc[0] - acc[2]) if acc[0] != acc[2] else float("nan"),
            logit_diff_full=ld[0], logit_diff_circuit=ld[1], logit_diff_none=ld[2],
            faithfulness=(ld[1] - ld[2]) / (ld[0] - ld[2]) if ld[0] != ld[2] else float("nan"),
        ))
    return pd.DataFrame(rows)


def locate_circuit(model, task=None, *, spec: Optional[CircuitSpec] = None,
                   problems: Optional[Sequence[T.Problem]] = None) -> LocatedCircuit:
    """Locate the addition circuit of ``model`` at the grain (layer, head, answer position).

    ``problems`` default to ``spec.n`` problems of the task's ``spec.split`` (seeded); the circuit is
    the smallest prefix of the growth order whose accuracy with every other cell ablated is at least
    ``spec.keep`` x the full model's. Cells without answer rows in the data are left out.
    """
    spec = (spec or CircuitSpec()).check()
    require_eval(model)
    if problems is None:
        task = T.task_for(model, task, who="locate_circuit")
        problems = task.sample_problems(spec.n, spec.split, seed=spec.seed)
    data = circuit_data(problems, seed=spec.seed + 1, position_key=spec.position_key)
    src = ablation_sources(model, data, spec.ablation)
    effects = cell_effects(model, data, src, chunk_rows=spec.chunk_rows, progress=spec.progress)
    full, _ = evaluate(model, data, torch.zeros(1, model.cfg.n_layers, model.cfg.n_heads, len(data.slots),
                                                dtype=torch.bool), src)
    target = spec.keep * float(full[0])
    if spec.grow == "ranked":
        curve = grow_ranked(model, data, effects, src, chunk_rows=spec.chunk_rows, progress=spec.progress)
    else:
        curve = grow_greedy(model, data, effects, src, target, chunk_rows=spec.chunk_rows, progress=spec.progress)
    curve = curve.assign(share_of_cells=curve["size"] / len(effects), accuracy_kept=curve["accuracy"] / full[0])
    size = _target_size(curve, target)
    cells = effects.set_index("cell").loc[curve["added"].iloc[1 : size + 1]].reset_index()
    cells = cells.assign(order=np.arange(1, size + 1)).reset_index(drop=True)
    ver = verify(model, data, cells, effects, chunk_rows=spec.chunk_rows)
    return LocatedCircuit(cells, effects, curve, ver, data, spec)


__all__ = [
    "ABLATIONS", "GRAINS", "CircuitData", "class_ids", "is_digit_class", "token_class", "CircuitSpec", "LocatedCircuit", "ablated_logits", "ablation_sources",
    "cell_effects", "cell_table", "circuit_data", "evaluate", "grow_greedy", "grow_ranked", "locate_circuit",
    "place_name", "resample_problems", "score_logits", "slot_order", "verify",
]
