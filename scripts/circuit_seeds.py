"""The addition circuit on every seed of Pre-Norm and QKV-Norm at both score scales, compared by role,
and tied to collapse.

    .venv/bin/python scripts/circuit_seeds.py run [--out report-circuits] [--problems 256]
        # per checkpoint (24: pre, pre-s1..s5, pre-cal..., qkv..., qkv-cal...): the circuit, roles,
        # verification, cell sparsity, collapse by role and the circuit vs matched noise cost, as CSVs
        # in OUT/CHECKPOINT/ (a checkpoint already done is skipped, so the run can be resumed)
    .venv/bin/python scripts/circuit_seeds.py noise-cost [--out report-circuits] [--problems 256]
        # only the circuit vs matched-control noise cost, recomputed per checkpoint from the circuit in
        # OUT/CHECKPOINT/circuit.csv; tables missing from OUT are first unpacked from data/seed_tables (the
        # shipped run), so the seed summary can be rebuilt without relocating any circuit (resumable:
        # a checkpoint whose noise_cost.csv has the current arms is skipped)
    .venv/bin/python scripts/circuit_seeds.py summarise [--out report-circuits] [--write]
        # the seed comparisons (data/seed_tables/circuit_seed_*.csv with --write, and the section of
        # docs/findings-tables.md between its CIRCUIT-TABLES markers)

Statistics (:mod:`interp_norm.stats.inference`): per arm the mean and Student-t 95% interval over
seeds, A − B with its Welch interval, exact permutation p-values (two-sided, and one-sided both ways),
Holm over this page's own declared family (every circuit comparison below; the verdicts' family in
scripts/verdicts.py is unchanged: the paper makes no claim about the circuit).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from _docs import replace_block

from interp_norm.stats.inference import holm, permutation_test, t_interval, t_test_value
from interp_norm.stats.seed_compare import PAIRS, compare_seeds

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data" / "seed_tables"
PAGE = ROOT / "docs" / "findings-tables.md"
START, END = "<!-- CIRCUIT-TABLES:start -->", "<!-- CIRCUIT-TABLES:end -->"
ARMS = ("pre", "qkv", "pre-cal", "qkv-cal")
CHECKPOINTS = tuple(n for a in ARMS for n in (a, *(f"{a}-s{s}" for s in range(1, 6))))
FAMILIES = ("operand digits", "=", "earlier answer", "[", "operand signs", "operators", "]", "spread")
LEVELS = (0.11, 0.2)
CIRCUIT, MATCHED = "circuit", "matched outside"  # interp_norm.circuits.circuit_collapse's arm names
#: The same pair matched on the answer position too (the finer control: same layer, same position).
CIRCUIT_POS, MATCHED_POS = "circuit (position-matched)", "matched outside (same position)"
ARM_ROWS = (CIRCUIT, MATCHED, CIRCUIT_POS, MATCHED_POS, "circuit (every sparse row)", "matched outside (layer only)")
COST = "noise on the circuit's sparse rows minus on matched answer rows outside (same layer, equal counts)"
COST_POS = ("noise on the circuit's sparse rows minus on matched rows outside (same layer and answer position, "
            "equal counts)")
NOISE_DRAWS = 8
#: data/seed_tables file of each per-checkpoint table (what ``summarise --write`` keeps).
SHIPPED = dict(circuit="circuit_circuit_per_checkpoint", roles="circuit_roles_per_checkpoint",
               curve="circuit_curve_per_checkpoint", sparsity="circuit_sparsity_per_checkpoint",
               verification="circuit_verification", collapse_by_role="circuit_collapse_by_role",
               noise_cost="circuit_noise_cost")


def _model_and_data(name: str, n: int):
    """The checkpoint (eval mode), its circuit spec and the problems every table of the run uses."""
    from interp_norm import load
    from interp_norm.circuits.cell_circuit import CircuitSpec, circuit_data
    from interp_norm.core import task as T

    model = load(name, kind="interp_norm")
    model.eval()
    spec = CircuitSpec(n=n, seed=0)
    task = T.task_for(model, None, who="circuit_seeds")
    return model, spec, circuit_data(task.sample_problems(n, spec.split, seed=spec.seed), seed=spec.seed + 1)


def run_one(name: str, out: Path, n: int) -> None:
    """Every per-checkpoint table of ``name`` into ``out``."""
    from interp_norm.circuits.circuit_collapse import cell_sparsity, clean_patterns, collapse_by_role, role_family
    from interp_norm.circuits.cell_roles import addition_circuit

    model, spec, data = _model_and_data(name, n)
    res = addition_circuit(model, None, spec=spec, name=name)
    circuit = res["circuit"].assign(family=[role_family(r, c) for r, c in zip(res["circuit"]["role"],
                                                                                res["circuit"]["top_class"])])
    tables = dict(circuit=circuit, verification=res["verification"], curve=res["curve"], roles=res["roles"],
                  sparsity=cell_sparsity(clean_patterns(model, data), data),
                  collapse_by_role=collapse_by_role(model, data, circuit, levels=LEVELS, n_draws=16),
                  noise_cost=noise_cost(model, data, circuit))
    out.mkdir(parents=True, exist_ok=True)
    for key, df in tables.items():
        df.assign(checkpoint=name).to_csv(out / f"{key}.csv", index=False)
    (out / "account.txt").write_text(res["account"] + "\n")


def unpack(name: str, out: Path, data: Path = DATA) -> None:
    """Write ``name``'s tables kept in ``data`` into ``out`` where ``out`` lacks them."""
    out.mkdir(parents=True, exist_ok=True)
    for key, stem in SHIPPED.items():
        if not (out / f"{key}.csv").exists() and (data / f"{stem}.csv").exists():
            t = pd.read_csv(data / f"{stem}.csv")
            if (t["checkpoint"] == name).any():
                t[t["checkpoint"] == name].to_csv(out / f"{key}.csv", index=False)
    acc = data / "circuit_accounts.csv"
    if not (out / "account.txt").exists() and acc.exists():
        a = pd.read_csv(acc)
        if (a["checkpoint"] == name).any():
            (out / "account.txt").write_text(str(a.loc[a["checkpoint"] == name, "account"].iloc[0]) + "\n")


