"""The one sentence that opens each dashboard section: what to look at, read off the tables shown.

Each ``lead_<anchor>(tables)`` returns a sentence that names the panel to look at and the numbers
that make it worth a look, computed from the same tables the panels draw (so the sentence is true
of the page it opens), or ``""`` when its tables are missing. :func:`lead` picks by anchor.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import pandas as pd

__all__ = ["lead", "LEADS"]


def _pct(x: float) -> str:
    return f"{100 * float(x):.3g}%"


def _names(pairs: list[tuple[str, float]], fmt: Callable[[float], str] = _pct) -> str:
    """``"A 12%, B 30% and C 41%"``."""
    parts = [f"{n} {fmt(v)}" for n, v in pairs]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _key(label: object) -> str:
    """A series' variant with its noise placement: seeds and recipes of one variant share it, noise placed
    after the norm does not (``"QKV-Norm, noise after norm"``)."""
    from interp_norm.report.plots._style import AFTER_NORM, base_variant

    s = str(label)
    return (base_variant(s) or s) + (f", {AFTER_NORM}" if AFTER_NORM in s else "")


def _by_variant(df: pd.DataFrame, col: str) -> pd.Series:
    """Mean of ``col`` per variant and noise placement (seeds and recipes pooled, :func:`_key`), first-seen order."""
    return df.groupby(df["variant"].map(_key), sort=False)[col].mean()


def lead_models(T: dict) -> str:
    card = T.get("model_card")
    if card is None or "extrap_acc" not in card.columns or not card["extrap_acc"].notna().any():
        return ""
    from interp_norm.report.plots._style import variant_label

    labels = [variant_label(c, a) for c, a in zip(card["checkpoint"], card.get("attn_norm", card["checkpoint"]))]
    acc = pd.Series(card["extrap_acc"].to_numpy(), index=labels).dropna()
    return (f"Look at the extrap split of 'Accuracy per split': per-token accuracy there runs from "
            f"{_pct(acc.min())} ({acc.idxmin()}) to {_pct(acc.max())} ({acc.idxmax()}), against "
            f"{_pct(card[['id_acc']].min().iloc[0])}–{_pct(card[['id_acc']].max().iloc[0])} in distribution."
            if "id_acc" in card.columns else
            f"Look at the extrap split: per-token accuracy runs from {_pct(acc.min())} to {_pct(acc.max())}.")


def lead_circuits(T: dict) -> str:
    pt, faith = T.get("circuits_patching"), T.get("circuits_faithfulness")
    out = []
    if pt is not None and len(pt) and "normalized" in pt.columns:
        resid = pt[(pt["activation"] == "resid_pre") & pt["normalized"].notna()]
        if len(resid):
            top = resid.loc[resid["normalized"].idxmax()]
            pos = "" if pd.isna(top.get("pos")) else f" at position {int(top['pos'])}"
            out.append(f"Look at the bright cells of 'Patching the residual stream': the largest single restore is "
                       f"{_pct(top['normalized'])} of the clean answer ({top['variant']}, layer {int(top['layer'])}{pos})")
    if faith is not None and len(faith) and "faithfulness" in faith.columns:
        f = faith[faith["ablation"] == "resample"] if "ablation" in faith.columns else faith
        if len(f):
            out.append(f"with resample ablation the pruned circuits keep {_pct(f['faithfulness'].min())}–"
                       f"{_pct(f['faithfulness'].max())} of the metric")
    return ("; ".join(out) + ".") if out else ""


def lead_noise(T: dict) -> str:
    df = T.get("noise_accuracy")
    if df is None or not len(df):
        return ""
    d = df[df["noised"] == "all"] if "noised" in df.columns and (df["noised"] == "all").any() else df
    top = float(d["level"].max())
    clean, noisy = d[d["level"] == 0], d[d["level"] == top]
    if not len(clean) or not len(noisy) or top <= 0:
        return ""
    drop = (_by_variant(clean, "accuracy") - _by_variant(noisy, "accuracy")).dropna().sort_values()
    return (f"Look at the left panel's right edge: with every row noised at {_pct(top)}, per-token accuracy falls by "
            + _names([(n, v) for n, v in drop.items()], lambda v: f"{100 * v:.1f} points")
            + " (means over seeds).")


def lead_collapse(T: dict) -> str:
    th = T.get("collapse_thresholds")
    if th is None or not len(th):
        return ""
    v = th[(th["layer"].astype(str) == "all") & (th["definition"] == "loose")]
    if not len(v):
        return ""
    reached = v[v["level_measured"].notna()]
    never = sorted(set(v.loc[v["level_measured"].isna(), "variant"].astype(str)))
    text = "Look at the pooled ('layer all') column of '1% collapse levels': "
    if not len(reached):
        return text + "no series reaches 1% (loose) collapse within the tested noise levels."
    lo = reached.loc[reached["level_measured"].idxmin()]
    hi = reached.loc[reached["level_measured"].idxmax()]
    text += (f"1% of sparse rows collapse (loose) from a noise level of {_pct(lo['level_measured'])} "
             f"({lo['variant']})")
    if len(reached) > 1:
        text += f" up to {_pct(hi['level_measured'])} ({hi['variant']})"
    if never:
        text += f"; {len(never)} of {len(v)} series never reach it within the tested levels"
    return text + "."


def lead_geometry(T: dict) -> str:
    sc = T.get("geometry_sphere_scores")
    if sc is None or not len(sc) or "score" not in sc.columns:
        return ""
    s = _by_variant(sc, "score").sort_values()
    return ("Look at the right panel of 'Orthogonal spheres' (1 = components on orthogonal spheres of constant "
            "norm, as Pre-Norm's Theorem 2 asks): the score averaged over layers is " + _names(
                list(s.items()), lambda v: f"{v:.2f}") + ".")


def lead_seeds(T: dict) -> str:
    sp = T.get("seed_spread")
    if sp is None or not len(sp) or "half_range" not in sp.columns or not sp["half_range"].notna().any():
        return ""
    r = sp.loc[sp["half_range"].idxmax()]
    unit = r["unit"] if "unit" in sp.columns and isinstance(r["unit"], str) else ""
    unit = unit if unit.startswith("%") else f" {unit}" if unit else ""
    return (f"Look at the width of each range: the widest is {r['quantity']} of {r['attn_norm']} "
            f"(± {r['half_range']:.3g}{unit} over {int(r['n_seeds'])} seeds); a difference between variants "
            "narrower than its range is not a finding.")


def lead_controls(T: dict) -> str:
    tp = T.get("temperature")
    if tp is None or not len(tp):
        return ""
    v = tp[tp["layer"].astype(str) == "all"]
    if not len(v) or v["c"].nunique() < 2:
        return ""
    lo, hi = float(v["c"].min()), float(v["c"].max())
    a, b = _by_variant(v[v["c"] == lo], "frac_sparse"), _by_variant(v[v["c"] == hi], "frac_sparse")
    pairs = [f"{n} {_pct(a[n])} → {_pct(b[n])}" for n in a.index if n in b.index and math.isfinite(b[n])]
    return (f"Look at 'Attention temperature': multiplying the scores by c from {lo:g} to {hi:g} moves the share of "
            "sparse rows " + "; ".join(pairs) + ".") if pairs else ""


def lead_real_models(T: dict) -> str:
    real = T.get("real_layers")
    if real is None or not len(real) or "frac_sparse" not in real.columns:
        return ""
    from interp_norm.report.dashboard.real_models import display_name

    s = real.assign(model=real["model"].map(display_name)).groupby("model", sort=False)["frac_sparse"].max().dropna()
    if not len(s):
        return ""
    return ("Look at the dashed lines of the first figure: the largest share of sparse rows in any layer is "
            + _names(list(s.items())) + ".")


def lead_attention(T: dict) -> str:
    pat = T.get("attention_patterns")
    if pat is None or not len(pat):
        return ""
    rows = pat.groupby(["model", "problem", "layer", "head", "query"], sort=False)["weight"].max()
    sparse = rows[rows >= 0.95]
    text = (f"Look for rows with one dark cell: {_pct(len(sparse) / len(rows))} of the {len(rows):,} query rows shown put "
            "at least 95% of their attention on one token")
    if len(sparse):
        top = sparse.groupby(level=["model", "layer", "head"], sort=False).size().idxmax()
        text += f", most often in {top[0]}, layer {top[1]} head {top[2]}"
    return text + "."


def lead_seed_comparisons(T: dict) -> str:
    comp = T.get("seed_comparisons")
    if comp is None or not len(comp) or "diff_lo" not in comp.columns:
        return ""
    c = comp[comp["diff_lo"].notna()]
    if not len(c):
        return "Look at the single dots: no difference here has a 95% interval (an arm needs two seeds for one)."
    apart = int(((c["diff_lo"] > 0) | (c["diff_hi"] < 0)).sum())
    return (f"Look at whether the two arms' intervals overlap: in {apart} of the {len(c)} differences with an interval, "
            "the 95% interval excludes 0 (uncorrected; the verdicts apply Holm's adjustment).")


def lead_controls_23(T: dict) -> str:
    th = T.get("collapse_thresholds")
    if th is None or "effective_heads" not in th.columns:
        return ""
    v = th[(th["layer"].astype(str) == "all") & (th["definition"] == "loose")]
    v = v.loc[v["level_measured"].notna(), "effective_heads"].dropna() if "level_measured" in v.columns else v["effective_heads"].dropna()
    if not len(v):  # no pooled level was reached: there is no level to rest on anything
        return ""
    return (f"Look at effective_heads: the pooled 1% collapse levels rest on {v.min():.1f} to {v.max():.1f} heads' worth "
            "of sparse rows (1 = one head carries them all).")


def lead_addition_circuit(T: dict) -> str:
    ver = T.get("addition_verification")
    if ver is None or not len(ver) or "accuracy_kept" not in ver.columns:
        return ""
    v = ver[ver["ablation"] == "resample"] if "ablation" in ver.columns and (ver["ablation"] == "resample").any() else ver
    return (f"Look at 'Circuit size and verification': the circuits keep {_pct(v['accuracy_kept'].min())}–"
            f"{_pct(v['accuracy_kept'].max())} of per-token accuracy with {_pct(v['share_of_cells'].min())}–"
            f"{_pct(v['share_of_cells'].max())} of the cells.")


#: Lead sentence builder per section anchor.
LEADS: dict[str, Callable[[dict], str]] = {
    "models": lead_models, "circuits": lead_circuits, "noise": lead_noise, "collapse": lead_collapse,
    "geometry": lead_geometry, "seeds": lead_seeds, "controls": lead_controls, "real-models": lead_real_models,
    "attention": lead_attention, "seed-comparisons": lead_seed_comparisons, "controls-23": lead_controls_23,
    "addition-circuit": lead_addition_circuit,
}


def lead(anchor: str, tables: dict) -> str:
    """The opening sentence of section ``anchor`` ("" when there is none or its tables are missing)."""
    build: Optional[Callable[[dict], str]] = LEADS.get(anchor)
    return build(tables) if build is not None else ""
