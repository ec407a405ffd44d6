"""Pipeline schedule simulator: per-rank action orders of torch's schedules, timed as events.

Owns (1) the per-rank action ORDER that each ``torch.distributed.pipelining`` schedule class
runs, re-derived here torch-free (a test compares them with torch's ``pipeline_order``), and
(2) a discrete-event simulation of that order with given per-stage times, used to score plans
in the search and to draw timelines in the report.

Schedules (names as ``meshplan.plan.SCHEDULES``) and the torch class whose order is reproduced:

- ``gpipe``            ScheduleGPipe: all forwards, then all full backwards (B = input + weight grad).
- ``1f1b``             Schedule1F1B: min(m, p - r) warm-up forwards on rank r, then B/F pairs.
- ``interleaved-1f1b`` ScheduleInterleaved1F1B: looped placement (rank r holds stages r, r+p, ...).
- ``zero-bubble``      ScheduleInterleavedZeroBubble (ZB-H1 for v = 1): backward split into
                       B (input grad) and W (weight grad), W deferred to fill bubbles.
- ``zbv``              ScheduleZBVZeroBubble: V placement (rank r holds stages r and 2p-1-r), v = 2.

Timing model. Stage ``s`` has per-microbatch times ``fwd_s[s]``, ``bwd_input_s[s]``,
``bwd_weight_s[s]`` (for non-zero-bubble schedules B takes input + weight time and there are no
W events). ``p2p_s[s]`` is the time to send stage s's output to stage s+1, and the same for the
gradient back; it is charged only when the two stages sit on different ranks. Each rank runs its
actions in order, one at a time; an action starts at max(rank free, dependencies met):
F(s, j) after F(s-1, j) + p2p; B(s, j) after F(s, j) and B(s+1, j) + p2p; W(s, j) after B(s, j).
Sends are asynchronous (they do not occupy the rank). This is the blocking-receive model
torch's schedules run under on NCCL. With ``sends_occupy`` (gloo on a CPU host:
``ClusterSpec.sends_occupy_rank``) a send instead holds its sending rank for the hop: F(s, j) that
sends to another rank lasts f + p2p, B(s, j) that sends its input gradient to another rank lasts
b + p2p, and the receiver's dependency is met when that action ends (the bytes crossed inside it):
the hop stays on the critical path once, and now also takes the sender's time (gloo's transport
copies through the host's sockets on the same cores; torch's 1F1B waits on each send's work
before its next action).

In-flight microbatches (activation memory): per rank, the number of (stage, microbatch) pairs
whose F is done and whose B is not. Since a rank runs its actions in a fixed order, the peak is
a property of the order alone (independent of the times).

Bubble fraction: idle time over busy time summed over ranks, ``p * makespan / sum(busy) - 1``;
for equal stages it is (p-1)/m for gpipe/1f1b and (p-1)/(v m) for interleaved 1F1B (SC'21).
No torch import here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from meshplan.partition.schedule_lockstep import (
    MIN_RANKS,
    held_signs,
    inflight_from_orders,
    lockstep_times,
    order_arrays,
    weighted_peaks_from_orders,
)

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv")
ZERO_BUBBLE = frozenset({"zero-bubble", "zbv"})

# An action is (kind, stage, microbatch) with kind "F", "B" or "W".
Action = tuple[str, int, int]


@dataclass(frozen=True)
class Event:
    """One timed action. ``kind`` "F" forward, "B" backward (input grad, or full backward for
    non-zero-bubble schedules), "W" weight grad."""

    rank: int
    stage: int
    microbatch: int
    kind: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Timeline:
    """Result of ``simulate``. Per-rank tuples are indexed by pipeline rank, per-stage by stage."""

    schedule: str
    pp: int
    num_microbatches: int
    virtual_stages: int
    events: tuple[Event, ...]
    makespan_s: float
    busy_s: tuple[float, ...]
    bubble_fraction: float
    stage_to_rank: tuple[int, ...]

    @property
    def peak_inflight(self) -> tuple[int, ...]:
        """Peak in-flight microbatches per rank (``inflight``: a property of the order alone)."""
        return inflight(self.schedule, self.pp, self.num_microbatches, self.virtual_stages)[0]

    @property
    def stage_peak_inflight(self) -> tuple[int, ...]:
        """Peak in-flight microbatches per stage."""
        return inflight(self.schedule, self.pp, self.num_microbatches, self.virtual_stages)[1]

    @property
    def idle_fraction(self) -> float:
        """Share of the p x makespan device time spent idle."""
        total = self.pp * self.makespan_s
        return 1.0 - sum(self.busy_s) / total if total > 0 else 0.0


# ---------------------------------------------------------------- validation and placement


def validate(schedule: str, pp: int, num_microbatches: int, virtual_stages: int = 1) -> None:
    """Raise ValueError when torch's schedule class (or meshplan's rule) rejects the combination."""
    if schedule not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {SCHEDULE_NAMES}")
    p, m, v = pp, num_microbatches, virtual_stages
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pp, num_microbatches and virtual_stages must be >= 1, got {p}, {m}, {v}")
    if schedule in ("gpipe", "1f1b") and v != 1:
        raise ValueError(f"{schedule} runs one stage per rank; got virtual_stages={v} (use interleaved-1f1b)")
    if schedule == "1f1b" and m < p:
        raise ValueError(f"1f1b needs num_microbatches >= pp (torch Schedule1F1B); got m={m} < pp={p}")
    if schedule == "zbv" and v != 2:
        raise ValueError(f"zbv needs exactly virtual_stages=2 (V placement); got {v}")
    if schedule == "interleaved-1f1b" and m % p != 0:
        raise ValueError(f"interleaved-1f1b needs num_microbatches divisible by pp; got m={m}, pp={p}")
    if schedule == "zero-bubble":
        rounds = max(1, m // p)
        if m % rounds != 0:
            raise ValueError(
                f"zero-bubble needs num_microbatches to be a multiple of max(1, m // pp) = {rounds} "
                f"(torch ScheduleInterleavedZeroBubble); got m={m}, pp={p}"
            )


@lru_cache(maxsize=1024)
def stage_to_rank(schedule: str, pp: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """Pipeline rank of each stage: looped (s % pp) or V (zbv: rank r holds r and 2p-1-r)."""
    n = pp * virtual_stages
    if schedule == "zbv":
        return tuple(s if s < pp else 2 * pp - 1 - s for s in range(n))
    return tuple(s % pp for s in range(n))


# ---------------------------------------------------------------- action orders (as torch)


def _gpipe_order(p: int, m: int, r: int) -> list[Action]:
    return [("F", r, j) for j in range(m)] + [("B", r, j) for j in range(m)]


def _1f1b_order(p: int, m: int, r: int) -> list[Action]:
    warm = min(m, p - r)
    ops: list[Action] = [("F", r, j) for j in range(warm)]
    f, b = warm, 0
    while b < m:
        ops.append(("B", r, b))
        b += 1
        if f < m:
            ops.append(("F", r, f))
            f += 1
    return ops


def _looped_order(p: int, m: int, v: int, r: int, zero_bubble: bool) -> list[Action]:
    """torch ``_get_1f1b_rank_ops`` for ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble,
    with the no-op slots dropped (the simulator waits on dependencies instead)."""
    rounds = max(1, m // p)
    per_round = m // rounds
    warm = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - r), m * v)
    total_mb_ops = v * m
    fwd_bwd = total_mb_ops - warm

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % v) * p + r

    def bwd_stage(step: int) -> int:
        return (v - 1 - ((step - warm) // per_round) % v) * p + r

    f_idx: dict[int, int] = {}
    b_idx: dict[int, int] = {}
    w_idx: dict[int, int] = {}
    bwd_steps: list[int] = []
    w_count = 0
    ops: list[Action] = []

    def take(counter: dict[int, int], stage: int) -> int:
        j = counter.get(stage, 0)
        counter[stage] = j + 1
        return j

    def add_w() -> None:
        nonlocal w_count
        s = bwd_stage(bwd_steps[w_count])
        ops.append(("W", s, take(w_idx, s)))
        w_count += 1

    for step in range(warm + fwd_bwd + warm):
        if step < warm + fwd_bwd:
            s = fwd_stage(step)
            ops.append(("F", s, take(f_idx, s)))
            if step < warm:
                continue
        s = bwd_stage(step)
        ops.append(("B", s, take(b_idx, s)))
        bwd_steps.append(step)
        if zero_bubble and step - warm >= r:  # rank r runs r plain 1F1B steps before deferring W
            add_w()
    while zero_bubble and w_count < len(bwd_steps):
        add_w()
    return ops


def _zbv_order(p: int, m: int, r: int) -> list[Action]:
    """torch ScheduleZBVZeroBubble._calculate_single_rank_operations, no-ops dropped."""
    n = max(2 * p - 1, m)
    s0, s1 = r, 2 * p - 1 - r
    ops: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (p - r) - 1):
        ops.append(("F", s0, f0))
        f0 += 1
    for _ in range(r):
        ops += [("F", s1, f1), ("F", s0, f0)]
        f1 += 1
        f0 += 1
    for _ in range(p - r):
        ops += [("F", s1, f1), ("B", s1, b1), ("W", s1, b1)]
        f1 += 1
        b1 += 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            ops.append(("F", s0, f0))
            f0 += 1
        ops += [("B", s0, b0), ("W", s0, b0), ("F", s1, f1), ("B", s1, b1), ("W", s1, b1)]
        b0 += 1
        f1 += 1
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(r):
        ops += [("B", s0, b0), ("B", s1, b1)]
        b0 += 1
        b1 += 1
    for _ in range(p - r):
        ops += [("B", s0, b0), ("W", s0, w0)]
        b0 += 1
        w0 += 1
    ops += [("W", s1, j) for j in range(w1, b1)]
    ops += [("W", s0, j) for j in range(w0, b0)]
    return [a for a in ops if a[2] < m]  # torch pads to 2p-1 microbatches, then drops the extra


@lru_cache(maxsize=4096)
def rank_orders(
    schedule: str, pp: int, num_microbatches: int, virtual_stages: int = 1
) -> tuple[tuple[Action, ...], ...]:
    """Per-rank action order, ``orders[r]`` = actions of rank r in the order torch runs them."""
    validate(schedule, pp, num_microbatches, virtual_stages)
    p, m, v = pp, num_microbatches, virtual_stages
    out = []
    for r in range(p):
        if schedule == "gpipe":
            ops = _gpipe_order(p, m, r)
        elif schedule == "1f1b":
            ops = _1f1b_order(p, m, r)
        elif schedule == "zbv":
            ops = _zbv_order(p, m, r)
        else:
            ops = _looped_order(p, m, v, r, zero_bubble=schedule == "zero-bubble")
        out.append(tuple(ops))
    return tuple(out)


@lru_cache(maxsize=128)
def rank_order_arrays(
    schedule: str, pp: int, num_microbatches: int, virtual_stages: int = 1
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``rank_orders`` as (kind, stage, microbatch) arrays of shape (actions per rank, pp), kind 0 F,
    1 B, 2 W (``schedule_lockstep.order_arrays``: numpy-built by the same rules), read-only. Cached:
    the search asks for the same few orders thousands of times (simulation, held bytes, in-flight
    counts, across cluster sizes); at most 128 kept (a few MB each at the largest pp × m)."""
    arrays = order_arrays((schedule, pp, num_microbatches, virtual_stages))
    for a in arrays:
        a.flags.writeable = False
    return arrays


