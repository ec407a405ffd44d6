"""Exact dynamic programs and the greedy fallback for contiguous stage splits.

``dp_split`` minimizes the ILP's objective (``partition.stage_ilp``) exactly when v = 1: the
min-max stage time (``dp_min_max``), then the cheapest p2p among splits with each candidate
bottleneck; for v > 1 it gives the min-max stage (chunk) time. ``greedy_split`` cuts where the
running time passes k/n of the total. Memory per stage is kept under the problem's limit.
No torch import.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable

from meshplan.partition.stage_problem import SplitProblem, evaluate_split, split_fits, stage_mem


def dp_min_max(pr: SplitProblem, cost: Callable[[int, int, int], float]) -> tuple[float, list[int]] | None:
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
                    or stage_mem(pr, k - 1, lo, hi) + pr.reserved_bytes > pr.limit_bytes
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


def _dp_min_p2p(pr: SplitProblem, cap_s: float) -> list[int] | None:
    """Cheapest-p2p contiguous split with every stage time <= cap_s and memory <= limit.

    The same dynamic program as ``best[k][hi] = cut(hi) + min_lo best[k-1][lo]`` over the
    admissible ``lo`` (stage ``[lo, hi)`` within the time cap and the memory limit), in
    O(n · L) rather than O(n · L²): with non-negative layer times and bytes, the admissible ``lo``
    of an ``hi`` form one window ``[a(hi), hi)`` whose left end never moves back as ``hi`` grows,
    so a monotone deque gives each window's minimum (its earliest minimum, as the quadratic
    loop's first strict improvement did). Floating-point differences of prefix sums are monotone
    in ``lo``, so the windows are exactly the quadratic loop's admissible sets.
    """
    L, n = len(pr.layers), pr.n
    pre, ps, pa = pr.pre_t, pr.pre_state, pr.pre_act
    tcap = cap_s * (1 + 1e-12)
    limit, reserved = pr.limit_bytes, pr.reserved_bytes
    inf = math.inf
    prev = [inf] * (L + 1)
    prev[0] = 0.0
    args: list[list[int]] = [[]]
    for k in range(1, n + 1):
        cur = [inf] * (L + 1)
        arg = [0] * (L + 1)
        infl = pr.inflight[k - 1]
        crosses = k < n and pr.crosses(k - 1)
        window: deque[int] = deque()  # lo with finite prev, prev non-decreasing front to back
        nxt = a = k - 1
        for hi in range(k, L - (n - k) + 1):
            while nxt < hi:  # every lo < hi enters the window once
                v = prev[nxt]
                if v < inf:
                    while window and prev[window[-1]] > v:
                        window.pop()
                    window.append(nxt)
                nxt += 1
            while a < hi and (
                pre[hi] - pre[a] > tcap or ps[hi] - ps[a] + infl * (pa[hi] - pa[a]) + reserved > limit
            ):
                a += 1
            while window and window[0] < a:
                window.popleft()
            if window:
                lo = window[0]
                cur[hi] = prev[lo] + (pr.cut_s[hi - 1] if crosses else 0.0)
                arg[hi] = lo
        prev = cur
        args.append(arg)
    if prev[L] == inf:
        return None
    return _backtrack(args, n, L)


def _segment_sums(pr: SplitProblem) -> list[float]:
    """Every distinct stage time a contiguous split can have, ascending (the candidate bottlenecks)."""
    pre, L = pr.pre_t, len(pr.layers)
    return sorted({pre[hi] - pre[lo] for lo in range(L) for hi in range(lo + 1, L + 1)})


def _memo_p2p(pr: SplitProblem) -> Callable[[float], list[int] | None]:
    """``_dp_min_p2p(pr, cap)`` memoized per cap for one split problem (the bisection's last cap and
    the loosest cap are each asked twice); callers must not modify the returned lists."""
    memo: dict[float, list[int] | None] = {}

    def run(cap_s: float) -> list[int] | None:
        if cap_s not in memo:
            memo[cap_s] = _dp_min_p2p(pr, cap_s)
        return memo[cap_s]

    return run


def _min_max(
    pr: SplitProblem, seg: list[float], run: Callable[[float], list[int] | None] | None = None
) -> tuple[float, list[int]] | None:
    """(least bottleneck stage time, the cheapest-p2p split reaching it): bisection over the
    candidate bottlenecks ``seg``, feasibility by ``_dp_min_p2p`` (monotone in the cap; ``run``:
    a ``_memo_p2p`` of ``pr``)."""
    run = run or _memo_p2p(pr)
    if not seg or run(seg[-1]) is None:
        return None
    # no bottleneck is below the mean stage time or the largest layer (less a rounding margin)
    floor = max(pr.pre_t[-1] / pr.n, max(x.time_s for x in pr.layers)) * (1 - 1e-9)
    lo, hi = bisect.bisect_left(seg, floor), len(seg) - 1  # seg[hi] is feasible
    lo = min(lo, hi)
    while lo < hi:
        mid = (lo + hi) // 2
        if run(seg[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    bounds = run(seg[hi])
    assert bounds is not None
    return seg[hi], bounds


def dp_split(pr: SplitProblem, max_candidates: int = 64) -> tuple[list[int], str] | None:
    """Exact split for v = 1 (module docstring): the least bottleneck T*, then, for each larger
    candidate bottleneck T that could still pay through cheaper cuts, the cheapest-p2p split
    under T. A candidate is skipped once ``coef · T + 2 · (cheapest p2p of any split)`` cannot
    beat the best objective found. For v > 1 the min-max split (per-stage memory)."""
    seg = _segment_sums(pr)
    run = _memo_p2p(pr)
    found = _min_max(pr, seg, run)
    if found is None:
        return None
    t_star, bounds = found
    if pr.v > 1:
        if not split_fits(pr, bounds):  # per-stage memory held; a rank's stages together may not
            return None
        return bounds, "heuristic"
    best_obj = evaluate_split(pr, bounds)[0]
    loosest = run(seg[-1])  # cheapest cuts with no bottleneck cap: a floor on 2 · p2p
    assert loosest is not None
    loose_obj, loose_t, _ = evaluate_split(pr, loosest)
    p2p_floor = loose_obj - pr.coef_t * max(loose_t) - pr.constant_s
    if loose_obj < best_obj - 1e-15:
        bounds, best_obj = loosest, loose_obj
    if pr.coef_t > 0:
        top = t_star + max(0.0, best_obj - pr.constant_s - p2p_floor - pr.coef_t * t_star) / pr.coef_t
        cands = [t for t in seg if t_star < t <= top + 1e-12]
    else:  # one microbatch with gpipe/1f1b: the bottleneck has no weight, only the cuts count
        cands = []
    status = "exact"
    for i, cap in enumerate(cands):
        if pr.coef_t * cap + p2p_floor + pr.constant_s >= best_obj - 1e-15:
            break  # every later candidate's objective is at least this
        if i == max_candidates:
            status = "heuristic"
            break
        b = run(cap)
        obj = evaluate_split(pr, b)[0] if b is not None else math.inf
        if b is not None and obj < best_obj - 1e-15:
            bounds, best_obj = b, obj
    return bounds, status


def greedy_split(pr: SplitProblem) -> list[int]:
    """Balanced split by prefix time: cut where the running time passes k/n of the total."""
    L, n = len(pr.layers), pr.n
    pre = pr.pre_t
    bounds = [0]
    for k in range(1, n):
        target = pre[L] * k / n
        lo, hi = bounds[-1] + 1, L - (n - k)
        bounds.append(min(range(lo, hi + 1), key=lambda i: abs(pre[i] - target)))
    return [*bounds, L]
