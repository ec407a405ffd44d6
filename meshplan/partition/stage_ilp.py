"""Pipeline stage split: ordered layers -> pp * v contiguous stages (ILP, exact DP, greedy fallback).

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
Constraints are named ``<family>__<index>`` (see ``meshplan.ilp``). Every solve has a time limit
and may have a node limit (the same stop on any load); if it fails, or the wall-clock limit
stops it (an incumbent that depends on the load), the DP split (exact for v = 1) or the greedy
balanced split is used instead.

``stage_dp.dp_split`` is an exact dynamic program for contiguous splits: it minimizes the same
objective exactly when v = 1 (min-max stage time, then the cheapest p2p among splits with each
candidate bottleneck), and the min-max stage (chunk) time for v > 1. The problem types and the
scoring of a split are in ``partition.stage_problem``. No torch import here.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence

import pulp

from meshplan import ilp
from meshplan.errors import NoFeasiblePlanError
from meshplan.partition.stage_dp import dp_min_max, dp_split, greedy_split
from meshplan.partition.stage_problem import (
    GIB,
    Layer,
    SplitProblem,
    StageSplit,
    boundary_bytes_from_edges,
    evaluate_split,
    make_problem,
    split_fits,
    split_result,
    stage_mem,
)

__all__ = ["Layer", "StageSplit", "StageSplitILP", "boundary_bytes_from_edges", "split_stages"]


# ---------------------------------------------------------------- ILP


class StageSplitILP:
    """The formulation in the module docstring; one ``add_*`` per constraint family."""

    def __init__(self, pr: SplitProblem) -> None:
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
        obj, rank_t, _ = evaluate_split(self.pr, bounds)
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


#: branch-and-bound nodes of the smallest-memory ILP behind a "no split fits" message
MIN_MEMORY_NODES = 50


def _min_rank_memory(pr: SplitProblem) -> float:
    """Smallest achievable max per-rank memory (exact for v = 1, by a small ILP otherwise)."""
    free = dataclasses.replace(pr, limit_bytes=math.inf)
    if pr.v == 1:
        found = dp_min_max(free, lambda s, lo, hi: stage_mem(free, s, lo, hi))
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
        res = ilp.solve(model.problem, time_limit_s=5.0, diagnose=False, node_limit=MIN_MEMORY_NODES)
        if res.stopped_by != "time limit":  # proven, or the node limit's incumbent (the same on any load)
            return (mem_max.varValue or 0.0) * GIB + pr.reserved_bytes
    except ilp.SolverFailedError:
        pass
    # no answer, or one the wall-clock cap cut at a load-dependent point: the balanced split's peak
    return max(evaluate_split(free, greedy_split(free))[2])


def _infeasible(pr: SplitProblem, explain: bool = True) -> NoFeasiblePlanError:
    if not explain:  # the caller only needs to know (the search's memory rescue): no extra solve
        return NoFeasiblePlanError(f"no split of {len(pr.layers)} layers into {pr.n} stages fits "
                                   f"{pr.limit_bytes / GIB:.3f} GiB per device")  # fmt: skip
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
    explain: bool = True,
    node_limit: int | None = None,
) -> StageSplit:
    """Split ``layers`` into pp * virtual_stages contiguous stages minimizing the linearized step.

    method: "ilp" (HiGHS/CBC, falls back to DP/greedy if the solver fails), "dp" (exact for
    v = 1), or "auto" (dp for v = 1, ilp otherwise). Raises ``NoFeasiblePlanError`` naming the
    smallest per-rank memory reachable when nothing fits ``mem_limit_bytes`` (with ``explain=False``
    without that figure, which costs another solve).

    ``node_limit`` bounds the ILP's branch and bound (``ilp.solve``): stopped there, its incumbent
    is the same on any load and is kept (status "feasible at its N-node limit"). Stopped by the
    wall-clock ``time_limit_s`` instead, its incumbent depends on how far the solver got on this
    machine's load, so the DP split (the warm start) is kept and the status says so: the split,
    and so the plan, does not change with the load.
    """
    if method not in ("auto", "ilp", "dp"):
        raise ValueError(f"method must be 'auto', 'ilp' or 'dp', got {method!r}")
    pr = make_problem(
        layers, pp, num_microbatches, schedule, virtual_stages, mem_limit_bytes, p2p_time, reserved_bytes
    )
    if method == "auto":
        method = "dp" if virtual_stages == 1 else "ilp"
    t0 = time.perf_counter()
    if method == "dp":
        found = dp_split(pr)
        if found is None:
            if pr.v == 1:
                raise _infeasible(pr, explain)
            method = "ilp"  # per-stage DP cannot see a rank's several stages: ask the ILP
        else:
            return split_result(pr, found[0], "dp", found[1], "", time.perf_counter() - t0)
    start = dp_split(pr)  # incumbent for the solver, and the answer if the solver does worse
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
            node_limit=node_limit,
        )
        if res.stopped_by == "time limit" and start is not None:
            why = (f"{start[1]}; the ILP reached its {time_limit_s:g} s wall-clock cap before "
                   + (f"its {node_limit}-node limit" if node_limit else "proving its optimum")
                   + ": the DP split is kept, as the incumbent at a wall-clock stop depends on the machine's load")  # fmt: skip
            return split_result(pr, start[0], "dp", why, "", time.perf_counter() - t0)
        bounds = model.boundaries()
        status = res.status + (f" at its {node_limit}-node limit" if res.stopped_by == "node limit" else "")
        if start is not None and evaluate_split(pr, start[0])[0] < evaluate_split(pr, bounds)[0] - 1e-12:
            why = f"{start[1]}; the ILP ({status}, {time_limit_s:g} s cap) found no better split"
            return split_result(pr, start[0], "dp", why, "", time.perf_counter() - t0)
        return split_result(pr, bounds, "ilp", status, res.solver, time.perf_counter() - t0)
    except ilp.InfeasibleProblemError:
        raise _infeasible(pr, explain) from None
    except ilp.SolverFailedError:
        if start is not None:
            why = f"{start[1]}; the ILP gave no answer within its {time_limit_s:g} s cap"
            return split_result(pr, start[0], "dp", why, "", time.perf_counter() - t0)
        bounds = greedy_split(pr)
        if not split_fits(pr, bounds):
            raise _infeasible(pr, explain) from None
        return split_result(pr, bounds, "greedy", "heuristic", "", time.perf_counter() - t0)
