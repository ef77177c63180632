"""The attribution error budget on the shipped checkpoints: which nonlinearity carries attribution's error.

For each checkpoint: :func:`interp_norm.circuits.attribution_error.attribution_error_budget` on
``--pairs`` aligned in-distribution pairs (logit difference): per method (AtP, AtP*, EAP, EAP-IG)
and node (heads' outputs and q/k/v inputs, MLPs), the error against exact patching with live
norms and patterns, and the parts that freezing the norms' scales and then the attention patterns
remove. Per checkpoint and method the relative error (error summed over nodes / the error of
attributing nothing, in %), with the norms live or frozen; then Pre-Norm vs QKV-Norm over seeds
(does a norm on q, k, v make attribution more or less faithful?), per score scaling.

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/attribution_error_budget.py [--models pre ... qkv-cal-s5]
        [--pairs 32] [--ig-steps 8] [--per pair|mean] [--out attribution_error] [--bridges gpt2 ... gemma4] [--write]
    PYTHONPATH=. python scripts/attribution_error_budget.py --summarise DIR [--write]   # from DIR's budget.csv

Writes ``budget.csv`` (every node), ``bridges.csv`` and the tables below into ``--out``; ``--write``
also into data/seed_tables (``attribution_error_*.csv``) and the ATTRIBUTION-ERROR block of
docs/findings-tables.md. ``--bridges``: tiny random TransformerBridges (EAP and EAP-IG on random
token pairs differing at one position: the method on the architecture, not a trained circuit); an
architecture the budget refuses is kept as a row saying why.

Statistics (:mod:`interp_norm.stats.inference`, through :func:`~interp_norm.stats.seed_compare.compare_seeds`):
per arm the mean and Student-t 95% interval over seeds, Pre − QKV with its Welch interval, exact
permutation p one-sided both ways; within each arm with seeds, frozen-norm minus live error per seed
with its t interval and a one-sided one-sample t-test (H1: freezing the norm makes the estimate worse).
Holm over this block's declared family: every one of those p for AtP*, EAP and EAP-IG, norms live and
frozen, at both scalings (AtP is EAP's estimate computed by other code, an identity, so it stays out;
the control, the size of the exact effects, is shown beside and stays out).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from _docs import replace_block

from interp_norm.circuits import LogitDiff, PatchingPairs, make_pairs
from interp_norm.circuits.attribution_error import BudgetSpec, attribution_error_budget, budget_summary
from interp_norm.errors import PatchingError
from interp_norm.stats.inference import holm, permutation_test, t_interval, t_test_value
from interp_norm.stats.seed_compare import PAIRS, compare_seeds
from interp_norm import load_with_info
from interp_norm.training.checkpoints import list_pretrained

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data" / "seed_tables"
PAGE = ROOT / "docs" / "findings-tables.md"
BLOCK = "ATTRIBUTION-ERROR"
ARMS = ("pre", "qkv", "qk", "none", "pre-cal", "qkv-cal")
SEEDS = [f"{a}{s}" for a in ("pre", "qkv") for s in ("", "-s1", "-s2", "-s3", "-s4", "-s5")] + ["qk", "none"] + [
    f"{a}{s}" for a in ("pre-cal", "qkv-cal") for s in ("", "-s1", "-s2", "-s3", "-s4", "-s5")]
BRIDGES = ("gpt2", "llama", "qwen3", "olmo2", "gemma4")
LABEL = {"atp": "AtP", "atp*": "AtP*", "eap": "EAP", "eap-ig": "EAP-IG"}
#: AtP's estimate is EAP's (two implementations): shown, but an identity, so not in the family.
IDENTITY = "atp"
CONTROL = "mean absolute exact effect per node (control)"
#: The arms with seeds whose frozen-minus-live error is tested: (arm, attn_norm, calibration).
WITHIN = (("pre", "pre", "none"), ("qkv", "qkv", "none"), ("pre-cal", "pre", "paper"), ("qkv-cal", "qkv", "paper"))


def _quantity(method: str, norm: str) -> str:
    return f"relative error, {LABEL[method]}, norm {norm}"


def run(models: list, n_pairs: int, ig_steps: int, seed: int, per: str = "pair") -> pd.DataFrame:
    """Every node of every checkpoint (:func:`attribution_error_budget`), with the checkpoint's name."""
    frames = []
    for name in models:
        model, info = load_with_info(name, kind="interp_norm")
        pairs = make_pairs(info.task, n_pairs, "id", seed=seed, aligned=True)
        t0 = time.perf_counter()
        df = attribution_error_budget(model, pairs, LogitDiff(pairs), BudgetSpec(ig_steps=ig_steps, per=per))
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
        frames.append(df.assign(model=name))
    return pd.concat(frames, ignore_index=True)


