"""Planning every (cluster kind, GPU count) of a capacity question: which sizes, and the searches.

``sweep_sizes`` turns a GPU range into the sizes worth planning: 2^k and 3·2^k GPUs inside the
range (plus its ends), each a whole number of nodes (or a power-of-two part of one node), that
leave every data-parallel replica a model-parallel share the planner can fill (some dp dividing the
global batch with GPUs / dp ≤ devices per node × layers, tp·pp at most). A listed set of counts is
planned as given.

``plan_points`` runs ``planner.api.plan_graph`` on one traced graph for each (kind, size), with a
``PlanMemo`` per process so every size of a kind reuses the kind's costing (TP placements, cost
tables); with ``jobs`` > 1 the searches run in that many forked worker processes (the graph is
inherited, not copied), each with its own memo, results in task order; each worker plans its own
cluster kinds' sizes first and then takes what the others left (``worker_order``), so a kind's
sizes share one memo where the work allows. The first time a worker has nothing left to take
while another still plans (a CPU is idle until the sweep ends), the parent runs ``when_idle``
once (``meshplan capacity``: ``report.plot.warm_up``, the picture's imports and caches, work it
would do after the sweep). A size where no plan fits gives a point with the reason. The sweep
runs with fewer cyclic-GC passes (``fewer_collections``: CPU, not results), each search with the
collector off and one pass after it (``one_pass_per_search``). No torch import.
"""

from __future__ import annotations

import gc
import math
import multiprocessing
import queue
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from meshplan.errors import NoFeasiblePlanError
from meshplan.graph import ModelGraph
from meshplan.sizing.parse import GpuCounts

GIB = 2**30
#: Allocations between two young-generation collections of CPython's cyclic GC during the sweep
#: (default 700): the searches make millions of short-lived objects whose refcounts free them, and
#: each collection also walks the long-lived memos and cost tables; with the default the collector
#: took about a quarter of the sweep's CPU (llama3-70b x 3 kinds x 12 sizes, BENCHMARKS.md)
SWEEP_GC_THRESHOLD = 50_000


@dataclass(frozen=True)
class SweepPoint:
    """What planning one cluster kind at one size gave (predicted, per training step)."""

    cluster: str
    gpus: int
    plan: str = ""  # Plan.summary(); "" when nothing fits
    step_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    peak_mem_gib: float = 0.0
    seconds: float = 0.0  # wall time of the search
    error: str = ""


def _candidates(lo: int, hi: int) -> list[int]:
    out = {lo, hi}
    k = 1
    while k <= hi:
        for n in (k, 3 * k):
            if lo <= n <= hi:
                out.add(n)
        k *= 2
    return sorted(out)


def sweep_sizes(counts: GpuCounts, *, devices_per_node: int, batch_seqs: int,
                num_layers: int) -> tuple[list[int], list[str]]:
    """(sizes to plan, one line per size left out and why); see the module docstring."""
    if not counts.is_range:
        return list(counts.sizes), []
    sizes, skipped = [], []
    max_mp = devices_per_node * max(1, num_layers)
    for n in _candidates(counts.lo, counts.hi):
        if n > devices_per_node and n % devices_per_node:
            skipped.append(f"{n}: not a whole number of {devices_per_node}-GPU nodes")
        elif n < devices_per_node and devices_per_node % n:
            skipped.append(f"{n}: does not divide a {devices_per_node}-GPU node")
        elif n // math.gcd(n, batch_seqs) > max_mp:
            skipped.append(f"{n}: the global batch of {batch_seqs} sequences gives at most {math.gcd(n, batch_seqs)} "
                           f"data-parallel replicas, {n // math.gcd(n, batch_seqs)} GPUs each (over tp·pp ≤ {max_mp})")
        else:
            sizes.append(n)
    return sizes, skipped


def plan_point(graph: ModelGraph, kind: str, gpus: int, global_batch: int, memo: Any, **plan_kw: Any) -> SweepPoint:
    """The best plan of ``graph`` on ``gpus`` devices of ``kind`` (``plan_graph`` with ``memo``)."""
    from meshplan.planner.api import plan_graph

    t0 = time.perf_counter()
    try:
        p = plan_graph(graph, gpus, cluster=kind, global_batch_size=global_batch, memo=memo, **plan_kw)
    except (NoFeasiblePlanError, ValueError) as e:
        return SweepPoint(kind, gpus, seconds=time.perf_counter() - t0, error=str(e).split("; ")[0])
    pr = p.predicted
    return SweepPoint(kind, gpus, plan=p.summary(), step_s=pr.step_s, tokens_per_s=pr.tokens_per_s, mfu=pr.mfu,
                      peak_mem_gib=max(pr.peak_mem_bytes, default=0) / GIB, seconds=time.perf_counter() - t0)


def worker_order(tasks: Sequence[tuple[str, int]], worker: int, jobs: int) -> list[int]:
    """The order in which worker ``worker`` of ``jobs`` looks for a task not yet taken: first the
    tasks of its own cluster kinds (kind k belongs to worker k mod jobs; in task order), then the
    others' from their ends (the largest sizes last planned by their owner). Every size of a kind
    then runs in one process where the work allows, on one ``PlanMemo`` (its costing and the
    searches' shared memos built once per kind, not once per worker); no result depends on it."""
    kinds = list(dict.fromkeys(kind for kind, _ in tasks))
    mine = {k for j, k in enumerate(kinds) if j % jobs == worker}
    own = [i for i, (kind, _) in enumerate(tasks) if kind in mine]
    rest = [i for i, (kind, _) in enumerate(tasks) if kind not in mine]
    return own + rest[::-1]


