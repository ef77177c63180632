"""Circuit-collapse theory: pure functions of attention scores and a noise law.

Nothing here touches a model or a hook. The inputs are the clean pre-softmax scores of attention
rows (``hook_attn_scores``: already scaled, masked keys set to ``-inf``), a multiplicative noise
law on the norms of q and k_t, or attention patterns. Everything follows Menary, Kaski & Freitas
(2024, arXiv 2406.17837), their theory of norm noise and circuit collapse:

* Pre-Norm interference is modelled as multiplicative noise on the norms, q → (1+κ_q) q and
  k_t → (1+κ_t) k_t, so a score becomes w_t → (1+κ_q)(1+κ_t) w_t (Theorem 7's model).
* **Circuit collapse**: a sparse distribution (max_t a_t ≥ 95%) picks another token because of
  the noise. The "loose" definition only asks that the argmax changes; the "strict" one also asks
  that the new token gets ≥ 95% attention (the paper's thresholds).

Why exact formulas rather than only Theorem 7's first-order one: the query factor (1+κ_q)
multiplies every score in a row, so for 1+κ_q > 0 it cancels exactly from the argmax. The
first-order form keeps κ_q in λ_w and so disagrees with the true argmax at finite noise.

Masked keys must be ``-inf`` (as in ``HookedNormTransformer``). A finite sentinel such as −1e5 is
treated as a real (very negative) score; under normal noise with 1+κ_q < 0 such a key could win.
Scores must not have been shifted by a constant: softmax ignores shifts, multiplicative noise
does not.
"""

from __future__ import annotations

from interp_norm.theory.law import NoiseLaw, sample_kappa
from interp_norm.core.defaults import DISTRIBUTIONS
from interp_norm.theory.conditions import (  # noqa: F401
    collapse_condition_exact, collapse_condition_first_order, critical_ratio, small_angle_threshold, collapse_condition_small_angle,
)
from interp_norm.theory.probabilities import (  # noqa: F401
    predicted_collapse_probability, predicted_collapse_probability_strict, collapse_probability_small_angle, noise_level_at_rate, sparse_mask, nonsparse_mask,
)
from interp_norm.theory.rows import THEORY_KINDS, predict_rows, rate_summary  # noqa: F401

__all__ = [
    "DISTRIBUTIONS",
    "NoiseLaw",
    "sample_kappa",
    "collapse_condition_exact",
    "collapse_condition_first_order",
    "critical_ratio",
    "small_angle_threshold",
    "collapse_condition_small_angle",
    "predicted_collapse_probability",
    "predicted_collapse_probability_strict",
    "collapse_probability_small_angle",
    "noise_level_at_rate",
    "sparse_mask",
    "nonsparse_mask",
    "THEORY_KINDS",
    "predict_rows",
    "rate_summary",
]
