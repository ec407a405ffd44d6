"""Costs of expert parallelism (EP) and context parallelism (CP): pure functions, no torch.

Every collective goes through ``_collective_s`` (one switch point onto ``comm.collective_time_s``,
the hierarchical collective model of ``cost_models/comm.py``).

**EP, per MoE layer and microbatch** (Lepikhin et al. 2020 "GShard" §2; Rajbhandari et al. 2022
"DeepSpeed-MoE" §5; torchtitan's expert_parallel): a rank holding ``n`` tokens sends each of its
``k`` routed copies to the expert's rank and receives them back::

    a2a_bytes = n · k · H · elem · (ep − 1) / ep        (bytes leaving a rank, dispatch or combine)
    ep_comm_s = 4 · T_all_to_all(n · k · H · elem, ep)  (dispatch + combine, forward and backward)

The runtime (``runtime/apply/expert_parallel.py``) waits for each exchange before computing, so none of
it overlaps. Megatron-Core's "flex" dispatcher (DeepEP / HybridEP) sends a token once per destination rank
(``dispatch_copies``) and, across nodes, once per destination node through the NIC, forwarded
inside that node over NVLink (``flex_off_node_copies``, ``ep_comm_s(dispatcher="flex")``). Load balance: the busiest expert rank receives ``capacity_factor`` times the mean
(``capacity_factor`` = 1: perfect balance; GShard uses 1.25 as the capacity bound), so the expert
compute of a step is ``capacity_factor ×`` its mean. Expert weights are held ``1/ep`` per rank
(``expert_params_per_rank``); their gradients are all-reduced over the ``dp·cp/ep`` replicas.

**EP under Megatron-Core's "MoE parallel folding"** (an engine's layout, costed for engine
configurations only: ``estimate_graph(moe_folding=True)``; meshplan's runtime keeps the MoE block
replicated over tp). With ``--sequence-parallel`` and ``--expert-tensor-parallel-size 1`` the
MoE layer receives the rank's sequence-parallel shard and dispatches it as is (Megatron-LM
core_v0.15.0 ``megatron/core/transformer/moe/token_dispatcher.py`` L575 ``hidden_states.view(-1,
H)``, L626 ``all_to_all(self.ep_group, ...)``; the gather over the expert tp group, L651, runs
only when ETP > 1), so a rank routes, sends and computes ``n / tp`` tokens
(``moe_tokens_per_rank``). The expert mesh is generated on its own (``parallel_state.py``
L743-762: ``expert_data_parallel_size = world // (etp · ep · pp)``, a second ``RankGenerator``
over (tp=etp, ep, dp=edp, pp) in the order ``tp-cp-ep-dp-pp`` of L527, cp = 1), so a rank's
position is ``etp_rank + etp·ep_rank + etp·ep·edp_rank + …`` (``expert_mesh_groups``): an ep
group is ``ep`` ranks ``etp`` apart (EP 8 at ETP 1 = 8 consecutive GPUs, one NVLink node) and
the expert gradients are reduced over the EDP group, ``world / (pp·ep·etp)`` ranks ``etp·ep``
apart (L1201 ``get_ranks('dp')`` of the expert generator), not over the attention's dp
(``folded_expert_mesh``).

**CP, per attention layer and microbatch, as ``runtime/apply/context_parallel.py`` runs it** (Liu et
al. 2023 "Ring Attention" §3 for the overlapped ring; Llama 3 paper §3.3.2 for the 2·cp-chunk
causal balance): each rank holds ``T/cp`` tokens; its key/value block of the UN-repeated
grouped-query heads (``2 · b · T/cp · kv_heads · head_dim · elem`` bytes) moves ``cp − 1`` times
around the ring in the forward and its gradient ``cp − 1`` times back in the backward. Every
shift is posted before the block it overlaps is computed and waited after it, so a ring step
lasts ``max(block compute, transfer)``::

    t      = T_send_recv(kv_bytes)                    (one shift, comm.p2p_time_s)
    c_fwd  = attn_fwd_s / cp,   c_bwd = attn_bwd_s / cp   (one ring step's blocks)
    fwd    = Σ_{s=0}^{cp−2} max(c_fwd, t) + c_fwd     (step s computes while block s+1 arrives)
    exposed_fwd = (cp − 1) · max(0, t − c_fwd)
    exposed_bwd = (cp − 1) · max(0, t − c_bwd)         (the gradient of block s+1 travels back
                                                        while block s's backward runs)

The first transfer is posted before the rank's own (diagonal) blocks and the last step sends
nothing, so no transfer is exposed whole. A hidden transfer is not free: its NCCL kernel holds
SMs the blocks it overlaps need, so each step also pays
``contention.overlap_slowdown_s(min(t, c), c)`` (the collective channel count
``ClusterSpec.comm_sms``; NCCL's send/recv may run on fewer channels, so this is an upper bound). With the 2·cp-chunk split every ring step holds the
same work (step 0: two causal diagonal blocks + one full block; every other step: two full
blocks; in units of a chunk × chunk block: 2 each), so ``c = attention / cp`` is exact, not an
average: compute and activation memory per rank are those of ``T/cp`` tokens and the search
costs a cp configuration with ``micro_batch / cp`` sequences per rank. Under recomputation (full,
or selective: the ring attention call checkpointed) the re-run forward repeats the ring
(``forward_passes = 2``), as torchtitan's CP with activation checkpointing does.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from meshplan.cost_models.comm import (
    collective_time_s,
    group_collective_s,
    group_layout,
    p2p_time_s,
    split_all_to_all_s,
)
from meshplan.cost_models.contention import overlap_slowdown_s
from meshplan.cost_models.hardware import ClusterSpec

DEFAULT_CAPACITY_FACTOR = 1.0  # the runtime drops no token; imbalance is a costing assumption


def _collective_s(kind: str, nbytes: float, group: int, cluster: ClusterSpec, spans_nodes: bool,
                  stride: int = 0) -> float:
    """The one place EP/CP costs reach the collective model.

    With ``stride`` (> 0: the group's ranks are that far apart in the mesh, tp for the ep and cp
    groups of the dp × cp row) the group is priced with its node layout
    (``comm.group_collective_s``; a cp ring's send crosses nodes when the cp group spans nodes,
    ``comm.p2p_time_s``); without, inside one node unless ``spans_nodes`` (one rank per node)."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    if stride > 0:
        if kind == "send_recv":
            nodes = group_layout(group, stride, cluster.devices_per_node)[0]
            return p2p_time_s(nbytes, cluster, crosses_nodes=nodes > 1)
        return group_collective_s(kind, nbytes, group, cluster, stride=stride)
    return collective_time_s(kind, nbytes, group, cluster, spans_nodes=spans_nodes)


