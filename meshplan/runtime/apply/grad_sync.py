"""Bucketed, overlapped data-parallel gradient all-reduce for pipelined and manual data parallelism.

``BucketedGradSync`` packs a rank's trainable parameters into buckets
(``meshplan.cost_models.grad_sync.bucket_indices``, in backward order: the reverse of registration
order, over the rank's stages from last to first) and counts, per parameter, the gradient
contributions of the step. Once a parameter has received all of them (one per microbatch per
local stage that uses it) it is final; once every parameter of a bucket is final, the bucket's
gradients are flattened into one buffer, divided by ``divide_by`` (dp, times the microbatch
count under pipelining, whose schedules do not scale gradients) and
``all_reduce(..., async_op=True)`` is issued over the dp group, while the backward of the last microbatch goes on. ``finish()`` issues any bucket
not yet issued (parameters that got no gradient), waits for all, and writes the averages back.

Where a contribution is seen:

* ordinary schedules and one-process gradient accumulation: ``register_post_accumulate_grad_hook``.
* zero-bubble schedules (InterleavedZeroBubble, ZBV): torch's weight-gradient pass assigns
  ``param.grad`` directly (no accumulate hook fires), so each ``PipelineStage``'s
  ``backward_weight_one_chunk`` is wrapped to count one contribution for every parameter of that
  stage after it runs. DDP and FSDP2 give wrong gradients under these schedules (PLATFORM.md);
  this reduction is correct there.

``collectives_last_step`` is the number of all-reduce calls this object issued in the last step
(counted as they are issued), ``bytes_last_step`` the bytes they reduced, ``overlapped_last_step`` how many of them were issued from the
backward (before ``finish()``). DTensor gradients (TP inside the stage) reduce their local shard.

With ``main`` (``runtime.apply.master_state.MasterState``: 16-bit weights, ``Plan.state_layout``
"megatron" / "zero") each contribution is first folded into the parameter's main gradient (fp32 / bf16),
and the buckets reduce (and are sized by) the main gradients instead of ``.grad``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshplan.cost_models.grad_sync import DEFAULT_BUCKET_CAP_BYTES, bucket_indices
from meshplan.runtime.launch import collectives


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _Bucket:
    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.ready = 0
        self.work: Any = None
        self.flat: torch.Tensor | None = None


class BucketedGradSync:
    def __init__(
        self,
        stage_params: Sequence[Sequence[torch.Tensor]],
        group: dist.ProcessGroup,
        *,
        microbatches: int,
        cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
        use_hooks: bool = True,
        divide_by: int | None = None,
        main: Any = None,
    ) -> None:
        self.group = group
        self.main = main  # MasterState or None
        self.divide_by = divide_by or dist.get_world_size(group)
        uses: dict[int, int] = {}
        order: list[torch.Tensor] = []
        for params in reversed(list(stage_params)):
            for p in reversed(list(params)):
                if not p.requires_grad:
                    continue
                if id(p) not in uses:
                    order.append(p)
                uses[id(p)] = uses.get(id(p), 0) + 1
        self.expected = {k: v * microbatches for k, v in uses.items()}
        self.buckets: list[_Bucket] = []
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in order:
            by_dtype.setdefault(main.main_dtype if main is not None else p.dtype, []).append(p)
        for dt, ps in by_dtype.items():
            sizes = [_local(p).numel() * dt.itemsize for p in ps]
            self.buckets += [_Bucket([ps[i] for i in idx]) for idx in bucket_indices(sizes, cap_bytes)]
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.counts: dict[int, int] = {}
        self.collectives_last_step = 0
        self.last_issue_s = 0.0  # perf_counter() when the last bucket was issued
        self.overlapped_last_step = 0  # of those, issued from a hook (before finish())
        self.bytes_last_step = 0  # bytes all-reduced in the last step
        self._bytes = 0
        self._issued = 0
        self._overlapped = 0
        self.handles: list[Any] = []
        if use_hooks:
            for p in order:
                self.handles.append(p.register_post_accumulate_grad_hook(self._hook))

    def owns(self, p: torch.Tensor) -> bool:
        return id(p) in self.bucket_of

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    # ---- contributions --------------------------------------------------------------------------
    def _hook(self, p: torch.Tensor) -> None:
        self.mark(p)

    def mark(self, p: torch.Tensor) -> None:
        key = id(p)
        if key not in self.expected:
            return
        if self.main is not None:
            self.main.fold(p)
        n = self.counts.get(key, 0) + 1
        self.counts[key] = n
        if n > self.expected[key]:
            raise AssertionError(
                f"gradient of a parameter {tuple(p.shape)} accumulated {n} times in one step, expected "
                f"{self.expected[key]}: its bucket was reduced too early"
            )
        if n == self.expected[key]:
            b = self.bucket_of[key]
            b.ready += 1
            if b.ready == len(b.params):
                self._issue(b)
                self._overlapped += 1

    def watch_weight_passes(self, stage: Any, params: Sequence[torch.Tensor]) -> None:
        """Count one contribution per parameter of ``stage`` after each of its weight-gradient passes."""
        inner = stage.backward_weight_one_chunk
        ps = [p for p in params if p.requires_grad]

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            for p in ps:
                self.mark(p)
            return out

        stage.backward_weight_one_chunk = wrapped

    # ---- collectives ----------------------------------------------------------------------------
    def _issue(self, b: _Bucket) -> None:
        if b.work is not None:
            return
        self.last_issue_s = time.perf_counter()  # this rank's gradients of the bucket are final (stragglers)
        if self.main is not None:
            grads = [self.main.main_grad(p) for p in b.params]
        else:
            grads = [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)) for p in b.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat.div_(self.divide_by)
        b.flat, b.work = collectives.all_reduce_async(flat, group=self.group)
        self._issued += 1
        self._bytes += flat.numel() * flat.element_size()

    def finish(self) -> None:
        """Issue what is left, wait for every bucket, write the averaged gradients back; reset."""
        for b in self.buckets:
            if b.work is None and (self.main is not None or any(p.grad is not None for p in b.params)):
                self._issue(b)
        for b in self.buckets:
            if b.work is None:
                continue
            b.work.wait()
            off = 0
            assert b.flat is not None
            for p in b.params:
                loc = _local(p)
                n = loc.numel()
                if self.main is not None:
                    self.main.main_grad(p).copy_(b.flat[off:off + n].view_as(loc))
                elif p.grad is None:
                    p.grad = DTensor.from_local(b.flat[off:off + n].view_as(loc), p.device_mesh, p.placements) \
                        if isinstance(p, DTensor) else b.flat[off:off + n].view_as(loc).clone()
                else:
                    _local(p.grad).copy_(b.flat[off:off + n].view_as(loc))
                off += n
            b.work, b.flat, b.ready = None, None, 0
        self.collectives_last_step, self.overlapped_last_step = self._issued, self._overlapped
        self.bytes_last_step = self._bytes
        self._issued = self._overlapped = self._bytes = 0
        self.counts.clear()
