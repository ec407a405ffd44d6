"""Time bounds for ``meshplan profile``: a total budget split over its measurements, progress lines,
and whether this CPU does bf16 / fp16 fast enough to sweep them.

``Budget(total_s)`` gives each phase (matmul, memory, eager chains, op overhead, collectives) a
share of what is left; ``phase(name, share)`` returns the phase's absolute deadline
(``time.monotonic()``; ``wall_deadline`` for spawned processes) and prefixes every log line with
the elapsed time over the budget, so a slow machine shows progress instead of silence. Each
measurement stops its repetitions at its deadline (after at least one), and skips the larger sizes
it could not finish in time, naming them. On a CPU without bf16 instructions (no ``avx512_bf16``
or ``amx_bf16``; bf16 matmuls then run near 1 GFLOP/s) the bf16 sweep is skipped with a note and
only the smallest size is measured. No torch import here.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

Log = Callable[[str], None]


def log_stderr(msg: str) -> None:
    """The default progress line of ``meshplan profile``."""
    print(f"[meshplan profile] {msg}", file=sys.stderr, flush=True)


#: phase -> share of the budget still left when the phase starts
SHARES = {"matmul": 0.35, "memory": 0.1, "eager": 0.3, "overhead": 0.15, "collectives": 1.0}


class Budget:
    def __init__(self, total_s: float, log: Log) -> None:
        if total_s <= 0:
            raise ValueError(f"--budget must be > 0 seconds, got {total_s}")
        self.total_s = total_s
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        self._log = log
        self.deadline = self.t0 + total_s

    def left_s(self) -> float:
        return max(0.0, self.t0 + self.total_s - time.monotonic())

    def phase(self, name: str) -> float:
        """Deadline (monotonic seconds) of phase ``name``: its share of the time left."""
        self.deadline = time.monotonic() + SHARES.get(name, 0.2) * self.left_s()
        return self.deadline

    def wall_deadline(self) -> float:
        """The current phase's deadline as ``time.time()`` (for spawned processes)."""
        return self.wall0 + (self.deadline - self.t0)

    def log(self, msg: str) -> None:
        self._log(f"[{time.monotonic() - self.t0:5.1f}/{self.total_s:.0f} s] {msg}")


#: the /proc/cpuinfo flags of native low-precision matmul support, per dtype
FAST_FLAGS = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}


def cpu_has_fast_bf16(cpuinfo: str | None = None) -> bool:
    """True when the CPU flags include native bf16 (``avx512_bf16`` or ``amx_bf16``)."""
    return cpu_has_fast("bf16", cpuinfo)


def cpu_has_fast(dtype: str, cpuinfo: str | None = None) -> bool:
    """True when the CPU flags include native ``dtype`` matmul support (``FAST_FLAGS``)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return True  # not Linux: no way to tell; measure as asked
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return bool(flags & set(FAST_FLAGS[dtype]))


def cpu_name(cpuinfo: str | None = None) -> str:
    """The CPU's model name (/proc/cpuinfo), else ``platform.processor()`` or the machine type."""
    import platform

    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def fits(last_call_s: float, scale: float, reps: int, deadline: float) -> bool:
    """Would ``reps + 2`` calls of a size ``scale`` times as costly as the last one end before ``deadline``?"""
    return time.monotonic() + last_call_s * scale * (reps + 2) <= deadline