def noise_cost(model, data, circuit: pd.DataFrame, parts: tuple = ("row kind", "answer position")) -> pd.DataFrame:
    """The noise-cost arms: the pair matched on layer and row kind with the references, and (``answer
    position``) the pair matched on layer and answer position, renamed :data:`CIRCUIT_POS` / :data:`MATCHED_POS`."""
    from interp_norm.circuits.circuit_collapse import circuit_noise_cost

    out = []
    if "row kind" in parts:
        out.append(circuit_noise_cost(model, data, circuit, levels=LEVELS, n_draws=NOISE_DRAWS))
    if "answer position" in parts:
        t = circuit_noise_cost(model, data, circuit, levels=LEVELS, n_draws=NOISE_DRAWS, match_on="answer position")
        t = t[t["rows"].isin([CIRCUIT, MATCHED])]
        out.append(t.assign(rows=t["rows"].map({CIRCUIT: CIRCUIT_POS, MATCHED: MATCHED_POS})))
    return pd.concat(out, ignore_index=True)


def noise_cost_one(name: str, out: Path, n: int) -> bool:
    """Recompute only the arms ``out/noise_cost.csv`` lacks, from ``out/circuit.csv``; False if none."""
    from interp_norm.circuits.circuit_collapse import MATCHED_LAYER

    unpack(name, out)
    path = out / "noise_cost.csv"
    have = set(pd.read_csv(path)["rows"]) if path.exists() else set()
    parts = tuple(p for p, arm in (("row kind", MATCHED_LAYER), ("answer position", MATCHED_POS)) if arm not in have)
    if not parts:
        return False
    model, _, data = _model_and_data(name, n)
    new = noise_cost(model, data, pd.read_csv(out / "circuit.csv"), parts).assign(checkpoint=name)
    kept = pd.read_csv(path) if path.exists() else new.iloc[:0]
    if "row kind" in parts:  # an older file: only its position-matched arms (if any) are still current
        kept = kept[kept["rows"].isin([CIRCUIT_POS, MATCHED_POS])]
    pd.concat([kept, new], ignore_index=True).to_csv(path, index=False)
    return True


def read(out: Path, key: str) -> pd.DataFrame:
    return pd.concat([pd.read_csv(out / n / f"{key}.csv") for n in CHECKPOINTS if (out / n / f"{key}.csv").exists()],
                     ignore_index=True)


def _ckpt_meta(name: str) -> dict:
    base = name.split("-s")[0]
    return dict(checkpoint=name, attn_norm=base.split("-")[0], calibration="paper" if "cal" in base else "none",
                seed=int(name.split("-s")[1]) if "-s" in name else 0)


def _family_quantity(family: str) -> str:
    return "circuit cells with no dominant class (spread)" if family == "spread" else f"circuit cells reading {family}"


