"""Reliability: typed errors for the cases not covered elsewhere, and hooks that never leak.

The full list of bad-input cases and where each is tested is in the README ("Errors"). Here: the
derived-n_heads divisibility check, an empty set of patching cells, clean/corrupted batches of
different shapes, and hook hygiene: analyses that fail half-way leave the model exactly as it was.
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from interp_norm import AdditionTask, HookedNormTransformer, ModelConfig
from interp_norm.circuits import activation_patch, attribution_patch, make_pairs
from interp_norm.errors import ConfigError, InterpNormError, NoiseSpecError, PatchingError
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

    with pytest.raises(Exception):
        activation_patch(model, pairs, metric=failing_metric, activation="z", method="hooks", batch_size=2)
    # 3) a failing metric inside attribution patching (a backward pass with hooks attached)
    with pytest.raises(Exception):
        attribution_patch(model, pairs, metric=lambda logits: (_ for _ in ()).throw(Boom()), activation="z")
    # 4) bad noise specs part-way through a sweep
    with pytest.raises(NoiseSpecError):
        run_noise(model, TASK, levels=[0.0, 0.01, 2.0], n_datasets=1, n_examples=8)
    with pytest.raises(InterpNormError):
        measure_collapse(model, tokens, levels=[0.01, -1.0])

    assert no_hooks_attached(model)
    assert torch.equal(model(tokens), expected), "the model's logits changed after failed analyses"
