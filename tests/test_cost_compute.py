"""Compute cost model (cost_models.compute): roofline, backward split, node_time."""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.cost_models.compute import (
    NodeTime,
    backward_factors,
    dtype_bytes,
    elem_scale,
    node_input_bytes,
    node_time,
    nodes_time,
    roofline_time_s,
)
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.graph import NODE_KINDS, GraphNode

A100 = ClusterSpec.preset("a100-80g")


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
    assert backward_factors("attention") == (2.0, 0.0)
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
    assert t.bwd_weight_s == 0.0 and t.bwd_input_s == pytest.approx(2 * t.fwd_s)
    view = GraphNode(id=3, name="v", op="call_method", kind="reshape", target="view", out_bytes=10**9)
    assert node_time(view, A100) == NodeTime(0.0, 0.0, 0.0)


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
