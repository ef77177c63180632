"""Circuit collapse: the paper's protocol, measured from one clean cache, with the theory beside it.

A clean *sparse* row (max attention ≥ 95%) collapses when norm noise on q and k makes it pick
another key ("loose"), and "strict"-ly when the new key also gets ≥ 95%. The paper noises "every
layer independently", so each layer's rows are judged on that layer's clean inputs: the noised
scores are exactly f_q·f_k·w (:func:`collapse_from_scores`), and the model runs once.

What the comparison with the theory is: ``measured`` is a Monte Carlo over noise draws of the
event whose probability ``predicted`` integrates exactly (:func:`theory.predicted_collapse_probability`)
on the same clean scores — agreement checks the *code* (sampling, hooks, quadrature), not the
theory. :mod:`interp_norm.noise.forward` tests the theory against the model's real noisy forward pass.

Options live in one :class:`CollapseSpec` (defaults in one place, validated once); the functions
also accept its fields as keyword arguments.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from interp_norm import theory
from interp_norm.errors import ConfigError, NoiseSpecError
from interp_norm.core.defaults import DEFAULT_COLLAPSE_LEVELS, SPARSE_THRESHOLD
from interp_norm.core.hook_names import act_name, is_normalised
from interp_norm.core.model import HookedNormTransformer, ModelConfig
from interp_norm.core.specs import split_overrides
from interp_norm.noise import _validate as V
from interp_norm.noise.bridge_collapse import bridge_collapse
from interp_norm.noise.decide import rate_table, row_decisions
from interp_norm.noise.kernels import OWN_COLLAPSE_STREAM, collapse_draws, effective_factor, seeded_generator
from interp_norm.anatomy import kind_of
from interp_norm.core.task import PAD_ID, AdditionTask, Batch
from interp_norm.theory import NoiseLaw, predict_rows

_CHUNK = 1 << 22  # elements per vectorised block in the collapse sweep


# ----------------------------------------------------------------------------- the options


@dataclass(frozen=True)
class CollapseSpec:
    """How a collapse measurement samples noise and which rows it counts.

    ``n_draws`` noise draws per level; ``targets`` ``q`` and/or ``k`` (v noise cannot move an
    argmax); ``distribution`` of κ; ``placement`` (before or after a q/k norm, see
    :mod:`interp_norm.noise.norm_noise`); ``layers``/``heads`` (None = all); a row is counted when its
    clean max attention is ≥ ``sparse_threshold`` and collapses strictly when the new top key gets
    ≥ ``strict_threshold``; ``seed`` of the draws. Validated on construction (NoiseSpecError);
    layer/head ranges are checked against a model by :meth:`resolve`.
    """

    n_draws: int = 64
    targets: tuple[str, ...] = ("q", "k")
    distribution: str = "uniform"
    placement: str = "before_norm"
    layers: Optional[tuple[int, ...]] = None
    heads: Optional[tuple[int, ...]] = None
    sparse_threshold: float = SPARSE_THRESHOLD
    strict_threshold: float = SPARSE_THRESHOLD
    seed: int = 0

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        put("n_draws", V.check_positive_int(self.n_draws, "n_draws", NoiseSpecError))
        put("targets", V.check_targets(self.targets, None, allowed=("q", "k")))
        put("distribution", V.check_distribution(self.distribution))
        put("placement", V.check_placement(self.placement))
        for name in ("layers", "heads"):
            if getattr(self, name) is not None:  # ranges need the model (resolve); here only the form
                put(name, V.check_index_form(getattr(self, name), name[:-1]))
        put("sparse_threshold", V.check_threshold(self.sparse_threshold, "sparse_threshold"))
        put("strict_threshold", V.check_threshold(self.strict_threshold, "strict_threshold"))
        put("seed", V.check_seed(self.seed))

    @classmethod
    def make(cls, spec: Optional["CollapseSpec"] = None, **options) -> "CollapseSpec":
        """``spec`` (default: the defaults) with ``options`` replacing fields; unknown names are refused."""
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(fields))
        if unknown:
            raise NoiseSpecError(f"unknown collapse option(s) {unknown}; CollapseSpec fields are {fields}")
        if spec is None:
            return cls(**options)
        if not isinstance(spec, CollapseSpec):
            raise NoiseSpecError(f"spec must be a CollapseSpec, got {type(spec).__name__}")
        return dataclasses.replace(spec, **options) if options else spec

    def resolve(self, cfg: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(layers, heads) for a model: None → all, each checked against its size."""
        return (V.check_index_list(self.layers, cfg.n_layers, "layer"),
                V.check_index_list(self.heads, cfg.n_heads, "head"))

    def noise_removed(self, cfg: ModelConfig) -> bool:
        """Whether a per-head norm sits after the noise (before_norm on QK/QKV-Norm): it removes it."""
        return self.placement == "before_norm" and is_normalised(cfg.attn_norm, "q")


