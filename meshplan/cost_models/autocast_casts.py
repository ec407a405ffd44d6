"""Device bytes of ``torch.autocast``'s casts of fp32 parameters (``autocast_cast_bytes``).

Where a run computes under ``torch.autocast`` on fp32 parameters (meshplan's runtime, torchtitan
without FSDP2's MixedPrecisionPolicy over dp > 1: ``planner.state_costs.StateCosts.runs_autocast``;
not Megatron-LM / DeepSpeed, which keep 16-bit weights, nor meshplan's "megatron" / "zero" state
layouts) every linear / matmul reads each parameter it uses (weight, bias, a tied head's embedding
weight) as a compute-dtype copy, made by a memory-bound cast kernel beside the GEMMs:

- **forward**: ``aten::_to_copy`` fp32 -> bf16 / fp16 of each such parameter, read 4 B + write 2 B =
  ``CAST_BYTES_PER_PARAM`` (6), once per autocast region: autocast caches the copy of a leaf tensor
  that requires grad until the outermost region exits (torch ``aten/src/ATen/autocast_mode.cpp``
  ``cached_cast``; ``torch.amp.autocast.__exit__`` clears it at nesting 0). A region is one forward
  call, per microbatch (``EngineProfile.autocast_cache`` "call": torchtitan; meshplan's runtime at
  pp = 1, whose loop calls the model once per microbatch, and under full / op recompute), or the
  whole pipeline step (meshplan's runtime at pp > 1 under recompute none / selective,
  ``runtime/apply/precision.step_cast_cache``: once per step, ``per_step``);
- **recompute**: a layer re-run by full / op recompute casts its parameters again (torch.utils.checkpoint
  restores the forward's autocast state in a fresh region inside the backward), 6 B per parameter of
  the re-run layers per microbatch (``RecastBytes``: the caller counts only those layers);
- **backward**: the cast's backward (``ToCopyBackward0``) converts each compute-dtype weight gradient to
  fp32, read 2 B + write 4 B = ``GRAD_CAST_BYTES_PER_PARAM`` (6), every microbatch (a step-cached copy
  is one autograd node every microbatch's backward runs through); its accumulation into ``.grad`` from
  the second microbatch is ``grad_accum`` "autograd"'s, priced there.

Each pass is priced at the HBM roofline (``mem_bw_bytes_per_s × mem_efficiency``), as the other
memory-bound passes. Measured (torch.profiler, one gpt2-xl step of meshplan's runtime, mb8x1, on an
H100: ``benchmarks/gpu_results/2026-11-27-h100/call3/kernels.md``): the fp32 -> bf16 copies
(``bfloat16_copy_kernel_cuda``, 867 calls: 577 parameter casts, 193 casts of fp32 norm outputs into
linears, 97 gradient casts back into the fp32 residual stream / loss) took 12.40 ms for about 34.6 GB,
2.8 TB/s; the bf16 -> fp32 copies (``direct_copy_kernel_cuda`` on torch's unrolled, non-vectorized
dtype-converting path, 771 calls: 577 parameter-gradient casts, 193 input-gradient casts, the logits'
``float()``) 15.80 ms for about 27.0 GB, 1.7 TB/s. The parameters' share, 9.3 GB each way
(1.556 G parameters × 6 B), is about 3.3 ms forward and 5.5 ms backward measured; priced here
at 2.68 TB/s (the h100 preset's 3.35 TB/s × 0.8), 3.5 + 3.5 ms. The activation casts are not
priced here (BENCHMARKS.md "Wave 3 stop 10: autocast casts").

No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass

#: bytes a forward cast of one fp32 parameter moves: read 4, write the 2-byte copy
CAST_BYTES_PER_PARAM = 4 + 2
#: bytes the cast's backward moves per parameter: read the 2-byte gradient, write it in fp32
GRAD_CAST_BYTES_PER_PARAM = 2 + 4
#: the compute dtypes autocast casts fp32 parameters to (fp8: torchao's float8 linears cast their fp32
#: weights themselves, ``precision.fp8_cast_bytes``; not priced again here)
AUTOCAST_DTYPES = ("bf16", "fp16")
#: recompute kinds whose re-run forward casts the re-run layers' parameters again
RECASTING_RECOMPUTE = ("full", "op")


@dataclass(frozen=True)
class CastBytes:
    """Bytes per cast parameter per microbatch (a step's share where the cast runs once per step)."""

    forward: float  # the forward's casts
    backward: float  # the gradients' casts back to fp32 (input-gradient / weight pass)
    recompute: float  # per parameter of a re-run layer: the re-run forward's casts


def autocast_cast_bytes(num_microbatches: int, *, per_step: bool, recompute: str) -> CastBytes:
    """Bytes per parameter per microbatch that ``torch.autocast``'s casts of fp32 parameters move
    (module docstring): forward ``CAST_BYTES_PER_PARAM`` per region (``per_step``: one region over
    the step's ``num_microbatches``, so 1/m of it per microbatch), backward ``GRAD_CAST_BYTES_PER_PARAM``,
    and ``CAST_BYTES_PER_PARAM`` again per re-run layer's parameter under full / op ``recompute``."""
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    m = num_microbatches
    fwd = CAST_BYTES_PER_PARAM / m if per_step else float(CAST_BYTES_PER_PARAM)
    rec = float(CAST_BYTES_PER_PARAM) if recompute in RECASTING_RECOMPUTE else 0.0
    return CastBytes(forward=fwd, backward=float(GRAD_CAST_BYTES_PER_PARAM), recompute=rec)


__all__ = [
    "AUTOCAST_DTYPES",
    "CAST_BYTES_PER_PARAM",
    "GRAD_CAST_BYTES_PER_PARAM",
    "RECASTING_RECOMPUTE",
    "CastBytes",
    "autocast_cast_bytes",
]
