"""Tracr-compiled programs as TransformerLens 4 bridges with their compiler-given circuits, no JAX needed.

``scripts/compile_tracr.py`` (run once, in a separate environment with tracr and JAX) compiled
reverse, sort, histogram, double histogram and frac_prevs and saved, per program, the raw tracr
parameters, 300 inputs with the RASP interpreter's outputs, 64 clean/corrupted pairs and the
ground truth (``data/ground_truth/tracr/<name>.json``; how it is derived is in that script's
docstring). Here the parameters become a ``TransformerBridge.boot_native`` model through
TransformerLens's own converter, ``transformer_lens.utilities.tracr`` (a numerical output, as
frac_prevs', is presented to it as one categorical column, so logit 0 is the value itself).

The metric is what the program outputs, not the next token: for categorical programs
``logit(clean output) - logit(corrupted output)`` at each position where the two outputs differ,
for numerical ones the output moved towards the clean value, ``(y - y_corr) * sign(y_clean - y_corr)``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from interp_norm.circuits import Circuit, PatchingPairs
from interp_norm.errors import CheckpointNotFoundError, PatchingError

TRACR_PROGRAMS: tuple[str, ...] = ("reverse", "sort", "histogram", "double_histogram", "frac_prevs")


def tracr_dir() -> Path:
    from interp_norm.training.checkpoints import data_dir

    return data_dir() / "ground_truth" / "tracr"


@cache
def _files(name: str) -> tuple[dict, dict]:
    if name not in TRACR_PROGRAMS:
        raise PatchingError(f"unknown tracr program {name!r}; choose from {TRACR_PROGRAMS}")
    base = tracr_dir() / name
    if not base.with_suffix(".json").is_file() or not base.with_suffix(".npz").is_file():
        raise CheckpointNotFoundError(
            f"no compiled tracr program at {base}.json/.npz; run scripts/compile_tracr.py in a tracr environment"
        )
    spec = json.loads(base.with_suffix(".json").read_text())
    with np.load(base.with_suffix(".npz")) as z:
        arrays = {k: z[k] for k in z.files}
    return spec, arrays


def load_tracr(name: str):
    """The compiled program as an eval-mode ``TransformerBridge`` (TransformerLens 4)."""
    from transformer_lens.model_bridge import TransformerBridge
    from transformer_lens.utilities.tracr import (
        make_tracr_transformer_bridge_config,
        make_tracr_transformer_bridge_state_dict,
    )

    spec, arrays = _files(name)
    params: dict = {}
    for key, value in arrays.items():
        if key.startswith("param|"):
            _, module, p = key.split("|")
            params.setdefault(module, {})[p] = value
    labels = list(spec["residual_labels"])
    out_map = spec["output_encoding"]
    out_label = spec["output_labels"][0].split(":")[0]
    if spec["output"] == "numerical":  # one column: the value itself
        (out,) = spec["output_labels"]
        labels = [f"{out}:value" if x == out else x for x in labels]
        out_map = {"value": 0}
    tracr_like = SimpleNamespace(
        params=params, model_config=SimpleNamespace(**spec["model_config"]), residual_labels=labels,
        output_encoder=SimpleNamespace(encoding_map=out_map),
    )
    # boot_native is attached to TransformerBridge by transformer_lens.model_bridge.sources
    bridge = TransformerBridge.boot_native(make_tracr_transformer_bridge_config(tracr_like))  # type: ignore[attr-defined]
    sd = make_tracr_transformer_bridge_state_dict(tracr_like, out_label)
    # TransformerLens 4.3's converter names the MLP fc_in/fc_out and gives no head bias, while
    # boot_native's model also registers the aliases mlp.in/mlp.out and a head bias: fill both
    for key in [k for k in sd if ".mlp.fc_" in k]:
        sd[key.replace(".mlp.fc_in.", ".mlp.in.").replace(".mlp.fc_out.", ".mlp.out.")] = sd[key]
    sd.setdefault("head.bias", torch.zeros(sd["head.weight"].shape[0]))
    bridge.load_state_dict(sd)
    return bridge.eval()


class TracrMetric:
    """Per-example program-output metric over the positions where clean and corrupted outputs differ."""

    name = "output_diff"
    supports_stacked = True

    def __init__(self, clean_out: Tensor, corr_out: Tensor, mask: Tensor, numerical: bool):
        self.clean_out, self.corr_out, self.mask, self.numerical = clean_out, corr_out, mask.bool(), numerical
        self.batch = mask.shape[0]
        w = self.mask.to(torch.float64)
        self.weights = w / w.sum(-1, keepdim=True)

    def __call__(self, logits: Tensor) -> Tensor:
        lg = logits.view(-1, self.batch, *logits.shape[1:])  # [R, b, n, V]
        if self.numerical:
            y = lg[..., 0]
            c, x = self.clean_out.to(lg.device, lg.dtype), self.corr_out.to(lg.device, lg.dtype)
            v = (y - x) * torch.sign(c - x)
        else:
            idx = lambda t: t.clamp(min=0).long().to(lg.device).unsqueeze(0).unsqueeze(-1).expand(lg.shape[0], -1, -1, 1)  # noqa: E731
            v = (lg.gather(-1, idx(self.clean_out)) - lg.gather(-1, idx(self.corr_out))).squeeze(-1)
        v = torch.where(self.mask.to(v.device), v, torch.zeros_like(v))
        return (v * self.weights.to(v.device, v.dtype)).sum(-1).reshape(-1)

    def select(self, rows: Sequence[int]) -> "TracrMetric":
        rows = list(rows)
        return TracrMetric(self.clean_out[rows], self.corr_out[rows], self.mask[rows], self.numerical)


@dataclass(frozen=True)
class TracrGroundTruth:
    """One compiled program with the interface the benchmark uses (as :class:`GroundTruth`)."""

    name: str

    @property
    def spec(self) -> dict:
        return _files(self.name)[0]

    @property
    def shape(self) -> tuple[int, int]:
        c = self.spec["model_config"]
        return c["num_layers"], c["num_heads"]

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(n["node"] for n in self.spec["nodes"] if n["reads"] == "token")

    @property
    def fixed_nodes(self) -> set[str]:
        return {n["node"] for n in self.spec["nodes"] if n["reads"] == "fixed"}

    @property
    def edges(self) -> tuple[tuple[str, str, str], ...]:
        return tuple((e["sender"], e["receiver"], e["reads"]) for e in self.spec["edges"])

    @property
    def token_edges(self) -> set[tuple[str, str]]:
        return {(u, r) for u, r, k in self.edges if k == "token"}

    @property
    def fixed_edges(self) -> set[tuple[str, str]]:
        return {(u, r) for u, r, k in self.edges if k == "fixed"}

    def circuit(self) -> Circuit:
        return Circuit(*self.shape, frozenset((u, r) for u, r, _ in self.edges))

    def build(self):
        return load_tracr(self.name)

    def make_pairs(self, n: int = 32, seed: int = 0) -> PatchingPairs:
        _, a = _files(self.name)
        rows = sorted(random.Random(seed).sample(range(len(a["pairs_clean"])), min(n, len(a["pairs_clean"]))))
        clean, corr = torch.tensor(a["pairs_clean"][rows]), torch.tensor(a["pairs_corrupted"][rows])
        co, xo = torch.tensor(a["pairs_clean_out"][rows]), torch.tensor(a["pairs_corrupted_out"][rows])
        mask = (co != xo) & ~torch.isnan(co)
        mask[:, 0] = False
        pairs = PatchingPairs(clean, corr, score_mask=mask)
        object.__setattr__(pairs, "tracr_outputs", (co, xo))
        return pairs

    def metric(self, pairs: PatchingPairs) -> TracrMetric:
        co, xo = pairs.tracr_outputs  # type: ignore[attr-defined]  # attached by pairs() above
        return TracrMetric(co, xo, pairs.score_mask, self.spec["output"] == "numerical")

    def reference(self) -> tuple[Tensor, Tensor]:
        """(inputs [K, n], the RASP interpreter's outputs [K, n]; position 0 is BOS, no output)."""
        _, a = _files(self.name)
        return torch.tensor(a["inputs"]), torch.tensor(a["outputs"])


TRACR_SUITE: dict[str, TracrGroundTruth] = {n: TracrGroundTruth(n) for n in TRACR_PROGRAMS}

__all__ = ["TRACR_PROGRAMS", "TRACR_SUITE", "TracrGroundTruth", "TracrMetric", "load_tracr", "tracr_dir"]
