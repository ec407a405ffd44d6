"""NCCL-style collectives across nodes (cost_models.comm.nccl_collective, group_layout)."""

from __future__ import annotations

import math

import pytest

from meshplan.cost_models.comm import TREE_BW_FACTOR, collective_time_s, group_layout, nccl_collective
from meshplan.cost_models.hardware import ClusterSpec

H100 = ClusterSpec.preset("h100", num_nodes=256)
NVL, NIC = 450e9 * 0.8, 50e9 * 0.8  # per GPU per direction × comm_efficiency


def test_ring_across_nodes_uses_the_nodes_nics_together() -> None:
    n, k = 2e9, 32  # 4 nodes × 8 ranks: 8 NICs carry the rings, capped by NVLink
    algo, t = nccl_collective("all_reduce", n, k, H100, ranks_per_node=8)
    bus = min(NVL, 8 * NIC)
    assert algo == "ring"
    assert t == pytest.approx(2 * 31 / 32 * n / bus + 2 * 31 * 1e-5)
    flat = collective_time_s("all_reduce", n, k, H100, spans_nodes=True)  # one NIC (r = 1)
    assert flat == pytest.approx(2 * 31 / 32 * n / NIC + 2 * 31 * 1e-5)
    assert flat / t > 7  # the old flat ring on one GPU's NIC was 8x too slow


def test_one_rank_per_node_is_the_single_nic_ring() -> None:
    n = 1e9
    assert nccl_collective("reduce_scatter", n, 16, H100, ranks_per_node=1)[1] == pytest.approx(
        15 / 16 * n / NIC + 15 * 1e-5
    )


def test_tree_wins_small_messages_on_many_nodes_ring_wins_large() -> None:
    k, r = 2048, 8
    algo_s, t_small = nccl_collective("all_reduce", 1e6, k, H100, ranks_per_node=r)
    algo_l, t_large = nccl_collective("all_reduce", 1e10, 16, H100, ranks_per_node=8)
    assert algo_s == "tree" and algo_l == "ring"
    bus = min(NVL, r * NIC)
    want = 2 * (k - 1) / k * 1e6 / (bus * TREE_BW_FACTOR) + 2 * (7 * 5e-6 + math.ceil(math.log2(256)) * 1e-5)
    assert t_small == pytest.approx(want)


def test_intra_node_and_p2p_and_all_to_all() -> None:
    n = 1e8
    assert nccl_collective("all_gather", n, 8, H100, ranks_per_node=8) == ("ring", 7 / 8 * n / NVL + 7 * 5e-6)
    assert nccl_collective("send_recv", n, 2, H100, ranks_per_node=1) == ("p2p", pytest.approx(n / NIC + 1e-5))
    # all-to-all over 16 ranks on 2 nodes: the off-node half leaves through each rank's own NIC
    t = nccl_collective("all_to_all", n, 16, H100, ranks_per_node=8)[1]
    assert t == pytest.approx(max(7 / 16 * n / NVL, 8 / 16 * n / NIC) + 15 * 1e-5)
    assert nccl_collective("all_reduce", 0, 8, H100, ranks_per_node=8) == ("none", 0.0)
    with pytest.raises(ValueError, match="ranks_per_node"):
        nccl_collective("all_reduce", 1, 8, H100, ranks_per_node=0)


def test_group_layout() -> None:
    assert group_layout(8, 1, 8) == (1, 8)  # tp inside a node
    assert group_layout(16, 4, 8) == (8, 2)  # dp of (dp, tp) = (16, 4)
    assert group_layout(4, 8, 8) == (4, 1)  # dp of (dp, tp) = (4, 8)
    assert group_layout(128, 1, 8) == (16, 8)  # FSDP over 16 nodes
    assert group_layout(2, 2, 8) == (1, 2)
    with pytest.raises(ValueError, match="stride"):
        group_layout(2, 0, 8)
