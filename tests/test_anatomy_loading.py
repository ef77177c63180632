"""Loading real checkpoints offline: save_pretrained folders, the Hugging Face cache, our own
checkpoints, and typed errors for everything else. Plus the text inputs for text models."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from interp_norm import AdditionTask, HookedNormTransformer
from interp_norm.anatomy import (
    anatomy,
    load,
    random_tokens,
    sample_text,
    text_tokens,
    tiny_hf_model,
    verify_scores,
)
from interp_norm.training.checkpoints import save_checkpoint
from interp_norm.errors import CheckpointError, CheckpointNotFoundError, ConfigError

from _models import make_model, word_tokenizer


@pytest.mark.parametrize("arch", ["qwen3", "gemma4"])
@torch.no_grad()
def test_load_a_save_pretrained_folder(tmp_path, arch):
    hf = tiny_hf_model(arch, seed=2)
    tokens = random_tokens(128, 2, 9, seed=1)
    ref = hf(tokens).logits
    hf.save_pretrained(tmp_path / arch)
    bridge = load(tmp_path / arch)
    assert type(bridge).__name__ == "TransformerBridge"
    assert torch.allclose(bridge(tokens), ref, atol=1e-5)
    assert verify_scores(bridge, tokens)["ok"].all()
    assert bridge.tokenizer is None


@torch.no_grad()
def test_load_a_multimodal_gemma4_folder(tmp_path):
    """Real Gemma 4 checkpoints are Gemma4ForConditionalGeneration (text decoder under
    model.language_model, a vision tower beside it): the anatomy and the pattern check hold."""
    from interp_norm.anatomy import tiny_gemma4_conditional

    hf = tiny_gemma4_conditional(seed=1)
    tokens = random_tokens(120, 2, 9, seed=2)  # ids 120-126 are media tokens in this config
    ref = hf(tokens).logits
    hf.save_pretrained(tmp_path / "g4")
    bridge = load(tmp_path / "g4")
    assert torch.allclose(bridge(tokens), ref, atol=1e-5)
    an = anatomy(bridge)
    assert an.architecture == "Gemma4ForConditionalGeneration"
    assert [la.placement for la in an.layers] == ["qkv"] * 4 and [la.kv_layer for la in an.layers] == [0, 1, 0, 1]
    assert verify_scores(bridge, tokens)["ok"].all()


def _populate_hub_cache(root, repo_id: str, hf, tokenizer=None) -> str:
    """The huggingface_hub cache layout: models--org--name/{refs/main, snapshots/<commit>/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    hf.save_pretrained(snapshot)
    if tokenizer is not None:
        tokenizer.save_pretrained(snapshot)
    return commit


@torch.no_grad()
def test_load_a_cached_name_with_the_hub_offline(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    hf = tiny_hf_model("olmo2", seed=4)
    tokens = random_tokens(128, 2, 9, seed=3)
    ref = hf(tokens).logits
    _populate_hub_cache(hub, "tiny-org/tiny-olmo2", hf, tokenizer=word_tokenizer(128))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    bridge = load("tiny-org/tiny-olmo2")
    assert torch.allclose(bridge(tokens), ref, atol=1e-5)
    assert anatomy(bridge)[0].norms["q"].axis == "all_heads"
    # the tokenizer came along: the sample text becomes windows of real token ids
    windows = text_tokens(bridge, n_ctx=16, max_windows=4)
    assert windows.shape == (4, 16) and int(windows.max()) < 128
    assert (windows != 0).float().mean() > 0.5  # mostly known words, not [UNK]


def test_a_name_that_is_not_cached_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(CheckpointNotFoundError, match="hf download nobody/no-such-model"):
        load("nobody/no-such-model")
    with pytest.raises(CheckpointNotFoundError, match="not in the Hugging Face cache"):
        load("no-such-name")


def test_a_folder_that_is_no_model_is_a_typed_error(tmp_path):
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "config.json").write_text(json.dumps({"hello": 1}))
    (junk / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match="not a supported model folder") as e:
        load(junk)
    assert "format_version None" not in str(e.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="not a supported model folder"):
        load(empty)
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        load(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="is a file"):
        load(junk / "notes.txt")


def test_an_hf_folder_with_an_unknown_model_type_is_a_typed_error(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "no_such_architecture_xyz"}))
    with pytest.raises(ConfigError, match="cannot read"):
        load(bad)


