"""Exact activation patching, batched: many patch cells per forward pass, same numbers as TransformerLens.

TransformerLens's ``patching.get_act_patch_*`` run one full forward pass per cell. Here a chunk of
``K`` cells runs as ``K`` stacked copies of the corrupted batch, each copy patched in its own
cell, and the metric is read per copy. Two methods compute those copies:

* ``method="incremental"`` (our :class:`~interp_norm.core.model.HookedNormTransformer`): the
  :class:`~interp_norm.circuits.exact.engine.IncrementalEngine` recomputes, with the model's block steps
  (or fused kernels equal to them up to rounding), only the rows a patch can change and the metric
  can see.
* ``method="kv-cache"`` (a TransformerLens 4 bridge, its default for ``resid_*``, ``attn_out``,
  ``mlp_out``, ``z``): :class:`~interp_norm.circuits.exact.kv_patching.KVCacheEngine` re-runs the
  bridge's own blocks from the patched layer and position on, earlier keys and values from the
  corrupted run's cache; it refuses blocks it cannot replay exactly (``auto`` then uses hooks).
* ``method="hooks"`` (any TransformerLens-protocol model, e.g. a ``TransformerBridge``): full
  forward passes of the stacked batch with one hook per activation name that writes each copy's
  clean slice in place, as TransformerLens's setters do (a bridge's ``hook_resid_mid`` tensor is also
  the residual its block carries on; for our model each pass starts at the patched layer:
  ``model(resid, start_at_layer=l)``).

Cells that cannot change the metric are the corrupted baseline without a forward pass: the clean and
corrupted activations agree in the cell for every example (exactly: by causality before an example's
first differing input, known from the clean tokens or the clean cache's layer-0 residual, and at layer
0 before attention where the input row agrees; else the engine reproduces the clean cache bit for bit
and compares), or the position comes after the last one the metric reads. All equal
``transformer_lens.patching`` (tests check every cell to 1e-5); ``benchmarks/`` measure the speed-up.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor
from tqdm.auto import tqdm

from interp_norm.anatomy import capabilities
from interp_norm.circuits._types import (
    MetricFn,
    PatchResult,
    cell_kind,
    check_by,
    device,
    grid_cells,
    metric_name,
    metric_per_copy,
    require_eval,
)
from interp_norm.circuits.exact.engine import IncrementalEngine
from interp_norm.circuits.exact.kv_cells import kv_patch_cells
from interp_norm.circuits.exact.kv_patching import KV_ACTIVATIONS, KVCacheEngine
from interp_norm.circuits.exact.read_probe import ReadOutsideProbe, probe_read_positions
from interp_norm.circuits.metrics import LogitDiff
from interp_norm.circuits.pairs import PatchingPairs
from interp_norm.circuits.exact.patch_cells import (
    PatchSpec,
    after_first_difference,
    cell_differs,
    cell_mask,
    cells_from_df,
    check_hooks,
    check_pattern_hooks_act,
    clean_act,
    first_difference,
    head_count,
    input_differs,
    layer0_cells_differ,
    resid0,
    row_axis,
)
from interp_norm.errors import EngineRefusal, PatchingError
from interp_norm.core.hook_names import act_name
from interp_norm.core.specs import with_overrides

# activations computed before layer 0's softmax: the engine's corrupted values equal the model's bit for bit
_PRE_ATTENTION = ("resid_pre", "q", "k", "v")
_METHODS = ("auto", "incremental", "kv-cache", "hooks")
#: The incremental engine's chunk holds at most ``ENGINE_CHUNK_VALUES // d_model`` whole sequences'
#: rows (fewer if batch_size asks), so its per-group keys and values stay in the CPU's cache (z
#: patching, 32 pairs: d_model 64 within ~5% at 256-1024 sequences, 256 and 512 1.4-1.5x faster).
ENGINE_CHUNK_VALUES = 2**16


# ----------------------------------------------------------------------------- what one call needs


@dataclass
class _Request:
    """One :func:`activation_patch` call, validated: everything the later steps read."""

    model: Any
    #: [b, n] on the model's device
    corrupted: Tensor
    metric: MetricFn
    activation: str
    by: str
    #: the cell kind of the activation: "resid", "head" or "pattern"
    kind: str
    #: the cells' axis names, and each axis's size
    axes: tuple
    sizes: dict
    #: [n_cells, len(axes)]
    cells: Tensor
    #: explicit cells were given: one value per row instead of a grid
    flat: bool
    #: the clean activation of each layer
    clean_acts: list
    clean_cache: Mapping
    clean_tokens: Optional[Tensor]
    #: [b, n]: the logits positions the metric reads (None: all)
    read: Optional[Tensor]
    method: str
    batch_size: int

    @property
    def row_col(self) -> Optional[int]:
        """Which cell column is the (destination) position; None for all-position cells."""
        return row_axis(self.kind, self.by)

    @property
    def head_col(self) -> Optional[int]:
        """Which cell column is the head (each such cell patches one head), if any."""
        return self.axes.index("head") if "head" in self.axes else None

    def row_keys(self) -> np.ndarray:
        """Each cell's first affected position (0 for all-position cells)."""
        col = self.row_col
        return self.cells.numpy()[:, col] if col is not None else np.zeros(len(self.cells), dtype=np.int64)


