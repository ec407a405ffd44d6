"""Hang watchdog and fault broadcast: every rank's progress in the launcher's store, one verdict.

Each rank tells its ``Watchdog`` where it is (``at(phase, step)``: an attribute write, nothing
else, so the training step pays nothing). A background thread per rank publishes that state to
the store every ``poll_s`` when it changed (``rank/<r>`` = step, phase, a counter, host, steps
done) and watches the store's ``fault`` key. Rank 0's thread also reads every rank's state and
declares a hang (the last rank's thread too, 1.5 times later, in case rank 0 is the stuck one) when *no* rank advanced for ``hang_timeout_s`` (three times that while no rank
finished its first step or while a rank is checkpointing or validating, which take longer than a
step); the message names the ranks that are behind (the lowest step, then the earliest phase of
it) with their host and phase, and the others with where they wait.

A fault (a hang, or an error a rank explains: out of memory, damaged data, a full disk) is posted
once (``post``: the first poster wins through an atomic counter) and every rank's thread that
sees it ends its process with ``os._exit(code)``, so ranks stuck in a collective or a kernel stop
too and torchrun sees a failed worker (``--max-restarts`` then restarts from the newest complete
checkpoint, which a fault never touches: an unfinished save is a ``.tmp-*`` directory no reader
takes). The poster prints the one message (``faults.report``). Store keys are under a prefix per
torchrun attempt (``train.py``), so a restarted attempt never reads the last one's fault.

Torch-free: the store is anything with ``set``, ``get``, ``multi_get``, ``check``, ``add`` (a torch ``Store``;
the tests pass a dict-backed one), and the clock and the exit are injectable.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_MIN_TIMEOUT_S = 180.0  # "at least a few minutes"
STEPS_OF_SLACK = 20  # default timeout: this many predicted steps, when longer than the minimum
SLOW_FACTOR = 3.0  # the first step (warm-up, compilation), checkpoints and validation get 3x
SLOW_PHASES = ("checkpoint", "validation", "profile")
BACKUP_FACTOR = 1.5  # the last rank's monitor waits this much longer than rank 0's
# where a phase falls inside a step: the rank with the lowest (step, order) is the one behind
PHASE_ORDER = {"start": 0, "data": 1, "barrier": 2, "forward": 3, "schedule": 3, "backward": 4,
               "gradient/loss all-reduce": 5, "optimizer": 6, "all_gather of step facts": 7,
               "validation": 8, "checkpoint": 9, "finished": 10}
FAULT_EXIT = {"hang": 4, "oom": 5, "data": 6, "disk": 7, "error": 1}


def default_timeout_s(predicted_step_s: float) -> float:
    """``--hang-timeout`` when none is given: 20 predicted steps, at least 3 minutes."""
    return max(DEFAULT_MIN_TIMEOUT_S, STEPS_OF_SLACK * max(predicted_step_s, 0.0))


@dataclass(frozen=True)
class RankState:
    step: int
    phase: str
    seq: int
    done: int  # steps this rank completed
    host: str = ""

    @property
    def order(self) -> tuple[int, int]:
        return self.step, PHASE_ORDER.get(self.phase, 5)


def ranks_text(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``ranks 0-2, 5``; one rank -> ``rank 3``."""
    rs = sorted(ranks)
    if len(rs) == 1:
        return f"rank {rs[0]}"
    parts, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(f"{rs[i]}-{rs[j]}" if j > i else str(rs[i]))
        i = j + 1
    return "ranks " + ", ".join(parts)


def describe(states: dict[int, RankState], world_size: int) -> tuple[list[int], str]:
    """(the ranks behind, a text naming them and where every other rank is)."""
    missing = [r for r in range(world_size) if r not in states]
    if missing:
        return missing, f"{ranks_text(missing)} never reported progress (stuck before the first step)"
    live = {r: s for r, s in states.items() if s.phase != "finished"} or states
    low = min(s.order for s in live.values())
    behind = sorted(r for r, s in live.items() if s.order == low)
    first = states[behind[0]]
    hosts = sorted({states[r].host for r in behind if states[r].host})
    on = f" on {', '.join(hosts[:4])}{' ...' if len(hosts) > 4 else ''}" if hosts else ""
    text = f"{ranks_text(behind)}{on} stopped at step {first.step} in {first.phase}"
    groups: dict[tuple[int, str], list[int]] = {}
    for r, s in sorted(states.items()):
        if r not in behind:
            groups.setdefault((s.step, s.phase), []).append(r)
    waits = [f"{ranks_text(rs)} at step {st} in {ph}" for (st, ph), rs in sorted(groups.items())]
    if waits:
        text += "; waiting: " + "; ".join(waits[:6]) + (" ..." if len(waits) > 6 else "")
    return behind, text


