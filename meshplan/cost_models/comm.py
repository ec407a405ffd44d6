"""Communication time: collectives as NCCL runs them on a ClusterSpec (alpha-beta model).

Owns ``collective_time_s`` (all_reduce, all_gather, reduce_scatter, broadcast, all_to_all,
send_recv), ``nccl_collective`` (the same with the algorithm NCCL would pick), the two-level
``hierarchical_all_reduce_time_s``, ``group_layout`` (how many nodes a strided group touches and
how many of its ranks share a node) and the mesh-layout helpers that say which mesh axes stay
inside a node: ranks are laid out row-major over ``MeshSpec.axis_names`` (outermost first), so
the innermost axes are consecutive ranks.

Single node (Patarasuk & Yuan 2009; Thakur, Rabenseifner & Gropp 2005), k ranks, n bytes,
α the NVLink latency and β = 1 / (NVLink bandwidth · comm_efficiency)::

    all_reduce      2·(k−1)/k · n·β + 2·(k−1)·α
    all_gather      (k−1)/k · n·β + (k−1)·α          n = the gathered (full) size
    reduce_scatter  (k−1)/k · n·β + (k−1)·α          n = the input (full) size
    all_to_all      (k−1)/k · n·β + (k−1)·α          n = each rank's send buffer
    broadcast       n·β + (k−1)·α                    pipelined ring (chunks stream down the chain)
    send_recv       n·β + α                          one point-to-point message

Across nodes (a group of k = N·r ranks on N nodes, r of them per node; ``ranks_per_node``):
NCCL builds one ring per channel and spreads the channels over the node's NICs (one NIC per GPU
on DGX-class nodes), so a ring's bus bandwidth is that of the node's r NICs together, capped by
NVLink: ``B = min(B_nvlink, r · B_nic)`` (NCCL performance docs, "bus bandwidth"; nccl-tests
multi-node all_reduce busbw ≈ the node's aggregate NIC bandwidth). Every ring step waits on the
slowest hop (α_net). All-reduce may instead run NCCL's double binary tree across nodes (chains
inside a node), with log latency and ``TREE_BW_FACTOR`` of the ring bandwidth; the faster of the
two is taken, as NCCL's tuner does (src/graph/tuning.cc: time = latency + bytes / bus bandwidth,
per algorithm)::

    ring all_reduce   2·(k−1)/k · n/B + 2·(k−1)·α_net
    tree all_reduce   2·(k−1)/k · n/(B·TREE_BW_FACTOR) + 2·((r−1)·α_nvl + ⌈log2 N⌉·α_net)
    all_gather, reduce_scatter, broadcast: the ring formulas with B and α_net
    all_to_all        max((r−1)/k · n/B_nvlink, (k−r)/k · n/B_nic) + (k−1)·α_net
                      (the off-node share of each rank leaves through its own NIC)
    send_recv         n/B_nic + α_net

With r = 1 (one rank of the group per node, e.g. the DP groups of a TP-8 mesh) this is the flat
ring on one GPU's NIC; with r = 8 the node's eight NICs carry the ring together. Calling
``collective_time_s(..., spans_nodes=True)`` without ``ranks_per_node`` takes r = 1 (the
pessimistic layout). No torch import.
"""

from __future__ import annotations

import math

from meshplan.cost_models.hardware import ClusterSpec
from meshplan.plan import MeshSpec

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv")
#: Tree all-reduce bus bandwidth relative to the ring's across nodes: NCCL's tuner charges its tree
#: a lower bandwidth than the ring (src/graph/tuning.cc scales the tree's bus bandwidth down), so
#: large messages take the ring and small ones (latency bound, many nodes) the tree.
TREE_BW_FACTOR = 0.9


def link(cluster: ClusterSpec, spans_nodes: bool) -> tuple[float, float]:
    """(α seconds, effective bandwidth bytes/s) of the link a group uses: inter-node if it spans nodes."""
    if spans_nodes:
        return cluster.inter_latency_s, cluster.inter_bw_bytes_per_s * cluster.comm_efficiency
    return cluster.intra_latency_s, cluster.intra_bw_bytes_per_s * cluster.comm_efficiency


