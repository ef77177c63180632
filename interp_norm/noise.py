"""Norm noise: hooks that jitter L2 norms, accuracy under noise, and circuit collapse.

Menary et al. (2024) model Pre-Norm interference as multiplicative noise on the L2 norms of
queries, keys and values (digest §2.3): v → (1+κ) v with κ drawn independently per (example,
position, layer, head, vector). This module turns that model into an instrument:

* :class:`NormNoise` — the hooks. A plain hook list (``model.run_with_hooks(..., fwd_hooks=
  noise.hooks())``) or a context manager (``with NormNoise(model, 0.01): model(tokens)``).
  Targets ``q``, ``k``, ``v`` (= the message, since m = W_O v is linear) and ``scale`` (the
  Pre-Norm divisor ``ln1.hook_scale`` itself). Uniform (the paper's) or normal κ; the noise
  *level* is the RMS of κ. Optional ``row_gate`` restricts q/k noise to chosen attention rows.
* :func:`run_noise` — per-token accuracy vs noise level, all layers at once, mean ± standard
  error over independent datasets, with the paper's sparse-only / non-sparse-only variants.
* :func:`run_collapse` — the paper's circuit-collapse protocol, measured from a clean cache
  without re-running the model, with the theory's prediction beside every measured rate;
  :func:`collapse_thresholds` gives the noise level where 1% of sparse rows collapse.

Placement in QK-/QKV-Norm models (``placement``). ``"before_norm"`` (default) puts the noise on
``hook_q/hook_k/hook_v``, the outputs of W_Q/W_K/W_V — the same physical place as in the Pre-Norm
model, where interference arrives from upstream — and the per-head norm then removes it up to
eps. This is the reading under which the paper can call QKV-Norm "stable by construction" and see
"only jitter due to finite sampling". ``"after_norm"`` puts it on ``hook_q_normed`` etc., asking
how fragile QKV-Norm's attention *would* be if noise survived the norm. Pre-Norm and No-Norm
models have no norm between W_Q and the scores, so both placements are ``hook_q/hook_k/hook_v``;
QK-Norm has no value norm, so ``v`` noise always lands on ``hook_v``.

Seeding: the κ of forward pass n (counted per :class:`NormNoise` object) at (layer, target) comes
from a generator seeded by ``(seed, layer, target, n)``, so draws do not depend on which other
targets, layers or heads are noised. κ = level · z with z of unit RMS: the same seed gives
proportional κ at every level (common random numbers make noise curves smooth).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from interp_norm import task as T
from interp_norm import theory
from interp_norm.errors import ConfigError, NoiseSpecError
from interp_norm.model import HookedNormTransformer, ModelConfig
from interp_norm.task import AdditionTask, Batch
from interp_norm.theory import NoiseLaw

__all__ = [
    "TARGETS",
    "PLACEMENTS",
    "NOISED_ROWS",
    "DEFAULT_NOISE_LEVELS",
    "DEFAULT_COLLAPSE_LEVELS",
    "VARIANT_LABELS",
    "NormNoise",
    "norm_noise_hooks",
    "unit_noise",
    "effective_factor",
    "noise_hook_name",
    "clean_row_gates",
    "accuracy_under_noise",
    "run_noise",
    "collapse_from_scores",
    "collapse_noise_draws",
    "LayerCollapse",
    "collapse_decisions",
    "measure_collapse",
    "run_collapse",
    "collapse_thresholds",
]

TARGETS = ("q", "k", "v", "scale")
_ALIASES = {"m": "v", "message": "v", "query": "q", "key": "k", "value": "v"}
_TARGET_CODE = {"q": 0, "k": 1, "v": 2, "scale": 3}
PLACEMENTS = ("before_norm", "after_norm")
NOISED_ROWS = ("all", "sparse", "nonsparse")
# The paper's accuracy sweep (0, 0.1%, 0.3%, 1%, 3%, 10%, 30%).
DEFAULT_NOISE_LEVELS = (0.0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3)
# Dense around the paper's 1%-collapse levels (7.5%–17%); uniform needs level < 1/√3 ≈ 0.577.
DEFAULT_COLLAPSE_LEVELS = (0.01, 0.02, 0.03, 0.05, 0.07, 0.1, 0.13, 0.17, 0.2, 0.3, 0.4, 0.5)
VARIANT_LABELS = {"pre": "Pre-Norm", "qkv": "QKV-Norm", "qk": "QK-Norm", "none": "No-Norm"}
_SQRT3 = math.sqrt(3.0)
_CHUNK = 1 << 22  # elements per vectorised block in the collapse sweep


# ----------------------------------------------------------------------------- validation


def _check_model(model: HookedNormTransformer) -> ModelConfig:
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, ModelConfig) or not hasattr(model, "hook_dict"):
        raise NoiseSpecError(f"expected a HookedNormTransformer, got {type(model).__name__}")
    return cfg


def _check_distribution(distribution: str) -> str:
    if distribution not in theory.DISTRIBUTIONS:
        raise NoiseSpecError(f"unknown noise distribution {distribution!r}; use one of {theory.DISTRIBUTIONS}")
    return distribution


def _check_levels(levels: Sequence[float] | float, distribution: str) -> tuple[float, ...]:
    """Each level through :class:`NoiseLaw` (NaN, negative, uniform ≥ 1/√3 → NoiseSpecError)."""
    if isinstance(levels, (int, float, np.floating, np.integer)) and not isinstance(levels, bool):
        levels = (levels,)
    try:
        levels = tuple(levels)
    except TypeError:
        raise NoiseSpecError(f"noise levels must be a number or a list of numbers, got {levels!r}") from None
    if not levels:
        raise NoiseSpecError("no noise levels given; pass e.g. levels=(0, 0.01, 0.1)")
    return tuple(NoiseLaw(lv, _check_distribution(distribution)).level for lv in levels)


def _check_targets(targets: str | Sequence[str], cfg: ModelConfig, allowed: Sequence[str] = TARGETS) -> tuple[str, ...]:
    if isinstance(targets, str):
        if targets in TARGETS or targets in _ALIASES:
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
        t = _ALIASES.get(t, t) if isinstance(t, str) else t
        if t not in allowed:
            raise NoiseSpecError(f"unknown noise target {t!r}; choose from {tuple(allowed)} ('m' = 'v', the message)")
        if t == "scale" and cfg.attn_norm != "pre":
            raise NoiseSpecError(
                f"target 'scale' is the Pre-Norm scale factor (ln1.hook_scale), but this model has "
                f"attn_norm={cfg.attn_norm!r}; use targets among ('q', 'k', 'v') or a Pre-Norm model"
            )
        if t not in out:
            out.append(t)
    if not out:
        raise NoiseSpecError(f"no noise targets given; choose from {tuple(allowed)}")
    return tuple(sorted(out, key=_TARGET_CODE.__getitem__))


def _check_index_list(values: Optional[int | Sequence[int]], n: int, what: str) -> tuple[int, ...]:
    if values is None:
        return tuple(range(n))
    if isinstance(values, (int, np.integer)) and not isinstance(values, bool):
        values = (int(values),)
    try:
        values = list(values)
    except TypeError:
        raise NoiseSpecError(f"{what}s must be an int or a list of ints in [0, {n}), got {values!r}") from None
    if not values:
        raise NoiseSpecError(f"no {what}s selected; pass None for all {n} or some of {list(range(n))}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v < n:
            raise NoiseSpecError(f"{what} {v!r} is out of range; this model has {n} {what}s, choose from {list(range(n))}")
    return tuple(sorted({int(v) for v in values}))


def _check_placement(placement: str) -> str:
    if placement not in PLACEMENTS:
        raise NoiseSpecError(f"unknown placement {placement!r}; choose one of {PLACEMENTS}")
    return placement


def _check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise NoiseSpecError(f"seed must be a non-negative integer, got {seed!r}")
    return int(seed)


def _check_positive_int(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _check_threshold(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < float(value) <= 1.0:
        raise NoiseSpecError(f"{name} must be a fraction in (0, 1], got {value!r}")
    return float(value)


def _is_normalised(cfg: ModelConfig, target: str) -> bool:
    """Whether a per-head norm sits between W_{Q,K,V} and the scores/values for this target."""
    return (cfg.attn_norm == "qkv" and target in ("q", "k", "v")) or (cfg.attn_norm == "qk" and target in ("q", "k"))


def noise_hook_name(cfg: ModelConfig, layer: int, target: str, placement: str = "before_norm") -> str:
    """The hook point where noise on ``target`` of ``layer`` is applied (see the module docstring)."""
    if target == "scale":
        return f"blocks.{layer}.ln1.hook_scale"
    if placement == "after_norm" and _is_normalised(cfg, target):
        return f"blocks.{layer}.attn.hook_{target}_normed"
    return f"blocks.{layer}.attn.hook_{target}"


def _variant(cfg: ModelConfig, variant: Optional[str]) -> str:
    return variant if variant is not None else VARIANT_LABELS.get(cfg.attn_norm, cfg.attn_norm)


# ----------------------------------------------------------------------------- draws


def _generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded from a tuple of non-negative ints (NumPy's SeedSequence mixing)."""
    state = np.random.SeedSequence([int(k) for k in keys]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state) & 0x7FFF_FFFF_FFFF_FFFF)


