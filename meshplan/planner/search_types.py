"""Data types of the joint search and the time-balanced stage split.

``Config`` (one point of the search space), ``Evaluation`` (its costs), ``SearchResult``,
``divisors`` and ``balanced_split`` (contiguous min-max split by bisection on the bottleneck
with greedy packing over prefix sums). No torch import.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

from meshplan.planner.costing import CostTable, GraphCoster, replaced

GiB = 1024**3
SCHEDULE_CHOICES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv")
RECOMPUTE_CHOICES = ("none", "selective", "op", "full")


@dataclass(frozen=True)
class Config:
    dp: int
    tp: int
    pp: int
    micro_batch: int
    num_microbatches: int
    schedule: str
    virtual_stages: int
    recompute: str
    sequence_parallel: bool
    dp_kind: str
    cp: int = 1  # context parallel degree (an extra mesh axis: world = dp * cp * tp * pp)
    ep: int = 1  # expert parallel degree (borrows dp x cp ranks)

    def but(self, **changes: Any) -> Config:
        """``dataclasses.replace(self, **changes)`` without re-running ``__init__`` (no
        ``__post_init__``; a frozen dataclass's ``__init__`` sets each field through
        ``object.__setattr__``): the search derives tens of thousands of variants."""
        return replaced(self, **changes)  # type: ignore[no-any-return]

    def summary(self) -> str:
        v = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        sp = " sp" if self.sequence_parallel else ""
        cpep = (f" cp{self.cp}" if self.cp > 1 else "") + (f" ep{self.ep}" if self.ep > 1 else "")
        return (
            f"dp{self.dp}{cpep} tp{self.tp}{sp} pp{self.pp} {self.schedule}{v} mb{self.micro_batch}x{self.num_microbatches}"
            f" recompute={self.recompute} {self.dp_kind}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class Evaluation:
    """A costed configuration (read only: ``dataclasses.replace`` makes a changed copy)."""

    config: Config
    step_s: float
    pipeline_s: float
    compute_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    bubble_s: float
    optimizer_s: float
    recompute_s: float
    bubble_fraction: float
    peak_mem_bytes: tuple[int, ...]
    mem_breakdown: dict[str, int]
    comm_bytes: dict[str, int]
    stage_layers: list[tuple[int, int]]  # [start, end) layer indices per stage (model order)
    stage_times: list[tuple[float, float, float, float]]  # fwd, bwd (total), bwd_weight, send per stage
    stage_mem: list[int]
    stage_send_bytes: list[int]
    stage_params: list[float]  # parameters held per device, tied copies included
    fits: bool
    mem_limit_bytes: int
    table: CostTable = field(repr=False, default=None)  # type: ignore[assignment]
    exact: bool = True  # False: the makespan is a lower bound (not simulated)
    kind_note: str = ""  # why a data-parallel kind other than ddp was chosen (empty when ddp or pinned)
    ep_comm_s: float = 0.0  # exposed EP all-to-all + expert load imbalance, per step
    cp_comm_s: float = 0.0  # exposed CP ring key/value exchange, per step
    ep_expert_read_s: float = 0.0  # MoE time of holding E/ep experts, not E, per step (< 0: saved)

    @property
    def max_mem_bytes(self) -> int:
        return max(self.peak_mem_bytes) if self.peak_mem_bytes else 0


@dataclass(frozen=True)
class SplitSolve:
    """What the stage-split ILP reported for the winner's split (``partition.stage_ilp``)."""

    method: str  # "ilp", or "dp" when its warm start (the exact DP) stayed better
    status: str
    solver: str
    objective_s: float  # the linearized step time the ILP minimizes
    seconds: float
    improved: bool  # the ILP's split beat the search's time-balanced split in simulation


@dataclass
class SearchResult:
    best: Evaluation | None
    alternatives: list[tuple[Evaluation, str]]
    candidates: int
    evaluated: int
    seconds: float
    ilp_solves: int
    ilp_seconds: float
    min_mem_bytes: int  # smallest per-device need seen (exact where evaluated)
    mem_limit_bytes: int
    coster: GraphCoster = field(repr=False, default=None)  # type: ignore[assignment]
    split: SplitSolve | None = None  # the stage-split ILP's answer for the winner (pp > 1)
    #: measured wall seconds per search phase: enumerate (incl. the TP placement ILP of each TP
    #: degree), bound, cost (split, memory, DP, optimizer of each candidate), simulate, finalize
    phase_s: dict[str, float] = field(default_factory=dict)
    simulated: int = 0  # configurations whose pipeline schedule was simulated
    pruned: int = 0  # configurations skipped before costing as dominated (``Searcher.dominated``)
    skipped: int = 0  # configurations not costed: they cannot change the result (``planner.search_prune``)
    tp_reason: str = ""  # why the winner has tp=1 (``planner.tp_reason``); "" when tp > 1
    #: why the winner's cp / ep (> 1) when no alternative has another degree (``planner.tp_reason``)
    degree_reasons: dict[str, str] = field(default_factory=dict)
    #: the smallest memory lower bound over every candidate (``ConfigEvaluator.bound``): no
    #: configuration needs less, costed or skipped
    min_mem_floor_bytes: int = 0


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def balanced_split(costs: list[float], num_stages: int) -> list[tuple[int, int]]:
    """Contiguous split of ``costs`` into ``num_stages`` non-empty runs minimising the largest
    run sum (bisection on the bottleneck + greedy packing; exact up to the bisection tolerance)."""
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers into {num_stages} stages")

    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def pack(limit: float) -> list[tuple[int, int]] | None:
        """Greedy: each run takes as many layers as fit under ``limit`` (binary search on the
        prefix sums); None when more than ``num_stages`` runs are needed."""
        out, start, lim, right = [], 0, limit * (1 + 1e-12), bisect.bisect_right
        while start < n:
            end = right(prefix, prefix[start] + lim) - 1
            if end <= start:
                return None  # one layer alone exceeds the limit
            out.append((start, end))
            if len(out) > num_stages:
                return None
            start = end
        return out

    lo, hi = max(costs), sum(costs)
    for _ in range(60):
        if hi - lo <= 1e-7 * max(hi, 1e-30):
            break
        mid = (lo + hi) / 2
        if pack(mid) is None:
            lo = mid
        else:
            hi = mid
    runs = pack(hi) or [(i, i + 1) for i in range(n)]
    while len(runs) < num_stages:  # split the largest splittable run: the maximum never grows
        k = max(
            (i for i, (a, b) in enumerate(runs) if b - a > 1),
            key=lambda i: sum(costs[runs[i][0] : runs[i][1]]),
        )
        a, b = runs[k]
        best_j, best_v = a + 1, math.inf
        for j in range(a + 1, b):
            v = max(sum(costs[a:j]), sum(costs[j:b]))
            if v < best_v:
                best_j, best_v = j, v
        runs[k : k + 1] = [(a, best_j), (best_j, b)]
    return runs


def valid_count(schedule: str, p: int, v: int, at_least: int) -> int | None:
    """The smallest microbatch count ≥ ``at_least`` the schedule accepts (multiple of p)."""
    from meshplan.partition.schedule import validate

    m = max(p, ((at_least + p - 1) // p) * p)
    for cand in (m, m + p, 2 * m):
        try:
            validate(schedule, p, cand, v)
            return cand
        except ValueError:
            continue
    return None


def group(c: Config) -> tuple[Any, ...]:
    """What makes two configurations a different choice for a reader: degrees, schedule, recompute."""
    return (c.dp, c.tp, c.pp, c.schedule, c.recompute)
