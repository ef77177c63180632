"""Edge EAP from one plain backward pass (Pre-Norm bridges) equals the receiver-copies backend,
which reads each receiver's gradient at its own copy of the residual: every edge, EAP and EAP-IG,
plain and grouped k/v heads, QK-Norm; post-norm heads (OLMo-2) and frozen modes keep the copies.
(Equality with TransformerLens's edges: tests/test_bridge_attribution.py, through the same default.)

Tolerance: both are float32 sums of the same products in another order (the copies backend adds a
zero leaf and backpropagates 1 + 3 x heads copies; here the projection's transpose and the norm's
vector-Jacobian product run per receiver): a few float32 ulps of the largest gradient-times-difference
terms, 1e-6 relative to the largest score. That holds in like arithmetic: the one-pass route runs the
bridge's GELU and norms through one-kernel stand-ins (fused_elementwise), other float32 groupings of
the same formulas, so the tight comparison runs it with the modules (``modules_only``), and the
stand-ins are checked separately against the exact (float64) scores within a float32 rounding bound.
"""

from __future__ import annotations

import math
import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from _models import bridge_pairs
from interp_norm.anatomy import tiny_bridge
from interp_norm.circuits import edge_attribution
import interp_norm.circuits.edge_grads as edge_grads
import interp_norm.circuits.edge_scores as edge_scores
from interp_norm.circuits.exact.fused_elementwise import ACTIVATIONS, Substitute, modules_only, substitutes


def metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 5] - logits[:, -1, 6]


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen3"])
def test_one_pass_equals_the_copies_backend(arch, monkeypatch):
    bridge = tiny_bridge(arch, seed=3, n_layers=3)
    pairs = bridge_pairs(bridge, 3, 6)
    used = []
    real = edge_grads.fast_receivers
    monkeypatch.setattr(edge_grads, "fast_receivers", lambda *a, **k: (lambda g: used.append(g is not None) or g)(real(*a, **k)))
    for ig in (1, 3):
        used.clear()
        with modules_only():  # like arithmetic: the modules, not their stand-ins (test below)
            fast = edge_attribution(bridge, pairs, metric, ig_steps=ig).set_index(["sender", "receiver"])["score"]
        ref = edge_attribution(bridge, pairs, metric, ig_steps=ig, backend="copies").set_index(["sender", "receiver"])["score"]
        assert used == [True]  # the one-pass path ran (once: every pair and step in one pass)
        assert set(fast.index) == set(ref.index)
        scale = float(ref.abs().max())
        assert scale > 1e-2 and float((fast - ref.reindex(fast.index)).abs().max()) <= 1e-6 * scale


def test_post_norm_and_frozen_modes_keep_the_copies(monkeypatch):
    called = []
    monkeypatch.setattr(edge_grads, "fast_receivers", lambda *a, **k: called.append(1))
    olmo = tiny_bridge("olmo2", seed=3, n_layers=2)
    edge_attribution(olmo, bridge_pairs(olmo, 3, 6), metric)
    gpt2 = tiny_bridge("gpt2", seed=3, n_layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        edge_attribution(gpt2, bridge_pairs(gpt2, 3, 6), metric, norm="frozen")
    assert called == []


class _OnePlusGain(torch.nn.Module):
    """An RMSNorm whose gain is ``1 + weight`` (Gemma's convention): the closed form, which reads
    ``weight`` as the gain, is wrong for it and must be caught by its check."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d) * 0.5)
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


@pytest.mark.parametrize("norm", ["layer", "rms", "one_plus_gain"])
def test_norm_transposed_jacobian_equals_autograd_one_vector_at_a_time(norm):
    """Each vector's ``J^T v`` against a separate autograd backward through the norm (brute force)."""
    from interp_norm.circuits.edge_grads import _through_norm

    torch.manual_seed(0)
    d = 32
    mod = {"layer": torch.nn.LayerNorm(d), "rms": torch.nn.RMSNorm(d, eps=1e-6), "one_plus_gain": _OnePlusGain(d)}[norm]
    with torch.no_grad():
        for p in mod.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    x, vecs = torch.randn(2, 5, d) * 2 + 0.5, torch.randn(4, 2, 5, d)
    got = _through_norm(mod, x, vecs)
    for k in range(4):
        xk = x.clone().requires_grad_()
        (ref,) = torch.autograd.grad(mod(xk), xk, vecs[k])
        assert torch.allclose(got[k], ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max())), (norm, k)