@dataclass
class _CorruptedRun:
    """The corrupted run, by whichever method patches: its logits and the patched activation per layer."""

    logits: Tensor
    acts: list
    #: the incremental engine (our models) or the key/value-cache engine (bridges), or neither (hooks)
    engine: Optional[IncrementalEngine] = None
    kv: Optional[KVCacheEngine] = None
    #: hooks on our model: the cache holding each layer's resid_pre, to start a pass at its layer
    start_cache: Optional[Mapping] = None

    @property
    def method(self) -> str:
        return "incremental" if self.engine is not None else "kv-cache" if self.kv is not None else "hooks"

    def n_eff(self, n: int) -> int:
        """Positions up to the last one the metric reads (the hooks method: all ``n``)."""
        return self.engine.n_eff if self.engine is not None else self.kv.n_eff if self.kv is not None else n


# ----------------------------------------------------------------------------- the engines


def _make_engine(req: _Request, exact: bool) -> Optional[IncrementalEngine]:
    """The incremental engine where it applies (our models, ``method`` auto/incremental), else None.
    ``auto`` falls back to hooks, with a warning, only when the engine refuses the model
    (:class:`EngineRefusal`); any other error is a bug and propagates."""
    model, method = req.model, req.method
    if method not in ("auto", "incremental"):
        return None
    if not capabilities(model).full_vocabulary:  # the engine replays our components
        if method == "incremental":
            raise PatchingError(
                "method='incremental' needs a HookedNormTransformer; use method='kv-cache' (bridges) or 'hooks' for other models"
            )
        return None
    try:
        return IncrementalEngine(model, req.corrupted, req.read, exact_pattern=exact)
    except EngineRefusal as e:
        if method == "incremental":
            raise
        warnings.warn(f"incremental patching engine unavailable ({e}); falling back to hooks", RuntimeWarning, stacklevel=3)
        return None


def _make_kv_engine(req: _Request) -> Optional[KVCacheEngine]:
    """The bridge engine (:mod:`~interp_norm.circuits.exact.kv_patching`) where it applies, else None
    (``method='auto'``: full forward passes instead, with a warning, when the architecture refuses:
    :class:`EngineRefusal`; any other error propagates)."""
    model, method, activation, by = req.model, req.method, req.activation, req.by
    if method not in ("auto", "kv-cache") or capabilities(model).full_vocabulary:
        if method == "kv-cache":
            raise PatchingError("method='kv-cache' is for TransformerLens bridges; use method='incremental' for our models")
        return None
    if activation not in KV_ACTIVATIONS or by not in ("pos", "all"):
        if method == "kv-cache":
            raise PatchingError(
                f"method='kv-cache' patches {list(KV_ACTIVATIONS)} by 'pos' or 'all', not {activation!r} by {by!r}; use method='hooks'"
            )
        return None
    if method == "auto" and not capabilities(model).hf_original:
        return None
    b = req.corrupted.shape[0]
    find_read = None if req.read is not None else (lambda logits: probe_read_positions(req.metric, logits, b))
    try:
        return KVCacheEngine(model, req.corrupted, req.read, activation, find_read=find_read)
    except EngineRefusal as e:
        if method == "kv-cache":
            raise
        warnings.warn(f"key/value-cache patching unavailable ({e}); falling back to hooks", RuntimeWarning, stacklevel=3)
        return None


