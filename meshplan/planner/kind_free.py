"""The part of costing one configuration that does not depend on its data-parallel kind:
``kind_free_terms`` (used by ``planner.evaluate.ConfigEvaluator.evaluate``, which memoizes it
across the DP kinds ``evaluate_auto`` tries).

For a configuration and a stage split (the evaluator's own, or given ``runs``) it computes per
stage the forward / input-backward / weight-backward / recompute / TP seconds (with the engine's
gradient-accumulation pass and, where the configuration runs torch.autocast on fp32 parameters,
the casts of those parameters: ``autocast_cast_s``), parameters and
stored activations (skip tensors passed through, tied-weight copies), the sends between stages
on their links, the stage-to-rank placement of the schedule, the makespan (the schedule
simulator when ``exact``, else its lower bound) and per pipeline rank the work, parameters,
activations held (in-flight microbatches + recompute transient; under zero-bubble schedules
also the microbatches waiting for their weight pass, ``split_backward_held``) and the EP/CP terms (per
stage, over the stage's own layers, added to its forward and backward). The kind-
dependent rest (model-state sharding, DP sync, optimizer) is ``ConfigEvaluator.evaluate``.
No torch import.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from operator import add, itemgetter
from typing import TYPE_CHECKING, Protocol

from meshplan.cost_models.autocast_casts import (
    WIDENING_COPY_FRACTION,
    CastBytes,
    autocast_cast_bytes,
)
from meshplan.cost_models.comm import collective_time_s, p2p_crosses_nodes, p2p_time_s
from meshplan.cost_models.grad_accum import grad_accum_pass_bytes
from meshplan.cost_models.pipe_p2p import blocking, deepspeed_hop_s
from meshplan.cost_models.precision import (
    fp8_amax_reduction_s,
    fp8_recipe,
    fp8_sp_amax_reduction_s,
    fp8_weight_copy_bytes,
)
from meshplan.partition.schedule import ZERO_BUBBLE, held_counts, held_peaks
from meshplan.planner.memory_floor import rank_pipeline_buffers
from meshplan.planner.pipeline_time import (
    makespan_lower_bound,
    per_stage_held,
    rank_held,
    simulated_makespan,
    stage_inflight,
)
from meshplan.planner.pipeline_time import placement as stage_placement
from meshplan.planner.search_types import Config

if TYPE_CHECKING:
    from meshplan.cost_models.hardware import ClusterSpec
    from meshplan.planner.cost_memos import CostMemos
    from meshplan.planner.costing import CostTable, GraphCoster
    from meshplan.planner.epcp_cost import EPCPTerms
    from meshplan.planner.epcp_coster import EPCPCosts
    from meshplan.planner.state_costs import StateCosts


class KindFreeCosts(Protocol):
    """What ``kind_free_terms`` reads of the coster (``evaluate.ConfigEvaluator``), named here
    structurally so this module sits below the coster, which calls it, without an import cycle."""

    cluster: ClusterSpec
    coster: GraphCoster
    memos: CostMemos
    states: StateCosts
    ep_cp: EPCPCosts
    quant: bool
    dtype: str
    memo_kind_free: bool
    pp_buffers: str
    pp_scatter_gather: bool
    pp_p2p: str
    grad_accum_pass: str
    recompute_unit: str

    def table(self, c: Config) -> CostTable: ...
    def split(self, t: CostTable, num_stages: int, virtual_stages: int = 1) -> list[tuple[int, int]]: ...
    def prefix(self, t: CostTable) -> dict[str, list[float]]: ...
    def transient(self, t: CostTable, runs: list[tuple[int, int]], whole: bool = False,
                  cast: bool = False) -> float: ...
    def tied_layers(self, t: CostTable) -> list[int]: ...
    def inflight_ranks(self, c: Config) -> list[float]: ...
    def autocast_once(self, c: Config) -> bool: ...


@dataclass(frozen=True, slots=True)
class StageColumns:
    """Per stage of a split (``stage_columns``): seconds per microbatch of forward (``f``), input
    backward (``b``), weight backward (``w``), recompute (``rec``) and TP communication (``tp``);
    parameters (tied-weight copies included; ``params0`` the same values, kept unchanged), stored
    activations, model-state bytes without ZeRO and trainable count (``q``: [param, grad,
    optimizer, trainable]), bytes sent on (``sendb``), autocast's kept bytes (``cast``) and the
    weight-pass gradients a split backward keeps (``wgrad``, ``LayerCost.wgrad_bytes``)."""

    f: list[float]
    b: list[float]
    w: list[float]
    rec: list[float]
    tp: list[float]
    params: list[float]
    params0: list[float]
    act: list[float]
    q: list[list[float]]
    sendb: list[int]
    cast: list[float]
    wgrad: list[float]
    castw: list[float]
    hf: list[float]  # host dispatch seconds per microbatch of the forward (LayerCost.host_fwd_s)
    hb: list[float]  # ... and of the backward with its recompute (LayerCost.host_bwd_s)
    castx: list[float]  # LayerCost.autocast_expert_bytes: all E experts' copies, a rank keeps 1/ep
    cachew: list[float]
    remat: list[float]
    castp: list[float]  # LayerCost.autocast_cast_params: parameters autocast casts per forward
    recastp: list[float]  # LayerCost.autocast_recast_params: ... again in a full / op recompute
    gcastp: list[float]  # LayerCost.autocast_gradcast_params: ... whose gradient is cast back (the trained ones)
    # LayerCost.autocast_act (autocast_casts.ActivationCastBytes), bytes per microbatch: forward, backward at the
    # roofline, forward / backward on the widening copy path, and the forward parts of the re-run layers
    actf: list[float]
    actb: list[float]
    actfw: list[float]
    actbw: list[float]
    actrf: list[float]
    actrfw: list[float]
    loss: list  # per stage, what only the loss saves (LayerCost.loss_bytes summed in layer order)
    fwd_end: list  # per stage, its layers' logits less the loss's saves (the forward end's peak beside the cache)
    casts: bool  # whether any stage casts parameters or activations under autocast (castp or actf)
    any_remat: bool  # whether any stage re-saves autocast's copies in a recompute (remat)


@dataclass(frozen=True, slots=True)
class KindFreeTerms:
    """The DP-kind-free terms of one configuration (``kind_free_terms``; read only). ``st_*`` are
    per stage, ``r_*`` per pipeline rank, ``worst`` the rank with the most gradients and
    parameters; seconds are per step unless named per microbatch."""

    t: CostTable  # the configuration's cost table
    n_st: int  # stages (pp x virtual stages)
    m: int  # microbatches
    runs: list[tuple[int, int]]  # each stage's layer range
    ranks: range  # the pipeline ranks
    on_rank: list[list[int]]  # each rank's stages
    placement: tuple[int, ...]  # each stage's rank
    st_q: list[list[float]]  # StageColumns.q
    st_params0: list[float]  # parameters per stage, expert parameters not taken off
    st_params: list[float]  # parameters per stage a rank holds (ep: E/ep experts)
    st_act: list[float]  # stored activations per stage per microbatch
    st_sendb: list[int]  # bytes each stage sends on
    rank_work: list[float]  # seconds of F + B + W per microbatch per rank
    makespan: float  # the schedule's makespan (simulated, or its lower bound)
    bubble_frac: float  # idle / compute over the ranks (0.0 unless simulated)
    infl: list[float]  # in-flight microbatches per rank
    st_infl: list[float]  # in-flight microbatches per stage, at the stage's own peak
    r_params: list[float]  # parameters per rank
    r_q: list[list[float]]  # StageColumns.q summed per rank
    ec: EPCPTerms  # the whole model's EP/CP terms per microbatch
    r_act: list[float]  # activations held per rank (in flight + recompute transient)
    r_cast: list[float]  # autocast's kept bytes per rank (in flight)
    r_pipe: list[float]  # the pipeline runtime's buffers per rank
    fp8_copy: float  # fp8's weight copy (every rank)
    worst: int
    ep_cut: list[float]  # expert parameters a rank does not hold under ep
    r_experts: list[float]  # expert parameters per rank
    grad_bytes: float  # gradient bytes the worst rank syncs
    gather_bytes: float  # parameter bytes the worst rank gathers
    rank_b: list[float]  # backward seconds per microbatch per rank
    rank_f: list[float]  # forward seconds per microbatch per rank
    ep_s: float  # the busiest rank's EP all-to-all and imbalance seconds per step
    cp_s: float  # its CP ring seconds per step
    read_s: float  # its expert weight-read seconds per step
    epcp_bytes: dict[str, float]  # its EP/CP bytes per step, per collective
    tp_s: float  # its TP communication seconds per step
    rec_s: float  # its recompute seconds per step
    compute: float  # its compute seconds per step
    bubble: float  # its idle seconds per step
    pp_comm: float  # its pipeline send seconds per step
    send_recv: int  # its pipeline send bytes per step
    stage_times: list[tuple[float, float, float, float]]  # per stage (F, B + W, W, send) seconds per microbatch
    rank_sum: Callable[[list], list]  # per pipeline rank, a per-stage list's sum over its stages (RankLayout.sums)


def kind_free_terms(
    ev: KindFreeCosts, c: Config, exact: bool, runs: list[tuple[int, int]] | None
) -> KindFreeTerms:
    """``c``'s DP-kind-free terms on evaluator ``ev`` (read only; see the module docstring)."""
    t = ev.table(c)
    n_st = c.pp * c.virtual_stages
    m = c.num_microbatches
    if runs is None:
        runs = ev.split(t, n_st, c.virtual_stages) if n_st > 1 else [(0, len(t.layers))]
    cols = stage_columns(ev, t, runs)
    st_rec, st_tp = cols.rec, cols.tp
    # a split backward (zero-bubble schedules) re-runs a block checkpointed on its own in the input pass
    # AND in the weight pass: torch's checkpoint re-runs a region in every backward graph task that reads
    # it, and torch.distributed.pipelining's weight pass is autograd.grad calls of its own (meshplan's
    # runtime puts a microbatch's under one GraphExecGroup: one more re-run, runtime/apply/schedules.py)
    rerun_w = (c.pp > 1 and c.schedule in ZERO_BUBBLE and c.recompute in ("full", "op")
               and ev.recompute_unit == "block")
    st_f, st_b, st_w, st_ec, st_act = stage_work(ev, c, t, runs, cols, rerun_w)
    # the gradient pass after each microbatch's backward (autograd's own accumulation into .grad, a
    # main-gradient hook, DeepSpeed's BF16_Optimizer: cost_models.grad_accum), over the stage's
    # parameters on this rank, memory-bound; autograd's on the rank's shard where the DP kind
    # reduce-scatters every microbatch (no pipeline: under one, pipelining keeps them unsharded)
    pass_b = grad_accum_pass_bytes(ev.grad_accum_pass, ev.states.precision, m)
    if pass_b and ev.grad_accum_pass == "autograd" and c.pp == 1:
        pass_b /= ev.states.zero_divs(c)[1]
    if pass_b:
        hbm = ev.cluster.mem_bw_bytes_per_s * ev.cluster.mem_efficiency
        if c.pp > 1 and c.schedule in ZERO_BUBBLE:  # it follows the weight gradients
            st_w = [w + p * pass_b / hbm for w, p in zip(st_w, cols.params)]
        else:
            st_b = [b + p * pass_b / hbm for b, p in zip(st_b, cols.params)]
    if cols.casts and ev.states.runs_autocast(c):
        st_f, st_b, st_w = autocast_cast_s(ev, c, cols, st_f, st_b, st_w, rerun_w)
    if ev.cluster.host_op_s:  # the host-dispatch floor (cost_models.host), per stage and microbatch
        st_f, st_b, st_w = host_floored(st_f, st_b, st_w, cols.hf, cols.hb)
    st_params, st_q, st_params0, st_sendb = cols.params, cols.q, cols.params0, cols.sendb
    ranks = range(c.pp)
    placement = stage_placement(c.schedule, c.pp, c.virtual_stages)
    if ev.dtype == "fp8" and fp8_recipe(ev.coster.profile.fp8_recipe).amax_reductions:
        st_f, st_b = amax_reduced(ev, c, t, runs, placement, st_f, st_b)
    if ev.dtype == "fp8" and c.tp > 1 and c.sequence_parallel and fp8_recipe(ev.coster.profile.fp8_recipe).sp_amax_reductions:
        st_f, st_b = sp_amax_reduced(ev, c, t, runs, st_f, st_b)
    lay = rank_layout(ev, t, runs, cols, placement, c.pp)
    on_rank, rank_sums = lay.on_rank, lay.sums
    # stage i sends to stage i + 1 on the link between their pipeline ranks: NVLink when both
    # sit in one node, else one NIC (comm.p2p_crosses_nodes)
    ds_p2p = blocking(ev.pp_p2p)
    st_send = stage_sends(ev, c, lay, placement, st_sendb, ds_p2p)
    totals = [f + b + w for f, b, w in zip(st_f, st_b, st_w)]
    rank_work = rank_sums(totals)
    if exact:
        makespan, bubble_frac = simulated_makespan(c, st_f, st_b, st_w, st_send,
                                                   sends_occupy=ev.cluster.sends_occupy_rank or ds_p2p)  # fmt: skip
    else:
        makespan, bubble_frac = makespan_lower_bound(c, st_f, totals, rank_work), 0.0
    infl = ev.inflight_ranks(c)
    r_params, r_q = lay.r_params, lay.r_q  # rank_sums(st_params); the q columns' sums in stage order
    ec = ev.ep_cp.epcp(c)  # the whole model's terms (the stages' sum): what ep saves, for reports
    ep_cut = [0.0 for _ in ranks]  # expert parameters a rank does not hold under ep
    r_experts = rank_sums([e.expert_params for e in st_ec]) if st_ec else [0.0 for _ in ranks]
    if ec.expert_params_saved:  # ep: a rank holds E/ep experts of the MoE layers its stages hold
        ep_cut = rank_sums([e.expert_params_saved for e in st_ec])
        r_params = [p - e for p, e in zip(r_params, ep_cut)]
        st_params = [p - e.expert_params_saved for p, e in zip(st_params, st_ec)]
    # kept besides under autocast (fp32 parameters): per in-flight microbatch (LayerCost.autocast_bytes),
    # but the weight copies once per stage where one autocast region spans the step (ev.autocast_once)
    cast_w, cast_mb, r_cast_w, r_cast_mb = cast_kept(ev, lay, cols, c.ep, ev.autocast_once(c))
    r_st_act = lay.r_act if st_act is cols.act else rank_sums(st_act)
    if not per_stage_held(c):
        r_act = [x * f for x, f in zip(r_st_act, infl)]
        r_cast = [x * f for x, f in zip(r_cast_mb, infl)]
    else:  # interleaved: a rank's chunks hold different counts at its peak, weighted over its order
        r_act, r_cast = rank_held(c, st_act), rank_held(c, cast_mb)
    st_infl, r_pipe = stage_buffers(ev, c, t, runs, lay, st_sendb, infl)
    # recompute_unit "stage" (meshplan's runtime before per-block checkpointing): one region per stage call
    whole = c.pp > 1 and c.recompute == "full" and ev.recompute_unit == "stage"
    trans = rank_transients(ev, t, lay, whole, False)
    # under autocast a re-run layer saves its weight copies and fp32 inputs again: autocast's part
    # of the transient (LayerCost.autocast_remat_bytes), counted with autocast's kept bytes (r_cast)
    trans_cast = (rank_transients(ev, t, lay, whole, True)
                  if cols.any_remat or ev.coster.quant.mode == "qat" else trans)  # QAT: LayerCost.autocast_work_bytes
    if c.pp > 1 and c.schedule in ZERO_BUBBLE:
        kept = split_backward_kept(cols.wgrad, st_sendb, cols.loss)
        r_act = split_backward_held(c, r_st_act, rank_sums(kept), trans)
        # autocast's weight copies are saved by the weight-reading ops: kept to the weight pass
        r_cast = [x * f for x, f in zip(r_cast_mb, held_counts(c.schedule, c.pp, c.num_microbatches, c.virtual_stages))]
    else:
        r_act = [x + y for x, y in zip(r_act, trans)]
    r_cast = [x + w + tc - tr for x, w, tc, tr in zip(r_cast, r_cast_w, trans_cast, trans)]
    if lay.r_end is not None:
        # full / op recompute under autocast: at the end of a stage's forward call autocast's weight
        # cache still holds every weight copy the call made (LayerCost.autocast_cache_bytes) beside
        # its logits, before the loss runs; the cache is cleared when the call's autocast region
        # exits (torch.amp.autocast.__exit__), before any backward: a peak beside the in-flight
        # activations instead of the backward's transient (rank_layout.r_end: each rank's largest)
        r_cast = [x + max(0.0, e - tc) for x, e, tc in zip(r_cast, lay.r_end, trans_cast)]
    fp8_copy = fp8_weight_copy_bytes(ev.states.largest_linear / c.tp) if ev.dtype == "fp8" else 0.0
    worst = max(ranks, key=lambda r: (r_q[r][1], r_params[r]))
    busiest = max(ranks, key=rank_work.__getitem__)
    on_b = on_rank[busiest]
    tp_s = m * sum(st_tp[i] for i in on_b)
    # the busiest rank's EP / CP seconds per step (inside its stage times, so inside the makespan)
    ep_s = m * sum(st_ec[i].ep_comm_s + st_ec[i].imbalance_s for i in on_b) if st_ec else 0.0
    cp_s = m * sum(st_ec[i].cp_comm_s for i in on_b) if st_ec else 0.0
    read_s = m * sum(st_ec[i].expert_read_s for i in on_b) if st_ec else 0.0
    epcp_bytes: dict[str, float] = {}
    for i in on_b if st_ec else []:
        for key, v in st_ec[i].comm_bytes.items():
            epcp_bytes[key] = epcp_bytes.get(key, 0.0) + v * m

    # p2p the busiest rank sends: outputs forward (not the last stage), input gradients backward
    # (not the first: the boundary below); the simulated makespan times both directions already
    def sends(xs: list) -> float:
        return sum((xs[i] if i < n_st - 1 else 0) + (xs[i - 1] if i > 0 else 0) for i in on_b)

    out = KindFreeTerms(
        t=t, n_st=n_st, m=m, runs=runs, ranks=ranks, on_rank=on_rank, placement=placement, st_q=st_q,
        st_params0=st_params0, st_params=st_params, st_act=st_act, st_sendb=st_sendb, rank_work=rank_work,
        makespan=makespan, bubble_frac=bubble_frac, infl=infl, st_infl=st_infl, r_params=r_params, r_q=r_q, ec=ec,
        r_act=r_act, r_cast=r_cast, r_pipe=r_pipe, fp8_copy=fp8_copy, worst=worst, ep_cut=ep_cut, r_experts=r_experts,
        # gradients synced: every parameter, or (quantized) only the trainable ones, reduced in
        # fp32 on every precision as the runtime does (cost_models.grad_sync.GRAD_REDUCE_BYTES:
        # fp32 master gradients under autocast, FSDP2 reduce_dtype fp32), or in the training dtype
        # where the engine profile says so (EngineProfile.grad_reduce "param": torch FSDP1 under
        # Composer); parameters gathered in the training dtype
        grad_bytes=(r_q[worst][3] if ev.quant else r_params[worst]) * ev.states.grad_reduce_bytes,
        gather_bytes=r_q[worst][0] if ev.quant else r_params[worst] * ev.states.elem_bytes,
        rank_b=rank_sums(list(map(add, st_b, st_w))), rank_f=rank_sums(st_f),
        ep_s=ep_s, cp_s=cp_s, read_s=read_s, epcp_bytes=epcp_bytes,
        tp_s=tp_s, rec_s=m * sum(st_rec[i] for i in on_b) * (2 if rerun_w else 1),
        compute=m * rank_work[busiest] - tp_s - ep_s - cp_s - read_s,
        bubble=max(0.0, makespan - m * rank_work[busiest]),
        pp_comm=m * sends(st_send) if c.pp > 1 else 0.0,
        send_recv=int(m * sends(st_sendb)) if c.pp > 1 else 0,
        stage_times=list(zip(st_f, map(add, st_b, st_w), st_w, st_send)),
        rank_sum=rank_sums,
    )  # fmt: skip
    return out


