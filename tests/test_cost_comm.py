"""Communication cost model (cost_models.comm): ring collectives and mesh-axis layout."""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.cost_models.comm import (
    COLLECTIVES,
    axis_collective_time_s,
    axis_group_stride,
    axis_groups,
    axis_nodes_spanned,
    axis_spans_nodes,
    collective_time_s,
    hierarchical_all_reduce_time_s,
)
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.plan import MeshSpec

H100 = ClusterSpec.preset("h100", num_nodes=4)


def test_ring_all_reduce_hand_arithmetic() -> None:
    # 1 GB over 8 H100s in a node: NVLink 450 GB/s per direction × 0.8, α = 5 µs
    n, k = 1e9, 8
    bw = 450e9 * 0.8
    want = 2 * (k - 1) / k * n / bw + 2 * (k - 1) * 5e-6
    assert collective_time_s("all_reduce", n, k, H100) == pytest.approx(want, rel=1e-12)
    assert want == pytest.approx(4.861e-3 + 7e-5, rel=1e-3)  # 4.93 ms by hand


def test_spanning_group_pays_inter_node_link() -> None:
    n, k = 1e9, 32
    want = 2 * (k - 1) / k * n / (50e9 * 0.8) + 2 * (k - 1) * 1e-5
    assert collective_time_s("all_reduce", n, k, H100, spans_nodes=True) == pytest.approx(want)
    assert collective_time_s("all_reduce", n, k, H100, spans_nodes=True) > collective_time_s(
        "all_reduce", n, k, H100
    )


def test_other_collectives() -> None:
    n, k = 64e6, 4
    c = dataclasses.replace(H100, comm_efficiency=1.0)
    bw, a = c.intra_bw_bytes_per_s, c.intra_latency_s
    assert collective_time_s("all_gather", n, k, c) == pytest.approx(3 / 4 * n / bw + 3 * a)
    assert collective_time_s("reduce_scatter", n, k, c) == pytest.approx(3 / 4 * n / bw + 3 * a)
    assert collective_time_s("all_to_all", n, k, c) == pytest.approx(3 / 4 * n / bw + 3 * a)
    assert collective_time_s("broadcast", n, k, c) == pytest.approx(n / bw + 3 * a)
    assert collective_time_s("send_recv", n, 2, c) == pytest.approx(n / bw + a)
    # all-reduce == reduce-scatter + all-gather in the ring model
    assert collective_time_s("all_reduce", n, k, c) == pytest.approx(
        collective_time_s("reduce_scatter", n, k, c) + collective_time_s("all_gather", n, k, c)
    )
    for kind in COLLECTIVES:
        assert collective_time_s(kind, n, 1, c) == 0.0
        assert collective_time_s(kind, 0, 8, c) == 0.0


def test_collective_errors() -> None:
    with pytest.raises(ValueError, match="kind"):
        collective_time_s("allreduce", 1, 2, H100)
    with pytest.raises(ValueError, match="group_size"):
        collective_time_s("all_reduce", 1, 0, H100)
    with pytest.raises(ValueError, match="nbytes"):
        collective_time_s("all_reduce", -1, 2, H100)


def test_hierarchical_all_reduce_beats_flat_inter_ring() -> None:
    n = 1e9
    hier = hierarchical_all_reduce_time_s(n, 8, 4, H100)
    flat = collective_time_s("all_reduce", n, 32, H100, spans_nodes=True)
    rs = 7 / 8 * n / (450e9 * 0.8) + 7 * 5e-6
    ar = 2 * 3 / 4 * (n / 8) / (50e9 * 0.8) + 2 * 3 * 1e-5
    assert hier == pytest.approx(2 * rs + ar)
    assert hier < flat


def test_axis_layout_innermost_stays_in_node() -> None:
    mesh = MeshSpec(("pp", "dp", "tp"), (4, 8, 8))  # 256 ranks on 8-GPU nodes
    assert axis_group_stride(mesh, "tp") == 1
    assert axis_group_stride(mesh, "dp") == 8
    assert axis_group_stride(mesh, "pp") == 64
    assert not axis_spans_nodes(mesh, "tp", 8)
    assert axis_spans_nodes(mesh, "dp", 8) and axis_spans_nodes(mesh, "pp", 8)
    assert axis_nodes_spanned(mesh, "dp", 8) == 8
    small = MeshSpec(("dp", "tp"), (2, 4))
    assert not axis_spans_nodes(small, "dp", 8) and not axis_spans_nodes(small, "tp", 8)
    # a tp group of 4 on 6-GPU nodes: the group {4, 5, 6, 7} crosses a node boundary
    assert axis_spans_nodes(MeshSpec(("dp", "tp"), (3, 4)), "tp", 6)
    assert axis_groups(MeshSpec(("dp", "tp"), (2, 2)), "dp") == [[0, 2], [1, 3]]
    assert not axis_spans_nodes(MeshSpec(("dp", "tp"), (1, 8)), "dp", 8)  # degree 1
    with pytest.raises(ValueError, match="no axis"):
        axis_spans_nodes(mesh, "cp", 8)


def test_axis_collective_picks_link() -> None:
    mesh = MeshSpec(("dp", "tp"), (4, 8))
    n = 1e8
    assert axis_collective_time_s("all_reduce", n, mesh, "tp", H100) == collective_time_s(
        "all_reduce", n, 8, H100
    )
    # dp groups hold one rank per node: a flat ring over the inter-node link
    assert axis_collective_time_s("all_reduce", n, mesh, "dp", H100) == pytest.approx(
        collective_time_s("all_reduce", n, 4, H100, spans_nodes=True)
    )
    # dp over 32 ranks, 8 per node: the NCCL model on the node's 8 NICs, no slower than two-level
    wide = MeshSpec(("dp",), (32,))
    assert axis_collective_time_s("all_reduce", n, wide, "dp", H100) == pytest.approx(
        collective_time_s("all_reduce", n, 32, H100, ranks_per_node=8)
    )
    assert axis_collective_time_s("all_reduce", n, wide, "dp", H100) <= hierarchical_all_reduce_time_s(n, 8, 4, H100)
    assert axis_collective_time_s("all_reduce", n, wide, "dp", H100, hierarchical=False) == pytest.approx(
        collective_time_s("all_reduce", n, 32, H100, spans_nodes=True)
    )


def test_a_few_bytes_all_reduce_is_priced_at_nccls_ll_latency() -> None:
    """An all-reduce of a few bytes (an fp8 amax) at NCCL's LL-protocol latency (v2.21.5 tuning.cc): in one
    node 6.6 + 2(k-1)·0.6 µs; across nodes the faster of the LL ring and the LL tree; several times below the
    ring model's Simple-protocol α, which stays for larger messages."""
    from meshplan.cost_models.comm import group_collective_s, latency_bound_all_reduce_s
    from meshplan.cost_models.hardware import resolve_cluster

    h100 = resolve_cluster("h100", 512)
    assert latency_bound_all_reduce_s(4, 1, h100) == 0.0
    assert latency_bound_all_reduce_s(0, 8, h100) == pytest.approx(15.0e-6)  # 6.6 + 14 x 0.6
    assert latency_bound_all_reduce_s(0, 4, h100) == pytest.approx(10.2e-6)
    # 128 ranks on 16 nodes: tree 6.8 + 2 (7 x 0.6 + 4 x 5.0) = 55.2 µs beats the ring's 254 steps
    assert latency_bound_all_reduce_s(0, 128, h100) == pytest.approx(55.2e-6)
    assert latency_bound_all_reduce_s(4, 8, h100) < group_collective_s("all_reduce", 4, 8, h100) / 4
