"""Checkpoints: bit-exact round trip, atomic writes, no unpickling, and one typed error per failure."""

from __future__ import annotations

import json
import os

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file

from interp_norm import load_with_info
from interp_norm.training import checkpoints as C
from interp_norm.training.checkpoint_format import sha256
from interp_norm.training.checkpoints import (
    commit_run_checkpoint,
    list_pretrained,
    load_train_state,
    save_checkpoint,
)
from interp_norm.errors import CheckpointError, CheckpointNotFoundError, InterpNormError, OutputDirError
from interp_norm.core.model import HookedNormTransformer, ModelConfig
from interp_norm.core.task import AdditionTask
from interp_norm.training.config import TrainConfig

TASK = AdditionTask(train_terms=(2,), interp_terms=(2,), extrap_terms=(3,), n_digits=(1,))


def tiny(attn_norm: str = "pre", seed: int = 0) -> HookedNormTransformer:
    return HookedNormTransformer(ModelConfig.preset("tiny", attn_norm=attn_norm, seed=seed)).eval()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


@pytest.fixture
def ckpt(tmp_path):
    model = tiny()
    path = save_checkpoint(
        model, tmp_path / "ck", task=TASK, train_cfg=TrainConfig(max_steps=3),
        train_state={"step": 3, "x": torch.arange(4)}, metrics={"evaluation": [{"split": "id", "per_token_acc": 0.5}]},
        curve=pd.DataFrame({"step": [1, 2], "loss": [0.1 + 0.2, 1 / 3]}), step=3,
    )
    return model, path


def rewrite_manifest(path, name):
    """Re-record a file's size and hash, as a deliberate forger (not random corruption) would."""
    cfg = json.loads((path / "config.json").read_text())
    f = path / name
    cfg["files"][name] = {"bytes": f.stat().st_size, "sha256": sha256(f)}
    (path / "config.json").write_text(json.dumps(cfg))


# ----------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("attn_norm", ["pre", "qkv", "qk", "none"])
def test_round_trip_gives_bit_identical_weights_and_logits(tmp_path, attn_norm):
    model = tiny(attn_norm, seed=3)
    with torch.no_grad():  # move away from the seeded init so a re-init could not pass
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    save_checkpoint(model, tmp_path / "ck", task=TASK)
    loaded, info = C._load_checkpoint(tmp_path / "ck")
    assert not loaded.training
    assert info.model_cfg.to_dict() == model.cfg.to_dict() and info.task.to_dict() == TASK.to_dict()
    for (k, a), (k2, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(bits(a), bits(b)), k
    tokens = TASK.sample_batch(16, "extrap", seed=1).tokens
    assert torch.equal(bits(model(tokens)), bits(loaded(tokens)))


def test_info_holds_task_train_cfg_metrics_curve_exactly(ckpt):
    _, path = ckpt
    _, info = C._load_checkpoint(path)
    assert info.step == 3
    assert info.train_cfg == TrainConfig(max_steps=3)
    assert info.metrics["evaluation"][0]["per_token_acc"] == 0.5
    assert info.curve["loss"].tolist() == [0.1 + 0.2, 1 / 3]  # floats survive the CSV bit-exactly
    state = load_train_state(path)
    assert state["step"] == 3 and torch.equal(state["x"], torch.arange(4))


def test_export_drops_train_state_and_keeps_the_rest(ckpt, tmp_path):
    model, path = ckpt
    dst = C.export_checkpoint(path, tmp_path / "shipped")
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "metrics.json", "model.safetensors", "training_curve.csv"]
    loaded, info = C._load_checkpoint(dst)
    assert (dst / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()
    assert info.step == 3 and info.train_cfg == TrainConfig(max_steps=3) and len(info.curve) == 2
    assert not info.has_train_state


def test_every_checkpoint_file_is_world_readable_whatever_the_umask(ckpt, tmp_path):
    """safetensors alone writes model.safetensors 0600; shipped checkpoints must be readable by all."""
    _, path = ckpt
    modes = {p.name: p.stat().st_mode & 0o777 for p in path.iterdir()}
    assert set(modes) == {"config.json", "model.safetensors", "metrics.json", "training_curve.csv", "train_state.pt"}
    assert modes == {name: 0o644 for name in modes}
    old = os.umask(0o077)  # a private umask: files are still 0644, as io.write_atomic sets them
    try:
        commit_run_checkpoint(tmp_path / "run", 1, model=tiny(), task=TASK)
    finally:
        os.umask(old)
    run = tmp_path / "run"
    assert {p.name: p.stat().st_mode & 0o777 for p in (run / "step-00000001").iterdir()} == {
        "config.json": 0o644, "model.safetensors": 0o644}
    assert (run / "LATEST").stat().st_mode & 0o777 == 0o644


def test_checkpoints_keeps_the_io_helpers_callers_import():
    from interp_norm.training import io

    assert C.ensure_writable_dir is io.ensure_writable_dir  # re-exported, not a second copy


def test_run_folder_resolves_to_latest_and_prunes(tmp_path):
    model = tiny()
    for step in (10, 20, 30):
        commit_run_checkpoint(tmp_path, step, keep_last=2, model=model, task=TASK)
    assert (tmp_path / "LATEST").read_text().strip() == "step-00000030"
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000020", "step-00000030"]
    _, info = C._load_checkpoint(tmp_path)
    assert info.step == 30 and info.path.name == "step-00000030"


# ----------------------------------------------------------------------------- atomicity


def test_interrupted_write_leaves_old_checkpoint_and_no_visible_new_one(tmp_path, monkeypatch):
    old = tiny(seed=1)
    save_checkpoint(old, tmp_path / "ck", task=TASK)
    before = (tmp_path / "ck" / "model.safetensors").read_bytes()

    real_replace = os.replace

    def crash_on_final_rename(src, dst):
        if ".tmp-" in str(src) and "ck" == os.path.basename(dst):
            raise KeyboardInterrupt("killed while renaming")
        return real_replace(src, dst)

    monkeypatch.setattr(C.os, "replace", crash_on_final_rename)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tiny(seed=2), tmp_path / "ck", task=TASK)
    monkeypatch.undo()
    assert not any(".tmp-" in p.name for p in tmp_path.iterdir())  # the temp folder was cleaned up
    # the kill fell between moving the old folder aside and moving the new one in: loading recovers the old
    loaded, _ = C._load_checkpoint(tmp_path / "ck")
    assert (tmp_path / "ck" / "model.safetensors").read_bytes() == before
    assert torch.equal(bits(loaded.W_E), bits(old.W_E))


