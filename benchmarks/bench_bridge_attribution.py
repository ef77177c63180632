"""Node attribution patching (EAP, EAP-IG) on TransformerLens 4 bridges: ours (``node_attribution``,
all pairs in one batched pass) vs TransformerLens 4.3's ``attribution_patch`` (a clean forward and a
corrupted forward + backward per pair).

Same random 12-layer bridges as ``bench_bridge_patching.py`` (GPT-2-small, Llama and Qwen3-0.6B
shapes; 8 pairs x 16 tokens, the metric the last position's logit difference between the pair's
clean and corrupted token). Nodes: every head's ``z`` and every MLP's output at every position
(TransformerLens also scores the 16 embedding nodes). Each pair's scores are first checked equal to
TransformerLens's ``attribution_patch`` run on that pair (max |diff| <= 1e-5; a pair-specific metric
cannot be passed to one batched call of it, which applies one metric to every pair), then both run
alternately in each round (the machine is shared: load hits both alike); the table prints median CPU
seconds, the ratio (target >= 5x) and peak tensor memory of one call. ``--ig-steps m`` adds an EAP-IG
row: TransformerLens 4.3 raises NotImplementedError for ``ig_steps > 1``, so its side there is its
own ``cache_activation_and_gradient`` once per pair and integration point with the token embedding
moved along the corrupted -> clean line by a hook (checked equal the same way).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_bridge_attribution.py [--archs gpt2,llama,qwen3]
        [--layers 12] [--pos 16] [--pairs 8] [--repeats 3] [--ig-steps 0] [--shrink 1] [--breakdown] [--edges]

``--edges`` adds edge EAP (``edge_attribution``: every sender -> q/k/v/MLP/logits receiver, summed over
positions, mean over pairs) against TransformerLens's ``attribution_patch(granularity="edge")`` per pair
(checked equal first; it refuses grouped k/v heads, so Llama and Qwen3 get ours only) and the ratio of
ours's edge pass to ours's node pass (target <= 2x).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformer_lens.tools.analysis.attribution_patching import (  # noqa: E402
    EdgeAttributionConfig,
    Node,
    attribution_patch,
    cache_activation_and_gradient,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_bridge_patching import LastLogitDiff, build, pairs  # noqa: E402
from bench_patching import cpu_time, matmul_profile, peak_gmacs, peak_mb  # noqa: E402

from interp_norm.circuits import PatchingPairs, edge_attribution, node_attribution  # noqa: E402

TOL = 1e-5


def quiet(fn, *args, **kw):
    with contextlib.redirect_stderr(io.StringIO()):  # warnings; autograd stays on (attribution needs it)
        return fn(*args, **kw)


def tl_eap(bridge, clean, corr, metric: LastLogitDiff) -> list[dict]:
    """TransformerLens 4.3's attribution_patch on each pair, with that pair's metric."""
    out = []
    for i in range(len(clean)):
        a, c = int(metric.a[i]), int(metric.c[i])
        out.append(attribution_patch(bridge, clean[i : i + 1], corr[i : i + 1],
                                     lambda lg, a=a, c=c: lg[0, -1, a] - lg[0, -1, c]).node_scores)
    return out


def tl_eap_ig(bridge, clean, corr, metric: LastLogitDiff, steps: int) -> list[dict]:
    """EAP-IG from TransformerLens's gradient cache: one forward + backward per pair and integration point."""
    L = bridge.cfg.n_layers
    names = [f"blocks.{l}.attn.hook_z" for l in range(L)] + [f"blocks.{l}.hook_mlp_out" for l in range(L)]
    out = []
    for i in range(len(clean)):
        a, c = int(metric.a[i]), int(metric.c[i])
        fn = lambda lg, a=a, c=c: lg[0, -1, a] - lg[0, -1, c]  # noqa: E731
        cg = cache_activation_and_gradient(bridge, clean[i : i + 1], fn, names_filter=names + ["hook_embed"], compute_gradient=False)
        xg = cache_activation_and_gradient(bridge, corr[i : i + 1], fn, names_filter=["hook_embed"] + names, compute_gradient=False)
        e0, e1 = xg.activations["hook_embed"], cg.activations["hook_embed"]
        total = {nm: 0.0 for nm in names}
        for k in range(steps):
            mix = e0 + (k / steps) * (e1 - e0)
            with bridge.hooks(fwd_hooks=[("hook_embed", lambda x, hook, mix=mix: x + (mix - x).detach())]):
                gc = cache_activation_and_gradient(bridge, corr[i : i + 1], fn, names_filter=["hook_embed"] + names)
            for nm in names:
                total[nm] = total[nm] + gc.gradients[nm]
        out.append({nm: ((cg.activations[nm] - xg.activations[nm]) * total[nm] / steps).sum(-1)[0] for nm in names})
    return out


