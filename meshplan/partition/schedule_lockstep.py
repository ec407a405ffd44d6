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


def compiled(key: tuple[str, int, int, int], orders: Sequence[Sequence[Action]] | None) -> tuple[np.ndarray, ...]:
    """(out, dep_a, dep_b slots; hop_a, hop_b, duration indices) of every action, flat arrays
    indexed by step · pp + rank (with a padding step at the end), of the
    per-rank orders of ``key`` = (schedule, pp, m, v) (``order_arrays``; ``orders`` needed for
    zbv only); see the module docstring."""
    if key not in _compiled:
        if len(_compiled) >= _CACHE_SIZE:
            del _compiled[next(iter(_compiled))]
        _compiled[key] = _compile(key, orders)
    return _compiled[key]


def _compile(key: tuple[str, int, int, int], orders: Sequence[Sequence[Action]] | None) -> tuple[np.ndarray, ...]:
    _, pp, m, v = key
    n = pp * v
    big_n = n * m
    neg, nan = 3 * big_n, 3 * big_n + 1
    kind, stage, mb = order_arrays(key, orders)
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
    # flat: row = step · pp + rank
    return out.ravel(), dep_a.ravel(), dep_b.ravel(), hop_a.ravel(), hop_b.ravel(), dur.ravel()


