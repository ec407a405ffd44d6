"""Tests of meshplan.partition.stage_ilp: ILP, exact DP and fallback against hand answers and brute force."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest

from meshplan import ilp
from meshplan.errors import NoFeasiblePlanError
from meshplan.partition import stage_dp as sd
from meshplan.partition import stage_ilp as si
from meshplan.partition import stage_problem as sp

GIB = 1 << 30


def _uniform(n: int, **kw: float) -> list[si.Layer]:
    return [si.Layer(f"block{i}", fwd_s=1.0, bwd_s=2.0, **kw) for i in range(n)]


def _brute(layers, *, pp, m, schedule="1f1b", v=1, limit=None, p2p_time=None):  # noqa: ANN001, ANN202
    """Best objective over every contiguous split (None if nothing fits)."""
    pr = sp.make_problem(layers, pp, m, schedule, v, limit, p2p_time, 0)
    best = None
    for cuts in itertools.combinations(range(1, len(layers)), pr.n - 1):
        bounds = [0, *cuts, len(layers)]
        obj, _, mem = sp.evaluate_split(pr, bounds)
        if max(mem) <= pr.limit_bytes and (best is None or obj < best):
            best = obj
    return best


@pytest.mark.parametrize("method", ["dp", "ilp"])
def test_uniform_layers_split_evenly(method: str) -> None:
    out = si.split_stages(_uniform(8), pp=4, num_microbatches=8, method=method)
    assert out.boundaries == (0, 2, 4, 6, 8)
    assert out.rank_time_s == (6.0, 6.0, 6.0, 6.0)
    # (m - 1) T + sum t = 7 * 6 + 24 = (m + p - 1) * 6, as the simulator gives for equal stages
    assert out.objective_s == pytest.approx(66.0)
    assert out.method == method and out.status in ("optimal", "exact")


def test_uniform_interleaved_and_zbv_split_evenly() -> None:
    inter = si.split_stages(
        _uniform(16), pp=4, num_microbatches=8, schedule="interleaved-1f1b", virtual_stages=2
    )
    assert inter.ranges == tuple((2 * i, 2 * i + 2) for i in range(8))
    assert inter.stage_to_rank == (0, 1, 2, 3, 0, 1, 2, 3)
    assert inter.objective_s == pytest.approx((8 * 2 + 4 - 1) * 6.0)  # (v m + p - 1) t_chunk
    zbv = si.split_stages(_uniform(8), pp=2, num_microbatches=4, schedule="zbv", virtual_stages=2)
    assert zbv.boundaries == (0, 2, 4, 6, 8) and zbv.stage_to_rank == (0, 1, 1, 0)


@pytest.mark.parametrize("method", ["dp", "ilp"])
def test_heavy_layer_gets_its_own_stage(method: str) -> None:
    layers = _uniform(8)
    layers[3] = si.Layer("heavy", fwd_s=4.0, bwd_s=8.0)
    out = si.split_stages(layers, pp=4, num_microbatches=8, method=method)
    assert (3, 4) in out.ranges
    assert max(out.rank_time_s) == pytest.approx(12.0)


def test_embedding_and_head_weights_count_in_memory() -> None:
    emb = si.Layer("embed", fwd_s=0.1, bwd_s=0.2, state_bytes=8 * GIB)
    head = si.Layer("head", fwd_s=0.1, bwd_s=0.2, state_bytes=6 * GIB)
    blocks = [si.Layer(f"b{i}", fwd_s=1.0, bwd_s=2.0, state_bytes=GIB, act_bytes=GIB // 4) for i in range(6)]
    layers = [emb, *blocks, head]
    free = si.split_stages(layers, pp=2, num_microbatches=4)
    assert free.boundaries == (0, 4, 8)
    # rank 0: embed 8 + 3 blocks x (1 + 2 in flight x 0.25) = 12.5 GiB; rank 1: 3 x (1 + 0.25) + 6
    assert free.rank_mem_bytes == (int(12.5 * GIB), int(9.75 * GIB))
    assert free.stage_inflight == (2, 1)
    tight = si.split_stages(layers, pp=2, num_microbatches=4, mem_limit_bytes=12 * GIB)
    assert tight.boundaries == (0, 3, 8)  # one block moves off the embedding's rank: 11 and 11 GiB
    assert max(tight.rank_mem_bytes) <= 12 * GIB
    assert tight.objective_s > free.objective_s
    for method in ("dp", "ilp"):
        with pytest.raises(NoFeasiblePlanError, match=r"10\.500 GiB.*11\.000 GiB") as err:
            si.split_stages(layers, pp=2, num_microbatches=4, mem_limit_bytes=10.5 * GIB, method=method)
        assert "deeper pipeline" in str(err.value)


def test_deeper_pipeline_helps_memory() -> None:
    layers = [si.Layer(f"b{i}", fwd_s=1.0, bwd_s=2.0, state_bytes=4 * GIB) for i in range(8)]
    with pytest.raises(NoFeasiblePlanError):
        si.split_stages(layers, pp=2, num_microbatches=8, mem_limit_bytes=10 * GIB)
    out = si.split_stages(layers, pp=4, num_microbatches=8, mem_limit_bytes=10 * GIB)
    assert max(out.rank_mem_bytes) == 8 * GIB


CASES = [
    ("1f1b", 1, 3),
    ("gpipe", 1, 2),
    ("interleaved-1f1b", 2, 2),
    ("zero-bubble", 1, 3),
    ("zero-bubble", 2, 2),
    ("zbv", 2, 2),
]


@pytest.mark.parametrize(("schedule", "v", "pp"), CASES)
def test_ilp_and_dp_equal_brute_force(schedule: str, v: int, pp: int) -> None:
    rng = random.Random(f"{schedule}-{v}-{pp}")

    def p2p(nbytes: int) -> float:
        return nbytes * 1e-3

    for trial in range(4):
        n_layers = pp * v + rng.randint(1, 4)
        layers = [
            si.Layer(
                f"l{i}",
                fwd_s=rng.choice([1.0, 2.0, 3.0]),
                bwd_s=rng.choice([2.0, 4.0, 6.0]),
                bwd_weight_s=1.0,
                state_bytes=rng.randint(1, 4) * GIB,
                act_bytes=rng.randint(0, 2) * GIB // 8,
                boundary_bytes=rng.choice([0, 500, 2000]),
            )
            for i in range(n_layers)
        ]
        limit = None if trial % 2 == 0 else 7.5 * GIB * v
        m = 2 * pp
        want = _brute(layers, pp=pp, m=m, schedule=schedule, v=v, limit=limit, p2p_time=p2p)
        kw = dict(
            pp=pp,
            num_microbatches=m,
            schedule=schedule,
            virtual_stages=v,
            mem_limit_bytes=limit,
            p2p_time=p2p,
        )
        if want is None:
            with pytest.raises(NoFeasiblePlanError):
                si.split_stages(layers, method="ilp", **kw)
            continue
        got = si.split_stages(layers, method="ilp", **kw)
        assert got.objective_s == pytest.approx(want, rel=1e-6)
        if v == 1:
            dp = si.split_stages(layers, method="dp", **kw)
            assert dp.objective_s == pytest.approx(want, rel=1e-9)
            assert dp.status == "exact"


def test_skip_tensor_charged_at_every_boundary_it_crosses() -> None:
    # layer i -> i+1 carries 100 bytes; a skip tensor from layer 0 to layer 5 carries 1000 bytes
    edges = [(i, i + 1, 100) for i in range(5)] + [(0, 5, 1000)]
    bb = si.boundary_bytes_from_edges(6, edges)
    assert bb == [1100, 1100, 1100, 1100, 1100, 0]
    layers = [si.Layer(f"l{i}", fwd_s=1.0, bwd_s=2.0, boundary_bytes=b) for i, b in enumerate(bb)]
    out = si.split_stages(layers, pp=3, num_microbatches=6, p2p_time=lambda nb: nb * 1e-4, method="ilp")
    assert out.stage_send_bytes == (1100, 1100, 0)
    assert out.stage_send_s == pytest.approx((0.11, 0.11, 0.0))
    # objective = (m - 1) T + sum t + 2 * (two cuts x 0.11 s)
    assert out.objective_s == pytest.approx(5 * 6.0 + 18.0 + 2 * 0.22)
    with pytest.raises(ValueError, match="must go forward"):
        si.boundary_bytes_from_edges(3, [(2, 1, 5)])


def test_p2p_cost_moves_the_cut_to_a_cheap_boundary() -> None:
    # equal layers; cutting after layer 0 or 1 is expensive, after layer 2 free
    layers = [
        si.Layer(f"l{i}", fwd_s=1.0, bwd_s=1.0, boundary_bytes=b)
        for i, b in enumerate([10_000, 10_000, 0, 0])
    ]
    cheap = si.split_stages(layers, pp=2, num_microbatches=2, p2p_time=lambda nb: nb * 1e-3, method="dp")
    assert cheap.boundaries == (0, 3, 4)  # T grows by 2 (x (m-1) = 2) but saves 2 x 10 s of p2p
    assert cheap.objective_s == pytest.approx(1 * 6.0 + 8.0)
    for method in ("ilp", "dp"):
        out = si.split_stages(layers, pp=2, num_microbatches=2, p2p_time=lambda nb: nb * 1e-3, method=method)
        assert out.boundaries == cheap.boundaries


def test_solver_failure_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*a: object, **k: object) -> ilp.SolveResult:
        raise ilp.SolverFailedError("no solver")

    monkeypatch.setattr(si.ilp, "solve", broken)
    out = si.split_stages(_uniform(8), pp=4, num_microbatches=8, method="ilp")
    assert out.method == "dp" and out.boundaries == (0, 2, 4, 6, 8)
    inter = si.split_stages(
        _uniform(8), pp=2, num_microbatches=4, schedule="interleaved-1f1b", virtual_stages=2
    )
    assert inter.method == "dp" and inter.boundaries == (0, 2, 4, 6, 8)


def test_greedy_split_is_contiguous_and_balanced() -> None:
    pr = sp.make_problem(_uniform(10), 4, 8, "1f1b", 1, None, None, 0)
    bounds = sd.greedy_split(pr)
    assert bounds[0] == 0 and bounds[-1] == 10 and all(b > a for a, b in itertools.pairwise(bounds))
    assert len(bounds) == 5


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="cannot fill"):
        si.split_stages(_uniform(3), pp=4, num_microbatches=8)
    with pytest.raises(ValueError, match="method"):
        si.split_stages(_uniform(8), pp=4, num_microbatches=8, method="magic")
    with pytest.raises(ValueError, match="bwd_weight_s <= bwd_s"):
        si.Layer("x", fwd_s=1.0, bwd_s=1.0, bwd_weight_s=2.0)
    with pytest.raises(ValueError, match="divisible by pp"):
        si.split_stages(_uniform(8), pp=4, num_microbatches=6, schedule="interleaved-1f1b", virtual_stages=2)
    assert math.isinf(sp.make_problem(_uniform(4), 2, 2, "1f1b", 1, None, None, 0).limit_bytes)


@pytest.mark.parametrize(
    ("schedule", "v", "pp", "m"),
    [
        ("gpipe", 1, 4, 8),
        ("1f1b", 1, 4, 8),
        ("interleaved-1f1b", 2, 4, 8),
        ("zero-bubble", 1, 4, 8),
        ("zero-bubble", 2, 2, 4),
        ("zbv", 2, 2, 4),
    ],
)
def test_objective_equals_simulated_step_for_equal_stages(schedule: str, v: int, pp: int, m: int) -> None:
    layers = [si.Layer(f"b{i}", fwd_s=1.0, bwd_s=2.0, bwd_weight_s=1.0) for i in range(2 * pp * v)]
    out = si.split_stages(layers, pp=pp, num_microbatches=m, schedule=schedule, virtual_stages=v)
    assert out.boundaries == tuple(range(0, 2 * pp * v + 1, 2))
    assert out.timeline().makespan_s == pytest.approx(out.objective_s)
    assert out.schedule == schedule and out.num_microbatches == m and out.virtual_stages == v


@pytest.mark.parametrize(
    ("schedule", "v"), [("1f1b", 1), ("zero-bubble", 1), ("interleaved-1f1b", 2), ("zbv", 2)]
)
def test_ilp_objective_is_the_documented_formula(schedule: str, v: int) -> None:
    rng = random.Random(7)
    layers = [
        si.Layer(
            f"l{i}", fwd_s=rng.uniform(1, 3), bwd_s=4.0, bwd_weight_s=1.5, boundary_bytes=rng.choice([0, 900])
        )
        for i in range(2 * v + 3)
    ]
    pr = sp.make_problem(layers, 2, 4, schedule, v, None, lambda nb: nb * 1e-3, 0)
    model = si.StageSplitILP(pr).build()
    assert set(ilp.constraint_families(model.problem)) >= {
        "assignment",
        "contiguity",
        "nonempty",
        "bottleneck",
    }
    res = ilp.solve(model.problem, time_limit_s=5, gap_rel=0.0)
    assert res.objective == pytest.approx(sp.evaluate_split(pr, model.boundaries())[0])


def test_edge_cases() -> None:
    one = si.split_stages(_uniform(3), pp=1, num_microbatches=4, method="ilp")
    assert one.boundaries == (0, 3) and one.objective_s == pytest.approx(4 * 9.0)
    exact = si.split_stages(_uniform(4), pp=4, num_microbatches=4, method="ilp")
    assert exact.boundaries == (0, 1, 2, 3, 4)
    zero = si.split_stages(
        [si.Layer(f"z{i}", fwd_s=0.0, bwd_s=0.0) for i in range(4)], pp=2, num_microbatches=2
    )
    assert zero.objective_s == 0.0 and len(zero.boundaries) == 3


def test_one_microbatch_dp_has_no_division_by_zero() -> None:
    # m = 1 (gpipe; 1f1b needs m >= pp): the bottleneck term (m - 1)·T vanishes, only the cuts count
    schedule = "gpipe"
    layers = [
        si.Layer(f"l{i}", fwd_s=t, bwd_s=2 * t, boundary_bytes=b, state_bytes=GIB)
        for i, (t, b) in enumerate([(1.0, 500), (1.0, 0), (3.0, 800), (1.0, 900)])
    ]
    kw = dict(pp=2, num_microbatches=1, schedule=schedule, p2p_time=lambda nb: nb * 1e-3)
    want = _brute(layers, pp=2, m=1, schedule=schedule, p2p_time=kw["p2p_time"])
    for method in ("dp", "ilp"):
        got = si.split_stages(layers, method=method, **kw)
        assert got.objective_s == pytest.approx(want, rel=1e-9)
    assert si.split_stages(layers, method="dp", **kw).boundaries == (0, 2, 4)  # the free cut
    limited = si.split_stages(layers, method="dp", mem_limit_bytes=2.5 * GIB, **kw)
    assert all(m <= 2.5 * GIB for m in limited.rank_mem_bytes)


def _interleaved_problem() -> tuple[list[si.Layer], dict[str, object]]:
    """34 uneven layers on pp 2 x v 2: HiGHS's root node does not prove this split optimal."""
    rng = random.Random(0)
    layers = [
        si.Layer(f"l{i}", fwd_s=rng.uniform(1, 3), bwd_s=rng.uniform(2, 6), bwd_weight_s=0.5, state_bytes=GIB,
                 act_bytes=GIB // 8, boundary_bytes=rng.choice([0, 500, 2000]))  # fmt: skip
        for i in range(34)
    ]
    return layers, dict(pp=2, num_microbatches=8, schedule="interleaved-1f1b", virtual_stages=2,
                        p2p_time=lambda nb: nb * 1e-4, method="ilp")  # fmt: skip


def test_node_limit_stops_at_one_answer_and_says_so() -> None:
    layers, kw = _interleaved_problem()
    dp = sd.dp_split(sp.make_problem(layers, 2, 8, "interleaved-1f1b", 2, None, kw["p2p_time"], 0))
    assert dp is not None
    first = si.split_stages(layers, node_limit=1, time_limit_s=60, **kw)  # type: ignore[arg-type]
    # pulp 3.3 has no mapping for HiGHS's node-limit stop: read by meshplan.ilp, not a CBC fallback
    assert first.method == "ilp" and first.solver == "highs"
    assert first.status == "feasible at its 1-node limit"
    again = si.split_stages(layers, node_limit=1, time_limit_s=60, **kw)  # type: ignore[arg-type]
    assert (again.boundaries, again.status, again.objective_s) == (first.boundaries, first.status, first.objective_s)
    assert first.objective_s <= sp.evaluate_split(sp.make_problem(layers, 2, 8, "interleaved-1f1b", 2, None,
                                                                  kw["p2p_time"], 0), dp[0])[0] + 1e-9  # fmt: skip
    proven = si.split_stages(layers, time_limit_s=60, **kw)  # type: ignore[arg-type]
    assert proven.status == "optimal" and proven.objective_s <= first.objective_s + 1e-9


def test_wall_clock_stop_keeps_the_dp_split(monkeypatch: pytest.MonkeyPatch) -> None:
    layers, kw = _interleaved_problem()
    pr = sp.make_problem(layers, 2, 8, "interleaved-1f1b", 2, None, kw["p2p_time"], 0)
    dp = sd.dp_split(pr)
    assert dp is not None
    # a real solve stopped by a wall-clock cap far below what it needs
    tiny = si.split_stages(layers, time_limit_s=1e-6, node_limit=100, **kw)  # type: ignore[arg-type]
    assert tiny.method == "dp" and tuple(tiny.boundaries) == tuple(dp[0])
    assert "wall-clock cap" in tiny.status or "no answer within" in tiny.status
    # a stop at the wall clock with an incumbent (whatever the load let the solver reach): not kept
    real = si.ilp.solve

    def stopped(*a: object, **k: object) -> ilp.SolveResult:
        return dataclasses.replace(real(*a, **k), status="feasible", stopped_by="time limit")  # type: ignore[arg-type]

    monkeypatch.setattr(si.ilp, "solve", stopped)
    out = si.split_stages(layers, time_limit_s=60, node_limit=100, **kw)  # type: ignore[arg-type]
    assert out.method == "dp" and tuple(out.boundaries) == tuple(dp[0])
    assert "reached its 60 s wall-clock cap before its 100-node limit: the DP split is kept" in out.status
