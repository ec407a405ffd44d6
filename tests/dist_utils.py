"""Multi-process test helpers (gloo, CPU): spawn N ranks once, run a worker, collect results.

``run_ranks(worker, world_size, *args)`` starts ``world_size`` processes with
``torch.multiprocessing`` (spawn), each joining a gloo process group at ``tcp://127.0.0.1:PORT``
with a timeout, calls ``worker(rank, world_size, *args)`` and returns the workers' return values
in rank order. A worker that raises makes ``run_ranks`` raise with that rank's traceback; a hang
is killed after ``timeout_s``. One thread per process (2 cores are shared by everyone).
Keep all ``torch.testing._internal``-style plumbing in this one module.
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world_size: int, port: int, worker: Callable, args: tuple, queue: Any, pg_timeout_s: float) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["RANK"] = str(rank)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        out = worker(rank, world_size, *args)
        queue.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_ranks(
    worker: Callable, world_size: int, *args: Any, timeout_s: float = 240.0, pg_timeout_s: float = 60.0
) -> list[Any]:
    """Run ``worker(rank, world_size, *args)`` on ``world_size`` spawned ranks; results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, worker, args, queue, pg_timeout_s), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    import time

    deadline = time.monotonic() + timeout_s
    while len(results) + len(errors) < world_size and time.monotonic() < deadline:
        if not queue.empty():
            rank, ok, val = queue.get()
            (results if ok else errors)[rank] = val
            if errors:
                break
        else:
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
            time.sleep(0.05)
    for p in procs:
        p.join(timeout=5 if not errors else 1)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    if errors:
        r = min(errors)
        raise AssertionError(f"rank {r} failed:\n{errors[r]}")
    if len(results) < world_size:
        raise AssertionError(f"timed out after {timeout_s}s; ranks done: {sorted(results)}")
    return [results[r] for r in range(world_size)]
