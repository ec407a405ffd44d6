"""The planner never enumerates a combination the runtime refuses (meshplan.execution_rules)."""

from __future__ import annotations

from planner_fixtures import gpt_graph

from meshplan.cost_models.hardware import ClusterSpec
from meshplan.execution_rules import dp_kind_blocker, recompute_blocker
from meshplan.planner.search import Searcher


def test_rules_name_what_the_runtime_refuses():
    assert "zero-bubble" in dp_kind_blocker(dp=2, tp=1, pp=2, schedule="zero-bubble", dp_kind="fsdp")
    assert "zero1" in dp_kind_blocker(dp=2, tp=2, pp=1, schedule="1f1b", dp_kind="zero1")
    assert dp_kind_blocker(dp=2, tp=1, pp=2, schedule="1f1b", dp_kind="fsdp") == ""
    assert dp_kind_blocker(dp=1, tp=2, pp=2, schedule="zbv", dp_kind="fsdp") == ""  # no DP: nothing to shard
    assert "recompute=full" in recompute_blocker(pp=2, schedule="zbv", recompute="full")
    assert recompute_blocker(pp=2, schedule="zbv", recompute="selective") == ""
    assert recompute_blocker(pp=1, schedule="zero-bubble", recompute="full") == ""


def test_search_never_enumerates_a_refused_combination():
    g = gpt_graph(layers=8, h=2048, heads=16, seq=1024, vocab=8192)
    cluster = ClusterSpec.preset("h100").with_devices(16)
    configs = Searcher(g, cluster, global_batch=64).configs()
    assert any(c.schedule in ("zero-bubble", "zbv") for c in configs)  # the rule filters, not the schedules
    for c in configs:
        assert not dp_kind_blocker(dp=c.dp, tp=c.tp, pp=c.pp, schedule=c.schedule, dp_kind=c.dp_kind), c
        assert not recompute_blocker(pp=c.pp, schedule=c.schedule, recompute=c.recompute), c
