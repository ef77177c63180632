"""Where models run and in which dtype: --dtype, --device, --device-map.

Bad input is a typed one-line error: an unknown dtype, a device that is not there, a device_map (or a
dtype other than float32) for one of our models, a device_map without accelerate. A Hugging Face
folder loads in the chosen dtype or the stored one ("auto"); expected values come from the saved
model reloaded with transformers, not through interp_norm.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

import interp_norm
from interp_norm.anatomy import tiny_hf_model
from interp_norm.training.devices import check_device_map, resolve_device, resolve_dtype
from interp_norm.errors import ConfigError

from _models import make_model, run_cli
from test_cli_bridges import one_line_error


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    f32, bf16 = root / "qwen3-f32", root / "qwen3-bf16"
    tiny_hf_model("qwen3", seed=3).save_pretrained(f32)
    tiny_hf_model("qwen3", seed=3).to(torch.bfloat16).save_pretrained(bf16)
    return f32, bf16


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    from interp_norm.training.checkpoints import save_checkpoint
    from interp_norm.core.task import AdditionTask

    folder = tmp_path_factory.mktemp("ours") / "ckpt"
    save_checkpoint(make_model(), folder, task=AdditionTask.preset("cpu"))
    return folder


def test_unknown_dtype_and_absent_devices_are_typed_errors():
    with pytest.raises(ConfigError, match=r"unknown dtype 'bf17'.*bfloat16"):
        resolve_dtype("bf17")
    with pytest.raises(ConfigError, match="not a floating-point"):
        resolve_dtype(torch.int64)
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype("auto") == "auto"
    assert resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(ConfigError, match="unknown device 'gpu'"):
        resolve_device("gpu")
    n = torch.cuda.device_count()
    with pytest.raises(ConfigError, match="cuda:99"):  # absent whether or not this machine has CUDA
        resolve_device("cuda:99")
    if n == 0:
        with pytest.raises(ConfigError, match="CUDA is not available"):
            resolve_device("cuda")
    assert resolve_device(None) == torch.device("cpu")


def test_load_in_a_chosen_or_the_stored_dtype(folders):
    import transformers

    f32, bf16 = folders
    model = interp_norm.load(f32, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in interp_norm.load(bf16, dtype="auto").parameters()} == {torch.bfloat16}
    assert {p.dtype for p in interp_norm.load(f32, dtype="auto").parameters()} == {torch.float32}
    # bfloat16 logits equal transformers' own bfloat16 model (loaded independently)
    ref = transformers.AutoModelForCausalLM.from_pretrained(f32, local_files_only=True, dtype=torch.bfloat16,
                                                            attn_implementation="eager").eval()
    tokens = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(tokens), ref(tokens).logits)


def test_load_refuses_bad_device_dtype_and_device_map(folders, ours, monkeypatch):
    f32, _ = folders
    with pytest.raises(ConfigError, match="unknown dtype"):
        interp_norm.load(f32, dtype="float8")
    with pytest.raises(ConfigError, match="cuda:99"):
        interp_norm.load(f32, device="cuda:99")
    with pytest.raises(ConfigError, match="cuda:99"):
        interp_norm.load(ours, device="cuda:99")
    from interp_norm import load_with_info
    from interp_norm.core.model import HookedNormTransformer

    with pytest.raises(ConfigError, match="cuda:99"):
        load_with_info(ours, device="cuda:99")
    with pytest.raises(ConfigError, match="unknown device 'gpu'"):
        HookedNormTransformer.from_pretrained(str(ours), device="gpu")
    with pytest.raises(ConfigError, match="device_map.*Hugging Face models.*interp_norm model"):
        interp_norm.load(ours, device_map="auto")
    with pytest.raises(ConfigError, match="dtype 'bfloat16' applies to Hugging Face models"):
        interp_norm.load(ours, dtype="bfloat16")
    assert interp_norm.load(ours, dtype="float32") is not None
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install accelerate"):
        interp_norm.load(f32, device_map="auto")
    with pytest.raises(ConfigError, match="pip install accelerate"):
        check_device_map("auto")


@pytest.mark.skipif(__import__("importlib").util.find_spec("accelerate") is None, reason="accelerate not installed")
def test_device_map_goes_to_from_pretrained(folders, monkeypatch):
    import transformers

    f32, _ = folders
    tokens = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    plain = interp_norm.load(f32)
    real, seen = transformers.Qwen3ForCausalLM.from_pretrained, {}

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.Qwen3ForCausalLM, "from_pretrained", spy)
    mapped = interp_norm.load(f32, device_map="cpu")
    assert seen["device_map"] == "cpu"
    with torch.no_grad():
        assert torch.equal(plain(tokens), mapped(tokens))
    with pytest.raises(ConfigError, match="either device"):
        check_device_map("auto", "cuda:0")


def test_cli_one_line_errors(folders, ours, tmp_path, capsys):
    f32, _ = folders
    code, _, err = run_cli(capsys, "collapse", f32, "--dtype", "bf17", "--out", tmp_path / "a")
    one_line_error(code, err, "unknown dtype 'bf17'")
    code, _, err = run_cli(capsys, "geometry", f32, "--device", "cuda:99", "--out", tmp_path / "b")
    one_line_error(code, err, "cuda:99")
    code, _, err = run_cli(capsys, "noise", ours, "--device-map", "auto", "--out", tmp_path / "c")
    one_line_error(code, err, "--device-map", "interp_norm model")
    code, _, err = run_cli(capsys, "collapse", ours, "--dtype", "bfloat16", "--out", tmp_path / "d")
    one_line_error(code, err, "applies to Hugging Face models")
    code, _, err = run_cli(capsys, "evaluate", ours, "--device", "tpu", "--out", tmp_path / "e")
    one_line_error(code, err, "unknown device 'tpu'")
