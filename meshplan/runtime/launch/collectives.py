"""The runtime's own collectives, each on its process group's device: the one place that knows it.

c10d picks a group's backend by the device of the tensors it is handed, so a CPU tensor on an
NCCL group fails ("No backend type associated with device type cpu"; seen on an H200 at the end
of a run, in the peak-memory gather). Every collective the runtime issues itself (peak-memory
gather, loss and gradient-norm reductions, tied-weight and bucketed gradient reductions, the
expert token exchange, ring attention's shifts, barriers, checkpoint and data checks) goes
through this module, and every tensor enters a collective through ``on_group_device``:

- ``group_device(group)``: the device bound at ``init_process_group(device_id=...)``; else
  CUDA's current device when the group's backend is NCCL; else the CPU (gloo).
- ``on_group_device(t, group)``: ``t`` moved there (itself when it already lives there).
- In-place collectives (``all_reduce``, ``all_to_all_single``) write the result back into the
  caller's tensor when it had to be copied, so callers keep torch's in-place contract.

Collectives torch's own modules issue (DDP, FSDP2, DTensor, pipelining, DCP) pick their device
themselves. Object collectives (``all_gather_object``) and ``barrier`` carry no caller tensor:
torch uses the bound device (``runtime.launch.dist.init_runtime`` binds it on CUDA).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.nn import functional as autograd_collectives

SUM = dist.ReduceOp.SUM


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device whose tensors a collective on ``group`` (None: the default group) takes."""
    bound = getattr(dist.group.WORLD, "bound_device_id", None)
    if bound is not None:
        return torch.device(bound)
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def on_group_device(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``t`` on ``group``'s device: every tensor the runtime hands to a collective passes here."""
    return t.to(group_device(group))


def _write_back(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    if src is not dst:
        dst.copy_(src)
    return dst


def all_reduce(t: torch.Tensor, *, op: Any = SUM, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Reduce ``t`` in place over ``group`` (through a copy on the group's device if needed); returns ``t``."""
    x = on_group_device(t, group)
    dist.all_reduce(x, op=op, group=group)
    return _write_back(t, x)


def all_reduce_async(t: torch.Tensor, *, op: Any = SUM,
                     group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, dist.Work]:
    """Start reducing ``t`` over ``group``; (the tensor that holds the result once waited, the work)."""
    x = on_group_device(t, group)
    work = dist.all_reduce(x, op=op, group=group, async_op=True)
    assert work is not None
    return x, work


def all_gather(t: torch.Tensor, *, group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape everywhere), in group rank order, on the group's device."""
    x = on_group_device(t, group)
    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, x, group=group)
    return out


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Even all-to-all of ``inp`` into ``out`` (in place); returns ``out``."""
    o = on_group_device(out, group)
    dist.all_to_all_single(o, on_group_device(inp, group), group=group)
    return _write_back(out, o)


def all_to_all_autograd(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], *,
                        group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Uneven all-to-all whose backward sends the gradients back (``torch.distributed.nn``); returns
    the received rows (a new tensor on the group's device)."""
    return autograd_collectives.all_to_all_single(on_group_device(out, group), on_group_device(inp, group),
                                                  out_splits, in_splits, group=group)


def all_reduce_autograd(t: torch.Tensor, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum of ``t`` over ``group`` whose backward all-reduces the gradient (``torch.distributed.nn``)."""
    return autograd_collectives.all_reduce(on_group_device(t, group), group=group or dist.group.WORLD)


GLOO_RS_PIECE_BYTES = 16 * 2**20  # input bytes per gloo reduce-scatter call (see reduce_scatter_single)


def reduce_scatter_single(out: torch.Tensor, inp: torch.Tensor, *, op: Any, group: dist.ProcessGroup,
                          async_op: bool = False) -> dist.Work | None:
    """``reduce_scatter_tensor`` of ``inp`` into ``out`` (FSDP2's custom reduce-scatter hook hands
    both on its device; they are checked onto the group's, not copied, since FSDP reads ``out``).

    On gloo, a blocking call whose input exceeds ``GLOO_RS_PIECE_BYTES`` runs as several calls over
    column pieces of the (world, shard) input: gloo's reduce-scatter works in a scratch copy of its
    whole input (measured here: 0.31 GiB over a 0.25 GiB input on 4 ranks, 0.09 GiB in 4 MiB pieces),
    which at FSDP2's root group (a tied 50k-token embedding) was the largest single term of a CPU
    rank's peak. The bytes sent are the same; each rank still receives exactly its shard."""
    o = on_group_device(out, group)
    if o.data_ptr() != out.data_ptr():
        raise RuntimeError(f"reduce-scatter buffer on {out.device}, the group's device is {o.device}")
    i = on_group_device(inp, group)
    world = dist.get_world_size(group)
    piece = max(1, GLOO_RS_PIECE_BYTES // (i.element_size() * world))
    if async_op or "gloo" not in str(dist.get_backend(group)) or o.numel() <= piece or i.dim() != 1:
        return dist.reduce_scatter_tensor(o, i, op=op, group=group, async_op=async_op)
    rows = i.view(world, o.numel())
    for c0 in range(0, o.numel(), piece):
        c1 = min(c0 + piece, o.numel())
        dist.reduce_scatter_tensor(o[c0:c1], rows[:, c0:c1].contiguous().view(-1), op=op, group=group)
    return None


def send_recv(x: torch.Tensor, recv: torch.Tensor, to: int, frm: int, *,
              group: dist.ProcessGroup) -> tuple[torch.Tensor, list[dist.Work]]:
    """Post ``x`` -> global rank ``to`` and a receive from ``frm`` (not waited); (the buffer that holds
    the received tensor once the works are waited, the works)."""
    buf = on_group_device(recv, group)
    ops = [dist.P2POp(dist.isend, on_group_device(x, group), to, group), dist.P2POp(dist.irecv, buf, frm, group)]
    return buf, dist.batch_isend_irecv(ops)


def all_gather_object(obj: Any, *, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's picklable ``obj``, in group rank order."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait for every rank of ``group``, on the group's device (NCCL barriers run an all-reduce)."""
    dev = group_device(group)
    dist.barrier(group=group, device_ids=[dev.index] if dev.type == "cuda" and dev.index is not None else None)
