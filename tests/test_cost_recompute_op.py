"""Op-level selective recompute in the cost model (``recompute="op"``), the cross-entropy peak and the
recompute transient, on a traced zoo Llama, by hand from the shapes."""

from __future__ import annotations

import pytest
import torch

from meshplan.cost_models.memory import (
    loss_buffer_bytes,
    node_activation_bytes,
    op_sac_kept_bytes,
    recompute_transient_bytes,
)
from meshplan.models.llama import Llama, LlamaConfig
from meshplan.trace import trace_model

B, S, H, HEADS, KV, FFN, V = 2, 32, 64, 4, 2, 160, 96
HD, KVD = H // HEADS, H // HEADS * KV


@pytest.fixture(scope="module")
def graph():
    cfg = LlamaConfig(n_layer=2, n_head=HEADS, n_kv_head=KV, dim=H, ffn_hidden=FFN, vocab_size=V,
                                max_seq_len=S)
    return trace_model(Llama(cfg), (torch.randint(0, V, (B, S)),))


def _block(g):
    a, b = g.blocks[0].node_ranges[0]
    return g.nodes[a:b]


def test_op_counts_the_three_matmuls_of_each_qlora_linear(graph) -> None:
    """A QLoRA linear issues three matmuls (NF4 base, ``x @ A^T`` of rank r, ``h @ B^T``): of a block's
    21 the 1st, 3rd, ... are kept, q_proj's base (1) and B (3), k_proj's A (5), v_proj's base and B
    (7, 9), o_proj's A (11), gate_proj's base and B (13, 15), up_proj's A (17), down_proj's base and B."""
    from meshplan.cost_models.quant import qlora_mm_parts

    nodes = _block(graph)
    r, tokens, fp32 = 8, B * S, 4

    def parts(n):
        return qlora_mm_parts(int(n.attrs["out_features"]), r)

    want = tokens * fp32 * (H + 2 * H + r + 2 * KVD + r + H * (1 + 1 / HD) + 2 * FFN + r + 2 * H)
    assert op_sac_kept_bytes(nodes, input_bytes=tokens * H * fp32, mm_parts=parts) == pytest.approx(want)
    # A's output (rank r) is whole on every TP rank; the base and B outputs split like the linear's
    assert qlora_mm_parts(4096, 16) == ((1.0, True), (16 / 4096, False), (1.0, True))
    with pytest.raises(ValueError):
        qlora_mm_parts(4096, 0)


def test_op_keeps_input_every_other_linear_and_attention(graph) -> None:
    nodes = _block(graph)
    assert [n.module_fqn.rsplit(".", 1)[-1] for n in nodes if n.kind == "linear"] == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # fmt: skip
    tokens, fp32 = B * S, 4
    # input + q_proj (1st) + v_proj (3rd) + attention output (+ log-sum-exp) + gate_proj (5th) + down_proj (7th)
    want = tokens * fp32 * (H + H + KVD + H * (1 + 1 / HD) + FFN + H)
    assert op_sac_kept_bytes(nodes, input_bytes=tokens * H * fp32) == pytest.approx(want)
    got = node_activation_bytes(nodes, recompute="op", input_bytes=tokens * H * fp32, batch_scale=2.0, elem_scale=0.5)
    assert got == pytest.approx(want)  # twice the batch, half the bytes
    none = node_activation_bytes(nodes, recompute="none", seq_len=S)
    full = node_activation_bytes(nodes, recompute="full", input_bytes=tokens * H * fp32)
    assert full < want < none
    assert recompute_transient_bytes(none, want) == pytest.approx(none - want)
    assert recompute_transient_bytes(want, none) == 0.0


