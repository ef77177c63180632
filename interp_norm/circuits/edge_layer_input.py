"""Which Hugging Face bridges have an edge graph, and Gemma 4's per-layer-input branch inside it.

A Gemma 4 decoder layer adds a third term to the residual after its MLP: the per-layer-input
branch ``N_pl(P(act(G r2) * p_l))``, which reads the residual ``r2 = r1 + mlp_out`` (``r1`` the
residual after attention) and the layer's per-layer input ``p_l`` (a function of the tokens and
their embedding). It reads and writes the residual like an MLP, so its write is not a constant
bias. Choice: the branch is part of the layer's MLP node. The sender ``m{l}`` writes
``mlp_out + N_pl(...)`` (everything the layer adds after attention) and the receiver ``m{l}``
reads ``r1``: an edge into ``m{l}`` shifts the input of the MLP *and* of the branch
(``r1 + shift + mlp(r1 + shift)``), while the residual the layer passes on keeps ``r1``
unshifted. ``p_l`` is a side input of the node, like a position: no edge carries it, and exact
edge patching keeps it at the run's own value (EAP-IG's interpolated embedding moves it along,
since the model projects the embedding into it: part of the integration path). The layer
scalar (``hidden *= layer_scalar``, the whole residual after the layer) is folded into the paths:
sender ``u`` of layer ``l`` reaches a receiver of layer ``l'`` as ``s_l ... s_{l'-1}`` times its
output (the embedding from layer 0; the logits read after the last layer), so an edge's
correction and its score carry that product (:func:`scalar_paths`).

KV sharing, ``v = k`` and per-layer k/v head counts give each layer its own receivers
(:func:`receiver_layout`). Choice: receivers follow the computation -- a k/v receiver is where a k/v
projection reads the residual -- because that is the only place an edge can act on keys and values.
A ``v = k`` layer has q and k receivers, its k receiver feeding both its keys and its values (v is
``v_norm`` of the raw k). A KV-sharing layer has q receivers only: its keys and values are the source
layer's, made from the source layer's residual, so an edge into the source's k (or v) receiver moves
the attention of the source layer *and* of every layer sharing its cache, and a sender after the
source layer reaches the shared keys and values by no edge at all. The mixture-of-experts block reads
the residual through a second norm outside the MLP's input: its MLP receiver is undefined, refused.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from interp_norm.errors import PatchingError

_NODE_LEVEL = "use the node-level attribution_patch or activation_patch"


def branch_hooks(block: Any) -> Optional[tuple[str, str]]:
    """(hook on the per-layer-input branch's input ``r1 + mlp_out`` -- the gate projection's input --,
    hook on what the branch adds to the residual -- its norm's output) of a bridge block, or None."""
    from interp_norm.anatomy.bridge_anatomy import _hook

    names = (_hook(getattr(block, "per_layer_input_gate", None), "hook_in"),
             _hook(getattr(block, "post_per_layer_input_norm", None), "hook_out"))
    return (names[0], names[1]) if names[0] is not None and names[1] is not None else None


Branch = Optional[tuple[str, str]]


def check_hf_bridge(model) -> tuple[Optional[list[tuple[int, str]]], Any, list[Branch]]:
    """(per layer (k/v heads, inputs) -- :func:`receiver_layout` --, attention anatomy, per layer: its
    per-layer-input branch's hooks (:func:`branch_hooks`) or None) of a Hugging Face bridge whose edges
    are defined (layout and anatomy None for a model the anatomy does not describe); a typed error
    where not (see the module docstring)."""
    from interp_norm.anatomy import ArchitectureError, anatomy, capabilities, original

    none: tuple[Optional[list[tuple[int, str]]], Any, list[Branch]] = (None, None, [None] * model.cfg.n_layers)
    if getattr(model, "original_model", None) is None or capabilities(model).full_vocabulary:
        return none
    try:
        anat = anatomy(model)
    except ArchitectureError:
        return none  # not a Hugging Face architecture the anatomy knows (e.g. boot_native): a plain Pre-Norm sum
    layers = [original(model.blocks[l]) for l in range(len(anat.layers))]
    moe = [l for l, m in enumerate(layers) if getattr(m, "enable_moe_block", False)]
    if moe:
        raise PatchingError(
            f"{anat.architecture} layers {moe} have a mixture-of-experts block that reads the residual through its own "
            f"norm, not through the MLP's input, so the MLP receiver is undefined; {_NODE_LEVEL}"
        )
    has = [bool(getattr(m, "hidden_size_per_layer_input", 0)) for m in layers]
    branch = [branch_hooks(model.blocks[l]) if b else None for l, b in enumerate(has)]
    missing = [l for l, b in enumerate(has) if b and branch[l] is None]
    if missing:
        raise PatchingError(
            f"{anat.architecture} layers {missing} add a per-layer-input term to the residual but the bridge has no "
            f"hooks on that branch (per_layer_input_gate.hook_in, post_per_layer_input_norm.hook_out), so edges into "
            f"it cannot be applied; {_NODE_LEVEL}"
        )
    return receiver_layout(anat), anat, branch


def receiver_layout(anat: Any) -> list[tuple[int, str]]:
    """Per layer (k/v head count, inputs its attention reads from the residual: ``"qkv"``; ``"qk"`` where v
    is ``v_norm`` of the raw k; ``"q"`` where it reads an earlier layer's keys and values). Receivers follow
    the computation: a k/v receiver is where a k/v projection reads the residual, so a KV-sharing layer
    has none of its own -- its keys and values move with the source layer's k/v receivers."""
    return [(la.n_kv_heads, "q" if la.shares_kv else "qk" if la.v_from_k else "qkv") for la in anat.layers]


def layer_scalars(model) -> Optional[list[float]]:
    """Each layer's ``layer_scalar`` (1 where it has none), or None if every one is 1."""
    from interp_norm.anatomy import original

    if getattr(model, "original_model", None) is None:
        return None
    out = []
    for blk in model.blocks:
        sc = getattr(original(blk), "layer_scalar", None)
        out.append(float(sc.reshape(-1)[0]) if isinstance(sc, torch.Tensor) and sc.numel() == 1 else 1.0)
    return None if all(v == 1.0 for v in out) else out


def scalar_paths(graph: Any, scalars: list[float]) -> torch.Tensor:
    """[U, R] float64: the product of the layer scalars between sender ``u``'s write and receiver
    ``r``'s read (``s_l ... s_{l'-1}``; 1 within a layer), the factor on edge ``u -> r``. A KV-sharing
    layer has no k/v receivers: the source layer's are read in the source layer, whichever layers
    use the keys and values they make."""
    L = graph.n_layers
    start = [0] + [l for l in range(L) for _ in range(graph.n_heads + 1)]  # the layer each sender writes in
    read = graph.receiver_layers()  # the layer each receiver reads in
    sc = torch.tensor(scalars, dtype=torch.float64)
    return torch.tensor([[float(sc[a:b].prod()) for b in read] for a in start], dtype=torch.float64)


__all__ = ["Branch", "branch_hooks", "check_hf_bridge", "receiver_layout", "layer_scalars", "scalar_paths"]
