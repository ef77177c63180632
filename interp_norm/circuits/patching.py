"""Exact activation patching, batched: many patch cells per forward pass, same numbers as TransformerLens.

TransformerLens's ``patching.get_act_patch_*`` run one full forward pass per cell. Here a chunk of
``K`` cells runs as ``K`` stacked copies of the corrupted batch, each copy patched in its own
cell, and the metric is read per copy. Two methods compute those copies:

* ``method="incremental"`` (our :class:`~interp_norm.model.HookedNormTransformer`): the
  :class:`~interp_norm.circuits.engine.IncrementalEngine` recomputes, with the model's block steps
  (or fused kernels equal to them up to rounding), only the rows a patch can change and the metric
  can see.
* ``method="kv-cache"`` (a TransformerLens 4 ``TransformerBridge``, the default there for
  ``resid_pre/mid/post``, ``attn_out``, ``mlp_out`` and ``z``): the
  :class:`~interp_norm.circuits.kv_patching.KVCacheEngine` re-runs the bridge's own blocks from the
  patched layer on, at the positions from the patched one on, the earlier positions' keys and values
  taken from the corrupted run through the attention's cache interface; it refuses architectures
  whose blocks it cannot replay exactly (``auto`` then uses hooks).
* ``method="hooks"`` (any TransformerLens-protocol model, e.g. a ``TransformerBridge``): full
  forward passes of the stacked batch with one hook per activation name that writes each copy's
  clean slice (for our model each pass starts at the patched layer: ``model(resid, start_at_layer=l)``).

Cells that cannot change the metric are the corrupted baseline without a forward pass: the clean
and corrupted activations agree in the cell for every example, or (incremental engine) the position
comes after the last one the metric reads. Agreement is exact: positions before an example's first
differing input (known from the clean tokens, or the clean cache's layer-0 residual) agree by
causality, and so do the layer-0 activations before attention at positions whose input agrees
(each is a function of its own input row); without either,
the engine reproduces the clean cache's arithmetic bit for bit and the activations are compared.

Both equal ``transformer_lens.patching`` on the same model, inputs and metric (tests check
every cell to 1e-5). ``benchmarks/bench_patching.py`` measures the speed-up.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor
from tqdm.auto import tqdm

from interp_norm.circuits._types import (
    MetricFn,
    PatchResult,
    cell_kind,
    check_by,
    device,
    grid_cells,
    is_ours,
    metric_name,
    metric_per_copy,
    require_eval,
)
from interp_norm.circuits.engine import IncrementalEngine
from interp_norm.circuits.kv_patching import KV_ACTIVATIONS, KVCacheEngine, kv_patch_cells
from interp_norm.circuits.metrics import LogitDiff
from interp_norm.circuits.pairs import PatchingPairs
from interp_norm.errors import HookNameError, PatchingError
from interp_norm.hooks import act_name

# ----------------------------------------------------------------------------- cells

# activations computed before layer 0's softmax: the engine's corrupted values equal the model's bit for bit
_PRE_ATTENTION = ("resid_pre", "q", "k", "v")
#: The incremental engine's chunk holds at most ``ENGINE_CHUNK_VALUES // d_model`` whole sequences'
#: rows (fewer if batch_size asks): its per-group copies of keys and values then stay in the CPU's
#: cache. Measured on z patching (32 pairs, 1024 sequences against smaller chunks): d_model 64
#: (the cpu preset) within ~5% at 256-1024; d_model 256, 6 layers: 1.4x faster at 256; the paper's
#: d_model 512: 1.5x faster at 64-256.
ENGINE_CHUNK_VALUES = 2**16


def _row_axis(kind: str, by: str) -> Optional[int]:
    """Which cell column is the (destination) position, or None for all-position cells."""
    if by == "all":
        return None
    return 2 if kind == "pattern" else 1


def _cell_mask(kind: str, by: str, cells: Tensor, n_rows: int, n_heads: int, n_keys: int) -> Tensor:
    """Bool mask, broadcastable to the stacked activation [K, b, ...], True where copy k is patched.

    Layouts: resid [K, b, R, d]; head [K, b, R, h, dh]; pattern [K, b, h, R, keys]; R = ``n_rows``
    (the first positions; cells at later positions patch nothing).
    """
    K, R = cells.shape[0], n_rows
    k = torch.arange(K)
    if kind == "resid":
        m = torch.zeros(K, 1, R, 1, dtype=torch.bool)
        if by == "all":
            m[:] = True
        else:
            ok = cells[:, 1] < R
            m[k[ok], 0, cells[ok, 1], 0] = True
    elif kind == "head":
        m = torch.zeros(K, 1, R, n_heads, 1, dtype=torch.bool)
        if by == "all":
            m[k, 0, :, cells[:, 1], 0] = True
        else:
            ok = cells[:, 1] < R
            m[k[ok], 0, cells[ok, 1], cells[ok, 2], 0] = True
    else:  # pattern
        m = torch.zeros(K, 1, n_heads, R, n_keys, dtype=torch.bool)
        h = cells[:, 1]
        if by == "all":
            m[k, 0, h] = True
        else:
            ok = cells[:, 2] < R
            if by == "pos":
                m[k[ok], 0, h[ok], cells[ok, 2], :] = True
            else:
                ok &= cells[:, 3] < n_keys
                m[k[ok], 0, h[ok], cells[ok, 2], cells[ok, 3]] = True
    return m


def _cell_differs(kind: str, by: str, cells: Tensor, clean_acts: list, corr_acts: list) -> Tensor:
    """[n_cells, batch] bool: does the clean value differ from the corrupted one in the cell's slice?"""
    per_layer = []
    for a, c in zip(clean_acts, corr_acts):
        ne = a.to(c.device, c.dtype) != c
        per_layer.append(ne if kind == "pattern" else ne.any(-1))
    M = torch.stack(per_layer).cpu()  # [L, b, ...]
    l = cells[:, 0]
    if kind == "resid":
        return M[l, :, cells[:, 1]] if by == "pos" else M.any(-1)[l]
    if kind == "head":
        return M[l, :, cells[:, 1], cells[:, 2]] if by == "pos" else M.any(2)[l, :, cells[:, 1]]
    if by == "pos":
        return M.any(-1)[l, :, cells[:, 1], cells[:, 2]]
    if by == "all":
        return M.any(-1).any(-1)[l, :, cells[:, 1]]
    return M[l, :, cells[:, 1], cells[:, 2], cells[:, 3]]