def stage_work(
    ev: KindFreeCosts, c: Config, t: CostTable, runs: list[tuple[int, int]], cols: StageColumns, rerun_w: bool
) -> tuple[list[float], list[float], list[float], list[EPCPTerms], list[float]]:
    """Per stage, (forward, input backward, weight backward) seconds per microbatch of ``cols``
    (``rerun_w``: with the recompute again in the weight pass), the stages' EP/CP terms inside
    them, and the stored activations with the token exchange's saves. Memoized per (table, split,
    ``rerun_w``, EP/CP key): read only."""
    has = ev.ep_cp.has_epcp(c)
    key = (id(t), tuple(runs), ev.states.layout_key, rerun_w, ev.ep_cp.key(c) if has else None)
    hit = ev.memos.stage_work.get(key)
    if hit is not None:
        return hit
    st_f, st_b, st_w, st_act = cols.f, cols.b, cols.w, cols.act
    if rerun_w:
        st_w = [w + r for w, r in zip(st_w, cols.rec)]
    # EP all-to-all, CP ring, expert imbalance / weight reads of each stage's own layers, inside its
    # forward and (input-)backward, so the schedule simulator times them where they run
    st_ec = ev.ep_cp.epcp_stages(c, t, runs) if has else []
    if st_ec:
        st_f = [f + e.forward_s for f, e in zip(st_f, st_ec)]
        # the backward's share: its exchanges run in the input backward; its MoE compute terms
        # (imbalance, and the weight-read saving, <= 0) split like the stage's own backward between
        # input and weight gradients, so neither part can go below zero when the saving is larger
        # than the stage's input backward alone
        comm_b = [e.ep_comm_s - e.ep_forward_s + e.cp_comm_s - e.cp_forward_s for e in st_ec]
        comp_b = [e.per_microbatch_s - e.forward_s - cb for e, cb in zip(st_ec, comm_b)]
        frac = [b / (b + w) if b + w > 0 else 1.0 for b, w in zip(st_b, st_w)]
        st_w = [w + x * (1.0 - f) for w, x, f in zip(st_w, comp_b, frac)]
        st_b = [b + cb + x * f for b, cb, x, f in zip(st_b, comm_b, comp_b, frac)]
        if any(e.kept_bytes for e in st_ec):  # the token exchange's saves (epcp_cost.ep_kept_bytes)
            st_act = [a + e.kept_bytes for a, e in zip(st_act, st_ec)]
    out = ev.memos.stage_work[key] = (st_f, st_b, st_w, st_ec, st_act)
    return out


