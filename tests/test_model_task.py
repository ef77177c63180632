"""A model knows its task: loaders attach it, analyses default to it, another task warns
naming both, none known is a typed error; generate() warns on problems outside the training split;
the activation cache refuses bad names like run_with_hooks; one ``interp_norm.load`` for every model."""

from __future__ import annotations

import json
import os
import warnings
from functools import partial

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pandas as pd
import pytest
import torch

import interp_norm
from interp_norm import AdditionTask, HookedNormTransformer
from interp_norm.training.checkpoints import save_checkpoint
from interp_norm.circuits import attention_map_split, make_pairs
from interp_norm.errors import (
    CheckpointError, ConfigError, HookNameError, OutOfDistributionWarning, PatchingError, TaskMismatchWarning,
)
from interp_norm.core.scoring import evaluate
from interp_norm.geometry import run_geometry
from interp_norm.noise import CollapseSpec, run_collapse, run_forward_collapse, run_noise, run_temperature_sweep
from interp_norm.core.task import encode

from _models import make_model, sharpened_model

CPU = AdditionTask.preset("cpu")
# another task that fits the tiny model's context (the paper's does not: 52 tokens > n_ctx 40)
EASY = AdditionTask(train_terms=(2,), interp_terms=(2,), extrap_terms=(3,), n_digits=(1,))
CPU_TEXT = "AdditionTask.preset('cpu') (2-digit terms; 2, 3 or 5 terms in training"
EASY_TEXT = "AdditionTask(train_terms=(2,), interp_terms=(2,), extrap_terms=(3,), n_digits=(1,))"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny model saved as a checkpoint on the cpu task, and loaded back (the loader attaches the task)."""
    path = save_checkpoint(sharpened_model("qkv"), tmp_path_factory.mktemp("ck") / "tiny-cpu", task=CPU)
    model = interp_norm.load(path)
    return path, model


FEW = CollapseSpec(n_draws=4)
# every analysis that needs a task, as f(model, task) -> a DataFrame (small sizes: tiny model)
ANALYSES = {
    "run_noise": lambda m, *t: run_noise(m, *t, levels=[0.0, 0.5], n_datasets=1, n_examples=16),
    "run_collapse": lambda m, *t: run_collapse(m, *t, levels=[0.1, 0.5], spec=FEW, n_examples=8),
    "run_forward_collapse": lambda m, *t: run_forward_collapse(m, *t, levels=[0.1, 0.5], spec=FEW, n_examples=4),
    "run_temperature_sweep": lambda m, *t: run_temperature_sweep(m, *t, multipliers=[1.0], levels=[0.1, 0.5], spec=FEW,
                                                                 n_examples=8),
    "run_geometry": lambda m, *t: run_geometry(m, *t, n=8)["norm_spread"],
    "evaluate": lambda m, *t: evaluate(m, *t, splits=("id",), size=32, exact_match=False),
    "attention_map_split": lambda m, *t: attention_map_split(m, *t, n=16, threshold=0.3),
}


def test_a_loaded_model_carries_the_task_its_config_json_records(saved):
    path, model = saved
    recorded = json.loads((path / "config.json").read_text())["task"]
    assert model.task == AdditionTask(**{k: tuple(v) for k, v in recorded.items()}) == CPU
    assert model.name == str(path)
    for loaded in (interp_norm.load(path), interp_norm.load_with_info(path)[0], interp_norm.load(path, kind="interp_norm"),
                   HookedNormTransformer.from_pretrained(str(path))):
        assert isinstance(loaded, HookedNormTransformer) and loaded.task == CPU
        assert torch.equal(loaded.W_E, model.W_E)


@pytest.mark.parametrize("name", sorted(ANALYSES))
def test_every_analysis_defaults_to_the_models_task(saved, name):
    _, model = saved
    run = ANALYSES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error", TaskMismatchWarning)  # the model's own task: no warning
        default, explicit = run(model), run(model, CPU)
    pd.testing.assert_frame_equal(default, explicit)
    with pytest.warns(TaskMismatchWarning) as caught:
        other = run(model, EASY)
    said = str(caught[0].message)
    assert said.startswith(f"model {str(saved[0])!r} was trained on {CPU_TEXT}") and f"you passed {EASY_TEXT}" in said
    assert not default.equals(other)  # the other task's problems really were used
    bare = make_model()  # built from a config: no task known
    assert bare.task is None
    with pytest.raises(ConfigError, match=r"needs a task.*task=AdditionTask.preset\('cpu'\)"):
        run(bare)


def test_evaluate_default_task_matches_a_brute_force_count(saved):
    """The default-task accuracy is the one a per-problem loop over the cpu task's test set gives."""
    _, model = saved
    got = evaluate(model, splits=("id",), size=48, seed=3, exact_match=False)["per_token_acc"].item()
    right = total = 0
    with torch.no_grad():
        for p in CPU.test_set("id", 48, seed=3).problems:  # one problem at a time, no padding
            toks = encode(p.text)
            pred = model(toks[None])[0].argmax(-1)
            for i in range(p.text.index("=") + 1, len(p.text)):  # each answer character and the closing ']'
                right += int(pred[i - 1] == toks[i])
                total += 1
    assert got == pytest.approx(right / total, abs=1.5 / total)


def test_make_pairs_and_run_circuits_take_the_models_task(saved):
    from interp_norm.circuits import run_circuits

    _, model = saved
    a, b = make_pairs(model, 12, seed=4), make_pairs(CPU, 12, seed=4)
    assert torch.equal(a.clean_tokens, b.clean_tokens) and torch.equal(a.corrupted_tokens, b.corrupted_tokens)
    with pytest.raises(ConfigError, match="make_pairs needs a task"):
        make_pairs(make_model(), 4)
    with pytest.raises(ConfigError, match="run_circuits needs a task"):
        run_circuits(make_model())
    # the warning comes first; the bad metric then stops the run before any patching
    with pytest.warns(TaskMismatchWarning, match="you passed AdditionTask"), pytest.raises(PatchingError, match="unknown metric"):
        run_circuits(model, EASY, metric="no-such-metric", n_pairs=2)


