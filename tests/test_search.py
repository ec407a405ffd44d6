"""Joint search: even splits, heavy layers, memory pressure, bound validity, equality with
exhaustive enumeration under the same cost model, infeasibility."""

from __future__ import annotations

import dataclasses
import re

import pytest
from planner_fixtures import gpt_graph

from meshplan.cost_models.hardware import ClusterSpec
from meshplan.errors import NoFeasiblePlanError
from meshplan.plan import Plan
from meshplan.planner.api import plan_graph
from meshplan.planner.search import Searcher, balanced_split
from meshplan.report.explain import explain_plan
from meshplan.report.text import format_plan

H100 = ClusterSpec.preset("h100")


def small_mem(spec: ClusterSpec, gib: float) -> ClusterSpec:
    """``spec`` with ``gib`` GiB of memory all usable (no reserve): a synthetic budget."""
    return dataclasses.replace(spec, mem_bytes=int(gib * 1024**3), mem_reserved_bytes=0)


def test_balanced_split_uniform_and_heavy():
    assert balanced_split([1.0] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert balanced_split([1, 1, 1, 4, 1, 1, 1], 3) == [(0, 3), (3, 4), (4, 7)]  # the heavy layer alone
    assert balanced_split([5.0], 1) == [(0, 1)]
    with pytest.raises(ValueError):
        balanced_split([1.0, 1.0], 3)


def test_uniform_blocks_split_evenly_in_a_plan():
    g = gpt_graph(layers=8, h=1024, heads=16, vocab=1024)
    p = plan_graph(g, 4, cluster="h100", global_batch_size=16, fixed={"pp": 4, "tp": 1, "schedule": "1f1b"})
    per_stage = [sum(1 for m in s.modules if m.endswith(".ln_1")) for s in p.stages]
    assert per_stage == [2, 2, 2, 2]
    assert Plan.from_json(p.to_json()) == p


def test_heavy_block_gets_its_own_stage():
    g = gpt_graph(layers=6, h=1024, heads=16, vocab=1024, heavy={2: 4.0})
    p = plan_graph(g, 4, cluster="h100", global_batch_size=16, fixed={"pp": 4, "tp": 1, "schedule": "1f1b"})
    heavy_stage = next(s for s in p.stages if "blocks.2.ln_1" in s.modules)
    assert [m for m in heavy_stage.modules if m.endswith(".ln_1")] == ["blocks.2.ln_1"]
    assert Plan.from_json(p.to_json()) == p


def test_tight_memory_forces_more_model_parallelism():
    g = gpt_graph(layers=8, h=4096, heads=32, seq=2048, vocab=32768)
    # batch 128: enough microbatches that the roomy plan is not already pipelined for its bubble
    kw = dict(global_batch_size=128, fixed={"dp_kind": "ddp"}, recompute=["none"])
    roomy = plan_graph(g, 16, cluster=small_mem(H100.with_devices(16), 200), **kw)
    tight = plan_graph(g, 16, cluster=small_mem(H100.with_devices(16), 10), **kw)
    assert roomy.tp * roomy.pp < tight.tp * tight.pp
    assert max(tight.predicted.peak_mem_bytes) <= 10 * 1024**3
    for p in (roomy, tight):
        assert Plan.from_json(p.to_json()) == p


@pytest.mark.parametrize(
    "world,batch,layers,spec",
    [(8, 16, 4, H100), (16, 64, 8, H100), (8, 32, 6, small_mem(H100, 16))],
)
def test_search_matches_exhaustive_enumeration(world, batch, layers, spec):
    g = gpt_graph(layers=layers, h=2048, heads=16, seq=1024, vocab=8192)
    cluster = spec.with_devices(world)
    fast = Searcher(g, cluster, global_batch=batch).run()
    full = Searcher(g, cluster, global_batch=batch).run(exhaustive=True)
    assert full.evaluated >= fast.evaluated
    assert fast.best is not None and full.best is not None
    assert fast.best.config == full.best.config
    assert fast.best.step_s == pytest.approx(full.best.step_s)


def test_split_aware_bound_never_exceeds_simulation():
    g = gpt_graph(layers=6, h=2048, heads=16, seq=1024, vocab=8192)
    s = Searcher(g, H100.with_devices(8), global_batch=32)
    cfgs = s.configs()
    assert len(cfgs) > 20
    for c in cfgs:
        lb, _ = s.costs.lower_bound(c)
        rough = s.costs.evaluate(c, exact=False)
        exact = s.costs.evaluate(c)
        assert lb <= exact.step_s * (1 + 1e-9), c
        assert rough.step_s <= exact.step_s * (1 + 1e-9), c
        assert rough.peak_mem_bytes == exact.peak_mem_bytes


def test_pins_are_respected_and_alternatives_have_reasons():
    g = gpt_graph(layers=8, h=2048, heads=16, seq=1024, vocab=8192)
    p = plan_graph(g, 16, cluster="h100", global_batch_size=64, fixed={"tp": 2})
    assert p.tp == 2 and p.dp * p.tp * p.pp == 16
    assert any(a.reason.startswith("best with pp=") for a in p.alternatives)  # what another degree costs
    assert p.alternatives and all(a.reason for a in p.alternatives)
    for a in p.alternatives:
        assert a.reason.startswith(("slower by", "out of memory by", "best with"))
        if a.step_s is not None:
            assert a.step_s >= p.predicted.step_s
    assert Plan.from_json(p.to_json()) == p


def test_memory_pressure_picks_fsdp_or_recompute_when_allowed():
    g = gpt_graph(layers=8, h=4096, heads=32, seq=2048, vocab=32768)
    p = plan_graph(
        g, 8, cluster=small_mem(H100.with_devices(8), 24), global_batch_size=8, fixed={"tp": 1, "pp": 1}
    )
    # 26 GiB of model states only fit sharded over dp: the fastest sharded kind that fits, said so
    assert p.dp_kind in ("zero1", "zero2", "fsdp")
    assert any(n.startswith(f"{p.dp_kind} chosen because ddp does not fit: ") for n in p.notes), p.notes
    assert max(p.predicted.peak_mem_bytes) <= 24 * 1024**3


def test_no_feasible_plan_names_the_smallest_need_and_the_limit():
    g = gpt_graph(layers=4, h=4096, heads=32, seq=2048, vocab=32768)
    with pytest.raises(
        NoFeasiblePlanError, match=r"smallest per-device need found is [\d.]+ GiB, the limit 0\.5"
    ) as err:
        plan_graph(g, 2, cluster=small_mem(H100.with_devices(2), 0.5), global_batch_size=2)
    m = re.search(r"need found is ([\d.]+) GiB.*\((\d+) of (\d+) configurations costed; by its memory lower bound "
                  r"none needs less than ([\d.]+) GiB\)", str(err.value))
    assert m, err.value
    found, costed, total, floor = float(m[1]), int(m[2]), int(m[3]), float(m[4])
    assert 0 < floor <= found and 0 < costed <= total  # the floor bounds every configuration, costed or skipped


def test_tp_that_shards_nothing_is_skipped_unless_pinned():
    g = gpt_graph(layers=2, h=64, heads=4, seq=32, vocab=128)  # too small for TP to pay
    free = plan_graph(g, 2, global_batch_size=4)
    assert free.tp == 1
    pinned = plan_graph(g, 2, global_batch_size=4, fixed={"tp": 2})
    assert pinned.tp == 2
    assert any("sharding does not pay" in n for n in pinned.notes)
    assert Plan.from_json(pinned.to_json()) == pinned


def test_memory_constrained_resplit_when_the_balanced_split_does_not_fit():
    g = gpt_graph(layers=8, h=1024, heads=16, seq=8192, vocab=1024)  # activations dominate memory
    pins = {"pp": 2, "tp": 1, "schedule": "1f1b", "micro_batch_size": 1, "recompute": "none"}
    roomy = Searcher(g, H100.with_devices(2), global_batch=8, fixed=pins)
    balanced = roomy.costs.evaluate(roomy.configs()[0])
    assert balanced.stage_layers == [(0, 5), (5, 10)]  # 1F1B: rank 0 holds 2 microbatches, rank 1 one
    limit = int(0.9 * max(balanced.peak_mem_bytes))
    tight = Searcher(
        g, dataclasses.replace(H100.with_devices(2), mem_bytes=limit, mem_reserved_bytes=0), global_batch=8, fixed=pins
    ).run()
    assert tight.best is not None and tight.best.config.recompute == "none"
    assert tight.best.stage_layers[0][1] < 5  # fewer layers on the rank with more in flight
    assert max(tight.best.peak_mem_bytes) <= limit


def test_tied_head_in_another_stage_holds_a_copy_of_the_embedding():
    from meshplan.planner.api import estimate_graph

    g = gpt_graph(layers=4, h=1024, heads=16, vocab=32768)  # lm_head tied to wte
    one = estimate_graph(g, 1, tp=1, pp=1, dp=1, num_microbatches=1, global_batch_size=4)
    two = estimate_graph(g, 2, tp=1, pp=2, dp=1, schedule="1f1b", num_microbatches=4, global_batch_size=4)
    assert one.stages[0].param_count == g.param_count
    assert sum(s.param_count for s in two.stages) == g.param_count + 32768 * 1024


def test_alternatives_show_other_families_and_what_did_not_fit():
    g = gpt_graph(layers=8, h=4096, heads=32, seq=2048, vocab=32768)
    kw = dict(global_batch_size=32, fixed={"dp_kind": "ddp"}, recompute=["none"])
    p = plan_graph(g, 16, cluster=small_mem(H100.with_devices(16), 24), **kw)
    assert p.pp > 1 or p.tp > 1  # a full data-parallel replica does not fit 24 GiB
    dp_only = [a for a in p.alternatives if a.reason.startswith("best with data parallelism only")]
    assert len(dp_only) == 1 and dp_only[0].step_s is None and "out of memory by" in dp_only[0].reason
    assert dp_only[0].config["tp"] == 1 and dp_only[0].config["pp"] == 1
    fitting = [a.step_s for a in p.alternatives if a.step_s is not None]
    assert fitting == sorted(fitting) and all(s >= p.predicted.step_s for s in fitting)
    assert p.alternatives[-1].step_s is None  # ranked: fitting first, then out of memory
    assert "why not data parallelism only: out of memory by" in explain_plan(p)


def test_winner_split_comes_from_the_stage_split_ilp():
    g = gpt_graph(layers=6, h=1024, heads=16, vocab=1024, heavy={2: 4.0})
    p = plan_graph(g, 4, cluster="h100", global_batch_size=16, fixed={"pp": 4, "tp": 1, "schedule": "1f1b"})
    sv = p.solver
    assert sv.split_method in ("ilp", "dp") and sv.split_status and sv.split_seconds > 0
    assert sv.split_objective_s > 0 and "Stage split:" in format_plan(p)
    assert any("stage split re-solved by the" in n for n in p.notes)
    # one stage per rank: the exact DP answers and the plan says so (no ILP built)
    assert sv.split_method == "dp" and "no ILP needed" in sv.split_status
    assert "stage boundaries chosen by the exact DP split" in explain_plan(p)
    inter = plan_graph(g, 2, cluster="h100", global_batch_size=16,
                       fixed={"pp": 2, "tp": 1, "schedule": "interleaved-1f1b"})  # fmt: skip
    assert inter.solver.split_method in ("ilp", "dp") and inter.solver.split_status
    assert "stage boundaries chosen by" in explain_plan(inter)
    flat = plan_graph(g, 4, cluster="h100", global_batch_size=16, fixed={"pp": 1})
    assert flat.solver.split_method == "" and "Stage split:" not in str(flat)


def test_ddp_sync_reduces_fp32_gradients_on_every_precision():
    """The runtime keeps fp32 parameters (autocast) and so all-reduces fp32 gradients, bf16 or not."""
    from meshplan.planner.api import estimate_graph

    g = gpt_graph()
    kw = dict(tp=1, pp=1, dp=4, dp_kind="ddp", num_microbatches=1, global_batch_size=4)
    bf16 = estimate_graph(g, 4, **kw)
    fp32 = estimate_graph(g, 4, dtype="fp32", **kw)
    assert fp32.predicted.comm_bytes["all_reduce"] == bf16.predicted.comm_bytes["all_reduce"]
    assert bf16.predicted.comm_bytes["all_reduce"] == pytest.approx(4 * g.param_count, rel=0.01)


def test_progress_reports_phases_and_counts():
    g = gpt_graph(layers=8, h=1024, heads=16, vocab=1024)
    lines: list[str] = []
    s = Searcher(g, ClusterSpec.preset("h100", num_nodes=1), global_batch=64, progress=lines.append)
    res = s.run()
    assert set(res.phase_s) == {"enumerate", "bound", "cost", "simulate", "finalize"}
    assert all(v >= 0 for v in res.phase_s.values()) and 0 < res.simulated <= res.evaluated <= res.candidates
    assert lines[0].endswith("configurations; bounding") and lines[-1].startswith("done:")


@pytest.mark.parametrize("world,batch,layers", [(16, 64, 8), (64, 256, 12)])
def test_pruning_dominated_recompute_keeps_the_exhaustive_best(world, batch, layers):
    """Recompute variants of a configuration that fits with every DP kind without recompute are
    not costed; the best plan is the exhaustive search's."""
    g = gpt_graph(layers=layers, h=2048, heads=16, seq=1024, vocab=8192)
    cluster = H100.with_devices(world)
    fast = Searcher(g, cluster, global_batch=batch).run()
    full = Searcher(g, cluster, global_batch=batch).run(exhaustive=True)
    assert fast.pruned > 0 and full.pruned == 0
    assert fast.evaluated + fast.pruned <= full.evaluated
    assert fast.best.config == full.best.config
    assert fast.best.step_s == pytest.approx(full.best.step_s)
    s = Searcher(g, cluster, global_batch=batch)
    s.run()
    dominated = [c for _, _, c in s.bounded if s.dominated(c)][:25]
    assert dominated
    for c in dominated:  # the claim itself: no faster than the twin without recompute, exactly costed
        twin = dataclasses.replace(c, recompute="none")
        assert s.costs.evaluate_auto(c).step_s >= s.costs.evaluate_auto(twin).step_s * (1 - 1e-9), c


def test_split_ilp_is_work_limited_and_only_for_the_winner(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wall-clock stop would make the split depend on the machine's load: the winner's split ILP
    runs under a node limit, and the contenders' splits are re-solved by the DP alone."""
    from meshplan import ilp
    from meshplan.planner import finalize

    calls: list[tuple[str, int | None]] = []
    real = ilp.solve

    def spy(problem, **kw):  # noqa: ANN001, ANN003, ANN202
        calls.append((problem.name, kw.get("node_limit")))
        return real(problem, **kw)

    monkeypatch.setattr(ilp, "solve", spy)
    g = gpt_graph(layers=6, h=1024, heads=16, vocab=1024, heavy={2: 4.0})
    # the device's time alone (host-bound on the preset, cost_models.host, the winner would differ)
    h100 = ClusterSpec.preset("h100").without_host_floor()
    p = plan_graph(g, 2, cluster=h100, global_batch_size=16, fixed={"pp": 2, "tp": 1})
    # a contender with two stages per rank (zbv) was refined too, by the DP: one ILP, the winner's
    assert p.schedule == "interleaved-1f1b" and any("zbv v2" in a.summary for a in p.alternatives)
    assert [n for name, n in calls if name == "stage_split"] == [finalize.WINNER_SPLIT_NODES]


def test_a_wall_clock_stop_of_the_split_ilp_keeps_the_dp_split_and_explain_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from meshplan import ilp

    real = ilp.solve

    def stopped(problem, **kw):  # noqa: ANN001, ANN003, ANN202 - as if the load had let it reach its wall-clock cap
        res = real(problem, **kw)
        return dataclasses.replace(res, status="feasible", stopped_by="time limit") if problem.name == "stage_split" else res

    monkeypatch.setattr(ilp, "solve", stopped)
    g = gpt_graph(layers=6, h=1024, heads=16, vocab=1024, heavy={2: 4.0})
    p = plan_graph(g, 2, cluster="h100", global_batch_size=16, fixed={"pp": 2, "tp": 1, "schedule": "interleaved-1f1b"})
    assert p.solver.split_method == "dp" and "wall-clock cap" in p.solver.split_status
    assert "the DP split is kept" in explain_plan(p)
