"""Circuit collapse on tiny random bridges (GPT-2, Llama, Qwen3, OLMo-2, Gemma 4 with grouped k/v heads).

Every decision of :func:`collapse_chunks` (from the clean scores) equals a brute-force re-run:
the model run again with that draw's κ on one layer (its own HF attention module computes the
pattern), or for a Gemma 4 KV-sharing layer an explicit softmax of the noised q and k; the sparse
rows are those of ``hook_pattern``; blocks of ``max_elements`` change nothing; the theory's
prediction lies within Monte-Carlo error of the measured rate.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from interp_norm.anatomy import anatomy, canonical, random_tokens, tiny_bridge
from interp_norm.noise import HeadNoise, bridge_collapse, collapse_chunks, collapse_kappa
from interp_norm.errors import ArchitectureError, NoiseSpecError
from interp_norm.core.defaults import SPARSE_THRESHOLD

ARCHS = ["gpt2", "llama", "qwen3", "olmo2", "gemma4", "gemma4-shared"]
B, N = 3, 16


@pytest.fixture(scope="module")
def models():
    return {a: tiny_bridge(a, seed=5, sharpness=4.0) for a in ARCHS}


def _pattern_after(model, tokens, la, kappa, placement):
    noise = HeadNoise(model, kappa, placement=placement)
    with model.hooks(fwd_hooks=noise.hooks()):
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n == la.hooks["pattern"])
    return cache[la.hooks["pattern"]]


def _explicit_pattern(model, cache, la, kq, kk):
    """Softmax recomputed by hand from (1+κ)·q and (1+κ)·k (after_norm), rotated by the model's rotary."""
    from interp_norm.anatomy.rebuild import attention_mask, rotate

    q = canonical(cache[la.hooks[la.used("q")]], la.layouts[la.used("q")], la.n_heads, la.d_head) * (1 + kq)[..., None]
    k = canonical(cache[la.hooks[la.used("k")]], la.layouts[la.used("k")], la.n_kv_heads, la.d_head) * (1 + kk)[..., None]
    if la.rope:
        q, k = rotate(model, la, q), rotate(model, la, k)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k[:, :, list(la.kv_head_of)]) * la.score_scale
    if la.softcap:
        s = torch.tanh(s / la.softcap) * la.softcap
    return s.masked_fill(~attention_mask(la, s.shape[-1]), -math.inf).softmax(-1)


def _unsure(chunk, i, d, fq_fk_gap=1e-4):
    """Rows whose noised top-2 gap is tiny or whose new top weight sits at the threshold: float32
    re-runs and float64 decisions may legitimately differ there."""
    w = chunk.scores
    top2 = w.topk(2, -1).values
    return (top2[:, 0] - top2[:, 1]) < fq_fk_gap * top2[:, 0].abs().clamp(min=1)


@pytest.mark.parametrize("placement", ["after_norm", "before_norm"])
@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_decisions_equal_a_brute_force_rerun_per_draw(models, arch, placement):
    model = models[arch]
    an = anatomy(model)
    tokens = random_tokens(model, B, N, seed=2)
    levels, draws = (0.15, 0.4), 3
    _, clean = model.run_with_cache(tokens)
    chunks = list(collapse_chunks(model, tokens, levels, draws=draws, placement=placement, seed=7, max_elements=300))
    assert len(chunks) > an.n_layers  # the small budget splits layers into blocks of heads
    same = list(collapse_chunks(model, tokens, levels, draws=draws, placement=placement, seed=7))
    by_layer = {}
    for c in chunks:
        by_layer.setdefault(c.layer, []).append(c)
    moved = checked = 0
    for l, cs in by_layer.items():
        la = an[l]
        pattern = clean[la.hooks["pattern"]]
        rows = torch.cat([c.rows for c in cs])
        loose = torch.cat([c.loose for c in cs], -1)
        strict = torch.cat([c.strict for c in cs], -1)
        ref = [c for c in same if c.layer == l]
        order = lambda r: ((r[:, 1] * B + r[:, 0]) * N + r[:, 2]).argsort()  # noqa: E731 (blocks list heads first)
        o, o_ref = order(rows), order(ref[0].rows)
        assert len(ref) == 1 and torch.equal(ref[0].rows[o_ref], rows[o])
        assert torch.equal(ref[0].loose[..., o_ref], loose[..., o]) and torch.equal(ref[0].strict[..., o_ref], strict[..., o])
        # the rows are hook_pattern's sparse rows (query 0 excluded), up to float noise at the threshold
        top = pattern.max(-1).values
        expect = (top >= SPARSE_THRESHOLD)
        expect[:, :, 0] = False
        got = torch.zeros_like(expect)
        got[rows[:, 0], rows[:, 1], rows[:, 2]] = True
        assert torch.equal(got | ((top - SPARSE_THRESHOLD).abs() < 1e-5), expect | ((top - SPARSE_THRESHOLD).abs() < 1e-5))
        unsure_rows = torch.cat([_unsure(c, 0, 0) for c in cs])
        z_q, z_k = collapse_kappa(an, l, B, N, draws, seed=7)
        clean_arg = pattern.argmax(-1)[rows[:, 0], rows[:, 1], rows[:, 2]]
        for i, level in enumerate(levels):
            for d in range(draws):
                kq, kk = level * z_q[d], level * z_k[d]
                if la.shares_kv:  # its keys are another layer's: recompute this layer's softmax by hand
                    if placement == "before_norm":
                        continue
                    p = _explicit_pattern(model, clean, la, kq, kk)
                else:
                    p = _pattern_after(model, tokens, la, {(l, "q"): kq, (l, "k"): kk}, placement)
                p = p[rows[:, 0], rows[:, 1], rows[:, 2]]
                new = p.argmax(-1)
                brute_loose = new != clean_arg
                brute_strict = brute_loose & (p.max(-1).values >= SPARSE_THRESHOLD)
                ok = ~unsure_rows & ((p.max(-1).values - SPARSE_THRESHOLD).abs() > 1e-5)
                top2 = p.topk(2, -1).values
                ok &= (top2[:, 0] - top2[:, 1]) > 1e-5
                assert torch.equal(loose[i, d][ok], brute_loose[ok]), (l, level, d)
                assert torch.equal(strict[i, d][ok], brute_strict[ok]), (l, level, d)
                assert ok.double().mean() > 0.9
                moved += int(brute_loose.sum())
                checked += int(ok.sum())
    assert checked > 100
    removed = placement == "before_norm" and an[0].norms["q"] is not None and an[0].norms["q"].axis == "per_head"
    assert (moved == 0) if removed else (moved > 0)


