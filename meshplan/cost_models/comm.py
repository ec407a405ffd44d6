"""Communication time: the alpha-beta (latency-bandwidth) ring model of collectives on a ClusterSpec.

Owns ``collective_time_s`` (all_reduce, all_gather, reduce_scatter, broadcast, all_to_all,
send_recv), ``hierarchical_all_reduce_time_s`` (the two-level variant NCCL uses across nodes) and
the mesh-layout helpers that say which mesh axes stay inside a node: ranks are laid out row-major
over ``MeshSpec.axis_names`` (outermost first), so the innermost axes are consecutive ranks.

Model (Patarasuk & Yuan 2009; Thakur, Rabenseifner & Gropp 2005; NCCL docs "performance"), with
k ranks, n bytes, α the link latency and β = 1 / (link bandwidth · comm_efficiency)::

    all_reduce      2·(k−1)/k · n·β + 2·(k−1)·α
    all_gather      (k−1)/k · n·β + (k−1)·α          n = the gathered (full) size
    reduce_scatter  (k−1)/k · n·β + (k−1)·α          n = the input (full) size
    all_to_all      (k−1)/k · n·β + (k−1)·α          n = each rank's send buffer
    broadcast       n·β + (k−1)·α                    pipelined ring (chunks stream down the chain)
    send_recv       n·β + α                          one point-to-point message

A group that spans nodes pays the inter-node link (per-device NIC, per direction) for the whole
ring: the slowest hop sets a ring's pace. No torch import.
"""

from __future__ import annotations

from meshplan.cost_models.hardware import ClusterSpec
from meshplan.plan import MeshSpec

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv")


def link(cluster: ClusterSpec, spans_nodes: bool) -> tuple[float, float]:
    """(α seconds, effective bandwidth bytes/s) of the link a group uses: inter-node if it spans nodes."""
    if spans_nodes:
        return cluster.inter_latency_s, cluster.inter_bw_bytes_per_s * cluster.comm_efficiency
    return cluster.intra_latency_s, cluster.intra_bw_bytes_per_s * cluster.comm_efficiency