def unit_noise(
    shape: Sequence[int], generator: torch.Generator, distribution: str = "uniform", dtype: torch.dtype = torch.float32
) -> Tensor:
    """Draws z with RMS 1 (uniform on ±√3 or standard normal); κ = level · z has RMS ``level``."""
    _check_distribution(distribution)
    if distribution == "uniform":
        return (2.0 * torch.rand(tuple(shape), generator=generator, dtype=dtype) - 1.0) * _SQRT3
    return torch.randn(tuple(shape), generator=generator, dtype=dtype)


def effective_factor(kappa: Tensor, scale: Tensor, eps: float) -> Tensor:
    """What noise (1+κ) on x *before* a norm leaves on the normalised vector.

    With divisor s = sqrt(m + eps) (m = mean(x²), or the variance for LayerNorm; both scale by
    (1+κ)²), N((1+κ)x) = f · N(x) with f = (1+κ)·s / sqrt((1+κ)²(s² − eps) + eps). So f → sign(1+κ)
    as eps → 0: the norm removes the noise "by construction", and only an eps-sized residue
    (|f − 1| ≲ |κ|·eps/m) survives. ``scale`` is the clean ``hook_{q,k,v}_scale``.
    """
    one = 1.0 + kappa
    m = (scale * scale - eps).clamp(min=0.0)
    return one * scale / torch.sqrt(one * one * m + eps)


