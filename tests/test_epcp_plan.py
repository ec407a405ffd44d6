"""EP/CP costing formulas and their place in the joint search (#17)."""

from __future__ import annotations

import pytest
import torch

from meshplan.cost_models.comm import collective_time_s
from meshplan.cost_models.epcp import cp_kv_bytes, cp_ring_exposed_s, ep_a2a_bytes, ep_comm_s
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.plan import Plan
from meshplan.planner.api import plan_graph
from meshplan.planner.epcp_cost import epcp_rule
from meshplan.report.explain import explain_plan

H100 = ClusterSpec.preset("h100", num_nodes=1)


def test_ep_all_to_all_formula():
    b = ep_a2a_bytes(4096, 2, 4096, 2)
    assert b == 4096 * 2 * 4096 * 2
    assert ep_comm_s(4096, 2, 4096, 2, 8, H100) == pytest.approx(4 * collective_time_s("all_to_all", b, 8, H100))
    assert ep_comm_s(4096, 2, 4096, 2, 1, H100) == 0.0


def test_cp_ring_formula_and_overlap():
    kv = cp_kv_bytes(1, 8192, 4, 8, 128, 2)
    assert kv == 2 * 1 * 2048 * 8 * 128 * 2
    step = collective_time_s("send_recv", kv, 2, H100)
    # the executed ring waits for every block: (cp - 1) transfers forward and backward, all exposed
    assert cp_ring_exposed_s(kv, 4, 1.0, H100) == pytest.approx(2 * 3 * step)
    # a ring that overlaps transfers with block compute hides them when a block outlasts a transfer
    assert cp_ring_exposed_s(kv, 4, 8 * step, H100, overlap=1.0) == 0.0
    assert cp_ring_exposed_s(kv, 1, 1.0, H100) == 0.0


def test_rule_refuses_what_the_runtime_cannot_run():
    ok = dict(cp=2, ep=2, tp=1, pp=1, seq_len=32, num_experts=4, recompute="none")
    assert epcp_rule(**ok) == ""
    assert "tp = pp = 1" in epcp_rule(**{**ok, "tp": 2})
    assert "2*cp" in epcp_rule(**{**ok, "seq_len": 30})
    assert "recomputation" in epcp_rule(**{**ok, "recompute": "full"})
    assert "experts" in epcp_rule(**{**ok, "ep": 8})


@pytest.fixture(scope="module")
def moe_graph():
    from meshplan.models.moe import moe_llama
    from meshplan.trace import trace_model

    torch.manual_seed(0)
    return trace_model(moe_llama(), (torch.randint(0, 64, (1, 32)),))


def test_cp_chosen_when_the_batch_cannot_fill_the_devices(moe_graph):
    # 2 sequences on 8 devices with tp = pp = 1: only splitting the sequence uses them all
    p = plan_graph(moe_graph, 8, cluster="h100", global_batch_size=2, fixed={"tp": 1, "pp": 1})
    assert p.cp > 1 and p.dp * p.cp == 8
    assert p.predicted.cp_comm_s > 0 and p.predicted.comm_bytes.get("send_recv", 0) > 0
    assert p.mesh.axis_names == ("pp", "dp", "cp", "tp")
    assert Plan.from_json(p.to_json()) == p
    assert f"cp={p.cp}:" in explain_plan(p)


def test_ep_pinned_shards_expert_memory(moe_graph):
    base = plan_graph(moe_graph, 4, cluster="h100", global_batch_size=8, fixed={"tp": 1, "pp": 1, "ep": 1})
    p = plan_graph(moe_graph, 4, cluster="h100", global_batch_size=8, fixed={"tp": 1, "pp": 1, "ep": 2})
    assert p.ep == 2 and p.predicted.ep_comm_s > 0 and p.predicted.comm_bytes["all_to_all"] > 0
    experts = moe_graph.meta["moe_expert_numel"]
    saved = base.predicted.mem_breakdown["params"] - p.predicted.mem_breakdown["params"]
    assert saved == pytest.approx(experts / 2 * base.predicted.mem_breakdown["params"] / moe_graph.param_count, rel=1e-6)
    assert "ep=2:" in explain_plan(p)


def test_search_never_emits_cp_or_ep_with_tp_or_pp(moe_graph):
    p = plan_graph(moe_graph, 8, cluster="h100", global_batch_size=4)
    for a in p.alternatives:
        c = a.config
        if c.get("cp", 1) > 1 or c.get("ep", 1) > 1:
            assert c["tp"] == 1 and c["pp"] == 1, a.summary
    if p.cp > 1 or p.ep > 1:
        assert p.tp == 1 and p.pp == 1
    with pytest.raises(Exception, match="pins"):
        plan_graph(moe_graph, 8, cluster="h100", global_batch_size=4, fixed={"cp": 2, "tp": 2})


def test_dense_model_gets_no_ep(moe_graph):
    from meshplan.models import llama
    from meshplan.trace import trace_model

    g = trace_model(llama(), (torch.randint(0, 128, (1, 32)),))
    with pytest.raises(Exception, match="pins"):
        plan_graph(g, 4, cluster="h100", global_batch_size=8, fixed={"ep": 2})


def test_explain_says_why_ep_lost(moe_graph):
    # ep is searched for a MoE model; at this size sharding experts does not pay, and explain says so
    p = plan_graph(moe_graph, 4, cluster="h100", global_batch_size=8, fixed={"tp": 1, "pp": 1, "cp": 1})
    assert p.ep == 1
    assert any(a.config.get("ep", 1) > 1 for a in p.alternatives)
    assert "- ep=1: ep=" in explain_plan(p)
