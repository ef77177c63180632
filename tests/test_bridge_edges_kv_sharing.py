"""Edges on a tiny Gemma 4 with KV sharing, ``k = v`` global layers and per-layer k/v head counts.

``tiny_bridge("gemma4-shared")``: layers 0 and 2 are sliding (2 k/v heads, d_head 16), 1 and 3 global
(1 k/v head, d_head 32, no v projection: v = v_norm(raw k)); layers 2 and 3 read the keys and values
of layers 0 and 1. Receivers follow the computation (:mod:`interp_norm.circuits.edge_layer_input`): a
k/v receiver is where a k/v projection reads the residual, so layer 1 has a k receiver and no v one,
and layers 2 and 3 have q receivers only. TransformerLens refuses Gemma 4 edges, so the references
are a five-point finite difference of exact edge patching, node EAP of each head's ``z`` (autograd
through the whole model, KV sharing included) and hooks placed by hand on the model's own k
projections.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from interp_norm.anatomy import original, tiny_bridge
from interp_norm.circuits import attribution_patch, edge_attribution, exact_edge_patch
from interp_norm.circuits.edges import EdgeRunner
from interp_norm.core.hook_names import act_name
from interp_norm.errors import PatchingError

from _models import bridge_pairs

B, N = 3, 6


def plain(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 5] - logits[:, -1, 6]


def _shared():
    """Seed 5 with the softmax's factor halved: random weights at full sharpness have large fifth
    derivatives of the metric along an edge, and the finite difference's truncation with them."""
    return tiny_bridge("gemma4-shared", seed=5, sharpness=0.5).double()


@pytest.fixture(scope="module")
def shared():
    return _shared()


@pytest.fixture(scope="module")
def scaled():
    """Layer scalars 0.6, 1.7, 0.8, 1.3 (the tiny model's are 1; real checkpoints carry their own)."""
    bridge = _shared()
    for blk, s in zip(bridge.blocks, (0.6, 1.7, 0.8, 1.3)):
        original(blk).layer_scalar.fill_(s)
    return bridge


def test_each_layer_has_the_receivers_its_own_projections_read(shared):
    """Read off the Hugging Face modules: a layer with k_proj has one k receiver per k/v head, a v
    receiver too if it has v_proj; a KV-sharing layer (no projections) has its q receivers alone."""
    runner = EdgeRunner(shared)
    R = runner.graph.receivers
    for l, blk in enumerate(shared.blocks):
        hf = original(blk.attn)
        want = [f"a{l}.h{h}.q" for h in range(4)]
        if not hf.is_kv_shared_layer:
            kv = hf.k_proj.out_features // hf.head_dim
            want += [f"a{l}.kv{g}.{j}" for g in range(kv) for j in ("k" if hf.v_proj is None else "kv")]
        got = [r for r in R if r.startswith(f"a{l}.")]
        assert got == want
    assert [r for r in R if r.startswith("a2.") or r.startswith("a3.")] == [f"a{l}.h{h}.q" for l in (2, 3) for h in range(4)]
    assert "a1.kv0.v" not in R and "a0.kv1.v" in R
    edges = set(zip(*[edge_attribution(shared, bridge_pairs(shared, B, N), plain)[c] for c in ("sender", "receiver")]))
    assert ("m1", "a2.h0.q") in edges and ("embed", "a0.kv0.k") in edges and ("a0.h1", "a1.kv0.k") in edges
    pairs = bridge_pairs(shared, B, N)
    with pytest.raises(PatchingError, match="unknown node 'a2.kv0.k'"):  # no k/v of its own: no such edge
        exact_edge_patch(shared, pairs, plain, edges=[("m1", "a2.kv0.k")])
    with pytest.raises(PatchingError, match="not edges"):  # the shared keys are made before layer 0's heads write
        exact_edge_patch(shared, pairs, plain, edges=[("a0.h0", "a0.kv0.k")])


@pytest.mark.parametrize("which", ["shared", "scaled"])
def test_edge_eap_equals_the_finite_difference_of_exact_patching(request, which):
    """Five-point stencil at eps = 1e-2: truncation ~ eps^4 |M^(5)| / 30; Gemma 4's norms and softmax
    compute in float32 inside the float64 model, roundoff ~ 1.5 * 6e-8 |M| / eps ~ 1e-5 |M| (|M| < 1
    here); both under 1e-4 (measured 3e-5; at eps = 5e-3 roundoff already dominates)."""
    bridge = request.getfixturevalue(which)
    pairs = bridge_pairs(bridge, B, N)
    eap = edge_attribution(bridge, pairs, plain).set_index(["sender", "receiver"])["score"]
    edges = list(eap.index)
    eps = 1e-2

    def patched(scale: float):
        return exact_edge_patch(bridge, pairs, plain, edges=edges, scale=scale).set_index(["sender", "receiver"])["score"]

    fd = (8 * (patched(eps) - patched(-eps)) - (patched(2 * eps) - patched(-2 * eps))) / (12 * eps)
    assert max(abs(fd[e] - eap[e]) for e in edges) <= 1e-4
    for r in ("a0.kv0.k", "a0.kv1.v", "a1.kv0.k", "a2.h1.q", "a3.h0.q"):  # every kind of receiver carries signal
        assert max(abs(eap[e]) for e in edges if e[1] == r) > 1e-3, r


