"""The schedule simulator without events, vectorised over pipeline ranks (numpy): what the search
calls thousands of times (``partition.schedule.simulate(..., keep_events=False)``).

Same timing model and the same floating-point operations as the event simulator in
``partition.schedule`` (its docstring), so the makespan and busy times are bit for bit the same:
every action ends at ``max(rank free, dependency end + hop, ...) + duration``; a maximum is exact
and each action's sums are taken in the same order, and a rank's busy time is summed in its own
action order. Only the order in which independent actions are computed differs, which cannot
change any value.

Mechanism. Each rank's action order (``schedule.rank_orders``, built here with numpy by the same
rules for all schedules but zbv: ``order_arrays``) is compiled once per (schedule, pp, m, v) into
integer arrays, one row per step of the rank's order: the slot its end time is
written to, the slots of its two dependencies and the hop added to each, and its duration's
index. Then in lock step every rank whose next action's dependencies have ended runs it: one
round is a dozen numpy operations over the pp ranks, and a step takes as many rounds as the
longest dependency chain counted in actions (about the per-rank action count plus the pipeline
fill), instead of one Python iteration per action. Slots: F ends [0, N), B ends [N, 2N), W ends
[2N, 3N) (N = stages × microbatches), then one slot holding -inf (a dependency that does not
exist) and one holding NaN (never ends: the row after a rank's last action). No torch import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

Action = tuple[str, int, int]  # (kind, stage, microbatch), as partition.schedule

#: Below this many pipeline ranks the per-round numpy overhead outweighs the per-action Python
#: loop of ``schedule.simulate``; the search uses the event simulator there.
MIN_RANKS = 6


#: compiled orders by (schedule, pp, m, v), at most ``_CACHE_SIZE`` (oldest dropped first)
_compiled: dict[tuple[str, int, int, int], tuple[np.ndarray, ...]] = {}
_CACHE_SIZE = 64


def compiled(key: tuple[str, int, int, int], arrays: tuple[np.ndarray, np.ndarray, np.ndarray]) -> tuple[np.ndarray, ...]:
    """(out slot, (dep_a, dep_b) slots, (hop_a, hop_b) indices, duration index) of every action,
    arrays indexed by step · pp + rank (with a padding step at the end), of the per-rank orders of
    ``key`` = (schedule, pp, m, v) given as ``order_arrays(key)``'s ``arrays``; see the module
    docstring."""
    if key not in _compiled:
        if len(_compiled) >= _CACHE_SIZE:
            del _compiled[next(iter(_compiled))]
        _compiled[key] = _compile(key, arrays)
    return _compiled[key]


def _compile(key: tuple[str, int, int, int], arrays: tuple[np.ndarray, np.ndarray, np.ndarray]) -> tuple[np.ndarray, ...]:
    _, pp, m, v = key
    n = pp * v
    big_n = n * m
    neg, nan = 3 * big_n, 3 * big_n + 1
    kind, stage, mb = arrays
    pad = np.full((1, pp), 3, dtype=np.int64)  # 3: past the rank's last action
    kind = np.vstack([kind, pad])
    stage = np.vstack([stage, 0 * pad])
    mb = np.vstack([mb, 0 * pad])
    idx = stage * m + mb
    f, b, w, done = kind == 0, kind == 1, kind == 2, kind == 3
    out = np.select([f, b, w], [idx, big_n + idx, 2 * big_n + idx], nan)
    dep_a = np.select([f & (stage > 0), f, b, w], [idx - m, neg, idx, big_n + idx], nan)
    hop_a = np.where(f & (stage > 0), stage - 1, n)  # hop index n: 0.0
    dep_b = np.where(b & (stage + 1 < n), big_n + idx + m, neg)
    dep_b[done] = nan
    hop_b = np.where(b, stage, n)
    dur = np.select([f, b, w], [stage, n + stage, 2 * n + stage], 0)
    # flat: row = step · pp + rank; the two dependencies (and their hops) side by side
    return (out.ravel(), np.stack([dep_a.ravel(), dep_b.ravel()], axis=1), np.stack([hop_a.ravel(), hop_b.ravel()], axis=1),
            dur.ravel())  # fmt: skip


def order_arrays(key: tuple[str, int, int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kind, stage, microbatch) of every rank's actions, shape (actions per rank, pp), kind
    0 F, 1 B, 2 W: ``schedule.rank_orders`` generated with numpy by the same rules (gpipe and
    1f1b per rank; for every rank at once the looped schedules interleaved-1f1b and zero-bubble,
    ``_looped``, and zbv, ``_zbv``)."""
    schedule, p, m, v = key
    if schedule in ("interleaved-1f1b", "zero-bubble"):
        return _looped(p, m, v, schedule == "zero-bubble")
    if schedule == "zbv":
        return _zbv(p, m)
    if schedule == "gpipe":
        cols = [_gpipe(m, r) for r in range(p)]
    else:
        cols = [_1f1b(p, m, r) for r in range(p)]
    return tuple(np.stack([c[i] for c in cols], axis=1).astype(np.int64) for i in range(3))  # type: ignore[return-value]


