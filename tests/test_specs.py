"""Settings objects with keyword overrides: one spec per concern, its fields also accepted as keywords,
an unknown keyword refused with a typed error naming it and the valid ones."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
import torch

from interp_norm import circuits as C
from interp_norm import geometry as G
from interp_norm import noise as N
from interp_norm.core.specs import split_overrides, with_overrides
from interp_norm.core.task import AdditionTask
from interp_norm.errors import ConfigError, NoiseSpecError, PatchingError
from interp_norm.noise.text_agreement import text_agreement
from _models import make_model


@dataclasses.dataclass(frozen=True)
class _Spec:
    a: int = 1
    b: str = "x"


def test_with_overrides_replaces_fields_and_keeps_defaults():
    assert with_overrides(_Spec, None, {}, who="f") == _Spec()
    assert with_overrides(_Spec, None, {"a": 3}, who="f") == _Spec(a=3, b="x")
    assert with_overrides(_Spec, _Spec(b="y"), {"a": 4}, who="f") == _Spec(a=4, b="y")
    base = _Spec(a=2)
    assert with_overrides(_Spec, base, {}, who="f") is base


def test_with_overrides_refuses_unknown_names_and_other_specs_with_the_given_error():
    with pytest.raises(NoiseSpecError, match=r"f has no option 'c'.*\['a', 'b'\]"):
        with_overrides(_Spec, None, {"c": 1, "a": 2}, who="f", error=NoiseSpecError)
    with pytest.raises(ConfigError, match="spec must be a _Spec"):
        with_overrides(_Spec, {"a": 1}, {}, who="f")


def test_split_overrides_partitions_by_field():
    mine, rest = split_overrides({"a": 1, "z": 2, "b": "q"}, _Spec)
    assert mine == {"a": 1, "b": "q"} and rest == {"z": 2}


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def tokens(model):
    return AdditionTask.preset("cpu").test_set("id", 6, seed=0).tokens


@pytest.mark.parametrize("call, error", [  # each misspells one option: the message must name it
    (lambda m, t: N.NormNoise(m, 0.1, sedd=1), NoiseSpecError),
    (lambda m, t: N.HeadNoise(m, levle=0.1), NoiseSpecError),
    (lambda m, t: N.accuracy_under_noise(m, [t], (0.1,), nosied="all"), NoiseSpecError),
    (lambda m, t: N.collapse_consequence(m, t, (0.1,), n_draw=2), NoiseSpecError),
    (lambda m, t: N.noise_decomposition(m, [t], (0.1,), sed=1), NoiseSpecError),
    (lambda m, t: N.measure_collapse(m, t, (0.1,), strict_sample=3), NoiseSpecError),
    (lambda m, t: N.bridge_collapse(m, t, (0.1,), drawz=3), ConfigError),
    (lambda m, t: text_agreement(m, t, (0.1,), draw=2), NoiseSpecError),
    (lambda m, t: G.run_geometry(m, tokens=t, coverag=0.5), ConfigError),
    (lambda m, t: G.orthogonal_spheres(m, t, granularty="layer"), ConfigError),
    (lambda m, t: C.activation_patch(m, t, None, lambda lg: lg[:, -1, 0], "z", bye="all"), PatchingError),
])
def test_an_unknown_keyword_is_refused_by_name(model, tokens, call, error):
    with pytest.raises(error) as info:
        call(model, tokens)
    wrong = {"sedd", "levle", "nosied", "n_draw", "sed", "strict_sample", "drawz", "draw", "coverag", "granularty", "bye"}
    named = [w for w in wrong if f"'{w}'" in str(info.value)]
    assert len(named) == 1, str(info.value)


def test_a_spec_and_the_same_keywords_give_the_same_noise(model, tokens):
    """The spec path and the keyword path build the same options: the same κ and the same accuracy table."""
    spec = N.AccuracyNoiseSpec(noised="all", targets="qk", seed=5, batch_size=4)
    by_spec = N.accuracy_under_noise(model, [tokens], (0.2,), spec)
    by_keywords = N.accuracy_under_noise(model, [tokens], (0.2,), noised="all", targets="qk", seed=5, batch_size=4)
    pd.testing.assert_frame_equal(by_spec, by_keywords)
    assert by_spec["targets"].tolist() == ["qk"]  # the option took effect (the default is qkv)
    overridden = N.accuracy_under_noise(model, [tokens], (0.2,), spec, targets="q")
    assert overridden["targets"].tolist() == ["q"]  # a keyword overrides the spec's field


def test_norm_noise_controls_and_head_noise_draws_take_effect(model, tokens):
    """``shared`` (a NormNoise control keyword) gives every head the same κ; HeadNoise's ``level``/``seed``
    keywords reach its sampler: κ = level · z with z the seeded unit draws."""
    with N.NormNoise(model, 0.3, "q", shared=True, seed=2) as noise:
        model(tokens)
    kappa = noise.last_kappa[(0, "q")]  # [b, p, h, 1]
    assert torch.equal(kappa, kappa[:, :, :1].expand_as(kappa))
    a, b = N.HeadNoise(model, level=0.2, seed=7), N.HeadNoise(model, level=0.4, seed=7)
    za, zb = a.sampler(0, "q", (2, 3, 4), 0), b.sampler(0, "q", (2, 3, 4), 0)
    assert torch.allclose(zb, 2 * za, rtol=4 * torch.finfo(torch.float32).eps, atol=0)
