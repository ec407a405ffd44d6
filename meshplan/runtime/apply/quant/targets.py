"""Which linears of a model a ``Quantization`` targets (shared by QAT and QLoRA).

``targeted_linears(model, quantization)``: the FQNs of the ``nn.Linear`` modules (subclasses
included) whose names match ``quantization.target_modules`` (``cost_models.quant.is_targeted``),
leaving out linears already converted to :class:`LoRALinear`.
"""

from __future__ import annotations

from torch import nn

from meshplan.cost_models.quant import is_targeted
from meshplan.plan import Quantization
from meshplan.runtime.apply.quant.lora_linear import LoRALinear

__all__ = ["targeted_linears"]


def targeted_linears(model: nn.Module, quantization: Quantization) -> list[str]:
    """FQNs of the ``nn.Linear`` modules (subclasses included) that ``quantization`` targets."""
    return [
        name
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear)
        and not isinstance(mod, LoRALinear)  # already converted
        and name
        and is_targeted(name, quantization.target_modules)
    ]
