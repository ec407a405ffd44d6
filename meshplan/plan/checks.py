"""What makes a Plan runnable, checked when a plan is loaded (``Plan.from_dict`` -> ``Plan.validate``).

A plan file may be edited by hand; before it reaches torchrun every field the runtime relies on is
checked: known mesh axis names (an unknown axis would run unsynchronised replicas), degrees vs
world size, batch arithmetic (microbatches >= 1 dividing the batch, global batch = data-parallel
degree x microbatch size x microbatches), the pipeline stages (count, indices, pipeline ranks,
contiguous node ranges) and the TP styles. ``plan_problems`` returns one line per problem, each
naming the field; ``Plan.validate`` raises the first as ``PlanFormatError``. Duck-typed on the
Plan (plan.py imports this module), no torch.
"""

from __future__ import annotations

from typing import Any

MESH_AXES = ("pp", "dp", "dp_replicate", "dp_shard", "cp", "tp")


def plan_problems(plan: Any) -> list[str]:
    out: list[str] = []
    mesh = plan.mesh
    unknown = [a for a in mesh.axis_names if a not in MESH_AXES]
    if unknown:
        out.append(f"mesh.axis_names: unknown axis {unknown[0]!r}; use names from {MESH_AXES}")
    if plan.world_size < 1:
        out.append(f"world_size: must be >= 1, got {plan.world_size}")
    if mesh.world_size != plan.world_size:
        out.append(f"mesh.degrees: {mesh.degrees} multiply to {mesh.world_size}, world_size is {plan.world_size}")
    for name in ("micro_batch_size", "num_microbatches", "global_batch_size", "virtual_stages"):
        v = getattr(plan, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            out.append(f"{name}: must be an integer >= 1, got {v!r}")
    if out:
        return out
    if not isinstance(plan.seq_len, int) or plan.seq_len < 0:
        out.append(f"seq_len: must be an integer >= 0, got {plan.seq_len!r}")
    dp, mbs, nmb, gb = mesh.dp, plan.micro_batch_size, plan.num_microbatches, plan.global_batch_size
    if gb % (dp * nmb):
        out.append(f"num_microbatches: {nmb} x dp {dp} does not divide global_batch_size {gb}")
    elif gb != dp * mbs * nmb:
        out.append(
            f"global_batch_size: {gb} != dp {dp} x micro_batch_size {mbs} x num_microbatches {nmb} = {dp * mbs * nmb}"
        )
    out += _stage_problems(plan)
    return out


def _stage_problems(plan: Any) -> list[str]:
    stages, pp = plan.stages, plan.mesh.pp
    if not stages:
        return ["stages: a plan needs at least one stage"]
    out = []
    want = pp * plan.virtual_stages
    if pp > 1 and len(stages) != want:
        out.append(f"stages: {len(stages)} stages, pp {pp} x virtual_stages {plan.virtual_stages} needs {want}")
    for i, s in enumerate(stages):
        if s.index != i:
            out.append(f"stages[{i}].index: {s.index}, expected {i} (stages in model order)")
        if not 0 <= s.rank < pp:
            out.append(f"stages[{i}].rank: {s.rank} is not a pipeline rank (0..{pp - 1})")
        if s.node_start < 0 or s.node_end < s.node_start:
            out.append(f"stages[{i}]: node range [{s.node_start}, {s.node_end}) is empty or negative")
        if i and pp > 1 and s.node_start != stages[i - 1].node_end:
            out.append(
                f"stages[{i}].node_start: {s.node_start} does not continue stages[{i - 1}].node_end "
                f"{stages[i - 1].node_end}"
            )
    if pp > 1:
        used = {s.rank for s in stages}
        if used != set(range(pp)):
            out.append(f"stages: pipeline ranks {sorted(set(range(pp)) - used)} hold no stage")
    return out
