"""Room on this node for the ranks a launch starts: checked by ``meshplan run`` before torchrun.

- **CUDA visible**: one rank per GPU (NCCL refuses two ranks on one device), so a node starting more
  ranks than it sees GPUs is refused, always.
- **CPU only**: ranks x torch threads per rank above the cores this process may use
  (``os.sched_getaffinity``) is oversubscription: every rank still runs, but step times are slow
  and noisy and a large plan can hang the machine (64 ranks on 2 cores did). Refused unless the
  launch says ``--oversubscribe`` (a correctness run of a small plan, e.g. the tests' 4 gloo ranks
  on 2 cores).

A one-node launch (no ``--nnodes``) of a plan that needs more ranks than the node holds is told
how many nodes it needs and the command to run on each (``fit_problem``'s ``command``). The check
is a pure function of counts (``fit_problem``); ``local_devices`` reads them (torch only for CUDA).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from meshplan.runtime.launch.torchrun import Launch


@dataclass(frozen=True)
class NodeDevices:
    """What this node offers the ranks a launch starts on it."""

    gpus: int  # CUDA devices visible to this process (0: ranks run on the CPU)
    cores: int  # CPU cores this process may run on


def local_devices() -> NodeDevices:
    """This node's visible CUDA devices (``CUDA_VISIBLE_DEVICES`` applies) and usable CPU cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return NodeDevices(gpus=gpus, cores=max(cores, 1))


def _nodes_of(world_size: int, per_node: int) -> tuple[int, int] | None:
    """(nodes, ranks per node) sharing ``world_size`` ranks with at most ``per_node`` on a node, evenly."""
    for p in range(min(per_node, world_size), 0, -1):
        if world_size % p == 0:
            return world_size // p, p
    return None


def fit_problem(world_size: int, launch: Launch, node: NodeDevices, *, threads: int = 1,
                oversubscribe: bool = False, planned_per_node: int | None = None,
                command: Callable[[int, int], str] | None = None) -> str:
    """'' when ``launch`` (this node's share of a ``world_size``-rank plan) fits ``node``; else the one-line
    reason, naming what would work. ``planned_per_node``: the devices per node the plan was made for;
    ``command(nnodes, nproc_per_node)``: the ``meshplan run`` line each node of a multi-node launch runs."""
    here = launch.nproc_per_node
    single = not launch.multi_node

    def on_nodes(per_node: int) -> str:
        split = _nodes_of(world_size, per_node)
        if split is None or split[0] < 2:
            return ""
        n, p = split
        cmd = f": on each node `{command(n, p)}`" if command is not None else ""
        return f"run it on {n} nodes of {p} ranks{cmd}"

    if node.gpus:
        if here <= node.gpus:
            return ""
        if single:
            where = on_nodes(node.gpus)
            return (f"the plan needs {world_size} ranks and this node has {node.gpus} GPU(s), one rank each; "
                    + (where or f"re-plan for a multiple of {node.gpus} ranks, or run on several nodes (--nnodes)"))
        split = _nodes_of(world_size, node.gpus)
        return (f"--nproc-per-node {here}: this node has {node.gpus} GPU(s), one rank each; "
                + (f"use --nproc-per-node {split[1]} (and --nnodes {split[0]})" if split
                   else f"re-plan for a multiple of {node.gpus} ranks"))
    busy = here * threads
    if busy <= node.cores or oversubscribe:
        return ""
    load = f"{here} ranks x {threads} thread(s) on {node.cores} CPU cores (no GPU)"
    spans = planned_per_node is not None and 0 < planned_per_node < world_size
    if single and spans:
        where = on_nodes(planned_per_node)  # type: ignore[arg-type]
        if where:
            return (f"the plan needs {world_size} ranks on nodes of {planned_per_node}; here that is {load}, "
                    f"{busy / node.cores:.0f}x oversubscribed: {where}; or pass --oversubscribe to start all "
                    f"{world_size} here anyway")
    fewer = max(node.cores // threads, 1)
    if not single:  # several nodes already: more of them, fewer ranks on each
        where = on_nodes(fewer)
        if where:
            return (f"{load}: oversubscribed ({busy / node.cores:.1f}x the cores); {where}; or pass "
                    "--oversubscribe to run anyway")
    fix = f"--threads {max(node.cores // here, 1)}, " if threads > 1 and here <= node.cores else ""
    return (f"{load}: oversubscribed (step times slow and noisy; {busy / node.cores:.1f}x the cores); pass "
            f"--oversubscribe to run anyway (e.g. a correctness run), {fix}or re-plan for {fewer} rank(s)")
