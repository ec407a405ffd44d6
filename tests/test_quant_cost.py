"""Pure cost model of quantized training (meshplan.cost_models.quant, quant_nodes) against hand arithmetic."""

from __future__ import annotations

import pytest

from meshplan.cost_models.compute import node_time, roofline_time_s
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.cost_models.qlora_kernels import nf4_dequant_bytes_moved
from meshplan.cost_models.quant import (
    QuantCost,
    is_targeted,
    linear_quant_costs,
    lora_param_count,
    lora_trainable_per_rank,
    nf4_bits_per_param,
    qlora_memory_bytes,
    quant_constraint_errors,
    quantized_param_bytes,
)
from meshplan.cost_models.quant_nodes import (
    node_quant_cost,
    qlora_node_kernels,
    quant_node_time,
    quant_state_bytes,
    without_frozen_weight_grad,
)
from meshplan.graph import GraphNode
from meshplan.plan import Quantization

H, FFN, LAYERS, VOCAB = 4096, 11008, 32, 32000  # Llama-2-7B shapes


def _llama7b_linears() -> list[tuple[int, int]]:
    per_layer = [(H, H)] * 4 + [(H, FFN), (H, FFN), (FFN, H)]
    return per_layer * LAYERS


def test_nf4_bits_follow_the_qlora_paper() -> None:
    # 4 bits + 8-bit scale per 64 + one fp32 per 256 scales = 4.127 bits (paper: 0.127 bit/param overhead)
    assert nf4_bits_per_param(64) == pytest.approx(4 + 8 / 64 + 32 / (64 * 256))
    assert nf4_bits_per_param(64) - 4 == pytest.approx(0.127, abs=5e-4)
    assert nf4_bits_per_param(64, double_quant=False) == pytest.approx(4.5)
    assert quantized_param_bytes(1_000_000, "qlora", 4, 64) == pytest.approx(1e6 * 4.127 / 8, rel=1e-3)
    assert quantized_param_bytes(1000, "none", dtype_bytes=2) == 2000
    assert quantized_param_bytes(1000, "qat", 4, 32, dtype_bytes=2) == 2000  # fake quant keeps bf16
    assert quantized_param_bytes(1024, "qat", 4, 32, dtype_bytes=2, deployed=True) == 1024 * (0.5 + 2 / 32)


def test_qlora_memory_of_a_7b_model() -> None:
    q = Quantization(mode="qlora", group_size=64, lora_rank=64)
    linears = _llama7b_linears()
    base_n = sum(i * o for i, o in linears)
    assert base_n == 6_476_005_376
    other = 2 * VOCAB * H + (2 * LAYERS + 1) * H  # embedding + untied head + norms
    mem = qlora_memory_bytes(linears, other, q, dtype_bytes=2, optimizer="adam")

    # base ≈ 0.5 byte/param (0.516 with NF4 scales)
    assert mem.base_bytes / base_n == pytest.approx(0.5159, abs=1e-4)
    # LoRA r=64 on every linear: 64·(in+out) per linear ≈ 160M params, 16 B each with Adam
    lora_n = LAYERS * (4 * 64 * 2 * H + 2 * 64 * (H + FFN) + 64 * (FFN + H))
    assert mem.trainable_params == lora_n == 159_907_840
    assert (mem.lora_param_bytes, mem.lora_grad_bytes, mem.lora_optimizer_bytes) == (
        4 * lora_n,
        4 * lora_n,
        8 * lora_n,
    )
    # frozen parameters carry no gradient or optimizer state
    assert mem.frozen_params == base_n + other
    assert mem.lora_grad_bytes + mem.lora_optimizer_bytes == 12 * mem.trainable_params
    assert mem.total == pytest.approx(base_n * 4.127 / 8 + other * 2 + 16 * lora_n, rel=1e-4)
    # ≈ 6.4 GB in all, vs 16 B/param = 108 GB for full bf16-mixed Adam fine-tuning
    assert 6.3e9 < mem.total < 6.5e9


