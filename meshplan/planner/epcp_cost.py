"""Expert- and context-parallel terms of one search configuration (formulas: ``cost_models/epcp.py``).

``epcp_terms(graph, cluster, cp, ep, micro_batch, dtype, capacity_factor)`` returns, per
microbatch on one rank, the exposed EP all-to-all seconds (every MoE node), the exposed CP ring
seconds (every attention node), the extra expert compute of load imbalance
(``(capacity_factor − 1) ×`` the MoE nodes' time), the bytes each collective moves, and the
expert parameters a rank does NOT hold (``(1 − 1/ep) ×`` all experts). The search only emits
cp/ep > 1 with pp = tp = 1 (what the runtime executes), so a rank holds the whole layer stack.

``epcp_rule(...)`` is the one rule, shared with the runtime's refusal, for which combinations run.
No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshplan.cost_models.compute import node_time
from meshplan.cost_models.epcp import cp_kv_bytes, cp_ring_exposed_s, ep_a2a_bytes, ep_comm_s
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.graph import ModelGraph


@dataclass
class EPCPTerms:
    ep_comm_s: float = 0.0  # per microbatch, exposed
    cp_comm_s: float = 0.0  # per microbatch, exposed
    imbalance_s: float = 0.0  # per microbatch: (capacity_factor - 1) x MoE compute
    expert_params_saved: float = 0.0  # parameters a rank does not hold thanks to ep
    comm_bytes: dict[str, float] = field(default_factory=dict)  # per microbatch

    @property
    def per_microbatch_s(self) -> float:
        return self.ep_comm_s + self.cp_comm_s + self.imbalance_s


def epcp_rule(*, cp: int, ep: int, tp: int, pp: int, seq_len: int, num_experts: int, recompute: str,
              quantized: bool = False) -> str:
    """Why (cp, ep) cannot run with the rest of a configuration ('' when it can)."""
    if cp == 1 and ep == 1:
        return ""
    if quantized:
        return "cp/ep with quantized training is not executed"
    if tp > 1 or pp > 1:
        return "cp/ep run with data parallelism only (tp = pp = 1)"
    if cp > 1 and (seq_len <= 0 or seq_len % (2 * cp)):
        return f"seq_len {seq_len} not divisible by 2*cp = {2 * cp}"
    if cp > 1 and recompute != "none":
        return "recomputation under cp is not executed"
    if ep > 1 and (num_experts <= 0 or num_experts % ep):
        return f"ep={ep} does not divide the {num_experts} experts"
    return ""


def epcp_terms(graph: ModelGraph, cluster: ClusterSpec, *, cp: int, ep: int, micro_batch: float, dtype: str,
               capacity_factor: float, elem_bytes: int, spans_nodes: bool = False, stride: int = 0,
               cp_overlap: float = 0.0) -> EPCPTerms:
    """EP/CP terms for ``micro_batch`` sequences per replica (each rank holds ``micro_batch/cp`` of them)."""
    out = EPCPTerms()
    if cp == 1 and ep == 1:
        return out
    scale = micro_batch / cp / max(1, graph.batch_size)  # this rank's share of the traced batch
    for n in graph.nodes:
        if n.kind == "moe":
            tokens = n.attrs.get("tokens", 0) * scale
            t = node_time(n, cluster, batch_scale=scale, dtype=dtype)
            out.imbalance_s += (capacity_factor - 1.0) * t.total_s
            if ep > 1:
                k, h = n.attrs.get("top_k", 1), n.attrs.get("hidden", 0)
                out.ep_comm_s += ep_comm_s(tokens, k, h, elem_bytes, ep, cluster, spans_nodes=spans_nodes,
                                          stride=stride)
                b = ep_a2a_bytes(tokens, k, h, elem_bytes) * (ep - 1) / ep
                out.comm_bytes["all_to_all"] = out.comm_bytes.get("all_to_all", 0.0) + 4 * b
                out.expert_params_saved += n.param_numel - n.attrs.get("dense_numel", 0) * 1.0
        elif n.kind == "attention" and cp > 1:
            a = n.attrs
            if not a.get("head_dim"):
                continue
            kvb = cp_kv_bytes(micro_batch, graph.seq_len, cp, a.get("num_kv_heads", 1), a["head_dim"], elem_bytes)
            attn_s = node_time(n, cluster, batch_scale=scale, dtype=dtype).fwd_s
            out.cp_comm_s += cp_ring_exposed_s(kvb, cp, attn_s, cluster, overlap=cp_overlap, spans_nodes=spans_nodes,
                                               stride=stride)
            out.comm_bytes["send_recv"] = out.comm_bytes.get("send_recv", 0.0) + 2 * (cp - 1) * kvb
    if ep > 1:
        out.expert_params_saved *= 1.0 - 1.0 / ep
    return out
