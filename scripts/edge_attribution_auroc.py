"""How well edge attribution ranks edges against exact edge patching, on tiny random bridges.

Per architecture and seed: EAP and EAP-IG (``--ig-steps``) scores of every edge and the exact
single-edge patching effect (:func:`interp_norm.circuits.exact_edge_patch`), on random token pairs
differing at one position and the logit difference of two fixed tokens at the last position.
AUROC: |attribution| as a classifier of the top ``--top`` fraction of edges by |exact effect|
(ties averaged, Mann-Whitney); Spearman: rank correlation of the signed scores. Random weights, so
the numbers describe the estimator on the architecture, not a trained circuit. Gemma 4 is scored
(its per-layer-input branch is part of each layer's MLP node); ``gemma4-shared`` adds KV-sharing layers,
k = v global layers and per-layer k/v head counts, and has at least 4 layers (its last half shares
keys and values), whatever ``--layers`` says. An architecture edge attribution refuses is reported as such.

    PYTHONPATH=. python scripts/edge_attribution_auroc.py [--archs gpt2 llama qwen3 olmo2 gemma4 gemma4-shared]
        [--seeds 0 1 2] [--layers 2] [--ig-steps 8] [--top 0.1]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd
import torch

from interp_norm.anatomy import random_tokens, tiny_bridge
from interp_norm.circuits import PatchingPairs, edge_attribution, exact_edge_patch
from interp_norm.errors import PatchingError


def auroc(score: np.ndarray, positive: np.ndarray) -> float:
    """Mann-Whitney AUROC of ``score`` separating ``positive`` from the rest (ties averaged)."""
    r = pd.Series(score).rank().to_numpy()
    n1, n0 = positive.sum(), (~positive).sum()
    return float((r[positive].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 5] - logits[:, -1, 6]


def one(arch: str, seed: int, args: argparse.Namespace) -> list[dict]:
    bridge = tiny_bridge(arch, seed=seed, n_layers=max(args.layers, 4) if arch == "gemma4-shared" else args.layers)
    clean = random_tokens(bridge, args.pairs, args.n, seed=seed + 100, low=3)
    corr = clean.clone()
    at = torch.randint(1, args.n - 1, (args.pairs,), generator=torch.Generator().manual_seed(seed))
    corr[torch.arange(args.pairs), at] = (corr[torch.arange(args.pairs), at] + 9) % 120 + 3
    mask = torch.zeros_like(clean, dtype=torch.bool)
    mask[:, -1] = True
    pairs = PatchingPairs(clean, corr, score_mask=mask)
    exact = exact_edge_patch(bridge, pairs, metric).set_index(["sender", "receiver"])["score"]
    top = exact.abs() >= exact.abs().quantile(1 - args.top)
    rows = []
    for steps in (1, args.ig_steps):
        est = edge_attribution(bridge, pairs, metric, ig_steps=steps).set_index(["sender", "receiver"])["score"][exact.index]
        rows.append(dict(arch=arch, seed=seed, method="eap" if steps == 1 else f"eap-ig{steps}", edges=len(exact),
                         auroc=auroc(est.abs().to_numpy(), top.to_numpy()),
                         spearman=float(np.corrcoef(est.rank(), exact.rank())[0, 1])))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--archs", nargs="+", default=["gpt2", "llama", "qwen3", "olmo2", "gemma4", "gemma4-shared"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--n", type=int, default=8, help="tokens per prompt")
    p.add_argument("--ig-steps", type=int, default=8)
    p.add_argument("--top", type=float, default=0.1)
    args = p.parse_args()
    rows, t0 = [], time.time()
    for arch in args.archs:
        for seed in args.seeds:
            try:
                rows += one(arch, seed, args)
            except PatchingError as e:
                print(f"{arch}: refused -- {e}")
                break
    df = pd.DataFrame(rows)
    summary = df.groupby(["arch", "method"]).agg(edges=("edges", "first"), auroc_mean=("auroc", "mean"), auroc_min=("auroc", "min"),
                                                 auroc_max=("auroc", "max"), spearman_mean=("spearman", "mean"))
    print(df.to_string(index=False))
    print(summary.to_string())
    print(f"{time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
