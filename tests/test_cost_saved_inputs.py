"""What the engines keep for backward beyond Korthikanti's closed forms: the all-gathered input a
column-parallel linear saves under torch's sequence parallelism (``memory.SP_SAVES``), and the
layers outside the repeated blocks, which no engine checkpoints."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from planner_fixtures import gpt_graph

from meshplan.cost_models.engine_profiles import MESHPLAN
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.planner.costing import GraphCoster
from meshplan.planner.layer_saves import saved_shard as _saved_shard

H100 = ClusterSpec.preset("h100")
H, SEQ = 1024, 1024


def test_torch_sp_saves_the_gathered_input_of_column_parallel_linears():
    # a linear reading a sequence-sharded (Q) tensor takes it all-gathered: under torch's TP
    # (PrepareModuleInput / ColwiseParallel(input_layouts=Shard(1))) the all-gather runs before the
    # linear, which saves the whole input; Megatron-LM saves the 1/tp shard and gathers it again
    g = gpt_graph(layers=2, h=H, heads=16, seq=SEQ, vocab=32768)
    norm = next(n for n in g.nodes if n.kind == "norm")
    q = next(n for n in g.nodes if n.kind == "linear" and norm.id in n.inputs)
    act = next(n for n in g.nodes if n.kind == "activation")
    down = next(n for n in g.nodes if n.kind == "linear" and act.id in n.inputs)
    sol = SimpleNamespace(tp=4, node_shard={q.id: 4, down.id: 4},
                          node_state={norm.id: "Q", q.id: "S", act.id: "S", down.id: "P", norm.inputs[0]: "Q"})
    assert _saved_shard(q, sol, "gathered") == 1 and _saved_shard(q, sol, "shard") == 4
    assert _saved_shard(down, sol, "gathered") == _saved_shard(down, sol, "shard") == 4  # its input is head-sharded
    assert _saved_shard(norm, sol, "gathered") == 4  # a norm on the sequence shard saves the shard
    with pytest.raises(ValueError, match="sp_saves"):
        GraphCoster(g, H100, profile=MESHPLAN.but(sp_saves="both"))


@pytest.mark.parametrize("rc", ["full", "op"])
def test_only_the_repeated_blocks_are_recomputed(rc):
    g = gpt_graph(layers=2, h=H, heads=16, seq=SEQ, vocab=32768)
    co = GraphCoster(g, H100)
    none, rec = co.table(1, False, "none", 1), co.table(1, False, rc, 1)
    assert [a.kind for a in none.layers] == [b.kind for b in rec.layers] and "block" in [a.kind for a in none.layers]
    for a, b in zip(none.layers, rec.layers, strict=True):
        if a.kind == "block":
            assert b.act_bytes < a.act_bytes and b.recompute_s > 0
        else:  # the embeddings, final norm and head keep what they save (and the loss peak)
            assert b.act_bytes == a.act_bytes and b.recompute_s == 0
    post = rec.layers[-1]
    assert post.kind == "post" and post.act_bytes == post.loss_bytes + SEQ * H * 2  # the lm_head input
