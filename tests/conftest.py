"""Set-up shared by the whole test session (``make test`` runs ``pytest -n auto --dist worksteal``).

* Under pytest-xdist each worker process computes with one torch thread, and the processes the
  tests start inherit ``OMP_NUM_THREADS=1``: two workers, each with torch's default of one thread
  per core, would oversubscribe the cores and spin. A serial ``pytest`` keeps torch's default.
* Under pytest-xdist the tests marked ``slow`` (notebooks, killed-and-resumed training runs) are
  handed out first, so the run does not end waiting on one long test started last.
* SIGINT gets Python's own handler if the session started with it ignored (as a shell does for a job
  started with ``&``, or ``nohup``): the Ctrl-C tests send real SIGINTs, in-process and to the
  training processes they start, which inherit an ignored SIGINT but not a handled one.
* A run that selects no test fails with a message (exit 1), never pytest's exit code 5, which CI
  scripts could mistake for something other than a failure.
* ``replays``: the fixture the attribution tests use to see which path ``node_attribution`` took.
"""

from __future__ import annotations

import os
import signal

import pytest

IN_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))

if IN_WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)


if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_report_header(config):
    """Which vector kernels torch runs on (``ATEN_CPU_CAPABILITY``): the ``numerics`` tests run under each."""
    import torch

    return f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()}"


def pytest_collection_modifyitems(config, items):
    if IN_WORKER:  # every worker collects the same order, as xdist requires
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.config.pluginmanager.get_plugin("terminalreporter").write_line(
            "error: no test was selected (check the path, -k or -m); run `make test` from the repository root")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# ----------------------------------------------------------------------------- shared fixtures


@pytest.fixture
def replays(monkeypatch):
    """Records whether each node_attribution call took the re-run path (True) or refused it (False)."""
    from interp_norm.circuits import attribution_replay

    taken: list = []
    real = attribution_replay.prefix_attribution

    def spy(*args, **kwargs):
        try:
            out = real(*args, **kwargs)
        except Exception:
            taken.append(False)
            raise
        taken.append(True)
        return out

    monkeypatch.setattr(attribution_replay, "prefix_attribution", spy)
    return taken
