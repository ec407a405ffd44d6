"""Data-parallel kinds: what each keeps per rank and which collectives it runs per step.

Kinds (``meshplan.plan.DP_KINDS``) and their ZeRO stage over the sharding group of S ranks::

    none    dp = 1                                         stage 0
    ddp     replicated states, all-reduce of gradients     stage 0
    zero1   optimizer states sharded (Megatron's           stage 1   S = dp
            --use-distributed-optimizer)
    zero2   + gradients sharded                            stage 2   S = dp
    fsdp    + parameters sharded (ZeRO-3, FSDP2)           stage 3   S = dp
    hsdp    fsdp inside a node, replicated across nodes    stage 3   S = the dp group's ranks in
            (FSDP2 HSDP: dp_replicate × dp_shard)                    one node (``hsdp_shard_degree``)

Memory per rank is ``cost_models.memory.model_state_bytes(zero=stage, dp=S)`` (Rajbhandari et al.
2020, §5). Collectives (n_g gradient bytes, n_p parameter bytes of the rank's share, each over
the DP group laid out as ``comm.group_layout`` says; m microbatches)::

    ddp     per step    all_reduce(n_g)                          gradient accumulation without sync
    zero1   per step    reduce_scatter(n_g) + all_gather(n_p)    Megatron distributed optimizer
    zero2   FSDP2 with reshard_after_forward=False: pp = 1: per microbatch all_gather(n_p) in
            forward (kept to backward) + reduce_scatter(n_g); pp > 1: as fsdp
    fsdp    pp = 1: per microbatch all_gather(n_p) in forward and again in backward (FSDP2
            reshard_after_forward=True) + reduce_scatter(n_g), each prefetched one unit ahead so
            only what compute cannot hide is exposed (the runtime syncs every microbatch);
            pp > 1: per step all_gather(n_p) + reduce_scatter(n_g) (torchtitan and
            torch.distributed.pipelining: reshard_after_forward=False, gradient sync only in
            the last microbatch's backward), at the cost of the stage's unsharded parameters and
            fp32 accumulated gradients held during the step
    hsdp    the fsdp collectives over the S ranks of a node, plus all_reduce(n_g / S) over the
            dp / S replicas (one rank per node) with each reduce-scatter

How a ZeRO-3 engine runs those collectives (``ZERO3_IMPLS``, an engine profile's ``zero3_impl``):
"fsdp2" as above; "deepspeed-2021" as DeepSpeed v0.3.13-0.3.16 (March-May 2021, the ZeRO-3 of
Megatron-LM SC'21 Table 2) runs them at pp = 1 (``deepspeed_2021_fsdp``)::

    per microbatch  T · all_gather(n_p / T) in forward, again in a full-recompute re-run, again in
                    backward, + T · all_reduce(n_p / T) of the 16-bit gradients

one collective per parameter tensor (T tensors above ``stage3_param_persistence_threshold``),
each paying its own ring latency; given the tensors (``layout``), module by module between the
device-wide syncs (``cost_models.ds2021_intervals``: what each module's compute hides, the tensors
full recompute keeps gathered for their backward). Sources (DeepSpeed at tag v0.3.14): ``runtime/zero/stage3.py``
``pre_sub_module_forward_function`` -> ``fetch_sub_module`` on every forward call of a submodule
(a checkpointed layer's re-run included) and ``release_sub_module`` after it;
``partition_parameters.py`` ``_allgather_param``: one ``torch.distributed.all_gather`` per
parameter; ``zero/constants.py`` ``ZERO3_OPTIMIZATION_CONTIGUOUS_GRADIENTS_DEFAULT = False`` ->
``reduce_ipg_grads`` -> ``buffered_reduce_fallback`` -> ``allreduce_bucket``: ``dist.all_reduce``
of the flattened 16-bit gradients (not a reduce-scatter).

Each gather also costs host time the device waits for (``ds2021_gather_host_s``), exposed: the
prefetch of the next parameter is issued from a submodule's pre-forward hook after a device-wide
``torch.cuda.synchronize()`` (``stage3.py`` ``fetch_sub_module`` -> ``_synchronize_communication``)
and before that submodule's own kernels are launched, so the device has nothing queued while it
runs. ``_allgather_param`` builds the flat tensor with ``torch.zeros`` (the parameter's bytes
written), synchronizes again, and builds the output list in Python, one ``flat_tensor.narrow``
per rank (``for i in range(self.world_size)``): ``dp`` ops on the host per gather, each at the
measured per-op host cost ``ClusterSpec.host_op_s``. Torch's list-form ``all_gather`` (ProcessGroupNCCL
``allgather``: flatten, one ``ncclAllGather``, then one ``copy_`` per output tensor on the NCCL stream)
adds ``dp`` copy kernels to each gather (``ds2021_copy_back_s``: each ``max(kernel_floor_s, 2 · chunk
/ memory bandwidth)``), counted in the gather's time. Not counted (so a lower bound): the host time of
launching those copies from C++ and the ``torch.distributed.get_rank`` call per loop iteration.

How zero1 runs (``ZERO1_IMPLS``, an engine profile's ``zero1_impl``): "bucketed" (Megatron's
distributed optimizer, DeepSpeed ZeRO-1): the collectives above, on flat buckets. "torch"
(meshplan's runtime: ``torch.distributed.optim.ZeroRedundancyOptimizer`` over DDP,
``parameters_as_bucket_view=False``): DDP's bucketed all-reduce of the gradients (overlapped with
backward, as ddp) and, after the update, one ``broadcast`` per parameter tensor from the rank that
owns it, every rank of the group taking part in each, all waited for before the step ends
(``zero1_broadcast_s``; torch ``zero_redundancy_optimizer.py`` ``_sync_params`` ->
``_broadcast_params_from_rank``): as many collective latencies as the stage has parameter tensors.

Sources: ZeRO (Rajbhandari et al. 2020); Megatron-LM distributed optimizer docs; PyTorch FSDP2
``fully_shard`` docs (reshard_after_forward, HSDP); torchtitan ``parallelize`` (PP + FSDP). No torch
import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from meshplan.cost_models.comm import group_collective_s
from meshplan.cost_models.ds2021_intervals import ZERO3_MAX_LIVE_NUMEL, DSTensor, ds2021_intervals
from meshplan.cost_models.grad_sync import GRAD_REDUCE_BYTES
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.cost_models.memory import ModelStateBytes, model_state_bytes

#: ZeRO stage of each data-parallel kind over its sharding group
ZERO_STAGE: dict[str, int] = {"none": 0, "ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3, "hsdp": 3}
#: kinds in order of how much they save (and move): the planner's upgrade path
KIND_ORDER: tuple[str, ...] = ("ddp", "zero1", "zero2", "hsdp", "fsdp")


#: what a parameter-sharding kind gathers at once (``unsharded_buffer_bytes``'s largest unit):
#: "block" = FSDP2 / FSDP1 wrapped per repeated block + the root (meshplan's runtime, torchtitan's
#: apply_fsdp up to 2025-07, llm-foundry): a whole block and the prefetched next one, the root (every
#: layer outside the blocks) gathered for the whole step; "block-ends" = the same, the embedding and
#: the final norm + head each their own unit (torchtitan from 83e6941); both priced step by step
#: without a pipeline (``fsdp_units.fsdp_step_peak``); "module" = DeepSpeed ZeRO-3,
#: which gathers each leaf module's own parameters in its pre-forward hook
#: (``deepspeed/runtime/zero/parameter_offload.py``) with a prefetch bounded by
#: ``stage3_prefetch_bucket_size``: the largest module (linear) and the next one
FSDP_UNITS: tuple[str, ...] = ("block", "block-ends", "module")

#: how a ZeRO-3 engine runs its collectives (module docstring): "fsdp2" (FSDP2 / FSDP1 / llm-foundry /
#: modern DeepSpeed: one gather per unit, reduce-scatter) or "deepspeed-2021" (``deepspeed_2021_fsdp``)
ZERO3_IMPLS: tuple[str, ...] = ("fsdp2", "deepspeed-2021")
#: how a zero1 engine communicates (module docstring): flat buckets, or torch's ZeroRedundancyOptimizer
ZERO1_IMPLS: tuple[str, ...] = ("bucketed", "torch")
#: parameter tensors below this many elements stay whole on every rank under a per-tensor ZeRO-3
#: (DeepSpeed ``stage3_param_persistence_threshold``, ``zero/constants.py`` default 100,000)
ZERO3_PERSISTENCE_NUMEL = 100_000


def unprefetched_share(sizes: list[float], max_live: float = ZERO3_MAX_LIVE_NUMEL) -> float:
    """Share of the elements a per-tensor ZeRO-3 gathers (``sizes``: each gathered tensor's
    elements on this rank, in forward order, the step cyclic) whose gather no prefetch issues:
    DeepSpeed v0.3.x's ``prefetch_next_sub_modules`` runs in a module's pre-forward hook, after
    the previous module's parameters were released, and prefetches the next tensor only while
    the live elements (this module's) are below ``stage3_max_live_parameters``; so tensor j is
    gathered when needed iff tensor j − 1 holds ``max_live`` elements or more. 0 without tensors.
    """
    total = sum(sizes)
    if not total:
        return 0.0
    return sum(s for prev, s in zip(sizes[-1:] + sizes[:-1], sizes) if prev >= max_live) / total

#: whose model-state layout a configuration is costed with (``state_precision``)
STATE_LAYOUTS: tuple[str, ...] = ("torch", "megatron", "zero")
#: the dtype of the gradient buffer a 16-bit run's backward accumulates into and data parallelism
#: reduces (``state_precision``'s ``main_grads``): "fp32" (Megatron-LM's ``main_grad`` under
#: --accumulate-allreduce-grads-in-fp32, Megatron-Core ``grad_reduce_in_fp32``, apex
#: DistributedFusedAdam ``grad_sync_dtype`` fp32) or "16-bit" (the parameters' own dtype)
MAIN_GRADS: tuple[str, ...] = ("fp32", "16-bit")


def state_precision(layout: str, dtype: str, main_grads: str | None = None) -> str:
    """The ``memory.PRECISIONS`` row of the model states an engine keeps when training in ``dtype``.

    - "torch" (meshplan's runtime, torchtitan's FSDP2): parameters and optimizer states stay fp32
      on every path, the compute dtype only in autocast / FSDP2's gathered copies
      (``runtime/apply/precision.py``; ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``):
      "fp32" (4, 4, 0): ddp 16, zero1 8 + 8/d, zero2 16/d (+ its gathered copy,
      ``state_zero_stage``), fsdp 16/d bytes per parameter;
    - "megatron" (Megatron-LM, Megatron-DeepSpeed): bf16/fp8 "bf16-fp32-grads" (18, 6 + 12/d),
      fp16 "fp16-fp32-master-grads" (20, 4 + 16/d), fp32 "fp32" (16, 8 + 8/d): the README's
      distributed-optimizer table;
    - "zero" (the ZeRO paper's accounting, Rajbhandari et al. 2020 §3): 16-bit weights and
      gradients + fp32 master copy, "bf16-mixed" (16, 4 + 12/d); fp32 "fp32".

    ``main_grads`` (``MAIN_GRADS``; None = the layout's own rule above, which for "megatron" is
    Megatron-LM's arguments.py: fp32 accumulation forced under --bf16, the fp16 buffer + the
    optimizer's fp32 copies under --fp16) is what a recipe sets for the gradient buffer of a 16-bit
    run on a "megatron" or "zero" layout: "fp32" -> "bf16-fp32-grads" (2 + 4 + 12: the fp32 buffer
    is the optimizer's gradient, no copy), "16-bit" -> "bf16-mixed" (2 + 2 + 12) in bf16 / fp8 and,
    under fp16 on "megatron", Megatron's fp16 buffer + fp32 copies. The "torch" layout keeps fp32.
    """
    if layout not in STATE_LAYOUTS:
        raise ValueError(f"state layout {layout!r} unknown; use one of {STATE_LAYOUTS}")
    if main_grads is not None and main_grads not in MAIN_GRADS:
        raise ValueError(f"main_grads {main_grads!r} unknown; use None or one of {MAIN_GRADS}")
    if dtype in ("fp32", "float32") or layout == "torch":
        return "fp32"
    if main_grads == "fp32":
        return "bf16-fp32-grads"
    if layout == "megatron" and dtype == "fp16":
        return "fp16-fp32-master-grads"
    if layout == "megatron" and main_grads is None:
        return "bf16-fp32-grads"
    return "bf16-mixed"


def main_grad_bytes(layout: str, dtype: str, main_grads: str | None = None) -> int:
    """Bytes of one element of the gradient a weight-gradient GEMM accumulates into, by the state
    layout and the recipe's gradient dtype (``state_precision``): 2 where that is "bf16-mixed"
    (16-bit gradients: DeepSpeed; Megatron-Bridge's recipes, ``ddp.grad_reduce_in_fp32 = False`` ->
    Megatron-Core ``distributed_data_parallel.py`` ``grad_dtype = param.dtype``), else 4 (fp32
    ``main_grad``: Megatron-LM / -Core's default ``--accumulate-allreduce-grads-in-fp32`` for bf16;
    torch's fp32 parameters)."""
    return 2 if state_precision(layout, dtype, main_grads) == "bf16-mixed" else 4


def _check_kind(kind: str) -> None:
    if kind not in ZERO_STAGE:
        raise ValueError(f"dp_kind {kind!r} unknown; use one of {tuple(ZERO_STAGE)}")


def hsdp_shard_degree(dp: int, stride: int, devices_per_node: int) -> int:
    """Ranks of one DP group (``dp`` ranks ``stride`` apart) that share a node: HSDP's shard group,
    ``gcd(dp, devices_per_node // stride)``.

    E.g. dp = 64 over (dp, tp) = (64, 2) on 8-GPU nodes: 4 (shard inside the node, 16 replicas).
    """
    return math.gcd(dp, max(1, devices_per_node // stride))  # as the runtime builds it (Plan.hsdp_shard_degree)


def shard_degree(kind: str, dp: int, *, stride: int = 1, devices_per_node: int = 8) -> int:
    """Ranks the model states are sharded over: 1 (none, ddp), dp (zero1/2, fsdp), or the
    node-local part of the DP group (hsdp)."""
    _check_kind(kind)
    if ZERO_STAGE[kind] == 0 or dp == 1:
        return 1
    if kind == "hsdp":
        return hsdp_shard_degree(dp, stride, devices_per_node)
    return dp


def dp_state_bytes(
    param_count: float,
    kind: str,
    dp: int,
    *,
    stride: int = 1,
    devices_per_node: int = 8,
    optimizer: str = "adam",
    precision: str = "bf16-mixed",
    layout: str = "zero",
) -> ModelStateBytes:
    """Parameter, gradient and optimizer bytes per rank under ``kind``: ``model_state_bytes``
    with the kind's ZeRO stage (``state_zero_stage`` under ``layout``) over ``shard_degree``.
    Unit: bytes. Source: ZeRO §5."""
    s = shard_degree(kind, dp, stride=stride, devices_per_node=devices_per_node)
    z = state_zero_stage(kind, layout)
    return model_state_bytes(param_count, optimizer=optimizer, precision=precision, zero=z, dp=s)


def state_zero_stage(kind: str, layout: str = "zero") -> int:
    """The ZeRO stage ``kind``'s stored states are sharded at: ``ZERO_STAGE``, except zero2 under
    the "torch" layout, which meshplan's runtime runs as FSDP2 with ``reshard_after_forward=False``
    (``runtime/apply/data_parallel.py``): its fp32 parameters are sharded too (stage 3), and the
    gathered 16-bit copy it keeps from forward to backward is ``unsharded_buffer_bytes``."""
    _check_kind(kind)
    if kind == "zero2" and layout == "torch":
        return 3
    return ZERO_STAGE[kind]


@dataclass(frozen=True)
class DPComm:
    """Seconds of one rank's data-parallel collectives, before overlap with compute.

    ``sync_s``: gradient reduction once per step (overlaps the last microbatch's backward);
    ``gather_s``: parameter all-gather once per step (overlaps the next step's first forward);
    ``per_microbatch_s``: collectives repeated every microbatch (overlap that microbatch's
    compute, prefetched one layer ahead); ``bytes``: per step, by collective kind. For FSDP2 kinds
    at pp = 1 also its split: ``mb_forward_s`` (forward all-gathers), ``mb_bwd_gather_s``
    (backward all-gathers; the rest of ``per_microbatch_s`` is reduce-scatters and hsdp's
    all-reduce) over ``units`` FSDP units (one per repeated block + the root), each gathered one
    unit ahead of its compute. ``mb_serial_s``: per microbatch, gathers no prefetch issues ahead
    (DeepSpeed 2021 refuses to prefetch while ``stage3_max_live_parameters`` are live): each runs
    when its module needs it, exposed whatever the compute (not in ``per_microbatch_s``).
    """

    sync_s: float = 0.0
    gather_s: float = 0.0
    per_microbatch_s: float = 0.0
    bytes: dict[str, int] = field(default_factory=dict)
    mb_forward_s: float = 0.0
    mb_bwd_gather_s: float = 0.0
    units: int = 1
    mb_serial_s: float = 0.0
    #: DeepSpeed 2021 given its gathered tensors (``deepspeed_2021_fsdp(layout=)``): one microbatch's
    #: intervals between device-wide syncs, (forward, recompute, backward share, NCCL seconds) each
    #: (``ds2021_intervals``); exposed by ``ds2021_exposed_s`` in place of the unit formula
    intervals: tuple[tuple[float, float, float, float], ...] = ()


def dp_comm(
    kind: str,
    grad_bytes: float,
    param_bytes: float,
    dp: int,
    cluster: ClusterSpec,
    *,
    stride: int = 1,
    pp: int = 1,
    num_microbatches: int = 1,
    units: int = 1,
    impl: str = "fsdp2",
    recompute_regather: bool = False,
    tensors: int = 1,
    unprefetched: float = 0.0,
    layout: tuple[DSTensor, ...] = (),
) -> DPComm:
    """The collectives of ``kind`` (module docstring) for a rank holding ``grad_bytes`` of
    gradients and ``param_bytes`` of parameters (unsharded sizes), its DP group of ``dp`` ranks
    ``stride`` apart (the product of the inner mesh axes), costed by ``comm.group_collective_s``
    with the group's layout (nodes × ranks per node). ``impl`` (``ZERO3_IMPLS``) says how a fsdp
    kind runs at pp = 1; "deepspeed-2021" takes ``recompute_regather`` (full recompute re-runs
    the forward, which gathers again), ``tensors`` (parameter tensors gathered one by one) and
    ``unprefetched`` (``unprefetched_share``), or ``layout`` (its gathered tensors one by one,
    ``deepspeed_2021_fsdp``). Unit: seconds and bytes."""
    _check_kind(kind)
    if impl not in ZERO3_IMPLS:
        raise ValueError(f"zero3 impl {impl!r} unknown; use one of {ZERO3_IMPLS}")
    if dp == 1 or kind == "none":
        return DPComm()
    dpn = cluster.devices_per_node
    m = num_microbatches

    def t(coll: str, n: float, k: int, st: int) -> float:
        return group_collective_s(coll, n, k, cluster, stride=st)

    if kind == "ddp":
        return DPComm(sync_s=t("all_reduce", grad_bytes, dp, stride), bytes={"all_reduce": int(grad_bytes)})
    if kind == "zero1":
        return DPComm(
            sync_s=t("reduce_scatter", grad_bytes, dp, stride), gather_s=t("all_gather", param_bytes, dp, stride),
            bytes={"reduce_scatter": int(grad_bytes), "all_gather": int(param_bytes)},
        )  # fmt: skip
    if kind == "fsdp" and pp == 1 and impl == "deepspeed-2021":
        return deepspeed_2021_fsdp(param_bytes, dp, cluster, stride=stride, num_microbatches=m, units=units,
                                   recompute_regather=recompute_regather, tensors=tensors,
                                   unprefetched=unprefetched, layout=layout, tp=stride)  # fmt: skip
    # zero2, fsdp, hsdp: FSDP2 over the S-rank shard group (+ hsdp's all-reduce across replicas)
    s = shard_degree(kind, dp, stride=stride, devices_per_node=dpn)
    ag, rs = t("all_gather", param_bytes, s, stride), t("reduce_scatter", grad_bytes, s, stride)
    rep = dp // s if kind == "hsdp" else 1
    ar = t("all_reduce", grad_bytes / s, rep, stride * s) if rep > 1 else 0.0
    gathers = 1 if kind == "zero2" else 2  # zero2: reshard_after_forward=False, no backward re-gather
    n = 1 if pp > 1 else m  # under PP once per step, else every microbatch
    out = {"all_gather": int(param_bytes * (1 if pp > 1 else gathers) * n), "reduce_scatter": int(grad_bytes * n)}
    if ar:
        out["all_reduce"] = int(grad_bytes / s * n)
    if pp > 1:
        return DPComm(sync_s=rs + ar, gather_s=ag, bytes=out)
    return DPComm(per_microbatch_s=gathers * ag + rs + ar, mb_forward_s=ag, mb_bwd_gather_s=ag if gathers == 2 else 0.0,
                  units=max(1, units), bytes=out)  # fmt: skip


def deepspeed_2021_fsdp(
    param_bytes: float,
    dp: int,
    cluster: ClusterSpec,
    *,
    stride: int = 1,
    num_microbatches: int = 1,
    units: int = 1,
    recompute_regather: bool = False,
    tensors: int = 1,
    unprefetched: float = 0.0,
    layout: tuple[DSTensor, ...] = (),
    tp: int = 1,
) -> DPComm:
    """DeepSpeed v0.3.x ZeRO-3's collectives at pp = 1 (module docstring) for a rank whose
    16-bit parameters are ``param_bytes`` unsharded, over ``dp`` ranks ``stride`` apart.

    Per microbatch: ``tensors`` all-gathers of ``param_bytes / tensors`` in forward, again in the
    backward's re-run of a fully recomputed layer (``recompute_regather``), again in backward,
    and ``tensors`` all-reduces of the 16-bit gradients (ZeRO-3's default without contiguous
    gradients). Each collective is costed by ``comm.group_collective_s`` (so each pays its ring
    latency over the group). The backward gathers (re-run and backward) and the all-reduces are
    backward's share (``mb_bwd_gather_s``: the gathers). The share ``unprefetched`` of every
    gather (``unprefetched_share``) runs only when its module needs it: ``mb_serial_s``, exposed;
    so is each pass's host work between a device-wide sync and the next launch
    (``ds2021_gather_host_s``). Unit: seconds and bytes.

    With ``layout`` (the gathered tensors in forward order, ``ds2021_intervals.DSTensor``; ``tp`` the
    shard their elements are held at) the same collectives tensor by tensor, each its own size
    (``param_bytes`` split in proportion to the elements), in the intervals between the device-wide
    syncs of ``stage3.py`` (``ds2021_intervals``): ``DPComm.intervals``, the prefetch rule and the
    tensors full recompute keeps gathered for their backward included (``tensors`` and
    ``unprefetched`` unused); each all-reduce with its bucket's copies on the reduction stream
    (``allreduce_and_copy``: flatten, ``div_``, the copy back, 6 × its bytes at the memory
    bandwidth); ``mb_serial_s`` the host work of the gathers the intervals run. ``tp`` is the
    shard the tensors' elements are held at (the DP group's stride at pp = 1).
    """
    if layout:
        return _ds2021_layout(param_bytes, dp, cluster, stride=stride, num_microbatches=num_microbatches,
                              units=units, recompute=recompute_regather, layout=layout, tp=tp)
    tensors = max(1, int(tensors))
    m = num_microbatches

    def t(coll: str, n: float) -> float:
        return tensors * group_collective_s(coll, n / tensors, dp, cluster, stride=stride)

    ag = t("all_gather", param_bytes) + ds2021_copy_back_s(param_bytes, tensors, dp, cluster)
    ar = t("all_reduce", param_bytes)
    bwd_gathers = 2 if recompute_regather else 1
    u = min(1.0, max(0.0, unprefetched))
    out = {"all_gather": int(param_bytes * (1 + bwd_gathers) * m), "all_reduce": int(param_bytes * m)}
    hid = ag * (1.0 - u)  # one pass's gathers issued ahead of their module
    host = ds2021_gather_host_s(param_bytes, tensors, dp, cluster)  # one pass's, with the device idle
    return DPComm(per_microbatch_s=(1 + bwd_gathers) * hid + ar, mb_forward_s=hid, mb_bwd_gather_s=bwd_gathers * hid,
                  units=max(1, units), bytes=out, mb_serial_s=(1 + bwd_gathers) * (ag * u + host))  # fmt: skip


def _ds2021_layout(param_bytes: float, dp: int, cluster: ClusterSpec, *, stride: int, num_microbatches: int,
                   units: int, recompute: bool, layout: tuple[DSTensor, ...], tp: int) -> DPComm:
    """``deepspeed_2021_fsdp`` tensor by tensor (its ``layout`` paragraph)."""
    total = sum(x.numel for x in layout) or 1.0
    nb = [param_bytes * x.numel / total for x in layout]
    gather = [group_collective_s("all_gather", b, dp, cluster, stride=stride) + ds2021_copy_back_s(b, 1, dp, cluster)
              for b in nb]  # fmt: skip
    # each bucket's all-reduce between its copies on the reduction stream (stage3.py allreduce_and_copy ->
    # allreduce_bucket: flatten, div_, all_reduce, then copy_ back into every gradient): 6 x its bytes of HBM
    bw = cluster.mem_bw_bytes_per_s * cluster.mem_efficiency
    reduce = [group_collective_s("all_reduce", b, dp, cluster, stride=stride) + (6.0 * b / bw if bw > 0 else 0.0)
              for b in nb]  # fmt: skip
    intervals, gathered = ds2021_intervals(layout, gather, reduce, tp=tp, recompute=recompute)
    m = num_microbatches
    n_fwd = len(layout)  # the forward's gathers come first in the trace
    host = sum(ds2021_gather_host_s(nb[i], 1, dp, cluster) for i in gathered)
    out = {"all_gather": int(sum(nb[i] for i in gathered) * m), "all_reduce": int(param_bytes * m)}
    return DPComm(per_microbatch_s=sum(c for *_, c in intervals), mb_forward_s=sum(gather[i] for i in gathered[:n_fwd]),
                  mb_bwd_gather_s=sum(gather[i] for i in gathered[n_fwd:]), units=max(1, units), bytes=out,
                  mb_serial_s=host, intervals=intervals)  # fmt: skip


def ds2021_copy_back_s(param_bytes: float, tensors: int, dp: int, cluster: ClusterSpec) -> float:
    """Seconds of the copies torch's list-form ``all_gather`` runs after each of ``tensors`` gathers
    (module docstring): ``dp`` kernels per tensor, each moving its chunk (``param_bytes / tensors /
    dp``) out of the flat output, ``tensors · dp · max(kernel_floor_s, 2 · chunk / (mem_bw · mem_eff))``.
    0 at dp = 1. Unit: seconds."""
    if dp <= 1 or tensors <= 0 or param_bytes <= 0:
        return 0.0
    bw = cluster.mem_bw_bytes_per_s * cluster.mem_efficiency
    chunk = param_bytes / tensors / dp
    return tensors * dp * max(cluster.kernel_floor_s, 2.0 * chunk / bw if bw > 0 else 0.0)


def ds2021_gather_host_s(param_bytes: float, tensors: int, dp: int, cluster: ClusterSpec) -> float:
    """Seconds one pass of DeepSpeed v0.3.14's per-parameter gathers keeps the device idle (module
    docstring): per gathered tensor, ``dp`` host ops building the all-gather's output list
    (``flat_tensor.narrow`` per rank) at ``cluster.host_op_s`` each, and the ``torch.zeros`` of the
    flat tensor (``param_bytes / tensors`` written, then ``torch.cuda.synchronize()``) at the
    cluster's effective memory bandwidth: ``tensors · dp · host_op_s + param_bytes / (mem_bw · mem_eff)``.
    0 at dp = 1 (nothing gathered). Unit: seconds."""
    if dp <= 1 or tensors <= 0 or param_bytes <= 0:
        return 0.0
    bw = cluster.mem_bw_bytes_per_s * cluster.mem_efficiency
    return tensors * dp * cluster.host_op_s + (param_bytes / bw if bw > 0 else 0.0)


def zero1_broadcast_s(param_bytes: float, tensors: float, dp: int, cluster: ClusterSpec, *, stride: int = 1) -> float:
    """Seconds of torch ZeroRedundancyOptimizer's parameter sync (``ZERO1_IMPLS`` "torch"): after the
    update each of the stage's ``tensors`` parameter tensors (``param_bytes`` in all, in the training
    dtype) is broadcast from its owner over the dp group (``dp`` ranks ``stride`` apart), one collective
    each: ``tensors · broadcast(param_bytes / tensors)``, i.e. the bytes once plus one collective
    latency per tensor. 0 at dp = 1. Unit: seconds."""
    if dp <= 1 or tensors <= 0 or param_bytes <= 0:
        return 0.0
    return tensors * group_collective_s("broadcast", param_bytes / tensors, dp, cluster, stride=stride)


def unsharded_buffer_bytes(
    kind: str, dp: int, *, stage_param_count: float, largest_layer_params: float, elem_bytes: int, pp: int = 1,
    layout: str = "zero", gathered_bytes: float | None = None, grad_params: float | None = None,
    largest_gathered_bytes: float | None = None,
) -> float:
    """Bytes a sharded kind holds unsharded beyond its sharded states.

    fsdp/hsdp at pp = 1: two layers' parameters (the one computing and the one prefetched).
    fsdp/hsdp at pp > 1 (reshard_after_forward=False, gradient sync in the last microbatch
    only): the stage's parameters and its unreduced gradients, which FSDP2 accumulates in its
    fp32 reduce dtype (``to_accumulated_grad_if_needed``): ``stage params · (elem_bytes + 4)``.
    zero2: its parameters stay whole (counted in its states); under PP its unreduced fp32
    gradients, ``stage params · 4``. zero2 under the "torch" layout (FSDP2 with
    ``reshard_after_forward=False``, ``state_zero_stage``): its sharded states count as fsdp's,
    and it holds the stage's gathered parameters, ``stage params · elem_bytes`` at pp = 1 (as
    fsdp under PP). Others: 0. Where the gathered parameters are not ``elem_bytes`` each or not all
    have gradients (QLoRA: NF4 bases gathered as stored, adapters the only gradients):
    ``gathered_bytes`` (the stage's), ``largest_gathered_bytes`` (the largest layer's) and
    ``grad_params`` replace ``stage_param_count · elem_bytes``, ``largest_layer_params · elem_bytes``
    and ``stage_param_count`` in the gradient terms. Unit: bytes. Source: PyTorch FSDP2
    ``fully_shard`` docs and ``_fsdp_param.py``; torch.distributed.pipelining's no-sync backward.
    """
    _check_kind(kind)
    if ZERO_STAGE[kind] < 2 or dp == 1:
        return 0.0
    gathered = stage_param_count * elem_bytes if gathered_bytes is None else gathered_bytes
    grads = (stage_param_count if grad_params is None else grad_params) * GRAD_REDUCE_BYTES
    if kind == "zero2" and layout == "torch":
        return gathered + (grads if pp > 1 else 0.0)
    if pp > 1:
        return (0.0 if kind == "zero2" else gathered) + grads
    if kind == "zero2":
        return 0.0
    return 2.0 * (largest_layer_params * elem_bytes if largest_gathered_bytes is None else largest_gathered_bytes)
