"""Circuit-collapse sweep: vectorised from one clean cache vs the naive per-draw re-run (target >= 50x).

The naive method is what one writes first: for every (level, draw, layer), re-run the whole model
with hooks that scale that layer's q and k by the draw's (1+κ), and read the layer's scores and
pattern. The fast method (``noise.collapse_decisions``) runs the model once, caches the clean
scores and evaluates every draw as (1+κ_q)(1+κ_k)·w in one vectorised pass. Both use the same
draws (``noise.collapse_noise_draws``); the script asserts identical loose and strict decisions,
then prints both times and the ratio. The theory's prediction is not part of either timing.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_collapse.py [--ckpt PATH] [--n 64] [--draws 16]
"""

from __future__ import annotations

import argparse
import time

import torch

from interp_norm import AdditionTask, HookedNormTransformer, ModelConfig
from interp_norm import noise as N
from interp_norm.core.defaults import SPARSE_THRESHOLD
from interp_norm.core.hook_names import act_name, noise_site
from interp_norm.core.task import PAD_ID


@torch.no_grad()
def naive(model, tokens, levels, n_draws, placement, seed, sparse_threshold=SPARSE_THRESHOLD,
          strict_threshold=SPARSE_THRESHOLD):
    """Per (level, draw, layer): one full forward pass with that layer's q and k scaled."""
    cfg = model.cfg
    b, n = tokens.shape
    lengths = (tokens != PAD_ID).sum(-1)
    _, clean = model.run_with_cache(tokens)
    out = []
    for l in range(cfg.n_layers):
        pat = clean[act_name("pattern", l)]
        q = torch.arange(n)
        rows = ((pat.max(-1).values >= sparse_threshold) & (q >= 1) & (q < lengths[:, None, None])).nonzero()
        rb, rh, rq = rows.unbind(-1)
        tstar = clean[act_name("attn_scores", l)][rb, rh, rq].argmax(-1)
        z_q, z_k = N.collapse_noise_draws((b, n, cfg.n_heads), n_draws, l, seed)
        names = [noise_site(cfg.attn_norm, t, l, placement) for t in "qk"]
        loose = torch.zeros(len(levels), n_draws, len(rows), dtype=torch.bool)
        strict = torch.zeros_like(loose)
        for i, level in enumerate(levels):
            for d in range(n_draws):
                fq, fk = 1.0 + level * z_q[d], 1.0 + level * z_k[d]
                hooks = [(names[0], lambda a, hook, f=fq: a * f[..., None]), (names[1], lambda a, hook, f=fk: a * f[..., None])]
                store = {}
                hooks += [(act_name("attn_scores", l), lambda a, hook: store.__setitem__("s", a)),
                          (act_name("pattern", l), lambda a, hook: store.__setitem__("p", a))]
                model.run_with_hooks(tokens, fwd_hooks=hooks)
                loose[i, d] = store["s"][rb, rh, rq].argmax(-1) != tstar
                strict[i, d] = loose[i, d] & (store["p"][rb, rh, rq].max(-1).values >= strict_threshold)
        out.append((rows, loose, strict))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default=None, help="checkpoint folder (default: random weights, cpu preset)")
    ap.add_argument("--attn-norm", default="pre")
    ap.add_argument("--n", type=int, default=64, help="problems")
    ap.add_argument("--draws", type=int, default=16)
    ap.add_argument("--levels", default="0.05,0.1,0.2,0.4")
    ap.add_argument("--sharpen", type=float, default=4.0, help="W_Q multiplier for random weights")
    ap.add_argument("--repeats", type=int, default=3, help="timing repeats of the fast path (median)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    levels = tuple(float(x) for x in args.levels.split(","))
    if args.ckpt:
        from interp_norm import load_with_info

        model, info = load_with_info(args.ckpt)
        task = info.task
    else:
        model = HookedNormTransformer(ModelConfig.preset("cpu", attn_norm=args.attn_norm)).eval()
        task = AdditionTask.preset("cpu")
        # random weights attend diffusely; sharpen W_Q so that, as in a trained model, many rows are sparse
        with torch.no_grad():
            for block in model.blocks:
                block.attn.W_Q.mul_(args.sharpen)
                if args.attn_norm in ("qk", "qkv"):  # the q norm undoes W_Q's scale; sharpen its gain instead
                    block.attn.q_norm.w.mul_(args.sharpen)
    tokens = task.test_set("id", args.n, seed=1234).tokens
    tokens = tokens[:, : int((tokens != PAD_ID).sum(-1).max())]
    placement = "after_norm"  # so that QKV-/QK-Norm checkpoints collapse too; same hooks as Pre-Norm otherwise
    cfg = model.cfg
    print(f"collapse sweep: attn_norm={cfg.attn_norm}, {cfg.n_layers} layers x {cfg.n_heads} heads, {args.n} problems "
          f"x {tokens.shape[1]} positions, {len(levels)} levels x {args.draws} draws, 1 thread")

    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        fast = N.collapse_decisions(model, tokens, levels, n_draws=args.draws, placement=placement, seed=0)
        times.append(time.perf_counter() - t0)
    t_fast = sorted(times)[len(times) // 2]
    t0 = time.perf_counter()
    slow = naive(model, tokens, levels, args.draws, placement, seed=0)
    t_naive = time.perf_counter() - t0

    n_rows = n_loose = n_strict = 0
    for r, (rows, loose, strict) in zip(fast, slow):
        assert torch.equal(r.rows, rows), "the two methods select different sparse rows"
        assert torch.equal(r.loose, loose) and torch.equal(r.strict, strict), f"decisions differ in layer {r.layer}"
        n_rows += len(rows)
        n_loose += int(loose.sum())
        n_strict += int(strict.sum())
    runs = len(levels) * args.draws * cfg.n_layers
    print(f"sparse rows: {n_rows}; (row, draw, level) trials: {n_rows * args.draws * len(levels)}; "
          f"loose collapses: {n_loose}; strict: {n_strict}; decisions identical: yes")
    print(f"naive per-draw re-run: {t_naive:8.3f} s ({runs} forward passes)")
    print(f"vectorised sweep:      {t_fast:8.3f} s (1 forward pass + scores x factors)")
    print(f"speed-up: {t_naive / t_fast:.1f}x (target >= 50x)")


if __name__ == "__main__":
    main()