def _edge_name(node: Node, reader: bool) -> str:
    """Ours's name of a TransformerLens edge end (its q/k/v/mlp input, or the head/MLP writing)."""
    if node.kind in ("embed", "logits"):
        return node.kind
    if node.kind in ("mlp_out", "mlp_in"):
        return f"m{node.layer}"
    head = f"a{node.layer}.h{node.head}"
    return f"{head}.{node.kind[0]}" if reader else head


def tl_edges(bridge, clean, corr, metric: LastLogitDiff) -> dict:
    """TransformerLens 4.3's edge attribution per pair (its edges per position summed per (sender,
    receiver)), the mean over pairs: what ours's ``edge_attribution`` scores."""
    out: dict = {}
    for i in range(len(clean)):
        a, c = int(metric.a[i]), int(metric.c[i])
        ref = attribution_patch(bridge, clean[i : i + 1], corr[i : i + 1], lambda lg, a=a, c=c: lg[0, -1, a] - lg[0, -1, c],
                                EdgeAttributionConfig(granularity="edge")).edge_scores
        for (w, r), v in ref.items():
            key = (_edge_name(w, False), _edge_name(r, True))
            out[key] = out.get(key, 0.0) + v / len(clean)
    return out


def edge_row(bridge, clean, corr, metric, repeats: int) -> dict:
    """Edge EAP: ours vs TransformerLens (where it scores the architecture: not grouped k/v heads), and
    ours's edge pass over ours's node pass, timed alternately."""
    pp = PatchingPairs(clean, corr, score_mask=metric.read_mask)
    ours = lambda: edge_attribution(bridge, pp, metric)  # noqa: E731
    node = lambda: node_attribution(bridge, pp, metric, ("z", "mlp_out"))  # noqa: E731
    tl = lambda: quiet(tl_edges, bridge, clean, corr, metric)  # noqa: E731
    node(), ours()  # warm-up
    grouped = bridge.cfg.n_key_value_heads not in (None, bridge.cfg.n_heads)
    times: dict = {"ours": [], "node": [], "tl": []}
    diff = float("nan")
    for r in range(repeats):
        t, res = cpu_time(ours)
        times["ours"].append(t)
        times["node"].append(cpu_time(node)[0])
        if not grouped:
            t, ref = cpu_time(tl)
            times["tl"].append(t)
            if r == 0:
                got = res.set_index(["sender", "receiver"])["score"]
                assert set(ref) == set(got.index), "edge sets differ from TransformerLens's"
                diff = max(abs(ref[k] - got[k]) for k in ref)
                assert diff <= TOL, f"edges differ from TransformerLens by {diff}"
    med = {k: statistics.median(v) if v else float("nan") for k, v in times.items()}
    return dict(diff=diff, edges=len(res), **med)


