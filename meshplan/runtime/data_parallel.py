"""Data parallelism for one module (a stage or the whole model), chosen from the Plan.

Modes (``dp_mode``):

* ``"none"``   dp degree 1.
* ``"manual"`` zero-bubble schedules (interleaved zero-bubble, ZBV) with pp > 1: DDP and FSDP2
  give wrong or missing gradients under them (PLATFORM.md), so gradients are all-reduced (mean)
  over the dp group after the schedule's ``step()`` by ``allreduce_grads``. Also used when the
  plan says ``dp_kind="none"`` on a dp > 1 mesh (the replicas must still agree), and for
  ``dp_kind="ddp"`` with pp > 1 (DDP-wrapped stages assert in DDP's reducer on the second
  step under torch 2.13's pipelining; seen in tests).
* ``"fsdp"``   the plan asks for FSDP, or TP is combined with DP (DDP around DTensor fails):
  FSDP2 ``fully_shard(module, mesh=mesh["dp"])``.
* ``"ddp"``    plain data parallel: ``DistributedDataParallel(module, process_group=dp_group)``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshplan.plan import Plan

ZERO_BUBBLE = ("zero-bubble", "zbv")


def dp_mode(plan: Plan) -> str:
    if plan.dp == 1:
        return "none"
    if plan.pp > 1 and plan.schedule in ZERO_BUBBLE:
        return "manual"
    if plan.dp_kind == "none":
        return "manual"
    if plan.dp_kind == "fsdp" or plan.tp > 1:
        return "fsdp"
    if plan.pp > 1:
        # DDP-wrapped pipeline stages hit a reducer assert on the second step here ("rebuilt
        # parameter indices size is not same as original model parameters size", torch 2.13,
        # gloo, 1F1B and Interleaved1F1B; also with hand-written nn.Module stages, so not the fx
        # split): same gradients, reduced once after step() instead.
        return "manual"
    return "ddp"


def wrap_dp(module: nn.Module, mode: str, *, dp_mesh: object, dp_group: dist.ProcessGroup | None) -> nn.Module:
    """Wrap ``module`` for ``mode``; returns the module to run (DDP returns a wrapper)."""
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if not any(p.requires_grad for p in module.parameters()):
            return module
        return DistributedDataParallel(module, process_group=dp_group)
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(module, mesh=dp_mesh)  # type: ignore[arg-type]
        return module
    return module


def allreduce_grads(params: Iterable[torch.Tensor], group: dist.ProcessGroup, *, average: bool = True) -> None:
    """In-place all-reduce of every gradient over ``group`` (DTensor grads: their local shard)."""
    n = dist.get_world_size(group)
    for p in params:
        if p.grad is None:
            continue
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        dist.all_reduce(g, op=dist.ReduceOp.SUM, group=group)
        if average:
            g.div_(n)
