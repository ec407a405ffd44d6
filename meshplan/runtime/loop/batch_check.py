"""Checks on what a user's data hook returns, every step, before the batch reaches the model.

The hook contract (``train.py``): ``fn(step, batch_size, seq_len) -> (inputs, targets)``, the
GLOBAL batch, the same tensors on every rank (each rank keeps its data-parallel slice). A hook that
returns the wrong batch size, another sequence length, a shape or dtype that changes between
steps, or different data on different ranks would train on something else than planned (or
deadlock in a collective); ``check_batch`` raises ``ValueError`` naming the step instead. The
cross-rank comparison is one ``all_gather_object`` of shapes, dtypes and a CRC32 of the bytes.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist

from meshplan.runtime.launch import collectives


def _signature(t: torch.Tensor) -> tuple[tuple[int, ...], str, int]:
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return tuple(t.shape), str(t.dtype).removeprefix("torch."), zlib.crc32(raw.tobytes())


def check_batch(step: int, batch: Any, *, global_batch: int, seq_len: int, first: Any = None,
                across_ranks: bool = True) -> tuple:
    """Validate one hook batch; returns its (shape, dtype) signature to pass as ``first`` next step."""
    where = f"--data hook, step {step}"
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch)):
        raise ValueError(f"{where}: must return (inputs, targets) as two tensors, got {type(batch).__name__}")
    x, y = batch
    for name, t in (("inputs", x), ("targets", y)):
        if t.dim() == 0 or t.shape[0] != global_batch:
            raise ValueError(f"{where}: {name} have batch dimension {tuple(t.shape)[:1]}, the plan's "
                             f"global batch is {global_batch} (return the GLOBAL batch on every rank)")
    if seq_len and x.dim() > 1 and not x.dtype.is_floating_point and x.shape[1] != seq_len:
        raise ValueError(f"{where}: inputs have sequence length {x.shape[1]}, the plan's seq_len is {seq_len}")
    sig = tuple((tuple(t.shape), t.dtype) for t in (x, y))
    if first is not None and sig != first:
        raise ValueError(f"{where}: (shape, dtype) of (inputs, targets) changed from {first} to {sig}")
    if across_ranks and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        mine = (_signature(x), _signature(y))
        every = collectives.all_gather_object(mine)
        differ = [r for r, s in enumerate(every) if s != every[0]]
        if differ:
            raise ValueError(f"{where}: rank {differ[0]} got a different batch than rank 0 (shape, dtype or "
                             "values); the hook must return the same global batch on every rank")
    return sig
