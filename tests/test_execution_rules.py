"""The planner never enumerates a combination the runtime refuses (meshplan.plan.execution_rules)."""

from __future__ import annotations

from planner_fixtures import gpt_graph

from meshplan.cost_models.hardware import ClusterSpec
from meshplan.plan.execution_rules import dp_kind_blocker, recompute_blocker
from meshplan.planner.search import Searcher


def test_rules_name_what_the_runtime_refuses():
    assert "zero-bubble" in dp_kind_blocker(dp=2, tp=1, pp=2, schedule="zero-bubble", dp_kind="fsdp")
    assert dp_kind_blocker(dp=2, tp=2, pp=1, schedule="1f1b", dp_kind="zero1") == ""  # runtime.apply.zero1.TPZero
    assert dp_kind_blocker(dp=2, tp=1, pp=2, schedule="1f1b", dp_kind="fsdp") == ""
    assert dp_kind_blocker(dp=1, tp=2, pp=2, schedule="zbv", dp_kind="fsdp") == ""  # no DP: nothing to shard
    # full recompute runs under split backward (runtime/apply/cached_checkpoint.py: one recompute per microbatch)
    assert recompute_blocker(pp=2, schedule="zbv", recompute="full") == ""
    assert recompute_blocker(pp=2, schedule="zbv", recompute="selective") == ""
    assert recompute_blocker(pp=1, schedule="zero-bubble", recompute="full") == ""


def test_search_never_enumerates_a_refused_combination():
    g = gpt_graph(layers=8, h=2048, heads=16, seq=1024, vocab=8192)
    cluster = ClusterSpec.preset("h100").with_devices(16)
    configs = Searcher(g, cluster, global_batch=64).configs()
    assert any(c.schedule in ("zero-bubble", "zbv") for c in configs)  # the rule filters, not the schedules
    assert any(c.schedule in ("zero-bubble", "zbv") and c.pp > 1 and c.recompute == "full" for c in configs)
    # the kinds evaluate_auto may upgrade ddp to obey the rule too
    ev = Searcher(g, cluster, global_batch=64)
    zb = next(c for c in configs if c.schedule == "zero-bubble" and c.dp > 1)
    assert [k.dp_kind for k in ev.costs.other_kinds(zb)] == ["zero1"]
    tp2 = next(c for c in configs if c.tp > 1 and c.dp > 1 and c.pp == 1)
    assert "zero1" in [k.dp_kind for k in ev.costs.other_kinds(tp2)]  # zero1 with tp runs (runtime.apply.zero1.TPZero)
    for c in configs:
        assert not dp_kind_blocker(dp=c.dp, tp=c.tp, pp=c.pp, schedule=c.schedule, dp_kind=c.dp_kind), c
        assert not recompute_blocker(pp=c.pp, schedule=c.schedule, recompute=c.recompute), c


def test_tp_with_pp_is_searched_for_export_captures_without_sequence_parallelism():
    """An 8-layer Llama-8B-wide decoder on 8 H100 with dp pinned to 1: tp x pp wins whether the model
    is fx- or export-captured (an export capture's stages get their nn.Linear modules and local shapes
    back: runtime/apply/tp_export.py); the export plan runs without sequence parallelism (its stages
    have no norm modules), which the search leaves off there with no configuration dropped."""
    import dataclasses

    from meshplan.plan.execution_rules import tp_pp_blocker
    from meshplan.planner.api import plan_graph

    g = gpt_graph(layers=8, h=8192, heads=64, seq=4096, vocab=32768)
    # cp pinned to 1: with cp x tp searched (#17), cp4 x tp2 would win here instead of tp x pp
    fx = plan_graph(g, 8, cluster="h100", global_batch_size=8, fixed={"dp": 1, "cp": 1})
    assert fx.tp > 1 and fx.pp > 1, fx.summary()
    ex = plan_graph(dataclasses.replace(g, capture="export"), 8, cluster="h100", global_batch_size=8,
                    fixed={"dp": 1, "cp": 1})
    assert ex.tp > 1 and ex.pp > 1 and not ex.sequence_parallel, ex.summary()
    assert not any(n.startswith("not searched") for n in ex.notes), ex.notes
    assert tp_pp_blocker(tp=ex.tp, pp=ex.pp, capture="export", sequence_parallel=True)
    assert tp_pp_blocker(tp=2, pp=2, capture="fx", sequence_parallel=True) == ""

