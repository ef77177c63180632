"""Circuit collapse on any bridge, from one clean run, with the theory's prediction beside it.

The paper's protocol (Menary et al. 2024; :mod:`interp_norm.noise.collapse` for our models) on a Hugging
Face model: a clean *sparse* row (max attention ≥ :data:`interp_norm.core.defaults.SPARSE_THRESHOLD`)
collapses when multiplicative noise on q and k makes it pick another key ("loose"), and
"strict"-ly when the new key also gets ≥ the threshold. Each layer is judged on its own clean
inputs ("noise every layer independently"), so the model runs once.

Why no re-run is needed, with RoPE and grouped heads: scaling q by 1+κ_q and k_t by 1+κ_t scales
the score q_rot·k_rot by (1+κ_q)(1+κ_t) exactly, because the rotation is linear and acts on each
vector alone; a grouped k/v head is noised once, and every query head reading it sees the same
κ. Before a q/k norm the factor that survives is :func:`~interp_norm.noise.kernels.effective_factors`
(≈ 1 per head: the norm removes the noise; a mix of the heads' factors for OLMo-2's all-heads
norm, which no :class:`~interp_norm.theory.NoiseLaw` describes, so its prediction is NaN).

Memory: a real model's scores are large (batch · heads · pos² per layer), so the clean scores are
rebuilt from the cached q and k one block of heads at a time, and the noised rows one block of
draws at a time, each block holding at most ``max_elements`` numbers. The clean pass runs over blocks of
``window_batch`` windows in lockstep and hands over one block's q/k of one layer at a time
(:func:`interp_norm.anatomy.stream.window_blocks`: no logits, never every layer's or every window's
cache at once); each block's scores and noise factors (draws × levels per position) are made from it
and only its sparse rows are kept (their clean scores and decisions). What grows with the windows is
the layer's κ draws (O(draws · positions · heads)) and the sparse rows; the values are those of
``run_with_cache``.

The prediction is the theory's (:func:`interp_norm.theory.predicted_collapse_probability`, exact
for "loose"; :func:`~interp_norm.theory.predicted_collapse_probability_strict`, a Monte Carlo) on
the same clean rows, and κ comes from :func:`interp_norm.theory.sample_kappa`: agreement checks
the code, not the theory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from interp_norm import theory
from interp_norm.anatomy import Anatomy, LayerAnatomy, anatomy, canonical
from interp_norm.anatomy.rebuild import attention_mask, masked_softmax, rebuilt_query_key, scores_from_qk
from interp_norm.anatomy.stream import layer_caches, window_blocks
from interp_norm.core.specs import with_overrides
from interp_norm.core.defaults import BRIDGE_COLLAPSE_LEVELS, COLLAPSE_MAX_ELEMENTS, SPARSE_THRESHOLD, WINDOW_BATCH
from interp_norm.errors import ArchitectureError, ConfigError, NoiseSpecError
from interp_norm.noise import _validate as V
from interp_norm.noise.decide import cap as _cap
from interp_norm.noise.decide import rate_table, row_decisions
from interp_norm.noise.kernels import BRIDGE_COLLAPSE_STREAM, collapse_draws, placed_factors, seeded_generator
from interp_norm.theory import NoiseLaw

#: Defaults of the bridge collapse sweep (kept as they were: levels coarser than our models').
DEFAULT_LEVELS = BRIDGE_COLLAPSE_LEVELS
DEFAULT_MAX_ELEMENTS = COLLAPSE_MAX_ELEMENTS
_STREAM = BRIDGE_COLLAPSE_STREAM  # seed stream of the collapse draws (distinct from the hooks' per-pass stream)


@dataclass(frozen=True)
class BridgeCollapseSpec:
    """The options of :func:`bridge_collapse` and :func:`collapse_chunks` (both also take them as keywords).

    Noise: κ per (example, position, head) on ``targets`` ("q" and/or "k"; k once per key/value
    head), ``distribution`` uniform or normal with RMS the level, ``draws`` draws per level (the same unit
    draws at every level) from ``seed``, at ``placement`` "before_norm" (the projection output, where
    upstream interference arrives; a per-head q/k norm then removes it) or "after_norm" (what the scores
    use). ``layers`` None = all. ``by_head``: a row per head too. ``max_elements`` bounds every score block
    (clean scores per block of heads, noised rows per block of draws); peak memory grows with it, results
    do not change. ``window_batch`` (None: :data:`~interp_norm.core.defaults.WINDOW_BATCH`, 8; ≥ the
    windows: one pass) runs the clean forward over that many windows at a time, in lockstep layer by layer,
    and inside each layer rebuilds the scores and the noise factors of one block of windows at a time,
    keeping only the sparse rows' scores and decisions: the peak is bounded by ``window_batch`` (and
    ``max_elements``), not by the number of windows; the rows and decisions are those of one pass (the
    tests check it). ``predict=False`` skips the theory (NaN); ``strict_samples`` Monte-Carlo samples per
    row for the strict prediction (0: NaN). A row is sparse when its clean max attention is ≥
    ``sparse_threshold``; a strict collapse gives the new key ≥ ``strict_threshold``. Checked when the
    sweep starts (NoiseSpecError / ConfigError), in the order the sweep reads them.
    """

    draws: int = 64
    targets: Sequence[str] = ("q", "k")
    placement: str = "before_norm"
    distribution: str = "uniform"
    layers: Optional[Sequence[int]] = None
    by_head: bool = False
    max_elements: int = DEFAULT_MAX_ELEMENTS
    seed: int = 0
    predict: bool = True
    strict_samples: int = 256
    sparse_threshold: float = SPARSE_THRESHOLD
    strict_threshold: float = SPARSE_THRESHOLD
    window_batch: Optional[int] = None


# ----------------------------------------------------------------------------- noise draws


def collapse_kappa(anat: Anatomy, layer: int, batch: int, pos: int, draws: int, seed: int = 0, *,
                   distribution: str = "uniform") -> tuple[Tensor, Tensor]:
    """Unit-RMS draws (z_q [draws, b, p, n_heads], z_k [draws, b, p, n_kv_heads]) of one layer;
    κ = level · z at every level (common random numbers: curves are smooth in the level).

    z_k is seeded by the layer whose keys are read (``kv_layer``), so a Gemma 4 KV-sharing layer
    sees the κ of its source's keys. Public so a brute-force check can rebuild every κ.
    """
    la = anat[layer]
    src = la.layer if la.kv_layer is None else la.kv_layer
    return collapse_draws((draws, batch, pos, la.n_heads), (draws, batch, pos, la.n_kv_heads), (seed, _STREAM, layer, 0),
                          (seed, _STREAM, src, 1), distribution=distribution)


def theory_kind(la: LayerAnatomy, targets: Sequence[str], placement: str) -> str:
    """How the theory models this layer's noise: "multiplicative" (factors 1+κ reach the scores),
    "removed_by_norm" (per-head norms after the noise) or "not_modelled" (an all-heads norm mixes
    the heads' factors)."""
    if placement == "after_norm":
        return "multiplicative"
    normed = [la.norms.get(t) for t in targets if la.norms.get(t) is not None]
    if not normed:
        return "multiplicative"
    if any(n.axis != "per_head" for n in normed):
        return "not_modelled"
    return "removed_by_norm" if len(normed) == len(targets) else "not_modelled"


# ----------------------------------------------------------------------------- decisions


@dataclass
class ChunkCollapse:
    """Per-draw decisions for the sparse rows of one (layer, block of query heads).

    ``rows`` [R, 3] (batch, head, query) with the model's head index; ``scores`` [R, K] clean
    scores before any soft cap (float64, masked keys −inf); ``loose``/``strict`` [levels, draws, R];
    ``theory`` as :func:`theory_kind`; ``softcap`` the layer's cap or None.
    """

    layer: int
    heads: tuple[int, ...]
    levels: tuple[float, ...]
    rows: Tensor
    scores: Tensor
    loose: Tensor
    strict: Tensor
    theory: str
    softcap: Optional[float]


def _check(tokens: Any, levels: Any, *, draws: Any, targets: Any, placement: Any, distribution: str, max_elements: Any,
           allowed: tuple[str, ...]) -> tuple[Tensor, tuple[float, ...], tuple[str, ...]]:
    if not isinstance(tokens, Tensor) or tokens.ndim != 2 or tokens.is_floating_point() or tokens.shape[1] < 2:
        raise ConfigError("tokens must be an integer tensor [batch, pos] with pos >= 2 (unpadded sequences)")
    levels = V.check_levels(levels, distribution)  # each level through NoiseLaw (NoiseSpecError)
    for name, v in (("draws", draws), ("max_elements", max_elements)):
        V.check_positive_int(v, name, NoiseSpecError)
    targets = V.check_targets(targets, None, allowed=allowed)
    V.check_placement(placement)
    return tokens, levels, targets


@torch.no_grad()
def collapse_chunks(
    model: Any, tokens: Tensor, levels: Sequence[float] = DEFAULT_LEVELS, spec: Optional[BridgeCollapseSpec] = None, *,
    progress: bool = False, anat: Optional[Anatomy] = None, **overrides: Any,
) -> Iterator[ChunkCollapse]:
    """Per (layer, block of query heads): the sparse rows and their decisions at every level and
    draw (:class:`ChunkCollapse`), from one clean forward pass. Options: :class:`BridgeCollapseSpec`
    (``spec`` and/or its fields as keywords; ``by_head``, ``predict`` and ``strict_samples`` are the
    table's, not read here).

    Rows counted: every (example, head, query) whose clean max attention (softmax of the rebuilt,
    soft-capped, masked scores — verified equal to ``hook_pattern`` by :func:`anatomy`) is ≥
    ``sparse_threshold``, except query 0, which has a single key and cannot collapse.
    """
    sp = with_overrides(BridgeCollapseSpec, spec, overrides, who="bridge_collapse")
    placement, draws, seed = sp.placement, sp.draws, sp.seed
    tokens, levels, targets = _check(tokens, levels, draws=draws, targets=sp.targets, placement=placement,
                                     distribution=sp.distribution, max_elements=sp.max_elements, allowed=("q", "k"))
    window_batch = WINDOW_BATCH if sp.window_batch is None else sp.window_batch
    V.check_positive_int(window_batch, "window_batch", NoiseSpecError)
    anat = anat or anatomy(model)
    if anat.kind != "bridge":
        raise ArchitectureError("bridge_collapse is for TransformerBridges; for a HookedNormTransformer use "
                                "interp_norm.noise.measure_collapse / run_collapse")
    layers = list(range(anat.n_layers)) if sp.layers is None else list(sp.layers)
    for l in layers:
        anat[l]  # range check (ArchitectureError)
    per_layer: dict[int, set[str]] = {}
    for l in layers:
        la = anat[l]
        for t in ("q", "k"):
            per_layer.setdefault(l, set()).add(la.hooks[f"{t}_rot" if la.rope_from_hooks else la.used(t)])
            if placement == "before_norm" and la.norms.get(t) is not None:
                per_layer[l].add(la.hooks[t])
    device = getattr(model.cfg, "device", None) or "cpu"
    b, n = tokens.shape
    step = min(int(window_batch), b)
    if layers == sorted(per_layer):  # one block of windows' q/k of one layer at a time
        stream = window_blocks(model, tokens.to(device), per_layer, step)
    else:  # an unsorted layer list keeps its order: every layer's q/k of every window held at once
        step = b
        joined = {nm: c[nm] for l, c in layer_caches(model, tokens.to(device), per_layer, window_batch=window_batch)
                  for nm in per_layer[l]}
        stream = ((l, 0, joined) for l in layers)
    bar = tqdm(total=len(layers), desc="collapse", disable=not progress)
    for l, start, cache in stream:
        la = anat[l]
        if start == 0:  # the layer's draws for every window (O(draws · positions · heads)), its chunks' parts
            z_q, z_k = collapse_kappa(anat, l, b, n, draws, seed, distribution=sp.distribution)
            st = _LayerState.build(model, anat, l, b, n, spec=sp, n_levels=len(levels))
            parts: dict[tuple[int, ...], list] = {heads: [] for heads in st.head_blocks}
        q, k = rebuilt_query_key(model, cache, anat, l)
        raw = {t: canonical(cache[la.hooks[t]], la.layouts.get(t, "bphd"), la.n_heads_of(t), la.d_head).cpu()
               for t in ("q", "k") if placement == "before_norm" and la.norms.get(t) is not None}
        del cache
        stop = min(b, start + step)
        f = _factors(la, z_q[:, start:stop], z_k[:, start:stop], raw, levels=levels, targets=targets, placement=placement)
        for heads, got in parts.items():  # per block of heads: (rows, w, loose, strict) of this block of windows
            got.append(_block_rows(st, q, k, heads, f, start))
        del f, q, k, raw
        if stop < b:
            continue
        bar.update()
        kind = theory_kind(la, targets, placement)
        for heads, got in parts.items():
            rows, w, loose, strict = (torch.cat([p[i] for p in got], -1 if i >= 2 else 0) for i in range(4))
            got.clear()
            yield ChunkCollapse(l, heads, levels, rows, w, loose, strict, kind, la.softcap)
        del z_q, z_k
    bar.close()


def _factors(la: LayerAnatomy, zq: Tensor, zk: Tensor, raw: dict, *, levels: Sequence[float], targets: Sequence[str],
             placement: str) -> list[tuple[Tensor, Tensor]]:
    """Per level: (f_q [D, w, p, H], f_k [D, w, p, H_kv]) float64 of one block of windows (its draws ``zq``,
    ``zk`` and clean projections ``raw``; elementwise in the windows, so a block's factors are the whole
    batch's, sliced). O(draws · windows · pos · heads)."""
    rq, rk = raw.get("q"), raw.get("k")
    f = []
    for level in levels:
        kq = level * zq if "q" in targets else torch.zeros_like(zq)
        kk = level * zk if "k" in targets else torch.zeros_like(zk)
        f.append((placed_factors(la, "q", kq, rq, placement), placed_factors(la, "k", kk, rk, placement)))
    return f


@dataclass(frozen=True)
class _LayerState:
    """What every block of windows and heads of one layer shares in a collapse sweep (built once per layer):
    its causal/sliding ``mask`` [query, key] (CPU), the ``usable`` queries [query] (two keys or more: query 0
    has one and cannot collapse), ``kv_of`` (query head -> its k/v head), the ``head_blocks`` whose scores
    are made at once (at most ``max_elements`` numbers of one pass), and the sweep's thresholds and sizes."""

    model: Any
    anat: Anatomy
    layer: int
    mask: Tensor
    usable: Tensor
    kv_of: Tensor
    head_blocks: tuple[tuple[int, ...], ...]
    sparse_threshold: float
    strict_threshold: float
    max_elements: int
    n_levels: int
    draws: int

    @classmethod
    def build(cls, model: Any, anat: Anatomy, layer: int, batch: int, n: int, *, spec: BridgeCollapseSpec,
              n_levels: int) -> "_LayerState":
        """Layer ``layer``'s state for ``batch`` windows of ``n`` positions (thresholds and sizes from ``spec``)."""
        la = anat[layer]
        max_elements = spec.max_elements
        mask = attention_mask(la, n, n, "cpu")
        block = max(1, min(la.n_heads, max_elements // max(1, batch * n * n)))  # heads per block of one pass
        return cls(model, anat, layer, mask=mask, usable=mask.sum(-1) >= 2, kv_of=torch.as_tensor(la.kv_head_of),
                   head_blocks=tuple(tuple(range(h0, min(la.n_heads, h0 + block))) for h0 in range(0, la.n_heads, block)),
                   sparse_threshold=spec.sparse_threshold, strict_threshold=spec.strict_threshold,
                   max_elements=max_elements, n_levels=n_levels, draws=spec.draws)


def _block_rows(st: _LayerState, q: Tensor, k: Tensor, heads: tuple[int, ...], f: list, b0: int
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The sparse rows of one block of windows of layer ``st.layer`` (``q``/``k`` theirs, the first being window
    ``b0``; ``f`` their noise factors per level, :func:`_factors`) and one block of ``heads``: (rows [R, 3] with
    the batch index of the whole batch, clean scores w [R, K] float64, loose, strict [levels, draws, R]), in
    the order of one pass (window, head, query)."""
    la = st.anat[st.layer]
    n = q.shape[1]
    h0 = heads[0]
    s = scores_from_qk(st.model, st.anat, st.layer, q, k, heads=heads, softcap=False).cpu()  # [w, hc, n, n]
    pattern = masked_softmax(_cap(s, la.softcap), st.mask)
    sparse = theory.sparse_mask(pattern, st.sparse_threshold) & st.usable[None, None, :]
    del pattern
    rows = sparse.nonzero()  # (window in block, head in block, query)
    rb, rh, rq = rows.unbind(-1)
    w = s[rb, rh, rq].to(torch.float64).masked_fill(~st.mask[rq], -math.inf)  # [R, n]
    del s
    gh = rh + h0
    loose = torch.zeros(st.n_levels, st.draws, len(rb), dtype=torch.bool)
    strict = torch.zeros_like(loose)
    base = (rb * la.n_kv_heads + st.kv_of[gh]) * n  # [R]: where each row's key factors start
    for i, (fq, fk) in enumerate(f):
        fq_rows = fq[:, rb, rq, gh]  # [D, R]
        fkp = fk.permute(0, 1, 3, 2).reshape(fk.shape[0], -1)  # [D, w·H_kv·n]
        loose[i], strict[i] = row_decisions(w, fq_rows, fkp, base, la.softcap, st.strict_threshold,
                                            max_elements=st.max_elements)
    return torch.stack([rb + b0, gh, rq], -1), w, loose, strict


# ----------------------------------------------------------------------------- the table


def bridge_collapse(
    model: Any, tokens: Tensor, levels: Sequence[float] = DEFAULT_LEVELS, spec: Optional[BridgeCollapseSpec] = None, *,
    progress: bool = False, anat: Optional[Anatomy] = None, **overrides: Any,
) -> pd.DataFrame:
    """Collapse rate of sparse attention rows vs noise level on a TransformerBridge, measured and
    predicted side by side (module docstring), from one clean forward pass of ``tokens`` [batch, pos].
    Options: :class:`BridgeCollapseSpec` (``spec`` and/or its fields as keywords; an unknown one: ConfigError).

    One row per (layer, level, definition) — per (layer, head, level, definition) with ``by_head``
    — plus pooled rows with ``layer == "all"`` (and ``head == "all"``). Columns: ``architecture``,
    ``placement``, ``distribution``, ``targets``, ``layer``, ``head``, ``level``, ``definition``
    ("loose": argmax moved; "strict": and the new key gets ≥ ``strict_threshold``), ``theory``
    (:func:`theory_kind`; "mixed" when pooled layers differ), ``n_rows`` (sparse rows), ``n_draws``,
    ``measured`` (fraction of (row, draw) pairs that collapse), ``se`` (clustered by row: std of
    per-row rates / √n_rows), ``predicted`` (mean over the same rows of the theory's probability),
    ``mc_se`` (Monte-Carlo error of measured around predicted: √(Σ p(1−p)(1/draws + 1/strict_samples))
    / n_rows) and ``z`` = (measured − predicted) / mc_se.
    """
    sp = with_overrides(BridgeCollapseSpec, spec, overrides, who="bridge_collapse")
    anat = anat or anatomy(model)
    chunks = collapse_chunks(model, tokens, levels, sp, progress=progress, anat=anat)
    targets = V.check_targets(sp.targets, None, allowed=("q", "k"))
    groups, level_list = _group_rates(chunks, sp, targets)
    base = dict(architecture=anat.architecture, placement=sp.placement, distribution=sp.distribution,
                targets="".join(targets))
    per_group = []  # rate_table items: (layer, level index, definition, rates, predictions, ns, {head, theory})
    for (layer, h, i, definition), items in groups.items():
        per_group.append((layer, i, definition, torch.cat([it[0] for it in items]), torch.cat([it[1] for it in items]),
                          items[0][2], dict(head=h, theory=_kind({it[3] for it in items}))))
    df = rate_table(per_group, level_list, sp.draws, base, pool_extra=_pooled)
    if len(df):
        order = [*base, "layer", "head", "level", "definition", "theory"]
        df = df[order + [c for c in df.columns if c not in order]]
        df["head"] = df["head"].astype(object)
    return df


def _group_rates(chunks: Iterator[ChunkCollapse], sp: BridgeCollapseSpec, targets: tuple[str, ...]
                 ) -> tuple[dict[tuple, list], tuple[float, ...]]:
    """(``{(layer, head, level index, definition): [(per-row rates, predictions, ns, theory)]}``, the levels)
    of the chunks, with the theory's prediction per row unless ``sp.predict`` is off (NaN)."""
    gen = seeded_generator(sp.seed, _STREAM, 0x7E0E)
    groups: dict[tuple, list] = {}
    level_list: tuple[float, ...] = ()
    for chunk in chunks:
        level_list = chunk.levels
        heads = chunk.rows[:, 1]
        for i, level in enumerate(chunk.levels):
            if sp.predict:
                pl, ps, ns = theory.predict_rows(chunk.scores, NoiseLaw(level, sp.distribution), targets, chunk.theory,
                                                  sp.strict_threshold, int(sp.strict_samples), generator=gen,
                                                  softcap=chunk.softcap)
            else:
                pl = ps = torch.full((len(chunk.rows),), math.nan, dtype=torch.float64)
                ns = math.inf
            for definition, dec, pred in (("loose", chunk.loose[i], pl), ("strict", chunk.strict[i], ps)):
                rates = dec.double().mean(0)
                for h in (chunk.heads if sp.by_head else ("all",)):
                    sel = slice(None) if h == "all" else heads == h
                    groups.setdefault((chunk.layer, h, i, definition), []).append((rates[sel], pred[sel], ns, chunk.theory))
    return groups, level_list


def _pooled(items: list) -> dict:
    """The extra columns of a pooled row: every head, and the pooled layers' theory kind."""
    return dict(head="all", theory=_kind({it[6]["theory"] for it in items}))


def _kind(kinds: set) -> str:
    """One theory kind, or "mixed" when the pooled rows' differ."""
    return next(iter(kinds)) if len(kinds) == 1 else "mixed"


__all__ = ["DEFAULT_LEVELS", "BridgeCollapseSpec", "collapse_kappa", "theory_kind", "ChunkCollapse", "row_decisions", "collapse_chunks",
           "bridge_collapse"]