@pytest.mark.parametrize("norm", ["live", "frozen"])
@pytest.mark.parametrize("ig_steps", [1, 3])
def test_a_heads_out_edges_add_up_to_its_node_eap(shared, ig_steps, norm):
    """Node EAP of ``z`` (autograd through the whole model, every layer that reads the keys a head's
    write feeds included) equals the sum of the head's out-edges: the receivers after it are every
    reader of the residual it writes. a0's heads reach layer 3's attention only through layer 1's
    k receiver. With ``norm="frozen"`` both hold every norm's scale (the post-attention norm's in the
    edges' sender path, the node pass's freeze hooks). Tolerance: both take the post-attention norm's
    float32 Jacobian, ~6e-8 relative."""
    pairs = bridge_pairs(shared, B, N)
    z = attribution_patch(shared, pairs, plain, "z", by="all", ig_steps=ig_steps, norm=norm).effect()
    out = edge_attribution(shared, pairs, plain, ig_steps=ig_steps, norm=norm).groupby("sender")["score"].sum()
    assert max(abs(float(out[f"a{l}.h{h}"]) - float(z[l, h])) for l in range(4) for h in range(4)) <= 1e-6
    assert float(z.abs().max()) > 1e-2


def _single_edge(bridge, u: str, r: str):
    """(metric with edge u -> r patched to its clean sender, clean - corrupted output of u, pairs)."""
    pairs = bridge_pairs(bridge, B, N)
    runner = EdgeRunner(bridge)
    _, s_clean = runner.sender_cache(pairs.clean_tokens)
    _, s_corr = runner.sender_cache(pairs.corrupted_tokens)
    g = runner.graph
    w = torch.zeros_like(runner.valid)
    w[g.senders.index(u), g.receivers.index(r)] = True
    with torch.no_grad():
        ours = plain(runner.run(pairs.corrupted_tokens, weights=w.unsqueeze(0), ablated=s_clean)[0])
    return ours, s_clean[g.senders.index(u)] - s_corr[g.senders.index(u)], pairs


def _k_input_moved(bridge, layer: int, shift: torch.Tensor, kv_head: int):
    """Hooks moving k/v head ``kv_head``'s k projection input of ``layer`` by ``shift`` (before the
    block's input norm), and nothing else: the k projection re-run on ``norm(resid + shift)``."""
    blk = bridge.blocks[layer]
    ln1, k_proj = original(blk.ln1), original(blk.attn).k_proj
    seen = {}

    def pre(x, hook):
        seen["resid"] = x.clone()
        return x

    def k_out(x, hook):  # [b, n, kv heads, d_head]
        moved = torch.nn.functional.linear(ln1(seen["resid"] + shift), k_proj.weight, k_proj.bias).view(x.shape)
        x = x.clone()
        x[:, :, kv_head] = moved[:, :, kv_head]
        return x

    return [(act_name("resid_pre", layer), pre), (f"blocks.{layer}.attn.k.hook_out", k_out)]


@torch.no_grad()
def _run(bridge, tokens, hooks, watch: list[str]):
    seen = {}

    def keep(x, hook):
        seen[hook.name] = x.clone()
        return x

    logits = bridge.run_with_hooks(tokens, fwd_hooks=hooks + [(nm, keep) for nm in watch])
    return plain(logits), seen


def test_an_edge_into_a_source_layers_key_moves_every_layer_that_shares_them(shared):
    """embed -> a0.kv0.k == moving k/v head 0's k projection input of layer 0 alone; layer 2 reads
    those keys, and its pattern changes with them. Tolerance: the runner subtracts the corrected
    sender where the hook adds the shift, and the float32 norm can round the two sums differently
    (~6e-8 relative on a few entries, |M| < 1): 1e-6."""
    ours, shift, pairs = _single_edge(shared, "embed", "a0.kv0.k")
    watch = ["blocks.2.attn.hook_pattern"]
    ref, moved = _run(shared, pairs.corrupted_tokens, _k_input_moved(shared, 0, shift, 0), watch)
    base, before = _run(shared, pairs.corrupted_tokens, [], watch)
    assert (ours - ref).abs().max() <= 1e-6 and (ref - base).abs().max() > 1e-3
    assert (moved[watch[0]] - before[watch[0]]).abs().max() > 1e-3