def test_a_task_that_is_not_a_task_is_a_typed_error(saved):
    with pytest.raises(ConfigError, match="pass levels by name"):
        run_noise(saved[1], [0.0, 0.1])


def test_generate_warns_on_problems_outside_the_training_split(saved):
    _, model = saved
    with pytest.warns(OutOfDistributionWarning) as caught:
        model.generate(["[12+3="])
    said = str(caught[0].message)
    assert "'[12+3=' has 1-digit terms (training had 2-digit terms only)" in said and CPU_TEXT in said
    with pytest.warns(OutOfDistributionWarning, match=r"4 terms \(training had 2, 3 or 5, its interpolation split\)"):
        model.generate(["[12+34+56+78="])
    with pytest.warns(OutOfDistributionWarning, match="8 terms"):
        model.generate(model.to_tokens(["[12+34+56+78+11+22+33+44="]))  # token tensors are checked too
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.generate(["[12+34=", "[N12-34+56="])  # 2 and 3 two-digit terms: inside
        model.generate(["[12+3="], warn_out_of_distribution=False)
        make_model().generate(["[12+3="])  # no known task: nothing to compare with
        evaluate(model, splits=("extrap",), size=4)  # out of distribution on purpose: silent


# ----------------------------------------------------------------------------- the activation cache


def test_a_bad_cache_name_is_a_hook_name_error_like_run_with_hooks():
    model = make_model(attn_norm="qkv")
    tokens = model.to_tokens(["[12+34="])
    _, cache = model.run_with_cache(tokens)
    with pytest.raises(HookNameError) as from_hooks:
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_qq", lambda x, hook: x)])
    with pytest.raises(HookNameError) as from_cache:
        cache["blocks.0.attn.hook_qq"]
    assert isinstance(from_cache.value, KeyError)  # `except KeyError` keeps working
    assert str(from_cache.value) == str(from_hooks.value)
    assert "Closest valid names: ['blocks.0.attn.hook_q'" in str(from_cache.value)
    with pytest.raises(HookNameError, match="has 2 layers"):
        cache["q", 5]
    with pytest.raises(HookNameError, match="never fires.*use_attn_result"):
        cache["blocks.0.attn.hook_result"]
    with pytest.raises(HookNameError, match="unknown activation kind 'qq'"):
        cache["qq", 0]
    with pytest.raises(HookNameError, match="hook names"):
        cache[3]
    # what TL's lookups accept still works, and our head-norm kinds as tuples too
    assert torch.equal(cache["q", -1], cache["blocks.1.attn.hook_q"])
    assert torch.equal(cache["q_normed", 0], cache["blocks.0.attn.hook_q_normed"])
    _, some = model.run_with_cache(tokens, names_filter=["blocks.0.attn.hook_q"])
    with pytest.raises(HookNameError, match="exists but is not in this cache.*names_filter"):
        some["blocks.0.attn.hook_k"]


# ----------------------------------------------------------------------------- one loader


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from interp_norm.anatomy import tiny_hf_model

    folder = tmp_path_factory.mktemp("hf") / "tiny-qwen3"
    tiny_hf_model("qwen3", seed=6).save_pretrained(folder)
    return folder


@torch.no_grad()
def test_interp_norm_load_opens_a_save_pretrained_folder(hf_folder):
    import transformers

    from interp_norm.anatomy import random_tokens

    bridge = interp_norm.load(hf_folder)
    assert type(bridge).__name__ == "TransformerBridge"
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_folder, local_files_only=True).eval()
    tokens = random_tokens(bridge, 2, 7, seed=1)
    assert torch.allclose(bridge(tokens), ref(tokens).logits, atol=1e-5)


def test_loading_only_ours_points_an_hf_folder_to_interp_norm_load(hf_folder, tmp_path):
    for load in (partial(interp_norm.load, kind="interp_norm"), partial(interp_norm.load_with_info, kind="interp_norm"),
                 HookedNormTransformer.from_pretrained):
        with pytest.raises(CheckpointError) as e:
            load(hf_folder)
        said = str(e.value)
        assert f"interp_norm.load({str(hf_folder)!r})" in said and "Hugging Face model folder" in said, (load, said)
        assert "format_version None" not in said and "no pretrained checkpoint named" not in said
    with pytest.raises(CheckpointError, match=r"no pretrained checkpoint named 'gpt2'.*interp_norm.load\(spec\)"):
        interp_norm.load("gpt2", kind="interp_norm")


def test_a_bridge_without_a_tokenizer_says_its_tokens_are_random(hf_folder):
    bridge = interp_norm.load(hf_folder)
    assert bridge.tokenizer is None
    with pytest.warns(UserWarning, match="seeded random token ids, not text, because it has no tokenizer"):
        run_geometry(bridge, n=2)


def test_the_cli_says_text_needs_a_tokenizer_without_python_advice(hf_folder, tmp_path, capsys):
    from _models import run_cli

    text = tmp_path / "story.txt"
    text.write_text("Once upon a time. " * 50)
    code, _, err = run_cli(capsys, "geometry", hf_folder, "--out", tmp_path / "g", "--text", text, "--no-progress")
    assert code == 2
    assert "--text needs a tokenizer" in err and "tokenizer.json" in err
    assert "random_tokens(" not in err and "interp_norm." not in err
