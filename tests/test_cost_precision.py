"""Precision as a cost option: fp8 (torchao float8 training) GEMMs, scaling overhead, memory,
refusal on GPUs without FP8 tensor cores, and ``meshplan plan --dtype`` pinned or auto."""

from __future__ import annotations

import dataclasses

import pytest
from planner_fixtures import gpt_graph, linear_node

from meshplan.api.plan import choose_dtype, dtype_candidates
from meshplan.cost_models.compute import gemm_time_s, node_time, roofline_time_s
from meshplan.cost_models.efficiency import FP8_TILE_K, fp8_k_factor
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.cost_models.moe_kernels import moe_kernels
from meshplan.cost_models.precision import (
    check_training_dtype,
    fp8_cast_bytes,
    fp8_eligible,
    fp8_weight_copy_bytes,
)
from meshplan.planner.api import estimate_graph

H100 = ClusterSpec.preset("h100")
A100 = ClusterSpec.preset("a100-80g")
FLAT = dataclasses.replace(H100, sm_count=0)  # no shape factor: hand arithmetic below


def test_fp8_only_where_the_gpu_has_fp8_tensor_cores() -> None:
    assert H100.peak("fp8") == pytest.approx(1979e12) and ClusterSpec.preset("h200").peak("fp8") == 1979e12
    check_training_dtype("fp8", H100)
    check_training_dtype("bf16", A100)
    with pytest.raises(ValueError, match="FP8 tensor cores.*a100-80g.*--dtype bf16"):
        check_training_dtype("fp8", A100)
    with pytest.raises(ValueError, match="dtype 'int8' unknown"):
        check_training_dtype("int8", H100)
    with pytest.raises(ValueError, match="FP8 tensor cores"):
        estimate_graph(gpt_graph(layers=2), 8, tp=1, pp=1, dp=8, cluster="a100-80g", dtype="fp8")
    with pytest.raises(ValueError, match="fp8.*with quantization 'qat'.*--dtype bf16"):
        estimate_graph(gpt_graph(layers=2), 8, tp=1, pp=1, dp=8, cluster="h100", dtype="fp8", quantization="qat")


def test_which_linears_torchao_converts() -> None:
    assert fp8_eligible(4096, 11008)
    assert not fp8_eligible(4096, 50257)  # not 16-aligned
    assert not fp8_eligible(4096, 32000, is_head=True)  # the LM head stays bf16 (torchtitan default)


def test_fp8_linear_runs_at_the_fp8_peak_plus_its_casts() -> None:
    n = linear_node(8192, 4096, 4096)
    t8, t16 = node_time(n, FLAT, dtype="fp8"), node_time(n, FLAT, dtype="bf16")
    moved = 8192 * 4096 * (1 + 2) + 4096 * 4096 * 1  # the GEMM reads fp8 input and weight copies, writes bf16
    moved_w = 8192 * 4096 * (1 + 1) + 4096 * 4096 * 2  # dW = Xᵀ·dY: two fp8 operands, a bf16 weight gradient
    bw = FLAT.mem_bw_bytes_per_s * FLAT.mem_efficiency
    cf, cb, cw = (b / bw for b in fp8_cast_bytes(8192, 4096, 4096))
    me = FLAT.matmul_efficiency
    gemm = roofline_time_s(n.fwd_flops, moved, FLAT, dtype="fp8", efficiency=me * 4096 / (4096 + FP8_TILE_K))
    gemm_w = roofline_time_s(n.fwd_flops, moved_w, FLAT, dtype="fp8", efficiency=me * 8192 / (8192 + FP8_TILE_K))
    assert t8.fwd_s == pytest.approx(gemm + cf)
    assert t8.bwd_input_s == pytest.approx(gemm + cb) and t8.bwd_weight_s == pytest.approx(gemm_w + cw)
    assert 1.3 < t16.total_s / t8.total_s < 1.77  # the fp8 GEMM ceiling (1.77x bf16), minus the casts
    # a memory-bound GEMM (few output features): its fp8 operands are read at 1 B/element
    thin = linear_node(65536, 4096, 64)
    t8_thin = node_time(thin, FLAT, dtype="fp8")
    bw = FLAT.mem_bw_bytes_per_s * FLAT.mem_efficiency
    assert t8_thin.fwd_s == pytest.approx((65536 * 4096 + 65536 * 64 * 2 + 4096 * 64) / bw
                                          + fp8_cast_bytes(65536, 64, 4096)[0] / bw)
    # torchao tensorwise, compiled (torchao's roofline): x and dY an amax + one cast into both layouts
    # (2 + 2 + 1 + 1 B/element), the weight amax + cast forward (2 + 3), cast backward (3); M=10 N=20 K=30
    assert fp8_cast_bytes(10, 20, 30) == (6 * 10 * 30 + 5 * 30 * 20, 6 * 10 * 20 + 3 * 30 * 20, 0.0)
    # the head, attention and memory-bound ops are bf16 in fp8 training
    assert node_time(n, FLAT, dtype="fp8", is_head=True) == t16
    norm = dataclasses.replace(n, kind="norm", target="LayerNorm", param_numel=0, param_bytes=0, attrs={})
    assert node_time(norm, FLAT, dtype="fp8") == node_time(norm, FLAT, dtype="bf16")


