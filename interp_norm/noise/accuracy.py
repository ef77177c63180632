"""Per-token accuracy under norm noise: the paper's noise-sensitivity sweep.

:func:`run_noise` noises all layers at once (errors compound with depth, as in the paper) and
reports mean ± standard error over independent datasets, for noise on every row (``"all"``) and the
paper's sparse-only / non-sparse-only variants, which gate q/k noise to the attention rows whose
clean max attention is ≥ 95% / < 70% (:func:`clean_row_gates`).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Int
from torch import Tensor
from tqdm.auto import tqdm

from interp_norm import task as T
from interp_norm import theory
from interp_norm.errors import ConfigError, NoiseSpecError
from interp_norm.hooks import NONSPARSE_THRESHOLD, NOISED_ROWS, SPARSE_THRESHOLD, act_name
from interp_norm.model import HookedNormTransformer
from interp_norm.noise import _validate as V
from interp_norm.noise.hooks import NormNoise
from interp_norm.task import AdditionTask, Batch

#: The paper's accuracy sweep (0, 0.1%, 0.3%, 1%, 3%, 10%, 30%).
DEFAULT_NOISE_LEVELS = (0.0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3)


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


def _count_correct(logits: Tensor, tokens: Tensor) -> tuple[int, int]:
    targets = T.next_token_targets(tokens.to(logits.device))
    mask = targets != -100
    return int(((logits.argmax(-1) == targets) & mask).sum()), int(mask.sum())


def pass_seed(seed: int, dataset: int, group: int, chunk: int) -> int:
    """The noise seed of one forward pass of :func:`accuracy_under_noise`: it differs per dataset,
    noised group (index in ``NOISED_ROWS``) and batch chunk, but not per level (common random numbers)."""
    return int(np.random.SeedSequence([seed, dataset, group, chunk]).generate_state(1)[0])


@torch.no_grad()
def accuracy_under_noise(
    model: HookedNormTransformer,
    datasets: Sequence[Batch | Tensor],
    levels: Sequence[float] = DEFAULT_NOISE_LEVELS,
    *,
    noised: str | Sequence[str] = NOISED_ROWS,
    targets: str | Sequence[str] = ("q", "k", "v"),
    distribution: str = "uniform",
    placement: str = "before_norm",
    layers: Optional[int | Sequence[int]] = None,
    heads: Optional[int | Sequence[int]] = None,
    sparse_threshold: float = SPARSE_THRESHOLD,
    nonsparse_threshold: float = NONSPARSE_THRESHOLD,
    seed: int = 0,
    batch_size: int = 512,
    variant: Optional[str] = None,
    progress: bool = False,
) -> pd.DataFrame:
    """Per-token answer accuracy (teacher-forced, ``]`` included) under norm noise: one row per
    (noised, level, dataset) with ``correct``, ``total``, ``accuracy``.

    ``noised``: ``"all"`` noises every row with ``targets``; ``"sparse"`` / ``"nonsparse"`` noise
    only q and k of rows whose clean max attention is ≥ ``sparse_threshold`` / < ``nonsparse_
    threshold`` (the paper: "{q, k_t} noise only on sparse distributions"; v and scale noise are
    not row-specific and are left out of these variants). Noise hits all chosen layers in the
    same forward pass, so errors compound with depth (as in the paper). The noise seed differs per
    dataset and variant but not per level (common random numbers; :func:`pass_seed`).
    """
    cfg = V.check_model(model)
    levels = V.check_levels(levels, distribution)
    targets = V.check_targets(targets, cfg)
    V.check_placement(placement)
    layers = V.check_index_list(layers, cfg.n_layers, "layer")
    heads_t = None if heads is None else V.check_index_list(heads, cfg.n_heads, "head")
    seed = V.check_seed(seed)
    batch_size = V.check_positive_int(batch_size, "batch_size")
    sparse_threshold = V.check_threshold(sparse_threshold, "sparse_threshold")
    nonsparse_threshold = V.check_threshold(nonsparse_threshold, "nonsparse_threshold")
    noised = (noised,) if isinstance(noised, str) else tuple(noised)
    for g in noised:
        if g not in NOISED_ROWS:
            raise NoiseSpecError(f"unknown noised={g!r}; choose from {NOISED_ROWS}")
    qk = tuple(t for t in targets if t in ("q", "k"))
    if any(g != "all" for g in noised) and not qk:
        raise NoiseSpecError("the sparse/nonsparse variants noise q and k only; include 'q' or 'k' in targets")
    if not datasets:
        raise ConfigError("no datasets given; pass e.g. [task.test_set('id', 512, seed=s) for s in range(3)]")
    toks = []
    for d in datasets:
        t = d.tokens if isinstance(d, Batch) else d
        if not isinstance(t, Tensor) or t.ndim != 2:
            raise ConfigError("each dataset must be a Batch or a [batch, pos] token tensor")
        toks.append(t)

    rows = []
    bar = tqdm(total=len(toks) * len(noised) * len(levels), desc="noise", disable=not progress)
    for di, tokens in enumerate(toks):
        chunks = [V.trimmed_tokens(tokens[i : i + batch_size], model) for i in range(0, len(tokens), batch_size)]
        for gi, g in enumerate(NOISED_ROWS):
            if g not in noised:
                continue
            gates = None
            if g != "all":
                thr = sparse_threshold if g == "sparse" else nonsparse_threshold
                gates = [clean_row_gates(model, c, g, thr) for c in chunks]
            for level in levels:
                correct = total = 0
                for ci, chunk in enumerate(chunks):
                    kw = dict(distribution=distribution, layers=layers, heads=heads_t, placement=placement)
                    noise_seed = pass_seed(seed, di, gi, ci)
                    if gates is None:
                        noise = NormNoise(model, level, targets, seed=noise_seed, **kw)
                    else:
                        gate = {l: gates[ci][l] for l in layers}
                        noise = NormNoise(model, level, qk, seed=noise_seed, row_gate=gate, **kw)
                    logits = model.run_with_hooks(chunk, fwd_hooks=noise.hooks())
                    c, n = _count_correct(logits, chunk)
                    correct, total = correct + c, total + n
                rows.append(dict(
                    variant=V.variant_label(cfg, variant), attn_norm=cfg.attn_norm, noised=g, level=level,
                    dataset=di, correct=correct, total=total,
                    accuracy=correct / total if total else math.nan,
                    targets="".join(targets if g == "all" else qk), distribution=distribution, placement=placement,
                ))
                bar.update()
    bar.close()
    return pd.DataFrame(rows)


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
    task: AdditionTask,
    levels: Sequence[float] = DEFAULT_NOISE_LEVELS,
    *,
    split: str = "id",
    n_datasets: int = 3,
    n_examples: int = 512,
    data_seed: int = 1234,
    aggregate: bool = True,
    **kwargs,
) -> pd.DataFrame:
    """The paper's accuracy-vs-noise experiment in one call.

    Datasets are ``task.test_set(split, n_examples, seed=data_seed + i)`` for i < ``n_datasets``
    (independent seeded draws; dataset 0 is the standard test set when sizes agree). Returns one
    row per (noised, level): ``accuracy`` (mean over datasets), ``se`` (std / √n_datasets, the
    paper's "standard error over 3 datasets"), ``n_datasets``, ``n_tokens``; with
    ``aggregate=False`` the per-dataset rows of :func:`accuracy_under_noise`. Other keyword
    arguments go to :func:`accuracy_under_noise`.
    """
    if not isinstance(task, AdditionTask):
        raise ConfigError(f"task must be an AdditionTask, got {type(task).__name__}")
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


__all__ = ["DEFAULT_NOISE_LEVELS", "clean_row_gates", "pass_seed", "accuracy_under_noise", "run_noise"]
