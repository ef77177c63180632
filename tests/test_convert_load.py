"""Loading a folder in another dtype than it stores reads it block by block (never holding the stored
copy) and gives exactly the weights of converting each stored tensor: checked against safetensors'
own reader followed by ``Tensor.to`` (round to nearest even), tensor by tensor, for float32 ->
bfloat16 / float16 and bfloat16 -> float32, on several architectures (tied and untied embeddings); a
truncated file is a typed error. Peak memory is measured by ``benchmarks/bench_memory.py``."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file

from interp_norm.anatomy import bridge_from_hf, load, random_tokens, tiny_hf_model
from interp_norm.anatomy.safetensors_read import read_converted, stored_float_dtypes
from interp_norm.errors import CheckpointError, ConvertedInMemoryWarning


def _stored(folder) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen3"])
@pytest.mark.parametrize("stored, asked", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                           (torch.bfloat16, torch.float32)])
def test_converted_read_equals_converting_each_stored_tensor(tmp_path, monkeypatch, arch, stored, asked):
    import interp_norm.anatomy.safetensors_read as sr

    monkeypatch.setattr(sr, "BLOCK_BYTES", 4096)  # many blocks per tensor, a partial last one
    hf = tiny_hf_model(arch, seed=1).to(stored)
    hf.save_pretrained(tmp_path / arch)
    ref = _stored(tmp_path / arch)
    assert stored_float_dtypes(tmp_path / arch) == {stored}
    got = read_converted(tmp_path / arch, asked)
    assert got is not None and set(got) == set(ref)
    for name, t in ref.items():
        assert got[name].dtype == asked and torch.equal(got[name], t.to(asked)), name
    bridge = load(tmp_path / arch, dtype=asked)
    params = dict(bridge.original_model.named_parameters())
    for name, t in ref.items():  # the loaded model holds exactly these (a name may be the tied embedding's)
        if name in params:
            assert torch.equal(params[name].detach(), t.to(asked)), name
    # the usual load (from_pretrained converting as it reads the mapped file): same weights, buffers, logits
    usual = bridge_from_hf(type(hf).from_pretrained(tmp_path / arch, dtype=asked, attn_implementation="eager").eval())
    ours, theirs = bridge.original_model, usual.original_model
    assert list(ours.state_dict()) == list(theirs.state_dict())
    for (n1, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), n1
    for (n1, a), (n2, b) in zip(ours.named_buffers(), theirs.named_buffers()):
        assert n1 == n2 and torch.equal(a, b), n1  # e.g. rotary inv_freq, built at init
    tokens = random_tokens(128, 2, 7, seed=3)
    with torch.no_grad():
        assert torch.equal(bridge(tokens), usual(tokens))


def test_same_dtype_keeps_the_usual_load_and_a_truncated_file_is_a_typed_error(tmp_path):
    hf = tiny_hf_model("qwen3", seed=1)
    hf.save_pretrained(tmp_path / "m")
    assert stored_float_dtypes(tmp_path / "m") == {torch.float32}
    assert not stored_float_dtypes(tmp_path / "m") - {torch.float32}  # float32 asked: nothing to convert
    f = next((tmp_path / "m").glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        read_converted(tmp_path / "m", torch.bfloat16)


def _file_mappings() -> list[tuple[int, int, str]]:
    """(start, end, path) of this process's file-backed mappings, from /proc/self/maps."""
    out = []
    for line in open("/proc/self/maps"):
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out.append((start, end, fields[5].strip()))
    return out


def _mapped_from(t: torch.Tensor, directory) -> bool:
    """Whether ``t``'s data lies in a mapping of a deleted file of ``directory`` (the kernel's own record)."""
    return any(a <= t.data_ptr() < b and p.startswith(f"{directory}/") and p.endswith("(deleted)")
               for a, b, p in _file_mappings())


def _files(folder) -> list:
    """The files in ``folder`` (torch may put its own cache folders beside them)."""
    return [p for p in folder.iterdir() if not p.is_dir()]


@pytest.fixture
def spill(tmp_path, monkeypatch):
    """A fresh temporary folder (as TMPDIR would set), and a spill threshold the tiny models' largest
    tensors reach in bfloat16 (64 x 128 x 2 bytes) and their norm gains do not."""
    import tempfile

    import interp_norm.anatomy.temp_mapped as tm

    folder = tmp_path / "tmpdir"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    monkeypatch.setattr(tm, "SPILL_BYTES", 64 * 128 * 2)
    return folder


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc to see mappings")
@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_large_converted_tensors_are_mapped_from_a_temp_file_that_is_gone(tmp_path, spill, monkeypatch, arch):
    import warnings

    import interp_norm.anatomy.build as build

    seen: dict = {}  # the Hugging Face model's tensors by stored name, before the bridge wraps its modules
    real = build.bridge_from_hf
    monkeypatch.setattr(build, "bridge_from_hf", lambda m, **kw: seen.update(m.state_dict(keep_vars=True)) or real(m, **kw))
    hf = tiny_hf_model(arch, seed=2)
    hf.save_pretrained(tmp_path / arch)
    ref = _stored(tmp_path / arch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvertedInMemoryWarning)
        bridge = load(tmp_path / arch, dtype=torch.bfloat16)
    assert _files(spill) == []  # the file never had a name there (or lost it at once)
    big = [n for n, t in ref.items() if t.numel() * 2 >= 64 * 128 * 2]
    assert big and len(big) < len(ref)
    for name, t in ref.items():
        got = seen[name].detach()
        assert got.dtype == torch.bfloat16 and torch.equal(got, t.to(torch.bfloat16)), name
        # from_pretrained kept the mapped tensor (no copy into anonymous memory), and only the large ones
        assert _mapped_from(got, spill) == (name in big), name
    held = {p.data_ptr() for p in bridge.parameters()}
    assert {seen[n].data_ptr() for n in big} <= held  # the bridge holds those same tensors
    if hf.config.tie_word_embeddings:  # the output embedding is the mapped input embedding
        emb = next(n for n, w in hf.named_parameters() if w is hf.get_input_embeddings().weight)
        head = next(n for n in seen if n not in ref)
        assert emb in big and seen[head].data_ptr() == seen[emb].data_ptr() and _mapped_from(seen[head], spill)
    usual = type(hf).from_pretrained(tmp_path / arch, dtype=torch.bfloat16, attn_implementation="eager").eval()
    tokens = random_tokens(128, 2, 7, seed=4)
    with torch.no_grad():
        assert torch.equal(bridge(tokens), bridge_from_hf(usual)(tokens))


