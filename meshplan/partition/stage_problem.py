"""The stage-split problem: its input, its answer, and how a given split is scored.

Input: an ordered list of ``Layer`` (units between candidate cut points: embedding segment,
block 0 .. L-1, head segment), each with per-microbatch ``fwd_s`` and ``bwd_s`` (input + weight
grad, of which ``bwd_weight_s`` is the weight part), ``state_bytes`` (params + grads + optimizer
states held on the rank), ``act_bytes`` (activations kept per in-flight microbatch) and
``boundary_bytes`` (bytes crossing a cut placed right after the layer, skip tensors included, so a
skip tensor spanning several stages is charged at every boundary it crosses). ``p2p_time`` maps
bytes to seconds for one stage-to-stage send.

Stage s runs on rank ``stage_to_rank(schedule, pp, v)[s]`` (looped s % pp, or V for zbv).
``inflight[s]`` is the schedule's peak in-flight microbatches of stage s (``schedule.inflight``).

``make_problem`` checks the input and precomputes prefix sums; ``evaluate_split`` gives a split's
linearized step time (the objective of ``partition.stage_ilp``), stage times and rank memory;
``split_result`` builds the ``StageSplit`` answer. No torch import.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshplan.partition import schedule as sch

GIB = float(1 << 30)
EPS = 1e-12


@dataclass(frozen=True)
class Layer:
    """One unit between candidate cut points, costed per microbatch."""

    name: str
    fwd_s: float
    bwd_s: float  # input grad + weight grad (+ recompute)
    bwd_weight_s: float = 0.0  # of bwd_s, the weight-grad part zero-bubble schedules defer
    state_bytes: int = 0  # params + grads + optimizer states living on the rank
    act_bytes: int = 0  # activations kept per in-flight microbatch
    boundary_bytes: int = 0  # bytes sent per microbatch if a cut follows this layer

    def __post_init__(self) -> None:
        if min(self.fwd_s, self.bwd_s, self.bwd_weight_s) < 0 or self.bwd_weight_s > self.bwd_s + EPS:
            raise ValueError(f"layer {self.name!r}: times must be >= 0 and bwd_weight_s <= bwd_s")
        if min(self.state_bytes, self.act_bytes, self.boundary_bytes) < 0:
            raise ValueError(f"layer {self.name!r}: byte counts must be >= 0")

    @property
    def time_s(self) -> float:
        return self.fwd_s + self.bwd_s


@dataclass(frozen=True)
class StageSplit:
    """A split: stage s = layers[boundaries[s]:boundaries[s+1]], run on rank stage_to_rank[s]."""

    boundaries: tuple[int, ...]
    stage_to_rank: tuple[int, ...]
    stage_fwd_s: tuple[float, ...]
    stage_bwd_s: tuple[float, ...]
    stage_bwd_weight_s: tuple[float, ...]
    stage_state_bytes: tuple[int, ...]
    stage_act_bytes: tuple[int, ...]
    stage_send_bytes: tuple[int, ...]  # per microbatch to the next stage (0 for the last)
    stage_send_s: tuple[float, ...]
    stage_inflight: tuple[int, ...]
    rank_time_s: tuple[float, ...]  # per microbatch, all of the rank's stages
    rank_mem_bytes: tuple[int, ...]
    objective_s: float  # the linearized step time the ILP minimizes
    method: str  # "ilp", "dp" or "greedy"
    status: str  # solver status ("optimal", "feasible") or "exact"/"heuristic"
    solver: str  # "highs", "cbc" or "" for dp/greedy
    seconds: float
    schedule: str = "1f1b"
    num_microbatches: int = 1
    virtual_stages: int = 1

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        b = self.boundaries
        return tuple((b[i], b[i + 1]) for i in range(len(b) - 1))

    def timeline(self, *, keep_events: bool = False) -> sch.Timeline:
        """Simulate this split under its schedule (the step time the search should trust)."""
        return sch.simulate(
            self.schedule,
            (len(self.boundaries) - 1) // self.virtual_stages,
            self.num_microbatches,
            virtual_stages=self.virtual_stages,
            fwd_s=self.stage_fwd_s,
            bwd_input_s=[b - w for b, w in zip(self.stage_bwd_s, self.stage_bwd_weight_s)],
            bwd_weight_s=self.stage_bwd_weight_s,
            p2p_s=self.stage_send_s,
            keep_events=keep_events,
        )


@dataclass(frozen=True)
class SplitProblem:
    layers: tuple[Layer, ...]
    pp: int
    v: int
    m: int
    schedule: str
    limit_bytes: float  # math.inf when unlimited
    reserved_bytes: int
    cut_s: tuple[float, ...]  # p2p seconds of a cut after layer l
    placement: tuple[int, ...]
    inflight: tuple[int, ...]
    pre_t: tuple[float, ...]  # prefix sums over layers, length L + 1
    pre_state: tuple[float, ...]
    pre_act: tuple[float, ...]

    @property
    def n(self) -> int:
        return self.pp * self.v

    @property
    def zero_bubble(self) -> bool:
        return self.schedule in sch.ZERO_BUBBLE

    @property
    def coef_t(self) -> float:
        return self.m - 1.0 if self.v == 1 and not self.zero_bubble else float(self.m)

    @property
    def constant_s(self) -> float:
        if self.v > 1:
            return 0.0
        if self.zero_bubble:
            return (self.pp - 1) / self.pp * sum(max(self.fill_s(x), 0.0) for x in self.layers)
        return sum(x.time_s for x in self.layers)

    def fill_s(self, x: Layer) -> float:
        """A layer's share of the pipeline fill/drain time (W deferred by zero-bubble)."""
        return x.fwd_s + x.bwd_s - 2 * x.bwd_weight_s if self.zero_bubble else x.time_s

    def crosses(self, s: int) -> bool:
        """Does the boundary after stage s go between two different ranks?"""
        return self.placement[s] != self.placement[s + 1]


