"""Tests of meshplan.partition.schedule: torch's action orders, timing invariants, closed forms."""

from __future__ import annotations

import itertools
import random
import types

import pytest

from meshplan.partition import schedule as sch

COMBOS = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved-1f1b", 1),
    ("interleaved-1f1b", 2),
    ("interleaved-1f1b", 3),
    ("zero-bubble", 1),
    ("zero-bubble", 2),
    ("zbv", 2),
]
PM = [(1, 2), (2, 2), (2, 4), (3, 3), (3, 6), (4, 4), (4, 5), (4, 8), (8, 16), (4, 3)]


def _valid(name: str, p: int, m: int, v: int) -> bool:
    try:
        sch.validate(name, p, m, v)
    except ValueError:
        return False
    return True


def _torch_orders(name: str, p: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """Per-rank (kind, stage, microbatch) from torch's own order generators, no process group."""
    import torch.distributed.pipelining.schedules as schedules
    if name in ("gpipe", "1f1b"):
        ns = types.SimpleNamespace(_num_stages=p, _n_microbatches=m)
        cls = schedules.ScheduleGPipe if name == "gpipe" else schedules.Schedule1F1B
        po = cls._get_pipeline_order(ns)
    elif name in ("interleaved-1f1b", "zero-bubble"):
        rounds = max(1, m // p)
        ns = types.SimpleNamespace(
            n_local_stages=v,
            pp_group_size=p,
            _n_microbatches=m,
            number_of_rounds=rounds,
            microbatches_per_round=m // rounds,
        )
        cls = (
            schedules.ScheduleInterleaved1F1B
            if name == "interleaved-1f1b"
            else schedules.ScheduleInterleavedZeroBubble
        )
        po = {r: cls._calculate_single_rank_operations(ns, r) for r in range(p)}
    else:
        ns = types.SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
        po = {r: schedules.ScheduleZBVZeroBubble._calculate_single_rank_operations(ns, r) for r in range(p)}
    kinds = {"F": "F", "B": "B", "I": "B", "W": "W"}
    return [
        [
            (kinds[a.computation_type.value], a.stage_index, a.microbatch_index)
            for a in po[r]
            if a is not None and a.computation_type.value in kinds
        ]
        for r in range(p)
    ]


@pytest.mark.parametrize(("name", "v"), COMBOS)
def test_orders_match_torch(name: str, v: int) -> None:
    checked = 0
    for p, m in PM:
        if not _valid(name, p, m, v):
            continue
        mine = [list(o) for o in sch.rank_orders(name, p, m, v)]
        theirs = _torch_orders(name, p, m, v)
        if name == "1f1b":
            # torch's Schedule1F1B._get_pipeline_order misnumbers the last rank's forwards (it is
            # only used for printing); _step_microbatches runs F x min(m, p-r), then B/F pairs.
            assert mine[:-1] == theirs[:-1]
            assert [k for k, _, _ in mine[-1]] == ["F", "B"] * m
            assert [j for _, _, j in mine[-1]] == [j for j in range(m) for _ in (0, 1)]
        else:
            assert mine == theirs, (name, p, m, v)
        checked += 1
    assert checked >= 3


@pytest.mark.parametrize(("name", "v"), COMBOS)
def test_every_action_once_and_dependencies_respected(name: str, v: int) -> None:
    rng = random.Random(0)
    checked = 0
    for p, m in PM:
        if not _valid(name, p, m, v):
            continue
        checked += 1
        n = p * v
        f = [rng.uniform(0.5, 2) for _ in range(n)]
        bi = [rng.uniform(0.5, 2) for _ in range(n)]
        bw = [rng.uniform(0.1, 1) for _ in range(n)]
        c = [rng.uniform(0, 0.3) for _ in range(n - 1)]
        t = sch.simulate(name, p, m, virtual_stages=v, fwd_s=f, bwd_input_s=bi, bwd_weight_s=bw, p2p_s=c)
        zb = name in sch.ZERO_BUBBLE
        ev = {(e.kind, e.stage, e.microbatch): e for e in t.events}
        assert len(ev) == len(t.events) == n * m * (3 if zb else 2)
        place = t.stage_to_rank
        for (kind, s, j), e in ev.items():
            assert e.rank == place[s]
            hop_f = c[s - 1] if s > 0 and place[s - 1] != place[s] else 0.0
            hop_b = c[s] if s + 1 < n and place[s + 1] != place[s] else 0.0
            if kind == "F" and s > 0:
                assert e.start_s >= ev[("F", s - 1, j)].end_s + hop_f - 1e-9
            if kind == "B":
                assert e.start_s >= ev[("F", s, j)].end_s - 1e-9
                if s + 1 < n:
                    assert e.start_s >= ev[("B", s + 1, j)].end_s + hop_b - 1e-9
                dur = bi[s] if zb else bi[s] + bw[s]
                assert e.end_s - e.start_s == pytest.approx(dur)
            if kind == "W":
                assert e.start_s >= ev[("B", s, j)].end_s - 1e-9
        for r in range(p):  # one action at a time per rank
            mine = sorted((e.start_s, e.end_s) for e in t.events if e.rank == r)
            for (_, end), (start, _) in itertools.pairwise(mine):
                assert start >= end - 1e-9
        assert t.makespan_s == pytest.approx(max(e.end_s for e in t.events))
        assert sum(t.busy_s) == pytest.approx(sum(e.end_s - e.start_s for e in t.events))
    assert checked >= 3, f"{name} v={v}: only {checked} of the (p, m) pairs are valid"


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(1, 4), (2, 4), (4, 8), (4, 4), (8, 32)])
def test_equal_stage_makespan_and_bubble(name: str, p: int, m: int) -> None:
    f, b, w = 1.0, 1.5, 0.5
    t = sch.simulate(name, p, m, fwd_s=f, bwd_input_s=b, bwd_weight_s=w)
    assert t.makespan_s == pytest.approx((m + p - 1) * (f + b + w))
    assert t.bubble_fraction == pytest.approx((p - 1) / m)
    assert t.bubble_fraction == pytest.approx(sch.bubble_fraction_formula(name, p, m))
    assert t.idle_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize(
    ("p", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 8, 4), (4, 16, 2), (8, 16, 2), (3, 9, 3)]
)
def test_interleaved_bubble(p: int, m: int, v: int) -> None:
    t = sch.simulate("interleaved-1f1b", p, m, virtual_stages=v, fwd_s=0.5, bwd_input_s=1.0, bwd_weight_s=0.0)
    assert t.bubble_fraction == pytest.approx((p - 1) / (v * m))
    assert sch.bubble_fraction_formula("interleaved-1f1b", p, m, v) == pytest.approx((p - 1) / (v * m))
    one = sch.simulate("1f1b", p, m, fwd_s=0.5 * v, bwd_input_s=1.0 * v)
    assert t.makespan_s < one.makespan_s


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (8, 16), (4, 5)])
def test_zero_bubble_beats_1f1b_when_w_positive(p: int, m: int) -> None:
    kw = dict(fwd_s=1.0, bwd_input_s=1.0, bwd_weight_s=1.0)
    zb = sch.simulate("zero-bubble", p, m, **kw)
    base = sch.simulate("1f1b", p, m, **kw)
    assert zb.makespan_s < base.makespan_s
    # ZB-H1: bubble (p-1)(F+B-W) instead of (p-1)(F+B+W)  (Qi et al. 2023)
    assert zb.makespan_s == pytest.approx(m * 3 + (p - 1) * 1)
    same = sch.simulate("zero-bubble", p, m, fwd_s=1.0, bwd_input_s=2.0, bwd_weight_s=0.0)
    assert same.makespan_s == pytest.approx(base.makespan_s)  # no W to defer: plain 1F1B
    if m >= 2 * p - 1:
        half = dict(fwd_s=0.5, bwd_input_s=0.5, bwd_weight_s=0.5)
        zbv = sch.simulate("zbv", p, m, virtual_stages=2, **half)
        assert zbv.makespan_s < base.makespan_s
        assert zbv.bubble_fraction < zb.bubble_fraction