def per_checkpoint(out: Path) -> pd.DataFrame:
    """One row per (checkpoint, quantity) in the columns :func:`compare_seeds` reads."""
    circ, ver, spars = read(out, "circuit"), read(out, "verification"), read(out, "sparsity")
    col, cost = read(out, "collapse_by_role"), read(out, "noise_cost")
    rows = []
    for name in sorted(set(ver["checkpoint"]), key=CHECKPOINTS.index):
        c, v = circ[circ["checkpoint"] == name], ver[(ver["checkpoint"] == name) & (ver["ablation"] == "resample")]
        s = spars[spars["checkpoint"] == name].merge(c[["layer", "head", "slot"]], on=["layer", "head", "slot"])
        q = [("circuit size at 90% of accuracy (share of cells)", "%", 100 * float(v["share_of_cells"].iloc[0])),
             ("circuit cells", "cells", float(len(c))),
             ("mean max attention of circuit cells", "%", 100 * float(s["max_attention"].mean())),
             ("sparse rows of circuit cells", "%", 100 * float((s["sparse_share"] * s["n_rows"]).sum() / s["n_rows"].sum()))]
        q += [(_family_quantity(f), "cells", float((c["family"] == f).sum())) for f in FAMILIES]
        q += [(f"circuit cells in layer {l}", "cells", float((c["layer"] == l).sum())) for l in sorted(set(spars["layer"]))]
        cl = col[(col["checkpoint"] == name) & col["in_circuit"]]
        for level in LEVELS:
            at = cl[np.isclose(cl["level"], level)]
            q.append((f"circuit's share of collapses at {level:.0%} noise", "%", 100 * float(at["share_of_collapses"].sum(min_count=1))))
        q.append(("circuit's share of sparse rows", "%", 100 * float(cl[np.isclose(cl["level"], LEVELS[0])]["share_of_sparse"].sum())))
        k = cost[cost["checkpoint"] == name]
        for level in LEVELS:
            m = k[np.isclose(k["level"], level)].groupby("rows")["drop"].mean()
            q.append((f"accuracy lost to {level:.0%} {COST}", "points", float(m[CIRCUIT] - m[MATCHED])))
            q.append((f"accuracy lost to {level:.0%} {COST_POS}", "points", float(m[CIRCUIT_POS] - m[MATCHED_POS])))
        rows += [dict(**_ckpt_meta(name), quantity=qq, unit=u, value=val) for qq, u, val in q]
    return pd.DataFrame(rows)


def comparisons(per: pd.DataFrame) -> pd.DataFrame:
    """Pre vs QKV per scaling (:func:`compare_seeds`), one-sided exact permutation p both ways."""
    comp, _ = compare_seeds(per, pairs=PAIRS)
    order = {q: i for i, q in enumerate(per["quantity"].unique())}
    comp = comp.sort_values(["scaling", "comparison"], key=lambda c: c.map(order) if c.name == "comparison" else c,
                            kind="stable").reset_index(drop=True)
    extra = []
    for r in comp.itertuples():
        cal = "none" if r.scaling == PAIRS[0][0] else "paper"
        vals = [per[(per["attn_norm"] == a) & (per["calibration"] == cal) & (per["quantity"] == r.comparison)]["value"]
                .dropna().to_numpy() for a in ("pre", "qkv")]
        ok = len(vals[0]) and len(vals[1])
        extra.append(dict(p_greater=permutation_test(*vals, alternative="greater").p_value if ok else math.nan,
                          p_less=permutation_test(*vals, alternative="less").p_value if ok else math.nan))
    return pd.concat([comp, pd.DataFrame(extra)], axis=1)


def within_arm(per: pd.DataFrame) -> pd.DataFrame:
    """Per arm, the circuit-minus-matched noise cost over seeds: mean, t interval, two-sided t p (vs 0) and
    one-sided t p (circuit costs more)."""
    rows = []
    for a in ARMS:
        norm, cal = a.split("-")[0], "paper" if "cal" in a else "none"
        for q in sorted({x for x in per["quantity"] if x.endswith((COST, COST_POS))}):
            v = per[(per["attn_norm"] == norm) & (per["calibration"] == cal) & (per["quantity"] == q)]["value"].dropna()
            lo, hi = t_interval(v) if len(v) > 1 else (math.nan, math.nan)
            ok = len(v) > 1 and v.std() > 0
            p = t_test_value(v, 0.0) if ok else math.nan
            p1 = t_test_value(v, 0.0, alternative="greater") if ok else math.nan
            rows.append(dict(arm=a, quantity=q, n=len(v), mean=float(v.mean()), ci_lo=lo, ci_hi=hi, p_value=p,
                             p_greater=p1, values=", ".join(f"{x:.1f}" for x in v)))
    return pd.DataFrame(rows)