def test_partial_temporary_folder_is_never_a_checkpoint(tmp_path):
    """Simulate a SIGKILL mid-write: a hidden temp folder with some files but no config.json."""
    model = tiny()
    commit_run_checkpoint(tmp_path, 5, model=model, task=TASK)
    tmp = tmp_path / ".step-00000010.tmp-deadbeef"
    tmp.mkdir()
    save_file({"W_E": torch.zeros(3)}, str(tmp / "model.safetensors"))
    _, info = C._load_checkpoint(tmp_path)
    assert info.step == 5  # LATEST still names the complete one
    with pytest.raises(CheckpointError, match="incomplete"):
        C._load_checkpoint(tmp)
    assert tmp in C.clean_temporary(tmp_path) and not tmp.exists()


def test_save_refuses_to_replace_a_folder_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(OutputDirError, match="not a checkpoint"):
        save_checkpoint(tiny(), tmp_path / "notes", task=TASK)
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine"


# ----------------------------------------------------------------------------- errors


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        C._load_checkpoint(tmp_path / "nope")


def test_folder_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(CheckpointNotFoundError, match="not a checkpoint"):
        C._load_checkpoint(tmp_path)


def test_missing_weights(ckpt):
    _, path = ckpt
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="lacks model.safetensors"):
        C._load_checkpoint(path)


def test_truncated_weights(ckpt):
    _, path = ckpt
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        C._load_checkpoint(path)
    # without the manifest check, safetensors' own header check still catches it
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        C._load_checkpoint(path, verify=False)


def test_flipped_byte_in_weights_is_detected(ckpt):
    _, path = ckpt
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-100] ^= 0xFF  # inside the tensor data: safetensors alone would load this silently
    (path / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted"):
        C._load_checkpoint(path)


def test_config_and_weights_disagree_names_the_keys(tmp_path):
    save_checkpoint(tiny("qkv"), tmp_path / "ck", task=TASK)
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    cfg["model"]["attn_norm"] = "pre"  # qkv weights, pre config
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        C._load_checkpoint(tmp_path / "ck")
    msg = str(e.value)
    assert "missing weights: blocks.0.ln1.w" in msg and "unexpected weights: blocks.0.attn.k_norm.w" in msg


def test_shape_mismatch_names_the_tensor(tmp_path):
    save_checkpoint(tiny(), tmp_path / "ck", task=TASK)
    f = tmp_path / "ck" / "model.safetensors"
    state = load_file(str(f))
    state["W_E"] = torch.zeros(17, 7)
    save_file(state, str(f))
    rewrite_manifest(tmp_path / "ck", "model.safetensors")
    with pytest.raises(CheckpointError, match=r"shape mismatch.*W_E \(17, 7\) vs \(17, 32\)"):
        C._load_checkpoint(tmp_path / "ck")


@pytest.mark.parametrize("version", [2, None, "1"])
def test_unknown_format_version(ckpt, version):
    _, path = ckpt
    cfg = json.loads((path / "config.json").read_text())
    cfg["format_version"] = version
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="format_version"):
        C._load_checkpoint(path)


