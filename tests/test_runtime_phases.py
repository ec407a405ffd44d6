"""Per-phase measurement (runtime.record.phases): the arithmetic on profiler ranges, the plan's predicted
phases, and a 2-rank run (dp2, pp2 1F1B, pp2 zero-bubble) measured on an extra profiled step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from meshplan.runtime.record import phases


def _ev(name: str, a: float, b: float) -> SimpleNamespace:
    return SimpleNamespace(name=phases.PREFIX + name, time_range=SimpleNamespace(start=a, end=b))


def test_phases_from_events_unions_ranges_and_derives_bubble() -> None:
    evs = [_ev("schedule", 0, 10_000), _ev("forward", 0, 2_000), _ev("forward", 1_000, 3_000),  # overlap: 3 ms
           _ev("backward", 4_000, 8_000), _ev("comm", 10_000, 11_000), _ev("optimizer", 11_000, 13_000),
           SimpleNamespace(name="aten::mm", time_range=SimpleNamespace(start=0, end=99_000))]
    got = phases.phases_from_events(evs, steps=1, step_s=0.014)
    assert got["forward"] == pytest.approx(0.003) and got["backward"] == pytest.approx(0.004)
    assert got["bubble"] == pytest.approx(0.010 - 0.007)  # schedule time outside the chunks
    assert got["comm"] == pytest.approx(0.001) and got["optimizer"] == pytest.approx(0.002)
    assert got["other"] == pytest.approx(0.014 - 0.013)
    assert phases.phases_from_events(evs, steps=2, step_s=0.007)["forward"] == pytest.approx(0.0015)


def test_cpu_phases_per_step_bubble_and_other() -> None:
    """The spans' summed CPU seconds become per-step ``{phase}_cpu``: bubble is the schedule's CPU less
    its forwards and backwards, other the step's CPU less every phase's."""
    got = phases.cpu_phases({"schedule": 0.020, "forward": 0.006, "backward": 0.010, "optimizer": 0.004}, 2, 0.015)
    assert got["forward_cpu"] == pytest.approx(0.003) and got["backward_cpu"] == pytest.approx(0.005)
    assert got["bubble_cpu"] == pytest.approx(0.002) and got["comm_cpu"] == 0.0
    assert got["other_cpu"] == pytest.approx(0.015 - 0.003 - 0.005 - 0.002 - 0.002)
    assert "bubble_cpu" not in phases.cpu_phases({"forward": 0.001}, 1, 0.001)  # no pipeline schedule


def test_predicted_phases_and_largest_mismatch() -> None:
    from dataclasses import replace

    from runtime_cases import tiny_gpt

    from meshplan.plan import MeshSpec, Prediction, StageSpec
    from meshplan.runtime.apply.handplan import manual_plan

    def stage(i: int, rank: int, f: float, b: float) -> StageSpec:
        return StageSpec(index=i, rank=rank, node_start=i, node_end=i + 1, first_node="", last_node="",
                         modules=(), fwd_s=f, bwd_s=b)

    # interleaved: rank 0 holds stages 0 and 2 (forward 0.01 + 0.03, backward 0.02 + 0.06), rank 1 stage 1
    plan = replace(manual_plan(tiny_gpt(), None, microbatches=4), mesh=MeshSpec(("pp", "dp", "tp"), (2, 1, 1)), world_size=2,
                   stages=(stage(0, 0, 0.01, 0.02), stage(1, 1, 0.02, 0.04), stage(2, 0, 0.03, 0.06)),
                   predicted=Prediction(step_s=1.0, optimizer_s=0.05, dp_comm_s=0.02, bubble_s=0.1))
    pred = phases.predicted_phases(plan)
    assert pred["forward"] == pytest.approx(4 * 0.04) and pred["backward"] == pytest.approx(4 * 0.08)
    assert (pred["optimizer"], pred["comm"], pred["bubble"]) == (0.05, 0.02, 0.1)
    assert pred["other"] == pytest.approx(1.0 - 0.16 - 0.32 - 0.05 - 0.02 - 0.1)
    rec = {p: {"measured_s": pred[p], "predicted_s": pred[p]} for p in phases.PHASES}
    rec["comm"] = {"measured_s": 0.3, "predicted_s": 0.02}
    rec["how"] = {"profiled_steps": 1}
    assert phases.largest_mismatch(rec) == ("comm", 0.3, 0.02)
    assert phases.mismatch_text(rec) == "largest phase mismatch: comm 300.0 ms measured / 20.0 ms predicted (+1400%)"
    assert "%" not in phases.mismatch_text(rec, comparable=False)


@pytest.mark.distributed
@pytest.mark.slow
class TestTwoRanks:
    def test_dp2_and_pp2_phases_measured(self) -> None:
        import phase_cases as pc
        from dist_utils import run_ranks

        res = run_ranks(pc.phases_worker, 2, timeout_s=400)
        for r in res:
            assert sorted(r) == ["dp2", "pp2", "pp2_zb"]
            for name, got in r.items():
                mine = got["mine"]
                assert got["timed_ranges"] == 0, name  # timed steps carry no phase ranges
                assert not got["enabled_after"] and got["steps"] == 3, name
                assert mine["forward"] > 0 and mine["backward"] > 0 and mine["optimizer"] > 0, (name, mine)
                assert sum(mine[p] for p in phases.PHASES) == pytest.approx(got["wall"], rel=0.05), (name, mine, got["wall"])
                # the process's CPU seconds inside each phase: some in forward and backward, never negative
                assert mine["forward_cpu"] > 0 and mine["backward_cpu"] > 0, (name, mine)
                assert all(mine[f"{p}_cpu"] >= 0 for p in phases.PHASES if p != "bubble"), (name, mine)
                if name == "dp2":
                    assert mine["bubble"] == 0 and mine["comm"] > 0, mine  # the loss all-reduce at least
                else:  # a 2-stage pipeline waits on its neighbour
                    assert mine["bubble"] > 0, (name, mine)
        rec = res[0]["pp2"]["rec"]
        assert set(rec) == {*phases.PHASES, "how"} and len(rec["how"]["measured_s_by_rank"]) == 2
        assert rec["forward"]["measured_cpu_s"] > 0 and "measured_cpu_s" in rec["bubble"]
        # a hand-written plan has no stage times: its predicted 50 ms step is all "other"
        assert rec["forward"]["predicted_s"] == 0 and rec["other"]["predicted_s"] == pytest.approx(0.05)
        assert res[0]["pp2"]["rec"] == res[1]["pp2"]["rec"]  # every rank holds the same record