def collective_time_s(
    kind: str, nbytes: float, group_size: int, cluster: ClusterSpec, *, spans_nodes: bool = False
) -> float:
    """Seconds for one collective of ``nbytes`` over ``group_size`` ranks (alpha-beta ring model).

    Formulas in the module docstring (all_reduce: ``2(k−1)/k·n/bw + 2(k−1)·α``; all_gather,
    reduce_scatter, all_to_all: ``(k−1)/k·n/bw + (k−1)·α``; broadcast: ``n/bw + (k−1)·α``;
    send_recv: ``n/bw + α``), with ``bw = link bandwidth · cluster.comm_efficiency`` and the
    inter-node link when ``spans_nodes``. A group of one rank, or 0 bytes, costs 0.
    Unit: seconds. Source: Patarasuk & Yuan 2009; NCCL performance docs; FORMULAS.md.
    """
    if kind not in COLLECTIVES:
        raise ValueError(f"collective kind {kind!r} unknown; use one of {COLLECTIVES}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    k = group_size
    if k == 1 or nbytes == 0:
        return 0.0
    alpha, bw = link(cluster, spans_nodes)
    if kind == "all_reduce":
        return 2 * (k - 1) / k * nbytes / bw + 2 * (k - 1) * alpha
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (k - 1) / k * nbytes / bw + (k - 1) * alpha
    if kind == "broadcast":
        return nbytes / bw + (k - 1) * alpha
    return nbytes / bw + alpha  # send_recv


def hierarchical_all_reduce_time_s(
    nbytes: float, ranks_per_node: int, num_nodes: int, cluster: ClusterSpec
) -> float:
    """Two-level all-reduce: reduce-scatter inside each node, all-reduce across nodes on n/r
    bytes, all-gather inside each node (r = ranks_per_node, N = num_nodes)::

        RS_intra(n, r) + AR_inter(n/r, N) + AG_intra(n, r)

    Each node's r ranks all-reduce their 1/r slice over their own NIC in parallel, so the slow
    link carries n/r bytes per rank instead of n. Unit: seconds. Source: NCCL tree/ring
    hierarchy (Jeaugey, GTC 2019); Thakur et al. 2005.
    """
    if ranks_per_node < 1 or num_nodes < 1:
        raise ValueError(f"ranks_per_node and num_nodes must be >= 1, got {ranks_per_node}, {num_nodes}")
    t = collective_time_s("reduce_scatter", nbytes, ranks_per_node, cluster)
    t += collective_time_s("all_reduce", nbytes / ranks_per_node, num_nodes, cluster, spans_nodes=True)
    t += collective_time_s("all_gather", nbytes, ranks_per_node, cluster)
    return t


def _check_axis(mesh: MeshSpec, axis: str) -> int:
    if axis not in mesh.axis_names:
        raise ValueError(f"mesh has no axis {axis!r}; its axes are {mesh.axis_names}")
    return mesh.axis_names.index(axis)


def axis_group_stride(mesh: MeshSpec, axis: str) -> int:
    """Rank distance between neighbours on ``axis``: the product of the degrees of the axes
    inside it (row-major layout, ``axis_names`` outermost first). Unit: ranks."""
    i = _check_axis(mesh, axis)
    stride = 1
    for d in mesh.degrees[i + 1 :]:
        stride *= d
    return stride


def axis_groups(mesh: MeshSpec, axis: str) -> list[list[int]]:
    """Every process group of ``axis`` as a sorted list of global ranks (row-major layout)."""
    i = _check_axis(mesh, axis)
    deg, stride = mesh.degrees[i], axis_group_stride(mesh, axis)
    block = deg * stride
    return [
        [outer * block + inner + j * stride for j in range(deg)]
        for outer in range(mesh.world_size // block)
        for inner in range(stride)
    ]


def axis_nodes_spanned(mesh: MeshSpec, axis: str, devices_per_node: int) -> int:
    """Most nodes any single group of ``axis`` touches (1 = the axis stays inside a node)."""
    if devices_per_node < 1:
        raise ValueError(f"devices_per_node must be >= 1, got {devices_per_node!r}")
    return max(len({r // devices_per_node for r in g}) for g in axis_groups(mesh, axis))


def axis_spans_nodes(mesh: MeshSpec, axis: str, devices_per_node: int) -> bool:
    """True when some group of ``axis`` holds ranks on two or more nodes (ranks ``r`` and
    ``r'`` share a node iff ``r // devices_per_node == r' // devices_per_node``).

    E.g. mesh ("dp", "tp") = (4, 8) on 8-GPU nodes: tp stays inside a node, dp spans nodes.
    """
    return axis_nodes_spanned(mesh, axis, devices_per_node) > 1


def axis_collective_time_s(
    kind: str, nbytes: float, mesh: MeshSpec, axis: str, cluster: ClusterSpec, *, hierarchical: bool = True
) -> float:
    """``collective_time_s`` over the groups of ``axis``, choosing the link from the layout.

    When the axis spans nodes, ``hierarchical`` and ``kind == "all_reduce"`` and every node
    holds the same number r > 1 of a group's ranks, the two-level all-reduce is used
    (``hierarchical_all_reduce_time_s``); else the flat ring over the inter-node link.
    Unit: seconds.
    """
    k = mesh.degree(axis)
    _check_axis(mesh, axis)
    spans = axis_spans_nodes(mesh, axis, cluster.devices_per_node)
    if spans and hierarchical and kind == "all_reduce":
        nodes = axis_nodes_spanned(mesh, axis, cluster.devices_per_node)
        if k % nodes == 0 and k // nodes > 1:
            return hierarchical_all_reduce_time_s(nbytes, k // nodes, nodes, cluster)
    return collective_time_s(kind, nbytes, k, cluster, spans_nodes=spans)
