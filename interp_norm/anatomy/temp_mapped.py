"""Large tensors converted at load, backed by a nameless temporary file instead of anonymous memory.

A folder stored in the dtype a run asks for is memory-mapped: an analysis that reads a few rows of the
151 936-row embedding (collapse, geometry) brings only those pages into the process. A tensor
converted at load (``safetensors_read``) used to be an ordinary tensor, all of it resident. Here a
tensor of at least :data:`SPILL_BYTES` converted bytes is written block by block (plain writes: the
kernel's page cache holds the file, outside the process) into a temporary file that has no name
(``tempfile.TemporaryFile``: on Linux ``O_TMPFILE`` or unlinked at once), then mapped copy-on-write
(``numpy.memmap(mode="c")`` shared with torch): pages are read from the file when touched, as for a
stored folder, and a write to the tensor never reaches the file. The file is freed when the tensor
is, at the latest when the process ends, even if it is killed.

Where it goes: ``tempfile.gettempdir()``, i.e. ``TMPDIR`` (then ``TEMP``, ``TMP``, ``/tmp``). The
conversion stays in memory, with a :class:`~interp_norm.errors.ConvertedInMemoryWarning` that says
why, when that folder has less free space than the mapped tensors plus :data:`SPARE_BYTES`, or lives
in memory itself (tmpfs, ramfs: the file's pages would take the same RAM; read from ``/proc/mounts``
where there is one).

Every tensor that large is mapped, not only the embedding: a weight read whole on every forward
pass then costs a disk write at load and is resident once read, as a stored folder's would be.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import torch

from interp_norm.anatomy._common import outside_stacklevel
from interp_norm.errors import ConvertedInMemoryWarning

#: Converted tensors at least this large are mapped from a temporary file (the embedding of a
#: 50 000-token vocabulary at d_model 768 in bfloat16 is 77 MB; a Qwen3-0.6B layer's largest weight 6 MB).
SPILL_BYTES = 2**26
#: Free space left on the temporary folder's disk after the mapped tensors are written.
SPARE_BYTES = 2**28
_RAM_FILESYSTEMS = ("tmpfs", "ramfs")


def spilled(nbytes: int) -> bool:
    """Whether a converted tensor of ``nbytes`` is large enough to be mapped from a temporary file."""
    return nbytes >= SPILL_BYTES


def spill_dir(needed: int) -> Optional[Path]:
    """The temporary folder to map ``needed`` bytes of converted tensors from, or None (after a
    :class:`ConvertedInMemoryWarning` naming the reason and the fix) when they must stay in memory."""
    if needed <= 0:
        return None
    directory = Path(tempfile.gettempdir())
    reason = _refusal(directory, needed)
    if reason is None:
        return directory
    warnings.warn(ConvertedInMemoryWarning(
        f"the {needed / 1e9:.2f} GB of large tensors converted at load stay in memory (the whole of each is "
        f"resident) instead of being mapped from a temporary file: {reason}; set TMPDIR to a folder on a disk "
        "with room, or store the folder in the dtype you load it in"), stacklevel=outside_stacklevel())
    return None


def _refusal(directory: Path, needed: int) -> Optional[str]:
    """Why ``needed`` bytes cannot be mapped from a file in ``directory`` (None: they can)."""
    fs = _filesystem(directory)
    if fs in _RAM_FILESYSTEMS:
        return f"{str(directory)!r} is on {fs}, which keeps files in memory"
    free = shutil.disk_usage(directory).free
    if free < needed + SPARE_BYTES:
        return (f"{str(directory)!r} has {free / 1e9:.2f} GB free, and {(needed + SPARE_BYTES) / 1e9:.2f} GB "
                f"are needed ({SPARE_BYTES / 2**20:.0f} MiB left spare)")
    return None


def _filesystem(directory: Path) -> Optional[str]:
    """The filesystem type of the mount holding ``directory`` (the longest mount point above it in
    ``/proc/mounts``), or None where there is no ``/proc/mounts``."""
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(directory)
    best, kind = "", None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, fields[2]
    return kind


def mapped_from_blocks(blocks: Iterable[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype,
                       directory: Path) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` whose values are ``blocks`` (contiguous 1-D tensors of
    ``dtype``, in order) written to a nameless file in ``directory`` and mapped copy-on-write."""
    nbytes = 0
    with tempfile.TemporaryFile(dir=directory, prefix="interp_norm-converted-") as f:
        for block in blocks:
            f.write(block.view(torch.uint8).numpy().data)
            nbytes += block.numel() * block.element_size()
        f.flush()
        raw = np.memmap(f, dtype=np.uint8, mode="c", shape=(nbytes,))  # keeps its own handle on the file
    return torch.from_numpy(raw).view(dtype).view(shape)


__all__ = ["SPARE_BYTES", "SPILL_BYTES", "mapped_from_blocks", "spill_dir", "spilled"]
