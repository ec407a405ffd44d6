"""TP, PP, EP and CP terms priced with their real group layout (cost_models.comm.group_collective_s,
p2p_crosses_nodes, p2p_time_s) and the planner using them per pipeline boundary."""

from __future__ import annotations

import pytest
from planner_fixtures import gpt_graph

from meshplan.cost_models.comm import (
    group_collective_s,
    nccl_collective,
    p2p_crosses_nodes,
    p2p_time_s,
)
from meshplan.cost_models.epcp import cp_ring_exposed_s, ep_comm_s
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.planner.search import Searcher
from meshplan.planner.search_types import Config
from meshplan.planner.tp.ilp import collective_time

H100 = ClusterSpec.preset("h100", num_nodes=4)
NVL, NIC = 450e9 * 0.8, 50e9 * 0.8  # per GPU per direction × comm_efficiency


def test_tp_inside_a_node_runs_on_nvlink_and_tp16_on_the_nodes_nics() -> None:
    n = 64e6
    assert group_collective_s("all_reduce", n, 8, H100) == pytest.approx(2 * 7 / 8 * n / NVL + 2 * 7 * 5e-6)
    # tp 16 on 8-GPU nodes: 2 nodes x 8 ranks, the ring on 8 NICs (not one GPU's NIC)
    t16 = group_collective_s("all_reduce", n, 16, H100)
    assert t16 == nccl_collective("all_reduce", n, 16, H100, ranks_per_node=8)[1]
    assert t16 < nccl_collective("all_reduce", n, 16, H100, ranks_per_node=1)[1] / 4
    # the TP placement ILP prices its collectives the same way (+ one launch)
    assert collective_time("all_reduce", n, 16, H100) == pytest.approx(t16 + H100.kernel_floor_s)
    assert collective_time("all_gather", n, 4, H100) == pytest.approx(
        group_collective_s("all_gather", n, 4, H100) + H100.kernel_floor_s
    )


def test_group_with_one_rank_per_node_uses_one_nic() -> None:
    n = 1e9
    # 4 ranks 8 apart: one per node
    assert group_collective_s("all_gather", n, 4, H100, stride=8) == pytest.approx(3 / 4 * n / NIC + 3 * 1e-5)
    assert group_collective_s("all_gather", n, 1, H100, stride=8) == 0.0


def test_pipeline_boundaries_cross_nodes_only_where_the_mesh_puts_them() -> None:
    # pp 4 over stages of dp*tp = 4 ranks on 8-GPU nodes: ranks 0-7 hold pipeline ranks 0 and 1
    assert [p2p_crosses_nodes(i, i + 1, 4, 8) for i in range(3)] == [False, True, False]
    assert all(p2p_crosses_nodes(i, i + 1, 8, 8) for i in range(3))  # a stage fills a node
    assert not any(p2p_crosses_nodes(i, i + 1, 1, 8) for i in range(7))  # pp 8 inside one node
    assert p2p_crosses_nodes(3, 0, 2, 8) is False and p2p_crosses_nodes(3, 4, 2, 8) is True
    assert p2p_crosses_nodes(0, 1, 3, 8) is False and p2p_crosses_nodes(2, 3, 3, 8) is True  # unaligned
    with pytest.raises(ValueError, match="stride"):
        p2p_crosses_nodes(0, 1, 0, 8)


def test_p2p_intra_node_is_nvlink_inter_node_one_nic() -> None:
    n = 32e6
    assert p2p_time_s(n, H100, crosses_nodes=False) == pytest.approx(n / NVL + 5e-6)
    assert p2p_time_s(n, H100, crosses_nodes=True) == pytest.approx(n / NIC + 1e-5)


def test_planner_prices_each_pipeline_boundary_on_its_own_link() -> None:
    g = gpt_graph(layers=8, h=1024, heads=16, seq=1024, vocab=8192)
    cluster = H100.with_devices(16)  # 2 nodes
    s = Searcher(g, cluster, global_batch=16)
    c = Config(dp=1, tp=4, pp=4, micro_batch=1, num_microbatches=16, schedule="1f1b", virtual_stages=1,
               recompute="none", sequence_parallel=False, dp_kind="none")  # fmt: skip
    ev = s.costs.evaluate(c)
    sends = [x[3] for x in ev.stage_times]
    b = ev.stage_send_bytes
    assert sends[0] == pytest.approx(p2p_time_s(b[0], cluster, crosses_nodes=False))  # ranks 0-3 -> 4-7
    assert sends[1] == pytest.approx(p2p_time_s(b[1], cluster, crosses_nodes=True))  # ranks 4-7 -> 8-11
    assert sends[2] == pytest.approx(p2p_time_s(b[2], cluster, crosses_nodes=False))
    assert sends[3] == 0.0  # the last stage sends nothing on
    assert sends[1] > 5 * sends[0]
    # tp 8: every stage fills a node, every boundary crosses
    c8 = Config(dp=1, tp=8, pp=2, micro_batch=1, num_microbatches=16, schedule="1f1b", virtual_stages=1,
                recompute="none", sequence_parallel=False, dp_kind="none")  # fmt: skip
    ev8 = s.costs.evaluate(c8)
    assert ev8.stage_times[0][3] == pytest.approx(p2p_time_s(ev8.stage_send_bytes[0], cluster, crosses_nodes=True))


def test_ep_all_to_all_and_cp_ring_take_the_group_layout() -> None:
    tokens, k, h = 8192, 2, 4096
    inside = ep_comm_s(tokens, k, h, 2, 8, H100, stride=1)  # 8 consecutive ranks: NVLink
    spread = ep_comm_s(tokens, k, h, 2, 8, H100, stride=4)  # tp 4: the ep group spans 4 nodes
    n = tokens * k * h * 2
    assert inside == pytest.approx(4 * group_collective_s("all_to_all", n, 8, H100))
    assert spread == pytest.approx(4 * nccl_collective("all_to_all", n, 8, H100, ranks_per_node=2)[1])
    assert spread > 3 * inside
    kv = 16e6
    assert cp_ring_exposed_s(kv, 4, 0.0, H100, stride=1) == pytest.approx(6 * p2p_time_s(kv, H100, crosses_nodes=False))
    assert cp_ring_exposed_s(kv, 4, 0.0, H100, stride=4) == pytest.approx(6 * p2p_time_s(kv, H100, crosses_nodes=True))
