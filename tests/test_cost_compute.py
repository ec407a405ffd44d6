"""Compute cost model (cost_models.compute): roofline, backward split, node_time."""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.cost_models.compute import (
    NodeTime,
    backward_factors,
    dtype_bytes,
    elem_scale,
    matmul_efficiency_at,
    node_input_bytes,
    node_time,
    nodes_time,
    roofline_time_s,
)
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.graph import NODE_KINDS, GraphNode

# the flat roofline (sm_count 0: no GEMM shape factor); shapes: tests/test_cost_efficiency.py
A100 = dataclasses.replace(ClusterSpec.preset("a100-80g"), sm_count=0)


def _linear(tokens: int = 4096, fin: int = 4096, fout: int = 4096, frozen: bool = False) -> GraphNode:
    return GraphNode(
        id=1, name="fc", op="call_module", kind="linear", target="Linear", module_fqn="fc",
        inputs=(0,), out_shape=(tokens, fout), out_dtype="bfloat16", out_bytes=tokens * fout * 2,
        param_numel=fin * fout, param_bytes=fin * fout * 2, frozen_param_numel=fin * fout if frozen else 0,
        fwd_flops=2 * tokens * fin * fout, saved_bytes=tokens * fin * 2,
        attrs={"in_features": fin, "out_features": fout},
    )  # fmt: skip


def test_roofline_compute_bound_hand_arithmetic() -> None:
    t = roofline_time_s(1e12, 1e6, A100, dtype="bf16", kind="linear")
    assert t == pytest.approx(1e12 / (312e12 * A100.matmul_efficiency))


def test_roofline_memory_bound_and_vector_peak() -> None:
    # a norm over 1 GB: memory bound at HBM bandwidth × efficiency
    t = roofline_time_s(1e6, 1e9, A100, kind="norm")
    assert t == pytest.approx(1e9 / (2.039e12 * A100.mem_efficiency))
    # non-matmul FLOPs run at the fp32 (vector) peak, not the tensor-core peak
    t2 = roofline_time_s(1e12, 0, A100, kind="elementwise")
    assert t2 == pytest.approx(1e12 / (19.5e12 * A100.matmul_efficiency))


def test_roofline_floor_and_free_kinds() -> None:
    assert roofline_time_s(10, 10, A100) == A100.kernel_floor_s
    assert roofline_time_s(0, 0, A100) == 0.0
    assert roofline_time_s(1e9, 1e9, A100, kind="reshape") == 0.0
    calibrated = dataclasses.replace(A100, matmul_efficiency=0.5)
    assert roofline_time_s(1e12, 0, calibrated) == pytest.approx(2 * 1e12 / 312e12)


def test_roofline_errors() -> None:
    with pytest.raises(ValueError, match="kind"):
        roofline_time_s(1, 1, A100, kind="conv")
    with pytest.raises(ValueError, match="flops"):
        roofline_time_s(-1, 1, A100)


def test_backward_factors_cover_every_kind() -> None:
    for k in NODE_KINDS:
        b, w = backward_factors(k)
        assert b >= 0 and w >= 0
    assert backward_factors("linear") == (1.0, 1.0)
    assert backward_factors("attention") == (2.5, 0.0)  # flash: five GEMMs of the forward's two
    assert backward_factors("norm")[1] < backward_factors("norm")[0]
    assert backward_factors("elementwise")[1] == 0.0


def test_node_time_linear_b_equals_w_equals_fwd() -> None:
    n = _linear()
    t = node_time(n, A100)
    expected = roofline_time_s(n.fwd_flops, 3 * 4096 * 4096 * 2, A100)  # in + out + weight, all bf16
    assert t.fwd_s == pytest.approx(expected)
    assert t.bwd_input_s == pytest.approx(t.fwd_s) and t.bwd_weight_s == pytest.approx(t.fwd_s)
    assert t.bwd_s == pytest.approx(2 * t.fwd_s) and t.total_s == pytest.approx(3 * t.fwd_s)


def test_node_time_shard_and_batch_scale() -> None:
    n = _linear()
    base = node_time(n, A100).fwd_s
    assert node_time(n, A100, shard=4).fwd_s == pytest.approx(base / 4)  # compute bound: FLOPs / 4
    assert node_time(n, A100, batch_scale=2.0).fwd_s == pytest.approx(2 * base)
    # a memory-bound small-batch linear: weight bytes do not scale with the batch
    small = _linear(tokens=1)
    t1, t2 = node_time(small, A100).fwd_s, node_time(small, A100, batch_scale=2.0).fwd_s
    weight_s = 4096 * 4096 * 2 / (A100.mem_bw_bytes_per_s * A100.mem_efficiency)
    assert t1 == pytest.approx(weight_s, rel=0.01) and t2 == pytest.approx(t1, rel=0.01)


