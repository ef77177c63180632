"""Accuracy under noise for text models: top-1 agreement and KL(clean ‖ noised) per level.

Level 0 is bit-identical to the clean model; noise before Gemma 4's parameter-free v-norm changes
no prediction; the table's numbers equal a hand computation from the same noised forward pass.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from interp_norm.anatomy import anatomy, random_tokens, tiny_bridge
from interp_norm.noise.text_agreement import text_agreement
from interp_norm.noise import HeadNoise, seeded_sampler
from interp_norm.errors import ConfigError, NoiseSpecError


@pytest.fixture(scope="module")
def models():
    return {a: tiny_bridge(a, seed=5) for a in ("qwen3", "gemma4", "gpt2", "llama", "olmo2")}


@pytest.mark.parametrize("arch", ["qwen3", "gemma4", "gpt2", "llama", "olmo2"])
@pytest.mark.parametrize("placement", ["before_norm", "after_norm"])
@torch.no_grad()
def test_level_zero_is_bit_identical_to_clean(models, arch, placement):
    model = models[arch]
    tokens = random_tokens(model, 3, 12, seed=1)
    noise = HeadNoise(model, placement=placement, sampler=seeded_sampler(0.0, 0))
    assert torch.equal(model.run_with_hooks(tokens, fwd_hooks=noise.hooks()), model(tokens))
    df = text_agreement(model, tokens, (0.0, 0.3), placement=placement, batch_size=2)
    zero = df[df.level == 0.0].iloc[0]
    assert zero.agreement == 1.0 and zero.kl == 0.0 and zero.n_tokens == 36
    if not df.removed_by_norm.iloc[1]:
        assert df.agreement.iloc[1] < 1.0 and df.kl.iloc[1] > 1e-3  # the same call does measure noise


@torch.no_grad()
def test_noise_before_gemma4_parameter_free_v_norm_changes_nothing(models):
    model = models["gemma4"]
    assert all(la.norms["v"].gain is False for la in anatomy(model).layers)
    tokens = random_tokens(model, 4, 12, seed=2)
    df = text_agreement(model, tokens, (0.1, 0.5), targets=("v",), placement="before_norm", draws=2)
    assert df.removed_by_norm.all()
    assert (df.agreement == 1.0).all()  # exactly: no position changes its prediction
    # the only change left is the norm's eps: |Δ| ≲ |κ|·eps/m, far below float32 logit resolution
    assert (df.kl <= 1e-9).all()
    after = text_agreement(model, tokens, (0.5,), targets=("v",), placement="after_norm")
    assert not after.removed_by_norm.all() and after.kl.iloc[0] > 1e-3


@torch.no_grad()
def test_table_equals_a_hand_computation(models):
    model = models["qwen3"]
    tokens = random_tokens(model, 3, 10, seed=4)
    df = text_agreement(model, tokens, (0.3,), placement="after_norm", seed=11, batch_size=3)
    clean = model(tokens)
    noise = HeadNoise(model, placement="after_norm", sampler=seeded_sampler(0.3, 11))
    noised = model.run_with_hooks(tokens, fwd_hooks=noise.hooks())
    p = torch.softmax(clean.double(), -1)
    kl = (p * (torch.log_softmax(clean.double(), -1) - torch.log_softmax(noised.double(), -1))).sum(-1)
    agree = (clean.argmax(-1) == noised.argmax(-1)).double().mean()
    assert df.agreement.iloc[0] == pytest.approx(float(agree), abs=1e-12)
    assert df.kl.iloc[0] == pytest.approx(float(kl.mean()), rel=1e-4)


def test_bad_input_is_refused(models):
    model = models["qwen3"]
    with pytest.raises(ConfigError, match="tokenizer"):
        text_agreement(model)  # a tiny model has no tokenizer: say what to pass instead
    with pytest.raises(NoiseSpecError):
        text_agreement(model, random_tokens(model, 1, 5), (0.1,), targets=("x",))
    with pytest.raises(NoiseSpecError):
        text_agreement(model, random_tokens(model, 1, 5), (0.1,), draws=0)