def test_fp8_gemm_speedup_by_shape() -> None:
    """The mechanisms the H100 measurement showed (BENCHMARKS.md "Wave 3 stop 10: fp8 GEMMs"): a
    short-K fp8 GEMM keeps less of fp8's gain (one 128-deep fp8 k-step per output tile), and a
    memory-bound one moves half the operand bytes but the same 16-bit output bytes."""
    ratio = H100.gemm_peak("fp8") / H100.gemm_peak("bf16")

    def speedup(m: int, n: int, k: int) -> float:
        return gemm_time_s(m, n, k, H100, "bf16") / gemm_time_s(m, n, k, H100, "fp8")

    assert fp8_k_factor(512) == pytest.approx(0.8) and fp8_k_factor(98304) > 0.998
    short, long_ = speedup(98304, 4096, 512), speedup(98304, 512, 4096)  # Llama 3.1 8B tp8: wo fwd, wq fwd
    assert short == pytest.approx(ratio * 0.8, rel=1e-6) and short < 1.45 < long_ < ratio  # measured 1.41 / 1.73
    # memory bound (N = 128: Llama 3.1 8B's wk at tp 8): fp8 reads X at 1 B, so ~2x (measured 1.89 / 2.03) ...
    assert 1.9 < speedup(98304, 128, 4096) < 2.0 and 1.9 < speedup(4096, 128, 98304) <= 2.0
    # ... but its input gradient (K = 128) writes a bf16 dX the size of X either way (measured 0.98)
    assert 0.95 < speedup(98304, 4096, 128) < 1.05
    # the same three through a linear node: each GEMM its own bytes and K
    wk = linear_node(98304, 4096, 128)
    t8, t16 = node_time(wk, H100, dtype="fp8"), node_time(wk, H100, dtype="bf16")
    bw = H100.mem_bw_bytes_per_s * H100.mem_efficiency
    cf, cb, cw = (b / bw for b in fp8_cast_bytes(98304, 128, 4096))
    assert t8.fwd_s - cf == pytest.approx(gemm_time_s(98304, 128, 4096, H100, "fp8"), rel=1e-3)
    assert t8.bwd_input_s - cb == pytest.approx(gemm_time_s(98304, 4096, 128, H100, "fp8"), rel=1e-3)
    assert t8.bwd_weight_s - cw == pytest.approx(gemm_time_s(4096, 128, 98304, H100, "fp8"), rel=1e-3)
    assert t16.bwd_input_s / (t8.bwd_input_s - cb) < 1.05 < 1.9 < t16.fwd_s / (t8.fwd_s - cf)


