"""Context parallelism as the engines run it (``cost_models/cp_kernels.py``): the ring's flash calls at
their chunk shapes and torch's context_parallel rotation, fp32 dK/dV ring and merge passes (#33)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.cost_models.comm import group_collective_s, p2p_time_s
from meshplan.cost_models.cp_kernels import (
    ACCUM_BYTES,
    CP_ROTATES,
    cp_step_shape_ratio,
    torch_ring_exposed_s,
    torch_ring_memory_bytes,
)
from meshplan.cost_models.engine_profiles import EngineProfile
from meshplan.cost_models.engine_profiles import profile as engine_profile
from meshplan.cost_models.epcp import cp_kv_bytes
from meshplan.cost_models.hardware import ClusterSpec

H100 = ClusterSpec.preset("h100", num_nodes=2)
BARE = replace(H100, comm_sms=0, kernel_floor_s=0.0)  # no NCCL SM contention, no launch floor: the formulas alone


def test_chunk_shapes_match_one_long_kernel_only_at_long_chunks() -> None:
    # cp calls of T/cp tokens do the same work as one causal kernel of T at batch 1/cp
    assert cp_step_shape_ratio(1, 32, 262144, 8, 128, H100) == pytest.approx(1.0, abs=0.02)  # half-q grids: waves
    # 1k-token chunks: each call visits few key blocks per query block and fills fewer SMs
    short = cp_step_shape_ratio(1, 8, 8192, 8, 128, H100)
    assert short > 1.05
    assert cp_step_shape_ratio(1, 8, 8192, 2, 128, H100) < short  # longer chunks lose less
    assert cp_step_shape_ratio(1, 32, 8192, 1, 128, H100) == 1.0
    assert cp_step_shape_ratio(1, 32, 8192, 8, 128, replace(H100, sm_count=0)) == 1.0  # no shape model


def test_torch_ring_memory_passes_counted_from_the_source() -> None:
    kv, q, e, f = 2.0 * 1000, 1000.0, 2, ACCUM_BYTES  # bytes: [k; v] of 500 elements each, 500 query elements
    E, K = q / e, kv / e
    fwd, bwd = torch_ring_memory_bytes(kv, q, 2, e, "allgather")
    # cp = 2: contiguous copies, one [k; v] cat, out to fp32, one merge step (mean of whole / half), back to bf16
    whole, half = (e + f) * E + 32 * E, (e + f) * E / 2 + 24 * E
    assert fwd == pytest.approx(2 * kv + 2 * kv + (e + f) * E + (whole + half) / 2 + (f + e) * E)
    early = (2 * f + e) * K / 2 + 2 * f * K + (2 * f + e) * E
    late = (2 * f + e) * K + (2 * f + e) * E / 2 + 2 * f * E
    assert bwd == pytest.approx(f * (E + K) + 2 * kv + 2 * kv + (2 * f + e) * (K + E) + (early + late) / 2
                                + 2 * 2 * f * K + (f + e) * (E + K))  # fmt: skip
    # every step but the last concatenates [k; v], whichever method sends it
    assert torch_ring_memory_bytes(kv, q, 4, e, "alltoall") == torch_ring_memory_bytes(kv, q, 4, e, "allgather")


def test_torch_ring_rotation_and_the_fp32_gradient_ring() -> None:
    kv = cp_kv_bytes(1, 131072, 4, 8, 128, 2)
    q = 4 * kv / 2  # 32 query heads over 8 kv heads: the output block is 4x one of k, v
    bw = BARE.mem_bw_bytes_per_s * BARE.mem_efficiency
    mf, mb = (x / bw for x in torch_ring_memory_bytes(kv, q, 4, 2, "allgather"))
    t_ag = group_collective_s("all_gather", 4 * kv, 4, BARE, stride=8)  # cp ranks tp = 8 apart: across nodes
    t_p = p2p_time_s(kv, BARE, crosses_nodes=True)
    t_dkv = p2p_time_s(kv * 2, BARE, crosses_nodes=True)  # dK/dV accumulated and sent in fp32
    # nothing to hide behind: every transfer exposed
    f, b = torch_ring_exposed_s(kv, q, 4, 0.0, 0.0, BARE, rotate="allgather", elem_bytes=2, stride=8)
    assert f == pytest.approx(t_ag + mf) and b == pytest.approx(t_ag + 4 * t_dkv + mb)
    f, b = torch_ring_exposed_s(kv, q, 4, 0.0, 0.0, BARE, rotate="alltoall", elem_bytes=2, stride=8)
    assert f == pytest.approx(3 * t_p + mf) and b == pytest.approx(3 * t_p + 4 * t_dkv + mb)
    # long steps hide every transfer but the last dK/dV send, waited after the loop
    f, b = torch_ring_exposed_s(kv, q, 4, 100.0, 250.0, BARE, rotate="allgather", elem_bytes=2, stride=8)
    assert f == pytest.approx(mf) and b == pytest.approx(t_dkv + mb)
    # the all-gather is hidden by step 0 alone; the all-to-all shifts one step each
    c = t_ag / 2
    f_ag = torch_ring_exposed_s(kv, q, 4, 4 * c, 10 * c, BARE, rotate="allgather", elem_bytes=2, stride=8)[0]
    assert f_ag == pytest.approx(t_ag - c + mf)
    assert torch_ring_exposed_s(kv, q, 1, 1.0, 1.0, BARE, rotate="allgather", elem_bytes=2) == (0.0, 0.0)
    with pytest.raises(ValueError, match="rotate must be one of"):
        torch_ring_exposed_s(kv, q, 4, 1.0, 1.0, BARE, rotate="ring", elem_bytes=2)


def test_profiles_name_their_ring() -> None:
    assert CP_ROTATES[0] == "ring" and engine_profile("meshplan").cp_rotate == "ring-dkv"
    assert any(f == "cp_rotate" and "ring_attention.py" in src for f, src in engine_profile("meshplan").sources)
    for name in ("torchtitan-2024.12", "torchtitan-2026"):
        p = engine_profile(name)
        assert p.cp_rotate == "allgather" and any(f == "cp_rotate" for f, _ in p.sources)
    assert engine_profile("megatron-bridge-2025").cp_rotate == "ring"  # TE's p2p ring
    with pytest.raises(ValueError, match="cp_rotate must be one of"):
        EngineProfile("x", "x", "0", cp_rotate="zigzag")
