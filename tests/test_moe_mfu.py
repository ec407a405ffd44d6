"""MoE planning: MFU counts the parameters a token meets (k of E experts), not every expert; the
search's pruning bound stays below the evaluated step under ep / cp."""

from __future__ import annotations

from meshplan.cost_models.hardware import ClusterSpec
from meshplan.loading import load_graph
from meshplan.planner.api import plan_graph
from meshplan.planner.assemble import active_param_count, model_flops_per_token
from meshplan.planner.search import Searcher


def test_moe_flops_count_active_experts_only() -> None:
    g = load_graph("mixtral-tiny", use_cache=False)
    moe = [n for n in g.nodes if n.kind == "moe"]
    assert moe, "mixtral-tiny must trace to MoE nodes"
    idle = sum((n.attrs["num_experts"] - n.attrs["top_k"]) * n.attrs["expert_numel"] for n in moe)
    assert idle > 0
    assert active_param_count(g) == g.param_count - idle
    L, h = g.meta["num_layers"], g.meta["hidden"]
    assert model_flops_per_token(g) == 6 * (g.param_count - idle) + 12 * L * h * g.seq_len
    plan = plan_graph(g, 4, cluster="h100")
    assert 0 < plan.predicted.mfu < 1


def test_dense_model_counts_every_parameter() -> None:
    g = load_graph("gpt-tiny", use_cache=False)
    assert active_param_count(g) == g.param_count


def test_search_bound_holds_with_expert_and_context_parallelism() -> None:
    """The pruning bound counts the EP/CP terms (the expert-read saving is negative): never above
    the evaluated step, or the search could prune a faster ep/cp configuration."""
    g = load_graph("mixtral-tiny", use_cache=False)
    s = Searcher(g, ClusterSpec.preset("h100").with_devices(8), global_batch=16)
    cfgs = [c for c in s.configs() if c.ep > 1 or c.cp > 1]
    assert cfgs, "the search must enumerate ep/cp configurations for a MoE model"
    for c in cfgs:
        lb, _ = s.costs.lower_bound(c)
        ev = s.costs.evaluate(c)
        assert lb <= ev.step_s * (1 + 1e-9), c
