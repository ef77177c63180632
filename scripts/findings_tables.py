"""The seed tables of a report as markdown, for docs/findings-tables.md.

    .venv/bin/python scripts/findings_tables.py report-seeds            # print the markdown
    .venv/bin/python scripts/findings_tables.py report-seeds --write     # rewrite docs/findings-tables.md
                                                                         # between its markers (prose kept) and
                                                                         # copy the tables it reads to data/seed_tables/
                                                                         # (seed_numbers.csv as seed_values.csv)
    .venv/bin/python scripts/findings_tables.py data/seed_tables         # the same from that copy (what the test checks)

The report comes from ``interp-norm reproduce --all-seeds --out report-seeds`` (every seed) or
``make reproduce`` (seeds 0 and 1). Every number is read from its ``seed_comparisons.csv`` and
``seed_matched_id.csv`` (nothing typed by hand): per seed, the mean and the Student-t 95% interval
per arm, the difference A − B with its Welch-t interval, the two-sided exact permutation p-value, and
that p Holm-adjusted over every p on the page (the page's family; rows whose note says an arm is 0 by
construction are identities and stay out of it). The unrounded per-seed values behind every row are
``data/seed_tables/seed_values.csv`` (the report's ``seed_numbers.csv``; :mod:`interp_norm.stats.verdicts` decides
the verdicts from it).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pandas as pd
from _docs import replace_block

from interp_norm.stats.inference import holm
from interp_norm.stats.shipped import seed_tables_dir

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "findings-tables.md"
DATA = seed_tables_dir()
#: The report files the page is built from, kept in data/seed_tables/ so that a test can rebuild the page
#: (and the dashboard can show the 6-seed tables: interp_norm.stats.shipped).
SOURCES = ("seed_comparisons.csv", "seed_matched_id.csv", "seed_matched_id_values.csv", "run.json", "checkpoints.csv")
#: The report's unrounded per-seed values (one row per checkpoint and measure), shipped under this name.
VALUES = ("seed_numbers.csv", "seed_values.csv")
#: A seed-table note that marks a comparison against an arm fixed by construction (an identity).
IDENTITY_NOTE = "by construction"
START, END = "<!-- FINDINGS-TABLES:start -->", "<!-- FINDINGS-TABLES:end -->"


def _num(x: float, digits: int = 1) -> str:
    """``x`` rounded, without the sign of a negative value that rounds to zero ("-0.0")."""
    s = f"{x:.{digits}f}"
    return s[1:] if s.startswith("-") and float(s) == 0 else s


def _ci(m: float, lo: float, hi: float, digits: int = 1) -> str:
    if pd.isna(m):
        return "—"
    return f"{_num(m, digits)} [{_num(lo, digits)}, {_num(hi, digits)}]" if not pd.isna(lo) else _num(m, digits)


def _p(r: pd.Series) -> str:
    if pd.isna(r["p_value"]):
        return "—"
    method = str(r["p_method"])
    return f"{r['p_value']:.2g}" + ("" if method.startswith("exact") else f" (MC {int(r['n_splits'])})")


def _holm(r: pd.Series) -> str:
    return "identity" if pd.isna(r["p_holm"]) and pd.notna(r["p_value"]) else "—" if pd.isna(r["p_holm"]) else f"{r['p_holm']:.2g}"


def with_holm(comp: pd.DataFrame, matched: pd.DataFrame | None) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """Both tables with ``p_holm``: Holm over every p-value on the page, identities left out."""
    comp = comp.copy()
    ident = comp["note"].fillna("").str.contains(IDENTITY_NOTE)
    p = [comp["p_value"].where(~ident)] + ([matched["p_value"]] if matched is not None and len(matched) else [])
    adjusted = holm(pd.concat(p, ignore_index=True).to_numpy(float))
    comp["p_holm"] = adjusted[:len(comp)]
    if matched is not None and len(matched):
        matched = matched.copy()
        matched["p_holm"] = adjusted[len(comp):]
    return comp, matched


def _seeds(text: object) -> str:
    return "—" if pd.isna(text) or not str(text) else str(text)


def comparison_table(comp: pd.DataFrame, scaling: str) -> str:
    s = comp[comp["scaling"] == scaling]
    a, b = s["arm_a"].iloc[0], s["arm_b"].iloc[0]
    lines = [f"| comparison | unit | {a}: per seed | {a}: mean [95% CI] | {b}: per seed | {b}: mean [95% CI] | "
             "A − B [95% CI] | p | Holm p | note |", "|---|---|---|---|---|---|---|---|---|---|"]
    for _, r in s.iterrows():
        note = r["note"] if isinstance(r.get("note"), str) else ""
        lines.append(f"| {r['comparison']} | {r['unit']} | {_seeds(r['values_a'])} | "
                     f"{_ci(r['mean_a'], r['ci_lo_a'], r['ci_hi_a'])} | {_seeds(r['values_b'])} | "
                     f"{_ci(r['mean_b'], r['ci_lo_b'], r['ci_hi_b'])} | {_ci(r['diff'], r['diff_lo'], r['diff_hi'])} | "
                     f"{_p(r)} | {_holm(r)} | {note} |")
    return "\n".join(lines)


def matched_table(m: pd.DataFrame, scaling: str) -> str:
    s = m[m["scaling"] == scaling]
    a, b = s["arm_a"].iloc[0], s["arm_b"].iloc[0]
    lines = [f"| at | ID accuracy (%) | split | {a}: per seed | {a}: mean [95% CI] | {b}: per seed | "
             f"{b}: mean [95% CI] | A − B [95% CI] | p | Holm p |", "|---|---|---|---|---|---|---|---|---|---|"]
    for _, r in s.iterrows():
        at = "—" if pd.isna(r["id_target"]) else f"{r['id_target']:.1f}"
        lines.append(f"| {r['at']} | {at} | {r['split']} | {_seeds(r['values_a'])} | "
                     f"{_ci(r['mean_a'], r['ci_lo_a'], r['ci_hi_a'])} | {_seeds(r['values_b'])} | "
                     f"{_ci(r['mean_b'], r['ci_lo_b'], r['ci_hi_b'])} | {_ci(r['diff'], r['diff_lo'], r['diff_hi'])} | "
                     f"{_p(r)} | {_holm(r)} |")
    return "\n".join(lines)


def markdown(report: Path) -> str:
    comp = pd.read_csv(report / "seed_comparisons.csv")
    matched = pd.read_csv(report / "seed_matched_id.csv") if (report / "seed_matched_id.csv").exists() else None
    run = json.loads((report / "run.json").read_text()) if (report / "run.json").exists() else {}
    ck = pd.read_csv(report / "checkpoints.csv") if (report / "checkpoints.csv").exists() else None
    comp, matched = with_holm(comp, matched)
    n_family = int(comp["p_holm"].notna().sum() + (matched["p_holm"].notna().sum() if matched is not None else 0))
    n_ident = int((comp["p_holm"].isna() & comp["p_value"].notna()).sum())
    parts = ["Generated by `scripts/findings_tables.py` from a report's `seed_comparisons.csv` and "
             f"`seed_matched_id.csv`, copied to `data/seed_tables/` (run: {run.get('seconds', '?')} s, "
             f"{'every seed (--all-seeds)' if run.get('all_seeds') else 'seeds 0 and 1'}); the unrounded per-seed "
             "values are `data/seed_tables/seed_values.csv`. Per seed (s0, s1, ...) rounded to one decimal, the mean with its "
             "Student-t 95% interval over seeds, the difference A − B with its Welch-t interval, the two-sided exact "
             f"permutation p-value of the difference of means (every split of the seeds), and that p Holm-adjusted over "
             f"the {n_family} p-values on this page ({len(comp)} comparisons in tables S, {len(matched) if matched is not None else 0} "
             f"in tables M; {n_ident} comparisons against an arm that is 0 by construction are identities, outside the "
             "family). These tables describe; the verdicts, with their own tests and family, are in the README. "
             "'> 50' for a seed: a collapse level not reached within the tested noise levels (right-censored: kept "
             "at the largest level tested, the mean is then a lower bound and p comes from ranks; see the note); "
             "'—': no value."]
    if ck is not None and "scope" in ck.columns:
        by = ck.groupby("scope")["checkpoint"].apply(lambda c: ", ".join(map(str, c)))
        parts.append("Checkpoints: " + "; ".join(f"{scope}: {names}" for scope, names in by.items()) + ".")
    for i, scaling in enumerate(dict.fromkeys(comp["scaling"]), start=1):
        s = comp[comp["scaling"] == scaling]
        parts += [f"\n### Table S{i}: {s['arm_a'].iloc[0]} vs {s['arm_b'].iloc[0]} ({scaling})\n",
                  comparison_table(comp, scaling)]
    if matched is not None and len(matched):
        for i, scaling in enumerate(dict.fromkeys(matched["scaling"]), start=1):
            s = matched[matched["scaling"] == scaling]
            parts += [f"\n### Table M{i}: out-of-distribution accuracy at matched ID accuracy, "
                      f"{s['arm_a'].iloc[0]} vs {s['arm_b'].iloc[0]} ({scaling})\n",
                      "From the training curves (ID / interp / extrap per-token accuracy every 1 000 steps on 512 "
                      "problems per split): each run's OOD accuracy where its ID accuracy first reaches the value "
                      "(linear interpolation between evaluations); 'end of training': the last evaluation.\n",
                      matched_table(matched, scaling)]
    return "\n".join(parts)


def _relative_paths(path: Path) -> None:
    """The copied checkpoints.csv names each checkpoint folder relative to the repository (the run's own
    absolute paths mean nothing on another machine)."""
    if not path.exists():
        return
    ck = pd.read_csv(path)
    if "path" in ck.columns:
        ck["path"] = [p if not isinstance(p, str) or "data/checkpoints/" not in p
                      else "data/checkpoints/" + p.split("data/checkpoints/", 1)[1] for p in ck["path"]]
        ck.to_csv(path, index=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("report", nargs="?", default=str(ROOT / "report"))
    ap.add_argument("--write", action="store_true",
                    help=f"rewrite {PAGE.relative_to(ROOT)} between its markers (created with the markers if missing)")
    args = ap.parse_args()
    md = markdown(Path(args.report))
    print(md)
    if args.write:
        if not PAGE.exists():
            PAGE.write_text("# Findings: the tables\n\nVariant A vs variant B over seeds.\n\n"
                            f"{START}\n{END}\n")
        replace_block("FINDINGS-TABLES", md, page=PAGE)
        DATA.mkdir(parents=True, exist_ok=True)
        for name, target in [(n, n) for n in SOURCES] + [VALUES]:
            if (Path(args.report) / name).exists() and (Path(args.report) / name).resolve() != (DATA / target).resolve():
                shutil.copyfile(Path(args.report) / name, DATA / target)
        _relative_paths(DATA / "checkpoints.csv")
        print(f"copied {', '.join(SOURCES)} and {VALUES[0]} (as {VALUES[1]}) to {DATA}; now run scripts/verdicts.py --write")


if __name__ == "__main__":
    main()