def test_too_little_disk_or_a_ram_folder_keeps_the_conversion_in_memory(tmp_path, spill, monkeypatch, capsys):
    import shutil
    import subprocess

    hf = tiny_hf_model("qwen3", seed=2)
    hf.save_pretrained(tmp_path / "m")
    ref = _stored(tmp_path / "m")
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=0))
    with pytest.warns(ConvertedInMemoryWarning, match=r"has 0\.00 GB free.*set TMPDIR"):
        got = read_converted(tmp_path / "m", torch.bfloat16)
    assert got is not None and set(got) == set(ref)
    for name, t in ref.items():
        assert torch.equal(got[name], t.to(torch.bfloat16)) and not _mapped_from(got[name], spill), name
    from _models import run_cli

    code, _, err = run_cli(capsys, "geometry", tmp_path / "m", "--dtype", "bfloat16", "--windows", "1", "--n-ctx", "5",
                           "--no-progress", "--out", tmp_path / "out")
    assert code == 0, err  # the command runs, and says once, in its own words, why the load held more
    assert err.count("interp-norm geometry: warning: the 0.00 GB of large tensors converted at load stay in memory") == 1, err
    monkeypatch.setattr(shutil, "disk_usage", real)
    shm = "/dev/shm"
    kind = subprocess.run(["stat", "-f", "-c", "%T", shm], capture_output=True, text=True).stdout.strip()
    if kind == "tmpfs" and os.access(shm, os.W_OK):
        import tempfile

        monkeypatch.setattr(tempfile, "tempdir", shm)
        with pytest.warns(ConvertedInMemoryWarning, match="on tmpfs, which keeps files in memory"):
            got = read_converted(tmp_path / "m", torch.bfloat16)
        assert all(torch.equal(got[n], t.to(torch.bfloat16)) for n, t in ref.items())


@pytest.mark.parametrize("command", ["collapse", "geometry"])
def test_converted_run_writes_the_tables_of_the_folder_stored_in_bfloat16(tmp_path, spill, capsys, command):
    from _models import run_cli

    tiny_hf_model("qwen3", seed=5).save_pretrained(tmp_path / "f32")
    tiny_hf_model("qwen3", seed=5).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    tables = {}
    for stored in ("f32", "bf16"):
        out = tmp_path / f"out-{stored}"
        code, _, err = run_cli(capsys, command, tmp_path / stored, "--dtype", "bfloat16", "--windows", "3", "--n-ctx", "9",
                               "--no-progress", "--out", out, *(["--levels", "0.1"] if command == "collapse" else []))
        assert code == 0, err
        tables[stored] = {p.name: p.read_bytes() for p in sorted(out.glob("*.csv"))}
    assert tables["f32"] and tables["f32"].keys() == tables["bf16"].keys()
    for name, data in tables["f32"].items():
        if data != tables["bf16"][name]:
            _assert_same_table(name, data, tables["bf16"][name])
    assert _files(spill) == []


def _assert_same_table(name: str, got: bytes, want: bytes) -> None:
    """Two CSVs of the same computation on bit-equal weights: text columns equal, numbers equal to
    float64 rounding. Byte equality is not what the arithmetic promises: the float64 post-processing
    (``torch.linalg.eigh`` of the ellipsoids, MKL's LAPACK) may take other code paths for other
    memory alignments, moving the last bits (seen once: one semi-axis, one digit). Any difference in
    the bfloat16 forward would move values by a bfloat16 rounding step (~4e-3 relative), far above
    the 1e-12 here (N * eps64 = 2.8e-14 for N <= 128, a 32x margin)."""
    import io

    import numpy as np
    import pandas as pd

    a, b = pd.read_csv(io.BytesIO(got)), pd.read_csv(io.BytesIO(want))
    assert list(a.columns) == list(b.columns) and a.shape == b.shape, name
    for col in a.columns:
        if pd.api.types.is_float_dtype(a[col]) and pd.api.types.is_float_dtype(b[col]):
            assert np.allclose(a[col], b[col], rtol=1e-12, atol=0.0, equal_nan=True), (name, col)
        else:
            assert a[col].tolist() == b[col].tolist(), (name, col)