def test_fp8_recipes_cast_what_their_engine_casts() -> None:
    m, n, k = 8192.0, 3584.0, 8192.0
    # TE delayed: one cast_transpose of x (forward) and of dY (both backward GEMMs); weights cached per step
    assert fp8_cast_bytes(m, n, k, "delayed") == (4 * m * k, 4 * m * n, 0.0)
    assert fp8_cast_bytes(m, n, k, "current") == (6 * m * k, 6 * m * n, 0.0)  # + an amax pass each
    # torchao rowwise, compiled: a cast + bf16 transpose, then its cast (8 B); weight 3 forward, 4 + 3 backward
    assert fp8_cast_bytes(m, n, k, "rowwise") == (8 * m * k + 3 * k * n, 8 * m * n + 7 * k * n, 0.0)
    # torchtitan TP (tensorwise): the crossing operand cast on the 1/tp shard, its other use a transpose copy
    full = fp8_cast_bytes(m, n, k, "tensorwise")
    col = fp8_cast_bytes(m, n, k, "tensorwise", tp=8)
    assert col == (5 * m * k / 8 + 5 * k * n, full[1], 2 * m * k)
    row = fp8_cast_bytes(m, n, k, "tensorwise", tp=8, style="rowwise")
    assert row == (full[0], 5 * m * n / 8 + 3 * k * n, 2 * m * n)
    assert fp8_cast_bytes(m, n, k, "rowwise", tp=8) == fp8_cast_bytes(m, n, k, "rowwise")  # no fp8 all-gather
    # TE under sequence parallelism: the norm writes x in fp8 (no cast of its own), dY cast on the shard
    # (read 2, write 1; current scaling + an amax pass), each gathered tensor transposed in fp8 for dW
    assert fp8_cast_bytes(m, n, k, "delayed", tp=8) == (0.0, 4 * m * n, 2 * m * k)
    assert fp8_cast_bytes(m, n, k, "delayed", tp=8, style="rowwise") == (4 * m * k, 3 * m * n / 8, 2 * m * n)
    assert fp8_cast_bytes(m, n, k, "current", tp=8, style="rowwise") == (6 * m * k, 5 * m * n / 8, 2 * m * n)
    with pytest.raises(ValueError, match="unknown fp8 recipe 'mx'.*tensorwise"):
        fp8_cast_bytes(m, n, k, "mx")
    node = linear_node(8192, 4096, 4096)
    # without sequence parallelism the crossing operand is replicated: cast over all M tokens, no shard cast
    sp, no_sp = (node_time(node, FLAT, shard=4, dtype="fp8", fp8_recipe="delayed", sequence_parallel=v)
                 for v in (True, False))
    assert sp.fwd_s < no_sp.fwd_s and no_sp.bwd_weight_s < sp.bwd_weight_s  # TE: no cast_transpose, a transpose in dW
    te, ao = node_time(node, FLAT, dtype="fp8", fp8_recipe="delayed"), node_time(node, FLAT, dtype="fp8")
    assert te.total_s < ao.total_s  # fewer passes: fused cast + transpose, weights cast once per step


def test_planner_costs_fp8_faster_with_its_weight_copies() -> None:
    g = gpt_graph(layers=4, h=2048, heads=16, seq=2048, vocab=32768)
    # one DP kind for both: bf16 pays autocast's parameter casts under zero1 and not under FSDP2's zero2
    # (cost_models.autocast_casts), so left to choose, bf16 takes zero2 and fp8 zero1
    kw = dict(tp=1, pp=1, dp=8, cluster="h100", global_batch_size=16, micro_batch_size=2, dp_kind="zero1")
    p16, p8 = estimate_graph(g, 8, **kw, dtype="bf16"), estimate_graph(g, 8, **kw, dtype="fp8")
    assert p8.dtype == "fp8"
    assert 1.05 < p16.predicted.compute_s / p8.predicted.compute_s < 2.0
    largest = max(n.param_numel for n in g.nodes if n.kind == "linear")
    assert max(p8.predicted.peak_mem_bytes) - max(p16.predicted.peak_mem_bytes) == pytest.approx(
        fp8_weight_copy_bytes(largest), abs=8)
    # MFU against the bf16 peak (as torchtitan reports float8 runs): faster steps, higher MFU
    assert p8.predicted.mfu > p16.predicted.mfu


