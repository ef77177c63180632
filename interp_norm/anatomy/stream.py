"""One forward pass, one layer's activations at a time: the memory bound of the analyses on real models.

``run_with_cache`` on a Hugging Face model holds every cached hook of every layer at once, and the
forward it runs ends with the unembedding: for Qwen3-0.6B on 8 windows of 256 tokens, 1.2 GB of
logits nobody reads plus every layer's q and k. :func:`layer_caches` runs the same forward (the
model's own code, unchanged, so every value is the one ``run_with_cache`` would give) in a worker
thread and hands the caller each layer's hooks once the forward has moved past that layer (at the next
layer's first hook, so the waiting forward holds none of the layer's attention internals); the forward
waits there until the caller asks for the next layer, drops what no later layer needs, and is stopped
right after the last hook anyone asked for (no later layers, no logits). :func:`window_blocks` runs
blocks of ``window_batch`` windows in lockstep and hands over one block's hooks of one layer at a time:
an analysis that reduces them to per-row results before asking for the next (collapse, geometry)
peaks at the weights plus one block's hooks plus those results, whatever the number of windows;
:func:`layer_caches` joins the blocks of a layer (the whole batch's hooks, as one pass). Every forward
here runs with ``use_cache=False``: the Hugging Face key/value cache of every layer (for generation; the values are the same without it) would
otherwise grow layer by layer, 470 MB for Qwen3-0.6B on 8 windows of 256 tokens in float32.
:func:`cache_before_unembed` is the one-shot form (the anatomy's probe): the hooks of one forward,
ended where the unembedding would start.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Mapping
from typing import Any, Callable, Generator, Iterator, Optional

import torch
from torch import Tensor

from interp_norm.errors import ArchitectureError, ConfigError, check_positive_int


class _Stop(Exception):
    """Raised inside a hook to end the forward early (caught in the worker)."""


def layer_caches(model: Any, tokens: Tensor, names: Mapping[int, set[str]], *,
                 window_batch: Optional[int] = None) -> Iterator[tuple[int, dict[str, Tensor]]]:
    """Yield ``(layer, cache)`` in increasing ``layer`` for every key of ``names`` (layer -> hook names it needs),
    each ``cache`` holding at least those hooks (detached, as ``run_with_cache`` stores them) from one
    forward pass of ``tokens`` (``torch.no_grad``).

    A hook another layer still needs stays until that layer is done (Gemma 4's KV-sharing layers read
    their source layer's keys); everything else is dropped after its layer. Leaving the loop early
    stops the forward. Raises :class:`ArchitectureError` if the forward ends before every named hook fired.

    ``window_batch`` (None: all windows in one pass) runs the forward over that many windows (rows of
    ``tokens``) at a time, the passes in lockstep: each pass stops in the hooks of a layer until every
    pass has reached it, and the layer's cache is their hooks concatenated along the batch dimension,
    so it holds exactly ``names[layer]`` for every window, as one pass would. Only one pass computes at a
    time, so the forward's own activations (attention weights, MLP) are those of ``window_batch``
    windows; what stays whole is the layer's cached hooks (use :func:`window_blocks` to never join
    them). Each window's values are its own forward's (no position or token mixes windows); equal to the one-pass values bit for bit where the model's
    matrix products give each row the same result whatever the number of rows (the tests check it).
    """
    if window_batch is not None:
        check_positive_int(window_batch, "window_batch", ConfigError, "windows per forward pass; None = all")
    if window_batch is None or window_batch >= len(tokens):
        yield from _one_pass(model, tokens, names)
        return
    merged: dict[str, list[Tensor]] = {}
    for layer, start, cache in window_blocks(model, tokens, names, window_batch):
        for n in names[layer]:
            merged.setdefault(n, []).append(cache[n])
        del cache
        if start + window_batch >= len(tokens):  # the last block of this layer
            joined = {n: torch.cat(p) for n, p in merged.items()}
            merged = {}
            yield layer, joined
            del joined


def window_blocks(model: Any, tokens: Tensor, names: Mapping[int, set[str]],
                  window_batch: Optional[int] = None) -> Iterator[tuple[int, int, dict[str, Tensor]]]:
    """Yield ``(layer, start, cache)``: layer by layer (increasing), then block by block of
    ``window_batch`` windows (rows of ``tokens``; None = all, one block), ``cache`` holding ``names[layer]``
    of windows ``start .. start + window_batch`` only. The forwards of the blocks run in lockstep: a
    block's pass waits in the hooks of a layer until the consumer asks for the next item, so a consumer
    that reduces each block's hooks to small per-window results before the next ``next()`` never holds
    more than one block's hooks of one layer (plus each paused pass's own state at that layer).
    Values: those of :func:`layer_caches` (each window's own forward). Raises :class:`ArchitectureError`
    if a pass does not reach a layer or a hook is not batch-first.
    """
    if window_batch is not None:
        check_positive_int(window_batch, "window_batch", ConfigError, "windows per forward pass; None = all")
    step = len(tokens) if window_batch is None else min(int(window_batch), len(tokens))
    starts = list(range(0, len(tokens), max(1, step)))
    passes = [_one_pass(model, tokens[i : i + step], names) for i in starts]
    last_use = {n: l for l in sorted(names) for n in names[l]}
    try:
        for layer in sorted(names):
            for start, it in zip(starts, passes):
                got = next(it, None)
                if got is None or got[0] != layer:
                    raise ArchitectureError(f"a pass over a block of windows did not reach layer {layer}'s hooks")
                cache = got[1]
                n_rows = min(step, len(tokens) - start)
                for n in names[layer]:
                    p = cache[n]
                    if len(starts) > 1 and (p.ndim == 0 or p.shape[0] != n_rows):
                        raise ArchitectureError(f"hook {n!r} is not batch-first ({tuple(p.shape)} for {n_rows} "
                                                "windows); use window_batch=None")
                yield layer, start, {n: cache[n] for n in names[layer]}
                for n in names[layer]:  # done with: the paused pass drops it now, not when it resumes
                    if last_use[n] == layer:
                        cache.pop(n, None)
                del got, cache
    finally:
        for it in reversed(passes):  # the last pass added its hooks last: it removes them first
            it.close()


def _one_pass(model: Any, tokens: Tensor, names: Mapping[int, set[str]]) -> Generator[tuple[int, dict[str, Tensor]], None, None]:
    """:func:`layer_caches` of one forward pass over every row of ``tokens``."""
    order = sorted(names)
    wanted = {n for l in order for n in names[l]}
    last_use: dict[str, int] = {}
    for l in order:
        for n in names[l]:
            last_use[n] = l
    handoff: "queue.Queue[tuple[str, Any]]" = queue.Queue()
    resume = threading.Semaphore(0)
    state: dict[str, Any] = {"abort": False, "worker": None}
    cache: dict[str, Tensor] = {}
    pending = list(order)

    fired: set[str] = set()

    def hook(act: Tensor, hook: Any, name: str) -> Tensor:
        if threading.get_ident() != state["worker"]:
            return act  # another forward of the model while this one waits (its hooks stay registered)
        if state["abort"]:
            raise _Stop
        # a complete layer is handed over once the forward has moved past it (a later layer's hook fires):
        # a pass waiting here holds no attention internals of that layer, only its own state at this point
        while pending and names[pending[0]] <= fired and name not in names[pending[0]]:
            layer = pending.pop(0)
            handoff.put(("layer", layer))
            resume.acquire()  # the caller works on this layer's cache meanwhile
            if state["abort"]:
                raise _Stop
            for n in names[layer]:
                if last_use[n] == layer:
                    cache.pop(n, None)
        cache[name] = act.detach()  # under the name asked for (an alias's HookPoint has another)
        fired.add(name)
        if wanted <= fired:  # nothing later is needed: hand the rest over and stop (no further layers, no logits)
            for layer in pending:
                handoff.put(("layer", layer))
            pending.clear()
            raise _Stop
        return act

    def work() -> None:
        state["worker"] = threading.get_ident()
        try:
            with torch.no_grad(), model.hooks(fwd_hooks=[(n, functools.partial(hook, name=n)) for n in sorted(wanted)]):
                model(tokens, use_cache=False)  # no key/value cache of every layer: nothing reads it
            missing = sorted(wanted - cache.keys())
            handoff.put(("error", ArchitectureError(f"the forward pass ended before hooks {missing[:4]} fired")))
        except _Stop:
            handoff.put(("done", None))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            handoff.put(("error", e))

    if not order:
        return
    worker = threading.Thread(target=work, name="interp_norm-layer-stream", daemon=True)
    worker.start()
    try:
        while True:
            kind, value = handoff.get()
            if kind == "layer":
                yield value, cache
                resume.release()
            elif kind == "done":
                return
            else:
                raise value
    finally:
        state["abort"] = True
        resume.release()  # a worker waiting in a hook wakes, sees the abort and stops
        worker.join()


def unembed_input(model: Any) -> Optional[str]:
    """The hook holding what the unembedding reads (``unembed.hook_in``), or None if the bridge has none."""
    hp = getattr(getattr(model, "unembed", None), "hook_in", None)
    name = getattr(hp, "name", None)
    return name if isinstance(name, str) else None


def cache_before_unembed(model: Any, tokens: Tensor, names: set[str]) -> dict[str, Tensor]:
    """The hooks of ``names`` that fire in one forward pass of ``tokens`` (``torch.no_grad``; detached,
    as ``run_with_cache`` stores them), the pass ended where the unembedding would start.

    The values are those of ``run_with_cache`` (the same forward, the model's own code); what is saved
    is the unembedding: a [batch, pos, vocab] logits tensor nobody reads and, with tied or large
    embeddings, reading the whole vocabulary matrix (for weights memory-mapped from safetensors, the
    pages of that matrix are then never brought into memory). A bridge without ``unembed.hook_in``
    runs to the end.
    """
    cache: dict[str, Tensor] = {}

    def keep(act: Tensor, hook: Any, name: str) -> Tensor:
        cache[name] = act.detach()
        return act

    def halt(act: Tensor, hook: Any) -> Tensor:
        raise _Stop

    stop = unembed_input(model)
    hooks: list[tuple[str, Callable]] = [(n, functools.partial(keep, name=n)) for n in sorted(names)]
    hooks += [(stop, halt)] if stop is not None else []
    try:
        with torch.no_grad(), model.hooks(fwd_hooks=hooks):
            model(tokens, use_cache=False)
    except _Stop:
        pass
    return cache


class StreamedCache(Mapping):
    """A read-only cache of ``names`` (layer -> hook names) over ``tokens`` that holds one layer at a time.

    Analyses written for a whole cache (``cache[name]`` for every layer, in layer order) read it as
    one: each lookup advances :func:`layer_caches` to the layer holding the name; a name of an earlier
    layer than the one held starts a new forward pass (``passes`` counts them). So memory stays one
    layer's hooks, and an analysis that sweeps the layers k times costs k early-stopped forwards.
    Call :meth:`close` (or use ``with``) to stop a forward left waiting. ``window_batch``: windows
    per forward pass, as in :func:`layer_caches`.
    """

    def __init__(self, model: Any, tokens: Tensor, names: Mapping[int, set[str]], *,
                 window_batch: Optional[int] = None) -> None:
        self.model, self.tokens, self.names = model, tokens, {l: set(names[l]) for l in sorted(names)}
        self.window_batch = window_batch
        self.layer_of: dict[str, int] = {}
        for l, group in self.names.items():
            for n in group:
                self.layer_of.setdefault(n, l)
        self.passes = 0
        self._it: Any = None
        self._layer: Optional[int] = None
        self._held: dict[str, Tensor] = {}

    def __contains__(self, name: object) -> bool:
        return name in self.layer_of

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.layer_of))

    def __len__(self) -> int:
        return len(self.layer_of)

    def __getitem__(self, name: str) -> Tensor:
        if name not in self.layer_of:
            raise KeyError(name)
        if name in self._held:
            return self._held[name]
        if self._it is None or self._layer is None or self.layer_of[name] < self._layer:
            self.close()
            self._it = layer_caches(self.model, self.tokens, self.names, window_batch=self.window_batch)
            self.passes += 1
        for layer, cache in self._it:
            self._layer, self._held = layer, {n: cache[n] for n in self.names[layer]}
            if name in self._held:
                return self._held[name]
        self._it = self._layer = None
        raise KeyError(name)

    def close(self) -> None:
        if self._it is not None:
            self._it.close()
        self._it, self._layer, self._held = None, None, {}

    def __enter__(self) -> "StreamedCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["layer_caches", "window_blocks", "StreamedCache", "cache_before_unembed", "unembed_input"]
