"""The torchrun command line that ``meshplan run`` starts (``python -m meshplan.runtime.launch.agent``:
``torch.distributed.run`` with meshplan's console settings, ``agent.py``; its arguments are torchrun's).

One node: ``--standalone`` (or a fixed local master port). Several nodes: torchrun's c10d
rendezvous (``--nnodes N --nproc-per-node P --rdzv-backend c10d --rdzv-endpoint HOST:PORT
--rdzv-id ID``), run once per node as torchrun is; with c10d torchrun ignores ``--node-rank`` and
numbers the ranks in rendezvous order. ``--max-restarts K`` is torchrun's: when a worker dies, all
workers of the run are stopped and started again (``TORCHELASTIC_RESTART_COUNT`` > 0), and the
training entry resumes from the newest complete checkpoint. ``check_endpoint`` waits (up to the
rendezvous timeout) for a remote endpoint to accept TCP connections, so an unreachable one fails
with a clear message instead of a long torchrun stack. torch is not imported here.
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_RDZV_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Launch:
    """How many processes, on how many nodes, meeting where; restarts allowed."""

    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_id: str = "meshplan"
    rdzv_timeout_s: float = DEFAULT_RDZV_TIMEOUT_S
    max_restarts: int = 0
    master_port: int | None = None

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1 or self.rdzv_endpoint is not None


def plan_launch(world_size: int, *, nproc: int | None = None, nnodes: int | None = None,
                nproc_per_node: int | None = None, **kw: object) -> Launch:
    """The Launch for a plan of ``world_size`` ranks; ValueError (one line) when the numbers disagree."""
    n = nnodes or 1
    if n < 1:
        raise ValueError(f"--nnodes must be >= 1, got {n}")
    if nproc_per_node is None:
        nproc_per_node = nproc if nproc is not None and n == 1 else None
    if nproc_per_node is None:
        if world_size % n:
            raise ValueError(f"the plan needs {world_size} ranks, which {n} nodes cannot share evenly; "
                             f"use --nnodes dividing {world_size} or re-plan for a multiple of {n}")
        nproc_per_node = world_size // n
    if nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    if n * nproc_per_node != world_size:
        raise ValueError(f"the plan needs {world_size} ranks but --nnodes {n} x --nproc-per-node {nproc_per_node} "
                         f"= {n * nproc_per_node}; launch {world_size} ranks in all or re-plan for {n * nproc_per_node}")
    launch = Launch(nproc_per_node=nproc_per_node, nnodes=n, **kw)  # type: ignore[arg-type]
    if launch.nnodes > 1 and not launch.rdzv_endpoint:
        raise ValueError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
    if launch.rdzv_endpoint:
        split_endpoint(launch.rdzv_endpoint)
    if launch.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {launch.max_restarts}")
    return launch


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT, e.g. node001:29500")
    return host.strip("[]"), int(port)


def is_local_host(host: str) -> bool:
    """True when ``host`` names this machine (it may host the rendezvous store itself)."""
    try:
        addrs = {a[4][0] for a in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    if any(a.startswith("127.") or a == "::1" for a in addrs):
        return True
    names = {socket.gethostname(), socket.getfqdn()}
    local: set[str] = set()
    for name in names:
        try:
            local |= {a[4][0] for a in socket.getaddrinfo(name, None)}
        except OSError:
            continue
    return bool(addrs & local) or host in names


def check_endpoint(endpoint: str, timeout_s: float, *, poll_s: float = 0.5) -> None:
    """Wait until a remote rendezvous endpoint accepts TCP connections; ValueError after ``timeout_s``.

    A local endpoint is not checked: this node may be the one that hosts the store.
    """
    host, port = split_endpoint(endpoint)
    if is_local_host(host):
        return
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError as e:
            last = str(e) or type(e).__name__
        if time.monotonic() >= deadline:
            raise ValueError(
                f"rendezvous endpoint {endpoint} not reachable within {timeout_s:g} s ({last}); start the node "
                "that hosts it (the endpoint's host) first, or check the address, port and firewall")
        time.sleep(poll_s)


def torchrun_command(nproc: int | Launch, train_args: Sequence[str], *, master_port: int | None = None) -> list[str]:
    """argv of torchrun (through ``agent.py``) launching ``meshplan.runtime.loop.train`` (one node, or this
    node of several)."""
    launch = nproc if isinstance(nproc, Launch) else Launch(nproc_per_node=nproc, master_port=master_port)
    if launch.nproc_per_node < 1:
        raise ValueError(f"--nproc must be >= 1, got {launch.nproc_per_node}")
    # torch.distributed.run itself, run by agent.py: its notices quiet and a failure told in a line per rank
    cmd = [sys.executable, "-m", "meshplan.runtime.launch.agent", f"--nproc-per-node={launch.nproc_per_node}"]
    if launch.multi_node:
        cmd += [f"--nnodes={launch.nnodes}", f"--node-rank={launch.node_rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={launch.rdzv_endpoint}", f"--rdzv-id={launch.rdzv_id}",
                f"--rdzv-conf=join_timeout={int(launch.rdzv_timeout_s)}"]
    elif launch.master_port is None:
        cmd.append("--standalone")
    else:
        cmd += ["--master-addr=127.0.0.1", f"--master-port={launch.master_port}"]
    if launch.max_restarts:
        cmd.append(f"--max-restarts={launch.max_restarts}")
    return [*cmd, "-m", "meshplan.runtime.loop.train", *train_args]
