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
from interp_norm.errors import CheckpointError


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
