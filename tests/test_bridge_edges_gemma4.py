"""Edges on a tiny Gemma 4 bridge: post-attention norms on the heads' path, grouped k/v heads and
the per-layer-input branch as part of each layer's MLP node
(:mod:`interp_norm.circuits.edge_layer_input`).

Edge attribution is a first-order estimate, so it must equal the derivative of exact single-edge
patching in the patch size (a five-point finite difference in float64). That check shares the edge
runner's wiring with the estimate, so the MLP node's meaning is checked separately against plain
hooks on the model: patching an edge into ``m0`` shifts the input of the MLP *and* of the
per-layer-input branch, and patching every edge out of ``m0`` is the residual after layer 0
carrying the clean write of both.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from interp_norm.anatomy import original, tiny_bridge
from interp_norm.circuits import edge_attribution, exact_edge_patch
from interp_norm.circuits.edges import EdgeRunner
from interp_norm.core.hook_names import act_name
from interp_norm.errors import PatchingError

from _models import bridge_pairs

B, N = 3, 6


def plain(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 5] - logits[:, -1, 6]


@pytest.fixture(scope="module")
def gemma4():
    return tiny_bridge("gemma4", seed=5).double()


@pytest.fixture(scope="module")
def scaled():
    """Layer scalars 0.6 and 1.7 (the tiny model's are 1; real checkpoints carry their own)."""
    bridge = tiny_bridge("gemma4", seed=5).double()
    for blk, s in zip(bridge.blocks, (0.6, 1.7)):
        original(blk).layer_scalar.fill_(s)
    return bridge


@pytest.mark.parametrize("which", ["gemma4", "scaled"])
def test_gemma4_edge_eap_equals_the_finite_difference_of_exact_patching(request, which):
    """Five-point stencil at eps = 1e-2: truncation ~ eps^4 |M^(5)| / 30; Gemma 4's RMSNorm computes in
    float32 inside the float64 model, roundoff ~ 1.5 * 6e-8 |M| / eps ~ 1e-5 |M|; both under 1e-4.
    (A central difference at eps = 1e-2 is off by 1.9e-4, shrinking as eps^2: its truncation.)"""
    gemma4 = request.getfixturevalue(which)
    pairs = bridge_pairs(gemma4, B, N)
    eap = edge_attribution(gemma4, pairs, plain).set_index(["sender", "receiver"])["score"]
    edges = list(eap.index)
    kinds = {r.split(".")[-1] for _, r in edges}
    assert {"q", "k", "v", "m0", "m1", "logits"} <= kinds and any(u == "m0" for u, _ in edges)
    eps = 1e-2

    def patched(scale: float):
        return exact_edge_patch(gemma4, pairs, plain, edges=edges, scale=scale).set_index(["sender", "receiver"])["score"]

    fd = (8 * (patched(eps) - patched(-eps)) - (patched(2 * eps) - patched(-2 * eps))) / (12 * eps)
    assert max(abs(fd[e] - eap[e]) for e in edges) <= 1e-4
    assert max(abs(eap[e]) for e in edges if e[0] == "m0") > 1e-2  # the MLP node's out-edges carry signal
    assert max(abs(eap[e]) for e in edges if e[1] == "m0") > 1e-2


@torch.no_grad()
def test_an_edge_into_the_mlp_node_feeds_the_mlp_and_the_per_layer_input_branch(gemma4):
    """embed -> m0 with the clean embedding: the MLP and the branch read ``r1 - (e_corr - e_clean)``."""
    pairs = bridge_pairs(gemma4, B, N)
    runner = EdgeRunner(gemma4)
    _, s_clean = runner.sender_cache(pairs.clean_tokens)
    _, s_corr = runner.sender_cache(pairs.corrupted_tokens)
    w = torch.zeros_like(runner.valid)
    w[runner.graph.sender_index(0, "embed"), runner.graph.receiver_index(0, "mlp")] = True
    ours = plain(runner.run(pairs.corrupted_tokens, weights=w.unsqueeze(0), ablated=s_clean)[0])
    shift = s_clean[0] - s_corr[0]  # the token embeddings' difference

    def move(x, hook):
        return x + shift

    mlp_in = (act_name("resid_mid", 0), move)  # hook_resid_mid is the MLP norm's input on a bridge
    gate_in = "blocks.0.per_layer_input_gate.hook_in"  # the branch's first projection reads r1 + mlp_out
    ref = plain(gemma4.run_with_hooks(pairs.corrupted_tokens, fwd_hooks=[mlp_in, (gate_in, move)]))
    mlp_only = plain(gemma4.run_with_hooks(pairs.corrupted_tokens, fwd_hooks=[mlp_in]))
    assert (ours - ref).abs().max() <= 1e-9
    assert (ref - mlp_only).abs().max() > 1e-3  # the branch's input matters
    assert (ref - plain(gemma4(pairs.corrupted_tokens))).abs().max() > 1e-3


@torch.no_grad()
def test_edges_out_of_the_mlp_node_carry_the_mlp_and_the_branch(gemma4):
    pairs = bridge_pairs(gemma4, B, N)
    runner = EdgeRunner(gemma4)
    _, s_clean = runner.sender_cache(pairs.clean_tokens)
    w = torch.zeros_like(runner.valid)
    u = runner.graph.sender_index(0, "mlp")
    w[u] = runner.valid[u]
    ours = plain(runner.run(pairs.corrupted_tokens, weights=w.unsqueeze(0), ablated=s_clean)[0])
    branch_out = "blocks.0.post_per_layer_input_norm.hook_out"
    names = {act_name("resid_mid", 0), act_name("resid_post", 0), branch_out}
    _, cc = gemma4.run_with_cache(pairs.clean_tokens, names_filter=lambda nm: nm in names)
    write_clean = cc[act_name("resid_post", 0)] - cc[act_name("resid_mid", 0)]
    seen = {}

    def mid(x, hook):
        seen["r1"] = x.clone()
        return x

    def post(x, hook):
        return seen["r1"] + write_clean

    ref = plain(gemma4.run_with_hooks(pairs.corrupted_tokens, fwd_hooks=[(act_name("resid_mid", 0), mid), (act_name("resid_post", 0), post)]))
    assert (ours - ref).abs().max() <= 1e-9
    assert (ref - plain(gemma4(pairs.corrupted_tokens))).abs().max() > 1e-3
    assert cc[branch_out].abs().max() > 1e-3  # the branch writes something


@torch.no_grad()
def test_patching_every_edge_out_of_a_head_is_patching_its_z_under_layer_scalars(scaled):
    """Its edges reach m0 unscaled, layer 1 through s_0 and the logits through s_0 s_1: a plain hook
    on ``z`` knows nothing of that bookkeeping. Tolerance: Gemma 4's RMSNorm computes in float32, and
    the runner's pre-norm sum (its own ``z W_O``) can round there differently from the model's: ~6e-8
    relative on a few norm outputs, |M| ~ 1, so 1e-6."""
    pairs = bridge_pairs(scaled, B, N)
    runner = EdgeRunner(scaled)
    _, s_clean = runner.sender_cache(pairs.clean_tokens)
    _, cache = scaled.run_with_cache(pairs.clean_tokens, names_filter=lambda nm: nm == act_name("z", 0))
    z_clean = cache[act_name("z", 0)]
    base = plain(scaled(pairs.corrupted_tokens))
    for h in (0, 3):
        u = runner.graph.sender_index(0, "head", h)
        w = torch.zeros_like(runner.valid)
        w[u] = runner.valid[u]
        ours = plain(runner.run(pairs.corrupted_tokens, weights=w.unsqueeze(0), ablated=s_clean)[0])

        def put(z, hook, h=h):
            z = z.clone()
            z[:, :, h] = z_clean[:, :, h]
            return z

        ref = plain(scaled.run_with_hooks(pairs.corrupted_tokens, fwd_hooks=[(act_name("z", 0), put)]))
        assert (ours - ref).abs().max() <= 1e-6 and (ref - base).abs().max() > 1e-3


def test_a_mixture_of_experts_block_is_refused_with_the_reason():
    import transformers as tf

    from interp_norm.anatomy import bridge_from_hf, tiny_config

    cfg = tiny_config("gemma4")
    cfg.enable_moe_block, cfg.num_experts, cfg.top_k_experts, cfg.moe_intermediate_size = True, 2, 1, 32
    torch.manual_seed(0)
    bridge = bridge_from_hf(tf.Gemma4ForCausalLM(cfg).eval())
    with pytest.raises(PatchingError, match="mixture-of-experts"):
        EdgeRunner(bridge)
