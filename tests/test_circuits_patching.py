"""Batched exact patching against TransformerLens 4.3's own ``transformer_lens.patching``, cell by cell."""

from __future__ import annotations

import contextlib
import io

import pandas as pd
import pytest
import torch
from transformer_lens import patching

from interp_norm import AdditionTask, HookedNormTransformer, ModelConfig
from interp_norm.circuits import (
    KLToClean,
    LogitDiff,
    CorrectProb,
    PatchResult,
    activation_patch,
    make_pairs,
    patch_sweep,
)
from interp_norm.circuits.exact.engine import STAGES, IncrementalEngine
from interp_norm.errors import HookNameError, PatchingError
from interp_norm.core.hook_names import act_name

TL_BY_POS = {
    "resid_pre": patching.get_act_patch_resid_pre,
    "resid_mid": patching.get_act_patch_resid_mid,
    "attn_out": patching.get_act_patch_attn_out,
    "mlp_out": patching.get_act_patch_mlp_out,
    "z": patching.get_act_patch_attn_head_out_by_pos,
    "q": patching.get_act_patch_attn_head_q_by_pos,
    "k": patching.get_act_patch_attn_head_k_by_pos,
    "v": patching.get_act_patch_attn_head_v_by_pos,
    "pattern": patching.get_act_patch_attn_head_pattern_by_pos,
}
TL_ALL_POS = {
    "z": patching.get_act_patch_attn_head_out_all_pos,
    "q": patching.get_act_patch_attn_head_q_all_pos,
    "k": patching.get_act_patch_attn_head_k_all_pos,
    "v": patching.get_act_patch_attn_head_v_all_pos,
    "pattern": patching.get_act_patch_attn_head_pattern_all_pos,
}
VARIANTS = [
    dict(attn_norm="pre", norm_kind="rms"),
    dict(attn_norm="qkv", norm_kind="rms"),
    dict(attn_norm="qk", norm_kind="ln"),
    dict(attn_norm="none", pre_norm_gains="shared"),
    dict(attn_norm="pre", norm_kind="ln", pre_norm_gains="shared"),
]
TOL = 1e-5


def make_model(preset: str = "tiny", seed: int = 0, mlp_biases: bool = True, **kw) -> HookedNormTransformer:
    """A seeded model with norm gains/biases, ``b_O`` and (``mlp_biases``) the MLP biases moved off
    their init, so every parameter the engine's kernels use matters."""
    model = HookedNormTransformer(ModelConfig.preset(preset, seed=seed, **kw)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    moved = (".w", ".b", "b_O") + (("b_in", "b_out") if mlp_biases else ())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(moved):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def tl(fn, *args, **kw):
    with contextlib.redirect_stderr(io.StringIO()), torch.no_grad():  # TL's tqdm bar
        return fn(*args, **kw)


@pytest.fixture(scope="module")
def pairs():
    return make_pairs(AdditionTask.preset("cpu"), 4, "id", seed=5)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(v.values()))
def test_every_activation_by_position_equals_transformer_lens(variant, pairs):
    model = make_model(**variant)
    metric = LogitDiff(pairs)
    _, cache = model.run_with_cache(pairs.clean_tokens)
    for act, fn in TL_BY_POS.items():
        ref = tl(fn, model, pairs.corrupted_tokens, cache, metric.mean)
        assert ref.std() > 1e-4, f"{act}: the test needs cells with different effects"
        for method in ("incremental", "hooks"):
            ours = activation_patch(model, pairs.corrupted_tokens, cache, metric, act, method=method, batch_size=24)
            assert ours.values.shape == ref.shape
            assert (ours.values - ref).abs().max() <= TOL, (act, method)


