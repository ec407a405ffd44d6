"""Memory-bound work outside a fused graph node (cost_models.eager_ops): an eager RMSNorm, the
cross-entropy over the logits, the optimizer update by implementation (cost_models.optimizer_phase); wired
through node_time, the cost table and estimate_graph. Figures by hand from the byte counts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshplan.cost_models.autocast_casts import FP32_EXTRA_BYTES
from meshplan.cost_models.compute import node_time
from meshplan.cost_models.eager_ops import (
    ATTENTION_IMPLS,
    LOSS_PASS_BYTES,
    RUNTIME_NORM_KERNEL,
    eager_rmsnorm_s,
    loss_time_s,
    unfused_attention_s,
)
from meshplan.cost_models.efficiency import gemm_shape_factor
from meshplan.cost_models.engine_profiles import MESHPLAN, PROFILES
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.cost_models.optimizer_phase import optimizer_step_s
from meshplan.graph import GraphNode

H100 = ClusterSpec.preset("h100").without_host_floor()  # device mechanisms: tiny fixtures are host-bound
BW = H100.mem_bw_bytes_per_s * H100.mem_efficiency


def _norm(target: str, tokens: int = 8192, dim: int = 4096) -> GraphNode:
    return GraphNode(
        id=1, name="norm", op="call_module", kind="norm", target=target, module_fqn="norm", inputs=(0,),
        out_shape=(1, tokens, dim), out_dtype="bfloat16", out_bytes=tokens * dim * 2, param_numel=dim,
        param_bytes=dim * 2, attrs={"normalized_dim": dim},
    )  # fmt: skip


def test_eager_rmsnorm_moves_the_bytes_of_its_ops() -> None:
    n = 8192 * 4096
    f, b, w = eager_rmsnorm_s(n, H100)
    assert (f, b, w) == pytest.approx((36 * n / BW, 84 * n / BW, 8 * n / BW))
    assert eager_rmsnorm_s(n, H100, weight_grad=False)[2] == 0.0
    with pytest.raises(ValueError, match="numel"):
        eager_rmsnorm_s(-1, H100)


def test_node_time_prices_an_rmsnorm_module_as_written_and_a_layernorm_as_one_kernel() -> None:
    rms, ln = _norm("RMSNorm"), _norm("LayerNorm")
    fused = node_time(rms, H100, batch_scale=2, input_bytes=rms.out_bytes)
    eager = node_time(rms, H100, batch_scale=2, input_bytes=rms.out_bytes, norm_kernel="eager")
    n = 2 * 8192 * 4096
    assert fused.fwd_s == pytest.approx(4 * n / BW, rel=1e-3)  # one pass: read 2 B, write 2 B (+ the weight)
    assert eager.fwd_s == pytest.approx(36 * n / BW)
    assert eager.bwd_input_s == pytest.approx(84 * n / BW) and eager.bwd_weight_s == pytest.approx(8 * n / BW)
    # sequence parallel: the rank holds 1/shard of the tokens
    assert node_time(rms, H100, shard=2, batch_scale=2, norm_kernel="eager").fwd_s == pytest.approx(eager.fwd_s / 2)
    # F.layer_norm is one kernel in eager: unchanged
    assert node_time(ln, H100, input_bytes=ln.out_bytes, norm_kernel="eager") == node_time(ln, H100, input_bytes=ln.out_bytes)
    with pytest.raises(ValueError, match="norm_kernel"):
        node_time(rms, H100, norm_kernel="triton")


def test_loss_time_by_kernel_and_vocab_shard() -> None:
    tokens, vocab = 16384, 128256
    f, b = loss_time_s(tokens, vocab, H100)
    assert (f, b) == pytest.approx((22 * tokens * vocab / BW, 26 * tokens * vocab / BW))
    # vocab-sharded logits default to torch's loss_parallel, on 1/shard of the columns
    fp, bp = loss_time_s(tokens, vocab, H100, vocab_shard=8)
    assert (fp, bp) == pytest.approx(tuple(x * tokens * vocab / 8 / BW for x in LOSS_PASS_BYTES["loss_parallel"]))
    fm, bm = loss_time_s(tokens, vocab, H100, kernel="fused")
    assert fm + bm == pytest.approx(52 * tokens * vocab / BW)
    with pytest.raises(ValueError, match="loss kernel"):
        loss_time_s(tokens, vocab, H100, kernel="chunked")


def test_unfused_attention_materializes_the_scores() -> None:
    # Megatron-LM 2021 at seq 2048, 16 sequences x 24 heads, head dim 96, fp16 on A100
    a100 = dataclasses.replace(ClusterSpec.preset("a100-80g"), kernel_floor_s=0.0)
    bh, s, d = 16 * 24, 2048, 96
    bw = a100.mem_bw_bytes_per_s * a100.mem_efficiency
    score = bh * s * s
    f, b = unfused_attention_s(bh, s, d, a100, impl="unfused", dtype="fp16", dropout=False)
    # QK^T (K = d = 96) is memory bound on its 2-byte score write; PV is bound by its FLOPs
    qk = max(2 * score * d / (312e12 * a100.matmul_efficiency * gemm_shape_factor(bh * s, s, d, 108)), 2 * score / bw)
    assert qk == pytest.approx(2 * score / bw)
    pv = 2 * score * d / (312e12 * a100.matmul_efficiency * gemm_shape_factor(bh * s, d, s, 108))
    pv = max(pv, 2 * score / bw)
    assert f == pytest.approx(qk + pv + 4 * score / bw)  # + the fused softmax: read 2, write 2
    assert b == pytest.approx(qk + 3 * pv + 6 * score / bw)  # dP, dV, dQ, dK; softmax backward r r w
    # dropout adds 2 + 2 + 1 bytes each way, the 2020 unfused mask fill 2 + 2 more
    f_d, b_d = unfused_attention_s(bh, s, d, a100, impl="unfused", dtype="fp16")
    assert (f_d - f, b_d - b) == pytest.approx((5 * score / bw, 5 * score / bw))
    f_e, b_e = unfused_attention_s(bh, s, d, a100, impl="eager", dtype="fp16")
    assert (f_e - f_d, b_e - b_d) == pytest.approx((4 * score / bw, 4 * score / bw))
    assert ATTENTION_IMPLS == ("flash", "unfused", "eager")
    with pytest.raises(ValueError, match="attention_impl"):
        unfused_attention_s(bh, s, d, a100, impl="flash")


def test_node_time_prices_an_attention_node_without_a_flash_kernel() -> None:
    a100 = ClusterSpec.preset("a100-80g")
    n = GraphNode(
        id=3, name="sdpa", op="call_function", kind="attention", target="scaled_dot_product_attention", inputs=(0, 1, 2),
        out_shape=(2, 16, 2048, 128), out_dtype="bfloat16", out_bytes=2 * 16 * 2048 * 128 * 2,
        fwd_flops=4 * 2 * 16 * 2048 * 2048 * 128, attrs={"num_heads": 16, "seq_len": 2048, "head_dim": 128, "is_causal": True},
    )  # fmt: skip
    flash = node_time(n, a100, batch_scale=2)
    unf = node_time(n, a100, batch_scale=2, shard=2, attention_impl="unfused")
    f, b = unfused_attention_s(2 * 2 * 16 / 2, 2048, 128, a100, impl="unfused", dtype="bf16")
    assert (unf.fwd_s, unf.bwd_input_s, unf.bwd_weight_s) == pytest.approx((f, b, 0.0))
    # the flash kernel skips the masked half and never writes the scores: far cheaper
    assert node_time(n, a100, batch_scale=2, attention_impl="unfused").total_s > 2 * flash.total_s
    with pytest.raises(ValueError, match="attention_impl"):
        node_time(n, a100, attention_impl="sdpa")



@pytest.fixture(scope="module")
def llama_graph():
    from meshplan.models.llama import Llama, LlamaConfig
    from meshplan.trace import trace_model

    cfg = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, dim=64, ffn_hidden=160, vocab_size=96, max_seq_len=32)
    return trace_model(Llama(cfg), (torch.randint(0, 96, (2, 32)),))


def test_estimate_prices_the_engines_norms_loss_and_optimizer(llama_graph) -> None:
    from meshplan.planner.api import estimate_graph
    from meshplan.planner.costing import GraphCoster

    spec = dataclasses.replace(H100, kernel_floor_s=0.0)
    kw = {"tp": 1, "pp": 1, "dp": 1, "global_batch_size": 2, "micro_batch_size": 2, "cluster": spec}
    base = estimate_graph(llama_graph, 1, profile=MESHPLAN.but(norm_kernel="fused"), **kw)
    eager = estimate_graph(llama_graph, 1, profile=MESHPLAN.but(norm_kernel="eager"), **kw)
    # meshplan's runtime runs the zoo Llama's Python RMSNorm as eager ops (no compile): the default
    assert RUNTIME_NORM_KERNEL == "eager"
    assert estimate_graph(llama_graph, 1, **kw).predicted.step_s == eager.predicted.step_s
    foreach = estimate_graph(llama_graph, 1, profile=MESHPLAN.but(optimizer_impl="foreach", norm_kernel="fused"), **kw)
    norms = [n for n in llama_graph.nodes if n.kind == "norm"]
    assert len(norms) == 5  # two per block and the final one
    extra = sum(sum(node_time(n, spec, norm_kernel="eager").__dict__.values()) - sum(node_time(n, spec).__dict__.values())
                for n in norms)  # fmt: skip
    # a fused norm under autocast moves its fp32 input and output at 4 bytes (autocast_casts.FP32_EXTRA_BYTES more
    # per element, forward and backward_factors("norm") = 1.5 + 0.5 passes back); the eager ops' price holds them
    hbm = spec.mem_bw_bytes_per_s * spec.mem_efficiency
    width = sum(FP32_EXTRA_BYTES * 2 * n.out_bytes / 4 * 2 / llama_graph.batch_size for n in norms) * (1 + 2) / hbm
    assert eager.predicted.step_s - base.predicted.step_s == pytest.approx(extra - width, rel=1e-6)
    params = sum(n.param_numel for n in llama_graph.nodes)
    assert base.predicted.optimizer_s == pytest.approx(optimizer_step_s(params, spec))
    assert foreach.predicted.optimizer_s == pytest.approx(optimizer_step_s(params, spec, impl="foreach"))
    # the post layer carries the fp32 cross-entropy over the (untraced-loss) logits
    coster = GraphCoster(llama_graph, spec, profile=MESHPLAN.but(norm_kernel="fused"))
    post = coster.table(1, False, "none", 2).layers[-1]
    nodes = llama_graph.nodes[post.node_start:post.node_end]
    fwd = sum(node_time(n, spec, input_bytes=coster._in_bytes.get(n.id, 0)).fwd_s for n in nodes)
    assert post.fwd_s - fwd == pytest.approx(loss_time_s(2 * 32, 96, spec)[0], rel=1e-6)
    with pytest.raises(ValueError, match="optimizer_impl"):
        estimate_graph(llama_graph, 1, profile=MESHPLAN.but(optimizer_impl="apex"), **kw)
    with pytest.raises(ValueError, match="norm_kernel"):
        estimate_graph(llama_graph, 1, profile=MESHPLAN.but(norm_kernel="x"), **kw)


def test_plans_price_the_runtimes_eager_norm_and_megatron_its_fused_one(llama_graph) -> None:
    """meshplan's own search prices the norms as its runtime runs them (eager, so a plan is no faster
    than what runs); the Megatron adapter prices Transformer Engine's fused norm (its profile's)."""
    from meshplan.api.engine_cost import cost_spec
    from meshplan.engines.spec import EngineSpec
    from meshplan.planner.api import estimate_graph, plan_graph

    spec = dataclasses.replace(H100, kernel_floor_s=0.0)
    plan = plan_graph(llama_graph, 1, cluster=spec, global_batch_size=2)
    kw = {"tp": 1, "pp": 1, "dp": 1, "global_batch_size": 2, "micro_batch_size": plan.micro_batch_size,
          "cluster": spec, "recompute": plan.recompute}
    assert plan.predicted.step_s == pytest.approx(estimate_graph(llama_graph, 1, profile=MESHPLAN.but(norm_kernel="eager"), **kw).predicted.step_s)
    assert plan.predicted.step_s > estimate_graph(llama_graph, 1, profile=MESHPLAN.but(norm_kernel="fused"), **kw).predicted.step_s
    es = EngineSpec(tp=1, pp=1, dp=1, global_batch_size=2, micro_batch_size=2)
    mega, titan = cost_spec(llama_graph, es, spec, "megatron"), cost_spec(llama_graph, es, spec, "torchtitan")
    kw2 = {**kw, "micro_batch_size": 2, "recompute": "none"}
    meg = PROFILES["megatron-core-2026"]
    assert meg.norm_kernel == "fused"
    assert mega.predicted.step_s == pytest.approx(estimate_graph(llama_graph, 1, profile=meg, **kw2).predicted.step_s)
    assert mega.predicted.step_s < estimate_graph(llama_graph, 1, profile=meg.but(norm_kernel="eager"), **kw2).predicted.step_s
    assert titan.predicted.step_s == pytest.approx(
        estimate_graph(llama_graph, 1, profile="torchtitan-2026", **kw2).predicted.step_s)
