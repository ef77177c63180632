"""Where the accuracy lost to norm noise comes from: q, k or v, the norm or any direction, per head or per token.

Menary et al. (2024, §2.3) model Pre-Norm interference as multiplicative noise on the L2 norms of
q, k and v and read the accuracy drop at 1% noise as fragility of the attention circuits. The drop
of "noise on everything" does not say which part does the damage. :func:`noise_decomposition`
measures, on the same problems and with common random numbers, the drop under each of
:data:`DECOMPOSITION_MODES`:

* ``q``, ``k``, ``v``: noise on one target only (v noise cannot move an attention argmax; q and k
  noise can); ``qkv``: all three, the paper's setting;
* ``random``: q, k and v each perturbed by the same-size noise in a random direction,
  x → x + κ·‖x‖·u (u a random unit vector, κ the very draws of ``qkv``): is it the *norm* that is
  fragile, or any perturbation of that size? (:class:`~interp_norm.noise.NormNoise`,
  ``direction="random"``);
* ``shared``: one κ per (example, position, layer), shared by every head and by q, k and v — the
  paper's picture of interference arriving through the one shared Pre-Norm divisor, rather than an
  independent κ per head and vector (``NormNoise(shared=True)``).

Every mode noises all layers at once (as :func:`~interp_norm.noise.run_noise`). The draws: one
noise seed per (dataset, batch chunk), the same for every mode and level, so κ on q in mode ``q``
is κ on q in mode ``qkv`` and in ``random`` (differences between modes are paired, not two
independent samples). The drop is clean minus noisy accuracy on the same tokens, per dataset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor
from tqdm.auto import tqdm

from interp_norm.errors import NoiseSpecError
from interp_norm.core.scoring import count_correct
from interp_norm.core.model import HookedNormTransformer
from interp_norm.core.specs import with_overrides
from interp_norm.noise import _validate as V
from interp_norm.noise.norm_noise import NormNoise
from interp_norm.core.task import AdditionTask, Batch, task_for

#: mode -> (targets, NormNoise options): the rows of the decomposition, in this order.
DECOMPOSITION_MODES: dict[str, tuple[tuple[str, ...], dict]] = {
    "q": (("q",), {}),
    "k": (("k",), {}),
    "v": (("v",), {}),
    "qkv": (("q", "k", "v"), {}),
    "random": (("q", "k", "v"), {"direction": "random"}),
    "shared": (("q", "k", "v"), {"shared": True}),
}
#: The levels of the decomposition by default: the paper's 1% and a ten times larger one.
DECOMPOSITION_LEVELS = (0.01, 0.1)


def _check_modes(modes: str | Sequence[str]) -> tuple[str, ...]:
    modes = (modes,) if isinstance(modes, str) else tuple(modes)
    bad = [m for m in modes if m not in DECOMPOSITION_MODES]
    if bad or not modes:
        raise NoiseSpecError(f"unknown decomposition modes {bad or modes}; choose from {tuple(DECOMPOSITION_MODES)}")
    return tuple(m for m in DECOMPOSITION_MODES if m in modes)


def chunk_seed(seed: int, dataset: int, chunk: int) -> int:
    """The noise seed of one forward pass of :func:`noise_decomposition`: per dataset and batch
    chunk, the same for every mode and level (common random numbers)."""
    return int(np.random.SeedSequence([seed, dataset, 0xDEC0, chunk]).generate_state(1)[0])


@dataclass(frozen=True)
class DecompositionSpec:
    """The options of :func:`noise_decomposition` (also taken as keywords; an unknown one: NoiseSpecError):
    κ's ``distribution``, the noise ``placement``, ``seed`` (:func:`chunk_seed`), ``batch_size`` problems per
    forward pass, ``variant`` labelling the rows."""

    distribution: str = "uniform"
    placement: str = "before_norm"
    seed: int = 0
    batch_size: int = 512
    variant: Optional[str] = None


@torch.no_grad()
def noise_decomposition(
    model: HookedNormTransformer,
    datasets: Sequence[Batch | Int[Tensor, "batch pos"]],
    levels: Sequence[float] | float = DECOMPOSITION_LEVELS,
    modes: str | Sequence[str] = tuple(DECOMPOSITION_MODES),
    spec: Optional[DecompositionSpec] = None,
    *,
    progress: bool = False,
    **overrides: Any,
) -> pd.DataFrame:
    """Accuracy lost to norm noise, split by what is noised (module docstring): one row per (mode, level).
    Options: :class:`DecompositionSpec` (``spec`` and/or its fields as keywords).

    Columns: ``variant``, ``attn_norm``, ``mode``, ``targets``, ``direction`` (norm / random),
    ``shared`` (one κ per token), ``level``, ``clean_accuracy`` and ``accuracy`` (per-token,
    teacher-forced, ``]`` included; mean over datasets), ``drop`` = clean − noisy in points of
    accuracy (mean over datasets of the paired difference), ``drop_se`` (std over datasets / √n),
    ``n_datasets``, ``n_tokens``, ``distribution``, ``placement``. A level of 0 is exactly clean.
    """
    sp = with_overrides(DecompositionSpec, spec, overrides, who="noise_decomposition", error=NoiseSpecError)
    distribution, placement, variant = sp.distribution, sp.placement, sp.variant
    cfg = V.check_model(model)
    levels = V.check_levels(levels, distribution)
    modes = _check_modes(modes)
    V.check_placement(placement)
    seed = V.check_seed(sp.seed)
    batch_size = V.check_positive_int(sp.batch_size, "batch_size")
    chunks_per = [[V.trimmed_tokens(t[i : i + batch_size], model) for i in range(0, len(t), batch_size)]
                  for t in V.dataset_tokens(datasets)]
    clean = np.zeros(len(datasets))
    n_tokens = 0
    for di, chunks in enumerate(chunks_per):
        c = n = 0
        for chunk in chunks:
            cc, nn = count_correct(model(chunk), chunk)
            c, n = c + cc, n + nn
        clean[di], n_tokens = (c / n if n else math.nan), n_tokens + n
    rows = []
    bar = tqdm(total=len(modes) * len(levels) * len(datasets), desc="noise decomposition", disable=not progress)
    for mode in modes:
        targets, opts = DECOMPOSITION_MODES[mode]
        for level in levels:
            acc = np.zeros(len(datasets))
            for di, chunks in enumerate(chunks_per):
                c = n = 0
                for ci, chunk in enumerate(chunks):
                    noise = NormNoise(model, level, targets, distribution=distribution, placement=placement,
                                      seed=chunk_seed(seed, di, ci), **opts)
                    cc, nn = count_correct(model.run_with_hooks(chunk, fwd_hooks=noise.hooks()), chunk)
                    c, n = c + cc, n + nn
                acc[di] = c / n if n else math.nan
                bar.update()
            drops = (clean - acc) * 100
            k = len(drops)
            rows.append(dict(
                variant=V.variant_label(cfg, variant), attn_norm=cfg.attn_norm, mode=mode, targets="".join(targets),
                direction=opts.get("direction", "norm"), shared=bool(opts.get("shared", False)), level=level,
                clean_accuracy=float(clean.mean()), accuracy=float(acc.mean()), drop=float(drops.mean()),
                drop_se=float(drops.std(ddof=1) / math.sqrt(k)) if k > 1 else math.nan,
                n_datasets=k, n_tokens=n_tokens, distribution=distribution, placement=placement,
            ))
    bar.close()
    return pd.DataFrame(rows)


def run_noise_decomposition(
    model: HookedNormTransformer,
    task: Optional[AdditionTask] = None,
    levels: Sequence[float] | float = DECOMPOSITION_LEVELS,
    modes: str | Sequence[str] = tuple(DECOMPOSITION_MODES),
    *,
    split: str = "id",
    n_datasets: int = 3,
    n_examples: int = 512,
    data_seed: int = 1234,
    **kwargs,
) -> pd.DataFrame:
    """:func:`noise_decomposition` on ``task.test_set(split, n_examples, seed=data_seed + i)`` for
    i < ``n_datasets`` (the datasets of :func:`~interp_norm.noise.run_noise`), with a ``split`` column.
    ``task`` defaults to the model's own (``model.task``)."""
    task = task_for(model, task, who="run_noise_decomposition")
    n_datasets = V.check_positive_int(n_datasets, "n_datasets")
    n_examples = V.check_positive_int(n_examples, "n_examples")
    datasets = [task.test_set(split, n_examples, seed=data_seed + i) for i in range(n_datasets)]
    df = noise_decomposition(model, datasets, levels, modes, **kwargs)
    df.insert(2, "split", split)
    return df


__all__ = ["DECOMPOSITION_MODES", "DECOMPOSITION_LEVELS", "chunk_seed", "DecompositionSpec", "noise_decomposition", "run_noise_decomposition"]
