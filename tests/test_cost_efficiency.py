"""Compute efficiency by kernel shape and GPU generation (cost_models.efficiency, node_time)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from planner_fixtures import linear_node

from meshplan.cost_models.compute import node_time, roofline_time_s
from meshplan.cost_models.efficiency import (
    attention_shape_factor,
    attention_wave_factor,
    causal_work_fraction,
    gemm_shape_factor,
    linear_gemm_dims,
    wave_fraction,
)
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.graph import GraphNode

H100 = ClusterSpec.preset("h100")
A100 = ClusterSpec.preset("a100-80g")


def _attention(batch: int, heads: int, seq: int, hd: int, causal: bool) -> GraphNode:
    return GraphNode(
        id=2, name="sdpa", op="call_function", kind="attention", target="scaled_dot_product_attention", inputs=(0,),
        out_shape=(batch, heads, seq, hd), out_dtype="bfloat16", out_bytes=batch * heads * seq * hd * 2,
        fwd_flops=4 * batch * heads * seq * seq * hd,
        attrs={"num_heads": heads, "num_kv_heads": heads, "head_dim": hd, "seq_len": seq, "is_causal": causal},
    )  # fmt: skip


def test_presets_know_their_sm_count_and_old_profiles_load() -> None:
    assert (H100.sm_count, A100.sm_count, ClusterSpec.preset("v100").sm_count) == (132, 108, 80)
    d = H100.to_dict()
    del d["sm_count"]  # a profile written before the field existed
    assert ClusterSpec.from_dict(d).sm_count == 0
    with pytest.raises(ValueError, match="sm_count"):
        dataclasses.replace(H100, sm_count=-1)


def test_wave_and_tile_quantization() -> None:
    assert wave_fraction(132, 132) == 1.0
    assert wave_fraction(133, 132) == pytest.approx(133 / 264)
    # a large square GEMM fills the waves; a small microbatch on a narrow shard cannot
    big = gemm_shape_factor(8192, 8192, 8192, 132)
    small = gemm_shape_factor(256, 512, 1024, 132)
    assert big > 0.95 and small < 0.75
    # tile quantization: N = 520 pads the last tile of every row
    assert gemm_shape_factor(8192, 520, 8192, 132) < gemm_shape_factor(8192, 512, 8192, 132)
    # the generation's SM count matters: 3 x 44 tiles fill 132 SMs, not 108
    assert gemm_shape_factor(256 * 3, 128 * 44, 256, 132) > gemm_shape_factor(256 * 3, 128 * 44, 256, 108)
    assert gemm_shape_factor(100, 100, 100, 0) == 1.0
    with pytest.raises(ValueError, match="m must be"):
        gemm_shape_factor(0, 1, 1, 132)


def test_linear_dims_by_tp_style() -> None:
    assert linear_gemm_dims(4096, 4096, 11008, 8, "colwise") == (4096, 11008 / 8, 4096)
    assert linear_gemm_dims(4096, 11008, 4096, 8, "rowwise") == (4096, 4096, 11008 / 8)


def test_node_time_linear_runs_each_gemm_at_its_shape() -> None:
    flat = dataclasses.replace(H100, sm_count=0)
    n = linear_node(1024, 4096, 4096)
    t, t0 = node_time(n, H100), node_time(n, flat)
    f = gemm_shape_factor(1024, 4096, 4096, 132)
    assert t.fwd_s == pytest.approx(t0.fwd_s / f)
    assert t.bwd_input_s == pytest.approx(t0.bwd_input_s / gemm_shape_factor(1024, 4096, 4096, 132))
    assert t.bwd_weight_s == pytest.approx(t0.bwd_weight_s / gemm_shape_factor(4096, 4096, 1024, 132))
    # a narrow TP shard of a small microbatch is slower per FLOP than the whole GEMM
    small = linear_node(512, 8192, 8192)
    ratio = gemm_shape_factor(512, 8192, 8192, 132) / gemm_shape_factor(512, 1024, 8192, 132)
    assert ratio > 1.05
    assert 8 * node_time(small, H100, shard=8).fwd_s == pytest.approx(ratio * node_time(small, H100).fwd_s)
    # row-parallel: TP splits K (a full-width output), a different shape than column-parallel
    assert node_time(small, H100, shard=8, style="rowwise").fwd_s != node_time(small, H100, shard=8).fwd_s
    # a measured per-size table (meshplan profile) takes precedence over the shape model
    prof = dataclasses.replace(H100, matmul_efficiency_by_flops=[[1e6, 0.5, 0.5], [1e13, 0.5, 0.5]])
    moved = 2 * 1024 * 4096 * 2 + 4096 * 4096 * 2  # input + output + weight
    assert node_time(n, prof).fwd_s == pytest.approx(roofline_time_s(n.fwd_flops, moved, prof, efficiency=0.5))


def test_flash_attention_skips_the_masked_half_and_is_wave_quantized() -> None:
    assert causal_work_fraction(2048, True) == pytest.approx(17 / 32)
    assert causal_work_fraction(2048, False) == 1.0
    assert attention_wave_factor(1, 32, 4096, 132) == pytest.approx(wave_fraction(32 * 32, 132))
    c, nc = _attention(4, 32, 2048, 128, True), _attention(4, 32, 2048, 128, False)
    tc, tnc = node_time(c, H100), node_time(nc, H100)
    # the masked half skipped, each at its own shape's efficiency (efficiency.attention_shape_factor)
    shape = attention_shape_factor(2048, 128, False, exp_cost_flops=H100.exp_cost_flops)
    assert tc.fwd_s / tnc.fwd_s == pytest.approx(17 / 32 * shape)
    assert tc.bwd_input_s == pytest.approx(2.5 * tc.fwd_s)  # flash backward: five GEMMs of the two
    flat = dataclasses.replace(H100, sm_count=0)
    # the flash kernel's own fraction of peak (FlashAttention-2 on H100 at 2k causal: 298 of 989 TFLOP/s), wave-quantized
    assert H100.attention_efficiency == 0.30 and A100.attention_efficiency == 0.53
    assert ClusterSpec.preset("v100").attention_efficiency == 0.0  # no FA2 kernel: matmul_efficiency
    eff = H100.attention_efficiency * shape * attention_wave_factor(4, 32, 2048, 132)
    assert tnc.fwd_s == pytest.approx(node_time(nc, flat).fwd_s * H100.matmul_efficiency / eff)
    plain = dataclasses.replace(H100, attention_efficiency=0.0)  # unset: the GEMM efficiency, no shape factor
    assert node_time(nc, plain).fwd_s == pytest.approx(tnc.fwd_s * 0.30 * shape / H100.matmul_efficiency)
    with pytest.raises(ValueError, match="attention_efficiency"):
        dataclasses.replace(H100, attention_efficiency=1.5)
    assert math.isclose(node_time(c, flat).fwd_s, node_time(nc, flat).fwd_s)  # no SM count: dense FLOPs
    # a GPU profile's measured table sets the efficiency; the kernel still skips the masked half
    prof = dataclasses.replace(H100, matmul_efficiency_by_flops=[[1e6, 0.5, 0.5], [1e14, 0.5, 0.5]])
    assert node_time(c, prof).fwd_s / node_time(nc, prof).fwd_s == pytest.approx(17 / 32, rel=1e-3)


def test_memory_bound_ops_stay_on_bandwidth() -> None:
    norm = GraphNode(id=3, name="ln", op="call_module", kind="norm", target="LayerNorm", inputs=(0,),
                     out_shape=(4096, 4096), out_dtype="bfloat16", out_bytes=4096 * 4096 * 2, fwd_flops=5 * 4096 * 4096)
    t = node_time(norm, H100)
    assert t.fwd_s == pytest.approx(2 * 4096 * 4096 * 2 / (H100.mem_bw_bytes_per_s * H100.mem_efficiency))


def test_memoized_shape_factor_is_the_computed_one() -> None:
    """gemm_shape_factor is memoized (a search asks for few shapes many times): the same value as
    computing it, int and float dimensions kept apart, bad dimensions still raise."""
    compute = gemm_shape_factor.__wrapped__
    for m, n, k in [(2048, 4096, 4096), (2048.0, 4096.0, 4096.0), (7, 3, 600), (16384, 1024, 53248), (1.5, 2, 3)]:
        for sms in (0, 108, 132):
            assert gemm_shape_factor(m, n, k, sms) == compute(m, n, k, sms)
            assert gemm_shape_factor(m, n, k, sms) == compute(m, n, k, sms)  # from the memo
    with pytest.raises(ValueError, match="k must be >= 1"):
        gemm_shape_factor(8, 8, 0, 132)
