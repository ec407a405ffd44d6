"""Expert and context parallelism inside ``apply_plan``: checks, application, batch shard, grad sync.

``epcp_blocker(model, plan)`` says (before any collective) why a plan's cp/ep cannot run on this
runtime; ``apply_plan`` raises ``PlanMismatchError`` with it. Supported: cp and ep under data
parallelism, alone or together, with pp = 1 and tp = 1, no activation recomputation under cp (a
recomputed forward would run outside the ring-attention mode), fp32/bf16 models. The planner
never emits the others (``meshplan.planner`` applies the same rule).

``EPCPState`` (from ``apply_epcp``) wraps the model for cp (``ContextParallel``), shards every
global batch (the dp slice, then the cp sequence shard) and reduces gradients after backward
(``epcp_groups.sync_grads``): dense ones averaged over dp x cp, expert ones summed over their
replicas only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from meshplan.plan import Plan
from meshplan.runtime.context_parallel import ContextParallel, RingContext, cp_blocker, shard_sequence
from meshplan.runtime.dist import RuntimeEnv
from meshplan.runtime.epcp_groups import DCGroups, build_groups, sync_grads
from meshplan.runtime.expert_parallel import apply_expert_parallel, ep_blocker


def uses_epcp(plan: Plan) -> bool:
    return plan.cp > 1 or plan.ep > 1


def epcp_blocker(model: nn.Module, plan: Plan) -> str:
    """Why this runtime cannot run ``plan``'s cp/ep on ``model`` ('' when it can)."""
    if not uses_epcp(plan):
        return ""
    what = " x ".join(f"{a}{d}" for a, d in (("cp", plan.cp), ("ep", plan.ep)) if d > 1)
    if plan.pp > 1 or plan.tp > 1:
        return f"{what} runs with data parallelism only here (pp={plan.pp}, tp={plan.tp}); re-plan with pp=tp=1"
    if plan.quantization.mode != "none":
        return f"{what} with quantization {plan.quantization.mode} is not executed here"
    if plan.cp > 1 and plan.recompute != "none":
        return f"{what} with recompute={plan.recompute}: a recomputed forward would skip ring attention"
    if plan.cp > 1:
        if plan.seq_len and plan.seq_len % (2 * plan.cp):
            return f"seq_len {plan.seq_len} is not divisible by 2*cp = {2 * plan.cp} (causal load balancing)"
        why = cp_blocker(model)
        if why:
            return why
    if plan.ep > 1:
        why = ep_blocker(model, plan.ep)
        if why:
            return why
    return ""


@dataclass
class EPCPState:
    plan: Plan
    env: RuntimeEnv
    groups: DCGroups
    expert_ids: set[int] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)

    def wrap(self, module: nn.Module) -> nn.Module:
        if self.plan.cp <= 1:
            return module
        return ContextParallel(module, RingContext(self.env.mesh.get_group("cp"), self.plan.cp, self.env.coord("cp")))

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's sequence shard of a (dp-sliced) batch ``t`` [B, T, ...]."""
        if self.plan.cp <= 1 or t.dim() < 2:
            return t
        return shard_sequence(t, self.plan.cp, self.env.coord("cp"))

    def sync(self, params: list[torch.Tensor]) -> None:
        dense = [p for p in params if id(p) not in self.expert_ids]
        experts = [p for p in params if id(p) in self.expert_ids]
        sync_grads(dense, experts, self.groups)


def apply_epcp(model: nn.Module, plan: Plan, env: RuntimeEnv) -> EPCPState:
    """Groups, expert sharding (ep > 1); the cp wrapper is applied by ``EPCPState.wrap``."""
    groups = build_groups(env, plan.ep)
    state = EPCPState(plan=plan, env=env, groups=groups)
    if plan.ep > 1:
        applied = apply_expert_parallel(model, groups)
        state.expert_ids = {id(p) for p in applied.expert_params}
        state.notes.append(f"expert parallelism ep={plan.ep}: experts of {len(applied.blocks)} MoE blocks sharded, "
                           "tokens exchanged with all_to_all_single")
    if plan.cp > 1:
        state.notes.append(f"context parallelism cp={plan.cp}: sequence in {2 * plan.cp} chunks (causal balance), "
                           "ring attention on send/recv")
    state.notes.append(f"gradients reduced over dp x cp = {groups.dc_size} ranks (experts: over their replicas)")
    return state