def boundary_bytes_from_edges(num_layers: int, edges: Sequence[tuple[int, int, int]]) -> list[int]:
    """Bytes crossing a cut after each layer, from (src_layer, dst_layer, bytes) data edges.

    An edge from layer a to layer b > a crosses every cut after a, a+1, ..., b-1 (skip tensors
    are charged at each boundary they cross). A tensor consumed by several later layers should
    be given once, with its last consumer.
    """
    out = [0] * num_layers
    for src, dst, nbytes in edges:
        if not 0 <= src < dst < num_layers + 1:
            raise ValueError(f"edge ({src}, {dst}) must go forward between layers 0..{num_layers}")
        for cut in range(src, min(dst, num_layers)):
            out[cut] += nbytes
    return out


def make_problem(
    layers: Sequence[Layer],
    pp: int,
    num_microbatches: int,
    schedule: str,
    virtual_stages: int,
    mem_limit_bytes: float | None,
    p2p_time: Callable[[int], float] | None,
    reserved_bytes: int,
) -> SplitProblem:
    sch.validate(schedule, pp, num_microbatches, virtual_stages)
    n = pp * virtual_stages
    if len(layers) < n:
        raise ValueError(
            f"{len(layers)} layers cannot fill pp*virtual_stages = {n} stages; lower pp or virtual_stages"
        )
    cut_s = tuple(float(p2p_time(x.boundary_bytes)) if p2p_time else 0.0 for x in layers)
    return SplitProblem(
        layers=tuple(layers),
        pp=pp,
        v=virtual_stages,
        m=num_microbatches,
        schedule=schedule,
        limit_bytes=math.inf if mem_limit_bytes is None else float(mem_limit_bytes),
        reserved_bytes=reserved_bytes,
        cut_s=cut_s,
        placement=sch.stage_to_rank(schedule, pp, virtual_stages),
        inflight=sch.inflight(schedule, pp, num_microbatches, virtual_stages)[1],
        pre_t=tuple(itertools.accumulate((x.time_s for x in layers), initial=0.0)),
        pre_state=tuple(itertools.accumulate((float(x.state_bytes) for x in layers), initial=0.0)),
        pre_act=tuple(itertools.accumulate((float(x.act_bytes) for x in layers), initial=0.0)),
    )


# ---------------------------------------------------------------- evaluation of a split


def stage_mem(pr: SplitProblem, s: int, lo: int, hi: int) -> float:
    return pr.pre_state[hi] - pr.pre_state[lo] + pr.inflight[s] * (pr.pre_act[hi] - pr.pre_act[lo])


def evaluate_split(pr: SplitProblem, bounds: Sequence[int]) -> tuple[float, list[float], list[float]]:
    """(objective, rank times, rank memory) of a split given by its n+1 boundaries."""
    rank_t = [0.0] * pr.pp
    rank_mem = [float(pr.reserved_bytes)] * pr.pp
    p2p = 0.0
    chunk = 0.0
    for s in range(pr.n):
        lo, hi = bounds[s], bounds[s + 1]
        r = pr.placement[s]
        chunk = max(chunk, sum(pr.fill_s(x) for x in pr.layers[lo:hi]))
        rank_t[r] += pr.pre_t[hi] - pr.pre_t[lo]
        rank_mem[r] += stage_mem(pr, s, lo, hi)
        if s + 1 < pr.n and pr.crosses(s):
            p2p += pr.cut_s[hi - 1]
    chunk_term = (pr.pp - 1) * chunk if pr.v > 1 else 0.0
    return pr.coef_t * max(rank_t) + chunk_term + 2 * p2p + pr.constant_s, rank_t, rank_mem


def split_result(
    pr: SplitProblem, bounds: Sequence[int], method: str, status: str, solver: str, seconds: float
) -> StageSplit:
    obj, rank_t, rank_mem = evaluate_split(pr, bounds)
    stages = [pr.layers[bounds[s] : bounds[s + 1]] for s in range(pr.n)]
    send_bytes = tuple(st[-1].boundary_bytes if s + 1 < pr.n else 0 for s, st in enumerate(stages))
    send_s = tuple(
        pr.cut_s[bounds[s + 1] - 1] if s + 1 < pr.n and pr.crosses(s) else 0.0 for s in range(pr.n)
    )
    return StageSplit(
        boundaries=tuple(bounds),
        stage_to_rank=pr.placement,
        stage_fwd_s=tuple(sum(x.fwd_s for x in st) for st in stages),
        stage_bwd_s=tuple(sum(x.bwd_s for x in st) for st in stages),
        stage_bwd_weight_s=tuple(sum(x.bwd_weight_s for x in st) for st in stages),
        stage_state_bytes=tuple(sum(x.state_bytes for x in st) for st in stages),
        stage_act_bytes=tuple(sum(x.act_bytes for x in st) for st in stages),
        stage_send_bytes=send_bytes,
        stage_send_s=send_s,
        stage_inflight=pr.inflight,
        rank_time_s=tuple(rank_t),
        rank_mem_bytes=tuple(int(round(x)) for x in rank_mem),
        objective_s=obj,
        method=method,
        status=status,
        solver=solver,
        seconds=seconds,
        schedule=pr.schedule,
        num_microbatches=pr.m,
        virtual_stages=pr.v,
    )


def split_fits(pr: SplitProblem, bounds: Sequence[int]) -> bool:
    return max(evaluate_split(pr, bounds)[2]) <= pr.limit_bytes * (1 + 1e-9)