def _after_first_difference(kind: str, by: str, cells: Tensor, first: Tensor, n: int) -> Tensor:
    """[n_cells, batch] bool: is the cell's (destination) position at or after the example's first
    differing input position? Before it the clean and corrupted runs agree exactly (causality)."""
    first = first.cpu()
    col = _row_axis(kind, by)
    if col is None:
        return (first < n).unsqueeze(0).repeat(len(cells), 1)
    return cells[:, col].unsqueeze(1) >= first.unsqueeze(0)


def _input_differs(corrupted: Tensor, clean_tokens: Optional[Tensor], clean_cache, corrupted_resid0) -> Optional[Tensor]:
    """[batch, pos] bool: where the clean and corrupted inputs differ, from the tokens or from the
    clean cache's layer-0 residual; None if neither is known."""
    b, n = corrupted.shape
    if clean_tokens is not None and tuple(clean_tokens.shape) == (b, n):
        return clean_tokens.to(corrupted.device) != corrupted
    if corrupted_resid0 is not None and _resid0(clean_cache, b, n) is not None:
        clean0 = _resid0(clean_cache, b, n)
        return (clean0.to(corrupted_resid0.device, corrupted_resid0.dtype) != corrupted_resid0).any(-1)
    return None


def _first_difference(diff: Tensor) -> Tensor:
    """Per example, the first position where the inputs differ (``n`` if none)."""
    b, n = diff.shape
    pos = torch.arange(n, device=diff.device).expand(b, n)
    return torch.where(diff, pos, n).amin(-1)


