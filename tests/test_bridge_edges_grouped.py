"""Edges into grouped key/value heads (Llama, Qwen3): one k and one v receiver per k/v head.

The reference is an independent computation on an equivalent *ungrouped* copy of the same model --
each k/v head's projection repeated for every query head of its group, so the two models compute the
same function -- scored by TransformerLens's own edge ``attribution_patch``. A grouped receiver's
input is shared by its query heads, so its gradient is the sum of the ungrouped heads' gradients:
the ungrouped k/v scores summed over each group must equal ours.
"""

from __future__ import annotations

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformer_lens.tools.analysis.attribution_patching import EdgeAttributionConfig, Node
from transformer_lens.tools.analysis.attribution_patching import attribution_patch as tl_attribution_patch

from interp_norm.anatomy import bridge_from_hf, tiny_hf_model
from interp_norm.circuits import edge_attribution, exact_edge_patch
from interp_norm.circuits.edges import EdgeRunner
from interp_norm.core import nodes
from interp_norm.errors import PatchingError

from _models import bridge_pairs

B, N, L, H, KV = 3, 6, 2, 4, 2


def plain(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 5] - logits[:, -1, 6]


def ungrouped_copy(hf, arch: str):
    """The same model with ``n_kv_heads = n_heads``: each k/v head's rows repeated per query head."""
    wide = tiny_hf_model(arch, seed=0, n_layers=L, n_kv_heads=H)
    state = copy.deepcopy(hf.state_dict())
    for name, w in list(state.items()):
        if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            per_head = w.view(KV, -1, *w.shape[1:])
            state[name] = per_head.repeat_interleave(H // KV, dim=0).reshape(H * per_head.shape[1], *w.shape[1:])
    wide.load_state_dict(state)
    return wide.eval()


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def grouped(request):
    arch = request.param
    hf = tiny_hf_model(arch, seed=5, n_layers=L, n_heads=H, n_kv_heads=KV)
    wide, ref = ungrouped_copy(hf, arch), copy.deepcopy(hf)
    return ref, bridge_from_hf(hf, name=f"tiny-{arch}"), bridge_from_hf(wide, name=f"tiny-{arch}-ungrouped")


def _tl_name(node: Node, reader: bool) -> str:
    """TransformerLens's node as our name, an ungrouped k/v reader mapped to its k/v head's receiver."""
    if node.kind in ("embed", "logits"):
        return node.kind
    if node.kind in ("mlp_out", "mlp_in"):
        return f"m{node.layer}"
    if not reader:
        return f"a{node.layer}.h{node.head}"
    j = node.kind[0]
    return nodes.head_input(node.layer, node.head, j) if j == "q" else nodes.kv_input(node.layer, node.head // (H // KV), j)


def test_the_ungrouped_copy_is_the_same_function(grouped):
    _, bridge, wide = grouped
    toks = bridge_pairs(bridge, B, N).clean_tokens
    with torch.no_grad():
        assert (bridge(toks) - wide(toks)).abs().max() <= 1e-5


def test_grouped_edge_eap_equals_transformer_lens_on_the_ungrouped_copy(grouped):
    _, bridge, wide = grouped
    pairs = bridge_pairs(bridge, B, N)
    ours = edge_attribution(bridge, pairs, plain).set_index(["sender", "receiver"])["score"]
    expected_receivers = {nodes.kv_input(l, g, j) for l in range(L) for g in range(KV) for j in "kv"}
    assert expected_receivers <= set(ours.index.get_level_values("receiver"))
    assert not any(r.endswith((".k", ".v")) and ".h" in r for r in ours.index.get_level_values("receiver"))
    lg = lambda x: x[0, -1, 5] - x[0, -1, 6]  # noqa: E731  -- TransformerLens scores one metric value
    ref = tl_attribution_patch(wide, pairs.clean_tokens, pairs.corrupted_tokens, lg,
                               EdgeAttributionConfig(granularity="edge")).edge_scores
    summed: dict = {}
    for (w, r), v in ref.items():
        key = (_tl_name(w, False), _tl_name(r, True))
        summed[key] = summed.get(key, 0.0) + v
    assert set(summed) == set(ours.index)
    diff = max(abs(summed[k] - ours[k]) for k in summed)
    kv_max = max(abs(v) for k, v in summed.items() if ".kv" in k[1])
    assert diff <= 1e-5 and kv_max > 1e-4


def test_grouped_edge_eap_equals_a_hand_gradient_of_the_shared_key_input(grouped):
    """Edge (embed -> a1.kv0.k): (e_clean - e_corr) . dM/dx, x a perturbation added to the input of
    layer 1's k projection only, read by autograd on an untouched copy of the grouped Hugging Face model."""
    hf, bridge, _ = grouped
    pairs = bridge_pairs(bridge, B, N)
    ours = edge_attribution(bridge, pairs, plain).set_index(["sender", "receiver"])["score"]
    emb = hf.get_input_embeddings()
    de = (emb(pairs.clean_tokens) - emb(pairs.corrupted_tokens)).detach()
    k_proj = hf.model.layers[1].self_attn.k_proj
    dh = k_proj.out_features // KV
    leaf = torch.zeros(B, N, hf.config.hidden_size, requires_grad=True)
    norm = hf.model.layers[1].input_layernorm
    # k/v head 0's k input is the residual plus the leaf, before the norm; the other k/v head and q, v see none
    seen = {}

    def pre(mod, args):
        seen["resid"] = args[0]

    def k_hook(mod, args, out):
        shifted = torch.nn.functional.linear(type(norm).forward(norm, seen["resid"] + leaf), k_proj.weight, k_proj.bias)
        return torch.cat([shifted[..., :dh], out[..., dh:]], dim=-1)

    h1 = norm.register_forward_pre_hook(pre)
    h2 = k_proj.register_forward_hook(k_hook)
    try:
        m = plain(hf(pairs.corrupted_tokens).logits).sum()
        (g,) = torch.autograd.grad(m, leaf)
    finally:
        h1.remove(), h2.remove()
    ref = float((de * g).sum() / B)
    assert abs(ours[("embed", "a1.kv0.k")] - ref) <= 1e-5 and abs(ref) > 1e-6


def test_grouped_exact_edge_patch_equals_patching_every_head_of_the_group_on_the_copy(grouped):
    """Exact patching of a shared k/v input = patching that input for all its query heads at once."""
    _, bridge, wide = grouped
    pairs = bridge_pairs(bridge, B, N)
    edges = [("embed", "a1.kv1.v"), ("a0.h2", "a1.kv0.k"), ("m0", "a1.kv1.k"), ("a0.h0", "a1.h3.q")]
    ours = exact_edge_patch(bridge, pairs, plain, edges=edges).set_index(["sender", "receiver"])["score"]
    wide_runner = EdgeRunner(wide)
    g = wide_runner.graph
    _, s_clean = wide_runner.sender_cache(pairs.clean_tokens)
    base_logits, s_corr = wide_runner.sender_cache(pairs.corrupted_tokens)
    base = plain(base_logits).double().mean()
    for u, r in edges:
        w = torch.zeros(1, *wide_runner.valid.shape, dtype=torch.bool)
        n = nodes.parse(r)
        heads = [n.head] if n.kind == "head" else range(n.head * (H // KV), (n.head + 1) * (H // KV))
        for h in heads:
            w[0, g.senders.index(u), g.receiver_index(n.layer, "head", h, "qkv".index(n.input))] = True
        with torch.no_grad():
            logits, _ = wide_runner.run(pairs.corrupted_tokens, weights=w, ablated=s_clean)
        ref = float(plain(logits).double().mean() - base)
        assert abs(ours[(u, r)] - ref) <= 1e-5
    assert ours.abs().max() > 1e-4


def test_split_backend_refuses_grouped_heads(grouped):
    _, bridge, _ = grouped
    with pytest.raises(PatchingError, match="grouped"):
        EdgeRunner(bridge, backend="split")


def test_circuits_refuse_grouped_heads_with_a_typed_error(grouped):
    from interp_norm.circuits import Circuit
    from interp_norm.circuits.circuit import faithfulness

    _, bridge, _ = grouped
    with pytest.raises(PatchingError, match="groups its k/v heads"):
        faithfulness(bridge, bridge_pairs(bridge, B, N), Circuit.full(L, H), plain, ablations=("resample",))