def with_family_holm(comp: pd.DataFrame, within: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Holm over the declared family: every two-sided p of both tables."""
    p = np.concatenate([comp["p_value"].to_numpy(float), within["p_value"].to_numpy(float)])
    adj = holm(p)
    return comp.assign(p_holm=adj[: len(comp)]), within.assign(p_holm=adj[len(comp):])


def _ci(m: float, lo: float, hi: float) -> str:
    return "—" if pd.isna(m) else f"{m:.1f}" if pd.isna(lo) else f"{m:.1f} [{lo:.1f}, {hi:.1f}]"


def _pc(x: float) -> str:
    return "—" if pd.isna(x) else f"{100 * x:.1f}%"


def _pv(p: float) -> str:
    return "—" if pd.isna(p) else f"{p:.2g}"


def arm_counts(cost: pd.DataFrame) -> pd.DataFrame:
    """Per arm of checkpoints and row set: rows noised per run, of which answer rows, circuit rows left
    unmatched, and the accuracy lost per level (means over draws, then over seeds)."""
    c = cost.assign(arm=cost["checkpoint"].str.replace(r"-s\d$", "", regex=True))
    per = c.groupby(["arm", "checkpoint", "rows", "level"], sort=False)[
        ["n_noised", "n_answer_rows", "shortfall", "drop"]].mean().reset_index()
    g = per.groupby(["arm", "rows", "level"], sort=False)[["n_noised", "n_answer_rows", "shortfall", "drop"]].mean()
    out = g["drop"].unstack("level")
    out.columns = [f"drop at {x:.0%}" for x in out.columns]
    counts = g[["n_noised", "n_answer_rows", "shortfall"]].groupby(["arm", "rows"], sort=False).first()
    return counts.join(out).reset_index()


def _counts_markdown(cost: pd.DataFrame) -> list[str]:
    t = arm_counts(cost)
    levels = [c for c in t.columns if c.startswith("drop at")]
    out = ["", "Rows noised per run and accuracy lost per arm (means over draws, then seeds): the circuit arm and its "
           "control noise equal counts of answer rows in every layer; the position-matched pair equal counts in "
           "every layer and answer position; `circuit (every sparse row)` and `matched outside (layer only)` are "
           "the unmatched-kind reference (the control before row kinds were matched); "
           "unmatched = circuit rows their control could not match (too few sparse rows outside the circuit in "
           "that layer and row kind, or layer and answer position, for the pairs; in that layer for the "
           "reference):", "",
           "| arm | rows | noised | of which answer rows | unmatched | " + " | ".join(f"lost {c[8:]} (points)" for c in levels)
           + " |", "|---|---|---|---|---|" + "---|" * len(levels)]
    t = t.assign(order=t["rows"].map({r: i for i, r in enumerate(ARM_ROWS)}), a=t["arm"].map(ARMS.index))
    for _, r in t.sort_values(["a", "order"]).iterrows():
        out.append(f"| {r['arm']} | {r['rows']} | {r['n_noised']:.0f} | {r['n_answer_rows']:.0f} | {r['shortfall']:.0f} | "
                   + " | ".join(f"{r[c]:.2f}" for c in levels) + " |")
    return out


def markdown(comp: pd.DataFrame, within: pd.DataFrame, col: pd.DataFrame, cost: pd.DataFrame) -> str:
    """The page's section, from the tables only."""
    out = ["### The addition circuit over seeds (Pre-Norm vs QKV-Norm, by role)", "",
           "Generated by `scripts/circuit_seeds.py`; per seed the circuit at 90% of per-token accuracy at the "
           "grain (layer, head, answer position), 256 ID problems. Mean [Student-t 95%] per arm, A − B [Welch 95%], "
           "exact permutation p (two-sided; one-sided A > B and A < B), Holm over this section's family.", "",
           "| scaling | quantity | A | B | A − B | p | p (A>B) | p (A<B) | Holm |", "|---|---|---|---|---|---|---|---|---|"]
    for r in comp.itertuples():
        out.append(f"| {r.scaling} | {r.comparison} ({r.unit}) | {r.arm_a} {_ci(r.mean_a, r.ci_lo_a, r.ci_hi_a)} | "
                   f"{r.arm_b} {_ci(r.mean_b, r.ci_lo_b, r.ci_hi_b)} | {_ci(r.diff, r.diff_lo, r.diff_hi)} | "
                   f"{_pv(r.p_value)} | {_pv(r.p_greater)} | {_pv(r.p_less)} | {_pv(r.p_holm)} |")
    out += ["", f"Noise (q/k, uniform, after any norm) on the circuit's sparse rows only minus on as many sparse answer "
            f"rows outside it, matched per layer and row kind (where a layer has fewer such rows than the circuit, "
            f"as many circuit rows as it has, drawn at random; {cost['draw'].nunique()} draws), and the same matched per layer "
            "and answer position (the finer control: other heads' rows at the same position), accuracy points; t interval "
            "over seeds, t-test against 0 (two-sided, in the Holm family; one-sided: the circuit costs more):", "",
            "| arm | quantity | mean [95%] | p | p (circuit > matched) | Holm | per seed |",
            "|---|---|---|---|---|---|---|"]
    for r in within.itertuples():
        out.append(f"| {r.arm} | {r.quantity} | {_ci(r.mean, r.ci_lo, r.ci_hi)} | {_pv(r.p_value)} | "
                   f"{_pv(r.p_greater)} | {_pv(r.p_holm)} | {r.values} |")
    out += _counts_markdown(cost)
    g = col.assign(arm=col["checkpoint"].str.replace(r"-s\d$", "", regex=True))
    g = g.groupby(["arm", "level", "group"])[["share_of_sparse", "share_of_collapses", "collapse_rate"]].mean()
    out += ["", "Per role family (mean over seeds): share of all sparse rows, share of all collapses, collapse rate "
            "of its sparse rows (— where nothing collapsed or it has no sparse row):", "", "| arm | noise | group | share of sparse | share of collapses | collapse rate |",
            "|---|---|---|---|---|---|"]
    for (arm, level, grp), r in g.iterrows():
        out.append(f"| {arm} | {level:.0%} | {grp} | {_pc(r.share_of_sparse)} | {_pc(r.share_of_collapses)} | "
                   f"{_pc(r.collapse_rate)} |")
    return "\n".join(out)


def markdown_from_data(data: Path = DATA) -> str:
    """The section rebuilt from the tables kept in data/seed_tables (what the docs test checks)."""
    return markdown(pd.read_csv(data / "circuit_seed_comparisons.csv"), pd.read_csv(data / "circuit_noise_cost_seeds.csv"),
                    pd.read_csv(data / "circuit_collapse_by_role.csv"), pd.read_csv(data / "circuit_noise_cost.csv"))


def summarise(out: Path, write: bool) -> str:
    per = per_checkpoint(out)
    comp, within = with_family_holm(comparisons(per), within_arm(per))
    col, cost = read(out, "collapse_by_role"), read(out, "noise_cost")
    text = markdown(comp, within, col, cost)
    if write:
        DATA.mkdir(parents=True, exist_ok=True)
        per.to_csv(DATA / "circuit_seed_values.csv", index=False)
        comp.to_csv(DATA / "circuit_seed_comparisons.csv", index=False)
        within.to_csv(DATA / "circuit_noise_cost_seeds.csv", index=False)
        col.to_csv(DATA / "circuit_collapse_by_role.csv", index=False)
        cost.to_csv(DATA / "circuit_noise_cost.csv", index=False)
        read(out, "verification").to_csv(DATA / "circuit_verification.csv", index=False)
        for key in ("circuit", "roles", "curve", "sparsity"):
            read(out, key).to_csv(DATA / f"circuit_{key}_per_checkpoint.csv", index=False)
        pd.DataFrame([dict(checkpoint=n, account=(out / n / "account.txt").read_text().strip()) for n in CHECKPOINTS
                      if (out / n / "account.txt").exists()]).to_csv(DATA / "circuit_accounts.csv", index=False)
        page = PAGE.read_text(encoding="utf-8")
        if START not in page:
            PAGE.write_text(page.rstrip("\n") + f"\n\n{START}\n{END}\n", encoding="utf-8")
        replace_block("CIRCUIT-TABLES", text, PAGE)
    return text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("run", "noise-cost", "summarise"))
    ap.add_argument("--out", type=Path, default=ROOT / "report-circuits")
    ap.add_argument("--problems", type=int, default=256)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("checkpoints", nargs="*", default=list(CHECKPOINTS))
    a = ap.parse_args(argv)
    if a.what == "summarise":
        print(summarise(a.out, a.write))
        return
    if a.what == "noise-cost":
        for name in a.checkpoints:
            if noise_cost_one(name, a.out / name, a.problems):
                print(name, "noise cost done", flush=True, file=sys.stderr)
        return
    for name in a.checkpoints:
        if (a.out / name / "noise_cost.csv").exists():
            continue
        run_one(name, a.out / name, a.problems)
        print(name, "done", flush=True, file=sys.stderr)


if __name__ == "__main__":
    main()