def test_inflight_counts() -> None:
    p, m = 4, 8
    one = sch.simulate("1f1b", p, m, fwd_s=1, bwd_input_s=2)
    assert one.peak_inflight == tuple(p - i for i in range(p))
    assert sch.simulate("gpipe", p, m, fwd_s=1, bwd_input_s=2).peak_inflight == (m,) * p
    assert sch.simulate("zero-bubble", p, m, fwd_s=1, bwd_input_s=1, bwd_weight_s=1).peak_inflight == (
        4,
        3,
        2,
        1,
    )
    # interleaved rank 0 holds p(1 + (p-1)/(p v)) full-stage activations = 2 v p (1 + ...) chunks / v
    inter = sch.simulate("interleaved-1f1b", p, m, virtual_stages=2, fwd_s=1, bwd_input_s=2)
    assert inter.peak_inflight[0] / 2 == pytest.approx(p * (1 + (p - 1) / (p * 2)))
    assert sum(inter.stage_peak_inflight[s] for s in (0, p)) >= inter.peak_inflight[0]
    zbv = sch.simulate("zbv", p, m, virtual_stages=2, fwd_s=1, bwd_input_s=1, bwd_weight_s=1)
    assert zbv.peak_inflight == (2 * p,) * p
    assert zbv.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)


