"""Gradient passes an engine's own code runs after every microbatch's backward (``EngineProfile.grad_accum_pass``).

``GRAD_ACCUM_PASSES``:

- "none": nothing beyond what the backward itself writes: the weight-gradient GEMM writes the
  gradient, or accumulates into the main gradient inside the GEMM (Megatron-LM's
  ``gradient_accumulation_fusion`` from 83b1e42, 2022-02, with fp32 main gradients; Transformer
  Engine's ``fuse_wgrad_accumulation``).
- "bf16-optimizer": DeepSpeed's ``BF16_Optimizer`` (from 56c52238, 2022-04-19): after each
  microbatch's backward ``update_hp_grads`` adds every 16-bit gradient into its fp32 copy,
  ``hp_grad.data.add_(lp.grad.data.to(hp_grad.dtype))`` (deepspeed/runtime/bf16_optimizer.py line 400
  at 9b70ce56, 2022-06-29; the pipeline engine calls it after every ``BackwardPass``,
  deepspeed/runtime/pipe/engine.py lines 771-773, and the last stage through ``backward``): the cast
  reads 2 bytes and writes 4, the add reads 4 + 4 and writes 4, per parameter: 18 bytes, every
  microbatch. DeepSpeed uses it for bf16 parameters with fp32 gradient accumulation (BLOOM's
  Megatron-DeepSpeed; deepspeed 0.19 ``engine.py`` selects the BFLOAT16 wrapper for bf16 with an fp32
  ``grad_accum_dtype``: the "bf16-fp32-grads" state precision here).

Not priced (no profile has it yet): torch autograd's own accumulation into ``.grad`` from the second
microbatch on (``AccumulateGrad``: ``grad += new``), which every engine that accumulates in
``.grad`` runs (Megatron-LM 2020/2021's local DDP without ``--use-contiguous-buffers-in-ddp``, off by
default at 6985e58; DeepSpeed's fp16 ZeRO-1 of 2021; torch DDP / FSDP runs without ``no_sync``
fusion); BENCHMARKS.md "Wave 3 stop 9" gives what it would move.

No torch import.
"""

from __future__ import annotations

#: engine-run gradient passes per microbatch (module docstring)
GRAD_ACCUM_PASSES: tuple[str, ...] = ("none", "bf16-optimizer")

#: bytes read and written per parameter per microbatch by DeepSpeed's BF16_Optimizer.update_hp_grads
BF16_OPTIMIZER_PASS_BYTES = 2 + 4 + (4 + 4 + 4)


def grad_accum_pass_bytes(kind: str, precision: str) -> float:
    """Bytes per parameter per microbatch the engine's gradient pass ``kind`` moves at the model
    states' ``precision`` (``dp_kinds.state_precision``): DeepSpeed's BF16_Optimizer runs only where
    16-bit parameters keep fp32 gradients ("bf16-fp32-grads"); 0 otherwise."""
    if kind not in GRAD_ACCUM_PASSES:
        raise ValueError(f"grad_accum_pass must be one of {', '.join(GRAD_ACCUM_PASSES)}, got {kind!r}")
    if kind == "bf16-optimizer" and precision == "bf16-fp32-grads":
        return float(BF16_OPTIMIZER_PASS_BYTES)
    return 0.0


__all__ = ["BF16_OPTIMIZER_PASS_BYTES", "GRAD_ACCUM_PASSES", "grad_accum_pass_bytes"]
