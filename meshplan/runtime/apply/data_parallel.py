"""Data parallelism for one module (a stage or the whole model), chosen from the Plan.

Modes (``dp_mode``), from the plan's ``dp_kind``:

* ``"none"``   dp degree 1.
* ``"manual"`` bucketed, overlapped all-reduce from gradient hooks (``runtime.apply.grad_sync``), for
  the replicated kinds (ddp, zero1, none) where DDP cannot run: zero-bubble schedules (DDP and
  FSDP2 give wrong or missing gradients under them, PLATFORM.md), pp > 1 (DDP-wrapped stages
  assert in DDP's reducer on the second step under torch 2.13's pipelining; seen in tests), TP
  (DDP around DTensor fails; the local shards are reduced), and ``dp_kind="none"`` on dp > 1.
* ``"fsdp"``   dp_kind fsdp (ZeRO-3), zero2 or hsdp: FSDP2 ``fully_shard`` over the dp mesh, per
  repeated block then the root at pp = 1 (each block's reduce-scatter overlaps the backward of
  the blocks before it), the stage root under pp > 1 (an fx stage does not call its blocks as
  modules). zero2: ``reshard_after_forward=False`` (parameters stay gathered from forward to
  backward, gradients and optimizer state sharded). hsdp: a 2-D (dp_replicate, dp_shard) mesh
  unflattened from the dp mesh, shard size ``Plan.hsdp_shard_degree()``.
* ``"ddp"``    ``DistributedDataParallel(module, process_group=dp_group)`` (its reducer buckets
  gradients and overlaps their all-reduce with the backward). Not under ``state_layout`` "megatron"
  (16-bit parameters): DDP would reduce the 16-bit gradients; the manual mode reduces the fp32 main
  gradients (``runtime.apply.master_state``).

zero1 runs one of the replicated modes with the optimizer wrapped in torch's
``ZeroRedundancyOptimizer`` over the dp group (under cp: over the dp x cp group whose gradients
``runtime.apply.epcp`` all-reduces) (``runtime.apply.zero1``; with tp > 1 over the TP shards' local tensors).
``check_dp_kind`` refuses, before any collective, what the runtime does not execute.

Gradient-reducing collectives are counted where they are issued (``SyncCounter``): DDP through a
communication hook that counts and then runs torch's ``allreduce_hook``, FSDP2 through a custom
reduce-scatter (``set_custom_reduce_scatter``) that counts and then calls
``reduce_scatter_tensor``, the manual mode by ``BucketedGradSync`` itself.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from meshplan.errors import PlanMismatchError
from meshplan.plan import Plan
from meshplan.plan.execution_rules import (
    SHARDED_DP_KINDS,
    STATE_SHARDING_KINDS,
    ZERO_BUBBLE_SCHEDULES,
    dp_kind_blocker,
    states_over_cp,
)
from meshplan.runtime.launch import collectives


def check_dp_kind(plan: Plan) -> None:
    """PlanMismatchError for a data-parallel kind this runtime cannot execute as planned
    (``meshplan.plan.execution_rules``, the rule the planner's search also obeys)."""
    why = dp_kind_blocker(dp=plan.dp_state_ranks(), tp=plan.tp, pp=plan.pp, schedule=plan.schedule,
                          dp_kind=plan.dp_kind)
    if why:
        raise PlanMismatchError(why)
    if plan.ep > 1 and plan.dp_kind in STATE_SHARDING_KINDS:
        # expert parameters differ across the dp x cp ranks (each holds E/ep experts) and reduce over their
        # replicas only (runtime.apply.epcp): a dp-wide ZeRO partition or FSDP2 mesh would mix them (zero1 measured:
        # losses 1e-3 off one device at dp2 ep2)
        raise PlanMismatchError(f"dp_kind {plan.dp_kind} with expert parallelism (ep={plan.ep}) is not executed: "
                                "expert and dense gradients reduce over different groups; re-plan with dp_kind ddp")


def fsdp_over_cp(plan: Plan) -> bool:
    """An FSDP2 kind sharding over dp x cp (module docstring): FSDP2 reduces the cp ranks' gradients."""
    return plan.dp_kind in SHARDED_DP_KINDS and states_over_cp(cp=plan.cp, ep=plan.ep, dp_kind=plan.dp_kind)


def state_mesh(plan: Plan, mesh: Any) -> Any:
    """The mesh FSDP2 shards over (None at one rank): ``mesh``'s dp axis, or its (dp, cp) submesh
    flattened into ``dp_cp`` (``fsdp_over_cp``); hsdp: that mesh unflattened into
    (dp_replicate, dp_shard) of shard size ``Plan.hsdp_shard_degree()``. Every rank calls it alike."""
    if fsdp_over_cp(plan):
        out = mesh["dp", "cp"]._flatten("dp_cp")
    else:
        out = mesh["dp"] if plan.dp > 1 else None
    if plan.dp_kind == "hsdp" and out is not None:
        shard = plan.hsdp_shard_degree()
        out = out._unflatten(0, (plan.dp_state_ranks() // shard, shard), ("dp_replicate", "dp_shard"))
    return out


def dp_mode(plan: Plan) -> str:
    if fsdp_over_cp(plan):
        return "fsdp"
    if plan.dp == 1:
        return "none"
    if plan.dp_kind in SHARDED_DP_KINDS:
        return "fsdp"
    if plan.pp > 1 and plan.schedule in ZERO_BUBBLE_SCHEDULES:
        return "manual"
    if plan.dp_kind == "none" or plan.tp > 1 or plan.state_layout != "torch":
        return "manual"
    if plan.pp > 1:
        # DDP-wrapped pipeline stages hit a reducer assert on the second step here ("rebuilt
        # parameter indices size is not same as original model parameters size", torch 2.13,
        # gloo, 1F1B and Interleaved1F1B; also with hand-written nn.Module stages, so not the fx
        # split): the same bucketed overlapped all-reduce, issued from gradient hooks instead.
        return "manual"
    return "ddp"


class SyncCounter:
    """Counts gradient-reducing collective calls, and the bytes (and dtypes) they reduce; reset by
    the train step (``reset``)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.calls = 0
        self.last_call_s = 0.0  # perf_counter() at the last counted call
        self.bytes = 0  # input bytes of the counted collectives (the full buffer before a reduce-scatter)
        self.dtypes: set[str] = set()

    def reset(self) -> None:
        self.calls, self.bytes = 0, 0
        self.dtypes = set()

    def add(self, t: torch.Tensor) -> None:
        self.last_call_s = time.perf_counter()  # this rank's gradients of the bucket are final (stragglers)
        self.calls += 1
        self.bytes += t.numel() * t.element_size()
        self.dtypes.add(str(t.dtype).removeprefix("torch."))


def _counting_allreduce_hook(state: SyncCounter, bucket):  # type: ignore[no-untyped-def]
    # no annotations on bucket/return: DDP checks them against the real classes, and this module's
    # ``from __future__ import annotations`` would turn them into strings
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    state.add(bucket.buffer())
    return allreduce_hook(state.group, bucket)  # type: ignore[arg-type]


class _CountingReduceScatter(ReduceScatter):
    def __init__(self, counter: SyncCounter) -> None:
        self.counter = counter

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> dist.Work | None:
        self.counter.add(input_tensor)
        work = collectives.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        if work is None and input_tensor.device.type == "cpu":
            # FSDP2 keeps each group's reduce-scatter input (the full unsharded gradients in the reduce
            # dtype) alive until the next group's post-backward, for CUDA stream ordering; on CPU the
            # call above has finished with it, so its memory goes back now (nothing reads it again)
            input_tensor.untyped_storage().resize_(0)
        return work



def block_modules(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks: children of every ``nn.ModuleList`` inside ``module``."""
    return [c for m in module.modules() if isinstance(m, nn.ModuleList) for c in m]


def wrap_dp(
    module: nn.Module, mode: str, *, dp_mesh: Any, dp_group: dist.ProcessGroup | None, counter: SyncCounter,
    mp_policy: Any = None, per_block: bool = False, reshard_after_forward: bool = True,
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

        kw: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": reshard_after_forward}
        if mp_policy is not None:
            kw["mp_policy"] = mp_policy
        if per_block:
            for b in block_modules(module):
                if any(p.requires_grad for p in b.parameters()):
                    fully_shard(b, **kw)
        fully_shard(module, **kw)
        comm = _CountingReduceScatter(counter)
        hsdp = getattr(dp_mesh, "ndim", 1) == 2
        for m in module.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_reduce_scatter(comm)
                if hsdp:  # HSDP: the all-reduce over dp_replicate after each reduce-scatter
                    m.set_all_reduce_hook(counter.add)
        return module
    return module