@pytest.mark.parametrize("blocks,unchanged", [(False, [0, 1]), (True, [0, 1]), (True, [2])])
def test_float32_score_product_is_within_its_rounding_bound_of_a_float64_loop(blocks, unchanged):
    """The score product (float32 matrix products over valid edges and changed positions) against an
    explicit float64 loop over every valid (sender, receiver), with the receiver gradients given whole
    (copies backend) or as per-layer blocks (one-pass route), the unchanged positions a prefix (a run of
    positions is read as views) or not (selected). Tolerance: the m integration points are
    added, then K = rows x changed positions x d_model products summed, so each score is within
    gamma_{K+m} x sum |d| |g| of exact (product_bound); invalid edges stay exactly 0."""
    from interp_norm.circuits.edge_scores import _pass_scores, product_bound
    from interp_norm.circuits.edges import EdgeRunner

    runner = EdgeRunner(tiny_bridge("gpt2", seed=3, n_layers=2))
    U, R = runner.valid.shape
    b, n, m, dd = 3, 5, 2, runner.model.cfg.d_model
    gen = torch.Generator().manual_seed(0)
    d = torch.randn(U, b, n, dd, generator=gen)
    d[:, :, unchanged] = 0  # positions no sender changes: skipped, exactly as if summed
    g = torch.randn(R, m * b, n, dd, generator=gen) * torch.logspace(-3, 1, R).view(R, 1, 1, 1)
    A = runner.graph.n_attn_receivers
    given: object = g
    if blocks:
        given = [blk for r0 in range(0, R - 1, A + 1) for blk in (g[r0 : r0 + A], g[r0 + A : r0 + A + 1])] + [g[-1:]]
    got = _pass_scores(runner, d, given, m)
    gs = g.double().view(R, m, b, n, dd)
    for u in range(U):
        for r in range(R):
            if not runner.valid[u, r]:
                assert got[u, r] == 0
                continue
            exact = float((d[u].double() * gs[r].sum(0)).sum())
            size = float((d[u].double().abs() * gs[r].abs().sum(0)).sum())
            K = b * (n - len(unchanged)) * dd
            assert abs(float(got[u, r]) - exact) <= product_bound(K + m, torch.float32) * size, (u, r)


def test_sender_runs_stop_early_and_equal_a_full_cached_run():
    """The sender run stopped at the final norm and the embedding stopped at the first block read the
    same activations, bit for bit, as a whole ``run_with_cache``."""
    from interp_norm.circuits.edge_senders import embedding, sender_names, sender_run
    from interp_norm.circuits.edges import EdgeRunner

    bridge = tiny_bridge("gpt2", seed=3, n_layers=2)
    runner = EdgeRunner(bridge)
    tokens = bridge_pairs(bridge, 3, 6).clean_tokens
    _, cache = bridge.run_with_cache(tokens, names_filter=lambda nm: nm in set(sender_names(runner)))
    senders, emb = sender_run(runner, tokens)
    assert torch.equal(senders, runner.senders_from_cache(cache))
    assert torch.equal(emb, cache["hook_embed"]) and torch.equal(embedding(runner, tokens), cache["hook_embed"])


class _LastDiff:
    """The last position's logit difference, declaring that it reads only that position."""

    def __init__(self, b: int, n: int):
        self.read_mask = torch.zeros(b, n, dtype=torch.bool)
        self.read_mask[:, -1] = True

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return metric(logits)


def test_a_metric_declaring_its_read_positions_unembeds_only_those_and_scores_the_same():
    """With ``read_mask`` the one-pass route unembeds the last position alone (counted at the
    unembedding's input) and still equals the copies backend (same tolerance as above)."""
    bridge = tiny_bridge("gpt2", seed=3, n_layers=2)
    pairs = bridge_pairs(bridge, 3, 6)
    widths = []
    h = bridge.unembed.register_forward_hook(lambda mod, args, out: widths.append(args[0].shape[1]))
    try:
        with modules_only():
            fast = edge_attribution(bridge, pairs, _LastDiff(3, 6)).set_index(["sender", "receiver"])["score"]
    finally:
        h.remove()
    assert widths == [1]  # the gradient pass's unembedding read one position (the sender runs stop before it)
    ref = edge_attribution(bridge, pairs, metric, backend="copies").set_index(["sender", "receiver"])["score"]
    scale = float(ref.abs().max())
    assert scale > 1e-2 and float((fast - ref.reindex(fast.index)).abs().max()) <= 1e-6 * scale


