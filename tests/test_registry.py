"""The analysis registry: every registered analysis reaches reproduce, the CLI and the dashboard.

``interp_norm.report.registry.REGISTRY`` is the one list of analyses; these tests read what each consumer
actually produced (the report folder's CSVs and timings, the parser's choices, the dashboard's HTML)
and check each registered analysis is there, under the names its entry declares.
"""

from __future__ import annotations

import argparse
import pickle
import re

import pandas as pd
import pytest

from interp_norm.report import registry
from interp_norm.report import reproduce as R
from interp_norm.errors import ConfigError
from interp_norm.core.model import ModelConfig
from interp_norm.core.task import AdditionTask
from interp_norm.training.train import train
from interp_norm.training.config import TrainConfig

EASY = AdditionTask(train_terms=(2,), interp_terms=(2,), extrap_terms=(3,), n_digits=(1,))
#: Tables the report makes itself, from every checkpoint (no analysis owns them).
REPORT_TABLES = {"model_card", "training_curves", "seed_numbers", "seed_spread", "seed_comparisons",
                 "seed_comparison_values", "seed_matched_id", "seed_matched_id_values"}


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    """A quick reproduce of a Pre-Norm and a QKV-Norm tiny model with every registered analysis."""
    cfg = TrainConfig(lr=3e-3, batch_size=16, steps_per_epoch=6, max_steps=12, log_every=4, eval_every=12,
                      eval_size=16, final_eval_size=16, checkpoint_every=12, grad_clip=1.0, seed=3)
    root = tmp_path_factory.mktemp("ckpts")
    for norm in ("pre", "qkv"):
        train(ModelConfig.preset("tiny", attn_norm=norm), EASY, cfg, root / norm, progress=False)
    out = tmp_path_factory.mktemp("report")
    R.reproduce(out, [str(root / "pre"), str(root / "qkv")], settings=R.Settings.quick(analyses=registry.ANALYSES),
                progress=False)
    return out


@pytest.mark.slow
def test_every_analysis_writes_the_tables_it_declares(report_dir):
    written = {p.stem for p in report_dir.glob("*.csv")} - {"timings", "checkpoints"}
    timed = set(pd.read_csv(report_dir / "timings.csv")["stage"])
    for a in registry.REGISTRY:
        assert a.name in timed, a.name
        mine = {k for k in written if registry.produces(a, k)}
        assert mine, f"{a.name} wrote none of {a.tables}"
        missing = [t for t in a.tables if not t.endswith("*") and t not in written]
        assert not missing, f"{a.name} declares {missing} but reproduce did not write them"
    for key in written - REPORT_TABLES:  # every other table has exactly one owner
        owners = [a.name for a in registry.REGISTRY if registry.produces(a, key)]
        assert len(owners) == 1, f"{key}.csv is declared by {owners or 'no analysis'}"


def _reproduce_parser() -> argparse.ArgumentParser:
    from interp_norm.cli import build_parser

    sub = next(a for a in build_parser("reproduce")._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["reproduce"]


def test_the_cli_offers_every_analysis():
    actions = {a.dest: a for a in _reproduce_parser()._actions}
    assert list(actions["only"].choices) == [a.name for a in registry.REGISTRY]
    opt_in = [a.name for a in registry.REGISTRY if not a.default]
    assert opt_in and all(name in actions["controls"].help for name in opt_in)
    assert set(R.Settings().analyses) == {a.name for a in registry.REGISTRY if a.default}
    assert set(R.Settings.quick(analyses=registry.ANALYSES).analyses) == set(registry.ANALYSES)


@pytest.mark.slow
def test_the_dashboard_has_a_section_for_every_analysis(report_dir):
    page = (report_dir / "dashboard.html").read_text(encoding="utf-8")
    anchors = set(re.findall(r'<section id="([^"]+)"', page))
    tables = {p.stem: pd.read_csv(p) for p in report_dir.glob("*.csv")}
    for a in registry.REGISTRY:
        own = {k: v for k, v in tables.items() if registry.produces(a, k) or k in REPORT_TABLES}
        built = registry.resolve(a.figure)(own, lambda title, build, caption="", kind="figure": object(), True)
        assert built and all(s.panels for s in built), f"{a.name}: no dashboard panels from its tables"
        assert {s.anchor for s in built} <= anchors, (a.name, {s.anchor for s in built} - anchors)


def test_every_size_belongs_to_one_analysis_and_reaches_settings():
    sizes = registry.sizes()
    s, q = R.Settings(), R.Settings.quick()
    for a in registry.REGISTRY:
        assert set(a.quick) <= set(a.sizes), a.name
        for k, v in a.sizes.items():
            assert sizes[k] is v
            assert getattr(s, k) == (v() if callable(v) else v)
            assert getattr(q, k) == a.quick.get(k, getattr(s, k))
    assert len(sizes) == sum(len(a.sizes) for a in registry.REGISTRY)  # no name declared twice


def test_settings_are_frozen_typed_and_picklable():
    s = R.Settings.quick(seed=3)
    with pytest.raises(AttributeError):
        s.seed = 4
    assert s.replace(seed=4).seed == 4 and s.seed == 3
    assert pickle.loads(pickle.dumps(s)) == s and hash(pickle.loads(pickle.dumps(s))) == hash(s)
    with pytest.raises(ConfigError, match="noise_exampels"):
        R.Settings(noise_exampels=3)
    for bad in (0, -1, 2.0, True, "3"):
        with pytest.raises(ConfigError, match="Settings.collapse_draws must be a positive integer"):
            R.Settings(collapse_draws=bad)
    assert R.Settings(noise_matched=False).noise_matched is False  # a bool is a switch, not a count


def test_registry_import_stays_light():
    """The CLI reads the registry for --help: it must not import torch, pandas or an analysis module."""
    import subprocess
    import sys

    code = ("import sys, interp_norm.report.registry as r; r.REGISTRY; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'pandas') "
            "or m.startswith(('interp_norm.noise', 'interp_norm.circuits', 'interp_norm.geometry'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
