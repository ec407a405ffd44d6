"""TP placement ILP: textbook answers, hand-computed objective, named constraint families."""

from __future__ import annotations

import pytest
from planner_fixtures import gpt_graph, lone_linear_graph, mlp_graph

from meshplan.cost_models.comm import collective_time_s
from meshplan.cost_models.compute import node_time
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.graph import GraphNode
from meshplan.ilp import constraint_families
from meshplan.planner.tp.graph import solve_tp
from meshplan.planner.tp.ilp import MEM_WEIGHT_S_PER_BYTE, TPPlacementILP, solve_segment

H100 = ClusterSpec.preset("h100")
BLOCK = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.fc_in", "mlp.fc_out")
TEXTBOOK = dict(zip(BLOCK, ("colwise", "colwise", "colwise", "rowwise", "colwise", "rowwise")))


def test_mlp_tp2_is_colwise_then_rowwise_with_one_all_reduce():
    g = mlp_graph()
    sol = solve_tp(g, 2, H100)
    assert sol.styles == {"layers.0": "colwise", "layers.2": "rowwise"}
    events = sol.segment_events["rest"]
    assert [k for _, k, _ in events] == ["all_reduce"]  # one forward all-reduce (mirrored in backward)
    out_bytes = g.nodes[3].out_bytes  # the second linear's output
    assert sol.comm_bytes == {"all_reduce": 2 * out_bytes}
    assert sol.node_shard[1] == 2 and sol.node_shard[2] == 2  # linear and GELU run sharded


def test_mlp_objective_equals_hand_computed_cost():
    g = mlp_graph()
    ilp = TPPlacementILP(g, [n.id for n in g.nodes], 2, H100)
    sol = ilp.solve()
    hand = 0.0
    for n in g.nodes:
        shard = 2 if n.kind in ("linear", "activation") else 1
        t = node_time(n, H100, shard=shard, input_bytes=sum(b for _, d, b in g.edges if d == n.id))
        hand += t.total_s + MEM_WEIGHT_S_PER_BYTE * n.param_bytes / (shard if n.kind == "linear" else 1)
    ar = collective_time_s("all_reduce", g.nodes[3].out_bytes, 2, H100) + H100.kernel_floor_s
    hand += 2 * ar
    import pulp

    assert pulp.value(ilp.prob.objective) == pytest.approx(hand, rel=1e-9)
    assert sol.comm_s == pytest.approx(2 * ar)


def test_named_constraint_families():
    g = gpt_graph(layers=1, h=4096, heads=32)
    a, b = g.blocks[0].node_ranges[0]
    ilp = TPPlacementILP(g, list(range(a, b)), 8, H100, sequence_parallel=True)
    fams = constraint_families(ilp.build())
    for fam in ("one_strategy", "edge_allowed", "reshard", "boundary_reshard"):
        assert fam in fams, fams


@pytest.mark.parametrize("sp", [False, True])
def test_transformer_block_textbook_styles_on_every_instance(sp):
    g = gpt_graph(layers=4, h=4096, heads=32, seq=2048)
    sol = solve_tp(g, 8, H100, sequence_parallel=sp)
    for i in range(4):
        for rel, style in TEXTBOOK.items():
            assert sol.styles[f"blocks.{i}.{rel}"] == style, (i, rel)
    block_kinds = sorted(k for _, k, _ in sol.segment_events["block:blk"])
    if sp:  # Megatron SP: all-gather before attention/MLP, reduce-scatter after
        assert block_kinds == ["all_gather", "all_gather", "reduce_scatter", "reduce_scatter"]
        norms = [n.id for n in g.nodes if n.kind == "norm"]
        assert all(sol.node_shard[i] == 8 for i in norms)
    else:  # two all-reduces forward per layer (SC'21 §3.2)
        assert block_kinds == ["all_reduce", "all_reduce"]
    assert sol.solves == 2  # one block instance + the non-block parts
    # tied embedding/head shard alike: vocab-parallel embedding iff colwise head
    assert (sol.styles["wte"] == "rowwise") == (sol.styles["lm_head"] == "colwise")


