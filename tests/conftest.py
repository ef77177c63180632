"""Set-up shared by the whole test session (``make test`` runs ``pytest -n auto``, see the Makefile).

* Under pytest-xdist each worker process computes with one torch thread, and the processes the
  tests start inherit ``OMP_NUM_THREADS=1``: two workers, each with torch's default of one thread
  per core, would oversubscribe the cores and spin. A serial ``pytest`` keeps torch's default.
* A run that selects no test fails with a message (exit 1), never pytest's exit code 5, which CI
  scripts could mistake for something other than a failure.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.config.pluginmanager.get_plugin("terminalreporter").write_line(
            "error: no test was selected (check the path, -k or -m); run `make test` from the repository root")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
