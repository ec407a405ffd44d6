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

Flash attention by shape and kernel generation (``attention_shape_factor``): per score element the
forward does ``4d`` matmul FLOPs (QKᵀ, PV) and one exponential, the backward ``10d`` (S recomputed,
dV, dP, dQ, dK) and one exponential (P recomputed), d = head dim. The exponential runs on the
special-function units, ``E = ClusterSpec.exp_cost_flops`` matmul FLOPs' worth of time (H100:
989 / 3.9 TFLOP/s, FlashAttention-3 §3.1: "exponential can take 50 % of the cycle time compared
to matmul" at d = 128). FlashAttention-2 runs softmax and GEMMs one after the other in each warp
(exposed: x = 1) and on Hopper issues Ampere ``mma.sync``, which reaches about 2/3 of the tensor
cores' peak (FA3 §2.2); FlashAttention-3 (``attention_kernel = "fa3"``, Hopper) overlaps them
(ping-pong and intra-warpgroup pipelining, x = 0) on ``wgmma`` (full peak, m = 1.5 relative to
FA2)::

    g = 14d / (14d/m + 2·x·E)                        (forward + backward, per score element)
    b = n_kv / (n_kv + 1)                            per query block: one key-block iteration's
                                                     worth of fixed work (Q load, O rescale and
                                                     store, LSE), n_kv = key blocks it visits
                                                     (causal: (n+1)/2 on average, else n = ⌈s/128⌉)
    factor = g·b / (g·b at head dim 128, causal, seq 2048 under FA2)

so ``ClusterSpec.attention_efficiency`` stays the calibration knob, read at that reference shape
(FlashAttention-2 paper's A100 figure; the FA3 paper's fig. 5 for FA2 on H100, 298 TFLOP/s at 2k causal). The fixed work of
one iteration per query block is an assumption named here (the papers show throughput rising
with sequence length, not its cause), not fitted to any case.

GEMM ceilings by dtype (``GEMM_CEILING_H100``, ``ClusterSpec.gemm_ceiling`` / ``gemm_peak``): the
datasheet's FP8 peak is twice the BF16 one (the same tensor-core clock, twice the operations per
clock), but the best-shaped GEMM reaches a smaller fraction of it: MEASURED on one H100 SXM with the
same torch build, the maximum achievable matmul throughput over a sweep of large shapes is 794.5 of
989 TFLOP/s in bf16 (0.803) and 1,402.6 of 1,979 in float8_e4m3fn (0.709): an FP8 GEMM runs at
1.77x, not 2x, a bf16 one (S. Bekman, ml-engineering ``compute/accelerator/README.md``, "Maximum
Achievable Matmul FLOPS comparison table", at commit b9e29720e: its mamf-finder.py at each dtype,
mean of 100 iterations after 50 warm-ups, torch 2.7.0+cu126 for both rows; the table measures the
gap, it does not explain it). ``matmul_efficiency`` is read off 16-bit
runs, so a GEMM of another dtype is priced at ``peak(dtype) · ceiling(dtype) / ceiling(bf16)``: the
step's fraction of the ceiling carries over, not its fraction of the datasheet peak. The same
measured ratio serves the H200 (H100's SMs and clocks; the table's later H200 fp8 row, 1,453.4 on
torch 2.7.1, pairs with no bf16 row of its own build). Tile and wave quantization (above) apply to
either dtype as they are.