# ----------------------------------------------------------------------------- the clean run


@dataclass
class CleanAttention:
    """One clean run's attention, as the collapse measurements need it (all on CPU).

    ``scores``/``pattern`` per layer [b, h, q, k] (pre-softmax scores as the model computes
    them, masked keys −inf); ``q_scale``/``k_scale`` per layer [b, p, h] when noise lands before a
    q/k norm (for :func:`effective_factor`), else None; ``valid`` [b, h, q]: rows that count —
    query ≥ 1 (``[`` attends only to itself) and inside the example (no padding), selected heads.
    """

    tokens: Int[Tensor, "batch pos"]
    layers: tuple[int, ...]
    scores: dict[int, Tensor]
    pattern: dict[int, Tensor]
    q_scale: dict[int, Optional[Tensor]]
    k_scale: dict[int, Optional[Tensor]]
    valid: Bool[Tensor, "batch head query"]

    def sparse_rows(self, pattern: Float[Tensor, "batch head query key"], threshold: float) -> Int[Tensor, "row 3"]:
        """(batch, head, query) of each row that counts (:attr:`valid`) and is sparse in ``pattern``
        (max ≥ ``threshold``): one definition for the per-layer, forward and temperature measurements."""
        return (theory.sparse_mask(pattern, threshold) & self.valid).nonzero()


def check_inputs(model: HookedNormTransformer, levels: Sequence[float], spec: Optional[CollapseSpec],
                 options: dict) -> tuple[CollapseSpec, ModelConfig, tuple[float, ...]]:
    """(spec with ``options``, the model's config, the levels), checked in the order every collapse
    measurement checks them (options, then the model, then the levels against the distribution)."""
    spec = CollapseSpec.make(spec, **options)
    cfg = V.check_model(model)
    return spec, cfg, V.check_levels(levels, spec.distribution)


@torch.no_grad()
def clean_attention(model: HookedNormTransformer, tokens: Tensor | Batch, spec: CollapseSpec) -> CleanAttention:
    """Run ``model`` once on ``tokens`` (padding columns trimmed) and keep what :class:`CleanAttention` lists."""
    cfg = V.check_model(model)
    layers, heads = spec.resolve(cfg)
    tokens = V.trimmed_tokens(tokens, model)
    removed = spec.noise_removed(cfg)
    wanted = set()
    for l in layers:
        wanted |= {act_name("attn_scores", l), act_name("pattern", l)}
        if removed:
            wanted |= {act_name("q_scale", l), act_name("k_scale", l)}
    _, cache = model.run_with_cache(tokens, names_filter=lambda name: name in wanted)
    get = lambda kind, l: cache[act_name(kind, l)].detach().cpu()  # noqa: E731
    b, n = tokens.shape
    lengths = (tokens != PAD_ID).sum(-1).cpu()
    qpos = torch.arange(n)
    valid_q = (qpos[None, :] >= 1) & (qpos[None, :] < lengths[:, None])  # [b, q]
    head_ok = torch.zeros(cfg.n_heads, dtype=torch.bool)
    head_ok[list(heads)] = True
    return CleanAttention(
        tokens=tokens, layers=layers,
        scores={l: get("attn_scores", l) for l in layers}, pattern={l: get("pattern", l) for l in layers},
        q_scale={l: get("q_scale", l)[..., 0] if removed else None for l in layers},
        k_scale={l: get("k_scale", l)[..., 0] if removed else None for l in layers},
        valid=valid_q[:, None, :] & head_ok[None, :, None],
    )


# ----------------------------------------------------------------------------- decisions


