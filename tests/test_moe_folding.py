"""Megatron-Core's MoE parallel folding as an engine costing option (``estimate_graph(moe_folding=True)``):
tokens per tp rank, the expert mesh's ep group (consecutive ranks) and its link, the expert
data-parallel group of the expert gradients, the published Qwen3 rows that ran it, and the
Megatron adapter that reads it (``--expert-tensor-parallel-size 1``)."""

from __future__ import annotations

import copy
import functools

import pytest

from meshplan.commands.published_estimate import case_cluster, case_setup
from meshplan.cost_models.comm import collective_time_s, group_layout
from meshplan.cost_models.compute import node_time
from meshplan.cost_models.dp_kinds import dp_comm
from meshplan.cost_models.engine_profiles import MESHPLAN
from meshplan.cost_models.epcp import (
    ep_a2a_bytes,
    ep_comm_s,
    expert_mesh_groups,
    folded_expert_mesh,
    moe_tokens_per_rank,
)
from meshplan.cost_models.published import load_published_cases

FOLDED = [c for c in load_published_cases() if c["expert_config"].get("moe_folding")]


def _shrunk(case: dict) -> dict:
    """The case at pp·v layers and a small width (the layout and the degrees are the case's)."""
    c = copy.deepcopy(case)
    ex = c["expert_config"]
    ex.pop("blocks_per_stage", None)  # the engine's split is of the full model's layers
    c["model"].update(layers=(ex.get("pp") or 1) * (ex.get("interleave") or 1), hidden=512, heads=8,
                      kv_heads=4, head_dim=64, ffn_hidden=256, num_experts=max(16, ex["ep"]), vocab=4096)  # fmt: skip
    return c


@functools.cache
def _graph(case_id: str):  # noqa: ANN202
    from meshplan.loading import case_graph

    return case_graph(_shrunk(next(c for c in FOLDED if c["id"] == case_id)))


def test_expert_mesh_is_laid_out_on_its_own_as_megatrons_rank_generator():
    # Qwen3 TP4 PP8 EP8 on 256 GPUs: EDP = 256 / (8 * 8 * 1) = 4 (the readme's column)
    ep = expert_mesh_groups(256, 8, 8, "ep")
    assert ep[0] == list(range(8)) and ep[1] == list(range(8, 16))  # one 8-GPU node each
    assert expert_mesh_groups(256, 8, 8, "edp")[0] == [0, 8, 16, 24]
    # the pipeline groups equal the attention mesh's (Megatron asserts it): stride dp*tp = 32
    assert expert_mesh_groups(256, 8, 8, "pp")[0] == [32 * i for i in range(8)]
    m = folded_expert_mesh(32, 8)
    assert (m.ep, m.ep_stride, m.edp, m.edp_stride) == (8, 1, 4, 8)
    assert folded_expert_mesh(256, 8).edp == 32  # the TP2 FSDP128 row's EDP 32
    for axis, stride in (("ep", m.ep_stride), ("edp", m.edp_stride)):
        g = expert_mesh_groups(256, 8, 8, axis)[0]
        assert {b - a for a, b in zip(g, g[1:])} == {stride}
    with pytest.raises(ValueError, match="ep"):
        folded_expert_mesh(12, 8)
    with pytest.raises(ValueError, match="axis"):
        expert_mesh_groups(256, 8, 8, "tp")


