# Entry points (see README): `make reproduce`, `make test`, `make notebooks`. Each sets up .venv first.
# torch==2.13.0 is installed explicitly first: on CPU-only machines it is the CPU build, and the
# project's own `torch>=2.6` requirement is then already satisfied (no multi-GB CUDA download).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
OUT ?= report

.PHONY: setup reproduce reproduce-seeds compare lint test test-numerics browser bench notebooks tutorials-html
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $@

# --force: `make reproduce` regenerates the report, replacing the tables of the last run.
reproduce: setup
	$(VENV)/bin/interp-norm reproduce --out $(OUT) --force

# Every shipped seed: the seed tables' analyses on the seeds and calibrated models the default run skips,
# then the tables as markdown in docs/findings-tables.md, the thesis measure on the 24 Pre-/QKV-Norm seeds
# (scripts/coupling_seeds.py, about a minute) and the verdicts, recomputed independently from the unrounded
# CSVs by scripts/recheck_verdicts.py (its diff and exit 1 if a page disagrees), the addition circuit on every
# seed, and the attribution error budget on every seed and five tiny bridges (scripts/attribution_error_budget.py: about
# 90 s of CPU on one thread; 127 s wall in one measured run, longer on shared cores). Slower than `make reproduce` (its time is in $(OUT)-seeds/run.json).
reproduce-seeds: setup
	$(VENV)/bin/interp-norm reproduce --all-seeds --controls --out $(OUT)-seeds --force
	$(PY) scripts/findings_tables.py $(OUT)-seeds --write > /dev/null
	$(PY) scripts/coupling_seeds.py --write > /dev/null
	$(PY) scripts/verdicts.py --write > /dev/null
	$(PY) scripts/recheck_verdicts.py > $(OUT)-seeds/recheck_verdicts.txt || { tail -n 40 $(OUT)-seeds/recheck_verdicts.txt; exit 1; }
	OMP_NUM_THREADS=1 $(PY) scripts/circuit_seeds.py run --out $(OUT)-seeds/circuits
	$(PY) scripts/circuit_seeds.py summarise --out $(OUT)-seeds/circuits --write > /dev/null
	OMP_NUM_THREADS=1 $(PY) scripts/recheck_circuits.py > /dev/null
	OMP_NUM_THREADS=1 $(PY) scripts/attribution_error_budget.py --out $(OUT)-seeds/attribution_error --write > /dev/null

# Compare the CSV tables of two reports (e.g. before and after a change): make compare OLD=report-old NEW=report
compare: setup
	$(PY) scripts/compare_reports.py $(OLD) $(or $(NEW),$(OUT))

# Headless Chromium (Debian's package) for the dashboard's browser check. Needs root (as in CI);
# elsewhere, if it cannot be installed, the browser test is skipped with a message (in CI it fails).
# Non-interactive and bounded in time, so CI never waits on it.
browser:
	@command -v chromium >/dev/null 2>&1 || { timeout 900 apt-get update -qq \
	  && DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq chromium >/dev/null; } \
	  || { [ "$$CI" != "true" ] && echo "note: could not install chromium; the browser test will be skipped"; }

# Lint (ruff) and the package's type check (mypy), both configured in pyproject.toml; `make test` runs it first.
lint: setup
	$(VENV)/bin/ruff check interp_norm tests scripts benchmarks
	$(VENV)/bin/mypy

# The suite in parallel: one pytest-xdist worker per core (at most TEST_WORKERS), each on one torch
# thread, slow tests handed out first (tests/conftest.py); an idle worker takes tests queued for a busy
# one (worksteal). stdin is closed and each test has a time limit (pyproject.toml): CI cannot hang.
# Then the `numerics` tests (two computations of one quantity compared up to float rounding) again
# under each other instruction set this CPU's kernels can use (ATEN_CPU_CAPABILITY; the plain run used
# the best one): the tolerances must hold on any CPU, not only on the one CI runs on.
TEST_WORKERS ?= 4
NUMERICS_CAPS ?= $(shell sh scripts/cpu_capabilities.sh)
NUMERICS_FILES = $(shell grep -l 'mark.numerics' tests/test_*.py)
test: setup browser lint
	$(PY) -m pytest -q -n auto --maxprocesses $(TEST_WORKERS) --dist worksteal < /dev/null
	$(MAKE) --no-print-directory test-numerics

test-numerics: setup
	@for cap in $(NUMERICS_CAPS); do echo "numerics tests with ATEN_CPU_CAPABILITY=$$cap"; \
	  ATEN_CPU_CAPABILITY=$$cap $(PY) -m pytest -q -m numerics $(NUMERICS_FILES) -n auto --maxprocesses $(TEST_WORKERS) < /dev/null || exit 1; done

bench: setup
	for f in benchmarks/bench_*.py; do OMP_NUM_THREADS=1 $(PY) $$f || exit 1; done

# The tutorials in JupyterLab: installs the `notebooks` extra into .venv once, then opens tutorials/
# (the notebooks import their checks from the installed package, interp_norm.tutorial).
# Jupyter refuses to run as root (a container, CI) unless given --allow-root: added when uid is 0.
# Extra options go in JUPYTER_ARGS (e.g. JUPYTER_ARGS="--no-browser --port 8890").
USER_ID ?= $(shell id -u)
JUPYTER_ARGS ?=
notebooks: $(VENV)/.notebooks
	$(VENV)/bin/jupyter lab $(if $(filter 0,$(USER_ID)),--allow-root) $(JUPYTER_ARGS) tutorials/

$(VENV)/.notebooks: $(VENV)/.installed
	$(PY) -m pip install -q --disable-pip-version-check -e '.[notebooks]'
	touch $@

# Re-run every tutorial and rewrite tutorials/html/*.html (nbconvert comes with the dev extra).
tutorials-html: setup
	OMP_NUM_THREADS=1 $(PY) scripts/tutorials/build_notebooks.py --execute
