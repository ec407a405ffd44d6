"""A run record (``run_record.json`` written by ``meshplan run``) read for the report, tolerantly.

The report reads the JSON itself (it never imports ``runtime/``) and accepts records from older
and newer meshplan versions: only ``steps`` is required; every other field may be missing
(``precision``, ``dp_kind``, ``grad_sync_collectives_per_step``, ``tokens_per_s``, ``phases``,
``rank_peak_mem_bytes``, ``predicted_rank_peak_mem_bytes`` were added later), and fields this
reader does not know are kept in ``extra`` and listed by :func:`format_run`.

Tokens/s per step (``RunView.tokens_per_s``) exists only where the record has per-step figures:
a recorded list per step; else the record's ``tokens_per_step`` over each step's measured time;
else, with the global batch and sequence length known (from the record or the plan given beside
it), ``global_batch * seq_len / step_s``, labelled so. A record holding only one run-wide number
(``tokens_per_s``, the run's average) gives ``tokens_per_s_run`` and no per-step series: the
reports show it as one figure, never as a flat "per step" line. Measured step time is the median after the record's ``warmup`` steps,
as ``RunRecord.measured_step_s``. No torch import.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshplan.plan import Plan

KNOWN = {
    "plan_summary", "model", "world_size", "predicted_step_s", "predicted_peak_mem_bytes", "steps", "warmup",
    "memory_kind", "notes", "measured_step_s", "error_fraction", "precision", "dp_kind",
    "grad_sync_collectives_per_step", "tokens_per_s", "phases", "rank_peak_mem_bytes",
    "predicted_rank_peak_mem_bytes", "global_batch_size", "seq_len", "rank_step_s", "rank_wait_s", "tokens_per_step",
}  # fmt: skip
GIB = 2**30


@dataclass
class RunView:
    steps: list[int]
    step_s: list[float]
    loss: list[float]
    peak_mem_bytes: list[int]  # per step, the largest over ranks
    plan_summary: str = ""
    model: str = ""
    world_size: int = 0
    predicted_step_s: float = 0.0
    predicted_peak_mem_bytes: list[int] = field(default_factory=list)  # per pipeline rank
    rank_peak_mem_bytes: list[int] = field(default_factory=list)  # measured, per rank (newer records)
    predicted_rank_peak_mem_bytes: list[int] = field(default_factory=list)  # predicted, per rank
    warmup: int = 1
    memory_kind: str = ""
    precision: str = ""
    dp_kind: str = ""
    grad_sync_collectives_per_step: float | None = None
    tokens_per_s: list[float] = field(default_factory=list)  # per step; empty without per-step figures
    tokens_source: str = ""  # "measured" or how it was computed
    tokens_per_s_run: float | None = None  # one figure for the run: median after warm-up, or the recorded average
    phases: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    rank_step_s: list[list[float]] = field(default_factory=list)  # per rank, per step: own time (newer records)
    rank_wait_s: list[list[float]] = field(default_factory=list)  # per rank, per step: waiting for the others

    @property
    def measured_step_s(self) -> float:
        kept = self.step_s[self.warmup :] or self.step_s
        return float(statistics.median(kept)) if kept else 0.0

    @property
    def error_fraction(self) -> float | None:
        if self.predicted_step_s <= 0 or not self.step_s:
            return None
        return self.measured_step_s / self.predicted_step_s - 1.0


def is_run_record(d: Any) -> bool:
    return isinstance(d, dict) and isinstance(d.get("steps"), list) and "format_version" not in d


def _num(v: Any, name: str, default: float = 0.0) -> float:
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"run record field {name!r} should be a number, got {v!r}")
    return float(v)


def run_view(d: dict[str, Any], plan: Plan | None = None) -> RunView:
    """Read a run-record dict (as ``RunRecord.to_dict`` writes it); ``plan`` fills what it lacks."""
    if not is_run_record(d):
        raise ValueError("not a run record: expected a JSON object with a 'steps' list (written by `meshplan run`)")
    rows = d["steps"]
    for i, s in enumerate(rows):
        if not isinstance(s, dict) or "step_s" not in s:
            raise ValueError(f"run record steps[{i}] has no 'step_s'; is this a run_record.json?")
    v = RunView(
        steps=[int(s.get("step", i + 1)) for i, s in enumerate(rows)],
        step_s=[_num(s["step_s"], "step_s") for s in rows],
        loss=[_num(s.get("loss"), "loss", float("nan")) for s in rows],
        peak_mem_bytes=[int(_num(s.get("peak_mem_bytes"), "peak_mem_bytes")) for s in rows],
        plan_summary=str(d.get("plan_summary", "")), model=str(d.get("model", "")),
        world_size=int(_num(d.get("world_size"), "world_size")),
        predicted_step_s=_num(d.get("predicted_step_s"), "predicted_step_s"),
        predicted_peak_mem_bytes=[int(x) for x in d.get("predicted_peak_mem_bytes") or []],
        rank_peak_mem_bytes=[int(x) for x in d.get("rank_peak_mem_bytes") or []],
        predicted_rank_peak_mem_bytes=[int(x) for x in d.get("predicted_rank_peak_mem_bytes") or []],
        warmup=int(_num(d.get("warmup"), "warmup", 1)), memory_kind=str(d.get("memory_kind", "")),
        precision=str(d.get("precision") or ""), dp_kind=str(d.get("dp_kind") or ""),
        grad_sync_collectives_per_step=None if d.get("grad_sync_collectives_per_step") is None
        else _num(d["grad_sync_collectives_per_step"], "grad_sync_collectives_per_step"),
        phases=d.get("phases") if isinstance(d.get("phases"), dict) else {},
        notes=[str(n) for n in d.get("notes") or []], extra={k: d[k] for k in d if k not in KNOWN},
        rank_step_s=_rank_lists(d.get("rank_step_s"), "rank_step_s"),
        rank_wait_s=_rank_lists(d.get("rank_wait_s"), "rank_wait_s"),
    )  # fmt: skip
    if plan is not None:
        v.plan_summary = v.plan_summary or plan.summary()
        v.model = v.model or plan.model_name
        v.world_size = v.world_size or plan.world_size
        v.predicted_step_s = v.predicted_step_s or plan.predicted.step_s
        v.predicted_peak_mem_bytes = v.predicted_peak_mem_bytes or list(plan.predicted.peak_mem_bytes)
    _tokens(v, d, plan)
    return v


def _rank_lists(v: Any, name: str) -> list[list[float]]:
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(r, list) for r in v):
        raise ValueError(f"run record field {name!r} should be a list per rank of step times, got {type(v).__name__}")
    return [[_num(x, name) for x in r] for r in v]


def _tokens(v: RunView, d: dict[str, Any], plan: Plan | None) -> None:
    tps = d.get("tokens_per_s")
    if isinstance(tps, dict):
        tps = tps.get("measured", tps.get("per_step"))
    per_step = d.get("tokens_per_step")
    batch = d.get("global_batch_size") or (plan.global_batch_size if plan else 0)
    seq = d.get("seq_len") or (plan.seq_len if plan else 0)
    if isinstance(tps, list) and len(tps) == len(v.steps):
        v.tokens_per_s, v.tokens_source = [float(x) for x in tps], "measured"
    elif isinstance(per_step, int) and per_step > 0 and v.step_s:
        v.tokens_per_s = [per_step / t if t > 0 else 0.0 for t in v.step_s]
        v.tokens_source = f"measured: {per_step:,} tokens per step / each step's time"
    elif isinstance(tps, (int, float)) and not isinstance(tps, bool):
        v.tokens_per_s_run, v.tokens_source = float(tps), "measured: run average"  # no per-step figures
        return
    elif batch and seq and v.step_s:
        v.tokens_per_s = [batch * seq / t if t > 0 else 0.0 for t in v.step_s]
        v.tokens_source = f"computed: {batch} x {seq} tokens / measured step time"
    if v.tokens_per_s:
        kept = v.tokens_per_s[v.warmup :] or v.tokens_per_s
        v.tokens_per_s_run = float(statistics.median(kept))


def load_run(path: str | Path, plan: Plan | None = None) -> RunView:
    try:
        d = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON: {e}") from e
    return run_view(d, plan)


def memory_rows(v: RunView) -> list[tuple[str, int | None, int | None]]:
    """(label, measured bytes, predicted bytes) per rank when the record has per-rank figures,
    else one row of the largest measured peak over ranks beside the largest prediction."""
    if v.rank_peak_mem_bytes:
        pred = v.predicted_rank_peak_mem_bytes
        return [(f"rank {r}", m, pred[r] if r < len(pred) else None) for r, m in enumerate(v.rank_peak_mem_bytes)]
    meas = max(v.peak_mem_bytes) if v.peak_mem_bytes else None
    return [("largest over ranks", meas, max(v.predicted_peak_mem_bytes) if v.predicted_peak_mem_bytes else None)]


def format_run(v: RunView) -> str:
    """The plain-text summary of a run: what was measured beside what was predicted."""
    out = [f"meshplan run record: {v.model or '?'} — {v.plan_summary or '?'} on {v.world_size or '?'} ranks"]
    facts = [f"{len(v.steps)} steps"] + [f"{k} {x}" for k, x in (("precision", v.precision), ("dp", v.dp_kind)) if x]
    out.append("  " + ", ".join(facts))
    err = v.error_fraction
    line = f"  step time: {v.measured_step_s * 1e3:.1f} ms measured (median after {v.warmup} warm-up)"
    out.append(line + (f", {v.predicted_step_s * 1e3:.1f} ms predicted ({err:+.1%})" if err is not None else ""))
    finite = [x for x in v.loss if x == x]
    if finite:
        out.append(f"  loss: {finite[0]:.4f} at step {v.steps[0]} -> {finite[-1]:.4f} at step {v.steps[-1]} (measured)")
    kind = f" ({v.memory_kind})" if v.memory_kind else ""
    for label, meas, pred in memory_rows(v):
        m = f"{meas / GIB:.2f} GiB measured{kind}" if meas is not None else "not measured"
        out.append(f"  memory {label}: {m}" + (f", {pred / GIB:.2f} GiB predicted" if pred is not None else ""))
    if v.tokens_per_s_run is not None:
        out.append(f"  tokens/s: {v.tokens_per_s_run:,.0f} ({v.tokens_source})")
    if v.grad_sync_collectives_per_step is not None:
        out.append(f"  gradient-sync collectives per step: {v.grad_sync_collectives_per_step:g} (measured)")
    for name, val in v.phases.items():
        if isinstance(val, dict) and "measured_s" in val:  # runtime.record.phases: {measured_s, predicted_s}
            pred = val.get("predicted_s")
            out.append(f"  phase {name}: {val['measured_s'] * 1e3:.1f} ms measured"
                       + (f", {pred * 1e3:.1f} ms predicted" if isinstance(pred, (int, float)) else ""))
        elif name == "how" and isinstance(val, dict):
            out.append(f"  phases measured by: {val.get('method', '?')}, {val.get('profiled_steps', '?')} profiled "
                       f"step(s), rank {val.get('rank', '?')}")
        else:
            out.append(f"  phase {name}: {json.dumps(val)}")
    if v.rank_step_s:
        from meshplan.stragglers import spread_text

        out += [f"  {line}" for line in spread_text(v.rank_step_s, v.rank_wait_s, v.warmup)]
    out += [f"  note: {n}" for n in v.notes]
    if v.extra:
        out.append(f"  other fields (not shown): {', '.join(sorted(v.extra))}")
    return "\n".join(out)
