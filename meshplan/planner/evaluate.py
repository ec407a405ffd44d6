"""Costing one point of the search space: ``ConfigEvaluator``, the base of ``planner.search.Searcher``.

``evaluate(config)`` gives an ``Evaluation``: stage split (time-balanced, or the memory-constrained
DP of ``partition.stage_ilp`` when that does not fit), memory per pipeline rank, exposed DP
gradient sync, optimizer step and (``exact``) the schedule simulator's makespan; ``lower_bound``
is the cheap (step, memory) bound the search orders candidates by; ``evaluate_auto`` upgrades DDP
to FSDP when DDP does not fit. The formulas are in ``planner.search``'s docstring. With a
``Quantization`` on the coster, model states, gradient sync and the optimizer step count the
quantized layout. No torch import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from meshplan.cost_models.comm import p2p_crosses_nodes, p2p_time_s
from meshplan.cost_models.dp_kinds import (
    KIND_ORDER,
    ZERO_STAGE,
    dp_comm,
    dp_state_bytes,
    shard_degree,
    unsharded_buffer_bytes,
)
from meshplan.cost_models.epcp import DEFAULT_CAPACITY_FACTOR
from meshplan.cost_models.grad_sync import GRAD_REDUCE_BYTES, overlapped_sync_exposed_s, uniform_bucket_bytes
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.cost_models.memory import ModelStateBytes, model_state_bytes
from meshplan.cost_models.precision import check_training_dtype, fp8_weight_copy_bytes
from meshplan.execution_rules import dp_kind_blocker, epcp_rule
from meshplan.graph import ModelGraph
from meshplan.partition.engine_split import SPLIT_RULES, rule_for, rule_split
from meshplan.planner.costing import CostTable, GraphCoster, LayerCost
from meshplan.planner.epcp_cost import EPCPTerms, epcp_terms, expert_params, expert_params_saved
from meshplan.planner.pipeline_time import inflight, makespan_lower_bound, simulated_makespan
from meshplan.planner.pipeline_time import placement as stage_placement
from meshplan.planner.search_types import (
    RECOMPUTE_CHOICES,
    SCHEDULE_CHOICES,
    Config,
    Evaluation,
    balanced_split,
)

#: At most this many memory-constrained re-splits (partition.stage_ilp DP) per search.
MAX_MEMORY_RESCUES = 8


class ConfigEvaluator:
    """Costs configurations of one graph on one cluster (see the module docstring)."""

    def __init__(
        self,
        graph: ModelGraph,
        cluster: ClusterSpec,
        *,
        global_batch: int,
        fixed: dict[str, Any] | None = None,
        recompute: tuple[str, ...] | None = None,
        schedules: tuple[str, ...] | None = None,
        dtype: str = "bf16",
        optimizer: str = "adam",
        progress: Callable[[str], None] | None = None,
        coster: GraphCoster | None = None,
        keep_alternatives: int = 5,
        ilp_split: bool = True,
        split_rule: str = "any",
        dp_kinds: tuple[str, ...] | None = None,
    ) -> None:
        self.g = graph
        self.cluster = cluster
        self.W = cluster.num_devices
        self.B = global_batch
        self.fixed = dict(fixed or {})
        self.recompute = tuple(recompute or RECOMPUTE_CHOICES)
        if "recompute" in self.fixed and self.fixed["recompute"] not in self.recompute:
            self.recompute = (*self.recompute, self.fixed["recompute"])
        self.schedules = tuple(schedules or SCHEDULE_CHOICES)
        self.dtype = dtype
        self.optimizer = optimizer
        self.progress = progress or (lambda _msg: None)
        self.coster = coster or GraphCoster(graph, cluster, dtype=dtype, optimizer=optimizer)
        self.quant = self.coster.quant.mode != "none"
        self._bpp0 = model_state_bytes(1.0, optimizer=optimizer)
        # bytes per element of the gradients DP syncs and of the parameters FSDP gathers: the
        # training dtype (bf16 mixed precision: 2; fp32 training: 4)
        self._elem_bytes = 4 if dtype in ("fp32", "float32") else 2
        self._quant_err: dict[tuple[int, int], list[str]] = {}
        self.keep = keep_alternatives
        # an engine's stage-split rule (partition.engine_split) and DP kinds (meshplan plan --target);
        # the split ILP's refinement ignores the rule, so it is off under one
        if split_rule not in SPLIT_RULES:
            raise ValueError(f"split_rule must be one of {', '.join(SPLIT_RULES)}, got {split_rule!r}")
        self.split_rule = split_rule
        self.dp_kinds = tuple(dp_kinds) if dp_kinds else tuple(KIND_ORDER)
        self.ilp_split = ilp_split and split_rule == "any"
        # MoE load imbalance assumed by the costing (busiest expert rank / mean); a setting, not a pin
        self.capacity_factor = float(self.fixed.pop("capacity_factor", DEFAULT_CAPACITY_FACTOR))
        self.bounded: list[tuple[float, float, Config]] = []
        self.mem_limit = int(cluster.usable_mem_bytes)
        self._split_cache: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self._prefix_cache: dict[int, dict[str, list[float]]] = {}
        self._bpp_cache: dict[tuple[str, int], ModelStateBytes] = {}
        self._rescues = 0
        self.memo_kind_free = True  # evaluate shares its DP-kind-free part across kinds
        self._kind_free_memo: dict[tuple[Config, bool, tuple | None], SimpleNamespace] = {}
        self._sp_choice: dict[int, bool] = {}
        self.rule_notes: dict[str, str] = {}  # configurations the runtime refuses, left out (execution_rules)
        self._kind_notes: dict[Config, str] = {}  # why evaluate_auto chose a kind other than ddp
        self._every_kind_fits: set[Config] = set()  # evaluate_auto found every DP kind it tried fitting
        check_training_dtype(dtype, cluster)
        if dtype == "fp8" and self.quant:
            raise ValueError(f"dtype fp8 (torchao float8 training) with quantization {self.coster.quant.mode!r}: "
                             "torchao converts plain nn.Linear layers only; use --dtype bf16 with quantization")
        self._largest_linear = max((n.param_numel for n in graph.nodes if n.kind == "linear"), default=0)

    def _auto(self, c: Config) -> bool:
        # cp/ep configurations run their own gradient reduction (runtime/epcp): no other DP kind
        return c.dp_kind == "ddp" and "dp_kind" not in self.fixed and c.cp * c.ep == 1

    def _other_kinds(self, c: Config) -> list[Config]:
        """The sharded kinds ``c`` may take instead of DDP (``dp_kinds.KIND_ORDER``), each as
        the runtime would accept it; hsdp only where it differs from fsdp (dp spans nodes)."""
        out = []
        for kind in KIND_ORDER[1:]:
            if kind not in self.dp_kinds:
                continue
            c2 = replace(c, dp_kind=kind)
            if kind == "hsdp" and self._shard(c2) in (1, c.dp):
                continue
            if dp_kind_blocker(dp=c.dp, tp=c.tp, pp=c.pp, schedule=c.schedule, dp_kind=kind):
                continue  # the runtime would refuse it (meshplan.execution_rules)
            if not self.quant_errors(c2):
                out.append(c2)
        return out

    def evaluate_auto(self, c: Config, *, exact: bool = True) -> Evaluation:
        """``evaluate`` over the data-parallel kinds (DP not pinned): the fastest kind that fits
        among ddp, zero1, zero2, hsdp and fsdp, or the smallest when none fits."""
        ev = base = self._fit(c)
        all_fit = base.fits
        if self._auto(c) and c.dp > 1:
            for c2 in self._other_kinds(c):
                ev2 = self._fit(c2)
                all_fit = all_fit and ev2.fits
                if (ev2.fits, -ev2.step_s if ev2.fits else -ev2.max_mem_bytes) > (
                    ev.fits, -ev.step_s if ev.fits else -ev.max_mem_bytes
                ):
                    ev = ev2
        if all_fit:
            self._every_kind_fits.add(c)
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

    def quant_errors(self, c: Config) -> list[str]:
        """Why the runtime would reject the quantization at ``c``'s TP placement and FSDP degree
        (``cost_models.quant.quant_constraint_errors``); empty without quantization."""
        if not self.quant:
            return []
        sol = self._table(c).tp_solution
        fsdp_dp = self._shard(c) if ZERO_STAGE[c.dp_kind] >= 3 else 1
        key = (id(sol), fsdp_dp)
        if key not in self._quant_err:
            self._quant_err[key] = self.coster.quant_errors(sol, fsdp_dp)
        return self._quant_err[key]

    def bound(self, c: Config) -> tuple[float, float]:
        lb, mlb = self.lower_bound(c)
        if self._auto(c) and c.dp > 1:
            for c2 in self._other_kinds(c):
                lb2, mlb2 = self.lower_bound(c2)
                lb, mlb = min(lb, lb2), min(mlb, mlb2)
        return lb, mlb

    # ---- costs shared by bound and evaluation --------------------------------------------
    def _table(self, c: Config) -> CostTable:
        # cp: a rank holds micro_batch sequences of seq_len/cp tokens, the work of micro_batch/cp
        # sequences (attention included, with the causal 2*cp split): cost_models/epcp.py
        mb = c.micro_batch if c.cp == 1 else c.micro_batch / c.cp
        return self.coster.table(c.tp, c.sequence_parallel, c.recompute, mb)  # type: ignore[arg-type]

    def epcp_why(self, tp: int, pp: int, cp: int, ep: int, recompute: str) -> str:
        """``execution_rules.epcp_rule`` (what the runtime refuses) for these degrees; a pinned
        sequence_parallel counts (otherwise cp/ep configurations are costed without SP)."""
        return epcp_rule(cp=cp, ep=ep, tp=tp, pp=pp, seq_len=self.g.seq_len,
                         num_experts=int(self.g.meta.get("num_experts", 0) or 0), recompute=recompute,
                         quantized=self.quant, sequence_parallel=bool(self.fixed.get("sequence_parallel")))

    def _epcp(self, c: Config) -> EPCPTerms:
        return epcp_terms(self.g, self.cluster, cp=c.cp, ep=c.ep, micro_batch=c.micro_batch, dtype=self.dtype,
                          capacity_factor=self.capacity_factor, elem_bytes=self._elem_bytes, tp=c.tp,
                          recompute=c.recompute, stride=c.tp)  # ep and cp groups: dc-row positions, tp apart

    def _shard(self, c: Config) -> int:
        """Ranks ``c``'s model states are sharded over (``dp_kinds.shard_degree``; mesh (pp, dp, tp):
        a DP group's ranks are tp apart)."""
        return shard_degree(c.dp_kind, c.dp, stride=c.tp, devices_per_node=self.cluster.devices_per_node)

    def _zero_divs(self, c: Config) -> tuple[int, int, int]:
        """Divisors of (parameter, gradient, optimizer) bytes under ``c``'s ZeRO stage."""
        s, z = self._shard(c), ZERO_STAGE[c.dp_kind]
        return (s if z >= 3 else 1, s if z >= 2 else 1, s if z >= 1 else 1)

    def _states(self, params: float, c: Config) -> float:
        return dp_state_bytes(params, c.dp_kind, c.dp, stride=c.tp, devices_per_node=self.cluster.devices_per_node,
                              optimizer=self.optimizer).total  # fmt: skip

    def _optimizer_s(self, params: float, c: Config) -> float:
        """Optimizer step: memory bound, 16 B/param read and written, on the rank's shard."""
        local = params / self._zero_divs(c)[2]
        return 2 * 16 * local / (self.cluster.mem_bw_bytes_per_s * self.cluster.mem_efficiency)

    def _dp_comm(self, params_bytes: float, grad_bytes: float, c: Config):  # -> dp_kinds.DPComm
        # FSDP units at pp = 1: the runtime wraps every repeated block, then the root
        units = sum(len(b.instances) for b in self.g.blocks) + 1
        return dp_comm(c.dp_kind, grad_bytes, params_bytes, c.dp * c.cp, self.cluster, stride=c.tp, pp=c.pp,
                       num_microbatches=c.num_microbatches, units=units)  # fmt: skip

    def _pp_spans(self, c: Config) -> bool:
        """Whether any pipeline send (rank r to r + 1, and the interleaved wrap) crosses nodes
        (``comm.p2p_crosses_nodes``; pipeline ranks are dp·cp·tp apart in the mesh): the
        pessimistic link for a stage split's p2p term."""
        stride, dpn = c.dp * c.cp * c.tp, self.cluster.devices_per_node
        return c.pp > 1 and any(p2p_crosses_nodes(r, (r + 1) % c.pp, stride, dpn) for r in range(c.pp))

    def p2p_time(self, c: Config) -> Callable[[float], float]:
        """Seconds of one stage-to-stage send of b bytes on ``c``'s slowest pipeline link."""
        cross = self._pp_spans(c)
        return lambda b: p2p_time_s(b, self.cluster, crosses_nodes=cross)

    def lower_bound(self, c: Config) -> tuple[float, float]:
        """(step-time lower bound, memory lower bound) without splitting or simulating."""
        t = self._table(c)
        P = self._prefix(t)
        work = P["f"][-1] + P["b"][-1] + P["w"][-1]
        avg_params = (P["params"][-1] - expert_params_saved(self.g, c.ep)) / c.pp  # ep: E/ep experts per rank
        if self.quant:  # only trainable parameters are synced and stepped
            dv = self._zero_divs(c)
            step = c.num_microbatches * work / c.pp + self._optimizer_s(P["train"][-1] / c.pp, c)
            mem = (P["sp"][-1] / dv[0] + P["sg"][-1] / dv[1] + P["so"][-1] / dv[2]) / c.pp
        else:
            step = c.num_microbatches * work / c.pp + self._optimizer_s(avg_params, c)
            mem = self._states(avg_params, c)
        if c.schedule == "gpipe" and c.pp > 1:
            mem += c.num_microbatches * P["act"][-1] / c.pp
        return step, mem

    # ---- exact evaluation ----------------------------------------------------------------
    def split(self, t: CostTable, num_stages: int, virtual_stages: int = 1) -> list[tuple[int, int]]:
        """The time-balanced split, or under an engine's split rule the legal one with the smallest
        bottleneck (``Searcher.configs`` only enumerates stage counts the rule can split)."""
        rule = rule_for(self.split_rule, virtual_stages)
        key = (id(t), num_stages, rule)
        if key not in self._split_cache:
            costs = [layer.total_s for layer in t.layers]
            runs = balanced_split(costs, num_stages) if rule == "any" else rule_split(
                costs, [x.kind == "block" for x in t.layers], rule, num_stages)  # fmt: skip
            if runs is None:
                raise ValueError(f"no {rule!r} split of {len(t.layers)} layers into {num_stages} stages")
            self._split_cache[key] = runs
        return self._split_cache[key]

    def _prefix(self, t: CostTable) -> dict[str, list[float]]:
        """Prefix sums of the per-layer columns of ``t`` (stage sums in O(1)), and under "largest" the
        largest layer's parameter count."""
        key = id(t)
        if key not in self._prefix_cache:
            cols: dict[str, list[float]] = {k: [0.0] for k in ("f", "b", "w", "rec", "tp", "params", "act")}
            for x in t.layers:
                for k, v in (("f", x.fwd_total_s), ("b", x.bwd_input_total_s), ("w", x.bwd_weight_s),
                             ("rec", x.recompute_s), ("tp", x.tp_comm_s), ("params", x.param_count),
                             ("act", x.act_bytes), ("sp", x.state_param_bytes), ("sg", x.state_grad_bytes),
                             ("so", x.state_opt_bytes), ("train", x.trainable_params)):  # fmt: skip
                    cols.setdefault(k, [0.0]).append(cols[k][-1] + v)
            cols["largest"] = [max((x.param_count for x in t.layers), default=0.0)]
            self._prefix_cache[key] = cols
        return self._prefix_cache[key]

    def _state_bytes_per_param(self, c: Config) -> ModelStateBytes:
        key = (c.dp_kind, c.dp, c.tp)
        if key not in self._bpp_cache:
            self._bpp_cache[key] = dp_state_bytes(1.0, c.dp_kind, c.dp, stride=c.tp, optimizer=self.optimizer,
                                                  devices_per_node=self.cluster.devices_per_node)  # fmt: skip
        return self._bpp_cache[key]

    def split_layers(self, c: Config) -> list[Any]:
        """``c``'s layers as ``partition.stage_ilp.Layer`` (times, model states, activations, sends)."""
        from meshplan.partition.stage_ilp import Layer

        t = self._table(c)
        per_param = self._state_bytes_per_param(c).total
        dv = self._zero_divs(c)

        def states(x: LayerCost) -> int:
            if self.quant:
                return int(x.state_param_bytes / dv[0] + x.state_grad_bytes / dv[1] + x.state_opt_bytes / dv[2])
            return int(x.param_count * per_param)

        return [
            Layer(x.name, fwd_s=x.fwd_total_s, bwd_s=x.bwd_input_total_s + x.bwd_weight_s, bwd_weight_s=x.bwd_weight_s,
                  state_bytes=states(x), act_bytes=int(x.act_bytes), boundary_bytes=int(x.out_bytes))
            for x in t.layers
        ]  # fmt: skip

    @staticmethod
    def _transient(t: CostTable, runs: list[tuple[int, int]]) -> float:
        """Bytes a rank holds on top of its stored activations while back-propagating: the
        largest recompute transient of its layers (``LayerCost.transient_bytes``, one layer
        re-run at a time), less the loss peak freed before any block's backward."""
        layers = [x for a, b in runs for x in t.layers[a:b]]
        worst = max((x.transient_bytes for x in layers), default=0.0)
        return max(0.0, worst - sum(x.loss_bytes for x in layers))

    def fsdp_buffer(self, c: Config, stage_params: float = 0.0) -> float:
        """What a parameter-sharding kind holds unsharded (``dp_kinds.unsharded_buffer_bytes``:
        two layers' weights at pp = 1, the stage's weights and gradients under PP; else 0)."""
        return unsharded_buffer_bytes(
            c.dp_kind, c.dp, stage_param_count=stage_params, elem_bytes=self._elem_bytes, pp=c.pp,
            largest_layer_params=self._prefix(self._table(c))["largest"][0],
        )  # fmt: skip

    def memory_split(self, c: Config) -> list[tuple[int, int]] | None:
        """A memory-feasible split from ``partition.stage_ilp.split_stages`` (its exact DP, v = 1)
        when the time-balanced split does not fit; None when it finds none."""
        from meshplan.errors import NoFeasiblePlanError
        from meshplan.partition.stage_ilp import split_stages

        if (
            c.virtual_stages != 1
            or self.split_rule != "any"  # the memory DP splits freely
            or not 1 < c.pp <= 32
            or self._rescues >= MAX_MEMORY_RESCUES
        ):
            return None
        self._rescues += 1
        try:
            split = split_stages(
                self.split_layers(c), pp=c.pp, num_microbatches=c.num_microbatches, schedule=c.schedule, virtual_stages=1,
                mem_limit_bytes=self.mem_limit, method="dp", explain=False, p2p_time=self.p2p_time(c),
            )  # fmt: skip
        except (NoFeasiblePlanError, ValueError):
            return None
        return [tuple(r) for r in split.ranges]  # type: ignore[misc]

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
        t, n_st, m, runs, ranks, on_rank = k.t, k.n_st, k.m, k.runs, k.ranks, k.on_rank
        st_q, r_q, ec, worst, rank_work = k.st_q, k.r_q, k.ec, k.worst, k.rank_work
        bpp = self._state_bytes_per_param(c)
        per_param = bpp.total
        dv = self._zero_divs(c)
        st_state = [q[0] / dv[0] + q[1] / dv[1] + q[2] / dv[2] for q in st_q]
        if not self.quant:  # exactly model_state_bytes per parameter (ZeRO-3 over dp for fsdp)
            st_state = [p * per_param for p in k.st_params0]
        r_state = [sum(st_state[i] for i in on_rank[r]) for r in ranks]
        if ec.expert_params_saved:  # ep: a rank holds E/ep experts of the MoE layers it holds
            r_state = [s - e * per_param for s, e in zip(r_state, k.ep_cut)]
        r_params, r_act = k.r_params, k.r_act
        r_mem = [int(r_state[r] + r_act[r] + self.fsdp_buffer(c, r_params[r]) + k.fp8_copy) for r in ranks]
        d = self._dp_comm(k.gather_bytes, k.grad_bytes, c)
        if c.dp_kind == "ddp" and c.dp * c.cp > 1:  # cp ranks hold the same weights: reduced too
            # what the runtime executes (cost_models.grad_sync): fp32 gradients in 25 MiB buckets,
            # each all-reduced (NCCL-costed over the DP group's layout) as soon as it is final in
            # the last microbatch's backward
            exp_b = expert_params(self.g) / c.ep * GRAD_REDUCE_BYTES if c.ep > 1 else 0.0
            dp_exposed = overlapped_sync_exposed_s(
                uniform_bucket_bytes(k.grad_bytes - exp_b), k.rank_b[worst], lambda b: self._dp_comm(b, b, c).sync_s)
            if exp_b and c.dp * c.cp > c.ep:  # ep: expert gradients over their dp*cp/ep replicas only (runtime/epcp)
                dc = c.dp * c.cp
                rep = dp_comm("ddp", exp_b, exp_b, dc // c.ep, self.cluster, stride=c.tp * c.ep)
                dp_exposed += overlapped_sync_exposed_s(
                    uniform_bucket_bytes(exp_b), k.rank_b[worst],
                    lambda b: dp_comm("ddp", b, b, dc // c.ep, self.cluster, stride=c.tp * c.ep).sync_s)
                d = replace(d, bytes={"all_reduce": d.bytes.get("all_reduce", 0) - int(exp_b)
                                      + rep.bytes.get("all_reduce", 0)})
            elif exp_b:
                d = replace(d, bytes={"all_reduce": d.bytes.get("all_reduce", 0) - int(exp_b)})
        else:
            dp_exposed = exposed_dp_s(d, backward_s=k.rank_b[worst], forward_s=k.rank_f[worst],
                                      microbatch_s=max(rank_work), num_microbatches=m)  # fmt: skip
        dp_bytes = d.bytes
        opt = self._optimizer_s(max(q[3] for q in r_q) if self.quant else max(r_params), c)
        # exposed EP all-to-all and CP ring, expert imbalance: all layers per microbatch at pp = 1; under
        # pp a stage holds 1/pp of them and the pipeline runs m + pp - 1 stage slots
        slots = m if c.pp == 1 else (m + c.pp - 1) / c.pp
        epcp_s = ec.per_microbatch_s * slots
        step = k.makespan + epcp_s + dp_exposed + opt
        comm_bytes = {key: int(v * m / c.pp) for key, v in t.tp_comm_bytes.items()}
        for key, v in ec.comm_bytes.items():
            comm_bytes[key] = comm_bytes.get(key, 0) + int(v * m)
        for key, v in dp_bytes.items():
            comm_bytes[key] = comm_bytes.get(key, 0) + v
        if c.pp > 1:
            comm_bytes["send_recv"] = k.send_recv
        w = r_params[worst]
        mem_breakdown = {"params": int(w * bpp.params), "grads": int(w * bpp.grads),
                         "optimizer": int(w * bpp.optimizer), "activations": int(max(r_act))}  # fmt: skip
        if self.quant:
            big = max(ranks, key=lambda r: r_state[r])
            mem_breakdown.update(params=int(r_q[big][0] / dv[0]), grads=int(r_q[big][1] / dv[1]),
                                 optimizer=int(r_q[big][2] / dv[2]))  # fmt: skip
        st_act, infl, placement = k.st_act, k.infl, k.placement
        return Evaluation(
            config=c, step_s=step, pipeline_s=k.makespan, compute_s=k.compute, tp_comm_s=k.tp_s,
            pp_comm_s=k.pp_comm, dp_comm_s=dp_exposed, bubble_s=k.bubble, optimizer_s=opt,
            recompute_s=k.rec_s, bubble_fraction=k.bubble_frac, peak_mem_bytes=tuple(r_mem),
            mem_breakdown=mem_breakdown, comm_bytes=comm_bytes, stage_layers=list(runs),
            stage_times=list(k.stage_times),
            stage_mem=[int(st_state[i] + st_act[i] * infl[placement[i]]) for i in range(n_st)],
            stage_send_bytes=list(k.st_sendb), stage_params=list(k.st_params), fits=max(r_mem) <= self.mem_limit,
            mem_limit_bytes=self.mem_limit, table=t, exact=exact, kind_note=self._kind_notes.get(c, ""),
            ep_comm_s=slots * (ec.ep_comm_s + ec.imbalance_s), cp_comm_s=slots * ec.cp_comm_s,
            ep_expert_read_s=slots * ec.expert_read_s,
        )  # fmt: skip

    def _kind_free(self, c: Config, exact: bool, runs: list[tuple[int, int]] | None) -> SimpleNamespace:
        """The part of ``evaluate`` that does not depend on ``c.dp_kind``, memoized (read only)."""
        key = (replace(c, dp_kind="ddp"), exact, tuple(runs) if runs is not None else None)
        if self.memo_kind_free and key in self._kind_free_memo:
            return self._kind_free_memo[key]
        t = self._table(c)
        n_st = c.pp * c.virtual_stages
        m = c.num_microbatches
        if runs is None:
            runs = self.split(t, n_st, c.virtual_stages) if n_st > 1 else [(0, len(t.layers))]
        P = self._prefix(t)

        def col(k: str) -> list[float]:
            arr = P[k]
            return [arr[b] - arr[a] for a, b in runs]

        st_f, st_b, st_w, st_rec, st_tp = col("f"), col("b"), col("w"), col("rec"), col("tp")
        st_params, st_act = col("params"), col("act")
        if n_st > 1:  # skip tensors a stage forwards unchanged stay in its memory per microbatch
            st_act = [x + self.coster.passthrough_bytes(t, a, b) for x, (a, b) in zip(st_act, runs)]
        if self.quant:  # [param, grad, optimizer] bytes without ZeRO and trainable count per stage
            st_q = [list(x) for x in zip(col("sp"), col("sg"), col("so"), col("train"))]
        else:
            st_q = [[p * self._bpp0.params, p * self._bpp0.grads, p * self._bpp0.optimizer, p] for p in st_params]
        frozen_tied = self.coster.quant.mode == "qlora"
        for i, (a, b) in enumerate(runs):  # a tied weight whose owner sits in another stage: a copy
            for x in t.layers[a:b]:
                for owner, numel in x.tied:
                    if not t.layers[a].node_start <= owner < t.layers[b - 1].node_end:
                        st_params[i] += numel
                        b0 = self._bpp0
                        extra = (numel * b0.params, 0.0, 0.0, 0.0) if frozen_tied else (
                            numel * b0.params, numel * b0.grads, numel * b0.optimizer, numel)  # fmt: skip
                        st_q[i] = [u + v for u, v in zip(st_q[i], extra)]
        st_params0 = list(st_params)
        st_sendb = [int(t.layers[b - 1].out_bytes) for _, b in runs]
        ranks = range(c.pp)
        placement = stage_placement(c.schedule, c.pp, c.virtual_stages)
        # stage i sends to stage i + 1 on the link between their pipeline ranks: NVLink when both
        # sit in one node, else one NIC (comm.p2p_crosses_nodes)
        stride, dpn = c.dp * c.cp * c.tp, self.cluster.devices_per_node
        st_send = [
            p2p_time_s(sb, self.cluster, crosses_nodes=i + 1 < n_st
                       and p2p_crosses_nodes(placement[i], placement[i + 1], stride, dpn)) if sb else 0.0
            for i, sb in enumerate(st_sendb)
        ]  # fmt: skip
        on_rank: list[list[int]] = [[] for _ in ranks]
        for s_, r_ in enumerate(placement):
            on_rank[r_].append(s_)
        totals = [st_f[i] + st_b[i] + st_w[i] for i in range(n_st)]
        rank_work = [sum(totals[i] for i in on_rank[r]) for r in ranks]
        if exact:
            makespan, bubble_frac = simulated_makespan(c, st_f, st_b, st_w, st_send)
        else:
            makespan, bubble_frac = makespan_lower_bound(c, st_f, totals, rank_work), 0.0
        infl = [inflight(c, r) for r in ranks]
        r_params = [sum(st_params[i] for i in on_rank[r]) for r in ranks]
        r_q = [[sum(st_q[i][k] for i in on_rank[r]) for k in range(4)] for r in ranks]
        ec = self._epcp(c)
        ep_cut = [0.0 for _ in ranks]  # expert parameters a rank does not hold under ep
        if ec.expert_params_saved:  # ep: a rank holds E/ep experts of the MoE layers it holds
            # share of the layers on a rank ~ its share of the parameters (1 at pp = 1; the search
            # only emits ep with pp = 1, a published ep x pp configuration is costed this way)
            tot = sum(st_params) or 1.0
            ep_cut = [ec.expert_params_saved * (p / tot) for p in r_params]
            r_params = [p - e for p, e in zip(r_params, ep_cut)]
            st_params = [p - ec.expert_params_saved * p / tot for p in st_params]
        r_act = [sum(st_act[i] for i in on_rank[r]) * infl[r] for r in ranks]
        r_act = [r_act[r] + self._transient(t, [runs[i] for i in on_rank[r]]) for r in ranks]
        fp8_copy = fp8_weight_copy_bytes(self._largest_linear / c.tp) if self.dtype == "fp8" else 0.0
        worst = max(ranks, key=lambda r: (r_q[r][1], r_params[r]))
        busiest = max(ranks, key=lambda r: rank_work[r])
        on_b = on_rank[busiest]
        tp_s = m * sum(st_tp[i] for i in on_b)

        # p2p the busiest rank sends: outputs forward (not the last stage), input gradients backward
        # (not the first: the boundary below); the simulated makespan times both directions already
        def sends(xs: list) -> float:
            return sum((xs[i] if i < n_st - 1 else 0) + (xs[i - 1] if i > 0 else 0) for i in on_b)

        out = SimpleNamespace(
            t=t, n_st=n_st, m=m, runs=runs, ranks=ranks, on_rank=on_rank, placement=placement, st_q=st_q,
            st_params0=st_params0, st_params=st_params, st_act=st_act, st_sendb=st_sendb, rank_work=rank_work,
            makespan=makespan, bubble_frac=bubble_frac, infl=infl, r_params=r_params, r_q=r_q, ec=ec,
            r_act=r_act, fp8_copy=fp8_copy, worst=worst, ep_cut=ep_cut,
            # gradients synced: every parameter, or (quantized) only the trainable ones, reduced in
            # fp32 on every precision as the runtime does (cost_models.grad_sync.GRAD_REDUCE_BYTES:
            # fp32 master gradients under autocast, FSDP2 reduce_dtype fp32); parameters gathered in
            # the training dtype
            grad_bytes=(r_q[worst][3] if self.quant else r_params[worst]) * GRAD_REDUCE_BYTES,
            gather_bytes=r_q[worst][0] if self.quant else r_params[worst] * self._elem_bytes,
            rank_b=[sum(st_b[i] + st_w[i] for i in on_rank[r]) for r in ranks],
            rank_f=[sum(st_f[i] for i in on_rank[r]) for r in ranks],
            tp_s=tp_s, rec_s=m * sum(st_rec[i] for i in on_b), compute=m * rank_work[busiest] - tp_s,
            bubble=max(0.0, makespan - m * rank_work[busiest]),
            pp_comm=m * sends(st_send) if c.pp > 1 else 0.0,
            send_recv=int(m * sends(st_sendb)) if c.pp > 1 else 0,
            stage_times=[(st_f[i], st_b[i] + st_w[i], st_w[i], st_send[i]) for i in range(n_st)],
        )  # fmt: skip
        if self.memo_kind_free:
            self._kind_free_memo[key] = out
        return out


def exposed_dp_s(d: Any, *, backward_s: float, forward_s: float, microbatch_s: float, num_microbatches: int) -> float:
    """Seconds of data-parallel communication ``d`` (a ``dp_kinds.DPComm``) compute does not hide::

        max(0.1·sync, sync − B) + max(0.1·gather, gather − F) + m·E_mb

    the gradient reduction overlaps the last microbatch's backward B (DDP buckets, Megatron
    --overlap-grad-reduce), the once-per-step parameter all-gather the first forward F
    (--overlap-param-gather, FSDP prefetch); at least a tenth of each stays exposed (the last
    bucket, the first layer's gather). Per-microbatch collectives (FSDP at pp = 1) as FSDP2 runs
    them over L units (``d.units``), each unit's all-gather prefetched one unit ahead of its
    compute and its reduce-scatter issued when its backward ends (ag, ag_b, rs: one microbatch's
    forward gathers, backward gathers (0 for zero2) and reduce-scatters + hsdp all-reduces;
    F, B its forward and backward)::

        E_mb = ag/L + (L−1)/L · max(0, ag − F)                   forward: the first unit waits
             + ag_b/L + (L−1)/L · max(0, ag_b + rs − B) + rs/L    backward: first gather, last reduce

    (``units`` 1 or no split: ``max(0, per_mb − T_mb)`` per microbatch + ``0.1·per_mb``).
    Unit: seconds. Source: PyTorch FSDP2 ``fully_shard`` (implicit forward prefetch, backward
    prefetch of one unit, reduce-scatter in its own stream).
    """
    out = 0.0
    if d.sync_s:
        out += max(0.1 * d.sync_s, d.sync_s - backward_s)
    if d.gather_s:
        out += max(0.1 * d.gather_s, d.gather_s - forward_s)
    if d.per_microbatch_s and d.units > 1 and d.mb_forward_s:
        L, ag_f, ag_b = d.units, d.mb_forward_s, d.mb_bwd_gather_s
        bwd = d.per_microbatch_s - ag_f  # backward gathers + reduce-scatters (+ hsdp all-reduce)
        rs = bwd - ag_b
        e_mb = ag_f / L + (L - 1) / L * max(0.0, ag_f - forward_s)
        e_mb += ag_b / L + (L - 1) / L * max(0.0, bwd - backward_s) + rs / L
        out += num_microbatches * e_mb
    elif d.per_microbatch_s:
        out += num_microbatches * max(0.0, d.per_microbatch_s - microbatch_s) + 0.1 * d.per_microbatch_s
    return out


def kind_note(chosen: Evaluation, ddp: Evaluation) -> str:
    """Why ``chosen``'s data-parallel kind replaced DDP (``ddp``, the default), in numbers."""
    gib = 1024**3
    k = chosen.config.dp_kind
    if not ddp.fits:
        return (f"{k} chosen because ddp does not fit: {ddp.max_mem_bytes / gib:.1f} GiB > "
                f"{ddp.mem_limit_bytes / gib:.1f} GiB per device")  # fmt: skip
    return (f"{k} chosen over ddp (which fits, {ddp.max_mem_bytes / gib:.1f} GiB): {chosen.step_s:.4g} s vs "
            f"{ddp.step_s:.4g} s per step (bound), {chosen.max_mem_bytes / gib:.1f} GiB per device")  # fmt: skip