def test_corrupted_config_json(ckpt):
    _, path = ckpt
    (path / "config.json").write_text('{"format_version": 1, "model": {')
    with pytest.raises(CheckpointError, match="not valid JSON"):
        C._load_checkpoint(path)


def test_unknown_model_field_in_config(ckpt):
    _, path = ckpt
    cfg = json.loads((path / "config.json").read_text())
    cfg["model"]["d_bogus"] = 3
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="d_bogus"):
        C._load_checkpoint(path)


_SIDE_EFFECTS: list[str] = []


def _mark() -> str:
    _SIDE_EFFECTS.append("unpickled")
    return "pwned"


class Evil:
    def __reduce__(self):
        return (_mark, ())


def test_train_state_with_custom_object_is_refused_without_running_it(ckpt):
    _, path = ckpt
    torch.save({"step": 1, "payload": Evil()}, path / "train_state.pt")
    rewrite_manifest(path, "train_state.pt")  # a forged checkpoint passes the hash check
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        load_train_state(path)
    assert _SIDE_EFFECTS == []


def test_truncated_train_state(ckpt):
    _, path = ckpt
    data = (path / "train_state.pt").read_bytes()
    (path / "train_state.pt").write_bytes(data[:50])
    with pytest.raises(CheckpointError, match="truncated"):
        load_train_state(path)
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        load_train_state(path, verify=False)


def test_errors_are_interp_norm_errors():
    assert issubclass(CheckpointNotFoundError, CheckpointError)
    assert issubclass(CheckpointError, InterpNormError)


# ----------------------------------------------------------------------------- pretrained


def test_pretrained_lookup_and_listing(tmp_path, monkeypatch):
    monkeypatch.setenv("INTERP_NORM_DATA", str(tmp_path))
    with pytest.raises(CheckpointNotFoundError, match="available: none"):
        load_with_info("pre", kind="interp_norm")
    assert list_pretrained().empty
    root = tmp_path / "checkpoints"
    metrics = {"evaluation": [{"split": "id", "per_token_acc": 0.9}, {"split": "extrap", "per_token_acc": 0.4}]}
    save_checkpoint(tiny("pre", seed=1), root / "pre", task=TASK, metrics=metrics)
    commit_run_checkpoint(root / "qkv", 7, model=tiny("qkv"), task=TASK)  # a run folder works too
    (root / ".pre.tmp-123").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="available: pre, qkv"):
        load_with_info("qk", kind="interp_norm")
    with pytest.raises(CheckpointNotFoundError):
        load_with_info("../checkpoints/pre", kind="interp_norm")
    model, info = load_with_info("qkv", kind="interp_norm")
    assert model.cfg.attn_norm == "qkv" and info.step == 7
    df = list_pretrained()
    assert df["name"].tolist() == ["pre", "qkv"]
    row = df.set_index("name").loc["pre"]
    assert (row.attn_norm, row.seed, row.id_acc, row.extrap_acc) == ("pre", 1, 0.9, 0.4)
    assert pd.isna(df.set_index("name").loc["qkv", "id_acc"])


def test_default_data_dir_is_the_repository_data_folder(monkeypatch):
    monkeypatch.delenv("INTERP_NORM_DATA", raising=False)
    assert C.data_dir() == C.Path(C.__file__).resolve().parents[2] / "data"  # the repository root, above interp_norm/training/


def test_reproduce_defaults_to_the_reference_set(tmp_path, monkeypatch):
    """A shipped checkpoint of another set (metrics ``set``, e.g. longer training) is listed and
    loads by name, but `reproduce` without --checkpoints leaves it out: its tables group seeds by
    variant, which would mix training recipes."""
    from interp_norm.report.reproduce import _load_models

    monkeypatch.setenv("INTERP_NORM_DATA", str(tmp_path))
    root = tmp_path / "checkpoints"
    save_checkpoint(tiny("pre", seed=0), root / "pre", task=TASK, metrics={"evaluation": []})
    save_checkpoint(tiny("pre", seed=0), root / "pre-long", task=TASK, metrics={"evaluation": [], "set": "30k steps"})
    df = list_pretrained().set_index("name")
    assert df.loc["pre", "set"] == "reference" and df.loc["pre-long", "set"] == "30k steps"
    assert list(_load_models()) == ["pre"]
    assert list(_load_models(["pre-long"])) == ["pre-long"]
    assert load_with_info("pre-long", kind="interp_norm")[0].cfg.attn_norm == "pre"
