"""Norm-noise hooks and circuit collapse (issue: noise), each claim against an independent computation."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from interp_norm import AdditionTask, HookedNormTransformer
from interp_norm import noise as N
from interp_norm import theory
from interp_norm.errors import ConfigError, NoiseSpecError
from interp_norm.core.scoring import per_token_accuracy
from interp_norm.report.plots import plot_accuracy_vs_noise, plot_collapse_thresholds, plot_collapse_vs_noise
from interp_norm.core.task import PAD_ID
from _models import sharpened_model

TASK = AdditionTask.preset("cpu")

# (attn_norm, placement): every distinct place the noise can land
SETUPS = [("pre", "before_norm"), ("qkv", "before_norm"), ("qkv", "after_norm"), ("qk", "before_norm"),
          ("qk", "after_norm"), ("none", "before_norm")]


def _ids(s):
    return "-".join(s)


_MODELS: dict = {}


def make_model(attn_norm: str) -> HookedNormTransformer:
    """:func:`_models.sharpened_model` (many sparse rows), built once per variant for this file."""
    if attn_norm not in _MODELS:
        _MODELS[attn_norm] = sharpened_model(attn_norm)
    return _MODELS[attn_norm]


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    t = TASK.sample_batch(12, "id", seed=5).tokens
    return t[:, : int((t != PAD_ID).sum(-1).max())]


# ----------------------------------------------------------------------------- hooks


@pytest.mark.parametrize("setup", SETUPS, ids=_ids)
def test_level_zero_leaves_logits_bit_identical(setup, tokens):
    attn_norm, placement = setup
    model = make_model(attn_norm)
    clean = model(tokens)
    targets = ("q", "k", "v", "scale") if attn_norm == "pre" else ("q", "k", "v")
    with N.NormNoise(model, 0.0, targets, placement=placement, seed=1):
        noisy = model(tokens)
    assert torch.equal(noisy, clean)
    gates = {l: torch.ones(len(tokens), model.cfg.n_heads, tokens.shape[1], dtype=torch.bool) for l in range(2)}
    gated = model.run_with_hooks(tokens, fwd_hooks=N.norm_noise_hooks(model, 0.0, "qk", placement=placement, row_gate=gates))
    assert torch.equal(gated, clean)


@pytest.mark.parametrize("setup", SETUPS, ids=_ids)
def test_hooks_scale_norms_by_the_drawn_factors(setup, tokens):
    """Noise on layer 1, heads 0 and 2: the cached vectors' norms are (1+κ) times the clean ones."""
    attn_norm, placement = setup
    model = make_model(attn_norm)
    cfg = model.cfg
    _, clean = model.run_with_cache(tokens)
    noise = N.NormNoise(model, 0.2, ("q", "k", "v"), layers=[1], heads=[0, 2], placement=placement, seed=7)
    with noise:
        _, noisy = model.run_with_cache(tokens)
    for t in ("q", "k", "v"):
        normed = (attn_norm == "qkv") or (attn_norm == "qk" and t != "v")
        name = f"blocks.1.attn.hook_{t}_normed" if placement == "after_norm" and normed else f"blocks.1.attn.hook_{t}"
        kappa = noise.last_kappa[(1, t)][..., 0]  # [b, p, h]
        assert kappa.shape == (len(tokens), tokens.shape[1], cfg.n_heads)
        assert (kappa[:, :, [1, 3]] == 0).all() and (kappa[:, :, [0, 2]] != 0).all()
        assert kappa.abs().max() <= math.sqrt(3) * 0.2 + 1e-6
        ratio = noisy[name].norm(dim=-1) / clean[name].norm(dim=-1)
        torch.testing.assert_close(ratio, 1 + kappa, rtol=2e-5, atol=2e-5)
        # same direction: the noise is on the norm only
        cos = torch.nn.functional.cosine_similarity(noisy[name], clean[name], dim=-1)
        torch.testing.assert_close(cos, torch.ones_like(cos), rtol=0, atol=1e-5)
        if placement == "before_norm" and normed:
            # removed by the q/k/v norm up to eps: the formula of effective_factor, from the clean divisor
            after = f"blocks.1.attn.hook_{t}_normed"
            s = clean[f"blocks.1.attn.hook_{t}_scale"][..., 0]
            m = s**2 - cfg.eps
            expected = (1 + kappa) * s / torch.sqrt((1 + kappa) ** 2 * m + cfg.eps)
            ratio = noisy[after].norm(dim=-1) / clean[after].norm(dim=-1)
            torch.testing.assert_close(ratio, expected, rtol=2e-5, atol=2e-5)
            assert (ratio - 1).abs().max() < 1e-4
    # layer 0 untouched
    assert torch.equal(noisy["blocks.0.attn.hook_pattern"], clean["blocks.0.attn.hook_pattern"])


