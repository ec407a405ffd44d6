"""DeepSpeed v0.3.x ZeRO-3, module by module: what a step's collectives overlap between two device-wide syncs.

DeepSpeed's ZeRO-3 of 2021 (tags v0.3.13 and v0.3.14, the same in every function named here; the ZeRO-3 of
Megatron-LM SC'21 Table 2, arXiv 2104.04473 of April 2021; read at
v0.3.14, commit 0cd9abf) gathers one parameter tensor at a time and synchronizes the whole device
before every module that owns a gathered tensor runs (``deepspeed/runtime/zero/stage3.py``):

- ``fetch_sub_module`` (l. 357-411), from the module's pre-forward / pre-backward hook, ends in
  ``_synchronize_communication`` (l. 483-493): ``handle.wait()``, ``comm_stream.synchronize()`` and
  ``torch.cuda.synchronize()`` whenever the module's parameters were in flight or had to be gathered;
- only then ``prefetch_next_sub_modules`` (l. 312-334) issues the next gather, and only when no
  gather is in flight; ``PrefetchCoordinator.get_params_to_prefetch`` (l. 188-219) returns once the
  tensors it picked hold ``stage3_prefetch_bucket_size`` elements (``zero/constants.py`` l. 94:
  5e7, below every weight the persistence threshold lets through at these sizes): the next tensor
  in the module trace, no further;
- the gradient buckets are all-reduced on the same data-parallel communicator, hence NCCL stream, as
  the gathers (``reduce_ipg_grads`` l. 1695 -> ``allreduce_bucket`` l. 1800), one bucket when the next
  gradient overflows ``reduce_bucket_size`` (5e8 elements): each weight of 1.5e8 elements or more is
  reduced while the module before it (in backward order) is back-propagated.

So a pass over the model is a chain of intervals, one per gathered tensor ``i``: the device runs
module ``i``'s compute (to the next gathered module) while NCCL runs the next tensor's gather
(+ in backward the previous tensor's all-reduce), and the next sync waits for both::

    interval_i = max(C_i, comm_i)        exposed_i = max(0, comm_i − C_i)

with ``C_i`` the pass's compute times module ``i``'s share of it (``DSTensor``), not the block-level
``max(Σ C, Σ comm)`` of an FSDP2 unit. Gathers no prefetch issues (``stage3_max_live_parameters``,
``dp_kinds.unprefetched_share``) are not in ``comm_i``: they run when their module needs them.

Under full recompute a tensor is not gathered again for its backward when its reuse distance is
below ``stage3_max_reuse_distance`` (1e9 elements, ``zero/constants.py`` l. 91): ``release_sub_module``
(l. 413-453) keeps it (``_keep_for_later`` l. 464-470), the distance being the elements of the
modules the trace runs between its recomputed forward and its backward
(``get_reuse_distance_in_numel`` / ``_distance_in_numel``, l. 222-273): those after it in its block,
once re-run and once back-propagated (``kept_for_backward``). No torch import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshplan.cost_models.contention import overlap_slowdown_s
from meshplan.cost_models.hardware import ClusterSpec

#: a per-tensor ZeRO-3 keeps a tensor gathered from its recomputed forward to its backward when fewer
#: than this many elements are used in between (DeepSpeed ``stage3_max_reuse_distance`` default 1e9)
ZERO3_MAX_REUSE_NUMEL = 1_000_000_000
#: a per-tensor ZeRO-3 prefetches the next module's parameters only while fewer than this many
#: elements are gathered (DeepSpeed ``stage3_max_live_parameters``, ``zero/constants.py`` default 1e9;
#: ``stage3.py`` ``prefetch_next_sub_modules``)
ZERO3_MAX_LIVE_NUMEL = 1_000_000_000


@dataclass(frozen=True)
class DSTensor:
    """One gathered parameter tensor in forward order: its elements (whole, before tensor
    parallelism), the shares of the model's forward and backward seconds its module runs from its
    own sync to the next gathered module's (the interval's compute), and the repeated-block instance
    it belongs to (None outside the blocks)."""

    numel: float
    fwd_share: float
    bwd_share: float
    block: str | None = None


def ds2021_tensors(nodes: Sequence, gathered: Callable[[object], float], seconds: Callable[[object], tuple[float, float]],
                   ) -> tuple[DSTensor, ...]:
    """The gathered tensors of a graph's ``nodes`` (topological order): ``gathered(n)`` is the
    elements node ``n`` gathers (0 for none: persistent, parameterless, or fused into another node),
    ``seconds(n)`` its (forward, backward) seconds at any one microbatch size. The compute of the nodes
    before the first gathered tensor belongs to the last (the step is cyclic). () without gathered
    tensors."""
    numel: list[float] = []
    fwd: list[float] = []
    bwd: list[float] = []
    block: list[str | None] = []
    lead_f = lead_b = 0.0
    for n in nodes:
        f, b = seconds(n)
        k = gathered(n)
        if k > 0:
            numel.append(float(k))
            fwd.append(0.0)
            bwd.append(0.0)
            block.append(getattr(n, "block", None))
        if numel:
            fwd[-1] += f
            bwd[-1] += b
        else:
            lead_f += f
            lead_b += b
    if not numel:
        return ()
    fwd[-1] += lead_f
    bwd[-1] += lead_b
    tf, tb = sum(fwd) or 1.0, sum(bwd) or 1.0
    return tuple(DSTensor(numel[i], fwd[i] / tf, bwd[i] / tb, block[i]) for i in range(len(numel)))


def kept_for_backward(tensors: Sequence[DSTensor], *, tp: int = 1, max_reuse: float = ZERO3_MAX_REUSE_NUMEL) -> list[bool]:
    """Per tensor, whether full recompute leaves it gathered from its recomputed forward to its
    backward (module docstring): a block's tensor whose later tensors in that block, re-run and then
    back-propagated (twice their elements at the tp shard), hold fewer than ``max_reuse`` elements."""
    out = []
    for i, x in enumerate(tensors):
        after = 0.0
        for y in tensors[i + 1:]:
            if y.block != x.block or x.block is None:
                break
            after += y.numel / tp
        out.append(x.block is not None and 2.0 * after < max_reuse)
    return out


def ds2021_intervals(tensors: Sequence[DSTensor], gather_s: Sequence[float], reduce_s: Sequence[float], *,
                     tp: int = 1, recompute: bool = False, max_live: float = ZERO3_MAX_LIVE_NUMEL,
                     ) -> tuple[tuple[tuple[float, float, float, float], ...], tuple[int, ...]]:
    """One microbatch's intervals in trace order (module docstring) and the tensor of each gather it runs.

    The trace: the forward over ``tensors``; then, block by block from the last, the block's
    recomputed forward (full ``recompute``) and its backward in reverse (a tensor outside the blocks:
    its backward alone). Each use of a tensor needs its gather, except a backward use of a tensor
    ``kept_for_backward``; a use that needs one syncs the device and starts an interval, the others
    run inside the interval before them. An interval is ``(forward share, recompute share, backward
    share, NCCL seconds)``: the compute shares (``DSTensor``) of the uses it runs and what its sync
    waits for on the communicator: the next needed gather (``gather_s``) when the use that opens the
    interval lets a prefetch issue it (its tensor, at the tp shard, below ``max_live`` elements),
    and in backward ``reduce_s`` of the tensor back-propagated before (bucketed when the next gradient
    arrives). A gather no prefetch issues is an interval of its own with no compute (exposed); so is
    the last all-reduce (``independent_gradient_partition_epilogue`` after the backward), and so is the
    step's first gather (the trace ends with the backward: nothing prefetches the next forward).
    Unit: seconds."""
    n = len(tensors)
    if not n:
        return (), ()
    kept = kept_for_backward(tensors, tp=tp) if recompute else [False] * n
    uses: list[tuple[int, str]] = [(i, "f") for i in range(n)]
    i = n - 1
    while i >= 0:  # backward phase, block by block from the last
        blk = tensors[i].block
        j = i
        while blk is not None and j > 0 and tensors[j - 1].block == blk:
            j -= 1
        if recompute and blk is not None:
            uses += [(k, "r") for k in range(j, i + 1)]
        uses += [(k, "b") for k in range(i, j - 1, -1)]
        i = j - 1
    needs = [not (p == "b" and kept[t]) for t, p in uses]
    out: list[list[float]] = []
    gathers: list[int] = []
    pending_reduce = -1  # the tensor whose gradient bucket waits for the next gradient
    for u, (t, p) in enumerate(uses):
        if needs[u]:
            gathers.append(t)
            prev_opener = out[-1] if out else None
            prefetched = bool(prev_opener) and prev_opener[4] >= 0 and tensors[int(prev_opener[4])].numel / tp < max_live
            if prefetched and prev_opener is not None:
                prev_opener[3] += gather_s[t]
            else:
                out.append([0.0, 0.0, 0.0, gather_s[t], -1.0])  # gathered when its module needs it
            out.append([0.0, 0.0, 0.0, 0.0, float(t)])
        cur = out[-1]
        share = tensors[t].fwd_share if p in ("f", "r") else tensors[t].bwd_share
        cur["frb".index(p)] += share
        if p == "b":
            if pending_reduce >= 0:
                cur[3] += reduce_s[pending_reduce]
            pending_reduce = t
    if pending_reduce >= 0:
        out.append([0.0, 0.0, 0.0, reduce_s[pending_reduce], -1.0])
    return tuple((a, b, c, d) for a, b, c, d, _ in out), tuple(gathers)


def ds2021_exposed_s(intervals: Sequence[tuple[float, float, float, float]], *, forward_s: float, recompute_s: float,
                     backward_s: float, cluster: ClusterSpec | None = None) -> float:
    """Seconds of one microbatch's collectives its ``intervals`` (``ds2021_intervals``) expose against
    the microbatch's forward, recompute and backward (without recompute) seconds:
    ``Σ_i max(0, comm_i − C_i)``, ``C_i`` the interval's compute; with ``cluster`` the hidden rest as
    ``dp_exposure.exposed_dp_s`` prices it (only ``comm_overlap`` of it hidden, NCCL's SMs taken from
    the compute it overlaps, ``contention.overlap_slowdown_s``). Unit: seconds."""
    w = (max(0.0, forward_s), max(0.0, recompute_s), max(0.0, backward_s))
    comm = exposed = 0.0
    for f, r, b, c in intervals:
        comm += c
        exposed += max(0.0, c - (f * w[0] + r * w[1] + b * w[2]))
    h = max(0.0, comm - exposed)
    phi = cluster.comm_overlap if cluster is not None else 1.0
    slow = overlap_slowdown_s(phi * h, sum(w), cluster) if cluster is not None else 0.0
    return exposed + (1.0 - phi) * h + slow


__all__ = ["ZERO3_MAX_LIVE_NUMEL", "ZERO3_MAX_REUSE_NUMEL", "DSTensor", "ds2021_exposed_s", "ds2021_intervals", "ds2021_tensors",
           "kept_for_backward"]