@pytest.mark.parametrize("arch,placement", [("gpt2", "after_norm"), ("llama", "after_norm"), ("qwen3", "after_norm"), ("olmo2", "after_norm"),
                                            ("gemma4", "after_norm"), ("gemma4-shared", "after_norm"),
                                            ("gemma4", "before_norm"), ("qwen3", "before_norm")])
def test_predicted_within_monte_carlo_error_of_measured(models, arch, placement):
    model = models[arch]
    tokens = random_tokens(model, 4, 24, seed=1)
    df = bridge_collapse(model, tokens, (0.1, 0.25), draws=128, placement=placement, seed=3, strict_samples=512)
    pooled = df[df.layer == "all"]
    assert set(pooled.definition) == {"loose", "strict"} and (pooled.n_rows > 50).all()
    if placement == "before_norm":  # per-head norms remove the noise: nothing collapses, theory says 0
        assert (pooled.theory == "removed_by_norm").all()
        assert (pooled.measured == 0).all() and (pooled.predicted == 0).all()
        return
    assert (pooled.theory == "multiplicative").all()
    loose = pooled[pooled.definition == "loose"]
    assert loose.measured.iloc[-1] > 0 and loose.mc_se.iloc[-1] > 0  # the larger level collapses rows
    assert (pooled.z.abs() < 4).all(), pooled[["level", "definition", "measured", "predicted", "mc_se", "z"]]
    per_layer = df[(df.layer != "all") & (df.mc_se > 0)]
    assert (per_layer.z.abs() < 4.5).all()


def test_olmo2_all_heads_norm_is_not_modelled_but_measured(models):
    model = models["olmo2"]
    df = bridge_collapse(model, random_tokens(model, 4, 24, seed=1), (0.25,), draws=64, placement="before_norm")
    pooled = df[df.layer == "all"]
    assert (pooled.theory == "not_modelled").all() and pooled.predicted.isna().all()
    assert float(pooled[pooled.definition == "loose"].measured.iloc[0]) > 0  # one divisor cannot remove per-head factors


def test_by_head_rows_add_up_to_the_layer_rows(models):
    model = models["gemma4"]
    tokens = random_tokens(model, 2, 20, seed=4)
    heads = bridge_collapse(model, tokens, (0.2,), draws=32, placement="after_norm", by_head=True, predict=False)
    layers = bridge_collapse(model, tokens, (0.2,), draws=32, placement="after_norm", predict=False)
    per_head = heads[heads["head"] != "all"]
    assert set(per_head["head"]) == set(range(anatomy(model)[0].n_heads))
    for (l, definition), g in per_head.groupby(["layer", "definition"]):
        row = layers[(layers.layer == l) & (layers.definition == definition)].iloc[0]
        assert g.n_rows.sum() == row.n_rows
        assert math.isclose((g.measured * g.n_rows).sum() / g.n_rows.sum(), row.measured, rel_tol=1e-12)
    assert layers.predicted.isna().all()


