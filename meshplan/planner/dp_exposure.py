"""Data-parallel communication as a step sees it: ``exposed_dp_s`` (the seconds of a DP kind's
collectives that compute does not hide) and ``kind_note`` (why ``evaluate_auto`` replaced DDP by
another kind, in numbers). Used by ``planner.evaluate``. No torch import.
"""

from __future__ import annotations

from typing import Any

from meshplan.cost_models.contention import overlap_slowdown_s
from meshplan.cost_models.ds2021_intervals import ds2021_exposed_s
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.planner.search_types import Evaluation


def exposed_dp_s(d: Any, *, backward_s: float, forward_s: float, microbatch_s: float, num_microbatches: int,
                 cluster: ClusterSpec | None = None, recompute_s: float = 0.0) -> float:
    """Seconds of data-parallel communication ``d`` (a ``dp_kinds.DPComm``) compute does not hide::

        max(0.1·sync, sync − B) + max(0.1·gather, gather − F) + m·E_mb

    the gradient reduction overlaps the last microbatch's backward B (DDP buckets, Megatron
    --overlap-grad-reduce), the once-per-step parameter all-gather the first forward F
    (--overlap-param-gather, FSDP prefetch); at least a tenth of each stays exposed (the last
    bucket, the first layer's gather). Per-microbatch collectives (FSDP at pp = 1) as FSDP2 runs
    them over L units (``d.units``), each unit's all-gather prefetched one unit ahead of its
    compute and its reduce-scatter issued when its backward ends (ag, ag_b, rs: one microbatch's
    forward gathers, backward gathers (0 for zero2) and reduce-scatters + hsdp all-reduces;
    F, B its forward and backward)::

        E_mb = ag/L + (L−1)/L · max(0, ag − F)                   forward: the first unit waits
             + ag_b/L + (L−1)/L · max(0, ag_b + rs − B) + rs/L    backward: first gather, last reduce

    (``units`` 1 or no split: ``max(0, per_mb − T_mb)`` per microbatch + ``0.1·per_mb``), plus
    ``m·d.mb_serial_s``: gathers issued only when their module runs (no prefetch), hidden by nothing.
    With ``cluster``, every hidden part (a collective's time minus its exposed share) also costs
    the compute it overlaps what NCCL's SMs take from it (``contention.overlap_slowdown_s``:
    the sync and backward gathers/reduce-scatters against B, the gathers against F), and only the
    share ``cluster.comm_overlap`` (φ) of it is hidden: the rest, (1 − φ)·(comm − exposed), is exposed.
    Unit: seconds. Source: PyTorch FSDP2 ``fully_shard`` (implicit forward prefetch, backward
    prefetch of one unit, reduce-scatter in its own stream).

    DeepSpeed 2021's ZeRO-3 given its tensors (``d.intervals``): ``m·ds2021_exposed_s`` of the
    intervals between its device-wide syncs, against the microbatch's forward, its recompute
    (``recompute_s``, inside ``backward_s``) and the rest of its backward, in place of the unit
    formula, plus ``m·d.mb_serial_s`` (cost_models.ds2021_intervals).
    """
    out = 0.0

    phi = cluster.comm_overlap if cluster is not None else 1.0

    def cost(comm: float, exposed: float, compute: float) -> float:
        """Exposed seconds + what the hidden rest costs: (1 − φ) of it is not hidden after all,
        the φ that is takes NCCL's SMs from the compute."""
        h = max(0.0, comm - exposed)
        slow = overlap_slowdown_s(phi * h, compute, cluster) if cluster is not None else 0.0
        return exposed + (1.0 - phi) * h + slow

    out += num_microbatches * d.mb_serial_s
    if getattr(d, "intervals", ()):
        return out + num_microbatches * ds2021_exposed_s(
            d.intervals, forward_s=forward_s, recompute_s=min(recompute_s, backward_s),
            backward_s=max(0.0, backward_s - recompute_s), cluster=cluster)
    if d.sync_s:
        out += cost(d.sync_s, max(0.1 * d.sync_s, d.sync_s - backward_s), backward_s)
    if d.gather_s:
        out += cost(d.gather_s, max(0.1 * d.gather_s, d.gather_s - forward_s), forward_s)
    if d.per_microbatch_s and d.units > 1 and d.mb_forward_s:
        L, ag_f, ag_b = d.units, d.mb_forward_s, d.mb_bwd_gather_s
        bwd = d.per_microbatch_s - ag_f  # backward gathers + reduce-scatters (+ hsdp all-reduce)
        rs = bwd - ag_b
        e_f = ag_f / L + (L - 1) / L * max(0.0, ag_f - forward_s)
        e_b = ag_b / L + (L - 1) / L * max(0.0, bwd - backward_s) + rs / L
        out += num_microbatches * (cost(ag_f, e_f, forward_s) + cost(bwd, e_b, backward_s))
    elif d.per_microbatch_s:
        e = max(0.0, d.per_microbatch_s - microbatch_s)
        out += num_microbatches * cost(d.per_microbatch_s, e, microbatch_s) + 0.1 * d.per_microbatch_s
    return out


def kind_note(chosen: Evaluation, ddp: Evaluation) -> str:
    """Why ``chosen``'s data-parallel kind replaced DDP (``ddp``, the default), in numbers."""
    gib = 1024**3
    k = chosen.config.dp_kind
    if not ddp.fits:
        return (f"{k} chosen because ddp does not fit: {ddp.max_mem_bytes / gib:.1f} GiB > "
                f"{ddp.mem_limit_bytes / gib:.1f} GiB per device")  # fmt: skip
    return (f"{k} chosen over ddp (which fits, {ddp.max_mem_bytes / gib:.1f} GiB): {chosen.step_s:.4g} s vs "
            f"{ddp.step_s:.4g} s per step (bound), {chosen.max_mem_bytes / gib:.1f} GiB per device")  # fmt: skip
