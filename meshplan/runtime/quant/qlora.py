"""QLoRA: frozen NF4 base weights (torchao) plus trainable low-rank adapters, TP-aware.

:class:`LoRALinear` replaces a targeted ``nn.Linear``. It holds

- ``weight``: the base weight as a frozen ``nn.Parameter`` wrapping a torchao ``NF4Tensor``
  (``torchao.quantization.to_nf4``; 4-bit NormalFloat codes in blocks of ``group_size`` with
  double-quantized int8 block scales, Dettmers et al. 2023) applied with ``linear_nf4`` (its
  backward computes only the input gradient);
- ``bias``: the base bias, frozen, in its original dtype;
- ``lora_A`` [r, in] (Kaiming-uniform init, as in the LoRA paper / peft) and ``lora_B`` [out, r]
  (zero init), fp32, trainable; ``y = x W^T + b + (alpha / r) * (x A^T) B^T``.

Under tensor parallelism the module computes on local shards and does the two Megatron
collectives itself, through DTensor (``_copy_to_tp``: identity forward, all-reduce backward;
``_reduce_from_tp``: all-reduce forward, identity backward). Layouts (see :func:`lora_tp_plan`):

- colwise: base weight/bias and ``lora_B`` sharded on the output dim, ``lora_A`` replicated;
  input replicated, output the local slice of the features (what torch's ColwiseParallel gives).
- rowwise: base weight and ``lora_A`` sharded on the input dim, ``lora_B`` and bias replicated;
  input the local feature slice, output replicated (what RowwiseParallel gives).

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

import copy
import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from meshplan.plan import Quantization
from meshplan.runtime.quant.qat import targeted_linears

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

STYLES = ("colwise", "rowwise", "replicate")


@dataclass(frozen=True)
class LoRATPLayout:
    """Which dim of each tensor a TP style shards (None = replicated). Dims are of the stored tensor:
    weight [out, in], bias [out], lora_A [r, in], lora_B [out, r]."""

    weight: int | None
    bias: int | None
    lora_A: int | None
    lora_B: int | None


def lora_tp_plan(style: str) -> LoRATPLayout:
    """Sharding of base weight, bias and LoRA factors for a TP style.

    colwise: weight/bias/lora_B on the output dim (0), lora_A replicated;
    rowwise: weight/lora_A on the input dim (1), bias/lora_B replicated; replicate: nothing.
    """
    if style == "colwise":
        return LoRATPLayout(weight=0, bias=0, lora_A=None, lora_B=0)
    if style == "rowwise":
        return LoRATPLayout(weight=1, bias=None, lora_A=1, lora_B=None)
    if style == "replicate":
        return LoRATPLayout(weight=None, bias=None, lora_A=None, lora_B=None)
    raise ValueError(f"unknown TP style {style!r}; use one of {STYLES}")


def style_of(weight: torch.Tensor) -> str:
    """TP style of a linear weight from its DTensor placements (plain tensor -> replicate)."""
    if not isinstance(weight, DTensor):
        return "replicate"
    if len(weight.placements) != 1:
        raise ValueError(f"QLoRA under TP expects a 1-D TP mesh, got placements {weight.placements}")
    p = weight.placements[0]
    if isinstance(p, Shard):
        return "colwise" if p.dim == 0 else "rowwise"
    if isinstance(p, Replicate):
        return "replicate"
    raise ValueError(f"unsupported weight placement {p} for QLoRA")


def nf4_scaler_block_size(
    numel: int, block_size: int, preferred: int = 256, *, shard_multiple: int = 1
) -> int:
    """Largest divisor s <= ``preferred`` of the block count ``numel / block_size`` that leaves a
    number of scaler blocks divisible by ``shard_multiple``.

    torchao's ``to_nf4`` needs the number of blocks divisible by the scaler block size; 256 is
    the QLoRA paper's choice, small layers get a smaller one. FSDP2 shards an NF4 weight by
    splitting its inner tensors, the per-scaler-block factors included, so under FSDP2 over
    ``dp`` ranks pass ``shard_multiple=dp``.
    """
    if block_size < 1 or numel % block_size:
        raise ValueError(
            f"weight with {numel} elements is not divisible by the NF4 block size {block_size}; "
            "choose a quantization.group_size that divides the (local) weight size"
        )
    n_blocks = numel // block_size
    for s in range(min(preferred, n_blocks), 0, -1):
        if n_blocks % s == 0 and (n_blocks // s) % shard_multiple == 0:
            return s
    raise ValueError(
        f"{n_blocks} NF4 blocks cannot form a number of scaler blocks divisible by {shard_multiple}; "
        "use a smaller group_size or fewer FSDP ranks"
    )


def _copy_to_tp(t: torch.Tensor, mesh: Any) -> torch.Tensor:
    """Identity forward; all-reduce (sum) of the gradient over the TP group in backward."""
    return DTensor.from_local(t, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _reduce_from_tp(t: torch.Tensor, mesh: Any) -> torch.Tensor:
    """All-reduce (sum) forward over the TP group; identity backward."""
    return (
        DTensor.from_local(t, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class LoRALinear(nn.Linear):
    """A frozen (NF4) linear plus a trainable low-rank update, optionally one TP shard of it.

    ``in_features``/``out_features`` are the global sizes; the stored tensors are local shards
    per :func:`lora_tp_plan` (``style``) when ``tp_mesh`` is set.

    It subclasses ``nn.Linear`` (without running ``nn.Linear.__init__``) so that graph capture
    keeps it whole as one ``call_module`` node, like every Linear (meshplan's tracer and
    ``torch.fx`` leaf rules test ``issubclass(cls, nn.Linear)``); tracing through it would see a
    Proxy where the NF4 check needs the real weight. Do not hand a LoRALinear to
    ``parallelize_module``: it shards itself.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        lora_A: torch.Tensor,
        lora_B: torch.Tensor,
        *,
        in_features: int,
        out_features: int,
        alpha: float,
        style: str = "replicate",
        tp_mesh: Any = None,
        quantize_base: bool = True,
        block_size: int = 64,
        shard_multiple: int = 1,
    ) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: no fresh weight to allocate
        if style not in STYLES:
            raise ValueError(f"unknown TP style {style!r}; use one of {STYLES}")
        if style != "replicate" and tp_mesh is None:
            raise ValueError(f"style {style!r} needs a tp_mesh")
        self.in_features = in_features
        self.out_features = out_features
        self.rank = lora_A.shape[0]
        self.scaling = alpha / self.rank
        self.style = style
        self.tp_mesh = tp_mesh if style != "replicate" else None
        base = weight.detach().contiguous()
        if quantize_base:
            from torchao.quantization import to_nf4

            sbs = nf4_scaler_block_size(base.numel(), block_size, shard_multiple=shard_multiple)
            base = to_nf4(base, block_size, sbs)
        self.weight = nn.Parameter(base, requires_grad=False)
        lay = lora_tp_plan(style)
        self.bias = (
            None if bias is None else self._param(bias.detach().clone(), lay.bias, False, (out_features,))
        )
        r = lora_A.shape[0]
        self.lora_A = self._param(
            lora_A.detach().to(torch.float32).clone(), lay.lora_A, True, (r, in_features)
        )
        self.lora_B = self._param(
            lora_B.detach().to(torch.float32).clone(), lay.lora_B, True, (out_features, r)
        )

    def _param(
        self, local: torch.Tensor, dim: int | None, trainable: bool, shape: tuple[int, ...]
    ) -> nn.Parameter:
        """Under TP a DTensor (sharded on ``dim`` or replicated) wrapping this rank's values, so
        state dicts, ``full_tensor()``, FSDP2 over a 2-D mesh and DTensor-aware gradient syncs see
        the global tensor; the forward computes on ``to_local()``."""
        if self.tp_mesh is None:
            return nn.Parameter(local, requires_grad=trainable)
        placement = Replicate() if dim is None else Shard(dim)
        dt = DTensor.from_local(local, self.tp_mesh, [placement], run_check=False)  # even shards
        if tuple(dt.shape) != shape:
            raise ValueError(
                f"local {tuple(local.shape)} on {placement} gives {tuple(dt.shape)}, expected {shape}"
            )
        return nn.Parameter(dt, requires_grad=trainable)

    @property
    def quantized(self) -> bool:
        from torchao.quantization import NF4Tensor

        return isinstance(self.weight, NF4Tensor) or isinstance(self.weight.data, NF4Tensor)

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized:
            from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

            return linear_nf4(x, self.weight)
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mesh = self.tp_mesh
        # local views; to_local()'s backward hands each grad back with the parameter's placement
        a, b = _local(self.lora_A), _local(self.lora_B)
        bias = None if self.bias is None else _local(self.bias)
        if self.style == "colwise":
            y = self._base(_copy_to_tp(x, mesh))
            h = F.linear(x.to(a.dtype), a)
            lora = F.linear(_copy_to_tp(h, mesh), b)
        elif self.style == "rowwise":
            y = _reduce_from_tp(self._base(x), mesh)
            h = _reduce_from_tp(F.linear(x.to(a.dtype), a), mesh)
            lora = F.linear(h, b)
        else:
            y = self._base(x)
            lora = F.linear(F.linear(x.to(a.dtype), a), b)
        if bias is not None:
            y = y + bias
        return y + (self.scaling * lora).to(y.dtype)

    def __deepcopy__(self, memo: dict[int, Any]) -> LoRALinear:
        # torchao's NF4Tensor.clone() re-quantizes with default block sizes (fails on small
        # layers, and is lossy): copy the NF4 inner tensors instead, share the mesh.
        if self.quantized:
            memo[id(self.weight)] = nn.Parameter(_clone_nf4(self.weight), requires_grad=False)
        if self.tp_mesh is not None:
            memo[id(self.tp_mesh)] = self.tp_mesh
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            new.__dict__[k] = copy.deepcopy(v, memo)
        return new

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
            f"scaling={self.scaling}, style={self.style}, nf4={self.quantized}"
        )