def test_op_under_tensor_parallel(graph) -> None:
    nodes = _block(graph)
    tokens, fp32, t = B * S, 4, 4

    def out_shard(n):  # colwise linears and attention leave sharded, rowwise ones partial (full size)
        name = (n.module_fqn or "").rsplit(".", 1)[-1]
        return 1 if name in ("o_proj", "down_proj") else t

    inp = tokens * H * fp32
    tp_only = inp + tokens * fp32 * (H / t + KVD / t + H * (1 + 1 / HD) / t + FFN / t + H)
    assert op_sac_kept_bytes(nodes, tp=t, input_bytes=inp, out_shard_of=out_shard) == pytest.approx(tp_only)
    # sequence parallel: the input is sequence-sharded and both reduce-scattered outputs are kept
    sp = tp_only - inp + inp / t + 2 * tokens * H * fp32 / t
    assert op_sac_kept_bytes(nodes, tp=t, sp=True, input_bytes=inp, out_shard_of=out_shard) == pytest.approx(sp)


def test_op_inside_a_compiled_block_keeps_no_output_only_an_addition_reads(graph) -> None:
    # torch.compile's partitioner stores a MUST_SAVE output only where the backward reads it: down_proj's
    # output (and o_proj's, unsaved anyway) feeds only the residual addition; the other saves stay
    nodes = _block(graph)
    tokens, fp32, t = B * S, 4, 4
    inp = tokens * H * fp32
    eager = op_sac_kept_bytes(nodes, input_bytes=inp)
    assert op_sac_kept_bytes(nodes, input_bytes=inp, sac_saves="partitioned") == pytest.approx(eager - tokens * H * fp32)

    def out_shard(n):
        return 1 if (n.module_fqn or "").rsplit(".", 1)[-1] in ("o_proj", "down_proj") else t

    sp = op_sac_kept_bytes(nodes, tp=t, sp=True, input_bytes=inp, out_shard_of=out_shard)
    # under SP both reduce-scattered outputs go too, and down_proj's partial output
    got = op_sac_kept_bytes(nodes, tp=t, sp=True, input_bytes=inp, out_shard_of=out_shard, sac_saves="partitioned")
    assert got == pytest.approx(sp - 2 * tokens * H * fp32 / t - tokens * H * fp32)
    got = node_activation_bytes(nodes, recompute="op", input_bytes=inp, sac_saves="partitioned")
    assert got == pytest.approx(eager - tokens * H * fp32)
    with pytest.raises(ValueError, match="sac_saves"):
        op_sac_kept_bytes(nodes, sac_saves="compiled")


def test_loss_peak_per_cross_entropy_kernel() -> None:
    # eager F.cross_entropy: saved log-softmax + its incoming and outgoing fp32 gradients
    assert loss_buffer_bytes(1000, 50, logits_bytes=2) == 1000 * 50 * 12
    # vocab-sharded logits under torch's loss_parallel: (zeros + exp(x)) * g beside the saved x
    assert loss_buffer_bytes(1000, 50, vocab_shard=5, logits_bytes=4) == 1000 * 10 * 16
    # fused kernels (Megatron, flash-attn): one fp32 buffer, or the cast of 16-bit logits
    assert loss_buffer_bytes(1000, 50, logits_bytes=2, kernel="fused") == 1000 * 50 * 6
    # torch.compile'd F.cross_entropy(logits.float()): the 16-bit logits and their 16-bit gradient, no fp32 copy
    assert loss_buffer_bytes(1000, 50, logits_bytes=2, kernel="compiled") == 1000 * 50 * 4
    with pytest.raises(ValueError, match="loss kernel"):
        loss_buffer_bytes(1000, 50, kernel="chunked")


def test_estimate_orders_recompute_kinds(graph) -> None:
    from meshplan.planner.api import estimate_graph

    plans = {rc: estimate_graph(graph, 1, tp=1, pp=1, dp=1, micro_batch_size=8, global_batch_size=8, recompute=rc,
                                cluster="h100") for rc in ("none", "op", "full")}  # fmt: skip
    mem = {rc: p.predicted.mem_breakdown["activations"] for rc, p in plans.items()}
    rec = {rc: p.predicted.recompute_s for rc, p in plans.items()}
    assert mem["full"] < mem["op"] < mem["none"]
    assert rec["none"] == 0.0 < rec["op"] < rec["full"]
