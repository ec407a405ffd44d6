"""Expert and context parallelism inside ``apply_plan``: checks, application, batch shard, grad sync.

``epcp_blocker(model, plan)`` says (before any collective) why a plan's cp/ep cannot run on this
runtime; ``apply_plan`` raises ``PlanMismatchError`` with it. Supported: cp and ep under data
parallelism, alone or together, with tp (MoE blocks replicated over tp; cp also with sequence parallelism, ep not),
with pp (each stage exchanges tokens / runs its ring over the groups of its own ranks:
``runtime.apply.epcp_pipeline``), full recomputation (a re-run block re-enters ring attention), selective
recomputation (``RingContext.checkpoint``: each ring attention call is its own checkpoint),
fp32/bf16 models. The planner never emits the others (both sides call ``execution_rules.epcp_rule``).

``EPCPState`` (from ``apply_epcp``) wraps the model for cp (``ContextParallel``), shards every
global batch (the dp slice, then the cp sequence shard) and reduces gradients: dense ones averaged
over dp x cp, expert ones summed over their replicas only and divided by dp x cp. Under an FSDP2
kind (fsdp / zero2 / hsdp, ep = 1) FSDP2 shards over dp x cp and reduces them instead
(``data_parallel.fsdp_over_cp``): ``attach`` is not called. Once the final
parameters are known (after TP), ``attach`` builds one ``BucketedGradSync`` per group (dense over
the dc row, experts over their replica group): buckets are all-reduced from gradient hooks while
the last microbatch's backward runs, as the cost model's overlapped DDP term assumes
(``cost_models.grad_sync``); ``sync`` waits for them after backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from meshplan.plan import Plan
from meshplan.plan.execution_rules import SHARDED_DP_KINDS, epcp_rule, states_over_cp
from meshplan.runtime.apply.context_parallel import (
    ContextParallel,
    RingContext,
    shard_sequence,
    takes_position_ids,
)
from meshplan.runtime.apply.epcp_groups import DCGroups, build_groups
from meshplan.runtime.apply.epcp_pipeline import StageRing
from meshplan.runtime.apply.expert_parallel import apply_expert_parallel, ep_blocker
from meshplan.runtime.apply.grad_sync import DEFAULT_BUCKET_CAP_BYTES, BucketedGradSync
from meshplan.runtime.launch.dist import RuntimeEnv
from meshplan.trace import find_moe


def uses_epcp(plan: Plan) -> bool:
    return plan.cp > 1 or plan.ep > 1


def epcp_blocker(model: nn.Module, plan: Plan) -> str:
    """Why this runtime cannot run ``plan``'s cp/ep on ``model`` ('' when it can): the planner's
    rule (``execution_rules.epcp_rule``), then what only the model can tell. Under cp, a forward without
    ``position_ids`` runs when it computes its positions by ``arange`` (``context_parallel.SeqPositions``;
    pipeline stages: ``epcp_pipeline.pipeline_cp_blocker``); the planner checks it on the traced graph."""
    if not uses_epcp(plan):
        return ""
    why = epcp_rule(cp=plan.cp, ep=plan.ep, tp=plan.tp, pp=plan.pp, dp=plan.dp, seq_len=plan.seq_len or 2 * plan.cp,
                    num_experts=0, recompute=plan.recompute, quantized=plan.quantization.mode != "none",
                    sequence_parallel=plan.sequence_parallel, capture=plan.capture)
    if why:
        return why
    if plan.ep > 1:
        why = ep_blocker(model, plan.ep)
        if why:
            return why
    if plan.tp > 1:
        for fqn, _m, _info in find_moe(model):
            inside = sorted(k for k, v in plan.tp_styles.items() if v != "replicate" and (k + ".").startswith(fqn + "."))
            if inside:
                return (f"tp styles shard {inside[0]} inside the MoE block {fqn}; under cp/ep MoE blocks stay "
                        "replicated over tp (re-plan: the planner keeps them replicated)")
    return ""


@dataclass
class EPCPState:
    plan: Plan
    env: RuntimeEnv
    groups: DCGroups
    expert_ids: set[int] = field(default_factory=set)
    expert_rows: dict[str, tuple[int, int]] = field(default_factory=dict)  # FQN -> rows of the full tensor kept
    expert_fqns: set[str] = field(default_factory=set)  # to find the expert params again after materializing
    notes: list[str] = field(default_factory=list)
    syncs: list[BucketedGradSync] = field(default_factory=list)
    unsynced: list[torch.Tensor] = field(default_factory=list)  # expert params with no replica: only / dc
    ring: RingContext | None = None  # cp > 1: the ring (its ``stats`` count the bytes it sends)
    micro_divisor: int = 1  # pipelined: the syncs also divide by the microbatch count

    def attach(self, params: list[torch.Tensor], microbatches: int,
               cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES, *, pipelined: bool = False, use_hooks: bool = True,
               main: Any = None) -> None:
        """Gradient hooks on the final parameters (call once, after TP replaced them). ``pipelined``:
        the schedule sums the microbatches' gradients (``scale_grads=False``), so the reduction also
        divides by their count; ``use_hooks`` False: contributions are counted by ``watch_weight_passes``
        (zero-bubble schedules assign weight gradients without accumulate hooks). ``main``: the 16-bit-weights
        layout's ``MasterState`` (its fp32 main gradients are what the syncs reduce)."""
        g = self.groups
        divide_by = g.dc_size * (microbatches if pipelined else 1)
        self.micro_divisor = microbatches if pipelined else 1
        dense = [p for p in params if id(p) not in self.expert_ids]
        experts = [p for p in params if id(p) in self.expert_ids]
        for ps, group in ((dense, g.dc_group), (experts, g.replica_group)):
            if not ps:
                continue
            if group is None:
                self.unsynced += ps
            else:
                self.syncs.append(BucketedGradSync([ps], group, microbatches=microbatches, cap_bytes=cap_bytes,
                                                   divide_by=divide_by, use_hooks=use_hooks, main=main))

    def owns(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s gradient is averaged by these syncs (microbatch mean included)."""
        return any(s.owns(p) for s in self.syncs)

    def watch_weight_passes(self, stage: object, params: list[torch.Tensor]) -> None:
        for s in self.syncs:
            s.watch_weight_passes(stage, [p for p in params if s.owns(p)])

    def wrap(self, module: nn.Module) -> nn.Module:
        """The module as it runs under cp: the whole model (pp = 1) gets its shard's positions and
        ring attention (``ContextParallel``); a pipeline stage runs ring attention over its stage's
        cp group (``epcp_pipeline.StageRing``; positions come from its rewritten graph)."""
        if self.plan.cp <= 1:
            return module
        if self.ring is None:  # one ring for all of this rank's stages (its stats count them all)
            self.ring = RingContext(self.env.mesh.get_group("cp"), self.plan.cp, self.env.coord("cp"),
                                    checkpoint=self.plan.recompute == "selective")
        return StageRing(module, self.ring) if self.plan.pp > 1 else ContextParallel(module, self.ring)

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's sequence shard of a (dp-sliced) batch ``t`` [B, T, ...]."""
        if self.plan.cp <= 1 or t.dim() < 2:
            return t
        return shard_sequence(t, self.plan.cp, self.env.coord("cp"))

    def sync(self) -> tuple[int, int]:
        """Wait for the step's gradient all-reduces (issued from hooks) and average; returns how
        many ran and the bytes they reduced."""
        n = b = 0
        for s in self.syncs:
            s.finish()
            n += s.collectives_last_step
            b += s.bytes_last_step
        if self.groups.dc_size > 1:
            for p in self.unsynced:
                if p.grad is not None:
                    (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).div_(self.groups.dc_size)
        return n, b


def apply_epcp(model: nn.Module, plan: Plan, env: RuntimeEnv) -> EPCPState:
    """Groups, expert sharding (ep > 1); the cp wrapper is applied by ``EPCPState.wrap``."""
    groups = build_groups(env, plan.ep)
    state = EPCPState(plan=plan, env=env, groups=groups)
    if plan.ep > 1:
        applied = apply_expert_parallel(model, groups)
        state.expert_ids = {id(p) for p in applied.expert_params}
        state.expert_rows = applied.rows
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        state.expert_fqns = {names[id(p)] for p in applied.expert_params if id(p) in names}
        state.notes.append(f"expert parallelism ep={plan.ep}: experts of {len(applied.blocks)} MoE blocks sharded, "
                           "tokens exchanged with all_to_all_single")
    if plan.cp > 1:
        state.notes.append(f"context parallelism cp={plan.cp}: sequence in {2 * plan.cp} chunks (causal balance), "
                           "ring attention on send/recv of the un-repeated key/value heads, each shift "
                           "overlapped with a block's compute"
                           + ("; every ring attention call checkpointed (recompute=selective: its re-run "
                              "replays the shifts)" if plan.recompute == "selective" else "")
                           + ("" if takes_position_ids(model) else "; positions: the forward's arange over the "
                              "sequence yields each shard's global positions (no position_ids argument)"))
    if plan.dp_kind in SHARDED_DP_KINDS and states_over_cp(cp=plan.cp, ep=plan.ep, dp_kind=plan.dp_kind):
        state.notes.append(f"gradients reduced over dp x cp = {groups.dc_size} ranks by FSDP2's reduce-scatter "
                           "(model states sharded over them)")
    else:
        state.notes.append(f"gradients reduced over dp x cp = {groups.dc_size} ranks (experts: over their replicas), "
                           "bucketed all-reduce from gradient hooks")
    return state