def test_dtype_pinned_or_auto_by_cluster_and_target() -> None:
    assert dtype_candidates("fp16", H100, "meshplan") == ("fp16",)
    assert dtype_candidates("auto", H100, "meshplan") == ("bf16",)  # meshplan's runtime refuses fp8
    assert dtype_candidates("auto", H100, "torchtitan") == ("bf16", "fp8")
    assert dtype_candidates("auto", A100, "torchtitan") == ("bf16",)
    with pytest.raises(ValueError, match="FP8 tensor cores"):
        dtype_candidates("fp8", A100, "torchtitan")

    g = gpt_graph(layers=2, h=2048, heads=16, seq=2048, vocab=32768)

    def plan_in(d: str):  # noqa: ANN202
        return estimate_graph(g, 8, tp=1, pp=1, dp=8, cluster="h100", global_batch_size=16, dtype=d)

    best = choose_dtype(plan_in, ("bf16", "fp8"), lambda _m: None)
    assert best.dtype == "fp8"
    assert best.notes[-1].startswith("dtype fp8 chosen (--dtype auto): ") and " vs bf16: " in best.notes[-1]


def test_te_recipes_run_moe_experts_in_fp8_with_their_casts() -> None:
    from meshplan.cost_models.precision import fp8_moe_cast_bytes
    from meshplan.graph import GraphNode

    tokens, h, f, e, k = 8192, 4096, 1536, 16, 8
    expert, act = 3 * h * f, 3 * h + 3 * f  # SwiGLU expert: 3 matrices; GEMM inputs + outputs per token
    moe = GraphNode(
        id=1, name="moe", op="call_module", kind="moe", target="moe", module_fqn="mlp", inputs=(0,),
        out_shape=(tokens, h), out_dtype="bfloat16", out_bytes=tokens * h * 2, param_numel=e * expert,
        param_bytes=e * expert * 2, fwd_flops=2 * tokens * k * expert,
        attrs={"tokens": tokens, "top_k": k, "hidden": h, "num_experts": e, "expert_numel": expert,
               "dense_numel": 0, "expert_act_numel": act},
    )  # fmt: skip
    bf16 = node_time(moe, FLAT, dtype="bf16")
    assert node_time(moe, FLAT, dtype="fp8") == bf16  # torchao's float8 converter leaves grouped experts bf16
    te = node_time(moe, FLAT, dtype="fp8", fp8_recipe="current")
    assert fp8_moe_cast_bytes(tokens * k, act, "current") == (3 * tokens * k * act, 3 * tokens * k * act)
    assert fp8_moe_cast_bytes(tokens * k, act, "tensorwise") == (0.0, 0.0)
    bw = FLAT.mem_bw_bytes_per_s * FLAT.mem_efficiency
    # the MoE layer's kernels (cost_models.moe_kernels): the expert GEMMs at the fp8 peak, the
    # permute / activation / unpermute passes in bf16, plus the casts; each fp8 GEMM at its K's share
    fp8_gemm = [x.groups and not x.name.startswith("router") for x in moe_kernels(moe.attrs, tokens)]
    fwd = sum(roofline_time_s(x.flops, x.bytes, FLAT, dtype="fp8" if f8 else "bf16",
                              kind="moe" if x.groups else "elementwise",
                              efficiency=FLAT.matmul_efficiency * (fp8_k_factor(x.shape[2]) if f8 else 1.0))
              for x, f8 in zip(moe_kernels(moe.attrs, tokens), fp8_gemm, strict=True) if x.phase == "fwd")  # fmt: skip
    assert any(fp8_gemm)
    assert te.fwd_s == pytest.approx(fwd + 3 * tokens * k * act / bw)
    assert te.total_s < bf16.total_s