def ep_a2a_bytes(tokens: float, top_k: float, hidden: int, elem_bytes: int) -> float:
    """Bytes of one dispatch (or combine) all-to-all buffer of a rank: n · k · H · elem."""
    return tokens * top_k * hidden * elem_bytes


#: how a MoE layer's tokens reach their experts' ranks: "alltoall" (one copy per routed expert: Megatron-Core's
#: MoEAlltoAllTokenDispatcher, meshplan's runtime, torchtitan) or "flex" (one copy per destination rank, the
#: experts on a rank sharing it: Megatron-Core's MoEFlexTokenDispatcher over DeepEP / HybridEP).
#: Megatron-Core's default "allgather" dispatcher is not modelled (costed as "alltoall").
MOE_DISPATCHERS = ("alltoall", "flex")


def dispatch_copies(num_experts: int, top_k: int, ep: int, dispatcher: str = "alltoall") -> float:
    """Copies of a token a dispatch sends (counting the rank's own, which the all-to-all's
    (ep − 1)/ep leaves out): ``top_k`` for "alltoall"; for "flex" the expected number of distinct
    ranks among its ``top_k`` experts drawn without replacement from ``num_experts`` laid out
    ``num_experts / ep`` per rank, ``ep · (1 − C(E − E/ep, k) / C(E, k))`` (DeepEP
    ``Buffer.dispatch``: one send per destination rank, ``get_dispatch_layout``'s is_token_in_rank)."""
    if dispatcher not in MOE_DISPATCHERS:
        raise ValueError(f"dispatcher must be one of {', '.join(MOE_DISPATCHERS)}, got {dispatcher!r}")
    if dispatcher == "alltoall" or ep <= 1 or num_experts <= 0:
        return float(top_k)
    per = num_experts // ep
    return ep * (1.0 - math.comb(num_experts - per, top_k) / math.comb(num_experts, top_k))


