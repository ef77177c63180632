"""``make notebooks`` works as root (Jupyter refuses to start as root without ``--allow-root``) and as a user."""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
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


def _serve(cmd: list[str], env: dict, cwd: str | None = None) -> str:
    """Run ``make notebooks`` (``cmd``) until JupyterLab serves, ask its REST API for the folder it
    opened (it must list the notebooks), stop it; return the log."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd,
                            start_new_session=True)
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 180
        url = None
        while time.monotonic() < deadline and proc.poll() is None and url is None:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                line = proc.stdout.readline()
                seen.append(line)
                if any("is running at" in s for s in seen):  # the URL follows on the same or the next line
                    m = re.search(r"http://(?:localhost|127\.0\.0\.1):(\d+)/", line)
                    url = f"http://127.0.0.1:{m.group(1)}" if m else None
        log = "".join(seen)
        assert url, log[-2000:]
        no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a local server, never a proxy
        for attempt in range(10):  # a loaded machine may print the URL a moment before it accepts
            try:
                with no_proxy.open(f"{url}/api/contents?token=test", timeout=30) as r:
                    listed = {c["name"] for c in json.load(r)["content"]}
                break
            except OSError:
                if attempt == 9 or proc.poll() is not None:
                    raise
                time.sleep(1)
        assert "01_quickstart.ipynb" in listed and not any(n.endswith(".py") for n in listed), listed
        return log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # make and the server it started (our own process group)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _make_notebooks() -> list[str]:
    return ["make", "-C", str(ROOT), "notebooks", f"VENV={VENV}", *KEEP,
            "JUPYTER_ARGS=--no-browser --port=0 --ServerApp.token=test"]


@pytest.mark.slow
def test_make_notebooks_starts_jupyterlab_as_this_user(tmp_path):
    """The real thing, as whoever runs the tests (root in CI and containers): the server starts and serves tutorials/."""
    if not (VENV / "bin" / "jupyter-lab").exists():
        pytest.skip("JupyterLab is not installed (pip install -e '.[notebooks]')")
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), JUPYTER_CONFIG_DIR=str(tmp_path / "config"))
    log = _serve(_make_notebooks(), env)
    assert "Running as root is not recommended" not in log
    assert ("--allow-root" in log) == (os.getuid() == 0)


@pytest.mark.slow
def test_make_notebooks_starts_jupyterlab_as_a_regular_user():
    """As root: the same as the unprivileged user ``nobody`` (``runuser``), with a home of its own: no
    --allow-root is passed and the server starts and serves tutorials/. (Not as root, the test above
    already ran as a regular user.)"""
    if os.getuid() != 0:
        pytest.skip("not root: test_make_notebooks_starts_jupyterlab_as_this_user ran as a regular user")
    runuser = shutil.which("runuser")
    if runuser is None or not (VENV / "bin" / "jupyter-lab").exists():
        pytest.skip("needs runuser and JupyterLab (pip install -e '.[notebooks]')")
    import pwd

    nobody = pwd.getpwnam("nobody")
    as_nobody = [runuser, "-u", "nobody", "--"]
    probe = subprocess.run([*as_nobody, str(VENV / "bin" / "python"), "-c", "import jupyterlab"], capture_output=True,
                           text=True, cwd="/")
    if probe.returncode:
        pytest.skip(f"user nobody cannot run this venv ({VENV}): {(probe.stderr.strip().splitlines() or ['?'])[-1]} "
                    "(e.g. its interpreter lives under /root); a venv of its own works, see tutorials/README.md")
    home = tempfile.mkdtemp(prefix="interp-norm-nobody-")  # /tmp/...: a folder nobody can reach, unlike tmp_path
    try:
        os.chown(home, nobody.pw_uid, nobody.pw_gid)
        env = dict(os.environ, HOME=home, JUPYTER_RUNTIME_DIR=f"{home}/runtime", JUPYTER_CONFIG_DIR=f"{home}/config",
                   JUPYTER_DATA_DIR=f"{home}/data", USER="nobody", LOGNAME="nobody")
        log = _serve([*as_nobody, *_make_notebooks()], env, cwd=home)
        assert "--allow-root" not in log and "Running as root is not recommended" not in log, log[-2000:]
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_make_test_runs_the_lint_and_the_type_check_before_the_suite():
    out = subprocess.run(["make", "-s", "-n", "-C", str(ROOT), "test", f"VENV={VENV}", *KEEP],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    lint = [i for i, line in enumerate(out) if "bin/ruff check " in line or line.rstrip().endswith("bin/mypy")]
    suite = [i for i, line in enumerate(out) if "-m pytest" in line and "-m numerics" not in line]
    assert len(lint) == 2 and len(suite) == 1 and max(lint) < suite[0], out