def test_scale_target_multiplies_the_prenorm_divisor(tokens):
    model = make_model("pre")
    _, clean = model.run_with_cache(tokens)
    noise = N.NormNoise(model, 0.1, "scale", layers=[1], seed=2)
    with noise:
        _, noisy = model.run_with_cache(tokens)
    kappa = noise.last_kappa[(1, "scale")]  # [b, p, 1]
    torch.testing.assert_close(noisy["blocks.1.ln1.hook_scale"], clean["blocks.1.ln1.hook_scale"] * (1 + kappa))
    # a larger divisor shrinks q, k and v of that position by 1/(1+κ), in every head
    for t in "qkv":
        torch.testing.assert_close(noisy[f"blocks.1.attn.hook_{t}"], clean[f"blocks.1.attn.hook_{t}"] / (1 + kappa[..., None]),
                                   rtol=1e-5, atol=1e-6)


def test_draws_follow_the_law_and_are_independent():
    model = make_model("pre")
    for dist in ("uniform", "normal"):
        noise = N.NormNoise(model, 0.05, "qk", distribution=dist, seed=11)
        kq = noise.draw(0, "q", (64, 32, 4, 1))
        kk = noise.draw(0, "k", (64, 32, 4, 1))
        k1 = noise.draw(1, "q", (64, 32, 4, 1))
        k_next = noise.draw(0, "q", (64, 32, 4, 1), call=1)
        assert abs(float(kq.pow(2).mean().sqrt()) - 0.05) < 0.05 * 0.03  # RMS = level
        for other in (kk, k1, k_next):
            assert abs(float(np.corrcoef(kq.flatten(), other.flatten())[0, 1])) < 0.03
        if dist == "uniform":
            assert float(kq.abs().max()) <= 0.05 * math.sqrt(3) + 1e-7
            # uniform: fraction within ±a/2 is 1/2
            assert abs(float((kq.abs() < 0.05 * math.sqrt(3) / 2).float().mean()) - 0.5) < 0.02
    # seeded: the same seed gives the same κ; another seed does not; levels share z (κ ∝ level)
    a = N.NormNoise(model, 0.1, "q", seed=3).draw(0, "q", (4, 5, 4, 1))
    b = N.NormNoise(model, 0.1, "q", seed=3).draw(0, "q", (4, 5, 4, 1))
    c = N.NormNoise(model, 0.1, "q", seed=4).draw(0, "q", (4, 5, 4, 1))
    d = N.NormNoise(model, 0.2, "q", seed=3).draw(0, "q", (4, 5, 4, 1))
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.testing.assert_close(d, 2 * a)


def test_hook_list_and_context_manager_agree_and_clean_up(tokens):
    model = make_model("pre")
    clean = model(tokens)
    via_list = model.run_with_hooks(tokens, fwd_hooks=N.norm_noise_hooks(model, 0.1, seed=5))
    with N.NormNoise(model, 0.1, seed=5) as noise:
        via_ctx = model(tokens)
        second = model(tokens)  # the next pass draws afresh
    assert torch.equal(via_list, via_ctx) and not torch.equal(via_ctx, clean)
    assert not torch.equal(second, via_ctx)
    noise.reset()
    with noise:
        assert torch.equal(model(tokens), via_ctx)
    assert torch.equal(model(tokens), clean)
    with pytest.raises(RuntimeError):
        with N.NormNoise(model, 0.1):
            raise RuntimeError("boom")
    assert torch.equal(model(tokens), clean)
    assert all(not hp._forward_hooks for hp in model.hook_dict.values())