def test_te_delayed_all_reduces_the_amaxes_per_chunk_and_microbatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """TE DelayedScaling: one amax all-reduce over tp x dp x cp at each model chunk's fp8_autocast exit and
    one in its backward, per microbatch (precision.fp8_amax_reduction_s); none on a one-rank group."""
    from meshplan.cost_models import precision
    from meshplan.cost_models.comm import latency_bound_all_reduce_s

    fwd, bwd = precision.fp8_amax_reduction_s("delayed", 28, 16, H100)
    assert fwd == latency_bound_all_reduce_s(4 * 3 * 28, 16, H100) > 0
    assert bwd == latency_bound_all_reduce_s(4 * 2 * 28, 16, H100) > 0
    assert precision.fp8_amax_reduction_s("delayed", 28, 1, H100) == (0.0, 0.0)
    assert precision.fp8_amax_reduction_s("tensorwise", 28, 16, H100) == (0.0, 0.0)
    g = gpt_graph(layers=4, h=1024, heads=16, seq=1024, vocab=32768)
    kw = dict(tp=1, pp=1, dp=2, cluster="h100", global_batch_size=16, micro_batch_size=2, dtype="fp8",
              profile="nemo-2024")
    with_amax = estimate_graph(g, 2, **kw)
    linears = sum(1 for n in g.nodes if n.kind == "linear" and precision.fp8_eligible(
        n.attrs.get("in_features"), n.attrs.get("out_features"), is_head=n.attrs.get("out_features") == 32768))
    per_mb = sum(precision.fp8_amax_reduction_s("delayed", linears, 2, H100))  # one chunk, group dp = 2
    monkeypatch.setitem(precision.FP8_RECIPES, "delayed",
                        dataclasses.replace(precision.FP8_RECIPES["delayed"], amax_reductions=0))
    without = estimate_graph(g, 2, **kw)
    assert linears == 24 and per_mb > 0  # 4 layers x (q, k, v, o, fc1, fc2); not the LM head
    # 16 sequences / (dp 2 x 2 per microbatch) = 4 microbatches, one chunk each
    assert with_amax.predicted.compute_s - without.predicted.compute_s == pytest.approx(4 * per_mb, rel=1e-6)


def test_te_amax_reductions_per_virtual_stage_carry_the_whole_ranks_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under interleaving every virtual stage (a model chunk, one fp8_autocast region) reduces once forward and
    once backward, and TE's buffer holds the amaxes of all the rank's converted linears, not the chunk's."""
    from meshplan.cost_models import precision

    g = gpt_graph(layers=8, h=1024, heads=16, seq=1024, vocab=32768)
    kw = dict(tp=2, pp=2, dp=2, cluster="h100", global_batch_size=16, micro_batch_size=1, dtype="fp8",
              profile="nemo-2024", schedule="interleaved-1f1b", virtual_stages=2)
    with_amax = estimate_graph(g, 8, **kw)
    af, ab = precision.fp8_amax_reduction_s("delayed", 24, 4, H100)  # 4 layers x 6 linears per rank, tp x dp = 4
    monkeypatch.setitem(precision.FP8_RECIPES, "delayed",
                        dataclasses.replace(precision.FP8_RECIPES["delayed"], amax_reductions=0))
    without = estimate_graph(g, 8, **kw)
    assert len(with_amax.stages) == 4
    for s1, s0 in zip(with_amax.stages, without.stages):
        assert s1.fwd_s - s0.fwd_s == pytest.approx(af, rel=1e-9)
        assert s1.bwd_s - s0.bwd_s == pytest.approx(ab, rel=1e-9)


