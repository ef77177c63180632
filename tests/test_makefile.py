"""``make notebooks`` works as root (Jupyter refuses to start as root without ``--allow-root``) and as a user."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(sys.prefix)
# never rebuild the venv from a test: treat its stamps as up to date
KEEP = ["-o", str(VENV / ".installed"), "-o", str(VENV / ".notebooks")]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def dry_run(*args: str) -> str:
    out = subprocess.run(["make", "-s", "-n", "-C", str(ROOT), "notebooks", f"VENV={VENV}", *KEEP, *args],
                         capture_output=True, text=True, check=True).stdout
    return next(line for line in out.splitlines() if "jupyter lab" in line)


def test_allow_root_is_passed_for_root_only():
    assert "--allow-root" in dry_run("USER_ID=0")
    assert "--allow-root" not in dry_run("USER_ID=1000")
    assert ("--allow-root" in dry_run()) == (os.getuid() == 0)  # the default reads `id -u`
    assert dry_run("JUPYTER_ARGS=--no-browser").endswith("--no-browser tutorials/")


@pytest.mark.slow
def test_make_notebooks_starts_jupyterlab_as_this_user(tmp_path):
    """The real thing, as whoever runs the tests (root in CI and containers): the server starts."""
    if not (VENV / "bin" / "jupyter-lab").exists():
        pytest.skip("JupyterLab is not installed (pip install -e '.[notebooks]')")
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), JUPYTER_CONFIG_DIR=str(tmp_path / "config"))
    cmd = ["make", "-C", str(ROOT), "notebooks", f"VENV={VENV}", *KEEP,
           "JUPYTER_ARGS=--no-browser --port=0 --ServerApp.token=test"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                line = proc.stdout.readline()
                seen.append(line)
                if "is running at" in line:
                    break
        log = "".join(seen)
        assert "is running at" in log, log[-2000:]
        assert "Running as root is not recommended" not in log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # make and the server it started (our own process group)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