def _exact_scores_and_magnitudes(arch: str, pairs, ig: int, monkeypatch):
    """The copies backend on a float64 build of the tiny ``arch`` bridge (the exact scores, to float64 rounding), and per
    edge M = sum over rows, positions and coordinates of |d| |g| (sender difference times receiver
    gradient), read off the same pass's products."""
    mags: list = []
    real = edge_scores._pass_scores

    def spy(runner, d, g, m, held=False):
        mags.append(real(runner, d.abs(), g.abs(), m, held))
        return real(runner, d, g, m, held)

    b64 = tiny_bridge(arch, seed=3, n_layers=3).double()
    with monkeypatch.context() as mp:
        mp.setattr(edge_scores, "_pass_scores", spy)
        exact = edge_attribution(b64, pairs, metric, ig_steps=ig, backend="copies")
    runner = edge_scores.EdgeRunner(b64)
    size = edge_scores.edge_frame(runner.graph, sum(mags) / (len(pairs.clean_tokens) * ig), runner.valid, "m")
    return exact.set_index(["sender", "receiver"])["score"], size.set_index(["sender", "receiver"])["score"]


def _rounding_allowance(bridge) -> float:
    """c unit roundoffs: how many float32 roundings a term d g of an edge score can carry. Forward to the
    sender and backward to the receiver each cross at most the L blocks and the final norm; per block two
    norms at (log2(d) + 8) roundings each (fused_elementwise._norm_tol), the activation at 8, and the
    matrix products (q/k/v, scores, values, W_O, the MLP's two) summing at most 4d terms, counted as
    log2(4d) each for six of them (blocked sums); c = 2 (L + 1) (2 (log2 d + 8) + 8 + 6 log2(4d))."""
    L, d = bridge.cfg.n_layers, bridge.cfg.d_model
    return 2 * (L + 1) * (2 * (math.log2(d) + 8) + 8 + 6 * math.log2(4 * d))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_stand_ins_keep_edge_scores_within_float32_rounding_of_the_exact_scores(arch, monkeypatch):
    """The one-pass route with its stand-ins (the default), the same route with the modules and the copies
    backend (float32) each within c u M of the exact score of every edge (the float64 copies backend): the
    stand-ins agree with their modules within rounding (their probe), so they only regroup the float32
    roundings a term d g carries, at most c (_rounding_allowance) of u relative to |d| |g| each; summed
    over an edge's terms, c u M. An erf GELU standing in for GPT-2's tanh GELU (2e-4 apart at |x| ~ 2,
    ~1e3 u relative) breaks the bound: it is not a stand-in."""
    bridge = tiny_bridge(arch, seed=3, n_layers=3)
    pairs = bridge_pairs(bridge, 3, 6)
    u = torch.finfo(torch.float32).eps / 2
    tol = _rounding_allowance(bridge) * u
    for ig in (1, 3):
        exact, size = _exact_scores_and_magnitudes(arch, pairs, ig, monkeypatch)
        with modules_only():
            plain = edge_attribution(bridge, pairs, metric, ig_steps=ig)
        runs = {"stand-ins": edge_attribution(bridge, pairs, metric, ig_steps=ig), "modules": plain,
                "copies": edge_attribution(bridge, pairs, metric, ig_steps=ig, backend="copies")}
        for name, got in runs.items():
            got = got.set_index(["sender", "receiver"])["score"].reindex(exact.index)
            err = (got - exact).abs()
            assert float((err - tol * size).max()) <= 0, (name, ig, float((err / size).max() / u))
        assert float(exact.abs().max()) > 1e-2
    if arch == "gpt2":  # a wrong stand-in is caught by the same bound
        subs = substitutes(bridge)
        wrong = [Substitute(s.module, "gelu_erf", ACTIVATIONS["gelu_erf"]) if s.kind == "gelu_tanh" else s for s in subs]
        monkeypatch.setattr(edge_scores, "substitutes", lambda model, key=None: wrong)
        exact, size = _exact_scores_and_magnitudes(arch, pairs, 1, monkeypatch)
        got = edge_attribution(bridge, pairs, metric).set_index(["sender", "receiver"])["score"].reindex(exact.index)
        assert float(((got - exact).abs() - tol * size).max()) > 0