def collapse_from_scores(
    scores: Float[Tensor, "row key"],
    factor_q: Float[Tensor, "draw row"],
    factor_k: Float[Tensor, "draw row key"],
    strict_threshold: float = SPARSE_THRESHOLD,
) -> tuple[Bool[Tensor, "draw row"], Bool[Tensor, "draw row"]]:
    """Collapse decisions for clean rows under per-vector factors, without touching a model.

    Scaling q by f_q and k_t by f_t turns the score q·k_t/scale into f_q·f_t·w_t exactly, so the
    noised row is that product (masked keys stay −inf). Loose collapse: the noised argmax differs
    from the clean one (first maximum, as ``torch.argmax``); strict: also the new top token gets
    softmax ≥ ``strict_threshold``. Computed in float64, blocked over draws to bound memory, by the
    one decision kernel (:func:`interp_norm.noise.decide.row_decisions`, whole rows: ``prune=False``).
    """
    w = scores.to(torch.float64)
    R, K = w.shape
    D = factor_q.shape[0]
    fk = factor_k.to(torch.float64).reshape(D, R * K)  # key t of row r is column r·K + t
    base = torch.arange(R) * K
    return row_decisions(w, factor_q.to(torch.float64), fk, base, None, strict_threshold, max_elements=_CHUNK,
                         prune=False)


def collapse_noise_draws(
    shape: Sequence[int], n_draws: int, layer: int, seed: int = 0, distribution: str = "uniform"
) -> tuple[Float[Tensor, "draw batch pos head"], Float[Tensor, "draw batch pos head"]]:
    """Unit-RMS draws (z_q, z_k), each [n_draws, batch, pos, head], for one layer of the collapse
    sweep; κ = level · z (the same z at every level). Public so a brute-force check can reuse them."""
    shape = (n_draws, *shape)
    return collapse_draws(shape, shape, (seed, layer, OWN_COLLAPSE_STREAM), distribution=distribution)


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


def layer_decisions(
    clean: CleanAttention, layer: int, levels: tuple[float, ...], spec: CollapseSpec, eps: float, *, multiplier: float = 1.0,
    rows: Optional[Int[Tensor, "row 3"]] = None,
) -> LayerCollapse:
    """One layer's sparse rows and their decisions at every level and draw, from the clean run.

    ``multiplier`` c scales the clean scores first (temperature 1/c): rows are those sparse in
    softmax(c·w) and the noised rows are f_q·f_k·c·w. c = 1 is the paper's protocol. ``rows``
    [R, 3] of (batch, head, query) fixes the rows instead (a row's draws do not depend on which
    other rows are judged).
    """
    scores = clean.scores[layer]  # [b, h, q, k]
    pattern = clean.pattern[layer]
    if multiplier != 1.0:
        scores = scores * multiplier
        pattern = scores.softmax(-1)
    b, h, n, _ = scores.shape
    if rows is None:
        rows = clean.sparse_rows(pattern, spec.sparse_threshold)  # [R, 3]: (batch, head, query)
    rb, rh, rq = rows.unbind(-1)
    w = scores[rb, rh, rq].to(torch.float64)  # [R, n]
    D = spec.n_draws
    z_q, z_k = collapse_noise_draws((b, n, h), D, layer, spec.seed, spec.distribution)
    zq = z_q[:, rb, rq, rh] if "q" in spec.targets else torch.zeros(D, len(rb))
    zk = z_k.permute(0, 1, 3, 2)[:, rb, rh, :] if "k" in spec.targets else torch.zeros(D, len(rb), n)
    sq = sk = None
    if clean.q_scale[layer] is not None:
        sq = clean.q_scale[layer][rb, rq, rh]  # [R]
        sk = clean.k_scale[layer].permute(0, 2, 1)[rb, rh, :]  # [R, n]
    loose = torch.zeros(len(levels), D, len(rb), dtype=torch.bool)
    strict = torch.zeros_like(loose)
    for i, level in enumerate(levels):
        kq, kk = level * zq, level * zk  # κ in float32, as a hook on the float32 model would apply it
        if sq is None:
            fq, fk = 1.0 + kq, 1.0 + kk
        else:
            fq, fk = effective_factor(kq, sq, eps), effective_factor(kk, sk, eps)
        loose[i], strict[i] = collapse_from_scores(w, fq, fk, spec.strict_threshold)
    return LayerCollapse(layer, levels, rows, w, loose, strict)


@torch.no_grad()
def collapse_decisions(
    model: HookedNormTransformer,
    tokens: Int[Tensor, "batch pos"] | Batch,
    levels: Sequence[float] = DEFAULT_COLLAPSE_LEVELS,
    spec: Optional[CollapseSpec] = None,
    *,
    progress: bool = False,
    **options,
) -> list[LayerCollapse]:
    """The paper's collapse protocol from one clean cache: each layer is noised on its own clean
    inputs ("we add noise to every layer independently"), so no re-run of the model is needed.

    Rows counted: every (example, head, query position) whose clean max attention is ≥
    ``spec.sparse_threshold``, except query 0 (``[`` attends only to itself) and padding positions
    (beyond the example's last real token). For each level and draw, κ_q per (example, query,
    head) and κ_k per (example, key, head) scale q and k at ``spec.placement`` (before a q/k norm
    the factor is :func:`effective_factor`, i.e. almost 1); decisions come from
    :func:`collapse_from_scores`. ``options`` are :class:`CollapseSpec` fields.
    """
    spec, cfg, levels = check_inputs(model, levels, spec, options)
    clean = clean_attention(model, tokens, spec)
    return [layer_decisions(clean, l, levels, spec, cfg.eps)
            for l in tqdm(clean.layers, desc="collapse", disable=not progress)]


