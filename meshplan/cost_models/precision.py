"""Training precision as a cost option: which dtypes a cluster runs, and what float8 training costs.

``TRAINING_DTYPES`` (``Plan.dtype``): "bf16" and "fp16" (16-bit mixed precision: fp32 master
weights, 16-bit compute and activations), "fp32", and "fp8" = torchao float8 training
(``torchao.float8.convert_to_float8_training``, as torchtitan's ``float8`` converter applies it):

- **which GEMMs**: every ``nn.Linear`` whose in/out features are multiples of 16 (the float8
  GEMM's alignment) except the LM head (torchtitan's default ``filter_fqns=["output"]``); all
  three GEMMs of such a linear (forward, input gradient, weight gradient) run on the FP8 tensor
  cores at ``ClusterSpec.peak("fp8")``. Attention (SDPA), norms, activations and the head stay in
  bf16, and so do the tensors between ops: activation memory is that of bf16.
- **scaling overhead** (tensorwise dynamic scaling, torchao's default recipe): each operand's
  amax is read every step (2 B/element) and the operand cast to float8 (2 B read + 1 B written):
  ``5`` bytes per element of x and W in forward and of dY in backward, plus a re-cast (3 B) of W
  for dX and of x and dY for dW (the transposed operands), all memory bound
  (``fp8_cast_bytes``). torch.compile fuses some of these into neighbouring kernels; none of that
  fusion is credited.
- **memory**: the float8 copies of the computing layer's weight and its transpose
  (1 B/element each, transient; ``fp8_weight_copy_bytes``); master weights, gradients and
  optimizer states as in bf16 mixed precision.

Only GPUs with FP8 tensor cores run it (Hopper and later: the h100/h200 presets carry
``peak_flops["fp8"]``, the datasheets' dense FP8 figure); ``check_training_dtype`` refuses it
elsewhere with the reason. Sources: torchao ``float8`` README (recipes, tensorwise dynamic
scaling, 16-alignment); torchtitan ``docs/float8.md``; NVIDIA H100 datasheet (1,979 TFLOP/s dense
FP8). No torch import.
"""

from __future__ import annotations

from meshplan.cost_models.hardware import ClusterSpec

TRAINING_DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32", "fp8")
#: float8 GEMMs need every dimension a multiple of this (torchao float8 / cuBLASLt FP8)
FP8_ALIGN = 16
#: bytes moved per element to scale and cast one operand (amax read 2 + cast read 2, write 1)
FP8_SCALE_CAST_BYTES = 5
#: bytes per element of re-casting an operand whose scale is known (read 2, write 1)
FP8_RECAST_BYTES = 3


def check_training_dtype(dtype: str, cluster: ClusterSpec) -> None:
    """ValueError unless ``dtype`` is a training dtype ``cluster`` runs (fp8 needs FP8 tensor cores:
    a ``peak_flops["fp8"]`` entry, the h100/h200 presets)."""
    if dtype not in TRAINING_DTYPES:
        raise ValueError(f"dtype {dtype!r} unknown; use one of {TRAINING_DTYPES}")
    if dtype == "fp8" and "fp8" not in cluster.peak_flops:
        raise ValueError(
            f"dtype fp8 (torchao float8 training) needs FP8 tensor cores (Hopper or newer: the h100/h200 "
            f"presets); cluster {cluster.name!r} has none (peak_flops: {', '.join(sorted(cluster.peak_flops))}): "
            f"use --dtype bf16, or a profile whose peak_flops has an 'fp8' entry"
        )


def activation_dtype(dtype: str) -> str:
    """The dtype tensors between ops have under training ``dtype`` (fp8 training keeps bf16)."""
    return "bf16" if dtype == "fp8" else dtype


def fp8_eligible(in_features: int | None, out_features: int | None, *, is_head: bool = False) -> bool:
    """Whether torchao float8 converts a linear of these features (16-aligned, not the LM head)."""
    if is_head or not in_features or not out_features:
        return False
    return in_features % FP8_ALIGN == 0 and out_features % FP8_ALIGN == 0


def fp8_cast_bytes(m: float, n: float, k: float) -> tuple[float, float, float]:
    """Bytes the float8 scaling and casts of one linear (M tokens, K in, N out on this rank) move
    in forward, input-gradient and weight-gradient parts (module docstring)::

        forward  5·(M·K + K·N)          amax + cast of x and W
        dX       5·M·N + 3·K·N          amax + cast of dY, re-cast of Wᵀ
        dW       3·M·K + 3·M·N          re-cast of xᵀ and dYᵀ
    """
    a, r = FP8_SCALE_CAST_BYTES, FP8_RECAST_BYTES
    return a * (m * k + k * n), a * m * n + r * k * n, r * m * k + r * m * n


def fp8_weight_copy_bytes(largest_linear_params: float) -> float:
    """Transient float8 copies (W and Wᵀ, 1 B/element) of the largest converted weight on a rank."""
    return 2.0 * largest_linear_params
