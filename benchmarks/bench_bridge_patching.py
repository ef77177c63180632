"""Exact activation patching on TransformerLens 4 bridges: ours (``method="kv-cache"``) vs ``transformer_lens.patching``.

For 12-layer random bridges shaped like GPT-2 small (d_model 768, 12 heads, MLP 3072, vocab 50 257),
a Llama (d_model 768, 12 query / 4 key-value heads, gated MLP 2048, RoPE, vocab 32 000) and Qwen3-0.6B
(d_model 1024, 16 / 8 heads of 128, per-head QK-Norm, MLP 3072, vocab 151 936) and Gemma 4 E2B
(d_model 1536, 8 / 1 heads of 256, global layers' heads 512 wide with k = v, MLP 6144, vocab 262 144;
sliding and full layers alternating, sliding window 8 (``--sliding-window``) so that it binds at 16
tokens, the last half of the layers reading the keys and values of the last sliding and full layer
before them, per-layer inputs of width 8), 8 pairs x 16 tokens:
clean tokens random, the corrupted ones differ in one token (``--corrupt-pos``), the metric is the
last position's logit difference between the pair's clean and corrupted token there (per example;
``.mean()`` for TransformerLens; ``--metric plain`` passes it to ours as a bare function, declaring no
read positions, so the engine finds them by probing it). For ``resid_pre``, ``attn_out``, ``mlp_out`` (layer x position) and
``z`` (layer x position x head), both tables are computed and checked equal cell by cell (max |diff|
<= 1e-5) first; then TransformerLens and ours run alternately in each round (the machine is shared,
so load hits both alike) and the table prints the median CPU time of each, the ratio (target >= 5x)
and the peak tensor memory of one call (the profiler's allocation events; TransformerLens's is that
of two of its cells: it does not grow with the cells). ``--tl-sample N`` times TransformerLens on N
sampled cells and scales to the whole table (its cost is one forward pass per cell; equality is then
checked on those cells), for sizes where its full tables take too long.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_bridge_patching.py [--archs gpt2,llama,qwen3]
        [--shrink 3 | --d-model 256 --vocab 8000] [--layers 12] [--sliding-window 8] [--pos 16] [--pairs 8] [--repeats 3] [--tl-sample 24]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from transformer_lens import patching  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_patching import cpu_time, peak_mb, quiet  # noqa: E402

from interp_norm.anatomy import bridge_from_hf, tiny_config  # noqa: E402
from interp_norm.anatomy.build import _reinit  # noqa: E402
from interp_norm.circuits import activation_patch  # noqa: E402

TOL = 1e-5
TL = {  # activation -> (TransformerLens function, its patch setter, axes)
    "resid_pre": (patching.get_act_patch_resid_pre, patching.layer_pos_patch_setter, ("layer", "pos")),
    "attn_out": (patching.get_act_patch_attn_out, patching.layer_pos_patch_setter, ("layer", "pos")),
    "mlp_out": (patching.get_act_patch_mlp_out, patching.layer_pos_patch_setter, ("layer", "pos")),
    "z": (patching.get_act_patch_attn_head_out_by_pos, patching.layer_pos_head_vector_patch_setter, ("layer", "pos", "head")),
}
#: real shapes (d_model, heads, kv heads, d_head, MLP, vocab)
SHAPES = {"gpt2": (768, 12, 12, 64, 3072, 50257), "llama": (768, 12, 4, 64, 2048, 32000),
          "qwen3": (1024, 16, 8, 128, 3072, 151936), "gemma4": (1536, 8, 1, 256, 6144, 262144)}


def build(arch: str, layers: int, n_ctx: int, d_model: int | None, vocab: int | None, shrink: float = 1.0, seed: int = 0,
          sliding_window: int = 8):
    """A random bridge of ``arch``'s shape (``d_model``/``vocab`` shrink it, heads of the same width;
    ``shrink`` divides both, keeping the unembedding's share of a forward pass)."""
    import transformers as tf

    d, h, kvh, dh, mlp, v = SHAPES[arch]
    if shrink != 1.0:
        d_model = d_model or max(dh, int(d / shrink) // dh * dh)
        vocab = vocab or int(v * d_model / d)
    if d_model:
        h, kvh, mlp, d = max(1, d_model // dh), max(1, d_model // dh // (h // kvh)), mlp * d_model // d, d_model
    v = vocab or v
    extra = dict(sliding_window=sliding_window) if arch == "gemma4" else {}
    cfg = tiny_config("gemma4-shared" if arch == "gemma4" else arch, n_layers=layers, d_model=d, n_heads=h, n_kv_heads=kvh,
                      d_head=dh, vocab=v, n_ctx=max(n_ctx, 64), **extra)
    if arch == "gpt2":
        cfg.n_inner = mlp
    else:
        cfg.intermediate_size = mlp
    cfg._attn_implementation = "eager"
    cls = {"gpt2": tf.GPT2LMHeadModel, "llama": tf.LlamaForCausalLM, "qwen3": tf.Qwen3ForCausalLM,
           "gemma4": getattr(tf, "Gemma4ForCausalLM", None)}[arch]
    torch.manual_seed(seed)
    hf = cls(cfg)
    _reinit(hf, seed)
    if arch == "gemma4":
        # Gemma 4 multiplies q.k by 1.0, trained q/k-norm gains setting the temperature; with random
        # gains ~1 its softmaxes over 256/512-wide heads are near one-hot (score std 16-23) and amplify
        # float32 rounding ~1000x. 1/sqrt(d_head), as the other random bridges have, keeps them soft.
        for m in hf.modules():
            if type(m).__name__ == "Gemma4TextAttention":
                m.scaling = m.head_dim ** -0.5
    return bridge_from_hf(hf.eval(), name=f"random-{arch}"), (d, h, kvh, dh, mlp, v)


class LastLogitDiff:
    """logit(clean token) - logit(corrupted token) of the corrupted position, read at the last position."""

    supports_stacked = True
    name = "last_logit_diff"

    def __init__(self, clean: torch.Tensor, corrupted: torch.Tensor, at: torch.Tensor):
        b, n = clean.shape
        r = torch.arange(b)
        self.a, self.c, self.b = clean[r, at], corrupted[r, at], b
        self.read_mask = torch.zeros(b, n, dtype=torch.bool)
        self.read_mask[:, -1] = True

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        lg = logits[:, -1].view(-1, self.b, logits.shape[-1])
        return (lg.gather(-1, self.a.expand(len(lg), -1).unsqueeze(-1)) - lg.gather(-1, self.c.expand(len(lg), -1).unsqueeze(-1))).reshape(-1)

    def mean(self, logits: torch.Tensor) -> torch.Tensor:
        return self(logits).mean()


def pairs(vocab: int, b: int, n: int, corrupt_pos: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(3, vocab, (b, n), generator=g)
    corr = clean.clone()
    at = torch.full((b,), corrupt_pos)
    corr[torch.arange(b), at] = (clean[torch.arange(b), at] - 3 + torch.randint(1, vocab - 3, (b,), generator=g)) % (vocab - 3) + 3
    return clean, corr, at


def table(bridge, clean, corr, metric, act: str, repeats: int, tl_sample: int, batch_size: int, memory: bool = True,
          plain: bool = False) -> dict:
    fn, setter, axes = TL[act]
    _, cache = bridge.run_with_cache(clean)
    L, n, H = bridge.cfg.n_layers, clean.shape[1], bridge.cfg.n_heads
    sizes = dict(layer=L, pos=n, head=H)
    grid = pd.DataFrame(np.stack(np.meshgrid(*[np.arange(sizes[a]) for a in axes], indexing="ij"), -1).reshape(-1, len(axes)),
                        columns=list(axes))
    sample = grid if not tl_sample or tl_sample >= len(grid) else grid.sample(tl_sample, random_state=0).sort_index()
    rows = torch.tensor(sample.index.to_numpy())

    def tl():
        if len(sample) == len(grid):
            return quiet(fn, bridge, corr, cache, metric.mean).reshape(-1)
        return quiet(patching.generic_activation_patch, bridge, corr, cache, metric.mean, patch_setter=setter,
                     activation_name=act, index_df=sample)

    ours_metric = metric if not plain else (lambda lg: metric(lg))  # a plain function: nothing declared

    def ours():
        return activation_patch(bridge, corr, cache, ours_metric, act, method="kv-cache", batch_size=batch_size)

    warm = grid[grid["pos"] == clean.shape[1] - 1].iloc[:4]  # warm-up on a few cells: the allocator, first calls
    activation_patch(bridge, corr, cache, ours_metric, act, method="kv-cache", batch_size=batch_size, cells=warm)
    t_tl, ref = cpu_time(tl)
    t_ours, res = cpu_time(ours)
    diff = float((res.values.reshape(-1)[rows] - ref).abs().max())
    assert res.method == "exact-kv-cache" and diff <= TOL, f"{act}: differs from TransformerLens by {diff}"
    times = {"tl": [t_tl], "ours": [t_ours]}
    for _ in range(repeats - 1):
        times["tl"].append(cpu_time(tl)[0])
        times["ours"].append(cpu_time(ours)[0])
    med = {k: statistics.median(v) * (len(grid) / len(sample) if k == "tl" else 1.0) for k, v in times.items()}
    few = grid.iloc[:2]
    tl_mb = peak_mb(lambda: quiet(patching.generic_activation_patch, bridge, corr, cache, metric.mean, patch_setter=setter,
                                  activation_name=act, index_df=few))
    return dict(cells=len(grid), diff=diff, tl=med["tl"], ours=med["ours"], mb=peak_mb(ours) if memory else float("nan"), tl_mb=tl_mb,
                sampled=len(sample) < len(grid), effect=float((res.values - res.baseline.mean()).abs().max()),
                fwd=res.rows_computed / (clean.numel() * L))


def scaling(args) -> None:
    """One table, its ratio as the layers and the positions grow (the other held at --layers / --pos)."""
    arch, act = args.archs.split(",")[0], args.acts.split(",")[0]
    axes = dict(kv.split("=") for kv in args.scaling.split(";"))
    print(f"\n{arch} {act}, {args.pairs} pairs; CPU s, median of {args.repeats}; ~ = TransformerLens timed on "
          f"{args.tl_sample} sampled cells, scaled up")
    print(f"   {'layers':>6}{'pos':>5}{'cells':>7}{'max|diff|':>11}{'TransformerLens':>17}{'ours':>9}{'ratio':>8}{'ours fwd':>9}")
    for axis, values in axes.items():
        for val in (int(x) for x in values.split(",")):
            L, n = (val, args.pos) if axis == "layers" else (args.layers, val)
            bridge, (d, h, kvh, dh, mlp, v) = build(arch, L, n, args.d_model, args.vocab, args.shrink,
                                                    sliding_window=args.sliding_window)
            clean, corr, at = pairs(v, args.pairs, n, args.corrupt_pos)
            r = table(bridge, clean, corr, LastLogitDiff(clean, corr, at), act, args.repeats, args.tl_sample, args.batch_size)
            est = "~" if r["sampled"] else " "
            print(f"   {L:>6}{n:>5}{r['cells']:>7}{r['diff']:>11.1e}{est}{r['tl']:>16.2f}{r['ours']:>9.2f}"
                  f"{r['tl'] / r['ours']:>7.1f}x{r['fwd']:>9.2f}", flush=True)
            del bridge


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archs", default="gpt2,llama,qwen3", help="any of gpt2, llama, qwen3, gemma4")
    ap.add_argument("--sliding-window", type=int, default=8, help="Gemma 4's sliding window (binds below --pos)")
    ap.add_argument("--acts", default="resid_pre,attn_out,mlp_out,z")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--pos", type=int, default=16)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--corrupt-pos", type=int, default=2, help="the position where corrupted tokens differ (default 2)")
    ap.add_argument("--d-model", type=int, default=None, help="shrink d_model (heads of the real width; MLP in proportion)")
    ap.add_argument("--vocab", type=int, default=None, help="shrink the vocabulary")
    ap.add_argument("--shrink", type=float, default=1.0,
                    help="divide d_model (to whole heads) and the vocabulary alike, e.g. 3 for quick runs")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median)")
    ap.add_argument("--tl-sample", type=int, default=24,
                    help="time TransformerLens on this many sampled cells, scaled to the table (0: all; a full z table at real size is ~15 CPU min)")
    ap.add_argument("--batch-size", type=int, default=1024, help="activation_patch's batch_size")
    ap.add_argument("--metric", default="declared",
                    help="'declared' (read_mask), 'plain' (a bare function: positions found by probing) or 'declared,plain'")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory column (it re-runs ours under the profiler)")
    ap.add_argument("--scaling", default="",
                    help="instead of the tables: how the ratio grows, e.g. 'layers=3,6,12;pos=8,16,32' "
                         "(first --archs, first --acts; the other axis at --layers / --pos)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    w0, c0 = time.perf_counter(), time.process_time()
    if args.scaling:
        scaling(args)
        print(f"total: {time.perf_counter() - w0:.0f} s wall, {time.process_time() - c0:.0f} s CPU")
        return
    ratios = []
    for arch in args.archs.split(","):
        bridge, (d, h, kvh, dh, mlp, v) = build(arch, args.layers, args.pos, args.d_model, args.vocab, args.shrink,
                                                sliding_window=args.sliding_window)
        clean, corr, at = pairs(v, args.pairs, args.pos, args.corrupt_pos)
        metric = LastLogitDiff(clean, corr, at)
        print(f"\n{arch}: {args.layers} layers, d_model {d}, heads {h} (k/v {kvh}) x {dh}, MLP {mlp}, vocab {v}; "
              f"{args.pairs} pairs x {args.pos} tokens, corrupted at position {args.corrupt_pos}; CPU s, median of {args.repeats}")
        print(f"   {'activation':<11}{'metric':<9}{'cells':>6}{'max|diff|':>11}{'max|effect|':>12}{'TransformerLens':>17}{'ours':>9}"
              f"{'ratio':>8}{'ours fwd':>9}{'ours MB':>9}{'TL MB':>8}")
        for act in args.acts.split(","):
            for kind in args.metric.split(","):
                r = table(bridge, clean, corr, metric, act, args.repeats, args.tl_sample, args.batch_size, not args.no_memory,
                          plain=kind == "plain")
                ratios.append(r["tl"] / r["ours"])
                est = "~" if r["sampled"] else " "
                print(f"   {act:<11}{kind:<9}{r['cells']:>6}{r['diff']:>11.1e}{r['effect']:>12.3g}{est}{r['tl']:>16.2f}"
                      f"{r['ours']:>9.2f}{ratios[-1]:>7.1f}x{r['fwd']:>9.2f}{r['mb']:>9.0f}{r['tl_mb']:>8.0f}", flush=True)
        del bridge
    print(f"\nSPEED RATIO (TransformerLens / ours, CPU time): min {min(ratios):.1f}x, median {statistics.median(ratios):.1f}x "
          f"over {len(ratios)} tables (target >= 5x each); ~ = TransformerLens timed on --tl-sample cells, scaled up")
    print(f"total: {time.perf_counter() - w0:.0f} s wall, {time.process_time() - c0:.0f} s CPU")


if __name__ == "__main__":
    main()
