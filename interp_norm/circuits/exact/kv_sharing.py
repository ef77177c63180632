"""Keys and values one attention layer hands to later ones (Gemma 4's KV sharing), for the kv-cache engine.

Transformers 5's Gemma 4 passes every decoder layer one ``shared_kv_states`` dict keyed by layer
type ("sliding_attention", "full_attention"): a *storing* layer writes its full-length keys and
values there (after its cache update), a *KV-shared* layer computes no keys or values and reads
the latest entry of its own type. Which layer stores and which reads is not taken from config names:
:class:`RecordingShares` is handed to the blocks during the engine's corrupted run and records
every write and read, so the engine knows, per layer, the entries it reads and the layers they
came from, and the corrupted run's entries for rows that enter a re-run after their storing layer.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor

from interp_norm.errors import EngineRefusal

#: The keyword argument through which a block's attention reads and writes shared keys/values.
SHARED_KW = "shared_kv_states"


def recording_shares(original: Any) -> Any:
    """A dict of ``original``'s class (the model checks its type) that records, per block (``layer``,
    set by the engine before each block runs), the entries it writes and the writer of those it reads."""

    class RecordingShares(type(original)):  # type: ignore[misc]  # the model's own dict class
        def __setitem__(self, key: str, val: Any) -> None:
            self.writes.setdefault(self.layer, {})[key] = tuple(val)
            self.last[key] = self.layer
            super().__setitem__(key, val)

        def __getitem__(self, key: str) -> Any:
            self.reads.setdefault(self.layer, {})[key] = self.last.get(key, -1)
            return super().__getitem__(key)

    rec = RecordingShares()
    rec.layer, rec.writes, rec.reads, rec.last = -1, {}, {}, {}
    return rec


class SharedKV:
    """What the corrupted run's layers wrote to and read from the shared dict, and the entries a
    re-run's rows need. ``writes[l]``: type -> (k, v) [batch, kv_heads, pos, d_head] layer ``l``
    stored; ``reads[l]``: type -> the layer whose entry ``l`` read."""

    def __init__(self, rec: Any, n_layers: int):
        self.cls = type(rec).__mro__[1]  # the model's own dict class, handed to the blocks in re-runs
        self.writes: dict[int, dict[str, tuple]] = dict(rec.writes)
        self.reads: dict[int, dict[str, int]] = dict(rec.reads)
        self.L = n_layers
        for l, read in self.reads.items():
            for key, src in read.items():
                if not 0 <= src < l:
                    raise EngineRefusal(
                        f"block {l} read shared keys/values {key!r} that no earlier block wrote; "
                        "method='kv-cache' cannot run this architecture -- use method='hooks'"
                    )
        for l, wrote in self.writes.items():
            for key, val in wrote.items():
                if len(val) != 2 or any(not isinstance(t, Tensor) or t.ndim != 4 for t in val):
                    raise EngineRefusal(
                        f"block {l} shared {key!r} as something other than (keys, values) [batch, heads, pos, d]; "
                        "method='kv-cache' cannot run this architecture -- use method='hooks'"
                    )

    def reads_shared(self, l: int) -> bool:
        """Whether layer ``l`` reads another layer's keys/values (then it computes none of its own)."""
        return bool(self.reads.get(l))

    def corrupted(self, before: int, examples: Tensor, ne: int) -> dict[str, tuple[Tensor, Tensor]]:
        """The corrupted run's entries as layer ``before`` finds them (the latest write of each type by
        a layer < ``before``), rows ``examples``, positions ``..ne``."""
        out: dict[str, tuple[Tensor, Tensor]] = {}
        for l in range(min(before, self.L)):
            for key, (k, v) in self.writes.get(l, {}).items():
                out[key] = (k[..., :ne, :].index_select(0, examples), v[..., :ne, :].index_select(0, examples))
        return out

    @staticmethod
    def extend(state: dict, new: dict) -> dict:
        """``state``'s entries (rows already running) with ``new``'s rows appended, type by type."""
        import torch

        if not state:
            return dict(new)
        if set(state) != set(new):
            raise EngineRefusal("rows entering a re-run would read other shared key/value types than the running rows; "
                                "use method='hooks'")
        return {key: (torch.cat([state[key][0], new[key][0]]), torch.cat([state[key][1], new[key][1]])) for key in state}

    def call_dict(self, state: Optional[dict]) -> Any:
        """The dict handed to a block: the model's own class holding ``state``'s entries."""
        d = self.cls()
        for key, val in (state or {}).items():
            d[key] = val
        return d


__all__ = ["SHARED_KW", "SharedKV", "recording_shares"]
