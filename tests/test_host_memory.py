"""Host memory of a CPU rank: glibc's mmap threshold fixed, gloo's reduce-scatter in bounded pieces, a
rank's own peak RSS.

``runtime.launch.host_memory.return_freed_memory`` must really change where glibc puts a freed-then-
reallocated buffer (checked with glibc's own ``mallinfo2`` in fresh interpreters, since the setting is
once per process), and leave the C library alone when told to. ``collectives.reduce_scatter_single``
in pieces must give every rank exactly what one ``reduce_scatter_tensor`` gives, also under FSDP2, whose
reduce-scatter inputs the runtime's hook releases once the (blocking, CPU) call has finished with them.
``host_memory.peak_rss_bytes`` (the RunRecord's CPU peak) must be the process's own, not its launcher's.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from dist_utils import run_ranks

PROBE = textwrap.dedent("""
    import ctypes
    from meshplan.runtime.launch.host_memory import return_freed_memory
    class MI(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MI
    note = return_freed_memory()
    before = libc.mallinfo2().hblkhd
    a = bytearray(2**21)
    del a  # glibc's dynamic rule raises its threshold to 2 MiB here
    b = bytearray(2**21)
    print(note is not None, libc.mallinfo2().hblkhd - before >= 2**21)
""")


def _glibc() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").mallinfo2)
    except (OSError, AttributeError):
        return False


@pytest.mark.skipif(not _glibc(), reason="glibc's mallopt/mallinfo2 only (Linux with glibc >= 2.33)")
@pytest.mark.parametrize(("env", "expect"), [({}, "True True"), ({"MESHPLAN_MALLOC": "keep"}, "False False"),
                                             ({"MALLOC_MMAP_THRESHOLD_": "4194304"}, "False False")])
def test_freed_buffers_go_back_to_the_system(env: dict[str, str], expect: str) -> None:
    import os

    full = {k: v for k, v in os.environ.items() if k not in ("MESHPLAN_MALLOC", "MALLOC_MMAP_THRESHOLD_")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**full, **env}, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split("\n")[-2]
    # fixed threshold: the second 2 MiB buffer is its own mmap again; dynamic (or the user's 4 MiB): the heap
    assert out == expect


LAUNCHER = textwrap.dedent("""
    import subprocess, sys
    big = bytearray(2**28)  # the launcher touches 256 MiB, then frees it before starting its child
    del big
    child = "import resource; from meshplan.runtime.launch.host_memory import peak_rss_bytes; " \\
            "print(peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux: ru_maxrss carried across exec")
def test_peak_rss_is_the_process_own_not_its_launchers() -> None:
    out = subprocess.run([sys.executable, "-c", LAUNCHER], capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    own, ru_maxrss = int(out[0]), int(out[1])
    # a fresh interpreter importing the torch-free module: tens of MiB; ru_maxrss carries the launcher's 256+
    assert own < 2**27 <= 2**28 <= ru_maxrss, (own, ru_maxrss)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(24, 40)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(40, 40) for _ in range(2)])
        self.out = torch.nn.Linear(40, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.out(x)


def _pieces_worker(rank: int, world: int) -> dict[str, object]:
    import torch.distributed as dist

    from meshplan.runtime.apply.data_parallel import SyncCounter, wrap_dp
    from meshplan.runtime.launch import collectives

    torch.manual_seed(rank)
    out: dict[str, object] = {}
    for shard in (7, 64, 1000):  # shards smaller than, equal to and not a multiple of the piece
        x = torch.randn(world * shard, dtype=torch.float64)
        ref = torch.empty(shard, dtype=torch.float64)
        dist.reduce_scatter_tensor(ref, x.clone())
        collectives.GLOO_RS_PIECE_BYTES = 8 * 8 * world  # 8 float64 elements per rank per call
        got = torch.full((shard,), float("nan"), dtype=torch.float64)
        collectives.reduce_scatter_single(got, x, op=dist.ReduceOp.SUM, group=dist.group.WORLD)
        out[f"rs{shard}"] = torch.equal(got, ref)
        collectives.GLOO_RS_PIECE_BYTES = 16 * 2**20
    grads = []
    for piece in (16 * 2**20, 64):  # one call, then pieces of 64 bytes, same model and batch
        collectives.GLOO_RS_PIECE_BYTES = piece
        torch.manual_seed(0)
        model = _Net()
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
        counter = SyncCounter()
        inputs: list[torch.Tensor] = []
        count = counter.add
        counter.add = lambda t, inputs=inputs, count=count: (inputs.append(t), count(t))  # type: ignore[method-assign]
        wrap_dp(model, "fsdp", dp_mesh=mesh, dp_group=None, counter=counter, per_block=True)
        torch.manual_seed(1 + rank)
        model(torch.randn(5, 24)).square().sum().backward()
        grads.append([p.grad.to_local().clone() for p in model.parameters()])
        # each reduce-scatter input (FSDP2 keeps one alive into the next group's backward) was released
        out["released"] = bool(inputs) and all(t.untyped_storage().nbytes() == 0 for t in inputs)
    out["fsdp"] = all(torch.equal(a, b) for a, b in zip(*grads))
    out["calls"] = counter.calls
    return out


@pytest.mark.distributed
def test_reduce_scatter_in_pieces_equals_one_call() -> None:
    for r in run_ranks(_pieces_worker, 2, timeout_s=240):
        assert r == {"rs7": True, "rs64": True, "rs1000": True, "fsdp": True, "released": True, "calls": r["calls"]}
        assert r["calls"] >= 2  # FSDP2 went through the counting (custom) reduce-scatter
