"""Distributed start-up: process group from the torchrun environment and the Plan's DeviceMesh.

``check_launch(plan)`` compares the plan's world size with the launch (``WORLD_SIZE``, or the
live process group) and raises ``PlanMismatchError`` before any collective runs.
``init_runtime(plan)`` then creates the process group (nccl with CUDA, else gloo; explicit
timeout) unless one already exists, and a DeviceMesh in the plan's axis order
(``init_device_mesh(device_type, plan.mesh.degrees, mesh_dim_names=plan.mesh.axis_names)``).
Every axis the runtime uses ("pp", "dp", "tp") is looked up by name; a plan without an axis
behaves as degree 1 on it.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshplan.errors import PlanMismatchError
from meshplan.plan import Plan

DEFAULT_TIMEOUT_S = 120.0


@dataclass
class RuntimeEnv:
    """What one rank knows about the launch: its coordinates on every mesh axis."""

    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh
    coords: dict[str, int]  # axis name -> this rank's index on that axis
    degrees: dict[str, int]

    def coord(self, axis: str) -> int:
        return self.coords.get(axis, 0)

    def degree(self, axis: str) -> int:
        return self.degrees.get(axis, 1)

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """The process group along ``axis``; None when the plan has no such axis."""
        if axis not in self.degrees:
            return None
        return self.mesh.get_group(axis)


def launched_world_size() -> int | None:
    """World size of the current launch: the live process group, else torchrun's WORLD_SIZE."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    ws = os.environ.get("WORLD_SIZE")
    return int(ws) if ws else None


def check_launch(plan: Plan) -> None:
    """Raise PlanMismatchError when the plan's world size is not the launched one."""
    ws = launched_world_size()
    if ws is None:
        raise PlanMismatchError(
            "no distributed launch found (no process group, no WORLD_SIZE); run under torchrun, "
            f"e.g. `meshplan run plan.json --nproc {plan.world_size}`"
        )
    if ws != plan.world_size:
        raise PlanMismatchError(
            f"plan {plan.summary()!r} needs world size {plan.world_size} (mesh {dict(zip(plan.mesh.axis_names, plan.mesh.degrees))}) "
            f"but {ws} processes were launched; launch {plan.world_size} ranks or re-plan for {ws}"
        )


def restart_store(timeout: datetime.timedelta) -> dist.Store | None:
    """After a torchrun restart (``--max-restarts``), the agent's store under a per-attempt prefix.

    torchrun's workers share the agent's TCPStore across restarts, so the restarted ranks could
    read the dead attempt's gloo addresses and fail with "Connection refused"; a prefix per attempt
    keeps each attempt's keys apart. None (plain ``env://``) on a first attempt or without an agent store.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"meshplan/attempt_{attempt}/", base)


def launch_device(use_cuda: bool, environ: Mapping[str, str], device_count: int) -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` (torchrun's; else RANK modulo the devices) with CUDA, else the CPU."""
    if not use_cuda:
        return torch.device("cpu")
    local = environ.get("LOCAL_RANK") or str(int(environ.get("RANK", "0") or 0) % max(device_count, 1))
    return torch.device("cuda", int(local))


def init_runtime(plan: Plan, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> RuntimeEnv:
    """Process group (if none yet) and the Plan's DeviceMesh. Checks the launch first.

    On CUDA the group is bound to this rank's device (``device_id``): NCCL connects eagerly, and
    barriers and object collectives know their device without guessing."""
    check_launch(plan)
    use_cuda = torch.cuda.is_available()
    device = launch_device(use_cuda, os.environ, torch.cuda.device_count() if use_cuda else 0)
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        store = restart_store(timeout)
        bound = {"device_id": device} if use_cuda else {}
        if store is None:
            dist.init_process_group(backend=backend, timeout=timeout, **bound)
        else:
            dist.init_process_group(backend=backend, timeout=timeout, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), **bound)
    rank = dist.get_rank()
    names = tuple(plan.mesh.axis_names)
    mesh = init_device_mesh(device.type, tuple(plan.mesh.degrees), mesh_dim_names=names)
    coords = {name: int(mesh.get_local_rank(name)) for name in names}
    return RuntimeEnv(
        rank=rank,
        world_size=dist.get_world_size(),
        device=device,
        mesh=mesh,
        coords=coords,
        degrees=dict(zip(names, plan.mesh.degrees)),
    )


def ranks_along(env: RuntimeEnv, axis: str, positions: list[int]) -> list[list[int]]:
    """For every coordinate of the other axes, the global ranks at ``positions`` on ``axis``.

    Used to build the groups that tie a weight between two pipeline ranks. Same order on all ranks.
    """
    names = list(env.mesh.mesh_dim_names or ())
    t = env.mesh.mesh
    if axis not in names:
        return [[int(x) for x in t.flatten().tolist()]]
    dim = names.index(axis)
    moved = t.movedim(dim, -1).reshape(-1, t.shape[dim])
    return [[int(row[p]) for p in positions] for row in moved]
