"""Sequence parallelism that saves the sequence shard, not its all-gather (Megatron-LM's layout).

Under sequence parallelism a TP region's input (an in-block norm's output) arrives as this rank's
slice of the sequence and is all-gathered before the column-parallel linears that read it; each of
them saves its input for its weight gradient, so torch's TP keeps the whole gathered sequence per
region and microbatch (``memory.SP_SAVES`` "gathered"). Megatron-LM's
``LinearWithGradAccumulationAndAsyncCommunication`` saves the shard and all-gathers it again in
backward (Korthikanti et al. 2022, §4.2.2), tp times less. Here the same, with PyTorch's own
mechanism for what autograd saves (``torch.autograd.graph.saved_tensors_hooks``):

- ``gather_for_linears`` all-gathers the shard and records the gathered tensor (by its storage,
  held weakly) beside its shard. Under ``torch.autocast`` on fp32 activations the shard is first cast to
  autocast's dtype: the linears would each cast the gathered fp32 input to it anyway (same values,
  and the cast's backward is the same cast back), and then all of them read (and save) one copy.
- ``ShardSaves`` is the pack / unpack pair, active around a module's forward (``install``): a saved
  tensor whose storage is the recorded gathered tensor's (itself or a view, DTensor or plain;
  ``linear`` saves a 2-D view) is packed as the shard; unpacking all-gathers it again (once per pack group: the q/k/v
  linears of one region share one re-gather) and rebuilds the view.

Backward runs the re-gather on every TP rank in the same order (each rank runs the same graph),
as Megatron's does. Inside a checkpointed region (full recompute) the hooks are not pushed: the
checkpoint's own decide what is kept (the region saves nothing). No model-specific branches.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard


def _gather(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()


class _Gathered:
    """What ``gather_for_linears`` recorded of one all-gather: its shard, and the re-gather made in
    backward (shared by every saved view of the gathered tensor)."""

    __slots__ = ("mesh", "regathered", "shard")

    def __init__(self, shard: torch.Tensor, mesh: DeviceMesh) -> None:
        self.shard, self.mesh = shard, mesh
        self.regathered: torch.Tensor | None = None

    def whole(self) -> torch.Tensor:
        if self.regathered is None:
            with torch.no_grad():
                self.regathered = _gather(self.shard, self.mesh)
        return self.regathered


class ShardSaves:
    """The saved-tensor hooks (module docstring) and the record of gathered tensors they look up."""

    def __init__(self) -> None:
        self._live: dict[int, tuple[weakref.ref, _Gathered]] = {}
        self.packed = 0  # saved tensors packed as their shard (tests read it)

    def gather_for_linears(self, mesh: DeviceMesh) -> Callable[[torch.Tensor], torch.Tensor]:
        """Local sequence slice -> whole sequence (all-gather; backward keeps the local chunk), recorded."""

        def gather(x: torch.Tensor) -> torch.Tensor:
            dev = x.device.type
            if x.dtype == torch.float32 and torch.is_autocast_enabled(dev):
                x = x.to(torch.get_autocast_dtype(dev))
            whole = _gather(x, mesh)
            key = whole.untyped_storage()._cdata
            self._live[key] = (weakref.ref(whole, lambda _r, k=key: self._live.pop(k, None)),
                               _Gathered(x.detach(), mesh))
            return whole

        return gather

    def _record_of(self, t: torch.Tensor) -> _Gathered | None:
        local = t._local_tensor if isinstance(t, DTensor) else t
        if local.device.type == "meta":
            return None
        key = local.untyped_storage()._cdata  # a view's storage is its base's (DTensor's local views keep no _base)
        hit = self._live.get(key)
        return hit[1] if hit is not None and hit[0]() is not None else None

    def pack(self, t: torch.Tensor) -> Any:
        rec = self._record_of(t)
        if rec is None:
            return t
        self.packed += 1
        local = t._local_tensor if isinstance(t, DTensor) else t
        meta = (local.size(), local.stride(), local.storage_offset())
        spec = (t.device_mesh, t.placements, t.size(), t.stride()) if isinstance(t, DTensor) else None
        return (rec, meta, spec)

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        rec, (size, stride, offset), spec = packed
        local = rec.whole().as_strided(size, stride, offset)
        if spec is None:
            return local
        mesh, placements, shape, dstride = spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=dstride)

    def install(self, module: nn.Module) -> None:
        """Make ``module``'s forward save shards: the hooks are pushed before it runs and popped after."""
        ctx: list[Any] = []

        def enter(_m: nn.Module, _args: Any) -> None:
            if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
                ctx.append(None)  # inside a checkpoint (or its recompute): its hooks decide, it saves nothing
                return
            c = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            c.__enter__()
            ctx.append(c)

        def leave(_m: nn.Module, _args: Any, _out: Any) -> None:
            c = ctx.pop() if ctx else None
            if c is not None:
                c.__exit__(None, None, None)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)
