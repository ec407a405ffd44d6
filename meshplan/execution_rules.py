"""Which plan options the runtime executes as costed: one torch-free rule for both sides.

The runtime refuses these combinations before training (``PlanMismatchError``), and the
planner's search never enumerates them, so ``autoparallel`` cannot return a plan that
``meshplan run`` refuses. Each function returns "" when the combination runs, else the reason.
No torch import here (the planner calls it).
"""

from __future__ import annotations

ZERO_BUBBLE_SCHEDULES = ("zero-bubble", "zbv")
SHARDED_DP_KINDS = ("zero2", "fsdp", "hsdp")


def dp_kind_blocker(*, dp: int, tp: int, pp: int, schedule: str, dp_kind: str) -> str:
    """Why ``dp_kind`` cannot run with these degrees and schedule ("" when it can)."""
    if dp == 1:
        return ""
    if dp_kind in SHARDED_DP_KINDS and pp > 1 and schedule in ZERO_BUBBLE_SCHEDULES:
        return (
            f"dp_kind {dp_kind} under the {schedule} schedule is not executed: FSDP2 gives wrong "
            "gradients under zero-bubble schedules; re-plan with dp_kind ddp/zero1 or a 1f1b/interleaved schedule"
        )
    if dp_kind == "zero1" and tp > 1:
        return (
            "dp_kind zero1 with tp > 1 is not executed (ZeroRedundancyOptimizer does not take DTensor "
            "parameters); re-plan with dp_kind zero2 or fsdp"
        )
    return ""


def recompute_blocker(*, pp: int, schedule: str, recompute: str) -> str:
    """Why ``recompute`` cannot run under this schedule ("" when it can)."""
    if recompute == "op" and pp > 1:
        return (
            "recompute=op at pp > 1 is not executed: a pipeline stage is one flat fx graph with no block "
            "boundaries to count matmuls in (runtime/op_recompute.py checkpoints nn.ModuleList blocks); "
            "re-plan with recompute=selective or full"
        )
    if recompute == "full" and pp > 1 and schedule in ZERO_BUBBLE_SCHEDULES:
        return (
            f"recompute=full under the {schedule} schedule is not executed: torch's split backward "
            "re-runs a checkpointed stage's forward for every weight-gradient group (measured here: about "
            "20 forwards per microbatch instead of 1); re-plan with recompute=selective or a "
            "1f1b/interleaved-1f1b schedule"
        )
    return ""
