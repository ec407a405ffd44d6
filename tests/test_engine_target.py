"""``--target ENGINE``: the search keeps to what the engine runs: its stage-split rule
(``partition.engine_split``), schedules, DP kinds and recompute kinds, so the plan exports as is."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from planner_fixtures import gpt_graph

from meshplan.cost_models.hardware import ClusterSpec
from meshplan.engines.spec import CAPS, blocks_per_stage, search_limits, spec_from_plan, unsupported
from meshplan.partition.engine_split import block_counts, rule_split
from meshplan.planner.api import plan_graph

#: the device's time alone: these fixtures are host-bound on the preset (cost_models.host), which
#: would hide the split and schedule differences the tests check
H100 = ClusterSpec.preset("h100").without_host_floor()


def _legal(rule: str, counts: tuple[int, ...]) -> bool:
    """The rules as the engines state them, checked on one tuple (the reference for block_counts)."""
    n, mid = len(counts), counts[1:-1]
    if min(counts) < 1:
        return False
    if rule == "even":
        return len(set(counts)) == 1
    if rule == "first_last":
        return len(set(mid)) <= 1
    per = mid[0] if mid else max(counts)
    return len(set(mid)) <= 1 and all(per - x in range(per) for x in (counts[0], counts[-1])) and (
        n > 2 or per in counts)


@pytest.mark.parametrize("rule", ["even", "first_last", "fewer_first_last"])
def test_block_counts_are_exactly_the_legal_splits(rule: str) -> None:
    for blocks, stages in itertools.product(range(1, 11), range(1, 6)):
        got = set(block_counts(rule, blocks, stages))
        ref = {c for c in itertools.product(range(1, blocks + 1), repeat=stages)
               if sum(c) == blocks and (stages == 1 or _legal(rule, c))}  # fmt: skip
        assert got == ref, (rule, blocks, stages)


def test_rule_split_minimises_the_bottleneck_among_legal_splits() -> None:
    costs = [3.0, 1, 2, 1, 1, 3, 1, 1, 1, 6.0]  # embedding, 8 blocks, a heavy head
    kinds = [False] + [True] * 8 + [False]
    for rule, stages in itertools.product(["even", "first_last", "fewer_first_last"], [2, 3, 4]):
        runs = rule_split(costs, kinds, rule, stages)
        legal = [c for c in itertools.product(range(1, 9), repeat=stages) if sum(c) == 8 and _legal(rule, c)]
        if not legal:
            assert runs is None
            continue
        blocks = tuple(b - a - (a == 0) - (b == len(costs)) for a, b in runs)  # pre/post join first/last
        assert blocks in legal and runs[0][0] == 0 and runs[-1][1] == len(costs)

        def bottleneck(c: tuple[int, ...]) -> float:
            edges = [0, *itertools.accumulate(c)]
            return max(sum(costs[1 + a:1 + b]) + costs[0] * (i == 0) + costs[-1] * (i == len(c) - 1)
                       for i, (a, b) in enumerate(zip(edges, edges[1:])))  # fmt: skip

        assert bottleneck(blocks) == min(map(bottleneck, legal)), (rule, stages)
    assert rule_split(costs, kinds, "even", 3) is None  # 8 blocks do not split evenly in 3


@pytest.fixture(scope="module")
def graph():
    return gpt_graph(layers=12, h=768, heads=12, seq=1024, vocab=50257)  # a heavy head: free splits are uneven


@pytest.mark.parametrize("engine", list(CAPS))
def test_target_plan_is_one_the_engine_runs(engine: str, graph) -> None:
    free = plan_graph(graph, 16, cluster=H100, global_batch_size=64, fixed={"pp": 4, "schedule": "1f1b"})
    limits = search_limits(engine, {"pp": 4})
    plan = plan_graph(graph, 16, cluster=H100, global_batch_size=64, fixed=limits.pop("fixed"), **limits)
    caps = CAPS[engine]
    assert not unsupported(spec_from_plan(plan), engine), unsupported(spec_from_plan(plan), engine)
    assert plan.schedule in caps.schedules and plan.dp_kind in caps.dp_kinds and plan.recompute in caps.recompute
    bps = blocks_per_stage(plan)
    if plan.virtual_stages == 1:
        assert _legal({"even": "even"}.get(caps.split, caps.split), bps)
    # the free split is one no engine-rule gives here; the engine's plan costs at least as much
    assert not _legal("even", blocks_per_stage(free))
    assert plan.predicted.step_s >= free.predicted.step_s * (1 - 1e-9) or plan.schedule != free.schedule


def test_search_limits_refuse_what_the_engine_lacks() -> None:
    with pytest.raises(ValueError, match="--dp-kind hsdp is not one megatron runs"):
        search_limits("megatron", {"dp_kind": "hsdp"})
    with pytest.raises(ValueError, match="--schedule zbv is not one deepspeed runs"):
        search_limits("deepspeed", {"schedule": "zbv"})
    with pytest.raises(ValueError, match="--cp 2: deepspeed has no cp axis"):
        search_limits("deepspeed", {"cp": 2})
    with pytest.raises(ValueError, match="--dtype fp16 is not one torchtitan runs"):
        search_limits("torchtitan", {}, "fp16")
    assert search_limits("deepspeed", {})["fixed"] == {"cp": 1, "ep": 1}


def test_engine_config_is_costed_with_the_engines_split(graph) -> None:
    from meshplan.api.engine_cost import cost_spec
    from meshplan.engines.spec import EngineSpec

    spec = EngineSpec(dp=4, pp=4, micro_batch_size=1, global_batch_size=32, dp_kind="ddp", num_layers=12)
    free = cost_spec(graph, spec, H100)
    assert not _legal("even", blocks_per_stage(free))  # meshplan's own split is uneven here
    ds = cost_spec(graph, spec, H100, "deepspeed")
    assert blocks_per_stage(ds) == (3, 3, 3, 3) and ds.predicted.step_s >= free.predicted.step_s
    mine = cost_spec(graph, dataclasses.replace(spec, layers_per_stage=(2, 4, 4, 2)), H100, "megatron")
    assert blocks_per_stage(mine) == (2, 4, 4, 2)
    with pytest.raises(ValueError, match="add up to the model's 12 repeated blocks"):
        cost_spec(graph, dataclasses.replace(spec, layers_per_stage=(2, 4, 4, 3)), H100, "megatron")