def test_tokens_per_tp_rank_and_the_folded_ep_group_on_one_node():
    case = next(c for c in FOLDED if c["expert_config"]["tp"] == 4)
    g = _graph(case["id"])
    spec = case_cluster(case)
    from meshplan.planner.epcp_cost import epcp_terms

    moe = [n for n in g.nodes if n.kind == "moe"]
    kw = dict(cp=1, ep=8, micro_batch=32, dtype="bf16", capacity_factor=1.0, elem_bytes=2, tp=4, stride=4, dp=8)
    plain = epcp_terms(g, spec, **kw)
    fold = epcp_terms(g, spec, **kw, folding=True)
    assert moe_tokens_per_rank(4096, 4, True) == 1024 and moe_tokens_per_rank(4096, 4, False) == 4096
    # a tp rank dispatches its 1/tp sequence shard: a quarter of the all-to-all bytes
    assert fold.comm_bytes["all_to_all"] == pytest.approx(plain.comm_bytes["all_to_all"] / 4)
    # over 8 consecutive ranks (one NVLink node) instead of 8 ranks 4 apart (4 nodes)
    assert group_layout(8, 1, spec.devices_per_node)[0] == 1 and group_layout(8, 4, spec.devices_per_node)[0] == 4
    scale = 32 / max(1, g.batch_size)  # micro_batch 32: bandwidth-bound, not latency-bound
    want = sum(ep_comm_s(n.attrs["tokens"] * scale / 4, n.attrs["top_k"], n.attrs["hidden"], 2, 8, spec) for n in moe)
    assert fold.ep_comm_s == pytest.approx(want)
    one = ep_a2a_bytes(moe[0].attrs["tokens"] * scale / 4, moe[0].attrs["top_k"], moe[0].attrs["hidden"], 2)
    assert want == pytest.approx(4 * len(moe) * collective_time_s("all_to_all", one, 8, spec))  # intra-node
    assert fold.ep_comm_s < plain.ep_comm_s / 4
    # the expert-read term is taken against the node as the folded cost table times it (1/tp of the
    # tokens): its kernels on E/ep experts (cost_models.moe_kernels) less on all E
    def t(n, shard):  # noqa: ANN001, ANN202
        return (node_time(n, spec, shard=shard, batch_scale=scale, ep=8).total_s
                - node_time(n, spec, shard=shard, batch_scale=scale).total_s)  # fmt: skip

    assert fold.expert_read_s == pytest.approx(sum(t(n, 4) for n in moe))
    assert plain.expert_read_s == pytest.approx(sum(t(n, 1) for n in moe))
    # folding is a tp > 1 mechanism: at tp 1 the terms are meshplan's own
    assert epcp_terms(g, spec, **{**kw, "tp": 1, "stride": 1}, folding=True) == epcp_terms(
        g, spec, **{**kw, "tp": 1, "stride": 1})


def test_folded_cost_table_puts_the_moe_block_on_the_sequence_shard():
    """Under folding the TP placement keeps a MoE node sequence-sharded (Q→Q at shard tp): 1/tp of its
    time and saved activations per rank, no all-gather / reduce-scatter around it (its input and output
    stay on the sequence shard)."""
    from meshplan.planner.costing import GraphCoster

    case = next(c for c in FOLDED if c["expert_config"]["tp"] == 4)
    g = _graph(case["id"])
    spec = case_cluster(case)
    plain, fold = (GraphCoster(g, spec, profile=MESHPLAN.but(vocab_parallel_embedding=True), moe_folding=f) for f in (False, True))
    tp, tf = plain.table(4, True, "none", 1), fold.table(4, True, "none", 1)
    moe = [n for n in g.nodes if n.kind == "moe"]
    assert all(tf.tp_solution.node_shard.get(n.id) == 4 and tf.tp_solution.node_state[n.id] == "Q" for n in moe)
    assert all(tp.tp_solution.node_shard.get(n.id, 1) == 1 for n in moe)
    block = next(i for i, x in enumerate(tp.layers) if x.kind == "block")
    lp, lf = tp.layers[block], tf.layers[block]
    scale = 1 / max(1, g.batch_size)
    n0 = next(n for n in moe if lp.node_start <= n.id < lp.node_end)
    saved = node_time(n0, spec, batch_scale=scale).total_s - node_time(n0, spec, shard=4, batch_scale=scale).total_s
    def compute(x):  # noqa: ANN001, ANN202
        return x.fwd_s + x.bwd_input_s + x.bwd_weight_s

    # the block's MoE at 1/tp of the tokens (and the ops around it stay on the shard too)
    assert compute(lp) - compute(lf) >= 0.98 * saved > 0
    assert lf.act_bytes < lp.act_bytes  # the MoE block's saved activations: its sequence shard's