@dataclass(frozen=True, slots=True)
class RankLayout:
    """The stages of a split on the pipeline ranks of a placement (``rank_layout``, memoized; read
    only): each rank's stages in order (``on_rank``), whether it is stage r on rank r (``one``),
    each rank's layer ranges, and the per-rank sums of the split's static columns: parameters
    (``StageColumns.params``), the q columns, stored activations and, where any stage has
    autocast's weight cache, each rank's largest forward-end peak (``r_end``; else None)."""

    on_rank: list[list[int]]
    one: bool
    getters: list[Callable[[list], tuple]] | None  # per rank, its stages' items (two or more stages each)
    rank_runs: list[list[tuple[int, int]]]
    placement: tuple[int, ...]
    key: tuple
    r_params: list[float]
    r_q: list[list[float]]
    r_act: list[float]
    r_end: list[float] | None

    def sums(self, xs: list) -> list:
        """Per pipeline rank, the sum of ``xs`` over its stages in stage order (as sum(generator));
        one stage per rank: 0.0 + the stage's value, the float sum() of one item gives."""
        if self.one:
            return [0.0 + x for x in xs]
        if self.getters is not None:
            return [sum(g(xs)) for g in self.getters]
        return [sum(xs[i] for i in ix) for ix in self.on_rank]