# ----------------------------------------------------------------------------- tables


@dataclass(frozen=True)
class CollapseTableSpec:
    """How per-layer decisions become the rate table: ``predict`` False skips the theory (NaN);
    ``strict_samples`` Monte-Carlo samples per row for the strict prediction; ``variant`` labels the rows
    (None: the model's attention norm's label)."""

    predict: bool = True
    strict_samples: int = 256
    variant: Optional[str] = None


def measure_collapse(
    model: HookedNormTransformer,
    tokens: Int[Tensor, "batch pos"] | Batch,
    levels: Sequence[float] = DEFAULT_COLLAPSE_LEVELS,
    spec: Optional[CollapseSpec] = None,
    *,
    progress: bool = False,
    decisions: Callable[..., list[LayerCollapse]] = collapse_decisions,
    **options,
) -> pd.DataFrame:
    """Collapse probability vs noise level, per layer and overall (``layer == "all"``), with the
    theory's prediction beside every measured rate. Tidy: one row per (layer, level, definition).

    Columns: ``measured`` (fraction of (sparse row, draw) pairs that collapse), ``se`` (its
    standard error, clustered by row: std of per-row rates / √n_rows), ``predicted`` (mean over
    the same rows of :func:`theory.predicted_collapse_probability` — exact for "loose" — or of
    :func:`theory.predicted_collapse_probability_strict`, a Monte Carlo of ``strict_samples`` per
    row), ``mc_se`` (the sampling error of ``measured`` around ``predicted`` given these rows:
    sqrt(Σ p_r(1−p_r)(1/n_draws + 1/strict_samples)) / n_rows), ``z`` = (measured − predicted) /
    mc_se. Both columns judge the same event on the same clean scores, so agreement is a check of
    the code, not of the theory (see :func:`interp_norm.noise.measure_forward_collapse`). With
    ``placement="before_norm"`` on a QK-/QKV-Norm model the norm removes the noise, so the
    prediction is 0 (``theory = "removed_by_norm"``; NaN for normal noise large enough that
    P(1+κ < 0) ≥ 1e-12, since the norm keeps such sign flips). ``decisions`` makes the per-layer
    decisions (:func:`collapse_decisions`; :func:`interp_norm.noise.forward_collapse_decisions` for
    the real noisy forward pass). ``options`` are :class:`CollapseSpec` fields and :class:`CollapseTableSpec`
    fields (``predict``, ``strict_samples``, ``variant``).
    """
    table_options, options = split_overrides(options, CollapseTableSpec)
    table = CollapseTableSpec(**table_options)
    spec = CollapseSpec.make(spec, **options)
    cfg = V.check_model(model)
    results = decisions(model, tokens, levels, spec, progress=progress)
    return collapse_table(results, spec, cfg, predict=table.predict, strict_samples=int(table.strict_samples),
                          variant=table.variant)


def collapse_table(
    results: Sequence["LayerCollapse"],
    spec: CollapseSpec,
    cfg: ModelConfig,
    *,
    predict: bool = True,
    strict_samples: int = 256,
    variant: Optional[str] = None,
) -> pd.DataFrame:
    """Per-layer collapse decisions -> the tidy rate table, with the theory's prediction from each
    row's clean scores beside every measured rate (shared by the per-layer protocol and the real
    forward pass, so both are judged by the same prediction and the same errors)."""
    removed = spec.noise_removed(cfg)
    gen = seeded_generator(spec.seed, 0x7E0E)
    levels = results[0].levels
    per_layer = []  # (layer, level index, definition) -> per-row rates and predictions
    for r in results:
        for i, level in enumerate(levels):
            if predict:
                pl, ps, ns = predict_rows(r.scores, NoiseLaw(level, spec.distribution), spec.targets,
                                          "removed_by_norm" if removed else "multiplicative",
                                          spec.strict_threshold, strict_samples, generator=gen)
            else:
                pl = ps = torch.full((len(r.rows),), math.nan, dtype=torch.float64)
                ns = math.inf
            for definition, dec, pred in (("loose", r.loose[i], pl), ("strict", r.strict[i], ps)):
                per_layer.append((r.layer, i, definition, dec.double().mean(0), pred, ns))
    columns = dict(variant=V.variant_label(cfg, variant), attn_norm=cfg.attn_norm, placement=spec.placement,
                   distribution=spec.distribution, targets="".join(spec.targets))
    df = rate_table(per_layer, levels, spec.n_draws, columns)
    df["theory"] = "removed_by_norm" if removed else "multiplicative"
    return df