def test_value_noise_never_changes_an_attention_argmax(tokens):
    """v (= message) noise in layer l leaves layer l's scores and every earlier pattern bit-identical."""
    for attn_norm in ("pre", "qkv", "qk"):
        model = make_model(attn_norm)
        _, clean = model.run_with_cache(tokens)
        for l in range(model.cfg.n_layers):
            with N.NormNoise(model, 0.5, "m", layers=range(l, model.cfg.n_layers), placement="after_norm", seed=l):
                out, noisy = model.run_with_cache(tokens)
            assert not torch.equal(out, model(tokens))  # the noise did act
            for j in range(l + 1):
                assert torch.equal(noisy[f"blocks.{j}.attn.hook_attn_scores"], clean[f"blocks.{j}.attn.hook_attn_scores"])
                assert torch.equal(noisy[f"blocks.{j}.attn.hook_pattern"].argmax(-1), clean[f"blocks.{j}.attn.hook_pattern"].argmax(-1))


@pytest.mark.parametrize("setup", [("pre", "before_norm"), ("qkv", "before_norm"), ("qkv", "after_norm")], ids=_ids)
def test_row_gate_all_rows_equals_vector_noise(setup, tokens):
    """Gating every row (noise on scores as f_q·f_k·w) reproduces noise on the q and k vectors."""
    attn_norm, placement = setup
    model = make_model(attn_norm)
    b, n = tokens.shape
    ones = {l: torch.ones(b, model.cfg.n_heads, n, dtype=torch.bool) for l in range(2)}
    zeros = {l: torch.zeros(b, model.cfg.n_heads, n, dtype=torch.bool) for l in range(2)}
    kw = dict(placement=placement, seed=9, heads=[0, 1, 3])
    with N.NormNoise(model, 0.3, "qk", **kw):
        _, vec = model.run_with_cache(tokens)
    with N.NormNoise(model, 0.3, "qk", row_gate=ones, **kw):
        _, gated = model.run_with_cache(tokens)
    for l in range(2):
        s_vec, s_gate = vec[f"blocks.{l}.attn.hook_attn_scores"], gated[f"blocks.{l}.attn.hook_attn_scores"]
        fin = torch.isfinite(s_vec)
        assert torch.equal(fin, torch.isfinite(s_gate))
        torch.testing.assert_close(s_gate[fin], s_vec[fin], rtol=1e-4, atol=1e-5)
    with N.NormNoise(model, 0.3, "qk", row_gate=zeros, **kw):
        assert torch.equal(model(tokens), model.run_with_hooks(tokens, fwd_hooks=[]))


def test_row_gate_noises_only_the_gated_rows(tokens):
    model = make_model("pre")
    _, clean = model.run_with_cache(tokens)
    gates = N.clean_row_gates(model, tokens, "sparse")
    # independent: the sparse rows straight from the clean pattern
    for l in range(2):
        assert torch.equal(gates[l], clean[f"blocks.{l}.attn.hook_pattern"].max(-1).values >= 0.95)
    noise = N.NormNoise(model, 0.3, "qk", layers=[0], row_gate=gates, seed=1)
    with noise:
        _, noisy = model.run_with_cache(tokens)
    s0, s1 = clean["blocks.0.attn.hook_attn_scores"], noisy["blocks.0.attn.hook_attn_scores"]
    g = gates[0]
    assert torch.equal(s1[~g], s0[~g])
    kq, kk = noise.last_kappa[(0, "q")][..., 0], noise.last_kappa[(0, "k")][..., 0]  # [b, p, h]
    expected = (1 + kq.permute(0, 2, 1))[..., None] * (1 + kk.permute(0, 2, 1))[:, :, None, :] * s0
    fin = torch.isfinite(s0) & g[..., None]
    torch.testing.assert_close(s1[fin], expected[fin])


# ----------------------------------------------------------------------------- accuracy under noise


def test_run_noise_level_zero_is_clean_accuracy_with_standard_error():
    model = make_model("pre")
    df = N.run_noise(model, TASK, levels=(0.0, 0.3), n_datasets=3, n_examples=24, data_seed=50)
    assert set(df["noised"]) == {"all", "sparse", "nonsparse"} and len(df) == 6
    accs = [per_token_accuracy(model, TASK.test_set("id", 24, seed=50 + i)) for i in range(3)]
    for _, row in df[df["level"] == 0].iterrows():
        assert row["accuracy"] == pytest.approx(np.mean(accs), abs=1e-12)
        assert row["se"] == pytest.approx(np.std(accs, ddof=1) / math.sqrt(3), abs=1e-12)
        assert row["n_datasets"] == 3
    raw = N.run_noise(model, TASK, levels=(0.3,), n_datasets=2, n_examples=24, data_seed=50, aggregate=False,
                      noised="all", batch_size=7)
    assert list(raw["dataset"]) == [0, 1] and (raw["accuracy"] == raw["correct"] / raw["total"]).all()