def rank_layout(ev: KindFreeCosts, t: CostTable, runs: list[tuple[int, int]], cols: StageColumns,
                placement: tuple[int, ...], pp: int) -> RankLayout:
    """``RankLayout`` of ``runs`` on ``t`` under ``placement`` over ``pp`` ranks (memoized per
    table, split, placement and state layout)."""
    key = (id(t), tuple(runs), placement, ev.states.layout_key)
    hit = ev.memos.rank_layout.get(key)
    if hit is not None:
        return hit
    n_st = len(runs)
    on_rank: list[list[int]] = [[] for _ in range(pp)]
    for s_, r_ in enumerate(placement):
        on_rank[r_].append(s_)
    one = n_st == pp and placement == tuple(range(n_st))
    getters = None if one or any(len(ix) < 2 for ix in on_rank) else [itemgetter(*ix) for ix in on_rank]
    st_q = cols.q
    # per column, the sum over the rank's stages in stage order (as sum(generator) adds them)
    if one:
        r_q = [[0.0 + x for x in q] for q in st_q]
    else:
        r_q = [[sum(col) for col in zip(*(st_q[i] for i in ix))] if ix else [0, 0, 0, 0]
               for ix in on_rank]  # fmt: skip
    r_end = None
    if any(cols.cachew):
        end = [max(0.0, cw + x) for cw, x in zip(cols.cachew, cols.fwd_end)]
        r_end = [max((end[i] for i in ix), default=0.0) for ix in on_rank]
    lay = RankLayout(on_rank=on_rank, one=one, getters=getters, key=key, placement=placement, r_params=[], r_q=r_q, r_act=[], r_end=r_end,
                     rank_runs=[[run] for run in runs] if one else [[runs[i] for i in ix] for ix in on_rank])  # fmt: skip
    lay.r_params.extend(lay.sums(cols.params))
    lay.r_act.extend(lay.sums(cols.act))
    ev.memos.rank_layout[key] = lay
    return lay