def flex_off_node_copies(num_experts: int, top_k: int, nodes: int) -> float:
    """Copies of a token the "flex" dispatcher sends off its node when the ep group spans ``nodes``
    nodes (experts laid out ``num_experts / nodes`` per node): one per other node holding any of its
    ``top_k`` experts, ``(nodes − 1) · (1 − C(E − E/nodes, k) / C(E, k))``. DeepEP's internode normal
    kernels and HybridEP send a token over RDMA once per destination node and forward it to that
    node's ranks over NVLink (DeepEP ``get_dispatch_layout``'s ``num_tokens_per_rdma_rank``; the
    hybrid-ep branch's docs/Hybrid-EP_Implementation.md: ``rdma_token_buffer`` of
    ``max_tokens_per_rank × (num_nodes − 1) × hidden``)."""
    if nodes <= 1 or num_experts <= 0:
        return 0.0
    per = num_experts // nodes
    return (nodes - 1) * (1.0 - math.comb(num_experts - per, top_k) / math.comb(num_experts, top_k))


def ep_comm_s(tokens: float, top_k: float, hidden: int, elem_bytes: int, ep: int, cluster: ClusterSpec,
              *, spans_nodes: bool = False, stride: int = 0, num_experts: int = 0, route_k: int = 0,
              dispatcher: str = "alltoall") -> float:
    """Seconds of one MoE layer's four all-to-alls (dispatch + combine, forward + backward) of
    ``top_k`` copies per token (``dispatch_copies``); ``stride``: distance of the ep group's ranks
    in the mesh (``_collective_s``). Under ``dispatcher`` "flex" an ep group spanning nodes sends a
    token through the NIC once per other node holding one of its ``route_k`` of ``num_experts``
    experts (``flex_off_node_copies``), its own node's share over NVLink as before
    (``comm.split_all_to_all_s``)."""
    buf = ep_a2a_bytes(tokens, top_k, hidden, elem_bytes)
    if dispatcher == "flex" and num_experts > 0 and route_k > 0 and ep > 1 and buf > 0:
        nodes, r = group_layout(ep, stride, cluster.devices_per_node) if stride > 0 else (
            (ep, 1) if spans_nodes else (1, ep))
        if nodes > 1:
            nic = ep_a2a_bytes(tokens, flex_off_node_copies(num_experts, route_k, nodes), hidden, elem_bytes)
            return 4 * split_all_to_all_s((r - 1) / ep * buf, nic, ep, cluster)
    return 4 * _collective_s("all_to_all", buf, ep, cluster, spans_nodes, stride)


#: Megatron-Core's expert rank generator's axes, innermost first (parallel_state.py L527, cp = 1)
EXPERT_MESH_ORDER = ("etp", "ep", "edp", "pp")


@dataclass(frozen=True)
class FoldedExpertMesh:
    """The expert groups of one pipeline stage under MoE parallel folding: the ep group's size and
    rank stride, the expert data-parallel group's (EDP) size and stride (module docstring)."""

    ep: int
    ep_stride: int
    edp: int
    edp_stride: int


