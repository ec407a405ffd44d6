"""``meshplan profile``'s collective measurements and their fit: all-reduce and a send/recv
ping-pong across ``nproc`` spawned processes (``torch.multiprocessing.spawn``, ``tcp://127.0.0.1``
rendezvous; gloo, or nccl when there is a GPU per process) at sizes from ``min_bytes`` to
``max_bytes`` (``byte_sizes``), and the alpha-beta model of ``meshplan.cost_models.comm`` fitted
to them by least squares (``fit_alpha_beta``). torch is imported inside the measuring functions only.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from meshplan.profile.budget import Log, log_stderr


def byte_sizes(min_bytes: int, max_bytes: int) -> list[int]:
    """Powers of 4 from ``min_bytes`` up to ``max_bytes`` (both included), e.g. 4 KB … 64 MB."""
    if not 4 <= min_bytes <= max_bytes:
        raise ValueError(f"need 4 <= min_bytes <= max_bytes, got {min_bytes}, {max_bytes}")
    out, n = [], min_bytes
    while n < max_bytes:
        out.append(n)
        n *= 4
    out.append(max_bytes)
    return out


def fit_alpha_beta(points: Sequence[tuple[float, float]], kind: str, group_size: int) -> tuple[float, float]:
    """Fit ``t = c0 + c1·n`` to (bytes, seconds) points and map it to the ring model of
    ``meshplan.cost_models.comm``:

    - all_reduce: ``t = 2(k−1)·α + 2(k−1)/k · n/bw``  ->  α = c0/(2(k−1)), bw = 2(k−1)/(k·c1)
    - send_recv:  ``t = α + n/bw``                    ->  α = c0,         bw = 1/c1

    The slope ``c1`` is the least-squares slope over all points (the large, bandwidth-bound
    messages dominate it, as they dominate training traffic); the intercept ``c0`` is the median
    of ``t − c1·n`` over the smaller half of the sizes (the latency-bound ones), clamped at 0.
    Exact data is recovered exactly. Returns (α seconds, bw bytes/s). Raises ValueError with
    fewer than two distinct sizes or a non-positive slope.
    """
    if kind not in ("all_reduce", "send_recv"):
        raise ValueError(f"fit_alpha_beta: kind must be all_reduce or send_recv, got {kind!r}")
    pts = sorted((float(n), float(t)) for n, t in points if t > 0)
    if len({n for n, _ in pts}) < 2:
        raise ValueError("fit_alpha_beta needs timings at two or more sizes")
    mx = statistics.fmean(n for n, _ in pts)
    my = statistics.fmean(t for _, t in pts)
    sxx = sum((n - mx) ** 2 for n, _ in pts)
    c1 = sum((n - mx) * (t - my) for n, t in pts) / sxx
    if not c1 > 0:
        raise ValueError(
            f"fit_alpha_beta: time does not grow with size (slope {c1:.3g} s/B); measure larger sizes"
        )
    small = pts[: max(1, (len(pts) + 1) // 2)]
    c0 = max(0.0, statistics.median(t - c1 * n for n, t in small))
    k = group_size
    if kind == "all_reduce":
        return c0 / (2 * (k - 1)), 2 * (k - 1) / (k * c1)
    return c0, 1.0 / c1


def fit_or_bound(points: Sequence[tuple[float, float]], kind: str, k: int, log: Log) -> tuple[float, float]:
    """``fit_alpha_beta``, or when noise hides the slope (tiny sizes on a busy machine) the bounds
    it implies: α from the smallest size alone, bandwidth from the largest size alone."""
    try:
        return fit_alpha_beta(points, kind, k)
    except ValueError as e:
        log(f"{kind}: {e}; using the smallest size for latency and the largest for bandwidth")
    (_, t0), (n1, t1) = min(points), max(points)
    if kind == "all_reduce":
        return t0 / (2 * (k - 1)), 2 * (k - 1) / k * n1 / t1
    return t0, n1 / t1


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a spawned process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _collective_worker(
    rank: int, world: int, init_method: str, backend: str, sizes: list[int], reps: int, out_path: str,
    wall_deadline: float | None = None, tp_host_reps: int = 0,
) -> None:
    """One spawned rank: time all_reduce and a send/recv ping-pong at each size, then with
    ``tp_host_reps`` > 0 tensor parallelism's DTensor host time (``profile.tp_host.measure_tp_host``,
    in the same process group: no second spawn); rank 0 writes JSON."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        res: dict[str, list[tuple[int, float]]] = {"all_reduce": [], "send_recv": []}
        warm = torch.ones(max(1, sizes[-1] // 4), device=device)
        for _ in range(3):  # the first collectives set up connections and buffers
            dist.all_reduce(warm)
        # smallest and largest first: if the budget cuts the sweep, the alpha-beta fit still spans it
        order = [sizes[0], sizes[-1], *sizes[1:-1]] if len(sizes) > 2 else list(sizes)
        for k, nbytes in enumerate(order):
            go = torch.ones(1, device=device)  # rank 0 decides for all: every rank runs the same collectives
            if rank == 0 and wall_deadline is not None and k >= 2 and time.time() > wall_deadline:
                go.zero_()
            dist.broadcast(go, 0)
            if not go.item():
                if rank == 0:
                    log_stderr(f"collectives from {nbytes / 1024:.0f} KiB skipped (budget)")
                break
            x = torch.ones(max(1, nbytes // 4), device=device)
            times = []
            for i in range(reps + 1):
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                dist.all_reduce(x)
                sync()
                if i:
                    times.append(time.perf_counter() - t0)
            res["all_reduce"].append((x.numel() * 4, statistics.median(times)))
            times = []
            for i in range(reps + 1):
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(x, 1)
                    dist.recv(x, 1)
                elif rank == 1:
                    dist.recv(x, 0)
                    dist.send(x, 0)
                sync()
                if i:
                    times.append((time.perf_counter() - t0) / 2)  # half a round trip
            res["send_recv"].append((x.numel() * 4, statistics.median(times)))
            if rank == 0:
                log_stderr(
                    f"collectives at {nbytes / 1024:.0f} KiB: all_reduce {res['all_reduce'][-1][1] * 1e3:.3f} ms, "
                    f"send_recv {res['send_recv'][-1][1] * 1e3:.3f} ms"
                )
        tp: dict[str, float] = {}
        if tp_host_reps > 0:
            from meshplan.profile.tp_host import measure_tp_host

            tp = measure_tp_host(tp_host_reps)
        if rank == 0:
            Path(out_path).write_text(json.dumps({**{k: sorted(v) for k, v in res.items()}, **({"tp_host": tp} if tp else {})}))
    finally:
        dist.destroy_process_group()


def measure_collectives(
    nproc: int, sizes: list[int], reps: int, backend: str, log: Log = log_stderr, wall_deadline: float | None = None
) -> dict[str, list[tuple[int, float]]]:
    """(bytes, seconds) of all_reduce and send/recv across ``nproc`` spawned processes."""
    return measure_collectives_and_tp_host(nproc, sizes, reps, backend, log, wall_deadline)[0]


def measure_collectives_and_tp_host(
    nproc: int, sizes: list[int], reps: int, backend: str, log: Log = log_stderr, wall_deadline: float | None = None,
    tp_host_reps: int = 0,
) -> tuple[dict[str, list[tuple[int, float]]], dict[str, float]]:
    """``measure_collectives``, and with ``tp_host_reps`` > 0 (gloo) ``profile.tp_host.measure_tp_host``'s
    timings on the same spawned ranks ({} otherwise)."""
    import torch.multiprocessing as mp

    if nproc < 2:
        raise ValueError(f"nproc must be >= 2 to measure collectives, got {nproc}")
    init = f"tcp://127.0.0.1:{free_port()}"
    log(f"spawning {nproc} processes ({backend}, {init}) for {len(sizes)} sizes x {reps} reps")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "collectives.json")
        mp.spawn(_collective_worker, args=(nproc, init, backend, sizes, reps, out, wall_deadline, tp_host_reps),
                 nprocs=nproc, join=True)  # fmt: skip
        raw = json.loads(Path(out).read_text())
    tp = {k: float(v) for k, v in raw.pop("tp_host", {}).items()}
    return {k: [(int(n), float(t)) for n, t in v] for k, v in raw.items()}, tp
