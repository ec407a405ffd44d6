"""The optimizer phase of a training step (gradient-norm clipping + the update) from the kernels torch runs
and the host work between them (#33).

**The kernels** (torch 2.11 / 2.13, CUDA). Gradient-norm clipping with ``foreach=True``
(``torch/nn/utils/clip_grad.py``: ``get_total_norm`` then ``clip_grads_with_norm_``, as meshplan's runtime
``runtime/apply/optim.py clip_grad_norm`` and torchtitan's ``dist_utils.clip_grad_norm_`` call them):
``_foreach_norm`` over the gradients (one read, 4 B per fp32 element; a per-tensor output, then ``stack``
and ``vector_norm`` of the per-tensor norms), the clip coefficient (``max_norm / (norm + 1e-6)``, ``clamp``)
and ``_foreach_mul_`` of every gradient by it in place (read + write, 8 B): ``CLIP_BYTES`` = 12. Adam /
AdamW with ``fused=True`` (``torch/optim/adam.py _fused_adam``): ``_foreach_add_`` of the per-tensor step
counters, then ``_fused_adam_`` / ``_fused_adamw_``, one multi-tensor kernel reading p, g, m, v and writing p,
m, v: 28 B; with ``foreach=True`` (``torch/optim/adamw.py _multi_tensor_adamw``) eight foreach passes,
``_foreach_mul_`` (weight decay) r4 w4, ``_foreach_lerp_`` (m) r8 w4, ``_foreach_mul_`` (v) r4 w4,
``_foreach_addcmul_`` (v) r8 w4, ``_foreach_sqrt`` r4 w4, ``_foreach_div_`` r4 w4, ``_foreach_add_`` (eps)
r4 w4, ``_foreach_addcdiv_`` (p) r12 w4: 80 B. An SGD step reads p, g and writes p (12 B), with momentum
also reads and writes its buffer (20 B), under either implementation. Apex's ``FusedAdam`` / ``multi_tensor_l2norm`` / ``multi_tensor_scale`` (Megatron, DeepSpeed,
NeMo) are the same multi-tensor kernels and bytes. Where the model weights are 16-bit and the optimizer
steps fp32 masters (the "megatron" and "zero" state layouts: Megatron-LM / -Core ``_copy_main_params_to_model_params``,
DeepSpeed's fp32 -> 16-bit partition copy, meshplan's runtime under ``meshplan-bf16``), the updated masters are
then written into the 16-bit weights: ``MASTER_COPY_BYTES`` = 6 (read 4, write 2) per parameter of the shard.
(The gradient buffer's zeroing after the step, 4 B per parameter of the replica under those layouts, is not
priced: < 0.1 % of their steps.)

**How a multi-tensor op launches** (``ATen/native/cuda/MultiTensorApply.cuh``): one CUDA block of 512
threads per chunk of 65,536 elements; a launch is issued when its blocks reach ``depth_to_max_blocks``
(320; 2,240 in builds against CUDA >= 13 in the 2.13 headers) or its tensors reach the depth's limit (110,
64, 48, 36, 30 tensors for 1-5 lists; 770 ... 210 there). gpt2-xl's 772 parameter tensors (24,488 chunks)
take 77 launches per multi-tensor op under the 320-block table (the H100's profiled step counted 77
fused-Adam kernels, torch 2.11+cu130) and 11 under the 2,240-block one (``multi_tensor_launches``). Each of
those kernels runs ~0.2 ms of device work against a few microseconds of launch, so the launches run while
the device is busy and are not priced; what the host does per parameter tensor is (below).

**Device time**: the bytes over ``mem_bw · mem_efficiency``. MEASURED on one H100 (torch 2.11, one
runtime step of ``bench_gpu.py --kernels`` under torch.profiler, CUPTI kernel times; no clipping there): the 77 fused-Adam kernels of gpt2-xl
(1.558 B parameters, 43.6 GB) took 16.44 ms, against 16.27 ms priced (+1.0 %): the multi-tensor kernel
reaches the memory efficiency every memory-bound kernel is priced at (0.79 of the datasheet, 0.88 of the
same call's 6.2 GB copy). The lower "fractions of a copy" ``benchmarks/optimizer_device.py`` printed for
its event-timed parts (fused Adam 0.68, foreach norm 0.38) counted the host's work inside the timing
(below), not slower kernels. Only the H100 has a kernel-level figure; on the H200 the kernels were not
timed alone, so the efficiency's transfer is not checked there.

**Host time**: per parameter tensor of the rank, Python and dispatch work that does not depend on the
tensor's size: Adam's ``_init_group`` (a Python loop appending p, its gradient, its two moments and its step
to lists; the state dict lookup), the grouping by device and dtype, the multi-tensor metadata; the norm's
per-tensor output and its ``.to(device)`` and ``stack`` input, the scale's metadata. Priced as
``tensors × ClusterSpec.host_optimizer_tensor_s``, a host property MEASURED like ``host_op_s``
(``benchmarks/host_overhead.py`` "optimizer" and ``meshplan profile`` on a GPU: the fused AdamW step and the
foreach clipping over 772 tiny tensors, host time, median of 7; ``profile.host.host_figures``); every GPU
preset carries the one host measured before (``hardware.HOST_H200``: 2.063 + 4.354 ms, 8.31 us per tensor).
The host of the H100 measured 4.287 + 3.711 ms (10.36 us per tensor, +25 %): the same ratio as their
per-op figures (``host_op_s`` 10.49 / 8.12 us, +29 %), about one dispatched op per tensor on both hosts
(0.99 and 1.02), so the preset's figure is off on another host as its ``host_op_s`` is, and a profile of
the host puts both right. The split between the step and the clipping does not transfer (step 0.53 / 0.33
of an op per tensor on the two hosts, clipping 0.46 / 0.69), so only their sum is priced. It is its own
figure, not a multiple of ``host_op_s``, so ``meshplan calibrate`` (which scales ``host_op_s``) does not move
it. A CPU cluster (0) prices no host term: there host and device are the same cores.

**How they compose** (``OPTIMIZER_SYNCS``, ``EngineProfile.optimizer_sync``):

- ``"host-wait"``: the host waits for the device inside the phase, so its per-tensor work runs with the
  device idle: **host + device**. Megatron-LM / Megatron-Core (``clip_grads.py get_grad_norm_fp32``:
  ``total_norm.item()``) and DeepSpeed (``stage_1_and_2.py``: ``overflow_gpu[0].item()``, the norm's
  ``.item()``) read on the host; their scale runs only when the norm exceeds the limit and can hide part
  of the step's Python, which is not priced (their per-rank tensor counts make the whole host term ~1 ms
  or less). Under fp16 every engine is here (``phase_sync``): a dynamic loss scaler reads its found-inf
  flag on the host before the update (torch's ``GradScaler.step``: ``found_inf.item()``; Megatron's
  ``_unscale_main_grads_and_check_for_nan``; DeepSpeed's overflow check).
- ``"async"``: no host read before the update (torchtitan reads the norm at logging steps, after the
  update; torch FSDP1's ``clip_grad_norm_`` under Composer clamps on the device; meshplan's runtime since
  #33's wave 3 stop 10: ``runtime/apply/optim.py`` sums the norm on the device and
  ``ParallelModel._optimizer_step`` reads it after the update is issued): the host's per-tensor work runs
  while the device clips and updates, **max(host, device)**. Before that fix meshplan's runtime was
  "host-wait" twice over: ``total_grad_norm``'s CPU accumulator ``.to(device)`` (a host-to-device copy
  that waited for the norm kernels) and ``clip_grad_norm``'s ``float(norm)`` after the scale.

MEASURED against the "host-wait" price (the runtime before the fix; ``benchmarks/optimizer_device.py``,
CUDA events, median of 7, gpt2-xl, torch 2.11+cu130): clipping + fused Adam 31.99 ms (one H100, 2026-11-27;
29.67 priced with the h100 preset, 31.25 with that host's own figure) and 33.48 ms (another H100,
2026-11-28, ``benchmarks/gpu_results/2026-11-28-h100/call1/optimizer.json``; 29.67 priced). That second
call also timed one clip+adam's CUDA kernels (CUPTI): fused Adam 16.38 ms (priced 16.27, +0.6 %), the
foreach scale 4.60 (4.65), the foreach norm 2.32 (2.33): the kernels run at ``mem_efficiency`` of the
datasheet; the lower "fractions of a copy" the event-timed parts print hold the host's work before the
first kernel, not slower kernels, so no per-kernel efficiency is added. The RunRecords' profiled
optimizer phases (28.9 ms H200, 36.4-50.8 ms H100) are steps run under ``torch.profiler`` (CPU activity:
every dispatched op recorded), 9-34 % slower than the same runs' timed steps as a whole, so they are not
this price's measure (BENCHMARKS.md "Wave 3 stop 10: the optimizer phase on an H100 (#33)").
No torch import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshplan.cost_models.hardware import ClusterSpec

OPTIMIZER_IMPLS = ("fused", "foreach")
#: optimizer update bytes per parameter of the rank's shard (fp32 states), by implementation
ADAM_UPDATE_BYTES = {"fused": 28.0, "foreach": 80.0}
SGD_UPDATE_BYTES = {"sgd": 12.0, "sgd-momentum": 20.0}
#: gradient-norm clipping bytes per gradient element: the foreach norm's read (``NORM_BYTES``) and the
#: foreach scale's read + write
NORM_BYTES = 4.0
CLIP_BYTES = 12.0

#: the updated fp32 master weights written into the 16-bit model weights, per parameter of the rank's shard
#: (read 4, write 2): Megatron ``_copy_main_params_to_model_params``, DeepSpeed's fp32 -> 16-bit partition copy,
#: meshplan's runtime under its 16-bit layout (``runtime/apply/master_state.py MasterState.step``: ``copy_``)
MASTER_COPY_BYTES = 6.0

#: how the host's work of the phase meets the device's (module docstring): "host-wait" adds them, "async"
#: overlaps them
OPTIMIZER_SYNCS = ("host-wait", "async")

#: multi_tensor_apply's chunk (elements per CUDA block) and launch limits (ATen/native/cuda/MultiTensorApply.cuh):
#: blocks per launch and tensors per launch by the number of lists (depth 1-5); the 320-block table is the
#: one torch 2.11+cu130 ran on the H100 (77 fused-Adam launches for gpt2-xl)
MTA_CHUNK = 65536
MTA_MAX_BLOCKS = 320
MTA_MAX_TENSORS = (110, 64, 48, 36, 30)


def phase_sync(sync: str, dtype: str) -> str:
    """How the phase composes for an engine whose profile says ``sync`` (``OPTIMIZER_SYNCS``) training in
    ``dtype``: "host-wait" under fp16, where the dynamic loss scaler reads its found-inf flag on the host
    before the update (module docstring), else ``sync``."""
    if sync not in OPTIMIZER_SYNCS:
        raise ValueError(f"optimizer_sync must be one of {', '.join(OPTIMIZER_SYNCS)}, got {sync!r}")
    return "host-wait" if dtype == "fp16" else sync


def multi_tensor_launches(numels: list[int], depth: int, *, max_blocks: int = MTA_MAX_BLOCKS,
                          max_tensors: tuple[int, ...] = MTA_MAX_TENSORS) -> int:
    """Kernel launches of one multi-tensor op over tensors of ``numels`` elements with ``depth`` lists, as
    ``multi_tensor_apply`` issues them: a launch when the blocks (one per chunk) or the tensors fill up."""
    if not 1 <= depth <= len(max_tensors):
        raise ValueError(f"depth must be 1..{len(max_tensors)}, got {depth!r}")
    launches = blocks = held = 0
    for numel in numels:
        if numel <= 0:
            continue
        held += 1
        chunks = math.ceil(numel / MTA_CHUNK)
        for chunk in range(chunks):
            blocks += 1
            last = chunk == chunks - 1
            if (held == max_tensors[depth - 1] and last) or blocks == max_blocks:
                launches, blocks = launches + 1, 0
                held = 0 if last else 1
    return launches + (1 if blocks else 0)


@dataclass(frozen=True)
class OptimizerPhase:
    """One optimizer step's seconds by part (module docstring): the update's kernels, the clipping's norm
    and scale kernels, the host's per-tensor work, and how they compose (``sync``)."""

    update_s: float
    norm_s: float
    scale_s: float
    host_s: float
    sync: str
    copy_s: float = 0.0

    @property
    def device_s(self) -> float:
        return self.update_s + self.norm_s + self.scale_s + self.copy_s

    @property
    def total_s(self) -> float:
        if self.sync == "host-wait":
            return self.device_s + self.host_s
        return max(self.device_s, self.host_s)


