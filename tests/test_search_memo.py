"""The DP-kind-free part of ``ConfigEvaluator.evaluate`` is computed once per configuration and
shared by the DP kinds (``_kind_free``): every evaluation and every search result is identical
to the unmemoized path (``memo_kind_free = False``)."""

from __future__ import annotations

import dataclasses

import pytest
from planner_fixtures import gpt_graph

from meshplan.cost_models.dp_kinds import KIND_ORDER
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.cost_models.quant import Quantization
from meshplan.planner.costing import GraphCoster
from meshplan.planner.search import Searcher

H100 = ClusterSpec.preset("h100")


def fields(ev) -> dict:
    return {f.name: getattr(ev, f.name) for f in dataclasses.fields(ev) if f.name != "table"}


def pair(g, cluster, quant: str = "none", **kw) -> tuple[Searcher, Searcher]:
    out = []
    for memo in (True, False):
        coster = GraphCoster(g, cluster, quantization=Quantization(mode=quant)) if quant != "none" else None
        s = Searcher(g, cluster, coster=coster, **kw)
        s.costs.memo_kind_free = memo
        out.append(s)
    return out[0], out[1]


def moe_graph():
    import torch

    from meshplan.models.moe import moe_llama
    from meshplan.trace import trace_model

    torch.manual_seed(0)
    return trace_model(moe_llama(), (torch.randint(0, 64, (1, 32)),))


@pytest.mark.parametrize("case", ["tied", "qlora", "moe"])
def test_every_kind_evaluates_identically_with_and_without_the_memo(case):
    g = moe_graph() if case == "moe" else gpt_graph(layers=4, h=1024, heads=16, seq=1024, vocab=32768)  # tied head
    on, off = pair(g, H100.with_devices(8), "qlora" if case == "qlora" else "none", global_batch=32)
    n = 0
    shared = set()  # what the memo keys on: the configuration but its kind, exact, and the kind's gradient
    cfgs = on.configs()  # sharding where autograd accumulates into the shard (cost_models.grad_accum)
    assert case != "moe" or any(c.ep > 1 for c in cfgs)
    for c in cfgs:
        for kind in KIND_ORDER:  # the kinds of one configuration in turn: the memo is hit
            c2 = dataclasses.replace(c, dp_kind=kind)
            for exact in (False, True):
                a, b = on.costs.evaluate(c2, exact=exact), off.costs.evaluate(c2, exact=exact)
                assert fields(a) == fields(b), (c2, exact)
                shared.add((dataclasses.replace(c, dp_kind="ddp"), exact, on.costs.states.zero_divs(c2)[1]))
                n += 1
    assert n > 100 and not off.costs.memos.kind_free
    assert len(on.costs.memos.kind_free) == len(shared) < n  # one entry per (configuration but kind, exact, shard)


@pytest.mark.parametrize(
    "world,batch,layers,gib",
    [(16, 64, 8, None), (8, 32, 6, 16.0)],  # roomy, and memory pressure (sharded kinds chosen)
)
def test_search_best_plan_is_unchanged_by_the_memo(world, batch, layers, gib):
    g = gpt_graph(layers=layers, h=2048, heads=16, seq=1024, vocab=8192)
    cluster = H100.with_devices(world)
    if gib is not None:
        cluster = dataclasses.replace(cluster, mem_bytes=int(gib * 1024**3), mem_reserved_bytes=0)
    on, off = pair(g, cluster, global_batch=batch)
    a, b = on.run(), off.run()
    assert a.best is not None and b.best is not None
    assert fields(a.best) == fields(b.best)
    assert a.best.step_s == b.best.step_s and a.best.peak_mem_bytes == b.best.peak_mem_bytes
    assert [e.config for e, _ in a.alternatives] == [e.config for e, _ in b.alternatives]
    assert a.evaluated == b.evaluated


