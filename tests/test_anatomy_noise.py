"""Multiplicative norm noise on bridges and on our own variants.

Level 0 is bit-identical; noise before a per-head norm is removed (exactly, up to eps — Gemma 4's
gainless v-norm included) and what survives equals the effective-factor formula (OLMo-2's
all-heads norm keeps a mix of the heads' factors); grouped k/v heads get one κ per key/value
head; and collapse decisions computed from the clean scores equal a brute-force re-run of the
model with the same κ, draw by draw.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from interp_norm.anatomy import (
    ARCHITECTURES,
    anatomy,
    attention_mask,
    attention_scores,
    canonical,
    random_tokens,
    tiny_bridge,
)
from interp_norm.noise import HeadNoise, effective_factors

from _models import make_model

MODELS = sorted(ARCHITECTURES) + ["own-pre", "own-qkv", "own-qk", "own-none", "own-qkv-ln"]


@pytest.fixture(scope="module")
def models():
    out = {a: tiny_bridge(a, seed=5) for a in ARCHITECTURES}
    out.update({f"own-{v}": make_model(attn_norm=v) for v in ("pre", "qkv", "qk", "none")})
    out["own-qkv-ln"] = make_model(attn_norm="qkv", norm_kind="ln")
    return out


def collapse_factors(model, cache, layer, kappa_q, kappa_k, placement="before_norm"):
    """(f_q [..., b, p, n_heads], f_k [..., b, p, n_kv_heads]): the factors κ puts on the q and k
    the scores use, for noise at ``placement`` (raw projections read from ``cache``). A per-test
    reference (it lived in interp_norm.bridges.noise, used only here)."""
    la = anatomy(model)[layer]
    out = []
    for t, kappa in (("q", kappa_q), ("k", kappa_k)):
        if placement == "after_norm" or la.norms.get(t) is None:
            out.append(1.0 + kappa)
            continue
        raw = canonical(cache[la.hooks[t]], la.layouts.get(t, "bphd"), la.n_heads_of(t), la.d_head)
        out.append(effective_factors(la, t, kappa, raw))
    return out[0], out[1]


def argmax_changes(scores, mask, f_q, f_k, kv_head_of, max_elements=1 << 24):
    """Bool [draw, b, h, q]: whether each row's argmax moves when q and k are scaled per vector
    (the whole noised score block per draw: the per-row reference for the collapse kernels).

    ``scores`` [b, h, q, k] pre-mask and pre-softcap; ``mask`` [q, k] allowed keys; ``f_q``
    [draw, b, q, h]; ``f_k`` [draw, b, k, h_kv], mapped to query heads by ``kv_head_of``. Noised
    scores are f_q·f_k·s (exact: RoPE commutes with scalar factors). First maximum wins."""
    w = scores.to(torch.float64).masked_fill(~mask, 0.0)
    neg = torch.zeros_like(w).masked_fill(~mask, -math.inf)
    clean = scores.to(torch.float64).masked_fill(~mask, -math.inf).argmax(-1)  # [b, h, q]
    idx = torch.as_tensor(list(kv_head_of), dtype=torch.long)
    fq = f_q.to(torch.float64).permute(0, 1, 3, 2)  # [D, b, h, q]
    fk = f_k.to(torch.float64)[..., idx].permute(0, 1, 3, 2)  # [D, b, h, k]
    D = fq.shape[0]
    step = max(1, max_elements // max(1, w.numel()))
    out = torch.empty((D, *clean.shape), dtype=torch.bool)
    for d0 in range(0, D, step):
        noised = w * fq[d0 : d0 + step, ..., :, None] * fk[d0 : d0 + step, ..., None, :] + neg
        out[d0 : d0 + step] = noised.argmax(-1) != clean
    return out


def _cached(model, tokens, fwd_hooks=()):
    with model.hooks(fwd_hooks=list(fwd_hooks)):
        return model.run_with_cache(tokens)


@pytest.mark.parametrize("placement", ["before_norm", "after_norm"])
@pytest.mark.parametrize("name", MODELS)
@torch.no_grad()
def test_level_zero_is_bit_identical(models, name, placement):
    model = models[name]
    tokens = random_tokens(model, 2, 10, seed=1)
    clean = model(tokens)
    noise = HeadNoise(model, level=0.0, placement=placement)
    assert torch.equal(model.run_with_hooks(tokens, fwd_hooks=noise.hooks()), clean)
    an = anatomy(model)
    shared = sum(la.shares_kv for la in an.layers)  # KV-sharing layers have only q of their own
    k_is_v = sum(la.v_from_k and not la.shares_kv for la in an.layers) if placement == "before_norm" else 0
    assert len(noise.last_kappa) == len(noise.sites) == 3 * an.n_layers - 2 * shared - k_is_v


# which targets pass through a norm after their projection (what each architecture is known to do)
NORMED = {"qwen3": "qk", "olmo2": "qk", "gemma4": "qkv", "gemma4-shared": "qkv",
          "own-qkv": "qkv", "own-qk": "qk", "own-qkv-ln": "qkv"}


@pytest.mark.parametrize("name,target", [(n, t) for n, ts in NORMED.items() for t in ts])
@torch.no_grad()
def test_noise_before_a_norm_leaves_the_effective_factor(models, name, target):
    """After the norm, noised = f · clean with f from the formula; f ≈ 1 for a per-head norm."""
    model = models[name]
    an = anatomy(model)
    assert all(la.norms[target] is not None for la in an.layers)
    assert all(la.norms[t] is None for la in an.layers for t in "qkv" if t not in NORMED[name])
    tokens = random_tokens(model, 2, 10, seed=3)
    _, clean = model.run_with_cache(tokens)
    noise = HeadNoise(model, level=0.3, targets=(target,), placement="before_norm", seed=9)
    logits_noised, noised = _cached(model, tokens, noise.hooks())
    logits_clean = model(tokens)
    for la in an.layers:
        heads = la.n_heads_of(target)
        key = f"{target}_normed"
        before = canonical(clean[la.hooks[key]], la.layouts[key], heads, la.d_head).double()
        after = canonical(noised[la.hooks[key]], la.layouts[key], heads, la.d_head).double()
        if la.layer > 0:  # later layers see noised residuals, so their raw inputs differ
            continue
        raw = canonical(clean[la.hooks[target]], la.layouts[target], heads, la.d_head)
        f = effective_factors(la, target, noise.last_kappa[(0, target)], raw).double()
        assert torch.allclose(after, f[..., None] * before, rtol=1e-5, atol=1e-6)
        if la.norms[target].axis == "per_head":  # removed up to the norm's eps: |f − 1| ≲ |κ|·eps/m
            m = raw.double().pow(2).mean(-1).min()
            assert (f - 1).abs().max() <= la.norms[target].eps / m + 1e-6
    if all(la.norms[target].axis == "per_head" for la in an.layers):
        assert (logits_noised - logits_clean).abs().max() <= 1e-4 * logits_clean.abs().max()
    else:  # OLMo-2: one divisor over all heads cannot remove per-head factors
        assert (logits_noised - logits_clean).abs().max() > 1e-2


@torch.no_grad()
def test_gemma4_gainless_v_norm_removes_noise_before_it(models):
    model = models["gemma4"]
    la = anatomy(model)[0]
    assert la.norms["v"].gain is False
    tokens = random_tokens(model, 2, 10, seed=4)
    clean = model(tokens)
    for level in (0.1, 0.5):
        noise = HeadNoise(model, level=level, targets=("v",), placement="before_norm", seed=1)
        out = model.run_with_hooks(tokens, fwd_hooks=noise.hooks())
        assert (out - clean).abs().max() <= 1e-5 * max(1.0, float(clean.abs().max()))
    after = HeadNoise(model, level=0.1, targets=("v",), placement="after_norm", seed=1)
    assert (model.run_with_hooks(tokens, fwd_hooks=after.hooks()) - clean).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["llama", "qwen3", "olmo2", "gemma4", "gemma4-shared"])
@torch.no_grad()
def test_grouped_kv_heads_get_one_kappa_per_key_value_head(models, name):
    model = models[name]
    la = anatomy(model)[0]
    assert la.n_kv_heads < la.n_heads
    tokens = random_tokens(model, 2, 9, seed=6)
    _, clean = model.run_with_cache(tokens)
    noise = HeadNoise(model, level=0.3, targets=("k",), placement="after_norm", layers=[0], seed=2)
    _, noised = _cached(model, tokens, noise.hooks())
    kappa = noise.last_kappa[(0, "k")]
    assert kappa.shape == (2, 9, la.n_kv_heads)
    key = la.used("k")
    before = canonical(clean[la.hooks[key]], la.layouts[key], la.n_kv_heads, la.d_head)
    after = canonical(noised[la.hooks[key]], la.layouts[key], la.n_kv_heads, la.d_head)
    assert torch.allclose(after, before * (1 + kappa)[..., None], rtol=1e-6, atol=1e-6)


def _near_ties(scores, mask, fq, fk, kv_head_of, gap=1e-4):
    """[D, b, h, q] rows whose clean or noised top-2 gap is below ``gap`` (float ties may differ)."""
    w = scores.double().masked_fill(~mask, -math.inf)
    idx = torch.as_tensor(kv_head_of)
    noised = w * fq.double().permute(0, 1, 3, 2)[..., None] * fk.double()[..., idx].permute(0, 1, 3, 2)[..., None, :]
    noised = noised.masked_fill(~mask, -math.inf)

    def small_gap(x):
        top = x.topk(min(2, x.shape[-1]), -1).values
        if top.shape[-1] < 2:
            return torch.zeros(top.shape[:-1], dtype=torch.bool)
        g = top[..., 0] - top[..., 1]
        return torch.nan_to_num(g, nan=math.inf) < gap * (1 + top[..., 0].abs())

    return small_gap(noised) | small_gap(w)[None]


@pytest.mark.parametrize("placement", ["after_norm", "before_norm"])
@pytest.mark.parametrize("name", MODELS)
@torch.no_grad()
def test_collapse_from_clean_scores_equals_brute_force(models, name, placement):
    """For each draw: argmax changes predicted from clean scores × f_q·f_k == argmax changes of
    the pattern when the model is re-run with that κ on one layer."""
    model = models[name]
    an = anatomy(model)
    b, n, draws = 2, 10, 6
    tokens = random_tokens(model, b, n, seed=8)
    _, cache = model.run_with_cache(tokens)
    g = torch.Generator().manual_seed(0)
    moved = 0
    for la in an.layers:
        kq = (torch.rand(draws, b, n, la.n_heads, generator=g) * 2 - 1) * 0.8
        kk = (torch.rand(draws, b, n, la.n_kv_heads, generator=g) * 2 - 1) * 0.8
        if la.shares_kv:  # its keys are another layer's: only q can be noised for this layer alone
            kk.zero_()
        mask = attention_mask(la, n)
        scores = attention_scores(model, cache, la.layer, softcap=False)
        fq, fk = collapse_factors(model, cache, la.layer, kq, kk, placement)
        predicted = argmax_changes(scores, mask, fq, fk, la.kv_head_of)
        assert torch.equal(predicted, argmax_changes(scores, mask, fq, fk, la.kv_head_of, max_elements=1))
        clean_top = cache[la.hooks["pattern"]].argmax(-1)
        ties = _near_ties(scores, mask, fq, fk, la.kv_head_of)
        for d in range(draws):
            kappa = {(la.layer, "q"): kq[d]} if la.shares_kv else {(la.layer, "q"): kq[d], (la.layer, "k"): kk[d]}
            noise = HeadNoise(model, kappa, placement=placement)
            _, noised = _cached(model, tokens, noise.hooks())
            brute = noised[la.hooks["pattern"]].argmax(-1) != clean_top
            ok = ~ties[d]
            assert torch.equal(predicted[d][ok], brute[ok]), (la.layer, d)
        assert ties.double().mean() < 0.05
        moved += int(predicted.sum())
    removed = placement == "before_norm" and all(
        la.norms["q"] is not None and la.norms["q"].axis == "per_head" for la in an.layers)
    assert (moved == 0) if removed else (moved > 0)


def test_gemma4_kv_sharing_and_k_equals_v_restrict_where_noise_can_go(models):
    from interp_norm.errors import NoiseSpecError

    model = models["gemma4-shared"]
    an = anatomy(model)
    with pytest.raises(NoiseSpecError, match="KV sharing"):
        HeadNoise(model, level=0.1, targets=("k",), layers=[3])
    with pytest.raises(NoiseSpecError, match="no v projection"):
        HeadNoise(model, level=0.1, targets=("v",), layers=[1], placement="before_norm")
    sites = HeadNoise(model, level=0.1, placement="before_norm").sites
    assert sites == [(0, "q"), (0, "k"), (0, "v"), (1, "q"), (1, "k"), (2, "q"), (3, "q")]
    assert [la.kv_layer for la in an.layers] == [0, 1, 0, 1]
    # k noise at a source layer reaches the layer that shares its keys: layer 2's k hook is layer 0's
    assert an[2].hooks["k_normed"] == an[0].hooks["k_normed"]


@pytest.mark.parametrize("name", ["qwen3", "gemma4"])
@torch.no_grad()
def test_norm_noise_on_a_bridge_is_head_noise_and_a_context_manager(models, name):
    """The README's ``with NormNoise(model, level, seed=...)`` works on a bridge: inside, the
    hooked k after its norm is (1+κ)·clean per key/value head (κ from ``last_kappa``); on exit
    the hooks are gone and the logits are the clean ones again, bit for bit."""
    from interp_norm.errors import NoiseSpecError
    from interp_norm.noise import NormNoise

    model = models[name]
    la = anatomy(model)[0]
    tokens = random_tokens(model, 2, 10, seed=4)
    clean_logits, clean = model.run_with_cache(tokens)
    noise = NormNoise(model, 0.1, "k", placement="after_norm", seed=7)
    assert isinstance(noise, HeadNoise) and {t for _, t in noise.sites} == {"k"}
    hook = la.hooks[la.used("k")]
    with noise:
        noised_logits, noised = model.run_with_cache(tokens)
    layout = la.layouts.get(la.used("k"), "bphd")
    k_clean = canonical(clean[hook], layout, la.n_heads_of("k"), la.d_head)
    k_noised = canonical(noised[hook], layout, la.n_heads_of("k"), la.d_head)
    kappa = noise.last_kappa[(0, "k")]
    assert kappa.shape[2] == la.n_heads_of("k") and kappa.abs().max() > 0
    torch.testing.assert_close(k_noised, k_clean * (1 + kappa)[..., None])
    assert not torch.allclose(noised_logits, clean_logits)
    assert torch.equal(model(tokens), clean_logits)  # hooks removed on exit
    with pytest.raises(NoiseSpecError, match="heads"):
        NormNoise(model, 0.1, heads=[0])
    for option in (dict(shared=True), dict(direction="random")):  # controls for our models only, refused here
        with pytest.raises(NoiseSpecError, match=next(iter(option))):
            NormNoise(model, 0.1, **option)


@pytest.mark.parametrize("name", [n for n in MODELS if n != "own-qkv-ln"])
@torch.no_grad()
def test_norm_noise_is_one_class_and_a_context_manager_on_every_model(models, name):
    """``NormNoise(model, ...)`` is a NormNoise (and a HeadNoise) on our four variants and on
    every bridge; inside ``with`` the k the scores use is (1+κ)·clean per key/value head (κ from
    ``last_kappa``), and on exit the hooks are gone (clean logits bit for bit)."""
    from interp_norm.noise import NormNoise

    model = models[name]
    la = anatomy(model)[0]
    tokens = random_tokens(model, 2, 10, seed=4)
    clean_logits, clean = model.run_with_cache(tokens)
    noise = NormNoise(model, 0.1, "k", placement="after_norm", seed=7)
    assert isinstance(noise, NormNoise) and isinstance(noise, HeadNoise)
    key = la.used("k")
    with noise:
        noised_logits, noised = model.run_with_cache(tokens)
    heads = la.n_heads_of("k")
    k_clean = canonical(clean[la.hooks[key]], la.layouts.get(key, "bphd"), heads, la.d_head)
    k_noised = canonical(noised[la.hooks[key]], la.layouts.get(key, "bphd"), heads, la.d_head)
    kappa = noise.last_kappa[(0, "k")].reshape(2, 10, heads)
    assert kappa.abs().max() > 0
    torch.testing.assert_close(k_noised, k_clean * (1 + kappa)[..., None])
    assert not torch.allclose(noised_logits, clean_logits)
    assert torch.equal(model(tokens), clean_logits)
