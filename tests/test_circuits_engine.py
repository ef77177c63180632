"""The patching engines' contract with ``activation_patch(method="auto")``: a refusal
(:class:`EngineRefusal`) falls back to full forward passes with a warning, any other error from an
engine is a bug and propagates; the incremental engine's wiring check is redone when the weights
change; and the engine's functions take few positional parameters (named row sets instead)."""

from __future__ import annotations

import ast
import contextlib
import io
import os
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformer_lens import patching

from interp_norm import AdditionTask, HookedNormTransformer, ModelConfig
from interp_norm.circuits import LogitDiff, activation_patch, make_pairs
from interp_norm.circuits.exact.engine import IncrementalEngine
from interp_norm.circuits.exact.kv_patching import KVCacheEngine
from interp_norm.errors import EngineRefusal, PatchingError

ENGINE_MODULES = ("engine.py", "engine_rows.py", "block_steps.py", "patching.py", "patch_cells.py")


@pytest.fixture(scope="module")
def pairs():
    return make_pairs(AdditionTask.preset("cpu"), 4, "id", seed=5)


def tiny(seed: int = 0) -> HookedNormTransformer:
    return HookedNormTransformer(ModelConfig.preset("tiny", seed=seed)).eval()


def tl_resid_pre(model, pairs, cache, metric):
    with contextlib.redirect_stderr(io.StringIO()), torch.no_grad():
        return patching.get_act_patch_resid_pre(model, pairs.corrupted_tokens, cache, metric.mean)


def test_an_engine_bug_propagates_in_auto_mode(pairs, monkeypatch):
    """A TypeError inside the engine (a bug, not a refusal) is raised, not turned into a fallback."""
    model = tiny()

    def broken(self, *args, **kwargs):
        raise TypeError("injected engine bug")

    monkeypatch.setattr(IncrementalEngine, "_block", broken)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no fallback warning on the way
        with pytest.raises(TypeError, match="injected engine bug"):
            activation_patch(model, pairs, activation="z")


def test_a_refusal_falls_back_to_hooks_with_a_warning(pairs):
    """A block wired otherwise than the engine's steps (the first block's output scaled) fails the
    engine's check against ``model(tokens)``: ``incremental`` raises EngineRefusal, ``auto`` warns,
    patches with hooks, and equals TransformerLens on that model."""
    model = tiny(seed=1)
    real = model.blocks[0].forward
    model.blocks[0].forward = lambda resid, *a, **kw: 1.5 * real(resid, *a, **kw)
    metric = LogitDiff(pairs)
    _, cache = model.run_with_cache(pairs.clean_tokens)
    with pytest.raises(EngineRefusal, match="disagrees with model"):
        activation_patch(model, pairs.corrupted_tokens, cache, metric, "resid_pre", method="incremental")
    assert issubclass(EngineRefusal, PatchingError)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        res = activation_patch(model, pairs.corrupted_tokens, cache, metric, "resid_pre")
    assert res.method == "exact-hooks"
    assert any(issubclass(x.category, RuntimeWarning) and "falling back to hooks" in str(x.message) for x in w)
    ref = tl_resid_pre(model, pairs, cache, metric)
    assert ref.std() > 1e-4 and (res.values - ref).abs().max() <= 1e-5


def test_a_kv_engine_bug_propagates_in_auto_mode(monkeypatch):
    """Same for the bridges' key/value-cache engine: a TypeError in its check is raised in auto mode."""
    from interp_norm.anatomy import random_tokens, tiny_bridge

    bridge = tiny_bridge("gpt2", seed=0)
    clean = random_tokens(bridge, 2, 6, seed=0)
    corr = random_tokens(bridge, 2, 6, seed=1)
    _, cache = bridge.run_with_cache(clean)

    def broken(self):
        raise TypeError("injected kv engine bug")

    monkeypatch.setattr(KVCacheEngine, "_check", broken)
    with pytest.raises(TypeError, match="injected kv engine bug"):
        activation_patch(bridge, corr, cache, lambda lg: lg[:, -1, 5] - lg[:, -1, 6], "resid_pre")


def test_the_wiring_check_is_redone_when_the_weights_change(pairs, monkeypatch):
    """The check runs once per model and weights: again after an in-place update (as an optimizer
    step does), a load_state_dict, a replaced parameter tensor; not again for the same weights."""
    model = tiny(seed=2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []
    real = IncrementalEngine._check

    def counting(self, tokens):
        calls.append(self.fast)
        return real(self, tokens)

    monkeypatch.setattr(IncrementalEngine, "_check", counting)
    x = pairs.corrupted_tokens

    def build() -> int:
        IncrementalEngine(model, x, exact_pattern=False)
        return len(calls)

    assert build() == 1 and build() == 1
    with torch.no_grad():
        model.blocks[0].attn.W_Q.mul_(1.01)
    assert build() == 2 and build() == 2
    model.load_state_dict(state)
    assert build() == 3
    with torch.no_grad():
        model.blocks[1].mlp.W_in.data = model.blocks[1].mlp.W_in.data * 1.0
    assert build() == 4
    IncrementalEngine(model, x, exact_pattern=True)  # the other arithmetic has its own check
    assert calls == [True, True, True, True, False]


def _positional_parameters(fn: ast.FunctionDef) -> int:
    return len(fn.args.posonlyargs) + len(fn.args.args) + (1 if fn.args.vararg else 0)


def test_engine_functions_take_at_most_six_positional_parameters():
    """Row sets travel as named dataclasses (``engine_rows``), not as long positional lists."""
    root = Path(__file__).resolve().parents[1] / "interp_norm" / "circuits" / "exact"
    too_many = []
    for name in ENGINE_MODULES:
        for node in ast.walk(ast.parse((root / name).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _positional_parameters(node) > 6:
                too_many.append(f"{name}:{node.lineno} {node.name} ({_positional_parameters(node)})")
    assert not too_many, too_many
