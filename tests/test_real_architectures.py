"""Acceptance gaps of the "real architectures" issue, each against an independent computation.

* Our own variants with LayerNorm attention norms: softmax of the rebuilt scores == the model's own
  ``hook_pattern`` (test_anatomy.py covers the RMS variants).
* Grouped k/v heads are noised once per key/value head: the query heads sharing a k/v head see the
  same factor, read off the model's own ``hook_attn_scores`` (k) and ``hook_z`` (v, by
  ``z = pattern · (1+κ)v``), the grouping taken from the Hugging Face config; q noise stays per
  query head.
* The CLI on a name in the Hugging Face cache with the hub offline, and ``--text``: the numbers
  come from the cached model reloaded with transformers / its own attentions, not via interp_norm.
* Riechers's ellipsoid on our own per-head q/k/v norms (``ellipsoid_membership`` lists only the
  residual-stream norms of our models): membership == σ²/(σ²+ε) from the raw hook, per head.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pandas as pd
import pytest
import torch

from interp_norm.anatomy import anatomy, random_tokens, sample_text, tiny_hf_model, verify_scores
from interp_norm.noise import HeadNoise
from interp_norm.anatomy import bridge_from_hf
from interp_norm.core.defaults import ATTN_NORMS, SPARSE_THRESHOLD
from interp_norm.core.hook_names import act_name

from _models import make_model, run_cli, word_tokenizer


# ----------------------------------------------------------------------------- our variants, LayerNorm


@pytest.mark.parametrize("attn_norm", ATTN_NORMS)
@torch.no_grad()
def test_own_layernorm_variant_scores_reproduce_the_pattern(attn_norm):
    model = make_model(attn_norm=attn_norm, norm_kind="ln")
    tokens = random_tokens(model, 3, 12, seed=2)
    check = verify_scores(model, tokens)
    assert check["ok"].all() and check["pattern_error"].max() <= 1e-5
    # by hand: the q and k the scores use (after the LayerNorm of q/k where there is one), q·k/attn_scale,
    # causal mask, softmax -- against the model's own pattern
    _, cache = model.run_with_cache(tokens)
    n = tokens.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for l in range(model.cfg.n_layers):
        kind = "normed" if attn_norm in ("qk", "qkv") else ""
        q = cache[act_name(f"q_{kind}" if kind else "q", l)]
        k = cache[act_name(f"k_{kind}" if kind else "k", l)]
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / model.cfg.attn_scale
        p = s.masked_fill(~causal, -math.inf).softmax(-1)
        assert (p - cache[act_name("pattern", l)]).abs().max() <= 1e-5


# ----------------------------------------------------------------------------- grouped k/v heads


GQA = ["llama", "qwen3", "olmo2", "gemma4"]


@pytest.fixture(scope="module")
def gqa_models():
    out = {}
    for arch in GQA:
        hf = tiny_hf_model(arch, seed=4)
        group = hf.config.num_attention_heads // hf.config.num_key_value_heads  # from the HF config itself
        out[arch] = (bridge_from_hf(hf, name=f"tiny-{arch}"), group)
    return out


def _group_of(n_heads: int, group: int) -> torch.Tensor:
    """The k/v head each query head reads (HF's repeat_kv: query head h uses k/v head h // group)."""
    return torch.arange(n_heads) // group


@pytest.mark.parametrize("arch,placement", [("llama", "before_norm"), ("llama", "after_norm"), ("qwen3", "after_norm"),
                                            ("olmo2", "after_norm")])
@torch.no_grad()
def test_query_heads_sharing_a_kv_head_see_the_same_key_noise(gqa_models, arch, placement):
    """k noise on layer 0: the model's own pre-softmax scores change by (1+κ[key, h // group]), the
    same factor for every query head of a group and different factors across groups."""
    model, group = gqa_models[arch]
    la = anatomy(model)[0]
    assert la.scores_hook == "pre_softmax" and group > 1
    tokens = random_tokens(model, 2, 9, seed=3)
    name = la.hooks["attn_scores"]
    _, clean = model.run_with_cache(tokens, names_filter=lambda n: n == name)
    noise = HeadNoise(model, level=0.3, targets=("k",), placement=placement, layers=[0], seed=5)
    with model.hooks(fwd_hooks=noise.hooks()):
        _, noised = model.run_with_cache(tokens, names_filter=lambda n: n == name)
    kappa = noise.last_kappa[(0, "k")]  # [b, key, kv head]
    assert kappa.shape == (2, 9, model.cfg.n_heads // group)
    allowed = torch.ones(9, 9, dtype=torch.bool).tril()
    s0, s1 = clean[name].double(), noised[name].double()  # [b, h, q, k]
    expect = (1 + kappa.double())[:, :, _group_of(model.cfg.n_heads, group)].permute(0, 2, 1)[:, :, None, :]  # [b, h, 1, k]
    big = s0.abs() > 1e-3  # the ratio is only informative away from zero scores
    sel = big & allowed
    assert torch.allclose(s1[sel], (s0 * expect)[sel], rtol=1e-4, atol=1e-5)
    ratio = torch.where(sel, s1 / s0.where(sel, torch.ones_like(s0)), torch.nan)
    for h in range(model.cfg.n_heads):
        partner = h + 1 if h % group == 0 else h - 1  # same k/v head
        both = sel[:, h] & sel[:, partner]
        assert torch.allclose(ratio[:, h][both], ratio[:, partner][both], rtol=1e-4)
    other = ratio[:, 0] - ratio[:, group]  # heads 0 and `group` read different k/v heads
    assert other[sel[:, 0] & sel[:, group]].abs().max() > 1e-2


@pytest.mark.parametrize("arch", GQA)
@torch.no_grad()
def test_query_heads_sharing_a_kv_head_see_the_same_value_noise(gqa_models, arch):
    """v noise (after the v-norm where there is one) on layer 0: the model's own z equals
    pattern · ((1+κ[key, h // group]) · v) with the clean pattern and v -- one κ per k/v head."""
    model, group = gqa_models[arch]
    la = anatomy(model)[0]
    tokens = random_tokens(model, 2, 9, seed=6)
    names = {la.hooks["pattern"], la.hooks[la.used("v")], act_name("z", 0)}
    _, clean = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    noise = HeadNoise(model, level=0.4, targets=("v",), placement="after_norm", layers=[0], seed=8)
    with model.hooks(fwd_hooks=noise.hooks()):
        _, noised = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    kappa = noise.last_kappa[(0, "v")].double()
    n_kv = model.cfg.n_heads // group
    assert kappa.shape == (2, 9, n_kv)
    v = clean[la.hooks[la.used("v")]].double().reshape(2, 9, n_kv, -1)  # [b, key, kv head, d]
    idx = _group_of(model.cfg.n_heads, group)
    vn = (v * (1 + kappa)[..., None])[:, :, idx]  # [b, key, h, d]
    pattern = clean[la.hooks["pattern"]].double()  # v noise does not change this layer's pattern
    assert torch.allclose(noised[la.hooks["pattern"]].double(), pattern, atol=1e-6)
    z = torch.einsum("bhqk,bkhd->bqhd", pattern, vn)
    got = noised[act_name("z", 0)].double().reshape(z.shape)
    assert torch.allclose(got, z, rtol=1e-4, atol=1e-5)
    assert (got - clean[act_name("z", 0)].double().reshape(z.shape)).abs().max() > 1e-3  # the noise did something


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@torch.no_grad()
def test_query_noise_is_per_query_head(gqa_models, arch):
    """q noise: each query head its own factor, also within a group (scores change by 1+κ[query, h])."""
    model, group = gqa_models[arch]
    la = anatomy(model)[0]
    tokens = random_tokens(model, 2, 9, seed=3)
    name = la.hooks["attn_scores"]
    _, clean = model.run_with_cache(tokens, names_filter=lambda n: n == name)
    noise = HeadNoise(model, level=0.3, targets=("q",), placement="after_norm", layers=[0], seed=5)
    with model.hooks(fwd_hooks=noise.hooks()):
        _, noised = model.run_with_cache(tokens, names_filter=lambda n: n == name)
    kappa = noise.last_kappa[(0, "q")].double()  # [b, query, head]
    assert kappa.shape == (2, 9, model.cfg.n_heads)
    assert (kappa[..., 0] - kappa[..., 1]).abs().max() > 1e-3  # heads 0 and 1 share a k/v head, not a κ
    allowed = torch.ones(9, 9, dtype=torch.bool).tril()
    expect = clean[name].double() * (1 + kappa).permute(0, 2, 1)[..., None]
    assert torch.allclose(noised[name].double()[..., allowed], expect[..., allowed], rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- the CLI on a cached name


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A Hugging Face cache (models--org--name/refs/main + snapshots/<commit>) holding a tiny Qwen3 and its tokenizer."""
    root = tmp_path_factory.mktemp("hub")
    commit = "89abcdef0123456789abcdef0123456789abcdef"
    repo = root / "models--tiny-org--tiny-qwen3"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    hf = tiny_hf_model("qwen3", seed=9)
    with torch.no_grad():  # sharper attention that survives save_pretrained (the gain is a weight; `scaling` is not)
        for layer in hf.model.layers:
            layer.self_attn.q_norm.weight *= 4.0
    hf.save_pretrained(snapshot)
    word_tokenizer(128).save_pretrained(snapshot)
    return root, snapshot


def test_cli_geometry_on_a_cached_name_with_the_hub_offline(hub_cache, tmp_path, capsys, monkeypatch):
    import transformers

    root, snapshot = hub_cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    code, out, err = run_cli(capsys, "geometry", "tiny-org/tiny-qwen3", "--out", tmp_path / "g", "--windows", "2",
                          "--n-ctx", "9", "--no-progress")
    assert code == 0, err
    mem = pd.read_csv(tmp_path / "g" / "geometry_ellipsoid_membership.csv")
    assert {"q_norm", "k_norm", "residual"} <= set(mem["role"]) and mem["max_abs_err"].max() < 1e-5
    # the k-norm ellipsoid's semi-axes are the cached weights |g|·√N (read back with transformers alone)
    ref = transformers.AutoModelForCausalLM.from_pretrained(snapshot, local_files_only=True)
    axes = pd.read_csv(tmp_path / "g" / "geometry_ellipsoid_axes.csv")
    k0 = axes[axes["module"] == mem[mem["role"] == "k_norm"]["module"].iloc[0]]["semi_axis"].sort_values().to_numpy()
    g = ref.model.layers[0].self_attn.k_norm.weight.detach().double()
    assert k0 == pytest.approx(torch.sort(g.abs() * g.numel() ** 0.5).values.numpy(), rel=1e-4)


@torch.no_grad()
def test_cli_collapse_on_a_cached_name_reads_the_text_file(hub_cache, tmp_path, capsys, monkeypatch):
    """``collapse NAME --text FILE``: the sparse rows counted are those of the HF model's own attentions
    on FILE's words (tokenised here by the cached tokenizer, through transformers alone)."""
    import transformers

    root, snapshot = hub_cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    text = " ".join(sample_text().split()[::-1][:200])  # not the default sample: the file must be read
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    n_ctx, windows = 16, 3
    code, out, err = run_cli(capsys, "collapse", "tiny-org/tiny-qwen3", "--out", tmp_path / "c", "--text",
                          tmp_path / "t.txt", "--n-ctx", n_ctx, "--windows", windows, "--levels", "0", "0.2", "--placement", "after_norm",
                          "--no-progress")
    assert code == 0, err
    df = pd.read_csv(tmp_path / "c" / "collapse.csv")
    tok = transformers.AutoTokenizer.from_pretrained(snapshot, local_files_only=True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(snapshot, local_files_only=True, attn_implementation="eager")
    ids = torch.tensor(tok(text)["input_ids"][: windows * n_ctx]).view(windows, n_ctx)
    atts = ref(ids, output_attentions=True).attentions  # per layer [b, h, q, k]
    sparse = sum(int((a.max(-1).values[:, :, 1:] >= SPARSE_THRESHOLD).sum()) for a in atts)  # query 0 excluded
    pooled = df[(df["layer"].astype(str) == "all") & (df["definition"] == "loose")]
    assert sparse > 10 and set(pooled["n_rows"]) == {sparse}
    assert float(pooled[pooled["level"] == 0]["measured"].iloc[0]) == 0.0
    assert float(pooled[pooled["level"] == 0.2]["measured"].iloc[0]) > 0.0


# ----------------------------------------------------------------------------- our per-head q/k/v norms' ellipsoids


@pytest.mark.parametrize("attn_norm,norm_kind,qkv_gain", [("qkv", "rms", "per_head"), ("qkv", "ln", "per_head"),
                                                          ("qk", "rms", "shared"), ("qk", "ln", "shared")])
@torch.no_grad()
def test_own_per_head_norm_outputs_lie_on_their_ellipsoid(attn_norm, norm_kind, qkv_gain):
    """Riechers on our QK/QKV-Norm q/k/v norms (per head, per-head or shared gains): the geometry's
    ellipsoid of head h's gain gives membership σ²/(σ²+ε), σ² read from the raw q/k/v hook."""
    from interp_norm.geometry import norm_ellipsoid

    eps = 0.3  # large, so that membership is far from 1 and the check is informative
    model = make_model(attn_norm=attn_norm, norm_kind=norm_kind, qkv_gain=qkv_gain, eps=eps)
    tokens = random_tokens(model, 3, 10, seed=1)
    _, cache = model.run_with_cache(tokens)
    inside = 0
    for l, block in enumerate(model.blocks):
        for t in ("qkv" if attn_norm == "qkv" else "qk"):
            norm = getattr(block.attn, f"{t}_norm")
            x = cache[act_name(t, l)].double()  # [b, p, h, d] before the norm
            y = cache[act_name(f"{t}_normed", l)].double()
            if norm_kind == "ln":
                x = x - x.mean(-1, keepdim=True)
            var = x.pow(2).mean(-1)
            for h in range(model.cfg.n_heads):
                gain = norm.w[h] if norm.w.ndim == 2 else norm.w
                e = norm_ellipsoid(gain, None, norm_kind)
                m = e.membership(y[:, :, h])
                assert torch.allclose(m, var[:, :, h] / (var[:, :, h] + eps), atol=1e-5, rtol=0), (l, t, h)
                if norm_kind == "ln":
                    assert e.plane_residual(y[:, :, h]).abs().max() < 1e-5
                inside += int((m < 0.99).sum())
    assert inside > 0
