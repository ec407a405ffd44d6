"""Activation recomputation from the Plan's ``recompute`` ("none" | "selective" | "op" | "full").

"op" (torchtitan's op-level selective checkpointing) lives in ``runtime/apply/op_recompute.py``: the
same checkpoint regions as "full" (blocks at pp = 1, blocks of a stage graph at pp > 1) under its
selective-checkpoint contexts; not under zero-bubble schedules (``execution_rules.recompute_blocker``).

* pp = 1 (the eager model runs): every child of every ``nn.ModuleList`` (the repeated blocks) is
  wrapped with torch's non-reentrant ``checkpoint_wrapper``: a block keeps only its input and
  re-runs its forward in backward; a model without ``ModuleList`` blocks is one checkpointed segment.
* pp > 1 (a stage is one flat fx GraphModule, blocks are not separate calls): each block inside the
  stage's graph runs under torch's non-reentrant checkpoint (``block_checkpoint.checkpoint_stage_blocks``:
  the graph is rewritten so each block is one ``BlockCheckpoint`` call), as torchtitan and Megatron
  checkpoint per block; an in-flight microbatch holds each block's input. Under zero-bubble
  schedules a microbatch's weight-gradient pass runs under one ``GraphExecGroup``
  (``schedules.InFlightStage``): each block is re-run once in the input-gradient pass and once in
  the weight-gradient pass. A stage graph with no blocks is one checkpointed segment
  (``CheckpointedStage``; under zero-bubble ``cached_checkpoint.CachedCheckpointStage``: one
  recompute per microbatch, in the input-gradient pass, its saved tensors kept for the
  weight-gradient passes).

"selective" (Korthikanti et al.: recompute only the attention core, keep the linears'
activations), at any pp and under every schedule: what runs (the model at pp = 1, each stage
module at pp > 1) is wrapped in ``SelectiveStage``, whose forward runs under a
``TorchFunctionMode`` that turns every ``F.scaled_dot_product_attention`` call (a
``call_function`` node in an fx stage, or the eager call in the model's code) into a
non-reentrant ``checkpoint`` of that call alone: backward re-runs the attention, everything else
keeps its saved activations. Attention written as explicit matmul/softmax ops is not matched (the
note says so only by the count of the SDPA calls seen, ``SelectiveStage.calls``).
Checkpoint wrappers add ``_checkpoint_wrapped_module.`` to FQNs; ``clean_fqn`` strips it (DCP's
state-dict helpers strip it too).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from meshplan.plan.execution_rules import ZERO_BUBBLE_SCHEDULES, recompute_blocker
from meshplan.runtime.apply.block_checkpoint import checkpoint_stage_blocks
from meshplan.runtime.apply.cached_checkpoint import CachedCheckpointStage, CountingStage

WRAPPED = "_checkpoint_wrapped_module."


def clean_fqn(name: str) -> str:
    return name.replace(WRAPPED, "")


class CheckpointedStage(CountingStage):
    """Runs ``inner`` under non-reentrant activation checkpointing; ``runs`` counts forwards incl. recomputes."""

    def forward(self, *args: Any) -> Any:
        return checkpoint(self._run, *args, use_reentrant=False)


_ATTENTION = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)


class _RecomputeAttention(TorchFunctionMode):
    """Runs each scaled-dot-product attention under its own non-reentrant checkpoint."""

    def __init__(self, owner: SelectiveStage) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _ATTENTION:
            self.owner.calls += 1
            return checkpoint(func, *args, use_reentrant=False, **kwargs)
        return func(*args, **kwargs)


class SelectiveStage(nn.Module):
    """Runs ``inner`` with only its attention cores recomputed in backward; ``calls`` counts them."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with _RecomputeAttention(self):
            return self.inner(*args, **kwargs)


def checkpoint_blocks(model: nn.Module, context_fn: Callable[[], Any] | None = None) -> int:
    """Wrap every ModuleList child of ``model`` in a checkpoint wrapper; returns how many.
    ``context_fn`` (a selective-checkpoint context, ``op_recompute.op_sac_context``) picks what
    each block keeps; None re-runs the whole block."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    ids = {id(c) for m in model.modules() if isinstance(m, nn.ModuleList) for c in m}
    if not ids:
        return 0
    fn: Callable[[nn.Module], bool] = lambda m: id(m) in ids  # noqa: E731
    apply_activation_checkpointing(
        model, check_fn=fn, checkpoint_wrapper_fn=partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
            **({"context_fn": context_fn} if context_fn is not None else {})),
    )
    return len(ids)


def apply_recompute(modules: list[nn.Module], mode: str, *, pipelined: bool, schedule: str) -> tuple[list[nn.Module], str]:
    """The modules to run (possibly wrapped) and a note for the RunRecord."""
    if mode == "none":
        return modules, ""
    if mode == "selective":
        return [SelectiveStage(m) for m in modules], (
            "recompute=selective: each scaled_dot_product_attention call checkpointed on its own "
            "(attention core recomputed, linear activations kept)"
        )
    suffix = ""
    if mode == "op":
        why = recompute_blocker(pp=2 if pipelined else 1, schedule=schedule, recompute=mode)
        if why:
            from meshplan.errors import PlanMismatchError

            raise PlanMismatchError(why)
        from meshplan.runtime.apply.op_recompute import op_sac_context

        # pipeline stages: each block of a stage graph one checkpoint region (block_checkpoint.py)
        n = sum(checkpoint_stage_blocks(m, op_sac_context) if pipelined else checkpoint_blocks(m, op_sac_context)
                for m in modules)
        if n == 0:
            from meshplan.errors import PlanMismatchError

            raise PlanMismatchError("recompute=op needs repeated blocks (nn.ModuleList children) to checkpoint; "
                                    "re-plan with recompute=full or selective")
        return modules, f"recompute=op: {n} blocks checkpointed op-level (every other matmul and attention saved)"
    if pipelined:
        why = recompute_blocker(pp=2, schedule=schedule, recompute=mode)
        if why:
            from meshplan.errors import PlanMismatchError

            raise PlanMismatchError(why)
        n = sum(checkpoint_stage_blocks(m) for m in modules)
        split = schedule in ZERO_BUBBLE_SCHEDULES
        if n:
            return modules, f"recompute={mode}: {n} blocks checkpointed inside the stage graphs" + (
                " (split backward: each block re-run once in the input-gradient pass and once in the "
                "microbatch's weight-gradient pass, under one GraphExecGroup)" if split else "")
        if split:  # no repeated blocks: the whole stage is one segment
            return [CachedCheckpointStage(m) for m in modules], (
                f"recompute={mode}: no nn.ModuleList blocks, one checkpointed segment per stage, recomputed once per "
                "microbatch in the input-gradient pass and kept for the weight-gradient passes (split backward)")
        return [CheckpointedStage(m) for m in modules], (
            f"recompute={mode}: no nn.ModuleList blocks, one checkpointed segment per stage{suffix}")
    n = sum(checkpoint_blocks(m) for m in modules)
    if n == 0:  # no repeated blocks to checkpoint one by one: the whole model is one segment
        return [CheckpointedStage(m) for m in modules], f"recompute={mode}: no nn.ModuleList blocks, the model is one checkpointed segment"
    return modules, f"recompute={mode}: {n} blocks checkpointed{suffix}"

