"""Per-token accuracy under norm noise: the paper's noise-sensitivity sweep.

:func:`run_noise` noises all layers at once (errors compound with depth, as in the paper) and
reports mean ± standard error over independent datasets, for noise on every row (``"all"``) and the
paper's sparse-only / non-sparse-only variants, which gate q/k noise to the attention rows whose
clean max attention is ≥ 95% / < 70% (:func:`clean_row_gates`).

The control ``"nonsparse_matched"`` (:func:`matched_row_gates`) noises a random subset of
non-sparse rows *as large as the sparse set*: sparse rows are a few percent of all rows and
non-sparse ones most of them, so "sparse-only hurts less than non-sparse-only" may only say that
fewer rows were noised; sparse-only vs matched non-sparse compares equal counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Int
from torch import Tensor
from tqdm.auto import tqdm

from interp_norm.anatomy import kind_of
from interp_norm.core import task as T
from interp_norm import theory
from interp_norm.errors import NoiseSpecError
from interp_norm.core.scoring import count_correct
from interp_norm.core.defaults import DEFAULT_NOISE_LEVELS, NONSPARSE_THRESHOLD, NOISED_ROWS, SPARSE_THRESHOLD
from interp_norm.core.hook_names import act_name
from interp_norm.core.model import HookedNormTransformer
from interp_norm.core.specs import with_overrides
from interp_norm.noise import _validate as V
from interp_norm.noise.norm_noise import NormNoise
from interp_norm.noise.kernels import seeded_generator
from interp_norm.core.task import AdditionTask, Batch

#: The paper's accuracy sweep (0, 0.1%, 0.3%, 1%, 3%, 10%, 30%).
#: The matched-count control group (opt-in: ``noised=NOISE_GROUPS``).
MATCHED = "nonsparse_matched"
#: Every ``noised`` group :func:`accuracy_under_noise` knows; the default is the paper's ``NOISED_ROWS``.
NOISE_GROUPS = NOISED_ROWS + (MATCHED,)
_SUBSET_KEY = 0x5E1EC7  # mixes the subset draw's seed apart from the κ draws'


@torch.no_grad()
def clean_row_gates(
    model: HookedNormTransformer, tokens: Int[Tensor, "batch pos"], rows: str, threshold: Optional[float] = None
) -> dict[int, Bool[Tensor, "batch head query"]]:
    """Per layer, which attention rows are sparse (clean max attention ≥ 95%) or non-sparse (< 70%).

    Decided once from the clean run: the gate marks the paper's distribution classes; noise in
    earlier layers may later change those rows, but not which ones are noised.
    """
    if rows not in ("sparse", "nonsparse"):
        raise NoiseSpecError(f"rows must be 'sparse' or 'nonsparse', got {rows!r}")
    names = {act_name("pattern", l) for l in range(model.cfg.n_layers)}
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    out = {}
    for l in range(model.cfg.n_layers):
        pattern = cache[act_name("pattern", l)]
        if rows == "sparse":
            out[l] = theory.sparse_mask(pattern, SPARSE_THRESHOLD if threshold is None else threshold)
        else:
            out[l] = theory.nonsparse_mask(pattern, NONSPARSE_THRESHOLD if threshold is None else threshold)
    return out


def influential_rows(tokens: Int[Tensor, "batch pos"], n_heads: int) -> Bool[Tensor, "batch head query"]:
    """Rows that can change a scored logit: query ≥ 1 (row 0 has a single key, so no noise on
    it moves anything) and query ≤ the example's last scored position (attention is causal, so a
    later row reaches no scored logit; this also drops padding)."""
    scored = T.answer_mask(tokens.cpu())
    pos = torch.arange(tokens.shape[1])
    last = torch.where(scored.any(-1), (scored * pos).amax(-1), torch.full((len(tokens),), -1))
    rows = (pos[None, :] >= 1) & (pos[None, :] <= last[:, None])  # [b, q]
    return rows[:, None, :].expand(-1, n_heads, -1)


@torch.no_grad()
def matched_row_gates(
    model: HookedNormTransformer,
    tokens: Int[Tensor, "batch pos"],
    sparse_threshold: float = SPARSE_THRESHOLD,
    nonsparse_threshold: float = NONSPARSE_THRESHOLD,
    seed: int = 0,
) -> dict[int, Bool[Tensor, "batch head query"]]:
    """Per layer, a random set of non-sparse rows with as many rows as the sparse set: the
    matched-count control for "noise only on sparse rows".

    Matching is per (example, layer): each answer depends on its own example's rows only, so every
    example gets exactly as many noised rows on its path as under sparse-only noise (matching only
    a layer's total could pile the subset onto long examples). Only :func:`influential_rows` are
    counted and drawn (the sparse gate's inert rows — row 0 is always "sparse" — would otherwise
    inflate the count). Within an example and layer, the subset is uniform over its non-sparse
    rows (all heads and queries), drawn from a generator seeded by ``(seed, layer)``; if the
    example has fewer non-sparse rows than sparse ones, all its non-sparse rows are taken
    (:func:`noised_row_counts` reports such shortfalls).
    """
    cfg = V.check_model(model)
    sparse_threshold = V.check_threshold(sparse_threshold, "sparse_threshold")
    nonsparse_threshold = V.check_threshold(nonsparse_threshold, "nonsparse_threshold")
    seed = V.check_seed(seed)
    names = {act_name("pattern", l) for l in range(cfg.n_layers)}
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    live = influential_rows(tokens, cfg.n_heads)
    b = len(tokens)
    out = {}
    for l in range(cfg.n_layers):
        pattern = cache[act_name("pattern", l)].cpu()
        want = (theory.sparse_mask(pattern, sparse_threshold) & live).reshape(b, -1).sum(-1)  # [b]
        pool = (theory.nonsparse_mask(pattern, nonsparse_threshold) & live).reshape(b, -1)  # [b, h*q]
        # a uniform random subset of size k = the k candidates with the smallest random keys
        keys = torch.rand(pool.shape, generator=seeded_generator(seed, l, _SUBSET_KEY), dtype=torch.float64)
        keys = keys.masked_fill(~pool, math.inf)
        rank = keys.argsort(-1).argsort(-1)
        out[l] = (pool & (rank < want[:, None])).reshape(pattern.shape[:-1]).to(tokens.device)
    return out


def noised_row_counts(
    model: HookedNormTransformer,
    tokens: Int[Tensor, "batch pos"] | Batch,
    sparse_threshold: float = SPARSE_THRESHOLD,
    nonsparse_threshold: float = NONSPARSE_THRESHOLD,
    seed: int = 0,
) -> pd.DataFrame:
    """How many influential rows each group noises, per layer: columns ``layer``, ``n_rows``
    (:func:`influential_rows`), ``sparse``, ``nonsparse``, ``nonsparse_matched`` and ``shortfall``
    (examples whose non-sparse rows were fewer than their sparse rows)."""
    cfg = V.check_model(model)
    tokens = V.trimmed_tokens(tokens, model)
    live = influential_rows(tokens, cfg.n_heads)
    sparse = clean_row_gates(model, tokens, "sparse", sparse_threshold)
    nonsparse = clean_row_gates(model, tokens, "nonsparse", nonsparse_threshold)
    matched = matched_row_gates(model, tokens, sparse_threshold, nonsparse_threshold, seed)
    rows = []
    for l in range(cfg.n_layers):
        s, ns = sparse[l].cpu() & live, nonsparse[l].cpu() & live
        short = s.flatten(1).sum(-1) > ns.flatten(1).sum(-1)
        rows.append(dict(layer=l, n_rows=int(live.sum()), sparse=int(s.sum()), nonsparse=int(ns.sum()),
                         nonsparse_matched=int(matched[l].sum()), shortfall=int(short.sum())))
    return pd.DataFrame(rows)


def pass_seed(seed: int, dataset: int, group: int, chunk: int) -> int:
    """The noise seed of one forward pass of :func:`accuracy_under_noise`: it differs per dataset,
    noised group (index in ``NOISE_GROUPS``) and batch chunk, but not per level (common random numbers)."""
    return int(np.random.SeedSequence([seed, dataset, group, chunk]).generate_state(1)[0])


@dataclass(frozen=True)
class AccuracyNoiseSpec:
    """The options of :func:`accuracy_under_noise` (also taken as keywords; an unknown one: NoiseSpecError).

    ``noised``: ``"all"`` noises every row with ``targets``; ``"sparse"`` / ``"nonsparse"`` noise
    only q and k of rows whose clean max attention is ≥ ``sparse_threshold`` / < ``nonsparse_
    threshold`` (the paper: "{q, k_t} noise only on sparse distributions"; v and scale noise are
    not row-specific and are left out of these variants); ``"nonsparse_matched"`` (opt-in) noises
    q and k of a random subset of non-sparse rows as large as the sparse set, per example and layer
    (:func:`matched_row_gates`, subset seeded by the pass's seed). ``distribution``, ``placement``,
    ``layers``, ``heads`` as :class:`~interp_norm.noise.NormNoise`; ``seed`` of the noise (:func:`pass_seed`);
    ``batch_size`` problems per forward pass; ``variant`` labels the rows (None: the model's norm's label).
    """

    noised: str | Sequence[str] = NOISED_ROWS
    targets: str | Sequence[str] = ("q", "k", "v")
    distribution: str = "uniform"
    placement: str = "before_norm"
    layers: Optional[int | Sequence[int]] = None
    heads: Optional[int | Sequence[int]] = None
    sparse_threshold: float = SPARSE_THRESHOLD
    nonsparse_threshold: float = NONSPARSE_THRESHOLD
    seed: int = 0
    batch_size: int = 512
    variant: Optional[str] = None


@dataclass(frozen=True)
class _Checked:
    """An :class:`AccuracyNoiseSpec` checked against one model: the values the sweep reads."""

    levels: tuple[float, ...]
    noised: tuple[str, ...]
    targets: tuple[str, ...]
    qk: tuple[str, ...]
    layers: tuple[int, ...]
    heads: Optional[tuple[int, ...]]
    sparse_threshold: float
    nonsparse_threshold: float
    seed: int
    batch_size: int


def _check_accuracy(cfg, levels: Sequence[float], sp: AccuracyNoiseSpec) -> _Checked:
    """Every option of ``sp`` checked (NoiseSpecError / ConfigError naming it), in one order."""
    levels = V.check_levels(levels, sp.distribution)
    targets = V.check_targets(sp.targets, cfg)
    V.check_placement(sp.placement)
    layers = V.check_index_list(sp.layers, cfg.n_layers, "layer")
    heads = None if sp.heads is None else V.check_index_list(sp.heads, cfg.n_heads, "head")
    seed = V.check_seed(sp.seed)
    batch_size = V.check_positive_int(sp.batch_size, "batch_size")
    sparse_threshold = V.check_threshold(sp.sparse_threshold, "sparse_threshold")
    nonsparse_threshold = V.check_threshold(sp.nonsparse_threshold, "nonsparse_threshold")
    noised = (sp.noised,) if isinstance(sp.noised, str) else tuple(sp.noised)
    for g in noised:
        if g not in NOISE_GROUPS:
            raise NoiseSpecError(f"unknown noised={g!r}; choose from {NOISE_GROUPS}")
    qk = tuple(t for t in targets if t in ("q", "k"))
    if any(g != "all" for g in noised) and not qk:
        raise NoiseSpecError("the sparse/nonsparse/matched variants noise q and k only; include 'q' or 'k' in targets")
    return _Checked(levels, noised, tuple(targets), qk, tuple(layers), heads, sparse_threshold, nonsparse_threshold,
                    seed, batch_size)


@torch.no_grad()
def accuracy_under_noise(
    model: HookedNormTransformer,
    datasets: Sequence[Batch | Tensor],
    levels: Sequence[float] = DEFAULT_NOISE_LEVELS,
    spec: Optional[AccuracyNoiseSpec] = None,
    *,
    progress: bool = False,
    **overrides: Any,
) -> pd.DataFrame:
    """Per-token answer accuracy (teacher-forced, ``]`` included) under norm noise: one row per
    (noised, level, dataset) with ``correct``, ``total``, ``accuracy``. Options: :class:`AccuracyNoiseSpec`
    (``spec`` and/or its fields as keywords).

    Noise hits all chosen layers in the same forward pass, so errors compound with depth (as in the
    paper). The noise seed differs per dataset and variant but not per level (common random numbers;
    :func:`pass_seed`).
    """
    sp = with_overrides(AccuracyNoiseSpec, spec, overrides, who="accuracy_under_noise", error=NoiseSpecError)
    cfg = V.check_model(model)
    ck = _check_accuracy(cfg, levels, sp)
    toks = V.dataset_tokens(datasets)
    rows = []
    bar = tqdm(total=len(toks) * len(ck.noised) * len(ck.levels), desc="noise", disable=not progress)
    for di, tokens in enumerate(toks):
        chunks = [V.trimmed_tokens(tokens[i : i + ck.batch_size], model) for i in range(0, len(tokens), ck.batch_size)]
        for gi, g in enumerate(NOISE_GROUPS):
            if g not in ck.noised:
                continue
            gates = _group_gates(model, chunks, g, ck, di, gi)
            for level in ck.levels:
                correct, total = _count_noised(model, chunks, gates, level, sp, ck, seeds=(di, gi))
                rows.append(dict(
                    variant=V.variant_label(cfg, sp.variant), attn_norm=cfg.attn_norm, noised=g, level=level,
                    dataset=di, correct=correct, total=total,
                    accuracy=correct / total if total else math.nan,
                    targets="".join(ck.targets if g == "all" else ck.qk), distribution=sp.distribution,
                    placement=sp.placement,
                ))
                bar.update()
    bar.close()
    return pd.DataFrame(rows)


def _group_gates(model: HookedNormTransformer, chunks: list, g: str, ck: _Checked, di: int, gi: int
                 ) -> Optional[list]:
    """Per chunk, the row gates of noised group ``g`` (None for ``"all"``: every row)."""
    if g == MATCHED:
        return [matched_row_gates(model, c, ck.sparse_threshold, ck.nonsparse_threshold, pass_seed(ck.seed, di, gi, ci))
                for ci, c in enumerate(chunks)]
    if g != "all":
        thr = ck.sparse_threshold if g == "sparse" else ck.nonsparse_threshold
        return [clean_row_gates(model, c, g, thr) for c in chunks]
    return None


def _count_noised(model: HookedNormTransformer, chunks: list, gates: Optional[list], level: float,
                  sp: AccuracyNoiseSpec, ck: _Checked, *, seeds: tuple[int, int]) -> tuple[int, int]:
    """(correct, total) answer tokens over the chunks at one level, each chunk's pass with its own noise seed."""
    di, gi = seeds
    correct = total = 0
    for ci, chunk in enumerate(chunks):
        kw = dict(distribution=sp.distribution, layers=ck.layers, heads=ck.heads, placement=sp.placement)
        noise_seed = pass_seed(ck.seed, di, gi, ci)
        if gates is None:
            noise = NormNoise(model, level, ck.targets, seed=noise_seed, **kw)
        else:
            gate = {l: gates[ci][l] for l in ck.layers}
            noise = NormNoise(model, level, ck.qk, seed=noise_seed, row_gate=gate, **kw)
        logits = model.run_with_hooks(chunk, fwd_hooks=noise.hooks())
        c, n = count_correct(logits, chunk)
        correct, total = correct + c, total + n
    return correct, total


def _summarise_accuracy(df: pd.DataFrame) -> pd.DataFrame:
    keys = ["variant", "attn_norm", "noised", "level", "targets", "distribution", "placement"]
    out = []
    for key, g in df.groupby(keys, sort=False):
        acc = g["accuracy"].to_numpy(dtype=float)
        n = len(acc)
        out.append(dict(
            zip(keys, key), accuracy=float(acc.mean()),
            se=float(acc.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan,
            n_datasets=n, n_tokens=int(g["total"].sum()),
        ))
    cols = keys[:4] + ["accuracy", "se", "n_datasets", "n_tokens"] + keys[4:]
    return pd.DataFrame(out)[cols]


def run_noise(
    model: HookedNormTransformer,
    task: Optional[AdditionTask] = None,
    levels: Sequence[float] = DEFAULT_NOISE_LEVELS,
    *,
    split: str = "id",
    n_datasets: int = 3,
    n_examples: int = 512,
    data_seed: int = 1234,
    aggregate: bool = True,
    **kwargs,
) -> pd.DataFrame:
    """The paper's accuracy-vs-noise experiment in one call, on any model.

    The one entry point for every kind: the backend is picked once. A TransformerBridge (a Hugging
    Face model: no addition task, so no accuracy) runs
    :func:`~interp_norm.noise.text_agreement.text_agreement` on ``tokens=`` (text windows; None: the
    shipped sample text) with the keyword arguments -- top-1 agreement with its clean prediction
    and KL; ``task``, ``split``, ``n_datasets``, ``n_examples``, ``data_seed`` and ``aggregate`` are
    not read. Our models run as follows.

    Datasets are ``task.test_set(split, n_examples, seed=data_seed + i)`` for i < ``n_datasets``
    (independent seeded draws; dataset 0 is the standard test set when sizes agree). Returns one
    row per (noised, level): ``accuracy`` (mean over datasets), ``se`` (std / √n_datasets, the
    paper's "standard error over 3 datasets"), ``n_datasets``, ``n_tokens``; with
    ``aggregate=False`` the per-dataset rows of :func:`accuracy_under_noise`. Other keyword
    arguments go to :func:`accuracy_under_noise`. ``task`` defaults to the model's own (``model.task``,
    :func:`interp_norm.core.task.task_for`; another task runs with a warning naming both).
    """
    tokens = kwargs.pop("tokens", None)  # a bridge's text: only the bridge backend reads it
    if kind_of(model) == "bridge":
        from interp_norm.noise.text_agreement import text_agreement

        return text_agreement(model, tokens, levels, **kwargs)
    if tokens is not None:
        raise NoiseSpecError("tokens= is a Hugging Face model's text; our models run on their task's test sets "
                             "(split, n_examples): call accuracy_under_noise(model, [tokens], levels) for tokens of your own")
    task = T.task_for(model, task, who="run_noise")
    n_datasets = V.check_positive_int(n_datasets, "n_datasets")
    n_examples = V.check_positive_int(n_examples, "n_examples")
    datasets = [task.test_set(split, n_examples, seed=data_seed + i) for i in range(n_datasets)]
    df = accuracy_under_noise(model, datasets, levels, **kwargs)
    df.insert(3, "split", split)
    if not aggregate:
        return df
    out = _summarise_accuracy(df)
    out.insert(3, "split", split)
    return out


__all__ = [
    "MATCHED", "NOISE_GROUPS", "clean_row_gates", "influential_rows", "matched_row_gates",
    "noised_row_counts", "pass_seed", "AccuracyNoiseSpec", "accuracy_under_noise", "run_noise",
]