def test_an_edge_into_a_k_eq_v_layers_key_moves_its_keys_and_values_and_the_sharing_layer(shared):
    """embed -> a1.kv0.k == moving layer 1's k projection input: its keys and values (v = v_norm of
    the raw k) both move, and so does layer 3, which reads them. Tolerance as above."""
    ours, shift, pairs = _single_edge(shared, "embed", "a1.kv0.k")
    watch = ["blocks.1.attn.k_norm.hook_in", "blocks.1.attn.v_norm.hook_in", "blocks.3.attn.hook_pattern"]
    ref, moved = _run(shared, pairs.corrupted_tokens, _k_input_moved(shared, 1, shift, 0), watch)
    base, before = _run(shared, pairs.corrupted_tokens, [], watch)
    assert (ours - ref).abs().max() <= 1e-6 and (ref - base).abs().max() > 1e-3
    assert all((moved[nm] - before[nm]).abs().max() > 1e-3 for nm in watch)


@torch.no_grad()
def test_circuits_over_the_models_own_receivers(shared):
    """Faithfulness on the KV-sharing model: ablating every edge (resample) is the corrupted run -- the
    receivers are every reader of the residual, shared keys included --, and a node circuit without
    head a0.h1 under resample ablation is the clean run with that head's z patched to its corrupted
    value by a plain hook. Tolerance: the runner's single-head change through the post-attention norm
    rounds in float32 differently from the model's own norm (~6e-8 relative, |M| < 1): 1e-6."""
    from interp_norm.circuits import Circuit, faithfulness, run_with_circuit
    from interp_norm.circuits.circuit import receiver_layout_of

    pairs = bridge_pairs(shared, B, N)
    L, H, layout = 4, 4, receiver_layout_of(shared)
    assert layout == ((2, "qkv"), (1, "qk"), (2, "q"), (1, "q"))
    f = faithfulness(shared, pairs, [Circuit.full(L, H, layout=layout)], plain).set_index("ablation")
    corr_m = float(plain(shared(pairs.corrupted_tokens)).mean())
    assert abs(f.loc["resample", "metric_empty"] - corr_m) <= 1e-6
    assert abs(f.loc["resample", "metric_clean"] - corr_m) > 1e-2
    assert all(abs(f.loc[a, "faithfulness"] - 1) <= 1e-6 for a in ("resample", "mean", "zero"))
    with pytest.raises(PatchingError, match="receiver_layout_of"):
        faithfulness(shared, pairs, [Circuit.full(L, H)], plain)

    runner = EdgeRunner(shared)
    _, s_corr = runner.sender_cache(pairs.corrupted_tokens)
    keep = [f"a{l}.h{h}" for l in range(L) for h in range(H) if (l, h) != (0, 1)] + [f"m{l}" for l in range(L)]
    circuit = Circuit.from_nodes(keep, L, H, layout=layout)
    ours = plain(run_with_circuit(shared, pairs.clean_tokens, [circuit], s_corr, _runner=runner)[0])
    _, cache = shared.run_with_cache(pairs.corrupted_tokens, names_filter=lambda nm: nm == act_name("z", 0))

    def put(z, hook):
        z = z.clone()
        z[:, :, 1] = cache[act_name("z", 0)][:, :, 1]
        return z

    ref = plain(shared.run_with_hooks(pairs.clean_tokens, fwd_hooks=[(act_name("z", 0), put)]))
    assert (ours - ref).abs().max() <= 1e-6 and (ref - plain(shared(pairs.clean_tokens))).abs().max() > 1e-3


@torch.no_grad()
def test_circuits_over_grouped_receivers():
    """Llama's grouped k/v heads: a circuit over its own receivers runs; ablating every edge is the corrupted run."""
    from interp_norm.circuits import Circuit, faithfulness
    from interp_norm.circuits.circuit import receiver_layout_of

    llama = tiny_bridge("llama", seed=5, n_layers=2)
    pairs = bridge_pairs(llama, B, N)
    layout = receiver_layout_of(llama)
    assert layout == ((2, "qkv"), (2, "qkv"))
    f = faithfulness(llama, pairs, [Circuit.full(2, 4, layout=layout)], plain, ablations=("resample",)).iloc[0]
    corr_m = float(plain(llama(pairs.corrupted_tokens)).mean())
    assert abs(f["metric_empty"] - corr_m) <= 1e-5 and abs(f["faithfulness"] - 1) <= 1e-5
    assert abs(f["metric_clean"] - corr_m) > 1e-2