def _layer0_cells_differ(by: str, cells: Tensor, diff: Tensor) -> Tensor:
    """[n_cells, batch] bool for layer-0 cells before attention (resid_pre, q, k, v): a position's
    value there is a function of its own input row, so it differs only where the input does."""
    diff = diff.cpu()
    if by == "all":
        return diff.any(-1).unsqueeze(0).repeat(len(cells), 1)
    return diff[:, cells[:, 1]].T


def _resid0(clean_cache, b: int, n: int) -> Optional[Tensor]:
    """The clean run's residual entering layer 0, if the cache holds it."""
    try:
        t = clean_cache[act_name("resid_pre", 0)]
    except (KeyError, TypeError):
        return None
    return t if tuple(t.shape[:2]) == (b, n) else None


def _cells_from_df(cells: pd.DataFrame, axes: Sequence[str], sizes: dict[str, int]) -> Tensor:
    df = cells.rename(columns={"head_index": "head"})
    missing = [a for a in axes if a not in df.columns]
    if missing:
        raise PatchingError(f"cells need columns {list(axes)}; missing {missing}")
    if len(df) == 0:
        raise PatchingError(
            f"the set of cells to patch is empty; pass at least one row with columns {list(axes)}, or cells=None for every cell"
        )
    try:
        values = df[list(axes)].to_numpy(dtype="int64")
    except (TypeError, ValueError):
        raise PatchingError(f"cells columns {list(axes)} must hold integer indices") from None
    t = torch.tensor(values, dtype=torch.long).reshape(-1, len(axes))
    for j, a in enumerate(axes):
        if len(t) and (t[:, j].min() < 0 or t[:, j].max() >= sizes[a]):
            raise PatchingError(f"cell column {a!r} must lie in [0, {sizes[a]}), got {t[:, j].min()}..{t[:, j].max()}")
    return t


def _pack(order: np.ndarray, cost: np.ndarray, budget: int) -> list[np.ndarray]:
    """Consecutive runs of ``order`` whose ``cost`` adds up to at most ``budget`` (at least one each)."""
    chunks, start, total = [], 0, 0
    for i, c in enumerate(cost):
        if i > start and total + c > budget:
            chunks.append(order[start:i])
            start, total = i, 0
        total += c
    if start < len(order):
        chunks.append(order[start:])
    return chunks


def _clean_act(clean_cache: Mapping[str, Tensor], name: str) -> Tensor:
    try:
        return clean_cache[name]
    except KeyError:
        raise HookNameError(
            f"the clean cache has no {name!r}; run model.run_with_cache(clean_tokens) without a names_filter that drops it"
        ) from None


# ----------------------------------------------------------------------------- the two methods


def _engine_chunk(engine: IncrementalEngine, kind: str, by: str, activation: str, cc: Tensor, clean_acts: list,
                  live: Tensor, n_heads: int, head_col: Optional[int] = None) -> Optional[Tensor]:
    """Logits of the copies patched in cells ``cc`` (sorted by layer), or None where no read row changes."""
    K, ne = cc.shape[0], engine.n_eff
    dev = clean_acts[0].device
    m = _cell_mask(kind, by, cc, ne, n_heads, ne).to(dev)
    m_rows = (m[:, 0].transpose(1, 2) if kind == "pattern" else m[:, 0]).contiguous()  # [K, rows, ...]
    m_rows = m_rows.reshape(K * ne, *m_rows.shape[2:])
    n = clean_acts[0].shape[1 if kind != "pattern" else 2]

    def patch_at(layer: int):
        clean = clean_acts[layer]
        src = clean[..., :ne].transpose(1, 2).contiguous() if kind == "pattern" else clean  # [b, n, ...]
        src = src.reshape(-1, *src.shape[2:])

        def patch(X: Tensor, idx: tuple) -> Tensor:  # rows idx = (copy, example, position)
            k_, b_, r_ = idx
            return torch.where(m_rows.index_select(0, k_ * ne + r_), src.index_select(0, b_ * n + r_).to(X.dtype), X)

        return patch

    P = live.unsqueeze(-1).expand(K, live.shape[1], ne).clone()  # [K, b, n]: rows each copy changes
    rowcol = _row_axis(kind, by)
    if rowcol is not None:
        P &= torch.arange(ne).view(1, 1, ne) == cc[:, rowcol].view(K, 1, 1)
    heads = None if head_col is None else cc[:, head_col]  # each cell patches one head
    return engine.run(cc[:, 0], activation, patch_at, P.to(dev), heads)