def test_tp1_is_all_replicate():
    g = gpt_graph(layers=2)
    sol = solve_tp(g, 1, H100)
    assert set(sol.styles.values()) == {"replicate"}
    assert sol.comm_s == 0 and sol.comm_bytes == {}
    assert set(sol.node_shard.values()) == {1}


def test_lone_linear_before_norm_is_not_sharded_into_an_all_gather():
    sol = solve_tp(lone_linear_graph(), 2, H100)
    assert sol.styles == {"proj": "replicate"}
    assert "all_gather" not in sol.comm_bytes


def test_attention_not_sharded_when_heads_do_not_divide():
    g = gpt_graph(layers=1, h=4096, heads=32, kv_heads=4)
    sol = solve_tp(g, 8, H100)
    att = next(n.id for n in g.nodes if n.kind == "attention")
    assert sol.node_shard[att] == 1


def _node(nid, target, shape, inputs=()):
    return GraphNode(
        id=nid,
        name=f"n{nid}",
        op="call_function",
        kind="reshape",
        target=target,
        inputs=inputs,
        out_shape=shape,
        out_dtype="bfloat16",
        out_bytes=2,
    )


def test_split_of_fused_qkv_does_not_keep_shard_but_head_dim_chunk_does():
    g = gpt_graph(layers=1)
    ilp = TPPlacementILP(g, [], 2, H100)
    g.nodes.append(_node(len(g.nodes), "split", (1, 8, 64)))
    src = g.nodes[-1]
    src.out_shape = (1, 8, 192)  # a fused qkv output
    fused = _node(len(g.nodes), "split", (1, 8, 64), inputs=(src.id,))
    g.nodes.append(fused)
    assert not ilp._keeps_shard(fused)
    rot_src = _node(len(g.nodes), "view", (1, 8, 4, 16))
    g.nodes.append(rot_src)
    rot = _node(len(g.nodes), "chunk", (1, 8, 4, 8), inputs=(rot_src.id,))
    g.nodes.append(rot)
    assert ilp._keeps_shard(rot)
    assert "pass-S" not in [s.name for s in ilp.node_strategies(fused)]


def test_segment_relative_styles():
    g = gpt_graph(layers=2, h=4096, heads=32)
    a, b = g.blocks[0].node_ranges[1]
    sol = solve_segment(g, list(range(a, b)), 4, H100, prefix="blocks.1")
    assert sol.rel_styles == TEXTBOOK


def test_bad_tp_degree():
    with pytest.raises(ValueError, match="tp must be >= 1"):
        TPPlacementILP(gpt_graph(layers=1), [], 0, H100)


def test_fused_qkv_split_is_never_consumed_sharded():
    from planner_fixtures import fused_qkv_graph

    g = fused_qkv_graph()
    sol = solve_tp(g, 4, H100)
    split = next(n.id for n in g.nodes if n.target == "split")
    assert sol.node_state[split] not in ("S", "P")  # each rank would hold the wrong slice of [q|k|v]
    if sol.styles["qkv"] == "colwise":  # then its output is gathered before the split...
        assert sol.gathered == {"qkv"}
        assert "all_gather" in sol.comm_bytes
    att = next(n.id for n in g.nodes if n.kind == "attention")
    # nothing in torch's TP styles slices q/k/v again after the split: the attention runs whole
    # (costed as such), and the output projection slices its whole input (rowwise, Replicate in)
    assert sol.node_shard[att] == 1


def _as_highs_sees_it(prob) -> tuple:
    """The problem as pulp hands it to HiGHS: columns by name with bounds, category and cost;
    rows with their bounds and nonzero coefficients in order (floats, signed zeros kept)."""
    f = float.__repr__
    obj = prob.objective or {}
    cols = [(v.name, v.lowBound, v.upBound, v.cat, f(float(obj.get(v, 0.0)))) for v in prob.variables()]
    bound = lambda b: None if b is None else f(float(b))  # noqa: E731
    rows = [(c.name, bound(c.getLb()), bound(c.getUb()), [(v.name, f(float(x))) for v, x in c.items() if x != 0])
            for c in prob.constraints()]  # fmt: skip
    return cols, rows