def _check(kind: str, nbytes: float, group_size: int) -> None:
    if kind not in COLLECTIVES:
        raise ValueError(f"collective kind {kind!r} unknown; use one of {COLLECTIVES}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")


def _ring_s(kind: str, n: float, k: int, bw: float, alpha: float) -> float:
    if kind == "all_reduce":
        return 2 * (k - 1) / k * n / bw + 2 * (k - 1) * alpha
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (k - 1) / k * n / bw + (k - 1) * alpha
    if kind == "broadcast":
        return n / bw + (k - 1) * alpha
    return n / bw + alpha  # send_recv


def split_all_to_all_s(nvlink_bytes: float, nic_bytes: float, group_size: int, cluster: ClusterSpec) -> float:
    """One all-to-all over nodes whose rank sends ``nvlink_bytes`` to its own node's ranks and
    ``nic_bytes`` off its node through its own NIC, both at once: ``max(nvlink_bytes / B_nvlink,
    nic_bytes / B_nic) + (group_size − 1)·α_net`` (the module docstring's all_to_all across nodes,
    with the two shares given; ``nccl_collective`` passes (r−1)/k and (k−r)/k of the buffer, a
    dispatcher that sends a token once per node passes its own off-node bytes). Unit: seconds."""
    eff = cluster.comm_efficiency
    return (max(nvlink_bytes / (cluster.intra_bw_bytes_per_s * eff), nic_bytes / (cluster.inter_bw_bytes_per_s * eff))
            + (group_size - 1) * cluster.inter_latency_s)


def nccl_collective(
    kind: str, nbytes: float, group_size: int, cluster: ClusterSpec, *, ranks_per_node: int
) -> tuple[str, float]:
    """(algorithm, seconds) of one collective of ``nbytes`` over ``group_size`` ranks of which
    ``ranks_per_node`` share each node, as NCCL runs it (formulas in the module docstring).

    The algorithm is "ring", "tree" (all-reduce across nodes when faster), "p2p" (send_recv) or
    "none" (one rank or 0 bytes). Unit: seconds. Source: NCCL src/graph/tuning.cc; NCCL docs
    "performance"; Patarasuk & Yuan 2009.
    """
    _check(kind, nbytes, group_size)
    k = group_size
    if k == 1 or nbytes == 0:
        return "none", 0.0
    if not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
    r = min(ranks_per_node, k)
    nodes = math.ceil(k / r)
    eff = cluster.comm_efficiency
    b_nvl, a_nvl = cluster.intra_bw_bytes_per_s * eff, cluster.intra_latency_s
    if nodes == 1:
        return ("p2p" if kind == "send_recv" else "ring"), _ring_s(kind, nbytes, k, b_nvl, a_nvl)
    b_nic, a_net = cluster.inter_bw_bytes_per_s * eff, cluster.inter_latency_s
    if kind == "send_recv":
        return "p2p", nbytes / b_nic + a_net
    if kind == "all_to_all":
        return "ring", split_all_to_all_s((r - 1) / k * nbytes, (k - r) / k * nbytes, k, cluster)
    bus = min(b_nvl, r * b_nic)
    ring = _ring_s(kind, nbytes, k, bus, a_net)
    if kind != "all_reduce":
        return "ring", ring
    tree = 2 * (k - 1) / k * nbytes / (bus * TREE_BW_FACTOR) + 2 * (
        (r - 1) * a_nvl + math.ceil(math.log2(nodes)) * a_net
    )
    return ("tree", tree) if tree < ring else ("ring", ring)