def test_noise_specification_errors(tokens):
    model = make_model("pre")
    qkv = make_model("qkv")
    for level in (-0.01, math.nan, 0.6, math.inf):
        with pytest.raises(NoiseSpecError, match="level"):
            N.NormNoise(model, level)
    with pytest.raises(NoiseSpecError):
        N.run_noise(model, TASK, levels=(0.0, 0.7), n_examples=4)
    with pytest.raises(NoiseSpecError, match=r"'q', 'k', 'v', 'scale'"):
        N.NormNoise(model, 0.1, "x")
    with pytest.raises(NoiseSpecError, match=r"\[0, 1\]"):
        N.NormNoise(model, 0.1, layers=[2])
    with pytest.raises(NoiseSpecError, match=r"\[0, 1, 2, 3\]"):
        N.NormNoise(model, 0.1, heads=[4])
    with pytest.raises(NoiseSpecError, match="scale"):
        N.NormNoise(qkv, 0.1, "scale")
    with pytest.raises(NoiseSpecError, match="placement"):
        N.NormNoise(qkv, 0.1, placement="middle")
    with pytest.raises(NoiseSpecError, match="distribution"):
        N.NormNoise(model, 0.1, distribution="laplace")
    with pytest.raises(NoiseSpecError, match="row_gate"):
        N.NormNoise(model, 0.1, "qkv", row_gate={0: torch.ones(1, 4, 3, dtype=torch.bool)})
    with pytest.raises(NoiseSpecError):
        N.collapse_decisions(model, tokens, (0.1,), targets="v")
    with pytest.raises(NoiseSpecError):
        N.run_noise(model, TASK, noised="dense", n_examples=4)
    with pytest.raises(ConfigError):
        N.run_collapse(model, TASK, n_examples=0)
    # normal noise accepts large levels (1+κ may turn negative; handled literally)
    N.NormNoise(model, 0.7, distribution="normal")


# ----------------------------------------------------------------------------- circuit collapse


def _brute_force(model, tokens, layer_result, placement, distribution, seed, strict_threshold=0.95):
    """Re-run the whole model once per (level, draw), scaling that layer's q and k by the same κ."""
    cfg = model.cfg
    b, n = tokens.shape
    l = layer_result.layer
    z_q, z_k = N.collapse_noise_draws((b, n, cfg.n_heads), layer_result.loose.shape[1], l, seed, distribution)
    rb, rh, rq = layer_result.rows.unbind(-1)
    _, clean = model.run_with_cache(tokens)
    tstar = clean[f"blocks.{l}.attn.hook_attn_scores"][rb, rh, rq].argmax(-1)
    loose = torch.zeros_like(layer_result.loose)
    strict = torch.zeros_like(layer_result.strict)
    normed = cfg.attn_norm in ("qk", "qkv") and placement == "after_norm"
    names = {t: f"blocks.{l}.attn.hook_{t}_normed" if normed else f"blocks.{l}.attn.hook_{t}" for t in "qk"}
    for i, level in enumerate(layer_result.levels):
        for d in range(z_q.shape[0]):
            fq, fk = 1.0 + level * z_q[d], 1.0 + level * z_k[d]
            hooks = [(names["q"], lambda a, hook, f=fq: a * f[..., None]), (names["k"], lambda a, hook, f=fk: a * f[..., None])]
            with model.hooks(fwd_hooks=hooks):
                _, cache = model.run_with_cache(tokens)
            scores = cache[f"blocks.{l}.attn.hook_attn_scores"][rb, rh, rq]
            pattern = cache[f"blocks.{l}.attn.hook_pattern"][rb, rh, rq]
            loose[i, d] = scores.argmax(-1) != tstar
            strict[i, d] = loose[i, d] & (pattern.max(-1).values >= strict_threshold)
    return loose, strict


