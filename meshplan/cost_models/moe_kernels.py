"""The kernels one MoE layer runs on one rank per microbatch, as Megatron-Core runs them: FLOPs,
bytes and GEMM shapes per pass (forward, input gradient, weight gradient). Timed by
``compute.modelled_node_time`` (each kernel on the roofline, GEMMs at their grouped shape's
efficiency, ``efficiency.grouped_gemm_factor``). The dispatch / combine all-to-alls are not here
(``cost_models/epcp.py``). No torch import.

A rank routes ``n`` tokens of hidden size ``H``; each goes to ``k`` of ``E`` experts, ``E/ep`` of
them on this rank. With balanced routing the rank's experts receive ``R = n·k`` rows in all,
``r = R / (E/ep) = n·k·ep/E`` per expert. An expert is ``m`` weight matrices of ``H × F`` (SwiGLU:
m = 3, gate and up fused into one ``H → 2F`` GEMM, ``F → H`` down), read off the traced node
(``expert_numel = m·H·F``, ``expert_act_numel = m·(H + F)``: ``expert_shape``). Sources
(Megatron-LM core_v0.15.0, ``megatron/core/transformer/moe/``; the Qwen3 benchmark rows run
``--moe-grouped-gemm --moe-permute-fusion --moe-router-fusion``)::

    router       router.py TopKRouter: one ``H → E`` GEMM on the n tokens (``dense_numel``: the
                 block's non-expert weights), then softmax / top-k (fused: small, not priced)
    permute      token_dispatcher.py ``permute`` (moe_utils.py, fused kernel): reads the n
                 tokens, writes R rows grouped by expert                 bytes (n + R)·H·e
    fc1          experts.py TEGroupedMLP ``linear_fc1`` (TE GroupedLinear: one GEMM per local
                 expert, shapes [r × H]·[H × (m−1)F])
    activation   ``bias_swiglu_impl`` / ``weighted_bias_swiglu_impl``: one fused pass, reads
                 (m−1)·F and writes F per row                             bytes R·m·F·e
    fc2          ``linear_fc2``: [r × F]·[F × H]
    unpermute    ``unpermute`` (fused, with the routing probabilities): reads R rows, writes n
                                                                          bytes (R + n)·H·e

The input gradient runs the same passes backward (the activation's backward reads its input and
output gradient and writes its input gradient: R·(2(m−1) + 1)·F·e); the GEMMs' dgrad shapes are
the forward's with N and K swapped. The weight gradient is one GEMM per expert weight with the
rows as its reduction dimension, [H × r]·[r × (m−1)F] and [F × r]·[r × H], accumulated into the
fp32 main gradient in place (TE ``GroupedLinear(fuse_wgrad_accumulation=
config.gradient_accumulation_fusion)``, on by default in Megatron-Core with Transformer Engine):
each weight's gradient is read and written in fp32, ``WGRAD_ACCUM_BYTES`` per element, however
few rows the expert got (in 16-bit, 4 B, where the engine keeps 16-bit main gradients:
Megatron-Bridge's ``grad_reduce_in_fp32 = False``, ``moe_kernels(grad_elem=2)``). At a few hundred rows per expert that read-modify-write, not the FLOPs,
bounds the weight-gradient GEMM (its arithmetic intensity is ~r/4 FLOPs per byte), which is why a
MoE layer spread thin over many experts (small ``r``) runs below the GEMM peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshplan.graph import expert_shape

__all__ = ["WGRAD_ACCUM_BYTES", "Kernel", "expert_shape", "moe_kernels"]

#: bytes per expert weight element of the weight-gradient GEMM's in-place fp32 accumulation
#: (read + write of the fp32 main gradient; Megatron-Core gradient_accumulation_fusion)
WGRAD_ACCUM_BYTES = 8


@dataclass(frozen=True)
class Kernel:
    """One kernel of a MoE layer: its pass ("fwd", "bwd_input", "bwd_weight"), FLOPs and bytes, and
    for a GEMM its per-expert shape (m, n, k) and the number of experts it runs over (``groups``;
    0 for a memory-bound pass)."""

    name: str
    phase: str
    flops: float
    bytes: float
    shape: tuple[float, float, float] = (0.0, 0.0, 0.0)
    groups: int = 0


def moe_kernels(attrs: dict[str, Any], tokens: float, *, ep: int = 1, elem: int = 2,
                weight_elem: int = 2, grad_elem: int = 4) -> list[Kernel]:
    """The kernels of a MoE node (``attrs``: the traced node's ``num_experts``, ``top_k``,
    ``hidden``, ``expert_numel``, ``expert_act_numel``, ``dense_numel``) for ``tokens`` routed on
    this rank, ``ep`` the expert-parallel degree (the rank holds E/ep experts), ``elem`` the bytes
    of an activation element, ``weight_elem`` of a weight element, ``grad_elem`` of the main
    gradient the weight gradients accumulate into (read + write: ``2 · grad_elem`` per weight;
    4 = fp32, ``WGRAD_ACCUM_BYTES``; 2 where the engine keeps 16-bit gradients,
    ``dp_kinds.main_grad_bytes``) (module docstring)."""
    E, k, H = int(attrs["num_experts"]), int(attrs.get("top_k", 1)), int(attrs["hidden"])
    if ep < 1 or E % ep:
        raise ValueError(f"ep={ep} must be a positive divisor of the {E} experts")
    if tokens <= 0:
        return []
    m, F = expert_shape(H, float(attrs["expert_numel"]), float(attrs.get("expert_act_numel", 0)))
    accum = 2 * grad_elem  # the in-place accumulation: read + write of the main gradient
    local = E // ep
    R = tokens * k  # routed rows the rank's experts compute (balanced)
    r = R / local
    N1 = (m - 1) * F if m > 1 else F  # fc1's width (gate and up fused); a single matrix: H -> F
    out: list[Kernel] = []
    dense = float(attrs.get("dense_numel", 0))
    if dense > 0:  # the router (and any shared part of the block) as one GEMM on the n tokens
        w = dense / H
        f = 2 * tokens * dense
        io = tokens * (H + w) * elem
        out += [Kernel("router", "fwd", f, io + dense * weight_elem, (tokens, w, H), 1),
                Kernel("router dgrad", "bwd_input", f, io + dense * weight_elem, (tokens, H, w), 1),
                Kernel("router wgrad", "bwd_weight", f, io + dense * accum, (H, w, tokens), 1)]
    gemms = [("fc1", H, N1)] + ([("fc2", F, H)] if m > 1 else [])
    for name, K, N in gemms:
        f = 2 * R * K * N
        io = R * (K + N) * elem
        out += [Kernel(name, "fwd", f, io + local * K * N * weight_elem, (r, N, K), local),
                Kernel(f"{name} dgrad", "bwd_input", f, io + local * K * N * weight_elem, (r, K, N), local),
                Kernel(f"{name} wgrad", "bwd_weight", f, io + local * K * N * accum, (K, N, r), local)]
    move = (tokens + R) * H * elem
    out += [Kernel("permute", "fwd", 0.0, move), Kernel("unpermute", "fwd", 0.0, move),
            Kernel("unpermute backward", "bwd_input", 0.0, move), Kernel("permute backward", "bwd_input", 0.0, move)]
    if m > 1:
        out += [Kernel("activation", "fwd", 0.0, R * (N1 + F) * elem),
                Kernel("activation backward", "bwd_input", 0.0, R * (2 * N1 + F) * elem)]
    return out
