"""Quantization-aware training (QAT) through torchao, made to work under tensor parallelism.

``prepare_qat(model, quantization)`` swaps every targeted ``nn.Linear`` for torchao's
``FakeQuantizedLinear`` (``quantize_(model, QATConfig(base_config, step="prepare"))``) and then
wraps each weight fake-quantizer in a :class:`ShardLocalFakeQuantizer`. ``convert_qat`` runs
``QATConfig(base_config, step="convert")``: the fake-quantized linears become real quantized
linears (int weights plus scales) whose outputs equal the fake-quantized ones.

Base config. ``QATConfig(Int4WeightOnlyConfig)`` cannot convert on CPU here (it needs a missing
kernel package), so the default is torchao's ``IntxWeightOnlyConfig(weight_dtype=int{bits},
granularity=PerGroup(group_size))`` (symmetric, unpacked to int8): weight-only, groupwise along
the input dimension, converts on CPU, and its converted output equals the fake-quantized output.
``dynamic_activations=True`` selects ``Int8DynamicActivationIntxWeightConfig`` (int8 per-token
activations too); it is refused under TP because a per-token activation scale would be computed
over a rank's slice of the features only.

Tensor parallelism. torchao's fake quantizer does not run on a DTensor weight (after
``parallelize_module``). :class:`ShardLocalFakeQuantizer` fake-quantizes ``w.to_local()`` with the
very same torchao quantizer (whose rounding uses a straight-through estimator) and rewraps the
result with ``DTensor.from_local`` and the weight's placements, so the backward is the
single-process one on each shard. The result equals the single-process fake-quantized weight
exactly when no quantization group crosses a shard boundary: groups run along the input dim, so
a colwise shard (``Shard(0)``) always qualifies, and a rowwise shard (``Shard(1)``) needs
``group_size | in_features / tp`` (checked; ``ValueError`` otherwise). Because the wrapper
handles plain and DTensor weights alike, ``prepare_qat`` may run before or after
``parallelize_module`` (``FakeQuantizedLinear`` is an ``nn.Linear`` subclass that torch's
Colwise/RowwiseParallel accept). ``convert_qat`` needs plain weights: convert a deployable copy
built from the gathered (full) state dict.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from meshplan.cost_models.quant import is_targeted
from meshplan.plan import Quantization
from meshplan.runtime.apply.quant.targets import targeted_linears

__all__ = [
    "ShardLocalFakeQuantizer",
    "check_group_size",
    "convert_qat",
    "is_targeted",
    "prepare_qat",
    "qat_base_config",
    "targeted_linears",
]


def qat_base_config(quantization: Quantization, *, dynamic_activations: bool = False) -> Any:
    """The torchao post-training config that QAT prepares for and converts to.

    ``bits`` in 2..8 become ``torch.int{bits}``; ``group_size`` the ``PerGroup`` granularity.
    """
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerGroup

    if not 2 <= quantization.bits <= 8:
        raise ValueError(f"QAT bits must be in 2..8 (torch.int2..int8), got {quantization.bits}")
    if quantization.group_size < 1:
        raise ValueError(f"QAT group_size must be positive, got {quantization.group_size}")
    dtype = getattr(torch, f"int{quantization.bits}")
    gran = PerGroup(quantization.group_size)
    if dynamic_activations:
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=dtype, weight_granularity=gran)
    return IntxWeightOnlyConfig(weight_dtype=dtype, granularity=gran)


def check_group_size(fqn: str, weight: torch.Tensor, group_size: int) -> None:
    """Raise ``ValueError`` unless every quantization group lies inside one shard of ``weight``.

    Groups run along dim 1 (input features). Plain tensors need ``group_size | in_features``; a
    DTensor sharded on dim 1 needs ``group_size | local in_features``.
    """
    in_f = weight.shape[1]
    if in_f % group_size:
        raise ValueError(
            f"{fqn}: in_features={in_f} is not divisible by group_size={group_size}; "
            f"pick a group_size that divides {in_f}"
        )
    if isinstance(weight, DTensor):
        local_in = weight.to_local().shape[1]
        if (
            any(isinstance(p, Shard) and p.dim in (1, -1) for p in weight.placements)
            and local_in % group_size
        ):
            raise ValueError(
                f"{fqn}: rowwise shard has {local_in} local in_features, not divisible by "
                f"group_size={group_size}; quantization groups would cross shard boundaries. "
                f"Use a group_size dividing in_features/tp (= {local_in}) or a smaller tp"
            )


class ShardLocalFakeQuantizer:
    """Apply a torchao weight fake-quantizer to the local shard of a DTensor (or to a plain tensor).

    ``__call__(w)``: plain ``w`` -> ``inner(w)``; DTensor ``w`` ->
    ``DTensor.from_local(inner(w.to_local()), w.device_mesh, w.placements)``. The gradient is
    the inner quantizer's straight-through estimate, applied shard by shard.

    Deliberately not an ``nn.Module``: torch's RowwiseParallel partitions *every* submodule of a
    linear and reads its ``.weight``, so a fake-quantizer submodule makes ``parallelize_module``
    fail (the "torchao QAT and TP fail together" trap). Held as a plain attribute it is invisible
    to TP, ``state_dict`` and ``named_modules``; it owns no parameters or buffers.
    """

    def __init__(self, inner: nn.Module) -> None:
        self.inner = inner

    @property
    def config(self) -> Any:
        # torchao's convert step reads ``weight_fake_quantizer.config`` (range learning check)
        return self.inner.config

    def __repr__(self) -> str:
        return f"ShardLocalFakeQuantizer({self.inner!r})"

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        if isinstance(w, DTensor):
            local = self.inner(w.to_local())
            return DTensor.from_local(
                local, w.device_mesh, w.placements, run_check=False, shape=w.shape, stride=w.stride()
            )
        return self.inner(w)


def _set_weight_quantizer(mod: nn.Module, value: Any) -> None:
    # nn.Module refuses to replace a registered child module with a non-module: drop it first
    if "weight_fake_quantizer" in mod._modules:
        del mod._modules["weight_fake_quantizer"]
    mod.__dict__.pop("weight_fake_quantizer", None)
    mod.weight_fake_quantizer = value


def _wrap_quantizers(model: nn.Module, fqns: list[str], group_size: int, *, tp: bool) -> None:
    from torchao.quantization.qat.linear import FakeQuantizedLinear

    for fqn in fqns:
        mod = model.get_submodule(fqn)
        if not isinstance(mod, FakeQuantizedLinear):
            continue
        if tp and mod.activation_fake_quantizer is not None:
            raise ValueError(
                f"{fqn}: activation fake-quantization is per-token over features and is not "
                "shard-consistent under tensor parallelism; use weight-only QAT with TP"
            )
        fq = mod.weight_fake_quantizer
        if fq is not None and not isinstance(fq, ShardLocalFakeQuantizer):
            check_group_size(fqn, mod.weight, group_size)
            _set_weight_quantizer(mod, ShardLocalFakeQuantizer(fq))


def prepare_qat(
    model: nn.Module,
    quantization: Quantization,
    *,
    dynamic_activations: bool = False,
    tp_mesh: Any = None,
) -> list[str]:
    """Swap the targeted linears of ``model`` (in place) for fake-quantized ones; return their FQNs.

    Works on a plain model or one already parallelized with DTensor weights; with ``tp_mesh``
    given (or DTensor weights seen) the group-size/shard requirement is checked.
    """
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    if quantization.mode != "qat":
        raise ValueError(f"prepare_qat needs quantization.mode == 'qat', got {quantization.mode!r}")
    from torchao.quantization.qat.linear import FakeQuantizedLinear

    fqns = targeted_linears(model, quantization)
    if not fqns:
        raise ValueError(
            f"no nn.Linear matches target_modules={quantization.target_modules!r}; "
            "give suffixes of linear module names such as ('q_proj', 'fc_in')"
        )
    base = qat_base_config(quantization, dynamic_activations=dynamic_activations)
    is_dtensor = any(isinstance(model.get_submodule(f).weight, DTensor) for f in fqns)
    for fqn in fqns:  # validate before touching the model
        check_group_size(fqn, model.get_submodule(fqn).weight, quantization.group_size)
    # linears prepared already (a second call, or by torchao directly) are left as they are
    todo = [f for f in fqns if not isinstance(model.get_submodule(f), FakeQuantizedLinear)]
    wanted = set(todo)
    if is_dtensor:
        _swap_dtensor_linears(model, todo, base)
    elif todo:
        quantize_(model, QATConfig(base, step="prepare"), filter_fn=lambda m, fqn: fqn in wanted)
    _wrap_quantizers(model, fqns, quantization.group_size, tp=is_dtensor or tp_mesh is not None)
    return fqns


def _swap_dtensor_linears(model: nn.Module, fqns: list[str], base: Any) -> None:
    """QAT prepare on already-parallelized linears: change the class in place.

    ``quantize_`` would build a new module and drop the TP forward hooks that
    ``parallelize_module`` registered; re-classing the existing module keeps hooks, parameters
    (DTensors) and names. The fake-quantizer config is the one torchao infers from ``base``.
    """
    from torchao.quantization.qat.fake_quantize_config import _infer_fake_quantize_configs
    from torchao.quantization.qat.fake_quantizer import FakeQuantizerBase
    from torchao.quantization.qat.linear import FakeQuantizedLinear

    act_cfg, w_cfg = _infer_fake_quantize_configs(base)
    for fqn in fqns:
        mod = model.get_submodule(fqn)
        if isinstance(mod, FakeQuantizedLinear):
            continue
        if type(mod) is not nn.Linear:
            raise ValueError(f"{fqn}: QAT under TP supports plain nn.Linear, got {type(mod).__name__}")
        mod.__class__ = FakeQuantizedLinear
        mod.activation_fake_quantizer = FakeQuantizerBase.from_config(act_cfg) if act_cfg else None
        mod.weight_fake_quantizer = FakeQuantizerBase.from_config(w_cfg)


def convert_qat(
    model: nn.Module, quantization: Quantization, *, dynamic_activations: bool = False
) -> nn.Module:
    """Turn a QAT-prepared model (plain weights) into a quantized one in place; returns it.

    Raises ``ValueError`` on DTensor weights: gather the full state dict into a plain model first.
    """
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig
    from torchao.quantization.qat.linear import FakeQuantizedLinear

    for name, mod in model.named_modules():
        if isinstance(mod, FakeQuantizedLinear):
            if isinstance(mod.weight, DTensor):
                raise ValueError(
                    f"{name}: cannot convert a tensor-parallel (DTensor) weight; load the gathered "
                    "full state dict into an unsharded copy of the model and convert that"
                )
            if isinstance(mod.weight_fake_quantizer, ShardLocalFakeQuantizer):
                _set_weight_quantizer(mod, mod.weight_fake_quantizer.inner)
    base = qat_base_config(quantization, dynamic_activations=dynamic_activations)
    quantize_(model, QATConfig(base, step="convert"))
    return model
