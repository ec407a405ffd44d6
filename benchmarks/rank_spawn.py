"""Shared by the per-rank memory benchmarks (bench_meta_build, bench_step_memory): the model's fp32
bytes with #28's bound (half of them plus 1.2 GiB), and spawning ``ranks`` processes that each run
``target(rank, ranks, port, args, queue)`` and put one row (a dict with "rank") on the queue."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree

GIB = 2**30


def model_bytes_and_bound(model: str) -> tuple[int, float]:
    """(fp32 bytes of ``model``'s parameters, built on meta; #28's bound in GiB: half of them + 1.2)."""
    from meshplan.models import load_model

    n = sum(p.numel() * 4 for p in load_model(model, device="meta").model.parameters())
    return n, n / 2 / GIB + 1.2


def spawn_rows(target: Callable[..., None], ranks: int, args: Any) -> list[dict[str, Any]]:
    """Run ``target`` on ``ranks`` spawned processes (a free local port for their rendezvous); the
    rows of the ranks that exited cleanly, by rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    procs = [ctx.Process(target=target, args=(r, ranks, port, args, q)) for r in range(ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return sorted((q.get() for _ in range(sum(p.exitcode == 0 for p in procs))), key=lambda r: r["rank"])
