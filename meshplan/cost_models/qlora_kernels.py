"""The kernels one QLoRA linear of meshplan's runtime launches per microbatch, with the bytes each moves.

Mechanism, not a fit: the list below is what ``meshplan.runtime.apply.quant.LoRALinear`` (a torchao
``NF4Tensor`` base applied with ``linear_nf4``, fp32 LoRA factors, ``y = x Wᵀ + s·(x Aᵀ) Bᵀ``)
dispatches, forward under ``torch.autocast`` and backward outside it, as listed by
``benchmarks/qlora_ops.py`` (every ATen op under a ``TorchDispatchMode``, torch 2.13 + torchao 0.18 on
CPU; the same ops run on CUDA: torchao's NF4 path and autocast's cast rules do not depend on the
device). ``tests/test_qlora_kernels.py`` checks this list against that trace kernel by kernel.

**Dequantization** (torchao 0.18 ``NF4Tensor.get_original_weight``, once in the forward for the GEMM
and again in the backward for the input gradient, ``LinearNF4``): with W weights, B bytes per base
element (the runtime quantizes its fp32 parameters: 4), nb = W/group blocks, ns scale blocks:

====================  =====================================  ==========================
kernel                read                                   written
====================  =====================================  ==========================
``>> 4``, ``& 0xF``   W/2 (uint8, two codes a byte) each     W/2 each
``.to(long)`` ×2      W/2 each                               4W each (int64 indices)
``nf4[idx]`` ×2       4W indices + the 16-entry table each   W·B/2 each
scales: ``div``       nb int8 + ns fp32 factors              4·nb (fp32)
scales: ``+ mean``    nb·B + B                               nb·B
``expand.flatten`` ×2 nb·B each (a broadcast source)         W·B/2 each (a copy)
``mul`` ×2            W·B each                               W·B/2 each
``stack``             W·B                                    W·B
cast to compute dtype W·B                                    W·c  (under autocast)
====================  =====================================  ==========================

so ``W·(19 + 8B + c) + nb·(5 + 4B) + 4·ns + 33B`` bytes: 53.3 bytes per weight at B = 4, c = 2
(fp32 base, bf16 compute), against the 2.5 bytes one fused dequantization would move (read the 4-bit
codes, write the 16-bit weight): 14 kernels and 26 host dispatches (12 of them views) each time.

**The rest** (X = tokens·in, Y = tokens·out, R = tokens·r, L_A = r·in, L_B = r·out on this rank,
c the compute dtype's bytes, x_b the input's: 4 for an fp32 norm output or residual, c for an
autocast GEMM's or attention's output). Forward: the input cast to c twice (the base linear's autocast
cast and the adapter path's ``x.to(fp32)`` + autocast cast; for a c input ``x.to(fp32)`` is the first
of the two), the LoRA factors cast to c (``L·(4 + c)``), the two LoRA GEMMs (X·c + L_A·c → R·c,
R·c + L_B·c → Y·c), the ``scaling ·`` multiply (2Y·c) and the add to the base output (3Y·c).
Backward: the multiply (2Y·c), four LoRA GEMMs (dB, dh, dA, dx), the factors' gradients cast back to
fp32, the two input-gradient casts (``ToCopyBackward``: 2X·(c + 4)) and the sum of the two input
gradients (3X·x_b). Without autocast (fp32 training, c = B = 4) no cast runs. The base GEMMs
(forward, input gradient) are the plain linear's, priced by ``compute.node_time``.

Not listed: a bias (none in the zoo's QLoRA targets; it adds one add each way), the tensor-parallel
collectives of ``LoRALinear``'s colwise / rowwise forms (priced with TP communication), and the
adapters' gradient accumulation after the first microbatch (2·L fp32 adds, negligible). Pure; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

#: entries of torchao's NF4 code table (fp32 values the indices look up)
NF4_TABLE = 16
#: host dispatches of one eager dequantization: its 13 kernels and 12 views (``benchmarks/qlora_ops.py``)
NF4_DEQUANT_DISPATCHES = 25
#: host dispatches of the QLoRA linear besides its dequantizations, (forward, backward), with autocast
#: (the casts included) and without (``benchmarks/qlora_ops.py``: 44 / 53 in all with autocast, torch 2.13)
QLORA_OTHER_DISPATCHES = {True: (18.0, 27.0), False: (14.0, 23.0)}


@dataclass(frozen=True)
class Kernel:
    """One kernel: ``phase`` "fwd", "bwd_input" or "bwd_weight" (the adapters' gradients), ``name``
    (the ATen op), ``flops`` (GEMMs: 2 per multiply-add; 0 for the memory-bound rest), ``bytes``
    read + written, ``gemm`` whether it is a matrix multiplication."""

    phase: str
    name: str
    flops: float
    bytes: float
    gemm: bool = False


def scaler_block(n_blocks: int, preferred: int = 256) -> int:
    """The NF4 scale-block size the runtime picks: the largest divisor of ``n_blocks`` up to
    ``preferred`` (``runtime.apply.quant.lora_linear.nf4_scaler_block_size`` without FSDP)."""
    for s in range(min(preferred, n_blocks), 0, -1):
        if n_blocks % s == 0:
            return s
    return 1


def nf4_dequant_kernels(
    weight_params: float, *, group_size: int = 64, base_bytes: float = 4.0, compute_bytes: float | None = 2.0,
    phase: str = "fwd",
) -> list[Kernel]:
    """The kernels of one eager torchao dequantization of ``weight_params`` weights (module
    docstring's table), ending with the cast to ``compute_bytes`` (None: no cast, fp32 training).
    Unit: bytes."""
    if weight_params < 0 or group_size < 1:
        raise ValueError(f"weight_params must be >= 0 and group_size >= 1, got {weight_params}, {group_size}")
    w, b = float(weight_params), float(base_bytes)
    nb = w / group_size
    ns = nb / scaler_block(max(1, int(nb))) if nb >= 1 else 0.0
    half = w / 2.0
    ks = [
        Kernel(phase, "__rshift__", 0.0, half + half),
        Kernel(phase, "_to_copy", 0.0, half + 8.0 * half),
        Kernel(phase, "bitwise_and", 0.0, half + half),
        Kernel(phase, "_to_copy", 0.0, half + 8.0 * half),
        Kernel(phase, "index", 0.0, NF4_TABLE * b + 8.0 * half + b * half),
        Kernel(phase, "index", 0.0, NF4_TABLE * b + 8.0 * half + b * half),
        Kernel(phase, "div", 0.0, nb + 4.0 * ns + 4.0 * nb),
        Kernel(phase, "add", 0.0, nb * b + b + nb * b),
        Kernel(phase, "clone", 0.0, nb * b + b * half),
        Kernel(phase, "mul", 0.0, 2.0 * b * half + b * half),
        Kernel(phase, "clone", 0.0, nb * b + b * half),
        Kernel(phase, "mul", 0.0, 2.0 * b * half + b * half),
        Kernel(phase, "stack", 0.0, 2.0 * b * w),
    ]
    if compute_bytes is not None:
        ks.append(Kernel(phase, "_to_copy", 0.0, w * (b + compute_bytes)))
    return ks


def nf4_dequant_bytes_moved(weight_params: float, **kw: float) -> float:
    """Bytes one eager dequantization moves (:func:`nf4_dequant_kernels`). Unit: bytes."""
    return sum(k.bytes for k in nf4_dequant_kernels(weight_params, **kw))  # type: ignore[arg-type]


def _gemm(phase: str, m: float, n: float, k: float, c: float) -> Kernel:
    """An [m, k] × [k, n] GEMM in ``c``-byte elements: 2mnk FLOPs, reads both operands, writes the result."""
    return Kernel(phase, "mm", 2.0 * m * n * k, c * (m * k + k * n + m * n), gemm=True)


def qlora_linear_kernels(
    weight_params: float,
    tokens: float,
    in_local: float,
    out_local: float,
    rank: int,
    *,
    group_size: int = 64,
    compute_bytes: float = 2.0,
    input_bytes: float = 4.0,
    base_bytes: float = 4.0,
    lora_bytes: float = 4.0,
) -> list[Kernel]:
    """Every kernel of one QLoRA linear's forward and backward for one microbatch of ``tokens`` rows
    except its two base GEMMs (module docstring). ``compute_bytes`` 2 trains under autocast (bf16 /
    fp16), 4 in fp32 (no casts); ``input_bytes`` is the input's element size (4: a norm's output or the
    residual stream under autocast; ``compute_bytes``: a GEMM's or attention's output)."""
    if min(weight_params, tokens, in_local, out_local) < 0 or rank < 1:
        raise ValueError("weight_params, tokens, in/out sizes must be >= 0 and rank >= 1")
    autocast = compute_bytes < base_bytes
    c, xb = compute_bytes, input_bytes if autocast else compute_bytes
    x, y = tokens * in_local, tokens * out_local
    la, lb = rank * in_local, rank * out_local
    cast = c + lora_bytes
    ks: list[Kernel] = []
    deq = dict(group_size=group_size, base_bytes=base_bytes, compute_bytes=c if autocast else None)
    # forward
    ks += nf4_dequant_kernels(weight_params, phase="fwd", **deq)  # type: ignore[arg-type]
    if autocast:
        ks += [Kernel("fwd", "_to_copy", 0.0, x * cast), Kernel("fwd", "_to_copy", 0.0, x * cast),
               Kernel("fwd", "_to_copy", 0.0, la * cast), Kernel("fwd", "_to_copy", 0.0, lb * cast)]  # fmt: skip
    ks += [_gemm("fwd", tokens, rank, in_local, c), _gemm("fwd", tokens, out_local, rank, c),
           Kernel("fwd", "mul", 0.0, 2.0 * y * c), Kernel("fwd", "add", 0.0, 3.0 * y * c)]  # fmt: skip
    # backward: through the adapter, then the base's input gradient
    ks += [Kernel("bwd_input", "mul", 0.0, 2.0 * y * c),
           _gemm("bwd_weight", out_local, rank, tokens, c),  # dB = gᵀ h
           _gemm("bwd_input", tokens, rank, out_local, c),  # dh = g B
           _gemm("bwd_weight", rank, in_local, tokens, c),  # dA = dhᵀ x
           _gemm("bwd_input", tokens, in_local, rank, c)]  # dx = dh A  # fmt: skip
    if autocast:
        ks += [Kernel("bwd_weight", "_to_copy", 0.0, lb * cast), Kernel("bwd_weight", "_to_copy", 0.0, la * cast),
               Kernel("bwd_input", "_to_copy", 0.0, x * cast), Kernel("bwd_input", "_to_copy", 0.0, x * cast)]  # fmt: skip
    ks += nf4_dequant_kernels(weight_params, phase="bwd_input", **deq)  # type: ignore[arg-type]
    ks.append(Kernel("bwd_input", "add", 0.0, 3.0 * x * xb))
    return ks


def qlora_linear_dispatches(*, autocast: bool = True) -> tuple[float, float]:
    """Host dispatches (ops and views) of one QLoRA linear per microbatch, (forward, backward),
    its two dequantizations included (``benchmarks/qlora_ops.py``: 44 / 53 under autocast)."""
    f, b = QLORA_OTHER_DISPATCHES[autocast]
    deq = NF4_DEQUANT_DISPATCHES + (1 if autocast else 0)
    return f + deq, b + deq