def per_checkpoint(budget: pd.DataFrame) -> pd.DataFrame:
    """:func:`budget_summary` per checkpoint, method and node kind, and over every node kind (``activation="all"``)."""
    meta = list_pretrained().set_index("name")
    out = []
    for name, df in budget.groupby("model", sort=False):
        s = pd.concat([budget_summary(df), budget_summary(df, by=("method",)).assign(activation="all")], ignore_index=True)
        m = meta.loc[name]
        out.append(s.assign(checkpoint=name, arm=name.split("-s")[0], attn_norm=m["attn_norm"],
                            calibration=m["calibration"], seed=int(m["seed"])))
    pc = pd.concat(out, ignore_index=True)
    return pc[["checkpoint", "arm", "attn_norm", "calibration", "seed"] + [c for c in pc.columns if c not in (
        "checkpoint", "arm", "attn_norm", "calibration", "seed")]]


def seed_values(pc: pd.DataFrame) -> pd.DataFrame:
    """One row per (checkpoint, quantity) in the columns :func:`compare_seeds` reads: the relative error
    (%) over every node per method with the norms live and frozen, and the control."""
    rows = []
    for r in pc[pc["activation"] == "all"].itertuples():
        base = dict(checkpoint=r.checkpoint, attn_norm=r.attn_norm, calibration=r.calibration, seed=r.seed)
        for norm, col in (("live", "rel_err_live"), ("frozen", "rel_err_norm")):
            rows.append(dict(base, quantity=_quantity(r.method, norm), unit="%", value=100 * getattr(r, col)))
        if r.method == "eap":
            rows.append(dict(base, quantity=CONTROL, unit="logit diff", value=r.exact_size / r.n_nodes))
    per = pd.DataFrame(rows)
    order = {q: i for i, q in enumerate([_quantity(m, n) for m in LABEL for n in ("live", "frozen")] + [CONTROL])}
    return per.sort_values("quantity", key=lambda c: c.map(order), kind="stable").reset_index(drop=True)


def _role(quantity: str) -> str:
    return "control" if quantity == CONTROL else "identity" if f", {LABEL[IDENTITY]}," in quantity else "family"


def comparisons(per: pd.DataFrame) -> pd.DataFrame:
    """Pre vs QKV per scaling (:func:`compare_seeds`), exact permutation p one-sided both ways, Holm over the
    family (the module docstring)."""
    comp, _ = compare_seeds(per, pairs=PAIRS)
    order = {q: i for i, q in enumerate(dict.fromkeys(per["quantity"]))}
    comp = comp.sort_values(["scaling", "comparison"], key=lambda c: c.map(order) if c.name == "comparison" else c,
                            kind="stable").reset_index(drop=True)
    extra = []
    for r in comp.itertuples():
        cal = next(p[1] for p in PAIRS if p[0] == r.scaling)
        vals = [per[(per["attn_norm"] == a) & (per["calibration"] == cal) & (per["quantity"] == r.comparison)]["value"]
                .to_numpy() for a in ("pre", "qkv")]
        extra.append(dict(p_greater=permutation_test(*vals, alternative="greater").p_value,
                          p_less=permutation_test(*vals, alternative="less").p_value, role=_role(r.comparison)))
    return pd.concat([comp, pd.DataFrame(extra)], axis=1)


