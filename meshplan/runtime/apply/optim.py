"""The optimizer step: AdamW (fused on CUDA, per tensor on CPU), global gradient-norm clipping, LR schedule.

* ``make_optimizer(name, lr)`` -> a factory ``params -> Optimizer`` for ``apply_plan``: AdamW / Adam
  with ``fused=True`` on CUDA and ``foreach=False`` elsewhere (torch's CPU default: the multi-tensor
  kernels' temporaries are as large as the whole local shard, see the factory), SGD with
  ``momentum`` (default 0.9; 0 is plain SGD: no momentum buffer, one fp32 state per parameter less,
  the cost model's "sgd" beside "sgd-momentum"; torch's default on CPU: per tensor); plain tensors
  and DTensors go in separate parameter groups (the multi-tensor kernels refuse a mix, which TP
  produces).
* ``lr_at(step, *, lr, schedule, warmup_steps, total_steps)``: the learning rate of a (1-based)
  step, a pure function of the step number: linear warm-up from lr/warmup to lr over
  ``warmup_steps``, then ``constant`` or ``cosine`` decay to 0 at ``total_steps``. A resumed run
  starts again at the saved step, so the schedule continues; the rate is set on the optimizer
  before every step, so a new ``--lr`` given on resume is applied (it overrides the rate stored
  with the optimizer state).
* ``clip_grad_norm(params, max_norm, *, pp_group, skip)``: the total 2-norm over every gradient
  of the model, on every rank the same: DTensor gradients (TP, FSDP2) are grouped by mesh and
  placements, each group's norm made whole with ``full_tensor()``, plain gradients are local
  (replicated over dp after the sync), then the squares are summed over the pipeline group. A
  tied parameter held by two pipeline ranks is counted once (``skip``: the copies not counted).
  Gradients are then scaled by ``min(1, max_norm / (norm + 1e-6))`` (torch's
  ``clip_grads_with_norm_``). Returns the norm before clipping as a 0-dim tensor on the gradients'
  device, NOT read on the host: the norm's squares are summed on the device (no CPU accumulator, whose
  ``.to(device)`` was a host-to-device copy that waited for the norm kernels) and the caller reads it
  after the update's kernels are issued (``ParallelModel._optimizer_step``), so the host's work of the
  update (Adam's per-tensor Python, the multi-tensor metadata) runs while the device clips (#33: the
  two reads inside the phase left the device idle for that work, ~6 ms per step for gpt2-xl's 772
  tensors on an H100's host, predicted).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshplan.runtime.launch import collectives

LR_SCHEDULES = ("constant", "cosine")


SGD_MOMENTUM = 0.9  # ``--optimizer sgd`` without ``--momentum``


def make_optimizer(name: str, lr: float, *, weight_decay: float = 0.0,
                   momentum: float | None = None) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    """``params -> Optimizer`` (see the module docstring); ``momentum`` is SGD's (None: 0.9), refused
    for Adam/AdamW (their moments are not optional)."""
    if name not in ("adam", "adamw", "sgd"):
        raise ValueError(f"--optimizer {name!r} unknown; use adam, adamw or sgd")
    if momentum is not None and name != "sgd":
        raise ValueError(f"--momentum is SGD's; --optimizer {name} keeps its two moments (drop --momentum)")
    if momentum is not None and not 0.0 <= momentum < 1.0:
        raise ValueError(f"--momentum must be in [0, 1), got {momentum}")
    sgd_momentum = SGD_MOMENTUM if momentum is None else momentum

    def factory(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        groups = param_groups(params)
        if name == "sgd":
            return torch.optim.SGD(groups, lr=lr, momentum=sgd_momentum)
        cuda = bool(params) and params[0].device.type == "cuda"
        # CPU: one parameter at a time. The multi-tensor (foreach) Adam kernels allocate temporaries the
        # size of the whole local shard at once (the scaled gradients, then sqrt(v)), +1 shard of host
        # memory at the step, and on CPU they loop over the tensors anyway (no launch cost to save)
        fast = {"fused": True} if cuda else {"foreach": False}
        if name == "adam":
            return torch.optim.Adam(groups, lr=lr, **fast)
        return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, **fast)

    return factory


def param_groups(params: list[torch.Tensor]) -> list[dict[str, Any]]:
    """Plain tensors and DTensors in separate groups: torch's foreach/fused kernels cannot mix them
    (TP leaves norms and replicated layers as plain tensors beside DTensor shards)."""
    plain = [p for p in params if not isinstance(p, DTensor)]
    dt = [p for p in params if isinstance(p, DTensor)]
    return [g for g in ({"params": plain}, {"params": dt}) if g["params"]] or [{"params": []}]


def lr_at(step: int, *, lr: float, schedule: str = "constant", warmup_steps: int = 0, total_steps: int = 0) -> float:
    """Learning rate of 1-based ``step`` (formula in the module docstring)."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"--lr-schedule {schedule!r} unknown; use one of {LR_SCHEDULES}")
    if warmup_steps < 0:
        raise ValueError(f"--warmup-steps must be >= 0, got {warmup_steps}")
    if step <= warmup_steps:
        return lr * step / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return lr
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


