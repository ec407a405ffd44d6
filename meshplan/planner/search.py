"""Joint search over data/tensor/pipeline degrees, microbatching, schedule, recompute and DP kind.

For every configuration::

    (dp, tp, pp)        dp·tp·pp = world_size; tp ≤ devices_per_node, tp | devices_per_node,
                        tp | heads and tp | kv_heads; pp ≤ number of layers
    micro_batch b, m    global_batch = b · m · dp
    schedule            gpipe | 1f1b | interleaved-1f1b (v = 2, 4 where layers allow, m % pp = 0) |
                        zero-bubble | zbv (v = 2); pp = 1 runs plain gradient accumulation ("1f1b")
    recompute           none | selective | full
    dp kind             the fastest that fits of ddp, zero1, zero2, hsdp, fsdp (cost_models.dp_kinds)

the step time is::

    step = makespan(schedule simulator; per-stage F, B, W incl. TP comm and recompute; p2p sends)
         + exposed DP communication (``planner.dp_exposure.exposed_dp_s`` of the kind's collectives,
           ``cost_models.dp_kinds.dp_comm``, NCCL-costed with the DP group's node layout):
           ddp: fp32 gradients in 25 MiB buckets all-reduced one after the other as each is final
           in the last microbatch's backward (cost_models.grad_sync.overlapped_sync_exposed_s);
           others: gradient sync overlapped with the last backward, a once-per-step parameter gather
           with the first forward, FSDP's per-microbatch gathers with each microbatch's compute
         + optimizer step (memory bound: 16 B/param read and written, ÷ the ZeRO shard degree)

Search: every configuration gets a cheap memory lower bound (model states of the average rank;
configurations that cannot fit are skipped). Phase 1 costs each remaining one without the
schedule simulation: stage split, memory per rank (exact), DP sync, optimizer, and a makespan
lower bound ``max_k (Σ_{s<k} F_s + m·T_k)``. Phase 2 simulates the fitting ones in order of that
bound and stops once the bound exceeds the best simulated step (and enough alternatives within
``ALT_MARGIN`` are known): the best plan is the same as exhaustive enumeration's. Phase 2 runs over
the candidates as the costing settles them, and the costing skips candidates that cannot change
the result, alternatives included (``planner.search_prune``). With ``exhaustive=True`` every configuration is evaluated (tests check
both give the same answer). Pipelines with many microbatches are simulated at two small valid
microbatch counts and extrapolated linearly (steady state: one microbatch per bottleneck period;
``planner.pipeline_time``).
The candidates are scored on the fast time-balanced split; the winner's (and small contenders')
split is then re-solved by the stage-split ILP and the alternatives chosen in ``planner.finalize``.
Costing one configuration is ``planner.evaluate.ConfigEvaluator``, which the Searcher holds (``costs``).
With a ``Quantization`` on the coster, model states, gradient sync and the optimizer step count
the quantized layout (only trainable parameters are synced and stepped).
No torch import.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from meshplan.cost_models.engine_profiles import EngineProfile
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.errors import NoFeasiblePlanError
from meshplan.graph import ModelGraph
from meshplan.partition.engine_split import block_counts, rule_for
from meshplan.partition.schedule import validate
from meshplan.plan.execution_rules import (
    BATCH_NORM_CLASSES,
    ZERO_BUBBLE_SCHEDULES,
    dp_kind_blocker,
    microbatch_blocker,
    recompute_blocker,
    state_layout_blocker,
    states_over_cp,
    tied_weight_blocker,
    tp_pp_blocker,
)
from meshplan.planner.costing import GraphCoster
from meshplan.planner.evaluate import ConfigEvaluator
from meshplan.planner.finalize import finalize, select_alternatives
from meshplan.planner.memory_floor import split_floor
from meshplan.planner.no_config import explain_no_configs
from meshplan.planner.search_prune import EPS, BoundOrderCosting
from meshplan.planner.search_types import (
    RECOMPUTE_CHOICES,
    SCHEDULE_CHOICES,
    Config,
    Evaluation,
    GiB,
    SearchResult,
    balanced_split,
    divisors,
)
from meshplan.planner.tp_reason import other_degree_reason, tp_one_reason

__all__ = [
    "ALT_MARGIN", "GiB", "MICRO_BATCH_CHOICES", "RECOMPUTE_CHOICES", "SCHEDULE_CHOICES", "Config", "Evaluation",
    "SearchResult", "Searcher", "balanced_split",
]  # fmt: skip

MICRO_BATCH_CHOICES = (1, 2, 4, 8, 16)
#: Alternatives are looked for among plans at most this much slower than the best.
ALT_MARGIN = 0.25


class Searcher:
    """The joint search for one graph on one cluster (see the module docstring). It holds its
    costing, ``costs`` (a ``planner.evaluate.ConfigEvaluator`` built from the same settings, or
    the one given), and keeps what only the search needs: the world size and global batch, the
    choices it enumerates, the alternatives it keeps and the notes on what it left out."""

    #: skip costing candidates that cannot change the result (``planner.search_prune``); False
    #: costs every candidate the bound and dominance rules leave (tests compare the two)
    skip_unneeded = True

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
        split_rule: str | None = None,
        dp_kinds: tuple[str, ...] | None = None,
        profile: EngineProfile | str | None = None,
    ) -> None:
        self.costs = ConfigEvaluator(graph, cluster, fixed=fixed, dtype=dtype, optimizer=optimizer, coster=coster,
                                     split_rule=split_rule, dp_kinds=dp_kinds, profile=profile)  # fmt: skip
        self.g = graph
        self.cluster = cluster
        self.W = cluster.num_devices
        self.B = global_batch
        self.fixed = self.costs.fixed  # the pins (capacity_factor taken out by the costing)
        self.mem_limit = self.costs.mem_limit
        self.recompute = tuple(recompute or RECOMPUTE_CHOICES)
        if "recompute" in self.fixed and self.fixed["recompute"] not in self.recompute:
            self.recompute = (*self.recompute, self.fixed["recompute"])
        self.schedules = tuple(schedules or SCHEDULE_CHOICES)
        self.progress = progress or (lambda _msg: None)
        self.keep = keep_alternatives
        # the split ILP's refinement ignores an engine's split rule, so it is off under one
        self.ilp_split = ilp_split and self.costs.split_rule == "any"
        self.bounded: list[tuple[float, float, Config]] = []
        self.rule_notes: dict[str, str] = {}  # configurations the runtime refuses, left out (execution_rules)

    # ---- enumeration -------------------------------------------------------------------
    @functools.cached_property
    def _shards_memo(self) -> dict[int, bool]:
        """Whether a TP placement shards any linear, per placement (``_shards_something``)."""
        return {}

    @functools.cached_property
    def _batch_norms(self) -> int:
        """BatchNorm calls in the graph (pipelined microbatches would each use their own statistics)."""
        return sum(n.op == "call_module" and n.target in BATCH_NORM_CLASSES for n in self.g.nodes)

    @functools.cached_property
    def zero_bubble_why(self) -> str:
        """Why zero-bubble schedules are skipped ("" when they are not): a parameter read at two
        places that may fall in one stage (``execution_rules.tied_weight_blocker``). A tied
        embedding read in the first layer and again by the head in the last is fine."""
        canon = {name: grp[0] for grp in self.g.tied_params for name in grp}
        uses: dict[str, list[int]] = {}
        for n in self.g.nodes:
            for p in dict.fromkeys(canon.get(x, x) for x in n.param_names):
                uses.setdefault(p, []).append(n.id)
        ranges = self.costs.coster.ranges
        first_end, last_start = ranges[0][2], ranges[-1][1]
        for p, ids in uses.items():
            if len(ids) > 1 and not (len(ids) == 2 and ids[0] < first_end and ids[1] >= last_start):
                return tied_weight_blocker(pp=2, schedule="zero-bubble", uses=len(ids), name=p)
        return ""

    def tp_choices(self) -> list[int]:
        heads = int(self.g.meta.get("num_heads") or 0)
        kv = int(self.g.meta.get("num_kv_heads") or heads)
        dpn = self.cluster.devices_per_node
        out = []
        for t in divisors(self.W):
            if t > dpn or dpn % t:
                continue
            if heads and (heads % t or kv % t):
                continue
            out.append(t)
        return out

    def configs(self) -> list[Config]:
        f = self.fixed
        n_layers = len(self.costs.coster.ranges)
        out = []
        for tp in self.tp_choices():
            if "tp" in f and f["tp"] != tp:
                continue
            for pp, cp, ep in self._pp_cp_ep(tp, n_layers):
                why = tp_pp_blocker(tp=tp, pp=pp, capture=self.g.capture,
                                    sequence_parallel=bool(f.get("sequence_parallel")))
                if why:  # the runtime would refuse it: named in the plan's notes and explain
                    self.rule_notes.setdefault("tp_pp", "not searched: " + why)
                    continue
                dp = self.W // (tp * pp * cp)
                if ("dp" in f and f["dp"] != dp) or self.B % dp:
                    continue
                per_replica = self.B // dp
                mbs = [f["micro_batch_size"]] if "micro_batch_size" in f else MICRO_BATCH_CHOICES
                for b in mbs:
                    if per_replica % b:
                        continue
                    m = per_replica // b
                    if "num_microbatches" in f and f["num_microbatches"] != m:
                        continue
                    if microbatch_blocker(pp=pp, num_microbatches=m, batch_norms=self._batch_norms):
                        continue  # the runtime would refuse it (meshplan.plan.execution_rules)
                    for sched, v in self._schedules(pp, m, n_layers):
                        if pp > 1 and not self._splittable(pp * v, v):
                            continue
                        for rc in self.recompute:
                            if "recompute" in f and f["recompute"] != rc:
                                continue
                            if self.costs.ep_cp.epcp_why(tp, pp, cp, ep, rc):
                                continue
                            if ep > 1 and state_layout_blocker(
                                    state_layout=self.costs.coster.runtime_state_layout, dp_kind="ddp",
                                    dtype="bf16", cp=cp, ep=ep):
                                continue  # the runtime would refuse it (meshplan.plan.execution_rules)
                            if recompute_blocker(pp=pp, schedule=sched, recompute=rc):
                                continue  # the runtime would refuse it (meshplan.plan.execution_rules)
                            for kind in self._dp_kinds(dp * cp if cp * ep > 1 else dp):
                                folds = states_over_cp(cp=cp, ep=ep, dp_kind=kind)  # a pinned kind over dp x cp
                                if cp * ep > 1 and kind not in ("none", "ddp") and not folds:
                                    continue  # ep runs its own gradient reduction (runtime/epcp)
                                kind = "ddp" if cp * ep > 1 and not folds else kind
                                if dp_kind_blocker(dp=dp * cp if folds else dp, tp=tp, pp=pp, schedule=sched,
                                                   dp_kind=kind):
                                    continue
                                out.append(Config(dp, tp, pp, b, m, sched, v, rc, False, kind, cp, ep))
        return out

    def _pp_cp_ep(self, tp: int, n_layers: int) -> list[tuple[int, int, int]]:
        """(pp, cp, ep) triples for ``tp``: cp divides the rest of the world, ep divides dp x cp and
        the expert count; cp > 1 only for a model with attention, ep > 1 only for a MoE model
        (the cost model then decides; pins --cp/--ep/--pp restrict)."""
        f = self.fixed
        out = []
        experts = int(self.g.meta.get("num_experts", 0) or 0)
        has_attn = any(n.kind == "attention" for n in self.g.nodes)
        for pp in divisors(self.W // tp):
            if pp > n_layers or ("pp" in f and f["pp"] != pp):
                continue
            for cp in divisors(self.W // (tp * pp)):
                if ("cp" in f and f["cp"] != cp) or (cp > 1 and not has_attn):
                    continue
                for ep in divisors(self.W // (tp * pp)):
                    if ("ep" in f and f["ep"] != ep) or (ep > 1 and not experts):
                        continue
                    if ep > 1 and (self.W // (tp * pp)) % ep:
                        continue
                    out.append((pp, cp, ep))
        return out

    def dominated(self, c: Config) -> bool:
        """True when ``c`` recomputes activations and its twin without recompute (same in every
        other field) was costed with every data-parallel kind fitting: each kind of ``c`` then
        does the same work plus the recompute with the same communication, so it is no faster
        (its longer backward can hide at most the recompute's own time of DP sync), and ``c``
        cannot hold the only fitting kind. Bound order costs the twin first (its bound is lower)."""
        return c.recompute != "none" and self.costs.every_kind_fits(c.but(recompute="none"))

    def _shards_something(self, c: Config) -> bool:
        sol = self.costs.table(c).tp_solution
        key = id(sol)  # (the coster keeps every solution: ids stay unique)
        if key not in self._shards_memo:
            self._shards_memo[key] = any(v != "replicate" for v in sol.styles.values())
        return self._shards_memo[key]

    def _splittable(self, n_stages: int, v: int) -> bool:
        """Whether the split rule (``--target``'s engine) has a split of the blocks into ``n_stages``;
        the first stage count it has none for is named in the plan's notes."""
        if self.costs.split_rule == "any":
            return True
        rule = rule_for(self.costs.split_rule, v)
        blocks = sum(1 for r in self.costs.coster.ranges if r[3] == "block")
        if next(block_counts(rule, blocks, n_stages), None) is not None:
            return True
        self.rule_notes.setdefault("split", f"not searched: {n_stages} stages (the {rule!r} stage-split rule of the "
                                            f"target engine has no split of {blocks} blocks into them)")  # fmt: skip
        return False

    def _dp_kinds(self, dp: int) -> list[str]:
        """One entry per configuration: "ddp" is upgraded to "fsdp" by ``evaluate_auto`` only
        when it does not fit (unless the DP kind is pinned)."""
        if "dp_kind" in self.fixed:
            return [self.fixed["dp_kind"]]
        return ["none"] if dp == 1 else ["ddp"]

    def _schedules(self, pp: int, m: int, n_layers: int) -> list[tuple[str, int]]:
        f = self.fixed
        if pp == 1:
            return [("1f1b", 1)] if "schedule" not in f or f["schedule"] in ("1f1b", "gpipe") else []
        out = []
        for s in self.schedules:
            if "schedule" in f and f["schedule"] != s:
                continue
            if s in ZERO_BUBBLE_SCHEDULES and self.zero_bubble_why:
                continue  # the runtime would refuse it (meshplan.plan.execution_rules)
            vs = [1]
            if s == "interleaved-1f1b":
                vs = [v for v in (2, 3, 4) if pp * v <= n_layers]
            elif s == "zbv":
                vs = [2] if 2 * pp <= n_layers else []
            if "virtual_stages" in f:
                vs = [v for v in vs if v == f["virtual_stages"]]
            for v in vs:
                try:
                    validate(s, pp, m, v)
                except ValueError:
                    continue
                out.append((s, v))
        return out

    # ---- the search ----------------------------------------------------------------------
    def run(self, *, exhaustive: bool = False) -> SearchResult:
        """The search (see the module docstring), in its named steps: ``candidates`` (enumerate),
        ``bound_all`` (bound and order), ``cost_all`` (phase 1, with phase 2's simulations as
        candidates settle: ``planner.search_prune``), ``settle`` (the remaining simulations) and
        ``conclude`` (alternatives, the winner's split, the reasons, the ``SearchResult``)."""
        clock = PhaseClock()
        cands = self.candidates()
        clock.lap("enumerate")
        self.progress(f"{len(cands.configs)} configurations; bounding")
        min_mem_lb = self.bound_all(cands.configs)
        clock.lap("bound")
        costed = self.cost_all(exhaustive)
        clock.lap("cost")
        clock.phase_s["cost"] -= costed.sim_s[0]  # the simulations run so far are phase 2's
        clock.phase_s["simulate"] = costed.sim_s[0]
        self.progress(f"{len(costed.partial)} fitting, {len(costed.oom)} out of memory ({costed.skipped} skipped: they "
                      "cannot change the result); simulating schedules")  # fmt: skip
        fitting = self.settle(costed)
        clock.lap("simulate")
        costed.order.release()  # phase 2 is done: its closures (over this search and ``costed``) go
        return self.conclude(cands, costed, fitting, min_mem_lb, clock)

    def candidates(self) -> Candidates:
        """Every configuration to search (``configs``, sequence parallelism chosen per TP degree,
        TP degrees whose placement shards nothing and quantization the runtime refuses left out),
        with the degrees enumerated and searched (for the plan's reasons); raises when none."""
        cfgs = self.configs()
        if not cfgs:
            raise NoFeasiblePlanError(explain_no_configs(self, MICRO_BATCH_CHOICES))
        # cp runs with sequence parallelism, ep without (execution_rules.epcp_rule, asked with SP on)
        sp = {tp: self.costs.sp_for(tp) for tp in {c.tp for c in cfgs}}  # (configs() builds them without)
        cfgs = [c.but(sequence_parallel=True) if sp[c.tp] and not tp_pp_blocker(
            tp=c.tp, pp=c.pp, capture=self.g.capture, sequence_parallel=True) and not self.costs.ep_cp.epcp_why(
            c.tp, c.pp, c.cp, c.ep, c.recompute, sequence_parallel=True) else c for c in cfgs]
        enumerated_tp = {c.tp for c in cfgs}  # for the plan's "tp=1: why" (planner.tp_reason)
        if "tp" not in self.fixed:  # a TP group whose placement shards nothing only repeats work
            useful = [c for c in cfgs if c.tp == 1 or self._shards_something(c)]
            cfgs = useful or cfgs
        if self.costs.quant:
            ok = [c for c in cfgs if not self.costs.quant_errors(c)]
            if not ok and cfgs:
                errs = self.costs.quant_errors(cfgs[0])
                raise ValueError(
                    f"{self.costs.coster.quant.mode} quantization cannot be applied at any candidate TP degree: "
                    + "; ".join(errs[:3]) + (f" (and {len(errs) - 3} more)" if len(errs) > 3 else "")
                )
            cfgs = ok
        return Candidates(configs=cfgs, enumerated_tp=enumerated_tp, searched_tp={c.tp for c in cfgs},
                          searched={axis: {getattr(c, axis) for c in cfgs} for axis in ("cp", "ep")})  # fmt: skip

    def bound_all(self, cfgs: list[Config]) -> float:
        """Bound every configuration (``ConfigEvaluator.bound``) into ``bounded``, in bound order;
        returns the smallest memory bound."""
        bounded = []
        min_mem_lb = math.inf
        for c in cfgs:
            lb, mlb = self.costs.bound(c)
            min_mem_lb = min(min_mem_lb, mlb)
            bounded.append((lb, mlb, c))
        bounded.sort(key=lambda x: (x[0], x[2].summary()))
        self.bounded = bounded
        return min_mem_lb

    def cost_all(self, exhaustive: bool) -> Costed:
        """Phase 1: everything but the simulation (split, memory, DP, optimizer), in bound order;
        phase 2 (simulation in order of the now split-aware bound) runs over the candidates as they
        are settled, and costing skips what cannot change the result (``planner.search_prune``)."""
        sim_s = [0.0]
        out = Costed(BoundOrderCosting(self._simulator(sim_s), self.keep, ALT_MARGIN, exhaustive), sim_s=sim_s)
        order = out.order
        shown = [time.perf_counter()]

        def simulated(i: int, pe: Evaluation, best: float) -> None:
            if i % 50 == 0 or time.perf_counter() - shown[0] > 1.0:
                shown[0] = time.perf_counter()
                self.progress(f"simulated {i} (bound {pe.step_s:.3g} s, best {best:.3g} s)")

        def cost(c: Config) -> None:
            ev = self.costs.evaluate_auto(c, exact=False)
            (out.partial if ev.fits else out.oom).append(ev)
            order.add(ev)

        order.on_simulated = simulated
        order.cost = cost
        lazy = not exhaustive and self.skip_unneeded  # off: phase 2 after all costing, nothing skipped
        for k, (lb, mlb, c) in enumerate(self.bounded):
            if lazy:
                order.settle(lb)
            if self._left_out(out, c, lb, mlb, exhaustive, lazy):
                continue
            cost(c)
            if time.perf_counter() - shown[0] > 1.0:  # a line a second on long searches
                shown[0] = time.perf_counter()
                best_bound = min((e.step_s for e in out.partial), default=math.inf)
                self.progress(
                    f"costing: {k + 1}/{len(self.bounded)} configurations, {len(out.partial)} fit, "
                    f"best so far {best_bound:.3g} s/step (before simulation)"
                )
        out.skipped += order.finish()
        return out

    def _simulator(self, sim_s: list[float]) -> Callable[[Evaluation], Evaluation]:
        """Phase 2's simulation of a partial evaluation, its seconds added to ``sim_s[0]``."""

        def simulate(pe: Evaluation) -> Evaluation:
            t = time.perf_counter()
            ev = self.costs.evaluate(pe.config, runs=pe.stage_layers)
            sim_s[0] += time.perf_counter() - t
            return ev

        return simulate

    def _left_out(self, out: Costed, c: Config, lb: float, mlb: float, exhaustive: bool, lazy: bool) -> bool:
        """Whether ``c`` is not costed (counted in ``out``): it cannot fit whatever the split (a
        few are kept to report), is dominated, cannot change the result, or is certainly out of
        memory (deferred)."""
        order = out.order
        if not exhaustive and mlb > self.mem_limit and (len(out.oom) + order.deferred >= 2 or out.partial):
            return True
        if not exhaustive and self.dominated(c):
            out.pruned += 1
            return True
        if lazy and order.can_skip(c, lb):
            out.skipped += 1
            return True
        if lazy:
            floor = self.costs.memory_floor(c, mlb)
            rescue = self.costs.rescue_possible(c, mlb, floor)
            if not rescue and floor <= self.mem_limit:  # no re-split: the time-balanced split is costed
                floor = max(floor, split_floor(self.costs, c))
            if order.skip_out_of_memory(c, lb, floor, self.mem_limit, rescue):
                out.skipped += 1
                return True
            if not rescue and floor > self.mem_limit * (1 + EPS):  # certainly out of memory
                order.defer(c, lb, floor, self.mem_limit)
                return True
        return False

    def settle(self, costed: Costed) -> list[Evaluation]:
        """Phase 2's remaining simulations; the simulated fitting evaluations, fastest first (and
        ``costed``'s lists sorted the same way)."""
        costed.partial.sort(key=lambda e: (e.step_s, e.config.summary()))
        costed.order.settle(math.inf)
        fitting = costed.order.fitting
        fitting.sort(key=lambda e: (e.step_s, e.config.summary()))
        costed.oom.sort(key=lambda e: (e.step_s, e.config.summary()))
        return fitting

    def conclude(self, cands: Candidates, costed: Costed, fitting: list[Evaluation], min_mem_lb: float,
                 clock: PhaseClock) -> SearchResult:
        """The winner (its split re-solved, a refined contender may take its place), the labelled
        alternatives and the reasons for tp = 1 and the other cp/ep degrees, as a ``SearchResult``."""
        partial, oom = costed.partial, costed.oom
        evaluated = len(partial) + len(oom)
        min_mem = min((e.max_mem_bytes for e in partial + oom), default=math.inf)
        best_ev = fitting[0] if fitting else None
        alts: list[tuple[Evaluation, str]] = []
        split, tp_reason, degree_reasons = None, "", {}
        if best_ev is not None:
            labelled = select_alternatives(self.costs, best_ev, fitting, partial, oom, keep=self.keep,
                                           bounded=self.bounded)  # fmt: skip
            if self.ilp_split and best_ev.config.pp > 1:
                self.progress("stage split of the winner and the top contenders by ILP")
            best_ev, alts, split = finalize(self.costs, best_ev, labelled, refine=self.ilp_split)
            tp_reason = tp_one_reason(self, best_ev, alts, partial, oom, enumerated_tp=cands.enumerated_tp,
                                      searched_tp=cands.searched_tp)
            degree_reasons = {axis: why for axis in ("cp", "ep") if (why := other_degree_reason(
                self, axis, best_ev, alts, partial, oom, searched=cands.searched[axis]))}
        else:
            for e in oom[: self.keep]:
                alts.append((e, f"out of memory by {(e.max_mem_bytes - self.mem_limit) / GiB:.1f} GiB"))
        if min_mem == math.inf:
            min_mem = min_mem_lb
        clock.lap("finalize")
        self.progress(f"done: {evaluated} evaluated in {time.perf_counter() - clock.t0:.2f} s")
        coster = self.costs.coster
        return SearchResult(
            best=best_ev, alternatives=alts, candidates=len(cands.configs), evaluated=evaluated,
            seconds=time.perf_counter() - clock.t0, ilp_solves=coster.ilp_solves,
            ilp_seconds=coster.ilp_seconds, min_mem_bytes=int(min_mem) if math.isfinite(min_mem) else 0,
            mem_limit_bytes=self.mem_limit, coster=coster, split=split, phase_s=clock.phase_s,
            simulated=len(fitting), pruned=costed.pruned, skipped=costed.skipped,
            tp_reason=tp_reason, degree_reasons=degree_reasons,
            min_mem_floor_bytes=int(min_mem_lb) if math.isfinite(min_mem_lb) else 0,
        )  # fmt: skip


class PhaseClock:
    """Wall seconds per named phase of a search (``SearchResult.phase_s``)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.mark = self.t0
        self.phase_s: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phase_s[name] = self.phase_s.get(name, 0.0) + now - self.mark
        self.mark = now


@dataclass
class Candidates:
    """What ``Searcher.candidates`` enumerated: the configurations, and the TP / cp / ep degrees
    enumerated and searched (the plan's reasons, ``planner.tp_reason``)."""

    configs: list[Config]
    enumerated_tp: set[int]
    searched_tp: set[int]
    searched: dict[str, set[int]]


@dataclass
class Costed:
    """Phase 1's outcome (``Searcher.cost_all``): the fitting partial evaluations, the ones out of
    memory, the bound-order costing (phase 2 so far), the configurations pruned as dominated and
    skipped as unable to change the result, and the simulation seconds so far (``sim_s[0]``)."""

    order: BoundOrderCosting
    partial: list[Evaluation] = field(default_factory=list)
    oom: list[Evaluation] = field(default_factory=list)
    pruned: int = 0
    skipped: int = 0
    sim_s: list[float] = field(default_factory=lambda: [0.0])
