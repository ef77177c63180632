"""Per-row predicted collapse probabilities, given how the noise reaches the scores.

Shared by the collapse sweeps of our models (:mod:`interp_norm.noise.collapse`) and of Hugging
Face bridges (:mod:`interp_norm.noise.bridge_collapse`), so both tables are judged by the same
prediction (:func:`predict_rows`) and the same errors (:func:`rate_summary`). What differs between models is only *how* noise on q and k reaches the scores —
the ``kind`` below — which the caller works out from its model's anatomy.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from interp_norm.errors import NoiseSpecError
from interp_norm.core.defaults import SPARSE_THRESHOLD
from interp_norm.theory.law import NoiseLaw, _as_law
from interp_norm.theory.probabilities import predicted_collapse_probability, predicted_collapse_probability_strict

#: How multiplicative noise on q and k reaches the scores:
#: "multiplicative" — the factors 1+κ multiply the scores (no norm after the noise);
#: "removed_by_norm" — a per-head norm after the noise divides it out (only a sign flip survives);
#: "not_modelled" — a norm mixes several heads' factors (OLMo-2's all-heads norm): no NoiseLaw fits.
THEORY_KINDS = ("multiplicative", "removed_by_norm", "not_modelled")


def predict_rows(
    w: Tensor, law: NoiseLaw, targets: Sequence[str], kind: Union[str, bool] = "multiplicative",
    strict_threshold: float = SPARSE_THRESHOLD, strict_samples: int = 256,
    *, generator: Optional[torch.Generator] = None, softcap: Optional[float] = None,
) -> tuple[Tensor, Tensor, float]:
    """Per-row predicted (loose, strict) collapse probabilities of clean rows ``w`` [R, K] (−inf
    masked), and the strict estimate's sample count (inf when exact or absent). NaN where the
    theory has no answer.

    ``kind`` one of :data:`THEORY_KINDS` (a bool is read as "removed_by_norm" if True, else
    "multiplicative", the older form). ``targets`` the noised vectors among "q", "k". Strict is a
    Monte Carlo of ``strict_samples`` per row (0: NaN) and NaN under a soft cap (``softcap``),
    which the theory's strict event does not include.
    """
    if isinstance(kind, bool):
        kind = "removed_by_norm" if kind else "multiplicative"
    if kind not in THEORY_KINDS:
        raise NoiseSpecError(f"unknown theory kind {kind!r}; choose one of {THEORY_KINDS}")
    law = _as_law(law)
    R = w.shape[0]
    zeros = torch.zeros(R, dtype=torch.float64)
    if law.level == 0 or R == 0:
        return zeros, zeros, math.inf
    if kind == "not_modelled":
        return zeros + math.nan, zeros + math.nan, math.inf
    if kind == "removed_by_norm":
        # the norm divides the noise out (effective factor 1 + O(eps)), except a sign flip when
        # 1+κ < 0 (normal law), which the norm keeps and no NoiseLaw describes
        p = zeros if law.prob_negative_factor < 1e-12 else zeros + math.nan
        return p, p, math.inf
    if "k" not in targets:  # query noise alone rescales the row; it reorders it only if 1+κ_q < 0
        flip = law.prob_negative_factor
        return zeros + flip, (zeros if flip == 0 else zeros + math.nan), math.inf
    query = "q" in targets
    loose = predicted_collapse_probability(w, law, include_query_noise=query).to(torch.float64)
    if strict_samples <= 0 or softcap:
        return loose, zeros + math.nan, math.inf
    if generator is None:
        generator = torch.Generator().manual_seed(0)
    strict = predicted_collapse_probability_strict(
        w, law, strict_threshold, strict_samples, generator, include_query_noise=query).to(torch.float64)
    return loose, strict, float(strict_samples)


def rate_summary(rates: Tensor, pred: Tensor, n_draws: int, ns: float) -> dict:
    """One row of a collapse table from per-row measured ``rates`` (fraction of ``n_draws`` draws
    that collapse) and per-row predictions ``pred`` whose strict estimate used ``ns`` samples (inf:
    exact): ``n_rows``, ``n_draws``, ``measured``, ``se`` (clustered by row: std of per-row rates /
    √n_rows), ``predicted``, ``mc_se`` = √(Σ p(1−p)(1/n_draws + 1/ns)) / n_rows (the sampling error
    of measured around predicted) and ``z`` = (measured − predicted) / mc_se. Here, not in each
    sweep, so that our models' and the bridges' tables are judged by one formula."""
    R = len(rates)
    measured = float(rates.mean()) if R else math.nan
    se = float(rates.std() / math.sqrt(R)) if R > 1 else math.nan
    predicted = float(pred.mean()) if R else math.nan
    var = (pred * (1 - pred)).sum() * (1.0 / n_draws + (0.0 if math.isinf(ns) else 1.0 / ns))
    mc_se = float(var.sqrt() / R) if R else math.nan
    z = (measured - predicted) / mc_se if mc_se > 0 else (0.0 if measured == predicted else math.nan)
    return dict(n_rows=R, n_draws=n_draws, measured=measured, se=se, predicted=predicted, mc_se=mc_se, z=z)


__all__ = ["THEORY_KINDS", "predict_rows", "rate_summary"]
