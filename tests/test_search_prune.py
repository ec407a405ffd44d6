"""The search's skipping of candidates that cannot change its result (``planner.search_prune``):
the bounds it rests on hold for every candidate (ep/cp included), and searches with and without
skipping give the same plan and the same alternatives, with candidates skipped."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from planner_fixtures import gpt_graph

from meshplan.cost_models.hardware import ClusterSpec
from meshplan.planner.memory_floor import split_floor
from meshplan.planner.search import Searcher
from meshplan.trace import trace_model

H100 = ClusterSpec.preset("h100")


def small_mem(spec: ClusterSpec, gib: float) -> ClusterSpec:
    """``spec`` with ``gib`` GiB of memory all usable (no reserve): a synthetic budget."""
    return dataclasses.replace(spec, mem_bytes=int(gib * 1024**3), mem_reserved_bytes=0)


def moe_meta_graph(layers: int = 4, seq: int = 256, **shape: int):
    """A zoo MoE Llama built on the meta device and traced (``shape`` overrides MoEConfig fields)."""
    from meshplan.models.meta_init import skip_init_on_meta
    from meshplan.models.moe import MoEConfig, moe_llama

    dims = dict(n_head=16, n_kv_head=8, dim=1024, ffn_hidden=2048, vocab_size=8192, num_experts=16, top_k=2)
    cfg = MoEConfig(n_layer=layers, max_seq_len=seq, **{**dims, **shape})
    with torch.device("meta"), skip_init_on_meta():
        model = moe_llama(cfg)
    return trace_model(model, (torch.zeros(1, seq, dtype=torch.long, device="meta"),))


@pytest.fixture(scope="module")
def moe():
    return moe_meta_graph()


@pytest.mark.parametrize("case", ["gpt", "gpt-tight", "moe"])
def test_bound_below_partial_below_exact_and_memory_floor_below_memory(case, moe):
    """What the skipping rests on, for every candidate and every DP kind: lower bound <= partial
    step <= simulated step (so the bound order settles the partial order) and the memory floor
    <= the memory of the kind (any DP kind, the time-balanced split or the memory re-split); the
    split-aware floor (``memory_floor.split_floor``) <= the memory on the time-balanced split."""
    if case == "moe":
        g, cl, batch = moe, H100.with_devices(16), 64
    else:
        g = gpt_graph(layers=6, h=2048, heads=16, seq=1024, vocab=8192)
        cl = (small_mem(H100, 12) if case == "gpt-tight" else H100).with_devices(8)
        batch = 32
    s = Searcher(g, cl, global_batch=batch)
    cfgs = s.configs()
    assert case != "moe" or any(c.ep > 1 for c in cfgs) and any(c.cp > 1 for c in cfgs)
    n = tight = 0
    for c in cfgs:
        lb, mlb = s.costs.bound(c)
        floor = s.costs.memory_floor(c, mlb)
        on_split = split_floor(s.costs, c)  # valid on the time-balanced split only
        kinds = [c] + (s.costs.other_kinds(c) if s.costs.may_change_kind(c) and c.dp > 1 else [])  # the kinds the search tries
        for ck in kinds:
            rough = s.costs.evaluate(ck, exact=False)
            assert lb <= rough.step_s * (1 + 1e-9), ck
            assert floor <= rough.max_mem_bytes * (1 + 1e-9), ck
            assert on_split <= rough.max_mem_bytes * (1 + 1e-9), ck
            tight += on_split > floor
            runs = s.costs.memory_split(ck) if ck.pp > 1 else None
            if runs is not None:
                assert floor <= s.costs.evaluate(ck, exact=False, runs=runs).max_mem_bytes * (1 + 1e-9), ck
            n += 1
        auto = s.costs.evaluate_auto(c, exact=False)
        assert lb <= auto.step_s * (1 + 1e-9) and auto.step_s <= s.costs.evaluate(auto.config, runs=auto.stage_layers).step_s * (1 + 1e-9)
    assert n > 50
    assert case == "moe" or tight > 0  # the split-aware floor is tighter somewhere (ep > 1: not covered)


def _run(g, cluster, batch, skip: bool):
    s = Searcher(g, cluster, global_batch=batch)
    s.skip_unneeded = skip
    return s.run()


def _fields(ev) -> dict:
    return {f.name: getattr(ev, f.name) for f in dataclasses.fields(ev) if f.name != "table"}


@pytest.mark.parametrize(
    "case,world,batch",
    [("gpt", 16, 64), ("gpt", 64, 512), ("gpt-tight", 64, 512), ("moe", 16, 64), ("moe", 32, 32),
     ("gpt-wide-tight", 8, 32), ("gpt-long-tight", 8, 32)],
)
def test_skipping_keeps_the_best_plan_and_every_alternative(case, world, batch, moe):
    """Never drops the best: the plan, its predicted figures and every alternative (configuration,
    reason, step) are those of the search that costs every candidate."""
    if case == "moe":
        g, spec = moe, H100
    elif case == "gpt-wide-tight":  # pipelines without tp never fit: that family's alternative is a misfit
        g, spec = gpt_graph(layers=4, h=8192, heads=32, seq=2048, vocab=65536), small_mem(H100, 12)
    elif case == "gpt-long-tight":  # many certain misfits deferred, then skipped
        g, spec = gpt_graph(layers=8, h=6144, heads=32, seq=4096, vocab=32768), small_mem(H100, 12)
    else:
        g = gpt_graph(layers=8, h=2048, heads=16, seq=1024, vocab=8192)
        spec = small_mem(H100, 16) if case == "gpt-tight" else H100
    cl = spec.with_devices(world)
    a, b = _run(g, cl, batch, True), _run(g, cl, batch, False)
    assert a.best is not None and b.best is not None
    assert _fields(a.best) == _fields(b.best)
    assert [(e.config, why, e.step_s, e.max_mem_bytes) for e, why in a.alternatives] == [
        (e.config, why, e.step_s, e.max_mem_bytes) for e, why in b.alternatives
    ]
    assert b.skipped == 0 and a.evaluated + a.skipped >= b.evaluated


def test_some_candidates_are_skipped():
    """The rule does skip: a 64-GPU search of an 8-layer GPT at global batch 512 costs fewer
    candidates with it (the case above shows it gives the same result)."""
    g = gpt_graph(layers=8, h=2048, heads=16, seq=1024, vocab=8192)
    # 24 GiB: some candidate must not fit (no candidate is skipped before a costed one that did not
    # fit has a lower partial step); at 80 GiB all fit once the tied wte/lm_head shard under tp
    cl = small_mem(H100, 24).with_devices(64)
    a, b = _run(g, cl, 512, True), _run(g, cl, 512, False)
    assert a.skipped > 0 and a.evaluated < b.evaluated
    assert _fields(a.best) == _fields(b.best)


def test_certain_misfits_are_deferred_then_skipped_with_the_same_result(monkeypatch):
    """Candidates that certainly do not fit are deferred (before anything fits, their families'
    fitting candidates are unknown) and some are never costed, with the result of the search that
    costs every candidate (``BoundOrderCosting.defer`` / ``finish``)."""
    from meshplan.planner import search_prune

    seen = {"deferred": 0, "skipped_at_finish": 0}
    defer, finish = search_prune.BoundOrderCosting.defer, search_prune.BoundOrderCosting.finish

    def counting_defer(self, *args):
        seen["deferred"] += 1
        return defer(self, *args)

    def counting_finish(self):
        n = finish(self)
        seen["skipped_at_finish"] += n
        return n

    monkeypatch.setattr(search_prune.BoundOrderCosting, "defer", counting_defer)
    monkeypatch.setattr(search_prune.BoundOrderCosting, "finish", counting_finish)
    g = gpt_graph(layers=8, h=2048, heads=16, seq=4096, vocab=8192)
    # some candidates certainly do not fit (16 GiB no longer since c7d4aea's loss memory; 14 GiB skipped none once
    # stop 11 priced autocast's fp32-activation passes, which reorder the partial steps: 13 GiB skips 19)
    cl = small_mem(H100, 13).with_devices(64)
    a = _run(g, cl, 256, True)
    assert seen["deferred"] > 0 and seen["skipped_at_finish"] > 0
    b = _run(g, cl, 256, False)
    assert _fields(a.best) == _fields(b.best)
    assert [(e.config, why, e.step_s, e.max_mem_bytes) for e, why in a.alternatives] == [
        (e.config, why, e.step_s, e.max_mem_bytes) for e, why in b.alternatives
    ]
