"""The kernels of a MoE layer (cost_models/moe_kernels.py) and their timing (compute.moe_node_time):
per-expert rows, grouped-GEMM shape efficiency, the permute / activation passes, and the weight
gradient's fp32 accumulation that bounds thinly spread experts. Pure arithmetic, no torch."""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.cost_models.compute import node_time, roofline_time_s
from meshplan.cost_models.efficiency import gemm_shape_factor, grouped_gemm_factor
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.cost_models.moe_kernels import WGRAD_ACCUM_BYTES, expert_shape, moe_kernels
from meshplan.graph import GraphNode

H100 = ClusterSpec.preset("h100")
FLAT = dataclasses.replace(H100, sm_count=0)
H, F, E, K = 4096, 1536, 128, 8  # Qwen3-235B-A22B's MoE layer
ATTRS = {"num_experts": E, "top_k": K, "hidden": H, "expert_numel": 3 * H * F, "expert_act_numel": 3 * (H + F),
         "dense_numel": H * E}


def _node(tokens: int) -> GraphNode:
    return GraphNode(id=1, name="moe", op="call_function", kind="moe", target="moe", module_fqn="mlp", inputs=(0,),
                     out_shape=(tokens, H), out_dtype="bfloat16", out_bytes=tokens * H * 2,
                     param_numel=E * 3 * H * F + H * E, param_bytes=(E * 3 * H * F + H * E) * 2,
                     fwd_flops=2 * tokens * (H * E + K * 3 * H * F), attrs={**ATTRS, "tokens": tokens})  # fmt: skip


def test_expert_shape_read_off_the_traced_counts() -> None:
    assert expert_shape(H, 3 * H * F, 3 * (H + F)) == (3, F)  # SwiGLU: gate, up, down
    assert expert_shape(H, 2 * H * F, 2 * (H + F)) == (2, F)  # a plain MLP: up, down
    assert expert_shape(H, 3 * H * F, 0) == (1, 3 * F)  # no activation count: one H -> 3F matrix
    with pytest.raises(ValueError, match="hidden and expert_numel"):
        expert_shape(0, 1, 1)


