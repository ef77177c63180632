"""Edges out of heads whose attention output passes a post-norm (OLMo-2): the norm is part of the
sender's path (:mod:`interp_norm.circuits.edge_post_norm`).

Edge attribution is a first-order estimate, so it must equal the derivative of exact single-edge
patching in the patch size, estimated here by a central finite difference in float64. Exact edge
patching itself is checked against a plain hook: patching every edge out of one head at once is
patching that head's ``z``. Gemma 4's post-norm heads: tests/test_bridge_edges_gemma4.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from interp_norm.anatomy import tiny_bridge
from interp_norm.circuits import edge_attribution, exact_edge_patch
from interp_norm.circuits.edges import EdgeRunner
from interp_norm.core.hook_names import act_name

from _models import bridge_pairs

B, N = 3, 6


def plain(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 5] - logits[:, -1, 6]


@pytest.fixture(scope="module")
def olmo2():
    return tiny_bridge("olmo2", seed=5, n_layers=2).double()


def test_post_norm_edge_eap_equals_the_finite_difference_of_exact_patching(olmo2):
    """Central difference at eps = 1e-2: truncation ~ eps^2 |M'''| / 6, and OLMo-2's RMSNorm computes
    in float32 inside a float64 model (roundoff ~ 6e-8 |M| / eps); both well under 1e-4 here."""
    pairs = bridge_pairs(olmo2, B, N)
    eap = edge_attribution(olmo2, pairs, plain).set_index(["sender", "receiver"])["score"]
    heads = [e for e in eap.index if e[0].startswith("a0.")]  # senders through layer 0's post-norm
    edges = heads + [e for e in eap.index[:8] if e not in heads]
    assert {r.split(".")[-1] for _, r in heads} >= {"q", "k", "v", "m0", "m1", "logits"}
    eps = 1e-2
    up = exact_edge_patch(olmo2, pairs, plain, edges=edges, scale=eps).set_index(["sender", "receiver"])["score"]
    down = exact_edge_patch(olmo2, pairs, plain, edges=edges, scale=-eps).set_index(["sender", "receiver"])["score"]
    fd = (up - down) / (2 * eps)
    assert max(abs(fd[e] - eap[e]) for e in edges) <= 1e-4
    assert max(abs(eap[e]) for e in heads) > 1e-2  # the post-norm heads' edges carry signal


@torch.no_grad()
def test_patching_every_edge_out_of_a_post_norm_head_is_patching_its_z(olmo2):
    pairs = bridge_pairs(olmo2, B, N)
    runner = EdgeRunner(olmo2)
    g = runner.graph
    _, s_clean = runner.sender_cache(pairs.clean_tokens)
    base = plain(olmo2(pairs.corrupted_tokens))
    _, cache = olmo2.run_with_cache(pairs.clean_tokens, names_filter=lambda nm: nm == act_name("z", 0))
    z_clean = cache[act_name("z", 0)]
    for h in (0, 3):
        u = g.sender_index(0, "head", h)
        w = runner.valid[u].clone().view(1, 1, -1).expand(1, len(g.senders), -1).clone()
        w[:, torch.arange(len(g.senders)) != u] = False
        ours = plain(runner.run(pairs.corrupted_tokens, weights=w, ablated=s_clean)[0])

        def put(z, hook, h=h):
            z = z.clone()
            z[:, :, h] = z_clean[:, :, h]
            return z

        ref = plain(olmo2.run_with_hooks(pairs.corrupted_tokens, fwd_hooks=[(act_name("z", 0), put)]))
        assert (ours - ref).abs().max() <= 1e-9 and (ref - base).abs().max() > 1e-3
