"""Node attribution (EAP / EAP-IG) on a TransformerBridge, recomputing only what the scores need.

EAP scores node ``a`` by ``(a_clean - a_corr) . dM/da`` on the corrupted run (Menary et al. 2024,
sec. 5 locates circuits with patching; attribution patching is its linear estimate). Three things
in that computation are exactly known without running them:

* **The shared prefix.** Before the first position ``p0`` where some pair's clean and corrupted
  tokens differ, the two runs are the same computation (causal attention), so every node there
  scores exactly 0. The clean run is the bridge's own forward; the corrupted run (with its gradient)
  re-runs the bridge's own blocks at positions ``p0..`` only, the earlier positions' keys and values
  taken from the clean run through the attention's key/value-cache interface -- the machinery of
  :class:`~interp_norm.circuits.exact.kv_patching.KVCacheEngine` (RoPE, grouped heads and q/k norms stay
  the model's code). The backward pass covers positions ``p0..`` only.
* **The last block at the read positions.** In the last block the query, the attention's output
  projection and the MLP at a position reach only that position's logits: they run at the positions
  the metric reads (their keys and values everywhere); elsewhere the gradient is exactly 0.
* **One unembedding.** The clean run's unembedding is deferred and done in the same call as the
  corrupted run's (one read of the unembedding matrix), at the read positions only, and the logits
  the metric sees are written into one buffer in place.

Both runs take the bridge's GELU and norms as one-kernel stand-ins
(:mod:`~interp_norm.circuits.exact.fused_elementwise`: each probed equal to its module up to rounding,
else the module runs); the rest of every block is the bridge's own code.

The re-run is compared with the bridge's own forward (logits, hooked activations, block inputs) the
first time per model and again whenever its weights change
(:func:`~interp_norm.circuits.exact.engine.weights_key`); a bridge wired otherwise (an attention that
ignores the cache, logits post-processed after the unembedding, Gemma 4's per-layer inputs, which are
made from the tokens and the moved embedding, ...) raises
:class:`~interp_norm.errors.EngineRefusal` and :func:`~interp_norm.circuits.attribution.node_attribution`
falls back to full forward passes. Never used when a hook is on the model.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional

import torch
from torch import Tensor

from interp_norm.circuits._types import metric_values
from interp_norm.circuits.exact.block_steps import _has_hooks
from interp_norm.circuits.exact.engine import check_once, weights_key
from interp_norm.circuits.exact.fused_elementwise import Substitute, fused, substitutes
from interp_norm.circuits.exact.kv_patching import KV_ACTIVATIONS, KVCacheEngine
from interp_norm.errors import EngineRefusal
from interp_norm.core.hook_names import act_name

#: the activations that are the residual stream itself
_RESIDUAL = ("resid_pre", "resid_mid", "resid_post")


class _CleanRun(KVCacheEngine):
    """The clean run of a bridge, captured for re-runs of its blocks (no run or check of its own)."""

    def __init__(self, model, shape: tuple, dev: torch.device, cols: Tensor):
        read = torch.zeros(shape, dtype=torch.bool, device=dev)
        read[:, cols] = True
        self._setup(model, shape, dev, read, "resid_pre")

    def rerun(self, H: Tensor, examples: Tensor, p: int, per_layer: Optional[Tensor] = None) -> Tensor:
        """Every block on rows ``H`` [rows, p..n, d] of ``examples``; positions before ``p`` from the clean run.
        ``per_layer`` [rows, p..n, layers, d']: the rows' own per-layer inputs (Gemma 4), else the clean run's."""
        shared: dict = {}  # KV sharing: the entries the re-run's storing layers write
        self.per_layer_rows = per_layer
        try:
            for l in range(self.L):
                H = self._block(l, H, examples, p, shared)
        finally:
            self.per_layer_rows = None
        return H


def _per_layer_inputs(model, tokens: Tensor, embed: Tensor) -> Optional[Tensor]:
    """Gemma 4's per-layer inputs [b, pos, layers, d'] of ``tokens`` whose (hooked) embedding is ``embed``,
    by the text model's own ``get_per_layer_inputs`` / ``project_per_layer_inputs``; None without them."""
    text = next((m for m in model.original_model.modules() if hasattr(m, "project_per_layer_inputs")), None)
    if text is None or not getattr(text, "hidden_size_per_layer_input", 0):
        return None
    return text.project_per_layer_inputs(embed, text.get_per_layer_inputs(tokens, embed))


class _Unembed(torch.autograd.Function):
    """The bridge's unembedding of rows ``[x_clean; x]`` in one product (one read of its matrix),
    differentiable in ``x``: the unembedding is the ``nn.Linear`` ``lin`` (checked once per model against
    the bridge's module), computed as ``weight @ rows.T`` -- with 16 rows against a [vocab, d] matrix the
    product in this orientation runs ~1.6x faster on CPU than ``rows @ weight.T`` (same sums; the
    benchmark's docs give the figures). The backward multiplies only the columns of the incoming gradient
    that are not zero (a logit difference has two per row) by the rows of ``weight``."""

    @staticmethod
    def forward(ctx, x: Tensor, x_clean: Tensor, lin: torch.nn.Linear) -> Tensor:
        ctx.k, ctx.weight = len(x_clean), lin.weight
        return linear_rows(torch.cat([x_clean, x]), lin)

    @staticmethod
    def backward(ctx, g: Tensor):
        g = g[ctx.k :]
        nz = g.ne(0).any(0).nonzero().flatten()
        if len(nz) * 4 > g.shape[-1]:
            return g @ ctx.weight, None, None
        return g.index_select(1, nz) @ ctx.weight.index_select(0, nz), None, None


def linear_rows(rows: Tensor, lin: torch.nn.Linear) -> Tensor:
    """``lin(rows)`` for few rows [k, d] against a wide matrix, as ``(weight @ rows.T).T`` (contiguous); not
    recorded for autograd (:class:`_Unembed` supplies the backward)."""
    with torch.no_grad():
        out = torch.mm(lin.weight, rows.t()).t()
        if lin.bias is None:
            return out.contiguous()
        return torch.add(out, lin.bias, out=out.new_empty(out.shape))  # the bias added in the copy to rows


def _unembed(model, x: Tensor, x_clean: Tensor, lin: Optional[torch.nn.Linear]) -> Tensor:
    """Logits [len(x_clean) + len(x), vocab] of both row sets, in one product (or one call of the bridge's unembedding)."""
    if lin is not None:
        return _Unembed.apply(x, x_clean, lin)
    return model.unembed(torch.cat([x_clean, x]).unsqueeze(0))[0]


def _unembed_linear(model) -> Optional[torch.nn.Linear]:
    """The bridge unembedding's one ``nn.Linear`` (else None)."""
    lin = getattr(model.unembed, "original_component", None)
    return lin if isinstance(lin, torch.nn.Linear) else None


def applies(model, activations: list) -> bool:
    """Whether the re-run path may be tried: a bridge, per-position activations, no hook on the model."""
    from interp_norm.anatomy import capabilities

    if not capabilities(model).hf_original or not all(a in KV_ACTIVATIONS for a in activations):
        return False
    parts = (getattr(model, "unembed", None), getattr(model, "ln_final", None))
    return all(isinstance(m, torch.nn.Module) for m in parts) and not _has_hooks(model)


def _to_positions(act: Tensor, pos: Tensor, ne: int) -> Tensor:
    """``act`` [rows, len(pos), ...] at positions ``pos`` -> [rows, ne, ...], zero elsewhere."""
    if act.shape[1] == ne and len(pos) == ne:
        return act
    out = act.new_zeros((act.shape[0], ne) + tuple(act.shape[2:]))
    return out.index_copy_(1, pos, act)


@dataclass(frozen=True)
class AttributionInputs:
    """What one attribution computation reads: the ``clean`` and ``corr``-upted tokens [b, n], the ``metric``,
    the hooks ``names`` whose (clean - corrupted) x gradient is wanted, the ``embed`` hook the integration
    path interpolates, the integration points ``alphas`` and how many of them share a pass (``steps_per_pass``)."""

    clean: Tensor
    corr: Tensor
    metric: Any
    names: list
    embed: str
    alphas: Tensor
    steps_per_pass: int


@dataclass
class _Prefix:
    """The clean pass of :func:`prefix_attribution`: the re-runnable blocks (``run``), the positions computed
    (``ne``), the first that differs (``p0``), the read positions ``cols`` (``sc``: those the re-run reaches,
    ``suffix``: the re-run's positions), the clean embedding, the clean unembedding input ``x_clean`` (used
    once, by the first chunk), the clean activations per hook, the unembedding's ``nn.Linear`` and the
    one-kernel stand-ins for the bridge's elementwise modules both runs use (``subs``)."""

    run: _CleanRun
    ne: int
    p0: int
    cols: Tensor
    sc: Tensor
    suffix: Tensor
    e_clean: Tensor
    x_clean: Optional[Tensor]
    clean_acts: dict
    lin: Optional[torch.nn.Linear]
    subs: list[Substitute]
    per_layer: bool = False


@dataclass
class _Sums:
    """What the chunks of integration points accumulate: per hook the summed gradient and (positions, clean -
    corrupted); the logits buffer whose read positions before p0 keep the clean logits; the metric values."""

    gsum: dict = field(default_factory=dict)
    diff: dict = field(default_factory=dict)
    buf: Optional[Tensor] = None
    clean_val: Optional[Tensor] = None
    baseline: Optional[Tensor] = None


def prefix_attribution(model, inputs: AttributionInputs, cols: Tensor) -> tuple[dict, Tensor, Tensor]:
    """``{name: (clean - corrupted) x gradient summed over the integration points}`` (float64,
    ``[b, ne, ..., 1]``: summed over the last axis; ``ne`` = last read position + 1) for the hooks ``names``, the clean metric
    values and the corrupted baseline (``[b]``), the logits read at ``cols``. Raises :class:`EngineRefusal`
    where the bridge's blocks cannot be re-run."""
    pre = _clean_pass(model, inputs, cols)
    sums = _Sums()
    for s0 in range(0, len(inputs.alphas), inputs.steps_per_pass):
        _integration_chunk(model, inputs, pre, sums, s0)
    b, ne = inputs.clean.shape[0], pre.ne
    prods = {}
    for nm in inputs.names:  # (clean - corrupted) . gradient, summed over the last axis (every cell sums it)
        pos, d = sums.diff[nm]
        prod = torch.zeros((b, ne) + tuple(d.shape[2:-1]) + (1,), dtype=torch.float64, device=inputs.clean.device)
        if nm in sums.gsum:  # positions before p0 score 0: clean and corrupted runs are the same there
            prod.index_copy_(1, pos, (d * sums.gsum[nm]).sum(-1, keepdim=True).double())
        prods[nm] = prod
    return prods, sums.clean_val, sums.baseline


def _clean_pass(model, inputs: AttributionInputs, cols: Tensor) -> _Prefix:
    """The clean run: the bridge's forward, the unembedding's input kept and its call deferred, the blocks'
    arguments captured for the re-run (checked once against the clean run)."""
    clean, corr, names, embed = inputs.clean, inputs.corr, inputs.names, inputs.embed
    b, n = clean.shape
    dev = clean.device
    ne = int(cols.max()) + 1
    differs = (clean[:, :ne] != corr[:, :ne]).any(0).nonzero().flatten()
    p0 = min(int(differs[0]) if len(differs) else ne - 1, ne - 1)
    run = _CleanRun(model, (b, ne), dev, cols)
    run.tail = _tail_without_residual_hooks(model, run, names)
    sliced = len(cols) < ne
    pos_all = torch.arange(ne, device=dev)
    held: dict[str, Any] = {}

    def unembed_pre(module, args, kwargs):
        if not args or not torch.is_tensor(args[0]) or args[0].ndim != 3 or args[0].shape[1] != ne:
            raise EngineRefusal("the bridge's unembedding is not called on [batch, pos, d_model]; use the full passes")
        held["x"] = args[0].index_select(1, cols)
        return (args[0][:, :0],) + tuple(args[1:]), kwargs

    def unembed_post(module, args, out):
        held["out"] = torch.empty(0)
        return held["out"]

    handles = run._capture_hooks()
    if sliced:
        for m in run.tail:
            handles.append(m.register_forward_pre_hook(run._slice_in(cols, ne), with_kwargs=True))
            handles.append(m.register_forward_hook(run._scatter_out(cols, ne)))
    handles += [model.unembed.register_forward_pre_hook(unembed_pre, with_kwargs=True),
                model.unembed.register_forward_hook(unembed_post)]
    cc: dict[str, Tensor] = {}
    key = weights_key(model)  # one read of the weights' versions for the probe's and the check's caches
    subs = substitutes(model, key)
    try:
        with torch.inference_mode(), fused(subs), model.hooks(fwd_hooks=[(nm, partial(_store, cc=cc, nm=nm)) for nm in [embed, *names]]):
            ret = model(clean[:, :ne])  # inference mode: cheaper per op than no_grad
    except TypeError as e:
        run._no_cache_argument(e)
    finally:
        for h in handles:
            h.remove()
    if "out" not in held or ret is not held["out"]:
        raise EngineRefusal("the bridge changes the logits after its unembedding; use the full passes")
    run._captured()
    per_layer = _check_per_layer(model, run, clean[:, :ne], cc[embed])
    # the block arguments the re-run slices become ordinary tensors (the backward may save them)
    run.calls = [{k: _ordinary(v) for k, v in call.items()} for call in run.calls]
    clean_acts = {nm: _to_positions(cc[nm], pos_all if cc[nm].shape[1] == ne else cols, ne) for nm in names}
    lin = _unembed_linear(model)
    check_once(model, ("attribution re-run", sliced, len(run.tail), tuple(s.kind for s in subs)),
               lambda: _check(run, clean[:, :ne], clean_acts, held["x"], cols, sliced=sliced, lin=lin, subs=subs), key=key)
    return _Prefix(run, ne, p0, cols, sc=cols[cols >= p0], suffix=torch.arange(p0, ne, device=dev), e_clean=cc[embed],
                   x_clean=held.pop("x"), clean_acts=clean_acts, lin=lin, subs=subs,
                   per_layer=per_layer)


def _check_per_layer(model, run: _CleanRun, tokens: Tensor, embed: Tensor) -> bool:
    """Whether the blocks take per-layer inputs (Gemma 4), which are made from the tokens and the embedding
    the integration path moves, so the re-run makes the corrupted rows' own: then they must be what the
    captured run's blocks got, from this run's tokens and embedding (else :class:`EngineRefusal`)."""
    got = [call.get("per_layer_input") for call in run.calls]
    if all(g is None for g in got):
        return False
    with torch.no_grad():
        want = _per_layer_inputs(model, tokens, embed)
    if want is None or any(g is None or g.shape != want[:, :, l].shape or not torch.equal(g, want[:, :, l])
                           for l, g in enumerate(got)):
        raise EngineRefusal("the blocks' per-layer inputs are not the text model's project_per_layer_inputs of the "
                            "tokens and embedding; attribution runs full passes")
    return True


def _store(act: Tensor, hook: Any, cc: dict, nm: str) -> None:
    cc[nm] = act


def _integration_chunk(model, inputs: AttributionInputs, pre: _Prefix, sums: _Sums, s0: int) -> None:
    """The corrupted run from p0 with the gradient, for the integration points from ``s0`` on (one pass):
    adds to ``sums``; the first chunk also makes the clean metric values and the corrupted baseline."""
    clean, corr, metric, names = inputs.clean, inputs.corr, inputs.metric, inputs.names
    b, n = clean.shape
    dev, ne, p0, sc, e_clean, alphas = clean.device, pre.ne, pre.p0, pre.sc, pre.e_clean, inputs.alphas
    al = alphas[s0 : s0 + inputs.steps_per_pass].to(dev, e_clean.dtype)
    m = len(al)
    ex = torch.arange(b, device=dev).repeat(m)

    def embed_hook(act: Tensor, hook: Any) -> Tensor:
        a = act.view(m, *e_clean.shape)  # the corrupted embedding: alpha = 0 leaves it as it is
        return (a + al.view(m, 1, 1, 1) * (e_clean.unsqueeze(0) - a)).reshape(act.shape)

    moved = bool(al.any())  # no hook context at alpha = 0 (entering one costs ~1 ms on a bridge)
    with torch.no_grad(), model.hooks(fwd_hooks=[(inputs.embed, embed_hook)]) if moved else nullcontext():
        h0 = model(corr[:, :ne].repeat(m, 1), stop_at_layer=0)[:, p0:]  # alpha = 0: the corrupted input
        # Gemma 4: the rows' own per-layer inputs (per position: of their tokens and moved embedding)
        ple = _per_layer_inputs(model, corr[:, p0:ne].repeat(m, 1), h0) if pre.per_layer else None
    seen: dict[str, tuple] = {}
    with torch.enable_grad(), fused(pre.subs), model.hooks(fwd_hooks=[(nm, partial(_keep, seen=seen, nm=nm)) for nm in names]):
        H = pre.run.rerun(h0, ex, p0, per_layer=ple)
        xs = model.ln_final(H.index_select(1, sc - p0))  # [rows, len(sc), d]
        first = sums.buf is None
        if first:
            assert pre.x_clean is not None
            xcl, pre.x_clean = pre.x_clean.reshape(-1, xs.shape[-1]), None
        else:
            xcl = xs.new_zeros((0, xs.shape[-1]))
        lg = _unembed(model, xs.reshape(-1, xs.shape[-1]), xcl, pre.lin)
        V = lg.shape[-1]
        if first:
            k = b * len(pre.cols)
            sums.buf = lg.new_zeros((b, n, V))
            sums.buf.index_copy_(1, pre.cols, lg[:k].detach().view(b, len(pre.cols), V))
            with torch.no_grad():
                sums.clean_val = metric_values(metric, sums.buf, b).double().cpu()
            lg = lg[k:]
        # the metric and its gradient per integration point, in one logits buffer whose read
        # positions before p0 keep the clean logits (the same computation there); then one
        # backward pass through the model from the logits' gradients
        lg = lg.view(m, b, len(sc), V)
        glg = torch.empty_like(lg)
        for i in range(m):
            li = lg[i].detach().requires_grad_()
            sums.buf = sums.buf.detach()
            sums.buf.index_copy_(1, sc, li)
            vals = metric_values(metric, sums.buf, b)
            (glg[i],) = torch.autograd.grad(vals.sum(), li)
            if s0 == 0 and i == 0:
                sums.baseline = vals[:b].detach().double().cpu()
        order = _unchanged(seen, names)
        gs = torch.autograd.grad(lg, [seen[nm][0] for nm in order], glg, allow_unused=True)
    for nm, g in zip(order, gs):
        act = seen[nm][0]
        pos = pre.suffix if act.shape[1] == ne - p0 else sc
        ct = torch.promote_types(act.dtype, torch.float32)  # float32 or wider for the products
        if s0 == 0:  # clean - corrupted at the re-run positions (alpha = 0 rows: the corrupted run)
            sums.diff[nm] = (pos, pre.clean_acts[nm].index_select(1, pos).to(ct) - act[:b].detach().to(ct))
        if g is not None:  # one gradient: as computed; several summed in float64
            g = g.to(ct) if m == len(alphas) == 1 else g.view(m, b, *g.shape[1:]).double().sum(0)
            sums.gsum[nm] = g if nm not in sums.gsum else sums.gsum[nm] + g


def _tail_without_residual_hooks(model, run: _CleanRun, names: list) -> list:
    """The last block's parts to run at the read positions, less any that holds the hook of a
    residual-stream activation scored here: that hook then sees the sliced copy, not the residual the
    block carries on (OLMo-2's ``hook_resid_mid`` is the MLP's ``hook_in``), and the gradient at it
    would miss the carried-on path."""
    hooks = getattr(model, "hook_dict", {})
    held = {id(hooks[nm]) for nm in names if nm in hooks and any(nm == act_name(a, run.L - 1) for a in _RESIDUAL)}
    return [m for m in run.tail if not held & {id(x) for x in m.modules()}]


def _ordinary(v: Any) -> Any:
    """An inference-mode tensor (or a tuple of them) as an ordinary tensor."""
    if torch.is_tensor(v):
        return v.clone() if v.is_inference() else v
    if isinstance(v, tuple) and any(torch.is_tensor(t) for t in v):
        return tuple(_ordinary(t) for t in v)
    return v


def _keep(act: Tensor, hook: Any, seen: dict, nm: str) -> Tensor:
    """Keep a hooked activation of the re-run (and its version) to take the gradient at; one that
    depends on nothing with a gradient (the first; any, when the weights do not require gradients)
    becomes a leaf in place, so that every reader of the tensor reaches the gradient: a bridge's
    ``hook_resid_mid`` (``ln2.hook_in``) holds the tensor the block also carries on as its residual,
    and a detached copy returned by the hook would reach the MLP only."""
    if not act.requires_grad:
        act.requires_grad_()
    seen[nm] = (act, act._version)
    return act


def _unchanged(seen: dict, names: list) -> list:
    """The hooks in ``names`` that ran, each kept activation not modified in place since (else the
    gradient taken at it would be another tensor's)."""
    for nm in names:
        if nm not in seen:
            raise EngineRefusal(f"the hook {nm!r} did not run when the bridge's blocks were re-run; use the full passes")
        act, version = seen[nm]
        if act._version != version:
            raise EngineRefusal(f"the bridge modifies the activation at {nm!r} in place; use the full passes")
    return list(names)


def _check(run: _CleanRun, tokens: Tensor, clean_acts: dict, x_clean: Tensor, cols: Tensor, *, sliced: bool,
           lin: Optional[torch.nn.Linear], subs: list[Substitute]) -> None:
    """The re-run of the clean tokens from a middle position, and the captured clean run, both with the
    one-kernel stand-ins ``subs``, against the bridge's own forward (its own modules): logits at the read
    positions, every hooked activation, the blocks' input."""
    model = run.model
    b, ne = tokens.shape
    p = ne // 2
    seen: dict[str, Tensor] = {}

    def record(act: Tensor, hook: Any, nm: str) -> None:
        seen[nm] = (act, act._version)

    ex = torch.arange(b, device=tokens.device)
    with torch.no_grad():
        ref = model(tokens)
        h0 = model(tokens, stop_at_layer=0)
        with fused(subs), model.hooks(fwd_hooks=[(nm, lambda act, hook, nm=nm: record(act, hook, nm)) for nm in clean_acts]):
            H = run.rerun(_ordinary(run.resid[0][:, p:]), ex, p)  # an ordinary tensor: the hooks read its version
            sc = cols[cols >= p]
            lg = model.unembed(model.ln_final(H.index_select(1, sc - p)))
        lg_clean = model.unembed(x_clean)
        # the unembedding is linear with the matrix the backward multiplies by, and is the product computed
        linear = None if lin is None else (model.unembed(2 * x_clean) - lg_clean, x_clean @ lin.weight.T)
        product = None if lin is None else (linear_rows(x_clean.reshape(-1, x_clean.shape[-1]), lin), lg_clean.reshape(-1, lg_clean.shape[-1]))

    def close(a: Tensor, r: Tensor) -> bool:
        return a.shape == r.shape and float((a - r).abs().max()) <= 1e-4 * (float(r.abs().max()) + 1.0)

    if not (close(lg, ref.index_select(1, sc)) and close(lg_clean, ref.index_select(1, cols)) and close(h0, run.resid[0])
            and (linear is None or close(*linear)) and (product is None or close(*product))):
        raise EngineRefusal("re-running the bridge's blocks from a key/value cache disagrees with its forward; "
                            "attribution runs full passes")
    last = {act_name(a, run.L - 1) for a in KV_ACTIVATIONS}
    for nm in _unchanged(seen, list(clean_acts)):
        want, got = clean_acts[nm], seen[nm][0]
        pos = torch.arange(p, ne, device=tokens.device) if got.shape[1] == ne - p else sc
        if got.shape[1] != len(pos):
            raise EngineRefusal(f"the hook {nm!r} holds {tuple(got.shape)} when its block is re-run; use the full passes")
        keep = pos[torch.isin(pos, cols)] if sliced and nm in last else pos  # after the query: read positions
        sel = torch.searchsorted(pos, keep)
        if not close(got.index_select(1, sel), want.index_select(1, keep)):
            raise EngineRefusal(f"the hook {nm!r} differs from the bridge's forward when its block is re-run; "
                                "use the full passes")


__all__ = ["AttributionInputs", "prefix_attribution", "applies"]
