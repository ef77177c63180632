"""``interp-norm train`` under ``torchrun`` with 2 CPU processes (gloo).

The independent reference is a 1-process run of the same command with the same global batch: after 20
steps the weights must agree to 1e-6 (DDP averages the ranks' gradients; the ranks' losses are scaled
so that average is the global batch's mean-loss gradient). Resume under DDP: a 2-process run of 10
steps continued with ``--resume --steps 20`` (plateau schedule, whose extension continues exactly as
a 20-step run) must give the weights of the 20-step run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from interp_norm import load_with_info
from interp_norm.training.checkpoints import read_checkpoint_info

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
#: a tiny model at the paper's learning rate (3e-4), a small global batch, the plateau schedule stepping every 5 steps, checkpoints every 5
OPTIONS = ["--preset", "paper", "--model-preset", "tiny", "--task-preset", "cpu", "--batch-size", "8",
           "--steps-per-epoch", "5", "--log-every", "5", "--eval-every", "10", "--eval-size", "16",
           "--final-eval-size", "16", "--checkpoint-every", "5", "--threads", "1", "--device", "cpu", "--no-progress"]


def _train(out: Path, steps: int, procs: int, *extra: str) -> subprocess.CompletedProcess:
    cli = ["-m", "interp_norm.cli", "train", "--out", str(out), "--steps", str(steps), *OPTIONS, *extra]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
                if procs > 1 else [sys.executable])
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    res = subprocess.run([*launcher, *cli], capture_output=True, text=True, env=env, cwd=out.parent, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return res


def _max_diff(a: Path, b: Path) -> float:
    sa, sb = load_with_info(a)[0].state_dict(), load_with_info(b)[0].state_dict()
    assert sa.keys() == sb.keys()
    return max(float((sa[k].double() - sb[k].double()).abs().max()) for k in sa)


def test_two_processes_equal_one_with_the_same_global_batch_and_resume(tmp_path):
    one, two, part = tmp_path / "one", tmp_path / "two", tmp_path / "part"
    _train(one, 20, 1)
    res = _train(two, 20, 2)
    assert res.stdout.count("trained 20 steps") == 1  # rank 0 reports, once
    info1, info2 = read_checkpoint_info(one), read_checkpoint_info(two)
    assert info1.step == info2.step == 20
    diff = _max_diff(one, two)
    assert diff <= 1e-6, diff
    moved = _max_diff(one, tmp_path / "one")  # sanity of the measure: identical folders differ by 0
    assert moved == 0.0
    # the runs really trained (weights moved away from the shared initialisation)
    init = load_with_info(one)[0]
    from interp_norm.core.model import HookedNormTransformer

    fresh = HookedNormTransformer(init.cfg)
    assert max(float((p - q).abs().max()) for p, q in zip(init.state_dict().values(), fresh.state_dict().values())) > 1e-3
    # the logged curve is the global batch's: equal losses in both runs
    c1, c2 = info1.curve, info2.curve
    assert list(c1["step"]) == list(c2["step"])
    assert torch.allclose(torch.tensor(c1["loss"].to_numpy()), torch.tensor(c2["loss"].to_numpy()), atol=1e-6)
    # resume under DDP: 10 steps, then --resume to 20 (2 processes both times)
    _train(part, 10, 2)
    assert read_checkpoint_info(part).step == 10
    _train(part, 20, 2, "--resume")
    assert read_checkpoint_info(part).step == 20
    diff = _max_diff(two, part)
    assert diff <= 1e-6, diff


def test_a_batch_that_does_not_split_over_the_processes_is_refused(tmp_path):
    out = tmp_path / "odd"
    cli = ["-m", "interp_norm.cli", "train", "--out", str(out), "--steps", "2", *OPTIONS]
    cli[cli.index("--batch-size") + 1] = "7"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *cli],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert res.returncode != 0
    assert "batch_size 7 does not divide by the 2 training processes" in res.stderr or \
           "--batch-size 7 does not divide by the 2 training processes" in res.stderr