def _hooks_chunk(model, kind: str, by: str, activation: str, cc: Tensor, clean: Tensor, corrupted: Tensor,
                 start: Optional[Tensor]) -> Tensor:
    """Logits of the copies patched in cells ``cc`` (one layer): full passes with a patching hook."""
    K, (b, n) = cc.shape[0], corrupted.shape
    layer = int(cc[0, 0])

    def hook_fn(act: Tensor, hook: Any) -> Tensor:
        X = act.view(K, b, *act.shape[1:])
        m = _cell_mask(kind, by, cc, n, model.cfg.n_heads, n).to(act.device)
        return torch.where(m, clean.unsqueeze(0).to(act.dtype), X).reshape(act.shape)

    hooks = [(act_name(activation, layer), hook_fn)]
    if start is None:
        return model.run_with_hooks(corrupted.repeat(K, 1), fwd_hooks=hooks)
    with model.hooks(fwd_hooks=hooks):  # our model: start at the patched layer
        return model(start.repeat(K, 1, 1), start_at_layer=layer)


def _make_engine(model, corrupted: Tensor, read: Optional[Tensor], method: str, exact: bool) -> Optional[IncrementalEngine]:
    if method not in ("auto", "incremental"):
        return None
    if not is_ours(model):
        if method == "incremental":
            raise PatchingError(
                "method='incremental' needs a HookedNormTransformer; use method='kv-cache' (bridges) or 'hooks' for other models"
            )
        return None
    try:
        return IncrementalEngine(model, corrupted, read, exact_pattern=exact)
    except (PatchingError, AttributeError, KeyError, TypeError, RuntimeError) as e:
        if method == "incremental":
            raise e if isinstance(e, PatchingError) else PatchingError(
                f"the incremental engine cannot run this model ({type(e).__name__}: {e}); use method='hooks'"
            ) from e
        warnings.warn(f"incremental patching engine unavailable ({e}); falling back to hooks", RuntimeWarning)
        return None


def _make_kv_engine(model, corrupted: Tensor, read: Optional[Tensor], method: str, activation: str, by: str):
    """The bridge engine (:mod:`~interp_norm.circuits.kv_patching`) where it applies, else None
    (``method='auto'``: full forward passes instead, with a warning if the architecture refuses)."""
    if method not in ("auto", "kv-cache") or is_ours(model):
        if method == "kv-cache":
            raise PatchingError("method='kv-cache' is for TransformerLens bridges; use method='incremental' for our models")
        return None
    if activation not in KV_ACTIVATIONS or by not in ("pos", "all"):
        if method == "kv-cache":
            raise PatchingError(
                f"method='kv-cache' patches {list(KV_ACTIVATIONS)} by 'pos' or 'all', not {activation!r} by {by!r}; use method='hooks'"
            )
        return None
    from interp_norm.anatomy._common import is_bridge

    if method == "auto" and not is_bridge(model):
        return None
    try:
        return KVCacheEngine(model, corrupted, read, activation)
    except (PatchingError, AttributeError, KeyError, TypeError, RuntimeError, ValueError, IndexError) as e:
        if method == "kv-cache":
            raise e if isinstance(e, PatchingError) else PatchingError(
                f"the key/value-cache engine cannot run this bridge ({type(e).__name__}: {e}); use method='hooks'"
            ) from e
        warnings.warn(f"key/value-cache patching unavailable ({e}); falling back to hooks", RuntimeWarning)
        return None


