"""Pipeline stage split: ordered layers -> pp * v contiguous stages (ILP, exact DP, greedy fallback).

Input: an ordered list of ``Layer`` (units between candidate cut points: embedding segment,
block 0 .. L-1, head segment), each with per-microbatch ``fwd_s`` and ``bwd_s`` (input + weight
grad, of which ``bwd_weight_s`` is the weight part), ``state_bytes`` (params + grads + optimizer
states held on the rank), ``act_bytes`` (activations kept per in-flight microbatch) and
``boundary_bytes`` (bytes crossing a cut placed right after the layer, skip tensors included, so a
skip tensor spanning several stages is charged at every boundary it crosses). ``p2p_time`` maps
bytes to seconds for one stage-to-stage send.

Stage s runs on rank ``stage_to_rank(schedule, pp, v)[s]`` (looped s % pp, or V for zbv).
``inflight[s]`` is the schedule's peak in-flight microbatches of stage s (``schedule.inflight``).

ILP (``StageSplitILP``), L layers l, n = pp * v stages s, ranks r, t_l = fwd_s + bwd_s:

    variables   x[l,s] in {0,1}   layer l is in stage s
                y[l,s] = sum_{s' <= s} x[l,s']     (layer l is in a stage <= s; an expression)
                T >= 0            bottleneck rank time per microbatch (seconds)
    minimize    a * T + (p-1) * C + 2 * sum_l sum_{s: rank(s) != rank(s+1)} c_l * (y[l,s] - y[l+1,s]) + K
                v = 1, gpipe/1f1b:  a = m - 1, no C, K = sum_l t_l  (textbook sum_s t_s + (m-1) max t_s)
                v = 1, zero-bubble: a = m, no C, K = (p-1)/p sum_l (f_l + b_l - 2 w_l)  (ZB-H1)
                v > 1:              a = m, K = 0, C >= chunk fill time of every stage:
                                    u_s = sum_{l in s} t_l, or f_l + b_l - 2 w_l for zero-bubble/zbv
                (exact for equal stages, as the simulator: interleaved (v m + p - 1) t,
                 ZB-H1 m(F+B+W) + (p-1)(F+B-W); p2p counted on fill and drain)
    assignment  sum_s x[l,s] = 1                                  for every l
    contiguity  y[l,s] >= y[l+1,s]                                for every l < L-1, s < n-1
                (stage index is nondecreasing along the layers, so each stage is one range)
    nonempty    sum_l x[l,s] >= 1                                 for every s
    bottleneck  T >= sum_{s on r} sum_l t_l x[l,s]                for every rank r
    chunk       C >= sum_l u_l x[l,s]                             for every stage s (v > 1)
    memory      sum_{s on r} sum_l (state_l + inflight[s] act_l) x[l,s] + reserved <= limit
                                                                  for every rank r (GiB units)

y[l,s] - y[l+1,s] is 1 exactly when the cut between stages s and s+1 lies after layer l.
Constraints are named ``<family>__<index>`` (see ``meshplan.ilp``). Every solve has a time limit;
if it fails, the exact DP (v = 1) or the greedy balanced split is used instead.

``dp_split`` is an exact dynamic program for contiguous splits: it minimizes the same objective
exactly when v = 1 (min-max stage time, then the cheapest p2p among splits with each candidate
bottleneck), and the min-max stage (chunk) time for v > 1. No torch import here.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pulp

from meshplan import ilp
from meshplan.errors import NoFeasiblePlanError
from meshplan.partition import schedule as sch

GIB = float(1 << 30)
_EPS = 1e-12


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
        if min(self.fwd_s, self.bwd_s, self.bwd_weight_s) < 0 or self.bwd_weight_s > self.bwd_s + _EPS:
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
class _Problem:
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


def _make_problem(
    layers: Sequence[Layer],
    pp: int,
    num_microbatches: int,
    schedule: str,
    virtual_stages: int,
    mem_limit_bytes: float | None,
    p2p_time: Callable[[int], float] | None,
    reserved_bytes: int,
) -> _Problem:
    sch.validate(schedule, pp, num_microbatches, virtual_stages)
    n = pp * virtual_stages
    if len(layers) < n:
        raise ValueError(
            f"{len(layers)} layers cannot fill pp*virtual_stages = {n} stages; lower pp or virtual_stages"
        )
    cut_s = tuple(float(p2p_time(x.boundary_bytes)) if p2p_time else 0.0 for x in layers)
    return _Problem(
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


def _stage_mem(pr: _Problem, s: int, lo: int, hi: int) -> float:
    return pr.pre_state[hi] - pr.pre_state[lo] + pr.inflight[s] * (pr.pre_act[hi] - pr.pre_act[lo])


def _evaluate(pr: _Problem, bounds: Sequence[int]) -> tuple[float, list[float], list[float]]:
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
        rank_mem[r] += _stage_mem(pr, s, lo, hi)
        if s + 1 < pr.n and pr.crosses(s):
            p2p += pr.cut_s[hi - 1]
    chunk_term = (pr.pp - 1) * chunk if pr.v > 1 else 0.0
    return pr.coef_t * max(rank_t) + chunk_term + 2 * p2p + pr.constant_s, rank_t, rank_mem


def _result(
    pr: _Problem, bounds: Sequence[int], method: str, status: str, solver: str, seconds: float
) -> StageSplit:
    obj, rank_t, rank_mem = _evaluate(pr, bounds)
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


def _fits(pr: _Problem, bounds: Sequence[int]) -> bool:
    return max(_evaluate(pr, bounds)[2]) <= pr.limit_bytes * (1 + 1e-9)


# ---------------------------------------------------------------- ILP


class StageSplitILP:
    """The formulation in the module docstring; one ``add_*`` per constraint family."""

    def __init__(self, pr: _Problem) -> None:
        self.pr = pr
        L, n = len(pr.layers), pr.n
        self.problem = pulp.LpProblem("stage_split", pulp.LpMinimize)
        self.x = {
            (lo, s): self.problem.add_variable(f"x_{lo}_{s}", cat="Binary")
            for lo in range(L)
            for s in range(n)
        }
        self.y = {
            (lo, s): pulp.lpSum(self.x[lo, k] for k in range(s + 1)) for lo in range(L) for s in range(n)
        }
        self.t = self.problem.add_variable("T", lowBound=0)
        self.c = self.problem.add_variable("C", lowBound=0)

    def _rank_stages(self, r: int) -> list[int]:
        return [s for s in range(self.pr.n) if self.pr.placement[s] == r]

    def set_objective(self) -> None:
        pr = self.pr
        L = len(pr.layers)
        p2p = pulp.lpSum(
            pr.cut_s[lo] * (self.y[lo, s] - self.y[lo + 1, s])
            for lo in range(L - 1)
            for s in range(pr.n - 1)
            if pr.crosses(s) and pr.cut_s[lo] > 0
        )
        chunk = (pr.pp - 1) * self.c if pr.v > 1 else 0.0
        self.problem += pr.coef_t * self.t + chunk + 2 * p2p + pr.constant_s

    def add_assignment(self) -> None:
        for lo in range(len(self.pr.layers)):
            self.problem += pulp.lpSum(self.x[lo, s] for s in range(self.pr.n)) == 1, f"assignment__{lo}"

    def add_contiguity(self) -> None:
        L, n = len(self.pr.layers), self.pr.n
        for lo, s in itertools.product(range(L - 1), range(n - 1)):
            self.problem += self.y[lo, s] >= self.y[lo + 1, s], f"contiguity__{lo * n + s}"

    def add_nonempty(self) -> None:
        for s in range(self.pr.n):
            self.problem += (
                pulp.lpSum(self.x[lo, s] for lo in range(len(self.pr.layers))) >= 1,
                f"nonempty__{s}",
            )

    def add_bottleneck(self) -> None:
        for r in range(self.pr.pp):
            load = pulp.lpSum(
                x.time_s * self.x[lo, s] for s in self._rank_stages(r) for lo, x in enumerate(self.pr.layers)
            )
            self.problem += self.t >= load, f"bottleneck__{r}"

    def add_chunk(self) -> None:
        if self.pr.v == 1:
            return
        for s in range(self.pr.n):
            fill = pulp.lpSum(self.pr.fill_s(x) * self.x[lo, s] for lo, x in enumerate(self.pr.layers))
            self.problem += self.c >= fill, f"chunk__{s}"

    def add_memory(self) -> None:
        pr = self.pr
        if math.isinf(pr.limit_bytes):
            return
        for r in range(pr.pp):
            mem = pulp.lpSum(
                (x.state_bytes + pr.inflight[s] * x.act_bytes) / GIB * self.x[lo, s]
                for s in self._rank_stages(r)
                for lo, x in enumerate(pr.layers)
            )
            self.problem += mem <= (pr.limit_bytes - pr.reserved_bytes) / GIB, f"memory__{r}"

    def build(self) -> StageSplitILP:
        self.set_objective()
        self.add_assignment()
        self.add_contiguity()
        self.add_nonempty()
        self.add_bottleneck()
        self.add_chunk()
        self.add_memory()
        return self

    def set_start(self, bounds: Sequence[int]) -> None:
        """Give the solver a known split (e.g. the DP's) as its starting incumbent."""
        obj, rank_t, _ = _evaluate(self.pr, bounds)
        for s in range(self.pr.n):
            for lo in range(len(self.pr.layers)):
                self.x[lo, s].setInitialValue(1 if bounds[s] <= lo < bounds[s + 1] else 0)
        self.t.setInitialValue(max(rank_t))
        chunk = [
            sum(self.pr.fill_s(x) for x in self.pr.layers[bounds[s] : bounds[s + 1]])
            for s in range(self.pr.n)
        ]
        self.c.setInitialValue(max(0.0, *chunk))

    def boundaries(self) -> list[int]:
        pr = self.pr
        stage_of = [
            max(range(pr.n), key=lambda s: self.x[lo, s].varValue or 0.0) for lo in range(len(pr.layers))
        ]
        bounds = (
            [0] + [lo for lo in range(1, len(stage_of)) if stage_of[lo] != stage_of[lo - 1]] + [len(stage_of)]
        )
        if len(bounds) != pr.n + 1 or any(b - a != 1 for a, b in itertools.pairwise(stage_of) if b != a):
            raise ilp.SolverFailedError(f"ILP returned a non-contiguous assignment {stage_of}")
        return bounds


# ---------------------------------------------------------------- DP and greedy


def _dp_min_max(pr: _Problem, cost: Callable[[int, int, int], float]) -> tuple[float, list[int]] | None:
    """Exact min over contiguous splits of max_s cost(s, lo, hi), memory per stage <= limit."""
    L, n = len(pr.layers), pr.n
    inf = math.inf
    best = [[inf] * (L + 1) for _ in range(n + 1)]
    arg = [[0] * (L + 1) for _ in range(n + 1)]
    best[0][0] = -inf
    for k in range(1, n + 1):
        for hi in range(k, L - (n - k) + 1):
            for lo in range(k - 1, hi):
                if (
                    best[k - 1][lo] == inf
                    or _stage_mem(pr, k - 1, lo, hi) + pr.reserved_bytes > pr.limit_bytes
                ):
                    continue
                val = max(best[k - 1][lo], cost(k - 1, lo, hi))
                if val < best[k][hi]:
                    best[k][hi], arg[k][hi] = val, lo
    if best[n][L] == inf:
        return None
    return best[n][L], _backtrack(arg, n, L)


def _backtrack(arg: list[list[int]], n: int, L: int) -> list[int]:
    """Stage boundaries ``[0, ..., L]`` from ``arg[k][hi]`` (where stage k starts when it ends at hi)."""
    bounds = [L]
    for k in range(n, 0, -1):
        bounds.append(arg[k][bounds[-1]])
    return bounds[::-1]


def _dp_min_p2p(pr: _Problem, cap_s: float) -> list[int] | None:
    """Cheapest-p2p contiguous split with every stage time <= cap_s and memory <= limit (v = 1)."""
    L, n = len(pr.layers), pr.n
    pre = pr.pre_t
    inf = math.inf
    best = [[inf] * (L + 1) for _ in range(n + 1)]
    arg = [[0] * (L + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for k in range(1, n + 1):
        for hi in range(k, L - (n - k) + 1):
            cut = pr.cut_s[hi - 1] if k < n and pr.crosses(k - 1) else 0.0
            for lo in range(k - 1, hi):
                if best[k - 1][lo] == inf or pre[hi] - pre[lo] > cap_s * (1 + 1e-12):
                    continue
                if _stage_mem(pr, k - 1, lo, hi) + pr.reserved_bytes > pr.limit_bytes:
                    continue
                val = best[k - 1][lo] + cut
                if val < best[k][hi]:
                    best[k][hi], arg[k][hi] = val, lo
    if best[n][L] == inf:
        return None
    return _backtrack(arg, n, L)


def _dp(pr: _Problem, max_candidates: int = 64) -> tuple[list[int], str] | None:
    pre = pr.pre_t
    found = _dp_min_max(pr, lambda s, lo, hi: pre[hi] - pre[lo])
    if found is None:
        return None
    t_star, bounds = found
    if pr.v > 1:
        if not _fits(pr, bounds):  # per-stage memory held; a rank's stages together may not
            return None
        return bounds, "heuristic"
    best_obj = _evaluate(pr, bounds)[0]
    # a larger bottleneck T can only pay off through cheaper cuts: try each T up to the saving
    max_saving = 2 * sum(sorted(pr.cut_s[:-1], reverse=True)[: pr.n - 1])
    seg = sorted(
        {pre[hi] - pre[lo] for lo in range(len(pr.layers)) for hi in range(lo + 1, len(pr.layers) + 1)}
    )
    if pr.coef_t > 0:
        cands = [t for t in seg if t_star - 1e-12 <= t <= t_star + max_saving / pr.coef_t + 1e-12]
    else:  # one microbatch with gpipe/1f1b: the bottleneck has no weight, only the cuts count
        cands = [t_star, seg[-1]]
    status = "exact" if len(cands) <= max_candidates else "heuristic"
    for cap in cands[:max_candidates]:
        b = _dp_min_p2p(pr, cap)
        if b is not None and _evaluate(pr, b)[0] < best_obj - 1e-15:
            bounds, best_obj = b, _evaluate(pr, b)[0]
    return bounds, status


def _greedy(pr: _Problem) -> list[int]:
    """Balanced split by prefix time: cut where the running time passes k/n of the total."""
    L, n = len(pr.layers), pr.n
    pre = pr.pre_t
    bounds = [0]
    for k in range(1, n):
        target = pre[L] * k / n
        lo, hi = bounds[-1] + 1, L - (n - k)
        bounds.append(min(range(lo, hi + 1), key=lambda i: abs(pre[i] - target)))
    return [*bounds, L]


def _min_rank_memory(pr: _Problem) -> float:
    """Smallest achievable max per-rank memory (exact for v = 1, by a small ILP otherwise)."""
    free = dataclasses.replace(pr, limit_bytes=math.inf)
    if pr.v == 1:
        found = _dp_min_max(free, lambda s, lo, hi: _stage_mem(free, s, lo, hi))
        assert found is not None
        return found[0] + pr.reserved_bytes
    model = StageSplitILP(free)
    mem_max = model.problem.add_variable("M", lowBound=0)
    model.problem += mem_max
    model.add_assignment()
    model.add_contiguity()
    model.add_nonempty()
    for r in range(pr.pp):
        model.problem += (
            mem_max
            >= pulp.lpSum(
                (x.state_bytes + pr.inflight[s] * x.act_bytes) / GIB * model.x[lo, s]
                for s in model._rank_stages(r)
                for lo, x in enumerate(pr.layers)
            ),
            f"memory__{r}",
        )
    try:
        ilp.solve(model.problem, time_limit_s=5.0, diagnose=False)
        return (mem_max.varValue or 0.0) * GIB + pr.reserved_bytes
    except ilp.SolverFailedError:  # no solver answer in time: report the balanced split's peak
        return max(_evaluate(free, _greedy(free))[2])


def _infeasible(pr: _Problem) -> NoFeasiblePlanError:
    need = _min_rank_memory(pr)
    return NoFeasiblePlanError(
        f"no split of {len(pr.layers)} layers into {pr.n} stages ({pr.schedule}, pp={pr.pp}, "
        f"v={pr.v}, m={pr.m}) fits {pr.limit_bytes / GIB:.3f} GiB per device; the smallest per-rank "
        f"peak any split reaches is {need / GIB:.3f} GiB. Use a deeper pipeline, fewer in-flight "
        f"microbatches (another schedule), recomputation or more memory."
    )


# ---------------------------------------------------------------- entry point


def split_stages(
    layers: Sequence[Layer],
    *,
    pp: int,
    num_microbatches: int,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    mem_limit_bytes: float | None = None,
    p2p_time: Callable[[int], float] | None = None,
    reserved_bytes: int = 0,
    method: str = "auto",
    time_limit_s: float = 10.0,
) -> StageSplit:
    """Split ``layers`` into pp * virtual_stages contiguous stages minimizing the linearized step.

    method: "ilp" (HiGHS/CBC, falls back to DP/greedy if the solver fails), "dp" (exact for
    v = 1), or "auto" (dp for v = 1, ilp otherwise). Raises ``NoFeasiblePlanError`` naming the
    smallest per-rank memory reachable when nothing fits ``mem_limit_bytes``.
    """
    if method not in ("auto", "ilp", "dp"):
        raise ValueError(f"method must be 'auto', 'ilp' or 'dp', got {method!r}")
    pr = _make_problem(
        layers, pp, num_microbatches, schedule, virtual_stages, mem_limit_bytes, p2p_time, reserved_bytes
    )
    if method == "auto":
        method = "dp" if virtual_stages == 1 else "ilp"
    t0 = time.perf_counter()
    if method == "dp":
        found = _dp(pr)
        if found is None:
            if pr.v == 1:
                raise _infeasible(pr)
            method = "ilp"  # per-stage DP cannot see a rank's several stages: ask the ILP
        else:
            return _result(pr, found[0], "dp", found[1], "", time.perf_counter() - t0)
    start = _dp(pr)  # incumbent for the solver, and the answer if the solver does worse
    model = StageSplitILP(pr).build()
    if start is not None:
        model.set_start(start[0])
    try:
        res = ilp.solve(
            model.problem,
            time_limit_s=time_limit_s,
            diagnose=False,
            gap_rel=1e-6,
            warm_start=start is not None,
        )
        bounds = model.boundaries()
        if start is not None and _evaluate(pr, start[0])[0] < _evaluate(pr, bounds)[0] - 1e-12:
            return _result(pr, start[0], "dp", start[1], "", time.perf_counter() - t0)
        return _result(pr, bounds, "ilp", res.status, res.solver, time.perf_counter() - t0)
    except ilp.InfeasibleProblemError:
        raise _infeasible(pr) from None
    except ilp.SolverFailedError:
        if start is not None:
            return _result(pr, start[0], "dp", start[1], "", time.perf_counter() - t0)
        bounds = _greedy(pr)
        if not _fits(pr, bounds):
            raise _infeasible(pr) from None
        return _result(pr, bounds, "greedy", "heuristic", "", time.perf_counter() - t0)
