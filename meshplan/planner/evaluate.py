"""Costing one point of the search space: ``ConfigEvaluator``, the base of ``planner.search.Searcher``.

``evaluate(config)`` gives an ``Evaluation``: stage split (time-balanced, or the memory-constrained
DP of ``partition.stage_ilp`` when that does not fit), memory per pipeline rank, exposed DP
gradient sync, optimizer step and (``exact``) the schedule simulator's makespan; ``lower_bound``
is the cheap (step, memory) bound the search orders candidates by; ``evaluate_auto`` upgrades DDP
to the fastest DP kind that fits. The formulas are in ``planner.search``'s docstring. The shared
cost terms are ``planner.config_costs.ConfigCosts`` (the base class), the DP-kind-free part of an
evaluation is ``planner.kind_free`` (memoized here across kinds), the exposed DP communication
``planner.dp_exposure``. With a ``Quantization`` on the coster, model states, gradient sync and
the optimizer step count the quantized layout. No torch import.
"""

from __future__ import annotations

from dataclasses import replace

from meshplan.cost_models.contention import overlap_slowdown_s
from meshplan.cost_models.dp_kinds import KIND_ORDER, dp_comm
from meshplan.cost_models.grad_sync import (
    GRAD_REDUCE_BYTES,
    local_ddp_sync_s,
    overlapped_sync_terms,
    uniform_bucket_runs,
)
from meshplan.plan.execution_rules import dp_kind_blocker, sequence_parallel_blocker
from meshplan.planner.config_costs import MAX_MEMORY_RESCUES, ConfigCosts
from meshplan.planner.dp_exposure import exposed_dp_s, kind_note
from meshplan.planner.kind_free import KindFreeTerms, kind_free_terms
from meshplan.planner.search_types import Config, Evaluation

__all__ = ["MAX_MEMORY_RESCUES", "ConfigEvaluator", "exposed_dp_s", "kind_note"]