@pytest.mark.numerics
@pytest.mark.parametrize("variant", VARIANTS + [dict(attn_norm="pre", norm_kind="ln")], ids=lambda v: "-".join(v.values()))
def test_fused_kernels_compute_the_models_activations(variant, pairs):
    """The engine's two arithmetics against ``model.run_with_cache``, stage by stage: the model's own
    steps (``exact_pattern=True``) bit for bit, the fused kernels to float rounding. A hook on the
    model switches the fused kernels off (they would bypass it)."""
    model = make_model(**variant)
    x = pairs.corrupted_tokens
    _, cache = model.run_with_cache(x)
    fast, exact = IncrementalEngine(model, x, exact_pattern=False), IncrementalEngine(model, x, exact_pattern=True)
    assert fast.fast and not exact.fast
    for l in range(model.cfg.n_layers):
        for stage in STAGES:
            ref = cache[act_name(stage, l)]
            assert torch.equal(exact.acts[l][stage], ref), (l, stage)
            assert (fast.acts[l][stage] - ref).abs().max() <= 1e-5 * (1 + ref.abs().max()), (l, stage)
            assert fast.acts[l][stage].shape == ref.shape
    with model.hooks(fwd_hooks=[(act_name("z", 0), lambda a, hook: a)]):
        assert not IncrementalEngine(model, x, exact_pattern=False).fast


@pytest.mark.parametrize("attn_norm", ["pre", "qkv"])
def test_shared_and_copied_keys_attention_equal_transformer_lens(attn_norm, pairs, monkeypatch):
    """The fast engine attends either against each example's shared keys plus corrections for the
    changed rows, or against a copy of the keys per (copy, example) group; it picks by cost. Forced
    each way, every activation equals TransformerLens."""
    model = make_model("cpu", attn_norm=attn_norm)
    metric = LogitDiff(pairs)
    _, cache = model.run_with_cache(pairs.clean_tokens)
    shared_calls = {}
    real = IncrementalEngine._attend_shared

    def counting(self, *a, **kw):
        shared_calls[ratio] = shared_calls.get(ratio, 0) + 1
        return real(self, *a, **kw)

    monkeypatch.setattr(IncrementalEngine, "_attend_shared", counting)
    refs = {act: tl(fn, model, pairs.corrupted_tokens, cache, metric.mean) for act, fn in TL_BY_POS.items()}
    for ratio in (0.0, float("inf")):
        monkeypatch.setattr(IncrementalEngine, "SHARED_KEYS_MAX_PAIRS_PER_ROW", ratio)
        for act, ref in refs.items():
            ours = activation_patch(model, pairs.corrupted_tokens, cache, metric, act, batch_size=16)
            assert (ours.values - ref).abs().max() <= TOL, (act, ratio)
    # copies forced: shared keys only for the changed copies beside one-head entering rows
    assert shared_calls[float("inf")] > shared_calls.get(0.0, 0) > 0


@pytest.mark.parametrize("act", sorted(TL_ALL_POS))
def test_all_position_patches_equal_transformer_lens(act, pairs):
    model = make_model(attn_norm="qkv")
    metric = CorrectProb(pairs)
    _, cache = model.run_with_cache(pairs.clean_tokens)
    ref = tl(TL_ALL_POS[act], model, pairs.corrupted_tokens, cache, metric.mean)
    for method in ("incremental", "hooks"):
        ours = activation_patch(model, pairs.corrupted_tokens, cache, metric, act, by="all", method=method)
        assert (ours.values - ref).abs().max() <= TOL


def test_three_layer_model_middle_and_last_layers(pairs):
    """Deeper model: patched layer, recomputed middle layer and metric-restricted last layer all exact."""
    model = make_model("cpu", attn_norm="pre")
    metric = KLToClean(pairs, model(pairs.clean_tokens), positions="answer")
    _, cache = model.run_with_cache(pairs.clean_tokens)
    for act in ("z", "k", "resid_pre", "mlp_out"):
        ref = tl(TL_BY_POS[act], model, pairs.corrupted_tokens, cache, metric.mean)
        ours = activation_patch(model, pairs.corrupted_tokens, cache, metric, act, batch_size=16)
        assert (ours.values - ref).abs().max() <= TOL, act


@pytest.mark.parametrize("act", ["resid_pre", "k", "z", "pattern", "mlp_out"])
def test_dead_cells_from_tokens_full_cache_or_filtered_cache(act, pairs):
    """Cells before the first differing input are skipped: known from the clean tokens, from the
    clean cache's layer-0 residual, or (a cache holding only the patched activation) by comparing
    bit-exact activations. Each way equals TransformerLens; chunks of one or many layers too."""
    model = make_model(attn_norm="qkv")
    metric = LogitDiff(pairs)
    _, cache = model.run_with_cache(pairs.clean_tokens)
    ref = tl(TL_BY_POS[act], model, pairs.corrupted_tokens, cache, metric.mean)
    names = [act_name(act, l) for l in range(model.cfg.n_layers)]
    only = {nm: cache[nm] for nm in names}
    runs = {
        "tokens": activation_patch(model, pairs, only, metric, act),
        "full cache": activation_patch(model, pairs.corrupted_tokens, cache, metric, act),
        "filtered cache": activation_patch(model, pairs.corrupted_tokens, only, metric, act),
        "one cell per pass": activation_patch(model, pairs.corrupted_tokens, cache, metric, act, batch_size=1),
    }
    for how, res in runs.items():
        assert res.method == "exact-incremental"
        assert (res.values - ref).abs().max() <= TOL, how


