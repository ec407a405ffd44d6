"""``estimate_graph`` is the coster's estimate of one ``Config`` (``planner.estimate.estimate_config``)
and the Searcher holds that coster rather than being it. Hand-built graphs, no torch."""

from __future__ import annotations

import dataclasses

import pytest
from planner_fixtures import gpt_graph

from meshplan.cost_models.hardware import ClusterSpec
from meshplan.planner.api import estimate_graph, microbatching
from meshplan.planner.estimate import estimate_config, estimate_notes
from meshplan.planner.evaluate import ConfigEvaluator
from meshplan.planner.search import Searcher
from meshplan.planner.search_types import Config

H100 = ClusterSpec.preset("h100", num_nodes=1)


def test_estimate_graph_is_estimate_config_of_its_config():
    g = gpt_graph(layers=8)
    plan = estimate_graph(g, 8, tp=2, pp=2, dp=2, num_microbatches=4, global_batch_size=16, cluster=H100)
    costs = ConfigEvaluator(g, H100.with_devices(8), fixed={"tp": 2, "pp": 2, "dp": 2})
    cfg = Config(2, 2, 2, 2, 4, "1f1b", 1, "none", costs.sp_for(2), "ddp")  # b·m·dp = 16
    ev, _split = estimate_config(costs, cfg, choose_kind=True)
    assert plan.predicted.step_s == pytest.approx(ev.step_s, rel=1e-12)
    assert max(s.mem_bytes for s in plan.stages) <= ev.max_mem_bytes
    # a pinned kind is costed as given; the auto one is never slower when it fits
    pinned, _ = estimate_config(costs, cfg)
    assert pinned.config.dp_kind == "ddp" and (not ev.fits or ev.step_s <= pinned.step_s * (1 + 1e-12))


def test_estimate_notes_say_what_does_not_fit():
    g = gpt_graph(layers=4)
    tiny = dataclasses.replace(H100.with_devices(1), mem_bytes=2**30, mem_reserved_bytes=0)
    costs = ConfigEvaluator(g, tiny)
    ev, split = estimate_config(costs, Config(1, 1, 1, 4, 1, "1f1b", 1, "none", False, "none"))
    assert not ev.fits and split is None
    assert estimate_notes(costs, ev)[0].startswith("does not fit: needs")


def test_microbatching_splits_the_global_batch():
    assert microbatching(64, 4, 2, None, None) == (4, 4)  # 2·pp microbatches
    assert microbatching(64, 4, 1, None, None) == (16, 1)
    assert microbatching(64, 4, 2, 2, None) == (2, 8)
    assert microbatching(64, 4, 2, None, 8) == (2, 8)
    with pytest.raises(ValueError, match="not divisible by num_microbatches=3"):
        microbatching(64, 4, 2, None, 3)
    with pytest.raises(ValueError, match="but the global batch is 64"):
        microbatching(64, 4, 2, 2, 4)


def test_the_search_holds_its_coster():
    g = gpt_graph(layers=4)
    s = Searcher(g, H100.with_devices(4), global_batch=8)
    assert not isinstance(s, ConfigEvaluator) and isinstance(s.costs, ConfigEvaluator)
    res = s.run()
    assert res.best is not None and res.coster is s.costs.coster
    # the winner is what the held coster prices
    again = s.costs.evaluate(res.best.config, runs=res.best.stage_layers)
    assert again.step_s == pytest.approx(res.best.step_s, rel=1e-12)


def test_the_coster_is_one_object_whose_parts_meet_the_protocols_helpers_read():
    """No base class: the coster holds its parts (``states``, ``ep_cp``); what ``kind_free``,
    ``memory_floor`` and ``StateCosts`` read of it through their Protocols (checked nowhere else at
    run time) is there, so a member renamed on the coster fails here, not deep in a search."""
    import weakref

    from meshplan.planner.epcp_coster import EPCPCosts
    from meshplan.planner.kind_free import KindFreeCosts
    from meshplan.planner.memory_floor import FloorCosts
    from meshplan.planner.state_costs import StateCosts, Tables

    assert ConfigEvaluator.__mro__ == (ConfigEvaluator, object)
    costs = ConfigEvaluator(gpt_graph(layers=4), H100, moe_folding=False)
    assert isinstance(costs.states, StateCosts) and isinstance(costs.ep_cp, EPCPCosts)
    assert costs.states.memos is costs.memos is costs.ep_cp.memos
    # the StateCosts reads the coster's tables through a weak reference (no cycle keeps a search alive)
    assert isinstance(costs.states.tables, weakref.ProxyType) and costs.states.tables.table.__self__ is costs
    for proto in (KindFreeCosts, FloorCosts, Tables):
        members = {n for n in vars(proto) if not n.startswith("_")} | set(proto.__annotations__)
        missing = sorted(n for n in members if not hasattr(costs, n))
        assert not missing, (proto.__name__, missing)