def inflight_from_orders(
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray], pp: int, v: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``schedule.inflight`` from ``order_arrays``' (kind, stage, microbatch) of a looped-placement
    schedule (stage = chunk · pp + rank): per rank and per stage the largest running count of
    forwards less input backwards over its action order (0 before any action)."""
    kind, stage, _ = arrays
    delta = (kind == 0).astype(np.int64) - (kind == 1)
    per_rank = np.maximum(np.cumsum(delta, axis=0).max(axis=0, initial=0), 0)
    per_stage = [0] * (pp * v)
    for k in range(v):
        peak = np.cumsum(np.where(stage // pp == k, delta, 0), axis=0).max(axis=0, initial=0)
        for r in range(pp):
            per_stage[k * pp + r] = int(peak[r])
    return tuple(int(x) for x in per_rank), tuple(per_stage)


def held_signs(arrays: tuple[np.ndarray, np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(sign, stage) of ``order_arrays``' actions, shape (pp, actions per rank), contiguous per
    rank: sign 1.0 for a forward, -1.0 for an input backward, 0.0 for a weight pass (what
    ``weighted_peaks_from_orders`` sums)."""
    kind, stage, _ = arrays
    return ((kind == 0).astype(np.float64) - (kind == 1)).T.copy(), stage.T.copy()


def weighted_peaks_from_orders(signs: tuple[np.ndarray, np.ndarray], stage_bytes: Sequence[float]) -> tuple[float, ...]:
    """Per rank, the largest running sum over its action order of ``stage_bytes[stage]`` added
    by a forward and taken off by the input backward that frees it (0 before any action), from
    ``held_signs``: what a rank holds at its peak when its stages keep different bytes per
    microbatch (``schedule.rank_held_peaks``). A running sum (``np.cumsum``) adds in order."""
    sign, stage = signs
    held = np.cumsum(sign * np.asarray(stage_bytes, dtype=np.float64)[stage], axis=1)
    return tuple(float(x) for x in np.maximum(held.max(axis=1, initial=0.0), 0.0))


