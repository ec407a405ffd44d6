"""The costs every evaluation of one configuration shares: ``ConfigCosts``, the base of
``planner.evaluate.ConfigEvaluator`` (and so of ``planner.search.Searcher``).

It holds the search's settings (cluster, global batch, pins, recompute / schedule / DP-kind
choices, dtype, optimizer, an engine's split rule) and the terms both the cheap bound and the
exact evaluation use: the per-(tp, sp, recompute, micro-batch) cost table and its prefix sums,
the time-balanced (or engine-rule) stage split and the memory-constrained re-split
(``partition.stage_ilp``), model-state bytes under each DP kind's sharding, the optimizer step,
DP collectives (``cost_models.dp_kinds``), pipeline send times and the (step, memory) lower
bound the search orders candidates by. With a ``Quantization`` on the coster, model states
count the quantized layout. No torch import.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from itertools import accumulate
from typing import Any

from meshplan.cost_models.allocator import fsdp_stream_pool_bytes
from meshplan.cost_models.comm import p2p_crosses_nodes, p2p_time_s
from meshplan.cost_models.dp_kinds import (
    KIND_ORDER,
    ZERO3_PERSISTENCE_NUMEL,
    ZERO_STAGE,
    DPComm,
    dp_comm,
    dp_state_bytes,
    shard_degree,
    state_precision,
    state_zero_stage,
    unprefetched_share,
    unsharded_buffer_bytes,
)
from meshplan.cost_models.eager_ops import optimizer_step_s
from meshplan.cost_models.engine_profiles import EngineProfile
from meshplan.cost_models.engine_profiles import profile as engine_profile
from meshplan.cost_models.epcp import DEFAULT_CAPACITY_FACTOR, folded_expert_mesh
from meshplan.cost_models.grad_sync import GRAD_REDUCE_BYTES
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.cost_models.memory import ModelStateBytes, model_state_bytes
from meshplan.cost_models.precision import check_training_dtype
from meshplan.graph import ModelGraph
from meshplan.partition.engine_split import SPLIT_RULES, rule_for, rule_split
from meshplan.plan.execution_rules import SHARDED_DP_KINDS, cp_forward_blocker, epcp_rule
from meshplan.planner.cost_memos import CostMemos
from meshplan.planner.costing import CostTable, GraphCoster, LayerCost
from meshplan.planner.epcp_cost import EPCPPrefix, EPCPTerms, expert_params
from meshplan.planner.memory_floor import held_floor
from meshplan.planner.pipeline_time import inflight
from meshplan.planner.search_memos import share_table_memos, solve_split
from meshplan.planner.search_types import Config, balanced_split

#: At most this many memory-constrained re-splits (partition.stage_ilp DP) per search.
MAX_MEMORY_RESCUES = 8


def add_dp_comm(a: DPComm, b: DPComm) -> DPComm:
    """Two groups' DP collectives run one after the other (their seconds and bytes add; FSDP units
    as ``a``'s, or ``b``'s when ``a`` has none)."""
    bytes_ = {k: a.bytes.get(k, 0) + b.bytes.get(k, 0) for k in sorted(set(a.bytes) | set(b.bytes))}
    return DPComm(sync_s=a.sync_s + b.sync_s, gather_s=a.gather_s + b.gather_s,
                  per_microbatch_s=a.per_microbatch_s + b.per_microbatch_s, bytes=bytes_,
                  mb_forward_s=a.mb_forward_s + b.mb_forward_s, mb_bwd_gather_s=a.mb_bwd_gather_s + b.mb_bwd_gather_s,
                  units=a.units if a.per_microbatch_s else b.units, mb_serial_s=a.mb_serial_s + b.mb_serial_s)  # fmt: skip


class ConfigCosts:
    """Settings of one search and the cost terms its evaluations share (see the module docstring)."""

    def __init__(
        self,
        graph: ModelGraph,
        cluster: ClusterSpec,
        *,
        fixed: dict[str, Any] | None = None,
        dtype: str = "bf16",
        optimizer: str = "adam",
        coster: GraphCoster | None = None,
        split_rule: str | None = None,
        dp_kinds: tuple[str, ...] | None = None,
        profile: EngineProfile | str | None = None,
        moe_folding: bool = False,
    ) -> None:
        self.g = graph
        self.cluster = cluster
        # pins (``Searcher.configs`` reads them too): a pinned dp_kind is never upgraded by
        # ``evaluate_auto``, a pinned sequence_parallel counts in ``epcp_why``; capacity_factor is taken out
        self.fixed = dict(fixed or {})
        self.dtype = dtype
        self.optimizer = optimizer
        # the engine whose conventions price every configuration (cost_models.engine_profiles): the
        # coster's when one is given, else ``profile`` (None = meshplan's runtime)
        self.coster = coster or GraphCoster(graph, cluster, dtype=dtype, optimizer=optimizer, profile=profile)
        self.profile = engine_profile(profile) if profile is not None else self.coster.profile
        ep = self.profile
        self.quant = self.coster.quant.mode != "none"
        # whose model-state layout (dp_kinds.STATE_LAYOUTS): "torch" = meshplan's runtime (fp32 parameters
        # and optimizer states on every path); an engine's configuration is costed with its own
        self.state_layout = ep.state_layout
        # what a sharded kind gathers at once (dp_kinds.FSDP_UNITS): "block" = FSDP2 per repeated block,
        # as meshplan's runtime wraps; "module" = DeepSpeed ZeRO-3's per-module gathers (an engine's)
        self.fsdp_units = ep.fsdp_units
        # how its ZeRO-3 runs the collectives (dp_kinds.ZERO3_IMPLS): FSDP2's, or DeepSpeed 2021's
        # per-tensor gathers (three under full recompute) and 16-bit gradient all-reduce
        self.zero3_impl = ep.zero3_impl
        # bytes per element of the gradients DP syncs and of the parameters FSDP gathers: the
        # training dtype (bf16 mixed precision: 2; fp32 training: 4)
        self.elem_bytes = 4 if dtype in ("fp32", "float32") else 2
        # an engine's stage-split rule (partition.engine_split; None = the profile's) and DP kinds
        # (meshplan plan --target)
        if split_rule is None:
            split_rule = ep.split_rule
        if split_rule not in SPLIT_RULES:
            raise ValueError(f"split_rule must be one of {', '.join(SPLIT_RULES)}, got {split_rule!r}")
        self.split_rule = split_rule
        self.dp_kinds = tuple(dp_kinds) if dp_kinds else tuple(KIND_ORDER)
        # MoE load imbalance assumed by the costing (busiest expert rank / mean); a setting, not a pin
        self.capacity_factor = float(self.fixed.pop("capacity_factor", DEFAULT_CAPACITY_FACTOR))
        # how ddp reduces gradients (grad_sync.DDP_IMPLS): "torch" = bucketed and overlapped with the
        # last backward, as meshplan's runtime and torch DDP run it; "local" = Megatron-LM's own
        # wrapper, one flat all-reduce after backward (an engine costing option, estimate_graph)
        self.ddp_impl = ep.ddp_impl
        # whose pipeline runtime holds the per-microbatch buffers (allocator.PP_BUFFERS): "torch" =
        # torch.distributed.pipelining, as meshplan's runtime and torchtitan run it; "megatron" = none
        self.pp_buffers = ep.pp_buffers
        # Megatron-Core's MoE parallel folding (planner.epcp_cost, cost_models.epcp): a tp rank routes
        # and computes its 1/tp sequence shard over an ep group of consecutive ranks, expert gradients
        # reduced over the expert data-parallel group; an engine costing option (estimate_graph),
        # never the planner's own plans (meshplan's runtime replicates the MoE block over tp)
        self.moe_folding = bool(moe_folding)
        # how the engine runs the optimizer update (cost_models.eager_ops.OPTIMIZER_IMPLS; estimate_graph sets it)
        self.optimizer_impl = ep.optimizer_impl
        # Megatron-LM's scatter/gather between pipeline stages (SC'21 §4.1, an engine costing option of
        # estimate_graph): without SP each tp rank sends 1/tp of the boundary activation and the
        # receiving stage all-gathers it inside its node; meshplan's runtime sends it whole
        self.pp_scatter_gather = ep.pp_scatter_gather
        self.mem_limit = int(cluster.usable_mem_bytes)
        self._rescues = 0
        self.memo_kind_free = True  # evaluate shares its DP-kind-free part across kinds
        self.epcp_nodes = [n for n in self.g.nodes if n.kind in ("moe", "attention")]  # what EP/CP terms read
        self.memos = CostMemos()  # every memo (planner.cost_memos)
        # the table-only ones shared with the other searches on this coster (a world-size sweep)
        share_table_memos(self.memos, self.coster.search_memos, dtype, optimizer)
        # what ``p2p_time`` reads of the cluster: its hardware, whatever the device count (search_memos.solve_split)
        self.links_key = repr(cluster.with_devices(cluster.devices_per_node))
        self._kind_notes: dict[Config, str] = {}  # why evaluate_auto chose a kind other than ddp
        self._all_kinds_fit: set[Config] = set()  # evaluate_auto found every DP kind it tried fitting
        check_training_dtype(dtype, cluster)
        if dtype == "fp8" and self.quant:
            raise ValueError(f"dtype fp8 (torchao float8 training) with quantization {self.coster.quant.mode!r}: "
                             "torchao converts plain nn.Linear layers only; use --dtype bf16 with quantization")
        self.largest_linear = max((n.param_numel for n in graph.nodes if n.kind == "linear"), default=0)
        # parameter tensors a per-tensor ZeRO-3 gathers one by one (the rest stay whole on every rank:
        # DeepSpeed's stage3_param_persistence_threshold)
        self.gathered_sizes = [float(n.param_numel) for n in graph.nodes if n.param_numel >= ZERO3_PERSISTENCE_NUMEL]

    def quant_errors(self, c: Config) -> list[str]:
        """Why the runtime would reject the quantization at ``c``'s TP placement and FSDP degree
        (``cost_models.quant.quant_constraint_errors``); empty without quantization."""
        if not self.quant:
            return []
        sol = self.table(c).tp_solution
        fsdp_dp = self._shard(c) if ZERO_STAGE[c.dp_kind] >= 3 else 1
        key = (id(sol), fsdp_dp)
        if key not in self.memos.quant_errors:
            self.memos.quant_errors[key] = self.coster.quant_errors(sol, fsdp_dp)
        return self.memos.quant_errors[key]

    # ---- costs shared by bound and evaluation --------------------------------------------
    def table(self, c: Config) -> CostTable:
        # cp: a rank holds micro_batch sequences of seq_len/cp tokens, the work of micro_batch/cp
        # sequences (attention included, with the causal 2*cp split): cost_models/epcp.py
        mb = c.micro_batch if c.cp == 1 else c.micro_batch / c.cp
        return self.coster.table(c.tp, c.sequence_parallel, c.recompute, mb)  # type: ignore[arg-type]

    def epcp_why(self, tp: int, pp: int, cp: int, ep: int, recompute: str) -> str:
        """``execution_rules.epcp_rule`` (what the runtime refuses) for these degrees; a pinned
        sequence_parallel counts (otherwise cp/ep configurations are costed without SP). Memoized per
        degrees (``Searcher.configs`` asks it once per microbatch size and schedule)."""
        key = (tp, pp, cp, ep, recompute)
        if key not in self.memos.epcp_why:
            self.memos.epcp_why[key] = self._epcp_rule(tp, pp, cp, ep, recompute)
        return self.memos.epcp_why[key]

    def _epcp_rule(self, tp: int, pp: int, cp: int, ep: int, recompute: str) -> str:
        if cp > 1 and "forward_params" in self.g.meta:  # graphs traced before the names were recorded: unknown
            why = cp_forward_blocker(str(self.g.meta.get("model_class", "")), self.g.meta["forward_params"],
                                     self.g.meta.get("seq_positions", ()))
            if why:
                return why
        return epcp_rule(cp=cp, ep=ep, tp=tp, pp=pp, seq_len=self.g.seq_len,
                         num_experts=int(self.g.meta.get("num_experts", 0) or 0), recompute=recompute,
                         quantized=self.quant, sequence_parallel=bool(self.fixed.get("sequence_parallel")),
                         capture=self.g.capture)

    def _epcp_key(self, c: Config) -> tuple:
        """What ``c``'s EP/CP terms depend on (the dp degree only under MoE parallel folding)."""
        return (c.cp, c.ep, c.micro_batch, c.tp, c.recompute, self.moe_folding, c.dp if self.moe_folding else 0)

    def epcp_prefix(self, c: Config) -> EPCPPrefix:
        """The EP/CP terms of every MoE / attention node for ``c``'s degrees, prefix-summed (memoized)."""
        key = self._epcp_key(c)
        if key not in self.memos.epcp_prefix:
            self.memos.epcp_prefix[key] = EPCPPrefix(
                self.g, self.cluster, self.epcp_nodes, cp=c.cp, ep=c.ep, micro_batch=c.micro_batch,
                dtype=self.dtype, capacity_factor=self.capacity_factor, elem_bytes=self.elem_bytes, tp=c.tp,
                recompute=c.recompute, stride=c.tp,  # ep and cp groups: dc-row positions, tp apart
                folding=self.moe_folding, dp=c.dp,  # folded: the ep group laid out on its own
                fp8_recipe=self.coster.profile.fp8_recipe,  # under fp8: TE recipes run the experts in fp8
                memo=self.memos.epcp_node, copies=self._epcp_copies)
        return self.memos.epcp_prefix[key]

    def has_epcp(self, c: Config) -> bool:
        """Whether ``c`` has EP/CP terms: cp or ep > 1, or MoE parallel folding at tp > 1."""
        return c.cp * c.ep > 1 or (self.moe_folding and c.tp > 1)

    def expert_dp_group(self, c: Config) -> tuple[int, int]:
        """(size, rank stride) of the group expert gradients are reduced over: their dp·cp/ep
        replicas tp·ep apart (meshplan's runtime, runtime/epcp), or folded the expert data-parallel
        group, dp·cp·tp/ep ranks ep apart (``cost_models.epcp.folded_expert_mesh``)."""
        if self.moe_folding and c.tp > 1:
            m = folded_expert_mesh(c.dp * c.cp * c.tp, c.ep)
            return m.edp, m.edp_stride
        return c.dp * c.cp // c.ep, c.tp * c.ep

    @functools.cached_property
    def _epcp_copies(self) -> list[tuple]:
        """Per EP/CP node, a key equal for the nodes at the same place of repeated layers of one type
        (the cost table's prototype layers, ``GraphCoster.table``: a block's copies cost the same)."""
        where: dict[int, tuple] = {}
        for _name, a, b, _kind, tid in self.coster.ranges:
            if tid:
                for i in range(a, b):
                    where[i] = (tid, b - a, i - a)
        return [where.get(n.id, ("node", n.id)) for n in self.epcp_nodes]

    @functools.cached_property
    def expert_param_count(self) -> float:
        """All experts' parameters of the graph (``epcp_cost.expert_params``)."""
        return expert_params(self.g, self.epcp_nodes)

    def epcp(self, c: Config) -> EPCPTerms:
        """The whole model's EP/CP terms per microbatch (``planner.epcp_cost.epcp_terms``)."""
        key = self._epcp_key(c)
        if key not in self.memos.epcp_whole:
            self.memos.epcp_whole[key] = self.epcp_prefix(c).whole()
        return self.memos.epcp_whole[key]

    def epcp_stages(self, c: Config, t: CostTable, runs: list[tuple[int, int]]) -> list[EPCPTerms]:
        """``_epcp`` per pipeline stage: over the MoE / attention nodes of the stage's layers."""
        key = (self._epcp_key(c), id(t), tuple(runs))  # per search: the prefix reads this cluster
        if key not in self.memos.epcp_stages:
            pre = self.epcp_prefix(c)
            self.memos.epcp_stages[key] = [pre.terms(t.layers[a].node_start, t.layers[b - 1].node_end) for a, b in runs]
        return self.memos.epcp_stages[key]

    def _shard(self, c: Config) -> int:
        """Ranks ``c``'s model states are sharded over (``dp_kinds.shard_degree``; mesh (pp, dp, tp):
        a DP group's ranks are tp apart)."""
        return shard_degree(c.dp_kind, c.dp, stride=c.tp, devices_per_node=self.cluster.devices_per_node)

    def _zero_divs(self, c: Config) -> tuple[int, int, int]:
        """Divisors of (parameter, gradient, optimizer) bytes under ``c``'s ZeRO stage (memoized)."""
        key = (c.dp_kind, c.dp, c.tp, self.state_layout)
        if key not in self.memos.zero_divs:
            s, z = self._shard(c), state_zero_stage(c.dp_kind, self.state_layout)
            self.memos.zero_divs[key] = (s if z >= 3 else 1, s if z >= 2 else 1, s if z >= 1 else 1)
        return self.memos.zero_divs[key]

    @property
    def _precision(self) -> str:
        """The ``memory.PRECISIONS`` row of the model states (``dp_kinds.state_precision``)."""
        return state_precision(self.state_layout, self.dtype)

    @property
    def unsharded_state_bytes(self) -> ModelStateBytes:
        """Model-state bytes per parameter without sharding (memoized per layout: read per stage)."""
        key = (self.state_layout, self.dtype, self.optimizer)
        if key not in self.memos.unsharded:
            self.memos.unsharded[key] = model_state_bytes(1.0, optimizer=self.optimizer, precision=self._precision)
        return self.memos.unsharded[key]

    def _states(self, params: float, c: Config) -> float:
        return dp_state_bytes(params, c.dp_kind, c.dp, stride=c.tp, devices_per_node=self.cluster.devices_per_node,
                              optimizer=self.optimizer, precision=self._precision, layout=self.state_layout).total  # fmt: skip

    def _optimizer_s(self, params: float, c: Config) -> float:
        """Optimizer step on the rank's shard with gradient-norm clipping, memory bound
        (``eager_ops.optimizer_step_s``: the update by ``optimizer_impl``, fused 28 B/param)."""
        local = params / self._zero_divs(c)[2]
        return optimizer_step_s(local, self.cluster, impl=self.optimizer_impl, optimizer=self.optimizer)

    def dp_collectives(self, params_bytes: float, grad_bytes: float, c: Config):  # -> dp_kinds.DPComm
        # FSDP units at pp = 1: the runtime wraps every repeated block, then the root
        units = sum(len(b.instances) for b in self.g.blocks) + 1
        per_tensor = self.zero3_impl == "deepspeed-2021"  # the share gathered only when needed, at its tp shard
        late = unprefetched_share([x / c.tp for x in self.gathered_sizes]) if per_tensor else 0.0
        return dp_comm(c.dp_kind, grad_bytes, params_bytes, c.dp * c.cp, self.cluster, stride=c.tp, pp=c.pp,
                       num_microbatches=c.num_microbatches, units=units, impl=self.zero3_impl,
                       recompute_regather=c.recompute == "full", tensors=len(self.gathered_sizes),
                       unprefetched=late)  # fmt: skip

    def dp_collectives_split(self, params_bytes: float, grad_bytes: float, expert_params: float, c: Config) -> DPComm:
        """``_dp_comm``; with ``expert_params`` (> 0 only under MoE parallel folding: the rank's held
        expert parameters) those are gathered / reduced over the expert data-parallel group
        (``expert_dp_group``) and the rest over dp·cp, one after the other (two communicators)."""
        if expert_params <= 0 or c.dp_kind in ("none", "ddp"):  # ddp's split is evaluate's (bucketed)
            return self.dp_collectives(params_bytes, grad_bytes, c)
        eg, ep_ = expert_params * GRAD_REDUCE_BYTES, expert_params * self.elem_bytes
        dense = self.dp_collectives(params_bytes - ep_, grad_bytes - eg, c)
        grp, gst = self.expert_dp_group(c)
        units = sum(len(b.instances) for b in self.g.blocks) + 1
        exp = dp_comm(c.dp_kind, eg, ep_, grp, self.cluster, stride=gst, pp=c.pp,
                      num_microbatches=c.num_microbatches, units=units)  # fmt: skip
        return add_dp_comm(dense, exp)

    def expert_state_bytes_per_param(self, c: Config) -> ModelStateBytes:
        """Model-state bytes per expert parameter under folding: sharded over the expert dp group."""
        grp, gst = self.expert_dp_group(c)
        key = (c.dp_kind, -grp, gst, self.state_layout)  # the same engine layout as _state_bytes_per_param
        if key not in self.memos.state_bytes:
            self.memos.state_bytes[key] = dp_state_bytes(1.0, c.dp_kind, grp, stride=gst, optimizer=self.optimizer,
                                                  devices_per_node=self.cluster.devices_per_node,
                                                  precision=self._precision, layout=self.state_layout)  # fmt: skip
        return self.memos.state_bytes[key]

    def pp_spans(self, c: Config) -> bool:
        """Whether any pipeline send (rank r to r + 1, and the interleaved wrap) crosses nodes
        (``comm.p2p_crosses_nodes``; pipeline ranks are dp·cp·tp apart in the mesh): the
        pessimistic link for a stage split's p2p term."""
        stride, dpn = c.dp * c.cp * c.tp, self.cluster.devices_per_node
        return c.pp > 1 and any(p2p_crosses_nodes(r, (r + 1) % c.pp, stride, dpn) for r in range(c.pp))

    def p2p_time(self, c: Config) -> Callable[[float], float]:
        """Seconds of one stage-to-stage send of b bytes on ``c``'s slowest pipeline link."""
        cross = self.pp_spans(c)
        return lambda b: p2p_time_s(b, self.cluster, crosses_nodes=cross)

    def lower_bound(self, c: Config) -> tuple[float, float]:
        """(step-time lower bound, memory lower bound) without splitting or simulating (memoized per
        configuration and engine layout: the search, the memory floor and ``_fit`` ask again)."""
        ckey = (c, self.state_layout, self.optimizer_impl)
        hit = self.memos.bound.get(ckey)
        if hit is None:
            hit = self.memos.bound[ckey] = self._lower_bound(c)
        return hit

    def _lower_bound(self, c: Config) -> tuple[float, float]:
        key = (c.tp, c.sequence_parallel, c.recompute, c.micro_batch, c.cp, c.ep, c.dp if self.moe_folding else 0)
        if key not in self.memos.lower_bound_part:  # what does not depend on pp, m, the schedule or the DP kind
            t = self.table(c)
            P = self.prefix(t)
            work = P["f"][-1] + P["b"][-1] + P["w"][-1]
            if self.has_epcp(c):  # the stages' EP/CP terms sum to the model's (the expert-read saving is <= 0)
                work += self.epcp(c).per_microbatch_s
            saved = self.expert_param_count * (1.0 - 1.0 / c.ep) if c.ep > 1 else 0.0  # epcp_cost.expert_params_saved
            self.memos.lower_bound_part[key] = (work, P["params"][-1] - saved, P)
        work, params, P = self.memos.lower_bound_part[key]
        avg_params = params / c.pp  # ep: E/ep experts per rank
        if self.quant:  # only trainable parameters are synced and stepped
            dv = self._zero_divs(c)
            step = c.num_microbatches * work / c.pp + self._optimizer_s(P["train"][-1] / c.pp, c)
            mem = (P["sp"][-1] / dv[0] + P["sg"][-1] / dv[1] + P["so"][-1] / dv[2]) / c.pp
        else:
            step = c.num_microbatches * work / c.pp + self._optimizer_s(avg_params, c)
            skey = (avg_params, c.dp_kind, c.dp, c.tp, self.state_layout, self.dtype)
            if skey not in self.memos.states:
                self.memos.states[skey] = self._states(avg_params, c)
            mem = self.memos.states[skey]
        if c.schedule == "gpipe" and c.pp > 1:
            mem += c.num_microbatches * P["act"][-1] / c.pp
        return step, mem

    def memory_floor(self, c: Config, mlb: float) -> float:
        """A per-device memory lower bound of ``c`` for any stage split and any DP kind, given ``mlb``
        (``bound``'s: the average rank's model states under the kind that shards most, gpipe's
        activations): rank r needs at least states_r + activations_r x inflight_r, so the busiest
        needs at least the average of that over the pipeline ranks, which is at least the average
        states (with what the kind holds unsharded: ``memory_floor.held_floor``) + the average
        activations x the fewest in-flight microbatches any rank holds."""
        P = self.prefix(self.table(c))
        acts = min(self.inflight_ranks(c)) * P["act"][-1] / c.pp
        held = c.num_microbatches * P["act"][-1] / c.pp if c.schedule == "gpipe" and c.pp > 1 else 0.0  # in mlb
        return held_floor(self, c, mlb, max(0.0, acts - held))  # type: ignore[arg-type]

    def inflight_ranks(self, c: Config) -> list[float]:
        """``pipeline_time.inflight`` of every pipeline rank of ``c`` (memoized per schedule shape; read only)."""
        key = (c.schedule, c.pp, c.num_microbatches, c.virtual_stages)
        if key not in self.memos.inflight:
            self.memos.inflight[key] = [inflight(c, r) for r in range(c.pp)]
        return self.memos.inflight[key]

    def tied_layers(self, t: CostTable) -> list[int]:
        """Indices of ``t``'s layers that read a tied weight (``LayerCost.tied``), ascending (memoized)."""
        key = id(t)
        if key not in self.memos.tied:
            self.memos.tied[key] = [j for j, x in enumerate(t.layers) if x.tied]
        return self.memos.tied[key]

    def rescue_possible(self, c: Config, mlb: float, floor: float) -> bool:
        """Whether costing ``c`` might spend a memory re-split (``ConfigEvaluator._fit``: a kind
        that could fit by its bound, within 25 % of the limit, one stage per rank, rescues left)."""
        return (mlb <= self.mem_limit and floor <= 1.25 * self.mem_limit and c.virtual_stages == 1
                and self.split_rule == "any" and 1 < c.pp <= 32 and self._rescues < MAX_MEMORY_RESCUES)  # fmt: skip

    # ---- exact evaluation ----------------------------------------------------------------
    def split(self, t: CostTable, num_stages: int, virtual_stages: int = 1) -> list[tuple[int, int]]:
        """The time-balanced split, or under an engine's split rule the legal one with the smallest
        bottleneck (``Searcher.configs`` only enumerates stage counts the rule can split)."""
        rule = rule_for(self.split_rule, virtual_stages)
        key = (id(t), num_stages, rule)
        if key not in self.memos.split:
            costs = [layer.total_s for layer in t.layers]
            runs = balanced_split(costs, num_stages) if rule == "any" else rule_split(
                costs, [x.kind == "block" for x in t.layers], rule, num_stages)  # fmt: skip
            if runs is None:
                raise ValueError(f"no {rule!r} split of {len(t.layers)} layers into {num_stages} stages")
            self.memos.split[key] = runs
        return self.memos.split[key]

    def prefix(self, t: CostTable) -> dict[str, list[float]]:
        """Prefix sums of the per-layer columns of ``t`` (stage sums in O(1)), and under "largest" the
        largest layer's parameter count."""
        key = id(t)
        if key not in self.memos.prefix:
            layers = t.layers

            def run(vals: list[float]) -> list[float]:  # [0.0, v0, v0 + v1, ...], summed left to right
                return list(accumulate(vals, initial=0.0))

            cols: dict[str, list[float]] = {
                "f": run([x.fwd_total_s for x in layers]), "b": run([x.bwd_input_total_s for x in layers]),
                "w": run([x.bwd_weight_s for x in layers]), "rec": run([x.recompute_s for x in layers]),
                "tp": run([x.tp_comm_s for x in layers]), "params": run([x.param_count for x in layers]),
                "act": run([x.act_bytes for x in layers]), "sp": run([x.state_param_bytes for x in layers]),
                "sg": run([x.state_grad_bytes for x in layers]), "so": run([x.state_opt_bytes for x in layers]),
                "train": run([x.trainable_params for x in layers]),
                "cast": run([x.autocast_bytes for x in layers]),
            }  # fmt: skip
            cols["largest"] = [max((x.param_count for x in layers), default=0.0)]
            self.memos.prefix[key] = cols
        return self.memos.prefix[key]

    def state_bytes_per_param(self, c: Config) -> ModelStateBytes:
        key = (c.dp_kind, c.dp, c.tp, self.state_layout)
        if key not in self.memos.state_bytes:
            self.memos.state_bytes[key] = dp_state_bytes(1.0, c.dp_kind, c.dp, stride=c.tp, optimizer=self.optimizer,
                                                  devices_per_node=self.cluster.devices_per_node,
                                                  precision=self._precision, layout=self.state_layout)  # fmt: skip
        return self.memos.state_bytes[key]

    def runs_autocast(self, c: Config) -> bool:
        """Whether ``c`` trains under ``torch.autocast`` on fp32 parameters, as meshplan's runtime
        (``runtime/precision.py``) and torchtitan do whenever FSDP2's MixedPrecisionPolicy does not
        hold the parameters in the compute dtype (no sharded DP kind over dp > 1); Megatron-LM and
        DeepSpeed keep 16-bit parameters instead (their ``state_layout``)."""
        return self.state_layout == "torch" and not (c.dp > 1 and c.dp_kind in SHARDED_DP_KINDS)

    def split_layers(self, c: Config) -> list[Any]:
        """``c``'s layers as ``partition.stage_ilp.Layer`` (times, model states, activations, sends)."""
        from meshplan.partition.stage_ilp import Layer

        t = self.table(c)
        per_param = self.state_bytes_per_param(c).total
        dv = self._zero_divs(c)
        cast = self.runs_autocast(c)  # kept per microbatch as the activations are (evaluate)

        def states(x: LayerCost) -> int:
            if self.quant:
                return int(x.state_param_bytes / dv[0] + x.state_grad_bytes / dv[1] + x.state_opt_bytes / dv[2])
            return int(x.param_count * per_param)

        return [
            Layer(x.name, fwd_s=x.fwd_total_s, bwd_s=x.bwd_input_total_s + x.bwd_weight_s, bwd_weight_s=x.bwd_weight_s,
                  state_bytes=states(x), act_bytes=int(x.act_bytes + (x.autocast_bytes if cast else 0.0)),
                  boundary_bytes=int(x.out_bytes))
            for x in t.layers
        ]  # fmt: skip

    def transient(self, t: CostTable, runs: list[tuple[int, int]]) -> float:
        """Bytes a rank holds on top of its stored activations while back-propagating, one
        microbatch at a time: the larger of the cross-entropy backward's buffers
        (``LayerCost.loss_peak_bytes``, at the start of that microbatch's backward) and the largest
        recompute transient of its layers (``LayerCost.transient_bytes``, one layer re-run at a
        time) less what the loss kept for that microbatch, freed before any block's backward.
        Memoized per (table, runs): configurations differing only in m, schedule or DP kind share it."""
        key = (id(t), tuple(runs))
        if key not in self.memos.transient:
            layers = [x for a, b in runs for x in t.layers[a:b]]
            worst = max((x.transient_bytes for x in layers), default=0.0)
            loss_peak = max((x.loss_peak_bytes for x in layers), default=0.0)
            self.memos.transient[key] = max(0.0, loss_peak, worst - sum(x.loss_bytes for x in layers))
        return self.memos.transient[key]

    def fsdp_buffer(self, c: Config, stage_params: float = 0.0) -> float:
        """What a parameter-sharding kind holds unsharded (``dp_kinds.unsharded_buffer_bytes``:
        two layers' weights at pp = 1, the stage's weights and gradients under PP; else 0)."""
        return unsharded_buffer_bytes(
            c.dp_kind, c.dp, stage_param_count=stage_params, elem_bytes=self.elem_bytes, pp=c.pp,
            largest_layer_params=self._largest_unit(c), layout=self.state_layout,
        )  # fmt: skip

    def _largest_unit(self, c: Config) -> float:
        """Parameters per rank of the largest unit a sharded kind gathers (``dp_kinds.FSDP_UNITS``):
        the largest layer (block, or the root's embedding / head), or under "module" the largest
        linear (its TP shard)."""
        if self.fsdp_units == "module":
            return self.largest_linear / c.tp
        return self.prefix(self.table(c))["largest"][0]

    def stream_pools(self, c: Config, t: CostTable, runs: list[tuple[int, int]], on_rank: list[list[int]]) -> float:
        """The largest of the pipeline ranks' FSDP2 side-stream pools (``allocator.fsdp_stream_pool_bytes``):
        units are a rank's repeated blocks and its other layers together (the root's, or its stage's,
        ``fully_shard``); 0 for kinds that do not run FSDP2 (ddp, zero1) or without sharding.
        ``runs``: the stages' layer ranges, ``on_rank``: each pipeline rank's stages (memoized per
        table, split and placement: the same for every configuration sharing them)."""
        if ZERO_STAGE[c.dp_kind] < 2 or self._shard(c) == 1 or self.fsdp_units != "block":
            return 0.0
        key = (id(t), tuple(runs), tuple(tuple(x) for x in on_rank))
        if key not in self.memos.pools:
            pools = []
            for stages in on_rank:
                idx = [i for s_ in stages for i in range(*runs[s_])]
                units = [t.layers[i].param_count for i in idx if t.layers[i].kind == "block"]
                units.append(sum(t.layers[i].param_count for i in idx if t.layers[i].kind != "block"))
                pools.append(fsdp_stream_pool_bytes(units, param_bytes=self.elem_bytes, reduce_bytes=GRAD_REDUCE_BYTES))
            self.memos.pools[key] = max(pools, default=0.0)
        return self.memos.pools[key]

    def fsdp_buffers(self, c: Config, rank_params: list[float]) -> list[float]:
        """``fsdp_buffer`` of every pipeline rank (its parameters ``rank_params[r]``), the table looked up once."""
        largest = self._largest_unit(c)
        return [unsharded_buffer_bytes(c.dp_kind, c.dp, stage_param_count=p, elem_bytes=self.elem_bytes, pp=c.pp,
                                       largest_layer_params=largest, layout=self.state_layout)
                for p in rank_params]  # fmt: skip

    def memory_split(self, c: Config) -> list[tuple[int, int]] | None:
        """A memory-feasible split from ``partition.stage_ilp.split_stages`` (its exact DP, v = 1)
        when the time-balanced split does not fit; None when it finds none."""
        from meshplan.errors import NoFeasiblePlanError

        if (
            c.virtual_stages != 1
            or self.split_rule != "any"  # the memory DP splits freely
            or not 1 < c.pp <= 32
            or self._rescues >= MAX_MEMORY_RESCUES
        ):
            return None
        self._rescues += 1
        try:
            split = solve_split(
                self, c, self.split_layers(c), pp=c.pp, num_microbatches=c.num_microbatches, schedule=c.schedule,
                virtual_stages=1, mem_limit_bytes=self.mem_limit, method="dp", explain=False,
            )  # fmt: skip
        except (NoFeasiblePlanError, ValueError):
            return None
        return [tuple(r) for r in split.ranges]  # type: ignore[misc]