def as_tensors(ref: list, L: int, n: int, H: int, ig: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, n, H, b] head scores and [L, n, b] MLP scores of per-pair TransformerLens results."""
    if ig:
        z = torch.stack([torch.stack([r[f"blocks.{l}.attn.hook_z"] for l in range(L)]) for r in ref], -1)
        m = torch.stack([torch.stack([r[f"blocks.{l}.hook_mlp_out"] for l in range(L)]) for r in ref], -1)
        return z.double(), m.double()
    z = torch.tensor([[[[r[Node("attn_head_out", p, l, h)] for r in ref] for h in range(H)] for p in range(n)] for l in range(L)])
    m = torch.tensor([[[r[Node("mlp_out", p, l)] for r in ref] for p in range(n)] for l in range(L)])
    return z.double(), m.double()


def row(bridge, clean, corr, metric, steps: int, repeats: int, breakdown: bool = False) -> dict:
    L, n, H, b = bridge.cfg.n_layers, clean.shape[1], bridge.cfg.n_heads, clean.shape[0]
    pp = PatchingPairs(clean, corr, score_mask=metric.read_mask)

    def ours():
        return node_attribution(bridge, pp, metric, ("z", "mlp_out"), ig_steps=max(1, steps))

    def tl():
        return quiet(tl_eap_ig, bridge, clean, corr, metric, steps) if steps > 1 else quiet(tl_eap, bridge, clean, corr, metric)

    ours()  # warm-up
    t_tl, ref = cpu_time(tl)
    t_ours, res = cpu_time(ours)
    tz, tm = as_tensors(ref, L, n, H, steps > 1)
    z = (res["z"].per_example - res["z"].baseline).view(L, n, H, b)
    m = (res["mlp_out"].per_example - res["mlp_out"].baseline).view(L, n, b)
    diff = max(float((z - tz).abs().max()), float((m - tm).abs().max()))
    assert diff <= TOL, f"differs from TransformerLens by {diff}"
    times = {"tl": [t_tl], "ours": [t_ours]}
    for _ in range(repeats - 1):
        times["tl"].append(cpu_time(tl)[0])
        times["ours"].append(cpu_time(ours)[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    one = lambda: quiet(tl_eap_ig, bridge, clean[:1], corr[:1], metric, steps) if steps > 1 else quiet(  # noqa: E731
        tl_eap, bridge, clean[:1], corr[:1], metric)
    out = dict(diff=diff, tl=med["tl"], ours=med["ours"], mb=peak_mb(ours), tl_mb=peak_mb(one),
               effect=float(max(tz.abs().max(), tm.abs().max())))
    if breakdown:
        out["profile"] = {"TransformerLens": matmul_profile(tl), "ours": matmul_profile(ours)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archs", default="gpt2,llama,qwen3")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--pos", type=int, default=16)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--corrupt-pos", type=int, default=2)
    ap.add_argument("--shrink", type=float, default=1.0, help="divide d_model and the vocabulary (quick runs)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median)")
    ap.add_argument("--ig-steps", type=int, default=0, help="also an EAP-IG row with this many steps (0: none)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also profile one run of each side: matrix products' multiply-accumulates, rate and share of CPU time")
    ap.add_argument("--edges", action="store_true",
                    help="also edge EAP: ours vs TransformerLens per pair (where it scores the model) and vs ours's node pass")
    args = ap.parse_args()
    torch.set_num_threads(1)
    w0, c0 = time.perf_counter(), time.process_time()
    ratios = []
    for arch in args.archs.split(","):
        bridge, (d, h, kvh, dh, mlp, v) = build(arch, args.layers, args.pos, None, None, args.shrink)
        clean, corr, at = pairs(v, args.pairs, args.pos, args.corrupt_pos)
        metric = LastLogitDiff(clean, corr, at)
        print(f"\n{arch}: {args.layers} layers, d_model {d}, heads {h} (k/v {kvh}) x {dh}, MLP {mlp}, vocab {v}; "
              f"{args.pairs} pairs x {args.pos} tokens; nodes: z per (layer, pos, head) + mlp_out per (layer, pos); "
              f"CPU s, median of {args.repeats}")
        print(f"   {'method':<12}{'max|diff|':>11}{'max|score|':>12}{'TransformerLens':>17}{'ours':>9}{'ratio':>8}"
              f"{'ours MB':>9}{'TL MB/pair':>11}")
        for steps in [1] + ([args.ig_steps] if args.ig_steps > 1 else []):
            r = row(bridge, clean, corr, metric, steps, args.repeats, args.breakdown)
            ratios.append(r["tl"] / r["ours"])
            name = "EAP" if steps == 1 else f"EAP-IG {steps}"
            print(f"   {name:<12}{r['diff']:>11.1e}{r['effect']:>12.3g}{r['tl']:>17.2f}{r['ours']:>9.2f}{ratios[-1]:>7.1f}x"
                  f"{r['mb']:>9.0f}{r['tl_mb']:>11.0f}", flush=True)
            for side, p in r.get("profile", {}).items():
                print(f"      {side:<16} matrix products {p['gmac']:6.1f} GMAC in {p['mm_ms']:6.0f} ms ({p['gmac'] / p['mm_ms'] * 1e3:4.0f} GMAC/s), "
                      f"{100 * p['mm_ms'] / p['ms']:3.0f}% of {p['ms']:.0f} ms in ops (profiled run)")
        if args.edges:
            e = edge_row(bridge, clean, corr, metric, args.repeats)
            tl_ratio = f"{e['tl'] / e['ours']:.1f}x" if e["tl"] == e["tl"] else "TransformerLens refuses grouped k/v"
            print(f"   edge EAP ({e['edges']} edges): max|diff| {e['diff']:.1e}, TransformerLens {e['tl']:.2f} s, ours "
                  f"{e['ours']:.2f} s ({tl_ratio}); ours node EAP {e['node']:.2f} s: edge / node {e['ours'] / e['node']:.2f}x "
                  "(target <= 2x)", flush=True)
        del bridge
    if args.breakdown:
        print(f"\none large matrix product (512 x 768 x 3072) on this machine: {peak_gmacs():.0f} GMAC/s")
    print(f"\nSPEED RATIO (TransformerLens / ours, CPU time): min {min(ratios):.1f}x over {len(ratios)} rows (target >= 5x); "
          "EAP-IG's TransformerLens side is its gradient cache per pair and step (4.3 has no EAP-IG)")
    print(f"total: {time.perf_counter() - w0:.0f} s wall, {time.process_time() - c0:.0f} s CPU")


if __name__ == "__main__":
    main()
