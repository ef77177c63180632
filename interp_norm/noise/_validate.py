"""Argument checks shared by the noise modules: each bad value -> NoiseSpecError/ConfigError with the fix."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
from torch import Tensor

from interp_norm import theory
from interp_norm.core.checks import require_norm_model
from interp_norm.errors import ConfigError, NoiseSpecError
from interp_norm.core.scoring import trim_padding
from interp_norm.core.defaults import PLACEMENTS, VARIANT_LABELS
from interp_norm.core.model import HookedNormTransformer, ModelConfig
from interp_norm.core.task import Batch, task_for
from interp_norm.theory import NoiseLaw

#: What the noise can act on: q, k, v (= the message m = W_O v) and the Pre-Norm divisor.
TARGETS = ("q", "k", "v", "scale")
ALIASES = {"m": "v", "message": "v", "query": "q", "key": "k", "value": "v"}
TARGET_CODE = {"q": 0, "k": 1, "v": 2, "scale": 3}
SHARED_CODE = 4  # the stream of NormNoise(shared=True): one κ per token for every head and target
DIRECTION_CODE = 16  # + TARGET_CODE: the unit vectors of NormNoise(direction="random")
#: What ``NormNoise(direction=...)`` can perturb: the norm (x → (1+κ)x) or a random direction.
DIRECTIONS = ("norm", "random")
#: Where noise on q/k/v enters a QK-/QKV-Norm model: before the per-head norm or after it.


def check_model(model: HookedNormTransformer) -> ModelConfig:
    return require_norm_model(model, "norm noise")


def check_distribution(distribution: str) -> str:
    if distribution not in theory.DISTRIBUTIONS:
        raise NoiseSpecError(f"unknown noise distribution {distribution!r}; use one of {theory.DISTRIBUTIONS}")
    return distribution


def number_tuple(values, not_numbers: str, empty: str) -> tuple:
    """``values`` as a non-empty tuple, one number (not a bool) becoming a 1-tuple; NoiseSpecError
    ``"<not_numbers>, got <values>"`` when it is not iterable, ``empty`` when it is empty. The one
    reading of "a number or a list of them" (noise levels, score multipliers); each checks its items."""
    if isinstance(values, (int, float, np.floating, np.integer)) and not isinstance(values, bool):
        values = (values,)
    try:
        values = tuple(values)
    except TypeError:
        raise NoiseSpecError(f"{not_numbers}, got {values!r}") from None
    if not values:
        raise NoiseSpecError(empty)
    return values


def check_levels(levels: Sequence[float] | float, distribution: str) -> tuple[float, ...]:
    """Each level through :class:`NoiseLaw` (NaN, negative, uniform ≥ 1/√3 → NoiseSpecError)."""
    levels = number_tuple(levels, "noise levels must be a number or a list of numbers",
                          "no noise levels given; pass e.g. levels=(0, 0.01, 0.1)")
    return tuple(NoiseLaw(lv, check_distribution(distribution)).level for lv in levels)


def check_targets(targets: str | Sequence[str], cfg: Optional[ModelConfig], allowed: Sequence[str] = TARGETS) -> tuple[str, ...]:
    """Target names (aliases resolved, ``"qk"`` split), deduplicated, in q, k, v, scale order.

    ``cfg`` None skips the model-specific check (``scale`` exists only in Pre-Norm models).
    """
    if isinstance(targets, str):
        if targets in TARGETS or targets in ALIASES:
            targets = (targets,)
        elif targets and set(targets) <= {"q", "k", "v"}:
            targets = tuple(targets)  # "qk" -> ("q", "k")
        else:
            targets = (targets,)
    try:
        items = list(targets)
    except TypeError:
        raise NoiseSpecError(f"targets must be names from {allowed}, got {targets!r}") from None
    out = []
    for t in items:
        t = ALIASES.get(t, t) if isinstance(t, str) else t
        if t not in allowed:
            raise NoiseSpecError(f"unknown noise target {t!r}; choose targets from {tuple(allowed)} ('m' = 'v', the message)")
        if t == "scale" and cfg is not None and cfg.attn_norm != "pre":
            raise NoiseSpecError(
                f"target 'scale' is the Pre-Norm scale factor (ln1.hook_scale), but this model has "
                f"attn_norm={cfg.attn_norm!r}; use targets among ('q', 'k', 'v') or a Pre-Norm model"
            )
        if t not in out:
            out.append(t)
    if not out:
        raise NoiseSpecError(f"no noise targets given; choose from {tuple(allowed)}")
    return tuple(sorted(out, key=TARGET_CODE.__getitem__))


def check_control(shared: bool, direction: str, targets: tuple[str, ...], gated: bool) -> tuple[bool, str]:
    """NormNoise's ``shared`` / ``direction`` options, checked against the targets and a row gate."""
    if not isinstance(shared, bool):
        raise NoiseSpecError(f"shared must be True or False, got {shared!r}")
    if direction not in DIRECTIONS:
        raise NoiseSpecError(f"unknown direction {direction!r}; choose one of {DIRECTIONS}")
    if "scale" in targets and (shared or direction != "norm"):
        raise NoiseSpecError("target 'scale' is already one κ per token on the Pre-Norm divisor; use shared=True or "
                             "direction='random' with targets among ('q', 'k', 'v')")
    if gated and direction != "norm":
        raise NoiseSpecError("row_gate acts on attention scores, which only norm noise can be moved to; "
                             "drop row_gate or use direction='norm'")
    return shared, direction