def test_held_states_count_the_deferred_weight_passes() -> None:
    """Zero-bubble ranks keep a microbatch's graph from its input backward to its weight pass:
    rank r of ZB-H1 runs r backwards before its first weight pass, so every rank holds p
    microbatches (in flight + waiting), where 1F1B's rank r holds p - r and nothing waits."""
    p, m = 4, 8
    one = sch.held_states("1f1b", p, m)
    assert [max(s.inflight for s in st) for st in one] == [p - r for r in range(p)]
    assert all(s.pending == 0 for st in one for s in st)
    zb = sch.held_states("zero-bubble", p, m)
    assert [max(s.inflight + s.pending for s in st) for st in zb] == [p] * p
    assert [max(s.pending for s in st) for st in zb] == [r + 1 for r in range(p)]  # r waiting + the one just done
    assert [max(s.inflight for s in st) for st in zb] == list(sch.inflight("zero-bubble", p, m)[0])
    # zbv: the last rank's cool-down runs input backwards of both chunks before their weight passes
    v = sch.held_states("zbv", 2, 4, 2)
    assert max(s.pending for s in v[1]) > max(s.pending for s in v[0])


def _held_by_walking(name: str, p: int, m: int, v: int) -> tuple[tuple[sch.HeldState, ...], ...]:
    """The reference of ``held_states``: each rank's order walked one action at a time, every
    (in_backward, inflight, pending) state seen, the distinct points no other of the same flag
    matches or beats in both counts kept, sorted."""
    split_w = name in sch.ZERO_BUBBLE
    out = []
    for ops in sch.rank_orders(name, p, m, v):
        live = pend = 0
        seen: set[tuple[bool, int, int]] = set()
        for kind, _, _ in ops:
            if kind == "B":
                seen.add((True, live, pend))
                live -= 1
                pend += split_w
            elif kind == "F":
                live += 1
            else:
                pend -= 1
            seen.add((False, live, pend))
        front = [x for x in seen if not any(y != x and y[0] == x[0] and y[1] >= x[1] and y[2] >= x[2] for y in seen)]
        out.append(tuple(sch.HeldState(a / v, w / v, b) for b, a, w in sorted(front)))
    return tuple(out)