def test_expert_gradients_are_reduced_over_the_expert_data_parallel_group():
    from meshplan.planner.search import Searcher
    from meshplan.planner.search_types import Config
    from meshplan.planner.state_costs import add_dp_comm

    case = next(c for c in FOLDED if c["expert_config"]["tp"] == 4)
    g = _graph(case["id"])
    spec = case_cluster(case)
    s = Searcher(g, spec, global_batch=2048, fixed={"tp": 4, "pp": 8, "dp": 8, "ep": 8})
    c = Config(8, 4, 8, 1, 256, "interleaved-1f1b", 4, "none", True, "zero1", 1, 8)
    assert s.costs.ep_cp.expert_dp_group(c) == (8 // 8, 4 * 8)  # meshplan's runtime: dp/ep replicas, tp*ep apart
    s.costs.ep_cp.moe_folding = True
    assert s.costs.ep_cp.expert_dp_group(c) == (4, 8)  # folded: EDP = dp*tp/ep = 4 ranks, ep apart
    exp = 1e9  # expert parameters a rank holds
    d = s.costs.states.dp_collectives_split(10e9, 20e9, exp, c)
    dense = s.costs.states.dp_collectives(10e9 - exp * 2, 20e9 - exp * 4, c)
    edp = dp_comm("zero1", exp * 4, exp * 2, 4, spec, stride=8, pp=8, num_microbatches=256, units=len(g.blocks) + 1)
    assert d == add_dp_comm(dense, edp) and d.sync_s > dense.sync_s
    assert edp.bytes["reduce_scatter"] == int(exp * 4)
    # model states of the experts sharded over the 4 EDP ranks, not the 8 dp ranks
    assert s.costs.states.expert_state_bytes_per_param(c).optimizer == pytest.approx(2 * s.costs.states.state_bytes_per_param(c).optimizer)


def test_estimate_graph_checks_the_folding_option():
    from meshplan.planner.api import estimate_graph

    case = next(c for c in FOLDED if c["expert_config"]["tp"] == 2)
    g = _graph(case["id"])
    spec = case_cluster(case)
    with pytest.raises(ValueError, match="sequence_parallel"):
        estimate_graph(g, 256, cluster=spec, tp=2, pp=1, dp=128, ep=8, global_batch_size=2048, micro_batch_size=4,
                       sequence_parallel=False, moe_folding=True)  # fmt: skip
    kw = dict(cluster=case_cluster({**case, "cluster": {**case["cluster"], "n_gpus": 32}}), tp=4, pp=1, dp=8, ep=8,
              global_batch_size=8, micro_batch_size=1, sequence_parallel=True)
    p = estimate_graph(g, 32, **kw, moe_folding=True)
    assert any("MoE parallel folding costed" in n and "8 consecutive ranks" in n and "over 4 expert" in n
               for n in p.notes)
    # folded, ep need only divide dp·cp·tp (the stage's expert ranks); unfolded it borrows dp·cp ranks
    with pytest.raises(ValueError, match="dp·cp = 4 .*moe_folding"):
        estimate_graph(g, 16, **{**kw, "cluster": kw["cluster"].with_devices(16), "dp": 4})
    with pytest.raises(ValueError, match="dp·cp·tp = 8"):
        estimate_graph(g, 16, **{**kw, "cluster": kw["cluster"].with_devices(16), "dp": 2, "pp": 2, "ep": 16},
                       moe_folding=True)  # fmt: skip


def test_ep_spanning_tensor_parallel_ranks_is_costed_folded_and_refused_at_run():
    """Megatron's folding regroups a stage's dp·cp·tp ranks as ep x EDP: at dp 8, tp 4 on 32 GPUs an ep
    of 16 (> dp·cp) is two nodes of consecutive ranks, EDP 2; the runtime refuses it in one line."""
    from meshplan.plan import Plan
    from meshplan.planner.api import estimate_graph
    from meshplan.runtime.apply.epcp import epcp_blocker

    case = next(c for c in FOLDED if c["expert_config"]["tp"] == 4)
    g = _graph(case["id"])
    kw = dict(cluster=case_cluster({**case, "cluster": {**case["cluster"], "n_gpus": 32}}), tp=4, pp=1, dp=8,
              global_batch_size=8, micro_batch_size=1, sequence_parallel=True, moe_folding=True,
              profile=case_setup(case)["profile"])  # fmt: skip
    one_node, two_nodes = (estimate_graph(g, 32, ep=ep, **kw) for ep in (8, 16))
    assert two_nodes.ep == 16 and two_nodes.mesh.dp * two_nodes.mesh.cp == 8
    assert any("over 2 expert data-parallel ranks" in n for n in two_nodes.notes)  # EDP = 32 / 16
    assert any("does not divide dp·cp = 8" in n and "not executed" in n for n in two_nodes.notes)
    assert not any("does not divide dp·cp" in n for n in one_node.notes)
    p, q = two_nodes.predicted, one_node.predicted
    assert p.ep_comm_s > 2 * q.ep_comm_s  # the group crosses the NIC
    assert p.mem_breakdown["params"] < q.mem_breakdown["params"]  # half the experts per rank
    back = Plan.from_json(two_nodes.to_json())  # the plan file holds it ...
    assert back.ep == 16
    why = epcp_blocker(None, back)  # ... and the runtime refuses it before touching the model
    assert "ep=16 does not divide dp·cp = 8" in why and "\n" not in why


def test_dense_model_refuses_folding():
    import torch

    from meshplan.models.llama import Llama, LlamaConfig
    from meshplan.planner.api import estimate_graph
    from meshplan.trace import trace_model

    m = Llama(LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, dim=32, ffn_hidden=64, vocab_size=64, max_seq_len=16))
    g = trace_model(m, (torch.randint(0, 64, (1, 16)),))
    with pytest.raises(ValueError, match="MoE"):
        estimate_graph(g, 2, tp=2, pp=1, dp=1, cluster="h100", moe_folding=True)