def run_collapse(
    model: HookedNormTransformer,
    task: Optional[AdditionTask] = None,
    levels: Sequence[float] = DEFAULT_COLLAPSE_LEVELS,
    spec: Optional[CollapseSpec] = None,
    *,
    split: str = V.TEST_SPLIT,
    n_examples: int = V.TEST_EXAMPLES,
    data_seed: int = V.TEST_SEED,
    tokens: Optional[Tensor] = None,
    **kwargs,
) -> pd.DataFrame:
    """The paper's circuit-collapse experiment in one call, on any model; pass the result to
    :func:`collapse_thresholds` for the 1%-collapse noise levels.

    The one entry point for every kind: the backend is picked once. Our models run
    :func:`measure_collapse` on ``task.test_set(split, n_examples, seed=data_seed)`` (a ``split``
    column added; ``task`` defaults to the model's own, another one warns naming both; other keyword
    arguments go to :func:`measure_collapse`). A TransformerBridge (a Hugging Face model, no task)
    runs :func:`~interp_norm.noise.bridge_collapse.bridge_collapse` on ``tokens`` (text windows
    [batch, pos]) with the keyword arguments (:class:`~interp_norm.noise.bridge_collapse.BridgeCollapseSpec`
    fields, ``window_batch`` among them); ``task``, ``split``, ``n_examples`` and ``data_seed`` are not read.
    """
    window_batch = kwargs.get("window_batch")
    if kind_of(model) == "bridge":
        if spec is not None:
            raise ConfigError("a CollapseSpec applies to our models; pass a bridge's options (draws, targets, placement, "
                              "distribution, layers, seed ...) as keyword arguments")
        if tokens is None:
            raise ConfigError("a Hugging Face model has no addition task: pass tokens= (text windows [batch, pos], e.g. "
                              "interp_norm.anatomy.text_tokens(model))")
        return bridge_collapse(model, tokens, levels, **kwargs)
    if window_batch is not None:
        raise ConfigError(f"window_batch={window_batch!r} applies to Hugging Face models (TransformerBridges); our "
                          "models run their problems in one pass: drop window_batch")
    if tokens is not None:
        raise ConfigError("tokens= is a Hugging Face model's text; our models run on their task's test set (split, "
                          "n_examples): call measure_collapse(model, tokens, levels) for tokens of your own")
    kwargs.pop("window_batch", None)
    return V.on_test_set(measure_collapse, model, task, levels, spec, split=split, n_examples=n_examples,
                         data_seed=data_seed, who="run_collapse", **kwargs)


def collapse_thresholds(curves: pd.DataFrame, target: float = 0.01) -> pd.DataFrame:
    """Noise level at which a fraction ``target`` of sparse rows collapses, from the measured and
    the predicted curve (:func:`theory.noise_level_at_rate`; NaN if the curve never reaches it or
    starts above it). One row per (variant, …, layer, definition)."""
    need = {"level", "measured", "predicted", "layer", "definition"}
    if not isinstance(curves, pd.DataFrame) or not need <= set(curves.columns):
        raise ConfigError(f"curves must be a DataFrame from measure_collapse/run_collapse with columns {sorted(need)}")
    keys = [c for c in ("variant", "attn_norm", "placement", "distribution", "targets", "split", "protocol", "layer",
                        "definition") if c in curves.columns]
    out = []
    for key, g in curves.groupby(keys, sort=False):
        out.append(dict(
            zip(keys, key), target=target,
            level_measured=theory.noise_level_at_rate(g["level"].to_numpy(), g["measured"].to_numpy(), target),
            level_predicted=theory.noise_level_at_rate(g["level"].to_numpy(), g["predicted"].to_numpy(), target),
        ))
    return pd.DataFrame(out)


__all__ = [
    "CollapseSpec", "CleanAttention", "clean_attention", "collapse_from_scores",
    "collapse_noise_draws", "LayerCollapse", "layer_decisions", "collapse_decisions", "measure_collapse",
    "CollapseTableSpec", "collapse_table", "run_collapse", "collapse_thresholds",
]