def stage_buffers(ev: KindFreeCosts, c: Config, t: CostTable, runs: list[tuple[int, int]], lay: RankLayout,
                  sendb: list[int], infl: list[float]) -> tuple[list[float], list[float]]:
    """Per stage the microbatches it holds at its own peak (``pipeline_time.stage_inflight``) and per
    pipeline rank the pipeline runtime's receive buffers and cached outputs (``rank_pipeline_buffers``,
    ``allocator.pipeline_buffer_bytes``): live memory beside the activations; a stage's output is what
    it sends, the last's its logits. Memoized per layout, schedule, m and buffer convention (read only)."""
    key = (lay.key, c.schedule, c.num_microbatches, c.virtual_stages, ev.pp_buffers)
    hit = ev.memos.stage_buffers.get(key)
    if hit is None:
        placement = lay.placement
        st_infl = stage_inflight(c, placement, infl)
        hit = ev.memos.stage_buffers[key] = (
            st_infl, rank_pipeline_buffers(ev, t, runs, sendb, placement, st_infl, c))
    return hit


def rank_transients(ev: KindFreeCosts, t: CostTable, lay: RankLayout, whole: bool, cast: bool) -> list[float]:
    """Per pipeline rank, ``ev.transient`` of its stages' layer ranges (memoized per layout; read only)."""
    key = (lay.key, whole, cast)
    hit = ev.memos.rank_transient.get(key)
    if hit is None:
        hit = ev.memos.rank_transient[key] = [ev.transient(t, rr, whole, cast) for rr in lay.rank_runs]
    return hit