def test_kernels_count_the_traced_flops_and_the_rows_per_expert() -> None:
    n, ep = 1024, 8
    ks = moe_kernels(ATTRS, n, ep=ep)
    fwd = sum(x.flops for x in ks if x.phase == "fwd")
    assert fwd == pytest.approx(2 * n * (H * E + K * 3 * H * F))  # tracing.moe.moe_flops
    for phase in ("bwd_input", "bwd_weight"):  # dX and dW: one forward's FLOPs each
        assert sum(x.flops for x in ks if x.phase == phase) == pytest.approx(fwd)
    fc1 = next(x for x in ks if x.name == "fc1")
    assert fc1.shape == (n * K * ep / E, 2 * F, H) and fc1.groups == E // ep  # 512 rows on each of 16 experts
    wgrad = next(x for x in ks if x.name == "fc1 wgrad")
    assert wgrad.shape == (H, 2 * F, n * K * ep / E)  # the rows are the reduction dimension
    assert wgrad.bytes == pytest.approx(n * K * (H + 2 * F) * 2 + (E // ep) * H * 2 * F * WGRAD_ACCUM_BYTES)
    # 16-bit main gradients (Megatron-Bridge's grad_reduce_in_fp32 = False): the accumulation moves half
    wgrad16 = next(x for x in moe_kernels(ATTRS, n, ep=ep, grad_elem=2) if x.name == "fc1 wgrad")
    assert wgrad16.bytes == pytest.approx(n * K * (H + 2 * F) * 2 + (E // ep) * H * 2 * F * WGRAD_ACCUM_BYTES / 2)
    assert wgrad16.flops == wgrad.flops
    permute = next(x for x in ks if x.name == "permute")
    assert permute.flops == 0 and permute.bytes == (n + n * K) * H * 2
    act = next(x for x in ks if x.name == "activation")
    assert act.bytes == n * K * 3 * F * 2  # reads gate + up, writes one F per routed row
    assert moe_kernels(ATTRS, 0) == []
    with pytest.raises(ValueError, match="divisor"):
        moe_kernels(ATTRS, n, ep=3)


def test_grouped_gemm_waves_over_every_expert_s_tiles() -> None:
    # one 128-row expert GEMM of width 1,536 has 12 tiles (split-K makes it 48) for 132 SMs; 16
    # experts' 192 tiles share the SMs in ~1.5 waves
    assert gemm_shape_factor(128, 1536, 4096, 132) < 0.7 < 0.8 < grouped_gemm_factor(128, 1536, 4096, 16, 132)
    assert grouped_gemm_factor(512, 3072, 4096, 1, 132) == gemm_shape_factor(512, 3072, 4096, 132)
    assert grouped_gemm_factor(512, 3072, 4096, 16, 0) == 1.0
    assert grouped_gemm_factor(100, 3072, 4096, 16, 132) < grouped_gemm_factor(128, 3072, 4096, 16, 132)  # tile padding


def test_thin_experts_are_bound_by_the_fp32_weight_gradient_accumulation() -> None:
    # 512 rows per expert: the wgrad GEMM's fp32 read-modify-write of 16 experts' gradients takes longer
    # than its FLOPs; at 4,096 rows per expert the FLOPs dominate again
    for n, bound in ((1024, "memory"), (8192, "compute")):
        w = next(x for x in moe_kernels(ATTRS, n, ep=8) if x.name == "fc1 wgrad")
        t_mem = w.bytes / (FLAT.mem_bw_bytes_per_s * FLAT.mem_efficiency)
        t_flops = w.flops / (FLAT.peak("bf16") * FLAT.matmul_efficiency)
        assert (t_mem > t_flops) == (bound == "memory")
    t = node_time(_node(1024), FLAT, ep=8)
    expect = sum(roofline_time_s(x.flops, x.bytes, FLAT, kind="moe" if x.groups else "elementwise")
                 for x in moe_kernels(ATTRS, 1024, ep=8) if x.phase == "bwd_weight")  # fmt: skip
    assert t.bwd_weight_s == pytest.approx(expect)


def test_node_time_prices_the_rank_s_experts_and_its_passes() -> None:
    node = _node(4096)
    one, eight = node_time(node, H100), node_time(node, H100, ep=8)
    assert eight.total_s < one.total_s  # E/8 experts' weights read and accumulated, 8x the rows each
    fwd = sum(roofline_time_s(x.flops, x.bytes, FLAT, kind="moe" if x.groups else "elementwise")
              for x in moe_kernels(ATTRS, 4096, ep=8) if x.phase == "fwd")  # fmt: skip
    assert node_time(node, FLAT, ep=8).fwd_s == pytest.approx(fwd)
    passes = sum(roofline_time_s(0.0, x.bytes, FLAT, kind="elementwise")
                 for x in moe_kernels(ATTRS, 4096, ep=8) if x.phase == "fwd" and not x.groups)  # fmt: skip
    assert passes > 0.1 * fwd  # permute, activation and unpermute: 10%+ of a Qwen3 MoE layer's forward
    frozen = dataclasses.replace(node, frozen_param_numel=node.param_numel)
    assert node_time(frozen, H100, ep=8).bwd_weight_s == 0.0


def test_main_gradient_bytes_follow_the_state_layout() -> None:
    from meshplan.cost_models.dp_kinds import main_grad_bytes

    assert main_grad_bytes("megatron", "bf16") == 4  # fp32 main_grad (--accumulate-allreduce-grads-in-fp32)
    assert main_grad_bytes("torch", "bf16") == 4  # fp32 parameters and gradients
    assert main_grad_bytes("zero", "bf16") == 2 and main_grad_bytes("zero", "fp8") == 2  # 16-bit gradients
    assert main_grad_bytes("zero", "fp32") == 4
    node = _node(1024)  # 512 rows per expert: the weight gradient is bound by the accumulation's bytes
    t32, t16 = node_time(node, H100, ep=8), node_time(node, H100, ep=8, main_grad_bytes=2)
    assert t16.fwd_s == t32.fwd_s and t16.bwd_input_s == t32.bwd_input_s
    assert t16.bwd_weight_s < 0.9 * t32.bwd_weight_s


def test_flex_dispatch_sends_a_token_once_per_destination_rank() -> None:
    from math import comb

    from meshplan.cost_models.epcp import dispatch_copies

    assert dispatch_copies(128, 8, 8) == 8.0  # all-to-all: a copy per routed expert
    # DeepEP: 8 experts of 128 drawn, 16 per rank: on average 5.34 distinct ranks of 8
    assert dispatch_copies(128, 8, 8, "flex") == pytest.approx(8 * (1 - comb(112, 8) / comb(128, 8)))
    assert dispatch_copies(128, 8, 8, "flex") == pytest.approx(5.339, abs=1e-3)
    assert dispatch_copies(8, 2, 8, "flex") == 2.0  # one expert per rank: nothing shared
    assert dispatch_copies(128, 8, 1, "flex") == 8.0
    with pytest.raises(ValueError, match="dispatcher"):
        dispatch_copies(128, 8, 8, "allgather")


def test_flex_dispatch_across_nodes_sends_a_token_once_per_remote_node() -> None:
    """DeepEP's internode kernels / HybridEP: one RDMA send per destination node, forwarded over
    NVLink inside it; the all-to-all dispatcher and an ep group inside one node are unchanged."""
    from math import comb

    from meshplan.cost_models.comm import nccl_collective
    from meshplan.cost_models.epcp import dispatch_copies, ep_a2a_bytes, ep_comm_s, flex_off_node_copies

    # 128 experts top-8 over 2 nodes of 64: a token almost surely has an expert on the other node
    assert flex_off_node_copies(128, 8, 2) == pytest.approx(1 - comb(64, 8) / comb(128, 8))
    assert flex_off_node_copies(128, 8, 4) == pytest.approx(3 * (1 - comb(96, 8) / comb(128, 8)))
    assert flex_off_node_copies(128, 8, 1) == 0.0
    cl = ClusterSpec.preset("h100", num_nodes=2)
    tokens, h = 4096.0, 2048
    k = dispatch_copies(128, 8, 16, "flex")
    per_rank = ep_comm_s(tokens, k, h, 2, 16, cl, stride=1)  # no expert count given: rank-level copies
    node = ep_comm_s(tokens, k, h, 2, 16, cl, stride=1, num_experts=128, route_k=8, dispatcher="flex")
    buf = ep_a2a_bytes(tokens, k, h, 2)
    assert per_rank == pytest.approx(4 * nccl_collective("all_to_all", buf, 16, cl, ranks_per_node=8)[1])
    eff = cl.comm_efficiency
    nic = tokens * h * 2 * flex_off_node_copies(128, 8, 2) / (cl.inter_bw_bytes_per_s * eff)
    assert node == pytest.approx(4 * (max(7 / 16 * buf / (cl.intra_bw_bytes_per_s * eff), nic) + 15 * cl.inter_latency_s))
    assert node < per_rank / 2  # 3.3 rank copies off the node -> 1.0 node copy
    # inside one node (8 consecutive GPUs) nothing changes; the all-to-all dispatcher is unchanged
    assert ep_comm_s(tokens, 5.3, h, 2, 8, cl, stride=1, num_experts=128, route_k=8, dispatcher="flex") == \
        ep_comm_s(tokens, 5.3, h, 2, 8, cl, stride=1)
    assert ep_comm_s(tokens, 8, h, 2, 16, cl, stride=1, num_experts=128, route_k=8, dispatcher="alltoall") == \
        ep_comm_s(tokens, 8, h, 2, 16, cl, stride=1)
