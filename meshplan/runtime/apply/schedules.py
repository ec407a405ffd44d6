"""Plan schedule names -> ``torch.distributed.pipelining`` schedules, and stage placement.

=====================  ===================================  =========================
plan.schedule          torch schedule                       stages per pipeline rank
=====================  ===================================  =========================
gpipe                  ScheduleGPipe                        1
1f1b                   Schedule1F1B                         1
interleaved-1f1b       ScheduleInterleaved1F1B              v (looped: r, r+p, ...)
zero-bubble            ScheduleInterleavedZeroBubble        v >= 1 (looped)
zbv                    ScheduleZBVZeroBubble                2 (V: r and 2p-1-r)
=====================  ===================================  =========================

``zero-bubble`` with one stage per rank (v=1) also uses ScheduleInterleavedZeroBubble: torch
has no single-stage zero-bubble class, and the interleaved one accepts a one-element stage list
(split backward into input-grad B and weight-grad W, W deferred into the bubbles).
Schedules are built with ``scale_grads=False``; the runtime divides every gradient by the
number of microbatches ONCE per parameter after ``step()``. torch's own scaling runs per stage,
so a parameter shared by two stages of one rank (the tied embedding/LM head under ZBV's V
placement: stages 0 and 2p-1 both on rank 0) would be divided twice. ``loss_fn`` must be a mean.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.stage import _RecvInfo

try:  # torch >= 2.12 (the pinned 2.13): receive metadata that allocates a buffer on demand
    from torch.distributed.pipelining._utils import _make_tensor_from_meta
except ImportError:  # older torch (2.11 on the GPU machine, PLATFORM.md): torch's own stages, below
    _make_tensor_from_meta = None

try:  # torch's group of backward calls that re-run a checkpointed region once (torch 2.13 has it)
    from torch.utils.checkpoint import GraphExecGroup
except ImportError:  # older torch: each weight-gradient call re-runs the blocks it reads (slower, same gradients)
    from contextlib import nullcontext as GraphExecGroup  # type: ignore[assignment]  # noqa: N812

from meshplan.errors import PlanMismatchError


def stage_rank(schedule: str, index: int, pp: int) -> int:
    """Pipeline rank that runs stage ``index`` under ``schedule`` (looped or V placement)."""
    if schedule == "zbv":
        return index if index < pp else 2 * pp - 1 - index
    return index % pp


def check_placement(schedule: str, pp: int, ranks_by_stage: Sequence[int], microbatches: int) -> None:
    n = len(ranks_by_stage)
    if n % pp:
        raise PlanMismatchError(f"{n} stages cannot be spread evenly over pp={pp} ranks")
    v = n // pp
    if schedule in ("gpipe", "1f1b") and v != 1:
        raise PlanMismatchError(f"schedule {schedule} runs one stage per rank; the plan has {v} (use interleaved-1f1b)")
    if schedule == "zbv" and v != 2:
        raise PlanMismatchError(f"schedule zbv needs exactly 2 stages per rank (V placement), the plan has {v}")
    if schedule == "1f1b" and microbatches < pp:
        raise PlanMismatchError(f"1f1b needs microbatches >= pipeline ranks ({microbatches} < {pp})")
    want = [stage_rank(schedule, i, pp) for i in range(n)]
    if list(ranks_by_stage) != want:
        raise PlanMismatchError(
            f"plan places stages on pipeline ranks {list(ranks_by_stage)}, but {schedule} runs them on {want}"
        )


class InFlightStage(PipelineStage):
    """torch's ``PipelineStage`` whose receive buffers follow the microbatches in flight.

    torch allocates, at a stage's first step, a receive buffer for the stage's input (non-first
    stages, ``_setup_forward_recv_info``) and one for its output's gradient (non-last stages,
    ``_create_grad_recv_info``) for EVERY microbatch of the step, and keeps them across steps:
    ``m · (I + O)`` bytes whatever the schedule keeps in flight (280 microbatches of a 175B model's
    stage: tens of GB). Here a microbatch's buffers are allocated when the schedule first asks for
    them (the receive op it posts, ``get_fwd_recv_ops`` / ``get_bwd_recv_ops``, or the retrieval
    before its forward / backward) and dropped after its backward has consumed them
    (``backward_one_chunk``; after its forward when the stage runs no backward). What autograd
    saved of the received input (the stage's first ops save it) and what zero-bubble's deferred
    weight step keeps (``backward_state``) stay alive through their own references until used, as
    with torch's buffers; a dropped buffer is never reused, so nothing a later microbatch receives
    can overwrite it. Numerics are torch's: the same ``_make_tensor_from_meta`` buffers, received
    into by the same ops. The last stage also detaches each microbatch's loss after its backward
    (``_drop_graph``), which would otherwise keep the received input alive until the step ends.

    Also, in shape inference on the first step torch runs a later stage on uninitialised tensors
    shaped like what it receives, so an integer tensor computed in an earlier stage (ids hashed or
    bucketed from the tokens, routing indices) would index an embedding out of range; here such
    tensors are zeros (float ones stay as torch makes them).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._roots: dict[int, tuple] = {}  # microbatch -> its cached outputs' stand-ins (``_OutputRoot``)
        self.uncached_outputs = 0  # microbatches whose sent output was not cached (tests read it)
        super().__init__(*args, **kwargs)

    def _to_tensor(self, arg: Any) -> Any:
        t = super()._to_tensor(arg)
        if not isinstance(arg, torch.Tensor) and isinstance(t, torch.Tensor) and not (
                t.is_floating_point() or t.is_complex()):
            with torch.no_grad():
                (t.to_local() if hasattr(t, "to_local") else t).zero_()
        return t

    # -- buffers on demand -------------------------------------------------------------------
    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        super()._setup_forward_recv_info(1, has_backward)  # torch's infos for one microbatch
        first = self.args_recv_info[0]
        for k in range(num_microbatches):
            self.args_recv_info[k] = tuple(_unallocated(info) for info in first)

    def _create_grad_recv_info(self, act_send_info: dict) -> tuple:
        return tuple(_unallocated(info) for info in super()._create_grad_recv_info(act_send_info))

    def _allocate(self, infos: tuple) -> None:
        for info in infos:
            if not info.is_root_arg and info.buffer is None and info.tensor_meta is not None:
                info.buffer = _make_tensor_from_meta(info.tensor_meta, self.device)

    @staticmethod
    def _release(infos: tuple) -> None:
        for info in infos:
            if not info.is_root_arg and info.tensor_meta is not None:
                info.buffer = None

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list:
        self._allocate(self.args_recv_info[fwd_chunk_id])
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
        ops = super().get_fwd_send_ops(fwd_chunk_id)  # each op holds its (detached) output until sent
        if ops and self.has_backward and not self.is_last:
            outs, inputs = self.fwd_cache[fwd_chunk_id]
            roots = tuple(_OutputRoot.apply(o) if _rootable(o) else o for o in outs)
            self.fwd_cache[fwd_chunk_id] = (roots, inputs)
            self._roots[fwd_chunk_id] = roots
            self.uncached_outputs += 1
        return ops

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
        if self.has_backward and not self.is_last:
            self._allocate(self.grad_recv_info[bwd_chunk_id])
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def _retrieve_recv_activations(self, fwd_chunk_id: int) -> Any:
        self._allocate(self.args_recv_info[fwd_chunk_id])
        return super()._retrieve_recv_activations(fwd_chunk_id)

    def _retrieve_recv_grads(self, bwd_chunk_id: int) -> Any:
        self._allocate(self.grad_recv_info[bwd_chunk_id])
        grads = super()._retrieve_recv_grads(bwd_chunk_id)
        roots = self._roots.pop(bwd_chunk_id, None)
        if roots is None:
            return grads
        out = []
        for root, g in zip(roots, grads, strict=True):
            if isinstance(root.grad_fn, _OutputRoot._backward_cls) and isinstance(g, torch.Tensor):
                root.grad_fn.grad = g  # what the root's backward hands the stage output
                g = g.new_empty((0,))
            out.append(g)
        return tuple(out)

    def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
        self._allocate(self.grad_recv_info[mb_index])  # torch zeroes it where the next stage gives None
        super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if not self.has_backward and fwd_chunk_id in self.args_recv_info:
            self._release(self.args_recv_info[fwd_chunk_id])
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, *args: Any, **kwargs: Any) -> Any:
        out = super().backward_one_chunk(bwd_chunk_id, loss, *args, **kwargs)
        if kwargs.get("full_backward", True):
            _drop_graph(loss)
        for infos in (self.args_recv_info, self.grad_recv_info):
            if bwd_chunk_id in infos:
                self._release(infos[bwd_chunk_id])
        return out

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        state = self.backward_state.get(bwd_chunk_id)
        # one microbatch's weight-gradient autograd.grad calls (one per parameter group) under one group:
        # a block checkpointed by torch's checkpoint (block_checkpoint.py) is re-run once for all of them,
        # not once per call; without checkpointed regions the group changes nothing
        with GraphExecGroup():
            out = super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
        if self.is_last and state is not None:
            _drop_graph(state[2])  # the loss, kept for the deferred weight step
        return out

    def clear_runtime_states(self) -> None:
        super().clear_runtime_states()
        self._roots = {}
        for infos in (*self.args_recv_info.values(), *self.grad_recv_info.values()):
            self._release(infos)


