"""RunRecord: what a run measured (per-step time, loss, peak memory) beside the Plan's prediction.

Peak memory is ``torch.cuda.max_memory_allocated`` on CUDA; on CPU it is the process's own peak
resident set size (``VmHWM``, ``runtime.launch.host_memory.peak_rss_bytes``; not ``ru_maxrss``, which
carries the launcher's peak into a torchrun worker), which includes the Python interpreter and torch
itself, so it is an upper bound, not the model's share. ``summary_line()`` ends each run, e.g.
``step 412 ms measured, 398 ms predicted (+3.5%)``; the measured figure is the median over steps
after the first ``warmup`` (first steps include shape inference and allocator warm-up). Every rank's own
and waiting time per step (``rank_step_s``, ``rank_wait_s``) name a straggler in that line
(``meshplan.stragglers``).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


def peak_mem_bytes() -> int:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    from meshplan.runtime.launch.host_memory import peak_rss_bytes

    return peak_rss_bytes()


def gather_peak_mem(pp_rank: int, predicted_per_pp_rank: Sequence[int]) -> list[tuple[int, int]]:
    """(measured peak bytes, predicted peak bytes of its pipeline rank) for every world rank; a
    collective (every rank calls it)."""
    import torch

    from meshplan.runtime.launch import collectives

    pred = predicted_per_pp_rank[pp_rank] if pp_rank < len(predicted_per_pp_rank) else 0
    mine = torch.tensor([float(peak_mem_bytes()), float(pred)], dtype=torch.float64)
    return [(int(a), int(b)) for a, b in torch.stack(collectives.all_gather(mine)).tolist()]


@dataclass
class StepRecord:
    step: int
    step_s: float
    loss: float
    peak_mem_bytes: int


@dataclass
class RunRecord:
    plan_summary: str
    model: str
    world_size: int
    predicted_step_s: float
    predicted_peak_mem_bytes: list[int] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    warmup: int = 1
    memory_kind: str = "cpu_peak_rss"
    notes: list[str] = field(default_factory=list)
    precision: str = ""  # what ran: bf16 | fp16 | fp32 ("" in records written before it existed)
    dp_kind: str = ""  # data-parallel kind that ran (the plan's; "none" at dp = 1)
    # gradient-reducing collective calls one rank issued in the last measured step (counted at the call)
    grad_sync_collectives_per_step: int | None = None
    # per world rank: the measured peak over the steps so far, and the plan's prediction for the
    # rank's pipeline stage (``gather_peak_mem``); empty in records of older versions
    rank_peak_mem_bytes: list[int] = field(default_factory=list)
    predicted_rank_peak_mem_bytes: list[int] = field(default_factory=list)
    eval_losses: list[list[float]] = field(default_factory=list)  # [step, held-out loss]
    # "" when the plan's cluster is the machine measured (or unknown); else why the prediction is for
    # another machine (``comparable.not_comparable_reason``): no percentage is printed then
    not_comparable: str = ""
    tokens_per_step: int = 0  # global batch x sequence length (0: not a token model)
    # per phase {"measured_s", "predicted_s"} seconds per step, plus "how" (``runtime.record.phases``;
    # measured on extra profiled steps after the timed ones); empty when not profiled
    phases: dict[str, Any] = field(default_factory=dict)
    # the Plan that ran (Plan.to_dict(); {} in older records): what ``meshplan calibrate`` re-costs
    plan: dict[str, Any] = field(default_factory=dict)
    # per world rank, per step (the last steps when world x steps is large): the rank's own time and
    # the time it waited for the others (``meshplan.stragglers``); empty in older records
    rank_step_s: list[list[float]] = field(default_factory=list)
    rank_wait_s: list[list[float]] = field(default_factory=list)
    # per world rank, per step (as ``rank_step_s``): CPU seconds the rank's process (all its threads)
    # used in the step (``time.process_time``); below the step's wall time when the rank waited or
    # lost its cores to other processes. Empty in older records
    rank_cpu_s: list[list[float]] = field(default_factory=list)
    # the optimizer that ran, as the cost model names it (``cost_models.memory.OPTIMIZERS``: adam,
    # adamw, sgd, sgd-momentum): what ``meshplan calibrate`` re-costs with; "" in older records (the plan's)
    optimizer: str = ""
    # rank 0's start-up, seconds per phase from the worker's start to the end of step 1 (import, meta
    # build, plan checks, process group, materialize, wrapping, first step; ``record.startup``); {} in older records
    startup_s: dict[str, float] = field(default_factory=dict)
    # rank 0's host figures measured by the run after its steps (``record.host_probe``: the ClusterSpec
    # host_* fields in seconds, with device, seconds, how); {} when not probed (a CPU run by default,
    # --host-probe off, older records). ``meshplan calibrate`` puts them in the calibrated cluster
    host: dict[str, Any] = field(default_factory=dict)
    init: str = ""  # how a meta-built model got its values: host-exact | device ("" on a host build / older records)

    def add_eval(self, step: int, loss: float) -> None:
        self.eval_losses.append([step, loss])

    def add(self, step: int, step_s: float, loss: float, mem: int) -> None:
        self.steps.append(StepRecord(step, step_s, loss, mem))

    def add_rank_peaks(self, peaks: list[tuple[int, int]]) -> int:
        """Fold one step's (measured, predicted) bytes per rank in; returns the step's largest measured."""
        if len(self.rank_peak_mem_bytes) != len(peaks):
            self.rank_peak_mem_bytes = [0] * len(peaks)
        self.rank_peak_mem_bytes = [max(a, m) for a, (m, _) in zip(self.rank_peak_mem_bytes, peaks)]
        self.predicted_rank_peak_mem_bytes = [p for _, p in peaks]
        return max((m for m, _ in peaks), default=0)

    @property
    def measured_step_s(self) -> float:
        times = [s.step_s for s in self.steps]
        if not times:
            return 0.0
        kept = times[self.warmup :] or times
        return float(statistics.median(kept))

    @property
    def error_fraction(self) -> float | None:
        if self.predicted_step_s <= 0 or not self.steps:
            return None
        return self.measured_step_s / self.predicted_step_s - 1.0

    @property
    def tokens_per_s(self) -> float | None:
        """Measured: tokens per step / the median measured step time (None without tokens or steps)."""
        s = self.measured_step_s
        return self.tokens_per_step / s if self.tokens_per_step and s > 0 else None

    def summary_line(self) -> str:
        """The end-of-run line: step time measured vs predicted, and the largest mismatch by phase."""
        line = self._step_text()
        if self.phases and self.steps and self.error_fraction is not None:
            from meshplan.runtime.record.phases import mismatch_text

            text = mismatch_text(self.phases, comparable=not self.not_comparable)
            line += f"; {text}" if text else ""
        from meshplan.stragglers import find_stragglers

        for s in find_stragglers(self.rank_step_s, self.rank_wait_s, self.warmup)[:3]:
            line += f"; {s.text()}"
        return line

    def _step_text(self) -> str:
        if not self.steps:
            return "no steps run (already at --steps)"
        ms = self.measured_step_s * 1e3
        if self.error_fraction is None:
            return f"step {ms:.0f} ms measured, no prediction in the plan"
        if self.not_comparable:
            return f"step {ms:.0f} ms measured, {self.predicted_step_s * 1e3:.0f} ms {self.not_comparable}"
        return f"step {ms:.0f} ms measured, {self.predicted_step_s * 1e3:.0f} ms predicted ({self.error_fraction:+.1%})"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["measured_step_s"] = self.measured_step_s
        d["error_fraction"] = self.error_fraction
        d["tokens_per_s"] = self.tokens_per_s
        return d

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> RunRecord:
        d = json.loads(Path(path).read_text())
        d.pop("measured_step_s", None)
        d.pop("error_fraction", None)
        d.pop("tokens_per_s", None)
        d["steps"] = [StepRecord(**s) for s in d.get("steps", [])]
        return cls(**d)
