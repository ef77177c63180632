"""What a collapse costs: accuracy of problems in which a sparse row collapsed vs those in which none did.

Menary et al. (2024, §2.3 and §4) argue that norm noise hurts Pre-Norm models *through* circuit
collapse: a sparse attention row (max attention ≥ 95%) picks another key and the circuit that
relied on it breaks. A drop in accuracy under noise does not show that by itself. Here the noise
goes on q and k of the sparse rows only (the paper's "noise only on sparse distributions", the
``row_gate`` of :class:`~interp_norm.noise.NormNoise`), every layer at once, in the model's real
noisy forward pass; for each problem and noise draw we record whether at least one of its sparse
rows that can reach a scored logit collapsed (its score argmax moved, "loose"), and compare the
accuracy of the (problem, draw) pairs with ≥ 1 collapsed row against those with none, at the same
noise. Both groups see noise on all their sparse rows; they differ in whether a row flipped.

This is evidence about the models, not an identity: problems with more sparse rows (longer
problems) are both more likely to have a collapse and, possibly, harder; so beside the noisy
accuracy each group carries its clean accuracy and the drop (clean − noisy on the same pairs).
Intervals: a percentile bootstrap over *problems* (all draws of a resampled problem move together,
so the interval does not pretend the draws of one problem are independent), the same resamples
for both groups and their difference (:func:`cluster_bootstrap`).
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

from interp_norm.core import task as T
from interp_norm import theory
from interp_norm.errors import NoiseSpecError
from interp_norm.core.defaults import SPARSE_THRESHOLD
from interp_norm.core.hook_names import act_name
from interp_norm.core.model import HookedNormTransformer
from interp_norm.core.specs import with_overrides
from interp_norm.noise import _validate as V
from interp_norm.noise.accuracy import influential_rows
from interp_norm.noise.norm_noise import NormNoise
from interp_norm.core.task import AdditionTask, Batch

#: The noise level of the comparison by default (where sparse rows do collapse in Pre-Norm models).
CONSEQUENCE_LEVELS = (0.2,)


def bootstrap_ratios(
    num: np.ndarray, den: np.ndarray, n_boot: int = 2000, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Ratios Σ num / Σ den over clusters and their bootstrap replicates: ``num``/``den`` are
    [k, clusters] (k statistics, each a per-cluster sum); clusters are resampled with replacement
    ``n_boot`` times, the same resamples for all k. Returns (estimate [k], replicates [n_boot, k]);
    a replicate whose denominator is 0 is NaN."""
    num, den = np.atleast_2d(np.asarray(num, dtype=np.float64)), np.atleast_2d(np.asarray(den, dtype=np.float64))
    if num.shape != den.shape:
        raise NoiseSpecError(f"num and den must have the same shape, got {num.shape} and {den.shape}")
    n_boot = V.check_positive_int(n_boot, "n_boot", NoiseSpecError)
    n = num.shape[1]
    rng = np.random.default_rng(np.random.SeedSequence([V.check_seed(seed), 0xB0075]))
    w = rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot).astype(np.float64) if n else np.zeros((n_boot, 0))
    with np.errstate(invalid="ignore", divide="ignore"):
        return num.sum(1) / den.sum(1), (w @ num.T) / (w @ den.T)


def percentile_interval(replicates: np.ndarray, confidence: float = 0.95) -> tuple[float, float]:
    """The central ``confidence`` interval of bootstrap replicates (NaN ones dropped; NaN if none are left)."""
    confidence = V.check_threshold(confidence, "confidence")
    x = np.asarray(replicates, dtype=np.float64)
    x = x[np.isfinite(x)]
    if not x.size:
        return math.nan, math.nan
    alpha = (1 - confidence) / 2
    return float(np.quantile(x, alpha)), float(np.quantile(x, 1 - alpha))