@pytest.mark.parametrize("case_id", [c["id"] for c in FOLDED])
def test_published_qwen3_rows_are_costed_folded(case_id, monkeypatch):
    from meshplan.commands.published_estimate import estimate_case
    from meshplan.cost_models import hardware
    from meshplan.report.explain import explain_plan

    # the device's terms: the shrunk rows are host-bound on the presets (cost_models.host), where the
    # host's time would hide the folded MoE compute this checks
    monkeypatch.setattr(hardware, "HOST_H200", {})

    case = _shrunk(next(c for c in FOLDED if c["id"] == case_id))
    assert case_setup(case)["moe_folding"] is True
    g = _graph(case_id)
    r = estimate_case(case, g)
    unfolded = {**case, "expert_config": {**case["expert_config"], "moe_folding": False}}
    ex = case["expert_config"]
    if ex["dp"] * (ex.get("cp") or 1) % ex["ep"]:  # an ep spanning tp ranks: only folded
        with pytest.raises(ValueError, match="moe_folding"):
            estimate_case(unfolded, g)
        assert any("MoE parallel folding costed" in n for n in r["plan"].notes)
        return
    plain = estimate_case(unfolded, g)
    p, q = r["plan"].predicted, plain["plan"].predicted
    assert any("MoE parallel folding costed" in n for n in r["plan"].notes)
    assert not any("MoE parallel folding" in n for n in plain["plan"].notes)
    assert p.ep_comm_s < q.ep_comm_s / case["expert_config"]["tp"]  # 1/tp of the tokens, inside a node
    assert p.compute_s < q.compute_s  # 1/tp of the MoE compute
    assert "MoE parallel folding" in explain_plan(r["plan"])
    assert "replicated over tp" in explain_plan(plain["plan"])
    # Mixtral (tp 1, MCore v0.8) is not folded
    mixtral = [c for c in load_published_cases() if c["id"].startswith("mcore-mixtral")]
    assert all(case_setup(c)["moe_folding"] is False for c in mixtral)


