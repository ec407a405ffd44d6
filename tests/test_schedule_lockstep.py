"""The numpy lock-step simulator (``partition.schedule_lockstep``) against the event simulator:
the same action orders as ``schedule.rank_orders`` and bit-identical makespans and busy times."""

from __future__ import annotations

import random

import pytest
from test_schedule import _valid

from meshplan.partition import schedule as sch
from meshplan.partition import schedule_lockstep as ls


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv"])
def test_numpy_orders_equal_rank_orders(name: str) -> None:
    n = 0
    for v in (1, 2, 3):
        for p in (1, 2, 3, 5, 8):
            for m in (*range(1, 3 * p + 2), 4 * p + 3):
                if not _valid(name, p, m, v):
                    continue
                kind, stage, mb = ls.order_arrays((name, p, m, v))
                assert kind.shape == stage.shape == mb.shape == (len(sch.rank_orders(name, p, m, v)[0]), p)
                for r, ref in enumerate(sch.rank_orders(name, p, m, v)):
                    got = [("FBW"[k], s, j) for k, s, j in zip(kind[:, r].tolist(), stage[:, r].tolist(), mb[:, r].tolist())]
                    assert got == list(ref), (name, p, m, v, r)
                n += 1
    assert n > 20


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3),
                                    ("zero-bubble", 1), ("zero-bubble", 2), ("zbv", 2)])  # fmt: skip
def test_lockstep_times_equal_event_simulation_bit_for_bit(name: str, v: int) -> None:
    rng = random.Random(7)
    n = 0
    for p in (ls.MIN_RANKS, 7, 8, 12):
        for m in (p, 2 * p, 3 * p + 1, 4 * p):
            if not _valid(name, p, m, v):
                continue
            k = p * v
            times = {
                "fwd_s": [rng.uniform(0.1, 2) for _ in range(k)],
                "bwd_input_s": [rng.uniform(0.1, 3) for _ in range(k)],
                "bwd_weight_s": [rng.uniform(0, 1) for _ in range(k)],
                "p2p_s": [rng.choice([0.0, rng.uniform(0, 0.5)]) for _ in range(k)],
            }
            ev = sch.simulate(name, p, m, virtual_stages=v, keep_events=True, **times)
            fast = sch.simulate(name, p, m, virtual_stages=v, keep_events=False, **times)
            assert (fast.makespan_s, fast.busy_s, fast.bubble_fraction) == (ev.makespan_s, ev.busy_s, ev.bubble_fraction)
            assert fast.peak_inflight == ev.peak_inflight and not fast.events
            n += 1
    assert n >= 3


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv"])
def test_inflight_counts_equal_the_action_by_action_count(name: str) -> None:
    """``schedule.inflight`` (numpy running sums over ``order_arrays`` but for zbv) equals walking the
    Python action orders one action at a time (``inflight_of_orders``)."""
    n = 0
    for v in (1, 2, 3):
        for p in (1, 2, 3, 5, 8):
            for m in (*range(1, 3 * p + 2), 4 * p + 3):
                if not _valid(name, p, m, v):
                    continue
                sch.inflight.cache_clear()
                assert sch.inflight(name, p, m, v) == sch.inflight_of_orders(sch.rank_orders(name, p, m, v), p * v), (name, p, m, v)
                n += 1
    assert n > 10


def _held_by_walking(orders: tuple, stage_bytes: list[float]) -> list[float]:
    """The reference of ``rank_held_peaks``: each rank's order walked one action at a time."""
    out = []
    for ops in orders:
        live = peak = 0.0
        for kind, s, _ in ops:
            live += stage_bytes[s] if kind == "F" else -stage_bytes[s] if kind == "B" else 0.0
            peak = max(peak, live)
        out.append(peak)
    return out


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zero-bubble", "zbv"])
def test_held_peaks_weight_each_stage_by_its_own_count_over_the_rank_order(name: str) -> None:
    """``schedule.rank_held_peaks`` (numpy running sums) equals walking the orders with each
    stage's bytes; with equal bytes it is ``inflight`` x the bytes."""
    rng = random.Random(3)
    n = 0
    for v in (1, 2, 3):
        for p in (2, 3, 8):
            for m in (p, 2 * p, 3 * p + 1):
                if not _valid(name, p, m, v):
                    continue
                w = [rng.uniform(0.5, 3.0) for _ in range(p * v)]
                got = sch.rank_held_peaks(name, p, m, v, tuple(w))
                assert got == pytest.approx(_held_by_walking(sch.rank_orders(name, p, m, v), w)), (name, p, m, v)
                flat = sch.rank_held_peaks(name, p, m, v, (2.0,) * (p * v))
                assert flat == pytest.approx(tuple(2.0 * x for x in sch.inflight(name, p, m, v)[0]))
                n += 1
    assert n >= 4


def test_interleaved_last_rank_holds_its_first_chunk_m_times_and_its_last_once() -> None:
    """torch's ScheduleInterleaved1F1B with m = p = 8, v = 2: the last rank runs all 8 forwards of
    stage 7 in its warm-up, then stage 15 (the logits) one microbatch at a time; a mean in-flight
    count over its two chunks (4.5) would charge the logits 4.5 times."""
    w = [1.0] * 16
    w[15] = 10.0  # the last stage: the loss's fp32 log-softmax beside its layers
    held = sch.rank_held_peaks("interleaved-1f1b", 8, 8, 2, tuple(w))
    assert held[7] == pytest.approx(8 * 1.0 + 1 * 10.0)
    assert sch.inflight("interleaved-1f1b", 8, 8, 2)[1][7::8] == (8, 1)
