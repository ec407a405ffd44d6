"""Start-up lines a user can follow: what a worker does between its launch and step 1, and how long.

``StartupClock`` times the phases of a worker's start (``phase(name)`` ends the one before and
begins ``name``; ``seconds()`` gives each) and ``MaterializeProgress`` prints, on rank 0, at most one
line every ``every_s`` seconds while the model's tensors are materialized (the phase that grows with
the model: ``materializing 312/773 tensors (host-exact replay on the CPU): 40%, 31 s so far, ~46 s
left``). ``startup_line`` is the one-line breakdown printed before step 1 and kept in the RunRecord
(``startup_s``).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from meshplan.runtime.record.progress import fmt_duration


class StartupClock:
    """Wall time per start-up phase, from ``t0`` (``time.perf_counter()`` at the worker's start)."""

    def __init__(self, t0: float | None = None, first: str = "") -> None:
        self.t0 = time.perf_counter() if t0 is None else t0
        self._last = self.t0
        self._name = first  # the phase running since t0 ("": none)
        self._s: dict[str, float] = {}

    @classmethod
    def since_process_start(cls, first: str) -> StartupClock:
        """A clock whose zero is this process's start (Linux: ``/proc/self/stat``, so the interpreter's
        start and ``import torch`` count), else now; phase ``first`` runs from there."""
        age = process_age_s()
        return cls(time.perf_counter() - age if age is not None else None, first)

    def phase(self, name: str) -> None:
        """End the current phase (if any) and start ``name``."""
        now = time.perf_counter()
        if self._name:
            self._s[self._name] = self._s.get(self._name, 0.0) + now - self._last
        self._name, self._last = name, now

    def add(self, parts: dict[str, float], within: str) -> None:
        """Split the time of phase ``within`` (already ended) into ``parts`` (measured inside it); the
        rest stays under ``within``."""
        total = self._s.pop(within, 0.0)
        for k, v in parts.items():
            self._s[k] = self._s.get(k, 0.0) + v
        rest = total - sum(parts.values())
        if rest > 0.0005:
            self._s[within] = rest

    def seconds(self) -> dict[str, float]:
        """Each ended phase's seconds, in the order they ran."""
        return dict(self._s)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def process_age_s() -> float | None:
    """Seconds since this process started (Linux), None where ``/proc`` does not tell."""
    import os

    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def startup_line(parts: dict[str, float], total_s: float, what: str, build: str = "") -> str:
    """``startup: 42.9 s to step 1 [meta build]: import 3.1 s, meta build 1.0 s, ...`` (``build``: which
    build the run used, ``train.build_label``)."""
    body = ", ".join(f"{k} {v:.1f} s" for k, v in parts.items() if v >= 0.05)
    return f"startup: {total_s:.1f} s {what}" + (f" [{build}]" if build else "") + f": {body}"


class MaterializeProgress:
    """``progress(done, total)`` callback: rank 0 prints a line at most every ``every_s`` seconds, and
    one at the end when any was printed (a start that takes under ``every_s`` prints nothing)."""

    def __init__(self, how: str, *, rank: int = 0, every_s: float = 5.0, out: TextIO | None = None) -> None:
        self.how, self.rank, self.every_s = how, rank, every_s
        self.out = out
        self.t0 = time.perf_counter()
        self._next = self.t0 + every_s
        self.printed = 0

    def __call__(self, done: int, total: int) -> None:
        if self.rank != 0:
            return
        now = time.perf_counter()
        if now < self._next and not (done == total and self.printed):
            return
        self._next = now + self.every_s
        el = now - self.t0
        frac = done / total if total else 1.0
        left = f", ~{fmt_duration(el / frac - el)} left" if 0 < frac < 1 else ""
        print(f"materializing {done}/{total} tensors ({self.how}): {frac:.0%}, {fmt_duration(el)} so far{left}",
              file=self.out or sys.stdout, flush=True)
        self.printed += 1