Short-K float8 GEMMs (``fp8_k_factor``, ``FP8_TILE_K``): relative to a bf16 GEMM of the same shape a
float8 one loses a fixed share of each output tile's time, about one k-step of its main loop: the
first k-tile's load before the tile's first MMA and the bf16 epilogue, which the K loop does not
hide. Hopper's float8 kernels step K by 128 elements where bf16 ones step by 64 (the same 128 bytes
per operand row per pipeline stage; wgmma's K is 32 B: 16 bf16 or 32 fp8 elements, CUTLASS's sm90
tiles stack four), and the bf16 kernel's own per-tile share is already inside ``matmul_efficiency``,
read off bf16 runs; so a float8 GEMM runs at ``K / (K + FP8_TILE_K)`` of the fp8 ceiling: 0.80 at
K = 512, 0.97 at K = 4096, 1.00 for a weight gradient (K = the tokens). MEASURED on one H100 SXM
(torch 2.11, CUDA events; ``benchmarks/fp8_gemm_gpu.py``, BENCHMARKS.md "Wave 3 stop 10: fp8
GEMMs"): ``torch._scaled_mm`` over ``torch.mm`` is 1.40 / 1.41 at the two K = 512 GEMMs of
Llama 3.1 8B at tp 8 (98304 x 4096 x 512) where this gives 1.41, 1.68-2.13 (median 1.83) at
the 34 compute-bound GEMMs of K >= 1792 (where this gives 1.65-1.76). The 128 is the tile's depth,
not fitted. A least-squares fit on one half of the 39 GEMMs (column- or row-parallel linears) of
the K share alone, at the shipped ceiling, gives 64 / 88 (pulled down by the long-K GEMMs, which
run above that ceiling); of the ceiling ratio and the K share together (1.91, 176) / (1.90, 192),
holding on the other half (median |log error| 3.0% / 3.8%, 3.9% / 6.3% at the shipped rule): this
torch build's long-K ratio is above the 1.77 ``GEMM_CEILING_H100`` sourced from another build (left
as sourced). The measured bf16 GEMM loses at short K too (643 against 747 TFLOP/s at K = 512 / 4096),
less than fp8 does (897 against 1,289), which is the share this factor prices.