@pytest.mark.parametrize("setup", [("pre", "before_norm"), ("qkv", "after_norm"), ("qk", "before_norm"), ("none", "before_norm")], ids=_ids)
def test_fast_collapse_equals_brute_force_rerun(setup, tokens):
    attn_norm, placement = setup
    model = make_model(attn_norm)
    dist = "normal" if attn_norm == "none" else "uniform"
    # strict_threshold 0.6: a random model rarely moves 95% of its attention to a new token
    results = N.collapse_decisions(model, tokens, (0.15, 0.45), n_draws=6, placement=placement, distribution=dist,
                                   seed=2, strict_threshold=0.6)
    lengths = (tokens != PAD_ID).sum(-1)
    any_loose = any_strict = 0
    for r in results:
        # rows: sparse in the clean pattern, query ≥ 1 and inside the sequence (independent check)
        _, clean = model.run_with_cache(tokens)
        pat = clean[f"blocks.{r.layer}.attn.hook_pattern"]
        b, h, q = r.rows.unbind(-1)
        assert (pat[b, h, q].max(-1).values >= 0.95).all() and (q >= 1).all() and (q < lengths[b]).all()
        n_sparse = int(((pat.max(-1).values >= 0.95) & (torch.arange(pat.shape[2]) >= 1) & (torch.arange(pat.shape[2]) < lengths[:, None, None])).sum())
        assert len(r.rows) == n_sparse > 0
        loose, strict = _brute_force(model, tokens, r, placement, dist, seed=2, strict_threshold=0.6)
        assert torch.equal(loose, r.loose)
        assert torch.equal(strict, r.strict)
        any_loose += int(loose.sum())
        any_strict += int(strict.sum())
    if attn_norm == "qk":  # noise before the q/k norm is removed by it
        assert any_loose == 0
    else:
        assert any_loose > 0 and any_strict > 0 and any_strict < any_loose


def test_measured_table_counts_the_decisions(tokens):
    model = make_model("pre")
    results = N.collapse_decisions(model, tokens, (0.1, 0.4), n_draws=8, seed=4)
    df = N.measure_collapse(model, tokens, (0.1, 0.4), n_draws=8, seed=4, strict_samples=200)
    for r in results:
        for i, level in enumerate(r.levels):
            row = df[(df["layer"] == r.layer) & (df["level"] == level) & (df["definition"] == "loose")].iloc[0]
            assert row["measured"] == pytest.approx(float(r.loose[i].float().mean()))
            assert row["n_rows"] == len(r.rows)
            pred = theory.predicted_collapse_probability(r.scores, theory.NoiseLaw(level)).mean()
            assert row["predicted"] == pytest.approx(float(pred))
    pooled = df[(df["layer"] == "all") & (df["level"] == 0.4) & (df["definition"] == "strict")].iloc[0]
    total = sum(int(r.strict[1].sum()) for r in results)
    assert pooled["measured"] == pytest.approx(total / (8 * sum(len(r.rows) for r in results)))
    # measured and predicted agree within the Monte-Carlo error
    assert (df["z"].abs() < 4).all(), df[["layer", "level", "definition", "measured", "predicted", "mc_se", "z"]]
    th = N.collapse_thresholds(df)
    assert set(th["definition"]) == {"loose", "strict"} and set(th["layer"]) == {0, 1, "all"}


@pytest.mark.parametrize("distribution", ["uniform", "normal"])
def test_theory_probability_matches_monte_carlo_on_synthetic_scores(distribution):
    """collapse_from_scores (the measurement) vs theory.predicted_collapse_probability, synthetic rows."""
    g = torch.Generator().manual_seed(0)
    R, T, D = 60, 9, 3000
    w = torch.randn(R, T, generator=g, dtype=torch.float64) * 0.5
    w[:, 0] += 4.0 + torch.rand(R, generator=g, dtype=torch.float64)  # a clear winner: sparse rows
    w[:, 6:] = -math.inf  # a causal mask
    w[:10, 1] = w[:10, 0] - 0.05  # a few near-ties
    for level in (0.05, 0.2):
        law = theory.NoiseLaw(level, distribution)
        kq, kk = law.sample((D, R), g, dtype=torch.float64), law.sample((D, R, T), g, dtype=torch.float64)
        loose, _ = N.collapse_from_scores(w, 1 + kq, 1 + kk)
        measured = loose.double().mean(0)
        p = theory.predicted_collapse_probability(w, law)
        se = (p * (1 - p) / D).sqrt()
        assert float(p.mean()) > 0.01
        assert abs(float(measured.mean() - p.mean())) < 4 * float((se**2).sum().sqrt() / R)
        assert ((measured - p).abs() <= 4.5 * se + 1e-3).all()