def folded_expert_mesh(stage_ranks: int, ep: int, etp: int = 1) -> FoldedExpertMesh:
    """The folded expert mesh of a pipeline stage of ``stage_ranks`` (= dp·cp·tp) ranks:
    ep groups of ``ep`` ranks ``etp`` apart, EDP = stage_ranks / (ep·etp) ranks ``etp·ep`` apart."""
    for name, v in (("stage_ranks", stage_ranks), ("ep", ep), ("etp", etp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if stage_ranks % (ep * etp):
        raise ValueError(f"MoE parallel folding: ep·etp = {ep}·{etp} must divide the {stage_ranks} ranks of a "
                         "pipeline stage (dp·cp·tp); change ep")
    return FoldedExpertMesh(ep, etp, stage_ranks // (ep * etp), etp * ep)


def expert_mesh_groups(world: int, pp: int, ep: int, axis: str, etp: int = 1) -> list[list[int]]:
    """The rank groups of ``axis`` (``EXPERT_MESH_ORDER``) of the folded expert mesh of ``world``
    ranks, as Megatron's expert ``RankGenerator`` lays them out (rank = Σ index_a · Π sizes of the
    axes inside a): the ranks that differ only in ``axis``."""
    if axis not in EXPERT_MESH_ORDER:
        raise ValueError(f"axis must be one of {', '.join(EXPERT_MESH_ORDER)}, got {axis!r}")
    if world % pp:
        raise ValueError(f"pp={pp} must divide world={world}")
    mesh = folded_expert_mesh(world // pp, ep, etp)
    sizes = dict(zip(EXPERT_MESH_ORDER, (etp, ep, mesh.edp, pp)))
    strides, acc = {}, 1
    for a in EXPERT_MESH_ORDER:
        strides[a], acc = acc, acc * sizes[a]
    others = [a for a in EXPERT_MESH_ORDER if a != axis]
    groups = []
    for rest in itertools.product(*(range(sizes[a]) for a in others)):
        base = sum(i * strides[a] for a, i in zip(others, rest))
        groups.append([base + i * strides[axis] for i in range(sizes[axis])])
    return sorted(groups)


def moe_tokens_per_rank(tokens: float, tp: int, folding: bool) -> float:
    """Tokens a rank routes, dispatches and computes experts for: all ``tokens`` of its tp group
    (meshplan's runtime: the MoE block replicated over tp) or, folded, its ``1/tp`` sequence shard."""
    return tokens / tp if folding else tokens


def expert_params_per_rank(expert_numel: float, ep: int) -> float:
    """Expert parameters one rank holds: all experts' / ep."""
    return expert_numel / ep


def cp_kv_bytes(batch: float, seq_len: int, cp: int, kv_heads: int, head_dim: int, elem_bytes: int) -> float:
    """Bytes of one rank's key+value block: 2 · b · T/cp · kv_heads · head_dim · elem."""
    return 2 * batch * (seq_len / cp) * kv_heads * head_dim * elem_bytes


def cp_ring_exposed_s(kv_bytes: float, cp: int, attn_fwd_s: float, cluster: ClusterSpec, *,
                      attn_bwd_s: float | None = None, spans_nodes: bool = False, stride: int = 0,
                      forward_passes: int = 1, dkv_bytes: float = 0.0) -> float:
    """Exposed seconds of one attention layer's ring exchange, forward + backward, as executed:
    per ring step ``max(0, t − c)`` plus the SMs the hidden part takes from the blocks
    (``overlap_slowdown_s``), with ``t`` one shift's transfer and ``c`` one step's blocks
    (``attn_fwd_s / cp`` forward, ``attn_bwd_s / cp`` backward; ``attn_bwd_s`` defaults to
    twice the forward, Dao 2023), ``cp − 1`` shifts each way (module docstring).

    ``dkv_bytes`` > 0: the backward of meshplan's ring (``runtime/apply/ring_attention.py``,
    ``cp_rotate`` "ring-dkv"): the key/value block again ``cp − 1`` times and the ``dkv_bytes``
    gradient accumulator ``cp`` times, on the same link; step s's kernel hides the key/value shift
    posted before it (s < cp − 1) and the accumulator posted after step s − 1 (s >= 1); the last
    accumulator, waited after the loop, is exposed whole.

    ``attn_fwd_s``: the layer's attention forward time on this rank (all cp steps).
    ``forward_passes`` = 2 under recomputation (the re-run forward repeats its shifts)."""
    if cp <= 1:
        return 0.0
    t = _collective_s("send_recv", kv_bytes, cp if stride else 2, cluster, spans_nodes, stride)
    bwd_s = 2 * attn_fwd_s if attn_bwd_s is None else attn_bwd_s

    def per_step(c: float, x: float = t) -> float:  # exposed transfer + what the hidden part takes from the blocks
        return max(0.0, x - c) + overlap_slowdown_s(min(x, c), c, cluster)

    fwd = (cp - 1) * per_step(attn_fwd_s / cp)
    if dkv_bytes <= 0:
        return forward_passes * fwd + (cp - 1) * per_step(bwd_s / cp)
    td = _collective_s("send_recv", dkv_bytes, cp if stride else 2, cluster, spans_nodes, stride)
    c_b = bwd_s / cp
    # step s moves t * (s < cp - 1) + td * (s >= 1): t at the first step, t + td between, td at the
    # last; the same additions in the same order as a sum over the cp steps, per_step called 3 times
    steps = itertools.chain((per_step(c_b, t + 0.0),), itertools.repeat(per_step(c_b, t + td), cp - 2),
                            (per_step(c_b, 0.0 + td),))  # fmt: skip
    bwd = sum(steps) + td
    return forward_passes * fwd + bwd
