"""Plan schedule names -> ``torch.distributed.pipelining`` schedules, and stage placement.

=====================  ===================================  =========================
plan.schedule          torch schedule                       stages per pipeline rank
=====================  ===================================  =========================
gpipe                  ScheduleGPipe                        1
1f1b                   Schedule1F1B                         1
interleaved-1f1b       ScheduleInterleaved1F1B              v (looped: r, r+p, ...)
zero-bubble            ScheduleInterleavedZeroBubble        v >= 1 (looped)
zbv                    ScheduleZBVZeroBubble                2 (V: r and 2p-1-r)
=====================  ===================================  =========================

``zero-bubble`` with one stage per rank (v=1) also uses ScheduleInterleavedZeroBubble: torch
has no single-stage zero-bubble class, and the interleaved one accepts a one-element stage list
(split backward into input-grad B and weight-grad W, W deferred into the bubbles).
Schedules are built with ``scale_grads=False``; the runtime divides every gradient by the
number of microbatches ONCE per parameter after ``step()``. torch's own scaling runs per stage,
so a parameter shared by two stages of one rank (the tied embedding/LM head under ZBV's V
placement: stages 0 and 2p-1 both on rank 0) would be divided twice. ``loss_fn`` must be a mean.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from meshplan.errors import PlanMismatchError


def stage_rank(schedule: str, index: int, pp: int) -> int:
    """Pipeline rank that runs stage ``index`` under ``schedule`` (looped or V placement)."""
    if schedule == "zbv":
        return index if index < pp else 2 * pp - 1 - index
    return index % pp


def check_placement(schedule: str, pp: int, ranks_by_stage: Sequence[int], microbatches: int) -> None:
    n = len(ranks_by_stage)
    if n % pp:
        raise PlanMismatchError(f"{n} stages cannot be spread evenly over pp={pp} ranks")
    v = n // pp
    if schedule in ("gpipe", "1f1b") and v != 1:
        raise PlanMismatchError(f"schedule {schedule} runs one stage per rank; the plan has {v} (use interleaved-1f1b)")
    if schedule == "zbv" and v != 2:
        raise PlanMismatchError(f"schedule zbv needs exactly 2 stages per rank (V placement), the plan has {v}")
    if schedule == "1f1b" and microbatches < pp:
        raise PlanMismatchError(f"1f1b needs microbatches >= pipeline ranks ({microbatches} < {pp})")
    want = [stage_rank(schedule, i, pp) for i in range(n)]
    if list(ranks_by_stage) != want:
        raise PlanMismatchError(
            f"plan places stages on pipeline ranks {list(ranks_by_stage)}, but {schedule} runs them on {want}"
        )


def pipeline_stage(module: Any, index: int, num_stages: int, device: Any, group: Any) -> Any:
    """torch's ``PipelineStage`` for ``module``, except in its shape inference on the first step: there
    torch runs a later stage on uninitialised tensors shaped like what it receives, so an integer
    tensor computed in an earlier stage (ids hashed or bucketed from the tokens, routing indices)
    would index an embedding out of range; here such tensors are zeros (float ones stay as torch makes them)."""
    from torch.distributed.pipelining import PipelineStage

    class _Stage(PipelineStage):
        def _to_tensor(self, arg: Any) -> Any:
            t = super()._to_tensor(arg)
            if not isinstance(arg, torch.Tensor) and isinstance(t, torch.Tensor) and not (
                    t.is_floating_point() or t.is_complex()):
                with torch.no_grad():
                    (t.to_local() if hasattr(t, "to_local") else t).zero_()
            return t

    return _Stage(module, index, num_stages, device, group=group)


def build_schedule(schedule: str, stages: list, microbatches: int, loss_fn: Callable) -> object:
    """The torch schedule object for this rank's ``stages`` (PipelineStage objects)."""
    from torch.distributed import pipelining as pl

    if schedule == "gpipe":
        return pl.ScheduleGPipe(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)
    if schedule == "1f1b":
        return pl.Schedule1F1B(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)
    if schedule == "interleaved-1f1b":
        return pl.ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    if schedule == "zero-bubble":
        return pl.ScheduleInterleavedZeroBubble(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    if schedule == "zbv":
        return pl.ScheduleZBVZeroBubble(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    raise PlanMismatchError(f"schedule {schedule!r} is not supported by the runtime")
