"""Compute efficiency by kernel shape and GPU generation: GEMM tile and wave quantization, the
flash-attention kernel's causal work and grid.

A GEMM ``C[M×N] = A[M×K]·B[K×N]`` runs as a grid of output tiles, one thread block each, over the
GPU's streaming multiprocessors (NVIDIA "Matrix Multiplication Background User's Guide",
DU-09799-001, §2.3 typical cuBLAS tiles, §3.1 tile quantization, §3.2 wave quantization)::

    tiles      = ⌈M/tm⌉ · ⌈N/tn⌉ · s                  (s = split-K slices, K/s ≥ MIN_SPLIT_K)
    useful     = M·N / (⌈M/tm⌉·tm · ⌈N/tn⌉·tn)        (tile quantization: padded tiles do work)
    waves      = tiles / (⌈tiles / SMs⌉ · SMs)        (wave quantization: the last wave half empty)
    factor     = max over cuBLAS-like tiles (tm, tn, e_tile) and s of e_tile · useful · waves

``e_tile`` is a tile's throughput relative to the largest (256×128): smaller tiles reuse each
loaded operand over fewer outputs (§2.3: larger tiles are more efficient). The guide gives that
ordering, not these numbers: the values in ``TILES`` (1, 0.95, 0.85, 0.7) are an assumption named
here, not fitted to any case; a ``meshplan profile`` table replaces the whole model. The library picks the best configuration for the shape
(cuBLAS heuristics), which the max stands for. The GEMM's efficiency is then
``ClusterSpec.matmul_efficiency × factor``: the preset's value is what large, well-shaped GEMMs
reach in a training step; narrow tensor-parallel shards and small microbatches lose to
quantization on the generation's SM count (V100 80, A100 108, H100/H200 132: ``ClusterSpec.sm_count``,
0 = unknown: factor 1). The three GEMMs of a linear layer have different shapes: forward
(M, N, K), input gradient (M, K, N), weight gradient (K, N, M).

Flash attention (Dao 2023, FlashAttention-2 §3.1–3.2): the kernel walks 128-query-row blocks and
skips key blocks above the diagonal under a causal mask, so it does
``(n_blk + 1) / (2·n_blk)`` of the dense FLOPs (``n_blk = ⌈s/128⌉``) that ``FlopCounterMode``
counts; its grid is ``batch · heads · n_blk`` blocks, wave-quantized like a GEMM.

Memory-bound ops (norms, activations, elementwise) stay on the roofline's bandwidth term
(``compute.roofline_time_s``: bytes / (HBM bandwidth · mem_efficiency)). No torch import.
"""

from __future__ import annotations

import math

#: cuBLAS-like CTA tiles (tm, tn, relative throughput); source in the module docstring
TILES: tuple[tuple[int, int, float], ...] = (
    (256, 128, 1.0), (128, 256, 1.0), (128, 128, 0.95), (128, 64, 0.85), (64, 128, 0.85), (64, 64, 0.7),
)  # fmt: skip
#: split-K slices are only taken while every slice keeps at least this much of K
MIN_SPLIT_K = 512
MAX_SPLIT_K = 4
#: query rows per flash-attention thread block (FlashAttention-2 forward, head dim ≤ 128)
FLASH_BLOCK_ROWS = 128


def _check_dims(**dims: float) -> None:
    for k, v in dims.items():
        if not v >= 1:
            raise ValueError(f"{k} must be >= 1, got {v!r}")


def wave_fraction(blocks: int, sms: int) -> float:
    """Busy fraction of the SMs over the waves of ``blocks`` thread blocks: ``blocks / (⌈blocks/sms⌉·sms)``."""
    if sms <= 0 or blocks <= 0:
        return 1.0
    return blocks / (math.ceil(blocks / sms) * sms)


def gemm_shape_factor(m: float, n: float, k: float, sms: int) -> float:
    """Fraction of the large-GEMM throughput a ``m×k · k×n`` GEMM reaches on ``sms`` SMs (tile and
    wave quantization, best cuBLAS-like tile and split-K; module docstring). 1.0 when ``sms`` is 0."""
    _check_dims(m=m, n=n, k=k)
    if sms <= 0:
        return 1.0
    mi, ni = math.ceil(m), math.ceil(n)
    best = 0.0
    for tm, tn, e in TILES:
        gm, gn = math.ceil(mi / tm), math.ceil(ni / tn)
        useful = (m * n) / (gm * tm * gn * tn)
        for s in range(1, MAX_SPLIT_K + 1):
            if s > 1 and k / s < MIN_SPLIT_K:
                break
            best = max(best, e * useful * wave_fraction(gm * gn * s, sms))
    return best


def linear_gemm_dims(
    tokens: float, in_features: int, out_features: int, shard: int = 1, style: str | None = None
) -> tuple[float, float, float]:
    """(M, N, K) of a linear layer's forward GEMM on one rank: M tokens, K = in, N = out, the
    tensor-parallel ``shard`` dividing K for a row-parallel layer (``style == "rowwise"``), else N."""
    if style == "rowwise":
        return tokens, float(out_features), in_features / shard
    return tokens, out_features / shard, float(in_features)


def linear_factors(m: float, n: float, k: float, sms: int) -> tuple[float, float, float]:
    """Shape factors of a linear layer's forward (M,N,K), input-gradient (M,K,N) and
    weight-gradient (K,N,M) GEMMs."""
    return gemm_shape_factor(m, n, k, sms), gemm_shape_factor(m, k, n, sms), gemm_shape_factor(k, n, m, sms)


def causal_work_fraction(seq_len: int, is_causal: bool) -> float:
    """Fraction of the dense attention FLOPs a flash kernel does: ``(n+1)/(2n)`` blocks under a
    causal mask (n = ⌈s/128⌉), 1 without one."""
    if not is_causal or seq_len <= 0:
        return 1.0
    n = math.ceil(seq_len / FLASH_BLOCK_ROWS)
    return (n + 1) / (2 * n)


def attention_wave_factor(batch: float, heads: float, seq_len: int, sms: int) -> float:
    """Wave quantization of a flash-attention grid of ``batch · heads · ⌈s/128⌉`` blocks."""
    if sms <= 0 or seq_len <= 0:
        return 1.0
    blocks = max(1, math.ceil(batch * heads) * math.ceil(seq_len / FLASH_BLOCK_ROWS))
    return wave_fraction(blocks, sms)