class Watchdog:
    """One per rank; see the module docstring. ``poll_once`` is one tick of the thread (tests call it)."""

    def __init__(self, store: Any, *, rank: int, world_size: int, hang_timeout_s: float,
                 poll_s: float | None = None, checkpoint_hint: Callable[[], str] | None = None,
                 report: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 exit_fn: Callable[[int], Any] = os._exit, start_step: int = 0) -> None:
        if hang_timeout_s < 0:
            raise ValueError(f"--hang-timeout must be >= 0 (0: off), got {hang_timeout_s}")
        self.store, self.rank, self.world = store, rank, world_size
        self.timeout_s = hang_timeout_s
        self.poll_s = poll_s if poll_s is not None else min(5.0, max(0.2, hang_timeout_s / 10 or 1.0))
        self.checkpoint_hint, self.report = checkpoint_hint, report
        self.clock, self.exit_fn = clock, exit_fn
        self.host = socket.gethostname()
        self.start_step = start_step
        self.step, self.phase, self.seq, self.done = start_step, "start", 0, start_step
        self._published = -1
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (seq, when it last changed), rank 0 only
        self._all_published = False
        self._t0 = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.hang_message: str | None = None

    # ---- the training loop's side ------------------------------------------------------------
    def at(self, phase: str, step: int | None = None) -> None:
        """This rank entered ``phase`` (of ``step``). Cheap: the thread publishes it."""
        if step is not None:
            self.step = step
        self.phase = phase
        self.seq += 1

    def finished_step(self, step: int) -> None:
        self.done = step
        self.seq += 1

    def start(self) -> Watchdog:
        """Publish, and start the thread (not without a store or with the timeout 0 and no store)."""
        if self.store is None:
            return self
        self._publish()
        self._thread = threading.Thread(target=self._run, name="meshplan-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread, publishing the last phase first (a finished rank is never taken for a stuck one)."""
        self._stop.set()
        try:
            self._publish()
        except Exception:  # noqa: BLE001 - the store is gone: nothing left to tell
            pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def post(self, kind: str, message: str) -> bool:
        """Post the run's fault; True when this rank is the first (it then reports the message)."""
        if self.store is None:
            return True
        try:
            first = int(self.store.add("fault_count", 1)) == 1
            if first:
                self.store.set("fault", json.dumps({"rank": self.rank, "kind": kind, "message": message}))
        except Exception:  # noqa: BLE001 - the store is gone (launcher died): report locally
            first = True
        return first

    def posted(self) -> dict[str, Any] | None:
        """The fault some rank posted, or None."""
        if self.store is None:
            return None
        try:
            if not self.store.check(["fault"]):
                return None
            return json.loads(self.store.get("fault"))
        except Exception:  # noqa: BLE001
            return None

    def wait_posted(self, wait_s: float) -> dict[str, Any] | None:
        """The posted fault, waiting up to ``wait_s`` for one (a peer's failure explains ours)."""
        deadline = time.monotonic() + wait_s
        while True:
            f = self.posted()
            if f is not None or time.monotonic() >= deadline:
                return f
            time.sleep(0.1)

    # ---- the thread's side ---------------------------------------------------------------------
    def _publish(self) -> None:
        if self.store is None or self._published == self.seq:
            return
        seq = self.seq
        state = {"step": self.step, "phase": self.phase, "seq": seq, "done": self.done, "host": self.host}
        self.store.set(f"rank/{self.rank}", json.dumps(state))
        self._published = seq

    def states(self) -> dict[int, RankState]:
        """Every rank's last published state (ranks that never published are absent): one ``multi_get``
        once every rank has published, a ``check`` and a ``get`` per rank until then."""
        keys = [f"rank/{r}" for r in range(self.world)]
        if self._all_published or self.store.check(keys):
            self._all_published = True
            raw = dict(enumerate(self.store.multi_get(keys)))
        else:
            raw = {r: self.store.get(k) for r, k in enumerate(keys) if self.store.check([k])}
        out = {}
        for r, v in raw.items():
            d = json.loads(v)
            out[r] = RankState(int(d["step"]), str(d["phase"]), int(d["seq"]), int(d.get("done", 0)),
                               str(d.get("host", "")))
        return out

    def check_hang(self, now: float) -> str | None:
        """The hang message when no rank advanced for the timeout, else None. Rank 0 decides; the last rank
        watches too with half as much again, should rank 0's own process be the one stuck with Python's lock
        held (its thread could not run then)."""
        if self.timeout_s <= 0:
            return None
        states = self.states()
        for r, s in states.items():
            seq, _ = self._seen.get(r, (-1, now))
            if s.seq != seq:
                self._seen[r] = (s.seq, now)
        live = [r for r in range(self.world) if r not in states or states[r].phase != "finished"]
        if not live:
            return None
        last = max([self._seen[r][1] for r in live if r in self._seen] + [self._t0])
        slow = (all(s.done <= self.start_step for s in states.values())
                or any(s.phase in SLOW_PHASES for s in states.values()))
        limit = self.timeout_s * (SLOW_FACTOR if slow else 1.0) * (1.0 if self.rank == 0 else BACKUP_FACTOR)
        idle = now - last
        if idle < limit:
            return None
        behind, where = describe(states, self.world)
        ck = self.checkpoint_hint() if self.checkpoint_hint else ""
        return (f"hang: no rank advanced for {idle:.0f} s (--hang-timeout {self.timeout_s:g} s"
                f"{f', x{SLOW_FACTOR:g} in this phase' if slow else ''}): {where}. Stopped all ranks; {ck}"
                f"look at {ranks_text(behind)}'s node (a stuck kernel or collective, a dead NIC, a blocked file "
                "system); with --max-restarts K the run restarts from the newest complete checkpoint")

    def poll_once(self) -> None:
        self._publish()
        f = self.posted()
        if f is not None and f.get("rank") != self.rank:  # this rank's own fault: its main thread exits
            self._stop.set()
            self.exit_fn(FAULT_EXIT.get(str(f.get("kind")), 1))
            return
        if self.rank in (0, self.world - 1):
            msg = self.check_hang(self.clock())
            if msg is not None:
                self.hang_message = msg
                if self.post("hang", msg) and self.report is not None:
                    self.report(msg)
                self._stop.set()
                self.exit_fn(FAULT_EXIT["hang"])

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll_once()
            except Exception:  # noqa: BLE001 - the store went away: the run is ending; stop watching
                return
