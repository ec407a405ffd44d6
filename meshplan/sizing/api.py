"""``meshplan.capacity``: how many GPUs of which kind, how long and at what cost (predicted).

``capacity(model, tokens=, gpus=, clusters=)`` traces the model once, plans it on every cluster
kind at every GPU count (``sizing.sweep``: one costing memo per kind, reused across sizes) and
returns one ``CapacityRow`` per (kind, count) with the best plan, its predicted tokens/s, MFU,
peak memory, days to train, GPU-hours and cost (where a price is given), each time and cost with
the ± band of the cost model's measured error (``sizing.band``; the scaling column its own,
``ScalingBand``), and the marks of
``sizing.rows.mark_rows`` (Pareto front, deadline and budget picks, scaling efficiency < 80%).
``capacity_report`` returns the same rows with what a reader needs beside them (the band's
source, the batch rule, the sizes left out); the command prints it (``sizing.text``).

Global batch: ``global_batch`` (sequences as an int or "512seq", tokens as "4M" / "4Mtok"), else
the rule ``DEFAULT_BATCH_TOKENS`` tokens in whole sequences, the same at every size (the question
is how fast one training run goes, so the batch the run trains with does not grow with the
cluster). No torch import unless ``model`` is a torch module.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from meshplan.cost_models.hardware import ClusterSpec
from meshplan.cost_models.memory import OPTIMIZERS
from meshplan.graph import ModelGraph
from meshplan.partition.cuts import layer_ranges
from meshplan.profile.local import describe, is_local, local_profile
from meshplan.sizing.band import ErrorBand, ScalingBand, load_error_band, load_scaling_band
from meshplan.sizing.parse import (
    BatchSpec,
    GpuCounts,
    parse_batch,
    parse_budget,
    parse_deadline,
    parse_gpus,
    parse_prices,
    parse_tokens,
    si,
)
from meshplan.sizing.rows import CapacityRow, mark_rows, training_figures
from meshplan.sizing.sweep import SweepPoint, plan_points, sweep_sizes

#: the default global batch: 4M tokens (2^22), Llama 2's pre-training batch, in whole sequences
DEFAULT_BATCH_TOKENS = 2**22


@dataclass(frozen=True)
class CapacityReport:
    """The rows and what the output says beside them."""

    model: str
    tokens: int
    rows: tuple[CapacityRow, ...]
    band: ErrorBand
    batch_rule: str  # how the global batch was chosen
    skipped: tuple[str, ...] = ()  # sizes left out of a range, with why
    prices: dict[str, float] = field(default_factory=dict)
    deadline_days: float | None = None
    budget: float | None = None
    seconds: float = 0.0  # wall time of the whole question (trace + searches)
    trace_seconds: float = 0.0
    scaling_band: ScalingBand | None = None  # the scaling column's own band (``sizing.band``)


def _graph(model: Any, seq_len: int | None, progress: Callable[[str], None]) -> ModelGraph:
    if isinstance(model, ModelGraph):
        return model
    if isinstance(model, str | Path):
        from meshplan.loading import load_graph

        return load_graph(str(model), seq=seq_len, use_cache=True, progress=progress)
    from meshplan.models.registry import default_inputs
    from meshplan.trace import trace_model

    inputs = default_inputs(model, batch_size=1, seq_len=seq_len)
    if inputs is None:
        raise ValueError(f"cannot build example inputs for {type(model).__name__}; trace it first "
                         "(meshplan.trace_model) and pass the ModelGraph")  # fmt: skip
    return trace_model(model, inputs)


def _clusters(clusters: str | Sequence[str]) -> list[str]:
    names = [c.strip().lower() for c in (clusters.split(",") if isinstance(clusters, str) else clusters) if c.strip()]
    if not names:
        raise ValueError("no cluster kind given; name presets, e.g. h100,h200,a100-80g")
    for n in names:
        if not is_local(n):
            ClusterSpec.preset(n)  # ValueError naming the presets
    return list(dict.fromkeys(names))


def batch_rule(spec: BatchSpec | None, seq_len: int) -> tuple[int, str]:
    """(sequences per step, the line saying how they were chosen)."""
    if spec is None:
        seqs = max(1, round(DEFAULT_BATCH_TOKENS / seq_len))
        why = (f"rule: {si(DEFAULT_BATCH_TOKENS)} tokens (2^22, Llama 2's pre-training batch) in whole sequences, "
               "the same at every size; change it with --global-batch (512 = sequences, 4M = tokens)")  # fmt: skip
    else:
        seqs = spec.sequences_for(seq_len)
        why = f"--global-batch {spec.describe()}"
    return seqs, f"global batch {seqs} sequences x {seq_len} tokens = {si(seqs * seq_len)} tokens per step ({why})"


@dataclass(frozen=True)
class Question:
    """The capacity question, checked (``ask``): everything but the model."""

    tokens: int
    counts: GpuCounts
    kinds: tuple[str, ...]
    prices: dict[str, float]
    deadline_days: float | None
    budget: float | None
    batch: BatchSpec | None
    dtype: str
    jobs: int
    band: ErrorBand
    optimizer: str = "adam"
    scaling_band: ScalingBand | None = None


def ask(
    *,
    tokens: str | int | float,
    gpus: str | int | Sequence[int],
    clusters: str | Sequence[str] = ("h100",),
    prices: str | Sequence[str] | dict[str, float] | None = None,
    deadline: str | float | None = None,
    budget: str | float | None = None,
    global_batch: str | int | None = None,
    dtype: str = "bf16",
    jobs: int = 1,
    error_band: ErrorBand | str | Path | None = None,
    optimizer: str = "adam",
    scaling_band: ScalingBand | str | Path | None = None,
) -> Question:
    """Parse and check the question (``ValueError``, one line, before anything is traced)."""
    kinds = _clusters(clusters)
    price = parse_prices(prices)
    unknown = sorted(set(price) - set(kinds))
    if unknown:
        raise ValueError(f"price given for {', '.join(unknown)}, which is not among the clusters {', '.join(kinds)}")
    money = parse_budget(budget)
    if money is not None and not price:
        raise ValueError("--budget needs prices: give --price KIND=DOLLARS_PER_GPU_HOUR for the cluster kinds")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive integer, got {jobs!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} unknown; use one of {', '.join(OPTIMIZERS)}")
    band = error_band if isinstance(error_band, ErrorBand) else load_error_band(error_band)
    scaling = scaling_band if isinstance(scaling_band, ScalingBand) else load_scaling_band(scaling_band)
    return Question(tokens=parse_tokens(tokens), counts=parse_gpus(gpus), kinds=tuple(kinds), prices=price,
                    deadline_days=parse_deadline(deadline), budget=money, batch=parse_batch(global_batch),
                    dtype=dtype, jobs=jobs, band=band, optimizer=optimizer, scaling_band=scaling)  # fmt: skip


def answer(graph: ModelGraph, q: Question, *, progress: Callable[[str], None] | None = None,
           started: float | None = None, when_idle: Callable[[], None] | None = None) -> CapacityReport:
    """Plan ``graph`` for every kind and size of ``q`` and make the rows (``started``: when the
    question was asked, for the reported wall time; default now; ``when_idle``: run once while a
    CPU is idle in the sweep, ``sweep.plan_points``)."""
    t0 = time.perf_counter() if started is None else started
    t_trace = time.perf_counter() - t0
    say = progress or (lambda _m: None)
    seqs, rule = batch_rule(q.batch, graph.seq_len)
    n_layers = len(layer_ranges(graph))  # the most pipeline stages the planner can cut
    tasks: list[tuple[str, int]] = []
    skipped: list[str] = []
    for kind in q.kinds:
        if is_local(kind):  # this machine: measured (or read from the cache) once, before the searches fork
            say(describe(local_profile(log=say, say=say)[0], "N"))
        # local: each size is one node of that many copies of this machine's device
        per_node = 1 if is_local(kind) else ClusterSpec.preset(kind).devices_per_node
        sizes, left = sweep_sizes(q.counts, devices_per_node=per_node, batch_seqs=seqs, num_layers=n_layers)
        tasks += [(kind, n) for n in sizes]
        skipped += [f"{kind} {s}" for s in left]
    if not tasks:
        raise ValueError(f"no GPU count in {q.counts.lo}-{q.counts.hi} can be planned: " + "; ".join(skipped[:3]))
    say(f"{graph.model_name}: {len(tasks)} plans ({', '.join(q.kinds)}), {rule}")
    points = plan_points(graph, tasks, seqs, jobs=q.jobs, progress=say, when_idle=when_idle, dtype=q.dtype,
                         optimizer=q.optimizer)  # fmt: skip
    rows = [_row(p, q.tokens, seqs, graph.seq_len, q.prices.get(p.cluster), q.band.median) for p in points]
    rows = mark_rows(rows, deadline_days=q.deadline_days, budget=q.budget)
    return CapacityReport(
        model=graph.model_name, tokens=q.tokens, rows=tuple(rows), band=q.band, batch_rule=rule,
        skipped=tuple(skipped), prices=q.prices, deadline_days=q.deadline_days, budget=q.budget,
        seconds=time.perf_counter() - t0, trace_seconds=t_trace, scaling_band=q.scaling_band,
    )  # fmt: skip


def capacity_report(
    model: Any,
    *,
    seq_len: int | None = None,
    progress: Callable[[str], None] | None = None,
    **question: Any,
) -> CapacityReport:
    """The capacity question answered (see the module docstring); ``question``: the keywords of
    ``ask``. Bad input raises ``ValueError`` before anything is traced."""
    t0 = time.perf_counter()
    q = ask(**question)
    graph = _graph(model, seq_len, progress or (lambda _m: None))
    return answer(graph, q, progress=progress, started=t0)


def _row(p: SweepPoint, tokens: int, seqs: int, seq_len: int, price: float | None, band: float) -> CapacityRow:
    base = CapacityRow(cluster=p.cluster, gpus=p.gpus, plan=p.plan, fits=bool(p.plan), global_batch=seqs,
                       seq_len=seq_len, price_per_gpu_hour=price, plan_seconds=p.seconds, reason=p.error)  # fmt: skip
    if not p.plan or p.tokens_per_s <= 0:
        return base
    fig = training_figures(tokens, p.tokens_per_s, p.gpus, price, band)
    return replace(base, step_s=p.step_s, tokens_per_s=p.tokens_per_s, tokens_per_s_per_gpu=p.tokens_per_s / p.gpus,
                   mfu=p.mfu, peak_mem_gib=p.peak_mem_gib, **fig)  # type: ignore[arg-type]  # fmt: skip


def capacity(model: Any, *, tokens: str | int | float, gpus: str | int | Sequence[int],
             clusters: str | Sequence[str] = ("h100",), **kw: Any) -> list[CapacityRow]:
    """One ``CapacityRow`` per cluster kind and GPU count (``pandas.DataFrame(rows)`` tabulates them).

    ``model``: a zoo name (``"llama3-70b"``), ``file.py:factory``, a traced ``ModelGraph`` or a torch
    module. ``tokens``: ``"15T"`` or a number. ``gpus``: ``"256-8192"`` (swept), ``"256,512"`` or a
    list. ``clusters``: preset names. Keywords as ``capacity_report``: ``prices`` ({"h100": 2.49} or
    "h100=2.49"), ``deadline`` ("30d"), ``budget`` ("2.5M"), ``global_batch``, ``seq_len``,
    ``dtype``, ``jobs``, ``optimizer`` (``cost_models.memory.OPTIMIZERS``, default "adam"), ``progress``,
    ``error_band`` / ``scaling_band`` (a band file other than the packaged ones). Every figure is predicted, with the band in ``days_low`` ..
    ``days_high`` and ``cost_low`` .. ``cost_high``."""
    return list(capacity_report(model, tokens=tokens, gpus=gpus, clusters=clusters, **kw).rows)


__all__ = ["DEFAULT_BATCH_TOKENS", "CapacityReport", "Question", "answer", "ask", "batch_rule", "capacity",
           "capacity_report"]
