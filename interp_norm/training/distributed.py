"""Data-parallel training under ``torchrun``: PyTorch's own DistributedDataParallel, nothing home-made.

:func:`interp_norm.training.train.train` calls :func:`setup`; when the process was started by ``torchrun``
(``WORLD_SIZE`` > 1 in the environment) it joins the process group (gloo on CPU, NCCL on CUDA; rank
``r`` runs on ``cuda:LOCAL_RANK``) and the training loop changes in three places only:

* every rank draws the step's whole global batch (a pure function of seed and step, see
  :func:`interp_norm.training.train.batch_for_step`) and trains on its contiguous share of the rows
  (:meth:`Dist.shard`; the batch size must divide by the number of processes);
* the loss of a rank is the *sum* of its answer-token losses divided by the global batch's count of
  answer tokens, times the world size, so DDP's gradient average is exactly the gradient of the
  global batch's mean loss: the weights equal a 1-process run with the same global batch up to float
  summation order (``tests/test_train_ddp.py``: 1e-6 after 20 steps);
* rank 0 alone evaluates, writes checkpoints and curves; the logged loss and accuracy are summed
  over ranks (:meth:`Dist.all_sum`). Resuming loads the same checkpoint on every rank.

N GPUs on one machine::

    torchrun --nproc-per-node N -m interp_norm.cli train --preset paper --device cuda --out runs/paper-pre
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from interp_norm.training.devices import resolve_device
from interp_norm.errors import ConfigError


@dataclass
class Dist:
    """This process's place in the run: ``world`` processes, this one ``rank`` (``local_rank`` on its machine)."""

    world: int = 1
    rank: int = 0
    local_rank: int = 0
    owned: bool = False  # this module initialised the process group (and destroys it in close())

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def shard(self, *tensors: Tensor) -> list[Tensor]:
        """This rank's contiguous share of the rows of each global-batch tensor."""
        n = tensors[0].shape[0]
        if n % self.world:
            raise ConfigError(f"batch_size {n} does not divide by the {self.world} training processes; use a multiple "
                              f"of {self.world} (it is the global batch, split over the processes)")
        size = n // self.world
        return [t[self.rank * size:(self.rank + 1) * size] for t in tensors]

    def all_sum(self, values: Sequence[float], device: Any) -> list[float]:
        """``values`` summed over every rank (float64); the values themselves with one process."""
        if not self.active:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t)
        return t.tolist()

    def barrier(self) -> None:
        if self.active:
            torch.distributed.barrier()

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """``DistributedDataParallel(model)`` (the model itself with one process)."""
        if not self.active:
            return model
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    def close(self) -> None:
        if self.owned and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
            self.owned = False


def setup(device: str) -> tuple[Dist, torch.device]:
    """(this process's :class:`Dist`, the device it trains on) for ``device`` (cpu, cuda, cuda:1 ...).

    Without ``torchrun`` (no ``WORLD_SIZE`` > 1 and no process group) this is one process on
    ``device``. Under ``torchrun`` a ``cuda`` device becomes ``cuda:LOCAL_RANK``.
    """
    dev = resolve_device(device)
    initialised = torch.distributed.is_available() and torch.distributed.is_initialized()
    world = torch.distributed.get_world_size() if initialised else int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return Dist(), dev
    if not torch.distributed.is_available():
        raise ConfigError("WORLD_SIZE > 1 but this torch build has no torch.distributed; run without torchrun")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if dev.type == "cuda":
        if local >= torch.cuda.device_count():
            raise ConfigError(f"torchrun started {world} processes but this machine has {torch.cuda.device_count()} "
                              "CUDA device(s); use --nproc-per-node at most that many")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    elif dev.type != "cpu":
        raise ConfigError(f"distributed training runs on cpu (gloo) or cuda (NCCL), not {dev.type}")
    owned = False
    if not initialised:
        torch.distributed.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
        owned = True
    return Dist(world, torch.distributed.get_rank(), local, owned), dev


def answer_token_count(targets: Tensor) -> int:
    """How many positions of a batch's next-token targets are scored (not ``ignore_index`` -100)."""
    return int((targets != -100).sum())


__all__ = ["Dist", "setup", "answer_token_count"]