def _worker(graph: ModelGraph, order: list[int], tasks: Sequence[tuple[str, int]], taken: Any, results: Any,
            global_batch: int, plan_kw: dict[str, Any]) -> None:
    from meshplan.planner.api import PlanMemo

    memo = PlanMemo()
    while True:
        with taken.get_lock():  # the first task in this worker's order that no worker took yet
            i = next((i for i in order if not taken[i]), None)
            if i is None:
                return
            taken[i] = 1
        kind, n = tasks[i]
        try:
            with one_pass_per_search():
                point = plan_point(graph, kind, n, global_batch, memo, **plan_kw)
            results.put((i, point))
        except Exception as e:  # an unexpected failure is reported on its row, not as a hang
            results.put((i, SweepPoint(kind, n, error=f"planning failed: {type(e).__name__}: {e}")))


@contextmanager
def one_pass_per_search() -> Iterator[None]:
    """Around one search of the sweep: the cyclic GC off while it runs, then one pass over the
    young generation (every object the search made and still holds is young: its cyclic garbage,
    such as a search's closures and their evaluations, is freed there) and what survives it (the
    memo's new entries, kept by the next searches) frozen out of later passes (``gc.freeze``; the
    sweep's ``fewer_collections`` unfreezes at its end). Each object is then walked once instead
    of at every collection while the search runs: llama3-70b x 12 h100 sizes in one process took
    43.9 s CPU with the sweep's thresholds alone, 37.3 s with the collector off (and 277 MiB more
    peak memory), BENCHMARKS.md. Used inside ``fewer_collections`` (which unfreezes). Changes no result."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect(0)
        gc.freeze()
        if was:
            gc.enable()


@contextmanager
def fewer_collections() -> Iterator[None]:
    """Around the sweep: what exists before it (the graph, imports) is frozen out of the cyclic
    GC's walks (``gc.freeze``; forked workers inherit it) and the young generation is collected
    every ``SWEEP_GC_THRESHOLD`` allocations; both restored after. Changes no result."""
    old = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(SWEEP_GC_THRESHOLD, old[1], old[2])
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


def plan_points(graph: ModelGraph, tasks: Sequence[tuple[str, int]], global_batch: int, *, jobs: int = 1,
                progress: Callable[[str], None] | None = None, when_idle: Callable[[], None] | None = None,
                **plan_kw: Any) -> list[SweepPoint]:
    """One ``SweepPoint`` per (kind, gpus) task, in task order (see the module docstring)."""
    with fewer_collections():
        return _plan_points(graph, tasks, global_batch, jobs=jobs, progress=progress, when_idle=when_idle,
                            **plan_kw)


def _plan_points(graph: ModelGraph, tasks: Sequence[tuple[str, int]], global_batch: int, *, jobs: int,
                 progress: Callable[[str], None] | None, when_idle: Callable[[], None] | None,
                 **plan_kw: Any) -> list[SweepPoint]:
    say = progress or (lambda _m: None)
    n_tasks = len(tasks)

    def report(done: int, p: SweepPoint) -> None:
        what = p.plan or f"no plan ({p.error})"
        say(f"[{done}/{n_tasks}] {p.cluster} x {p.gpus}: {what} ({p.seconds:.1f} s)")

    jobs = max(1, min(jobs, n_tasks))
    if jobs == 1 or "fork" not in multiprocessing.get_all_start_methods():
        from meshplan.planner.api import PlanMemo

        memo = PlanMemo()
        out = []
        for kind, n in tasks:
            with one_pass_per_search():
                out.append(plan_point(graph, kind, n, global_batch, memo, **plan_kw))
            report(len(out), out[-1])
        return out
    ctx = multiprocessing.get_context("fork")
    result_q = ctx.Queue()
    taken = ctx.Array("b", n_tasks)  # 1 once a worker took the task (under its lock)
    tasks = list(tasks)
    procs = [ctx.Process(target=_worker, args=(graph, worker_order(tasks, w, jobs), tasks, taken, result_q,
                                               global_batch, plan_kw), daemon=True)
             for w in range(jobs)]  # fmt: skip
    for p in procs:
        p.start()
    got: dict[int, SweepPoint] = {}
    try:
        while len(got) < n_tasks:
            if when_idle is not None and any(p.exitcode == 0 for p in procs):  # a worker is done, a CPU free
                when_idle, idle = None, when_idle
                try:
                    idle()
                except Exception as e:  # it only prepares later work: the sweep goes on, the later work redoes it
                    say(f"(preparing while a CPU was idle failed: {type(e).__name__}: {e})")
            try:
                i, point = result_q.get(timeout=1.0)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    codes = ", ".join(str(p.exitcode) for p in procs)
                    raise RuntimeError(f"the planning workers exited (codes {codes}) with {n_tasks - len(got)} "
                                       "sizes unplanned; rerun with --jobs 1") from None
                continue
            got[i] = point
            report(len(got), point)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    return [got[i] for i in range(n_tasks)]


__all__ = ["SWEEP_GC_THRESHOLD", "SweepPoint", "fewer_collections", "one_pass_per_search", "plan_point", "plan_points", "sweep_sizes", "worker_order"]