def within_arm(per: pd.DataFrame) -> pd.DataFrame:
    """Per arm with seeds and method: frozen-norm minus live relative error per seed (points), mean, t interval,
    one-sided one-sample t p (H1: > 0, freezing the norm makes the estimate worse)."""
    rows = []
    for arm, norm, cal in WITHIN:
        mine = per[(per["attn_norm"] == norm) & (per["calibration"] == cal)].set_index(["quantity", "checkpoint"])["value"]
        for method in LABEL:
            v = (mine[_quantity(method, "frozen")] - mine[_quantity(method, "live")]).dropna().to_numpy()
            if len(v) < 2:
                continue
            lo, hi = t_interval(v)
            rows.append(dict(arm=arm, method=LABEL[method], n=len(v), mean=float(v.mean()), ci_lo=lo, ci_hi=hi,
                             n_positive=int((v > 0).sum()), p_greater=t_test_value(v, 0.0, alternative="greater"),
                             role=_role(_quantity(method, "live"))))
    return pd.DataFrame(rows)


def with_family_holm(comp: pd.DataFrame, within: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Holm over the declared family (the module docstring); members of another role get NaN."""
    cols = [comp["p_greater"].where(comp["role"] == "family"), comp["p_less"].where(comp["role"] == "family"),
            within["p_greater"].where(within["role"] == "family")]
    adj = holm(np.concatenate([c.to_numpy(float) for c in cols]))
    n = len(comp)
    return comp.assign(p_greater_holm=adj[:n], p_less_holm=adj[n:2 * n]), within.assign(p_holm=adj[2 * n:])


def bridge_budgets(archs: list, n_pairs: int, ig_steps: int, seed: int) -> pd.DataFrame:
    """:func:`budget_summary` per tiny random bridge; a refused architecture is one row with the reason."""
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
            print(f"bridge {arch}: not available ({e})", flush=True)
            frames.append(pd.DataFrame([dict(arch=arch, status=f"not available: {e}")]))
            continue
        print(f"bridge {arch}: {time.perf_counter() - t0:.1f} s", flush=True)
        s = pd.concat([budget_summary(df), budget_summary(df, by=("method",)).assign(activation="all")], ignore_index=True)
        frames.append(s.assign(arch=arch, status="ok"))
    out = pd.concat(frames, ignore_index=True)
    return out[["arch", "status"] + [c for c in out.columns if c not in ("arch", "status")]]


# ----------------------------------------------------------------------------- the page's block

def _ci(m: float, lo: float, hi: float, d: int = 1) -> str:
    return "—" if pd.isna(m) else f"{m:.{d}f}" if pd.isna(lo) else f"{m:.{d}f} [{lo:.{d}f}, {hi:.{d}f}]"


def _pv(p: float) -> str:
    return "—" if pd.isna(p) else f"{p:.2g}"


def _comparison_rows(comp: pd.DataFrame) -> list[str]:
    out = ["| scaling | quantity | Pre-Norm | QKV-Norm | Pre − QKV | p (Pre>QKV) | p (Pre<QKV) | Holm (Pre>QKV) | "
           "Holm (Pre<QKV) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in comp.itertuples():
        d = 2 if r.unit == "logit diff" else 1
        note = {"control": " — control, not in the family", "identity": " — = EAP (one estimate), not in the family"}
        out.append(f"| {r.scaling} | {r.comparison} ({r.unit}){note.get(r.role, '')} | {_ci(r.mean_a, r.ci_lo_a, r.ci_hi_a, d)} | "
                   f"{_ci(r.mean_b, r.ci_lo_b, r.ci_hi_b, d)} | {_ci(r.diff, r.diff_lo, r.diff_hi, d)} | "
                   f"{_pv(r.p_greater)} | {_pv(r.p_less)} | {_pv(r.p_greater_holm)} | {_pv(r.p_less_holm)} |")
    return out


def _within_rows(within: pd.DataFrame) -> list[str]:
    out = ["| arm | method | frozen − live (points) | seeds worse | p (> 0) | Holm |", "|---|---|---|---|---|---|"]
    for r in within.itertuples():
        note = " (= EAP, not in the family)" if r.role == "identity" else ""
        out.append(f"| {r.arm} | {r.method}{note} | {_ci(r.mean, r.ci_lo, r.ci_hi)} | {r.n_positive} of {r.n} | "
                   f"{_pv(r.p_greater)} | {_pv(r.p_holm)} |")
    return out


def _arm_rows(pc: pd.DataFrame) -> list[str]:
    out = ["| arm | seeds | method | norm live | norm frozen | removed by freezing the norm | by freezing patterns | "
           "rest |", "|---|---|---|---|---|---|---|---|"]
    allk = pc[pc["activation"] == "all"]
    for arm in [a for a in ARMS if a in set(allk["arm"])]:
        for method in LABEL:
            g = allk[(allk["arm"] == arm) & (allk["method"] == method)]
            cells = []
            for col in ("rel_err_live", "rel_err_norm"):
                v = 100 * g[col].to_numpy()
                cells.append(_ci(v.mean(), *t_interval(v)) if len(v) > 1 else _ci(v.mean(), math.nan, math.nan))
            shares = [f"{100 * (g[c] / g['exact_size']).mean():.1f}" for c in ("removed_by_norm", "removed_by_pattern", "rest")]
            out.append(f"| {arm} | {len(g)} | {LABEL[method]} | {' | '.join(cells)} | {' | '.join(shares)} |")
    return out


def _bridge_rows(br: pd.DataFrame) -> list[str]:
    out = ["| architecture | method | norm live | norm frozen | removed by freezing the norm | by freezing patterns | "
           "rest |", "|---|---|---|---|---|---|---|"]
    for arch, g in br.groupby("arch", sort=False):
        if (g["status"] != "ok").all():
            out.append(f"| {arch} | — | {g['status'].iloc[0].replace('|', '/')} | | | | |")
            continue
        for r in g[g["activation"] == "all"].itertuples():
            parts = " | ".join("not available" if pd.isna(getattr(r, c)) else f"{100 * getattr(r, c) / r.exact_size:.1f}"
                               for c in ("removed_by_norm", "removed_by_pattern", "rest"))
            out.append(f"| {arch} | {LABEL[r.method]} | {100 * r.rel_err_live:.1f} | {100 * r.rel_err_norm:.1f} | {parts} |")
    return out


def markdown(comp: pd.DataFrame, within: pd.DataFrame, pc: pd.DataFrame, br: pd.DataFrame, info: dict) -> str:
    """The page's block, from the tables only."""
    return "\n".join([
        "### Attribution's error against exact patching (Pre-Norm vs QKV-Norm over seeds)", "",
        f"Generated by `scripts/attribution_error_budget.py` ({info['n_checkpoints']} checkpoints and "
        f"{info['n_bridges']} tiny random bridges: {info['cpu_seconds']:.0f} s of CPU on one thread, {info['seconds']:.0f} s "
        "wall on a shared machine; `make reproduce-seeds` runs it). "
        f"Per checkpoint {info['pairs']} aligned ID pairs, logit difference, EAP-IG with {info['ig_steps']} steps; every "
        "head output z, head input q, k, v and MLP output. **Relative error** = Σ over nodes of the mean over pairs "
        "|estimate − exact patching| / Σ of the mean |exact effect| (100% is no better than attributing nothing), "
        "with the norms' scales live or frozen in the backward pass (patterns live). Mean [Student-t 95%] per arm, "
        "Pre − QKV [Welch 95%], exact permutation p one-sided both ways (924 splits), Holm over this block's family "
        "(the one-sided p of AtP*, EAP and EAP-IG, norm live and frozen, both scalings, and of the within-arm tests "
        "below).", "",
        *_comparison_rows(comp), "",
        "Within each arm: the relative error with the norm frozen minus live, per seed (points; mean [Student-t 95%], "
        "how many seeds got worse, one-sided one-sample t-test of > 0, Holm over the same family):", "",
        *_within_rows(within), "",
        "Per arm, the relative error (%) and its split: the live error = removed by freezing the norm + removed by "
        "freezing the patterns (after the norm) + the rest (each % of the exact effects' size, mean over seeds; a "
        "negative part: freezing made the estimate worse). The error with the norm frozen = the last two parts.", "",
        *_arm_rows(pc), "",
        "Tiny random bridges (random weights and tokens: the method on the architecture, not a trained circuit; "
        "EAP and EAP-IG; grouped-query models without k and v; 'not available': the model's attention pattern is "
        "read after attention ran, so patterns cannot be frozen):", "",
        *_bridge_rows(br)])


def markdown_from_data(data: Path = DATA) -> str:
    """The block rebuilt from the tables kept in data/seed_tables (what the docs test checks)."""
    return markdown(pd.read_csv(data / "attribution_error_seed_comparisons.csv"),
                    pd.read_csv(data / "attribution_error_within_arm.csv"),
                    pd.read_csv(data / "attribution_error_per_checkpoint.csv"),
                    pd.read_csv(data / "attribution_error_bridges.csv"),
                    json.loads((data / "attribution_error_run.json").read_text()))


def summarise(out: Path, write: bool, info: dict) -> str:
    pc = per_checkpoint(pd.read_csv(out / "budget.csv"))
    per = seed_values(pc)
    comp, within = with_family_holm(comparisons(per), within_arm(per))
    br = pd.read_csv(out / "bridges.csv") if (out / "bridges.csv").exists() else pd.DataFrame(columns=["arch", "status"])
    info = dict(info, n_checkpoints=int(pc["checkpoint"].nunique()), n_bridges=int(br["arch"].nunique()))
    tables = dict(per_checkpoint=pc, seed_values=per, seed_comparisons=comp, within_arm=within, bridges=br)
    for key, df in tables.items():
        df.to_csv(out / f"{key}.csv", index=False)
    text = markdown(comp, within, pc, br, info)
    if write:
        for key, df in tables.items():
            df.to_csv(DATA / f"attribution_error_{key}.csv", index=False)
        (DATA / "attribution_error_run.json").write_text(json.dumps(info, indent=1) + "\n")
        page = PAGE.read_text(encoding="utf-8")
        if f"<!-- {BLOCK}:start -->" not in page:
            PAGE.write_text(page.rstrip("\n") + f"\n\n<!-- {BLOCK}:start -->\n<!-- {BLOCK}:end -->\n", encoding="utf-8")
        replace_block(BLOCK, text, PAGE)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=SEEDS)
    ap.add_argument("--pairs", type=int, default=32)
    ap.add_argument("--ig-steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("attribution_error"))
    ap.add_argument("--bridges", nargs="*", default=list(BRIDGES))
    ap.add_argument("--per", choices=("pair", "mean"), default="pair",
                    help="a node's error: mean over pairs of |estimate - exact|, or |mean estimate - mean exact|")
    ap.add_argument("--summarise", type=Path, help="rebuild the tables from this folder's budget.csv (no model is run)")
    ap.add_argument("--write", action="store_true", help="also write data/seed_tables/attribution_error_*.csv and the page's block")
    args = ap.parse_args()
    if args.summarise is not None:
        print(summarise(args.summarise, args.write, json.loads((args.summarise / "run.json").read_text())))
        return
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    budget = run(args.models, args.pairs, args.ig_steps, args.seed, args.per)
    args.out.mkdir(parents=True, exist_ok=True)
    budget.to_csv(args.out / "budget.csv", index=False)
    bridge_budgets(args.bridges, args.pairs, args.ig_steps, args.seed).to_csv(args.out / "bridges.csv", index=False)
    info = dict(pairs=args.pairs, ig_steps=args.ig_steps, seed=args.seed, per=args.per, seconds=time.perf_counter() - t0,
                cpu_seconds=time.process_time())
    (args.out / "run.json").write_text(json.dumps(info, indent=1) + "\n")
    print(summarise(args.out, args.write, info))


if __name__ == "__main__":
    main()
