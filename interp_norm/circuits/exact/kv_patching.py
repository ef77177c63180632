"""Exact activation patching on TransformerLens 4 bridges, recomputing only what a patch can change.

A patch at (layer ``l``, position ``p``) changes nothing before layer ``l`` and nothing at positions
before ``p`` (causal attention). :class:`KVCacheEngine` runs the corrupted input once through the
bridge's own forward, keeping each block's input, the keyword arguments the Hugging Face model loop
passed it (attention mask, rotary ``position_embeddings``, position ids) and the keys and values its
attention computed (after RoPE and any q/k norm). A chunk of patch cells sharing ``p`` then runs as
stacked copies of the corrupted examples through the bridge's own blocks ``l..L-1`` at positions
``p..`` (up to the last position the metric reads) only: the earlier positions' keys and values come
from the corrupted run through the attention's key/value-cache interface (``update(k, v, layer)``),
the mask, rotary embeddings and position ids are the corrupted run's, sliced to those positions, so
RoPE, grouped k/v heads and masks (Gemma 4's sliding windows) stay the model's own code. The cache is
handed over under both names an attention may read it by (``layer_past``: TransformerLens's attention
bridges; ``cache``: a Hugging Face attention run natively, Gemma 4's); Gemma 4's per-layer inputs are
sliced like the positions, and its KV-shared layers get the shared key/value entries
(:mod:`~interp_norm.circuits.exact.kv_sharing`). A copy *enters* at its cell's layer and
is patched by a hook at the same hook name, on the same hook point, that ``transformer_lens.patching``
uses. The final norm and the unembedding run only at the positions the metric reads.

Nothing here re-derives the model: a block wired otherwise (an attention that ignores the cache, a
head with extra steps such as Gemma's logit soft-capping, kwargs of unknown meaning) is caught by
:meth:`KVCacheEngine._check`, which replays the corrupted run from a middle position and compares
the logits and the hooked activation with the full forward, and is refused with a
:class:`~interp_norm.errors.EngineRefusal` (``activation_patch(method="auto")`` then falls back to
full forward passes). Sweeps are batched like :mod:`interp_norm.circuits.exact.patching`'s (Menary et al.
2024, sec. 5 uses activation patching to locate the circuits whose attention collapses).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import Tensor

from interp_norm.circuits.exact.kv_sharing import SHARED_KW, SharedKV, recording_shares
from interp_norm.errors import EngineRefusal, PatchingError
from interp_norm.core.hook_names import act_name

#: Activations the engine patches: per-position residual-stream tensors and per-head ``z``.
KV_ACTIVATIONS = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "z")
#: Keyword arguments of a block call: replaced (hidden, caches) or sliced to the recomputed positions.
_CACHE_KW = ("cache", "past_key_values", "past_key_value", "layer_past", SHARED_KW)
_SLICED_KW = ("attention_mask", "position_embeddings", "position_ids", "cache_position", "per_layer_input")
#: The replay check's tolerance, relative to the largest value compared. The replay multiplies the same
#: float32 numbers as the forward in other groupings (the query rows p.. alone, keys from the cache), so
#: it differs by rounding times the model's amplification: measured <= 5e-7 on the GPT-2 and Llama bench
#: shapes, 1.4e-5 on the Gemma 4 E2B one, exactly 0 in float64; a block wired otherwise (a cache
#: ignored, a wrong mask or shared key/value entry) is off by O(1). A model so sharp that rounding
#: alone exceeds it (Gemma 4's score scale 1.0 with random q/k-norm gains: 1.2e-3) is refused.
CHECK_RTOL = 1e-4
#: Bytes of logits handed to the metric at once (stacked copies x examples x positions x vocab).
METRIC_BYTES = 2**27


class _PastKV:
    """The key/value-cache interface an attention calls (``update(k, v, layer_idx)``): the corrupted
    run's keys/values of the earlier positions, with this call's ones appended; records the call."""

    def __init__(self, k: Optional[Tensor] = None, v: Optional[Tensor] = None):
        self.k, self.v, self.calls = k, v, 0
        self.new: Optional[tuple[Tensor, Tensor]] = None

    def update(self, k: Tensor, v: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        self.calls += 1
        self.new = (k, v)
        if self.k is None or self.k.shape[-2] == 0:
            return k, v
        assert self.v is not None  # keys and values are cached together
        return torch.cat([self.k, k], dim=-2), torch.cat([self.v, v], dim=-2)


def _close(got: Tensor, want: Tensor) -> bool:
    """Equal up to :data:`CHECK_RTOL` of the largest value compared (and of 1)."""
    return got.numel() == 0 or float((got - want).abs().max()) <= CHECK_RTOL * (float(want.abs().max()) + 1.0)


def _first(out: Any) -> Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


class KVCacheEngine:
    """The corrupted run of ``tokens`` on a bridge, and re-runs of patched copies from (layer, position).

    ``read_mask`` [batch, pos]: the logits the metric reads (None: all). ``activation``: the one
    patched (:data:`KV_ACTIVATIONS`). ``logits`` and ``acts[l]`` are the corrupted run's (the
    bridge's own forward, as ``run_with_cache`` gives them). ``find_read``: without a ``read_mask``,
    a function of those logits giving the positions read ([pos] bool, None: all), found by probing the
    metric (:mod:`~interp_norm.circuits.exact.read_probe`); ``probed`` then says the metric gets NaN
    at the other positions, so that a read there shows.
    """

    def __init__(self, model, tokens: Tensor, read_mask: Optional[Tensor], activation: str,
                 find_read: Optional[Callable[[Tensor], Optional[Tensor]]] = None):
        self._setup(model, tokens.shape, tokens.device, read_mask, activation)
        handles = self._capture_hooks()
        try:
            with torch.inference_mode():
                self.logits, cache = model.run_with_cache(tokens, names_filter=lambda nm: nm in self.names)
        except TypeError as e:  # a block that takes no key/value cache argument
            self._no_cache_argument(e)
        finally:
            for h in handles:
                h.remove()
        self.acts = [cache[nm] for nm in self.names]
        self._captured()
        self.probed = False
        if read_mask is None and find_read is not None:
            found = find_read(self.logits)
            if found is not None and not bool(found.all()):
                self._set_read(found.to(self.logits.device).expand(self.b, self.n))
                self.probed = True
        self._check()

    def _set_read(self, read: Tensor) -> None:
        """The positions the metric reads ([batch, pos] bool): only these are unembedded, nothing
        after the last is recomputed."""
        self.cols = read.to(torch.bool).any(0).nonzero().flatten()
        self.n_eff = int(self.cols.max()) + 1 if len(self.cols) else self.n

    def read_everywhere(self) -> None:
        """Drop a probed read set: every position is recomputed and unembedded (the safe fallback
        when the metric read outside it); re-checks the replay."""
        self._set_read(torch.ones(self.b, self.n, dtype=torch.bool, device=self.logits.device))
        self.probed = False
        self._check()

    def _setup(self, model, shape: tuple, dev: torch.device, read_mask: Optional[Tensor], activation: str) -> None:
        """Checks the bridge and prepares the capture of a run over ``shape`` = (batch, pos) tokens."""
        from interp_norm.anatomy import capabilities

        if not capabilities(model).hf_original:
            raise EngineRefusal("method='kv-cache' needs a TransformerLens TransformerBridge; use method='incremental' or 'hooks'")
        if activation not in KV_ACTIVATIONS:
            raise PatchingError(f"method='kv-cache' patches {list(KV_ACTIVATIONS)}, not {activation!r}; use method='hooks'")
        blocks = getattr(model, "blocks", None)
        for name in ("ln_final", "unembed"):
            if not hasattr(model, name):
                raise EngineRefusal(f"this bridge has no {name!r} component; use method='hooks'")
        self.model, self.activation = model, activation
        #: per-layer inputs [rows, p.., layers, d'] of the rows being re-run, when not the captured run's
        self.per_layer_rows: Optional[Tensor] = None
        self.L = model.cfg.n_layers
        if blocks is None or len(blocks) != self.L:
            raise EngineRefusal("method='kv-cache' needs the bridge's standard 'blocks' stack; use method='hooks'")
        self.blocks = list(blocks)
        self.b, self.n = shape
        read = torch.ones(self.b, self.n, dtype=torch.bool, device=dev) if read_mask is None else read_mask
        self._set_read(read.to(dev, torch.bool).expand(self.b, self.n))
        self.names = [act_name(activation, l) for l in range(self.L)]
        try:
            self._params = [inspect.signature(blk.original_component.forward) for blk in self.blocks]
        except (AttributeError, ValueError) as e:  # no wrapped Hugging Face block, or no signature to bind
            raise EngineRefusal(f"the bridge's blocks have no readable original_component.forward ({e}); use method='hooks'") from None
        last = self.blocks[-1]
        attn = getattr(last, "attn", None)
        #: the last block's parts whose output at a position reaches only that position's logits:
        #: run at the read positions alone (their inputs sliced, outputs zero elsewhere)
        self.tail = [m for m in (getattr(attn, "q", None), getattr(attn, "o", None), getattr(last, "mlp", None))
                     if isinstance(m, torch.nn.Module)]
        self.slice_tail = True

    def _capture_hooks(self) -> list:
        """Hooks recording each block's input, call arguments and keys/values, and the last block's
        output, during the next forward pass (remove them after it)."""
        self.calls: list[Any] = [None] * self.L
        self.resid: list[Any] = [None] * self.L
        self.kv: list[Any] = [None] * self.L
        self._rec_shares: Any = None  # the recording shared key/value dict, if the blocks take one
        handles = [blk.register_forward_pre_hook(self._capture(l), with_kwargs=True) for l, blk in enumerate(self.blocks)]
        handles.append(self.blocks[-1].register_forward_hook(lambda m, a, out: self.resid.append(_first(out))))
        return handles

    @staticmethod
    def _no_cache_argument(e: TypeError) -> None:
        if "layer_past" not in str(e):
            raise e
        raise EngineRefusal(f"the bridge's blocks take no key/value cache ({e}); use method='hooks'") from None

    def _captured(self) -> None:
        """After the captured pass: every attention used the cache it was given; keys and values."""
        self.shares = None if self._rec_shares is None else SharedKV(self._rec_shares, self.L)
        for l, rec in enumerate(self.kv):
            want = 0 if self.shares is not None and self.shares.reads_shared(l) else 1  # a KV-shared layer computes none
            if rec is None or rec.calls != want:
                raise EngineRefusal(
                    f"block {l}'s attention did not use the key/value cache it was given ({0 if rec is None else rec.calls} "
                    "calls); method='kv-cache' cannot run this architecture -- use method='hooks'"
                )
        if len(self.resid) != self.L + 1:
            raise EngineRefusal("the bridge's last block did not return its output; use method='hooks'")
        # [b, kv_heads, n, d_head], as the attention used them (None: a KV-shared layer)
        self.keys = [None if rec.new is None else rec.new[0] for rec in self.kv]
        self.values = [None if rec.new is None else rec.new[1] for rec in self.kv]
        self.rows_computed = self.b * self.n * self.L

    # -- the corrupted run -------------------------------------------------------------------
    def _capture(self, l: int):
        def hook(module, args, kwargs):
            try:
                bound = self._params[l].bind_partial(*args, **kwargs).arguments
            except TypeError as e:  # called with arguments its own signature does not take
                raise EngineRefusal(f"block {l}'s call does not bind to its forward's signature ({e}); use method='hooks'") from None
            extra = bound.pop("kwargs", {}) if isinstance(bound.get("kwargs"), dict) else {}
            bound.update(extra)
            hidden_name = next(iter(self._params[l].parameters))
            self.resid[l] = bound.pop(hidden_name)
            self.calls[l] = bound
            self.kv[l] = rec = _PastKV()
            new = {**kwargs, **self._cache_kwargs(l, rec)}
            names = list(self._params[l].parameters)
            if "cache" in new and names.index("cache") < len(args):  # passed positionally (GPT-2)
                i = names.index("cache")
                args = args[:i] + (new.pop("cache"),) + args[i + 1 :]
            if SHARED_KW in bound:
                if SHARED_KW not in kwargs:
                    raise EngineRefusal(f"block {l} takes {SHARED_KW!r} positionally; use method='hooks'")
                if self._rec_shares is None:
                    self._rec_shares = recording_shares(kwargs[SHARED_KW])
                self._rec_shares.layer = l
                new[SHARED_KW] = self._rec_shares
            return args, new

        return hook

    def _cache_kwargs(self, l: int, past: _PastKV) -> dict:
        """The key/value cache under the names block ``l``'s attention may read it: ``layer_past``
        (TransformerLens's attention bridges) and, where the block takes one, ``cache`` (a Hugging
        Face attention run natively, e.g. Gemma 4's); each call is counted, so a double use shows."""
        return {"layer_past": past, **({"cache": past} if "cache" in self._params[l].parameters else {})}

    def _call_kwargs(self, l: int, examples: Tensor, p: int, q: int, past: _PastKV) -> dict:
        """Block ``l``'s keyword arguments for rows of ``examples`` at positions ``p..q-1``."""
        out: dict = {}
        for key, val in self.calls[l].items():
            if key in _CACHE_KW:
                continue
            if key == "use_cache":
                out[key] = False
            elif key == "per_layer_input" and self.per_layer_rows is not None:  # the rows' own (attribution)
                out[key] = self.per_layer_rows[:, :, l]
            elif key in _SLICED_KW:
                out[key] = self._slice(key, val, examples, p, q)
            elif torch.is_tensor(val) or (isinstance(val, (tuple, list)) and any(torch.is_tensor(t) for t in val)):
                raise EngineRefusal(
                    f"block {l} takes a tensor argument {key!r} whose meaning per position is unknown; "
                    "method='kv-cache' cannot slice it -- use method='hooks'"
                )
            else:
                out[key] = val
        out.update(self._cache_kwargs(l, past))
        return out

    def _slice(self, key: str, val: Any, examples: Tensor, p: int, ne: int) -> Any:
        if val is None:
            return None
        if key == "position_embeddings":
            return tuple(self._rows(t[:, p:ne], examples) for t in val)
        if key == "cache_position":
            return val[p:ne]
        if key == "position_ids":
            return self._rows(val[..., p:ne], examples)
        if key == "per_layer_input":  # [batch, pos, d]: Gemma 4's per-layer input of each position
            return self._rows(val[:, p:ne], examples)
        if val.ndim != 4 or val.shape[-1] != self.n or val.shape[-2] != self.n:  # attention_mask
            raise EngineRefusal(
                f"the attention mask has shape {tuple(val.shape)}, not [batch, 1, pos, pos]; "
                "method='kv-cache' cannot slice it -- use method='hooks'"
            )
        return self._rows(val[..., p:ne, :ne], examples)

    def _rows(self, t: Tensor, examples: Tensor) -> Tensor:
        return t if t.shape[0] == 1 else t.index_select(0, examples)

    # -- re-runs ------------------------------------------------------------------------------
    def _block(self, l: int, H: Tensor, examples: Tensor, p: int, shared: Optional[dict] = None) -> Tensor:
        """Block ``l`` on rows ``H`` [rows, positions p.., d] of ``examples``, the positions before ``p``
        read from the corrupted run's keys and values. In the last block (``slice_tail``) the query
        projection, the attention's output projection and the MLP run at the read positions only:
        the other positions' keys and values are still computed, their outputs are never read.
        ``shared``: the shared key/value entries of ``H``'s rows (KV sharing), updated with what the
        block writes."""
        q = p + H.shape[1]
        k, v = self.keys[l], self.values[l]
        past = _PastKV() if k is None or v is None else _PastKV(k[..., :p, :].index_select(0, examples),
                                                                 v[..., :p, :].index_select(0, examples))
        kwargs = self._call_kwargs(l, examples, p, q, past)
        if self.shares is not None:
            kwargs[SHARED_KW] = box = self.shares.call_dict(shared)
        handles = []
        if l == self.L - 1 and self.slice_tail and self.tail:
            keep = self.cols[(self.cols >= p) & (self.cols < q)] - p
            if len(keep) < q - p:
                for m in self.tail:
                    handles.append(m.register_forward_pre_hook(self._slice_in(keep, q - p), with_kwargs=True))
                    handles.append(m.register_forward_hook(self._scatter_out(keep, q - p)))
        try:
            out = _first(self.blocks[l](H, **kwargs))
        finally:
            for h in handles:
                h.remove()
        if past.calls != (k is not None):
            raise EngineRefusal(f"block {l}'s attention did not use the key/value cache; use method='hooks'")
        if self.shares is not None and shared is not None:
            shared.clear()
            shared.update(box)
        return out

    @staticmethod
    def _slice_in(keep: Tensor, width: int):
        def hook(module, args, kwargs):
            x = args[0] if args else None
            if not torch.is_tensor(x) or x.ndim < 3 or x.shape[1] != width:
                raise EngineRefusal(
                    f"{type(module).__name__} of the last block takes {None if x is None else tuple(x.shape)}, not "
                    f"[rows, {width}, ...]; method='kv-cache' cannot run it at the read positions -- use method='hooks'"
                )
            return (x.index_select(1, keep),) + tuple(args[1:]), kwargs

        return hook

    @staticmethod
    def _scatter_out(keep: Tensor, width: int):
        def hook(module, args, out):
            y = _first(out)
            full = y.new_zeros((y.shape[0], width) + tuple(y.shape[2:]))
            full[:, keep] = y
            return (full,) + tuple(out[1:]) if isinstance(out, tuple) else full

        return hook

    def _head(self, H: Tensor, p: int) -> tuple[Tensor, Tensor]:
        """Logits at the read positions at or after ``p``: (positions, [rows, positions, vocab])."""
        cols = self.cols[self.cols >= p]
        x = H.index_select(1, cols - p)
        return cols, self.model.unembed(self.model.ln_final(x))

    def _check(self) -> None:
        """Replay the corrupted run from layer 0 at a middle position; logits and the hooked activation
        must equal the full forward's (else the blocks are not what this engine assumes)."""
        p = self.n_eff // 2
        ex = torch.arange(self.b, device=self.logits.device)
        seen: dict[int, Tensor] = {}

        def record(l: int):
            def hook(act: Tensor, hook: Any) -> None:
                seen[l] = act.detach().clone()

            return hook

        with torch.inference_mode(), self.model.hooks(fwd_hooks=[(nm, record(l)) for l, nm in enumerate(self.names)]):
            H = self.resid[0][:, p : self.n_eff]
            shared: dict = {}
            for l in range(self.L):
                H = self._block(l, H, ex, p, shared)
            cols, lg = self._head(H, p)
        ref = self.logits.index_select(1, cols)
        err = float((lg - ref).abs().max()) if len(cols) else 0.0
        if not _close(lg, ref):
            raise EngineRefusal(
                f"replaying the bridge's blocks from a key/value cache disagrees with its forward by {err:.3g}; "
                "method='kv-cache' cannot run this architecture -- use method='hooks'"
            )
        keep = self.cols[self.cols >= p] - p
        for l in range(self.L):
            want = self.acts[l][:, p : self.n_eff]
            got = seen.get(l)
            if l == self.L - 1 and self.activation != "resid_pre" and self.slice_tail and self.tail:
                # after the query, the last block is computed at the read positions only
                want = want.index_select(1, keep)
                if got is not None and got.shape[1] == self.n_eff - p:
                    got = got.index_select(1, keep)
            if got is None or got.shape != want.shape or not _close(got, want):
                what = "other values" if got is not None and got.shape == want.shape else None if got is None else tuple(got.shape)
                raise EngineRefusal(
                    f"the hook {self.names[l]!r} holds {what} when its block is re-run, "
                    f"not the corrupted run's {tuple(want.shape)}; use method='hooks'"
                )

    def _shared_rows(self, before: int, examples: Tensor, ne: int) -> Optional[dict]:
        """The corrupted run's shared key/value entries as block ``before`` finds them (rows ``examples``,
        positions ``..ne``); None without KV sharing."""
        return None if self.shares is None else self.shares.corrupted(before, examples, ne)

    def _extend_shared(self, shared: dict, before: int, examples: Tensor) -> dict:
        """``shared`` with rows ``examples`` appended, entering before block ``before``."""
        if self.shares is None:
            return shared
        return SharedKV.extend(shared, self.shares.corrupted(before, examples, self.n_eff))

    def _patch_hook(self, rows: Tensor, examples: Tensor, pos: Optional[Tensor], heads: Optional[Tensor],
                    clean: Tensor, *, p: int, state: dict):
        """Hook writing the clean activation into ``rows`` of the stacked batch: at position ``pos``
        (None: every position), head ``heads`` (None: the whole vector). In place, as
        ``transformer_lens.patching``'s setters write: where the hooked tensor is also the block's
        residual (a bridge's ``hook_resid_mid`` is the second norm's input), the patch reaches both."""
        ne = self.n_eff

        def hook(act: Tensor, hook: Any) -> Tensor:
            if not state["on"]:
                return act
            if pos is None:
                src = clean[:, p:ne].index_select(0, examples).to(act.dtype)
                if heads is None:
                    act[rows] = src
                else:
                    act[rows, :, heads] = src[torch.arange(len(rows)), :, heads]
            else:
                if heads is None:
                    act[rows, pos - p] = clean[examples, pos].to(act.dtype)
                else:
                    act[rows, pos - p, heads] = clean[examples, pos, heads].to(act.dtype)
            return act

        return hook

    @torch.inference_mode()
    def run_chunk(self, p: int, layer: Tensor, examples: Tensor, pos: Optional[Tensor], heads: Optional[Tensor],
                  clean_acts: list) -> tuple[Tensor, Tensor]:
        """Logits of stacked rows (one per patched copy x example), sorted by ``layer``: row ``r`` is
        example ``examples[r]`` patched at layer ``layer[r]`` (position ``pos[r]`` = ``p``, head
        ``heads[r]``; ``pos`` None: every position). Rows recompute positions ``p..n_eff`` from their
        layer on; a patch after the block's input at one position (``attn_out``, ``z``, ...) changes
        only that position in its own layer, so entering rows run it there alone and take the later
        positions from the corrupted run. Returns (read positions >= p, logits [rows, cols, vocab])."""
        lay = layer.tolist()
        single = pos is not None and self.activation != "resid_pre"
        # a whole-sequence patch of z / mlp_out (or resid_mid, where it is the MLP's input: OLMo-2) in
        # the last block writes every position of a hook that the read-position slicing shortens: run
        # that block whole
        self.slice_tail = not (pos is None and self.activation in ("z", "mlp_out", "resid_mid") and lay[-1] == self.L - 1)
        try:
            return self._run_chunk(p, lay, examples, pos, heads, clean_acts, single=single)
        finally:
            self.slice_tail = True

    def _run_chunk(self, p: int, lay: list, examples: Tensor, pos: Optional[Tensor], heads: Optional[Tensor],
                   clean_acts: list, *, single: bool) -> tuple[Tensor, Tensor]:
        bounds = np.searchsorted(np.asarray(lay), np.arange(self.L + 1))  # rows entering at each layer
        state = {"on": False}
        hooks = []
        for l in range(lay[0], self.L):
            s, e = int(bounds[l]), int(bounds[l + 1])
            if e > s:
                r = torch.arange(0 if single else s, e - s if single else e, device=examples.device)
                hooks.append((self.names[l], self._patch_hook(
                    r, examples[s:e], None if pos is None else pos[s:e], None if heads is None else heads[s:e], clean_acts[l], p=p,
                    state=state)))
        H: Optional[Tensor] = None
        shared: dict = {}  # KV sharing: the shared key/value entries of H's rows
        with self.model.hooks(fwd_hooks=hooks):
            for l in range(lay[0], self.L):
                s, e = int(bounds[l]), int(bounds[l + 1])
                if single:
                    if H is not None:
                        H = self._block(l, H, examples[: len(H)], p, shared)
                        self.rows_computed += H.shape[0] * H.shape[1]
                    if e > s:
                        ex = examples[s:e]
                        state["on"] = True
                        # the patch follows this layer's attention input: its keys and values, and
                        # those it shares, are the corrupted run's
                        try:
                            row = self._block(l, self.resid[l].index_select(0, ex)[:, p : p + 1], ex, p,
                                              self._shared_rows(l, ex, p + 1))
                        finally:
                            state["on"] = False
                        new = torch.cat([row, self.resid[l + 1].index_select(0, ex)[:, p + 1 : self.n_eff]], 1)
                        H = new if H is None else torch.cat([H, new])
                        shared = self._extend_shared(shared, l + 1, ex)
                        self.rows_computed += e - s
                    continue
                if e > s:
                    new = self.resid[l].index_select(0, examples[s:e])[:, p : self.n_eff]
                    H = new if H is None else torch.cat([H, new])
                    shared = self._extend_shared(shared, l, examples[s:e])
                state["on"] = e > s
                assert H is not None  # the first patched layer starts the rows
                try:
                    H = self._block(l, H, examples[: len(H)], p, shared)
                finally:
                    state["on"] = False
                self.rows_computed += H.shape[0] * H.shape[1]
            assert H is not None
            return self._head(H, p)

__all__ = ["KVCacheEngine", "KV_ACTIVATIONS", "METRIC_BYTES"]
