"""Batched exact patching vs TransformerLens's patching on the same cells, in one run.

Patches every (layer, position, head) cell of ``z`` (TransformerLens's
``get_act_patch_attn_head_out_by_pos``) on ``ModelConfig.preset("cpu")`` with a realistic batch of
clean/corrupted addition pairs -- aligned pairs (one token layout, what per-position tables use)
and unaligned ones (mixed lengths) -- checks that both give the same table (max |diff| <= 1e-5),
and prints both times and the speed ratio (target >= 20x). Single-threaded for fairness; the
ratio uses process CPU time (robust on a shared machine), wall time is printed too:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_patching.py [--pairs 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from transformer_lens import patching  # noqa: E402

from interp_norm import AdditionTask, HookedNormTransformer, ModelConfig  # noqa: E402
from interp_norm.circuits import LogitDiff, activation_patch, make_pairs  # noqa: E402

TL_FN = {
    "z": patching.get_act_patch_attn_head_out_by_pos,
    "q": patching.get_act_patch_attn_head_q_by_pos,
    "v": patching.get_act_patch_attn_head_v_by_pos,
    "resid_pre": patching.get_act_patch_resid_pre,
}


def bench(model, pairs, activation: str, repeats: int, batch_size: int) -> dict:
    metric = LogitDiff(pairs)
    with torch.no_grad():
        _, clean_cache = model.run_with_cache(pairs.clean_tokens)

    def run_tl():
        with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):  # TL's tqdm bar
            return TL_FN[activation](model, pairs.corrupted_tokens, clean_cache, metric.mean)

    def run_ours(method):
        return activation_patch(
            model, pairs.corrupted_tokens, clean_cache, metric, activation, method=method, batch_size=batch_size
        ).values

    ref = run_tl()  # also warms up
    for method in ("incremental", "hooks"):
        diff = float((run_ours(method) - ref).abs().max())
        assert diff <= 1e-5, f"{method} differs from TransformerLens by {diff}"
    keys = ("tl", "incremental", "hooks")
    cpu: dict[str, list[float]] = {k: [] for k in keys}
    wall: dict[str, list[float]] = {k: [] for k in keys}
    for _ in range(repeats):  # interleaved, so all three see the same machine load
        for key in keys:
            c0, w0 = time.process_time(), time.perf_counter()
            run_tl() if key == "tl" else run_ours(key)
            cpu[key].append(time.process_time() - c0)
            wall[key].append(time.perf_counter() - w0)
    return dict(
        cells=ref.numel(), n_pos=pairs.n_pos,
        cpu={k: statistics.median(v) for k, v in cpu.items()}, wall={k: statistics.median(v) for k, v in wall.items()},
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--attn-norm", default="pre")
    ap.add_argument("--activation", default="z", choices=sorted(TL_FN))
    ap.add_argument("--batch-size", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(1)

    model = HookedNormTransformer(ModelConfig.preset("cpu", attn_norm=args.attn_norm)).eval()
    task = AdditionTask.preset("cpu")
    print(f"model: ModelConfig.preset('cpu', attn_norm={args.attn_norm!r}); {args.pairs} pairs; activation "
          f"{args.activation!r} by position; every table checked equal to TransformerLens (max |diff| <= 1e-5)")
    ratios = []
    for aligned in (True, False):
        pairs = make_pairs(task, args.pairs, "id", seed=0, aligned=aligned)
        r = bench(model, pairs, args.activation, args.repeats, args.batch_size)
        label = "aligned pairs  " if aligned else "unaligned pairs"
        print(f"\n{label}: {r['cells']} cells ({r['n_pos']} positions)")
        for key, name in (("tl", "TransformerLens patching"), ("incremental", "batched, incremental"), ("hooks", "batched, hooks")):
            c, w = r["cpu"][key], r["wall"][key]
            extra = "" if key == "tl" else f"   speed-up {r['cpu']['tl'] / c:5.1f}x cpu, {r['wall']['tl'] / w:5.1f}x wall"
            print(f"  {name:<26} cpu {c:7.3f} s  wall {w:7.3f} s  ({c / r['cells'] * 1e3:6.3f} ms/cell){extra}")
        ratios.append(r["cpu"]["tl"] / r["cpu"]["incremental"])
    print(f"\nSPEED RATIO (TransformerLens / batched incremental, cpu time): aligned {ratios[0]:.1f}x, "
          f"unaligned {ratios[1]:.1f}x  (target >= 20x)")


if __name__ == "__main__":
    main()