def cast_kept(ev: KindFreeCosts, lay: RankLayout, cols: StageColumns, ep: int,
              once: bool) -> tuple[list[float], list[float], list[float], list[float]]:
    """Autocast's kept bytes per stage: the weight copies held once (``once``: ``autocast_once``;
    else 0.0) and per in-flight microbatch the rest (an expert's copies 1/``ep``), and both summed
    per rank (memoized per layout; read only)."""
    key = (lay.key, ep, once)
    hit = ev.memos.cast_kept.get(key)
    if hit is None:
        cast_w = cols.castw if once else [0.0 for _ in cols.cast]
        cast_mb = [x - w + e / ep for x, w, e in zip(cols.cast, cast_w, cols.castx)]
        hit = ev.memos.cast_kept[key] = (cast_w, cast_mb, lay.sums(cast_w), lay.sums(cast_mb))
    return hit


def stage_sends(ev: KindFreeCosts, c: Config, lay: RankLayout, placement: tuple[int, ...], st_sendb: list[int],
                ds_p2p: bool) -> list[float]:
    """Per stage, the seconds of its send to the next stage per microbatch (memoized per layout and
    pipeline stride)."""
    stride, dpn = c.dp * c.cp * c.tp, ev.cluster.devices_per_node
    mkey = (lay.key, stride, c.tp, c.sequence_parallel)
    hit = ev.memos.stage_sends.get(mkey)
    if hit is not None:
        return hit
    n_st = len(st_sendb)
    crosses = ev.memos.crosses.setdefault((stride, dpn), {})  # per pair of pipeline ranks, shared by configs
    send_s: dict[tuple[int, bool], float] = {}  # per (bytes, crosses nodes): most stages send the same
    st_send = []
    # Megatron-LM's scatter/gather (``EngineProfile.pp_scatter_gather``): a 1/tp slice per tp rank over
    # the link, then an all-gather of the whole activation over the receiving stage's tp group
    sg_tp = c.tp if ev.pp_scatter_gather and c.tp > 1 and not c.sequence_parallel else 1
    # DeepSpeed's PipelineEngine (cost_models.pipe_p2p): the hop is the whole blocking exchange, held by
    # the sending action in the simulator (sends_occupy)
    for i, sb in enumerate(st_sendb):
        if not sb:
            st_send.append(0.0)
            continue
        cross = False
        if i + 1 < n_st:
            pair = (placement[i], placement[i + 1])
            if pair not in crosses:
                crosses[pair] = p2p_crosses_nodes(pair[0], pair[1], stride, dpn)
            cross = crosses[pair]
        if (sb, cross) not in send_s and ds_p2p:  # one blocking exchange of activation and gradient
            send_s[sb, cross] = deepspeed_hop_s(sb, c.tp, ev.cluster, crosses_nodes=cross, pp_p2p=ev.pp_p2p,
                                                sequence_parallel=c.sequence_parallel)  # fmt: skip
        elif (sb, cross) not in send_s:
            send_s[sb, cross] = p2p_time_s(sb / sg_tp, ev.cluster, crosses_nodes=cross) + (collective_time_s(
                "all_gather", sb, sg_tp, ev.cluster, ranks_per_node=min(sg_tp, dpn)) if sg_tp > 1 else 0.0)  # fmt: skip
        st_send.append(send_s[sb, cross])
    ev.memos.stage_sends[mkey] = st_send
    return st_send


def split_backward_kept(wgrad: list[float], sendb: list[int], loss: list[float]) -> list[float]:
    """Per stage, bytes per microbatch a split backward (zero-bubble schedules) keeps from the
    input backward to the weight pass beyond the activations (``partition.schedule.held_states``):
    its weight-reading ops' output gradients (``wgrad``) and, from torch's ``backward_state``, the
    output and its gradient (not the last stage) and the received input's ``.grad`` (not the
    first). The last stage's input backward frees what only its loss saved (``loss``: the
    log-softmax; its logits are freed too, and counted in flight only: ``rank_pipeline_buffers``).
    The first stage's input backward does nothing (its inputs are token ids: torch runs its whole
    backward in the weight pass): it keeps the output and its gradient only. May be negative (the last stage), never below minus the activations."""
    n = len(sendb)
    out = []
    for s in range(n):
        o = 2.0 * sendb[s] if s < n - 1 else 0.0
        out.append(o if s == 0 else wgrad[s] + o + float(sendb[s - 1]) - loss[s])
    return out