def test_te_current_scaling_reduces_each_crossing_amax_over_tp_under_sp(monkeypatch: pytest.MonkeyPatch) -> None:
    """TE Float8CurrentScaling under sequence parallelism: a column-parallel module's input and a row-parallel
    module's output gradient each take one 4-byte amax all-reduce over the TP group before their cast, one per
    TE module (q / k / v read one input: one fused module), half in forward, half in backward; none without SP,
    at tp 1 or under the delayed recipe (precision.fp8_sp_amax_reduction_s)."""
    from meshplan.cost_models import precision
    from meshplan.cost_models.comm import latency_bound_all_reduce_s

    one = latency_bound_all_reduce_s(4, 4, H100)
    assert precision.fp8_sp_amax_reduction_s("current", 16, 4, H100) == (8 * one, 8 * one)
    assert precision.fp8_sp_amax_reduction_s("current", 16, 1, H100) == (0.0, 0.0)
    assert precision.fp8_sp_amax_reduction_s("delayed", 16, 4, H100) == (0.0, 0.0)
    g = gpt_graph(layers=4, h=1024, heads=16, seq=1024, vocab=32768)
    kw = dict(tp=2, pp=1, dp=2, cluster="h100", global_batch_size=16, micro_batch_size=2, dtype="fp8",
              profile="megatron-bridge-2025", sequence_parallel=True)
    with_amax = estimate_graph(g, 4, **kw)
    per_mb = sum(precision.fp8_sp_amax_reduction_s("current", 16, 2, H100))  # 4 layers x (qkv, o, fc1, fc2)
    monkeypatch.setitem(precision.FP8_RECIPES, "current",
                        dataclasses.replace(precision.FP8_RECIPES["current"], sp_amax_reductions=False))
    without = estimate_graph(g, 4, **kw)
    # 16 sequences / (dp 2 x 2 per microbatch) = 4 microbatches
    assert with_amax.predicted.compute_s - without.predicted.compute_s == pytest.approx(4 * per_mb, rel=1e-6)


def test_fp8_gemms_run_at_their_measured_ceiling_not_twice_bf16() -> None:
    # maximum achievable matmul on one H100 SXM, one torch build: bf16 794.5 of 989, fp8 1,402.6 of 1,979
    assert H100.gemm_peak("bf16") == H100.peak("bf16") and A100.gemm_peak("bf16") == A100.peak("bf16")
    assert H100.gemm_peak("fp8") == pytest.approx(989e12 * 1402.6 / 794.5)  # 1.77x the bf16 rate, not 2x
    assert dataclasses.replace(H100, gemm_ceiling={}).gemm_peak("fp8") == H100.peak("fp8")
    assert ClusterSpec.from_json(H100.to_json()) == H100
    with pytest.raises(ValueError, match="gemm_ceiling"):
        dataclasses.replace(H100, gemm_ceiling={"fp8": 1.2})


def test_fp8_recipes_that_gather_in_fp8_halve_the_sp_all_gathers() -> None:
    from meshplan.planner.costing import fp8_gathered_events

    g = gpt_graph(layers=2, h=1024, heads=8, seq=1024, vocab=32768)
    heads = {n.id for n in g.nodes if n.kind == "linear" and n.attrs.get("out_features") == 32768}
    ev = fp8_gathered_events(g, heads)
    lin = [n for n in g.nodes if n.kind == "linear" and n.id not in heads]
    assert lin and all((n.id, "reduce_scatter") in ev for n in lin)  # a row-parallel output's dY gathered in fp8
    lin_ids = {n.id for n in lin}
    norms = {s for s, d, _ in g.edges if d in lin_ids and g.nodes[s].kind == "norm"}
    assert norms and all((i, "all_gather") in ev for i in norms)  # a norm feeding fp8 linears: gathered in fp8
    head_inputs = {s for s, d, _ in g.edges if d in heads}
    assert head_inputs and not any((i, "all_gather") in ev for i in head_inputs)  # the LM head's input: bf16
    kw = dict(tp=2, pp=1, dp=4, cluster="h100", global_batch_size=16, micro_batch_size=2, sequence_parallel=True)
    tp_s = {(dt, prof): estimate_graph(g, 8, **kw, dtype=dt, profile=prof).predicted.tp_comm_s
            for dt in ("bf16", "fp8") for prof in ("torchtitan-2025.06", "torchtitan-2026")}
    assert tp_s["fp8", "torchtitan-2025.06"] < tp_s["bf16", "torchtitan-2025.06"]  # tensorwise: fp8 all-gathers
    assert tp_s["fp8", "torchtitan-2026"] == pytest.approx(tp_s["bf16", "torchtitan-2026"])  # rowwise: bf16 ones
