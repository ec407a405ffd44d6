"""A model and a data hook for the fault tests of `meshplan run` (imported by the torchrun workers
through PYTHONPATH). ``FAULT_CASE=kind:rank:step[:seconds]`` makes one rank misbehave inside the
forward of one step, on the first torchrun attempt only (a restart runs clean):

- ``hang:1:3`` rank 1 sleeps (a stuck kernel or collective) in step 3's forward;
- ``oom:1:3`` rank 1 raises the CUDA allocator's error there (``host-oom``: the host's MemoryError);
- ``error:1:2`` rank 1 fails with an error meshplan has no explanation for (a CUDA/NCCL error);
- ``slow:1:0:0.03`` rank 1 sleeps 30 ms in every forward (a slow node): losses are unchanged.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

CURRENT = {"step": 0}


def batches(step: int, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic float batches; remembers the step for the model's forward."""
    CURRENT["step"] = step
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch, 32, generator=g), torch.randn(batch, 32, generator=g)


class Faulty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _misbehave()
        return self.fc2(torch.relu(self.fc1(x)))


def _misbehave() -> None:
    case = os.environ.get("FAULT_CASE", "")
    if not case or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or CURRENT["step"] == 0:
        return
    kind, rank, step, *rest = case.split(":")
    if os.environ.get("RANK") != rank or (step != "0" and int(step) != CURRENT["step"]):
        return
    if kind == "hang":
        time.sleep(600)
    elif kind == "oom":
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity "
                                     "of 79.11 GiB of which 3.06 MiB is free.")
    elif kind == "host-oom":
        raise MemoryError()
    elif kind == "error":
        raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
    elif kind == "slow":
        time.sleep(float(rest[0]))


def model() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return Faulty(), (torch.randn(4, 32),)