def split_backward_held(c: Config, act: list[float], kept: list[float], trans: list[float]) -> list[float]:
    """Per pipeline rank, the activations a zero-bubble schedule holds at its peak: over the
    states of the rank's action order (``partition.schedule.held_states``), the ``inflight``
    microbatches' activations ``act`` + the ``pending`` ones' activations and weight-pass bytes
    ``kept`` (+ the backward's transient ``trans`` inside an input backward). All per rank, per
    microbatch of its share. At least 1F1B's count of in-flight microbatches × ``act``."""
    # max over the states of s.inflight * a + s.pending * max(0.0, a + k) + (t if s.in_backward else 0.0)
    return held_peaks(c.schedule, c.pp, c.num_microbatches, c.virtual_stages,
                      act, [max(0.0, a + k) for a, k in zip(act, kept)], trans)  # fmt: skip


def host_floored(f: list[float], b: list[float], w: list[float], hf: list[float],
                 hb: list[float]) -> tuple[list[float], list[float], list[float]]:
    """Per stage, the forward and backward of one microbatch no faster than the host dispatches
    them (``cost_models.host``): ``f = max(f, hf)``; where the backward's host time ``hb`` exceeds
    ``b + w``, both parts stretch by the same factor (the host feeds them in turn), so a split
    backward keeps its input : weight proportion."""
    f2 = [h if h > x else x for x, h in zip(f, hf)]  # max(x, h)
    b2, w2 = list(b), list(w)
    for i, h in enumerate(hb):
        dev = b[i] + w[i]
        if h > dev:
            if dev > 0:
                b2[i], w2[i] = b[i] * h / dev, w[i] * h / dev
            else:
                b2[i] = h
    return f2, b2, w2


def autocast_cast_s(ev: KindFreeCosts, c: Config, cols: StageColumns, f: list[float], b: list[float],
                    w: list[float], rerun_w: bool) -> tuple[list[float], list[float], list[float]]:
    """``f``, ``b``, ``w`` (per stage, seconds per microbatch) plus torch.autocast's casts of the
    stage's fp32 parameters (``cost_models.autocast_casts``), memory-bound at the HBM roofline: the
    forward's (``cols.castp``; a step's share where one autocast region spans the step,
    ``ev.autocast_once``), a full / op recompute's again (``cols.recastp``, in the input backward, and
    in the weight pass too where a split backward re-runs a block there: ``rerun_w``), and the
    gradients' casts back to fp32 (``cols.gcastp``: the trained parameters only, a frozen weight has no
    gradient; after the weight gradients: in the weight pass of a split backward), on torch's widening
    copy path (``WIDENING_COPY_FRACTION`` of the roofline). Then the passes of the fp32 activations
    (``autocast_casts.activation_cast_bytes``: ``cols.act*``): forward, backward (the input backward),
    and a re-run layer's forward parts again with its recompute."""
    cb = autocast_cast_bytes(c.num_microbatches, per_step=ev.autocast_once(c), recompute=c.recompute)
    hbm = ev.cluster.mem_bw_bytes_per_s * ev.cluster.mem_efficiency
    split = c.pp > 1 and c.schedule in ZERO_BUBBLE
    act_f, act_fw, rec, back, act_b = _cast_parts(ev, cols, cb, hbm, c.recompute)
    f2 = [x + p * cb.forward / hbm + af + afw for x, p, af, afw in zip(f, cols.castp, act_f, act_fw)]
    b2 = [x + r + a + (0.0 if split else g) for x, r, a, g in zip(b, rec, act_b, back)]
    w2 = [x + (g if split else 0.0) + (r if rerun_w else 0.0) for x, r, g in zip(w, rec, back)]
    return f2, b2, w2


def _cast_parts(ev: KindFreeCosts, cols: StageColumns, cb: CastBytes, hbm: float, recompute: str) -> tuple[list[float], ...]:
    """``autocast_cast_s``'s terms per stage that do not depend on the microbatch count: the forward's
    activation passes at the roofline and on the widening copy path (apart: the forward adds them in
    turn), a re-run's casts, the gradients' casts back, the backward's activation passes. Memoized per
    (stage columns, recompute kind; the evaluator's cluster), read only."""
    key = (id(cols), recompute)
    hit = ev.memos.cast_parts.get(key)
    if hit is not None and hit[0] is cols:
        return hit[1]
    wide = hbm * WIDENING_COPY_FRACTION
    act_f = [af / hbm for af in cols.actf]
    act_fw = [afw / wide for afw in cols.actfw]
    # actrf / actrfw are non-zero only on layers re-run by a full / op recompute (LayerCost.autocast_act_recomputed)
    rec = [r * cb.recompute / hbm + (arf / hbm + arfw / wide) for r, arf, arfw in zip(cols.recastp, cols.actrf, cols.actrfw)]
    back = [p * cb.backward / wide for p in cols.gcastp]  # the trained parameters' gradients alone
    act_b = [ab / hbm + abw / wide for ab, abw in zip(cols.actb, cols.actbw)]
    out = (act_f, act_fw, rec, back, act_b)
    ev.memos.cast_parts[key] = (cols, out)  # holds cols: its id names it while the entry lives
    return out


