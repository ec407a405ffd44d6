"""Pipeline makespan and in-flight microbatches of one configuration, for ``planner.search``.

Owns how the search turns per-stage times into a pipeline makespan: the schedule simulator
(``partition.schedule.simulate``, long runs simulated at two small valid microbatch counts and
extrapolated linearly), the cheap makespan lower bound used before simulating, the stage → rank
placement and the activations in flight per pipeline rank. No torch import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from meshplan.cost_models.memory import inflight_microbatches
from meshplan.partition.schedule import inflight as order_inflight
from meshplan.partition.schedule import rank_held_peaks, simulate, stage_to_rank
from meshplan.planner.search_types import Config, valid_count

#: Microbatch counts above this (× pp·v) are simulated small and extrapolated.
SIM_CAP_FACTOR = 3


def placement(schedule: str, pp: int, v: int) -> tuple[int, ...]:
    """Pipeline rank of every stage (``partition.schedule.stage_to_rank``)."""
    return stage_to_rank(schedule, pp, v)


def inflight(c: Config, rank: int) -> float:
    """Microbatches whose activations pipeline rank ``rank`` holds at its peak (1 without pp)."""
    if c.pp == 1:
        return 1.0
    return inflight_microbatches(c.schedule, c.pp, rank, c.num_microbatches, c.virtual_stages)


def per_stage_held(c: Config) -> bool:
    """Whether ``c``'s ranks hold their stages' activations by each stage's own in-flight count
    over the action order (``rank_held``, ``stage_inflight``) rather than the rank's mean count:
    several stages per rank under interleaved-1f1b, whose B pass frees what its F saved. Not
    zero-bubble / zbv: their deferred W passes keep the linears' inputs past B, which the
    F-to-B count does not follow (the rank's mean count stays their price)."""
    return c.virtual_stages > 1 and c.schedule == "interleaved-1f1b"


def stage_inflight(c: Config, placement: Sequence[int], infl: Sequence[float]) -> list[float]:
    """Microbatches each stage holds at its own peak: its rank's count (``inflight``), or under
    ``per_stage_held`` each stage's own, from the schedule's action order
    (``partition.schedule.inflight``): a rank's chunks do not hold alike."""
    if not per_stage_held(c):
        return [infl[r] for r in placement]
    return [float(x) for x in order_inflight(c.schedule, c.pp, c.num_microbatches, c.virtual_stages)[1]]


def rank_held(c: Config, stage_bytes: Sequence[float]) -> list[float]:
    """Per pipeline rank under ``per_stage_held``, the peak bytes its in-flight microbatches
    hold, each stage's ``stage_bytes`` per microbatch weighted by that stage's own count over the
    rank's action order (``partition.schedule.rank_held_peaks``)."""
    return list(rank_held_peaks(c.schedule, c.pp, c.num_microbatches, c.virtual_stages,
                                tuple(float(x) for x in stage_bytes)))  # fmt: skip


def makespan_lower_bound(c: Config, st_f: list[float], totals: list[float], rank_work: list[float]) -> float:
    """``max_k (Σ_{s<k} F_s + m·T_k)`` (v = 1: stage k cannot start before the first microbatch
    reaches it and then works m·T_k) or ``m · busiest rank`` (v > 1)."""
    m = c.num_microbatches
    if c.virtual_stages != 1:
        return m * max(rank_work)
    fill, makespan = 0.0, 0.0
    for k in range(c.pp * c.virtual_stages):
        makespan = max(makespan, fill + m * totals[k])
        fill += st_f[k]
    return makespan


def simulated_makespan(
    c: Config, f: list[float], b: list[float], w: list[float], send: list[float], *, sends_occupy: bool = False
) -> tuple[float, float]:
    """(makespan, bubble fraction) of the schedule simulator; long runs extrapolated. ``sends_occupy``:
    a send holds its sending rank (``ClusterSpec.sends_occupy_rank``, gloo)."""
    p, v, m = c.pp, c.virtual_stages, c.num_microbatches
    if p == 1:  # gradient accumulation: m forward/backward pairs back to back
        return m * (f[0] + b[0] + w[0]), 0.0

    def run(mm: int) -> Any:
        return simulate(c.schedule, p, mm, virtual_stages=v, fwd_s=f, bwd_input_s=b, bwd_weight_s=w,
                        p2p_s=send, keep_events=False, sends_occupy=sends_occupy)  # fmt: skip

    cap = SIM_CAP_FACTOR * p * v
    m1 = valid_count(c.schedule, p, v, cap)
    if m <= cap or m1 is None:
        tl = run(m)
        return tl.makespan_s, tl.bubble_fraction
    m2 = valid_count(c.schedule, p, v, m1 + p) or m1 + p
    t1, t2 = run(m1), run(m2)
    slope = (t2.makespan_s - t1.makespan_s) / (m2 - m1)
    makespan = t1.makespan_s + slope * (m - m1)
    # a linear extrapolation can undershoot what no schedule beats (a zero-bubble rank's deferred weight
    # passes change pattern with m): never below the lower bound
    totals = [fi + bi + wi for fi, bi, wi in zip(f, b, w)]
    on_rank = placement(c.schedule, p, v)
    rank_work = [sum(t for t, r in zip(totals, on_rank) if r == k) for k in range(p)]
    makespan = max(makespan, makespan_lower_bound(c, f, totals, rank_work))
    busy = m * sum(totals)
    bubble = p * makespan / busy - 1.0 if busy > 0 else 0.0
    return makespan, max(0.0, bubble)