def test_megatron_arguments_carry_folding():
    from meshplan.engines import megatron

    args = ("--tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 --expert-model-parallel-size 8 "
            "--sequence-parallel --micro-batch-size 1 --global-batch-size 64 --bf16")  # fmt: skip
    assert megatron.parse(args, 64).spec.moe_folding is False  # ETP defaults to TP (arguments.py)
    spec = megatron.parse(args + " --expert-tensor-parallel-size 1", 64).spec
    assert spec.moe_folding is True and "--expert-tensor-parallel-size 1" in megatron.export(spec)
    assert any("MoE parallel folding" in n for n in megatron.parse(args + " --expert-tensor-parallel-size 1", 64).notes)
    assert megatron.parse(args + " --expert-tensor-parallel-size 4", 64).spec.moe_folding is False
    with pytest.raises(ValueError, match="sequence-parallel"):
        megatron.parse(args.replace("--sequence-parallel ", "") + " --expert-tensor-parallel-size 1", 64)
    with pytest.raises(ValueError, match="expert-tensor-parallel-size 2"):
        megatron.parse(args + " --expert-tensor-parallel-size 2", 64)


def test_megatron_estimate_costs_folding_and_meshplans_own_plans_do_not():
    from meshplan.api.engine_cost import cost_spec
    from meshplan.engines import megatron

    case = next(c for c in FOLDED if c["expert_config"]["tp"] == 4)
    g = _graph(case["id"])
    spec = megatron.parse("--tensor-model-parallel-size 4 --pipeline-model-parallel-size 8 "
                          "--num-virtual-stages-per-pipeline-rank 4 --expert-model-parallel-size 8 "
                          "--expert-tensor-parallel-size 1 --sequence-parallel --micro-batch-size 1 "
                          "--global-batch-size 256 --bf16 --use-distributed-optimizer", 256).spec  # fmt: skip
    cl = case_cluster(case)
    folded = cost_spec(g, spec, cl, "megatron")
    assert any("MoE parallel folding costed" in n for n in folded.notes)
    own = cost_spec(g, spec, cl, None)  # meshplan's own costing of the same degrees: its runtime's layout
    assert not any("MoE parallel folding" in n for n in own.notes)
    # its runtime runs no sequence parallelism through a MoE block (the router replicated): said, as epcp's notes
    assert any("sequence_parallel=True at tp=4: meshplan's runtime cannot run it" in n for n in own.notes)
    assert folded.predicted.ep_comm_s < own.predicted.ep_comm_s


def test_megatron_estimate_costs_an_ep_spanning_tp_ranks_and_meshplans_own_refuses_it():
    from meshplan.api.engine_cost import cost_spec
    from meshplan.engines import megatron

    case = next(c for c in FOLDED if c["expert_config"]["tp"] == 4)
    g = _graph(case["id"])
    cl = case_cluster({**case, "cluster": {**case["cluster"], "n_gpus": 32}})
    spec = megatron.parse("--tensor-model-parallel-size 4 --expert-model-parallel-size 16 --expert-tensor-parallel-size 1 "
                          "--sequence-parallel --micro-batch-size 1 --global-batch-size 8 --bf16", 32).spec  # fmt: skip
    p = cost_spec(g, spec, cl, "megatron")  # dp 8 < ep 16: the expert group spans tp ranks
    assert p.ep == 16 and any("over 2 expert data-parallel ranks" in n for n in p.notes)
    with pytest.raises(ValueError, match="needs moe_folding"):
        cost_spec(g, spec, cl, None)  # meshplan's own costing: its runtime's layout
