"""The seed tables: comparisons of two variants over seeds, at matched ID accuracy, and reproduce's --all-seeds path."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from interp_norm.report import reproduce as R
from interp_norm.geometry import sparsity_summary
from interp_norm.core.model import ModelConfig
from interp_norm.stats.seed_compare import NOISE_CROSS, compare_seeds, matched_id_comparison
from interp_norm.stats.seed_summary import per_checkpoint
from interp_norm.core.task import AdditionTask
from interp_norm.training.train import train
from interp_norm.training.config import TrainConfig

EASY = AdditionTask(train_terms=(2,), interp_terms=(2,), extrap_terms=(3,), n_digits=(1,))
BEFORE, AFTER = "accuracy lost to 1% noise (all rows, before any norm)", "accuracy lost to 1% noise placed after the norm"


def _rows(norm, cal, quantity, values, unit="%"):
    return [dict(checkpoint=f"{norm}{'-cal' if cal != 'none' else ''}-s{s}", attn_norm=norm, calibration=cal, seed=s,
                 quantity=quantity, unit=unit, value=v) for s, v in enumerate(values)]


def test_compare_seeds_per_seed_rows_means_and_exact_p():
    per = pd.DataFrame(
        _rows("pre", "none", "extrapolation accuracy", [70.0, 72.0, 71.0])
        + _rows("qkv", "none", "extrapolation accuracy", [80.0, 84.0, 79.0])
        + _rows("pre", "none", BEFORE, [10.0, 9.0, 11.0], "points")
        + _rows("qkv", "none", BEFORE, [0.0, 0.0, 0.0], "points")
        + _rows("qkv", "none", AFTER, [18.0, 17.0, float("nan")], "points")
        + _rows("pre", "paper", "extrapolation accuracy", [60.0, 61.0]) + _rows("qkv", "paper", "extrapolation accuracy", [65.0])
    )
    summary, values = compare_seeds(per)
    s = summary.set_index(["scaling", "comparison"])
    ex = s.loc[("1/√d_head", "extrapolation accuracy")]
    assert ex["mean_a"] == pytest.approx(71.0) and ex["mean_b"] == pytest.approx(81.0)
    assert ex["diff"] == pytest.approx(-10.0)
    assert ex["p_value"] == pytest.approx(2 / 20) and ex["p_method"] == "exact" and ex["n_splits"] == 20  # C(6, 3)
    assert ex["values_a"] == "s0: 70.0, s1: 72.0, s2: 71.0"
    # Student t over 3 seeds: 71 ± t_{.975, 2}·s/√3 with s = 1 (t_{.975, 2} = 4.302653 from printed tables)
    assert (ex["ci_lo_a"], ex["ci_hi_a"]) == pytest.approx((71.0 - 4.302653 / math.sqrt(3), 71.0 + 4.302653 / math.sqrt(3)),
                                                           abs=1e-5)
    assert ex["diff_lo"] <= -10.0 <= ex["diff_hi"] and ex["diff_hi"] < 0
    # the cross comparison: Pre-Norm before its norm vs QKV-Norm after, with the missing seed left out
    cross = s.loc[("1/√d_head", NOISE_CROSS[0])]
    assert cross["n_a"] == 3 and cross["n_b"] == 2 and cross["n_missing_b"] == 1 and "left out" in cross["note"]
    assert cross["mean_b"] == pytest.approx(17.5) and cross["diff"] == pytest.approx(10.0 - 17.5)
    # C(5, 3) = 10 splits; |diff| >= 7.5 only for the observed split ({9, 10, 11} vs {17, 18}) and none else
    assert cross["p_value"] == pytest.approx(1 / 10)
    assert ("1/√d_head", AFTER) not in s.index  # Pre-Norm has no norm to put noise after
    # one seed in an arm: a p-value, no interval
    cal = s.loc[("Checkpoint calibration", "extrapolation accuracy")]
    assert cal["n_b"] == 1 and math.isnan(cal["ci_lo_b"]) and "no interval" in cal["note"]
    # C(3, 2) = 3 splits: {60, 61}|{65} (|diff| 4.5, observed), {60, 65}|{61} (1.5), {61, 65}|{60} (3.0)
    assert cal["p_value"] == pytest.approx(1 / 3)
    v = values[(values["comparison"] == "extrapolation accuracy") & (values["scaling"] == "1/√d_head")]
    assert list(v["value"]) == [70.0, 72.0, 71.0, 80.0, 84.0, 79.0] and list(v["arm"]) == ["A"] * 3 + ["B"] * 3


def test_matched_id_reads_ood_accuracy_where_id_first_reaches_the_target():
    def curve(name, ids, extraps):
        return [dict(checkpoint=name, step=1000 * (i + 1), eval_id_acc=a, eval_interp_acc=a, eval_extrap_acc=e)
                for i, (a, e) in enumerate(zip(ids, extraps))]

    curves = pd.DataFrame(curve("pre", [0.5, 0.7, 0.9], [0.4, 0.5, 0.6]) + curve("pre-s1", [0.6, 0.8, 0.75], [0.5, 0.7, 0.8])
                          + curve("qkv", [0.5, 0.6, 0.85], [0.5, 0.7, 0.9]) + curve("qkv-s1", [0.55, 0.9, 0.95], [0.6, 0.6, 0.7]))
    ck = pd.DataFrame([dict(checkpoint=n, attn_norm=n.split("-")[0], calibration="none", seed=int(n.endswith("s1")))
                       for n in ("pre", "pre-s1", "qkv", "qkv-s1")])
    summary, values = matched_id_comparison(curves, ck, n_points=3)
    # grid: from the highest first ID (0.6, pre-s1) to the lowest best ID (0.8, pre-s1): 60, 70, 80%
    targets = sorted(summary["id_target"].dropna().unique())
    assert targets == pytest.approx([60.0, 70.0, 80.0])
    v = values[(values["split"] == "extrap") & (values["at"] == "matched ID")].set_index(["checkpoint", "id_target"])["value"]
    assert v[("pre", 70.0)] == pytest.approx(50.0)  # reached exactly at step 2000
    assert v[("pre", 80.0)] == pytest.approx(55.0)  # halfway between 0.7 and 0.9
    assert v[("pre-s1", 60.0)] == pytest.approx(50.0)  # its first evaluation
    assert v[("pre-s1", 70.0)] == pytest.approx(60.0)  # halfway between 0.6 and 0.8
    assert v[("qkv", 70.0)] == pytest.approx(70.0 + 0.4 * 20.0)  # 0.6 -> 0.85: (0.7 - 0.6) / 0.25 = 0.4
    assert v[("qkv-s1", 80.0)] == pytest.approx(60.0)  # flat between its evaluations
    row = summary[(summary["at"] == "matched ID") & (summary["split"] == "extrap") & np.isclose(summary["id_target"], 70.0)].iloc[0]
    assert row["mean_a"] == pytest.approx((50.0 + 60.0) / 2) and row["mean_b"] == pytest.approx((78.0 + 60.0) / 2)
    end = summary[(summary["at"] == "end of training") & (summary["split"] == "id")].iloc[0]
    assert end["mean_a"] == pytest.approx((90.0 + 75.0) / 2) and end["mean_b"] == pytest.approx(90.0)


def test_very_sparse_share_and_per_layer_quantities():
    mx = pd.DataFrame(dict(layer=[0, 0, 0, 0, 1, 1], max_attn=[0.999, 0.991, 0.96, 0.5, 0.995, 0.2]))
    s = sparsity_summary(mx)
    layer0, pooled = s[s["layer"] == 0].iloc[0], s[s["layer"].isna()].iloc[0]
    assert layer0["frac_very_sparse"] == pytest.approx(2 / 4) and layer0["frac_sparse"] == pytest.approx(3 / 4)
    assert pooled["frac_very_sparse"] == pytest.approx(3 / 6)
    summ = sparsity_summary(mx).assign(checkpoint="pre")
    ns = pd.DataFrame([dict(checkpoint="pre", layer=0, head=h, spread=v) for h, v in enumerate([0.1, 0.5, 0.3, 0.2])]
                      + [dict(checkpoint="pre", layer=0, head=pd.NA, spread=0.9)])
    ck = pd.DataFrame([dict(checkpoint="pre", label="Pre-Norm", attn_norm="pre", calibration="none", seed=0)])
    got = per_checkpoint(dict(geometry_sparsity_summary=summ, geometry_norm_spread=ns), ck).set_index("quantity")["value"]
    assert got["rows with max attention ≥ 0.99, all layers"] == pytest.approx(50.0)
    assert got["rows with max attention ≥ 0.99, layer 1"] == pytest.approx(50.0)
    assert got["sparse attention rows (max ≥ 95%), layer 0"] == pytest.approx(75.0)
    assert got["norm spread (90% of attended norms within ±), layer 0"] == pytest.approx(100 * np.median([0.1, 0.5, 0.3, 0.2]))


@pytest.fixture(scope="module")
def two_seeds(tmp_path_factory):
    """Pre-Norm and QKV-Norm tiny models, seeds 0 and 1, with ID / interp / extrap evaluated every 4 steps."""
    cfg = TrainConfig(lr=3e-3, batch_size=16, steps_per_epoch=6, max_steps=12, log_every=4, eval_every=4,
                      eval_size=16, final_eval_size=16, checkpoint_every=12, grad_clip=1.0, seed=3)
    root = tmp_path_factory.mktemp("seeds")
    out = []
    for norm in ("pre", "qkv"):
        for seed in (0, 1):
            name = norm if seed == 0 else f"{norm}-s{seed}"
            train(ModelConfig.preset("tiny", attn_norm=norm, seed=seed), EASY, cfg, root / name, progress=False)
            out.append(str(root / name))
    return out


def test_all_seeds_path_writes_the_seed_tables_and_matches_the_full_analyses(two_seeds, tmp_path):
    settings = R.Settings.quick(analyses=("evaluate", "noise", "collapse", "forward_collapse", "geometry"))
    seeds0 = [s for s in two_seeds if not s.endswith("-s1")]
    report = R.reproduce(tmp_path / "r", two_seeds, settings=settings, analyse=[p.rsplit("/", 1)[1] for p in seeds0],
                         progress=False, all_seeds=True)
    ck = report.checkpoints.set_index("checkpoint")
    assert ck.loc["pre-s1", "scope"] == "seed tables" and ck.loc["pre", "scope"] == "all analyses"
    for name in ("seed_comparisons", "seed_comparison_values", "seed_matched_id", "seed_matched_id_values"):
        assert (tmp_path / "r" / f"{name}.csv").exists()
    comp = pd.read_csv(tmp_path / "r" / "seed_comparisons.csv").set_index("comparison")
    assert comp.loc["extrapolation accuracy", "n_a"] == 2 and comp.loc["extrapolation accuracy", "n_splits"] == 6
    assert comp.loc[BEFORE, "n_a"] + comp.loc[BEFORE, "n_missing_a"] == 2
    assert "1% loose collapse level, per-layer protocol" in comp.index and NOISE_CROSS[0] in comp.index
    # the seed pass (noise cut to 0 and 1%, all rows) gives what the full analyses give on the same checkpoint
    full = R.run_analyses(two_seeds, settings, analyse="all", progress=False)
    a = report.tables["seed_numbers"].set_index(["checkpoint", "quantity"])["value"]
    b = full.tables["seed_numbers"].set_index(["checkpoint", "quantity"])["value"]
    pd.testing.assert_series_equal(a.sort_index(), b.sort_index())
    noise = report.tables["noise_accuracy"]
    assert set(noise[noise["checkpoint"] == "pre-s1"]["level"]) == {0.0, 0.01}
    matched = report.tables["seed_matched_id"]
    assert set(matched["at"]) >= {"end of training"} and (matched["n_a"] + matched["n_missing_a"] == 2).all()


def test_dot_and_range_figure_draws_every_seed_and_the_interval_of_the_table():
    from interp_norm.report import plots

    per = pd.DataFrame(_rows("pre", "none", "extrapolation accuracy", [70.0, 72.0, 71.0])
                       + _rows("qkv", "none", "extrapolation accuracy", [80.0, 84.0, 79.0]))
    summary, values = compare_seeds(per)
    fig = plots.plot_seed_comparisons(summary, values)
    dots = [t for t in fig.data if t.marker.symbol != "line-ew-open"]
    assert sorted(y for t in dots for y in t.y) == sorted([70.0, 72.0, 71.0, 80.0, 84.0, 79.0])  # one dot per seed
    assert len({t.marker.color for t in dots}) == 2  # one colour per variant
    assert {t.marker.symbol for t in dots} == {"circle", "square", "diamond"}  # one shape per seed
    means = [t for t in fig.data if t.marker.symbol == "line-ew-open"]
    r = summary.iloc[0]
    assert [m.y[0] for m in means] == pytest.approx([r["mean_a"], r["mean_b"]])
    assert means[0].y[0] + means[0].error_y.array[0] == pytest.approx(r["ci_hi_a"])
    assert means[0].y[0] - means[0].error_y.arrayminus[0] == pytest.approx(r["ci_lo_a"])
    assert "p = 0.1 (exact, 20)" in fig.layout.annotations[0].text and "p = 0.1" in means[0].hovertemplate


def test_a_censored_seed_is_drawn_open_at_the_largest_level_tested():
    from interp_norm.report import plots

    q = "1% loose collapse level, per-layer protocol"
    per = pd.DataFrame(_rows("pre", "none", q, [20.0, 30.0, 25.0], "% noise")
                       + _rows("qkv", "none", q, [40.0, float("nan"), float("nan")], "% noise"))
    per["censored_above"] = [float("nan")] * 4 + [50.0, 50.0]
    summary, values = compare_seeds(per)
    fig = plots.plot_seed_comparisons(summary, values)
    open_dots = [t for t in fig.data if str(t.marker.symbol).endswith("-open") and t.marker.symbol != "line-ew-open"]
    assert [t.y[0] for t in open_dots] == [50.0, 50.0] and all("never reached" in t.hovertemplate for t in open_dots)


def test_cli_reproduce_takes_all_seeds():
    from interp_norm import cli

    assert cli.build_parser().parse_args(["reproduce", "--all-seeds"]).all_seeds is True
    assert cli.build_parser().parse_args(["reproduce"]).all_seeds is False


def test_findings_tables_script_renders_every_seed_and_the_statistics(tmp_path):
    from _scripts import load_script

    F = load_script("findings_tables")
    per = pd.DataFrame(_rows("pre", "none", "extrapolation accuracy", [70.0, 72.0, 71.0])
                       + _rows("qkv", "none", "extrapolation accuracy", [80.0, 84.0, 79.0]))
    summary, _ = compare_seeds(per)
    summary.to_csv(tmp_path / "seed_comparisons.csv", index=False)
    md = F.markdown(tmp_path)
    row = next(line for line in md.splitlines() if line.startswith("| extrapolation accuracy"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "s0: 70.0, s1: 72.0, s2: 71.0" and cells[4] == "s0: 80.0, s1: 84.0, s2: 79.0"
    assert cells[3].startswith("71.0 [") and cells[5].startswith("81.0 [") and cells[6].startswith("-10.0 [")
    assert cells[7] == "0.1"  # 2 / C(6, 3)


def test_all_seeds_keeps_the_heavy_analyses_on_seeds_0_and_1_and_gives_the_rest_the_seed_pass():
    from types import SimpleNamespace

    def info(attn, seed, cal="none"):
        return SimpleNamespace(model_cfg=SimpleNamespace(attn_norm=attn, seed=seed, calibration=cal))

    models = {n: (None, info(a, s, c)) for n, a, s, c in (
        ("pre", "pre", 0, "none"), ("pre-s1", "pre", 1, "none"), ("pre-s2", "pre", 2, "none"),
        ("qkv-s5", "qkv", 5, "none"), ("pre-cal", "pre", 0, "paper"), ("qk", "qk", 0, "none"))}
    heavy, seed_pass = R.choose_scopes(models, all_seeds=True)
    assert heavy == ["pre", "pre-s1", "qk"] and sorted(seed_pass) == ["pre-cal", "pre-s2", "qkv-s5"]
    assert R.choose_scopes(models)[1] == []  # without all_seeds: no seed pass
    assert R.choose_scopes(models, analyse="all", all_seeds=True) == (list(models), [])
    heavy, seed_pass = R.choose_scopes(models, explicit=True, analyse=["pre"], all_seeds=True)
    assert heavy == ["pre"] and len(seed_pass) == 5


# ----------------------------------------------------------------------------- right-censored collapse levels

def _rank_p_by_hand(a, b):
    """Two-sided exact permutation p of the difference of mean ranks, every split written out;
    ``None`` stands for a censored seed, tied above every reached value."""
    pooled = [(x if x is not None else math.inf) for x in [*a, *b]]
    order = sorted(pooled)
    rank = {v: (order.index(v) + 1 + len(order) - order[::-1].index(v)) / 2 for v in set(pooled)}
    r = [rank[v] for v in pooled]
    import itertools
    n = len(a)
    obs = abs(sum(r[:n]) / n - sum(r[n:]) / (len(r) - n))
    hits = total = 0
    for idx in itertools.combinations(range(len(r)), n):
        ra = [r[i] for i in idx]
        rb = [r[i] for i in range(len(r)) if i not in idx]
        total += 1
        hits += abs(sum(ra) / n - sum(rb) / len(rb)) >= obs - 1e-9
    return hits / total


def test_never_reached_collapse_levels_are_censored_not_dropped():
    from interp_norm.stats.seed_compare import compare_arms

    nan = float("nan")
    a = [10.0, 20.0, 30.0, 25.0]
    b = [40.0, nan, nan, 45.0]
    st = compare_arms(a, b, censored_a=[nan] * 4, censored_b=[nan, 50.0, 50.0, nan])
    assert (st["n_a"], st["n_b"], st["n_censored_b"], st["n_missing_b"]) == (4, 4, 2, 0)
    assert st["mean_b"] == pytest.approx((40 + 50 + 50 + 45) / 4)  # a lower bound: censored seeds at the bound
    assert math.isnan(st["diff_lo"]) and "ranks" in st["p_method"]
    assert st["p_value"] == pytest.approx(_rank_p_by_hand(a, [40.0, None, None, 45.0]))
    assert st["p_value"] == pytest.approx(2 / 70)  # every A below every B: the two extreme splits of C(8, 4)
    # dropping the two censored seeds would have tested 4 vs 2 seeds instead
    dropped = compare_arms(a, b)
    assert (dropped["n_b"], dropped["n_missing_b"]) == (2, 2)


def test_censored_ties_and_a_reached_value_above_some_censored_bound_rank_correctly():
    from interp_norm.stats.seed_compare import compare_arms

    nan = float("nan")
    a = [12.0, 48.0, nan]  # one A seed censored too
    b = [nan, 30.0, nan]
    st = compare_arms(a, b, censored_a=[nan, nan, 50.0], censored_b=[50.0, nan, 50.0])
    assert st["p_value"] == pytest.approx(_rank_p_by_hand([12.0, 48.0, None], [None, 30.0, None]))
    assert (st["n_censored_a"], st["n_censored_b"]) == (1, 2)


def test_per_checkpoint_marks_a_never_reached_level_with_the_largest_level_tested():
    ck = pd.DataFrame([dict(checkpoint=n, label=lab, attn_norm=a, calibration="none", seed=0)
                       for n, lab, a in (("p", "Pre-Norm", "pre"), ("q", "QKV-Norm", "qkv"))])
    nan = float("nan")
    thr = pd.DataFrame([dict(variant=v, layer="all", definition="loose", level_measured=m)
                        for v, m in (("Pre-Norm", 0.2), ("QKV-Norm, noise after norm", nan))])
    sweep = pd.DataFrame([dict(checkpoint=c, level=lv, n_rows=3) for c in ("p", "q") for lv in (0.01, 0.2, 0.4)])
    rows = per_checkpoint(dict(collapse_thresholds=thr, collapse=sweep), ck)
    q = "1% loose collapse level, per-layer protocol"
    got = rows[rows["quantity"] == q].set_index("checkpoint")
    assert got.loc["p", "value"] == pytest.approx(20.0) and math.isnan(got.loc["p", "censored_above"])
    assert math.isnan(got.loc["q", "value"]) and got.loc["q", "censored_above"] == pytest.approx(40.0)
    # without a single sparse row there is no level to censor: missing
    sweep.loc[sweep["checkpoint"] == "q", "n_rows"] = 0
    got = per_checkpoint(dict(collapse_thresholds=thr, collapse=sweep), ck)
    assert got[(got["quantity"] == q) & (got["checkpoint"] == "q")]["censored_above"].isna().all()


def test_per_checkpoint_reads_the_controls_per_seed():
    from interp_norm.stats.seed_summary import CONTROLS

    ck = pd.DataFrame([dict(checkpoint="p", label="Pre-Norm", attn_norm="pre", calibration="none", seed=0)])
    modes = ("q", "k", "v", "qkv", "random", "shared")
    dec = pd.DataFrame([dict(checkpoint="p", mode=m, level=lv, placement="before_norm", drop=10 * i + lv)
                        for i, m in enumerate(modes) for lv in (0.01, 0.1)]
                       + [dict(checkpoint="other", mode="q", level=0.01, placement="before_norm", drop=99.0)])
    con = pd.DataFrame([dict(checkpoint="p", group=g, drop=d) for g, d in (("collapsed", 20.0), ("none", 5.0),
                                                                           ("difference", 15.0))])
    rows = per_checkpoint(dict(noise_decomposition=dec, collapse_consequence=con), ck).set_index("quantity")["value"]
    expected = [10 * i + 0.01 for i in range(6)] + [20.0, 5.0, 15.0]  # the 1% rows of this checkpoint, in order
    assert [rows[q] for q, _ in CONTROLS] == pytest.approx(expected)


def test_qkv_decomposition_noise_before_its_norms_is_noted_as_zero_by_construction_except_random():
    from interp_norm.stats.seed_summary import CONTROLS

    per = pd.DataFrame(_rows("pre", "none", CONTROLS[0][0], [1.0, 2.0, 3.0], "points")
                       + _rows("qkv", "none", CONTROLS[0][0], [0.0, 0.0, 0.0], "points")
                       + _rows("pre", "none", CONTROLS[4][0], [1.0, 2.0, 3.0], "points")
                       + _rows("qkv", "none", CONTROLS[4][0], [3.0, 3.0, 4.0], "points"))
    s = compare_seeds(per)[0].set_index("comparison")["note"]
    assert "by construction" in s[CONTROLS[0][0]] and "by construction" not in s[CONTROLS[4][0]]