# ----------------------------------------------------------------------------- hooks


class NormNoise:
    """Multiply the L2 norm of chosen vectors by (1+κ), κ = level · z, z of unit RMS.

    Parameters: ``level`` (RMS of κ); ``targets`` any of ``"q"``, ``"k"``, ``"v"`` (alias ``"m"``),
    ``"scale"`` (Pre-Norm only: the divisor ``ln1.hook_scale`` [b, p, 1] times (1+κ), so q, k and
    v of that position shrink by 1/(1+κ); one κ per (example, position, layer), shared by all
    heads and by q, k and v — which is how Pre-Norm interference actually arrives); ``distribution`` ``"uniform"`` (the paper's) or ``"normal"``; ``layers`` and
    ``heads`` (None = all; unselected heads get κ = 0 exactly); ``placement`` (module docstring);
    ``seed``.

    ``row_gate``: ``{layer: Bool[batch, head, query]}`` restricts q/k noise to those attention
    rows (the paper's "noise only on sparse / non-sparse distributions"). A key is read by many
    rows, so gating cannot be done on the vectors; instead the layer's scores of gated rows become
    f_q·f_k·w — exactly what scaling q and k by f gives — and other rows keep their scores. f is
    1+κ, or :func:`effective_factor` for ``placement="before_norm"`` on a normalised q/k, so gating
    all rows reproduces ungated noise up to rounding. Gating applies to q and k only.

    After each forward pass, ``last_kappa[(layer, target)]`` holds the κ used ([b, p, h, 1], or
    [b, p, 1] for ``scale``).
    """

    def __init__(
        self,
        model: HookedNormTransformer,
        level: float,
        targets: str | Sequence[str] = ("q", "k", "v"),
        *,
        distribution: str = "uniform",
        layers: Optional[int | Sequence[int]] = None,
        heads: Optional[int | Sequence[int]] = None,
        placement: str = "before_norm",
        seed: int = 0,
        row_gate: Optional[Mapping[int, Tensor]] = None,
    ):
        cfg = _check_model(model)
        self.model, self.cfg = model, cfg
        self.law = NoiseLaw(level, _check_distribution(distribution))
        self.targets = _check_targets(targets, cfg)
        self.placement = _check_placement(placement)
        self.seed = _check_seed(seed)
        if row_gate is not None:
            if not isinstance(row_gate, Mapping) or not row_gate:
                raise NoiseSpecError("row_gate must be a non-empty dict {layer: Bool[batch, head, query] tensor}")
            if layers is None:
                layers = sorted(row_gate)
            bad = [t for t in self.targets if t not in ("q", "k")]
            if bad:
                raise NoiseSpecError(
                    f"row_gate restricts noise on attention rows, which only q and k noise can do; "
                    f"drop targets {bad} or drop row_gate"
                )
        self.layers = _check_index_list(layers, cfg.n_layers, "layer")
        self.heads = _check_index_list(heads, cfg.n_heads, "head")
        if "scale" in self.targets and heads is not None and len(self.heads) < cfg.n_heads:
            raise NoiseSpecError(
                "the Pre-Norm scale factor is shared by all heads of a layer, so it cannot be noised "
                "per head; pass heads=None with target 'scale'"
            )
        self.row_gate = None
        if row_gate is not None:
            missing = [l for l in self.layers if l not in row_gate]
            if missing:
                raise NoiseSpecError(f"row_gate has no gate for layers {missing}; give one per noised layer")
            gates = {}
            for l in self.layers:
                g = row_gate[l]
                if not isinstance(g, Tensor) or g.dtype != torch.bool or g.ndim != 3 or g.shape[1] != cfg.n_heads:
                    raise NoiseSpecError(
                        f"row_gate[{l}] must be a bool tensor [batch, n_heads={cfg.n_heads}, query], "
                        f"got {getattr(g, 'shape', type(g).__name__)}"
                    )
                gates[l] = g
            self.row_gate = gates
        self.last_kappa: dict[tuple[int, str], Tensor] = {}
        self._calls: dict[tuple[int, str], int] = {}
        self._scales: dict[tuple[int, str], Tensor] = {}
        self._ctx = None

    @property
    def level(self) -> float:
        return self.law.level

    def reset(self) -> None:
        """Restart the forward-pass counter: the next pass reuses the first pass's draws."""
        self._calls.clear()
        self.last_kappa.clear()

    def hook_names(self) -> dict[tuple[int, str], str]:
        """(layer, target) → hook point where the vector noise lands (without ``row_gate``)."""
        return {(l, t): noise_hook_name(self.cfg, l, t, self.placement) for l in self.layers for t in self.targets}

    def draw(self, layer: int, target: str, shape: Sequence[int], call: int = 0, dtype: torch.dtype = torch.float32) -> Tensor:
        """κ for (layer, target) in forward pass ``call``; unselected heads (dim 2 of q/k/v) get 0."""
        z = unit_noise(shape, _generator(self.seed, layer, _TARGET_CODE[target], call), self.law.distribution, dtype)
        kappa = z * self.law.level
        if target != "scale" and len(self.heads) < self.cfg.n_heads:
            keep = torch.zeros(self.cfg.n_heads, dtype=torch.bool)
            keep[list(self.heads)] = True
            kappa = kappa * keep.view(1, 1, -1, 1).to(dtype)
        return kappa

    def _next(self, layer: int, target: str, shape: Sequence[int], like: Tensor) -> Tensor:
        call = self._calls.get((layer, target), 0)
        self._calls[(layer, target)] = call + 1
        kappa = self.draw(layer, target, shape, call, like.dtype).to(like.device)
        self.last_kappa[(layer, target)] = kappa
        return kappa

    def _vector_hook(self, layer: int, target: str) -> Callable:
        def hook(act: Tensor, hook=None) -> Tensor:
            shape = (*act.shape[:-1], 1)  # [b, p, h, 1] or [b, p, 1] for the scale
            return act * (1.0 + self._next(layer, target, shape, act))

        return hook

    def _store_hook(self, layer: int, target: str) -> Callable:
        def hook(act: Tensor, hook=None) -> None:
            self._scales[(layer, target)] = act

        return hook

    def _factor(self, layer: int, target: str, b: int, n: int, like: Tensor) -> Tensor:
        """Per-vector factor [b, h, p] on the scores for q or k of this layer."""
        kappa = self._next(layer, target, (b, n, self.cfg.n_heads, 1), like)
        if self.placement == "before_norm" and _is_normalised(self.cfg, target):
            f = effective_factor(kappa, self._scales[(layer, target)], self.cfg.eps)
        else:
            f = 1.0 + kappa
        return f[..., 0].permute(0, 2, 1)

    def _gate_hook(self, layer: int) -> Callable:
        def hook(scores: Tensor, hook=None) -> Tensor:
            b, h, n, _ = scores.shape
            gate = self.row_gate[layer]
            if gate.shape[0] != b or gate.shape[2] < n:
                raise NoiseSpecError(
                    f"row_gate[{layer}] has shape {tuple(gate.shape)} but the scores are [b={b}, h={h}, q={n}]; "
                    "build the gate from a clean run on the same tokens (see clean_row_gates)"
                )
            ones = torch.ones(b, h, n, dtype=scores.dtype, device=scores.device)
            fq = self._factor(layer, "q", b, n, scores) if "q" in self.targets else ones
            fk = self._factor(layer, "k", b, n, scores) if "k" in self.targets else ones
            factor = fq[..., :, None] * fk[..., None, :]
            factor = torch.where(gate[:, :, :n, None].to(scores.device), factor, torch.ones_like(factor))
            return (scores * factor).masked_fill(torch.isneginf(scores), -math.inf)

        return hook

    def hooks(self) -> list[tuple[str, Callable]]:
        """``[(hook_name, fn), ...]`` for ``run_with_hooks`` / ``model.hooks``."""
        out = []
        for l in self.layers:
            if self.row_gate is None:
                out += [(noise_hook_name(self.cfg, l, t, self.placement), self._vector_hook(l, t)) for t in self.targets]
                continue
            if self.placement == "before_norm":
                for t in self.targets:
                    if _is_normalised(self.cfg, t):
                        out.append((f"blocks.{l}.attn.hook_{t}_scale", self._store_hook(l, t)))
            out.append((f"blocks.{l}.attn.hook_attn_scores", self._gate_hook(l)))
        for name, _ in out:
            if name not in self.model.hook_dict:
                raise NoiseSpecError(f"hook {name!r} does not exist on this model (attn_norm={self.cfg.attn_norm!r})")
        return out

    def __enter__(self) -> "NormNoise":
        if self._ctx is not None:
            raise NoiseSpecError("this NormNoise is already active; exit it before entering again")
        self._ctx = self.model.hooks(fwd_hooks=self.hooks())
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        ctx, self._ctx = self._ctx, None
        self._scales.clear()
        ctx.__exit__(*exc)