def _clone_nf4(w: Any) -> Any:
    """Exact copy of a torchao NF4Tensor (its codes and double-quantized scales)."""
    from torchao.quantization import NF4Tensor
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import SubclassTensorArgs

    meta = SubclassTensorArgs(w.size(), w.stride(), w.storage_offset(), w.dtype, w.device, False)
    return NF4Tensor(
        meta,
        w.block_size,
        w.n_blocks,
        w.scaler_block_size,
        w.quantized_scalers.clone(),
        w.quantization_factor.clone(),
        w.scaler_mean.clone(),
        w.quantized_data.clone(),
        w.nf4.clone(),
    )


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
) -> list[str]:
    """Replace the targeted linears of ``model`` with :class:`LoRALinear` in place; freeze the rest.

    Every parameter outside the LoRA factors gets ``requires_grad=False``. A targeted linear
    whose weight is a DTensor (``parallelize_module`` already ran) is converted shard-locally
    with the style its placements imply; a plain one is sharded here when ``tp_mesh`` is given and
    ``tp_styles[fqn]`` names a style (the runtime must then leave that FQN out of its TP plan).
    ``fsdp_shards``: the FSDP2 degree that will shard the model (NF4 scaler blocks must split
    evenly; see :func:`nf4_scaler_block_size`). Returns the replaced FQNs.
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
        a_full, b_full = _init_factors(fqn, in_f, out_f, quantization.lora_rank, seed)
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
    merged = (w.to(torch.float32) + mod.scaling * (_local(mod.lora_B) @ _local(mod.lora_A))).to(w.dtype)
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
