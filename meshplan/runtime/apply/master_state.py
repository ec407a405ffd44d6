"""16-bit model weights, fp32 main gradients, fp32 master weights (``Plan.state_layout`` "megatron"; "zero":
16-bit main gradients, accumulated and all-reduced in bf16, as Megatron-Core with ``grad_reduce_in_fp32``
off and NeMo's ``grad_sync_dtype`` bf16: 2 + 2 + 12/d bytes per parameter).

Megatron-Core's mixed-precision layout (``megatron/core/optimizer/optimizer.py``
``Float16OptimizerWithFloat16Params``, ``distrib_optimizer.py`` ``DistributedOptimizer``,
``distributed/param_and_grad_buffer.py``): the model's parameters are bf16 (2 B each), every
parameter has an fp32 ``main_grad`` (4 B) its 16-bit gradient is added into as soon as autograd
has accumulated it (Megatron's grad-accumulator hook; ``--accumulate-allreduce-grads-in-fp32``),
and data parallelism reduces the fp32 main gradients. The optimizer steps fp32 master copies of
the weights (4 B + Adam's 8 B); with the distributed optimizer (``dp_kind`` zero1) a rank holds
the masters and optimizer state of its partition only (12/d B per parameter), updates them, and
the updated 16-bit weights go to every dp rank. Per parameter: 2 + 4 + 12/d bytes, where the
"torch" layout (fp32 parameters under autocast) keeps 4 + 4 + 8/d and autocast's 16-bit copies
(``cost_models.dp_kinds.state_precision`` "bf16-fp32-grads" against "fp32").

What PyTorch runs and what this module glues:

- the 16-bit weights: each trainable parameter cast in place (``p.data``; a DTensor through
  ``torch.utils.swap_tensors``, which keeps the Parameter object, so ties, fx stage graphs and TP
  modules still hold it). The forward still runs under ``torch.autocast`` (``runtime.apply.precision``):
  matmuls read the bf16 weights as they are (no cast, so no autocast weight cache), the ops autocast
  runs in fp32 (norms, softmax, the loss) upcast as they do under the fp32 layout.
- the main gradients: ``register_post_accumulate_grad_hook`` (``fold``: ``main += grad``, ``grad = None``).
  With a data-parallel reduction, ``runtime.apply.grad_sync.BucketedGradSync`` folds before it counts
  a contribution and all-reduces the fp32 main gradients in its buckets (also from zero-bubble weight
  passes, where no hook fires); without one this module's own hooks fold (``fold_all`` catches the rest).
- the optimizer: the run's own (``optimizer_factory``: AdamW, Adam, SGD) over the fp32 masters this rank
  owns. Ownership: whole parameters, largest first to the least-loaded dp rank (the rule of torch's
  ``ZeroRedundancyOptimizer._partition_parameters``); every rank keeps all masters at dp_kind ddp / none.
- after the update: each owned master copied into its bf16 parameter, then every parameter broadcast
  from its owner over the dp group in bf16 (ZeroRedundancyOptimizer's per-tensor broadcast, at 2 B a
  parameter; Megatron all-gathers its bf16 parameter buffer).

Under context parallelism the cp ranks' main gradients are reduced with the dp ranks' by
``runtime.apply.epcp`` (its ``BucketedGradSync`` over dp x cp, given this object) and zero1 partitions
the masters over dp x cp. Not executed here (refused by ``plan.execution_rules.state_layout_blocker``):
FSDP2 kinds (their MixedPrecisionPolicy is their own layout), fp16 (the loss scaler's unscale would
need the main gradients), expert parallelism (dense and expert gradients reduce over different
groups) and quantization.

Checkpoints (``runtime.checkpoint.dcp``) hold what the torch layout's hold: each parameter's fp32 value (the
master, from the dp rank that owns it: ``master_view``) and its optimizer state keyed by FQN (``optimizer_view``,
an optimizer of the run's class over the model's parameters whose state is the masters' own tensors). So a resume
equals the uninterrupted run, and a checkpoint of either layout resumes under the other (resharded by DCP). A
host-built model's ``init_from`` is read in fp32 before the cast (``steps.apply_state_layout``), so the masters
hold the file's values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshplan.runtime.apply.zero1 import view_over, wrap_like
from meshplan.runtime.launch import collectives


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def owners(sizes: Sequence[int], ranks: int) -> list[int]:
    """The dp rank that owns each parameter: largest first, each to the rank with the fewest elements
    so far (ties to the lowest rank). The same on every rank (a pure function of the sizes)."""
    load = [0] * ranks
    out = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        out[i] = r
        load[r] += sizes[i]
    return out


def cast_param_(p: torch.Tensor, dtype: torch.dtype) -> None:
    """``p`` (a Parameter, kept as the same object) now holds its values in ``dtype``."""
    if p.dtype == dtype:
        return
    with torch.no_grad():
        if isinstance(p, DTensor):
            torch.utils.swap_tensors(p, torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad))
        else:
            p.data = p.data.to(dtype)


class MasterState:
    """The layout of one rank's trainable parameters (module docstring); the run's optimizer once
    ``attach`` gave it the optimizer over the masters (``step``, ``zero_grad``, ``param_groups``)."""

    def __init__(self, params: Sequence[torch.Tensor], dtype: torch.dtype, *,
                 group: dist.ProcessGroup | None = None, shard: bool = False, hooks: bool = True,
                 main_dtype: torch.dtype = torch.float32) -> None:
        seen: dict[int, torch.Tensor] = {}
        for p in params:
            if p.requires_grad and p.is_floating_point():
                seen.setdefault(id(p), p)
        self.params = list(seen.values())
        self.group = group
        ranks = dist.get_world_size(group) if group is not None and shard else 1
        me = dist.get_rank(group) if ranks > 1 else 0
        self.owner = owners([_local(p).numel() for p in self.params], ranks)
        self.ranks = ranks
        self.global_owner = [dist.get_global_rank(group, o) if ranks > 1 else 0 for o in self.owner]  # type: ignore[arg-type]
        with torch.no_grad():
            # fp32 masters from the fp32 values, before the cast (Megatron clones them from the model)
            self.masters = {id(p): _local(p).detach().clone().float() for p, o in zip(self.params, self.owner)
                            if o == me}
            for p in self.params:
                cast_param_(p, dtype)
            # the gradient buffer (Megatron's persistent grad buffer): fp32 (4 B per parameter) or, state_layout
            # "zero", the weights' 16-bit dtype (Megatron-Core grad_reduce_in_fp32 False, NeMo grad_sync_dtype bf16)
            self.main_dtype = main_dtype
            self.main = {id(p): torch.zeros(_local(p).shape, dtype=main_dtype, device=_local(p).device)
                         for p in self.params}
        self.optim: torch.optim.Optimizer | None = None
        self.handles = [p.register_post_accumulate_grad_hook(self.fold) for p in self.params] if hooks else []

    # ---- gradients ------------------------------------------------------------------------------
    def owns(self, p: torch.Tensor) -> bool:
        return id(p) in self.main

    def main_grad(self, p: torch.Tensor) -> torch.Tensor:
        return self.main[id(p)]

    def fold(self, p: torch.Tensor) -> None:
        """Add ``p``'s 16-bit gradient into its fp32 main gradient and free it."""
        g = p.grad
        if g is None or id(p) not in self.main:
            return
        if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
            # a vocab-sharded embedding's gradient comes whole (DTensor's embedding backward has no Shard(0)
            # strategy): to the parameter's shard, as the optimizer would read it
            g = g.redistribute(p.device_mesh, p.placements)
        self.main[id(p)].add_(_local(g))
        p.grad = None

    def fold_all(self) -> None:
        """Fold every gradient still held (a weight-gradient pass assigns ``.grad`` without a hook)."""
        for p in self.params:
            self.fold(p)

    def norm_views(self) -> list[torch.Tensor]:
        """The main gradients as the global-norm clipping reads them: a DTensor parameter's as a
        DTensor of its placements (so a sharded one's norm is made whole over its mesh)."""
        return [DTensor.from_local(self.main[id(p)], p.device_mesh, p.placements, run_check=False,
                                   shape=p.shape, stride=p.stride()) if isinstance(p, DTensor) else self.main[id(p)]
                for p in self.params]

    # ---- optimizer ------------------------------------------------------------------------------
    def attach(self, factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> MasterState:
        """The run's optimizer over this rank's fp32 masters (in the parameters' order)."""
        self.optim = factory([self.masters[id(p)] for p in self.params if id(p) in self.masters])
        return self

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        assert self.optim is not None, "MasterState.attach was not called"
        return self.optim.param_groups

    @property
    def state(self) -> Any:
        assert self.optim is not None
        return self.optim.state

    @torch.no_grad()
    def step(self) -> None:
        """Update the owned masters from their main gradients, write them into the 16-bit weights,
        and send every weight from its owner to the other dp ranks."""
        assert self.optim is not None, "MasterState.attach was not called"
        for p in self.params:
            m = self.masters.get(id(p))
            if m is not None:  # 16-bit main gradients: an fp32 copy for the update (this rank's masters only)
                g = self.main[id(p)]
                m.grad = g if g.dtype == m.dtype else g.float()
        self.optim.step()
        for p in self.params:
            m = self.masters.get(id(p))
            if m is not None:
                _local(p).copy_(m)
                m.grad = None
        if self.ranks > 1:
            works = []
            for p, src in zip(self.params, self.global_owner):
                x = collectives.on_group_device(_local(p), self.group)
                works.append((p, x, dist.broadcast(x, src=src, group=self.group, async_op=True)))
            for p, x, w in works:
                w.wait()  # type: ignore[union-attr]
                if x is not _local(p):
                    _local(p).copy_(x)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.main.values():
            g.zero_()
        for p in self.params:
            p.grad = None
        for m in self.masters.values():
            m.grad = None

    # ---- checkpoints (runtime.checkpoint.dcp) ---------------------------------------------------
    def master_view(self, p: torch.Tensor) -> torch.Tensor | None:
        """The fp32 master of ``p`` in the parameter's own layout (a DTensor of its placements over the
        master's storage), or None where another dp rank owns it. A checkpoint saves these in place of the
        16-bit weights, so it holds what the torch layout's holds: fp32 values under the model's FQNs."""
        m = self.masters.get(id(p))
        return None if m is None else wrap_like(m, p)

    def optimizer_view(self) -> torch.optim.Optimizer:
        """An optimizer of the run's class over the *model's* parameters whose masters this rank owns, its
        state the masters' own tensors (``zero1.view_over``, shared with ZeRO-1's ``state_view``): DCP's
        state-dict helpers key it by FQN as an unsharded optimizer, and a load writes into the fp32 state in
        place. The masters' state is created first (``_init_state``) so there is fp32 state to load into;
        the view itself never steps."""
        assert self.optim is not None, "MasterState.attach was not called"
        self._init_state()
        view = view_over(self.optim, {id(self.masters[id(p)]): p for p in self.params if id(p) in self.masters})
        for g in view.param_groups:  # no step runs on the view: mark stateless parameters (plain SGD) as initialized
            for q in g["params"]:
                view.state.setdefault(q, {})
        return view

    @torch.no_grad()
    def _init_state(self) -> None:
        """The optimizer's state before its first step, as DCP's state-dict helpers create it for an optimizer
        over model parameters (torch ``state_dict._init_optim_state``: one step on zero gradients at lr 0; the
        masters are not leaves that require grad, which that helper skips)."""
        assert self.optim is not None
        if self.optim.state:
            return
        lrs = [g["lr"] for g in self.optim.param_groups]
        for g in self.optim.param_groups:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
        for m in self.masters.values():
            m.grad = torch.zeros_like(m)
        self.optim.step()
        for g, lr in zip(self.optim.param_groups, lrs):
            g["lr"] = lr
        for m in self.masters.values():
            m.grad = None

    def load_optimizer(self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        """After a checkpoint load: ``p``'s optimizer state (tensors copied into the fp32 state, a no-op where
        DCP loaded in place) and its group's hyperparameters (``lr`` is the schedule's again at the next step)."""
        assert self.optim is not None
        m = self.masters[id(p)]
        mine = self.optim.state[m]
        with torch.no_grad():
            for k, v in state.items():
                if isinstance(mine.get(k), torch.Tensor) and isinstance(v, torch.Tensor):
                    mine[k].copy_(_local(v))
                else:
                    mine[k] = v
        for g in self.optim.param_groups:
            if any(x is m for x in g["params"]):
                g.update({k: v for k, v in group.items() if k != "params"})

    @torch.no_grad()
    def publish(self) -> None:
        """Each owned master rounded into its 16-bit weight (after its value was loaded)."""
        for p in self.params:
            m = self.masters.get(id(p))
            if m is not None:
                _local(p).copy_(m)

