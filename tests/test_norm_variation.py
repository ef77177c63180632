"""norm_variation: the models' own norm variation, against a brute-force loop over run_with_cache."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from interp_norm import HookedNormTransformer, ModelConfig
from interp_norm.core.task import AdditionTask, PAD_ID, answer_mask
from interp_norm.errors import NoiseSpecError
from interp_norm.noise.norm_variation import beside_levels, norm_variation
from tests._models import make_model

TASK = AdditionTask.preset("cpu")


def _tokens(n: int = 24):
    return TASK.test_set("id", n, seed=3).tokens


def _brute(model, tokens, hook: str, head: int, mask) -> np.ndarray:
    """‖x‖ per counted token of one head, by an explicit sum of squares over the cached activation."""
    _, cache = model.run_with_cache(tokens)
    x = cache[hook][:, :, head, :].double()
    norms = []
    for b in range(x.shape[0]):
        for p in range(x.shape[1]):
            if mask[b, p]:
                norms.append(math.sqrt(float((x[b, p] ** 2).sum())))
    return np.array(norms)


@pytest.mark.parametrize("attn_norm", ["pre", "qkv"])
@pytest.mark.parametrize("positions", ["all", "answer"])
def test_kappa_matches_an_explicit_computation(attn_norm, positions):
    model = make_model(seed=1, attn_norm=attn_norm)
    tokens = _tokens()
    df = norm_variation(model, tokens, positions=positions)
    keep = tokens.shape[1] - int((tokens == PAD_ID).all(0).flip(0).cumprod(0).sum())  # trailing all-pad columns
    toks = tokens[:, :keep]
    mask = answer_mask(toks) if positions == "answer" else toks != PAD_ID
    sites = {"before_norm": "blocks.{l}.attn.hook_{t}", "after_norm": "blocks.{l}.attn.hook_{t}_normed"}
    expected_sites = {"pre": {"before_norm"}, "qkv": {"before_norm", "after_norm"}}[attn_norm]
    assert set(df["site"]) == expected_sites
    assert len(df) == model.cfg.n_layers * 3 * model.cfg.n_heads * len(expected_sites)
    for r in df.sample(8, random_state=0).itertuples():
        norms = _brute(model, toks, sites[r.site].format(l=r.layer, t=r.vector), r.head, mask)
        sorted_norms = np.sort(norms)
        n = len(norms)
        median = (sorted_norms[(n - 1) // 2] + sorted_norms[n // 2]) / 2
        kappa = norms / median - 1
        assert r.n_tokens == n == int(mask.sum())
        # float32 activations read the same way on both sides; sums of squares in float64
        assert r.typical_norm == pytest.approx(median, rel=1e-12)
        assert r.kappa_rms == pytest.approx(math.sqrt(sum(k * k for k in kappa) / n), rel=1e-9, abs=1e-12)
        k = np.sort(kappa)
        h = 0.95 * (n - 1)  # linear-interpolation quantile, written out
        q95 = k[int(h)] + (h - int(h)) * (k[min(int(h) + 1, n - 1)] - k[int(h)])
        assert r.kappa_q95 == pytest.approx(q95, rel=1e-9, abs=1e-12)


def test_uniform_noise_on_the_tokens_is_recovered_as_its_level():
    """Norms that vary only by a known uniform (1+κ) per token give back that κ's RMS as the matching level."""
    model = HookedNormTransformer(ModelConfig.preset("tiny", attn_norm="none")).eval()
    tokens = TASK.test_set("id", 400, seed=5).tokens
    level = 0.05
    g = torch.Generator().manual_seed(0)

    def fix_norm(x, hook):  # every token's q at unit norm, times (1+κ), κ uniform with RMS = level
        kappa = (torch.rand(x.shape[:-1] + (1,), generator=g) * 2 - 1) * math.sqrt(3) * level
        return x / x.norm(dim=-1, keepdim=True) * (1 + kappa)

    with model.hooks(fwd_hooks=[("blocks.0.attn.hook_q", fix_norm)]):
        df = norm_variation(model, tokens)
    q = df[(df["layer"] == 0) & (df["vector"] == "q")]
    n = int(q["n_tokens"].iloc[0])
    # the sample RMS of n uniform draws around their median: within 4 standard errors of the level
    assert np.all(np.abs(q["matching_level"] - level) < 4 * level * math.sqrt(0.8 / n) + 2 * level * 3 / math.sqrt(n))
    assert np.all(np.abs(q["level_p90"] - level) < 0.15 * level)


