"""The QLoRA module: :class:`LoRALinear`, its TP layouts, and the NF4 helpers it needs.

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

Applying it to a model, merging and DDP helpers live in :mod:`meshplan.runtime.apply.quant.qlora`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

__all__ = ["STYLES", "LoRALinear", "LoRATPLayout", "lora_tp_plan", "nf4_scaler_block_size", "style_of"]


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


def local_tensor(t: torch.Tensor) -> torch.Tensor:
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
        a, b = local_tensor(self.lora_A), local_tensor(self.lora_B)
        bias = None if self.bias is None else local_tensor(self.bias)
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