def test_collapse_thresholds_interpolate_the_curves():
    curves = pd.DataFrame(dict(
        variant="m", layer="all", definition="loose", level=[0.05, 0.1, 0.2],
        measured=[0.0, 0.005, 0.02], predicted=[0.001, 0.01, 0.05],
    ))
    th = N.collapse_thresholds(curves).iloc[0]
    assert th["level_measured"] == pytest.approx(0.15)  # log-linear: 0.1 + 0.1·log(2)/log(4)
    assert th["level_predicted"] == pytest.approx(0.1)


def test_plots_build(tokens):
    model = make_model("pre")
    acc = pd.concat([
        N.run_noise(make_model(a), TASK, levels=(0.0, 0.01, 0.1), n_datasets=2, n_examples=8) for a in ("pre", "qkv")
    ])
    fig = plot_accuracy_vs_noise(acc)
    assert len(fig.data) == 6 and fig.layout.xaxis.type == "log"
    curves = N.measure_collapse(model, tokens, (0.1, 0.3), n_draws=2, strict_samples=20)
    def drawn(fig):  # traces with data (the legend's style keys are empty traces)
        return [d for d in fig.data if d.x is not None and list(d.x) != [None]]

    fig = plot_collapse_vs_noise(curves)
    from interp_norm.report.plots.noise import THEORY_WIDTH

    # measured: solid; theory: a wide pale line drawn before (under) the measured one of its series
    assert len(drawn(fig)) == 4 and {d.line.dash or "solid" for d in drawn(fig)} == {"solid"}
    names = [d.name for d in drawn(fig)]
    theory = [d for d in drawn(fig) if d.name.endswith(": theory")]
    assert len(theory) == 2 and all(d.line.width == THEORY_WIDTH and d.opacity < 0.5 for d in theory)
    assert all(names.index(d.name) < names.index(d.name[:-len(": theory")]) for d in theory)
    assert len(drawn(plot_collapse_vs_noise(curves, layer=None))) == 12
    assert len(drawn(plot_collapse_thresholds(N.collapse_thresholds(curves)))) == 4


# ----------------------------------------------------------------------------- options and checks


def test_collapse_spec_is_validated_once_and_equals_keyword_options(tokens):
    model = make_model("pre")
    spec = N.CollapseSpec(n_draws=3, targets="qk", seed=5, strict_threshold=0.6, layers=[1])
    assert spec.targets == ("q", "k") and spec.layers == (1,)
    a = N.collapse_decisions(model, tokens, (0.2,), spec)
    b = N.collapse_decisions(model, tokens, (0.2,), n_draws=3, seed=5, strict_threshold=0.6, layers=1)
    c = N.collapse_decisions(model, tokens, (0.2,), N.CollapseSpec(n_draws=9, seed=5, strict_threshold=0.6), n_draws=3,
                             layers=[1])  # keyword options replace the spec's fields
    for x in (b, c):
        assert [r.layer for r in x] == [1]
        assert torch.equal(a[0].rows, x[0].rows) and torch.equal(a[0].loose, x[0].loose)
        assert torch.equal(a[0].strict, x[0].strict)
    for bad in (dict(n_draws=0), dict(targets="v"), dict(distribution="laplace"), dict(placement="middle"),
                dict(sparse_threshold=1.5), dict(strict_threshold=0), dict(seed=-1), dict(layers=[-1]), dict(heads=[])):
        with pytest.raises(NoiseSpecError):
            N.CollapseSpec(**bad)
    with pytest.raises(NoiseSpecError, match="n_draw"):
        N.measure_collapse(model, tokens, (0.1,), n_draw=3)  # a typo is refused, not ignored
    with pytest.raises(NoiseSpecError, match=r"\[0, 1\]"):
        N.collapse_decisions(model, tokens, (0.1,), layers=[2])


def test_analyses_refuse_a_model_that_is_not_ours():
    from interp_norm.core.checks import require_norm_model

    for not_ours in (None, "pre-norm", torch.nn.Linear(2, 2)):
        with pytest.raises(ConfigError, match=r"HookedNormTransformer.*interp_norm.load\("):
            require_norm_model(not_ours)
        with pytest.raises(ConfigError, match="norm noise needs a HookedNormTransformer"):
            N.NormNoise(not_ours, 0.1)
    assert require_norm_model(make_model("qk")).attn_norm == "qk"