def test_explicit_cells_and_dest_src_pattern_equal_transformer_lens(pairs):
    model = make_model(attn_norm="qk", norm_kind="rms")
    metric = LogitDiff(pairs, positions=0)  # only the first answer token
    _, cache = model.run_with_cache(pairs.clean_tokens)
    n = pairs.n_pos
    cells = pd.DataFrame(
        [(l, h, d, s) for l in range(2) for h in (0, 3) for d in range(n - 5, n) for s in range(0, d + 1, 2)],
        columns=["layer", "head_index", "dest_pos", "src_pos"],
    )
    ref = tl(
        patching.generic_activation_patch, model, pairs.corrupted_tokens, cache, metric.mean,
        patch_setter=patching.layer_head_dest_src_pos_pattern_patch_setter, activation_name="pattern", index_df=cells,
    )
    for method in ("incremental", "hooks"):
        ours = activation_patch(model, pairs.corrupted_tokens, cache, metric, "pattern", by="dest_src", cells=cells, method=method)
        assert ours.flat and ours.values.shape == ref.shape
        assert (ours.values - ref).abs().max() <= TOL


def test_resid_post_matches_generic_transformer_lens_patch(pairs):
    model = make_model()
    metric = LogitDiff(pairs)
    _, cache = model.run_with_cache(pairs.clean_tokens)
    ref = tl(
        patching.generic_activation_patch, model, pairs.corrupted_tokens, cache, metric.mean,
        patch_setter=patching.layer_pos_patch_setter, activation_name="resid_post", index_axis_names=("layer", "pos"),
    )
    ours = activation_patch(model, pairs.corrupted_tokens, cache, metric, "resid_post")
    assert (ours.values - ref).abs().max() <= TOL


def test_user_metrics_per_example_and_scalar(pairs):
    """A plain callable (not stacked-aware) works, per-example or scalar; per-example values are kept."""
    model = make_model()
    _, cache = model.run_with_cache(pairs.clean_tokens)
    last = pairs.score_mask.float().argmax(-1)
    rows = torch.arange(len(pairs))

    def prob_of_seven(logits):  # [batch]
        return logits[rows, last].softmax(-1)[:, 7]

    ref = tl(TL_BY_POS["v"], model, pairs.corrupted_tokens, cache, lambda lg: prob_of_seven(lg).mean())
    ours = activation_patch(model, pairs.corrupted_tokens, cache, prob_of_seven, "v")
    assert (ours.values - ref).abs().max() <= TOL
    assert ours.per_example.shape == (ref.numel(), len(pairs))
    assert torch.allclose(ours.per_example.mean(-1).view_as(ref).float(), ref, atol=TOL)
    scalar = activation_patch(model, pairs.corrupted_tokens, cache, lambda lg: prob_of_seven(lg).mean(), "v")
    assert scalar.per_example is None and (scalar.values - ref).abs().max() <= TOL


def test_result_table_baselines_and_normalisation():
    # pairs whose clean and corrupted logit differences are far apart: normalized() divides by it
    pairs = make_pairs(AdditionTask.preset("cpu"), 4, "id", seed=7)
    model = make_model(mlp_biases=False)
    res = activation_patch(model, pairs, activation="resid_pre")  # clean cache + logit diff from the pairs
    metric = LogitDiff(pairs)
    with torch.no_grad():
        clean = metric(model(pairs.clean_tokens)).double()
        corr = metric(model(pairs.corrupted_tokens)).double()
    assert torch.allclose(res.clean, clean) and torch.allclose(res.baseline, corr)
    assert abs(float(clean.mean() - corr.mean())) > 0.1
    # patching the whole residual stream at layer 0, every position at once, gives the clean run
    full = activation_patch(model, pairs, activation="resid_pre", by="all")
    assert abs(float(full.values[0]) - float(clean.mean())) < TOL
    assert abs(float(full.normalized()[0]) - 1.0) < 1e-4
    df = res.to_dataframe()
    assert list(df.columns[:3]) == ["activation", "layer", "pos"]
    assert len(df) == res.values.numel() and {"value", "effect", "normalized"} <= set(df.columns)