@pytest.mark.parametrize(("name", "v"), COMBOS)
def test_held_states_equal_the_walked_pareto_front(name: str, v: int) -> None:
    """``held_states`` (running sums over the numpy orders, a suffix maximum per inflight count)
    equals walking each rank's Python order; ``held_peaks`` (numpy over all states) equals the
    Python max over the states bit for bit, and ``held_counts`` the largest inflight + pending."""
    rng = random.Random(11)
    n = 0
    for p in (1, 2, 3, 4, 5, 8):
        for m in (*range(1, 3 * p + 2), 4 * p + 3):
            if not _valid(name, p, m, v):
                continue
            got = sch.held_states(name, p, m, v)
            assert got == _held_by_walking(name, p, m, v), (name, p, m, v)
            act = [rng.uniform(0, 1e9) for _ in range(p)]
            kept = [rng.choice([0.0, rng.uniform(-2e9, 3e9)]) for _ in range(p)]
            trans = [rng.uniform(0, 5e8) for _ in range(p)]
            pend_b = [max(0.0, a + k) for a, k in zip(act, kept)]
            ref = [max(s.inflight * a + s.pending * k + (t if s.in_backward else 0.0) for s in st)
                   for st, a, k, t in zip(got, act, pend_b, trans)]  # fmt: skip
            fast = sch.held_peaks(name, p, m, v, act, pend_b, trans)
            assert fast == ref and all(type(x) is float for x in fast), (name, p, m, v)
            assert sch.held_counts(name, p, m, v) == tuple(max(s.inflight + s.pending for s in st) for st in got)
            n += 1
    assert n > 5


@pytest.mark.parametrize(("name", "v"), [c for c in COMBOS if c[0] != "zbv"])
def test_fast_makespan_equals_simulator(name: str, v: int) -> None:
    checked = 0
    for (p, m), (f, b, w, c) in itertools.product(
        PM, [(1, 1, 1, 0), (1, 2, 0.5, 0), (0.3, 0.9, 0.2, 0), (1, 1, 1, 0.2), (1, 2, 0.5, 0.05)]
    ):
        if not _valid(name, p, m, v):
            continue
        kw = dict(virtual_stages=v, fwd_s=f, bwd_input_s=b, bwd_weight_s=w, p2p_s=c)
        assert sch.fast_makespan(name, p, m, **kw) == pytest.approx(sch.simulate(name, p, m, **kw).makespan_s)
        checked += 1
    assert checked >= 15, f"{name} v={v}: only {checked} valid cases"


def test_validation_errors() -> None:
    with pytest.raises(ValueError, match="unknown schedule"):
        sch.simulate("dualpipe", 2, 4, fwd_s=1, bwd_input_s=1)
    with pytest.raises(ValueError, match="divisible by pp"):
        sch.simulate("interleaved-1f1b", 4, 6, virtual_stages=2, fwd_s=1, bwd_input_s=1)
    with pytest.raises(ValueError, match="virtual_stages=2"):
        sch.simulate("zbv", 4, 8, virtual_stages=3, fwd_s=1, bwd_input_s=1)
    with pytest.raises(ValueError, match="m=2 < pp=4"):
        sch.simulate("1f1b", 4, 2, fwd_s=1, bwd_input_s=1)
    with pytest.raises(ValueError, match="one stage per rank"):
        sch.simulate("gpipe", 4, 8, virtual_stages=2, fwd_s=1, bwd_input_s=1)
    with pytest.raises(ValueError, match="expected pp\\*virtual_stages = 4"):
        sch.simulate("1f1b", 4, 8, fwd_s=[1, 1], bwd_input_s=1)
    with pytest.raises(ValueError, match=">= 0"):
        sch.simulate("1f1b", 2, 8, fwd_s=[1, -1], bwd_input_s=1)
    with pytest.raises(ValueError, match="no closed-form"):
        sch.bubble_fraction_formula("zbv", 2, 4, 2)
