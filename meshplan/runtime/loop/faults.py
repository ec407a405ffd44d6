"""One message per fault: what happened, on which rank, at which step and phase, what to do.

``report(message)`` is how a worker says it: one ``meshplan run: error: ...`` line on stderr and
the same line appended to ``$MESHPLAN_FAULT_FILE`` (set by ``launch.supervise.run_tree``, which repeats
the last one after torchrun's own failure report, so the run's last line is the explanation).

``explain(exc, ...)`` turns the errors a run can meet mid-training into that message and a
fault kind (``watchdog.FAULT_EXIT`` gives the exit code):

- out of memory (``torch.OutOfMemoryError`` from CUDA, ``MemoryError`` on the host): the rank,
  step and phase, the measured peak against the plan's predicted peak for the rank's pipeline
  stage, and the re-plan to try: ``meshplan plan ... --memory-limit X`` where X scales the memory
  the plan may use by predicted / measured (``replan_limit_bytes``), so the plan the cost model
  fits into X really fits the device;
- damaged data (``DataChangedError``) and a checkpoint that could not be written (a
  ``CheckpointError``, e.g. a full disk): their own message, with the rank and step.

Anything else is not explained here (None).

The training loop's side: ``stop_on_fault`` is what ``train.py`` calls with whatever ended the loop
(see its docstring: every path ends in one message and ``os._exit``); ``watchdog_store`` connects to
the launcher's store for ``loop.watchdog``; ``pg_timeout_s`` keeps the process-group timeout
past the hang timeout; ``gather_rank_times`` collects every rank's own and waiting time per step for
the RunRecord (``meshplan.stragglers``).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

from meshplan.runtime.launch.supervise import FAULT_FILE_VAR

_TRIED = re.compile(r"Tried to allocate ([\d.]+) ([KMGT]i?B)")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9}


class DataChangedError(RuntimeError):
    """The training data changed under the running job (size, inode, mtime or header checksum)."""


def report(message: str) -> None:
    """The fault's one line on stderr, and in the supervisor's fault file."""
    line = f"meshplan run: error: {message}"
    print(line, file=sys.stderr, flush=True)
    path = os.environ.get(FAULT_FILE_VAR)
    if path:
        try:
            with open(path, "a") as f:
                f.write(message.replace("\n", " ") + "\n")
        except OSError:
            pass


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def requested_bytes(text: str) -> int:
    """The allocation a CUDA out-of-memory message says it tried (0 when it does not say)."""
    m = _TRIED.search(text)
    return int(float(m.group(1)) * _UNITS.get(m.group(2), 0)) if m else 0


def replan_limit_bytes(limit_bytes: int, predicted_bytes: int, needed_bytes: int) -> int:
    """The memory limit to plan with so a plan the cost model fits into it fits ``limit_bytes`` for real.

    The plan predicted ``predicted_bytes`` where the run needed at least ``needed_bytes`` (its
    peak plus the allocation that failed): the model under-counts by needed/predicted on this
    model and plan, so the limit shrinks by that factor.
    """
    if predicted_bytes <= 0 or needed_bytes <= predicted_bytes:
        return int(limit_bytes * 0.9)  # the prediction was not low: leave 10 % more room
    return int(limit_bytes * predicted_bytes / needed_bytes)


@dataclass(frozen=True)
class OomFacts:
    rank: int
    step: int
    phase: str
    measured_peak_bytes: int  # CUDA max allocated (or the host's peak RSS) when it failed
    requested_bytes: int  # what the failing allocation asked for (0: unknown)
    predicted_peak_bytes: int  # the plan's prediction for this rank's pipeline stage
    limit_bytes: int  # the memory the plan was made for (the device's usable memory)
    memory_kind: str  # "CUDA max allocated" or "host peak RSS"
    model: str
    world_size: int
    host: bool = False  # a host (CPU RAM) out-of-memory

    def message(self) -> str:
        needed = self.measured_peak_bytes + self.requested_bytes
        pred = f"{gib(self.predicted_peak_bytes)} predicted" if self.predicted_peak_bytes else "no prediction in the plan"
        tried = f" (+{gib(self.requested_bytes)} it tried to allocate)" if self.requested_bytes else ""
        where = "host memory" if self.host else "GPU memory"
        rss = ", which counts the interpreter and torch too" if "RSS" in self.memory_kind else ""
        text = (f"out of {where} on rank {self.rank} at step {self.step} in {self.phase}: measured peak "
                f"{gib(self.measured_peak_bytes)} ({self.memory_kind}{rss}){tried} vs {pred} for its stage")
        # the plan's memory, else what the device gave before it failed
        limit = self.limit_bytes or needed
        made = f"plan made for {gib(self.limit_bytes)}" if self.limit_bytes else f"the device gave out at {gib(needed)}"
        new = replan_limit_bytes(limit, self.predicted_peak_bytes, needed)
        return (f"{text}; {made}: re-plan with the measured headroom, `meshplan plan {self.model} -n {self.world_size} "
                f"--memory-limit {gib(new).replace(' ', '')}` (same other options), then resume with --resume from the "
                "newest complete checkpoint, which is kept")


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is always there in the runtime
        return False
    return isinstance(exc, torch.OutOfMemoryError)


# ---- the training loop's side (torch imported inside) ------------------------------------------
SPAN_PHASES = {"comm": "gradient/loss all-reduce", "schedule": "pipeline schedule (forward/backward chunks, "
               "send/recv)"}
# a collective broken because the other side went away (gloo, NCCL)
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited",
             "NCCL communicator was aborted")
MAX_RANK_TIME_VALUES = 200_000  # per-rank step times kept in the RunRecord (~2 MB of JSON): the last steps


def watchdog_store(timeout_s: float) -> object | None:
    """A client of the launcher's store (torchrun's agent store, which outlives the workers), under a
    prefix per torchrun attempt; None outside torchrun."""
    import datetime

    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    try:
        base = dist.TCPStore(addr, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    except (RuntimeError, OSError) as e:  # the run goes on without the watchdog, and says so
        print(f"warning: hang watchdog off: cannot reach the launcher's store {addr}:{port} ({e})",
              file=sys.stderr, flush=True)
        return None
    return dist.PrefixStore(f"meshplan/watchdog/attempt_{attempt}/", base)


def pg_timeout_s(timeout_s: float, hang_timeout_s: float) -> float:
    """The process-group timeout: at least a minute past the hang timeout, so the watchdog names the stuck
    rank before a collective times out (NCCL would abort the process without a word)."""
    return max(timeout_s, hang_timeout_s + 60.0) if hang_timeout_s > 0 else timeout_s


def oom_facts(exc: BaseException, *, rank: int, step: int, phase: str, plan: object, pp_rank: int,
              model: str) -> OomFacts:
    import torch

    from meshplan.runtime.record.run_record import peak_mem_bytes

    pred = list(getattr(plan.predicted, "peak_mem_bytes", []) or [])  # type: ignore[attr-defined]
    cluster = getattr(plan, "cluster", {}) or {}
    limit = int(cluster.get("mem_bytes", 0) or 0) - int(cluster.get("mem_reserved_bytes", 0) or 0)
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return OomFacts(rank=rank, step=step, phase=phase, measured_peak_bytes=peak_mem_bytes(),
                    requested_bytes=requested_bytes(str(exc)),
                    predicted_peak_bytes=int(pred[pp_rank]) if pp_rank < len(pred) else 0,
                    limit_bytes=max(limit, 0), memory_kind="CUDA max allocated" if cuda else "host peak RSS",
                    model=model, world_size=int(getattr(plan, "world_size", 0)), host=isinstance(exc, MemoryError))


def explain(exc: BaseException, *, rank: int, step: int, phase: str, plan: object, pp_rank: int,
            model: str) -> tuple[str, str] | None:
    """(fault kind, the one message) for a fault meshplan can explain, else None."""
    from meshplan.runtime.weights.files import CheckpointError

    if is_oom(exc):
        return "oom", oom_facts(exc, rank=rank, step=step, phase=phase, plan=plan, pp_rank=pp_rank,
                                model=model).message()
    if isinstance(exc, DataChangedError):
        return "data", f"rank {rank}: {exc}"
    if isinstance(exc, CheckpointError) and phase == "checkpoint":
        return "disk", f"step {step}: {exc}"
    return None


def stop_on_fault(exc: BaseException, wd: object, *, rank: int, step: int, plan: object, pp_rank: int,
                  model: str) -> None:
    """Called with whatever ended the training loop; never returns (``os._exit``) except for a signal.

    A fault another rank posted first (this rank's collective broke because that rank stopped): exit
    quietly with its code. A fault meshplan explains (``explain``), a user's mistake (one line, exit 2 as
    ``cli_main``) or any other error (its traceback, then one line naming rank, step and phase): post it
    (every rank's watchdog then ends its process), say it once, exit.
    """
    import traceback

    from meshplan.errors import MeshplanError
    from meshplan.runtime.loop.watchdog import FAULT_EXIT

    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        raise exc
    phase = getattr(wd, "phase", "?")
    known = explain(exc, rank=rank, step=step, phase=phase, plan=plan, pp_rank=pp_rank, model=model)
    user = isinstance(exc, (MeshplanError, ValueError, FileNotFoundError))
    peer = wd.posted() if known or user else wd.wait_posted(5.0)  # type: ignore[attr-defined]
    if peer is not None and peer.get("rank") != rank:
        _exit(FAULT_EXIT.get(str(peer.get("kind")), 1))
    if known is not None:
        kind, message = known
        code = FAULT_EXIT[kind]
    elif user:
        kind, message, code = "error", str(exc), 2
    else:
        traceback.print_exception(exc)
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        kind, message, code = "error", f"rank {rank} failed at step {step} in {phase}: {type(exc).__name__}: {first}", 1
        if any(w in str(exc) for w in PEER_GONE):
            message += ("; another rank's process probably died without a word (killed, e.g. by the kernel's "
                        "out-of-memory killer, or crashed): the launcher's report above names it and its exit signal")
    if wd.post(kind, message):  # type: ignore[attr-defined]
        report(message)
    _exit(code)


def _exit(code: int) -> None:
    """End this process now: a rank whose peers are gone must not wait in the process group's teardown."""
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)


def gather_rank_times(
    own_s: list[float], wait_s: list[float], cpu_s: list[float] | None = None
) -> tuple[list[list[float]], list[list[float]], list[list[float]]]:
    """Every rank's per-step own, wait and CPU times (one all_gather_object at the end of the run), the
    last steps only when world x steps exceeds ``MAX_RANK_TIME_VALUES``."""
    import torch.distributed as dist

    from meshplan.runtime.launch import collectives

    keep = max(1, MAX_RANK_TIME_VALUES // max(dist.get_world_size(), 1))
    mine = tuple([round(x, 6) for x in xs[-keep:]] for xs in (own_s, wait_s, cpu_s or []))
    parts = collectives.all_gather_object(mine)
    return ([list(p[0]) for p in parts], [list(p[1]) for p in parts],  # type: ignore[index]
            [list(p[2]) for p in parts])  # type: ignore[index]  # fmt: skip
