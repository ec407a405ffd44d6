"""Exact dynamic programs and the greedy fallback for contiguous stage splits.

``dp_split`` minimizes the ILP's objective (``partition.stage_ilp``) exactly when v = 1: the
min-max stage time (``dp_min_max``), then the cheapest p2p among splits with each candidate
bottleneck; for v > 1 it gives the min-max stage (chunk) time. ``greedy_split`` cuts where the
running time passes k/n of the total. Memory per stage is kept under the problem's limit.
No torch import.
"""

from __future__ import annotations

import math
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
                if stage_mem(pr, k - 1, lo, hi) + pr.reserved_bytes > pr.limit_bytes:
                    continue
                val = best[k - 1][lo] + cut
                if val < best[k][hi]:
                    best[k][hi], arg[k][hi] = val, lo
    if best[n][L] == inf:
        return None
    return _backtrack(arg, n, L)


def dp_split(pr: SplitProblem, max_candidates: int = 64) -> tuple[list[int], str] | None:
    pre = pr.pre_t
    found = dp_min_max(pr, lambda s, lo, hi: pre[hi] - pre[lo])
    if found is None:
        return None
    t_star, bounds = found
    if pr.v > 1:
        if not split_fits(pr, bounds):  # per-stage memory held; a rank's stages together may not
            return None
        return bounds, "heuristic"
    best_obj = evaluate_split(pr, bounds)[0]
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
        if b is not None and evaluate_split(pr, b)[0] < best_obj - 1e-15:
            bounds, best_obj = b, evaluate_split(pr, b)[0]
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