def amax_reduced(ev: KindFreeCosts, c: Config, t: CostTable, runs: list[tuple[int, int]],
                 placement: tuple[int, ...], f: list[float], b: list[float]) -> tuple[list[float], list[float]]:
    """``f``, ``b`` (per stage, seconds per microbatch) plus the fp8 recipe's amax all-reduces
    (``precision.fp8_amax_reduction_s``): each stage is one model chunk, one fp8_autocast region,
    whose forward exit and backward each all-reduce the amaxes of every converted linear on its
    pipeline rank (TE's global buffer per recipe and group) over tp x dp x cp ranks."""
    per_rank: dict[int, int] = {}
    for (a, e), r in zip(runs, placement):
        n = ev.coster.fp8_linears(t.layers[a].node_start, t.layers[e - 1].node_end) if e > a else 0
        per_rank[r] = per_rank.get(r, 0) + n
    group = c.tp * c.dp * c.cp
    f2, b2 = list(f), list(b)
    for i, r in enumerate(placement[:len(runs)]):
        af, ab = fp8_amax_reduction_s(ev.coster.profile.fp8_recipe, per_rank[r], group, ev.cluster)
        f2[i] += af
        b2[i] += ab
    return f2, b2


def sp_amax_reduced(ev: KindFreeCosts, c: Config, t: CostTable, runs: list[tuple[int, int]],
                    f: list[float], b: list[float]) -> tuple[list[float], list[float]]:
    """``f``, ``b`` (per stage, seconds per microbatch) plus TE current scaling's per-tensor amax
    all-reduces over the TP group under sequence parallelism (``precision.fp8_sp_amax_reduction_s``),
    one per Transformer Engine module of the stage (a distinct input of its converted linears)."""
    f2, b2 = list(f), list(b)
    for i, (a, e) in enumerate(runs):
        mods = ev.coster.fp8_linears(t.layers[a].node_start, t.layers[e - 1].node_end, by_input=True) if e > a else 0
        af, ab = fp8_sp_amax_reduction_s(ev.coster.profile.fp8_recipe, mods, c.tp, ev.cluster)
        f2[i] += af
        b2[i] += ab
    return f2, b2


def stage_columns(ev: KindFreeCosts, t: CostTable, runs: list[tuple[int, int]]) -> StageColumns:
    """Per stage of ``runs`` on table ``t``: forward / input-backward / weight-backward / recompute /
    TP seconds (prefix-sum differences), parameters (with the copies of tied weights whose owner
    sits in another stage: ``params``; ``params0`` the same values), stored activations (with
    skip tensors passed through), model-state bytes without ZeRO and trainable count (``q``) and
    the bytes sent on (``sendb``). Memoized per (table, split, state layout) when
    ``memo_kind_free``: configurations that differ in the schedule, m, the degrees a table does
    not depend on or the DP kind share them (read only)."""
    key = (id(t), tuple(runs), ev.states.layout_key)
    if ev.memo_kind_free and key in ev.memos.stage_cols:
        return ev.memos.stage_cols[key]
    P = ev.prefix(t)

    def col(k: str) -> list[float]:
        arr = P[k]
        return [arr[b] - arr[a] for a, b in runs]

    st_params, st_act = col("params"), col("act")
    if len(runs) > 1:  # skip tensors a stage forwards unchanged stay in its memory per microbatch
        st_act = [x + ev.coster.passthrough_bytes(t, a, b) for x, (a, b) in zip(st_act, runs)]
    b0 = ev.states.unsharded_state_bytes
    if ev.quant:  # [param, grad, optimizer] bytes without ZeRO and trainable count per stage
        st_q = [list(x) for x in zip(col("sp"), col("sg"), col("so"), col("train"))]
    else:
        st_q = [[p * b0.params, p * b0.grads, p * b0.optimizer, p] for p in st_params]
    frozen_tied = ev.coster.quant.mode == "qlora"
    tied = ev.tied_layers(t)  # indices of the layers reading a tied weight, in order
    for i, (a, b) in enumerate(runs) if tied else ():  # a tied weight whose owner sits in another stage: a copy
        for j in tied[bisect.bisect_left(tied, a):bisect.bisect_left(tied, b)]:
            for owner, numel in t.layers[j].tied:
                if not t.layers[a].node_start <= owner < t.layers[b - 1].node_end:
                    st_params[i] += numel
                    extra = (numel * b0.params, 0.0, 0.0, 0.0) if frozen_tied else (
                        numel * b0.params, numel * b0.grads, numel * b0.optimizer, numel)  # fmt: skip
                    st_q[i] = [u + v for u, v in zip(st_q[i], extra)]
    castp, actf, remat = col("castp"), col("actf"), col("remat")
    out = StageColumns(
        f=col("f"), b=col("b"), w=col("w"), rec=col("rec"), tp=col("tp"), params=st_params, params0=list(st_params),
        act=st_act, q=st_q, sendb=[int(t.layers[b - 1].out_bytes) for _, b in runs], cast=col("cast"),
        wgrad=col("wg"), castw=col("castw"), hf=col("hf"), hb=col("hb"), castx=col("castx"), cachew=col("cachew"),
        remat=remat, castp=castp, recastp=col("recastp"), gcastp=col("gcastp"),
        actf=actf, actb=col("actb"), actfw=col("actfw"), actbw=col("actbw"), actrf=col("actrf"), actrfw=col("actrfw"),
        loss=[sum(x.loss_bytes for x in t.layers[a:b]) for a, b in runs],
        fwd_end=[sum(x.logits_bytes - x.loss_bytes for x in t.layers[a:b]) for a, b in runs],
        casts=any(castp) or any(actf), any_remat=any(remat),
    )  # fmt: skip
    if ev.memo_kind_free:
        ev.memos.stage_cols[key] = out
    return out
