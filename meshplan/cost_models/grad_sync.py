"""Data-parallel gradient sync as the runtime executes it: buckets, and what of them stays exposed.

The runtime (``meshplan.runtime.apply.grad_sync`` for pipelined and manual data parallelism, DDP's own
reducer at pp = 1) packs gradients into buckets in backward order (the reverse of parameter
registration order) and all-reduces each bucket asynchronously as soon as its last gradient is
final in the last microbatch's backward, waiting only before the optimizer step. Both sides use
``bucket_indices`` so the predicted and the executed bucket counts are the same number.

Exposed time (``overlapped_sync_exposed_s``), unit seconds::

    ready_i  = B · (bytes of buckets 0..i) / (all bytes)    bucket i ready during the last backward B
    finish_i = max(finish_{i-1}, ready_i) + t_allreduce(bytes_i)   one collective at a time
    exposed  = max(0, finish_last - B)

(backward time is assumed to be spread over the gradients in proportion to their bytes; the
last bucket is ready only when the backward ends, so its all-reduce is always exposed).
Gradients are reduced in fp32 (``GRAD_REDUCE_BYTES``): parameters and their gradients stay
fp32 under autocast, and FSDP2 reduces with ``reduce_dtype=float32``. No torch import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

DEFAULT_BUCKET_CAP_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb = 25
GRAD_REDUCE_BYTES = 4  # fp32 gradient reduction on every precision
#: data-parallel wrappers a ddp configuration can be costed with: "torch" (bucketed, overlapped with
#: the last backward: torch DDP, meshplan's runtime) or "local" (``local_ddp_sync_s``)
DDP_IMPLS = ("torch", "local")
#: passes over the gradient buffer of Megatron-LM's local DDP besides the all-reduce: flatten
#: (read + write), divide by the world size (read + write), copy back (read + write)
LOCAL_DDP_GRAD_PASSES = 6


def local_ddp_sync_s(grad_bytes: float, allreduce_s: Callable[[float], float], mem_bw_bytes_per_s: float) -> float:
    """Seconds Megatron-LM's own data-parallel wrapper (``--DDP-impl local``, the default of its 2020
    ``megatron/arguments.py``; ``megatron/model/distributed.py``) adds after backward, none of it
    overlapped: ``_flatten_dense_tensors`` of the gradients (in the training dtype), ``/= world``,
    one ``all_reduce`` of the flat buffer, ``torch.cuda.synchronize()``, copy back::

        allreduce(grad_bytes) + LOCAL_DDP_GRAD_PASSES · grad_bytes / mem_bw
    """
    if grad_bytes <= 0:
        return 0.0
    return allreduce_s(grad_bytes) + LOCAL_DDP_GRAD_PASSES * grad_bytes / mem_bw_bytes_per_s


def bucket_indices(param_bytes: Sequence[int], cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES) -> list[list[int]]:
    """Greedy buckets over ``param_bytes`` (given in backward order): a bucket closes once it holds ``cap_bytes``."""
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be > 0 bytes, got {cap_bytes}")
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, b in enumerate(param_bytes):
        cur.append(i)
        size += b
        if size >= cap_bytes:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def uniform_bucket_bytes(total_bytes: float, cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES) -> list[float]:
    """Bucket sizes when only the total is known (planning): full buckets and one remainder."""
    return [b for b, k in uniform_bucket_runs(total_bytes, cap_bytes) for _ in range(k)]


def uniform_bucket_runs(total_bytes: float, cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES) -> list[tuple[float, int]]:
    """``uniform_bucket_bytes`` as runs of (bucket bytes, count): at most two runs, whatever the total."""
    if total_bytes <= 0:
        return []
    full = int(total_bytes // cap_bytes)
    rest = total_bytes - full * cap_bytes
    return ([(float(cap_bytes), full)] if full else []) + ([(rest, 1)] if rest > 0 else [])


def overlapped_sync_exposed_s(
    bucket_bytes: Sequence[float], backward_s: float, allreduce_s: Callable[[float], float]
) -> float:
    """Seconds of bucketed all-reduce left after the last microbatch's backward (formula above).

    The recurrence is summed per run of equal consecutive buckets (``overlapped_sync_exposed_runs``).
    """
    runs: list[tuple[float, int]] = []
    for b in bucket_bytes:
        if runs and runs[-1][0] == b:
            runs[-1] = (b, runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return overlapped_sync_exposed_runs(runs, backward_s, allreduce_s)


def overlapped_sync_exposed_runs(
    runs: Sequence[tuple[float, int]], backward_s: float, allreduce_s: Callable[[float], float]
) -> float:
    """``overlapped_sync_exposed_s`` of buckets given as runs of (bytes, count) (``overlapped_sync_terms``)."""
    return overlapped_sync_terms(runs, backward_s, allreduce_s)[0]


def overlapped_sync_terms(
    runs: Sequence[tuple[float, int]], backward_s: float, allreduce_s: Callable[[float], float]
) -> tuple[float, float]:
    """(exposed, hidden) seconds of the bucketed all-reduce: exposed as ``overlapped_sync_exposed_s``,
    hidden = the all-reduce time that ran under the backward (busy − exposed: once the backward
    ends every bucket is ready, so the collectives run back to back) — what NCCL's SMs take from
    the backward (``cost_models.contention``). Buckets given as runs of (bytes, count) of equal consecutive
    buckets (a 175B stage has thousands of 25 MiB buckets and one remainder: two runs, see
    ``uniform_bucket_runs``). Over q = 1..k equal buckets of t seconds each,
    ``finish_k = max(finish_0 + k·t, ready_1 + k·t, ready_k + t)`` (``ready_q + (k - q + 1)·t`` is
    linear in q, so its maximum is at an end), one ``allreduce_s`` call per run.
    """
    total = 0.0  # the buckets' sum, bit for bit as adding them one by one
    for b, k in runs:
        if total.is_integer() and float(b).is_integer() and total + b * k < 2**53:
            total += b * k  # whole numbers below 2**53: every partial sum is exact
        else:
            for _ in range(k):
                total += b
    if total <= 0:
        return 0.0, 0.0
    done = 0.0
    finish = 0.0
    busy = 0.0
    for b, k in runs:
        t = allreduce_s(b)
        busy += k * t
        first = backward_s * (done + b) / total
        done += k * b
        finish = max(finish + k * t, first + k * t, backward_s * done / total + t)
    exposed = max(0.0, finish - backward_s)
    return exposed, max(0.0, busy - exposed)
