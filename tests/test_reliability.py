"""Kill -9 at any moment, resume, and end bit-identical to a run that was never interrupted.

A real process, ``python -m interp_norm.cli train``, is SIGKILLed (no cleanup handlers run) at a
random moment after its first checkpoint; then death is simulated in-process at each commit point
inside checkpoint writing. All runs are compared bit-for-bit with an uninterrupted run.
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

from interp_norm.checkpoints import load_checkpoint
from interp_norm.cli import main

pytestmark = pytest.mark.slow

# tiny model on the cpu task; 10-step checkpoints so kills often land inside a checkpoint write
ARGS = [
    "train", "--preset", "cpu", "--model-preset", "tiny", "--attn-norm", "qkv", "--seed", "3",
    "--steps", "100", "--batch-size", "16", "--steps-per-epoch", "40", "--checkpoint-every", "10",
    "--log-every", "10", "--eval-every", "25", "--eval-size", "32", "--final-eval-size", "32", "--no-progress",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
FINAL = "step-00000100"


def cli(out: Path, *extra: str, script: str | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "interp_norm.cli"] if script is None else [sys.executable, script]
    return subprocess.Popen([*cmd, *ARGS, "--out", str(out), *extra], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen) -> None:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-2000:]


def resume_in_process(out: Path, resume: bool = True) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the subprocesses run single-threaded: same kernels, same bits
    try:
        assert main([*ARGS, "--out", str(out), *(["--resume"] if resume else [])]) == 0
    finally:
        torch.set_num_threads(threads)


def assert_same_run(a: Path, b: Path) -> None:
    for name in ("model.safetensors", "training_curve.csv", "metrics.json"):
        assert (a / FINAL / name).read_bytes() == (b / FINAL / name).read_bytes(), name
    ma, _ = load_checkpoint(a)
    mb, _ = load_checkpoint(b)
    for (k, x), (_, y) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32)), k


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "run"
    resume_in_process(out, resume=False)  # same bits as a subprocess: both single-threaded
    return out


def test_sigkill_at_a_random_moment_then_resume_is_bit_identical(reference, tmp_path):
    out = tmp_path / "run"
    proc = cli(out)
    deadline = time.time() + 120
    while not (out / "LATEST").exists():
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.01)
    delay = random.uniform(0.0, 0.3)
    time.sleep(delay)
    assert proc.poll() is None, "the run finished before it could be killed; make it longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    killed_at = (out / "LATEST").read_text().strip()
    _, info = load_checkpoint(out)  # whatever the moment, the newest checkpoint is complete and verified
    assert info.step < 100, (delay, killed_at)
    finish(cli(out, "--resume"))
    assert_same_run(reference, out)


class Killed(BaseException):
    """Stands for SIGKILL in-process: nothing after it runs, and no cleanup either (see below)."""


@pytest.mark.parametrize(
    "what, n, latest",
    [
        ("replace", 3, "step-00000010"),  # second checkpoint fully written in its temp folder, not renamed
        ("replace", 4, "step-00000010"),  # renamed into place, LATEST not yet updated
        ("rmtree", 1, "step-00000020"),  # LATEST updated, older step not yet pruned
    ],
)
def test_death_at_each_commit_point_then_resume_is_bit_identical(reference, tmp_path, monkeypatch, what, n, latest):
    """Deterministic kill points inside checkpoint writing (the random SIGKILL above hits them by chance).

    At the n-th call of os.replace / shutil.rmtree the "process dies": :class:`Killed` is raised and
    every later rmtree/unlink is a no-op, so the except-cleanup a SIGKILL would skip does not run.
    """
    import shutil

    real = {"replace": os.replace, "rmtree": shutil.rmtree}
    count = {"n": 0, "dead": False}

    def dying(name):
        def f(*a, **k):
            if count["dead"]:
                return None
            if name == what:
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
    _, info = load_checkpoint(out)
    assert info.path.name == latest
    resume_in_process(out)
    assert not any(p.name.startswith(".") for p in out.iterdir())  # leftovers cleaned up
    assert sorted(p.name for p in out.iterdir()) == ["LATEST", FINAL]
    assert_same_run(reference, out)
