"""Reading a safetensors folder converted to another dtype without holding the stored copy.

``from_pretrained(folder, dtype=bfloat16)`` on a float32 folder memory-maps each file for the whole
load and converts tensor by tensor: every float32 page it has read stays mapped into the process
until the end, so the load peaks at the float32 file plus the bfloat16 copy (1.66x the float32 file
on a Qwen3-0.6B shape, 3.3x the bfloat16 weights). Here each tensor is read with plain file reads,
a block of rows at a time, into its converted tensor: the process holds the converted weights and
one block (the page cache holds the file, outside the process). The largest tensors (the embedding)
are converted into a nameless temporary file and mapped instead (:mod:`interp_norm.anatomy.temp_mapped`),
so that, as for a folder stored in the asked dtype, only the pages an analysis reads are resident.
The result goes to ``from_pretrained(state_dict=...)``, which keeps tensors already in the asked dtype
as they are (their storage: mapped ones stay mapped).

The format (https://huggingface.co/docs/safetensors): 8 bytes little-endian header length, a JSON
header ``{name: {dtype, shape, data_offsets: [begin, end]}}`` (offsets from the end of the header).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Iterator, Optional

import torch

from interp_norm.anatomy.temp_mapped import mapped_from_blocks, spill_dir, spilled
from interp_norm.errors import CheckpointError

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
#: Bytes read per block: the only stored-dtype memory the process holds at once.
BLOCK_BYTES = 2**25


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's weight files: those its ``model.safetensors.index.json`` names, else every
    ``*.safetensors`` file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    return sorted(folder.glob("*.safetensors"))


def _header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def stored_float_dtypes(folder: Path) -> set[torch.dtype]:
    """The floating dtypes the folder's tensors are stored in (empty if it holds no safetensors)."""
    out = set()
    for path in safetensors_files(folder):
        for info in _header(path)[0].values():
            dt = _DTYPES.get(info["dtype"])
            if dt is not None and dt.is_floating_point:
                out.add(dt)
    return out


def read_converted(folder: Path, dtype: torch.dtype) -> Optional[dict[str, torch.Tensor]]:
    """Every tensor of the folder's safetensors files, floating ones converted to ``dtype`` as they
    are read (the others as stored); None if the folder holds none or a dtype this reader does not
    know (the caller then loads the usual way). Tensors of at least ``temp_mapped.SPILL_BYTES`` are
    mapped from a nameless temporary file (see :mod:`interp_norm.anatomy.temp_mapped`) when its
    folder has room, so that only their pages an analysis reads become resident."""
    files = safetensors_files(folder)
    if not files:
        return None
    headers = [(path, *_header(path)) for path in files]
    if any(info["dtype"] not in _DTYPES for _, header, _ in headers for info in header.values()):
        return None
    sizes = {(path, name): _converted_bytes(info, dtype) for path, header, _ in headers for name, info in header.items()}
    big = {key for key, nbytes in sizes.items() if spilled(nbytes)}
    directory = spill_dir(sum(sizes[key] for key in big))  # None: they stay in memory (it warned why)
    out: dict[str, torch.Tensor] = {}
    for path, header, start in headers:
        with open(path, "rb") as f:
            for name, info in header.items():
                into = directory if (path, name) in big else None
                out[name] = _read_tensor(f, path, start, info, dtype, into)
    return out


def _converted_bytes(info: dict, dtype: torch.dtype) -> int:
    src = _DTYPES[info["dtype"]]
    held = dtype if src.is_floating_point else src
    return math.prod(info["shape"]) * torch.empty((), dtype=held).element_size()


def _read_tensor(f, path: Path, start: int, info: dict, dtype: torch.dtype, spill: Optional[Path]) -> torch.Tensor:
    """The tensor ``info`` describes, converted; mapped from a temporary file in ``spill`` if given."""
    src = _DTYPES[info["dtype"]]
    shape = tuple(info["shape"])
    begin, end = info["data_offsets"]
    item = torch.empty((), dtype=src).element_size()
    if end - begin != math.prod(shape) * item:
        raise CheckpointError(f"{str(path)!r}: tensor of shape {shape} {info['dtype']} holds {end - begin} bytes; "
                              "the file is truncated or corrupted -- save the model again")
    held = dtype if src.is_floating_point else src
    f.seek(start + begin)
    blocks = _stored_blocks(f, path, src, math.prod(shape))
    if spill is not None:
        return mapped_from_blocks(_converting(blocks, held), shape, held, spill)
    out = torch.empty(shape, dtype=held)
    flat, i = out.view(-1), 0
    for block in blocks:
        flat[i : i + block.numel()].copy_(block)
        i += block.numel()
    return out


def _stored_blocks(f, path: Path, src: torch.dtype, n: int) -> Iterator[torch.Tensor]:
    """The next ``n`` stored elements of ``f``, read a block at a time into one reused buffer (each block
    is valid until the next is read)."""
    item = torch.empty((), dtype=src).element_size()
    per = max(1, BLOCK_BYTES // item)  # elements per block
    buf = bytearray(min(per, max(1, n)) * item)
    for i in range(0, n, per):
        k = min(per, n - i)
        view = memoryview(buf)[: k * item]
        if f.readinto(view) != k * item:
            raise CheckpointError(f"{str(path)!r} ends inside a tensor; the file is truncated -- save the model again")
        yield torch.frombuffer(view, dtype=src, count=k)


def _converting(blocks: Iterator[torch.Tensor], dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """``blocks`` converted to ``dtype`` in one reused buffer (each valid until the next is made)."""
    buf: Optional[torch.Tensor] = None
    for block in blocks:
        if buf is None:
            buf = torch.empty(block.numel(), dtype=dtype)
        yield buf[: block.numel()].copy_(block)


__all__ = ["BLOCK_BYTES", "read_converted", "safetensors_files", "stored_float_dtypes"]
