"""Reliability: typed errors for the cases not covered elsewhere, and hooks that never leak.

The full list of bad-input cases and where each is tested is in the README ("Errors"). Here: the
derived-n_heads divisibility check, an empty set of patching cells, clean/corrupted batches of
different shapes, and hook hygiene: analyses that fail half-way leave the model exactly as it was;
hook names that do not exist, or name points that never fire, are refused with the fix.
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from interp_norm import AdditionTask, HookedNormTransformer, ModelConfig
from interp_norm.circuits import activation_patch, attribution_patch, make_pairs
from interp_norm.errors import ConfigError, HookNameError, InterpNormError, NoiseSpecError, PatchingError
from interp_norm.noise import NormNoise, measure_collapse, run_noise

TASK = AdditionTask.preset("cpu")


def fresh_pair(attn_norm: str = "pre") -> tuple[HookedNormTransformer, HookedNormTransformer]:
    """The model under test and an independent fresh copy of it (same config, same state dict)."""
    model = HookedNormTransformer(ModelConfig.preset("tiny", attn_norm=attn_norm)).eval()
    copy = HookedNormTransformer(ModelConfig.preset("tiny", attn_norm=attn_norm)).eval()
    copy.load_state_dict(model.state_dict())
    return model, copy


def no_hooks_attached(model: HookedNormTransformer) -> bool:
    return all(not hp.fwd_hooks and not hp.bwd_hooks for hp in model.hook_dict.values()) and not any(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules()
    )


def test_d_model_not_divisible_when_n_heads_is_derived():
    with pytest.raises(ConfigError, match="not divisible by d_head"):
        ModelConfig.preset("tiny", d_model=30, d_head=8, n_heads=-1, n_freq=8)
    assert ModelConfig.preset("tiny", d_model=32, d_head=8, n_heads=-1).n_heads == 4


def test_empty_cells_and_mismatched_batches_raise_patching_errors():
    model, _ = fresh_pair()
    pairs = make_pairs(TASK, 4, seed=0, aligned=True)
    _, cache = model.run_with_cache(pairs.clean_tokens)
    with pytest.raises(PatchingError):
        activation_patch(model, pairs, activation="z", cells=pd.DataFrame(columns=["layer", "pos", "head"]))
    with pytest.raises(PatchingError):
        activation_patch(model, pairs.corrupted_tokens[:2], cache, metric=lambda logits: logits[:, 0, 0], activation="z")


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("attn_norm", ["pre", "qkv"])
def test_analyses_that_fail_half_way_leave_no_hooks(attn_norm):
    model, copy = fresh_pair(attn_norm)
    tokens = TASK.sample_batch(8, "id", seed=1).tokens
    expected = copy(tokens)

    # 1) an exception inside the noise context manager
    with pytest.raises(Boom):
        with NormNoise(model, 0.1, seed=0):
            model(tokens)
            raise Boom()
    # 2) a metric that fails half-way through a batched patching sweep
    pairs = make_pairs(TASK, 4, seed=0, aligned=True)
    calls = {"n": 0}

    def failing_metric(logits):
        calls["n"] += 1
        if calls["n"] > 1:
            raise Boom()
        return logits[:, -1, 0].reshape(-1)

    with pytest.raises(Exception):  # noqa: B017 (any error: what matters is that the hooks are gone)
        activation_patch(model, pairs, metric=failing_metric, activation="z", method="hooks", batch_size=2)
    # 3) a failing metric inside attribution patching (a backward pass with hooks attached)
    with pytest.raises(Exception):  # noqa: B017 (any error: what matters is that the hooks are gone)
        attribution_patch(model, pairs, metric=lambda logits: (_ for _ in ()).throw(Boom()), activation="z")
    # 4) bad noise specs part-way through a sweep
    with pytest.raises(NoiseSpecError):
        run_noise(model, TASK, levels=[0.0, 0.01, 2.0], n_datasets=1, n_examples=8)
    with pytest.raises(InterpNormError):
        measure_collapse(model, tokens, levels=[0.01, -1.0])

    assert no_hooks_attached(model)
    assert torch.equal(model(tokens), expected), "the model's logits changed after failed analyses"


# ----------------------------------------------------------------------------- hook names


def _ident(act, hook):
    return act


def _fired(model: HookedNormTransformer, tokens: torch.Tensor) -> set[str]:
    """Which hook points fire, seen from the HookPoints themselves (bypassing the model's checks)."""
    seen: set[str] = set()
    for name, hp in model.hook_dict.items():
        hp.add_hook(lambda act, hook, name=name: seen.add(name))
    try:
        model(tokens)
    finally:
        model.reset_hooks()
    return seen


@pytest.mark.parametrize("attn_norm", ["pre", "qkv", "qk", "none"])
@pytest.mark.parametrize("flags", [{}, dict(use_attn_result=True), dict(use_split_qkv_input=True)])
def test_dormant_hooks_are_exactly_the_points_that_never_fire(attn_norm, flags):
    from interp_norm.core.tl_api import dormant_hooks

    model = HookedNormTransformer(ModelConfig.preset("tiny", attn_norm=attn_norm, **flags)).eval()
    tokens = TASK.sample_batch(2, "id", seed=0).tokens
    assert set(model.hook_dict) - _fired(model, tokens) == set(dormant_hooks(model))


WRONG = "blocks.0.attn.hook_qq"


@pytest.mark.parametrize(
    "call",
    [
        lambda m, t: m.run_with_hooks(t, fwd_hooks=[(WRONG, _ident)]),
        lambda m, t: m.run_with_hooks(t, bwd_hooks=[(WRONG, _ident)], reset_hooks_end=False),
        lambda m, t: m.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", _ident), (WRONG, _ident)]).__enter__(),
        lambda m, t: m.add_hook(WRONG, _ident),
        lambda m, t: m.add_perma_hook(WRONG, _ident),
        lambda m, t: m.run_with_cache(t, names_filter=["blocks.0.attn.hook_z", WRONG]),
        lambda m, t: m.run_with_cache(t, names_filter=WRONG),
    ],
    ids=["run_with_hooks", "bwd_hooks", "hooks", "add_hook", "add_perma_hook", "names_filter_list", "names_filter_str"],
)
def test_wrong_hook_name_raises_hook_name_error_with_close_matches(call):
    model, copy = fresh_pair()
    tokens = TASK.sample_batch(2, "id", seed=0).tokens
    with pytest.raises(HookNameError, match=r"hook_qq.*Closest valid names: \['blocks\.0\.attn\.hook_q'") as e:
        call(model, tokens)
    assert isinstance(e.value, KeyError)  # still caught by code expecting TL's KeyError
    assert no_hooks_attached(model), "a refused hook list must leave no hook behind"
    assert torch.equal(model(tokens), copy(tokens))


def test_normed_hooks_on_a_variant_without_them_say_where_they_exist():
    model, _ = fresh_pair("pre")
    with pytest.raises(HookNameError, match=r"hook_q_normed exists only .*attn_norm='qk' or 'qkv'.*blocks\.0\.attn\.hook_q\b"):
        model.run_with_hooks(TASK.sample_batch(2, "id", seed=0).tokens, fwd_hooks=[("blocks.0.attn.hook_q_normed", _ident)])
    qk, _ = fresh_pair("qk")
    with pytest.raises(HookNameError, match=r"hook_v_normed exists only .*attn_norm='qkv'"):
        qk.add_hook("blocks.1.attn.hook_v_normed", _ident)
    with pytest.raises(HookNameError, match=r"ln1 exists only on Pre-Norm"):
        qk.add_hook("blocks.1.ln1.hook_scale", _ident)
    with pytest.raises(HookNameError, match=r"has 2 layers"):
        qk.add_hook("blocks.5.attn.hook_z", _ident)


@pytest.mark.parametrize(
    "name, flag",
    [("blocks.1.attn.hook_result", "use_attn_result"), ("blocks.0.hook_q_input", "use_split_qkv_input"),
     ("blocks.0.hook_k_input", "use_split_qkv_input"), ("blocks.1.hook_v_input", "use_split_qkv_input")],
)
def test_hooks_on_points_that_never_fire_are_refused_until_the_flag_is_set(name, flag):
    model, copy = fresh_pair("qkv")
    tokens = TASK.sample_batch(2, "id", seed=0).tokens
    for call in (
        lambda: model.run_with_hooks(tokens, fwd_hooks=[(name, _ident)]),
        lambda: model.add_hook(name, _ident),
        lambda: model.run_with_cache(tokens, names_filter=[name]),
        lambda: model.run_with_hooks(tokens, fwd_hooks=[(lambda n: n == name, _ident)]),
    ):
        with pytest.raises(HookNameError, match=rf"never fires.*cfg\.{flag} is False.*set_{flag}\(True\)"):
            call()
    assert no_hooks_attached(model)
    # a filter that also matches live points, or nothing, is fine (dormant points are simply skipped)
    model.run_with_hooks(tokens, fwd_hooks=[(lambda n: n.endswith(name.rsplit(".", 1)[-1]) or n.endswith("hook_z"), _ident)])
    model.run_with_hooks(tokens, fwd_hooks=[(lambda n: n == "no.such.hook", _ident)])
    _, cache = model.run_with_cache(tokens)
    assert name not in cache.keys()
    getattr(model, f"set_{flag}")(True)
    calls = []
    model.run_with_hooks(tokens, fwd_hooks=[(name, lambda act, hook: calls.append(hook.name))])
    assert calls and set(calls) == {name}
    _, cache = model.run_with_cache(tokens, names_filter=[name])
    assert list(cache.keys()) == [name]
    torch.testing.assert_close(model(tokens), copy(tokens), atol=1e-5, rtol=1e-5)