def norm_noise_hooks(model: HookedNormTransformer, level: float, targets: str | Sequence[str] = ("q", "k", "v"), **kwargs) -> list[tuple[str, Callable]]:
    """Shorthand: ``NormNoise(model, level, targets, **kwargs).hooks()``."""
    return NormNoise(model, level, targets, **kwargs).hooks()


# ----------------------------------------------------------------------------- accuracy under noise


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
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("attn.hook_pattern"))
    out = {}
    for l in range(model.cfg.n_layers):
        pattern = cache[f"blocks.{l}.attn.hook_pattern"]
        if rows == "sparse":
            out[l] = theory.sparse_mask(pattern, 0.95 if threshold is None else threshold)
        else:
            out[l] = theory.nonsparse_mask(pattern, 0.70 if threshold is None else threshold)
    return out


def _count_correct(logits: Tensor, tokens: Tensor) -> tuple[int, int]:
    targets = T.next_token_targets(tokens.to(logits.device))
    mask = targets != -100
    return int(((logits.argmax(-1) == targets) & mask).sum()), int(mask.sum())


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
    sparse_threshold: float = 0.95,
    nonsparse_threshold: float = 0.70,
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
    dataset and variant but not per level (common random numbers).
    """
    cfg = _check_model(model)
    levels = _check_levels(levels, distribution)
    targets = _check_targets(targets, cfg)
    _check_placement(placement)
    layers = _check_index_list(layers, cfg.n_layers, "layer")
    heads_t = None if heads is None else _check_index_list(heads, cfg.n_heads, "head")
    seed = _check_seed(seed)
    batch_size = _check_positive_int(batch_size, "batch_size")
    sparse_threshold = _check_threshold(sparse_threshold, "sparse_threshold")
    nonsparse_threshold = _check_threshold(nonsparse_threshold, "nonsparse_threshold")
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
        chunks = []
        for i in range(0, len(tokens), batch_size):
            chunk = tokens[i : i + batch_size]
            chunk = chunk[:, : int((chunk != T.PAD_ID).sum(-1).max())].to(model.W_E.device)
            chunks.append(chunk)
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
                    noise_seed = int(np.random.SeedSequence([seed, di, gi, ci]).generate_state(1)[0])
                    if gates is None:
                        noise = NormNoise(model, level, targets, seed=noise_seed, **kw)
                    else:
                        gate = {l: gates[ci][l] for l in layers}
                        noise = NormNoise(model, level, qk, seed=noise_seed, row_gate=gate, **kw)
                    logits = model.run_with_hooks(chunk, fwd_hooks=noise.hooks())
                    c, n = _count_correct(logits, chunk)
                    correct, total = correct + c, total + n
                rows.append(dict(
                    variant=_variant(cfg, variant), attn_norm=cfg.attn_norm, noised=g, level=level,
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
    n_datasets = _check_positive_int(n_datasets, "n_datasets")
    n_examples = _check_positive_int(n_examples, "n_examples")
    datasets = [task.test_set(split, n_examples, seed=data_seed + i) for i in range(n_datasets)]
    df = accuracy_under_noise(model, datasets, levels, **kwargs)
    df.insert(3, "split", split)
    if not aggregate:
        return df
    out = _summarise_accuracy(df)
    out.insert(3, "split", split)
    return out


# ----------------------------------------------------------------------------- circuit collapse


def collapse_from_scores(
    scores: Float[Tensor, "row key"],
    factor_q: Float[Tensor, "draw row"],
    factor_k: Float[Tensor, "draw row key"],
    strict_threshold: float = 0.95,
) -> tuple[Bool[Tensor, "draw row"], Bool[Tensor, "draw row"]]:
    """Collapse decisions for clean rows under per-vector factors, without touching a model.

    Scaling q by f_q and k_t by f_t turns the score q·k_t/scale into f_q·f_t·w_t exactly, so the
    noised row is that product (masked keys stay −inf). Loose collapse: the noised argmax differs
    from the clean one (first maximum, as ``torch.argmax``); strict: also the new top token gets
    softmax ≥ ``strict_threshold``. Computed in float64, blocked over draws to bound memory.
    """
    w = scores.to(torch.float64)
    masked = torch.isneginf(w)
    w0 = w.masked_fill(masked, 0.0)
    minus_inf = torch.zeros_like(w).masked_fill(masked, -math.inf)  # added: -inf stays -inf whatever the factor's sign
    tstar = w.argmax(-1)
    D = factor_q.shape[0]
    R, K = w.shape
    loose = torch.zeros(D, R, dtype=torch.bool)
    strict = torch.zeros(D, R, dtype=torch.bool)
    step = max(1, _CHUNK // max(1, R * K))
    for d0 in range(0, D, step):
        fq = factor_q[d0 : d0 + step].to(torch.float64)
        fk = factor_k[d0 : d0 + step].to(torch.float64)
        noised = fk * w0
        noised.mul_(fq[..., None]).add_(minus_inf)
        top, arg = noised.max(-1)
        lo = arg != tstar
        loose[d0 : d0 + step] = lo
        hit = lo.nonzero(as_tuple=True)  # the softmax is only needed where the argmax moved
        if hit[0].numel():
            p_top = torch.exp(top[hit] - torch.logsumexp(noised[hit], -1))
            s = torch.zeros_like(lo)
            s[hit] = p_top >= strict_threshold
            strict[d0 : d0 + step] = s
    return loose, strict


def collapse_noise_draws(
    shape: Sequence[int], n_draws: int, layer: int, seed: int = 0, distribution: str = "uniform"
) -> tuple[Float[Tensor, "draw batch pos head"], Float[Tensor, "draw batch pos head"]]:
    """Unit-RMS draws (z_q, z_k), each [n_draws, batch, pos, head], for one layer of the collapse
    sweep; κ = level · z (the same z at every level). Public so a brute-force check can reuse them."""
    g = _generator(seed, layer, 0xC011A95E)
    shape = (n_draws, *shape)
    return unit_noise(shape, g, distribution), unit_noise(shape, g, distribution)


@dataclass
class LayerCollapse:
    """Per-draw collapse decisions for one layer's sparse rows.

    ``rows`` [R, 3] holds (batch, head, query) of each sparse row; ``scores`` [R, T] its clean
    scores (float64, −inf masked); ``loose``/``strict`` [n_levels, n_draws, R].
    """

    layer: int
    levels: tuple[float, ...]
    rows: Int[Tensor, "row 3"]
    scores: Float[Tensor, "row key"]
    loose: Bool[Tensor, "level draw row"]
    strict: Bool[Tensor, "level draw row"]


@torch.no_grad()
def collapse_decisions(
    model: HookedNormTransformer,
    tokens: Int[Tensor, "batch pos"] | Batch,
    levels: Sequence[float] = DEFAULT_COLLAPSE_LEVELS,
    *,
    n_draws: int = 64,
    targets: str | Sequence[str] = ("q", "k"),
    distribution: str = "uniform",
    placement: str = "before_norm",
    layers: Optional[int | Sequence[int]] = None,
    heads: Optional[int | Sequence[int]] = None,
    sparse_threshold: float = 0.95,
    strict_threshold: float = 0.95,
    seed: int = 0,
    progress: bool = False,
) -> list[LayerCollapse]:
    """The paper's collapse protocol from one clean cache: each layer is noised on its own clean
    inputs ("we add noise to every layer independently"), so no re-run of the model is needed.

    Rows counted: every (example, head, query position) whose clean max attention is ≥
    ``sparse_threshold``, except query 0 (``[`` attends only to itself) and padding positions
    (beyond the example's last real token). For each level and draw, κ_q per (example, query,
    head) and κ_k per (example, key, head) scale q and k at ``placement`` (before a q/k norm the
    factor is :func:`effective_factor`, i.e. almost 1); decisions come from
    :func:`collapse_from_scores`. Targets are ``q`` and/or ``k`` (v noise cannot move an argmax).
    """
    cfg = _check_model(model)
    levels = _check_levels(levels, distribution)
    targets = _check_targets(targets, cfg, allowed=("q", "k"))
    _check_placement(placement)
    layers = _check_index_list(layers, cfg.n_layers, "layer")
    heads = _check_index_list(heads, cfg.n_heads, "head")
    n_draws = _check_positive_int(n_draws, "n_draws")
    sparse_threshold = _check_threshold(sparse_threshold, "sparse_threshold")
    strict_threshold = _check_threshold(strict_threshold, "strict_threshold")
    seed = _check_seed(seed)
    if isinstance(tokens, Batch):
        tokens = tokens.tokens
    if not isinstance(tokens, Tensor) or tokens.ndim != 2:
        raise ConfigError("tokens must be a Batch or a [batch, pos] token tensor")
    tokens = tokens[:, : int((tokens != T.PAD_ID).sum(-1).max())].to(model.W_E.device)
    b, n = tokens.shape
    lengths = (tokens != T.PAD_ID).sum(-1)

    wanted = set()
    for l in layers:
        wanted |= {f"blocks.{l}.attn.hook_attn_scores", f"blocks.{l}.attn.hook_pattern"}
        for t in ("q", "k"):
            if placement == "before_norm" and _is_normalised(cfg, t):
                wanted.add(f"blocks.{l}.attn.hook_{t}_scale")
    _, cache = model.run_with_cache(tokens, names_filter=lambda name: name in wanted)

    qpos = torch.arange(n)
    valid_q = (qpos[None, :] >= 1) & (qpos[None, :] < lengths[:, None].cpu())  # [b, q]
    head_ok = torch.zeros(cfg.n_heads, dtype=torch.bool)
    head_ok[list(heads)] = True
    out = []
    for l in tqdm(layers, desc="collapse", disable=not progress):
        scores = cache[f"blocks.{l}.attn.hook_attn_scores"].detach().cpu()  # [b, h, q, k]
        pattern = cache[f"blocks.{l}.attn.hook_pattern"].detach().cpu()
        select = theory.sparse_mask(pattern, sparse_threshold) & valid_q[:, None, :] & head_ok[None, :, None]
        rows = select.nonzero()  # [R, 3]: (batch, head, query)
        rb, rh, rq = rows.unbind(-1)
        w = scores[rb, rh, rq].to(torch.float64)  # [R, n]
        z_q, z_k = collapse_noise_draws((b, n, cfg.n_heads), n_draws, l, seed, distribution)
        zq = z_q[:, rb, rq, rh] if "q" in targets else torch.zeros(n_draws, len(rb))
        zk = z_k.permute(0, 1, 3, 2)[:, rb, rh, :] if "k" in targets else torch.zeros(n_draws, len(rb), n)
        sq = sk = None
        if placement == "before_norm" and _is_normalised(cfg, "q"):
            sq = cache[f"blocks.{l}.attn.hook_q_scale"].detach().cpu()[..., 0][rb, rq, rh]  # [R]
            sk = cache[f"blocks.{l}.attn.hook_k_scale"].detach().cpu()[..., 0].permute(0, 2, 1)[rb, rh, :]  # [R, n]
        loose = torch.zeros(len(levels), n_draws, len(rb), dtype=torch.bool)
        strict = torch.zeros_like(loose)
        for i, level in enumerate(levels):
            # κ in float32, as a hook on the float32 model would apply it
            kq, kk = level * zq, level * zk
            if sq is None:
                fq, fk = 1.0 + kq, 1.0 + kk
            else:
                fq, fk = effective_factor(kq, sq, cfg.eps), effective_factor(kk, sk, cfg.eps)
            loose[i], strict[i] = collapse_from_scores(w, fq, fk, strict_threshold)
        out.append(LayerCollapse(l, levels, rows, w, loose, strict))
    return out


def _predict_rows(
    w: Tensor, law: NoiseLaw, targets: tuple[str, ...], removed: bool, strict_threshold: float,
    strict_samples: int, generator: torch.Generator,
) -> tuple[Tensor, Tensor, float]:
    """Per-row predicted (loose, strict) probabilities and the strict estimate's sample count."""
    R = w.shape[0]
    zeros = torch.zeros(R, dtype=torch.float64)
    if law.level == 0 or R == 0:
        return zeros, zeros, math.inf
    if removed:
        # noise before a q/k norm is removed by it (effective factor 1 + O(eps)), except a sign
        # flip when 1+κ < 0 (normal law), which the norm keeps and no NoiseLaw describes
        if law.prob_negative_factor < 1e-12:
            return zeros, zeros, math.inf
        return zeros + math.nan, zeros + math.nan, math.inf
    if "k" not in targets:
        # query noise alone rescales the row; it reverses the order only when 1+κ_q < 0
        p = law.prob_negative_factor
        return zeros + p, (zeros if p == 0 else zeros + math.nan), math.inf
    loose = theory.predicted_collapse_probability(w, law, include_query_noise="q" in targets).to(torch.float64)
    if strict_samples <= 0:
        return loose, zeros + math.nan, math.inf
    strict = theory.predicted_collapse_probability_strict(
        w, law, strict_threshold, strict_samples, generator, include_query_noise="q" in targets
    ).to(torch.float64)
    return loose, strict, float(strict_samples)


def measure_collapse(
    model: HookedNormTransformer,
    tokens: Int[Tensor, "batch pos"] | Batch,
    levels: Sequence[float] = DEFAULT_COLLAPSE_LEVELS,
    *,
    predict: bool = True,
    strict_samples: int = 256,
    variant: Optional[str] = None,
    **kwargs,
) -> pd.DataFrame:
    """Collapse probability vs noise level, per layer and overall (``layer == "all"``), with the
    theory's prediction beside every measured rate. Tidy: one row per (layer, level, definition).

    Columns: ``measured`` (fraction of (sparse row, draw) pairs that collapse), ``se`` (its
    standard error, clustered by row: std of per-row rates / √n_rows), ``predicted`` (mean over
    the same rows of :func:`theory.predicted_collapse_probability` — exact for "loose" — or of
    :func:`theory.predicted_collapse_probability_strict`, a Monte Carlo of ``strict_samples`` per
    row), ``mc_se`` (the sampling error of ``measured`` around ``predicted`` given these rows:
    sqrt(Σ p_r(1−p_r)(1/n_draws + 1/strict_samples)) / n_rows), ``z`` = (measured − predicted) /
    mc_se. With ``placement="before_norm"`` on a QK-/QKV-Norm model the norm removes the noise,
    so the prediction is 0 (``theory = "removed_by_norm"``; NaN for normal noise large enough
    that P(1+κ < 0) ≥ 1e-12, since the norm keeps such sign flips). Other keyword arguments go to
    :func:`collapse_decisions`.
    """
    cfg = _check_model(model)
    strict_samples = int(strict_samples)
    results = collapse_decisions(model, tokens, levels, **kwargs)
    distribution = kwargs.get("distribution", "uniform")
    placement = kwargs.get("placement", "before_norm")
    targets = _check_targets(kwargs.get("targets", ("q", "k")), cfg, allowed=("q", "k"))
    strict_threshold = kwargs.get("strict_threshold", 0.95)
    removed = placement == "before_norm" and _is_normalised(cfg, "q")
    gen = _generator(_check_seed(kwargs.get("seed", 0)), 0x7E0E)
    levels = results[0].levels
    n_draws = results[0].loose.shape[1]

    per_layer = []  # (layer, level index, definition) -> per-row rates and predictions
    for r in results:
        for i, level in enumerate(levels):
            if predict:
                pl, ps, ns = _predict_rows(r.scores, NoiseLaw(level, distribution), targets, removed,
                                           strict_threshold, strict_samples, gen)
            else:
                pl = ps = torch.full((len(r.rows),), math.nan, dtype=torch.float64)
                ns = math.inf
            for definition, dec, pred in (("loose", r.loose[i], pl), ("strict", r.strict[i], ps)):
                per_layer.append((r.layer, i, definition, dec.double().mean(0), pred, ns))

    def summarise(layer, i, definition, rates: Tensor, pred: Tensor, ns: float) -> dict:
        R = len(rates)
        measured = float(rates.mean()) if R else math.nan
        se = float(rates.std() / math.sqrt(R)) if R > 1 else math.nan
        predicted = float(pred.mean()) if R else math.nan
        var = (pred * (1 - pred)).sum() * (1.0 / n_draws + (0.0 if math.isinf(ns) else 1.0 / ns))
        mc_se = float(var.sqrt() / R) if R else math.nan
        z = (measured - predicted) / mc_se if mc_se > 0 else (0.0 if measured == predicted else math.nan)
        return dict(
            variant=_variant(cfg, variant), attn_norm=cfg.attn_norm, placement=placement, distribution=distribution,
            targets="".join(targets), layer=layer, level=levels[i], definition=definition,
            n_rows=R, n_draws=n_draws, measured=measured, se=se, predicted=predicted, mc_se=mc_se, z=z,
            theory="removed_by_norm" if removed else "multiplicative",
        )

    rows = [summarise(*item) for item in per_layer]
    for i in range(len(levels)):
        for definition in ("loose", "strict"):
            items = [it for it in per_layer if it[1] == i and it[2] == definition]
            if not items:
                continue
            rates = torch.cat([it[3] for it in items])
            pred = torch.cat([it[4] for it in items])
            rows.append(summarise("all", i, definition, rates, pred, items[0][5]))
    df = pd.DataFrame(rows)
    if len(df):
        df["layer"] = df["layer"].astype(object)
    return df


def run_collapse(
    model: HookedNormTransformer,
    task: AdditionTask,
    levels: Sequence[float] = DEFAULT_COLLAPSE_LEVELS,
    *,
    split: str = "id",
    n_examples: int = 256,
    data_seed: int = 1234,
    **kwargs,
) -> pd.DataFrame:
    """The paper's circuit-collapse experiment in one call, on ``task.test_set(split, n_examples,
    seed=data_seed)``. Returns :func:`measure_collapse`'s table; pass it to
    :func:`collapse_thresholds` for the 1%-collapse noise levels."""
    if not isinstance(task, AdditionTask):
        raise ConfigError(f"task must be an AdditionTask, got {type(task).__name__}")
    n_examples = _check_positive_int(n_examples, "n_examples")
    df = measure_collapse(model, task.test_set(split, n_examples, seed=data_seed), levels, **kwargs)
    df.insert(5, "split", split)
    return df


def collapse_thresholds(curves: pd.DataFrame, target: float = 0.01) -> pd.DataFrame:
    """Noise level at which a fraction ``target`` of sparse rows collapses, from the measured and
    the predicted curve (:func:`theory.noise_level_at_rate`; NaN if the curve never reaches it or
    starts above it). One row per (variant, …, layer, definition)."""
    need = {"level", "measured", "predicted", "layer", "definition"}
    if not isinstance(curves, pd.DataFrame) or not need <= set(curves.columns):
        raise ConfigError(f"curves must be a DataFrame from measure_collapse/run_collapse with columns {sorted(need)}")
    keys = [c for c in ("variant", "attn_norm", "placement", "distribution", "targets", "split", "layer", "definition")
            if c in curves.columns]
    out = []
    for key, g in curves.groupby(keys, sort=False):
        out.append(dict(
            zip(keys, key), target=target,
            level_measured=theory.noise_level_at_rate(g["level"].to_numpy(), g["measured"].to_numpy(), target),
            level_predicted=theory.noise_level_at_rate(g["level"].to_numpy(), g["predicted"].to_numpy(), target),
        ))
    return pd.DataFrame(out)
