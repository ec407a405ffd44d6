"""Flash-attention efficiency by shape (sequence length, head dim, causal) and kernel generation
(FlashAttention-2 / -3), relative to the reference shape the presets' attention_efficiency was read at."""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.cost_models.compute import shape_efficiencies
from meshplan.cost_models.efficiency import (
    ATTENTION_REF_SHAPE,
    HOPPER_MMA_SYNC_FRACTION,
    attention_shape_factor,
)
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.graph import GraphNode

H100 = ClusterSpec.preset("h100")
A100 = ClusterSpec.preset("a100-80g")


def f(seq, d, causal, spec=H100, kernel="fa2"):
    return attention_shape_factor(seq, d, causal, kernel=kernel, exp_cost_flops=spec.exp_cost_flops)


def test_reference_shape_is_the_calibration_point():
    assert ATTENTION_REF_SHAPE == (128, True, 2048)
    assert f(2048, 128, True) == pytest.approx(1.0) and f(2048, 128, True, A100) == pytest.approx(1.0)


def test_longer_sequences_and_wider_heads_run_faster():
    assert f(512, 128, True) < f(2048, 128, True) < f(8192, 128, True)
    assert f(2048, 64, True) < 1.0
    # the exponential weighs more against H100's tensor cores than A100's (FA3 §3.1): head dim 64 loses more
    assert f(2048, 64, True, H100) < f(2048, 64, True, A100)
    # H100: E = 989/3.9 matmul FLOPs per exp; d = 128 forward: exp is ~50 % of the matmul time (FA3 §3.1)
    assert H100.exp_cost_flops / (4 * 128) == pytest.approx(0.5, abs=0.01)


def test_flashattention3_on_hopper_is_1_5_to_2x_flashattention2():
    x = f(2048, 128, True, kernel="fa3")
    expected = (1 / HOPPER_MMA_SYNC_FRACTION) * (14 * 128 + 2 * H100.exp_cost_flops) / (14 * 128)
    assert x == pytest.approx(expected)
    assert 1.5 <= x <= 2.0  # FA3 abstract: 1.5-2.0x over FA2 on H100
    fa3 = dataclasses.replace(H100, attention_kernel="fa3")
    with pytest.raises(ValueError, match="attention_kernel"):
        dataclasses.replace(A100, attention_kernel="fa3")  # Hopper only
    with pytest.raises(ValueError, match="attention_kernel"):
        dataclasses.replace(H100, attention_kernel="fa4")
    assert fa3.attention_kernel == "fa3"


def _attention(seq: int, hd: int) -> GraphNode:
    return GraphNode(
        id=2, name="sdpa", op="call_function", kind="attention", target="scaled_dot_product_attention", inputs=(0,),
        out_shape=(4, 32, seq, hd), out_dtype="bfloat16", out_bytes=4 * 32 * seq * hd * 2,
        fwd_flops=4 * 4 * 32 * seq * seq * hd,
        attrs={"num_heads": 32, "num_kv_heads": 32, "head_dim": hd, "seq_len": seq, "is_causal": True},
    )  # fmt: skip


def test_node_costing_uses_the_shape():
    att = _attention(4096, 128)
    e_fa2 = shape_efficiencies(att, H100)[1]
    e_fa3 = shape_efficiencies(att, dataclasses.replace(H100, attention_kernel="fa3"))[1]
    assert e_fa3 / e_fa2 == pytest.approx(f(4096, 128, True, kernel="fa3") / f(4096, 128, True))
    assert shape_efficiencies(_attention(4096, 64), H100)[1] / e_fa2 == pytest.approx(
        f(4096, 64, True) / f(4096, 128, True))
    assert shape_efficiencies(_attention(512, 128), H100)[1] < e_fa2


def test_transformer_engine_runs_cudnn_attention_on_hopper_only():
    """TE prefers cuDNN's fused attention over FlashAttention on Hopper (get_attention_backend): an engine
    profile with ``attention_backend="cudnn"`` prices its attention at cuDNN's figure (FA3 paper fig. 5,
    484 of 989 TFLOP/s at the reference shape, against FA2's 298), relative to itself at that shape."""
    from meshplan.cost_models.compute import node_time
    from meshplan.cost_models.engine_profiles import profile
    from meshplan.cost_models.hardware import CUDNN_ATTN_H100, FA2_H100, with_attention_backend

    te = with_attention_backend(H100, "cudnn")
    assert (te.attention_kernel, te.attention_efficiency) == ("cudnn", CUDNN_ATTN_H100)
    assert (FA2_H100, CUDNN_ATTN_H100) == (0.30, 0.49)
    assert with_attention_backend(A100, "cudnn") == A100  # TE keeps FlashAttention before Hopper
    assert with_attention_backend(H100, "flash") == H100
    assert with_attention_backend(dataclasses.replace(H100, attention_kernel="fa3"), "cudnn").attention_kernel == "fa3"
    assert f(2048, 128, True, kernel="cudnn") == pytest.approx(1.0)  # its own reference
    assert f(512, 128, True, kernel="cudnn") < 1.0 < f(16384, 128, True, kernel="cudnn")
    n = _attention(2048, 128)
    assert node_time(n, H100).fwd_s / node_time(n, te).fwd_s == pytest.approx(CUDNN_ATTN_H100 / FA2_H100, rel=1e-6)
    for name in ("megatron-core-2024", "megatron-core-2026", "megatron-bridge-2025", "nemo-2024"):
        assert profile(name).attention_backend == "cudnn", name
    assert profile("meshplan").attention_backend == profile("torchtitan-2024.12").attention_backend == "flash"
    with pytest.raises(ValueError, match="attention backend"):
        with_attention_backend(H100, "fa4")