def collective_time_s(
    kind: str,
    nbytes: float,
    group_size: int,
    cluster: ClusterSpec,
    *,
    spans_nodes: bool = False,
    ranks_per_node: int | None = None,
) -> float:
    """Seconds for one collective of ``nbytes`` over ``group_size`` ranks.

    With ``ranks_per_node`` (how many of the group's ranks share a node; ``group_layout`` gives
    it for a strided group) the NCCL model of ``nccl_collective``: NVLink ring inside a node,
    across nodes a ring on the node's aggregate NIC bandwidth or a tree. Without it, the group
    sits in one node unless ``spans_nodes``, which takes one rank per node (flat ring on one
    GPU's NIC, the pessimistic layout). A group of one rank, or 0 bytes, costs 0.
    Unit: seconds. Source: Patarasuk & Yuan 2009; NCCL performance docs; FORMULAS.md.
    """
    _check(kind, nbytes, group_size)
    if ranks_per_node is None:
        ranks_per_node = 1 if spans_nodes else group_size
    return nccl_collective(kind, nbytes, group_size, cluster, ranks_per_node=ranks_per_node)[1]


def group_layout(group_size: int, stride: int, devices_per_node: int) -> tuple[int, int]:
    """(nodes, ranks per node) of a process group of ``group_size`` ranks ``stride`` apart
    (consecutive ranks fill a node of ``devices_per_node`` first).

    E.g. the DP groups of a (dp, tp) = (16, 4) mesh on 8-GPU nodes: stride 4, 2 ranks per node
    on 8 nodes; of (dp, tp) = (4, 8): stride 8, one rank per node on 4 nodes.
    """
    for name, v in (("group_size", group_size), ("stride", stride), ("devices_per_node", devices_per_node)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if stride * (group_size - 1) < devices_per_node and devices_per_node % stride == 0:
        return 1, group_size  # the whole group fits inside one node (aligned)
    per_node = max(1, min(group_size, devices_per_node // stride)) if stride < devices_per_node else 1
    return math.ceil(group_size / per_node), per_node


def group_collective_s(kind: str, nbytes: float, group_size: int, cluster: ClusterSpec, *, stride: int = 1) -> float:
    """``nccl_collective`` over a process group of ``group_size`` ranks ``stride`` apart, laid out
    as ``group_layout`` says on ``cluster``'s nodes (the one call every DP/FSDP/TP/EP term makes).

    Mesh ``(pp, dp, cp, tp)`` (row-major): a tp group has stride 1, a cp group stride tp, a DP
    group (dp × cp) and an EP group (consecutive positions of the dp × cp row) stride tp, a pp
    group stride dp·cp·tp. A TP group of 8 on 8-GPU nodes stays on NVLink; a TP group of 16 runs
    the cross-node ring on the node's 8 NICs. Unit: seconds.
    """
    _check(kind, nbytes, group_size)
    if group_size == 1 or nbytes == 0:
        return 0.0
    r = group_layout(group_size, stride, cluster.devices_per_node)[1]
    return nccl_collective(kind, nbytes, group_size, cluster, ranks_per_node=r)[1]


#: NCCL's LL ("low latency") protocol, the one its tuner picks for a message of a few bytes to KiB
#: (NVIDIA/nccl v2.21.5-1, 2024-04, ``src/graph/tuning.cc`` lines 56-77): base latency of a ring /
#: tree LL collective (µs), per-step hardware latency on NVLink (ring and tree) and on the network
#: (ring, tree), and LL's share of the bus bandwidth (lines 180 / 183: ring 1/2, tree 1/3.8).
NCCL_LL_BASE_US = {"ring": 6.6, "tree": 6.8}
NCCL_LL_NVLINK_US = 0.6
NCCL_LL_NET_US = {"ring": 2.7, "tree": 5.0}
NCCL_LL_BW_SHARE = {"ring": 1 / 2, "tree": 1 / 3.8}


def latency_bound_all_reduce_s(nbytes: float, group_size: int, cluster: ClusterSpec, *, stride: int = 1) -> float:
    """One all-reduce of a few bytes to KiB (an fp8 amax, a scalar) as NCCL's tuner prices it under
    the LL protocol it picks for such a message (``NCCL_LL_*``; ``ncclTopoTuneModel``): in one node
    ``6.6 + 2(k−1)·0.6`` µs (ring); across N nodes with r ranks each the faster of the LL ring
    ``6.6 + 2(k−N)·0.6 + 2(N−1)·2.7`` and the LL tree ``6.8 + 2((r−1)·0.6 + ⌈log2 N⌉·5.0)`` µs
    (the ring's per-step network overhead, ``getNetOverhead``, taken at most the NVLink step), plus
    the bytes at LL's share of the bus bandwidth. ``nccl_collective``'s α (the Simple protocol's
    per-step latency) prices the same call several times higher (2·7·5 µs over 8 NVLink ranks);
    it stays for messages large enough that Simple wins. Unit: seconds."""
    _check("all_reduce", nbytes, group_size)
    if group_size == 1:
        return 0.0
    nodes, r = group_layout(group_size, stride, cluster.devices_per_node)
    k = group_size
    b_nvl = cluster.intra_bw_bytes_per_s * cluster.comm_efficiency
    data = 2 * (k - 1) / k * nbytes
    if nodes == 1:
        return 1e-6 * (NCCL_LL_BASE_US["ring"] + 2 * (k - 1) * NCCL_LL_NVLINK_US) + data / (b_nvl * NCCL_LL_BW_SHARE["ring"])
    bus = min(b_nvl, r * cluster.inter_bw_bytes_per_s * cluster.comm_efficiency)
    ring = (NCCL_LL_BASE_US["ring"] + 2 * (k - nodes) * NCCL_LL_NVLINK_US + 2 * (nodes - 1) * NCCL_LL_NET_US["ring"]
            ) * 1e-6 + data / (bus * NCCL_LL_BW_SHARE["ring"])
    tree = (NCCL_LL_BASE_US["tree"] + 2 * ((r - 1) * NCCL_LL_NVLINK_US + math.ceil(math.log2(nodes))
                                           * NCCL_LL_NET_US["tree"])) * 1e-6 + data / (bus * NCCL_LL_BW_SHARE["tree"])
    return min(ring, tree)


def p2p_crosses_nodes(index_a: int, index_b: int, stride: int, devices_per_node: int) -> bool:
    """True when the peers of positions ``index_a`` and ``index_b`` on a mesh axis whose ranks are
    ``stride`` apart (pipeline ranks: stride dp·cp·tp) sit on different nodes: rank
    ``index·stride + j`` talks to ``index'·stride + j`` for every inner offset j, and the send is an
    inter-node one when any pair is split (the slowest pair paces the pipeline).

    E.g. pp 4 × (dp·tp = 4) on 8-GPU nodes: pipeline ranks 0↔1 and 2↔3 share a node (NVLink),
    1↔2 cross nodes (one NIC per GPU); with dp·tp ≥ 8 every boundary crosses.
    """
    for name, v in (("stride", stride), ("devices_per_node", devices_per_node)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    d = devices_per_node
    offsets = (0,) if (stride % d == 0 or d % stride == 0) else (0, stride - 1)  # aligned: one check suffices
    return any((index_a * stride + j) // d != (index_b * stride + j) // d for j in offsets)


def p2p_time_s(nbytes: float, cluster: ClusterSpec, *, crosses_nodes: bool) -> float:
    """One point-to-point message of ``nbytes``: NVLink inside a node (``n/B_nvlink + α_nvl``), else
    the sender's own NIC (``n/B_nic + α_net``), ``nccl_collective("send_recv")``. Unit: seconds."""
    return nccl_collective("send_recv", nbytes, 2, cluster, ranks_per_node=1 if crosses_nodes else 2)[1]


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
    """``collective_time_s`` over the groups of ``axis``, with the layout the mesh gives them.

    A group inside one node runs on NVLink; one that spans N nodes with r of its ranks per node
    runs the NCCL model (``nccl_collective``: ring on r NICs or tree). ``hierarchical=False``
    prices the flat ring on one GPU's NIC instead (r = 1), the pre-NCCL-model figure.
    Unit: seconds.
    """
    k = mesh.degree(axis)
    _check_axis(mesh, axis)
    nodes = axis_nodes_spanned(mesh, axis, cluster.devices_per_node)
    if nodes == 1:
        return collective_time_s(kind, nbytes, k, cluster)
    r = max(1, k // nodes) if hierarchical else 1
    return collective_time_s(kind, nbytes, k, cluster, ranks_per_node=r)
