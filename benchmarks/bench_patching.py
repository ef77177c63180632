"""Batched exact patching vs TransformerLens 4.3's ``transformer_lens.patching``, every activation, same cells.

1. **Ratio table** -- ``ModelConfig.preset("cpu")``, 32 aligned clean/corrupted addition pairs of the
   cpu task (``run_circuits``'s defaults), logit-difference metric. For every activation (resid_pre,
   resid_mid, resid_post, attn_out, mlp_out, z, q, k, v, pattern; by position) both tables are
   computed and checked equal (max |diff| <= 1e-5) first; then TransformerLens and ours are timed
   alternately in each repeat, so machine load hits both alike. Time is this process's CPU time
   (median); the ratio is TransformerLens / ours. Target >= 30x. Beside it, the arithmetic each
   side does, in forward passes: TransformerLens one per cell; ours the corrupted run plus every
   block row the engine recomputes (``PatchResult.rows_computed`` / rows of one forward). Their
   quotient ("bound") is the ratio exact recomputation reaches at equal cost per row; "row cost"
   (bound / ratio) is what one of our recomputed rows costs against one row of TransformerLens's
   forward pass (below 1: the engine's fused kernels beat the model's own forward). Where the bound
   is below 30, reaching 30x needs rows that much cheaper than the model's own. "ceiling": the
   ratio if every recomputed row cost what a row of the engine's own *dense* fused forward costs
   (its blocks on the whole corrupted batch, timed in the same rounds) and the table around the
   rows (cells, chunks, metric) cost nothing: what exact recomputation reaches with a perfect
   ragged-row executor on this machine.
2. **Scaling** (``z`` by position): time and peak memory as the number of cells (explicit cell
   subsets), pairs, and the model size grow, up to the paper's size (10 layers, d_model 512,
   12 heads of 64). TransformerLens is timed on the same cells (or, for the larger models, on a
   sample of cells, checked equal there: its cost is one forward pass per cell). Memory is the peak
   of the tensors a call allocates (from the profiler's allocation events, in a separate untimed run).

Single-threaded for fairness:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_patching.py [--pairs 32] [--repeats 5] [--no-scaling]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from transformer_lens import patching  # noqa: E402

from interp_norm import AdditionTask, HookedNormTransformer, ModelConfig  # noqa: E402
from interp_norm.circuits import LogitDiff, activation_patch, make_pairs  # noqa: E402
from interp_norm.circuits.exact.engine import IncrementalEngine  # noqa: E402

TOL = 1e-5
TL_FN = {
    "resid_pre": patching.get_act_patch_resid_pre,
    "resid_mid": patching.get_act_patch_resid_mid,
    "resid_post": lambda m, x, c, f: patching.generic_activation_patch(
        m, x, c, f, patching.layer_pos_patch_setter, "resid_post", index_axis_names=("layer", "pos")),
    "attn_out": patching.get_act_patch_attn_out,
    "mlp_out": patching.get_act_patch_mlp_out,
    "z": patching.get_act_patch_attn_head_out_by_pos,
    "q": patching.get_act_patch_attn_head_q_by_pos,
    "k": patching.get_act_patch_attn_head_k_by_pos,
    "v": patching.get_act_patch_attn_head_v_by_pos,
    "pattern": patching.get_act_patch_attn_head_pattern_by_pos,
}
SIZES = {  # model size series for the scaling section
    "tiny": ModelConfig.preset("tiny"),
    "cpu": ModelConfig.preset("cpu"),
    "mid": ModelConfig(d_model=256, d_head=32, n_heads=8, n_layers=6, d_mlp=512, n_freq=32, head_hidden=(256,), n_ctx=40),
    "paper": ModelConfig.preset("paper", n_ctx=40),
}


def quiet(fn, *args, **kw):
    with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):  # TL's tqdm bar
        return fn(*args, **kw)


def cpu_time(fn) -> tuple[float, object]:
    c = time.process_time()
    out = fn()
    return time.process_time() - c, out


@contextlib.contextmanager
def _quiet_fd2():
    """Silence the C++ side's stderr (the profiler's "USDT ... profiler_start/stop" lines)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def peak_mb(fn) -> float:
    """Peak memory allocated by tensors while ``fn`` runs, in MB: the running sum of the profiler's
    allocation and free events (the allocator's reuse of freed memory hides this from the RSS)."""
    with _quiet_fd2(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cur = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        cur += e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        peak = max(peak, cur)
    return peak / 2**20


def matmul_profile(fn) -> dict:
    """One run of ``fn`` under the profiler: its CPU ms (ops' own time), the matrix products' share of
    it (``mm``/``addmm``/``bmm``) and their multiply-accumulates, counted from the input shapes."""
    with _quiet_fd2(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    total = mm_ms = macs = 0.0
    for e in prof.key_averages(group_by_input_shape=True):
        total += e.self_cpu_time_total / 1e3
        shapes = [s for s in e.input_shapes if s]
        if e.key in ("aten::mm", "aten::addmm", "aten::bmm"):
            mm_ms += e.self_cpu_time_total / 1e3
            a, b = shapes[-2:]  # addmm's bias comes first
            macs += e.count * math.prod(a) * b[-1]
    return dict(ms=total, mm_ms=mm_ms, gmac=macs / 1e9)


def peak_gmacs(m: int = 512, k: int = 768, n: int = 3072, repeats: int = 20) -> float:
    """This machine's rate for one large matrix product (GMAC/s), the yardstick of the rates above."""
    x, w = torch.randn(m, k), torch.randn(k, n)
    x @ w
    t = time.perf_counter()
    for _ in range(repeats):
        x @ w
    return m * k * n * repeats / (time.perf_counter() - t) / 1e9


def interleaved(runs: dict, repeats: int, ours_per_round: int = 3, first: dict | None = None) -> dict[str, float]:
    """Median CPU time of each run, TransformerLens and ours alternating within each round
    (``first``: times of a round already measured)."""
    times: dict[str, list[float]] = {k: list(first.get(k, [])) if first else [] for k in runs}
    for _ in range(max(1, repeats - (1 if first else 0))):
        for key, fn in runs.items():
            for _ in range(1 if key == "tl" else ours_per_round):
                times[key].append(cpu_time(fn)[0])
    return {k: statistics.median(v) for k, v in times.items()}


def checked_round(tl, ours, compare) -> tuple[dict, float, object]:
    """One timed round (ours warmed up first) whose results are checked equal: (times, max |diff|, our result)."""
    ours()
    t_tl, ref = cpu_time(tl)
    t_ours, res = cpu_time(ours)
    diff = compare(res, ref)
    assert res.method == "exact-incremental" and diff <= TOL, f"differs from TransformerLens by {diff}"
    return {"tl": [t_tl], "ours": [t_ours]}, diff, res


def fmt_mb(x: float) -> str:
    return f"{x:6.1f}"


# ----------------------------------------------------------------------------- 1. ratio table


def ratio_table(model, pairs, repeats: int, batch_size: int) -> list[float]:
    metric = LogitDiff(pairs)
    _, cache = model.run_with_cache(pairs.clean_tokens)
    x = pairs.corrupted_tokens
    dense_rows = len(pairs) * pairs.n_pos * model.cfg.n_layers
    engine = IncrementalEngine(model, x, metric.read_mask, exact_pattern=False)
    run_rows = engine.rows_computed  # the corrupted run's rows

    def init():  # the engine's corrupted run, as activation_patch builds it
        return IncrementalEngine(model, x, metric.read_mask, exact_pattern=False)

    @torch.inference_mode()
    def dense():  # the same fused blocks on every row of the corrupted batch
        resid = engine.acts[0]["resid_pre"]  # the embedding
        for l in range(model.cfg.n_layers):
            resid = engine._block(l, resid)["resid_post"]

    print(f"\n1. every activation by position: ModelConfig.preset('cpu', attn_norm={model.cfg.attn_norm!r}), "
          f"{len(pairs)} aligned pairs, {pairs.n_pos} positions; CPU ms (median of {repeats} rounds)")
    print(f"   {'activation':<11}{'cells':>6}{'max|diff|':>11}{'TransformerLens':>17}{'ours':>9}{'ratio':>9}"
          f"{'ours MB':>9}{'ours fwd':>9}{'bound':>8}{'row cost':>10}{'ceiling':>9}")
    ratios = []
    for act, fn in TL_FN.items():
        def tl():
            return quiet(fn, model, x, cache, metric.mean)

        def ours():
            return activation_patch(model, x, cache, metric, act, batch_size=batch_size)

        first, diff, res = checked_round(tl, ours, lambda res, ref: float((res.values - ref).abs().max()))
        n_cells = model.cfg.n_layers * pairs.n_pos * (1 if act in ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out") else model.cfg.n_heads)
        t = interleaved({"tl": tl, "ours": ours, "init": init, "dense": dense}, repeats, first=first)
        mb = peak_mb(ours)
        ratios.append(t["tl"] / t["ours"])
        fwd = res.rows_computed / dense_rows  # forward passes of arithmetic
        ceiling = t["tl"] / (t["init"] + (res.rows_computed - run_rows) * t["dense"] / dense_rows)
        print(f"   {act:<11}{n_cells:>6}{diff:>11.1e}{t['tl'] * 1e3:>17.1f}{t['ours'] * 1e3:>9.2f}"
              f"{ratios[-1]:>8.1f}x{fmt_mb(mb):>9}{fwd:>9.2f}{n_cells / fwd:>7.1f}x{n_cells / fwd / ratios[-1]:>10.2f}"
              f"{ceiling:>8.1f}x")
    return ratios


# ----------------------------------------------------------------------------- 2. scaling


def z_cells(model, n_pos: int) -> pd.DataFrame:
    L, H = model.cfg.n_layers, model.cfg.n_heads
    g = np.stack(np.meshgrid(np.arange(L), np.arange(n_pos), np.arange(H), indexing="ij"), -1).reshape(-1, 3)
    return pd.DataFrame(g, columns=["layer", "pos", "head_index"])


def tl_cells(model, x, cache, metric, cells: pd.DataFrame):
    return quiet(patching.generic_activation_patch, model, x, cache, metric.mean,
                 patch_setter=patching.layer_pos_head_vector_patch_setter, activation_name="z", index_df=cells)


def scaling_point(model, pairs, cells: pd.DataFrame, tl_sample: int, batch_size: int) -> dict:
    """Our z patching of ``cells``, and TransformerLens's on all of them (or a sample: time per cell)."""
    metric = LogitDiff(pairs)
    x = pairs.corrupted_tokens
    _, cache = model.run_with_cache(pairs.clean_tokens)

    def ours():
        return activation_patch(model, x, cache, metric, "z", cells=cells, batch_size=batch_size)

    sample = cells if len(cells) <= tl_sample else cells.sample(tl_sample, random_state=0).sort_index()
    rows = torch.tensor(sample.index.to_numpy())
    first, diff, _ = checked_round(lambda: tl_cells(model, x, cache, metric, sample), ours,
                                lambda res, ref: float((res.values[rows] - ref).abs().max()))
    few = sample.iloc[: min(len(sample), 8)]  # TransformerLens's memory does not grow with the cells
    return dict(cells=len(cells), ours=first["ours"][0], tl=first["tl"][0] * len(cells) / len(sample),
                sampled=len(sample) < len(cells), mb=peak_mb(ours), tl_mb=peak_mb(lambda: tl_cells(model, x, cache, metric, few)),
                diff=diff)


def print_point(label: str, r: dict) -> None:
    est = "~" if r["sampled"] else " "
    print(f"   {label:<28}{r['cells']:>6}{r['ours'] * 1e3:>11.1f}{r['ours'] / r['cells'] * 1e3:>9.3f}"
          f"{est}{r['tl'] * 1e3:>10.0f}{r['tl'] / r['ours']:>8.1f}x{fmt_mb(r['mb']):>9}{fmt_mb(r['tl_mb']):>8}")


def scaling(args) -> None:
    task = AdditionTask.preset("cpu")
    head = (f"   {'':<28}{'cells':>6}{'ours ms':>11}{'ms/cell':>9} {'TL ms':>10}{'ratio':>9}{'ours MB':>9}{'TL MB':>8}")
    print(f"\n2. scaling, z by position (~ = TransformerLens timed on {args.tl_sample} sampled cells, scaled up; "
          "MB = peak tensor memory of one call)")
    model = HookedNormTransformer(ModelConfig.preset("cpu", attn_norm=args.attn_norm)).eval()
    pairs = make_pairs(task, args.pairs, "id", seed=0, aligned=True)
    all_cells = z_cells(model, pairs.n_pos)
    print(f"   cells (cpu model, {args.pairs} pairs):\n{head}")
    for frac in (0.125, 0.25, 0.5, 1.0):
        cells = all_cells.sample(frac=frac, random_state=1).sort_values(["layer", "pos", "head_index"]).reset_index(drop=True)
        print_point(f"{frac:.0%} of the cells", scaling_point(model, pairs, cells, 10**9, args.batch_size))
    print(f"   pairs (cpu model, all cells):\n{head}")
    for n_pairs in (8, 16, 32, 64, 128):
        p = make_pairs(task, n_pairs, "id", seed=0, aligned=True)
        print_point(f"{n_pairs} pairs", scaling_point(model, p, z_cells(model, p.n_pos), 10**9, args.batch_size))
    print(f"   model size ({args.size_pairs} pairs, all cells):\n{head}")
    p = make_pairs(task, args.size_pairs, "id", seed=0, aligned=True)
    for name, cfg in SIZES.items():
        m = HookedNormTransformer(cfg.replace(attn_norm=args.attn_norm)).eval()
        label = f"{name}: L{cfg.n_layers} d{cfg.d_model} H{cfg.n_heads}x{cfg.d_head}"
        print_point(label, scaling_point(m, p, z_cells(m, p.n_pos), args.tl_sample, args.batch_size))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5, help="rounds of interleaved timing for the ratio table")
    ap.add_argument("--attn-norm", default="pre")
    ap.add_argument("--batch-size", type=int, default=1024, help="activation_patch's batch_size (its default)")
    ap.add_argument("--no-scaling", action="store_true", help="only the ratio table")
    ap.add_argument("--size-pairs", type=int, default=8, help="pairs for the model-size series (default 8)")
    ap.add_argument("--tl-sample", type=int, default=24, help="cells TransformerLens runs for the larger models")
    args = ap.parse_args()
    torch.set_num_threads(1)
    w0, c0 = time.perf_counter(), time.process_time()
    model = HookedNormTransformer(ModelConfig.preset("cpu", attn_norm=args.attn_norm)).eval()
    pairs = make_pairs(AdditionTask.preset("cpu"), args.pairs, "id", seed=0, aligned=True)
    ratios = ratio_table(model, pairs, args.repeats, args.batch_size)
    print(f"   SPEED RATIO (TransformerLens / ours, CPU time): min {min(ratios):.1f}x, median "
          f"{statistics.median(ratios):.1f}x over {len(ratios)} activations (target >= 30x each)")
    if not args.no_scaling:
        scaling(args)
    print(f"\ntotal: {time.perf_counter() - w0:.0f} s wall, {time.process_time() - c0:.0f} s CPU")


if __name__ == "__main__":
    main()