def order_arrays(
    key: tuple[str, int, int, int], orders: Sequence[Sequence[Action]] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kind, stage, microbatch) of every rank's actions, shape (actions per rank, pp), kind
    0 F, 1 B, 2 W: ``schedule.rank_orders`` generated with numpy for gpipe, 1f1b and the looped
    schedules (interleaved-1f1b, zero-bubble; the same rules, see ``_looped``), else read from
    ``orders`` (zbv)."""
    schedule, p, m, v = key
    if schedule == "gpipe":
        cols = [_gpipe(m, r) for r in range(p)]
    elif schedule == "1f1b":
        cols = [_1f1b(p, m, r) for r in range(p)]
    elif schedule in ("interleaved-1f1b", "zero-bubble"):
        cols = [_looped(p, m, v, r, schedule == "zero-bubble") for r in range(p)]
    else:
        if orders is None:
            raise ValueError(f"order_arrays needs the {schedule} orders")
        code = {"F": 0, "B": 1, "W": 2}
        cols = [(np.array([code[a[0]] for a in ops]), np.array([a[1] for a in ops]), np.array([a[2] for a in ops]))
                for ops in orders]  # fmt: skip
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


def weighted_peaks_from_orders(
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray], stage_bytes: Sequence[float]
) -> tuple[float, ...]:
    """Per rank, the largest running sum over its action order of ``stage_bytes[stage]`` added
    by a forward and taken off by the input backward that frees it (0 before any action):
    what a rank holds at its peak when its stages keep different bytes per microbatch
    (``schedule.rank_held_peaks``)."""
    kind, stage, _ = arrays
    delta = (kind == 0).astype(np.float64) - (kind == 1)
    held = np.cumsum(delta * np.asarray(stage_bytes, dtype=np.float64)[stage], axis=0)
    return tuple(float(x) for x in np.maximum(held.max(axis=0, initial=0.0), 0.0))


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


def _looped(p: int, m: int, v: int, r: int, zero_bubble: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``schedule._looped_order`` (torch ``_get_1f1b_rank_ops``): at step t the forward of step t
    (t < v·m), then from the warm-up on the backward of step t − warm, and under zero-bubble from
    the r-th backward on the weight pass of backward number (t − warm − r); the remaining weight
    passes at the end. Steps run in groups of ``per_round`` per chunk: step t's chunk is
    (t // per_round) % v (backwards: reversed), its microbatch (t // (per_round·v))·per_round + t % per_round."""
    rounds = max(1, m // p)
    per_round = m // rounds
    total = v * m
    warm = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - r), total)
    steps = np.arange(total + warm)
    t_b = np.arange(total)  # backward number

    def chunk_mb(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        g = t // per_round
        return g % v, (g // v) * per_round + t % per_round

    fc, fj = chunk_mb(steps[:total])
    bc, bj = chunk_mb(t_b)
    b_stage, f_stage = (v - 1 - bc) * p + r, fc * p + r
    kind = np.full((len(steps), 3), -1)
    stage = np.zeros((len(steps), 3), dtype=np.int64)
    mb = np.zeros((len(steps), 3), dtype=np.int64)
    kind[:total, 0], stage[:total, 0], mb[:total, 0] = 0, f_stage, fj
    kind[warm:, 1], stage[warm:, 1], mb[warm:, 1] = 1, b_stage, bj
    tail = (np.zeros(0, int),) * 3
    if zero_bubble:
        w_at = warm + r + np.arange(max(0, total - r))  # steps at which weight pass q = step - warm - r runs
        q = w_at - warm - r
        kind[w_at, 2], stage[w_at, 2], mb[w_at, 2] = 2, b_stage[q], bj[q]
        rest = np.arange(max(0, total - r), total)
        tail = (np.full(len(rest), 2), b_stage[rest], bj[rest])
    keep = kind.ravel() >= 0
    return tuple(np.concatenate([a.ravel()[keep], t]) for a, t in zip((kind, stage, mb), tail))  # type: ignore[return-value]


def lockstep_times(
    key: tuple[str, int, int, int], orders: Sequence[Sequence[Action]] | None,
    f: list[float], b_dur: list[float], bw: list[float], hop: list[float],
) -> tuple[list[float], list[float]]:
    """(rank free time, rank busy time) per pipeline rank after the step of ``key`` = (schedule,
    pp, m, v) with per-rank action ``orders``: ``f``, ``b_dur`` (input backward, or full backward
    outside zero-bubble), ``bw`` per stage, ``hop`` the send time across the s | s + 1 boundary
    (0.0 within a rank)."""
    schedule, pp, m, v = key
    out, dep_a, dep_b, hop_a, hop_b, dur_i = compiled(key, orders)
    n = pp * v
    big_n = n * m
    ends = np.full(3 * big_n + 2, np.nan)
    ends[3 * big_n] = -np.inf
    hops = np.array([*hop, 0.0])
    # per action: the hop after each dependency and the duration, looked up once per call
    hv_a, hv_b, durs = hops[hop_a], hops[hop_b], np.array([*f, *b_dur, *bw])[dur_i]
    free = np.zeros(pp)
    busy = np.zeros(pp)
    ranks = np.arange(pp)
    row = ranks.copy()  # row of every rank's next action
    # the arrays' own take methods (np.take adds two Python-level wrapper calls per use)
    at_ends, at_dep_a, at_dep_b, at_durs = ends.take, dep_a.take, dep_b.take, durs.take
    at_hv_a, at_hv_b, at_out = hv_a.take, hv_b.take, out.take
    isnan, maximum = np.isnan, np.maximum
    while True:
        ea, eb = at_ends(at_dep_a(row)), at_ends(at_dep_b(row))
        ok = ~isnan(ea + eb)  # both dependencies have ended (-inf: no such dependency)
        if ok.all():  # every rank runs its next action
            d = at_durs(row)
            end = maximum(maximum(ea + at_hv_a(row), eb + at_hv_b(row)), free) + d
            ends[at_out(row)] = end
            free = end
            busy += d
            row += pp
            continue
        rs = ranks[ok]
        if not len(rs):
            break
        r_ok = row[rs]
        d = at_durs(r_ok)
        end = maximum(maximum(ea[ok] + at_hv_a(r_ok), eb[ok] + at_hv_b(r_ok)), free[rs]) + d
        ends[at_out(r_ok)] = end
        free[rs] = end
        busy[rs] += d
        row[rs] += pp
    last = len(out) - pp  # the padding row
    if (row < last).any():
        stuck: dict[int, Any] = {int(r): int(row[r]) // pp for r in ranks if row[r] < last}
        raise AssertionError(f"schedule {schedule} deadlocks (p={pp}, m={m}, v={v}): ranks at action {stuck}")
    return free.tolist(), busy.tolist()