class _OutputRoot(torch.autograd.Function):
    """An empty stand-in for a sent stage output: the root of the stage's backward without the
    output's storage (Megatron-LM's ``deallocate_output_tensor`` keeps the output's ``grad_fn`` and
    frees its data after the send; here the storage is held only by the send op until the send
    completes, and no tensor's data is swapped). Its backward hands on the gradient received for
    the output (``grad``, set by ``InFlightStage._retrieve_recv_grads``); the empty gradient torch's
    ``stage_backward`` gives it is ignored."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor) -> torch.Tensor:
        ctx.grad = None
        return out.new_empty((0,))

    @staticmethod
    def backward(ctx: Any, _empty: torch.Tensor) -> torch.Tensor:
        return ctx.grad


def _rootable(t: Any) -> bool:
    """A stage output the stage's backward starts from, as a plain tensor (DTensor outputs are sent
    as their local shard and keep their own storage)."""
    return isinstance(t, torch.Tensor) and t.grad_fn is not None and not hasattr(t, "to_local")


def _drop_graph(loss: Any) -> None:
    """Detach a last stage's microbatch loss after its backward: the schedule keeps every
    microbatch's loss until the step ends, and through its graph's nodes (their saved tensors are
    freed, but ``AccumulateGrad`` holds its leaf) the microbatch's received input would stay alive
    (torch detaches the stage output after the backward for the same reason)."""
    if isinstance(loss, torch.Tensor) and loss.grad_fn is not None and not loss._is_view():
        loss.detach_()


def _unallocated(info: _RecvInfo) -> _RecvInfo:
    """``info`` without its buffer (the metadata that allocates it on demand)."""
    return _RecvInfo(info.input_name, info.source, None, info.tensor_meta, is_root_arg=info.is_root_arg)


def pipeline_stage(module: Any, index: int, num_stages: int, device: Any, group: Any, **metadata: Any) -> Any:
    """The runtime's one builder of a pipeline stage: an ``InFlightStage`` for ``module``;
    ``metadata``: ``PipelineStage``'s static ``input_args`` / ``output_args`` / ... (the runtime
    lets torch infer them on the first step).

    On a torch without ``_make_tensor_from_meta`` (before 2.12) the stage is torch's own
    ``PipelineStage``: it keeps a receive buffer per microbatch (what the memory model's
    ``pp_buffers="all"`` prices, not meshplan's in-flight convention), and a warning says so."""
    if _make_tensor_from_meta is None:
        import warnings

        warnings.warn(f"torch {torch.__version__} lacks pipelining._utils._make_tensor_from_meta: pipeline stages "
                      "are torch's own PipelineStage, which keeps a receive buffer for every microbatch (more memory "
                      "than the plan priced); torch >= 2.12 runs meshplan's in-flight stages", stacklevel=2)
        return PipelineStage(module, index, num_stages, device, group=group, **metadata)
    return InFlightStage(module, index, num_stages, device, group=group, **metadata)


def build_schedule(schedule: str, stages: list, microbatches: int, loss_fn: Callable) -> object:
    """The torch schedule object for this rank's ``stages`` (PipelineStage objects)."""
    from torch.distributed import pipelining as pl

    if schedule == "gpipe":
        return pl.ScheduleGPipe(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)
    if schedule == "1f1b":
        return pl.Schedule1F1B(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)
    if schedule == "interleaved-1f1b":
        return pl.ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    if schedule == "zero-bubble":
        return pl.ScheduleInterleavedZeroBubble(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    if schedule == "zbv":
        return pl.ScheduleZBVZeroBubble(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    raise PlanMismatchError(f"schedule {schedule!r} is not supported by the runtime")
