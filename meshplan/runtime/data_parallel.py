"""Data parallelism for one module (a stage or the whole model), chosen from the Plan.

Modes (``dp_mode``):

* ``"none"``   dp degree 1.
* ``"manual"`` bucketed, overlapped all-reduce from gradient hooks (``runtime.grad_sync``):
  zero-bubble schedules (DDP and FSDP2 give wrong or missing gradients under them, PLATFORM.md),
  ``dp_kind="ddp"`` with pp > 1 (DDP-wrapped stages assert in DDP's reducer on the second step
  under torch 2.13's pipelining; seen in tests), and ``dp_kind="none"`` on a dp > 1 mesh.
* ``"fsdp"``   the plan asks for FSDP, or TP is combined with DDP-style DP (DDP around DTensor
  fails): FSDP2 ``fully_shard`` over the dp mesh, per repeated block then the root at pp = 1
  (each block's reduce-scatter overlaps the backward of the blocks before it), the stage root
  under pp > 1 (an fx stage does not call its blocks as modules).
* ``"ddp"``    ``DistributedDataParallel(module, process_group=dp_group)`` (its reducer buckets
  gradients and overlaps their all-reduce with the backward).

Gradient-reducing collectives are counted where they are issued (``SyncCounter``): DDP through a
communication hook that counts and then runs torch's ``allreduce_hook``, FSDP2 through a custom
reduce-scatter (``set_custom_reduce_scatter``) that counts and then calls
``reduce_scatter_tensor``, the manual mode by ``BucketedGradSync`` itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

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
        # split): the same bucketed overlapped all-reduce, issued from gradient hooks instead.
        return "manual"
    return "ddp"


class SyncCounter:
    """Counts gradient-reducing collective calls; ``calls`` is reset by the train step."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.calls = 0


def _counting_allreduce_hook(state: SyncCounter, bucket):  # type: ignore[no-untyped-def]
    # no annotations on bucket/return: DDP checks them against the real classes, and this module's
    # ``from __future__ import annotations`` would turn them into strings
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    state.calls += 1
    return allreduce_hook(state.group, bucket)  # type: ignore[arg-type]


class _CountingReduceScatter(ReduceScatter):
    def __init__(self, counter: SyncCounter) -> None:
        self.counter = counter

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> dist.Work | None:
        self.counter.calls += 1
        return dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def block_modules(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks: children of every ``nn.ModuleList`` inside ``module``."""
    return [c for m in module.modules() if isinstance(m, nn.ModuleList) for c in m]


def wrap_dp(
    module: nn.Module, mode: str, *, dp_mesh: Any, dp_group: dist.ProcessGroup | None, counter: SyncCounter,
    mp_policy: Any = None, per_block: bool = False,
) -> nn.Module:
    """Wrap ``module`` for ``mode``; returns the module to run (DDP returns a wrapper)."""
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if not any(p.requires_grad for p in module.parameters()):
            return module
        ddp = DistributedDataParallel(module, process_group=dp_group)
        counter.group = dp_group
        ddp.register_comm_hook(counter, _counting_allreduce_hook)
        return ddp
    if mode == "fsdp":
        from torch.distributed.fsdp import FSDPModule, fully_shard

        kw: dict[str, Any] = {"mesh": dp_mesh}
        if mp_policy is not None:
            kw["mp_policy"] = mp_policy
        if per_block:
            for b in block_modules(module):
                if any(p.requires_grad for p in b.parameters()):
                    fully_shard(b, **kw)
        fully_shard(module, **kw)
        comm = _CountingReduceScatter(counter)
        for m in module.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_reduce_scatter(comm)
        return module
    return module
