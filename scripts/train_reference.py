"""Retrain the shipped reference checkpoints from their seeds, one command each.

    .venv/bin/python scripts/train_reference.py pre            # one checkpoint
    .venv/bin/python scripts/train_reference.py --all --jobs 2 # all of them, two at a time

Each run trains the ``cpu`` model preset on the ``cpu`` task preset with the ``cpu`` training
preset (see README), in ``runs/<name>/`` (resumable: rerun the same command after an interruption),
then writes a shipping copy without optimiser state to ``data/checkpoints/<name>/`` whose
``metrics.json`` also records the wall-clock training time and the thread count (training uses
``TrainConfig.threads``, 1 by default, whatever ``OMP_NUM_THREADS`` says: that is what makes it
bit-for-bit reproducible).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> (attn_norm, seed, calibration[, n_epochs]): "none" divides scores by sqrt(d_head); "paper"
# adds the paper's Checkpoint calibration layers (interp_norm.core.model.Calibration). n_epochs (of 250
# steps) defaults to the cpu preset's 40 (10k steps); the "-30k" runs train three times as long, with
# the cosine schedule stretched over the whole run, to measure what longer training does to attention
# temperature and circuit collapse.
REFERENCE = {
    "pre": ("pre", 0, "none"),
    "pre-s1": ("pre", 1, "none"),
    "qkv": ("qkv", 0, "none"),
    "qkv-s1": ("qkv", 1, "none"),
    "qk": ("qk", 0, "none"),
    "none": ("none", 0, "none"),
    "pre-cal": ("pre", 0, "paper"),
    "qkv-cal": ("qkv", 0, "paper"),
    "pre-cal-s1": ("pre", 1, "paper"),
    "qkv-cal-s1": ("qkv", 1, "paper"),
    "pre-30k": ("pre", 0, "none", 120),
    "pre-30k-s1": ("pre", 1, "none", 120),
    "qkv-30k": ("qkv", 0, "none", 120),  # the QKV-Norm side of the 30k comparison
    "qkv-30k-s1": ("qkv", 1, "none", 120),
}
# Seeds 2-5 of the four arms the findings compare (>= 6 seeds per arm), same recipe as
# seeds 0-1; ordered by seed so that every arm grows together when they are trained two at a time.
for _seed in range(2, 6):
    for _arm, _norm, _cal in (("pre", "pre", "none"), ("qkv", "qkv", "none"),
                              ("pre-cal", "pre", "paper"), ("qkv-cal", "qkv", "paper")):
        REFERENCE[f"{_arm}-s{_seed}"] = (_norm, _seed, _cal)


def train_one(name: str, runs: Path, data: Path, progress: bool = True) -> None:
    from interp_norm import AdditionTask, ModelConfig
    from interp_norm import load_with_info
    from interp_norm.training.checkpoints import latest_checkpoint, read_checkpoint_info, save_checkpoint
    from interp_norm.training.train import train
    from interp_norm.training.config import TrainConfig

    attn_norm, seed, calibration, *epochs = REFERENCE[name]
    model_cfg = ModelConfig.preset("cpu", attn_norm=attn_norm, seed=seed, calibration=calibration)
    task = AdditionTask.preset("cpu")
    train_cfg = TrainConfig.preset("cpu", seed=seed, **({"n_epochs": epochs[0]} if epochs else {}))
    shipped = data / name / "metrics.json"
    last = latest_checkpoint(runs / name)
    finished_before = last is not None and bool(read_checkpoint_info(last, verify=False).metrics.get("final"))
    t0 = time.perf_counter()
    train(model_cfg, task, train_cfg, runs / name, resume=True, progress=progress)
    seconds = time.perf_counter() - t0
    model, info = load_with_info(runs / name)
    metrics = dict(info.metrics)
    if finished_before and shipped.exists():  # nothing was trained now: keep the training time measured then
        seconds = json.loads(shipped.read_text()).get("train_seconds", seconds)
    metrics.setdefault("train_seconds", round(seconds, 1))
    metrics["threads"] = train_cfg.threads
    metrics["name"] = name
    if epochs:  # not the reference recipe: its own set, analysed on request (see README)
        metrics["set"] = f"{epochs[0] * train_cfg.steps_per_epoch // 1000}k steps"
    save_checkpoint(model, data / name, task=info.task, train_cfg=info.train_cfg, metrics=metrics, curve=info.curve, step=info.step)
    print(f"{name}: {seconds:.0f} s -> {data / name}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help=f"any of {list(REFERENCE)}")
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--jobs", type=int, default=1, help="parallel runs (one thread each)")
    ap.add_argument("--runs", default=str(ROOT / "runs"))
    ap.add_argument("--data", default=str(ROOT / "data" / "checkpoints"))
    args = ap.parse_args()
    names = list(REFERENCE) if args.all else args.names
    unknown = [n for n in names if n not in REFERENCE]
    if unknown or not names:
        ap.error(f"name one or more of {list(REFERENCE)} (or --all); unknown: {unknown}")
    if len(names) == 1 or args.jobs == 1:
        for n in names:
            train_one(n, Path(args.runs), Path(args.data))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    pending, running = list(names), []
    while pending or running:
        while pending and len(running) < args.jobs:
            n = pending.pop(0)
            log = open(Path(args.runs).mkdir(parents=True, exist_ok=True) or Path(args.runs) / f"{n}.log", "w")
            cmd = [sys.executable, __file__, n, "--runs", args.runs, "--data", args.data]
            running.append((n, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)))
        time.sleep(2)
        for n, p in list(running):
            if p.poll() is not None:
                running.remove((n, p))
                print(f"{n}: exit {p.returncode} (log: {args.runs}/{n}.log)", flush=True)
                if p.returncode:
                    sys.exit(p.returncode)


if __name__ == "__main__":
    main()