def optimizer_phase(
    params: float, cluster: ClusterSpec, *, impl: str = "fused", optimizer: str = "adam", clip: bool = True,
    tensors: float = 0.0, sync: str = "host-wait", master_copy: bool = False,
) -> OptimizerPhase:
    """The optimizer step over ``params`` parameters in ``tensors`` parameter tensors of the rank (its
    shard): the update (``ADAM_UPDATE_BYTES[impl]``, or ``SGD_UPDATE_BYTES`` for "sgd" / "sgd-momentum"),
    the clipping (``CLIP_BYTES``) when ``clip`` and the fp32 masters' copy into the 16-bit weights
    (``MASTER_COPY_BYTES``) when ``master_copy``, at ``mem_bw · mem_efficiency``; the host's per-tensor
    work at ``host_optimizer_tensor_s`` each; composed by ``sync`` (module docstring)."""
    if impl not in OPTIMIZER_IMPLS:
        raise ValueError(f"optimizer_impl must be one of {', '.join(OPTIMIZER_IMPLS)}, got {impl!r}")
    if sync not in OPTIMIZER_SYNCS:
        raise ValueError(f"optimizer_sync must be one of {', '.join(OPTIMIZER_SYNCS)}, got {sync!r}")
    if params < 0 or tensors < 0:
        raise ValueError(f"params and tensors must be >= 0, got {params!r}, {tensors!r}")
    bw = cluster.mem_bw_bytes_per_s * cluster.mem_efficiency
    per = SGD_UPDATE_BYTES.get(optimizer, ADAM_UPDATE_BYTES[impl])
    norm, scale = (NORM_BYTES, CLIP_BYTES - NORM_BYTES) if clip else (0.0, 0.0)
    host = tensors * cluster.host_optimizer_tensor_s if params else 0.0
    copy = params * MASTER_COPY_BYTES / bw if master_copy else 0.0
    return OptimizerPhase(params * per / bw, params * norm / bw, params * scale / bw, host, sync, copy)


def optimizer_step_s(
    params: float, cluster: ClusterSpec, *, impl: str = "fused", optimizer: str = "adam", clip: bool = True,
    tensors: float = 0.0, sync: str = "host-wait", master_copy: bool = False,
) -> float:
    """Seconds of one optimizer step (``optimizer_phase(...).total_s``); with ``tensors`` 0 or a cluster
    without a host figure (``host_optimizer_tensor_s`` 0), the kernels' memory-bound time alone."""
    return optimizer_phase(params, cluster, impl=impl, optimizer=optimizer, clip=clip, tensors=tensors,
                           sync=sync, master_copy=master_copy).total_s  # fmt: skip