# ----------------------------------------------------------------------------- main entry


@torch.no_grad()
def activation_patch(
    model,
    corrupted_tokens: Union[Int[Tensor, "batch pos"], PatchingPairs],
    clean_cache: Optional[Mapping[str, Tensor]] = None,
    metric: Optional[MetricFn] = None,
    activation: str = "z",
    *,
    by: str = "pos",
    cells: Optional[pd.DataFrame] = None,
    method: str = "auto",
    batch_size: int = 1024,
    clean_tokens: Optional[Tensor] = None,
    progress: bool = False,
) -> PatchResult:
    """Exact activation patching of ``activation`` (clean into corrupted), many cells per pass.

    ``corrupted_tokens`` may be a :class:`PatchingPairs` (then the clean cache, and by default
    the logit-difference metric, come from it). ``metric`` maps logits ``[batch, pos, vocab]``
    to ``[batch]`` (per-example; a scalar-valued metric also works but gives no per-example
    values). ``by``: ``"pos"`` (per position; per destination position for ``pattern``),
    ``"all"`` (all positions at once) or ``"dest_src"`` (``pattern`` only). ``cells``: a
    DataFrame of explicit cells (columns = the axis names); the result is then flat, one
    value per row, as in TransformerLens. ``batch_size`` bounds the work per forward pass and with
    it the memory: ``batch_size`` rows (copies x examples) for the hooks method; for the incremental
    engine, which keeps only the positions a patch changes, as many changed positions as
    ``batch_size`` whole sequences have, at most ``ENGINE_CHUNK_VALUES // d_model`` (cache-sized;
    one pass may then hold cells of several layers); for the bridges' ``kv-cache`` engine, at most
    ``batch_size`` (copy, example) rows per pass. ``method``: ``"auto"`` (the fastest exact one),
    ``"incremental"`` (our models), ``"kv-cache"`` (bridges) or ``"hooks"``.
    """
    pairs = corrupted_tokens if isinstance(corrupted_tokens, PatchingPairs) else None
    dev = device(model)
    if pairs is not None:
        corrupted = pairs.corrupted_tokens.to(dev)
        clean_tokens = pairs.clean_tokens if clean_tokens is None else clean_tokens
        if metric is None:
            metric = LogitDiff(pairs)
    else:
        corrupted = torch.as_tensor(corrupted_tokens).to(dev)
    if metric is None:
        raise PatchingError("give a metric (logits -> [batch]) or pass PatchingPairs to use the logit difference")
    if corrupted.ndim != 2:
        raise PatchingError(f"corrupted tokens must be [batch, pos], got shape {tuple(corrupted.shape)}")
    kind = cell_kind(activation)
    if method not in ("auto", "incremental", "kv-cache", "hooks"):
        raise PatchingError(f"method must be 'auto', 'incremental', 'kv-cache' or 'hooks', got {method!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise PatchingError(f"batch_size must be a positive integer, got {batch_size!r}")
    require_eval(model)
    axes = check_by(activation, by)
    b, n = corrupted.shape
    L, H = model.cfg.n_layers, model.cfg.n_heads
    sizes = dict(layer=L, pos=n, head=H, dest_pos=n, src_pos=n)
    names = [act_name(activation, l) for l in range(L)]
    if clean_cache is None:
        if clean_tokens is None:
            raise PatchingError("give clean_cache (model.run_with_cache(clean_tokens)[1]) or clean_tokens")
        _, clean_cache = model.run_with_cache(clean_tokens.to(dev), names_filter=lambda nm: nm in names)
    clean_acts = [_clean_act(clean_cache, nm) for nm in names]
    for a in clean_acts:
        if a.shape[0] != b:
            raise PatchingError(f"clean activations have batch {a.shape[0]} but corrupted tokens have batch {b}")

    flat = cells is not None
    cell_t = _cells_from_df(cells, axes, sizes) if flat else grid_cells(axes, sizes)
    head_col = axes.index("head") if "head" in axes else None
    n_cells = len(cell_t)

    read = getattr(metric, "read_mask", None)
    if read is None and getattr(metric, "read_positions", None) is not None:
        read = torch.as_tensor(metric.read_positions).expand(b, -1)
    # where the inputs first differ, per example: cells before it are dead by causality, so the
    # engine need not reproduce the clean cache bit for bit to find them
    knows_first = clean_tokens is not None or _resid0(clean_cache, b, n) is not None
    read = None if read is None else torch.as_tensor(read).to(dev)
    engine = _make_engine(model, corrupted, read, method, not knows_first)
    kv = _make_kv_engine(model, corrupted, read, method, activation, by)
    first = in_diff = None
    if engine is not None and knows_first:
        in_diff = _input_differs(corrupted, clean_tokens, clean_cache, engine.acts[0]["resid_pre"])
        first = _first_difference(in_diff)
    start_cache = None
    if engine is not None:
        corrupted_logits = engine.logits
        corr_acts = [engine.acts[l][activation] for l in range(L)]
    elif kv is not None:  # the bridge's own forward, run_with_cache's activations
        corrupted_logits, corr_acts = kv.logits, kv.acts
    else:
        want = set(names) | ({act_name("resid_pre", l) for l in range(L)} if is_ours(model) else set())
        corrupted_logits, cache = model.run_with_cache(corrupted, names_filter=lambda nm: nm in want)
        corr_acts = [cache[nm] for nm in names]
        start_cache = cache if is_ours(model) else None
    for a, c in zip(clean_acts, corr_acts):
        if a.shape != c.shape:
            raise PatchingError(
                f"clean activations {tuple(a.shape)} and corrupted ones {tuple(c.shape)} differ in shape; "
                "clean and corrupted tokens must have the same [batch, pos]"
            )
    baseline = metric_per_copy(metric, corrupted_logits, 1, b)[0]
    clean_val = None
    if clean_tokens is not None:
        clean_val = metric_per_copy(metric, model(clean_tokens.to(dev)), 1, b)[0]
    scalar_metric = baseline.ndim == 0
    store = torch.zeros((n_cells,) if scalar_metric else (n_cells, b), dtype=torch.float64)

    # order cells by (layer, first affected row) so chunks share a start layer and a tight row range
    rowcol = _row_axis(kind, by)
    cells_np = cell_t.numpy()
    rowkey = cells_np[:, rowcol] if rowcol is not None else np.zeros(n_cells, dtype=np.int64)
    order = np.lexsort((rowkey, cells_np[:, 0]))
    # cells that cannot change the metric are the corrupted baseline, without a forward pass:
    # clean == corrupted there for every example (e.g. positions before the corrupted token),
    # or (incremental engine) the position comes after the last one the metric reads
    if engine is not None and not engine.exact_pattern:
        differs = _after_first_difference(kind, by, cell_t, first, n)
        if activation in _PRE_ATTENTION:  # layer 0 before any softmax: as the input row
            at0 = cell_t[:, 0] == 0
            differs[at0] &= _layer0_cells_differ(by, cell_t[at0], in_diff)
    else:
        differs = _cell_differs(kind, by, cell_t, clean_acts, corr_acts)  # [cells, b]
    live = differs.any(-1).numpy()
    n_eff = engine.n_eff if engine is not None else kv.n_eff if kv is not None else n
    if rowcol is not None:
        live &= rowkey < n_eff
    dead = order[~live[order]]
    if len(dead):
        store[torch.from_numpy(dead)] = baseline.to(torch.float64).cpu()
        order = order[live[order]]
    if kv is not None:  # chunks of one position, cells of any layer; the loop below has nothing left
        if len(order):
            idx = torch.from_numpy(order)
            store[idx] = kv_patch_cells(kv, kind, cell_t[idx], differs[idx], clean_acts, metric, batch_size, rowcol, head_col,
                                        progress, f"patching {activation}")
        chunks = []
    elif engine is not None:  # chunks span layers; as many recomputed positions as batch_size sequences (cache-sized)
        ne = engine.n_eff
        cost = differs.sum(-1).numpy()[order] * (ne - np.minimum(rowkey[order], ne - 1) if rowcol is not None else ne)
        sequences = min(batch_size, max(1, ENGINE_CHUNK_VALUES // model.cfg.d_model))
        chunks = _pack(order, np.maximum(cost, 1), sequences * n)
    else:
        K_max = max(1, batch_size // b)
        layers = cells_np[order, 0]
        chunks = []
        for layer in np.unique(layers):
            sel = order[layers == layer]
            chunks += [sel[i : i + K_max] for i in range(0, len(sel), K_max)]

    for chunk in (tqdm(chunks, desc=f"patching {activation}") if progress else chunks):
        idx = torch.from_numpy(chunk)
        cc = cell_t[idx]
        K = len(chunk)
        if engine is not None:
            logits = _engine_chunk(engine, kind, by, activation, cc, clean_acts, differs[idx], H, head_col)
            if logits is None:
                vals = baseline.unsqueeze(0).expand(K, *baseline.shape)
            else:
                vals = metric_per_copy(metric, logits.reshape(K * b, n, -1), K, b)
        else:
            clean = clean_acts[int(cc[0, 0])]
            start = None if start_cache is None else start_cache[act_name("resid_pre", int(cc[0, 0]))]
            vals = metric_per_copy(metric, _hooks_chunk(model, kind, by, activation, cc, clean, corrupted, start), K, b)
        store[idx] = vals.to(torch.float64).cpu()

    per_example = None if scalar_metric else store
    mean = store if scalar_metric else store.mean(-1)
    values = mean if flat else mean.view(*[sizes[a] for a in axes])
    return PatchResult(
        activation=activation, by=by, axis_names=list(axes), values=values.to(torch.float32),
        index_df=pd.DataFrame(cells_np, columns=list(axes)), per_example=per_example,
        baseline=baseline.detach().double().cpu(), clean=None if clean_val is None else clean_val.detach().double().cpu(),
        metric_name=metric_name(metric), method=f"exact-{'incremental' if engine is not None else 'kv-cache' if kv is not None else 'hooks'}", flat=flat,
        rows_computed=engine.rows_computed if engine is not None else kv.rows_computed if kv is not None else None,
    )


@torch.no_grad()
def patch_sweep(
    model,
    pairs: PatchingPairs,
    metric: Optional[MetricFn] = None,
    activations: Sequence[Union[str, tuple[str, str]]] = ("resid_pre", "attn_out", "mlp_out", ("z", "pos"), ("z", "all")),
    *,
    method: str = "auto",
    batch_size: int = 1024,
    progress: bool = False,
) -> dict[str, PatchResult]:
    """Several patching sweeps sharing one clean cache; keys like ``"z"`` or ``"z_all"``.

    Entries of ``activations`` are names (by position) or ``(name, by)`` tuples.
    """
    dev = device(model)
    specs = [(a, "pos") if isinstance(a, str) else tuple(a) for a in activations]
    for a, _ in specs:
        cell_kind(a)
    names = {act_name(a, l) for a, _ in specs for l in range(model.cfg.n_layers)}
    _, cache = model.run_with_cache(pairs.clean_tokens.to(dev), names_filter=lambda nm: nm in names)
    metric = metric if metric is not None else LogitDiff(pairs)
    out = {}
    for a, by in specs:
        key = a if by == "pos" else f"{a}_{by}"
        out[key] = activation_patch(
            model, pairs, cache, metric, a, by=by, method=method, batch_size=batch_size, progress=progress
        )
    return out


__all__ = ["PatchResult", "activation_patch", "patch_sweep"]
