"""Circuit collapse on a Qwen3-shaped bridge: bridge_collapse vs re-running each layer's attention per draw.

Model: a random Qwen3 (per-head RMS QK-Norm before RoPE, grouped k/v heads) built offline with
``interp_norm.bridges.tiny_hf_model`` at 8 layers, 16 query / 8 key-value heads, d_head 64,
d_model 1024, on 512 tokens; ``sharpness`` multiplies the score factor so random weights give
sparse rows (as trained models have). Noise after the q/k norms (before them the norm removes it).

naive: per (layer, level, draw), the layer's attention recomputed from the noised q and k
(scores of all heads, masked softmax, argmax of every row); timed on ``--naive-draws`` draws and
reported per draw. fast: ``collapse_chunks`` (the engine of ``bridge_collapse``; predictions not
timed) on ``--draws`` draws, per draw. Before timing, the decisions of both on the naive's draws
are checked equal (rows whose top-2 gap is below float32 resolution excepted). Peak memory of the
fast sweep is measured in a child process per ``--max-elements`` setting (ru_maxrss above the
loaded model's).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_bridge_collapse.py
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time

import torch

from interp_norm.bridges import anatomy, bridge_from_hf, collapse_chunks, collapse_kappa, random_tokens, tiny_hf_model
from interp_norm.bridges.rebuild import attention_mask, rebuilt_query_key
from interp_norm.hooks import SPARSE_THRESHOLD

SHAPE = dict(n_layers=8, d_model=1024, n_heads=16, n_kv_heads=8, d_head=64, vocab=1000, n_ctx=512)


def build(args):
    model = bridge_from_hf(tiny_hf_model("qwen3", seed=0, sharpness=args.sharpness, **SHAPE), name="qwen3-shaped")
    return model, random_tokens(model, args.batch, args.pos, seed=1)


@torch.no_grad()
def naive(model, tokens, levels, draws, seed):
    """Decisions [level, draw, b, h, q] per layer, from a per-draw recompute of the layer's softmax."""
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
        for i, level in enumerate(levels):
            for d in range(draws):
                qn = q * (1 + level * z_q[d])[..., None]
                kn = k * (1 + level * z_k[d][:, :, list(la.kv_head_of)])[..., None]
                p = (torch.einsum("bqhd,bkhd->bhqk", qn, kn) * la.score_scale).masked_fill(~mask, -math.inf).softmax(-1)
                loose[i, d] = (p.argmax(-1) != tstar) & sparse
        out[la.layer] = (loose, sparse, clean)
    return out


def fast(model, tokens, levels, draws, seed, max_elements):
    return list(collapse_chunks(model, tokens, levels, draws=draws, targets=("q", "k"), placement="after_norm",
                                seed=seed, max_elements=max_elements))


def check_equal(ref, chunks, draws):
    compared = differ = 0
    for c in chunks:
        loose, sparse, clean = ref[c.layer]
        b, h, q = c.rows.unbind(-1)
        assert bool(sparse[b, h, q].all()) and int(sparse[:, list(c.heads)].sum()) == len(c.rows), "different rows"
        top2 = clean[b, h, q].topk(2, -1).values
        want = loose[:, :, b, h, q]
        got = c.loose[:, :draws]
        sure = (top2[:, 0] - top2[:, 1]) > 1e-6
        compared += int(sure.sum()) * want.shape[0] * want.shape[1]
        differ += int((want != got)[..., sure].sum())
    return compared, differ


def child(args):
    """Peak RSS of one fast sweep (its filtered clean forward included) above the loaded model's."""
    model, tokens = build(args)
    anatomy(model)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    fast(model, tokens, args.levels, args.draws, args.seed, args.child)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps(dict(max_elements=args.child, extra_mb=(peak - base) / 1024, seconds=seconds)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--pos", type=int, default=512)
    ap.add_argument("--draws", type=int, default=64)
    ap.add_argument("--naive-draws", type=int, default=4)
    ap.add_argument("--levels", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    ap.add_argument("--sharpness", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-elements", type=int, nargs="+", default=[1 << 20, 1 << 24])
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        return child(args)
    torch.set_num_threads(1)
    print("command:", " ".join([sys.executable.split("/")[-1]] + sys.argv))
    model, tokens = build(args)
    an = anatomy(model)
    la = an[0]
    print(f"model: Qwen3-shaped, {an.n_layers} layers, {la.n_heads} heads / {la.n_kv_heads} kv heads, d_head {la.d_head}, "
          f"{tokens.shape[1]} tokens x {tokens.shape[0]}; levels {args.levels}")
    with torch.no_grad():
        model.run_with_cache(tokens)  # warm-up
        t0 = time.perf_counter()
        model.run_with_cache(tokens)
        t_fwd = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = naive(model, tokens, args.levels, args.naive_draws, args.seed)
    t_naive = time.perf_counter() - t0
    t0 = time.perf_counter()
    chunks = fast(model, tokens, args.levels, args.draws, args.seed, args.max_elements[-1])
    t_fast = time.perf_counter() - t0
    compared, differ = check_equal(ref, chunks, args.naive_draws)
    n_rows = sum(len(c.rows) for c in chunks)
    print(f"sparse rows: {n_rows} of {tokens.shape[0] * la.n_heads * (tokens.shape[1] - 1) * an.n_layers}; "
          f"collapse decisions compared on {args.naive_draws} draws: {compared}, different: {differ}")
    assert differ == 0, "fast and naive decisions differ"
    per_naive = (t_naive - t_fwd) / args.naive_draws
    per_fast = (t_fast - t_fwd) / args.draws
    print(f"clean forward (both methods run it once): {t_fwd:.2f} s")
    print(f"naive (recompute each layer's attention per draw): {t_naive:.2f} s for {args.naive_draws} draws "
          f"= {per_naive:.3f} s/draw beyond the forward")
    print(f"fast  (bridge_collapse engine):                    {t_fast:.2f} s for {args.draws} draws "
          f"= {per_fast:.4f} s/draw beyond the forward (score blocks included)")
    print(f"ratio per draw: {per_naive / per_fast:.0f}x; whole sweep of {args.draws} draws: naive "
          f"{t_fwd + per_naive * args.draws:.1f} s (extrapolated) vs fast {t_fast:.1f} s = "
          f"{(t_fwd + per_naive * args.draws) / t_fast:.0f}x")
    for me in args.max_elements:
        cmd = [sys.executable, __file__, "--child", str(me), "--batch", str(args.batch), "--pos", str(args.pos),
               "--draws", str(args.draws), "--sharpness", str(args.sharpness), "--seed", str(args.seed),
               "--levels", *map(str, args.levels)]
        res = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
        print(f"max_elements={me:>9d} ({me * 8 / 2**20:6.0f} MB per float64 block): peak RSS above the loaded "
              f"model {res['extra_mb']:7.1f} MB, {res['seconds']:.2f} s")


if __name__ == "__main__":
    main()