Memory-bound ops (norms, activations, elementwise) stay on the roofline's bandwidth term
(``compute.roofline_time_s``: bytes / (HBM bandwidth · mem_efficiency)). No torch import.
"""

from __future__ import annotations

import functools
import math

#: cuBLAS-like CTA tiles (tm, tn, relative throughput); source in the module docstring
TILES: tuple[tuple[int, int, float], ...] = (
    (256, 128, 1.0), (128, 256, 1.0), (128, 128, 0.95), (128, 64, 0.85), (64, 128, 0.85), (64, 64, 0.7),
)  # fmt: skip
#: measured maximum achievable matmul throughput per dtype as a fraction of the datasheet's dense
#: peak, one H100 SXM, one torch build (module docstring: bf16 794.5 / 989, fp8 1,402.6 / 1,979)
GEMM_CEILING_H100: dict[str, float] = {"bf16": 794.5 / 989, "fp8": 1402.6 / 1979}
#: K-depth of one main-loop step of Hopper's float8 GEMM kernels (128 B of fp8 per operand row): the
#: per-output-tile share a float8 GEMM loses over a bf16 one (``fp8_k_factor``; module docstring)
FP8_TILE_K = 128
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


@functools.lru_cache(maxsize=1 << 16, typed=True)
def gemm_shape_factor(m: float, n: float, k: float, sms: int) -> float:
    """Fraction of the large-GEMM throughput a ``m×k · k×n`` GEMM reaches on ``sms`` SMs (tile and
    wave quantization, best cuBLAS-like tile and split-K; module docstring). 1.0 when ``sms`` is 0.
    A pure function of its arguments, memoized: a search asks for a few hundred shapes thousands of
    times (llama3-8b@64: 455 distinct of 5,712 calls)."""
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


def fp8_k_factor(k: float, tile_k: float = FP8_TILE_K) -> float:
    """Fraction of the float8 GEMM ceiling a GEMM of reduction depth ``k`` reaches relative to a bf16
    GEMM of its shape: ``k / (k + FP8_TILE_K)``, one fp8 k-step per output tile not hidden by the K
    loop (module docstring). Multiplies ``matmul_efficiency x gemm_shape_factor`` for fp8 GEMMs only.
    ``tile_k``: another depth (the fit check of ``benchmarks/fp8_gemm_gpu.py --measured``)."""
    _check_dims(k=k)
    return k / (k + tile_k)


def grouped_gemm_factor(m: float, n: float, k: float, groups: int, sms: int) -> float:
    """Fraction of the large-GEMM throughput ``groups`` GEMMs of ``m×k · k×n`` each (a MoE layer's
    experts: Megatron-Core's TEGroupedMLP / GroupedMLP) reach when their tiles share the SMs: tile
    quantization per GEMM, wave quantization over every GEMM's tiles together (one grouped kernel,
    or Transformer Engine's per-expert GEMMs on several streams), no split-K. ``groups`` <= 1 is
    ``gemm_shape_factor``. 1.0 when ``sms`` is 0."""
    if groups <= 1:
        return gemm_shape_factor(m, n, k, sms)
    _check_dims(m=m, n=n, k=k)
    if sms <= 0:
        return 1.0
    best = 0.0
    for tm, tn, e in TILES:
        gm, gn = math.ceil(m / tm), math.ceil(n / tn)
        best = max(best, e * (m * n) / (gm * tm * gn * tn) * wave_fraction(gm * gn * groups, sms))
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


#: FlashAttention-2's Ampere ``mma.sync`` on Hopper: about 2/3 of the tensor cores' peak (FA3 §2.2)
HOPPER_MMA_SYNC_FRACTION = 2 / 3
#: the shape the presets' ``attention_efficiency`` was read at (head dim, causal, sequence length)
ATTENTION_REF_SHAPE = (128, True, 2048)


def _attention_gb(head_dim: int, is_causal: bool, seq_len: int, kernel: str, exp_cost_flops: float) -> float:
    d = float(head_dim)
    # cudnn: Hopper kernels overlapping softmax and GEMMs (x = 0); its rate is its own efficiency's, so m cancels
    m, x = (1 / HOPPER_MMA_SYNC_FRACTION, 0.0) if kernel == "fa3" else (1.0, 0.0) if kernel == "cudnn" else (1.0, 1.0)
    g = 14 * d / (14 * d / m + 2 * x * exp_cost_flops)
    n = max(1, math.ceil(seq_len / FLASH_BLOCK_ROWS))
    n_kv = (n + 1) / 2 if is_causal else n
    return g * n_kv / (n_kv + 1)


def attention_shape_factor(
    seq_len: int, head_dim: int, is_causal: bool, *, kernel: str = "fa2", exp_cost_flops: float = 0.0
) -> float:
    """Flash-attention throughput at (seq_len, head_dim, causal) under ``kernel`` ("fa2", "fa3")
    relative to FlashAttention-2 at ``ATTENTION_REF_SHAPE`` (module docstring); under "cudnn"
    (cuDNN's fused attention, whose spec carries its own efficiency at that shape:
    ``hardware.with_attention_backend``) relative to itself there."""
    _check_dims(seq_len=seq_len, head_dim=head_dim)
    if kernel not in ("fa2", "fa3", "cudnn"):
        raise ValueError(f"kernel must be 'fa2', 'fa3' or 'cudnn', got {kernel!r}")
    base = "cudnn" if kernel == "cudnn" else "fa2"
    ref = _attention_gb(ATTENTION_REF_SHAPE[0], ATTENTION_REF_SHAPE[1], ATTENTION_REF_SHAPE[2], base, exp_cost_flops)
    return _attention_gb(head_dim, is_causal, seq_len, kernel, exp_cost_flops) / ref


def attention_wave_factor(batch: float, heads: float, seq_len: int, sms: int) -> float:
    """Wave quantization of a flash-attention grid of ``batch · heads · ⌈s/128⌉`` blocks."""
    if sms <= 0 or seq_len <= 0:
        return 1.0
    blocks = max(1, math.ceil(batch * heads) * math.ceil(seq_len / FLASH_BLOCK_ROWS))
    return wave_fraction(blocks, sms)
