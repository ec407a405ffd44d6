"""Vocab-parallel token embedding under TP: the engines' layout (Megatron-LM's
VocabParallelEmbedding, torchtitan's RowwiseParallel tok_embeddings) against meshplan's runtime
(a tied embedding and head sharded alike, one Shard(0) Parameter: runtime/tp.retie; an untied
embedding as the placement ILP chooses), its forward-only all-reduce and its sharded states."""

from __future__ import annotations

import dataclasses

import pytest
from planner_fixtures import gpt_graph

from meshplan.cost_models.engine_profiles import MESHPLAN
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.planner.api import estimate_graph
from meshplan.planner.tp.graph import solve_tp
from meshplan.planner.tp.ilp import collective_time
from meshplan.planner.tp.types import collective_passes

H100 = ClusterSpec.preset("h100")
V, H = 32768, 1024


def _untied(g):
    """The fixture with its LM head owning its own weight (Llama-style)."""
    nodes = [dataclasses.replace(n, param_names=("lm_head.weight",), shared_params=(), param_numel=V * H,
                                 param_bytes=4 * V * H) if n.module_fqn == "lm_head" else n for n in g.nodes]  # fmt: skip
    return dataclasses.replace(g, nodes=nodes, tied_params=[])


@pytest.mark.parametrize("engine", [True, False])
def test_tied_embedding_and_head_sharded_with_one_forward_all_reduce(engine):
    # engines: always; meshplan's runtime: when the ILP shards the pair (runtime/tp.retie runs it so)
    g = gpt_graph(layers=2, h=H, heads=16, vocab=V)
    sol = solve_tp(g, 8, H100, vocab_parallel=engine)
    assert sol.styles["wte"] == "rowwise" and sol.styles["lm_head"] == "colwise"
    out = next(n.id for n in g.nodes if n.kind == "output")
    assert sol.node_state[out] == "S"  # vocab-parallel logits into the loss, no gather
    wte = next(n for n in g.nodes if n.module_fqn == "wte")
    ev = [e for e in sol.segment_events["rest"] if e[0] == wte.id]
    assert [k for _, k, _ in ev] == ["all_reduce"]
    # the embedding's all-reduce runs in forward only (ids take no gradient): once, not twice
    assert collective_passes("embedding", "all_reduce") == 1 and collective_passes("linear", "all_reduce") == 2
    assert sol.segment_comm_bytes["rest"]["all_reduce"] == int(ev[0][2])
    assert sol.segment_comm_s["rest"] == pytest.approx(collective_time("all_reduce", ev[0][2], 8, H100))


@pytest.mark.parametrize("tied", [True, False])
def test_embedding_states_sharded_by_tp_under_the_engine_layout(tied):
    g = gpt_graph(layers=2, h=H, heads=16, vocab=V)
    g = g if tied else _untied(g)
    kw = dict(tp=8, pp=1, dp=1, global_batch_size=8, micro_batch_size=8, cluster=H100)
    run = estimate_graph(g, 8, **kw)
    eng = estimate_graph(g, 8, profile=MESHPLAN.but(vocab_parallel_embedding=True), **kw)
    assert eng.tp_styles["wte"] == "rowwise"
    # the runtime: a tied table sharded with its head (the same states as the engines'), an untied
    # one replicated (its all-reduce buys nothing: the ILP weighs time)
    assert run.tp_styles["wte"] == ("rowwise" if tied else "replicate")
    saved = run.predicted.mem_breakdown["params"] - eng.predicted.mem_breakdown["params"]
    shards = 0.0 if tied else V * H * 7 / 8  # the replicated table less its 1/8 shard
    if not tied:  # untied: the head is colwise in both; only the table differs
        assert eng.tp_styles["lm_head"] == run.tp_styles["lm_head"] == "colwise"
    # the runtime's state layout (dp_kinds.state_precision "torch"): fp32 params and grads, Adam's two fp32 moments
    assert saved == pytest.approx(4 * shards, rel=1e-3)
    grads = run.predicted.mem_breakdown["grads"] - eng.predicted.mem_breakdown["grads"]
    opt = run.predicted.mem_breakdown["optimizer"] - eng.predicted.mem_breakdown["optimizer"]
    assert grads == pytest.approx(4 * shards, rel=1e-3) and opt == pytest.approx(8 * shards, rel=1e-3)
