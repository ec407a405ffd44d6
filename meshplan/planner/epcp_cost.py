"""Expert- and context-parallel terms of one search configuration (formulas: ``cost_models/epcp.py``).

``epcp_terms(graph, cluster, cp, ep, micro_batch, dtype, capacity_factor)`` returns, per
microbatch on one rank, the exposed EP all-to-all seconds (every MoE node), the exposed CP ring
seconds (every attention node), the extra expert compute of load imbalance
(``(capacity_factor − 1) ×`` the MoE nodes' time), the MoE time a rank saves by holding only E/ep
experts (the cost table times the node's kernels on all E, ``cost_models.moe_kernels``: at a few
tokens per expert a MoE layer is bound by reading its weights and accumulating their gradients,
which EP divides, and ep gives each expert ep times the rows — Rajbhandari et al. 2022,
DeepSpeed-MoE §5; a few tenths of a percent the other way where fewer experts' tiles fill the
GPU's last wave less well),
the bytes each collective moves, and the expert parameters a rank does NOT hold
(``(1 − 1/ep) ×`` all experts). Under pp the terms are costed per stage, over the nodes of the
stage's layers (``nodes``; the runtime's exchange and ring run over the stage's own ranks), and
split between the stage's forward and backward (``EPCPTerms.forward_s``) so the schedule
simulator times them inside the pipeline; under TP the per-rank share of a MoE node is its whole
(MoE blocks stay replicated over tp) and the ring moves the rank's local key/value heads.

``folding=True`` costs Megatron-Core's MoE parallel folding instead (an engine costing option,
``estimate_graph(moe_folding=True)``; meshplan's runtime does not run it): a tp rank routes,
exchanges and computes only its ``1/tp`` sequence shard (``cost_models.epcp.moe_tokens_per_rank``)
over an ep group of consecutive ranks (``folded_expert_mesh``: stride ``etp`` = 1); the cost table
already times the MoE node on the sequence shard (``tp.strategies``: Q→Q at shard tp under
``GraphCoster(moe_folding=True)``), so its expert-read and imbalance terms here start from that.

Which combinations run is ``meshplan.plan.execution_rules.epcp_rule`` (shared with the runtime's refusal).
No torch import.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field, replace
from functools import reduce
from itertools import accumulate
from operator import add, attrgetter, itemgetter
from typing import Any

from meshplan.cost_models.compute import node_time
from meshplan.cost_models.cp_kernels import (
    ACCUM_BYTES,
    cp_step_shape_ratio,
    ring_dkv_passes_s,
    torch_ring_exposed_s,
)
from meshplan.cost_models.epcp import (
    cp_kv_bytes,
    cp_ring_exposed_s,
    dispatch_copies,
    ep_a2a_bytes,
    ep_comm_s,
    folded_expert_mesh,
    moe_tokens_per_rank,
)
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.cost_models.precision import DEFAULT_FP8_RECIPE
from meshplan.graph import GraphNode, ModelGraph


@dataclass
class EPCPTerms:
    ep_comm_s: float = 0.0  # per microbatch, exposed
    cp_comm_s: float = 0.0  # per microbatch, exposed: the ring's transfers and its own kernels beyond the cost table's
    imbalance_s: float = 0.0  # per microbatch: (capacity_factor - 1) x MoE compute
    expert_read_s: float = 0.0  # per microbatch: MoE time of E/ep experts less E's (cost_models.moe_kernels); < 0 saved
    expert_params_saved: float = 0.0  # parameters a rank does not hold thanks to ep
    expert_params: float = 0.0  # all experts' parameters of the costed nodes (before ep sharding)
    comm_bytes: dict[str, float] = field(default_factory=dict)  # per microbatch
    cp_forward_s: float = 0.0  # of cp_comm_s, the forward pass's ring (the rest runs in the backward)
    moe_forward_s: float = 0.0  # of imbalance_s + expert_read_s, the forward pass's share
    ep_forward_s: float = 0.0  # of ep_comm_s, the forward pass's dispatch + combine
    kept_bytes: float = 0.0  # per microbatch: what the engine's token exchange keeps for backward (ep_kept_bytes)

    @property
    def per_microbatch_s(self) -> float:
        return self.ep_comm_s + self.cp_comm_s + self.imbalance_s + self.expert_read_s

    @property
    def forward_s(self) -> float:
        """The share of ``per_microbatch_s`` in a stage's forward: the forward's all-to-alls (dispatch and
        combine; the backward repeats both, a full recompute's re-run forward too), the forward ring, the forward passes' part of the MoE
        compute terms (``moe_forward_s``: the MoE kernels' forward, ``cost_models.moe_kernels``)."""
        return self.ep_forward_s + self.cp_forward_s + self.moe_forward_s


def epcp_terms(graph: ModelGraph, cluster: ClusterSpec, *, cp: int, ep: int, micro_batch: float, dtype: str,
               capacity_factor: float, elem_bytes: int, tp: int = 1, recompute: str = "none",
               spans_nodes: bool = False, stride: int = 0,
               nodes: Iterable[GraphNode] | None = None, folding: bool = False, dp: int = 1,
               fp8_recipe: str = DEFAULT_FP8_RECIPE, moe_dispatcher: str = "alltoall",
               cp_rotate: str = "ring-dkv", main_grad_bytes: int = 4, ep_combine_bytes: int = 0) -> EPCPTerms:
    """EP/CP terms for ``micro_batch`` sequences per replica (each rank holds ``micro_batch/cp`` of
    them); ``stride``: distance of the ep / cp groups' ranks in the mesh (tp); ``nodes``: the nodes
    to cost (a pipeline stage's; default all: pp = 1). Under TP a rank's ring
    moves its ``kv_heads/tp`` local heads and attends with ``1/tp`` of the heads; MoE blocks are
    replicated over tp (each tp rank exchanges its tokens). Under any recompute kind the re-run
    forward repeats the ring exchange (full and op: the checkpointed block re-runs its ring;
    selective: the ring attention call is the checkpointed region).
    ``kv_heads`` is the attention node's key heads as traced: a model that repeats its kv heads
    before SDPA sends the repeated copies (the runtime's ring sends what SDPA receives).
    ``folding``: Megatron's MoE parallel folding (module docstring; ``dp``: the attention's dp
    degree, which with cp and tp sizes the stage's ranks the expert mesh is folded over).
    ``fp8_recipe``: the engine's (``cost_models.precision``; under fp8 the MoE node's time as the
    cost table priced it: TE recipes run the experts in fp8). ``moe_dispatcher``
    (``cost_models.epcp.MOE_DISPATCHERS``): the copies of a token a dispatch and a combine move
    (``dispatch_copies``: one per routed expert, or under "flex" one per destination rank).
    ``cp_rotate`` (``cost_models.cp_kernels.CP_ROTATES``): how the engine's ring moves key/value
    blocks: "ring" (TE p2p: ``epcp.cp_ring_exposed_s``), "ring-dkv" (meshplan's runtime: that ring, its
    backward re-sending key/value and an fp32 dK/dV accumulator, plus its merge passes,
    ``cp_kernels.ring_dkv_passes_s``) or torch's
    context_parallel "allgather" / "alltoall" (``cp_kernels.torch_ring_exposed_s``: its rotation,
    the fp32 dK/dV ring and its merge / accumulation passes). Under any of them the ring's cp flash
    calls are timed at their chunk shapes (``cp_kernels.cp_step_shape_ratio``) and what that adds
    to the cost table's one kernel of length T counts in ``cp_comm_s``.
    ``main_grad_bytes``: the element size of the gradient the experts' weight gradients accumulate
    into (``dp_kinds.main_grad_bytes``: 4 fp32, 2 for an engine's 16-bit gradients).
    ``ep_combine_bytes``: under ep > 1, the element size of the combine's accumulator in meshplan's
    runtime exchange (``runtime/apply/expert_parallel._grouped_forward``; 0: an engine whose exchange
    keeps nothing priced here), whose saves are ``kept_bytes`` (``ep_kept_bytes``) unless full / op
    recompute drops them."""
    out = EPCPTerms()
    fold = folding and tp > 1
    if cp == 1 and ep == 1 and not fold:
        return out
    # full recompute re-runs every layer's forward in its backward, a MoE layer's with its dispatch and
    # combine (Megatron-Core: CheckpointFunction over the whole TransformerLayer, token_dispatcher
    # included; meshplan's runtime: the checkpointed block); selective / op recompute keep the MoE
    # layer's outputs
    rerun = recompute == "full"
    scale = micro_batch / cp / max(1, graph.batch_size)  # this rank's share of the traced batch
    share = moe_tokens_per_rank(1.0, tp, fold)  # of its tp group's tokens a rank routes
    ep_stride = folded_expert_mesh(dp * cp * tp, ep).ep_stride if fold else stride
    nodes = list(graph.nodes if nodes is None else nodes)
    for n in nodes:
        if n.kind == "moe":
            tokens = n.attrs.get("tokens", 0) * scale * share
            shard = tp if fold else 1  # folded, the cost table times the node on the sequence shard
            t = node_time(n, cluster, shard=shard, batch_scale=scale, dtype=dtype, fp8_recipe=fp8_recipe,
                          main_grad_bytes=main_grad_bytes)
            if ep > 1:  # the cost table's MoE node holds all E experts; a rank holds E/ep
                if n.attrs.get("num_experts") and n.attrs.get("hidden") and n.attrs.get("expert_numel"):
                    # its kernels on E/ep experts: weights read and gradients accumulated for E/ep,
                    # ep times the rows per expert (cost_models.moe_kernels)
                    t_ep = node_time(n, cluster, shard=shard, batch_scale=scale, dtype=dtype, fp8_recipe=fp8_recipe,
                                     ep=ep, main_grad_bytes=main_grad_bytes)
                else:  # no expert shape traced: the roofline's weight bytes scaled to the held experts
                    dense = n.attrs.get("dense_numel", 0)
                    held = dense + (n.param_numel - dense) / ep
                    n_ep = replace(n, param_bytes=int(n.param_bytes * held / max(1, n.param_numel)))
                    t_ep = node_time(n_ep, cluster, shard=shard, batch_scale=scale, dtype=dtype, fp8_recipe=fp8_recipe,
                                     main_grad_bytes=main_grad_bytes)
                # a full recompute re-runs the forward (cost table: at E experts) inside the backward
                out.expert_read_s += t_ep.total_s - t.total_s + (t_ep.fwd_s - t.fwd_s) * rerun
                out.moe_forward_s += t_ep.fwd_s - t.fwd_s
                t = t_ep
            out.imbalance_s += (capacity_factor - 1.0) * (t.total_s + t.fwd_s * rerun)
            out.moe_forward_s += (capacity_factor - 1.0) * t.fwd_s
            if ep > 1:  # dispatch + combine in the forward, again in a re-run forward, and in the backward
                h = n.attrs.get("hidden", 0)
                n_exp, route_k = int(n.attrs.get("num_experts", 0) or 0), int(n.attrs.get("top_k", 1) or 1)
                k = dispatch_copies(n_exp, route_k, ep, moe_dispatcher)
                four = ep_comm_s(tokens, k, h, elem_bytes, ep, cluster, spans_nodes=spans_nodes, stride=ep_stride,
                                 num_experts=n_exp, route_k=route_k, dispatcher=moe_dispatcher)
                out.ep_comm_s += four * (1.0 + 0.5 * rerun)
                out.ep_forward_s += four / 2
                b = ep_a2a_bytes(tokens, k, h, elem_bytes) * (ep - 1) / ep
                out.comm_bytes["all_to_all"] = out.comm_bytes.get("all_to_all", 0.0) + (4 + 2 * rerun) * b
                if ep_combine_bytes and recompute not in ("full", "op"):
                    out.kept_bytes += ep_kept_bytes(tokens * route_k, h, ep_combine_bytes)
        elif n.kind == "attention" and cp > 1:
            a = n.attrs
            if not a.get("head_dim"):
                continue
            kv_heads = a.get("num_kv_heads", 1) / tp
            kvb = cp_kv_bytes(micro_batch, graph.seq_len, cp, kv_heads, a["head_dim"], elem_bytes)  # type: ignore[arg-type]
            at = node_time(n, cluster, batch_scale=scale, dtype=dtype)
            rounds = 2 + (recompute != "none")  # forward, backward, the recomputed forward
            f_s, b_s = at.fwd_s / tp, at.bwd_s / tp
            # the ring's cp flash calls at their chunk shapes, beyond the cost table's one kernel of length T
            heads = a.get("num_heads", a.get("num_kv_heads", 1)) / tp
            ratio = cp_step_shape_ratio(micro_batch, heads, int(a.get("seq_len") or graph.seq_len), cp,
                                        int(a["head_dim"]), cluster)  # fmt: skip
            # ... each of the cp calls at least a kernel launch (the table's one kernel has one floor)
            floor = cp * (cluster.kernel_floor_s + cluster.op_overhead_s)
            shape_f, shape_b = max(ratio * f_s, floor) - f_s, max(ratio * b_s, floor) - b_s
            qb = micro_batch * graph.seq_len / cp * heads * a["head_dim"] * elem_bytes
            if cp_rotate in ("ring", "ring-dkv"):
                # ring-dkv (meshplan's runtime): the backward re-sends key/value, an fp32 dK/dV accumulator
                # travels cp times, and the merge / accumulation passes run beside the kernels
                dkvb = kvb * ACCUM_BYTES / elem_bytes if cp_rotate == "ring-dkv" else 0.0
                ring = functools.partial(cp_ring_exposed_s, kvb, cp, f_s * ratio, cluster, attn_bwd_s=b_s * ratio,
                                         spans_nodes=spans_nodes, stride=stride, dkv_bytes=dkvb)
                bwd = ring(forward_passes=0)
                fwd = ring(forward_passes=1) - bwd
                # key/value each forward pass and in the backward (ring: its gradient instead), accumulators
                out.comm_bytes["send_recv"] = out.comm_bytes.get("send_recv", 0.0) + rounds * (cp - 1) * kvb + cp * dkvb
                if dkvb:
                    pf, pb = ring_dkv_passes_s(kvb, qb, cp, elem_bytes, cluster)
                    fwd, bwd = fwd + pf, bwd + pb
            else:  # torch's context_parallel: its rotation, the fp32 dK/dV ring, its merge passes
                fwd, bwd = torch_ring_exposed_s(kvb, qb, cp, f_s * ratio, b_s * ratio, cluster, rotate=cp_rotate,
                                                elem_bytes=elem_bytes, stride=stride)  # fmt: skip
                kind = "all_gather" if cp_rotate == "allgather" else "all_to_all"
                out.comm_bytes[kind] = out.comm_bytes.get(kind, 0.0) + rounds * (cp - 1) * kvb
                out.comm_bytes["all_to_all"] = (out.comm_bytes.get("all_to_all", 0.0)
                                                + cp * kvb * ACCUM_BYTES / elem_bytes)  # fmt: skip
            out.cp_comm_s += (rounds - 1) * (fwd + shape_f) + bwd + shape_b
            out.cp_forward_s += fwd + shape_f
    out.expert_params = expert_params(graph, nodes)
    out.expert_params_saved = expert_params_saved(graph, ep, nodes)
    return out


def expert_params(graph: ModelGraph, nodes: Iterable[GraphNode] | None = None) -> float:
    """Parameters of all experts of all MoE nodes (of ``nodes``; routers and shared experts excluded)."""
    return float(sum(n.param_numel - n.attrs.get("dense_numel", 0)
                     for n in (graph.nodes if nodes is None else nodes) if n.kind == "moe"))


def expert_params_saved(graph: ModelGraph, ep: int, nodes: Iterable[GraphNode] | None = None) -> float:
    """Parameters a rank does not hold at expert-parallel degree ``ep``: (1 − 1/ep) × all experts
    (of ``nodes``: a pipeline stage's)."""
    return expert_params(graph, nodes) * (1.0 - 1.0 / ep) if ep > 1 else 0.0


_SUMMED = ("ep_comm_s", "cp_comm_s", "imbalance_s", "expert_read_s", "expert_params_saved", "expert_params",
           "cp_forward_s", "moe_forward_s", "ep_forward_s", "kept_bytes")


def ep_kept_bytes(routed: float, hidden: int, combine_bytes: int) -> float:
    """Bytes meshplan's runtime exchange (``runtime/apply/expert_parallel._grouped_forward``) keeps for
    the backward per MoE layer beyond the eager block's own saves, for ``routed`` token copies (tokens
    x top-k) routed by this rank: the returned expert outputs (kept by the product with the routing
    weights) and their weighted copies (kept by ``index_add``), both ``hidden`` wide in the combine
    accumulator's dtype (``combine_bytes``: the block input's, fp32 under autocast), the routing
    weights (fp32) and three int64 index vectors (the sort order, the token ids, the gathered rows).
    Listed with ``saved_tensors_hooks`` under fake tensors (BENCHMARKS "Wave 3 stop 7")."""
    return routed * (2.0 * hidden * combine_bytes + 4.0 + 3 * 8.0)


def _node_key(n: GraphNode, kw: dict[str, Any]) -> tuple:
    """What one node's ``epcp_terms`` depend on besides the node: a MoE node's on ``micro_batch / cp``
    (its tokens on the rank), ep and the group stride, under MoE parallel folding at tp > 1 also on
    tp, dp and cp (its share of the tokens, the folded expert mesh), and whether a full recompute re-runs
    it; an
    attention node's on cp, micro_batch, tp, the stride and whether the forward is re-run, not on ep.
    Whether any term is costed at all is part of the key."""
    mine = ("cp", "ep", "micro_batch", "tp", "recompute", "stride", "dp", "folding")
    rest = tuple(sorted((k, v) for k, v in kw.items() if k not in mine))
    cp, ep, tp, mb = int(kw["cp"]), int(kw["ep"]), int(kw.get("tp", 1)), kw["micro_batch"]
    fold = bool(kw.get("folding")) and tp > 1
    on = cp * ep > 1 or fold  # epcp_terms returns nothing otherwise
    stride = kw.get("stride", 0)
    if n.kind == "moe":
        folded = (tp, kw.get("dp", 1), cp) if fold else None
        return (on, "moe", ep, mb / cp, stride, folded, kw.get("recompute", "none"), rest)
    return (on, "attention", cp, mb, tp, kw.get("recompute", "none") != "none", stride, rest)


class EPCPPrefix:
    """``epcp_terms`` of any run of consecutive nodes in O(log n): the terms of each MoE / attention
    node once (one configuration's degrees), prefix-summed in node order. ``terms(lo, hi)`` equals
    ``epcp_terms(..., nodes=[n for n in nodes if lo <= n.id < hi])``.

    ``memo`` (shared across configurations) with ``copies`` (per node, a key equal for the nodes at
    the same place of identical repeated layers: ``EPCPCosts._copies``) costs each node once
    per what its terms depend on (``_node_key``): configurations that differ only in ep (attention
    nodes), only in the recompute kind or in cp at the same tokens per rank (MoE nodes) share them,
    and a repeated block's copies share their template's. With it, configurations whose nodes all
    have the same keys share one list of node terms and its sums (``_NodeSums``). The prefix sums
    are built at the first ``terms`` call; ``whole()`` (every node) needs only their last entries.
    """

    def __init__(self, graph: ModelGraph, cluster: ClusterSpec, nodes: list[GraphNode], *,
                 memo: dict[tuple, Any] | None = None, copies: list[Hashable] | None = None,
                 **kw: Any) -> None:
        if memo is None or copies is None:
            self.ids = [n.id for n in nodes]
            self._sums = _NodeSums([epcp_terms(graph, cluster, nodes=[n], **kw) for n in nodes])
            return
        lkey = ("node layout", id(copies), len(nodes))
        if lkey not in memo:
            memo[lkey] = _Layout(nodes)
        lay: _Layout = memo[lkey]
        self.ids = lay.ids
        by_kind = {kind: _node_key(n, kw) for kind, n in lay.first.items()}  # _node_key: the node's kind only
        skey = ("node sums", id(copies), len(nodes), tuple(sorted(by_kind.items())))
        if skey not in memo:
            combined: list[EPCPTerms] = []
            for kind, at in lay.at.items():  # per kind, its nodes' terms in node order (shared by kind key)
                kkey = ("kind terms", id(copies), len(nodes), kind, by_kind[kind])
                if kkey not in memo:
                    terms = []
                    for i in at:
                        key = (copies[i], by_kind[kind])
                        if key not in memo:
                            memo[key] = epcp_terms(graph, cluster, nodes=[nodes[i]], **kw)
                        terms.append(memo[key])
                    memo[kkey] = terms
                combined += memo[kkey]
            memo[skey] = _NodeSums(lay.in_node_order(combined))
        self._sums = memo[skey]

    @property
    def acc(self) -> dict[str, list[float]]:
        """Per summed ``EPCPTerms`` field, the running sums over the nodes ([0, x0, x0 + x1, ...])."""
        return self._sums.prefix()[0]

    @property
    def bytes(self) -> dict[str, list[float]]:
        """Per collective kind, the running sums of the nodes' bytes."""
        return self._sums.prefix()[1]

    def terms(self, lo: int, hi: int) -> EPCPTerms:
        """The terms of the nodes with ``lo <= id < hi`` (shared: read only)."""
        a, b = bisect.bisect_left(self.ids, lo), bisect.bisect_left(self.ids, hi)
        return self._sums.between(a, b)

    def whole(self) -> EPCPTerms:
        """``terms`` of every node (the same floats), without building the prefix sums."""
        return self._sums.whole()


class _Layout:
    """Where each kind's nodes sit in a node list: ids, the first node and the positions of each
    kind, and the permutation from the kinds' lists put end to end back to node order."""

    def __init__(self, nodes: list[GraphNode]) -> None:
        self.ids = [n.id for n in nodes]
        self.at: dict[str, list[int]] = {}
        self.first: dict[str, GraphNode] = {}
        for i, n in enumerate(nodes):
            self.at.setdefault(n.kind, []).append(i)
            self.first.setdefault(n.kind, n)
        concat = [i for at in self.at.values() for i in at]  # node position of each concatenated entry
        where = {pos: j for j, pos in enumerate(concat)}
        self._get = itemgetter(*(where[i] for i in range(len(nodes)))) if len(nodes) > 1 else None

    def in_node_order(self, combined: list[EPCPTerms]) -> list[EPCPTerms]:
        """``combined`` (the kinds' lists end to end, in ``at``'s order) in node order."""
        return list(self._get(combined)) if self._get is not None else list(combined)


class _NodeSums:
    """Node terms in node order and their running sums (built once, on demand)."""

    def __init__(self, per: list[EPCPTerms]) -> None:
        self.per = per
        self._prefix: tuple[dict[str, list[float]], dict[str, list[float]]] | None = None
        self._whole: EPCPTerms | None = None
        self._between: dict[tuple[int, int], EPCPTerms] = {}

    def prefix(self) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
        """Per summed field and per collective kind, the running sums [0, x0, x0 + x1, ...]."""
        if self._prefix is None:  # accumulate: [0.0, 0.0 + x0, (0.0 + x0) + x1, ...], plain float additions
            acc = {name: list(accumulate(map(attrgetter(name), self.per), initial=0.0)) for name in _SUMMED}
            by = {key: list(accumulate((x.comm_bytes.get(key, 0.0) for x in self.per), initial=0.0))
                  for key in sorted({k for x in self.per for k in x.comm_bytes})}  # fmt: skip
            self._prefix = (acc, by)
        return self._prefix

    def between(self, a: int, b: int) -> EPCPTerms:
        """The terms of nodes a .. b - 1 (prefix-sum differences; memoized: read only)."""
        if (a, b) not in self._between:
            acc, by = self.prefix()
            out = EPCPTerms(**{name: acc[name][b] - acc[name][a] for name in _SUMMED})
            out.comm_bytes = {k: x[b] - x[a] for k, x in by.items() if x[b] - x[a]}
            self._between[a, b] = out
        return self._between[a, b]

    def whole(self) -> EPCPTerms:
        """The sums' last entries less their first (0.0), as ``EPCPPrefix.terms`` gives them."""
        if self._whole is None:  # reduce(add, ..., 0.0): the running sum's last entry, plain float additions
            out = EPCPTerms(**{name: reduce(add, map(attrgetter(name), self.per), 0.0) - 0.0 for name in _SUMMED})
            for key in sorted({k for x in self.per for k in x.comm_bytes}):
                total = reduce(add, (x.comm_bytes.get(key, 0.0) for x in self.per), 0.0)
                if total - 0.0:
                    out.comm_bytes[key] = total - 0.0
            self._whole = out
        return replace(self._whole, comm_bytes=dict(self._whole.comm_bytes))