def test_rows_equal_pulps_operator_arithmetic():
    """``TPPlacementILP._row`` gives each family's row exactly as pulp's operators build it."""
    import pulp

    prob = pulp.LpProblem("p", pulp.LpMinimize)
    w, x1, x2, x3, g = (prob.add_variable(n, cat="Binary") for n in ("w", "x1", "x2", "x3", "g"))
    ilp = TPPlacementILP(gpt_graph(layers=1), [], 2, H100)
    ilp.prob = pulp.LpProblem("q", pulp.LpMinimize)
    EQ, LE, GE = pulp.LpConstraintEQ, pulp.LpConstraintLE, pulp.LpConstraintGE
    cases = [
        (pulp.lpSum([x1, x2]) == 1, [(x1, 1), (x2, 1)], EQ, -1.0),  # one_strategy
        (pulp.lpSum([x1]) + pulp.lpSum([x2, x3]) <= 1, [(x1, 1), (x2, 1), (x3, 1)], LE, -1.0),  # edge_allowed
        (w >= pulp.lpSum([x1]) + pulp.lpSum([x2, x3]) - 1, [(w, 1), (x1, -1), (x2, -1), (x3, -1)], GE, 1.0),
        (x1 == 0, [(x1, 1)], EQ, 0),  # boundary_in / boundary_out / tied / tp_group bans
        (w >= x1, [(w, 1), (x1, -1)], GE, 0),  # boundary_reshard
        (pulp.lpSum([x1]) == pulp.lpSum([x2, x3]), [(x1, 1), (x2, -1), (x3, -1)], EQ, 0.0),  # tied
        (pulp.lpSum([x1, x2]) == g, [(x1, 1), (x2, 1), (g, -1)], EQ, 0.0),  # tp_group
        (g == 0, [(g, 1)], EQ, 0),
        (g == 1, [(g, 1)], EQ, -1.0),  # tp_group: a group inside a block under sequence parallelism
        (pulp.lpSum([x1, x1]) <= 1, [(x1, 1), (x1, 1)], LE, -1.0),  # a repeated variable is summed
    ]
    for i, (con, terms, sense, constant) in enumerate(cases):
        prob += con, f"c__{i}"
        ilp._row(terms, sense, constant, f"c__{i}")
    assert _as_highs_sees_it(ilp.prob)[1] == _as_highs_sees_it(prob)[1]


@pytest.mark.parametrize("vocab_parallel", [False, True])
def test_rows_reused_across_buckets_give_the_fresh_problem_and_answer(vocab_parallel):
    """Rows built once per (segment, tp, layout) in the shared GraphIndex and re-used with another
    bucket's objective give the problem (as HiGHS sees it) and the placement of a fresh build."""
    from meshplan.planner.tp.graph import block_node_ids
    from meshplan.planner.tp.groups import GraphIndex

    g = gpt_graph(layers=2, h=4096, heads=32, seq=2048)
    a, b = g.blocks[0].node_ranges[0]
    rest = [n.id for n in g.nodes if n.id not in block_node_ids(g)]
    shared = GraphIndex(g)
    for ids in (list(range(a, b)), rest):
        for tp, sp in ((2, False), (8, True)):
            for scale in (1.0, 4.0, 16.0):
                kw = dict(sequence_parallel=sp, batch_scale=scale, vocab_parallel=vocab_parallel)
                reused = TPPlacementILP(g, ids, tp, H100, index=shared, **kw)
                fresh = TPPlacementILP(g, ids, tp, H100, index=GraphIndex(g), **kw)
                assert _as_highs_sees_it(reused.build()) == _as_highs_sees_it(fresh.build())
                r, f = reused.solve(), fresh.solve()
                assert (r.styles, r.node_shard, r.node_state) == (f.styles, f.node_shard, f.node_state)
                assert r.objective == f.objective and r.comm_s == f.comm_s
    assert len(shared.placements) == 4  # 2 segments x 2 (tp, sp): each bucket re-used them