class ConfigEvaluator(ConfigCosts):
    """Costs configurations of one graph on one cluster (see the module docstring)."""

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
            if kind == "hsdp" and self._shard(c2) in (1, c.dp):
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
            for c2 in self.other_kinds(c):
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

    def grads_after_activations(self, c: Config) -> bool:
        """Whether no gradient of ``c`` outlives the backward that makes it before the next
        microbatch's activations exist: one microbatch, no pipeline, no recompute, and no data
        parallelism or a sharded kind (FSDP2: fsdp, zero2, hsdp), as meshplan's runtime and
        torchtitan step (gradients set to None after the optimizer): the peak holds the larger of
        activations (backward's start) and gradients (its end, beside the first layer's
        rematerialized activations under recompute), not both. FSDP2's per-unit unsharded
        gradients and fp32 reduce-scatter copies are its buffers (``fsdp_buffers``), counted
        beside. Measured on benchmarks/bench_memory.py (4 blocks): fsdp -2.4 %, zero2 -5.3 %, hsdp
        -3.2 % with the rule, +15.5 / +10.4 / +7.0 % without (an earlier harness, whose tracker
        hooks leaked autograd nodes, had shown +4 to +12 % and -5 to -14 %). Not with DDP (its
        Reducer holds gradient buckets for the whole run)."""
        return (self.state_layout == "torch" and c.pp == 1 and c.num_microbatches == 1
                and (c.dp * c.cp == 1 or c.dp_kind in ("fsdp", "zero2", "hsdp")))

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
        t, n_st, m, runs, ranks, on_rank = k.t, k.n_st, k.m, k.runs, k.ranks, k.on_rank
        st_q, r_q, ec, worst, rank_work = k.st_q, k.r_q, k.ec, k.worst, k.rank_work
        bpp = self.state_bytes_per_param(c)
        per_param = bpp.total
        dv = self._zero_divs(c)
        st_state = [q[0] / dv[0] + q[1] / dv[1] + q[2] / dv[2] for q in st_q]
        if not self.quant:  # exactly model_state_bytes per parameter (ZeRO-3 over dp for fsdp)
            st_state = [p * per_param for p in k.st_params0]
        r_state = [sum(st_state[i] for i in on_rank[r]) for r in ranks]
        if ec.expert_params_saved:  # ep: a rank holds E/ep experts of the MoE layers it holds
            r_state = [s - e * per_param for s, e in zip(r_state, k.ep_cut)]
        folded = self.moe_folding and c.tp > 1
        if folded and not self.quant:  # folded: expert states sharded over the expert dp group, not dp
            per_e = self.expert_state_bytes_per_param(c).total
            r_state = [s + x / c.ep * (per_e - per_param) for s, x in zip(r_state, k.r_experts)]
        r_params, r_act = k.r_params, k.r_act
        buf = self.fsdp_buffers(c, r_params)
        cast = k.r_cast if self.runs_autocast(c) else [0.0 for _ in ranks]
        live = [r_act[r] + cast[r] for r in ranks]
        if self.grads_after_activations(c) and not self.quant:
            # one microbatch, no pipeline, no DDP bucket: gradients come into being in the backward
            # as the activations it consumes are freed (the step ends with zero_grad(set_to_none)),
            # so the peak holds the larger of the two, not both (measured: benchmarks/bench_memory.py)
            g0 = r_params[0] * bpp.grads
            # the backward's end: the gradients beside what recompute rematerializes of the first layer
            end = g0 + max((x.transient_bytes for a, b in runs for x in t.layers[a:b]), default=0.0)
            live[0] = max(live[0], end) - g0
        r_mem = [int(r_state[r] + live[r] + buf[r] + k.fp8_copy + k.r_pipe[r]) for r in ranks]
        d = self.dp_collectives_split(k.gather_bytes, k.grad_bytes, k.r_experts[worst] / c.ep if folded else 0.0, c)
        if c.dp_kind == "ddp" and c.dp * c.cp > 1 and self.ddp_impl == "local":
            # Megatron-LM's local DDP: one flat all-reduce of the gradients in the training dtype
            # after backward, nothing overlapped, no SMs taken from compute (grad_sync.local_ddp_sync_s)
            gb = k.grad_bytes / GRAD_REDUCE_BYTES * self.elem_bytes
            d = self.dp_collectives(gb, gb, c)
            dp_exposed = local_ddp_sync_s(gb, lambda b: self.dp_collectives(b, b, c).sync_s,
                                          self.cluster.mem_bw_bytes_per_s * self.cluster.mem_efficiency)  # fmt: skip
        elif c.dp_kind == "ddp" and c.dp * c.cp > 1:  # cp ranks hold the same weights: reduced too
            # what the runtime executes (cost_models.grad_sync): fp32 gradients in 25 MiB buckets,
            # each all-reduced (NCCL-costed over the DP group's layout) as soon as it is final in
            # the last microbatch's backward
            exp_b = k.r_experts[worst] / c.ep * GRAD_REDUCE_BYTES if c.ep > 1 or folded else 0.0  # the rank's stages
            dp_exposed, hid = overlapped_sync_terms(
                uniform_bucket_runs(k.grad_bytes - exp_b), k.rank_b[worst], lambda b: self.dp_collectives(b, b, c).sync_s)
            grp, gst = self.expert_dp_group(c)
            if exp_b and grp > 1:  # ep: expert gradients over their replicas only (runtime/epcp; folded: EDP)
                rep = dp_comm("ddp", exp_b, exp_b, grp, self.cluster, stride=gst)
                e_x, h_x = overlapped_sync_terms(
                    uniform_bucket_runs(exp_b), k.rank_b[worst],
                    lambda b: dp_comm("ddp", b, b, grp, self.cluster, stride=gst).sync_s)
                dp_exposed, hid = dp_exposed + e_x, hid + h_x
                d = replace(d, bytes={"all_reduce": d.bytes.get("all_reduce", 0) - int(exp_b)
                                      + rep.bytes.get("all_reduce", 0)})
            elif exp_b:
                d = replace(d, bytes={"all_reduce": d.bytes.get("all_reduce", 0) - int(exp_b)})
            # only the share comm_overlap of the hidden buckets is hidden (ClusterSpec.comm_overlap); their
            # NCCL kernels hold SMs the backward they overlap needs (cost_models.contention)
            phi = self.cluster.comm_overlap
            dp_exposed += (1.0 - phi) * hid + overlap_slowdown_s(phi * hid, k.rank_b[worst], self.cluster)
        else:
            dp_exposed = exposed_dp_s(d, backward_s=k.rank_b[worst], forward_s=k.rank_f[worst],
                                      microbatch_s=max(rank_work), num_microbatches=m, cluster=self.cluster)  # fmt: skip
        dp_bytes = d.bytes
        opt = self._optimizer_s(max(q[3] for q in r_q) if self.quant else max(r_params), c)
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
        if c.pp > 1 and max(k.r_pipe) > 0:  # live: in peak_mem_bytes
            mem_breakdown["pipeline_buffers"] = int(max(k.r_pipe))
        pools = self.stream_pools(c, t, runs, on_rank)
        if pools:  # reserved by the allocator, not live: not in peak_mem_bytes (allocator.reserved_peak_bytes)
            mem_breakdown["fsdp_stream_pools"] = int(pools)
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
            ep_comm_s=k.ep_s, cp_comm_s=k.cp_s, ep_expert_read_s=k.read_s,
        )  # fmt: skip

    def _kind_free(self, c: Config, exact: bool, runs: list[tuple[int, int]] | None) -> KindFreeTerms:
        """The part of ``evaluate`` that does not depend on ``c.dp_kind``, memoized (read only)."""
        key = (c.dp, c.tp, c.pp, c.micro_batch, c.num_microbatches, c.schedule, c.virtual_stages, c.recompute,
               c.sequence_parallel, c.cp, c.ep, exact, tuple(runs) if runs is not None else None)  # all but dp_kind
        if self.memo_kind_free and key in self.memos.kind_free:
            return self.memos.kind_free[key]
        out = kind_free_terms(self, c, exact, runs)
        if self.memo_kind_free:
            self.memos.kind_free[key] = out
        return out
