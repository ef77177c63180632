"""The edge graph of a model shape: its senders and receivers in order, and which pairs are edges.

Senders and receivers are named in :mod:`interp_norm.core.nodes`. Every layer has exactly the receivers
its attention reads the residual with (:attr:`EdgeGraph.layout`: Gemma 4's layers differ in k/v head
count, some have no v projection, some no k/v projections at all -- their reasons in
:mod:`~interp_norm.circuits.edge_layer_input`), so receiver offsets are per layer, never
``n_layers x (n_heads + 2 n_kv)``. Every edge intervention and score reads the layout from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from interp_norm.core import nodes
from interp_norm.errors import PatchingError


@dataclass(frozen=True)
class EdgeGraph:
    """Sender and receiver names of a model shape, and which (sender, receiver) pairs are edges.

    ``n_kv_heads`` (default ``n_heads``): with fewer, grouped, k/v heads the key and value receivers
    are one per k/v head (``a{l}.kv{g}.k`` / ``.v``, :func:`interp_norm.core.nodes.kv_input`): the
    query heads of a group read one shared input, so an edge into it is one edge, not one per head.
    ``layout``: where layers differ (Gemma 4), per layer its (k/v head count, inputs) -- inputs
    ``"qkv"``, ``"qk"`` (no v projection: the k receiver feeds keys and values) or ``"q"`` (KV
    sharing: no k/v receivers; the keys and values are the source layer's, so edges reach them
    through that layer's k/v receivers, from senders before it). Build it with :meth:`of_layers`.
    """

    n_layers: int
    n_heads: int
    n_kv_heads: Optional[int] = None
    layout: Optional[tuple[tuple[int, str], ...]] = None

    @classmethod
    def of_layers(cls, n_layers: int, n_heads: int, layout: Sequence[tuple[int, str]]) -> "EdgeGraph":
        """The graph of per-layer (k/v heads, inputs); the plain form where every layer reads q, k, v with
        one k/v head count (so a model without per-layer differences has the graph it always had)."""
        layout = tuple((int(kv), str(inp)) for kv, inp in layout)
        if len(layout) != n_layers or any(inp not in nodes.LAYER_INPUTS or kv < 1 for kv, inp in layout):
            raise PatchingError(f"a layout is one (k/v heads >= 1, inputs in {nodes.LAYER_INPUTS}) per layer, got {layout}")
        if len(set(layout)) == 1 and layout[0][1] == "qkv":
            kv = layout[0][0]
            return cls(n_layers, n_heads, None if kv == n_heads else kv)
        return cls(n_layers, n_heads, None, layout)

    def layer_layout(self, layer: int) -> tuple[int, str]:
        """(k/v head count, inputs read) of attention ``layer``."""
        if self.layout is not None:
            return self.layout[layer]
        return (self.n_heads if self.n_kv_heads is None else self.n_kv_heads), "qkv"

    @property
    def kv_heads(self) -> int:
        """The k/v head count (every layer's; the first layer's where they differ: see :meth:`layer_layout`)."""
        return self.layer_layout(0)[0]

    @property
    def grouped(self) -> bool:
        """Whether some layer's receivers are not each head's q, k and v (grouped or missing k/v inputs)."""
        return any(self.layer_layout(l) != (self.n_heads, "qkv") for l in range(self.n_layers))

    def attn_count(self, layer: int) -> int:
        """Receivers of attention ``layer``: one q per head plus each k/v head's k/v inputs."""
        kv, inputs = self.layer_layout(layer)
        return self.n_heads + kv * (len(inputs) - 1)

    @property
    def n_attn_receivers(self) -> int:
        """Receivers per attention layer (3 per head, or one q per head plus k and v per k/v head);
        a PatchingError where layers differ (use :meth:`attn_count`)."""
        counts = {self.attn_count(l) for l in range(self.n_layers)}
        if len(counts) > 1:
            raise PatchingError(f"attention layers have different receiver counts {sorted(counts)}; use attn_count(layer)")
        return counts.pop()

    @property
    def max_attn_receivers(self) -> int:
        """The most receivers any attention layer has (the copies backend's copies per row)."""
        return max(self.attn_count(l) for l in range(self.n_layers))

    def attn_slots(self, layer: int = 0) -> list[tuple[int, int]]:
        """(input j = 0/1/2 for q/k/v, index on that input's head axis) of each attention receiver of
        ``layer``, in order (:func:`interp_norm.core.nodes.attention_receivers`)."""
        kv, inputs = self.layer_layout(layer)
        js = ["qkv".index(c) for c in inputs]
        if kv == self.n_heads:
            return [(j, h) for h in range(self.n_heads) for j in js]
        return [(0, h) for h in range(self.n_heads)] + [(j, g) for g in range(kv) for j in js[1:]]

    @cached_property
    def _starts(self) -> list[int]:
        """Index of each layer's first receiver, then of the logits."""
        out = [0]
        for l in range(self.n_layers):
            out.append(out[-1] + self.attn_count(l) + 1)
        return out

    def receiver_layers(self) -> list[int]:
        """The layer each receiver reads in (the logits: ``n_layers``)."""
        return [l for l in range(self.n_layers) for _ in range(self.attn_count(l) + 1)] + [self.n_layers]

    @property
    def senders(self) -> list[str]:
        return nodes.senders(self.n_layers, self.n_heads)

    @property
    def receivers(self) -> list[str]:
        return nodes.receivers(self.n_layers, self.n_heads, self.n_kv_heads, self.layout)

    def sender_index(self, layer: int, what: str, head: int = 0) -> int:
        """Index of ``embed`` / head ``(layer, head)`` (what='head') / MLP ``layer`` (what='mlp')."""
        if what == "embed":
            return 0
        base = 1 + layer * (self.n_heads + 1)
        return base + head if what == "head" else base + self.n_heads

    def receiver_index(self, layer: int, what: str, head: int = 0, j: int = 0) -> int:
        """Index of head ``head``'s input ``j`` (what='head'; with grouped k/v heads, ``head`` of
        k and v is the k/v head), MLP ``layer`` (what='mlp') or the logits."""
        if what == "logits":
            return self._starts[-1]
        base = self._starts[layer]
        if what != "head":
            return base + self.attn_count(layer)
        slots = self.attn_slots(layer)
        if (j, head) not in slots:
            raise PatchingError(f"layer {layer} has no receiver for input {'qkv'[j]} of head {head}: its attention reads "
                                f"{self.layer_layout(layer)[1]} with {self.layer_layout(layer)[0]} k/v heads")
        return base + slots.index((j, head))

    def attn_receivers(self, layer: int) -> slice:
        """The rows of ``layer``'s attention receivers in :attr:`receivers`."""
        return slice(self._starts[layer], self._starts[layer] + self.attn_count(layer))

    def n_senders_before(self, layer: int, what: str) -> int:
        """How many senders are computed before the attention ('attn') or MLP ('mlp') of ``layer``."""
        base = 1 + layer * (self.n_heads + 1)
        return base if what == "attn" else base + self.n_heads

    def valid(self) -> Tensor:
        """[n_senders, n_receivers] bool: u writes into the residual stream before r reads it."""
        U, R = len(self.senders), len(self.receivers)
        v = torch.zeros(U, R, dtype=torch.bool)
        for l in range(self.n_layers):
            v[: self.n_senders_before(l, "attn"), self.attn_receivers(l)] = True
            v[: self.n_senders_before(l, "mlp"), self.receiver_index(l, "mlp")] = True
        v[:, -1] = True
        return v

    def edges(self) -> list[tuple[str, str]]:
        s, r, v = self.senders, self.receivers, self.valid()
        return [(s[i], r[j]) for i, j in zip(*np.nonzero(v.numpy()))]


__all__ = ["EdgeGraph"]
