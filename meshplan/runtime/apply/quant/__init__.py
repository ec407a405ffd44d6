"""Quantized training for the runtime: the one entry point per Plan.quantization mode.

``apply_quantization(model, quantization, *, tp_mesh=None, tp_styles=None)`` dispatches on
``quantization.mode``: ``"none"`` does nothing, ``"qat"`` prepares torchao fake quantization
(:mod:`.qat`), ``"qlora"`` swaps targeted linears for NF4 + LoRA modules (:mod:`.qlora`).
``convert_for_deployment(model, quantization)`` turns a trained single-process (or gathered)
model into its deployable form: QAT -> real int-quantized linears, QLoRA -> merged linears.

Where it sits in the runtime's order (quantization -> stage split -> TP -> data parallel):

- no TP: call it on the whole model first, or on each stage module after the split;
- QAT with TP: either order works (the shard-local fake quantizer handles DTensor weights);
- QLoRA with TP: call it AFTER ``parallelize_module`` (it quantizes each rank's shard; NF4
  weights cannot be sharded), or before TP with ``tp_mesh``/``tp_styles`` and leave the
  returned FQNs out of the TP plan.
- data parallel (DDP / FSDP2) goes on after it (QLoRA + DDP: call ``ddp_ignore_quantized(model)``
  before ``DDP(model)``); the optimizer takes the parameters that still
  require grad (for QLoRA only the LoRA factors).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from meshplan.plan import Quantization
from meshplan.runtime.apply.quant.qat import (
    ShardLocalFakeQuantizer,
    check_group_size,
    convert_qat,
    is_targeted,
    prepare_qat,
    qat_base_config,
    targeted_linears,
)
from meshplan.runtime.apply.quant.qlora import (
    LoRALinear,
    LoRATPLayout,
    apply_qlora,
    ddp_ignore_quantized,
    lora_parameters,
    lora_tp_plan,
    merge_lora,
    merged_state_dict,
    style_of,
)

__all__ = [
    "LoRALinear",
    "LoRATPLayout",
    "ShardLocalFakeQuantizer",
    "apply_qlora",
    "apply_quantization",
    "check_group_size",
    "convert_for_deployment",
    "convert_targeted_conv1d",
    "convert_qat",
    "ddp_ignore_quantized",
    "is_targeted",
    "lora_parameters",
    "lora_tp_plan",
    "merge_lora",
    "merged_state_dict",
    "prepare_qat",
    "qat_base_config",
    "style_of",
    "targeted_linears",
]


def apply_quantization(
    model: nn.Module,
    quantization: Quantization,
    *,
    tp_mesh: Any = None,
    tp_styles: dict[str, str] | None = None,
    seed: int = 0,
    fsdp_shards: int = 1,
    before_each: Any = None,
) -> list[str]:
    """Apply ``quantization`` to ``model`` in place; return the FQNs of the linears it changed.

    ``fsdp_shards``: the FSDP2 degree that will wrap the model afterwards (QLoRA's NF4 scale
    blocks must split evenly over it); 1 for DDP / manual DP / none. ``before_each(fqn, linear)``
    (QLoRA): called before each targeted linear is quantized (``runtime.apply.quant_load``).
    """
    if quantization.mode == "none":
        return []
    convert_targeted_conv1d(model, quantization)
    if quantization.mode == "qat":
        return prepare_qat(model, quantization, tp_mesh=tp_mesh)
    if quantization.mode == "qlora":
        return apply_qlora(
            model, quantization, tp_mesh=tp_mesh, tp_styles=tp_styles, seed=seed, fsdp_shards=fsdp_shards,
            before_each=before_each,
        )
    raise ValueError(f"unknown quantization mode {quantization.mode!r}")


def convert_targeted_conv1d(model: nn.Module, quantization: Quantization) -> list[str]:
    """Turn the targeted HF ``Conv1D`` modules (GPT-2's ``c_attn``, ``c_fc``, ...; weight [in, out])
    into equal ``nn.Linear`` ones (weight transposed), so QAT/QLoRA can handle them; returns
    their FQNs. Uses the runtime's own converter (``runtime.apply.tp.convert_conv1d``)."""
    from meshplan.runtime.apply.tp import convert_conv1d

    fqns = [
        n
        for n, m in model.named_modules()
        if n and type(m).__name__ == "Conv1D" and is_targeted(n, quantization.target_modules)
    ]
    return convert_conv1d(model, fqns) if fqns else []


def convert_for_deployment(model: nn.Module, quantization: Quantization) -> nn.Module:
    """Deployable model from a trained one (in place): QAT -> torchao-quantized linears;
    QLoRA -> ``nn.Linear`` with the LoRA update merged into the dequantized base; none -> as is."""
    if quantization.mode == "qat":
        return convert_qat(model, quantization)
    if quantization.mode == "qlora":
        return merge_lora(model)
    return model