def test_node_time_dtype_rescales_traced_bytes() -> None:
    n = dataclasses.replace(_linear(tokens=1), out_dtype="float32")
    # traced in fp32, costed in bf16: the bytes halve (memory-bound case)
    assert node_time(n, A100, dtype="bf16").fwd_s == pytest.approx(node_time(n, A100, dtype="fp32").fwd_s / 2)


def test_node_time_frozen_and_weightless_nodes_have_no_w() -> None:
    assert node_time(_linear(frozen=True), A100).bwd_weight_s == 0.0
    attn = GraphNode(
        id=2, name="sdpa", op="call_function", kind="attention", target="sdpa", inputs=(0, 1, 1),
        out_shape=(1, 16, 2048, 128), out_dtype="bfloat16", out_bytes=2048 * 2048 * 2, fwd_flops=4 * 2048**2 * 2048,
    )  # fmt: skip
    t = node_time(attn, A100)
    assert t.bwd_weight_s == 0.0 and t.bwd_input_s == pytest.approx(2.5 * t.fwd_s)
    view = GraphNode(id=3, name="v", op="call_method", kind="reshape", target="view", out_bytes=10**9)
    assert node_time(view, A100) == NodeTime(0.0, 0.0, 0.0)


def test_tied_head_prices_its_weight_gradient() -> None:
    """A tied LM head counts no parameter (the embedding does) but reads a trainable weight: torch
    computes dW = dYᵀ·X at the head as at any linear, so its W is the owning linear's (the
    weight's bytes aside: compute-bound here); frozen (``frozen_params``), no W."""
    own = _linear(tokens=8192, fin=4096, fout=50304)
    tied = dataclasses.replace(own, param_numel=0, param_bytes=0, param_names=("lm_head.weight",),
                               shared_params=("lm_head.weight",))  # fmt: skip
    assert tied.trains_weight and own.trains_weight
    assert node_time(tied, A100).bwd_weight_s == pytest.approx(node_time(own, A100).bwd_weight_s, rel=1e-3)
    assert node_time(tied, A100).bwd_weight_s == pytest.approx(node_time(tied, A100).fwd_s)
    frozen = dataclasses.replace(tied, frozen_params=("lm_head.weight",))
    assert not frozen.trains_weight and node_time(frozen, A100).bwd_weight_s == 0.0
    h100 = ClusterSpec.preset("h100")  # the shape-aware path (sm_count) alike
    assert node_time(tied, h100).bwd_weight_s == pytest.approx(node_time(own, h100).bwd_weight_s, rel=1e-3)


def test_node_time_input_bytes_from_edges_and_sum() -> None:
    n = _linear(tokens=1)
    edges = [(0, 1, 4096 * 2), (5, 6, 999)]
    assert node_input_bytes(edges, 1) == 4096 * 2
    exact = node_time(n, A100, input_bytes=node_input_bytes(edges, 1))
    assert exact == node_time(n, A100)  # the estimate (out · in/out) is exact for a linear
    total = nodes_time([n, n], A100, edges=edges)
    assert total.fwd_s == pytest.approx(2 * exact.fwd_s)
    assert nodes_time([n], A100, shard={1: 2}).fwd_s <= exact.fwd_s


def test_node_time_errors() -> None:
    with pytest.raises(ValueError, match="shard"):
        node_time(_linear(), A100, shard=0)
    with pytest.raises(ValueError, match="batch_scale"):
        node_time(_linear(), A100, batch_scale=0)
    with pytest.raises(ValueError, match="dtype"):
        dtype_bytes("int3")
    with pytest.raises(ValueError, match="dtype"):
        node_time(_linear(), A100, dtype="int3")


def test_elem_scale() -> None:
    assert elem_scale("float32", "bf16") == 0.5
    assert elem_scale("torch.bfloat16", "fp32") == 2.0
    assert elem_scale("int64", "bf16") == 1.0 and elem_scale(None, "bf16") == 1.0


# ---- eager calibration (fields a `meshplan profile` fills; presets leave them empty) ------------
EAGER = dataclasses.replace(
    A100,
    op_overhead_s=4e-6,
    bwd_op_overhead_s=10e-6,
    matmul_efficiency_by_flops=[[1e9, 0.8, 0.6], [1e6, 0.2, 0.1]],  # unsorted on purpose
)


def test_matmul_efficiency_interpolates_in_log_flops_and_clamps() -> None:
    assert matmul_efficiency_at(A100, 1e3) == A100.matmul_efficiency  # no table: flat, any size
    assert matmul_efficiency_at(A100, 1e15, backward=True) == A100.matmul_efficiency
    assert matmul_efficiency_at(EAGER, 1e6) == pytest.approx(0.2)
    assert matmul_efficiency_at(EAGER, 10**7.5) == pytest.approx(0.5)  # half way in log10: 6 -> 9
    assert matmul_efficiency_at(EAGER, 10**7.5, backward=True) == pytest.approx(0.35)
    assert matmul_efficiency_at(EAGER, 1.0) == pytest.approx(0.2)  # clamped below the table
    assert matmul_efficiency_at(EAGER, 1e12, backward=True) == pytest.approx(0.6)  # and above it


