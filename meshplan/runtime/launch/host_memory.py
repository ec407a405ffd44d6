"""Freed tensor memory goes back to the operating system (glibc's mmap threshold, fixed).

glibc serves an allocation of at least ``M_MMAP_THRESHOLD`` bytes with its own ``mmap`` and returns it
to the system on ``free``. By default that threshold is dynamic: each time a mmapped block is freed,
glibc raises the threshold to that block's size (up to 32 MiB on 64-bit). A training step frees
blocks of every size (FSDP2's all-gathered parameters and reduce-scatter buffers, activations,
logits), so after the first step nearly every tensor under 32 MiB is carved from the heap arenas
instead, where freed space is reused only when the next request fits a hole; on this CPU machine a
gpt2-small dp2 FSDP2 rank's resident memory then climbed step after step (2.3 GiB after the first
step, 3.0 GiB after five, for a 0.23 GiB shard) although the live tensors stayed the same.
``mallopt(M_MMAP_THRESHOLD, 128 KiB)`` sets glibc's initial threshold and, being explicit, turns its
raising off; the same rank then peaked at 1.6 GiB and stayed there (BENCHMARKS.md, "host memory
of a training step").

``return_freed_memory()`` does that once per process; it is a no-op where the C library is not glibc
(macOS, musl) and when the user set ``MALLOC_MMAP_THRESHOLD_`` (glibc already read their choice at
start-up; ``MESHPLAN_MALLOC=keep`` leaves the C library alone as well). It returns a note for the run's
output, or None when nothing was changed.

``peak_rss_bytes()``: this process's own peak resident set size, ``VmHWM`` of ``/proc/self/status`` on
Linux. Not ``getrusage(RUSAGE_SELF).ru_maxrss``: Linux carries the peak of the process that forked a
child into the child's ``ru_maxrss`` across ``exec`` (with Python's vfork-based spawn, the parent's own
peak), so a torchrun worker or a spawned benchmark rank reported at least its launcher's peak (a parent
that had touched 1 GiB gave a fresh ``python`` child 1.01 GiB, whose VmHWM was 0.01).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
THRESHOLD_BYTES = 128 * 1024  # glibc's own initial value: only its dynamic raising is switched off

_done: list[str | None] = []


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()  # only glibc has it (musl does not)
    except (OSError, AttributeError):
        return None
    return libc


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes (``VmHWM`` on Linux; elsewhere ``ru_maxrss``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS reports bytes, Linux KiB


def return_freed_memory(environ: dict[str, str] | None = None) -> str | None:
    """Fix glibc's mmap threshold at 128 KiB in this process (once); the note saying so, or None."""
    if _done:
        return _done[0]
    env = os.environ if environ is None else environ
    note: str | None = None
    if "MALLOC_MMAP_THRESHOLD_" not in env and env.get("MESHPLAN_MALLOC", "") != "keep":
        libc = _glibc()
        if libc is not None and libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES) == 1:
            note = ("host memory: glibc mmap threshold fixed at 128 KiB, so freed tensor buffers return to the "
                    "system (MESHPLAN_MALLOC=keep to leave it dynamic)")
    _done.append(note)
    return note
