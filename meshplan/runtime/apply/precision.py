"""Training precision: which dtype a run computes in, and the PyTorch mechanism that applies it.

``resolve_precision(plan_dtype, override)`` picks what runs: the plan's dtype (``--dtype plan``, the
default) or the user's ``bf16`` / ``fp16`` / ``fp32``. ``fp8`` (torchao float8 training) is refused
before training: the runtime does not execute it, so a plan costed for it must be re-run with
``--dtype bf16`` (or re-planned).

How each precision is applied (parameters and optimizer state stay fp32 on every path):

* FSDP2 modules: ``MixedPrecisionPolicy(param_dtype=bf16|fp16, reduce_dtype=fp32)``: the
  all-gathered parameters are cast to the compute dtype, gradients are reduced in fp32.
* everything else (DDP, DTensor TP, manual data parallel, one process): ``torch.autocast`` around
  each module's forward (``PrecisionStage``), so matmuls run in the compute dtype and
  precision-sensitive ops (softmax, norms, losses) in fp32 as autocast decides.
* pipeline schedules (``step_cast_cache``): where the stages run under autocast and keep their saved
  tensors (recompute none / selective), the whole ``schedule.step`` runs inside one outer autocast
  region, so autocast's weight cache (a leaf fp32 parameter is cast once per region) lives for the
  step: every microbatch's forward reads, and saves for backward, one compute-dtype copy of each
  weight, where a region per stage call cast and saved one copy per microbatch in flight.
* pipeline stages: every floating output of a stage that is not the last is cast to the compute
  dtype, so activations (and their gradients) cross stage boundaries in 2 bytes, as costed.
* the loss is computed in fp32 (logits upcast before ``loss_fn``).
* fp16 adds a gradient scaler: torch's ``ShardedGradScaler`` over the whole world, so an inf or
  NaN found in any rank's (sharded, TP or pipeline-local) gradients skips the step everywhere.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

PRECISIONS = ("bf16", "fp16", "fp32")
DTYPE_CHOICES = ("plan", *PRECISIONS)
_TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_precision(plan_dtype: str, override: str = "plan") -> str:
    """The precision to run: ``override`` unless it is "plan", else the plan's dtype."""
    if override not in DTYPE_CHOICES:
        raise ValueError(f"--dtype {override!r} unknown; use one of {DTYPE_CHOICES}")
    want = plan_dtype if override == "plan" else override
    if want == "fp8":
        raise ValueError(
            "plan dtype fp8 (torchao float8 training) is not executed by the meshplan runtime; "
            "run it with --dtype bf16 or re-plan with dtype bf16"
        )
    if want not in PRECISIONS:
        raise ValueError(f"plan dtype {want!r} unknown to the runtime; use --dtype one of {PRECISIONS}")
    return want


def torch_dtype(precision: str) -> torch.dtype:
    return _TORCH[precision]


def fsdp_policy(precision: str) -> Any:
    """FSDP2 mixed precision: compute in ``precision``, reduce gradients in fp32 (None for fp32)."""
    if precision == "fp32":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch_dtype(precision), reduce_dtype=torch.float32)


def make_scaler(precision: str) -> Any:
    """A world-wide gradient scaler for fp16, else None."""
    if precision != "fp16":
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    scaler = ShardedGradScaler(device=dev)
    # create the scale now: pipeline ranks without the last stage never call scale() themselves
    # (their gradients arrive already scaled), but unscale_/step need it on every rank
    scaler.scale(torch.ones((), device=dev))
    return scaler


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, tuple):
        return tuple(_cast_floats(o, dtype) for o in obj)
    if isinstance(obj, list):
        return [_cast_floats(o, dtype) for o in obj]
    return obj


def to_fp32(out: Any) -> Any:
    """Logits (or an output object's ``.logits``) upcast to fp32 for the loss."""
    if isinstance(out, torch.Tensor):
        return out.float() if out.is_floating_point() else out
    logits = getattr(out, "logits", None)
    return logits.float() if isinstance(logits, torch.Tensor) else out


class PrecisionStage(nn.Module):
    """Runs ``inner`` under autocast (``autocast_dtype``) and casts its floating outputs to ``send_dtype``.

    ``autocast_dtype`` is None where FSDP2's MixedPrecisionPolicy already computes in low
    precision; ``send_dtype`` is set for pipeline stages that are not the last one.
    """

    def __init__(self, inner: nn.Module, *, autocast_dtype: torch.dtype | None, send_dtype: torch.dtype | None,
                 device_type: str) -> None:
        super().__init__()
        self.inner = inner
        self.autocast_dtype = autocast_dtype
        self.send_dtype = send_dtype
        self.device_type = device_type

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.autocast_dtype is not None:
            with torch.autocast(self.device_type, dtype=self.autocast_dtype):
                out = self.inner(*args, **kwargs)
        else:
            out = self.inner(*args, **kwargs)
        return _cast_floats(out, self.send_dtype) if self.send_dtype is not None else out


def step_cast_cache(modules: list[nn.Module], recompute: str) -> Any:
    """The context a pipeline schedule's ``step`` runs in: one ``torch.autocast`` region around the
    whole step where ``modules`` hold a ``PrecisionStage`` running autocast and ``recompute`` keeps the
    stages' saved tensors ("none", "selective"), else a no-op. Inside it, each stage call's own
    autocast region is nested, and autocast clears its weight cache only when the outermost region
    exits (``torch.amp.autocast.__exit__``: ``autocast_decrement_nesting() == 0``), so a weight is cast
    once per step and every microbatch in flight saves that one copy. Under full / op recompute the
    saved copies are dropped per microbatch, and a step-long cache would hold one more copy: no-op.
    Gradients are unchanged: the copies are the same casts, shared (``tests/test_runtime_precision.py``)."""
    if recompute not in ("none", "selective"):
        return nullcontext()
    for m in modules:
        for sub in m.modules():
            if isinstance(sub, PrecisionStage) and sub.autocast_dtype is not None:
                return torch.autocast(sub.device_type, dtype=sub.autocast_dtype)
    return nullcontext()


def wrap_precision(module: nn.Module, precision: str, *, fsdp: bool, last_stage: bool, pipelined: bool,
                   device_type: str) -> nn.Module:
    """``module`` wrapped for ``precision`` (unchanged for fp32)."""
    if precision == "fp32":
        return module
    dt = torch_dtype(precision)
    send = dt if pipelined and not last_stage else None
    return PrecisionStage(module, autocast_dtype=None if fsdp else dt, send_dtype=send, device_type=device_type)