def test_linear_costs_none_qat_qlora() -> None:
    attrs = {"in_features": 64, "out_features": 128}
    none = linear_quant_costs(attrs, Quantization(), tokens=10)
    assert none == QuantCost(
        param_bytes=64 * 128 * 2,
        trainable_params=64 * 128,
        extra_fwd_flops=0.0,
        extra_bytes_moved=0.0,
        grad_bytes=64 * 128 * 2,
        optimizer_bytes=64 * 128 * 12,
        weight_params=64 * 128,
    )
    qat = linear_quant_costs(attrs, Quantization(mode="qat", group_size=32), tokens=10)
    assert (
        qat.targeted and qat.param_bytes == none.param_bytes and qat.trainable_params == none.trainable_params
    )
    assert qat.extra_fwd_flops == 6 * 64 * 128
    assert qat.extra_bytes_moved == 5 * 64 * 128 * 2
    # the clamp's input and the fake-quantized weight (bf16 here), and the clamp backward's work
    assert qat.extra_saved_bytes == 64 * 128 * (2 + 2) and qat.work_bytes == 64 * 128 * (2 * 2 + 2)

    q = Quantization(mode="qlora", group_size=64, lora_rank=8)
    ql = linear_quant_costs(attrs, q, tokens=10, bias=True)
    lora = 8 * (64 + 128)
    assert ql.trainable_params == lora and ql.frozen_params == 64 * 128 + 128
    assert ql.grad_bytes == 4 * lora and ql.optimizer_bytes == 8 * lora
    assert ql.param_bytes == pytest.approx(64 * 128 * nf4_bits_per_param(64) / 8 + 128 * 2 + 4 * lora)
    assert not ql.base_weight_grad
    assert ql.extra_fwd_flops == 2 * 10 * 8 * (64 + 128)
    assert ql.extra_bwd_flops == 2 * ql.extra_fwd_flops
    # not targeted (an LM head with default targets) -> plain costs
    assert not linear_quant_costs(attrs, q, tokens=10, fqn="lm_head").targeted
    assert linear_quant_costs(attrs, q, tokens=10, fqn="blocks.0.mlp.fc_in").targeted


def test_lora_tp_layouts() -> None:
    assert lora_param_count(64, 128, 4) == 4 * 192
    assert lora_trainable_per_rank(64, 128, 4, "colwise", 2) == 4 * 64 + 4 * 64
    assert lora_trainable_per_rank(64, 128, 4, "rowwise", 2) == 4 * 32 + 4 * 128
    q = Quantization(mode="qlora", group_size=64, lora_rank=4)
    col = linear_quant_costs({"in_features": 64, "out_features": 128}, q, tokens=1, style="colwise", tp=2)
    assert col.frozen_params == 64 * 64 and col.extra_fwd_flops == 2 * 4 * (64 + 64)


def test_targeting_and_validation() -> None:
    assert is_targeted("model.layers.3.self_attn.q_proj", ())
    assert not is_targeted("lm_head", ())
    assert is_targeted("lm_head", ("lm_head",))
    assert not is_targeted("blocks.0.attn.q_proj", ("k_proj",))
    with pytest.raises(ValueError, match="in_features"):
        linear_quant_costs({"in_features": 4}, Quantization(mode="qat"), tokens=1)
    with pytest.raises(ValueError, match="TP style"):
        linear_quant_costs({"in_features": 4, "out_features": 4}, Quantization(), tokens=1, style="diag")
    with pytest.raises(ValueError, match="NF4"):
        linear_quant_costs(
            {"in_features": 4, "out_features": 4}, Quantization(mode="qlora", bits=8), tokens=1
        )
    with pytest.raises(ValueError, match="mode"):
        quantized_param_bytes(10, "int3")
    with pytest.raises(ValueError, match="rank"):
        lora_param_count(4, 4, 0)


def _linear_node(fqn: str, in_f: int, out_f: int, tokens: tuple[int, int] = (4, 512)) -> GraphNode:
    numel = in_f * out_f + out_f
    return GraphNode(
        id=0, name=fqn.replace(".", "_"), op="call_module", kind="linear", target="Linear", module_fqn=fqn,
        out_shape=(*tokens, out_f), out_dtype="bfloat16", out_bytes=tokens[0] * tokens[1] * out_f * 2,
        param_numel=numel, param_bytes=2 * numel, fwd_flops=2 * tokens[0] * tokens[1] * in_f * out_f,
        attrs={"in_features": in_f, "out_features": out_f, "bias": True},
    )  # fmt: skip