def test_transient_memo_and_layer_copies_equal_fresh_work():
    """``ConfigEvaluator.transient`` (memoized per table and runs) equals the bytes computed from the
    layers; ``costing.replaced`` (a table's per-instance copy of its block type's costs) equals
    ``dataclasses.replace`` field for field, and refuses an unknown field."""
    from meshplan.planner.costing import replaced

    g = gpt_graph(layers=4, h=1024, heads=16, seq=1024, vocab=32768)
    s = Searcher(g, H100.with_devices(8), global_batch=32)
    n = 0
    for c in s.configs():
        t = s.costs.table(c)
        runs = s.costs.split(t, c.pp * c.virtual_stages, c.virtual_stages) if c.pp > 1 else [(0, len(t.layers))]
        for r in (runs, runs[:1], runs[-1:]):
            layers = [x for a, b in r for x in t.layers[a:b]]
            want = max(0.0, max((x.loss_peak_bytes for x in layers), default=0.0),
                       max((x.transient_bytes for x in layers), default=0.0) - sum(x.loss_bytes for x in layers))
            assert s.costs.transient(t, r) == want and s.costs.transient(t, list(r)) == want  # the second call: memo
            n += 1
    assert n > 10 and s.costs.memos.transient
    for c in s.configs():
        s.costs.evaluate(c, exact=False)
    from meshplan.cost_models.comm import p2p_crosses_nodes

    assert any(len(v) for v in s.costs.memos.crosses.values())
    for (stride, dpn), pairs in s.costs.memos.crosses.items():  # shared link memo == fresh answers
        assert all(p2p_crosses_nodes(a, b, stride, dpn) == x for (a, b), x in pairs.items())
    x = t.layers[1]
    changes = dict(name="other", node_start=1, node_end=2, modules=("m",), out_bytes=3.0, kind="post")
    assert replaced(x, **changes) == dataclasses.replace(x, **changes)
    assert fields(replaced(x, **changes)) == fields(dataclasses.replace(x, **changes))
    assert x.name != "other"  # the prototype is untouched
    with pytest.raises(TypeError, match="no field"):
        replaced(x, bogus=1)


def test_prefix_sums_are_the_running_sums_left_to_right():
    """``ConfigEvaluator.prefix``: each column is [0.0, x0, x0 + x1, ...] of its layer field, summed in
    layer order (the same floats as adding one layer at a time)."""
    g = gpt_graph(layers=4, h=1024, heads=16, seq=1024, vocab=32768)
    s = Searcher(g, H100.with_devices(8), global_batch=32)
    fields_ = {"f": "fwd_total_s", "b": "bwd_input_total_s", "w": "bwd_weight_s", "rec": "recompute_s",
               "tp": "tp_comm_s", "params": "param_count", "act": "act_bytes", "sp": "state_param_bytes",
               "sg": "state_grad_bytes", "so": "state_opt_bytes", "train": "trainable_params"}  # fmt: skip
    tables = {id(s.costs.table(c)): s.costs.table(c) for c in s.configs()}
    assert len(tables) > 3
    for t in tables.values():
        P = s.costs.prefix(t)
        for key, name in fields_.items():
            want = [0.0]
            for x in t.layers:
                want.append(want[-1] + getattr(x, name))
            assert P[key] == want, (key, t.tp, t.recompute, t.micro_batch)
        assert P["largest"] == [max(x.param_count for x in t.layers)]


def test_config_but_equals_dataclasses_replace():
    """``Config.but`` (no ``__init__`` run) gives the configuration ``dataclasses.replace`` gives:
    equal, same hash, same fields, the original untouched; an unknown field is refused."""
    from meshplan.planner.search_types import Config

    c = Config(4, 2, 2, 1, 8, "1f1b", 1, "full", False, "ddp", 2, 1)
    for changes in ({"dp_kind": "fsdp"}, {"recompute": "none", "sequence_parallel": True}, {}):
        a, b = c.but(**changes), dataclasses.replace(c, **changes)
        assert a == b and hash(a) == hash(b) and dataclasses.asdict(a) == dataclasses.asdict(b)
        assert a.summary() == b.summary() and {a: 1}[b] == 1
    assert c.dp_kind == "ddp" and c.recompute == "full"
    with pytest.raises(TypeError, match="no field"):
        c.but(bogus=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.but(dp=8).dp = 2  # type: ignore[misc]