def test_level_zero_collapses_nothing_and_bad_input_is_refused(models):
    from _models import make_model

    model = models["qwen3"]
    tokens = random_tokens(model, 2, 12, seed=1)
    df = bridge_collapse(model, tokens, (0.0,), draws=8, placement="after_norm")
    assert (df.measured == 0).all() and (df.predicted == 0).all()
    with pytest.raises(NoiseSpecError, match="targets"):
        bridge_collapse(model, tokens, (0.1,), targets=("v",))
    with pytest.raises(NoiseSpecError, match="max_elements"):
        bridge_collapse(model, tokens, (0.1,), max_elements=0)
    with pytest.raises(NoiseSpecError):
        bridge_collapse(model, tokens, (0.7,))  # uniform noise this large can flip a sign
    with pytest.raises(ArchitectureError, match="measure_collapse"):
        bridge_collapse(make_model(attn_norm="qk"), tokens % 10, (0.1,))


@pytest.mark.parametrize("case", ["positive", "sign_flips", "softcap", "tiny_blocks"])
def test_row_decisions_equal_the_whole_noised_softmax(case):
    """row_decisions' shortcuts (ragged candidate keys, bounded far keys in strict, first-maximum
    ties) against argmax and softmax of the whole noised row computed directly (float64)."""
    from interp_norm.noise.bridge_collapse import row_decisions

    g = torch.Generator().manual_seed(11)
    R, K, D, F = 300, 40, 24, 6 * 40
    w = torch.randn(R, K, generator=g, dtype=torch.float64) * 3
    w[:, 0] = w.max(-1).values + torch.rand(R, generator=g, dtype=torch.float64) * 6  # sparse-ish tops
    w[:100] *= -1  # rows whose scores are all negative but one... or not: every sign appears
    w[100:120, 5] = w[100:120, 0]  # exact ties: the first maximum wins
    w[:, K - 3:] = -math.inf  # masked keys
    w[:50, 1:] = -math.inf  # rows with one key
    a = 0.6 if case == "sign_flips" else 0.4
    fq = 1 + a * (torch.rand(D, R, generator=g, dtype=torch.float64) * 2 - 1) * (1.8 if case == "sign_flips" else 1)
    fk = 1 + a * (torch.rand(D, F, generator=g, dtype=torch.float64) * 2 - 1)
    base = torch.randint(0, F // K, (R,), generator=g) * K
    softcap = 15.0 if case == "softcap" else None
    budget = 97 if case == "tiny_blocks" else 1 << 20
    loose, strict = row_decisions(w, fq, fk, base, softcap, 0.9, max_elements=budget)
    x = (w.masked_fill(w.isneginf(), 0) * fk[:, base[:, None] + torch.arange(K)] * fq[..., None]).masked_fill(
        w.isneginf(), -math.inf)
    if softcap:
        x = torch.tanh(x / softcap) * softcap
    moved = x.argmax(-1) != w.argmax(-1)
    assert torch.equal(loose, moved) and 0.05 < moved.double().mean() < 0.95
    assert torch.equal(strict, moved & (x.softmax(-1).max(-1).values >= 0.9)) and strict.any()


def test_the_noise_entry_points_take_any_model():
    """``run_collapse`` and ``run_noise`` are the one entry point for every kind: on a bridge they run
    the bridge's backend on the given text windows, with the same options; our models refuse text."""
    import pandas as pd

    from interp_norm.errors import ConfigError
    from interp_norm.noise import run_collapse, run_noise
    from interp_norm.noise.text_agreement import text_agreement

    from _models import make_model

    bridge = tiny_bridge("qwen3", seed=1, sharpness=4.0)
    tokens = random_tokens(bridge, 2, 8, seed=0)
    options = dict(draws=4, seed=3, placement="after_norm")
    pd.testing.assert_frame_equal(run_collapse(bridge, levels=(0.2, 0.5), tokens=tokens, window_batch=1, **options),
                                  bridge_collapse(bridge, tokens, (0.2, 0.5), **options))
    pd.testing.assert_frame_equal(run_noise(bridge, levels=(0.0, 0.3), tokens=tokens, seed=2, batch_size=1),
                                  text_agreement(bridge, tokens, (0.0, 0.3), seed=2, batch_size=1))
    with pytest.raises(ConfigError, match="pass tokens="):
        run_collapse(bridge, levels=(0.2,))
    ours = make_model()
    with pytest.raises(ConfigError, match="window_batch"):
        run_collapse(ours, levels=(0.2,), window_batch=2)
    with pytest.raises(ConfigError, match="tokens= is a Hugging Face model's text"):
        run_collapse(ours, levels=(0.2,), tokens=tokens)
    with pytest.raises(NoiseSpecError, match="tokens= is a Hugging Face model's text"):
        run_noise(ours, levels=(0.2,), tokens=tokens)
