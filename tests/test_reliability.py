"""Kill -9 or Ctrl-C at any moment, resume, and end bit-identical to a run that was never interrupted.

A real process, ``python -m interp_norm.cli train``, is SIGKILLed (no cleanup handlers run) or
sent SIGINT at a random moment after its first checkpoint; then death is simulated in-process at
each commit point inside checkpoint writing. All runs are compared bit-for-bit with an
uninterrupted run. The subprocesses run with the environment's default thread settings (no
``OMP_NUM_THREADS``): training fixes its own thread count, so the default path is deterministic.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from interp_norm import load_with_info
from interp_norm.cli import main

pytestmark = pytest.mark.slow

# tiny model on the cpu task; 10-step checkpoints so kills often land inside a checkpoint write
ARGS = [
    "train", "--preset", "cpu", "--model-preset", "tiny", "--attn-norm", "qkv", "--seed", "3",
    "--steps", "100", "--batch-size", "16", "--steps-per-epoch", "40", "--checkpoint-every", "10",
    "--log-every", "10", "--eval-every", "25", "--eval-size", "32", "--final-eval-size", "32", "--no-progress",
]
# the default path: whatever thread settings the user's shell has, none imposed here
ENV = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
FINAL = "step-00000100"


def cli(out: Path, *extra: str, script: str | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "interp_norm.cli"] if script is None else [sys.executable, script]
    return subprocess.Popen([*cmd, *ARGS, "--out", str(out), *extra], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen) -> None:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-2000:]


def resume_in_process(out: Path, resume: bool = True) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # as a default-configured process on a 2+ core machine: training sets its own
    try:
        assert main([*ARGS, "--out", str(out), *(["--resume"] if resume else [])]) == 0
    finally:
        torch.set_num_threads(threads)


def assert_same_run(a: Path, b: Path) -> None:
    for name in ("model.safetensors", "training_curve.csv", "metrics.json"):
        assert (a / FINAL / name).read_bytes() == (b / FINAL / name).read_bytes(), name
    ma, _ = load_with_info(a)
    mb, _ = load_with_info(b)
    for (k, x), (_, y) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32)), k


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "run"
    resume_in_process(out, resume=False)
    return out


def test_default_thread_setting_trains_bit_identically_in_a_fresh_process(reference, tmp_path):
    """The same run in a subprocess with the default environment (training twice)."""
    assert "OMP_NUM_THREADS" not in ENV
    out = tmp_path / "run"
    finish(cli(out))
    assert_same_run(reference, out)


def wait_for_first_checkpoint(proc: subprocess.Popen, out: Path) -> None:
    deadline = time.time() + 120
    while not (out / "LATEST").exists():
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.01)


def run_until_a_random_moment(out: Path, what: str) -> tuple[subprocess.Popen, float]:
    """Start a run into ``out``; return it, still running, and the random delay (0-0.3 s) waited after
    its first checkpoint. ``what`` the caller does next ("killed", "interrupted"), for the message."""
    proc = cli(out)
    wait_for_first_checkpoint(proc, out)
    delay = random.uniform(0.0, 0.3)
    time.sleep(delay)
    assert proc.poll() is None, f"the run finished before it could be {what}; make it longer"
    return proc, delay


def test_sigkill_at_a_random_moment_then_resume_is_bit_identical(reference, tmp_path):
    out = tmp_path / "run"
    proc, delay = run_until_a_random_moment(out, "killed")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    killed_at = (out / "LATEST").read_text().strip()
    _, info = load_with_info(out)  # whatever the moment, the newest checkpoint is complete and verified
    assert info.step < 100, (delay, killed_at)
    finish(cli(out, "--resume"))
    assert_same_run(reference, out)


def test_ctrl_c_at_a_random_moment_saves_the_current_step_then_resume_is_bit_identical(reference, tmp_path):
    out = tmp_path / "run"
    proc, delay = run_until_a_random_moment(out, "interrupted")
    periodic = int((out / "LATEST").read_text().strip().split("-")[1])
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err.decode()[-2000:]  # the CLI's exit code for an interrupt
    assert "interrupted" in err.decode()
    _, info = load_with_info(out)  # complete and verified: the step in progress (usually not a multiple of 10)
    assert periodic <= info.step <= 100, (delay, periodic, info.step)
    finish(cli(out, "--resume"))
    assert_same_run(reference, out)


class Killed(BaseException):
    """Stands for SIGKILL in-process: nothing after it runs, and no cleanup either (see below)."""


@pytest.mark.parametrize(
    "what, target, n, latest",
    [
        ("replace", "step-00000020", 1, "step-00000010"),  # second checkpoint fully written in its temp folder, not renamed
        ("replace", "LATEST", 2, "step-00000010"),  # renamed into place, LATEST not yet updated
        ("rmtree", "step-00000010", 1, "step-00000020"),  # LATEST updated, older step not yet pruned
    ],
)
def test_death_at_each_commit_point_then_resume_is_bit_identical(reference, tmp_path, monkeypatch, what, target, n, latest):
    """Deterministic kill points inside checkpoint writing (the random SIGKILL above hits them by chance).

    At the n-th call of os.replace / shutil.rmtree whose destination is ``target`` the "process
    dies": :class:`Killed` is raised and every later rmtree/unlink is a no-op, so the except-cleanup
    a SIGKILL would skip does not run.
    """
    import shutil

    real = {"replace": os.replace, "rmtree": shutil.rmtree}
    count = {"n": 0, "dead": False}

    def dying(name):
        def f(*a, **k):
            if count["dead"]:
                return None
            dst = Path(a[1] if name == "replace" else a[0]).name
            if name == what and dst == target:
                count["n"] += 1
                if count["n"] == n:
                    count["dead"] = True
                    raise Killed
            return real[name](*a, **k)
        return f

    monkeypatch.setattr(os, "replace", dying("replace"))
    monkeypatch.setattr(shutil, "rmtree", dying("rmtree"))
    monkeypatch.setattr(Path, "unlink", lambda self, missing_ok=False: None)
    out = tmp_path / "run"
    with pytest.raises(Killed):
        resume_in_process(out, resume=False)
    monkeypatch.undo()
    assert (out / "LATEST").read_text().strip() == latest
    _, info = load_with_info(out)
    assert info.path.name == latest
    resume_in_process(out)
    assert not any(p.name.startswith(".") for p in out.iterdir())  # leftovers cleaned up
    assert sorted(p.name for p in out.iterdir()) == ["LATEST", FINAL]
    assert_same_run(reference, out)
