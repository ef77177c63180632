"""Geometry on TransformerBridges of tiny random GPT-2, Llama, Qwen3, OLMo-2 and Gemma 4 models.

Every expected value is computed here independently of interp_norm.geometry: norm inputs/outputs
are captured with plain torch forward hooks on the Hugging Face norm modules (found by class name,
not by the bridge's hooks), gains read from their ``weight``/``bias``, and attention patterns and
residual streams taken from the untouched HF model's own ``output_attentions`` /
``output_hidden_states``.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from interp_norm.anatomy import random_tokens
from interp_norm.errors import ConfigError
from interp_norm.geometry import (
    attended_norms,
    bridge_geometry,
    bridge_norms,
    ellipsoid_membership,
    ellipsoid_table,
    geometry_summary,
    max_attention,
    norm_spread,
    run_geometry,
    sparsity_summary,
)
from interp_norm.core.defaults import SPARSE_THRESHOLD
from _models import bridges_with_hf_copies

ARCHS = ("gpt2", "llama", "qwen3", "olmo2", "gemma4")


@pytest.fixture(scope="module")
def built():
    """arch -> (bridge, untouched HF copy, tokens)."""
    return {arch: (bridge, ref, random_tokens(bridge, 3, 12, seed=4, low=3))
            for arch, (bridge, ref) in bridges_with_hf_copies(ARCHS, seed=5).items()}


def _is_hf_norm(module: torch.nn.Module) -> bool:
    """The HF norm classes of these four architectures, by name (the test's own independent list)."""
    return type(module).__name__ in ("LayerNorm", "LlamaRMSNorm", "Qwen3RMSNorm", "Olmo2RMSNorm", "Gemma4RMSNorm")


def _captured(ref, tokens):
    """{HF path: (module, inputs [n, N], outputs [n, N])} of every norm of the untouched HF model,
    from torch forward hooks (the bridge recomputes some norms itself, so hooks go on the copy)."""
    got, handles = {}, []
    for path, m in ref.named_modules():
        if _is_hf_norm(m):
            def hook(mod, args, out, path=path):
                x = args[0].detach().double()
                got[path] = (mod, x.reshape(-1, x.shape[-1]), out.detach().double().reshape(-1, x.shape[-1]))
            handles.append(m.register_forward_hook(hook))
    try:
        with torch.no_grad():
            ref(tokens)
    finally:
        for h in handles:
            h.remove()
    return got


def _hf_path(bridge, module_name: str) -> str:
    """The HF path (as in the untouched copy) of the module a bridge component wraps (norms the
    bridge does not wrap are named by that path already)."""
    try:
        orig = bridge.get_submodule(module_name)._original_component
    except AttributeError:
        return module_name
    paths = {id(m): n.replace("._original_component", "") for n, m in bridge.original_model.named_modules()}
    return paths[id(orig)]


@pytest.mark.parametrize("arch", ARCHS)
def test_ellipsoid_membership_equals_the_formula_for_every_norm(built, arch):
    """Riechers: a norm with gain g, bias b maps x onto the ellipsoid |Π(y−b)/g|²/N = σ²/(σ²+ε)."""
    bridge, ref, tokens = built[arch]
    table = ellipsoid_membership(bridge, tokens)
    got = _captured(ref, tokens)
    # every HF norm module that ran is in the table, and nothing else
    rows = {_hf_path(bridge, r.module): r for r in table.itertuples()}
    assert set(rows) == set(got), (len(rows), len(got))
    kinds = set()
    for key, (m, x, y) in got.items():
        r = rows[key]
        ln = type(m).__name__ == "LayerNorm"
        g = m.weight.double() if getattr(m, "weight", None) is not None else torch.ones(x.shape[-1], dtype=torch.float64)
        b = m.bias.double() if ln and m.bias is not None else torch.zeros_like(g)
        eps = float(getattr(m, "eps", getattr(m, "variance_epsilon", None)))
        xc = x - x.mean(-1, keepdim=True) if ln else x
        var = xc.pow(2).mean(-1)
        formula = var / (var + eps)
        z = (y - b) / g
        membership = z.pow(2).mean(-1)  # z already lies in the hyperplane for a LayerNorm output
        assert (membership - formula).abs().max() < 1e-5  # the formula holds on the HF model itself
        assert r.n == len(x) and r.kind == ("ln" if ln else "rms") and r.N == x.shape[-1]
        assert r.membership_mean == pytest.approx(float(membership.detach().mean()), abs=1e-6)
        assert r.predicted_mean == pytest.approx(float(formula.mean()), abs=1e-9)
        assert r.max_abs_err < 1e-5
        kinds.add((r.role, r.axis))
    expected = {"gpt2": {("residual", "residual")}, "llama": {("residual", "residual")},
                "qwen3": {("residual", "residual"), ("q_norm", "per_head"), ("k_norm", "per_head")},
                "olmo2": {("residual", "residual"), ("q_norm", "all_heads"), ("k_norm", "all_heads")},
                "gemma4": {("residual", "residual"), ("q_norm", "per_head"), ("k_norm", "per_head"),
                           ("v_norm", "per_head"), ("unhooked", "other")}}[arch]
    assert kinds == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_fitted_gains_are_the_modules_weights(built, arch):
    bridge, ref, _ = built[arch]
    for nm in bridge_norms(bridge):
        m = ref.get_submodule(_hf_path(bridge, nm.name))
        w = getattr(m, "weight", None)
        expect = torch.ones(nm.dim, dtype=torch.float64) if w is None else w.double()
        assert torch.allclose(nm.ellipsoid.gain, expect, atol=1e-5), nm.name
        if type(m).__name__ == "LayerNorm":
            assert torch.allclose(nm.ellipsoid.center, m.bias.double(), atol=1e-5)
            assert nm.ellipsoid.semi_axes.numel() == nm.dim - 1
        else:
            # RMSNorm: axes are the coordinate axes with semi-axis √N·|g_n|
            s = torch.sort(nm.ellipsoid.semi_axes).values
            assert torch.allclose(s, torch.sort(np.sqrt(nm.dim) * expect.abs()).values, atol=1e-4)
    if arch == "gemma4":  # the v-norm has no learnable scale
        v = [nm for nm in bridge_norms(bridge) if nm.role == "v_norm"]
        assert v and all(bool((nm.ellipsoid.gain - 1).abs().max() < 1e-6) for nm in v)
    assert len(ellipsoid_table(bridge)) == len(bridge_norms(bridge))


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_sparsity_uses_the_models_own_pattern(built, arch):
    bridge, ref, tokens = built[arch]
    attn = ref(tokens, output_attentions=True).attentions
    mx = max_attention(bridge, tokens, exclude_bos=True)
    summary = sparsity_summary(mx).set_index("layer")
    for l, a in enumerate(attn):
        m = a[:, :, 1:].max(-1).values.double()  # [b, h, q>=1]
        got = mx[mx["layer"] == l].sort_values(["head", "batch", "query"])
        assert np.allclose(got["max_attn"].to_numpy(), m.permute(1, 0, 2).reshape(-1).numpy(), atol=1e-6)
        assert summary.loc[l, "frac_sparse"] == pytest.approx(float((m >= SPARSE_THRESHOLD).double().mean()))


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_norm_spread_weights_and_norms_by_hand(built, arch):
    bridge, ref, tokens = built[arch]
    out = ref(tokens, output_attentions=True, output_hidden_states=True)
    df = attended_norms(bridge, tokens, exclude_bos=False)
    for l in range(len(out.attentions)):
        x = out.hidden_states[l].double()
        if arch == "gpt2":  # LayerNorm model: the norm of the centred residual
            x = x - x.mean(-1, keepdim=True)
        norms = x.norm(dim=-1)  # [b, p]
        weight = out.attentions[l].double().sum(2)  # attention received [b, h, k]
        got = df[(df["layer"] == l)].sort_values(["head", "batch", "pos"])
        assert np.allclose(got["norm"].to_numpy(), norms.reshape(-1).repeat(weight.shape[1]).numpy(), rtol=1e-5)
        assert np.allclose(got["weight"].to_numpy(), weight.permute(1, 0, 2).reshape(-1).numpy(), atol=1e-5)
    spread = norm_spread(bridge, tokens)
    assert spread["spread"].notna().all() and (spread["spread"] >= 0).all()


def test_run_geometry_on_a_bridge_and_the_summary(built):
    bridge, _, tokens = built["qwen3"]
    res = run_geometry(bridge, tokens=tokens)
    assert set(res) == {"anatomy", "norm_spread", "sparsity_hist", "sparsity_summary", "ellipsoids",
                        "ellipsoid_axes", "ellipsoid_membership"}
    assert res["ellipsoid_membership"]["max_abs_err"].max() < 1e-5
    per_layer = geometry_summary(res)
    assert list(per_layer["layer"]) == [0, 1] and "spread" in per_layer and "frac_sparse" in per_layer
    overall = geometry_summary(res, per_layer=False)
    assert len(overall) == 1 and "sphere_score" not in overall
    # default tokens: no tokenizer on a tiny model -> seeded random ordinary ids
    again = bridge_geometry(bridge, n=2, n_ctx=9)
    assert again["ellipsoid_membership"]["n"].min() > 0


def test_our_model_only_analyses_still_refuse_a_bridge(built):
    from interp_norm.geometry import orthogonal_spheres

    bridge, _, tokens = built["gpt2"]
    with pytest.raises(ConfigError, match="HookedNormTransformer"):
        orthogonal_spheres(bridge, tokens)
