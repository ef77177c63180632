"""reproduce's choices: which checkpoints get the heavy analyses, and workers that change nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest

from interp_norm import checkpoint_report, cli
from interp_norm import reproduce as R
from interp_norm.errors import ConfigError
from interp_norm.model import ModelConfig
from interp_norm.task import AdditionTask
from interp_norm.train import TrainConfig, train

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
    assert cli.ANALYSES == checkpoint_report.ANALYSES


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


def test_bad_workers_is_a_typed_error(tiny_checkpoints):
    with pytest.raises(ConfigError, match="workers"):
        R.run_analyses([str(tiny_checkpoints["pre"]), str(tiny_checkpoints["qkv"])],
                       R.Settings.quick(analyses=("evaluate",)), progress=False, workers=0)