def _gpipe(m: int, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    j = np.arange(m)
    return np.repeat([0, 1], m), np.full(2 * m, r), np.concatenate([j, j])


def _1f1b(p: int, m: int, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``schedule._1f1b_order``: min(m, p - r) forwards, then B j followed by F (warm + j) while any remain."""
    warm = min(m, p - r)
    j = np.arange(m)
    # slots: warm-up forwards, then per backward j the pair (B j, F warm + j)
    kind = np.concatenate([np.zeros(warm, int), np.tile([1, 0], m)])
    mb = np.concatenate([j[:warm], np.stack([j, j + warm], axis=1).ravel()])
    keep = (kind == 1) | (mb < m)
    return kind[keep], np.full(int(keep.sum()), r), mb[keep]


def _looped(p: int, m: int, v: int, zero_bubble: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``schedule._looped_order`` (torch ``_get_1f1b_rank_ops``) of every rank at once, shape
    (actions per rank, p): rank r at step t runs the forward of step t (t < v·m), then from its
    warm-up on the backward of step t − warm, and under zero-bubble from the r-th backward on the
    weight pass of backward number (t − warm − r); its remaining weight passes at the end (here
    in slots past every rank's last step). Steps run in groups of ``per_round`` per chunk: step
    t's chunk is (t // per_round) % v (backwards: reversed), its microbatch
    (t // (per_round·v))·per_round + t % per_round. Each rank runs as many actions; its slots
    (step, F / B / W) read in order are its order."""
    rounds = max(1, m // p)
    per_round = m // rounds
    total = v * m
    r = np.arange(p)[:, None]
    warm = np.minimum((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - r), total)  # (p, 1)
    n_tail = min(p - 1, total) if zero_bubble else 0
    end = total + int(warm.max())
    t = np.arange(end + n_tail)[None, :]

    def chunk_mb(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        g = q // per_round
        return g % v, (g // v) * per_round + q % per_round

    kind = np.full((p, end + n_tail, 3), -1, dtype=np.int64)
    stage = np.zeros_like(kind)
    mb = np.zeros_like(kind)
    fc, fj = chunk_mb(t)
    on = np.broadcast_to(t < total, (p, t.shape[1]))
    kind[..., 0][on], stage[..., 0][on], mb[..., 0][on] = 0, np.broadcast_to(fc * p + r, on.shape)[on], np.broadcast_to(fj, on.shape)[on]
    q = t - warm  # backward number at step t
    bc, bj = chunk_mb(q)
    on = (q >= 0) & (q < total)
    kind[..., 1][on], stage[..., 1][on], mb[..., 1][on] = 1, ((v - 1 - bc) * p + r)[on], bj[on]
    if zero_bubble:
        q = np.where(t < end, t - warm - r, total - np.minimum(r, total) + t - end)  # weight pass number at step t
        on = (q >= 0) & (q < total) & ((t < total + warm) | (t >= end))
        wc, wj = chunk_mb(q)
        kind[..., 2][on], stage[..., 2][on], mb[..., 2][on] = 2, ((v - 1 - wc) * p + r)[on], wj[on]
    keep = kind >= 0
    return tuple(a[keep].reshape(p, -1).T.copy() for a in (kind, stage, mb))  # type: ignore[return-value]


def _zbv(p: int, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``schedule._zbv_order`` (torch ScheduleZBVZeroBubble) of every rank at once, its loops
    counted out: rank r (stages s0 = r and s1 = 2p − 1 − r) with n = max(2p − 1, m) microbatches
    (torch's padding, dropped at the end) runs 2(p − r) − 1 forwards of s0; r pairs F(s1), F(s0);
    p − r triplets F, B, W of s1; n − p rounds of [F(s0) while any remain], B, W of s0, F, B, W of
    s1; r pairs B(s0), B(s1); p − r pairs B(s0), W(s0); the weight passes left, s1's then s0's.
    Each block is laid out for all ranks padded to its longest, the padding then dropped."""
    n = max(2 * p - 1, m)
    r = np.arange(p)
    z = 0 * r
    on = (r, 2 * p - 1 - r)  # stage of chunk 0 / 1 per rank
    blocks = [  # (rows per rank, columns (kind, chunk, first microbatch per rank)); row i adds i to the microbatch
        (2 * (p - r) - 1, [(0, 0, z)]),
        (r, [(0, 1, z), (0, 0, 2 * (p - r) - 1)]),
        (p - r, [(0, 1, r), (1, 1, z), (2, 1, z)]),
        (n - p + z, [(0, 0, 2 * p - r - 1), (1, 0, z), (2, 0, z), (0, 1, p + z), (1, 1, p - r), (2, 1, p - r)]),
        (r, [(1, 0, n - p + z), (1, 1, n - r)]),
        (p - r, [(1, 0, n - p + r), (2, 0, n - p + z)]),
        (r, [(2, 1, n - r)]),
        (r, [(2, 0, n - r)]),
    ]
    parts: list[list[np.ndarray]] = [[], [], [], []]
    for rows, cols in blocks:
        i = np.arange(int(rows.max(initial=0)))
        shape = (p, len(i), len(cols))
        parts[0].append(np.broadcast_to(np.array([k for k, _, _ in cols]), shape).reshape(p, -1))
        parts[1].append(np.broadcast_to(np.stack([on[c] for _, c, _ in cols], axis=1)[:, None, :], shape).reshape(p, -1))
        parts[2].append(np.stack([first[:, None] + i for _, _, first in cols], axis=2).reshape(p, -1))
        parts[3].append(np.broadcast_to((i < rows[:, None])[:, :, None], shape).reshape(p, -1))
    kind, stage, mb, valid = (np.concatenate(x, axis=1) for x in parts)
    keep = valid & (mb < m)  # a block's padding, torch's padding microbatches (and the fourth block's F(s0) past n)
    return tuple(a[keep].reshape(p, -1).T.astype(np.int64) for a in (kind, stage, mb))  # type: ignore[return-value]


def lockstep_times(
    key: tuple[str, int, int, int], arrays: tuple[np.ndarray, np.ndarray, np.ndarray],
    f: list[float], b_dur: list[float], bw: list[float], hop: list[float],
) -> tuple[list[float], list[float]]:
    """(rank free time, rank busy time) per pipeline rank after the step of ``key`` = (schedule,
    pp, m, v) with per-rank action orders ``arrays`` (``order_arrays(key)``): ``f``, ``b_dur`` (input backward, or full backward
    outside zero-bubble), ``bw`` per stage, ``hop`` the send time across the s | s + 1 boundary
    (0.0 within a rank)."""
    schedule, pp, m, v = key
    out, dep_ab, hop_ab, dur_i = compiled(key, arrays)
    n = pp * v
    big_n = n * m
    ends = np.full(3 * big_n + 2, np.nan)
    ends[3 * big_n] = -np.inf
    # per action: the hop after each of its two dependencies and its duration, looked up once per call
    hv_ab, durs = np.array([*hop, 0.0])[hop_ab], np.array([*f, *b_dur, *bw])[dur_i]
    free = np.zeros(pp)
    ranks = np.arange(pp)
    row = ranks.copy()  # row of every rank's next action
    # the arrays' own take methods (np.take adds two Python-level wrapper calls per use)
    at_ends, at_dep, at_hv, at_durs, at_out = ends.take, dep_ab.take, hv_ab.take, durs.take, out.take
    isnan, maximum, count_nonzero = np.isnan, np.maximum, np.count_nonzero
    while True:
        e = at_ends(at_dep(row, 0)) + at_hv(row, 0)  # each dependency's end + its hop (-inf: none)
        ready = maximum(e[:, 0], e[:, 1])  # NaN where a dependency has not ended (np.maximum keeps NaN)
        waiting = isnan(ready)
        if not count_nonzero(waiting):  # every rank runs its next action
            free = maximum(ready, free) + at_durs(row)
            ends[at_out(row)] = free
            row += pp
            continue
        ok = ~waiting
        rs = ranks[ok]
        if not len(rs):
            break
        r_ok = row[rs]
        end = maximum(ready[ok], free[rs]) + at_durs(r_ok)
        ends[at_out(r_ok)] = end
        free[rs] = end
        row[rs] += pp
    last = len(out) - pp  # the padding row
    if (row < last).any():
        stuck: dict[int, Any] = {int(r): int(row[r]) // pp for r in ranks if row[r] < last}
        raise AssertionError(f"schedule {schedule} deadlocks (p={pp}, m={m}, v={v}): ranks at action {stuck}")
    # each rank's busy time: its durations added in its order from 0.0 (a running sum adds in order)
    busy = np.cumsum(np.vstack([np.zeros((1, pp)), durs.reshape(-1, pp)[:-1]]), axis=0)[-1]
    return free.tolist(), busy.tolist()
