"""An engine configuration with context / expert parallelism is costed (``meshplan estimate``):
cp and ep go into ``estimate_graph`` and through the EP/CP terms of ``cost_models/epcp.py``; the
export -> import round trip keeps them and the predicted cost."""

from __future__ import annotations

import pytest
import torch

from meshplan.api.engine_cost import cost_spec
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.engines import megatron, torchtitan
from meshplan.engines.spec import EngineSpec
from meshplan.planner.api import estimate_graph
from meshplan.planner.evaluate import ConfigEvaluator


@pytest.fixture(scope="module")
def moe_graph():
    from meshplan.models.moe import moe_llama
    from meshplan.trace import trace_model

    torch.manual_seed(0)
    return trace_model(moe_llama(), (torch.randint(0, 64, (1, 32)),))


def test_cp_and_ep_from_megatron_args_are_costed(moe_graph) -> None:
    args = ("--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --context-parallel-size 2 "
            "--expert-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 8 --bf16")
    spec = megatron.parse(args, 8).spec
    assert (spec.dp, spec.cp, spec.ep) == (4, 2, 2)
    plan = cost_spec(moe_graph, spec, "h100")
    assert (plan.dp, plan.cp, plan.ep, plan.mesh.degree("cp")) == (4, 2, 2, 2)
    assert plan.predicted.cp_comm_s > 0 and plan.predicted.ep_comm_s > 0
    assert plan.predicted.comm_bytes["all_to_all"] > 0
    dense = cost_spec(moe_graph, EngineSpec(dp=4, cp=2, micro_batch_size=1, global_batch_size=8), "h100")
    assert dense.predicted.ep_comm_s == 0
    assert plan.predicted.mem_breakdown["params"] < dense.predicted.mem_breakdown["params"]  # 1/ep of the experts
    same = estimate_graph(moe_graph, 8, tp=1, pp=1, dp=4, cp=2, ep=2, micro_batch_size=1, global_batch_size=8,
                          cluster="h100")  # fmt: skip
    assert same.predicted.step_s == pytest.approx(plan.predicted.step_s, rel=1e-12)
    # round trip through both engines that express cp/ep
    for text, parse in ((megatron.export(spec), lambda t: megatron.parse(t, 8)),
                        (torchtitan.cli_overrides(spec), lambda t: torchtitan.parse(t, 8))):
        back = parse(text).spec
        assert (back.dp, back.cp, back.ep) == (4, 2, 2), text
        assert cost_spec(moe_graph, back, "h100").predicted.step_s == pytest.approx(plan.predicted.step_s, rel=1e-12)


def test_cp_ep_the_runtime_does_not_run_is_costed_with_a_note(moe_graph) -> None:
    plan = cost_spec(moe_graph, EngineSpec(dp=2, tp=2, cp=2, micro_batch_size=1, global_batch_size=4), "h100")
    assert plan.cp == 2 and plan.predicted.cp_comm_s > 0
    why = ConfigEvaluator(moe_graph, ClusterSpec.preset("h100", num_nodes=1)).ep_cp.epcp_why(2, 1, 2, 1, "none")
    noted = [n for n in plan.notes if n.startswith("cp=2 ep=1 costed")]
    assert noted == ([f"cp=2 ep=1 costed (cost_models/epcp.py), but meshplan's runtime does not run it: {why}"]
                     if why else [])  # fmt: skip
    with pytest.raises(ValueError, match="ep=8 must divide"):  # 4 experts
        cost_spec(moe_graph, EngineSpec(dp=8, ep=8, micro_batch_size=1, global_batch_size=8), "h100")


def test_sharding_kinds_shard_states_over_dp_x_cp_as_the_runtime_does(moe_graph) -> None:
    """meshplan's profile (``shard_over_cp``): under cp every kind that shards a state spreads it over
    dp x cp, as the runtime's FSDP2 on the flattened dp_cp mesh and zero1 over the dp x cp group do
    (``execution_rules.states_over_cp``); ddp / none stay replicated (#33)."""
    from meshplan.plan.execution_rules import states_over_cp

    def states(kind: str, cp: int) -> dict[str, int]:
        p = estimate_graph(moe_graph, 2 * cp, tp=1, pp=1, dp=2, cp=cp, dp_kind=kind, micro_batch_size=1,
                           global_batch_size=2, cluster="h100")
        return {k: p.predicted.mem_breakdown[k] for k in ("params", "grads", "optimizer")}

    for kind in ("ddp", "zero1", "zero2", "fsdp", "hsdp"):
        dp2, cp2 = states(kind, 1), states(kind, 2)
        sharded = {k: v for k, v in dp2.items() if v < states("ddp", 1)[k]}  # what the kind shards over dp
        assert bool(sharded) == states_over_cp(cp=2, ep=1, dp_kind=kind), kind
        for k, v in dp2.items():
            assert cp2[k] == pytest.approx(v / 2 if k in sharded else v, rel=1e-6), (kind, k, dp2, cp2)