def test_roofline_efficiency_override() -> None:
    assert roofline_time_s(1e12, 0, A100, efficiency=0.5) == pytest.approx(1e12 / (312e12 * 0.5))
    with pytest.raises(ValueError, match="efficiency"):
        roofline_time_s(1e12, 0, A100, efficiency=1.5)


def test_node_time_uses_size_dependent_efficiency_fwd_and_bwd() -> None:
    n = _linear(tokens=64, fin=256, fout=256)  # 2·64·256·256 ≈ 8.4 MFLOP: compute bound on the table
    flops = n.fwd_flops
    eff_f, eff_b = matmul_efficiency_at(EAGER, flops), matmul_efficiency_at(EAGER, flops, backward=True)
    assert 0.2 < eff_b < eff_f < 0.8
    t = node_time(n, EAGER)
    compute_f, compute_b = flops / (312e12 * eff_f), flops / (312e12 * eff_b)
    bytes_s = (64 * 256 * 2 * 2 + 256 * 256 * 2) / (A100.mem_bw_bytes_per_s * A100.mem_efficiency)
    assert t.fwd_s == pytest.approx(max(compute_f, bytes_s, A100.kernel_floor_s) + 4e-6)
    assert t.bwd_input_s == pytest.approx(max(compute_b, bytes_s, A100.kernel_floor_s) + 10e-6)
    assert t.bwd_weight_s == pytest.approx(t.bwd_input_s)
    # a small GEMM loses more of the peak than a big one: time per FLOP falls with size
    big = _linear(tokens=4096, fin=4096, fout=4096)
    tb = node_time(big, EAGER)
    assert tb.fwd_s / big.fwd_flops < (t.fwd_s - 4e-6) / flops
    assert tb.fwd_s == pytest.approx(big.fwd_flops / (312e12 * 0.8) + 4e-6, rel=1e-6)


def test_op_overhead_per_part_and_views_cost_host_time() -> None:
    norm = GraphNode(id=4, name="ln", op="call_module", kind="norm", target="LayerNorm", out_bytes=1024,
                     param_numel=2, param_bytes=8, fwd_flops=5000)  # fmt: skip
    plain, eager = node_time(norm, A100), node_time(norm, EAGER)
    assert eager.fwd_s == pytest.approx(plain.fwd_s + 4e-6)
    assert eager.bwd_input_s == pytest.approx(plain.bwd_input_s + 10e-6)
    assert eager.bwd_weight_s == pytest.approx(plain.bwd_weight_s + 10e-6)
    view = GraphNode(id=3, name="v", op="call_method", kind="reshape", target="view", out_bytes=10**9)
    assert node_time(view, EAGER) == NodeTime(4e-6, 10e-6, 0.0)
    assert node_time(view, A100) == NodeTime(0.0, 0.0, 0.0)  # presets: views stay free
    inp = GraphNode(id=0, name="x", op="placeholder", kind="input", target="x", out_bytes=100)
    assert node_time(inp, EAGER) == NodeTime(0.0, 0.0, 0.0)


def test_presets_have_no_eager_calibration() -> None:
    # GPU presets are calibrated against published runs: the eager fields must leave them as they were
    for name in ("a100-80g", "h100", "v100"):
        spec = ClusterSpec.preset(name)
        assert spec.op_overhead_s == 0.0 and spec.bwd_op_overhead_s == 0.0
        assert spec.matmul_efficiency_by_flops == []
    n = _linear()
    assert node_time(n, A100).fwd_s == pytest.approx(n.fwd_flops / (312e12 * A100.matmul_efficiency))


def test_eager_fields_validate_and_round_trip() -> None:
    assert ClusterSpec.from_json(EAGER.to_json()) == EAGER
    with pytest.raises(ValueError, match="matmul_efficiency_by_flops"):
        dataclasses.replace(A100, matmul_efficiency_by_flops=[[1e6, 0.0, 0.5]])
    with pytest.raises(ValueError, match="matmul_efficiency_by_flops"):
        dataclasses.replace(A100, matmul_efficiency_by_flops=[[1e6, 0.5]])
    with pytest.raises(ValueError, match="op_overhead_s"):
        dataclasses.replace(A100, op_overhead_s=-1.0)
    # an old profile JSON without the new fields still loads (defaults)
    d = A100.to_dict()
    for k in ("op_overhead_s", "bwd_op_overhead_s", "matmul_efficiency_by_flops"):
        d.pop(k)
    assert ClusterSpec.from_dict(d) == A100