def test_node_helpers_time_and_states() -> None:
    cluster = ClusterSpec.preset("h100")
    node = _linear_node("blocks.0.mlp.fc_in", 4096, 16384)
    plain = node_time(node, cluster, dtype="bf16")
    q0 = Quantization()
    assert quant_node_time(node, q0, cluster) == plain
    # QAT: extra elementwise passes, weight gradient kept
    qat = quant_node_time(node, Quantization(mode="qat", group_size=128), cluster)
    w = 4096 * 16384
    fq_s = roofline_time_s(6 * w, 3 * w * 2, cluster, dtype="bf16", kind="elementwise")
    assert fq_s >= 3 * w * 2 / (cluster.mem_bw_bytes_per_s * cluster.mem_efficiency)
    assert qat.fwd_s == pytest.approx(plain.fwd_s + fq_s)
    assert qat.bwd_weight_s == plain.bwd_weight_s and qat.bwd_input_s > plain.bwd_input_s
    # QLoRA: the base weight-gradient GEMM disappears, LoRA grads are tiny
    ql = Quantization(mode="qlora", group_size=64, lora_rank=16)
    t = quant_node_time(node, ql, cluster)
    assert t.bwd_weight_s < 0.1 * plain.bwd_weight_s
    assert t.fwd_s > plain.fwd_s
    # ... but torchao's eager dequantization (53 bytes per weight, forward and again in the input
    # backward) and the adapter path's kernels make the linear slower than a full-precision one
    deq_s = nf4_dequant_bytes_moved(w) / (cluster.mem_bw_bytes_per_s * cluster.mem_efficiency)
    assert t.fwd_s - plain.fwd_s >= deq_s and t.bwd_input_s - plain.bwd_input_s >= deq_s
    ks = qlora_node_kernels(node, ql)
    assert t.fwd_s == pytest.approx(plain.fwd_s + sum(
        roofline_time_s(k.flops, k.bytes, cluster, kind="linear" if k.gemm else "elementwise")
        for k in ks if k.phase == "fwd"))  # fmt: skip
    assert t.fwd_s + t.bwd_input_s + t.bwd_weight_s > plain.fwd_s + plain.bwd_input_s + plain.bwd_weight_s
    # an input already in the compute dtype (an attention's output): its gradient sum moves fewer bytes
    t_bf16 = quant_node_time(node, ql, cluster, input_elem_bytes=2.0)
    assert t_bf16.bwd_input_s < t.bwd_input_s and t_bf16.fwd_s == pytest.approx(t.fwd_s)
    # the LM head is not targeted by default
    head = _linear_node("lm_head", 4096, 32000)
    assert quant_node_time(head, ql, cluster) == node_time(head, cluster)
    # ... but QLoRA freezes it (every parameter but the adapters): no dW there; the targeted
    # linear keeps its LoRA W; QAT trains every weight
    assert without_frozen_weight_grad(node_time(head, cluster), head, ql).bwd_weight_s == 0.0
    assert without_frozen_weight_grad(node_time(head, cluster), head, ql).bwd_input_s == node_time(head, cluster).bwd_input_s
    assert without_frozen_weight_grad(t, node, ql) == t
    qat_q = Quantization(mode="qat", group_size=128)
    assert without_frozen_weight_grad(node_time(head, cluster), head, qat_q) == node_time(head, cluster)

    qc = node_quant_cost(node, ql, shard=2, style="rowwise")
    assert qc is not None and qc.trainable_params == 16 * 4096 / 2 + 16 * 16384
    assert qc.extra_fwd_flops == 2 * 4 * 512 * 16 * (4096 / 2 + 16384)

    # states: QLoRA keeps the head frozen at 2 B/param, base at NF4, LoRA with Adam
    st = quant_state_bytes([node, head], ql)
    lora = 16 * (4096 + 16384)
    expect_params = w * nf4_bits_per_param(64) / 8 + 16384 * 2 + 4 * lora + (4096 * 32000 + 32000) * 2
    assert st.params == pytest.approx(expect_params)
    assert (st.grads, st.optimizer) == (4 * lora, 8 * lora)
    plain_st = quant_state_bytes([node, head], q0)
    n = 2 * (4096 * 16384 + 16384) // 2 + 4096 * 32000 + 32000
    assert plain_st.total == pytest.approx(16 * n)
    assert quant_state_bytes([node, head], ql, zero=3, dp=4).params == pytest.approx(st.params / 4)


def test_constraint_errors_mirror_the_runtime() -> None:
    lin = [
        ("blocks.0.attn.q_proj", 64, 64, "colwise"),
        ("blocks.0.attn.o_proj", 64, 64, "rowwise"),
        ("lm_head", 64, 100, "replicate"),
    ]
    assert quant_constraint_errors(lin, Quantization(mode="qat", group_size=32), tp=2) == []
    errs = quant_constraint_errors(lin, Quantization(mode="qat", group_size=64), tp=2)
    assert len(errs) == 1 and "o_proj" in errs[0] and "rowwise shard 32" in errs[0]
    assert quant_constraint_errors(lin, Quantization(mode="qat", group_size=48)) != []
    assert quant_constraint_errors(lin, Quantization(mode="qlora", group_size=64), tp=2, fsdp_dp=2) == []
    errs = quant_constraint_errors(
        [("blocks.0.fc", 3, 64, "replicate")], Quantization(mode="qlora", group_size=128)
    )
    assert errs and "NF4 blocks" in errs[0]
    assert quant_constraint_errors(lin, Quantization()) == []
