"""A guard over torch.distributed for tests: which collectives meshplan issues, and on what tensors.

On an NCCL group a CPU tensor fails ("No backend type associated with device type cpu"). On this
CPU machine the group's device and the default device are both the CPU, so a stray tensor cannot
be told from a placed one by its device. The guard makes placement visible: it gives the runtime
a marked "device" (``meshplan.runtime.launch.collectives.on_group_device``, the one place the runtime puts
a tensor on its group's device, returns the tensor as ``OnGroupDevice``) and wraps the collectives
of ``torch.distributed`` (and its autograd ``torch.distributed.nn.functional``) so that a call from
a meshplan module is a violation when

- a tensor argument is not an ``OnGroupDevice`` or not on the group's real device, or
- it does not come from ``meshplan.runtime.launch.collectives`` (a collective issued around the one place).

Violations are recorded, not raised, so every rank finishes the run and the test reports them all.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter_single",
         "all_to_all_single", "broadcast", "reduce", "send", "recv", "batch_isend_irecv",
         "barrier", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "gather",
         "scatter", "monitored_barrier")
# isend / irecv stay unwrapped: P2POp checks its op is torch's own function (batch_isend_irecv is checked)
AUTOGRAD_NAMES = ("all_reduce", "all_to_all_single", "all_gather", "broadcast", "reduce_scatter", "all_to_all")


class OnGroupDevice(torch.Tensor):
    """A tensor the runtime placed on its process group's device (through ``on_group_device``)."""


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dist.P2POp):
        yield x.tensor


class Guard:
    """Install once per process (``install``); ``violations`` and ``seen`` fill as the run goes."""

    def __init__(self) -> None:
        from meshplan.runtime.launch import collectives

        self.home = collectives.__name__  # the one module allowed to call torch.distributed (wherever it moves)
        self.violations: list[str] = []
        self.seen: set[str] = set()  # collectives meshplan.runtime.launch.collectives issued

    def _wrap(self, where: str, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("meshplan"):
                self._check(caller, f"{where}.{name}", args, kwargs)
            return fn(*args, **kwargs)

        checked.__wrapped_collective__ = fn  # type: ignore[attr-defined]
        return checked

    def _check(self, caller: str, name: str, args: tuple, kwargs: dict) -> None:
        from meshplan.runtime.launch.collectives import group_device

        if caller != self.home:
            self.violations.append(f"{caller} calls {name} directly, not through {self.home}")
        else:
            self.seen.add(name)
        group = kwargs.get("group")
        for t in _tensors([*args, *kwargs.values()]):
            if not isinstance(t, OnGroupDevice):
                self.violations.append(f"{caller}: {name} got a {tuple(t.shape)} {t.dtype} tensor that was not put "
                                       "on the group's device (meshplan.runtime.launch.collectives.on_group_device)")
            elif t.device != group_device(group if isinstance(group, dist.ProcessGroup) else None):
                self.violations.append(f"{caller}: {name} got a tensor on {t.device}, the group's device is "
                                       f"{group_device(group)}")

    def install(self) -> Guard:
        import torch.distributed.nn.functional as fc

        from meshplan.runtime.launch import collectives

        originals: dict[int, Any] = {}
        for mod, where, names in ((dist, "torch.distributed", NAMES), (fc, "torch.distributed.nn.functional",
                                                                       AUTOGRAD_NAMES)):
            for name in names:
                fn = getattr(mod, name, None)
                if fn is None or hasattr(fn, "__wrapped_collective__"):
                    continue
                wrapped = self._wrap(where, name, fn)
                originals[id(fn)] = wrapped
                setattr(mod, name, wrapped)
        # names a meshplan module bound at import (``from torch.distributed import all_reduce``)
        for mname, mod in list(sys.modules.items()):
            if mname.startswith("meshplan") and mod is not None:
                for attr, val in list(vars(mod).items()):
                    if id(val) in originals:
                        setattr(mod, attr, originals[id(val)])
        place = collectives.on_group_device

        def marked(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
            return place(t, group).as_subclass(OnGroupDevice)

        collectives.on_group_device = marked
        return self


def tokens_hook(step: int, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A per-step global-batch hook for gpt-tiny (vocabulary 128): the runtime checks it on every rank."""
    g = torch.Generator().manual_seed(step)
    toks = torch.randint(0, 128, (batch, seq_len + 1), generator=g)
    return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()


def run_worker(rank: int, world: int, runs: list[list[str]], ports: list[int]) -> dict[str, Any]:
    """Each ``runs[i]`` is a ``meshplan.runtime.loop.train`` argv run under the guard; ``ports[i]`` (i >= 1)
    re-creates the gloo group the previous run destroyed at its end."""
    import datetime

    from meshplan.runtime.loop import train

    guard = Guard().install()
    codes = []
    for i, argv in enumerate(runs):
        if i:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[i]}", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=60))
        codes.append(train.main(argv))
    return {"codes": codes, "violations": sorted(set(guard.violations)), "seen": sorted(guard.seen)}