# ----------------------------------------------------------------------------- one chunk of cells


def _engine_chunk(req: _Request, engine: IncrementalEngine, cc: Tensor, live: Tensor) -> Optional[Tensor]:
    """Logits of the copies patched in cells ``cc`` (sorted by layer; ``live`` [K, b]: the examples
    each can change), or None where no read row changes."""
    kind, by, clean_acts = req.kind, req.by, req.clean_acts
    K, ne = cc.shape[0], engine.n_eff
    dev = clean_acts[0].device
    m = cell_mask(kind, by, cc, ne, req.sizes["head"], ne).to(dev)
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
    if req.row_col is not None:
        P &= torch.arange(ne).view(1, 1, ne) == cc[:, req.row_col].view(K, 1, 1)
    heads = None if req.head_col is None else cc[:, req.head_col]  # each cell patches one head
    return engine.run(cc[:, 0], req.activation, patch_at, P.to(dev), heads)


def _hooks_chunk(req: _Request, cc: Tensor, start: Optional[Tensor]) -> Tensor:
    """Logits of the copies patched in cells ``cc`` (one layer): full passes with a patching hook
    (``start``: the layer's resid_pre, to start there on our model).

    The hook writes in place, so every reader of the hooked tensor sees the patch: a bridge's
    ``hook_resid_mid`` (``ln2.hook_in``; OLMo-2 ``mlp.hook_in``) is also the residual its Hugging Face
    block adds the MLP's output to, which a returned new tensor would miss."""
    model, corrupted = req.model, req.corrupted
    K, (b, n) = cc.shape[0], corrupted.shape
    layer = int(cc[0, 0])
    clean = req.clean_acts[layer]

    def hook_fn(act: Tensor, hook: Any) -> Tensor:
        X = act.view(K, b, *act.shape[1:])
        m = cell_mask(req.kind, req.by, cc, n, req.sizes["head"], n).to(act.device)
        X.copy_(torch.where(m, clean.unsqueeze(0).to(act.dtype), X))
        return act

    hooks = [(act_name(req.activation, layer), hook_fn)]
    if start is None:
        return model.run_with_hooks(corrupted.repeat(K, 1), fwd_hooks=hooks)
    with model.hooks(fwd_hooks=hooks):  # our model: start at the patched layer
        return model(start.repeat(K, 1, 1), start_at_layer=layer)


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


# ----------------------------------------------------------------------------- the steps


