"""Speed mechanisms of the search that must not change a result: gradient buckets as runs
(``grad_sync.overlapped_sync_exposed_runs``) equal the bucket-by-bucket recurrence bit for bit."""

from __future__ import annotations

import random

from meshplan.cost_models.grad_sync import (
    overlapped_sync_exposed_runs,
    overlapped_sync_exposed_s,
    uniform_bucket_bytes,
    uniform_bucket_runs,
)


def _reference(bucket_bytes: list[float], backward_s: float, allreduce_s) -> float:
    """The recurrence of grad_sync's docstring, one bucket at a time."""
    total = float(sum(bucket_bytes))
    if total <= 0:
        return 0.0
    done = finish = 0.0
    for b in bucket_bytes:
        done += b
        finish = max(finish, backward_s * done / total) + allreduce_s(b)
    return max(0.0, finish - backward_s)


def test_bucket_runs_equal_buckets_bit_for_bit() -> None:
    rng = random.Random(3)
    for _ in range(300):
        total = rng.choice([rng.uniform(1, 400) * 2**20, rng.uniform(1, 5e4) * 2**20, float(rng.randint(1, 9) * 25 * 2**20)])
        backward = rng.uniform(0.001, 2.0)
        bw, lat = rng.uniform(1e9, 5e11), rng.uniform(0, 1e-4)

        def ar(b: float, lat: float = lat, bw: float = bw) -> float:
            return lat + b / bw

        buckets = uniform_bucket_bytes(total)
        runs = uniform_bucket_runs(total)
        assert [b for b, k in runs for _ in range(k)] == buckets and len(runs) <= 2
        assert overlapped_sync_exposed_runs(runs, backward, ar) == overlapped_sync_exposed_s(buckets, backward, ar)
        if len(buckets) < 50:  # the closed form per run against one bucket at a time (within rounding)
            assert abs(overlapped_sync_exposed_s(buckets, backward, ar) - _reference(buckets, backward, ar)) <= 1e-9