def test_unit_gain_qkv_norm_leaves_no_variation_after_the_norm():
    """Identity: an RMS norm with gain 1 puts every q at norm √d_head (up to eps), whatever went in."""
    model = HookedNormTransformer(ModelConfig.preset("tiny", attn_norm="qkv", norm_kind="rms")).eval()
    df = norm_variation(model, _tokens())
    after = df[df["site"] == "after_norm"]
    assert np.allclose(after["typical_norm"], math.sqrt(model.cfg.d_head), rtol=1e-4)
    assert after["kappa_rms"].max() < 1e-4
    assert df[df["site"] == "before_norm"]["kappa_rms"].min() > 1e-3


def test_beside_levels_counts_heads_above_each_level():
    df = norm_variation(make_model(seed=2, attn_norm="pre"), _tokens())
    b = beside_levels(df, levels=(0.0, 0.01, 0.1))
    assert list(b["vector"]) == ["q", "k", "v"]
    assert "share_above_0" not in b.columns  # level 0 is the clean run, not a level to compare with
    for _, r in b.iterrows():
        m = df[df["vector"] == r["vector"]]["matching_level"].to_numpy()
        assert r["share_above_0.01"] == pytest.approx(float(np.mean(m > 0.01)))
        assert r["share_above_0.1"] == pytest.approx(float(np.mean(m > 0.1)))
        assert r["median_level"] == pytest.approx(float(np.median(m)))


@pytest.mark.parametrize("kw", [dict(quantiles=(0.0, 0.5)), dict(quantiles=()), dict(positions="some"),
                                dict(centre="mode")])
def test_bad_options_raise_a_typed_error(kw):
    with pytest.raises(NoiseSpecError):
        norm_variation(make_model(attn_norm="pre"), _tokens(4), **kw)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_bridge_is_measured_through_its_anatomy(arch):
    """On a TransformerBridge the q/k/v hooks and layouts come from the anatomy; the norms, medians and κ
    are checked by an explicit loop over the cached tensors, and k has the key/value heads."""
    from interp_norm.anatomy import anatomy, canonical, tiny_bridge

    bridge = tiny_bridge(arch)
    tokens = torch.randint(0, bridge.cfg.d_vocab, (3, 10), generator=torch.Generator().manual_seed(0))
    df = norm_variation(bridge, tokens)
    an = anatomy(bridge)
    la = an.layers[0]
    assert set(df["site"]) == ({"before_norm", "after_norm"} if la.norms.get("q") is not None else {"before_norm"})
    assert (df[(df["vector"] == "k") & (df["layer"] == 0)]["head"].nunique()) == la.n_kv_heads
    with pytest.raises(NoiseSpecError):
        norm_variation(bridge, tokens, positions="answer")
    _, cache = bridge.run_with_cache(tokens)
    for r in df.sample(6, random_state=1).itertuples():
        lay = an.layers[r.layer]
        key = r.vector if r.site == "before_norm" else f"{r.vector}_normed"
        heads = lay.n_heads if r.vector == "q" else lay.n_kv_heads
        x = canonical(cache[lay.hooks[key]], lay.layouts[key], heads, lay.d_head)[:, :, r.head].double()
        norms = np.array([math.sqrt(float((x[b, p] ** 2).sum())) for b in range(3) for p in range(10)])
        median = float(np.sort(norms)[14] + np.sort(norms)[15]) / 2
        assert r.n_tokens == 30 and r.typical_norm == pytest.approx(median, rel=1e-12)
        assert r.kappa_rms == pytest.approx(math.sqrt(float(np.mean((norms / median - 1) ** 2))), rel=1e-9, abs=1e-12)
