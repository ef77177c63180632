"""How much the models' own q, k, v norms vary: the κ a multiplicative noise model would need.

Menary et al. (2024, §2.3) model Pre-Norm interference as v → (1+κ) v with κ uniform and small
(the accuracy sweep uses levels 0.1% to 30%, :data:`~interp_norm.core.defaults.DEFAULT_NOISE_LEVELS`).
:func:`norm_variation` measures the variation the trained model itself produces: per layer, head
and vector (q, k, v), for every token, the empirical κ̂ = ‖x‖ / median over tokens of ‖x‖ − 1,
i.e. the (1+κ) that would turn the head's typical norm into this token's norm. Where the model has a
per-head norm (QK-/QKV-Norm) it is measured twice: ``site="before_norm"`` on the projection's output
(``hook_q``; the place the noise experiments put κ by default) and ``site="after_norm"`` on what the
scores and values use (:func:`~interp_norm.core.hook_names.used_name`). Pre-Norm and No-Norm heads
have one site, ``before_norm`` (nothing sits between W_Q and the scores).

Choices (parameters): the typical norm is the **median** over tokens (robust to the few BOS-like
outliers; ``centre="mean"`` for the mean); the tokens are every non-padding position of the problems
(``positions="all"``) or only the positions whose next-token prediction is scored
(``positions="answer"``). The **matching uniform level** of a head is the RMS of its κ̂ (a
:class:`~interp_norm.noise.NormNoise` level is the RMS of κ, so uniform noise at that level has the same
second moment); ``level_p90`` is the uniform level whose central 90% has the width of κ̂'s
(uniform κ at level L has its 5% and 95% quantiles at ∓0.9·√3·L).

This is a description of the data, not a test of the noise model: the observed variation is
deterministic in the input and correlated across heads and tokens, which a κ drawn independently
per (token, head, vector) is not.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor

from interp_norm.core import task as T
from interp_norm.core.defaults import DEFAULT_NOISE_LEVELS
from interp_norm.core.hook_names import act_name, is_normalised, used_name
from interp_norm.core.model import HookedNormTransformer
from interp_norm.core.task import AdditionTask, Batch
from interp_norm.errors import NoiseSpecError
from interp_norm.noise import _validate as V

#: Quantiles of κ̂ reported per head.
QUANTILES: tuple[float, ...] = (0.05, 0.25, 0.5, 0.75, 0.95)
#: Which positions count as tokens: every non-padding one, or the scored answer positions only.
POSITIONS = ("all", "answer")
CENTRES = ("median", "mean")
_UNIFORM_P90 = 0.9 * math.sqrt(3.0)  # half-width of uniform κ's central 90%, per unit of RMS


def _check_quantiles(quantiles: Sequence[float]) -> tuple[float, ...]:
    qs = tuple(quantiles)
    if not qs or any(isinstance(q, bool) or not isinstance(q, (int, float)) or not 0.0 < q < 1.0 for q in qs):
        raise NoiseSpecError(f"quantiles must be fractions in (0, 1), got {list(qs)!r}; e.g. (0.05, 0.5, 0.95)")
    return qs


def _choice(value: str, choices: tuple[str, ...], name: str) -> str:
    if value not in choices:
        raise NoiseSpecError(f"unknown {name} {value!r}; choose one of {choices}")
    return value


def _sites(attn_norm: str, target: str, layer: int) -> list[tuple[str, str]]:
    """(site label, hook name) of ``target`` in ``layer``: before the norm, and after it where there is one."""
    out = [("before_norm", act_name(target, layer))]
    if is_normalised(attn_norm, target):
        out.append(("after_norm", used_name(attn_norm, target, layer)))
    return out


def _token_mask(tokens: Tensor, positions: str) -> Tensor:
    """Bool [batch, pos]: the positions whose norms are counted."""
    if positions == "answer":
        return T.answer_mask(tokens.cpu())
    return tokens.cpu() != T.PAD_ID


def _head_row(norms: np.ndarray, centre: str, quantiles: tuple[float, ...]) -> dict:
    typical = float(np.median(norms) if centre == "median" else norms.mean())
    kappa = norms / typical - 1.0
    row = dict(n_tokens=len(norms), typical_norm=typical, kappa_rms=float(np.sqrt(np.mean(kappa ** 2))))
    row.update({f"kappa_q{round(100 * q):02d}": float(np.quantile(kappa, q)) for q in quantiles})
    lo, hi = np.quantile(kappa, [0.05, 0.95])
    row["matching_level"] = row["kappa_rms"]
    row["level_p90"] = float((hi - lo) / 2 / _UNIFORM_P90)
    return row


@torch.no_grad()
def norm_variation(
    model: HookedNormTransformer,
    tokens: Int[Tensor, "batch pos"] | Batch,
    *,
    quantiles: Sequence[float] = QUANTILES,
    positions: str = "all",
    centre: str = "median",
    variant: Optional[str] = None,
) -> pd.DataFrame:
    """Per (layer, head, vector, site) the distribution of κ̂ = ‖x‖ / typical ‖x‖ − 1 over tokens.

    Columns: ``variant``, ``attn_norm``, ``layer``, ``head``, ``vector`` (q/k/v), ``site``
    (before_norm / after_norm), ``n_tokens``, ``typical_norm``, ``kappa_rms``, ``kappa_qNN`` per
    quantile, ``matching_level`` (= ``kappa_rms``: the uniform noise level with the same RMS) and
    ``level_p90`` (the uniform level with the same central 90% width). Module docstring: the choices.
    """
    cfg = V.check_model(model)
    qs = _check_quantiles(quantiles)
    _choice(positions, POSITIONS, "positions")
    _choice(centre, CENTRES, "centre")
    tokens = V.trimmed_tokens(tokens, model)
    mask = _token_mask(tokens, positions)
    if not mask.any():
        raise NoiseSpecError("no token positions to measure; pass problems with answers or positions='all'")
    sites = {(l, t): _sites(cfg.attn_norm, t, l) for l in range(cfg.n_layers) for t in ("q", "k", "v")}
    names = {name for s in sites.values() for _, name in s}
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    rows = []
    for (layer, target), pairs in sites.items():
        for site, name in pairs:
            norms = cache[name].double().norm(dim=-1).cpu()[mask]  # [tokens, head]
            for head in range(cfg.n_heads):
                rows.append(dict(variant=V.variant_label(cfg, variant), attn_norm=cfg.attn_norm, layer=layer,
                                 head=head, vector=target, site=site,
                                 **_head_row(norms[:, head].numpy(), centre, qs)))
    return pd.DataFrame(rows)


def run_norm_variation(
    model: HookedNormTransformer,
    task: Optional[AdditionTask] = None,
    *,
    split: str = "id",
    n_examples: int = 256,
    data_seed: int = V.TEST_SEED,
    **kwargs,
) -> pd.DataFrame:
    """:func:`norm_variation` on ``task.test_set(split, n_examples, seed=data_seed)`` (the model's own task by default)."""
    return V.on_test_set(norm_variation, model, task, split=split, n_examples=n_examples, data_seed=data_seed,
                         who="run_norm_variation", **kwargs)


def beside_levels(variation: pd.DataFrame, levels: Sequence[float] = DEFAULT_NOISE_LEVELS) -> pd.DataFrame:
    """The heads' matching levels beside the experiments' uniform levels: one row per (vector, site).

    Columns: ``n_heads``, ``median_level`` / ``min_level`` / ``max_level`` (over heads and layers of
    ``matching_level``) and, per experiment level L > 0, ``share_above_L``: the share of heads whose own
    variation is larger than uniform noise at level L (RMS).
    """
    keys = [k for k in ("variant", "attn_norm", "vector", "site") if k in variation.columns]
    out = []
    for key, g in variation.groupby(keys, sort=False):
        m = g["matching_level"].to_numpy(float)
        row = dict(zip(keys, key), n_heads=len(m), median_level=float(np.median(m)), min_level=float(m.min()),
                   max_level=float(m.max()))
        row.update({f"share_above_{level:g}": float((m > level).mean()) for level in levels if level > 0})
        out.append(row)
    return pd.DataFrame(out)


__all__ = ["QUANTILES", "POSITIONS", "CENTRES", "norm_variation", "run_norm_variation", "beside_levels"]