def _prepare(model, corrupted_tokens, clean_cache, metric, activation, *, spec: PatchSpec,
             clean_tokens: Optional[Tensor]) -> _Request:
    """Validate the call and gather what every later step reads: the tokens on the model's device,
    the metric (the logit difference of PatchingPairs by default), the cells, the clean activations
    (from ``clean_cache``, or a run of ``clean_tokens``) and the positions the metric reads. Every
    bad input fails here, with a :class:`PatchingError`, before any patched pass."""
    by, cells, method, batch_size = spec.by, spec.cells, spec.method, spec.batch_size
    dev = device(model)
    if isinstance(corrupted_tokens, PatchingPairs):
        pairs = corrupted_tokens
        corrupted = pairs.corrupted_tokens.to(dev)
        clean_tokens = pairs.clean_tokens if clean_tokens is None else clean_tokens
        metric = LogitDiff(pairs) if metric is None else metric
    else:
        corrupted = torch.as_tensor(corrupted_tokens).to(dev)
    if metric is None:
        raise PatchingError("give a metric (logits -> [batch]) or pass PatchingPairs to use the logit difference")
    if corrupted.ndim != 2:
        raise PatchingError(f"corrupted tokens must be [batch, pos], got shape {tuple(corrupted.shape)}")
    kind = cell_kind(activation)
    if method not in _METHODS:
        raise PatchingError(f"method must be 'auto', 'incremental', 'kv-cache' or 'hooks', got {method!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise PatchingError(f"batch_size must be a positive integer, got {batch_size!r}")
    require_eval(model)
    axes = check_by(activation, by)
    b, n = corrupted.shape
    L = model.cfg.n_layers
    sizes = dict(layer=L, pos=n, head=model.cfg.n_heads, dest_pos=n, src_pos=n)
    names = [act_name(activation, l) for l in range(L)]
    check_hooks(model, names)
    if kind == "pattern" and not capabilities(model).full_vocabulary:
        check_pattern_hooks_act(model, corrupted, names)
    if clean_cache is None:
        if clean_tokens is None:
            raise PatchingError("give clean_cache (model.run_with_cache(clean_tokens)[1]) or clean_tokens")
        _, clean_cache = model.run_with_cache(clean_tokens.to(dev), names_filter=lambda nm: nm in names)
    clean_acts = [clean_act(clean_cache, nm) for nm in names]
    for a in clean_acts:
        if a.shape[0] != b:
            raise PatchingError(f"clean activations have batch {a.shape[0]} but corrupted tokens have batch {b}")
    sizes["head"] = head_count(kind, clean_acts, model.cfg.n_heads)
    read = getattr(metric, "read_mask", None)
    if read is None and getattr(metric, "read_positions", None) is not None:
        read = torch.as_tensor(metric.read_positions).expand(b, -1)
    return _Request(
        model=model, corrupted=corrupted, metric=metric, activation=activation, by=by, kind=kind, axes=axes,
        sizes=sizes, cells=cells_from_df(cells, axes, sizes) if cells is not None else grid_cells(axes, sizes),
        flat=cells is not None, clean_acts=clean_acts, clean_cache=clean_cache, clean_tokens=clean_tokens,
        read=None if read is None else torch.as_tensor(read).to(dev), method=method, batch_size=batch_size,
    )


def _knows_first_difference(req: _Request) -> bool:
    """Are the positions where the inputs differ known (the clean tokens, or the clean cache's
    layer-0 residual)? Then cells before them are dead by causality, and the engine need not
    reproduce the clean cache bit for bit to find them (it runs its faster arithmetic)."""
    b, n = req.corrupted.shape
    return req.clean_tokens is not None or resid0(req.clean_cache, b, n) is not None


def _corrupted_run(req: _Request) -> _CorruptedRun:
    """The corrupted run, by the fastest method that applies: the incremental engine (our models),
    the key/value-cache engine (bridges), else the model's own ``run_with_cache``."""
    engine = _make_engine(req, exact=not _knows_first_difference(req))
    kv = _make_kv_engine(req)
    L, model = req.model.cfg.n_layers, req.model
    if engine is not None:
        run = _CorruptedRun(engine.logits, [engine.acts[l][req.activation] for l in range(L)], engine=engine)
    elif kv is not None:  # the bridge's own forward, run_with_cache's activations
        run = _CorruptedRun(kv.logits, kv.acts, kv=kv)
    else:
        names = [act_name(req.activation, l) for l in range(L)]
        restarts = capabilities(model).full_vocabulary  # model(resid, start_at_layer=l) replays from a cached resid_pre
        want = set(names) | ({act_name("resid_pre", l) for l in range(L)} if restarts else set())
        logits, cache = model.run_with_cache(req.corrupted, names_filter=lambda nm: nm in want)
        run = _CorruptedRun(logits, [cache[nm] for nm in names], start_cache=cache if restarts else None)
    for a, c in zip(req.clean_acts, run.acts):
        if a.shape != c.shape:
            raise PatchingError(
                f"clean activations {tuple(a.shape)} and corrupted ones {tuple(c.shape)} differ in shape; "
                "clean and corrupted tokens must have the same [batch, pos]"
            )
    return run


def _dead_cells(req: _Request, run: _CorruptedRun) -> tuple[Tensor, np.ndarray]:
    """Which examples each cell can change ([n_cells, b] bool) and which cells are live at all.

    A cell is dead for an example where its clean and corrupted values agree: proved by causality
    and the layer-0 rule when the engine runs its fast arithmetic (it cannot compare activations
    bit for bit then), else by comparing the activations (:mod:`~interp_norm.circuits.exact.patch_cells`).
    A cell after the last position the metric reads is dead for every example. Dead cells are the
    corrupted baseline without a forward pass."""
    kind, by, cells = req.kind, req.by, req.cells
    b, n = req.corrupted.shape
    engine = run.engine
    if engine is not None and not engine.exact_pattern:
        in_diff = input_differs(req.corrupted, req.clean_tokens, req.clean_cache, engine.acts[0]["resid_pre"])
        differs = after_first_difference(kind, by, cells, first_difference(in_diff), n)
        if req.activation in _PRE_ATTENTION:  # layer 0 before any softmax: as the input row
            at0 = cells[:, 0] == 0
            differs[at0] &= layer0_cells_differ(by, cells[at0], in_diff)
    else:
        differs = cell_differs(kind, by, cells, req.clean_acts, run.acts)
    live = differs.any(-1).numpy()
    if req.row_col is not None:
        live &= req.row_keys() < run.n_eff(n)
    return differs, live


def _plan_chunks(req: _Request, run: _CorruptedRun, order: np.ndarray, differs: Tensor) -> list[np.ndarray]:
    """Group the live cells ``order`` (sorted by layer, then first affected row) into patched passes.

    The incremental engine's chunks may span layers (a copy enters at its own layer) and hold as many
    recomputed positions as ``batch_size`` whole sequences, at most ``ENGINE_CHUNK_VALUES // d_model``
    so that its per-group keys stay in the CPU's cache; a cell's cost is its live examples times the
    positions from its row on. The hooks method runs full passes of one layer, ``batch_size`` rows
    (copies x examples) each. (The key/value-cache engine plans its own: :func:`kv_patch_cells`.)"""
    b, n = req.corrupted.shape
    if run.engine is not None:
        ne, rows = run.engine.n_eff, req.row_keys()[order]
        cost = differs.sum(-1).numpy()[order] * (ne - np.minimum(rows, ne - 1) if req.row_col is not None else ne)
        sequences = min(req.batch_size, max(1, ENGINE_CHUNK_VALUES // req.model.cfg.d_model))
        return _pack(order, np.maximum(cost, 1), sequences * n)
    K_max = max(1, req.batch_size // b)
    layers = req.cells.numpy()[order, 0]
    chunks = []
    for layer in np.unique(layers):
        sel = order[layers == layer]
        chunks += [sel[i : i + K_max] for i in range(0, len(sel), K_max)]
    return chunks


def _run_chunks(req: _Request, run: _CorruptedRun, chunks: list, differs: Tensor, out: tuple, progress: bool) -> None:
    """Patch each chunk of cells and write its metric values into ``out`` = (store [n_cells, b or
    scalar], baseline): a chunk whose patches change no read row is the baseline."""
    store, baseline = out
    b, n = req.corrupted.shape
    for chunk in (tqdm(chunks, desc=f"patching {req.activation}") if progress else chunks):
        idx = torch.from_numpy(chunk)
        cc, K = req.cells[idx], len(chunk)
        if run.engine is not None:
            logits = _engine_chunk(req, run.engine, cc, differs[idx])
            if logits is None:
                vals = baseline.unsqueeze(0).expand(K, *baseline.shape)
            else:
                vals = metric_per_copy(req.metric, logits.reshape(K * b, n, -1), K, b)
        else:
            start = None if run.start_cache is None else run.start_cache[act_name("resid_pre", int(cc[0, 0]))]
            vals = metric_per_copy(req.metric, _hooks_chunk(req, cc, start), K, b)
        store[idx] = vals.to(torch.float64).cpu()


def _sweep(req: _Request, run: _CorruptedRun, out: tuple, progress: bool) -> None:
    """Every cell's metric values into ``out`` = (store, baseline): dead cells are the baseline, the
    live ones are patched in chunks ordered by (layer, first affected row)."""
    store, baseline = out
    differs, live = _dead_cells(req, run)
    order = np.lexsort((req.row_keys(), req.cells.numpy()[:, 0]))
    dead = order[~live[order]]
    if len(dead):
        store[torch.from_numpy(dead)] = baseline.to(torch.float64).cpu()
        order = order[live[order]]
    if run.kv is not None:  # chunks of one position, cells of any layer
        if len(order):
            idx = torch.from_numpy(order)
            store[idx] = kv_patch_cells(run.kv, req.cells[idx], differs[idx], req.clean_acts, req.metric,
                                        batch_size=req.batch_size, columns=(req.row_col, req.head_col),
                                        progress=progress, desc=f"patching {req.activation}")
    else:
        _run_chunks(req, run, _plan_chunks(req, run, order, differs), differs, (store, baseline), progress)



@torch.no_grad()
def activation_patch(
    model,
    corrupted_tokens: Union[Int[Tensor, "batch pos"], PatchingPairs],
    clean_cache: Optional[Mapping[str, Tensor]] = None,
    metric: Optional[MetricFn] = None,
    activation: str = "z",
    spec: Optional[PatchSpec] = None,
    *,
    clean_tokens: Optional[Tensor] = None,
    progress: bool = False,
    **overrides: Any,
) -> PatchResult:
    """Exact activation patching of ``activation`` (clean into corrupted), many cells per pass.

    ``corrupted_tokens`` may be a :class:`PatchingPairs` (then the clean cache, and by default
    the logit-difference metric, come from it). ``metric`` maps logits ``[batch, pos, vocab]``
    to ``[batch]`` (per-example; a scalar-valued metric also works but gives no per-example
    values). A metric with ``read_mask`` [batch, pos] declares the positions it reads; for one without,
    the ``kv-cache`` engine finds them once by probing it (:mod:`~interp_norm.circuits.exact.read_probe`):
    which positions it reads must not depend on the logits' values (a read elsewhere returns NaN and the
    sweep is redone over every position, with a warning). Options (``by``, ``cells``, ``method``, ``batch_size``): :class:`PatchSpec`, ``spec`` and/or its
    fields as keywords. ``batch_size`` bounds the work per forward pass and with
    it the memory: ``batch_size`` rows (copies x examples) for the hooks method; for the incremental
    engine, which keeps only the positions a patch changes, as many changed positions as
    ``batch_size`` whole sequences have, at most ``ENGINE_CHUNK_VALUES // d_model`` (cache-sized;
    one pass may then hold cells of several layers); for the bridges' ``kv-cache`` engine, at most
    ``batch_size`` (copy, example) rows per pass. Steps: :func:`_prepare` (validate),
    :func:`_corrupted_run`, :func:`_sweep` (:func:`_dead_cells`, :func:`_plan_chunks`, :func:`_run_chunks`).
    """
    spec = with_overrides(PatchSpec, spec, overrides, who="activation_patch", error=PatchingError)
    req = _prepare(model, corrupted_tokens, clean_cache, metric, activation, spec=spec, clean_tokens=clean_tokens)
    run = _corrupted_run(req)
    b = req.corrupted.shape[0]
    baseline = metric_per_copy(req.metric, run.logits, 1, b)[0]
    clean_val = None
    if req.clean_tokens is not None:
        clean_val = metric_per_copy(req.metric, model(req.clean_tokens.to(req.corrupted.device)), 1, b)[0]
    scalar_metric = baseline.ndim == 0
    n_cells = len(req.cells)
    store = torch.zeros((n_cells,) if scalar_metric else (n_cells, b), dtype=torch.float64)

    try:
        _sweep(req, run, (store, baseline), progress)
    except ReadOutsideProbe as e:  # the probed read set was wrong: every position, from the start
        assert run.kv is not None
        warnings.warn(f"{e}; recomputing every position", RuntimeWarning, stacklevel=2)
        run.kv.read_everywhere()
        _sweep(req, run, (store, baseline), progress)

    mean = store if scalar_metric else store.mean(-1)
    values = mean if req.flat else mean.view(*[req.sizes[a] for a in req.axes])
    return PatchResult(
        activation=activation, by=spec.by, axis_names=list(req.axes), values=values.to(torch.float32),
        index_df=pd.DataFrame(req.cells.numpy(), columns=list(req.axes)), per_example=None if scalar_metric else store,
        baseline=baseline.detach().double().cpu(), clean=None if clean_val is None else clean_val.detach().double().cpu(),
        metric_name=metric_name(req.metric), method=f"exact-{run.method}", flat=req.flat,
        rows_computed=run.engine.rows_computed if run.engine is not None else run.kv.rows_computed if run.kv is not None else None,
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


__all__ = ["PatchResult", "PatchSpec", "activation_patch", "patch_sweep"]
