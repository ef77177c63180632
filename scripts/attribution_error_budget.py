"""The attribution error budget on the shipped checkpoints: which nonlinearity carries attribution's error.

For each checkpoint: :func:`interp_norm.circuits.attribution_error.attribution_error_budget` on
``--pairs`` aligned in-distribution pairs (logit difference): per method (AtP, AtP*, EAP, EAP-IG)
and node (heads' outputs and q/k/v inputs, MLPs), the error against exact patching with live
norms and patterns, and the parts that freezing the norms' scales and then the attention patterns
remove. Then over seeds, per variant, method and node kind: the mean share of the live error each
part carries and the relative live error (error / mean |exact effect| over pairs: 1 is no better
than estimating every effect as 0), with bootstrap intervals,
and QKV-Norm minus Pre-Norm on the relative error (does a norm on q, k, v make attribution more or
less faithful?).

    PYTHONPATH=. python scripts/attribution_error_budget.py [--models pre pre-s1 ... qkv ... qk none]
        [--pairs 32] [--ig-steps 8] [--per pair|mean] [--out attribution_error] [--bridges gpt2 llama qwen3 olmo2 gemma4]

Writes ``budget.csv`` (every node), ``per_checkpoint.csv``, ``over_seeds.csv`` and
``pre_vs_qkv.csv`` into ``--out`` and prints the last two. ``--bridges``: also tiny random
TransformerBridges of those architectures (EAP and EAP-IG; random weights and random token pairs
differing at one position, so their numbers show the method on the architecture, not a trained
circuit), written to ``bridges.csv``; an architecture the budget refuses is reported and skipped.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
import torch

from interp_norm.circuits import LogitDiff, PatchingPairs, make_pairs
from interp_norm.circuits.attribution_error import BudgetSpec, attribution_error_budget, budget_summary
from interp_norm.errors import PatchingError
from interp_norm.stats.inference import bootstrap_diff_ci, bootstrap_mean_ci
from interp_norm import load_with_info
from interp_norm.training.checkpoints import list_pretrained

SEEDS = [f"{v}{s}" for v in ("pre", "qkv") for s in ("", "-s1", "-s2", "-s3", "-s4", "-s5")] + ["qk", "none"]
KEYS = ["method", "activation"]


def run(models: list, n_pairs: int, ig_steps: int, seed: int, per: str = "pair") -> pd.DataFrame:
    variant = list_pretrained().set_index("name")["attn_norm"]
    frames = []
    for name in models:
        model, info = load_with_info(name, kind="interp_norm")
        pairs = make_pairs(info.task, n_pairs, "id", seed=seed, aligned=True)
        t0 = time.perf_counter()
        df = attribution_error_budget(model, pairs, LogitDiff(pairs), BudgetSpec(ig_steps=ig_steps, per=per))
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
        frames.append(df.assign(model=name, variant=variant[name]))
    return pd.concat(frames, ignore_index=True)


def per_checkpoint(budget: pd.DataFrame) -> pd.DataFrame:
    out = []
    for (name, var), df in budget.groupby(["model", "variant"], sort=False):
        s = budget_summary(df)
        out.append(s.assign(model=name, variant=var))
    return pd.concat(out, ignore_index=True)


def over_seeds(pc: pd.DataFrame) -> pd.DataFrame:
    rows = []
    cols = ("rel_err_live", "share_removed_by_norm", "share_removed_by_pattern", "share_rest")
    for (var, method, act), df in pc.groupby(["variant"] + KEYS, sort=False):
        row = dict(variant=var, method=method, activation=act, n_seeds=len(df))
        for c in cols:
            lo, hi = bootstrap_mean_ci(df[c].to_numpy())
            row.update({c: df[c].mean(), f"{c}_lo": lo, f"{c}_hi": hi})
        rows.append(row)
    return pd.DataFrame(rows)


def pre_vs_qkv(pc: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for (method, act), df in pc.groupby(KEYS, sort=False):
        a = df[df.variant == "qkv"]["rel_err_live"].to_numpy()
        b = df[df.variant == "pre"]["rel_err_live"].to_numpy()
        if len(a) and len(b):
            lo, hi = bootstrap_diff_ci(a, b)
            rows.append(dict(method=method, activation=act, qkv=a.mean(), pre=b.mean(), qkv_minus_pre=a.mean() - b.mean(),
                             lo=lo, hi=hi, n_qkv=len(a), n_pre=len(b)))
    return pd.DataFrame(rows)


def bridge_budgets(archs: list, n_pairs: int, ig_steps: int, seed: int) -> pd.DataFrame:
    from interp_norm.anatomy import random_tokens, tiny_bridge

    def metric(logits: torch.Tensor) -> torch.Tensor:  # logit(5) - logit(6) at the last position
        return logits[:, -1, 5] - logits[:, -1, 6]

    frames = []
    for arch in archs:
        bridge = tiny_bridge(arch)
        clean = random_tokens(bridge, n_pairs, 8, seed=seed, low=3)
        corr = clean.clone()
        corr[:, 3] = (corr[:, 3] + 9) % 120 + 3
        pairs = PatchingPairs(clean, corr, score_mask=torch.ones_like(clean, dtype=torch.bool))
        grouped = getattr(bridge.cfg, "n_key_value_heads", None) not in (None, bridge.cfg.n_heads)
        acts = ("z", "q", "mlp_out") if grouped else ("z", "q", "k", "v", "mlp_out")
        t0 = time.perf_counter()
        try:
            df = attribution_error_budget(bridge, pairs, metric, BudgetSpec(activations=acts, ig_steps=ig_steps))
        except PatchingError as e:
            print(f"bridge {arch}: skipped ({e})", flush=True)
            continue
        print(f"bridge {arch}: {time.perf_counter() - t0:.1f} s", flush=True)
        frames.append(budget_summary(df).assign(arch=arch))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=SEEDS)
    ap.add_argument("--pairs", type=int, default=32)
    ap.add_argument("--ig-steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("attribution_error"))
    ap.add_argument("--bridges", nargs="*", default=[])
    ap.add_argument("--per", choices=("pair", "mean"), default="pair",
                    help="a node's error: mean over pairs of |estimate - exact|, or |mean estimate - mean exact|")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    budget = run(args.models, args.pairs, args.ig_steps, args.seed, args.per)
    pc = per_checkpoint(budget)
    seeds, diff = over_seeds(pc), pre_vs_qkv(pc)
    args.out.mkdir(parents=True, exist_ok=True)
    for nm, df in (("budget", budget), ("per_checkpoint", pc), ("over_seeds", seeds), ("pre_vs_qkv", diff)):
        df.to_csv(args.out / f"{nm}.csv", index=False)
    pd.set_option("display.width", 250)
    pd.set_option("display.max_columns", 30)
    show = ["variant", "method", "activation", "n_seeds", "rel_err_live", "rel_err_live_lo", "rel_err_live_hi",
            "share_removed_by_norm", "share_removed_by_norm_lo", "share_removed_by_norm_hi",
            "share_removed_by_pattern", "share_rest"]
    print(seeds[show].round(3).to_string(index=False))
    print()
    print(diff.round(3).to_string(index=False))
    if args.bridges:
        br = bridge_budgets(args.bridges, args.pairs, args.ig_steps, args.seed)
        br.to_csv(args.out / "bridges.csv", index=False)
        if len(br):
            print()
            print(br[["arch", "method", "activation", "rel_err_live", "share_removed_by_norm", "share_removed_by_pattern",
                      "share_rest"]].round(3).to_string(index=False))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s for {len(args.models)} checkpoints and {len(args.bridges)} bridges")


if __name__ == "__main__":
    main()