@lru_cache(maxsize=4096)
def inflight(
    schedule: str, pp: int, num_microbatches: int, virtual_stages: int = 1
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(peak in-flight microbatches per rank, per stage): F done and B not yet done. Counted on
    the numpy-built action orders (``schedule_lockstep.order_arrays``, the same orders) for every
    schedule but zbv: a running sum per rank and per stage instead of a Python loop per action."""
    if schedule != "zbv":
        validate(schedule, pp, num_microbatches, virtual_stages)
        return inflight_from_orders(rank_order_arrays(schedule, pp, num_microbatches, virtual_stages), pp, virtual_stages)
    return inflight_of_orders(rank_orders(schedule, pp, num_microbatches, virtual_stages), pp * virtual_stages)


@lru_cache(maxsize=4096)
def rank_held_peaks(
    schedule: str, pp: int, num_microbatches: int, virtual_stages: int, stage_bytes: tuple[float, ...]
) -> tuple[float, ...]:
    """Per rank, the peak over its action order of the bytes its in-flight microbatches hold,
    each (stage, microbatch) holding ``stage_bytes[stage]`` from its forward to its input
    backward. With one stage per rank this is ``inflight`` × the stage's bytes; with several
    (looped and V placements) a rank's chunks do not hold the same number of microbatches at its
    peak: under torch's ScheduleInterleaved1F1B with m = p the last rank runs all m forwards of
    its first chunk in the warm-up but one microbatch at a time through the last chunk (the one
    with the logits), so weighting the rank's chunks alike by its mean in-flight count misprices it."""
    if len(stage_bytes) != pp * virtual_stages:
        raise ValueError(f"stage_bytes needs one value per stage ({pp * virtual_stages}), got {len(stage_bytes)}")
    validate(schedule, pp, num_microbatches, virtual_stages)
    return weighted_peaks_from_orders(_held_signs(schedule, pp, num_microbatches, virtual_stages), stage_bytes)


@lru_cache(maxsize=128)
def _held_signs(schedule: str, pp: int, num_microbatches: int, virtual_stages: int) -> tuple[np.ndarray, np.ndarray]:
    """``schedule_lockstep.held_signs`` of the orders, cached (``rank_held_peaks`` misses its own
    cache with every new ``stage_bytes``)."""
    return held_signs(rank_order_arrays(schedule, pp, num_microbatches, virtual_stages))


def inflight_of_orders(
    orders: Sequence[Sequence[Action]], n_stages: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``inflight`` walking per-rank action orders one action at a time (zbv's, and the reference
    the numpy count is tested against)."""
    per_rank = []
    per_stage = [0] * n_stages
    for ops in orders:
        live = peak = 0
        stage_live: dict[int, int] = {}
        for kind, s, _ in ops:
            if kind == "F":
                live += 1
                stage_live[s] = stage_live.get(s, 0) + 1
                peak = max(peak, live)
                per_stage[s] = max(per_stage[s], stage_live[s])
            elif kind == "B":
                live -= 1
                stage_live[s] -= 1
        per_rank.append(peak)
    return tuple(per_rank), tuple(per_stage)


@dataclass(frozen=True)
class HeldState:
    """One point of a rank's action order where its held memory can peak, in units of one
    microbatch of the rank's whole share (each local chunk counts 1 / v): ``inflight``
    microbatches past their forward and before their input (or full) backward, ``pending`` ones
    past their input backward and waiting for their weight pass (zero-bubble schedules), and
    ``in_backward``: the state while an input (or full) backward runs (its transient on top)."""

    inflight: float
    pending: float
    in_backward: bool


@lru_cache(maxsize=4096)
def held_states(
    schedule: str, pp: int, num_microbatches: int, virtual_stages: int = 1
) -> tuple[tuple[HeldState, ...], ...]:
    """Per rank, the states of its action order at which what it holds can peak: the Pareto
    front of (inflight, pending), separately for the states inside a backward and the others.

    Under torch's zero-bubble schedules (``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``)
    a stage's input backward (``stage_backward_input``) runs ``autograd.grad(retain_graph=True)``
    and keeps, until the microbatch's weight pass (``stage_backward_weight``), the weight-reading
    nodes (``param_groups``' intermediates: through their edges the whole graph below them, every
    saved activation of the stage but what only the loss saved) and the gradient of each of their
    outputs, besides ``backward_state``'s stage input (with its ``.grad``), output and output
    gradient. Rank r of the looped order runs r backwards before its first weight pass
    (``_get_1f1b_rank_ops``), so it holds p − r in flight plus r waiting: p microbatches' graphs
    on every rank (ZB-H1, Qi et al. 2023 §3.1), where 1F1B holds p − r. Other schedules run full
    backwards (``pending`` 0). Unit: microbatches (fractional under v > 1).

    Counted on ``rank_order_arrays`` (running sums over every rank at once; the states visited:
    after each action, and before each input / full backward), then per rank and flag the largest
    ``pending`` at each ``inflight`` and of those the ones no larger ``inflight`` matches (the
    Pareto front of distinct points, by a suffix maximum); each rank's states sorted by (in_backward, inflight, pending)."""
    kind = rank_order_arrays(schedule, pp, num_microbatches, virtual_stages)[0]
    split_w = int(schedule in ZERO_BUBBLE)
    is_b = (kind == 1).astype(np.int64)
    live = np.cumsum((kind == 0) - is_b, axis=0)  # after each action
    pend = np.cumsum(split_w * is_b - (kind == 2), axis=0)
    ranks = np.broadcast_to(np.arange(pp), kind.shape)
    b_rows = is_b.astype(bool)
    # (flag, rank, inflight) -> the largest pending seen there (-1: not visited); in a backward: its state before it
    best = np.full((2, pp, int(live.max(initial=0)) + 2), -1, dtype=np.int64)
    np.maximum.at(best[0], (ranks.ravel(), live.ravel()), pend.ravel())
    np.maximum.at(best[1], (ranks[b_rows], live[b_rows] + 1), pend[b_rows] - split_w)
    above = np.full_like(best, -1)  # the largest pending at any larger inflight
    above[..., :-1] = np.maximum.accumulate(best[..., :0:-1], axis=-1)[..., ::-1]
    flag, rank, a = np.nonzero(best > above)  # flag-major, then rank, then inflight ascending
    w = best[flag, rank, a]
    per_rank: list[list[HeldState]] = [[] for _ in range(pp)]
    v = virtual_stages
    for f_, r_, a_, w_ in zip(flag.tolist(), rank.tolist(), a.tolist(), w.tolist()):
        per_rank[r_].append(HeldState(a_ / v, w_ / v, bool(f_)))
    return tuple(tuple(x) for x in per_rank)


@lru_cache(maxsize=4096)
def held_counts(schedule: str, pp: int, num_microbatches: int, virtual_stages: int = 1) -> tuple[float, ...]:
    """Per rank, the most microbatches it holds past their forward and before their weight pass
    (full backward outside zero-bubble): the largest ``inflight + pending`` over ``held_states``."""
    states = held_states(schedule, pp, num_microbatches, virtual_stages)
    return tuple(max(s.inflight + s.pending for s in st) for st in states)


@lru_cache(maxsize=4096)
def _held_arrays(
    schedule: str, pp: int, num_microbatches: int, virtual_stages: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``held_states`` flattened over ranks: inflight, pending, in_backward, each state's rank and
    each rank's first index (for ``np.maximum.reduceat``)."""
    states = held_states(schedule, pp, num_microbatches, virtual_stages)
    flat = [s for st in states for s in st]
    starts = np.cumsum([0, *(len(st) for st in states[:-1])])
    rank = np.repeat(np.arange(pp), [len(st) for st in states])
    return (np.array([s.inflight for s in flat], dtype=np.float64), np.array([s.pending for s in flat], dtype=np.float64),
            np.array([s.in_backward for s in flat], dtype=bool), rank, starts)  # fmt: skip


def held_peaks(
    schedule: str, pp: int, num_microbatches: int, virtual_stages: int,
    inflight_bytes: Sequence[float], pending_bytes: Sequence[float], backward_bytes: Sequence[float],
) -> list[float]:
    """Per rank r, the largest over its ``held_states`` s of ``s.inflight * inflight_bytes[r] +
    s.pending * pending_bytes[r] + (backward_bytes[r] if s.in_backward else 0.0)``: the same
    floating-point operations in the same order as that Python expression (numpy over every
    state of every rank at once), so the same values bit for bit. ``pending_bytes`` must not be
    negative (and no input NaN). Cached: the search prices the same activations under several
    DP kinds."""
    return list(_held_peaks(schedule, pp, num_microbatches, virtual_stages, tuple(inflight_bytes),
                            tuple(pending_bytes), tuple(backward_bytes)))  # fmt: skip


@lru_cache(maxsize=8192)
def _held_peaks(
    schedule: str, pp: int, num_microbatches: int, virtual_stages: int,
    inflight_bytes: tuple[float, ...], pending_bytes: tuple[float, ...], backward_bytes: tuple[float, ...],
) -> tuple[float, ...]:
    infl, pend, in_bwd, rank, starts = _held_arrays(schedule, pp, num_microbatches, virtual_stages)
    a = np.array(inflight_bytes, dtype=np.float64)[rank]
    k = np.array(pending_bytes, dtype=np.float64)[rank]
    t = np.where(in_bwd, np.array(backward_bytes, dtype=np.float64)[rank], 0.0)
    return tuple(np.maximum.reduceat(infl * a + pend * k + t, starts).tolist())


# ---------------------------------------------------------------- simulation


def _per_stage(name: str, values: Sequence[float] | float, n: int) -> list[float]:
    if isinstance(values, int | float):
        out = [float(values)] * n
    else:
        out = [float(x) for x in values]
        if len(out) != n:
            raise ValueError(f"{name} has {len(out)} entries; expected pp*virtual_stages = {n}")
    if any(x < 0 for x in out):
        raise ValueError(f"{name} must be >= 0, got {out}")
    return out


def simulate(
    schedule: str,
    pp: int,
    num_microbatches: int,
    *,
    virtual_stages: int = 1,
    fwd_s: Sequence[float] | float,
    bwd_input_s: Sequence[float] | float,
    bwd_weight_s: Sequence[float] | float = 0.0,
    p2p_s: Sequence[float] | float = 0.0,
    keep_events: bool = True,
    sends_occupy: bool = False,
) -> Timeline:
    """Time one training step of ``schedule``; per-stage sequences are in model stage order.

    A scalar for a per-stage argument means the same value on every stage. ``p2p_s`` may have
    n or n-1 entries (n = pp * virtual_stages; the last stage sends nothing).
    ``keep_events=False`` skips building the event list (faster in the search) and, from
    ``schedule_lockstep.MIN_RANKS`` ranks on, runs the ranks in lock step with numpy
    (``partition.schedule_lockstep``: the same floating-point operations, so the same times).
    ``sends_occupy``: a send holds its sending rank for its hop (module docstring: gloo).
    """
    validate(schedule, pp, num_microbatches, virtual_stages)
    n = pp * virtual_stages
    m = num_microbatches
    f = _per_stage("fwd_s", fwd_s, n)
    bi = _per_stage("bwd_input_s", bwd_input_s, n)
    bw = _per_stage("bwd_weight_s", bwd_weight_s, n)
    if not isinstance(p2p_s, int | float) and len(p2p_s) == n - 1:
        p2p_s = [*p2p_s, 0.0]
    c = _per_stage("p2p_s", p2p_s, n)
    placement = stage_to_rank(schedule, pp, virtual_stages)
    split_w = schedule in ZERO_BUBBLE
    b_dur = bi if split_w else [x + y for x, y in zip(bi, bw)]
    # time for stage s's output (fwd) / stage s+1's input grad (bwd) to cross the s|s+1 boundary
    hop = [c[s] if s + 1 < n and placement[s] != placement[s + 1] else 0.0 for s in range(n)]
    if sends_occupy and any(hop):  # the hop moves into the sending action (module docstring)
        f = [x + h for x, h in zip(f, hop)]
        b_dur = [x + (hop[s - 1] if s > 0 else 0.0) for s, x in enumerate(b_dur)]
        hop = [0.0] * n

    if not keep_events and pp >= MIN_RANKS:
        arrays = rank_order_arrays(schedule, pp, m, virtual_stages)
        rank_free, busy = lockstep_times((schedule, pp, m, virtual_stages), arrays, f, b_dur, bw, hop)
        return _timeline(schedule, pp, m, virtual_stages, (), rank_free, busy, placement)
    orders = rank_orders(schedule, pp, m, virtual_stages)
    end_f: list[float | None] = [None] * (n * m)
    end_b: list[float | None] = [None] * (n * m)
    rank_free = [0.0] * pp
    busy = [0.0] * pp
    ptr = [0] * pp
    events: list[Event] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            ops = orders[r]
            k = ptr[r]
            t_free = rank_free[r]
            while k < len(ops):
                kind, s, j = ops[k]
                idx = s * m + j
                if kind == "F":
                    if s > 0:
                        e = end_f[idx - m]
                        if e is None:
                            break
                        ready = e + hop[s - 1]
                    else:
                        ready = 0.0
                    dur = f[s]
                elif kind == "B":
                    e = end_f[idx]
                    if e is None:
                        break
                    ready = e
                    if s + 1 < n:
                        e2 = end_b[idx + m]
                        if e2 is None:
                            break
                        ready = max(ready, e2 + hop[s])
                    dur = b_dur[s]
                else:
                    e = end_b[idx]
                    if e is None:
                        break
                    ready = e
                    dur = bw[s]
                start = ready if ready > t_free else t_free
                t_free = start + dur
                if kind == "F":
                    end_f[idx] = t_free
                elif kind == "B":
                    end_b[idx] = t_free
                busy[r] += dur
                if keep_events:
                    events.append(Event(r, s, j, kind, start, t_free))
                k += 1
            if k != ptr[r]:
                remaining -= k - ptr[r]
                ptr[r] = k
                rank_free[r] = t_free
                progressed = True
        if not progressed:
            stuck = {r: orders[r][ptr[r]] for r in range(pp) if ptr[r] < len(orders[r])}
            raise AssertionError(
                f"schedule {schedule} deadlocks (p={pp}, m={m}, v={virtual_stages}): {stuck}"
            )
    if keep_events:
        events.sort(key=lambda e: (e.start_s, e.rank))
    return _timeline(schedule, pp, m, virtual_stages, tuple(events), rank_free, busy, placement)


def _timeline(
    schedule: str, pp: int, m: int, v: int, events: tuple[Event, ...], rank_free: list[float], busy: list[float],
    placement: tuple[int, ...],
) -> Timeline:
    makespan = max(rank_free)
    total_busy = sum(busy)
    bubble = pp * makespan / total_busy - 1.0 if total_busy > 0 else 0.0
    return Timeline(
        schedule=schedule,
        pp=pp,
        num_microbatches=m,
        virtual_stages=v,
        events=events,
        makespan_s=makespan,
        busy_s=tuple(busy),
        bubble_fraction=bubble,
        stage_to_rank=placement,
    )


# ---------------------------------------------------------------- closed forms


def bubble_fraction_formula(schedule: str, pp: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Textbook bubble over ideal compute time for equal stages and free p2p (SC'21 §2.2):
    (p-1)/m for gpipe and 1f1b, (p-1)/(v m) for interleaved-1f1b. Zero-bubble schedules have no
    closed form independent of the F/B/W times: use ``simulate``."""
    validate(schedule, pp, num_microbatches, virtual_stages)
    p, m, v = pp, num_microbatches, virtual_stages
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / m
    if schedule == "interleaved-1f1b":
        return (p - 1) / (v * m)
    raise ValueError(f"no closed-form bubble for {schedule}; simulate it")


def fast_makespan(
    schedule: str,
    pp: int,
    num_microbatches: int,
    *,
    virtual_stages: int = 1,
    fwd_s: float,
    bwd_input_s: float,
    bwd_weight_s: float = 0.0,
    p2p_s: float = 0.0,
) -> float:
    """Makespan for EQUAL stages (times per stage, i.e. per model chunk), closed form where one
    is known and matches ``simulate`` exactly, else a (cached-order) simulation:

    - gpipe: (m + p - 1)(f + b + w) + 2 (p - 1) c
    - 1f1b, c = 0: (m + p - 1)(f + b + w)
    - interleaved-1f1b, c = 0: (v m + p - 1)(f + b + w)
    - zero-bubble v = 1 (ZB-H1), c = 0, w <= f, m >= p: m (f + b + w) + (p - 1)(f + b - w)  (Qi et al. 2023)
    """
    validate(schedule, pp, num_microbatches, virtual_stages)
    p, m, v = pp, num_microbatches, virtual_stages
    f, b, w, c = float(fwd_s), float(bwd_input_s), float(bwd_weight_s), float(p2p_s)
    if schedule == "gpipe":
        return (m + p - 1) * (f + b + w) + 2 * (p - 1) * c
    if c == 0.0:
        if schedule == "1f1b":
            return (m + p - 1) * (f + b + w)
        if schedule == "interleaved-1f1b":
            return (v * m + p - 1) * (f + b + w)
        if schedule == "zero-bubble" and v == 1 and w <= f and m >= p:
            return m * (f + b + w) + (p - 1) * (f + b - w)
    return simulate(
        schedule,
        p,
        m,
        virtual_stages=v,
        fwd_s=f,
        bwd_input_s=b,
        bwd_weight_s=w,
        p2p_s=c,
        keep_events=False,
    ).makespan_s
