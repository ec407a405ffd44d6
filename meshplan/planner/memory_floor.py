"""Memory lower bounds of a configuration that the search skips candidates by
(``planner.search_prune.BoundOrderCosting.skip_out_of_memory``), cheaper than costing it:

- ``held_floor``: valid for every stage split and every DP kind the configuration may take: the
  least over those kinds of the average pipeline rank's model states plus what the kind holds
  unsharded (``StateCosts.fsdp_buffer``, linear in the rank's parameters: the busiest rank holds
  at least the average's) plus fp8's weight copy (the same on every rank);
- ``split_floor``: valid for the time-balanced (or engine-rule) split ``ConfigEvaluator.split`` only,
  which is the split a partial evaluation costs unless a memory re-split may be spent
  (``ConfigEvaluator.rescue_possible``): per pipeline rank its stages' model states, unsharded buffer,
  stored activations × its in-flight microbatches and the pipeline runtime's buffers
  (``rank_pipeline_buffers``, below), the largest rank's, least over the kinds; where gradients
  and activations peak apart (``StateCosts.grads_after_activations``), the larger of the two.

Each term is one ``ConfigEvaluator.evaluate`` adds to a rank's memory, at parameters and
activations no larger than the ones it counts (tied-weight copies, skip tensors passed through,
and recompute transients are left out, both >= 0). Unquantized, without MoE
parallel folding, and (``split_floor``) without expert parallelism; otherwise the bound given.
No torch import.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol

from meshplan.cost_models.allocator import pipeline_buffer_bytes
from meshplan.cost_models.precision import fp8_weight_copy_bytes
from meshplan.planner.cost_memos import CostMemos
from meshplan.planner.pipeline_time import per_stage_held, rank_held, stage_inflight
from meshplan.planner.pipeline_time import placement as stage_placement
from meshplan.planner.search_types import Config

if TYPE_CHECKING:
    from meshplan.planner.epcp_coster import EPCPCosts
    from meshplan.planner.state_costs import StateCosts


class FloorCosts(Protocol):
    """What the floors read of the coster (``evaluate.ConfigEvaluator``), named here structurally
    so this module sits below the coster (which calls ``held_floor``) and ``kind_free`` (which
    calls ``rank_pipeline_buffers``) without an import cycle."""

    quant: Any
    moe_folding: bool
    dtype: str
    pp_buffers: str
    memos: CostMemos
    states: StateCosts
    ep_cp: EPCPCosts

    def may_change_kind(self, c: Config) -> bool: ...
    def other_kinds(self, c: Config) -> list[Config]: ...
    def table(self, c: Config) -> Any: ...
    def prefix(self, t: Any) -> Any: ...
    def lower_bound(self, c: Config) -> Any: ...
    def split(self, t: Any, n_stages: int, virtual_stages: int) -> list[tuple[int, int]]: ...
    def inflight_ranks(self, c: Config) -> list[float]: ...


def _kinds(ev: FloorCosts, c: Config) -> list[Config]:
    """The DP kinds ``evaluate_auto`` tries for ``c``."""
    return [c] + (ev.other_kinds(c) if ev.may_change_kind(c) and c.dp > 1 else [])


def _fp8(ev: FloorCosts, c: Config) -> float:
    return fp8_weight_copy_bytes(ev.states.largest_linear / c.tp) if ev.dtype == "fp8" else 0.0


def held_floor(ev: FloorCosts, c: Config, mlb: float, acts: float = 0.0) -> float:
    """The model-state part of ``ConfigEvaluator.memory_floor`` (see the module docstring) plus
    ``acts``, activations every rank holds at least; ``mlb + acts`` where not covered. Under a kind
    whose gradients and activations peak apart (``StateCosts.grads_after_activations``) the
    larger of the two counts, not both."""
    if ev.quant or ev.moe_folding:
        return mlb + acts
    saved = ev.ep_cp.expert_param_count * (1.0 - 1.0 / c.ep) if c.ep > 1 else 0.0  # epcp_cost.expert_params_saved
    avg_params = (ev.prefix(ev.table(c))["params"][-1] - saved) / c.pp

    def held(k: Config) -> float:
        grads = ev.states.state_bytes_per_param(k).grads * avg_params if ev.states.grads_after_activations(k) else 0.0
        return ev.lower_bound(k)[1] + ev.states.fsdp_buffer(k, avg_params) + max(acts, grads) - grads

    return min(held(k) for k in _kinds(ev, c)) + _fp8(ev, c)


def split_floor(ev: FloorCosts, c: Config) -> float:
    """A memory lower bound of ``c`` on the split a partial evaluation costs, any DP kind it may
    take (see the module docstring); 0.0 where not covered."""
    if ev.quant or ev.moe_folding or c.ep > 1:
        return 0.0
    t = ev.table(c)
    r_params, held = _split_held(ev, c, t)
    best = math.inf
    for k in _kinds(ev, c):  # the unsharded buffer is a0 + a1 x the rank's parameters (dp_kinds.unsharded_buffer_bytes)
        a0 = ev.states.fsdp_buffer(k, 0.0)
        sb = ev.states.state_bytes_per_param(k)
        coef = sb.total + (ev.states.fsdp_buffer(k, 1.0) - a0)
        if ev.states.grads_after_activations(k):  # gradients and activations peak apart (evaluate: the larger of the two)
            worst = max((coef - sb.grads) * p + max(h, sb.grads * p) for p, h in zip(r_params, held))
        else:
            worst = max(coef * p + h for p, h in zip(r_params, held))
        best = min(best, worst + a0)
    return best + _fp8(ev, c)


def _split_held(ev: FloorCosts, c: Config, t: Any) -> tuple[list[float], list[float]]:
    """``split_floor``'s per pipeline rank parameters and held bytes (activations × in-flight
    microbatches + the pipeline runtime's buffers) on table ``t`` (``c``'s), memoized by all it
    reads of ``c`` (read only)."""
    key = (id(t), c.pp, c.virtual_stages, c.schedule, c.num_microbatches)
    hit = ev.memos.split_held.get(key)
    if hit is not None:
        return hit
    n_st = c.pp * c.virtual_stages
    runs = ev.split(t, n_st, c.virtual_stages) if n_st > 1 else [(0, len(t.layers))]
    P = ev.prefix(t)
    params, act = P["params"], P["act"]
    r_params = [0.0] * c.pp
    r_act = [0.0] * c.pp
    place = stage_placement(c.schedule, c.pp, c.virtual_stages)
    for (a, b), r in zip(runs, place, strict=True):
        r_params[r] += params[b] - params[a]
        r_act[r] += act[b] - act[a]
    infl = ev.inflight_ranks(c)
    pipe = rank_pipeline_buffers(ev, t, runs, [int(t.layers[b - 1].out_bytes) for _, b in runs], place,
                                 stage_inflight(c, place, infl), c)  # fmt: skip
    if not per_stage_held(c):
        held = [x * f + q for x, f, q in zip(r_act, infl, pipe)]
    else:  # each stage's own count over the rank's action order, as evaluate holds them
        held = [x + q for x, q in zip(rank_held(c, [act[b] - act[a] for a, b in runs]), pipe)]
    ev.memos.split_held[key] = (r_params, held)
    return r_params, held


def rank_pipeline_buffers(
    ev: FloorCosts, t: Any, runs: list[tuple[int, int]], st_sendb: list[int], placement: tuple[int, ...],
    st_infl: list[float], c: Config,
) -> list[float]:
    """Per pipeline rank, the pipeline runtime's receive buffers and cached outputs of its stages
    (``allocator.pipeline_buffer_bytes``; 0 without pp): a stage's output is what it sends
    (``st_sendb``), the last stage's its logits; ``st_infl`` the microbatches each stage holds
    (``pipeline_time.stage_inflight``)."""
    # memoized by every input but ``t``'s last-layer logits (id(t): the coster keeps its tables);
    # the memo is shared by the searches on one coster (``search_memos``), read only
    key = (id(t), tuple(runs), tuple(st_sendb), placement, tuple(st_infl), c.pp, c.num_microbatches, ev.pp_buffers)
    hit = ev.memos.pipe_buffers.get(key)
    if hit is not None:
        return hit
    r_pipe = [0.0 for _ in range(c.pp)]
    n_st = len(runs)
    ev.memos.pipe_buffers[key] = r_pipe
    if n_st > 1:
        for i in range(n_st):
            last = i == n_st - 1
            out = t.layers[runs[i][1] - 1].logits_bytes if last else st_sendb[i]
            r_pipe[placement[i]] += pipeline_buffer_bytes(
                in_bytes=st_sendb[i - 1] if i else 0.0, out_bytes=out, num_microbatches=c.num_microbatches,
                inflight=st_infl[i], is_first=i == 0, is_last=last, convention=ev.pp_buffers)  # fmt: skip
    return r_pipe
