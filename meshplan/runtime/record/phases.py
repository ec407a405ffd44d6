"""Per-phase time of a training step, measured with torch's profiler beside the plan's prediction.

Phases (seconds per step, one rank): ``forward`` (every forward of the step, the loss included:
model forward or each pipeline stage's ``forward_one_chunk``), ``backward`` (``loss.backward()``,
or each stage's ``backward_one_chunk`` and, under zero-bubble, ``backward_weight_one_chunk``),
``optimizer`` (fp16 unscale, gradient-norm clipping, the update), ``comm`` (exposed communication:
waiting for the bucketed gradient all-reduces, tied-weight and expert/context gradient reductions,
the loss all-reduce), ``bubble`` (pipelining only: time inside the schedule that is neither a
forward nor a backward chunk: waiting for a neighbour's activations or gradients, and the sends),
``other`` (the rest of the step: batch slicing, bookkeeping). Collectives that run inside forward
or backward (TP, FSDP2's all-gathers and reduce-scatters, DDP's bucket all-reduces) count in
those phases, as the cost model's stage times and overlap rules count them.

Beside each phase's wall time, the CPU seconds the rank's process (every thread: gloo's included) used
inside it (``measured_cpu_s``, ``time.process_time`` at the span edges, summed): a phase whose CPU is
well below its wall time waited, for a peer or for a core other processes held.

How: ``PhaseSpans`` marks each phase with ``torch.profiler.record_function`` ranges
(``meshplan::<phase>``), only while ``enabled`` (the timed steps carry no profiler and no ranges).
``measure(pm, batches)`` runs the given extra steps under ``torch.profiler.profile`` (CPU
activity), unions each phase's ranges and averages over the steps; on CUDA the spans synchronize
the device at their edges so the host ranges are device time. Every rank measures itself;
``gather`` collects the ranks and ``record_phases`` keeps, for the run record, the busiest rank
(largest forward + backward, the cost model's critical path) beside the plan's phases for its
busiest pipeline rank (``predicted_phases``). No planner import.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from meshplan.plan import Plan
from meshplan.plan.phases import predicted_phases  # torch-free: the planner's calibration uses it too
from meshplan.runtime.launch import collectives

PHASES = ("forward", "backward", "optimizer", "comm", "bubble", "other")
PREFIX = "meshplan::"
_SCHEDULE = "schedule"  # the pipeline schedule's whole step: bubble = schedule - forward - backward


class PhaseSpans:
    """Profiler ranges around the phases of a step; free when ``enabled`` is False."""

    def __init__(self) -> None:
        self.enabled = False
        self.cuda = False
        self.on_enter: Callable[[str], None] | None = None  # told each phase entered (the hang watchdog)
        self.cpu_s: dict[str, float] = {}  # process CPU seconds inside each phase's spans while enabled

    @contextlib.contextmanager
    def span(self, phase: str) -> Iterator[None]:
        if self.on_enter is not None:
            self.on_enter(phase)
        if not self.enabled:
            yield
            return
        if self.cuda:
            torch.cuda.synchronize()
        c0 = time.process_time()
        with torch.profiler.record_function(PREFIX + phase):
            yield
            if self.cuda:
                torch.cuda.synchronize()
        self.cpu_s[phase] = self.cpu_s.get(phase, 0.0) + time.process_time() - c0

    def wrap(self, obj: Any, method: str, phase: str) -> None:
        """Run ``obj.method`` inside a ``phase`` span (pipeline stages' chunk methods)."""
        inner: Callable[..., Any] = getattr(obj, method)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with self.span(phase):
                return inner(*args, **kwargs)

        setattr(obj, method, wrapped)


def watch_stages(spans: PhaseSpans, stages: Iterable[Any]) -> None:
    """Mark the forward, backward and weight-gradient chunks of torch ``PipelineStage`` objects."""
    for st in stages:
        spans.wrap(st, "forward_one_chunk", "forward")
        spans.wrap(st, "backward_one_chunk", "backward")
        spans.wrap(st, "backward_weight_one_chunk", "backward")


def _union_s(ranges: list[tuple[float, float]]) -> float:
    """Total length (us -> s) of the union of [start, end) ranges."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(ranges):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total / 1e6


def phases_from_events(events: Iterable[Any], steps: int, step_s: float) -> dict[str, float]:
    """Seconds per step of each phase from profiler ``events`` (FunctionEvent-like: ``name`` and
    ``time_range.start/end`` in us) over ``steps`` profiled steps whose mean wall time is ``step_s``."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e.name.startswith(PREFIX):
            spans.setdefault(e.name[len(PREFIX):], []).append((e.time_range.start, e.time_range.end))
    per = {k: _union_s(v) / max(steps, 1) for k, v in spans.items()}
    out = {p: per.get(p, 0.0) for p in ("forward", "backward", "optimizer", "comm")}
    out["bubble"] = max(0.0, per[_SCHEDULE] - out["forward"] - out["backward"]) if _SCHEDULE in per else 0.0
    out["other"] = max(0.0, step_s - sum(out.values()))
    return out


def measure(pm: Any, batches: Iterable[tuple[Any, Any]], *, local: bool = False) -> dict[str, float]:
    """Run one step per batch of ``pm`` (a ``ParallelModel``) under torch's profiler; this rank's
    seconds per step per phase.

    The steps are real steps (they update the model): callers run them after the timed steps.
    """
    from torch.profiler import ProfilerActivity, profile

    # kineto prints "profiler_start/stop" lines on stderr at every profile; a user's run log is not the place
    os.environ.setdefault("KINETO_LOG_LEVEL", "99")
    pm.phase_spans.cuda = pm.env.device.type == "cuda"
    pm.phase_spans.enabled = True
    pm.phase_spans.cpu_s = {}
    walls: list[float] = []
    step_cpu = 0.0  # around the steps only: the profiler's own work at its exit is not a step's
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for x, y in batches:
                c0 = time.process_time()
                pm.step(x, y, local=local)
                step_cpu += time.process_time() - c0
                walls.append(pm.step_times_s[-1])
    finally:
        pm.phase_spans.enabled = False
    n = len(walls)
    out = phases_from_events(prof.events(), n, sum(walls) / n if n else 0.0)
    out.update(cpu_phases(pm.phase_spans.cpu_s, n, step_cpu / max(n, 1)))
    return out


def cpu_phases(cpu_s: dict[str, float], steps: int, step_cpu_s: float) -> dict[str, float]:
    """``{phase}_cpu`` seconds per step from the spans' summed CPU seconds over ``steps`` steps (bubble:
    the schedule's less its forwards and backwards; other: the step's CPU less the phases')."""
    per = {k: v / max(steps, 1) for k, v in cpu_s.items()}
    out = {f"{p}_cpu": per.get(p, 0.0) for p in ("forward", "backward", "optimizer", "comm")}
    if _SCHEDULE in per:
        out["bubble_cpu"] = max(0.0, per[_SCHEDULE] - out["forward_cpu"] - out["backward_cpu"])
    out["other_cpu"] = max(0.0, step_cpu_s - sum(out.values()))
    return out


def gather(mine: dict[str, float]) -> list[dict[str, float]]:
    """Every rank's phases, in rank order (one all_gather_object; every rank calls it)."""
    if not dist.is_initialized():
        return [mine]
    return collectives.all_gather_object(mine)


def record_phases(by_rank: list[dict[str, float]], plan: Plan, *, steps: int) -> dict[str, Any]:
    """The RunRecord's ``phases``: per phase {measured_s, predicted_s} for the busiest rank, and how."""
    busiest = max(range(len(by_rank)), key=lambda r: by_rank[r]["forward"] + by_rank[r]["backward"])
    pred = predicted_phases(plan)
    out: dict[str, Any] = {p: {"measured_s": by_rank[busiest][p], "predicted_s": pred[p]} for p in PHASES}
    for p in PHASES:  # the process CPU seconds inside the phase (measure(); absent in older callers' dicts)
        if f"{p}_cpu" in by_rank[busiest]:
            out[p]["measured_cpu_s"] = by_rank[busiest][f"{p}_cpu"]
    out["how"] = {
        "method": "torch.profiler record_function ranges (CPU wall time; CUDA synchronized at the span edges); "
                  "measured_cpu_s: the process's CPU seconds (time.process_time) inside the same spans",
        "profiled_steps": steps,
        "note": "extra steps after the timed ones (not in the step times); measured on the busiest rank",
        "rank": busiest,
        "measured_s_by_rank": by_rank,
    }
    return out


def largest_mismatch(phases: dict[str, Any]) -> tuple[str, float, float] | None:
    """(phase, measured s, predicted s) with the largest absolute difference, or None."""
    rows = [(k, v["measured_s"], v["predicted_s"]) for k, v in phases.items()
            if isinstance(v, dict) and "measured_s" in v and "predicted_s" in v]
    return max(rows, key=lambda r: abs(r[1] - r[2]), default=None)


def mismatch_text(phases: dict[str, Any], *, comparable: bool = True) -> str:
    """``largest phase mismatch: backward 180 ms measured / 52 ms predicted (+246%)`` ("" without phases)."""
    worst = largest_mismatch(phases)
    if worst is None:
        return ""
    name, meas, pred = worst
    pct = f" ({meas / pred - 1:+.0%})" if comparable and pred > 0 else ""
    return f"largest phase mismatch: {name} {meas * 1e3:.1f} ms measured / {pred * 1e3:.1f} ms predicted{pct}"
