"""The coster: ``ConfigEvaluator``, costing one point of the search space of one graph on one
cluster under one engine profile; ``planner.search.Searcher`` holds one (``Searcher.costs``),
``planner.estimate.estimate_config`` calls one with a ``Config``.

Its public API: ``evaluate(config)`` gives an ``Evaluation`` (a frozen dataclass): stage split
(time-balanced, or the memory-constrained DP of ``partition.stage_ilp`` when that does not fit),
memory per pipeline rank, exposed DP gradient sync, optimizer step and (``exact``) the schedule
simulator's makespan; ``lower_bound`` / ``bound`` are the cheap (step, memory) bounds the search
orders candidates by, ``memory_floor`` the memory bound it skips them by; ``evaluate_auto``
upgrades DDP to the fastest DP kind that fits; ``table``, ``prefix``, ``split``, ``transient``
the cost tables, their prefix sums, the stage split and the recompute transient the terms share.
The formulas are in ``planner.search``'s docstring.

It is one object built from its parts, no base class: the model states, optimizer step and DP
collectives are its ``states`` (``planner.state_costs.StateCosts``), the EP / CP terms its
``ep_cp`` (``planner.epcp_coster.EPCPCosts``); the DP-kind-free part of an evaluation is
``planner.kind_free`` (memoized here across kinds), the memory floors ``planner.memory_floor``,
both reading this coster through a Protocol; the exposed DP communication is
``planner.dp_exposure``. Every memo is one ``CostMemos`` (``memos``). With a ``Quantization`` on
the graph coster, model states, gradient sync and the optimizer step count the quantized layout.
No torch import.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import replace
from itertools import accumulate
from operator import add
from typing import Any

from meshplan.cost_models.comm import p2p_crosses_nodes, p2p_time_s
from meshplan.cost_models.dp_kinds import KIND_ORDER, ZERO_STAGE
from meshplan.cost_models.engine_profiles import EngineProfile
from meshplan.cost_models.engine_profiles import profile as engine_profile
from meshplan.cost_models.epcp import DEFAULT_CAPACITY_FACTOR
from meshplan.cost_models.hardware import ClusterSpec, with_attention_backend
from meshplan.cost_models.precision import check_training_dtype
from meshplan.graph import ModelGraph
from meshplan.partition.engine_split import SPLIT_RULES, rule_for, rule_split
from meshplan.plan.execution_rules import dp_kind_blocker, sequence_parallel_blocker
from meshplan.planner.cost_memos import CostMemos
from meshplan.planner.costing import CostTable, GraphCoster, LayerCost
from meshplan.planner.dp_exposure import exposed_dp_s, kind_note
from meshplan.planner.epcp_coster import EPCPCosts
from meshplan.planner.kind_free import KindFreeTerms, kind_free_terms
from meshplan.planner.memory_floor import held_floor
from meshplan.planner.pipeline_time import inflight
from meshplan.planner.search_memos import share_epcp_memos, share_table_memos, solve_split
from meshplan.planner.search_types import Config, Evaluation, balanced_split
from meshplan.planner.state_costs import StateCosts

__all__ = ["MAX_MEMORY_RESCUES", "ConfigEvaluator", "exposed_dp_s", "kind_note"]

#: At most this many memory-constrained re-splits (partition.stage_ilp DP) per search.
MAX_MEMORY_RESCUES = 8


class ConfigEvaluator:
    """Costs configurations of one graph on one cluster (see the module docstring)."""

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
        # an engine's stage-split rule (partition.engine_split; None = the profile's) and DP kinds
        # (meshplan plan --target)
        if split_rule is None:
            split_rule = ep.split_rule
        if split_rule not in SPLIT_RULES:
            raise ValueError(f"split_rule must be one of {', '.join(SPLIT_RULES)}, got {split_rule!r}")
        self.split_rule = split_rule
        # ... of those, the kinds the engine version has (EngineProfile.dp_kinds): a kind it lacks is
        # never proposed (Megatron-LM before its distributed optimizer has ddp alone)
        self.dp_kinds = tuple(k for k in (dp_kinds or KIND_ORDER) if k in ep.dp_kinds)
        # whose pipeline runtime holds the per-microbatch buffers (allocator.PP_BUFFERS): "torch" =
        # torch.distributed.pipelining, as meshplan's runtime and torchtitan run it; "megatron" = none
        self.pp_buffers = ep.pp_buffers
        # Megatron-LM's scatter/gather between pipeline stages (SC'21 §4.1): without SP each tp rank
        # sends 1/tp of the boundary activation and the receiving stage all-gathers it inside its
        # node; meshplan's runtime sends it whole
        self.pp_scatter_gather = ep.pp_scatter_gather
        # DeepSpeed's PipelineEngine: blocking exchanges of partitioned tensors (cost_models.pipe_p2p)
        self.pp_p2p = ep.pp_p2p
        # the engine's own gradient pass after every microbatch's backward (cost_models.grad_accum)
        self.grad_accum_pass = ep.grad_accum_pass
        self.recompute_unit = ep.recompute_unit  # what one checkpoint region re-runs under a pipeline
        self.mem_limit = int(cluster.usable_mem_bytes)
        self._rescues = 0
        self.memo_kind_free = True  # evaluate shares its DP-kind-free part across kinds
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
        # its parts: the EP / CP terms and the model states, optimizer and DP collectives
        # bytes per element of the gradients DP syncs and of the parameters FSDP gathers: the
        # training dtype (bf16 mixed precision: 2; fp32 training: 4)
        elem = 4 if dtype in ("fp32", "float32") else 2
        self.ep_cp = EPCPCosts(
            graph, with_attention_backend(cluster, self.coster.profile.attention_backend),  # the engine's attention
            self.coster, self.memos, dtype=dtype, elem_bytes=elem,
            capacity_factor=float(self.fixed.pop("capacity_factor", DEFAULT_CAPACITY_FACTOR)),
            moe_folding=moe_folding, sp_pinned=bool(self.fixed.get("sequence_parallel")), quant=self.quant)  # fmt: skip
        # its EP / CP memos shared with the other searches on this coster too (they read no device count)
        share_epcp_memos(self.memos, self.coster.search_memos, self.ep_cp.capacity_factor, elem, self.ep_cp.moe_folding)
        # tables: a weak reference to this evaluator (which holds the StateCosts), so that no reference
        # cycle keeps a finished search's evaluator, memos and evaluations alive until a cyclic-GC pass
        self.states = StateCosts(graph, cluster, dtype=dtype, optimizer=optimizer, profile=ep, elem_bytes=elem,
                                 memos=self.memos, tables=weakref.proxy(self), ep_cp=self.ep_cp,
                                 quant_mode=self.coster.quant.mode)  # fmt: skip

    @property
    def moe_folding(self) -> bool:
        """Whether MoE parallel folding is costed (``EPCPCosts.moe_folding``)."""
        return self.ep_cp.moe_folding

    def quant_errors(self, c: Config) -> list[str]:
        """Why the runtime would reject the quantization at ``c``'s TP placement and FSDP degree
        (``cost_models.quant.quant_constraint_errors``); empty without quantization."""
        if not self.quant:
            return []
        sol = self.table(c).tp_solution
        fsdp_dp = self.states.shard(c) if ZERO_STAGE[c.dp_kind] >= 3 else 1
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
        ckey = (c, self.states.layout_key, self.states.optimizer_impl)
        hit = self.memos.bound.get(ckey)
        if hit is None:
            hit = self.memos.bound[ckey] = self._lower_bound(c)
        return hit

    def _lower_bound(self, c: Config) -> tuple[float, float]:
        # what does not depend on m or the schedule: the work per microbatch, the optimizer step, the
        # model states and the activations per microbatch, per (table's fields, cp, ep, dp, pp, kind)
        rkey = (c.tp, c.sequence_parallel, c.recompute, c.micro_batch, c.cp, c.ep, c.dp, c.pp, c.dp_kind)
        rest = self.memos.lower_bound_rest.get(rkey)
        if rest is None:
            key = (c.tp, c.sequence_parallel, c.recompute, c.micro_batch, c.cp, c.ep, c.dp if self.ep_cp.moe_folding else 0)
            if key not in self.memos.lower_bound_part:  # what does not depend on pp, m, the schedule or the DP kind
                t = self.table(c)
                P = self.prefix(t)
                work = P["f"][-1] + P["b"][-1] + P["w"][-1]
                if self.ep_cp.has_epcp(c):  # the stages' EP/CP terms sum to the model's (the expert-read saving is <= 0)
                    work += self.ep_cp.epcp(c).per_microbatch_s
                saved = self.ep_cp.expert_param_count * (1.0 - 1.0 / c.ep) if c.ep > 1 else 0.0  # epcp_cost.expert_params_saved
                self.memos.lower_bound_part[key] = (work, P["params"][-1] - saved, P)
            work, params, P = self.memos.lower_bound_part[key]
            rest = self.memos.lower_bound_rest[rkey] = (work, *self._bound_states(c, params, P), P["act"][-1])
        work, opt, mem, act = rest
        step = c.num_microbatches * work / c.pp + opt
        if c.schedule == "gpipe" and c.pp > 1:
            mem += c.num_microbatches * act / c.pp
        return step, mem

    def _bound_states(self, c: Config, params: float, P: dict[str, list[float]]) -> tuple[float, float]:
        """``_lower_bound``'s (optimizer seconds, model-state bytes) of the average pipeline rank."""
        avg_params = params / c.pp  # ep: E/ep experts per rank
        if self.quant:  # only trainable parameters are synced and stepped
            dv = self.states.zero_divs(c)
            return (self.states.optimizer_s(P["train"][-1] / c.pp, c),
                    (P["sp"][-1] / dv[0] + P["sg"][-1] / dv[1] + P["so"][-1] / dv[2]) / c.pp)  # fmt: skip
        skey = (avg_params, c.dp_kind, c.dp, c.tp, self.states.layout_key, self.dtype)
        if skey not in self.memos.states:
            self.memos.states[skey] = self.states.total_state_bytes(avg_params, c)
        return self.states.optimizer_s(avg_params, c), self.memos.states[skey]

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
            # a layer's time as the step sees it: its device time, or its host dispatch time where
            # that is longer (the host-dispatch floor, cost_models.host; 0 without host figures)
            costs = [max(layer.total_s, layer.host_fwd_s + layer.host_bwd_s) for layer in t.layers]
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
                "cast": run([x.autocast_bytes for x in layers]), "wg": run([x.wgrad_bytes for x in layers]),
                "castw": run([x.autocast_weight_bytes for x in layers]),
                "hf": run([x.host_fwd_s for x in layers]), "hb": run([x.host_bwd_s for x in layers]),
                "castx": run([x.autocast_expert_bytes for x in layers]),
                "cachew": run([x.autocast_cache_bytes for x in layers]),
                "remat": run([x.autocast_remat_bytes for x in layers]),
                "castp": run([x.autocast_cast_params for x in layers]),
                "recastp": run([x.autocast_recast_params for x in layers]),
                "gcastp": run([x.autocast_cast_params if x.autocast_gradcast_params < 0 else x.autocast_gradcast_params
                               for x in layers]),
                "actf": run([x.autocast_act.forward for x in layers]),
                "actb": run([x.autocast_act.backward for x in layers]),
                "actfw": run([x.autocast_act.forward_widening for x in layers]),
                "actbw": run([x.autocast_act.backward_widening for x in layers]),
                "actrf": run([x.autocast_act.forward if x.autocast_act_recomputed else 0.0 for x in layers]),
                "actrfw": run([x.autocast_act.forward_widening if x.autocast_act_recomputed else 0.0 for x in layers]),
            }  # fmt: skip
            cols["largest"] = [max((x.param_count for x in layers), default=0.0)]
            self.memos.prefix[key] = cols
        return self.memos.prefix[key]

    def split_layers(self, c: Config) -> list[Any]:
        """``c``'s layers as ``partition.stage_ilp.Layer`` (times, model states, activations, sends)."""
        from meshplan.partition.stage_ilp import Layer

        t = self.table(c)
        per_param = self.states.state_bytes_per_param(c).total
        dv = self.states.zero_divs(c)
        cast = self.states.runs_autocast(c)  # autocast's kept bytes: per microbatch, as the activations are
        once = cast and self.autocast_once(c)  # of them, the weight copies once per stage, as its states are

        def states(x: LayerCost) -> int:
            if self.quant:
                return int(x.state_param_bytes / dv[0] + x.state_grad_bytes / dv[1] + x.state_opt_bytes / dv[2])
            return int(x.param_count * per_param)

        def held_once(x: LayerCost) -> float:
            return x.autocast_weight_bytes if once else 0.0

        return [
            Layer(x.name, fwd_s=x.fwd_total_s, bwd_s=x.bwd_input_total_s + x.bwd_weight_s, bwd_weight_s=x.bwd_weight_s,
                  state_bytes=states(x) + int(held_once(x)),
                  act_bytes=int(x.act_bytes + (x.autocast_bytes - held_once(x) + x.autocast_expert_bytes / c.ep
                                               if cast else 0.0)),
                  boundary_bytes=int(x.out_bytes))
            for x in t.layers
        ]  # fmt: skip

    def autocast_once(self, c: Config) -> bool:
        """Whether autocast's weight copies are held once per stage for the step, not per
        microbatch in flight: a pipeline whose engine runs the whole step in one autocast region
        (``EngineProfile.autocast_cache`` "step": meshplan's runtime, ``precision.step_cast_cache``),
        under a recompute kind that keeps the saved copies (``LayerCost.autocast_weight_bytes``)."""
        return self.profile.autocast_cache == "step" and c.pp > 1 and c.recompute in ("none", "selective")

    def transient(self, t: CostTable, runs: list[tuple[int, int]], whole: bool = False, cast: bool = False) -> float:
        """Bytes a rank holds on top of its stored activations while back-propagating, one
        microbatch at a time: the larger of the cross-entropy backward's buffers
        (``LayerCost.loss_peak_bytes``, at the start of that microbatch's backward) and the largest
        recompute transient of its layers (``LayerCost.transient_bytes``, one layer re-run at a
        time, with what one of its ops works in, ``LayerCost.work_bytes``: QLoRA's dequantization)
        less what the loss kept for that microbatch, freed before any block's backward.
        With ``whole`` (``EngineProfile.recompute_unit`` "stage" under a pipeline) each run is one
        checkpoint region: its layers' transients are rematerialized together (the largest run's sum);
        with ``cast`` (the layers run under autocast) a re-run layer also holds its
        ``LayerCost.autocast_remat_bytes`` and an op works in ``LayerCost.autocast_work_bytes`` more.
        Memoized per (table, runs): configurations differing only in m, schedule or DP kind share it."""
        key = (id(t), tuple(runs), whole, cast)
        if key not in self.memos.transient:
            layers = [x for a, b in runs for x in t.layers[a:b]]

            def remat(x: LayerCost) -> float:
                return x.transient_bytes + (x.autocast_remat_bytes if cast else 0.0)

            def work(x: LayerCost) -> float:
                return x.work_bytes + (x.autocast_work_bytes if cast else 0.0)

            # inside a layer's backward: what recompute re-ran beside what one of its ops works in
            # (QLoRA's dequantization, QAT's fake quantization)
            worst = max((remat(x) + work(x) for x in layers), default=0.0)
            if whole:
                worst = max((sum(remat(x) for x in t.layers[a:b]) + max(work(x) for x in t.layers[a:b])
                             for a, b in runs if b > a), default=0.0)
            loss_peak = max((x.loss_peak_bytes for x in layers), default=0.0)
            self.memos.transient[key] = max(0.0, loss_peak, worst - sum(x.loss_bytes for x in layers))
        return self.memos.transient[key]

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

    def sp_for(self, tp: int) -> bool:
        """Sequence parallelism for a TP degree: on when its placement is no slower (it always
        saves activation memory), off for tp = 1 or a sequence tp does not divide."""
        if tp not in self.memos.sp_choice:
            if "sequence_parallel" in self.fixed:
                self.memos.sp_choice[tp] = bool(self.fixed["sequence_parallel"]) and tp > 1
            elif tp == 1 or self.g.seq_len % tp or self.g.seq_len <= 1:
                self.memos.sp_choice[tp] = False
            elif self.sp_blocker(tp):
                self.memos.sp_choice[tp] = False
            else:
                a = self.coster.tp_solution(tp, False).objective
                b = self.coster.tp_solution(tp, True).objective
                self.memos.sp_choice[tp] = b <= a * 1.001
        return self.memos.sp_choice[tp]

    def sp_blocker(self, tp: int) -> str:
        """Why the runtime would refuse sequence parallelism at this TP degree ("" when it runs):
        its own rule on the traced module tree and the placement solved with sequence parallelism."""
        meta = self.g.meta
        if "module_lists" not in meta:
            return "the graph records no module tree (traced by an older meshplan); re-trace"
        styles = self.coster.tp_solution(tp, True).styles
        return sequence_parallel_blocker(meta["module_lists"], meta.get("param_modules") or {}, styles)

    def may_change_kind(self, c: Config) -> bool:
        # cp/ep configurations run their own gradient reduction (runtime/epcp): no other DP kind
        return c.dp_kind == "ddp" and "dp_kind" not in self.fixed and c.cp * c.ep == 1

    def other_kinds(self, c: Config) -> list[Config]:
        """The sharded kinds ``c`` may take instead of DDP (``dp_kinds.KIND_ORDER``), each as
        the runtime would accept it; hsdp only where it differs from fsdp (dp spans nodes)."""
        if c in self.memos.other_kinds:
            return self.memos.other_kinds[c]
        out = []
        for kind in KIND_ORDER[1:]:
            if kind not in self.dp_kinds:
                continue
            c2 = c.but(dp_kind=kind)
            if kind == "hsdp" and self.states.shard(c2) in (1, c.dp):
                continue
            if dp_kind_blocker(dp=c.dp, tp=c.tp, pp=c.pp, schedule=c.schedule, dp_kind=kind):
                continue  # the runtime would refuse it (meshplan.plan.execution_rules)
            if not self.quant_errors(c2):
                out.append(c2)
        self.memos.other_kinds[c] = out
        return out

    def evaluate_auto(self, c: Config, *, exact: bool = True) -> Evaluation:
        """``evaluate`` over the data-parallel kinds (DP not pinned): the fastest kind that fits
        among ddp, zero1, zero2, hsdp and fsdp, or the smallest when none fits."""
        ev = base = self._fit(c)
        all_fit = base.fits
        if self.may_change_kind(c) and c.dp > 1:
            others = self.other_kinds(c)
            if others and c.dp_kind not in self.dp_kinds:  # an engine without ddp (torchtitan before 2024-08)
                ev, others = self._fit(others[0]), others[1:]
                all_fit = ev.fits
            for c2 in others:
                ev2 = self._fit(c2)
                all_fit = all_fit and ev2.fits
                if (ev2.fits, -ev2.step_s if ev2.fits else -ev2.max_mem_bytes) > (
                    ev.fits, -ev.step_s if ev.fits else -ev.max_mem_bytes
                ):
                    ev = ev2
        if all_fit:
            self._all_kinds_fit.add(c)
        if ev is not base:
            self._kind_notes[ev.config] = kind_note(ev, base)
            ev = replace(ev, kind_note=self._kind_notes[ev.config])
        return self.evaluate(ev.config, runs=ev.stage_layers) if exact and ev.fits else ev

    def _fit(self, c: Config) -> Evaluation:
        """Bound-evaluate ``c`` on the time-balanced split; if that does not fit but might with
        another split (within 25 %), try the stage split's memory-constrained DP."""
        ev = self.evaluate(c, exact=False)
        could_fit = self.lower_bound(c)[1] <= self.mem_limit  # same configs in fast and exhaustive runs
        if not ev.fits and could_fit and ev.max_mem_bytes <= 1.25 * self.mem_limit:
            runs = self.memory_split(c)
            if runs is not None:
                ev2 = self.evaluate(c, exact=False, runs=runs)
                if ev2.fits:
                    return ev2
        return ev

    def every_kind_fits(self, c: Config) -> bool:
        """Whether ``evaluate_auto`` costed ``c`` with every DP kind it tried fitting (``Searcher.dominated``)."""
        return c in self._all_kinds_fit

    def bound(self, c: Config) -> tuple[float, float]:
        lb, mlb = self.lower_bound(c)
        if self.may_change_kind(c) and c.dp > 1:
            for c2 in self.other_kinds(c):
                lb2, mlb2 = self.lower_bound(c2)
                lb, mlb = min(lb, lb2), min(mlb, mlb2)
        return lb, mlb

    def evaluate(
        self, c: Config, *, exact: bool = True, runs: list[tuple[int, int]] | None = None
    ) -> Evaluation:
        """Cost ``c``: stage split, memory, DP sync, optimizer and (``exact``) the simulated
        makespan. With ``exact=False`` the makespan is the lower bound
        ``max_k (Σ_{s<k} F_s + m·T_k)`` (v = 1; the k-th stage cannot start before the first
        microbatch reaches it and then works m·T_k) or ``m · busiest rank`` (v > 1), and the
        result's ``exact`` is False.

        Memory of pipeline rank r: model states of its stages (``model_state_bytes``, ZeRO-3 over
        dp for fsdp) + its stages' activations per microbatch × ``inflight_microbatches``
        (schedule, pp, r, m, v) (+ two unsharded layers' weights for fsdp).

        What does not depend on the DP kind (split, stage times and activations, sends, makespan)
        is computed once per (configuration but its kind, ``exact``, ``runs``) and shared by the
        kinds ``evaluate_auto`` tries (``_kind_free``; ``memo_kind_free = False`` turns that off)."""
        k = self._kind_free(c, exact, runs)
        t, m, runs, ranks, on_rank = k.t, k.m, k.runs, k.ranks, k.on_rank
        st_q, r_q, ec, worst, rank_work = k.st_q, k.r_q, k.ec, k.worst, k.rank_work
        bpp = self.states.state_bytes_per_param(c)
        per_param = bpp.total
        dv = self.states.zero_divs(c)
        if self.quant:
            st_state = [q[0] / dv[0] + q[1] / dv[1] + q[2] / dv[2] for q in st_q]
        else:  # exactly model_state_bytes per parameter (ZeRO-3 over dp for fsdp)
            st_state = [p * per_param for p in k.st_params0]
        r_state = k.rank_sum(st_state)  # per rank, in stage order
        qlora = self.coster.quant.mode == "qlora"  # QAT trains and reduces every parameter, as unquantized
        emb_g = 0.0 if qlora else self.states.embedding_grad_extra(c)  # rank 0 holds the embedding
        r_state[0] += emb_g
        ddp_b = 0.0 if qlora else self.states.ddp_bucket_bytes(c, k.r_params[0])  # pp = 1: one rank
        r_state[0] += ddp_b
        if ec.expert_params_saved:  # ep: a rank holds E/ep experts of the MoE layers it holds
            r_state = [s - e * per_param for s, e in zip(r_state, k.ep_cut)]
        folded = self.ep_cp.moe_folding and c.tp > 1
        if folded and not self.quant:  # folded: expert states sharded over the expert dp group, not dp
            per_e = self.states.expert_state_bytes_per_param(c).total
            r_state = [s + x / c.ep * (per_e - per_param) for s, x in zip(r_state, k.r_experts)]
        r_params, r_act = k.r_params, k.r_act
        buf = self.states.fsdp_buffers(c, r_params, runs, on_rank)
        rs_grads = 0.0  # sharded gradients the reserved figure holds beside the live peak (below)
        cast = k.r_cast if self.states.runs_autocast(c) else [0.0 for _ in ranks]
        live = list(map(add, r_act, cast))
        # meshplan's BucketedGradSync (cp / ep at pp = 1): every reduced gradient's flat copy at the
        # backward's end; under ep the experts' only where they have replicas (dp·cp > ep: at ep = dp·cp
        # epcp.EPCPState.attach leaves them unsynced, no bucket)
        unq = self.coster.quant.mode in ("none", "qat")  # QAT trains and reduces every parameter
        reduced = r_params[0] - (k.r_experts[0] / c.ep if c.ep > 1 and c.dp * c.cp == c.ep else 0.0)
        flats = reduced * bpp.grads if self.states.grad_sync_flats(c) and unq else 0.0
        if self.states.grads_after_activations(c) and unq:
            # one microbatch, no pipeline, no DDP bucket: gradients come into being in the backward
            # as the activations it consumes are freed (the step ends with zero_grad(set_to_none)),
            # so the peak holds the larger of the two, not both (measured: benchmarks/bench_memory.py;
            # QAT trains every parameter as unquantized; QLoRA's adapters are priced with their states)
            g0 = r_params[0] * bpp.grads + emb_g
            # the backward's end: the gradients beside what recompute rematerializes of the first layer
            end = g0 + flats + max((x.transient_bytes for a, b in runs for x in t.layers[a:b]), default=0.0)
            before, live[0] = live[0], max(live[0], end) - g0
            if c.dp_kind in ("fsdp", "zero2", "hsdp") and c.dp * c.cp > 1:
                # reserved, not live: FSDP2 allocates the sharded gradients (its reduce-scatter
                # output) on its reduce-scatter stream (_fsdp_collectives.foreach_reduce), whose
                # allocator pool cannot take the blocks the default stream's freed activations
                # leave (allocator.fsdp_stream_pool_bytes): the reserved peak holds both
                rs_grads = max(before, end - g0) - max(before, end) + g0
        elif flats:  # gradients held through the step (microbatches): beside the activations or the flats
            live[0] = max(live[0], flats)
        emb_new = self.states.embedding_grad_new(c) if emb_g > 0 else 0.0
        if emb_new:  # a later microbatch's embedding backward (rank 0): its own activations freed by then,
            # the others in flight kept (gpipe: the second backward's, after all forwards, m - 2 of them)
            act0 = sum(k.st_act[i] for i in on_rank[0])
            others = max(0.0, k.infl[0] - (2 if c.schedule == "gpipe" and c.pp > 1 else 1))
            live[0] = max(live[0], others * act0 + cast[0] + emb_new)
        fp8_copy = k.fp8_copy
        r_mem = [int(s + x + b + fp8_copy + q) for s, x, b, q in zip(r_state, live, buf, k.r_pipe)]
        # meshplan's runtime with 16-bit main gradients (state_layout "zero", runtime/apply/master_state.py): the
        # update reads an fp32 copy of the gradients of the masters this rank owns, made for the step, beside the
        # states (activations gone): a peak of its own where the activations were smaller
        copies = [0.0 for _ in ranks]
        if self.states.master_state and bpp.grads < 4 and not self.quant:
            copies = [r_params[r] * 4 / max(1, self.states.shard(c)) for r in ranks]
            r_mem = [max(m_, int(r_state[r] + copies[r])) for m_, r in zip(r_mem, ranks)]
        if self.states.fsdp_steps(c):
            # FSDP2 per block without a pipeline, unit by unit (cost_models.fsdp_units): the root's
            # gathered weights and held gradients, a block's reduce-scatter buffers, the sharded
            # gradients where they exist (in fsdp_step_peak), beside the sharded weights and states
            g_sh = (r_q[0][3] if self.quant else r_params[0]) * bpp.grads  # QLoRA: the adapters' only
            peak = self.states.fsdp_step_peak(c, r_act[0] + cast[0])
            r_mem[0] = int(r_state[0] - g_sh + peak + k.fp8_copy + k.r_pipe[0])
        d, dp_exposed = self.states.dp_sync(c, grad_bytes=k.grad_bytes, gather_bytes=k.gather_bytes,
                                            experts=k.r_experts[worst] / c.ep, backward_s=k.rank_b[worst],
                                            forward_s=k.rank_f[worst], microbatch_s=max(rank_work), params=k.r_params[worst],
                                            quantized=self.quant, recompute_s=k.rec_s / max(1, m))  # fmt: skip
        dp_bytes = d.bytes
        opt = self.states.optimizer_s(max(q[3] for q in r_q) if self.quant else max(r_params), c)
        # exposed EP all-to-all and CP ring, expert imbalance: inside the stage times (kind_free_terms),
        # so inside the makespan; k.ep_s / cp_s / read_s are the busiest pipeline rank's share
        step = k.makespan + dp_exposed + opt
        comm_bytes = {key: int(v * m / c.pp) for key, v in t.tp_comm_bytes.items()}
        for key, v in k.epcp_bytes.items():
            comm_bytes[key] = comm_bytes.get(key, 0) + int(v)
        for key, v in dp_bytes.items():
            comm_bytes[key] = comm_bytes.get(key, 0) + v
        if c.pp > 1:
            comm_bytes["send_recv"] = k.send_recv
        w = r_params[worst]
        mem_breakdown = {"params": int(w * bpp.params), "grads": int(w * bpp.grads),
                         "optimizer": int(w * bpp.optimizer), "activations": int(max(r_act))}  # fmt: skip
        if max(cast) > 0:  # autocast's weight copies and fp32 norm inputs (LayerCost.autocast_bytes): live
            mem_breakdown["autocast_kept"] = int(cast[worst])
        if max(copies) > 0:  # the step's fp32 gradient copies (16-bit main gradients), beside the states
            mem_breakdown["step_grad_copies"] = int(copies[worst])
        if c.pp > 1 and max(k.r_pipe) > 0:  # live: in peak_mem_bytes
            mem_breakdown["pipeline_buffers"] = int(max(k.r_pipe))
        pools = self.states.stream_pools(c, t, runs, on_rank)
        if pools:  # reserved by the allocator, not live: not in peak_mem_bytes (allocator.reserved_peak_bytes)
            mem_breakdown["fsdp_stream_pools"] = int(pools)
        if flats > 0:  # live at the backward's end, in peak_mem_bytes: BucketedGradSync's flat copies
            mem_breakdown["grad_sync_flats"] = int(flats)
        if ddp_b > 0:  # live, in peak_mem_bytes: DDP's Reducer buckets
            mem_breakdown["ddp_buckets"] = int(ddp_b)
        if emb_g > 0:  # live, in peak_mem_bytes: a vocab-parallel embedding's whole gradient (DTensor TP)
            mem_breakdown["embedding_grad_whole"] = int(emb_g)
        if rs_grads > 0:  # reserved, not live: the sharded gradients in the reduce-scatter stream's pool
            mem_breakdown["fsdp_rs_stream_grads"] = int(rs_grads)
        if self.quant:
            big = max(ranks, key=lambda r: r_state[r])
            mem_breakdown.update(params=int(r_q[big][0] / dv[0]), grads=int(r_q[big][1] / dv[1]),
                                 optimizer=int(r_q[big][2] / dv[2]))  # fmt: skip
        st_act, st_infl = k.st_act, k.st_infl
        return Evaluation(
            config=c, step_s=step, pipeline_s=k.makespan, compute_s=k.compute, tp_comm_s=k.tp_s,
            pp_comm_s=k.pp_comm, dp_comm_s=dp_exposed, bubble_s=k.bubble, optimizer_s=opt,
            recompute_s=k.rec_s, bubble_fraction=k.bubble_frac, peak_mem_bytes=tuple(r_mem),
            mem_breakdown=mem_breakdown, comm_bytes=comm_bytes, stage_layers=list(runs),
            stage_times=list(k.stage_times),
            stage_mem=[int(s + a * f) for s, a, f in zip(st_state, st_act, st_infl)],
            stage_send_bytes=list(k.st_sendb), stage_params=list(k.st_params), fits=max(r_mem) <= self.mem_limit,
            mem_limit_bytes=self.mem_limit, table=t, exact=exact, kind_note=self._kind_notes.get(c, ""),
            ep_comm_s=k.ep_s, cp_comm_s=k.cp_s, ep_expert_read_s=k.read_s,
        )  # fmt: skip

    def _kind_free(self, c: Config, exact: bool, runs: list[tuple[int, int]] | None) -> KindFreeTerms:
        """The part of ``evaluate`` that does not depend on ``c.dp_kind``, memoized (read only)."""
        key = (c.dp, c.tp, c.pp, c.micro_batch, c.num_microbatches, c.schedule, c.virtual_stages, c.recompute,
               c.sequence_parallel, c.cp, c.ep, exact, tuple(runs) if runs is not None else None,
               self.states.zero_divs(c)[1] if self.grad_accum_pass == "autograd" else 1,  # dp_kind: its grad sharding
               self.states.runs_autocast(c))  # dp_kind: whether autocast casts the parameters (kind_free_terms)
        if self.memo_kind_free and key in self.memos.kind_free:
            return self.memos.kind_free[key]
        out = kind_free_terms(self, c, exact, runs)
        if self.memo_kind_free:
            self.memos.kind_free[key] = out
        return out
