"""Circuit collapse on any bridge, from one clean run, with the theory's prediction beside it.

The paper's protocol (Menary et al. 2024; :mod:`interp_norm.noise.collapse` for our models) on a Hugging
Face model: a clean *sparse* row (max attention ≥ :data:`interp_norm.defaults.SPARSE_THRESHOLD`)
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
draws at a time, each block holding at most ``max_elements`` numbers. What stays whole is O(pos):
the cached q/k and the κ draws of one layer. The clean pass hands over one layer's q/k at a time
and stops after the last layer analysed (:func:`interp_norm.bridges.stream.layer_caches`: no
logits, never every layer's cache at once); the values are those of ``run_with_cache``.

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
from interp_norm.bridges.stream import layer_caches
from interp_norm.defaults import BRIDGE_COLLAPSE_LEVELS, COLLAPSE_MAX_ELEMENTS, SPARSE_THRESHOLD
from interp_norm.errors import ArchitectureError, ConfigError, NoiseSpecError
from interp_norm.noise import _validate as V
from interp_norm.noise.kernels import placed_factors, seeded_generator
from interp_norm.theory import NoiseLaw

#: Defaults of the bridge collapse sweep (kept as they were: levels coarser than our models').
DEFAULT_LEVELS = BRIDGE_COLLAPSE_LEVELS
DEFAULT_MAX_ELEMENTS = COLLAPSE_MAX_ELEMENTS
_STREAM = 0xB21C0  # seed stream of the collapse draws (distinct from the hooks' per-pass stream)


# ----------------------------------------------------------------------------- noise draws


def collapse_kappa(anat: Anatomy, layer: int, batch: int, pos: int, draws: int, seed: int = 0,
                   distribution: str = "uniform") -> tuple[Tensor, Tensor]:
    """Unit-RMS draws (z_q [draws, b, p, n_heads], z_k [draws, b, p, n_kv_heads]) of one layer;
    κ = level · z at every level (common random numbers: curves are smooth in the level).

    z_k is seeded by the layer whose keys are read (``kv_layer``), so a Gemma 4 KV-sharing layer
    sees the κ of its source's keys. Public so a brute-force check can rebuild every κ.
    """
    la = anat[layer]
    src = la.layer if la.kv_layer is None else la.kv_layer
    z_q = theory.sample_kappa((draws, batch, pos, la.n_heads), seeded_generator(seed, _STREAM, layer, 0), distribution,
                              dtype=torch.float32)
    z_k = theory.sample_kappa((draws, batch, pos, la.n_kv_heads), seeded_generator(seed, _STREAM, src, 1), distribution,
                              dtype=torch.float32)
    return z_q, z_k


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


def _cap(x: Tensor, softcap: Optional[float]) -> Tensor:
    return torch.tanh(x / softcap) * softcap if softcap else x


def row_decisions(w: Tensor, fq: Tensor, fk: Tensor, base: Tensor, softcap: Optional[float], strict_threshold: float,
                  max_elements: int) -> tuple[Tensor, Tensor]:
    """(loose, strict) [D, R] for clean rows ``w`` [R, K] (−inf masked) under query factors ``fq``
    [D, R] and key factors ``fk`` [D, F] (a flat table: key t of row r is column ``base[r] + t``),
    in blocks of at most ``max_elements`` numbers.

    Noised row = fq·fk·w (first maximum wins, as ``torch.argmax``); strict also needs
    softmax(cap(noised))[new top] ≥ ``strict_threshold`` (the cap is monotone: it never moves the
    argmax). Speed, when every factor is positive: fq cancels from the argmax, and with key factors
    within [lo, hi] > 0 a key t can beat t* only if max_f f·w_t ≥ min_f f·w_t* (f in [lo, hi]),
    so only those (row, key) "candidate" pairs are kept — a ragged list, not a [R, K_max]
    block, so a few rows with many candidates cost only their own pairs, and rows whose only
    candidate is t* cost nothing. The argmax moves iff some candidate t has fk_t·w_t > fk_t*·w_t*,
    or = with t before t* (the first-maximum rule).
    """
    R, K = w.shape
    D = fq.shape[0]
    loose = torch.zeros(D, R, dtype=torch.bool)
    strict = torch.zeros(D, R, dtype=torch.bool)
    if R == 0 or D == 0:
        return loose, strict
    tstar = w.argmax(-1)
    wstar = w.gather(-1, tstar[:, None])[:, 0]
    lo, hi = (float(fk.min()), float(fk.max())) if fk.numel() else (1.0, 1.0)
    all_keys = torch.arange(K)
    masked_w = torch.isneginf(w)
    w0 = w.masked_fill(masked_w, 0.0)

    def strict_at(dd: Tensor, rr: Tensor) -> Tensor:  # (draw, row) pairs whose argmax moved
        out = torch.empty(len(dd), dtype=torch.bool)
        step = max(1, max_elements // K)
        for i in range(0, len(dd), step):
            d, r = dd[i:i + step], rr[i:i + step]
            row = (w0[r] * fk[d[:, None], base[r][:, None] + all_keys] * fq[d, r, None]).masked_fill(masked_w[r], -math.inf)
            capped = _cap(row, softcap)
            out[i:i + step] = torch.exp(capped.max(-1).values - torch.logsumexp(capped, -1)) >= strict_threshold
        return out

    if not (lo > 0 and bool((fq > 0).all())):
        # general case (a factor ≤ 0 can reverse a row's order): the whole noised row, blocks of draws
        minus_inf = torch.zeros_like(w).masked_fill(masked_w, -math.inf)
        cols = base[:, None] + all_keys
        step = max(1, max_elements // (R * K))
        for d0 in range(0, D, step):
            d1 = min(D, d0 + step)
            noised = fk[d0:d1].index_select(1, cols.reshape(-1)).view(d1 - d0, R, K)
            moved = noised.mul_(w0).mul_(fq[d0:d1, :, None]).add_(minus_inf).argmax(-1) != tstar
            loose[d0:d1] = moved
            dd, rr = moved.nonzero(as_tuple=True)
            strict[d0 + dd, rr] = strict_at(d0 + dd, rr)
        return loose, strict
    best = torch.where(w >= 0, w * hi, w * lo)  # largest f·w_t over the factor range (−inf stays −inf)
    floor = torch.where(wstar >= 0, wstar * lo, wstar * hi)  # smallest f·w_t*: the top's noised score is above it
    cand = best >= floor[:, None]  # t* included; masked (−inf) keys never qualify
    count = cand.sum(-1)
    cand &= (count >= 2)[:, None]  # a row whose only candidate is t* never moves
    # strict without the far keys: with x = fq·fk·w, M = max_t fk_t·w_t ≥ floor and fq ≥ q_lo (its row
    # minimum, > 0), Σ_{t not candidate} exp(x_t − max x) ≤ far[r]·exp(q_lo·(floor − M))
    q_lo = fq.min(0).values
    far = torch.exp(q_lo[:, None] * (best - floor[:, None])).masked_fill_(cand | masked_w, 0.0).sum(-1)
    del best
    pr, pk = cand.nonzero(as_tuple=True)  # [P] candidate pairs (t* included), by row then key
    del cand
    if not len(pr):
        return loose, strict
    ptr = torch.zeros(R + 1, dtype=torch.long)
    ptr[1:] = torch.bincount(pr, minlength=R).cumsum(0)
    before = (pk < tstar[pr])[:, None]
    wp = w[pr, pk]
    pair_col, star_col = base[pr] + pk, base + tstar
    fkT = fk.T  # [F, D]: one pair's factors over draws are one row
    step = max(1, max_elements // len(pr))
    for d0 in range(0, D, step):
        d1 = min(D, d0 + step)
        f = fkT[:, d0:d1].contiguous()
        v = f.index_select(0, pair_col).mul_(wp[:, None])  # [P, d]
        vs = f.index_select(0, star_col).mul_(wstar[:, None]).index_select(0, pr)  # [P, d]: the row's top
        beats = (v > vs).logical_or_(v.eq_(vs).logical_and_(before))  # t* vs itself: False
        del v, vs, f
        moved = torch.zeros(R, d1 - d0).index_add_(0, pr, beats.to(torch.float32)) > 0  # [R, d]
        del beats
        rr, dd = moved.nonzero(as_tuple=True)
        loose[d0:d1] = moved.T
        dd = dd + d0
        if softcap or not len(rr):  # the cap is not a scale: compute the whole row
            strict[dd, rr] = strict_at(dd, rr)
            continue
        for i in range(0, len(rr), max(1, max_elements // K)):  # (draw, row) hits, ragged over their candidates
            hr, hd = rr[i:i + max_elements // K or 1], dd[i:i + max_elements // K or 1]
            n_c = ptr[hr + 1] - ptr[hr]
            hit = torch.repeat_interleave(torch.arange(len(hr)), n_c)
            start = torch.repeat_interleave(ptr[hr] - (n_c.cumsum(0) - n_c), n_c)
            pair = start + torch.arange(len(hit))
            y = fk[hd[hit], pair_col[pair]] * wp[pair]  # fq cancels from the max and scales the exponent
            top = torch.full((len(hr),), -math.inf, dtype=y.dtype).scatter_reduce_(0, hit, y, "amax")
            fqh = fq[hd, hr]
            s_c = torch.zeros(len(hr), dtype=y.dtype).index_add_(0, hit, torch.exp(fqh[hit] * (y - top[hit])))
            sure = 1.0 / (s_c + far[hr] * torch.exp(q_lo[hr] * (floor[hr] - top))) >= strict_threshold
            unsure = ~sure & (1.0 / s_c >= strict_threshold)  # the far keys could decide: compute the whole row
            strict[hd[sure], hr[sure]] = True
            if bool(unsure.any()):
                strict[hd[unsure], hr[unsure]] = strict_at(hd[unsure], hr[unsure])
    return loose, strict


def _check(tokens: Any, levels: Any, draws: Any, targets: Any, placement: Any, distribution: str, max_elements: Any,
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
    model: Any, tokens: Tensor, levels: Sequence[float] = DEFAULT_LEVELS, *, draws: int = 64,
    targets: Sequence[str] = ("q", "k"), placement: str = "before_norm", distribution: str = "uniform",
    layers: Optional[Sequence[int]] = None, max_elements: int = DEFAULT_MAX_ELEMENTS, seed: int = 0,
    sparse_threshold: float = SPARSE_THRESHOLD, strict_threshold: float = SPARSE_THRESHOLD,
    progress: bool = False, anat: Optional[Anatomy] = None,
) -> Iterator[ChunkCollapse]:
    """Per (layer, block of query heads): the sparse rows and their decisions at every level and
    draw (:class:`ChunkCollapse`), from one clean forward pass. Arguments as :func:`bridge_collapse`.

    Rows counted: every (example, head, query) whose clean max attention (softmax of the rebuilt,
    soft-capped, masked scores — verified equal to ``hook_pattern`` by :func:`anatomy`) is ≥
    ``sparse_threshold``, except query 0, which has a single key and cannot collapse.
    """
    tokens, levels, targets = _check(tokens, levels, draws, targets, placement, distribution, max_elements, ("q", "k"))
    anat = anat or anatomy(model)
    if anat.kind != "bridge":
        raise ArchitectureError("bridge_collapse is for TransformerBridges; for a HookedNormTransformer use "
                                "interp_norm.noise.measure_collapse / run_collapse")
    layers = list(range(anat.n_layers)) if layers is None else list(layers)
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
    if layers == sorted(per_layer):  # one layer's q/k at a time, no logits (interp_norm.bridges.stream)
        stream = layer_caches(model, tokens.to(device), per_layer)
    else:  # an unsorted layer list keeps its order: every layer's q/k cached at once
        wanted = set().union(*per_layer.values())
        cache = model.run_with_cache(tokens.to(device), names_filter=lambda name: name in wanted)[1]
        stream = ((l, cache) for l in layers)
    b, n = tokens.shape
    for l, cache in tqdm(stream, total=len(layers), desc="collapse", disable=not progress):
        la = anat[l]
        q, k = rebuilt_query_key(model, cache, anat, l)
        z_q, z_k = collapse_kappa(anat, l, b, n, draws, seed, distribution)
        raw = {t: canonical(cache[la.hooks[t]], la.layouts.get(t, "bphd"), la.n_heads_of(t), la.d_head).cpu()
               for t in ("q", "k") if placement == "before_norm" and la.norms.get(t) is not None}
        f = []  # per level: (f_q [D, b, p, H], f_k [D, b, p, H_kv]) float64; O(pos), not O(pos²)
        for level in levels:
            kq = level * z_q if "q" in targets else torch.zeros_like(z_q)
            kk = level * z_k if "k" in targets else torch.zeros_like(z_k)
            f.append((placed_factors(la, "q", kq, raw.get("q"), placement), placed_factors(la, "k", kk, raw.get("k"), placement)))
        mask = attention_mask(la, n, n, q.device)
        mask_cpu = mask.cpu()
        usable = mask_cpu.sum(-1) >= 2  # [query]: query 0 has one key
        per_head = b * n * n
        block = max(1, min(la.n_heads, max_elements // max(1, per_head)))
        kind = theory_kind(la, targets, placement)
        kv_of = torch.as_tensor(la.kv_head_of)
        for h0 in range(0, la.n_heads, block):
            heads = tuple(range(h0, min(la.n_heads, h0 + block)))
            s = scores_from_qk(model, anat, l, q, k, heads=heads, softcap=False).cpu()  # [b, hc, n, n]
            pattern = masked_softmax(_cap(s, la.softcap), mask_cpu)
            sparse = theory.sparse_mask(pattern, sparse_threshold) & usable[None, None, :]
            del pattern
            rows = sparse.nonzero()  # (batch, head in block, query)
            rb, rh, rq = rows.unbind(-1)
            w = s[rb, rh, rq].to(torch.float64).masked_fill(~mask_cpu[rq], -math.inf)  # [R, n]
            del s
            gh = rh + h0
            rows = torch.stack([rb, gh, rq], -1)
            loose = torch.zeros(len(levels), draws, len(rb), dtype=torch.bool)
            strict = torch.zeros_like(loose)
            base = (rb * la.n_kv_heads + kv_of[gh]) * n  # [R]: where each row's key factors start
            for i, (fq, fk) in enumerate(f):
                fq_rows = fq[:, rb, rq, gh]  # [D, R]
                fkp = fk.permute(0, 1, 3, 2).reshape(fk.shape[0], -1)  # [D, b·H_kv·n]
                loose[i], strict[i] = row_decisions(w, fq_rows, fkp, base, la.softcap, strict_threshold, max_elements)
            yield ChunkCollapse(l, heads, levels, rows, w, loose, strict, kind, la.softcap)


# ----------------------------------------------------------------------------- the table


def bridge_collapse(
    model: Any, tokens: Tensor, levels: Sequence[float] = DEFAULT_LEVELS, *, draws: int = 64,
    targets: Sequence[str] = ("q", "k"), placement: str = "before_norm", distribution: str = "uniform",
    layers: Optional[Sequence[int]] = None, by_head: bool = False, max_elements: int = DEFAULT_MAX_ELEMENTS,
    seed: int = 0, predict: bool = True, strict_samples: int = 256, sparse_threshold: float = SPARSE_THRESHOLD,
    strict_threshold: float = SPARSE_THRESHOLD, progress: bool = False, anat: Optional[Anatomy] = None,
) -> pd.DataFrame:
    """Collapse rate of sparse attention rows vs noise level on a TransformerBridge, measured and
    predicted side by side (module docstring), from one clean forward pass of ``tokens`` [batch, pos].

    Noise: κ per (example, position, head) on ``targets`` ("q" and/or "k"; k once per key/value
    head), uniform or normal with RMS ``level``, ``draws`` draws per level (the same unit draws at
    every level), at ``placement`` "before_norm" (the projection output, where upstream
    interference arrives; a per-head q/k norm then removes it) or "after_norm" (what the scores
    use). ``layers`` None = all. ``max_elements`` bounds every score block (clean scores per block of
    heads, noised rows per block of draws); peak memory grows with it, results do not change.
    ``predict=False`` skips the theory (NaN); ``strict_samples`` Monte-Carlo samples per row for the
    strict prediction (0: NaN).

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
    anat = anat or anatomy(model)
    gen = seeded_generator(seed, _STREAM, 0x7E0E)
    groups: dict[tuple, list] = {}  # (layer, head, level index, definition) -> [(rates, pred, ns, theory)]
    chunks = collapse_chunks(model, tokens, levels, draws=draws, targets=targets, placement=placement,
                             distribution=distribution, layers=layers, max_elements=max_elements, seed=seed,
                             sparse_threshold=sparse_threshold, strict_threshold=strict_threshold,
                             progress=progress, anat=anat)
    targets = V.check_targets(targets, None, allowed=("q", "k"))
    level_list: tuple[float, ...] = ()
    for chunk in chunks:
        level_list = chunk.levels
        heads = chunk.rows[:, 1]
        for i, level in enumerate(chunk.levels):
            if predict:
                pl, ps, ns = theory.predict_rows(chunk.scores, NoiseLaw(level, distribution), targets, chunk.theory,
                                                  strict_threshold, int(strict_samples), gen, softcap=chunk.softcap)
            else:
                pl = ps = torch.full((len(chunk.rows),), math.nan, dtype=torch.float64)
                ns = math.inf
            for definition, dec, pred in (("loose", chunk.loose[i], pl), ("strict", chunk.strict[i], ps)):
                rates = dec.double().mean(0)
                for h in (chunk.heads if by_head else ("all",)):
                    sel = slice(None) if h == "all" else heads == h
                    groups.setdefault((chunk.layer, h, i, definition), []).append((rates[sel], pred[sel], ns, chunk.theory))
    base = dict(architecture=anat.architecture, placement=placement, distribution=distribution, targets="".join(targets))
    out = []
    pooled: dict[tuple, list] = {}
    for (layer, h, i, definition), items in groups.items():
        rates = torch.cat([it[0] for it in items])
        pred = torch.cat([it[1] for it in items])
        kinds = {it[3] for it in items}
        keys = dict(base, layer=layer, head=h, level=level_list[i], definition=definition,
                    theory=kinds.pop() if len(kinds) == 1 else "mixed")
        out.append(dict(keys, **theory.rate_summary(rates, pred, draws, items[0][2])))
        pooled.setdefault((i, definition), []).extend(items)
    for (i, definition), items in sorted(pooled.items()):
        kinds = {it[3] for it in items}
        keys = dict(base, layer="all", head="all", level=level_list[i], definition=definition,
                    theory=kinds.pop() if len(kinds) == 1 else "mixed")
        out.append(dict(keys, **theory.rate_summary(torch.cat([it[0] for it in items]),
                                                    torch.cat([it[1] for it in items]), draws, items[0][2])))
    df = pd.DataFrame(out)
    if len(df):
        df["layer"] = df["layer"].astype(object)
        df["head"] = df["head"].astype(object)
    return df


__all__ = ["DEFAULT_LEVELS", "collapse_kappa", "theory_kind", "ChunkCollapse", "row_decisions", "collapse_chunks",
           "bridge_collapse"]
