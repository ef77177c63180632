"""Start-up time of the command line: ``interp-norm --help`` and ``interp-norm CMD --help`` (target < 0.5 s).

Each command runs as a fresh process (``python -m interp_norm.cli``, what the ``interp-norm`` script
does), several times; the script prints min and median wall time beside ``python -c pass`` (the
interpreter's own start-up) and which heavy modules each one imported. ``--help`` must import none
of torch, TransformerLens, plotly or pandas; a subcommand whose shown defaults come from an analysis
module (noise/collapse levels, circuit metrics) imports that module.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_cli.py [--runs 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformer_lens", "plotly", "pandas")
TARGET = 0.5

PROBE = (
    "import runpy, sys, json, contextlib, io\n"
    "heavy = set(json.loads(sys.argv[2]))\n"
    "sys.argv = ['interp-norm'] + json.loads(sys.argv[1])\n"
    "with contextlib.redirect_stdout(io.StringIO()):\n"
    "    try:\n        runpy.run_module('interp_norm.cli', run_name='__main__')\n"
    "    except SystemExit:\n        pass\n"
    "print(' '.join(sorted({m.split('.')[0] for m in sys.modules} & heavy)))\n"
)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def timed(argv: list[str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        p = subprocess.run(argv, capture_output=True, text=True, env=_env())
        times.append(time.perf_counter() - t)
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed: {p.stderr[-500:]}")
    return times


def heavy_imports(cli_args: list[str]) -> str:
    import json

    p = subprocess.run([sys.executable, "-c", PROBE, json.dumps(cli_args), json.dumps(HEAVY)],
                       capture_output=True, text=True, env=_env())
    if p.returncode != 0:
        raise SystemExit(f"probe of {cli_args} failed: {p.stderr[-500:]}")
    return p.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from interp_norm.cli import COMMANDS

    rows = [("python -c pass", [sys.executable, "-c", "pass"], None)]
    rows.append(("interp-norm --help", [sys.executable, "-m", "interp_norm.cli", "--help"], ["--help"]))
    for name in COMMANDS:
        rows.append((f"interp-norm {name} --help", [sys.executable, "-m", "interp_norm.cli", name, "--help"],
                     [name, "--help"]))
    print(f"{'command':<34} {'min s':>7} {'median s':>9}  heavy modules imported")
    over = []
    for label, argv, cli_args in rows:
        t = timed(argv, args.runs)
        heavy = "" if cli_args is None else (heavy_imports(cli_args) or "none")
        print(f"{label:<34} {min(t):7.3f} {statistics.median(t):9.3f}  {heavy}")
        if cli_args is not None and statistics.median(t) > TARGET:
            over.append(label)
    print(f"target: median < {TARGET} s; over target: {', '.join(over) if over else 'none'}")


if __name__ == "__main__":
    main()
