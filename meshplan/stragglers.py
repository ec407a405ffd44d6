"""Stragglers: which rank makes every other rank wait, from each rank's own step times.

A synchronous step ends at the same moment on every rank (the last collective waits for the
slowest), so a rank's wall-clock step time says nothing about who is slow. What differs is how
each rank spends the step: its *own* time (reading its data, forward, backward, optimizer, up to
the moment its last gradient bucket is handed to the reduction) and its *wait* (the step-start
barrier, then from that hand-off until the reductions and the loss all-reduce return). The run
loop measures both on every rank (``RunRecord.rank_step_s`` / ``rank_wait_s``, one list per rank,
one value per step); waits inside forward/backward collectives (TP, FSDP all-gathers, pipeline
sends) count as own time, so on those plans the figures understate a straggler.

``find_stragglers`` names every rank whose median own step time (after the warm-up steps) is at
least ``THRESHOLD`` (15 %) above the median of the other ranks' medians, and what it cost: per
other rank, the summed wait beyond the straggler's own wait at the same step (the straggler waits
only for the collective itself, so the excess is the time lost to it). Torch-free: the run loop,
the end-of-run line and ``meshplan report`` share it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

THRESHOLD = 0.15  # a rank this much slower than the others' median is named (the issue's 15 %)


@dataclass(frozen=True)
class Straggler:
    rank: int
    median_s: float  # its median own step time (measured, after warm-up)
    others_median_s: float  # the median of the other ranks' medians
    lost_s: float  # median over the other ranks of their summed extra wait (seconds)
    lost_total_s: float  # the same summed over every other rank
    steps: int  # steps counted

    @property
    def slower(self) -> float:
        return self.median_s / self.others_median_s - 1.0 if self.others_median_s > 0 else 0.0

    def text(self) -> str:
        others = "the other rank" if self.lost_total_s == self.lost_s else "the other ranks"
        each = "" if others == "the other rank" else f" each ({self.lost_total_s:.2f} s in all)"
        return (f"straggler: rank {self.rank} median step {self.median_s * 1e3:.1f} ms vs "
                f"{self.others_median_s * 1e3:.1f} ms on {others} ({self.slower:+.0%}, measured); "
                f"{others} lost {self.lost_s:.2f} s{each} waiting for it over {self.steps} steps; look at its node "
                "(GPU clocks and temperature, other processes, its data reads) or leave that node out")


def _kept(xs: Sequence[float], warmup: int) -> list[float]:
    return list(xs[warmup:]) or list(xs)


def rank_medians(rank_step_s: Sequence[Sequence[float]], warmup: int = 1) -> list[float]:
    """Median own step time per rank (after ``warmup`` steps); 0.0 for a rank with no steps."""
    return [float(statistics.median(k)) if (k := _kept(xs, warmup)) else 0.0 for xs in rank_step_s]


def find_stragglers(rank_step_s: Sequence[Sequence[float]], rank_wait_s: Sequence[Sequence[float]] = (),
                    warmup: int = 1, threshold: float = THRESHOLD) -> list[Straggler]:
    """Ranks at least ``threshold`` slower than the others (median own step time), slowest first."""
    meds = rank_medians(rank_step_s, warmup)
    if len(meds) < 2:
        return []
    out = []
    for r, m in enumerate(meds):
        others = [x for i, x in enumerate(meds) if i != r]
        ref = float(statistics.median(others))
        if ref <= 0 or m < (1.0 + threshold) * ref:
            continue
        lost = []
        mine = _kept(rank_wait_s[r], warmup) if r < len(rank_wait_s) else []
        for i in range(len(meds)):
            if i == r or i >= len(rank_wait_s):
                continue
            theirs = _kept(rank_wait_s[i], warmup)
            lost.append(sum(max(0.0, w - (mine[k] if k < len(mine) else 0.0)) for k, w in enumerate(theirs)))
        steps = len(_kept(rank_step_s[r], warmup))
        out.append(Straggler(r, m, ref, float(statistics.median(lost)) if lost else 0.0, float(sum(lost)), steps))
    return sorted(out, key=lambda s: -s.median_s)


def spread_text(rank_step_s: Sequence[Sequence[float]], rank_wait_s: Sequence[Sequence[float]] = (),
                warmup: int = 1, per_rank_limit: int = 16) -> list[str]:
    """Report lines: the spread of the ranks' median own step times, each rank (up to a limit), stragglers."""
    meds = rank_medians(rank_step_s, warmup)
    if not meds:
        return []
    waits = rank_medians(rank_wait_s, warmup) if rank_wait_s else []
    lo, hi = min(range(len(meds)), key=meds.__getitem__), max(range(len(meds)), key=meds.__getitem__)
    mid = statistics.median(meds)
    spread = f" (max {meds[hi] / meds[lo] - 1:+.0%} over min)" if meds[lo] > 0 else ""
    out = [f"per-rank step time (own work, waits excluded; median after {warmup} warm-up, measured): "
           f"min {meds[lo] * 1e3:.1f} ms (rank {lo}), median {mid * 1e3:.1f} ms, "
           f"max {meds[hi] * 1e3:.1f} ms (rank {hi}){spread}"]
    order = sorted(range(len(meds)), key=lambda r: -meds[r])[:per_rank_limit]
    for r in sorted(order):
        w = f", {waits[r] * 1e3:.1f} ms waiting" if r < len(waits) else ""
        out.append(f"  rank {r}: {meds[r] * 1e3:.1f} ms own{w}")
    if len(meds) > per_rank_limit:
        out.append(f"  ({len(meds) - per_rank_limit} faster ranks not listed)")
    out += [s.text() for s in find_stragglers(rank_step_s, rank_wait_s, warmup)]
    return out