@torch.no_grad()
def test_our_checkpoint_folders_still_load_as_our_models(tmp_path):
    model = make_model(attn_norm="qk")
    path = save_checkpoint(model, tmp_path / "ck", task=AdditionTask.preset("cpu"))
    loaded = load(path)
    assert isinstance(loaded, HookedNormTransformer)
    tokens = random_tokens(loaded, 2, 8, seed=0)
    assert torch.equal(loaded(tokens), model(tokens))


@torch.no_grad()
def test_load_with_info_says_what_was_loaded(tmp_path, monkeypatch):
    """One loader for every kind: ours come with the checkpoint's info, a bridge with where its
    weights were read, the architecture its config.json names and the dtype of its parameters."""
    from interp_norm import load_with_info
    from interp_norm.anatomy import BridgeInfo, spec_kind
    from interp_norm.training.checkpoints import CheckpointInfo

    task = AdditionTask.preset("cpu")
    model = make_model(attn_norm="qkv")
    ours = save_checkpoint(model, tmp_path / "ck", task=task, step=5)
    loaded, info = load_with_info(ours)
    assert isinstance(info, CheckpointInfo) and info.step == 5 and info.task == task == loaded.task
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())

    tiny_hf_model("qwen3", seed=1).save_pretrained(tmp_path / "qwen3")
    written = json.loads((tmp_path / "qwen3" / "config.json").read_text())
    bridge, info = load_with_info(tmp_path / "qwen3")
    assert type(bridge).__name__ == "TransformerBridge" and isinstance(info, BridgeInfo)
    assert info.path == tmp_path / "qwen3" and info.architecture == written["architectures"][0]
    assert info.dtype == torch.float32 and info.task is None
    assert load_with_info(tmp_path / "qwen3", dtype="bfloat16")[1].dtype == torch.bfloat16

    hub = tmp_path / "hub"
    commit = _populate_hub_cache(hub, "tiny-org/tiny-gpt2", tiny_hf_model("gpt2", seed=2))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    cached, info = load_with_info("tiny-org/tiny-gpt2")
    assert info.name == "tiny-org/tiny-gpt2" and info.path.name == commit and info.architecture == "GPT2LMHeadModel"

    assert [spec_kind(x) for x in (ours, tmp_path / "qwen3", "tiny-org/tiny-gpt2")] == ["interp_norm", "bridge", "bridge"]
    with pytest.raises(CheckpointNotFoundError, match="not in the Hugging Face cache"):
        spec_kind("nobody/nothing")


def test_kind_refuses_the_other_kind_before_loading(tmp_path):
    model = make_model()
    ours = save_checkpoint(model, tmp_path / "ck", task=AdditionTask.preset("cpu"))
    tiny_hf_model("llama", seed=0).save_pretrained(tmp_path / "llama")
    (tmp_path / "llama" / "model.safetensors").write_bytes(b"not weights")  # never read: refused from config.json
    with pytest.raises(CheckpointError, match=r"Hugging Face model folder.*interp_norm.load\("):
        load(tmp_path / "llama", kind="interp_norm")
    with pytest.raises(CheckpointError, match="is an interp_norm model, not a Hugging Face one"):
        load(ours, kind="bridge")
    with pytest.raises(ConfigError, match="not a model kind"):
        load(ours, kind="hf")
    assert isinstance(load(ours, kind="interp_norm"), HookedNormTransformer)


def test_capabilities_follow_the_kind():
    """What the engines may assume: the full hook vocabulary only for ours, a Hugging Face original
    only for a bridge, neither for any other module (hooks only)."""
    from interp_norm.anatomy import capabilities, tiny_bridge

    plain = torch.nn.Linear(2, 2)
    got = {name: (c.full_vocabulary, c.hf_original) for name, c in
           (("ours", capabilities(make_model())), ("bridge", capabilities(tiny_bridge("gpt2"))), ("plain", capabilities(plain)))}
    assert got == {"ours": (True, False), "bridge": (False, True), "plain": (False, False)}


def test_text_inputs():
    text = sample_text()
    assert len(text.split()) >= 300
    a, b = random_tokens(128, 3, 7, seed=5), random_tokens(128, 3, 7, seed=5)
    assert a.shape == (3, 7) and a.dtype == torch.long and torch.equal(a, b)
    assert 0 <= int(a.min()) and int(a.max()) < 128
    with pytest.raises(ConfigError, match="positive integer"):
        random_tokens(128, 0, 7)
    with pytest.raises(ConfigError, match="no tokenizer"):
        text_tokens(make_model(), "some text")