def check_index_list(values: Optional[int | Sequence[int]], n: int, what: str) -> tuple[int, ...]:
    """Indices in [0, n), sorted and deduplicated; None -> all n."""
    if values is None:
        return tuple(range(n))
    return _indices(values, what, n)


def check_index_form(values: int | Sequence[int], what: str) -> tuple[int, ...]:
    """Non-negative ints, sorted and deduplicated, for when the model (and so the range) is not known yet."""
    return _indices(values, what, None)


def _indices(values: int | Sequence[int], what: str, n: Optional[int]) -> tuple[int, ...]:
    choices = f"in [0, {n})" if n is not None else ""
    if isinstance(values, (int, np.integer)) and not isinstance(values, bool):
        values = (int(values),)
    try:
        values = list(values)
    except TypeError:
        raise NoiseSpecError(f"{what}s must be an int or a list of ints {choices}, got {values!r}".replace("  ", " ")) from None
    if not values:
        if n is not None:
            raise NoiseSpecError(f"no {what}s selected; pass None for all {n} or some of {list(range(n))}")
        raise NoiseSpecError(f"no {what}s selected; pass None for all of them or a list of {what} indices")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise NoiseSpecError(f"{what} {v!r} is not a {what} index; pass non-negative ints (or None for all)")
        if n is not None and v >= n:
            raise NoiseSpecError(f"{what} {v!r} is out of range; this model has {n} {what}s, choose from {list(range(n))}")
    return tuple(sorted({int(v) for v in values}))


def check_placement(placement: str) -> str:
    if placement not in PLACEMENTS:
        raise NoiseSpecError(f"unknown placement {placement!r}; choose one of {PLACEMENTS}")
    return placement


def check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise NoiseSpecError(f"seed must be a non-negative integer, got {seed!r}")
    return int(seed)


def check_positive_int(value: int, name: str, error: type = ConfigError) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise error(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_threshold(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < float(value) <= 1.0:
        raise NoiseSpecError(f"{name} must be a fraction in (0, 1], got {value!r}")
    return float(value)


def variant_label(cfg: ModelConfig, variant: Optional[str]) -> str:
    return variant if variant is not None else VARIANT_LABELS.get(cfg.attn_norm, cfg.attn_norm)


def trimmed_tokens(tokens: Tensor | Batch, model: HookedNormTransformer) -> Tensor:
    """[batch, pos] tokens on the model's device, without the padding columns every example shares."""
    if isinstance(tokens, Batch):
        tokens = tokens.tokens
    if not isinstance(tokens, Tensor) or tokens.ndim != 2:
        raise ConfigError("tokens must be a Batch or a [batch, pos] token tensor")
    return trim_padding(tokens).to(model.W_E.device)


#: The test set every ``run_*`` of the collapse family reads by default (the same problems for all).
TEST_SPLIT, TEST_EXAMPLES, TEST_SEED = "id", 256, 1234


def on_test_set(measure, model, task, *args, split: str, n_examples: int, data_seed: int, who: str, **kwargs):
    """``measure(model, task.test_set(split, n_examples, seed=data_seed), *args, **kwargs)`` with a
    ``split`` column: the one-call ``run_*`` form (named ``who``) of every tokens-level measurement.
    ``task`` None means the model's own (:func:`interp_norm.core.task.task_for`)."""
    task = task_for(model, task, who=who, stacklevel=4)  # warns at the caller of run_*
    n_examples = check_positive_int(n_examples, "n_examples")
    df = measure(model, task.test_set(split, n_examples, seed=data_seed), *args, **kwargs)
    df.insert(5, "split", split)
    return df


def dataset_tokens(datasets) -> list[Tensor]:
    """The ``[batch, pos]`` token tensors of a non-empty list of datasets (Batches or tensors)."""
    if isinstance(datasets, (Batch, Tensor)) or not datasets:
        raise ConfigError("datasets must be a non-empty list; pass e.g. [task.test_set('id', 512, seed=s) for s in range(3)]")
    toks = []
    for d in datasets:
        t = d.tokens if isinstance(d, Batch) else d
        if not isinstance(t, Tensor) or t.ndim != 2:
            raise ConfigError("each dataset must be a Batch or a [batch, pos] token tensor")
        toks.append(t)
    return toks
