"""reproduce's choices: which checkpoints get the heavy analyses, and workers that change nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest

from interp_norm import cli
from interp_norm.report import worker
from interp_norm.report import reproduce as R
from interp_norm.errors import ConfigError
from interp_norm.core.model import ModelConfig
from interp_norm.core.task import AdditionTask
from interp_norm.training.train import train
from interp_norm.training.config import TrainConfig

EASY = AdditionTask(train_terms=(2,), interp_terms=(2,), extrap_terms=(3,), n_digits=(1,))


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    """A Pre-Norm and a QKV-Norm tiny model, 12 steps each (stand-ins for the shipped ones)."""
    cfg = TrainConfig(lr=3e-3, batch_size=16, steps_per_epoch=6, max_steps=12, log_every=4, eval_every=12,
                      eval_size=16, final_eval_size=16, checkpoint_every=12, grad_clip=1.0, seed=3)
    root = tmp_path_factory.mktemp("ckpts")
    for norm in ("pre", "qkv"):
        train(ModelConfig.preset("tiny", attn_norm=norm), EASY, cfg, root / norm, progress=False)
    return {norm: root / norm for norm in ("pre", "qkv")}


def _info(attn: str, seed: int, calibration: str = "none") -> SimpleNamespace:
    return SimpleNamespace(model_cfg=SimpleNamespace(attn_norm=attn, seed=seed, calibration=calibration))


def test_default_analysed_takes_every_seed_at_the_reference_scaling():
    models = {"qkv-s1": (None, _info("qkv", 1)), "pre-s1": (None, _info("pre", 1)), "pre": (None, _info("pre", 0)),
              "mine": (None, _info("qk", 3)), "pre-cal": (None, _info("pre", 0, "paper"))}
    assert R.default_analysed(models) == ["pre", "pre-s1", "qkv-s1", "mine"]
    only_calibrated = {"b": (None, _info("qkv", 0, "paper")), "a": (None, _info("pre", 0, "paper"))}
    assert R.default_analysed(only_calibrated) == ["a", "b"]


def test_cli_offers_exactly_the_analyses_reproduce_runs():
    assert cli.ANALYSES == worker.ANALYSES


def test_workers_do_not_change_any_table(tiny_checkpoints):
    specs = [str(tiny_checkpoints["pre"]), str(tiny_checkpoints["qkv"])]
    settings = R.Settings.quick(analyses=("evaluate", "noise", "collapse", "forward_collapse", "temperature"))
    one = R.run_analyses(specs, settings, progress=False, threads=1, workers=1)
    two = R.run_analyses(specs, settings, progress=False, threads=1, workers=2)
    assert two.workers == 2 and one.workers == 1
    assert set(one.tables) == set(two.tables)
    assert {"noise_accuracy", "collapse", "forward_collapse", "temperature"} <= set(one.tables)
    for key in one.tables:
        pd.testing.assert_frame_equal(one.tables[key], two.tables[key], obj=key)
    noise = one.tables["noise_accuracy"]
    assert "nonsparse_matched" in set(noise["noised"])  # the matched-count control runs by default
    after = noise[noise["placement"] == "after_norm"]
    assert set(after["attn_norm"]) == {"qkv"}  # noise after the norm: only where there is a q/k norm


def test_controls_are_opt_in_and_land_in_the_report(tiny_checkpoints, tmp_path):
    assert set(worker.CONTROLS) <= set(worker.ANALYSES)
    assert not set(worker.CONTROLS) & set(R.Settings().analyses)  # keeps make reproduce in budget
    from interp_norm.cli._support import CONTROLS

    assert CONTROLS == worker.CONTROLS
    out = tmp_path / "rep"
    code = cli.main(["reproduce", "--out", str(out), "--checkpoints", str(tiny_checkpoints["pre"]),
                     str(tiny_checkpoints["qkv"]), "--quick", "--no-progress", "--only", "evaluate", "collapse",
                     "--controls"])
    assert code == 0
    for key in ("collapse_heads", "noise_decomposition", "collapse_consequence", "collapse_thresholds"):
        assert (out / f"{key}.csv").exists(), key
    th = pd.read_csv(out / "collapse_thresholds.csv")
    heads = pd.read_csv(out / "collapse_heads.csv")
    pooled = th[(th["layer"].astype(str) == "all") & (th["variant"] == "Pre-Norm")]
    shares = heads[heads["variant"] == "Pre-Norm"]["n_sparse"] / heads[heads["variant"] == "Pre-Norm"]["n_sparse"].sum()
    assert pooled["effective_heads"].iloc[0] == pytest.approx(1 / (shares**2).sum())
    cons = pd.read_csv(out / "collapse_consequence.csv")
    assert set(cons["group"]) == {"collapsed", "none", "difference"}
    assert set(pd.read_csv(out / "noise_decomposition.csv")["mode"]) == {"q", "k", "v", "qkv", "random", "shared"}


def test_bad_workers_is_a_typed_error(tiny_checkpoints):
    with pytest.raises(ConfigError, match="workers"):
        R.run_analyses([str(tiny_checkpoints["pre"]), str(tiny_checkpoints["qkv"])],
                       R.Settings.quick(analyses=("evaluate",)), progress=False, workers=0)


def test_seed_spread_matches_a_hand_computation():
    from interp_norm.stats.seed_summary import per_checkpoint, seed_spread

    ck = pd.DataFrame([dict(checkpoint="pre", label="Pre-Norm", attn_norm="pre", calibration="none", seed=0),
                       dict(checkpoint="pre-s1", label="Pre-Norm (pre-s1)", attn_norm="pre", calibration="none", seed=1)])
    ev = pd.DataFrame([dict(checkpoint=c, split=s, per_token_acc=a) for c, accs in
                       (("pre", (0.9, 0.8, 0.7)), ("pre-s1", (0.8, 0.7, 0.4))) for s, a in zip(("id", "interp", "extrap"), accs)])
    noise = pd.DataFrame([dict(checkpoint=c, noised="all", placement="before_norm", split="id", level=l, accuracy=a)
                          for c, pts in (("pre", ((0.0, 0.9), (0.01, 0.8))), ("pre-s1", ((0.0, 0.8), (0.01, 0.76))))
                          for l, a in pts])
    th = pd.DataFrame([dict(variant=v, layer="all", definition="loose", level_measured=m)
                       for v, m in (("Pre-Norm", 0.24), ("Pre-Norm (pre-s1)", float("nan")))])
    tables = dict(evaluation=ev, noise_accuracy=noise, collapse_thresholds=th)
    spread = seed_spread(per_checkpoint(tables, ck)).set_index("quantity")
    assert spread.loc["ID accuracy", "mean"] == pytest.approx(85.0)
    assert spread.loc["extrapolation accuracy", "half_range"] == pytest.approx(15.0)
    lost = spread.loc["accuracy lost to 1% noise (all rows, before any norm)"]
    assert lost["mean"] == pytest.approx((10 + 4) / 2) and lost["half_range"] == pytest.approx(3.0)
    level = spread.loc["1% loose collapse level, per-layer protocol"]
    assert level["mean"] == pytest.approx(24.0) and level["n_missing"] == 1 and level["values"] == "24.0, —"
    assert "accuracy lost to 1% noise placed after the norm" not in spread.index  # Pre-Norm has no q/k norm


def test_temperature_figure_has_one_colour_per_variant():
    from interp_norm.report import plots

    df = pd.DataFrame([dict(variant=v, c=c, layer="all", frac_sparse=f, collapse_level_loose=lv)
                       for v, rows in (("Pre-Norm", ((1.0, 0.1, 0.3), (2.0, 0.2, 0.2))),
                                       ("Pre-Norm (pre-s1)", ((1.0, 0.05, float("nan")), (2.0, 0.1, 0.25))))
                       for c, f, lv in rows])
    fig = plots.plot_temperature(df)
    colours = {t.line.color for t in fig.data}
    assert len(colours) == 1  # two seeds of one variant share its colour
    assert [list(t.y) for t in fig.data if t.xaxis == "x"][0] == [0.1, 0.2]
    assert any("never reached" in a.text for a in fig.layout.annotations)


def test_evaluated_only_checkpoints_report_accuracy_and_nothing_else():
    from interp_norm.stats.seed_summary import per_checkpoint

    ck = pd.DataFrame([dict(checkpoint="c", label="Pre-Norm (c)", attn_norm="pre", calibration="paper", seed=0,
                            analysed=False)])
    ev = pd.DataFrame([dict(checkpoint="c", split=s, per_token_acc=0.5) for s in ("id", "interp", "extrap")])
    rows = per_checkpoint(dict(evaluation=ev), ck)
    assert list(rows["quantity"]) == ["ID accuracy", "interpolation accuracy", "extrapolation accuracy"]
    assert (rows["value"] == 50.0).all()


def _recording_workers():
    """(calls, a run_checkpoint that raises KeyboardInterrupt at the second checkpoint, one that only counts):
    both record the checkpoint names they are given in ``calls``."""
    real = worker.run_checkpoint
    calls: list = []

    def interrupted_after_one(job, *a, **kw):
        calls.append(job.name)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return real(job, *a, **kw)

    def counted(job, *a, **kw):
        calls.append(job.name)
        return real(job, *a, **kw)

    return calls, interrupted_after_one, counted


def test_an_interrupted_reproduce_keeps_finished_checkpoints_and_a_rerun_does_only_the_rest(
        tiny_checkpoints, tmp_path, monkeypatch):
    """Ctrl-C after the first checkpoint: its tables are on disk; the same run again analyses only the
    second, and the report equals one run without interruption."""
    from interp_norm.report.partial import PartialStore

    specs = [str(tiny_checkpoints["pre"]), str(tiny_checkpoints["qkv"])]
    settings = R.Settings.quick(analyses=("evaluate", "collapse"), workers=1)
    calls, interrupted_after_one, counted = _recording_workers()
    out = tmp_path / "rep"
    monkeypatch.setattr(worker, "run_checkpoint", interrupted_after_one)
    with pytest.raises(KeyboardInterrupt):
        R.reproduce(out, specs, settings=settings, progress=False)
    first = calls[0]
    kept = PartialStore(out).path(first)
    assert {"evaluation.csv", "collapse.csv", "fingerprint.json"} <= {p.name for p in kept.iterdir()}
    assert not (out / "evaluation.csv").exists()  # the report itself is written only when whole
    assert set(pd.read_csv(kept / "evaluation.csv")["checkpoint"]) == {first}

    calls.clear()
    monkeypatch.setattr(worker, "run_checkpoint", counted)
    R.reproduce(out, specs, settings=settings, progress=False)
    assert len(calls) == 1 and calls[0] != first  # only the rest
    assert not PartialStore(out).folder.exists()  # the report is whole: nothing left to resume
    whole = tmp_path / "whole"
    R.reproduce(whole, specs, settings=settings, progress=False)
    for key in ("evaluation", "collapse", "model_card", "collapse_thresholds"):
        pd.testing.assert_frame_equal(pd.read_csv(out / f"{key}.csv"), pd.read_csv(whole / f"{key}.csv"), obj=key)


def test_an_interrupted_dashboard_keeps_finished_checkpoints_and_a_rerun_does_only_the_rest(
        tiny_checkpoints, tmp_path, monkeypatch):
    """The dashboard command's run is interruptible too: the first checkpoint's tables stay beside the
    page (partial/), the same call again analyses only the second, and the folder goes once the page exists."""
    from interp_norm.report.partial import PartialStore

    specs = [str(tiny_checkpoints["pre"]), str(tiny_checkpoints["qkv"])]
    settings = R.Settings.quick(analyses=("evaluate", "collapse"), workers=1)
    calls, interrupted_after_one, counted = _recording_workers()
    page = tmp_path / "dash" / "dashboard.html"
    monkeypatch.setattr(worker, "run_checkpoint", interrupted_after_one)
    with pytest.raises(KeyboardInterrupt):
        R.make_dashboard(specs, page, settings=settings, progress=False)
    first = calls[0]
    assert (PartialStore(page.parent).path(first) / "fingerprint.json").exists() and not page.exists()
    calls.clear()
    monkeypatch.setattr(worker, "run_checkpoint", counted)
    R.make_dashboard(specs, page, settings=settings, progress=False)
    assert len(calls) == 1 and calls[0] != first and page.exists()
    assert not PartialStore(page.parent).folder.exists()


def test_ctrl_c_terminates_the_worker_processes_at_once(tiny_checkpoints, monkeypatch):
    """Ctrl-C in the parent while workers analyse: the workers are terminated, not waited for."""
    import concurrent.futures as cf
    import time

    pools, procs = [], []

    class Recorded(cf.ProcessPoolExecutor):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            pools.append(self)

    def busy(*a, **kw):  # a checkpoint that would take ten minutes (runs in the forked workers)
        time.sleep(600)

    real_wait = cf.wait

    def wait_then_interrupt(pending, **kw):
        real_wait(pending, timeout=0.5)
        procs[:] = list((pools[-1]._processes or {}).values())
        if len(procs) == 2 and all(p.is_alive() for p in procs):
            raise KeyboardInterrupt  # both workers are busy: Ctrl-C
        return set(), pending

    monkeypatch.setattr(worker, "run_checkpoint", busy)
    monkeypatch.setattr(cf, "ProcessPoolExecutor", Recorded)
    monkeypatch.setattr(cf, "wait", wait_then_interrupt)
    specs = [str(tiny_checkpoints["pre"]), str(tiny_checkpoints["qkv"])]
    with pytest.raises(KeyboardInterrupt):
        R.run_analyses(specs, R.Settings.quick(analyses=("evaluate",)), progress=False, workers=2)
    assert len(pools) == 1 and len(procs) == 2
    for p in procs:
        p.join(timeout=30)  # terminated: gone at once (a busy worker would live ten minutes)
    assert not any(p.is_alive() for p in procs)
