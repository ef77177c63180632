"""The circuit node vocabulary, beside the hook vocabulary (:mod:`interp_norm.core.hook_names`): one place that
builds and parses the names of a circuit's nodes and edge ends.

Senders write into the residual stream: ``embed``, head ``(l, h)``'s output ``a{l}.h{h}`` and MLP
``l``'s output ``m{l}``. Receivers read from it: each head's query, key and value input separately
(``a{l}.h{h}.q`` / ``.k`` / ``.v``), each MLP (``m{l}``) and the unembedding (``logits``). The names
are EAP-IG/MIB's (``input`` there is our ``embed``), so scores and circuits move between the two.
With grouped key/value heads (several query heads sharing one key and value input) the key and
value receivers are per k/v head instead: ``a{l}.kv{g}.k`` / ``.v`` (MIB has no name for these).
A layer's attention reads the residual through up to three inputs (:data:`LAYER_INPUTS`): its own q, k and v
(``"qkv"``); q and k only (``"qk"``: a Gemma 4 "k = v" layer has no v projection, its values are
``v_norm`` of the raw keys, so its ``k`` receiver feeds its keys *and* its values); or q only (``"q"``: a
KV-sharing layer reads an earlier layer's keys and values, so edges reach them through that layer's
k/v receivers).
No imports: the command line and the plots read it without loading torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from typing import Optional, Sequence

EMBED = "embed"
LOGITS = "logits"
#: A head's inputs, each a receiver of its own.
QKV: tuple[str, ...] = ("q", "k", "v")
#: What an attention layer reads the residual with: own q/k/v, q and k (k feeds keys and values), q alone (KV sharing).
LAYER_INPUTS: tuple[str, ...] = ("qkv", "qk", "q")

_NAME = re.compile(r"^(?:a(?P<l>\d+)\.h(?P<h>\d+)(?:\.(?P<j>[qkv]))?|a(?P<gl>\d+)\.kv(?P<g>\d+)\.(?P<gj>[kv])"
                   r"|m(?P<m>\d+)|(?P<end>embed|logits))$")


def head(layer: int, h: int) -> str:
    """Head ``h`` of ``layer`` as a sender (its output): ``a{layer}.h{h}``."""
    return f"a{int(layer)}.h{int(h)}"


def head_input(layer: int, h: int, which: str) -> str:
    """Head ``h`` of ``layer``'s ``which`` input (q, k or v) as a receiver: ``a{layer}.h{h}.{which}``."""
    if which not in QKV:
        raise ValueError(f"a head's input is one of {QKV}, got {which!r}")
    return f"{head(layer, h)}.{which}"


def kv_input(layer: int, g: int, which: str) -> str:
    """Key/value head ``g`` of ``layer``'s ``which`` input (k or v), shared by its query heads: ``a{layer}.kv{g}.{which}``."""
    if which not in QKV[1:]:
        raise ValueError(f"a k/v head's input is k or v, got {which!r}")
    return f"a{int(layer)}.kv{int(g)}.{which}"


def mlp(layer: int) -> str:
    """MLP ``layer`` (sender and receiver): ``m{layer}``."""
    return f"m{int(layer)}"


@dataclass(frozen=True)
class Node:
    """A parsed name: ``kind`` is embed / head / mlp / logits; ``layer`` and ``head`` where they apply;
    ``input`` is the q/k/v a head receiver reads (None for senders and whole nodes); a grouped
    k/v receiver is kind ``kv`` with ``head`` its k/v head."""

    kind: str
    layer: Optional[int] = None
    head: Optional[int] = None
    input: Optional[str] = None


@cache
def parse(name: str) -> Node:
    """The :class:`Node` a sender or receiver name stands for (ValueError naming the forms otherwise)."""
    m = _NAME.match(str(name))
    if m is None:
        raise ValueError(f"{name!r} is not a circuit node name; nodes are 'embed', 'a{{l}}.h{{h}}', 'm{{l}}', "
                         "'a{l}.h{h}.q|k|v', 'a{l}.kv{g}.k|v' and 'logits'")
    if m["end"]:
        return Node(m["end"])
    if m["m"] is not None:
        return Node("mlp", int(m["m"]))
    if m["gl"] is not None:
        return Node("kv", int(m["gl"]), int(m["g"]), m["gj"])
    return Node("head", int(m["l"]), int(m["h"]), m["j"])


def receiver_node(receiver: str) -> str:
    """The node a receiver belongs to: ``a1.h2.q`` -> ``a1.h2``; MLP and logits receivers are their own
    node, and so is a grouped k/v receiver (it feeds several heads)."""
    n = parse(receiver)
    if n.kind != "head":
        return receiver
    assert n.layer is not None and n.head is not None  # parse gives every head node both
    return head(n.layer, n.head)


def receiver_input(receiver: str) -> str:
    """What a receiver reads: ``q`` / ``k`` / ``v`` for a head, ``mlp`` or ``logits``."""
    n = parse(receiver)
    return n.input if n.kind in ("head", "kv") and n.input else "logits" if n.kind == "logits" else "mlp"


def senders(n_layers: int, n_heads: int) -> list[str]:
    """Every sender in the order they write: embed, then per layer its heads and its MLP."""
    out = [EMBED]
    for l in range(n_layers):
        out += [head(l, h) for h in range(n_heads)] + [mlp(l)]
    return out


def attention_receivers(layer: int, n_heads: int, n_kv_heads: Optional[int] = None, inputs: str = "qkv") -> list[str]:
    """The receivers of one attention layer reading ``inputs`` (:data:`LAYER_INPUTS`): each head's
    q, k, v in turn; with grouped k/v heads (``n_kv_heads`` < ``n_heads``) each head's q, then each k/v
    head's k and v. An input the layer does not read has no receiver."""
    if inputs not in LAYER_INPUTS:
        raise ValueError(f"an attention layer reads one of {LAYER_INPUTS}, got {inputs!r}")
    if n_kv_heads is None or n_kv_heads == n_heads:
        return [head_input(layer, h, j) for h in range(n_heads) for j in inputs]
    return [head_input(layer, h, "q") for h in range(n_heads)] + [kv_input(layer, g, j) for g in range(n_kv_heads) for j in inputs[1:]]


def receivers(n_layers: int, n_heads: int, n_kv_heads: Optional[int] = None,
              layout: Optional[Sequence[tuple[int, str]]] = None) -> list[str]:
    """Every receiver in the order they read: per layer its attention receivers and the MLP, then logits.
    ``layout``: per layer (k/v heads, inputs) where layers differ (Gemma 4); else every layer has
    ``n_kv_heads`` (default ``n_heads``) and reads q, k and v."""
    per_layer = [(n_kv_heads, "qkv")] * n_layers if layout is None else list(layout)
    out = []
    for l, (kv, inputs) in enumerate(per_layer):
        out += attention_receivers(l, n_heads, kv, inputs) + [mlp(l)]
    return out + [LOGITS]


def components(n_layers: int, n_heads: int) -> list[str]:
    """Every head, then every MLP: the nodes a node-level circuit chooses among."""
    return [head(l, h) for l in range(n_layers) for h in range(n_heads)] + [mlp(l) for l in range(n_layers)]


__all__ = ["EMBED", "LOGITS", "QKV", "LAYER_INPUTS", "Node", "head", "head_input", "kv_input", "mlp", "parse", "receiver_node", "receiver_input",
           "senders", "attention_receivers", "receivers", "components"]
