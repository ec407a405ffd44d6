"""QLoRA applied to a model: frozen NF4 base weights (torchao) plus trainable low-rank adapters, TP-aware.

The module itself (:class:`LoRALinear`, layouts, ``lora_tp_plan``) is in
:mod:`meshplan.runtime.apply.quant.lora_linear`; this module replaces targeted linears with it
(:func:`apply_qlora`), merges adapters for deployment and prepares DDP.

Order under TP: shard first, then quantize. Either run ``parallelize_module`` on the plain model
and then :func:`apply_qlora` (it reads each targeted DTensor weight's placements, quantizes the
local shard to NF4 and replaces the module, TP hooks included, with a LoRALinear that does its
own collectives), or call :func:`apply_qlora` with ``tp_mesh`` and ``tp_styles`` on a plain model
and leave those FQNs out of the ``parallelize_module`` plan. NF4's block statistics (the mean of
the block scales) are then per shard, so a TP model's base weights differ from a single-process
quantization by the double-quantization rounding (about 1e-3 relative); with
``quantize_base=False`` (plain frozen base, i.e. LoRA) TP matches single-process exactly.

LoRA factors are initialised from a generator seeded by ``seed`` and the module FQN, full size,
then sliced, so every rank and a single-process run get the same adapters. Under TP the LoRA
factors and the bias are DTensor parameters (placements per :func:`lora_tp_plan`), so state
dicts, ``full_tensor()`` and FSDP2 on a 2-D mesh see global tensors; the NF4 base ``weight`` is
a plain tensor holding this rank's shard (NF4 cannot be a DTensor). Without TP every parameter
is a plain tensor, so DDP and FSDP2 wrap a QLoRA model directly (call
:func:`ddp_ignore_quantized` before DDP: its start-up broadcast re-quantizes NF4); for pipeline stages
:class:`LoRALinear` is a plain module (traceable, or a leaf by ``is_lora_leaf``).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from meshplan.plan import Quantization
from meshplan.runtime.apply.quant.lora_linear import (
    LoRALinear,
    LoRATPLayout,
    local_tensor,
    lora_tp_plan,
    nf4_scaler_block_size,
    style_of,
)
from meshplan.runtime.apply.quant.targets import targeted_linears

__all__ = [
    "LoRALinear",
    "LoRATPLayout",
    "apply_qlora",
    "ddp_ignore_quantized",
    "lora_parameters",
    "lora_tp_plan",
    "merge_lora",
    "merged_state_dict",
    "merged_weight",
    "nf4_parameter_names",
    "nf4_tensor_bytes",
    "nf4_scaler_block_size",
    "style_of",
]


def _shard(t: torch.Tensor, dim: int | None, mesh: Any) -> torch.Tensor:
    if dim is None or mesh is None:
        return t
    n, r = mesh.size(), mesh.get_local_rank()
    if t.shape[dim] % n:
        raise ValueError(f"dim {dim} of size {t.shape[dim]} does not split over tp={n}")
    return t.chunk(n, dim=dim)[r].contiguous()


def _init_factors(fqn: str, in_f: int, out_f: int, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(fqn.encode()))
    bound = 1.0 / math.sqrt(in_f)  # kaiming_uniform_(a=sqrt(5)) on [r, in], as nn.Linear and peft
    a = (torch.rand(rank, in_f, generator=gen, dtype=torch.float32) * 2 - 1) * bound
    return a, torch.zeros(out_f, rank, dtype=torch.float32)


def apply_qlora(
    model: nn.Module,
    quantization: Quantization,
    *,
    tp_mesh: Any = None,
    tp_styles: dict[str, str] | None = None,
    quantize_base: bool = True,
    seed: int = 0,
    fsdp_shards: int = 1,
    before_each: Callable[[str, nn.Module], None] | None = None,
) -> list[str]:
    """Replace the targeted linears of ``model`` with :class:`LoRALinear` in place; freeze the rest.

    Every parameter outside the LoRA factors gets ``requires_grad=False``. A targeted linear
    whose weight is a DTensor (``parallelize_module`` already ran) is converted shard-locally
    with the style its placements imply; a plain one is sharded here when ``tp_mesh`` is given and
    ``tp_styles[fqn]`` names a style (the runtime must then leave that FQN out of its TP plan).
    ``fsdp_shards``: the FSDP2 degree that will shard the model (NF4 scaler blocks must split
    evenly; see :func:`nf4_scaler_block_size`). ``before_each(fqn, linear)`` runs just before a linear
    is quantized (a meta-built model's weights are read from a file there, one linear at a time, so the
    fp32 base is never whole). Returns the replaced FQNs.
    """
    if quantization.mode != "qlora":
        raise ValueError(f"apply_qlora needs quantization.mode == 'qlora', got {quantization.mode!r}")
    if quantization.bits != 4:
        raise ValueError(f"QLoRA stores the base in NF4 (4 bits); got bits={quantization.bits}, use bits=4")
    if quantization.lora_rank < 1:
        raise ValueError(f"lora_rank must be >= 1, got {quantization.lora_rank}")
    tp_styles = tp_styles or {}
    fqns = targeted_linears(model, quantization)
    if not fqns:
        raise ValueError(
            f"no nn.Linear matches target_modules={quantization.target_modules!r}; "
            "give suffixes of linear module names such as ('q_proj', 'v_proj')"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    for fqn in fqns:
        old = model.get_submodule(fqn)
        if before_each is not None:
            before_each(fqn, old)
        w, b = old.weight, old.bias
        if isinstance(w, DTensor):
            style, mesh = style_of(w), w.device_mesh
            w_local = w.to_local()
            b_local = None if b is None else (b.to_local() if isinstance(b, DTensor) else b)
            if style == "replicate":
                mesh = None
        else:
            style = tp_styles.get(fqn, "replicate") if tp_mesh is not None else "replicate"
            mesh = tp_mesh if style != "replicate" else None
            lay = lora_tp_plan(style)
            w_local = _shard(w, lay.weight, mesh)
            b_local = None if b is None else _shard(b, lay.bias, mesh)
        out_f, in_f = old.out_features, old.in_features
        a_full, b_full = _init_factors(fqn, in_f, out_f, quantization.lora_rank, seed)  # on the host, seeded
        # the factors live where the base weight does (a CUDA-materialized model: cuda), not on the host
        a_full, b_full = a_full.to(w_local.device), b_full.to(w_local.device)
        lay = lora_tp_plan(style)
        new = LoRALinear(
            w_local.detach(),
            None if b_local is None else b_local.detach(),
            _shard(a_full, lay.lora_A, mesh),
            _shard(b_full, lay.lora_B, mesh),
            in_features=in_f,
            out_features=out_f,
            alpha=quantization.lora_alpha,
            style=style,
            tp_mesh=mesh,
            quantize_base=quantize_base,
            block_size=quantization.group_size,
            shard_multiple=fsdp_shards,
        )
        parent_name, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return fqns


def nf4_tensor_bytes(w: Any) -> int:
    """Bytes an NF4Tensor really stores: codes, int8 block scales, scale factors, mean, code table."""
    parts = (w.quantized_data, w.quantized_scalers, w.quantization_factor, w.scaler_mean, w.nf4)
    return int(sum(t.numel() * t.element_size() for t in parts))


def nf4_parameter_names(model: nn.Module) -> list[str]:
    """FQNs of the NF4 (frozen, quantized) parameters of ``model``."""
    from torchao.quantization import NF4Tensor

    return [n for n, p in model.named_parameters() if isinstance(p, NF4Tensor)]


def ddp_ignore_quantized(model: nn.Module) -> list[str]:
    """Tell DDP (before wrapping ``model``) to leave the NF4 base weights alone; returns their FQNs.

    DDP broadcasts every parameter from rank 0 at construction; torchao's NF4Tensor goes through
    a lossy re-quantizing copy there (seen: base weights change by ~1e-3, so gradients no longer
    match a single-process run). The NF4 weights are identical on every rank already (same init,
    deterministic quantization) and never receive gradients, so ignoring them is exact.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    names = nf4_parameter_names(model)
    if names:
        DDP._set_params_and_buffers_to_ignore_for_model(model, names)
    return names


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable LoRA factors of ``model`` (what the optimizer should get)."""
    return [p for m in model.modules() if isinstance(m, LoRALinear) for p in (m.lora_A, m.lora_B)]


@torch.no_grad()
def merged_weight(mod: LoRALinear) -> torch.Tensor:
    """``dequant(W) + (alpha/r) B A`` of one LoRALinear in the base weight's dtype.

    Under TP it is this rank's shard (colwise: rows, from B's row shard and the replicated A;
    rowwise: columns, from the replicated B and A's column shard) wrapped as a DTensor with the
    weight's placement, so ``.full_tensor()`` gathers the full merged weight.
    """
    w = mod.weight.get_original_weight() if mod.quantized else mod.weight.detach()
    merged = (w.to(torch.float32) + mod.scaling * (local_tensor(mod.lora_B) @ local_tensor(mod.lora_A))).to(w.dtype)
    if mod.tp_mesh is None:
        return merged
    dim = lora_tp_plan(mod.style).weight
    return DTensor.from_local(merged, mod.tp_mesh, [Shard(dim)], run_check=False)


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (gathered) state dict of a QLoRA model with the adapters merged: the state dict of
    the plain model it came from, ready for ``load_state_dict`` into an unquantized copy for
    deployment. A collective under TP (every rank must call it)."""
    out: dict[str, torch.Tensor] = {}
    lora_mods = {f: m for f, m in model.named_modules() if isinstance(m, LoRALinear)}
    for name, t in model.state_dict().items():
        mod_name, _, leaf = name.rpartition(".")
        mod = lora_mods.get(mod_name)
        if mod is not None and leaf in ("lora_A", "lora_B"):
            continue
        if mod is not None and leaf == "weight":
            t = merged_weight(mod)
        out[name] = t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()
    return out


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Deployment: replace each single-process LoRALinear with an ``nn.Linear`` holding
    ``dequant(W) + (alpha/r) B A`` (in place; returns ``model``)."""
    for fqn, mod in list(model.named_modules()):
        if not isinstance(mod, LoRALinear):
            continue
        if mod.style != "replicate":
            raise ValueError(f"{fqn}: merge a gathered single-process copy, not a TP shard")
        merged = merged_weight(mod)
        lin = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, dtype=merged.dtype)
        lin.weight.copy_(merged)
        if mod.bias is not None:
            lin.bias.copy_(mod.bias)
        parent_name, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, lin)
    return model