def _group_key(g: torch.Tensor) -> object:
    if isinstance(g, DTensor):
        return (id(g.device_mesh), tuple(g.placements))
    return None


def total_grad_norm(params: Iterable[torch.Tensor], *, pp_group: dist.ProcessGroup | None = None,
                    skip: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """The global 2-norm of all gradients (fp32 scalar tensor, the same on every rank)."""
    skipped = {id(p) for p in skip}
    return grads_norm([p.grad for p in params if p.grad is not None and id(p) not in skipped], pp_group=pp_group)


def grads_norm(grads: Iterable[torch.Tensor], *, pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The global 2-norm of ``grads`` (DTensors made whole over their mesh, plain tensors local),
    summed over the pipeline group: an fp32 scalar tensor, the same on every rank."""
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(_group_key(g), []).append(g)
    # summed where the norms are (no host tensor: a CPU accumulator's .to(device) waits for the stream)
    sq: torch.Tensor | None = None
    for grads in groups.values():
        n = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        part = n.float() ** 2
        sq = part if sq is None else sq + part.to(sq.device)
    if sq is None:
        sq = torch.zeros((), dtype=torch.float32)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        sq = collectives.all_reduce(sq, group=pp_group)
    return sq.sqrt()


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, *, pp_group: dist.ProcessGroup | None = None,
                   skip: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """Clip all gradients to a global norm of ``max_norm``; returns the norm before clipping (a 0-dim
    tensor on the device, not read on the host: module docstring)."""
    norm = total_grad_norm(params, pp_group=pp_group, skip=skip)
    grads = [p for p in params if p.grad is not None]
    by_kind: dict[object, list[torch.Tensor]] = {}
    for p in grads:
        by_kind.setdefault(_group_key(p.grad), []).append(p)  # type: ignore[arg-type]
    for ps in by_kind.values():
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, norm, foreach=True)
    return norm


def clip_grads(grads: list[torch.Tensor], max_norm: float, *, pp_group: dist.ProcessGroup | None = None,
               norm_of: list[torch.Tensor] | None = None) -> torch.Tensor:
    """``clip_grad_norm`` over gradient tensors held apart from their parameters (the fp32 main
    gradients of ``runtime.apply.master_state``): the norm of ``norm_of`` (default ``grads``; DTensor
    views of the local tensors, a tied copy left out), then every tensor of ``grads`` scaled in place
    by torch's ``min(1, max_norm / (norm + 1e-6))`` with one ``_foreach_mul_`` per device (the kernels
    ``cost_models.optimizer_phase`` prices: torch's ``clip_grads_with_norm_(foreach=True)`` scales the same
    way, but reads ``p.grad``). Returns the norm before clipping (on the device, not read on the host)."""
    norm = grads_norm(grads if norm_of is None else norm_of, pp_group=pp_group)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for device, group in by_device.items():
        torch._foreach_mul_(group, coef.to(device))
    return norm
