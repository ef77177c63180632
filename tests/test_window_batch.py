"""Memory bounds of the analyses on Hugging Face models: windows in blocks and no logits.

``window_batch`` runs the forward over blocks of windows in lockstep, layer by layer: each layer's
cache must equal TransformerLens's own ``run_with_cache`` on each block (bit for bit) and on the whole
batch (up to rounding: whether a batched product is batch-invariant depends on the CPU's kernels),
and collapse / geometry tables must be those of one pass. The anatomy's probe ends before the
unembedding (``cache_before_unembed``), with the hooks ``run_with_cache`` gives. Bad values are typed
errors.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pandas as pd
import pytest
import torch

from interp_norm.anatomy import anatomy, random_tokens, tiny_bridge
from interp_norm.anatomy.stream import StreamedCache, cache_before_unembed, layer_caches
from interp_norm.errors import ConfigError, GeometryError, NoiseSpecError

from _models import assert_equal_up_to_rounding, forward_rtol, make_model, run_cli
from test_cli_bridges import one_line_error
EXACT = ["gpt2", "llama", "qwen3", "olmo2"]  # blocked tables compared to the one-pass ones without a tolerance


def _names(model):
    return {l: {f"blocks.{l}.hook_resid_pre", f"blocks.{l}.attn.hook_pattern", f"blocks.{l}.hook_resid_post"}
            for l in range(len(model.blocks))}


@pytest.mark.numerics
@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen3", "olmo2", "gemma4", "gemma4-shared"])
def test_blocks_of_windows_equal_run_with_cache_per_block_and_whole(arch):
    """A block of windows is the forward run_with_cache does on those windows: the same shapes, so the
    same kernels, bit for bit. The whole batch in one pass sums in another order on some CPUs
    (whether a batched matmul is batch-invariant depends on ATEN_CPU_CAPABILITY): equal up to rounding."""
    model = tiny_bridge(arch, seed=1)
    tokens = random_tokens(model, 5, 9, seed=2)
    names = _names(model)
    wanted = set().union(*names.values())
    with torch.no_grad():
        whole = model.run_with_cache(tokens, names_filter=lambda n: n in wanted)[1]
    for wb in (1, 2, 3):
        with torch.no_grad():
            per_block = [model.run_with_cache(tokens[i:i + wb], names_filter=lambda n: n in wanted)[1]
                         for i in range(0, len(tokens), wb)]
        seen = []
        for layer, cache in layer_caches(model, tokens, names, window_batch=wb):
            seen.append(layer)
            for n in names[layer]:
                assert torch.equal(cache[n], torch.cat([c[n] for c in per_block])), (wb, n)
                assert_equal_up_to_rounding(cache[n], whole[n], forward_rtol(model.cfg), msg=f"{(wb, n)}")
        assert seen == sorted(names)


def test_blocks_stop_early_remove_their_hooks_and_leave_the_logits_alone():
    model = tiny_bridge("qwen3", seed=0)
    tokens = random_tokens(model, 4, 7, seed=1)
    fired = []
    with model.hooks(fwd_hooks=[("unembed.hook_out", lambda x, hook: fired.append(1))]):
        for layer, _ in layer_caches(model, tokens, _names(model), window_batch=2):
            if layer == 1:
                break  # every block's forward is stopped and joined
    assert fired == []
    assert not any(hp.fwd_hooks for hp in model.hook_dict.values())  # every block removed its hooks
    with torch.no_grad():
        ref = model(tokens)
    with StreamedCache(model, tokens, _names(model), window_batch=3) as cache:
        for _sweep in range(2):
            for l in range(len(model.blocks)):
                cache[f"blocks.{l}.hook_resid_pre"]
        assert cache.passes == 2
    with torch.no_grad():
        assert torch.equal(model(tokens), ref)


@pytest.mark.parametrize("arch", ["qwen3", "gpt2", "gemma4-shared"])
def test_cache_before_unembed_equals_run_with_cache_without_unembedding(arch):
    model = tiny_bridge(arch, seed=3)
    tokens = random_tokens(model, 2, 8, seed=4)
    wanted = set().union(*_names(model).values()) | {"ln_final.hook_out", "unembed.hook_in"}
    with torch.no_grad():
        ref = model.run_with_cache(tokens, names_filter=lambda n: n in wanted)[1]
    fired = []
    with model.hooks(fwd_hooks=[("unembed.hook_out", lambda x, hook: fired.append(1))]):
        got = cache_before_unembed(model, tokens, wanted)
    assert fired == [] and set(got) == wanted
    for n in wanted:
        assert torch.equal(got[n], ref[n]), n


@pytest.mark.numerics
@pytest.mark.parametrize("arch", EXACT)
def test_collapse_in_blocks_of_windows_is_the_one_pass_table(arch):
    from interp_norm.noise import bridge_collapse

    model = tiny_bridge(arch, seed=5, sharpness=4.0)
    tokens = random_tokens(model, 5, 16, seed=2)
    kw = dict(draws=16, placement="after_norm", seed=3, strict_samples=32)
    ref = bridge_collapse(model, tokens, (0.1, 0.3), **kw)
    assert ref["n_rows"].sum() > 0
    for wb in (1, 2):
        pd.testing.assert_frame_equal(bridge_collapse(model, tokens, (0.1, 0.3), window_batch=wb, **kw), ref)
    # an unsorted layer list (every layer's q/k held at once) reads the same blocks
    pd.testing.assert_frame_equal(bridge_collapse(model, tokens, (0.1, 0.3), layers=[1, 0], window_batch=2, **kw),
                                  bridge_collapse(model, tokens, (0.1, 0.3), layers=[1, 0], **kw))


@pytest.mark.numerics
@pytest.mark.parametrize("arch", EXACT)
def test_geometry_in_blocks_of_windows_is_the_one_pass_result(arch):
    from interp_norm.geometry import run_geometry

    model = tiny_bridge(arch, seed=6)
    tokens = random_tokens(model, 5, 12, seed=1)
    ref = run_geometry(model, tokens=tokens)
    got = run_geometry(model, tokens=tokens, window_batch=2)
    assert set(got) == set(ref)
    for k in ref:
        pd.testing.assert_frame_equal(got[k], ref[k], obj=k)


def test_bad_window_batch_is_a_typed_error(tmp_path, capsys):
    from interp_norm.geometry import run_geometry
    from interp_norm.noise import bridge_collapse

    model = tiny_bridge("qwen3", seed=0)
    tokens = random_tokens(model, 3, 6, seed=1)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="window_batch must be a positive integer"):
            next(layer_caches(model, tokens, _names(model), window_batch=bad))
        with pytest.raises(NoiseSpecError, match="window_batch"):
            bridge_collapse(model, tokens, (0.1,), window_batch=bad)
        with pytest.raises(GeometryError, match="window_batch"):
            run_geometry(model, tokens=tokens, window_batch=bad)
    with pytest.raises(ConfigError, match="applies to Hugging Face models"):
        run_geometry(make_model(), n=4, window_batch=2)
    from interp_norm.training.checkpoints import save_checkpoint
    from interp_norm.core.task import AdditionTask

    ours = tmp_path / "ckpt"
    save_checkpoint(make_model(), ours, task=AdditionTask.preset("cpu"))
    for command in ("collapse", "geometry"):
        code, _, err = run_cli(capsys, command, ours, "--window-batch", "2", "--n-examples", "8",
                               "--out", tmp_path / command)
        one_line_error(code, err, "--window-batch applies to Hugging Face models")
    code, _, err = run_cli(capsys, "collapse", ours, "--window-batch", "0", "--out", tmp_path / "zero")
    assert code == 2 and "--window-batch" in err


@pytest.mark.parametrize("arch", EXACT + ["gemma4"])
def test_agreement_from_blocks_of_logits_equals_full_logits(arch, monkeypatch):
    """Blocks of ``logit_positions`` positions unembedded from the final residuals: the same table as
    full logits (``logit_positions=None``, the model's own forward), and the blocked path did run."""
    import interp_norm.noise.text_agreement as A

    model = tiny_bridge(arch, seed=2)
    tokens = random_tokens(model, 5, 40, seed=1)
    ref = A.text_agreement(model, tokens, [0.0, 0.1, 0.3], batch_size=2, logit_positions=None)
    checks = []
    real = A._exact_block
    monkeypatch.setattr(A, "_exact_block", lambda *a: checks.append(real(*a)) or checks[-1])
    got = A.text_agreement(model, tokens, [0.0, 0.1, 0.3], batch_size=2, logit_positions=8)
    assert len(checks) == 2 and None not in checks  # one check per batch shape (2 windows, then the last 1)
    pd.testing.assert_frame_equal(got, ref)
    with pytest.raises(NoiseSpecError, match="logit_positions"):
        A.text_agreement(model, tokens, [0.1], logit_positions=0)


def test_agreement_falls_back_to_full_logits_when_blocks_differ(monkeypatch):
    """A logit soft-cap after the unembedding (Gemma 2/3/4's ``final_logit_softcapping``): the blocks
    are not the model's logits, so the full-logits path runs and the table is unchanged."""
    import interp_norm.noise.text_agreement as A
    from interp_norm.anatomy import bridge_from_hf, tiny_hf_model

    hf = tiny_hf_model("gemma4", seed=0)
    hf.config.final_logit_softcapping = 0.5
    model = bridge_from_hf(hf)
    tokens = random_tokens(model, 3, 20, seed=1)
    ref = A.text_agreement(model, tokens, [0.0, 0.3], batch_size=2, logit_positions=None)
    checks = []
    real = A._exact_block
    monkeypatch.setattr(A, "_exact_block", lambda *a: checks.append(real(*a)) or checks[-1])
    got = A.text_agreement(model, tokens, [0.0, 0.3], batch_size=2, logit_positions=4)
    assert checks == [None, None]
    pd.testing.assert_frame_equal(got, ref)
    assert ref["kl"].iloc[1] > 0


def test_logit_check_unembeds_only_a_block_of_positions():
    """The check asks the model's own forward for the logits of the last ``logit_positions`` positions
    (``logits_to_keep``): every unembedding it runs has at most that many positions, never the whole
    window's [batch, pos, vocab] (the memory peak of ``noise`` in bfloat16 on Qwen3-0.6B before)."""
    import interp_norm.noise.text_agreement as A

    model = tiny_bridge("qwen3", seed=2)
    tokens = random_tokens(model, 2, 40, seed=1)
    stop = A.unembed_input(model)
    with torch.no_grad():
        x_clean = cache_before_unembed(model, tokens, {stop})[stop]
    shapes = []
    model.unembed.hook_out.add_hook(lambda act, hook: shapes.append(tuple(act.shape)))
    try:
        with torch.no_grad():
            assert A._exact_block(model, tokens, x_clean, 8) == 8
    finally:
        model.reset_hooks()
    assert shapes and all(s[1] <= 8 for s in shapes), shapes
    assert (2, 8, model.cfg.d_vocab) in shapes  # the model's own forward did unembed the last 8 positions


def test_logit_check_without_logits_to_keep_compares_full_logits(monkeypatch):
    """A forward that does not take ``logits_to_keep``: the blocks are checked against one full forward's
    logits (blocks of 4, 8 ... positions), and the table is the full-logits one."""
    import interp_norm.noise.text_agreement as A

    model = tiny_bridge("llama", seed=2)
    hf = model.original_model
    own = hf.forward
    monkeypatch.setattr(hf, "forward", lambda *a, **kw: own(*a, **kw))  # a signature without logits_to_keep
    assert not A._keeps_logits(model)
    tokens = random_tokens(model, 3, 20, seed=1)
    ref = A.text_agreement(model, tokens, [0.0, 0.3], batch_size=2, logit_positions=None)
    shapes, checks, real = [], [], A._exact_block
    monkeypatch.setattr(A, "_exact_block", lambda *a: checks.append(real(*a)) or checks[-1])
    model.unembed.hook_out.add_hook(lambda act, hook: shapes.append(tuple(act.shape)))
    try:
        got = A.text_agreement(model, tokens, [0.0, 0.3], batch_size=2, logit_positions=4)
    finally:
        model.reset_hooks()
    assert len(checks) == 2 and None not in checks
    assert (2, 20, model.cfg.d_vocab) in shapes  # one full forward's logits were compared
    pd.testing.assert_frame_equal(got, ref)


def test_agreement_on_windows_shorter_than_a_block_equals_full_logits(monkeypatch):
    """Windows of fewer positions than ``logit_positions``: one block is the whole window, the same
    matrix product as the model's own forward, so the table is the full-logits one exactly."""
    import interp_norm.noise.text_agreement as A

    model = tiny_bridge("qwen3", seed=2)
    tokens = random_tokens(model, 3, 6, seed=1)
    ref = A.text_agreement(model, tokens, [0.0, 0.1, 0.3], batch_size=2, logit_positions=None)
    checks, real = [], A._exact_block
    monkeypatch.setattr(A, "_exact_block", lambda *a: checks.append(real(*a)) or checks[-1])
    got = A.text_agreement(model, tokens, [0.0, 0.1, 0.3], batch_size=2, logit_positions=8)
    assert checks == [8, 8]  # the blocked path ran (2 windows, then the last 1)
    pd.testing.assert_frame_equal(got, ref, check_exact=True)


ALL = EXACT + ["gemma4", "gemma4-shared"]


def _block_cache(model, tokens, names, wb):
    """Every named hook of every window from TransformerLens's own ``run_with_cache`` on each block of
    ``wb`` windows, joined: what a blocked analysis must reproduce (each window's own forward)."""
    wanted = set().union(*names.values())
    with torch.no_grad():
        parts = [model.run_with_cache(tokens[i:i + wb], names_filter=lambda n: n in wanted)[1]
                 for i in range(0, len(tokens), wb)]
    return {n: torch.cat([p[n] for p in parts]) for n in wanted}


@pytest.mark.numerics
@pytest.mark.parametrize("arch", ALL)
def test_blocked_geometry_equals_the_whole_batch_analyses(arch, monkeypatch):
    """Geometry a block of windows at a time == the public analyses (norm_spread, max_attention,
    bridge_ellipsoid_membership) on every window's hooks at once, and no joined pattern is ever built:
    every hook the sweep reads holds at most ``window_batch`` windows."""
    import interp_norm.anatomy.stream as S
    from interp_norm.geometry import max_attention, norm_spread, run_geometry, sparsity_histogram, sparsity_summary
    from interp_norm.geometry.bridge import bridge_ellipsoid_membership, bridge_norms

    model = tiny_bridge(arch, seed=6)
    tokens = random_tokens(model, 5, 12, seed=1)
    norms = bridge_norms(model)
    names = {0: {h for nm in norms for h in (nm.hook_in, nm.hook_out) if h is not None}}
    names[0] |= {f"blocks.{l}.{h}" for l in range(len(model.blocks)) for h in ("hook_resid_pre",)}
    names[0] |= {la.hooks["pattern"] for la in anatomy(model).layers}
    real = S.window_blocks
    seen = []

    def spy(model_, tokens_, names_, window_batch=None):
        for layer, start, cache in real(model_, tokens_, names_, window_batch):
            seen.append(max(t.shape[0] for t in cache.values()))
            yield layer, start, cache

    monkeypatch.setattr(S, "window_blocks", spy)
    monkeypatch.setattr(S, "layer_caches", lambda *a, **k: pytest.fail("the sweep joined a layer's hooks"))
    for wb in (None, 1, 2):
        seen.clear()
        got = run_geometry(model, tokens=tokens, window_batch=wb)
        assert seen and max(seen) == (len(tokens) if wb is None else wb)  # None: 8 (WINDOW_BATCH) >= 5 windows
        cache = _block_cache(model, tokens, names, wb or len(tokens))
        mx = max_attention(model, tokens, cache=cache)
        pd.testing.assert_frame_equal(got["norm_spread"], norm_spread(model, tokens, cache=cache))
        pd.testing.assert_frame_equal(got["sparsity_hist"], sparsity_histogram(mx))
        pd.testing.assert_frame_equal(got["sparsity_summary"], sparsity_summary(mx))
        ref = bridge_ellipsoid_membership(model, tokens, cache=cache, norms=norms)
        hooked = ref["role"] != "unhooked"  # a norm outside the bridge's hooks: its own forward per block
        pd.testing.assert_frame_equal(got["ellipsoid_membership"][hooked], ref[hooked])
        if wb is None or arch in EXACT:
            pd.testing.assert_frame_equal(got["ellipsoid_membership"], ref)
        else:
            pd.testing.assert_frame_equal(got["ellipsoid_membership"], ref, check_exact=False, rtol=1e-5, atol=1e-8)


@pytest.mark.numerics
@pytest.mark.parametrize("arch", ALL)
@pytest.mark.parametrize("placement", ["before_norm", "after_norm"])
def test_blocked_collapse_equals_one_pass_over_the_same_hooks(arch, placement, monkeypatch):
    """Collapse a block of windows at a time (scores and noise factors of ``window_batch`` windows) ==
    the one-pass analysis of the same clean hooks (TransformerLens's ``run_with_cache`` per block,
    joined), with several blocks of heads (small ``max_elements``) and the strict Monte Carlo."""
    import importlib

    BC = importlib.import_module("interp_norm.noise.bridge_collapse")
    from interp_norm.noise import bridge_collapse

    model = tiny_bridge(arch, seed=5, sharpness=4.0)
    tokens = random_tokens(model, 5, 16, seed=2)
    kw = dict(draws=8, placement=placement, seed=3, strict_samples=16, max_elements=700)
    widths = []
    real_scores, real_factors = BC.scores_from_qk, BC.placed_factors
    monkeypatch.setattr(BC, "scores_from_qk", lambda m, a, l, q, k, **h: widths.append(q.shape[0]) or
                        real_scores(m, a, l, q, k, **h))
    monkeypatch.setattr(BC, "placed_factors", lambda la, t, kappa, raw, p: widths.append(kappa.shape[1]) or
                        real_factors(la, t, kappa, raw, p))
    real_stream = BC.window_blocks
    for wb in (1, 2):
        widths.clear()
        got = bridge_collapse(model, tokens, (0.1, 0.3), window_batch=wb, **kw)
        assert widths and max(widths) == wb
        assert got["n_rows"].sum() > 0
        joined = {}

        def from_blocks(model_, tokens_, names_, window_batch=None):
            assert window_batch >= len(tokens_)  # one pass over the joined hooks
            cache = _block_cache(model_, tokens_, names_, wb)
            joined.update(cache)
            return ((l, 0, cache) for l in sorted(names_))

        monkeypatch.setattr(BC, "window_blocks", from_blocks)
        ref = bridge_collapse(model, tokens, (0.1, 0.3), window_batch=len(tokens), **kw)
        monkeypatch.setattr(BC, "window_blocks", real_stream)
        assert joined
        pd.testing.assert_frame_equal(got, ref)


def test_the_default_window_batch_bounds_many_windows(monkeypatch):
    """No window_batch: blocks of :data:`~interp_norm.core.defaults.WINDOW_BATCH` (8) windows, so 11 windows
    run as 8 + 3, and the tables are those of one pass."""
    import interp_norm.anatomy.stream as S
    from interp_norm.core.defaults import WINDOW_BATCH
    from interp_norm.geometry import run_geometry
    from interp_norm.noise import bridge_collapse

    assert WINDOW_BATCH == 8
    model = tiny_bridge("llama", seed=6, sharpness=4.0)
    tokens = random_tokens(model, 11, 10, seed=1)
    real = S.window_blocks
    sizes = []

    def spy(model_, tokens_, names_, window_batch=None):
        for layer, start, cache in real(model_, tokens_, names_, window_batch):
            sizes.append(next(iter(cache.values())).shape[0])
            yield layer, start, cache

    monkeypatch.setattr(S, "window_blocks", spy)
    got = run_geometry(model, tokens=tokens)
    assert sorted(set(sizes)) == [3, 8]
    ref = run_geometry(model, tokens=tokens, window_batch=11)
    for k in ref:
        pd.testing.assert_frame_equal(got[k], ref[k], obj=k)
    kw = dict(draws=8, placement="after_norm", seed=3, strict_samples=16)
    pd.testing.assert_frame_equal(bridge_collapse(model, tokens, (0.1, 0.3), **kw),
                                  bridge_collapse(model, tokens, (0.1, 0.3), window_batch=11, **kw))
