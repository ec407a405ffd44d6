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
  ``grad_accum_dtype``: the "bf16-fp32-grads" state precision here). No autograd accumulation
  beside it: its ``clear_lp_grads`` sets every 16-bit ``.grad`` to None before each backward in the
  2022 versions (deepspeed 0.19 zeroes them instead, a further pass not priced: no row runs it).
- "autograd": torch autograd's own accumulation into ``.grad`` (``AccumulateGrad``: the first
  microbatch's gradient is stolen, ``variable_grad += new_grad`` from the second on, torch
  ``torch/csrc/autograd/functions/accumulate_grad.h`` line 252 at 2.13): a read of the old gradient,
  a read of the new, a write, in the gradient's dtype (the parameters' own: 4 B under fp32
  parameters, 2 B under 16-bit ones), (m - 1) times a step over the gradient the rank accumulates.
  Where the data-parallel kind reduce-scatters every microbatch that is the rank's shard (FSDP2
  ``_fsdp_collectives.py`` line 749 ``sharded_param.grad._local_tensor += new_sharded_grad``;
  DeepSpeed ZeRO-2/3 accumulating into their partitions): the gradient divisor of the ZeRO stage
  (``grad_divisor``). Under a pipeline torch.distributed.pipelining turns FSDP2's gradient sync
  off but for the last microbatch (``pipelining/stage.py`` line 847,
  ``set_requires_gradient_sync(False)``): the unsharded gradient accumulates, costed here as the
  whole gradient at the parameters' dtype (torch accumulates it in the reduce dtype, fp32:
  ``_fsdp_param.py`` lines 813 / 820, 10 B a parameter a later microbatch + 6 B once).
  Megatron-LM 2020 / 2021 without ``--use-contiguous-buffers-in-ddp`` (fp16 ``.grad``), DeepSpeed's
  fp16 ZeRO-1 of 2021 (MT-NLG), torch DDP under ``no_sync`` (meshplan's runtime, torchtitan,
  llm-foundry), FSDP1 / FSDP2 (sharded).
- "main-grad-hook": a hook after autograd's accumulation adds the 16-bit gradient into a main
  gradient and frees it (meshplan's ``runtime/apply/master_state.py`` ``fold``: ``main += grad``,
  ``grad = None``; Megatron-LM's ``main_grad`` hook without gradient-accumulation fusion): every
  microbatch, 2 B read + the main gradient read and written (4 + 4 fp32, 2 + 2 16-bit).

No torch import.
"""

from __future__ import annotations

#: engine-run gradient passes per microbatch (module docstring)
GRAD_ACCUM_PASSES: tuple[str, ...] = ("none", "autograd", "main-grad-hook", "bf16-optimizer")

#: bytes read and written per parameter per microbatch by DeepSpeed's BF16_Optimizer.update_hp_grads
BF16_OPTIMIZER_PASS_BYTES = 2 + 4 + (4 + 4 + 4)

#: tensors AccumulateGrad's ``grad += new`` moves per element: the old gradient and the new read, the sum written
AUTOGRAD_PASS_READS_WRITES = 3


def grad_accum_pass_bytes(kind: str, precision: str, num_microbatches: int = 1) -> float:
    """Bytes per parameter per microbatch (averaged over the step's ``num_microbatches``) the
    engine's gradient pass ``kind`` moves at the model states' ``precision``
    (``dp_kinds.state_precision``), over the whole gradient; the caller divides by the gradient's
    sharding where the pass runs on a shard. DeepSpeed's BF16_Optimizer runs only where 16-bit
    parameters keep fp32 gradients ("bf16-fp32-grads"); the main-gradient hook only on 16-bit
    parameters (fp32 training accumulates through autograd)."""
    if kind not in GRAD_ACCUM_PASSES:
        raise ValueError(f"grad_accum_pass must be one of {', '.join(GRAD_ACCUM_PASSES)}, got {kind!r}")
    m = max(1, num_microbatches)
    if kind == "bf16-optimizer":
        return float(BF16_OPTIMIZER_PASS_BYTES) if precision == "bf16-fp32-grads" else 0.0
    grad = 4 if precision == "fp32" else 2  # .grad in the parameters' dtype
    if kind == "autograd" or (kind == "main-grad-hook" and precision == "fp32"):
        return AUTOGRAD_PASS_READS_WRITES * grad * (m - 1) / m
    if kind == "main-grad-hook":
        main = 2 if precision == "bf16-mixed" else 4
        return float(grad + 2 * main)
    return 0.0


__all__ = ["AUTOGRAD_PASS_READS_WRITES", "BF16_OPTIMIZER_PASS_BYTES", "GRAD_ACCUM_PASSES", "grad_accum_pass_bytes"]
