"""How much the models' own q, k, v norms vary: the κ a multiplicative noise model would need.

Menary et al. (2024, §2.3) model Pre-Norm interference as v → (1+κ) v with κ uniform and small
(the accuracy sweep uses levels 0.1% to 30%, :data:`~interp_norm.core.defaults.DEFAULT_NOISE_LEVELS`).
:func:`norm_variation` measures the variation the trained model itself produces: per layer, head
and vector (q, k, v), for every token, the empirical κ̂ = ‖x‖ / median over tokens of ‖x‖ − 1,
i.e. the (1+κ) that would turn the head's typical norm into this token's norm. Where the model has a
per-head norm (QK-/QKV-Norm) it is measured twice: ``site="before_norm"`` on the projection's output
(``hook_q``; the place the noise experiments put κ by default) and ``site="after_norm"`` on what the
scores and values use (:func:`~interp_norm.core.hook_names.used_name`). Pre-Norm and No-Norm heads
have one site, ``before_norm`` (nothing sits between W_Q and the scores). Where the hooks sit comes from
the model's :func:`~interp_norm.anatomy.anatomy`, so a TransformerLens bridge (Qwen3's QK-Norm, Gemma 4's
QKV-Norm, ...) is measured the same way, over every position of its text.

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
from typing import Any, Optional, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor

from interp_norm.anatomy import anatomy, canonical, capabilities
from interp_norm.core import task as T
from interp_norm.core.defaults import DEFAULT_NOISE_LEVELS, VARIANT_LABELS
from interp_norm.core.model import HookedNormTransformer
from interp_norm.core.task import AdditionTask, Batch
from interp_norm.errors import ConfigError, NoiseSpecError
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


def _sites(la) -> list[tuple[str, str, str, str]]:
    """(vector, site label, hook name, layout) of one layer's q, k, v, from its anatomy: the projection's
    output, and the per-head norm's output where the layer has one."""
    out = []
    for t in ("q", "k", "v"):
        out.append((t, "before_norm", la.hooks[t], la.layouts[t]))
        if la.norms.get(t) is not None and la.hooks.get(f"{t}_normed"):
            out.append((t, "after_norm", la.hooks[f"{t}_normed"], la.layouts[f"{t}_normed"]))
    return out


def _tokens_and_mask(model, tokens, positions: str) -> tuple[Tensor, Tensor]:
    """The tokens to run and Bool [batch, pos], the positions whose norms are counted: ours, the
    addition problems without padding (or their answer positions); any other model (a bridge), every
    position of the text."""
    if capabilities(model).full_vocabulary:  # ours: the model knows the addition task's padding
        V.check_model(model)
        tokens = V.trimmed_tokens(tokens, model)
        mask = T.answer_mask(tokens.cpu()) if positions == "answer" else tokens.cpu() != T.PAD_ID
        return tokens, mask
    if positions == "answer":
        raise NoiseSpecError("positions='answer' needs the addition task's problems; use positions='all' on text")
    if isinstance(tokens, Batch):
        tokens = tokens.tokens
    if not isinstance(tokens, Tensor) or tokens.ndim != 2:
        raise ConfigError("tokens must be a Batch or a [batch, pos] token tensor")
    return tokens, torch.ones(tokens.shape, dtype=torch.bool)


def _head_row(norms: np.ndarray, centre: str, quantiles: tuple[float, ...]) -> dict:
    typical = float(np.median(norms) if centre == "median" else norms.mean())
    kappa = norms / typical - 1.0
    row = dict(n_tokens=len(norms), typical_norm=typical, kappa_rms=float(np.sqrt(np.mean(kappa ** 2))))
    row.update({f"kappa_q{round(100 * q):02d}": float(np.quantile(kappa, q)) for q in quantiles})
    lo, hi = np.quantile(kappa, [0.05, 0.95])
    row["matching_level"] = row["kappa_rms"]
    row["level_p90"] = float((hi - lo) / 2 / _UNIFORM_P90)
    return row


def norm_variation(
    model: Any,
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
    ``level_p90`` (the uniform level with the same central 90% width). Any model the anatomy knows (ours or
    a TransformerLens bridge; on a bridge k and v have the key/value heads, and every position counts).
    Module docstring: the choices.
    """
    qs = _check_quantiles(quantiles)
    _choice(positions, POSITIONS, "positions")
    _choice(centre, CENTRES, "centre")
    tokens, mask = _tokens_and_mask(model, tokens, positions)
    if not mask.any():
        raise NoiseSpecError("no token positions to measure; pass problems with answers or positions='all'")
    an = anatomy(model)
    sites = [(la, *site) for la in an.layers for site in _sites(la)]
    names = {name for _, _, _, name, _ in sites}
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    attn_norm = an.layers[0].placement if an.layers else ""
    label = variant if variant is not None else VARIANT_LABELS.get(attn_norm, attn_norm)
    rows = []
    for la, target, site, name, layout in sites:
        heads = la.n_heads if target == "q" else la.n_kv_heads
        x = canonical(cache[name], layout, heads, la.d_head)  # [b, p, head, d_head]
        norms = x.double().norm(dim=-1).cpu()[mask]  # [tokens, head]
        for head in range(heads):
            rows.append(dict(variant=label, attn_norm=attn_norm, layer=la.layer, head=head, vector=target, site=site,
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