def test_patch_sweep_shares_one_cache(pairs):
    model = make_model()
    out = patch_sweep(model, pairs, activations=("attn_out", ("z", "all")))
    assert set(out) == {"attn_out", "z_all"}
    assert isinstance(out["z_all"], PatchResult) and out["z_all"].values.shape == (2, 4)


def test_start_at_layer_reproduces_the_model(pairs):
    """The hooks method starts each pass at the patched layer: model(resid_pre, start_at_layer=l)."""
    model = make_model()
    _, cache = model.run_with_cache(pairs.clean_tokens)
    for layer in range(model.cfg.n_layers):
        out = model(cache[act_name("resid_pre", layer)], start_at_layer=layer)
        assert torch.allclose(out, model(pairs.clean_tokens), atol=1e-5)


@pytest.mark.parametrize("kw", [dict(attn_norm="qkv"), dict(attn_norm="pre", calib_score_std=3.0, calib_update_std=1.0)],
                         ids=["qkv", "pre-large-stds"])
def test_calibrated_model_equals_transformer_lens(kw, pairs):
    """The paper's Checkpoint factors (on embeddings, attention inputs, scores and residual updates)
    are applied only by the model's own steps, which the incremental engine calls. (With the
    paper's stds -- scores 0.1, updates 0.05 -- the untrained attention is nearly uniform and q/k
    patches change almost nothing; the second model's larger stds make them matter.)"""
    model = HookedNormTransformer(ModelConfig.preset("tiny", calibration="paper", **kw)).eval()
    model.calibrate(make_pairs(AdditionTask.preset("cpu"), 16, "id", seed=11).clean_tokens)
    factors = model.calibration_factors()
    assert any(abs(f - 1.0) > 0.05 for f in factors.values()), "calibration should change some factor"
    metric = LogitDiff(pairs)
    _, cache = model.run_with_cache(pairs.clean_tokens)
    for act, fn in TL_BY_POS.items():
        ref = tl(fn, model, pairs.corrupted_tokens, cache, metric.mean)
        if act not in ("q", "k") or "calib_score_std" in kw:
            assert ref.std() > 1e-5, f"{act}: the test needs cells with different effects"
        for method in ("incremental", "hooks"):
            ours = activation_patch(model, pairs.corrupted_tokens, cache, metric, act, method=method, batch_size=24)
            assert (ours.values - ref).abs().max() <= TOL, (act, method)
    for act in ("z", "pattern"):
        ref = tl(TL_ALL_POS[act], model, pairs.corrupted_tokens, cache, metric.mean)
        ours = activation_patch(model, pairs.corrupted_tokens, cache, metric, act, by="all", method="incremental")
        assert (ours.values - ref).abs().max() <= TOL, act


def test_bad_inputs_raise_typed_errors(pairs):
    model = make_model()
    metric = LogitDiff(pairs)
    _, cache = model.run_with_cache(pairs.clean_tokens)
    with pytest.raises(PatchingError, match="unknown activation"):
        activation_patch(model, pairs, activation="hook_z")
    with pytest.raises(PatchingError, match="by='dest_src'"):
        activation_patch(model, pairs, activation="z", by="dest_src")
    with pytest.raises(PatchingError, match="training mode"):
        activation_patch(model.train(), pairs, activation="z")
    model.eval()
    with pytest.raises(HookNameError, match="hook_z"):
        activation_patch(model, pairs.corrupted_tokens, {act_name("resid_pre", 0): cache[act_name("resid_pre", 0)]}, metric, "z")
    with pytest.raises(PatchingError, match="batch"):
        activation_patch(model, pairs.corrupted_tokens[:2], cache, metric, "z")
    with pytest.raises(PatchingError, match="metric"):
        activation_patch(model, pairs.corrupted_tokens, cache, None, "z")
    with pytest.raises(PatchingError, match="cells need columns"):
        activation_patch(model, pairs, activation="z", cells=pd.DataFrame({"layer": [0]}))
