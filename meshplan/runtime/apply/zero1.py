"""ZeRO-1 (dp_kind zero1): torch's ZeroRedundancyOptimizer, also over TP-sharded (DTensor) parameters.

``zero1_optimizer(opt, params, group)`` wraps ``opt``'s class and settings in torch's
``ZeroRedundancyOptimizer`` over the data-parallel group: every rank keeps the optimizer state of
the parameters it owns, updates them, and broadcasts them to the other dp ranks; parameters and
gradients stay replicated over dp (the ZeRO-1 memory ``cost_models.dp_kinds`` prices).

With tp > 1 some parameters are DTensors (a TP rank's shard), which ZeroRedundancyOptimizer
cannot take (its broadcasts and flat buckets are plain c10d collectives). ``TPZero`` gives it the
local shards instead (``to_local()`` under no_grad: the very storage of the DTensor, so updating it
updates the parameter), each a trainable leaf; the dp group of one TP rank holds the same shard of
every parameter, so the dp ranks partition and broadcast consistent tensors. Before the step
(``bind_grads``, called by ``ParallelModel`` before unscaling and clipping) each local shard's
``.grad`` is set to the DTensor gradient's local tensor (the same storage, so clipping and fp16
unscaling of the DTensor gradients act on it); ``zero_grad`` clears both.

Checkpoints (``runtime.checkpoint.dcp``): ``state_view(opt)`` is an optimizer of the same class over
the *model's* parameters that this rank owns, whose state is the ZeRO shard's (DTensor-wrapped for
DTensor parameters), so DCP's state-dict helpers key it by FQN exactly like an unsharded
optimizer; ``load_view(opt, view)`` copies a loaded view back into the ZeRO shard.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor


class TPZero(ZeroRedundancyOptimizer):
    """ZeroRedundancyOptimizer over the local shards of DTensor parameters (module docstring)."""

    def __init__(self, params: list[torch.Tensor], **kw: Any) -> None:
        self.model_params = list(params)
        with torch.no_grad():
            self.locals = [p.to_local() if isinstance(p, DTensor) else p for p in self.model_params]
        for p, loc in zip(self.model_params, self.locals):
            if loc is not p:
                loc.requires_grad_(p.requires_grad)
        super().__init__(self.locals, **kw)

    @torch.no_grad()
    def bind_grads(self) -> None:
        for p, loc in zip(self.model_params, self.locals):
            if loc is not p:
                loc.grad = None if p.grad is None else p.grad.to_local()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for p in self.model_params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def model_param_of(self) -> dict[int, torch.Tensor]:
        """id(local shard) -> the model's parameter."""
        return {id(loc): p for p, loc in zip(self.model_params, self.locals)}


def zero1_optimizer(opt: torch.optim.Optimizer, params: list[torch.Tensor],
                    group: dist.ProcessGroup) -> torch.optim.Optimizer:
    """``opt``'s class and settings, its state sharded over ``group`` (DTensor parameters: ``TPZero``)."""
    cls = type(opt)
    accepted = set(inspect.signature(cls.__init__).parameters)
    kw = {k: v for k, v in opt.defaults.items() if k in accepted and k != "params"}
    if any(isinstance(p, DTensor) for p in params):
        return TPZero(params, optimizer_class=cls, process_group=group, **kw)
    return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=group, **kw)


def wrap_like(v: Any, p: torch.Tensor) -> Any:
    """A tensor of ``p``'s local shape as a DTensor of ``p``'s placements (same storage); anything else as is."""
    if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.shape == p.to_local().shape and v.dim() > 0:
        return DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())
    return v


def view_over(opt: torch.optim.Optimizer, param_of: dict[int, torch.Tensor]) -> torch.optim.Optimizer:
    """An optimizer of ``opt``'s class and settings over other parameters (``param_of``: id of one of
    ``opt``'s parameters -> the view's parameter; the others are left out), its state ``opt``'s own tensors
    wrapped like the view's parameters (``wrap_like``: the same storage). A checkpoint saves and loads the view
    (this module's ``state_view``, ``MasterState.optimizer_view``). Built with the base ``Optimizer``
    constructor: the subclass's would validate its options (fused=True: CUDA parameters of a floating dtype)
    against parameters the view holds for keys only. Multi-tensor kernels are off in its groups (foreach and
    fused: a group may mix DTensor and plain parameters, which they refuse) since DCP may run one zero-gradient
    step on the view to create missing state."""
    off = {k: False for k in ("foreach", "fused") if k in opt.defaults}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, **off,
               "params": [param_of[id(p)] for p in g["params"] if id(p) in param_of]} for g in opt.param_groups]
    view = type(opt).__new__(type(opt))
    torch.optim.Optimizer.__init__(view, [g for g in groups if g["params"]] or [{"params": []}],
                                   {**opt.defaults, **off})
    for src, st in opt.state.items():
        p = param_of.get(id(src))
        if p is not None:
            view.state[p] = {k: wrap_like(v, p) for k, v in st.items()}
    return view


def state_view(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose state a checkpoint saves for ``opt`` (module docstring)."""
    if not isinstance(opt, ZeroRedundancyOptimizer):
        return opt
    if not isinstance(opt, TPZero):
        return opt.optim
    return view_over(opt.optim, opt.model_param_of())


def load_view(opt: torch.optim.Optimizer, view: torch.optim.Optimizer) -> None:
    """After a checkpoint filled ``view`` (from ``state_view``), copy its state into ``opt``'s shard."""
    if not isinstance(opt, TPZero):
        return  # the view is the optimizer itself (or ZeRO's own per-rank optimizer)
    by_id = {id(p): loc for p, loc in zip(opt.model_params, opt.locals)}
    for p, st in view.state.items():
        opt.optim.state[by_id[id(p)]] = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in st.items()}