def cluster_bootstrap(
    num: np.ndarray, den: np.ndarray, n_boot: int = 2000, confidence: float = 0.95, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Percentile bootstrap over clusters of ratios Σ num / Σ den (:func:`bootstrap_ratios`):
    (estimate [k], lower [k], upper [k])."""
    est, reps = bootstrap_ratios(num, den, n_boot, seed)
    bounds = np.array([percentile_interval(reps[:, j], confidence) for j in range(reps.shape[1])]).reshape(-1, 2)
    return est, bounds[:, 0], bounds[:, 1]


@dataclass(frozen=True)
class ConsequenceSpec:
    """The options of :func:`collapse_consequence` (also taken as keywords; an unknown one: NoiseSpecError).

    Noise: q/k (``targets``) of every row whose clean max attention is ≥ ``sparse_threshold``, in
    every layer (row gate), ``n_draws`` forward passes per level with draws 0..n_draws−1 of one
    :class:`NormNoise` (seed ``seed``; ``distribution``, ``placement`` as there). Intervals: ``n_boot``
    cluster-bootstrap resamples over problems at ``confidence``. ``variant`` labels the rows.
    """

    n_draws: int = 4
    targets: str | Sequence[str] = ("q", "k")
    distribution: str = "uniform"
    placement: str = "before_norm"
    sparse_threshold: float = SPARSE_THRESHOLD
    seed: int = 0
    n_boot: int = 2000
    confidence: float = 0.95
    variant: Optional[str] = None


@dataclass
class _Clean:
    """The clean run a consequence sweep compares against: sparse-row ``gates`` and the ``judged`` rows per
    layer [b, h, q], each row's clean top key ``tstar``, the next-token targets, which are ``scored``, and
    per problem the clean correct and ``total`` answer tokens [b]."""

    gates: dict
    judged: dict
    tstar: dict
    targets_next: Tensor
    scored: Tensor
    clean: np.ndarray
    total: np.ndarray

    def per_problem(self, lg: Tensor) -> np.ndarray:
        """Correct answer tokens per problem of logits ``lg``."""
        return ((lg.argmax(-1) == self.targets_next) & self.scored).sum(-1).cpu().numpy().astype(np.float64)


def _clean_run(model: HookedNormTransformer, tokens: Tensor, sparse_threshold: float) -> _Clean:
    """One clean pass: what :class:`_Clean` lists."""
    h = model.cfg.n_heads
    layers = range(model.cfg.n_layers)
    names = {act_name(k, l) for l in layers for k in ("attn_scores", "pattern")}
    logits, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    gates = {l: theory.sparse_mask(cache[act_name("pattern", l)], sparse_threshold) for l in layers}
    live = influential_rows(tokens, h).to(tokens.device)
    targets_next = T.next_token_targets(tokens)
    scored = targets_next != -100
    out = _Clean(gates, judged={l: gates[l] & live for l in layers},
                 tstar={l: cache[act_name("attn_scores", l)].argmax(-1) for l in layers},
                 targets_next=targets_next, scored=scored, clean=np.zeros(0),
                 total=scored.sum(-1).cpu().numpy().astype(np.float64))
    out.clean = out.per_problem(logits)
    return out


@torch.no_grad()
def collapse_consequence(
    model: HookedNormTransformer,
    tokens: Int[Tensor, "batch pos"] | Batch,
    levels: Sequence[float] | float = CONSEQUENCE_LEVELS,
    spec: Optional[ConsequenceSpec] = None,
    *,
    progress: bool = False,
    **overrides: Any,
) -> pd.DataFrame:
    """Per level, three rows (``group``): ``collapsed`` ((problem, draw) pairs with ≥ 1 collapsed
    sparse row), ``none`` (pairs without), ``difference`` (collapsed − none).

    Options: :class:`ConsequenceSpec` (``spec`` and/or its fields as keywords). A pair is ``collapsed`` when some clean-sparse row with query
    ≥ 1 that can reach a scored logit (:func:`~interp_norm.noise.accuracy.influential_rows`) has a
    different score argmax in that pass than in the clean run. Accuracy is per answer token
    (teacher-forced, ``]`` included), pooled over the group's pairs.

    Columns: ``variant``, ``attn_norm``, ``placement``, ``distribution``, ``targets``, ``level``,
    ``group``, ``n_pairs``, ``n_problems`` (distinct problems among them), ``share`` (of all pairs),
    ``clean_accuracy``, ``accuracy`` and ``accuracy_lo``/``_hi``, ``drop`` (clean − noisy accuracy,
    in points) and ``drop_lo``/``_hi``, ``n_draws``, ``n_boot``, ``confidence``. For
    ``difference``: each column is collapsed − none (``accuracy`` and ``clean_accuracy`` as
    fractions, ``drop`` in points), with the intervals of the differences (:func:`cluster_bootstrap` over problems).
    """
    sp = with_overrides(ConsequenceSpec, spec, overrides, who="collapse_consequence", error=NoiseSpecError)
    cfg = V.check_model(model)
    levels = V.check_levels(levels, sp.distribution)
    targets = V.check_targets(sp.targets, cfg, allowed=("q", "k"))
    placement = V.check_placement(sp.placement)
    n_draws = V.check_positive_int(sp.n_draws, "n_draws", NoiseSpecError)
    sparse_threshold = V.check_threshold(sp.sparse_threshold, "sparse_threshold")
    seed = V.check_seed(sp.seed)
    tokens = V.trimmed_tokens(tokens, model)
    ref = _clean_run(model, tokens, sparse_threshold)
    columns = dict(variant=V.variant_label(cfg, sp.variant), attn_norm=cfg.attn_norm, placement=placement,
                   distribution=sp.distribution, targets="".join(targets))
    rows = []
    bar = tqdm(total=len(levels) * n_draws, desc="collapse consequence", disable=not progress)
    for level in levels:
        noise = NormNoise(model, level, targets, distribution=sp.distribution, placement=placement, seed=seed,
                          row_gate=ref.gates)
        collapsed, noisy = _noisy_draws(model, tokens, noise, ref, n_draws, bar)
        rows += _group_rows(columns, level, collapsed, noisy, ref.clean, ref.total, n_boot=sp.n_boot,
                            confidence=sp.confidence, seed=seed)
    bar.close()
    return pd.DataFrame(rows)


def _noisy_draws(model: HookedNormTransformer, tokens: Tensor, noise: NormNoise, ref: _Clean, n_draws: int,
                 bar: Any) -> tuple[np.ndarray, np.ndarray]:
    """(collapsed [D, B]: some judged row's score argmax moved, noisy correct answer tokens [D, B]) over
    ``n_draws`` passes under ``noise``."""
    b = len(tokens)
    layers = range(model.cfg.n_layers)
    score_names = {act_name("attn_scores", l) for l in layers}
    collapsed = np.zeros((n_draws, b), dtype=bool)
    noisy = np.zeros((n_draws, b))
    with noise:
        for d in range(n_draws):
            lg, nc = model.run_with_cache(tokens, names_filter=lambda n: n in score_names)
            hit = torch.zeros(b, dtype=torch.bool, device=tokens.device)
            for l in layers:
                moved = (nc[act_name("attn_scores", l)].argmax(-1) != ref.tstar[l]) & ref.judged[l]
                hit |= moved.flatten(1).any(-1)
            collapsed[d], noisy[d] = hit.cpu().numpy(), ref.per_problem(lg)
            bar.update()
    return collapsed, noisy


def _group_rows(columns: dict, level: float, collapsed: np.ndarray, noisy: np.ndarray, clean: np.ndarray,
                total: np.ndarray, *, n_boot: int, confidence: float, seed: int) -> list[dict]:
    """The three rows of one level from per-(draw, problem) arrays [D, B] and per-problem clean/total [B]."""
    num, den = [], []
    for member in (collapsed, ~collapsed):
        m = member.astype(np.float64)
        num += [(m * noisy).sum(0), (m * clean).sum(0)]  # per problem: noisy and clean correct of its pairs
        den += [(m * total).sum(0)] * 2
    est, reps = bootstrap_ratios(np.array(num), np.array(den), n_boot, seed)  # noisy_c, clean_c, noisy_n, clean_n
    ci = lambda x: percentile_interval(x, confidence)  # noqa: E731
    acc = {"collapsed": (est[0], reps[:, 0]), "none": (est[2], reps[:, 2]),
           "difference": (est[0] - est[2], reps[:, 0] - reps[:, 2])}
    clean_acc = {"collapsed": est[1], "none": est[3], "difference": est[1] - est[3]}
    drop_c, drop_n = (est[1] - est[0], reps[:, 1] - reps[:, 0]), (est[3] - est[2], reps[:, 3] - reps[:, 2])
    drop = {"collapsed": drop_c, "none": drop_n, "difference": (drop_c[0] - drop_n[0], drop_c[1] - drop_n[1])}
    members = {"collapsed": collapsed, "none": ~collapsed, "difference": np.ones_like(collapsed)}
    out = []
    for group in ("collapsed", "none", "difference"):
        m = members[group]
        (a, a_reps), (dr, dr_reps) = acc[group], drop[group]
        a_lo, a_hi = ci(a_reps)
        d_lo, d_hi = ci(dr_reps)
        out.append(dict(columns, level=level, group=group, n_pairs=int(m.sum()), n_problems=int(m.any(0).sum()),
                        share=float(m.mean()), clean_accuracy=float(clean_acc[group]), accuracy=float(a),
                        accuracy_lo=a_lo, accuracy_hi=a_hi, drop=float(dr) * 100, drop_lo=d_lo * 100,
                        drop_hi=d_hi * 100, n_draws=collapsed.shape[0], n_boot=n_boot, confidence=confidence))
    return out


def run_collapse_consequence(
    model: HookedNormTransformer,
    task: Optional[AdditionTask] = None,
    levels: Sequence[float] | float = CONSEQUENCE_LEVELS,
    *,
    split: str = V.TEST_SPLIT,
    n_examples: int = 512,
    data_seed: int = V.TEST_SEED,
    **kwargs,
) -> pd.DataFrame:
    """:func:`collapse_consequence` on ``task.test_set(split, n_examples, seed=data_seed)``, with a
    ``split`` column; ``task`` defaults to the model's own (``model.task``)."""
    return V.on_test_set(collapse_consequence, model, task, levels, split=split, n_examples=n_examples,
                         data_seed=data_seed, who="run_collapse_consequence", **kwargs)


__all__ = ["CONSEQUENCE_LEVELS", "bootstrap_ratios", "percentile_interval", "cluster_bootstrap", "ConsequenceSpec",
           "collapse_consequence", "run_collapse_consequence"]
