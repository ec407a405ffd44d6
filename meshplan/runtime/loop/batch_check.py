"""Checks on what a user's data hook returns, every step, before the batch reaches the model.

The hook contract (``train.py``): ``fn(step, batch_size, seq_len) -> (inputs, targets)``, the
GLOBAL batch, the same tensors on every rank (each rank keeps its data-parallel slice). ``inputs``
is a tensor, a tuple of tensors or a dict of tensors (keyword inputs, as the model's example);
a hook may also return one dict whose ``labels`` entry is the targets (the HF convention):
``hook_batch`` splits it into ``(inputs, targets)``. Every entry has the global batch first. A hook that
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


def hook_batch(batch: Any) -> tuple[Any, torch.Tensor]:
    """A hook's return as ``(inputs, targets)``: a pair as given, or a dict with ``labels`` split off."""
    if isinstance(batch, dict) and "labels" in batch:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return (inputs if len(inputs) != 1 else next(iter(inputs.values()))), batch["labels"]
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    return batch, None  # type: ignore[return-value]  # refused by check_batch with the contract


def _entries(inputs: Any) -> list[tuple[str, Any]] | None:
    """The named input tensors (``inputs``, ``inputs[0]``, ``inputs['ids']``); None if not all tensors."""
    if isinstance(inputs, torch.Tensor):
        items = [("inputs", inputs)]
    elif isinstance(inputs, (tuple, list)) and inputs:
        items = [(f"inputs[{i}]", t) for i, t in enumerate(inputs)]
    elif isinstance(inputs, dict) and inputs:
        items = [(f"inputs[{k!r}]", t) for k, t in inputs.items()]
    else:
        return None
    return items if all(isinstance(t, torch.Tensor) for _, t in items) else None


def check_batch(step: int, batch: Any, *, global_batch: int, seq_len: int, first: Any = None,
                across_ranks: bool = True) -> tuple:
    """Validate one hook batch (as ``hook_batch`` returns it); returns its (shape, dtype) signature to
    pass as ``first`` next step."""
    where = f"--data hook, step {step}"
    entries = None
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[1], torch.Tensor):
        entries = _entries(batch[0])
    if entries is None:
        raise ValueError(f"{where}: must return (inputs, targets) with inputs a tensor, a tuple or a dict of tensors "
                         "and targets a tensor, or one dict of tensors with 'labels'; "
                         f"got {type(batch).__name__}")
    every = [*entries, ("targets", batch[1])]
    for name, t in every:
        if t.dim() == 0 or t.shape[0] != global_batch:
            raise ValueError(f"{where}: {name} have batch dimension {tuple(t.shape)[:1]}, the plan's "
                             f"global batch is {global_batch} (return the GLOBAL batch on every rank)")
    x = entries[0][1]
    if seq_len and x.dim() > 1 and not x.dtype.is_floating_point and x.shape[1] != seq_len:
        raise ValueError(f"{where}: {entries[0][0]} have sequence length {x.shape[1]}, the plan's seq_len is {seq_len}")
    sig = tuple((name, tuple(t.shape), t.dtype) for name, t in every)
    if first is not None and sig != first:
        raise ValueError(f"{where}: (name, shape, dtype) of the batch changed from {first} to {sig}")
    if across_ranks and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        mine = tuple(_signature(t) for _, t in every)
        gathered = collectives.all_gather_object(mine)
        differ = [r for r, s in enumerate(gathered) if s != gathered[0]]
        if differ:
            raise ValueError(f"{where}: rank {differ[0]} got a different batch than rank 0 (shape, dtype or "
                             "values); the hook must return the same global batch on every rank")
    return sig
