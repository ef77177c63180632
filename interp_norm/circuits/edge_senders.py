"""The sender outputs edge attribution differences, read without the work it does not need.

Edge EAP needs every sender's output (the embedding, each head's ``z W_O``, each MLP's output) on the
clean and the corrupted rows, and the token embedding of both for EAP-IG's line. A plain
``run_with_cache`` also runs the final norm and the unembedding -- on GPT-2 small 16 x 50 257 logits
per row, a sixth of the pass -- whose output nothing reads, so :func:`sender_run` stops the pass at
the final norm and :func:`embedding` at the first block. :func:`capture_hooks` reads the corrupted
rows' senders off the gradient pass itself (its first integration point is the corrupted input), so
the one-pass route of :mod:`~interp_norm.circuits.edge_grads` needs no corrupted sender run at all.
That route runs its sender runs with the one-kernel stand-ins of its gradient pass (``subs``,
:mod:`~interp_norm.circuits.exact.fused_elementwise`), so that clean and corrupted senders come from
like arithmetic.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor

from interp_norm.circuits.exact.fused_elementwise import Substitute, fused
from interp_norm.core.hook_names import act_name


class _Stop(Exception):
    """Raised by the forward pre-hook that ends a pass early (caught in :func:`_run_until`)."""


def sender_names(runner) -> list[str]:
    """Hook names the senders are read from (:meth:`EdgeRunner.senders_from_cache`)."""
    names = [act_name("embed")] + ([act_name("pos_embed")] if runner.has_pos else [])
    names += [act_name(a, l) for l in range(runner.L) for a in ("z", "mlp_out")]
    return names + [b[1] for b in runner.branch if b]  # Gemma 4's per-layer-input branch: part of the MLP sender


def capture_hooks(names: list[str], into: dict, rows: Optional[int] = None) -> list[tuple[str, Callable]]:
    """Forward hooks storing each named activation (its first ``rows`` rows, detached) in ``into``."""

    def keep(name: str) -> Callable:
        def hook(x: Tensor, hook: Any) -> Tensor:
            into[name] = (x if rows is None or x.shape[0] == 1 else x[:rows]).detach()
            return x

        return hook

    return [(nm, keep(nm)) for nm in names]


def run_until(model, tokens: Tensor, fwd_hooks: list, stop_at: Optional[torch.nn.Module],
              inference: bool = False) -> None:
    """One no-grad pass of ``tokens`` with ``fwd_hooks``, ended before module ``stop_at`` runs (the
    whole pass where it is None): for what the hooks see, not the output. ``inference``: in inference
    mode (cheaper per op; what the hooks keep are inference tensors: read them, do not write them)."""

    def stop(module, args):
        raise _Stop

    handle = stop_at.register_forward_pre_hook(stop) if stop_at is not None else None
    try:
        with torch.inference_mode() if inference else torch.no_grad():
            model.run_with_hooks(tokens, fwd_hooks=fwd_hooks)
    except _Stop:
        pass
    finally:
        if handle is not None:
            handle.remove()


def block_or_final(model, layer: int) -> Optional[torch.nn.Module]:
    """Block ``layer``'s module, the final norm past the last block (None if the model has neither)."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, torch.nn.ModuleList) and layer < len(blocks):
        return blocks[layer]
    return _module(model, "ln_final")


def _run_until(model, tokens: Tensor, names: list[str], stop_at: Optional[torch.nn.Module],
               inference: bool = False) -> dict:
    seen: dict[str, Tensor] = {}
    run_until(model, tokens, capture_hooks(names, seen), stop_at, inference)
    return seen


def _module(model, name: str) -> Optional[torch.nn.Module]:
    mod = getattr(model, name, None)
    return mod if isinstance(mod, torch.nn.Module) else None


def sender_blocks(runner, cache: dict) -> Iterator[tuple[slice, Tensor]]:
    """The senders read in ``cache``, block by block in the graph's order: (rows of the [U, ...] sender
    stack, their outputs [k, b, n, d]). The embedding (with the positional one where it fires), each
    layer's heads (``z W_O``) and its MLP (with Gemma 4's per-layer-input branch, part of the MLP sender)."""
    emb = cache[act_name("embed")]
    yield slice(0, 1), (emb + cache[act_name("pos_embed")] if runner.has_pos else emb)[None]
    for l in range(runner.L):
        h0, m = runner.graph.sender_index(l, "head"), runner.graph.sender_index(l, "mlp")
        yield slice(h0, h0 + runner.H), runner.head_outputs(l, cache[act_name("z", l)])
        mlp = cache[act_name("mlp_out", l)]
        yield slice(m, m + 1), (mlp + cache[runner.branch[l][1]] if runner.branch[l] else mlp)[None]


def subtract_senders(runner, into: Tensor, cache: dict) -> Tensor:
    """``into`` [U, b, n, d] minus the senders read in ``cache`` (:func:`sender_blocks`), in place, one
    block at a time: no second stack of the senders' size."""
    for rows, out in sender_blocks(runner, cache):
        into[rows].sub_(out)
    return into


def sender_run(runner, tokens: Tensor, subs: Sequence[Substitute] = ()) -> tuple[Tensor, Tensor]:
    """(senders [U, b, n, d], token embedding [b, n, d]) of a pass of ``tokens`` stopped at the final norm
    (``subs``: with these stand-ins for the modules they replace), in inference mode: both are made
    outside it from what the pass kept (ordinary tensors, which the caller may write and differentiate
    through)."""
    model = runner.model
    with fused(list(subs)):
        seen = _run_until(model, tokens, sender_names(runner), _module(model, "ln_final"), inference=True)
    return runner.senders_from_cache(seen), seen[act_name("embed")].clone()


def embedding(runner, tokens: Tensor) -> Tensor:
    """The token embedding [b, n, d] of ``tokens``: the pass stopped at the first block."""
    model = runner.model
    return _run_until(model, tokens, [act_name("embed")], block_or_final(model, 0))[act_name("embed")]


__all__ = ["sender_names", "sender_blocks", "capture_hooks", "run_until", "block_or_final", "subtract_senders",
           "sender_run", "embedding"]
