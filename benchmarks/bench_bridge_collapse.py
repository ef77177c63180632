"""Circuit collapse on a Qwen3-shaped bridge: bridge_collapse vs re-running each layer per draw.

Model: a random Qwen3 (per-head RMS QK-Norm before RoPE, grouped k/v heads) built offline with
``interp_norm.anatomy.tiny_hf_model`` at 8 layers, 16 query / 8 key-value heads, d_head 64,
d_model 1024, on 512 tokens; ``sharpness`` multiplies the score factor so random weights give
sparse rows (as trained models have). Noise after the q/k norms (before them the norm removes it).

Three methods, each giving the loose decision of every sparse row at every (layer, level, draw):

* rerun (the issue's baseline): per (layer, level, draw), the layer's Hugging Face attention
  module (an untouched copy of the bridged model's) called again on its cached clean input,
  with forward hooks on ``q_norm``/``k_norm`` multiplying |q| and |k| by 1+κ; argmax of the
  pattern it returns. Timed on ``--rerun-draws`` draws.
* einsum (a stricter baseline): per (layer, level, draw), one einsum of the cached, noised,
  rotated q and k and a masked softmax — no projections. Timed on ``--naive-draws`` draws.
* fast: ``collapse_chunks`` (the engine of ``bridge_collapse``; predictions not timed) on
  ``--draws`` draws.

Before the timings are trusted, the decisions of each baseline are checked equal to fast's on the
baseline's draws (rows whose noised top-2 gap is below float32 resolution excepted, and counted).
Per draw = time beyond the one clean forward each method needs, divided by draws.

Peak memory, per ``--max-elements`` setting, in a fresh child process: the kernel's high-water
mark of resident memory (VmHWM in /proc/self/status) is reset just before the sweep by writing 5
to /proc/self/clear_refs, and read after it; glibc is told to return freed blocks to the kernel
(MALLOC_MMAP_THRESHOLD_, malloc_trim) so memory freed by model construction cannot hide the
sweep's own. The sweep includes its clean forward, so the forward alone is measured the same way
as the floor that does not depend on ``max_elements``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_bridge_collapse.py
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import json
import math
import os
import re
import subprocess
import sys
import time

import torch

from interp_norm.anatomy import anatomy, bridge_from_hf, random_tokens, tiny_hf_model
from interp_norm.noise import collapse_chunks, collapse_kappa
from interp_norm.anatomy.rebuild import attention_mask, rebuilt_query_key
from interp_norm.core.defaults import SPARSE_THRESHOLD

SHAPE = dict(n_layers=8, d_model=1024, n_heads=16, n_kv_heads=8, d_head=64, vocab=1000, n_ctx=512)


def build(args, keep_hf=False):
    hf = tiny_hf_model("qwen3", seed=0, sharpness=args.sharpness, **SHAPE)
    ref = copy.deepcopy(hf).eval() if keep_hf else None  # the bridge replaces hf's submodules in place
    model = bridge_from_hf(hf, name="qwen3-shaped")
    return model, ref, random_tokens(model, args.batch, args.pos, seed=1)


@torch.no_grad()
def rerun(ref, tokens, levels, draws, seed, anat):
    """Decisions per layer from the HF attention module re-run per (level, draw) on its cached input.
    Returns ({layer: (loose [L, D, b, h, q], sparse [b, h, q], top-2 gap of each noised row)}, seconds)."""
    inputs = {}
    handles = [layer.self_attn.register_forward_pre_hook(
        lambda mod, args, kwargs, l=l: inputs.__setitem__(l, (args, kwargs)), with_kwargs=True)
        for l, layer in enumerate(ref.model.layers)]
    ref(tokens, use_cache=False)  # no KV cache: each re-run sees the same 512 keys
    for h in handles:
        h.remove()
    b, n = tokens.shape
    out = {}
    t0 = time.perf_counter()
    for l, layer in enumerate(ref.model.layers):
        attn, (args, kwargs) = layer.self_attn, inputs[l]
        scale = {}
        hooks = [attn.q_norm.register_forward_hook(lambda m, i, o: o * scale["q"][..., None] if scale else o),
                 attn.k_norm.register_forward_hook(lambda m, i, o: o * scale["k"][..., None] if scale else o)]
        clean = attn(*args, **kwargs)[1]  # [b, h, q, k]
        tstar, sparse = clean.argmax(-1), clean.max(-1).values >= SPARSE_THRESHOLD
        sparse[..., 0] = False
        z_q, z_k = collapse_kappa(anat, l, b, n, draws, seed)
        loose = torch.zeros(len(levels), draws, *tstar.shape, dtype=torch.bool)
        gap = torch.zeros(len(levels), draws, *tstar.shape)
        for i, level in enumerate(levels):
            for d in range(draws):
                scale.update(q=1 + level * z_q[d], k=1 + level * z_k[d])
                p = attn(*args, **kwargs)[1]
                top2 = p.topk(2, -1).values
                loose[i, d], gap[i, d] = (p.argmax(-1) != tstar) & sparse, top2[..., 0] - top2[..., 1]
        scale.clear()
        for h in hooks:
            h.remove()
        out[l] = (loose, sparse, gap)
    return out, time.perf_counter() - t0


@torch.no_grad()
def einsum_naive(model, tokens, levels, draws, seed):
    """Decisions per layer from one einsum of the cached noised q·k and a softmax per (level, draw)."""
    anat = anatomy(model)
    _, cache = model.run_with_cache(tokens)
    b, n = tokens.shape
    out = {}
    for la in anat.layers:
        q, k = rebuilt_query_key(model, cache, anat, la.layer)
        k = k[:, :, list(la.kv_head_of)]
        z_q, z_k = collapse_kappa(anat, la.layer, b, n, draws, seed)
        mask = attention_mask(la, n)
        clean = (torch.einsum("bqhd,bkhd->bhqk", q, k) * la.score_scale).masked_fill(~mask, -math.inf).softmax(-1)
        tstar, sparse = clean.argmax(-1), clean.max(-1).values >= SPARSE_THRESHOLD
        sparse[..., 0] = False
        loose = torch.zeros(len(levels), draws, *tstar.shape, dtype=torch.bool)
        gap = torch.zeros(len(levels), draws, *tstar.shape)
        for i, level in enumerate(levels):
            for d in range(draws):
                qn = q * (1 + level * z_q[d])[..., None]
                kn = k * (1 + level * z_k[d][:, :, list(la.kv_head_of)])[..., None]
                p = (torch.einsum("bqhd,bkhd->bhqk", qn, kn) * la.score_scale).masked_fill(~mask, -math.inf).softmax(-1)
                top2 = p.topk(2, -1).values
                loose[i, d], gap[i, d] = (p.argmax(-1) != tstar) & sparse, top2[..., 0] - top2[..., 1]
        out[la.layer] = (loose, sparse, gap)
    return out


def fast(model, tokens, levels, draws, seed, max_elements):
    return list(collapse_chunks(model, tokens, levels, draws=draws, targets=("q", "k"), placement="after_norm",
                                seed=seed, max_elements=max_elements))


def check_equal(ref, chunks, draws, tol=1e-5):
    """(decisions compared, excepted as float32 near-ties, different, sparse rows only one side has
    with the other's max attention off the threshold by > tol)."""
    compared = excepted = differ = rows_differ = 0
    per_layer = {}
    for c in chunks:
        per_layer.setdefault(c.layer, []).append(c)
    for l, cs in per_layer.items():
        loose, sparse, gap = ref[l]
        rows = torch.cat([c.rows for c in cs])
        got = torch.cat([c.loose[:, :draws] for c in cs], -1)
        mine = torch.zeros_like(sparse)
        mine[rows[:, 0], rows[:, 1], rows[:, 2]] = True
        rows_differ += int((mine != sparse).sum())  # reported; rows on the threshold may differ in float32
        b, h, q = rows.unbind(-1)
        keep = sparse[b, h, q]
        want, g = loose[:, :, b, h, q][..., keep], gap[:, :, b, h, q][..., keep]
        got = got[..., keep]
        sure = g > tol
        compared += int(sure.sum())
        excepted += int((~sure).sum())
        differ += int((want != got)[sure].sum())
    return compared, excepted, differ, rows_differ


def status():
    text = open("/proc/self/status").read()
    return {k: int(re.search(k + r":\s+(\d+) kB", text).group(1)) / 1024 for k in ("VmRSS", "VmHWM")}


def child(args):
    """Peak resident memory (MB) of the clean forward alone and of one fast sweep, each above the
    resident memory just before it (high-water mark reset through /proc/self/clear_refs)."""
    model, _, tokens = build(args)
    anat = anatomy(model)
    libc = ctypes.CDLL("libc.so.6")

    def peak(fn):
        libc.malloc_trim(0)
        before = status()["VmRSS"]
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        t0 = time.perf_counter()
        fn()
        return status()["VmHWM"] - before, time.perf_counter() - t0

    wanted = {la.hooks[f"{t}_rot" if la.rope_from_hooks else la.used(t)] for la in anat.layers for t in "qk"}  # as the sweep
    with torch.no_grad():
        fwd_mb, _ = peak(lambda: model.run_with_cache(tokens, names_filter=lambda name: name in wanted))
    sweep_mb, seconds = peak(lambda: fast(model, tokens, args.levels, args.draws, args.seed, args.child))
    print(json.dumps(dict(max_elements=args.child, forward_mb=fwd_mb, sweep_mb=sweep_mb, seconds=seconds)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--pos", type=int, default=512)
    ap.add_argument("--draws", type=int, default=64)
    ap.add_argument("--rerun-draws", type=int, default=2)
    ap.add_argument("--naive-draws", type=int, default=4)
    ap.add_argument("--levels", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    ap.add_argument("--sharpness", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-elements", type=int, nargs="+", default=[1 << 18, 1 << 20, 1 << 22, 1 << 24])
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.child is not None:
        return child(args)
    print("command:", " ".join(["python"] + sys.argv))
    model, ref, tokens = build(args, keep_hf=True)
    an = anatomy(model)
    la = an[0]
    print(f"model: Qwen3-shaped, {an.n_layers} layers, {la.n_heads} heads / {la.n_kv_heads} kv heads, d_head {la.d_head}, "
          f"{tokens.shape[1]} tokens x {tokens.shape[0]}; levels {args.levels}; after_norm, targets q,k")
    with torch.no_grad():
        model.run_with_cache(tokens)  # warm-up
        t0 = time.perf_counter()
        model.run_with_cache(tokens)
        t_fwd = time.perf_counter() - t0
    t0 = time.perf_counter()
    chunks = fast(model, tokens, args.levels, args.draws, args.seed, args.max_elements[-1])
    t_fast = time.perf_counter() - t0
    n_rows = sum(len(c.rows) for c in chunks)
    print(f"sparse rows: {n_rows} of {tokens.shape[0] * la.n_heads * (tokens.shape[1] - 1) * an.n_layers}")
    t0 = time.perf_counter()
    ein = einsum_naive(model, tokens, args.levels, args.naive_draws, args.seed)
    t_ein = time.perf_counter() - t0
    re_dec, t_re = rerun(ref, tokens, args.levels, args.rerun_draws, args.seed, an)
    for name, dec, d in (("rerun", re_dec, args.rerun_draws), ("einsum", ein, args.naive_draws)):
        compared, excepted, differ, rows_differ = check_equal(dec, chunks, d)
        print(f"{name:6s} vs fast on {d} draws: {compared} decisions compared, {differ} different, {excepted} "
              f"excepted (noised top-2 gap <= 1e-5); sparse rows on one side only: {rows_differ}")
        assert differ == 0, f"fast and {name} decisions differ"
    per_fast = (t_fast - t_fwd) / args.draws
    per_re = t_re / args.rerun_draws  # the capture forward is not counted
    per_ein = (t_ein - t_fwd) / args.naive_draws
    sweep = lambda per: t_fwd + per * args.draws  # noqa: E731
    print(f"clean forward (each method runs one): {t_fwd:.2f} s; per draw = all {an.n_layers} layers x "
          f"{len(args.levels)} levels, beyond that forward")
    print(f"{'method':<52s} {'s/draw':>8s} {'sweep of ' + str(args.draws) + ' draws':>18s} {'fast is':>8s}")
    rows = [("rerun: HF attention module re-run per layer & draw", per_re, sweep(per_re), "extrapolated"),
            ("einsum: cached q,k; one einsum+softmax per layer", per_ein, sweep(per_ein), "extrapolated"),
            ("fast: bridge_collapse engine (collapse_chunks)", per_fast, t_fast, "measured")]
    for name, per, total, how in rows:
        print(f"{name:<52s} {per:8.4f} {total:9.1f} s ({how:>5s}) {per / per_fast:6.0f}x per draw, "
              f"{total / t_fast:5.0f}x sweep")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    print("peak resident memory above the level just before (fresh child per setting):")
    for me in args.max_elements:
        cmd = [sys.executable, __file__, "--child", str(me), "--batch", str(args.batch), "--pos", str(args.pos),
               "--draws", str(args.draws), "--sharpness", str(args.sharpness), "--seed", str(args.seed),
               "--levels", *map(str, args.levels)]
        res = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout.strip().splitlines()[-1])
        print(f"  max_elements={me:>9d} ({me * 8 / 2**20:5.0f} MB as float64): clean forward alone "
              f"{res['forward_mb']:6.1f} MB; whole sweep {res['sweep_mb']:6.1f} MB "
              f"(= {(res['sweep_mb'] - res['forward_mb']) / (me * 8 / 2**20):5.1f} float64 blocks above the forward); "
              f"{res['seconds']:.2f} s")


if __name__ == "__main__":
    main()
