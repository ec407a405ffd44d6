"""Calibration: fit a cluster's efficiency terms to measured runs (``meshplan calibrate``).

A case is one measured run: the traced graph, the Plan that ran, its measured step time and,
when the RunRecord has them, measured seconds per phase and the share of a core its ranks got.
``predict`` re-costs the plan's layout (``planner.api.estimate_graph``: same degrees, microbatches,
schedule, recompute, DP kind) on a candidate ClusterSpec. ``fit`` finds multipliers ``exp(θ_k)`` of
the spec's terms (``TERMS``) that minimize, over the cases,

    Σ_runs with phases Σ_{p in FIT_PHASES} (log pred_p(θ) - log measured_p)²
  + Σ_runs without    (log pred_step(θ) - log measured_step)²
  + Σ_runs (log pred_bwd/fwd(θ) - log measured_bwd/fwd)²      (runs whose record has both phases)
  + λ Σ_k (θ_k / σ_k)²                                       (λ = ``RIDGE``, σ = ``PRIOR_SIGMA``)

by damped Gauss-Newton with a forward-difference Jacobian (``STEP`` in log space). The ridge keeps
terms the runs do not exercise (a Jacobian column of zeros: e.g. the inter-node link in a
one-node run) at their original values, and with fewer runs than terms spreads the correction
over the terms in proportion to σ_k² times their share of the predicted time (a log-normal prior
of width σ_k on each multiplier: the fit is its maximum a posteriori). A multiplier is clamped to
[1/``MAX_FACTOR``, ``MAX_FACTOR``].

**What a run identifies.** A run whose record has its forward and backward phases is fitted phase
by phase, each measured phase against its own predicted terms (``FIT_PHASES``: forward, backward,
and "update", the step after the last backward: the exposed gradient sync and the optimizer step
together), and *not* on its step total: time the model does not price (a pipeline's waits beyond
its simulated bubble, "other") then stays unexplained instead of going into whichever term moves
the total most. A term a run's fitted phases do not depend on keeps its prior: a pp run's phases
hold no collective (its sends are in the bubble), so it leaves the collective latency where it
started; a dp ZeRO-1 run's update phase (its per-tensor broadcasts) or a tp run's forward (its
per-layer all-reduces) set it. The bubble is fitted only with ``use_phases``. A run without phases
falls back to its step total (all it has).

**Contention** (``Case.core_share``). On a shared CPU host a rank's process gets a fraction of a
core; its wall time is then its full-core time over that share (``ClusterSpec.contended``: a
uniform stretch). The share is measured per run (``measured_core_share``: the busiest rank's CPU
seconds against wall seconds in its forward and backward, else every rank's CPU seconds per step
against the step), an input of the prediction, never a fitted term: with it the fit finds the
machine's full-core terms, and a prediction for another run is judged on the share that run got.

**The run's own host** (``recorded_host``, #33 item 6). On a GPU a small microbatch or recompute
makes the step host-bound (``cost_models.host``: max(device time, dispatched ops x ``host_op_s``)), and
the host's per-op time differs from machine to machine of one GPU kind (gpt2-xl mb2x4 recompute=full:
742 ms and 1173 ms on two H100 hosts). A GPU-bound run's step time and CPU seconds cannot show it (its
CUDA synchronizations spin: CPU seconds = wall seconds), so ``meshplan run`` measures its host after its
steps (RunRecord ``host``, ``runtime.record.host_probe``) and ``calibrate`` starts the fit from the
cluster with those figures (median over the records), which the calibrated cluster keeps: a fit on a
GPU-bound run then prices a host-bound configuration on the host that ran.

Terms and what each scales in the ClusterSpec (``apply_terms``):

- ``gemm``: GEMM efficiency (``matmul_efficiency`` and every row of ``matmul_efficiency_by_flops``,
  so its shape by size is kept); past an efficiency of 1 the rest goes into ``peak_flops``;
- ``memory``: the bandwidth memory-bound kernels reach (``mem_efficiency``, the rest into
  ``mem_bw_bytes_per_s``);
- ``op_overhead``: eager per-op host time (``op_overhead_s``, ``bwd_op_overhead_s``, and
  ``kernel_floor_s``; on a spec with a host-dispatch floor, ``host_op_s`` instead of the first two;
  not the optimizer phase's per-tensor host figure ``host_optimizer_tensor_s``, a measured host property
  kept as measured: scaled with ``host_op_s``, one run's optimizer phase, 1.5-2x its price on both GPUs
  measured, moved ``host_op_s`` x2.4 and the host-bound runs with it, ``cost_models.optimizer_phase``);
  nor the DTensor host figures of a CPU profile (``host_tp_linear_fwd_s``, ``host_tp_linear_bwd_s``,
  ``host_dtensor_param_s``: ``profile.tp_host``), CPU seconds of their own mechanism measured on a rank
  pair, kept as measured: scaled with this term, a one-run fit (the term's wide prior lets it take
  what the compute terms cannot) moved them by x0.57-x0.64 and the transfer in CPU seconds on
  BENCHMARKS.md's stop-9 window went from 15 % to 30 % median (#33 item 6);
- ``intra_bw`` / ``intra_latency``: collectives inside a node; ``inter_bw`` / ``inter_latency``:
  across nodes;
- ``backward``: the speed of the backward parts against the forward (``backward_speed``: every
  node's input- and weight-gradient time is divided by it). A step time alone cannot tell it
  from ``gemm`` (only forward + backward is seen); the backward : forward ratio the run measured
  (``Case.measured_ratio``, from the RunRecord's forward and backward phases of its busiest rank)
  can, and it is read whenever the record has those phases: a ratio is free of the profiler's
  overhead (it inflates both) and of where the other phases' boundaries lie. Schedules whose
  makespan depends on the split (pipelines: B and W fill the bubbles) and recompute (a second
  forward) need it; on this CPU eager autograd runs backward 1.5-2x slower than its FLOPs say.
- ``overlap``: the overlap fraction ``comm_overlap``, the share of the communication the cost
  model counts as hidden under compute that the machine really hides (capped at 1). A term at the
  top of its range (``comm_overlap`` = 1, as presets have it) is differenced downward (``STEP``
  negative for it), or its Jacobian column would be 0 and the fit could never lower it.

Phases compared (the RunRecord's "phases" written by ``runtime.record.phases``; any may be missing):
forward, backward, optimizer, comm (exposed), bubble, each against ``plan.phases.predicted_phases``
of the re-costed plan (the definition the runtime records its predictions with). The re-costing
uses the optimizer the run used (the RunRecord's ``optimizer``; older records: the plan's), so an
SGD run fits its optimizer phase and memory against SGD's cost, not the plan's Adam.

``calibrate(records, cluster)`` (``meshplan.calibrate``, what ``meshplan calibrate`` runs) reads
RunRecord files, traces each run's model, fits and returns the calibrated ClusterSpec. No torch
import (tracing imports it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from meshplan.cost_models.hardware import HOST_FIELDS, ClusterSpec
from meshplan.cost_models.memory import OPTIMIZERS
from meshplan.graph import ModelGraph
from meshplan.plan import Plan, Prediction
from meshplan.plan.phases import predicted_phases

TERMS = ("gemm", "memory", "op_overhead", "intra_bw", "intra_latency", "inter_bw", "inter_latency", "overlap",
         "backward")
#: prior width of each term's log multiplier (how far off the starting spec may plausibly be):
#: GEMM and memory efficiency are known within ~2x from datasheets and kernels; per-op host time,
#: link bandwidth and especially collective latency depend on the software stack (NCCL vs gloo,
#: eager dispatch, load) and can be off by 10x or more
PRIOR_SIGMA = {"gemm": 0.7, "memory": 0.7, "op_overhead": 2.3, "intra_bw": 1.2, "intra_latency": 2.3,
               "inter_bw": 1.2, "inter_latency": 2.3, "overlap": 1.2, "backward": 0.7}  # fmt: skip
RIDGE = 1e-3
STEP = 0.05
MAX_FACTOR = 1e3
#: weight of each fitted phase's residual (a run fitted on its phases is not fitted on its step)
PHASE_WEIGHT = 1.0
#: weight of a run's backward : forward ratio residual (as much as its step time)
RATIO_WEIGHT = 1.0
#: an eager op's host time when the spec has none to scale (presets): the multiplier acts on this
DEFAULT_OP_OVERHEAD_S = 1e-6


@dataclass(frozen=True)
class Case:
    """One measured run: what ran and what it measured (seconds)."""

    name: str
    graph: ModelGraph
    plan: Plan
    measured_step_s: float
    measured_phases: dict[str, float] = field(default_factory=dict)
    #: measured backward seconds / forward seconds of the busiest rank (``phase_ratio``); None: unknown
    measured_ratio: float | None = None
    #: the optimizer that ran (the cost model's name; RunRecord.optimizer); "": the plan's
    optimizer: str = ""
    #: the share of a core each rank got (``measured_core_share``; an input): the case is predicted
    #: on ``ClusterSpec.contended(core_share)``; None: a full core (as the spec is)
    core_share: float | None = None


@dataclass(frozen=True)
class Fit:
    """What ``fit`` found: the calibrated spec, the multipliers, and per case (predicted step
    seconds before, after, measured)."""

    spec: ClusterSpec
    factors: dict[str, float]
    rows: list[tuple[str, float, float, float]]
    iterations: int
    #: terms no fitted residual of the runs depends on (a zero Jacobian column at the start): they
    #: kept their prior value, the runs say nothing about them (e.g. the collective latency from a pp run)
    unconstrained: tuple[str, ...] = ()

    def error(self, which: int) -> list[float]:
        """Relative step-time errors of every case, ``which`` = 1 before, 2 after the fit."""
        return [r[which] / r[3] - 1.0 for r in self.rows]


def _scaled_eff(eff: float, f: float) -> tuple[float, float]:
    """(efficiency, extra peak factor) for an efficiency multiplied by ``f``, efficiency kept <= 1."""
    e = eff * f
    return (e, 1.0) if e <= 1.0 else (1.0, e)


def apply_terms(spec: ClusterSpec, factors: dict[str, float]) -> ClusterSpec:
    """``spec`` with each term of ``factors`` (name -> multiplier of the speed it stands for;
    > 1 is faster) applied as the module docstring says. Unknown names are a ValueError."""
    bad = set(factors) - set(TERMS)
    if bad:
        raise ValueError(f"unknown calibration terms {sorted(bad)}; use {TERMS}")
    g = factors.get("gemm", 1.0)
    eff, peak_x = _scaled_eff(spec.matmul_efficiency, g)
    rows = []
    for flops, ef, eb in spec.matmul_efficiency_by_flops:
        ef2, xf = _scaled_eff(ef, g)
        eb2, xb = _scaled_eff(eb, g)
        peak_x = max(peak_x, xf, xb)
        rows.append([flops, ef2, eb2])
    if peak_x > 1.0:  # some efficiency hit 1: put the rest in the peak, scale the others back
        eff = min(1.0, spec.matmul_efficiency * g / peak_x)
        rows = [[fl, min(1.0, ef * g / peak_x), min(1.0, eb * g / peak_x)]
                for fl, ef, eb in spec.matmul_efficiency_by_flops]  # fmt: skip
    m = factors.get("memory", 1.0)
    mem_eff, bw_x = _scaled_eff(spec.mem_efficiency, m)
    o = 1.0 / factors.get("op_overhead", 1.0)  # a faster host: less time per op
    # a GPU spec with a host-dispatch floor (host_op_s): the term scales the floor's per-op time,
    # not an additive per-op cost the GPU's host does not add (cost_models.host)
    floor = spec.host_op_s > 0
    additive = "op_overhead" in factors and not floor
    op_f = (spec.op_overhead_s or DEFAULT_OP_OVERHEAD_S) * o if additive else spec.op_overhead_s
    op_b = (spec.bwd_op_overhead_s or DEFAULT_OP_OVERHEAD_S) * o if additive else spec.bwd_op_overhead_s
    return replace(
        spec,
        matmul_efficiency=eff,
        matmul_efficiency_by_flops=rows,
        peak_flops={k: v * peak_x for k, v in spec.peak_flops.items()},
        mem_efficiency=mem_eff,
        mem_bw_bytes_per_s=spec.mem_bw_bytes_per_s * bw_x,
        op_overhead_s=op_f,
        bwd_op_overhead_s=op_b,
        host_op_s=spec.host_op_s * o,
        kernel_floor_s=spec.kernel_floor_s * o,
        intra_bw_bytes_per_s=spec.intra_bw_bytes_per_s * factors.get("intra_bw", 1.0),
        intra_latency_s=spec.intra_latency_s / factors.get("intra_latency", 1.0),
        inter_bw_bytes_per_s=spec.inter_bw_bytes_per_s * factors.get("inter_bw", 1.0),
        inter_latency_s=spec.inter_latency_s / factors.get("inter_latency", 1.0),
        comm_overlap=min(1.0, spec.comm_overlap * factors.get("overlap", 1.0)),
        backward_speed=spec.backward_speed * factors.get("backward", 1.0),
    )


def predict(case: Case, spec: ClusterSpec) -> Plan:
    """``case``'s layout re-costed on ``spec`` (``estimate_graph`` with every degree, batch,
    schedule, recompute and DP kind of the plan pinned), with the optimizer that ran (``case.optimizer``,
    else the plan's)."""
    from meshplan.planner.api import estimate_graph

    p = case.plan
    if case.core_share is not None:
        spec = spec.contended(min(1.0, case.core_share))
    if p.cp > 1 or p.ep > 1:
        raise ValueError(f"{case.name}: calibration re-costs a plan with estimate_graph, which takes no cp/ep "
                         f"(plan has cp={p.cp}, ep={p.ep})")  # fmt: skip
    est = estimate_graph(
        case.graph, p.world_size, tp=p.tp, pp=p.pp, dp=p.dp, schedule=p.schedule,
        num_microbatches=p.num_microbatches, recompute=p.recompute, micro_batch_size=p.micro_batch_size,
        global_batch_size=p.global_batch_size, virtual_stages=p.virtual_stages,
        dp_kind=p.dp_kind if p.dp > 1 else None, sequence_parallel=p.sequence_parallel,
        cluster=spec.with_devices(p.world_size), dtype=p.dtype, optimizer=case.optimizer or p.optimizer, quantization=p.quantization,
    )  # fmt: skip
    return est


#: the RunRecord phases compared (``plan.phases.predicted_phases``; "other" is what is left over)
PHASES = ("forward", "backward", "optimizer", "comm", "bubble")
#: the phases every run that has them is fitted on (module docstring), each against its own
#: predicted terms. "update" = "optimizer" + "comm": the step after the last backward, taken as one
#: because the runtime measures ZeRO-1's parameter broadcasts inside its optimizer span where the
#: cost model prices them as exposed DP communication
FIT_PHASES = ("forward", "backward", "update")
#: the phases whose presence makes a run fitted phase by phase (else on its step total)
COMPUTE_PHASES = ("forward", "backward")


def measured_phases(phases: Any, step_s: float | None = None) -> dict[str, float]:
    """Measured seconds per compared phase (``PHASES``) from a RunRecord's "phases" ({} when missing).

    Reads the runtime's ``{name: {"measured_s": s, "predicted_s": s}, "how": ...}`` (and the
    shapes ``{name: {"measured": s}}`` / ``{"measured": {name: s}}``); phases of 0 s are dropped.
    With ``step_s`` (the measured step time) the phases are scaled so that they and "other" add up
    to it: the runtime measures them on extra steps under torch's profiler, whose overhead
    inflates every phase; the phases then give the split of the step, the step time its total."""
    if not isinstance(phases, dict):
        return {}
    src = phases["measured"] if isinstance(phases.get("measured"), dict) else phases

    def value(k: str) -> float:
        v = src.get(k)
        if isinstance(v, dict):
            v = v.get("measured_s", v.get("measured"))
        return float(v) if isinstance(v, (int, float)) and v > 0 else 0.0

    out = {k: value(k) for k in PHASES if value(k) > 0}
    total = sum(out.values()) + value("other")
    if step_s is not None and step_s > 0 and total > 0:
        out = {k: v * step_s / total for k, v in out.items()}
    return out


def phase_ratio(phases: Any) -> float | None:
    """Measured backward / forward seconds in a RunRecord's "phases" (the busiest rank's), or None
    when either is missing or 0 (``measured_phases`` reads the shapes)."""
    m = measured_phases(phases)
    f, b = m.get("forward", 0.0), m.get("backward", 0.0)
    return b / f if f > 0 and b > 0 else None


def predicted_ratio(plan: Plan) -> float | None:
    """The plan's predicted backward / forward seconds of its busiest pipeline rank (the phases
    the runtime measures its ratio on), or None when forward is 0."""
    pp = predicted_phases(plan)
    return pp["backward"] / pp["forward"] if pp["forward"] > 0 and pp["backward"] > 0 else None


def with_update(phases: dict[str, float]) -> dict[str, float]:
    """``phases`` with "update" = "optimizer" + "comm" added when either is there (``FIT_PHASES``)."""
    up = phases.get("optimizer", 0.0) + phases.get("comm", 0.0)
    return {**phases, "update": up} if up > 0 else dict(phases)


def fitted_phases(case: Case, *, bubble: bool = False) -> tuple[str, ...]:
    """The phases ``case`` is fitted on: ``FIT_PHASES`` it measured (and "bubble" with ``bubble``)
    when it has forward and backward, else () (its step total is fitted instead)."""
    m = with_update(case.measured_phases)
    if not all(m.get(k, 0.0) > 0 for k in COMPUTE_PHASES):
        return ()
    return tuple(k for k in (*FIT_PHASES, *(("bubble",) if bubble else ())) if m.get(k, 0.0) > 0)


def _residuals(cases: Sequence[Case], spec: ClusterSpec, *, bubble: bool = False
               ) -> tuple[list[float], list[Prediction]]:  # fmt: skip
    res, preds = [], []
    for c in cases:
        plan = predict(c, spec)
        p = plan.predicted
        preds.append(p)
        names = fitted_phases(c, bubble=bubble)
        if c.measured_ratio and not names:  # fitted on its phases: forward and backward carry the ratio
            ratio = predicted_ratio(plan)
            res.append(math.sqrt(RATIO_WEIGHT) * math.log(ratio / c.measured_ratio) if ratio else 0.0)
        if not names:
            res.append(math.log(max(p.step_s, 1e-12) / c.measured_step_s))
            continue
        pp, mp = with_update(predicted_phases(plan)), with_update(c.measured_phases)
        pred = meas = 0.0
        for k in names:  # cumulative: a phase is weighed by its seconds, not by its own ratio
            pred, meas = pred + pp.get(k, 0.0), meas + mp[k]
            res.append(math.sqrt(PHASE_WEIGHT) * math.log(max(pred, 1e-12) / meas))
    return res, preds


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (a is small, square, positive definite)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for i in range(n):
        piv = max(range(i, n), key=lambda r: abs(m[r][i]))
        m[i], m[piv] = m[piv], m[i]
        for r in range(i + 1, n):
            f = m[r][i] / m[i][i]
            for c in range(i, n + 1):
                m[r][c] -= f * m[i][c]
    x = [0.0] * n
    for i in range(n - 1, -1, -1):
        x[i] = (m[i][n] - sum(m[i][c] * x[c] for c in range(i + 1, n))) / m[i][i]
    return x


def _step_sign(term: str, spec: ClusterSpec) -> float:
    """-1 for a term at the top of its range (``overlap`` at ``comm_overlap`` = 1: raising it
    changes nothing), so that its derivative is taken downward; else +1."""
    return -1.0 if term == "overlap" and spec.comm_overlap >= 1.0 else 1.0


def fit(
    cases: Sequence[Case], spec: ClusterSpec, *, iterations: int = 8, progress: Callable[[str], None] | None = None,
    bubble: bool = False,
) -> Fit:
    """Fit ``TERMS`` of ``spec`` to ``cases`` (module docstring); returns the calibrated spec.
    ``bubble``: also fit each pipeline run's measured bubble against its simulated one."""
    if not cases:
        raise ValueError("calibration needs at least one run record")
    for c in cases:
        if not c.measured_step_s > 0:
            raise ValueError(f"{c.name}: measured step time must be > 0, got {c.measured_step_s!r}")
    say = progress or (lambda _m: None)
    k = len(TERMS)
    theta = [0.0] * k
    lim = math.log(MAX_FACTOR)
    w = [RIDGE / PRIOR_SIGMA[t] ** 2 for t in TERMS]

    def prior(th: list[float]) -> float:
        return sum(wi * x * x for wi, x in zip(w, th, strict=True))

    def at(th: list[float]) -> ClusterSpec:
        return apply_terms(spec, {t: math.exp(v) for t, v in zip(TERMS, th, strict=True)})

    _, before = _residuals(cases, spec, bubble=bubble)
    r, _ = _residuals(cases, at(theta), bubble=bubble)
    cost = sum(x * x for x in r)
    done = 0
    unconstrained: tuple[str, ...] = ()
    for it in range(iterations):
        done = it + 1
        cols = []
        for j in range(k):
            th = theta[:]
            step = STEP * _step_sign(TERMS[j], at(theta))
            th[j] += step
            rj, _ = _residuals(cases, at(th), bubble=bubble)
            cols.append([(a - b) / step for a, b in zip(rj, r, strict=True)])
        if it == 0:
            unconstrained = tuple(t for t, col in zip(TERMS, cols, strict=True) if max(map(abs, col)) < 1e-9)
        jtj = [[sum(cols[i][n] * cols[j][n] for n in range(len(r))) + (w[i] if i == j else 0.0)
                for j in range(k)] for i in range(k)]  # fmt: skip
        jtr = [-sum(cols[i][n] * r[n] for n in range(len(r))) - w[i] * theta[i] for i in range(k)]
        delta = _solve(jtj, jtr)
        damp, improved = 1.0, False
        while damp > 1e-3:
            # the step taken on the time multipliers u = exp(-θ) (a term's seconds scale with 1 / its
            # speed, so a phase's seconds are near linear in u): u -> u (1 - Δθ), not θ -> θ + Δθ
            cand = [max(-lim, min(lim, t + damp * d))
                    for t, d in zip(theta, delta, strict=True)]  # fmt: skip
            rc, _ = _residuals(cases, at(cand), bubble=bubble)
            if sum(x * x for x in rc) + prior(cand) < cost + prior(theta) - 1e-12:
                theta, r, cost, improved = cand, rc, sum(x * x for x in rc), True
                break
            damp /= 2
        say(f"calibration iteration {done}: rms log error {math.sqrt(cost / max(1, len(r))):.4f}")
        if not improved or max(abs(d) for d in delta) * damp < 1e-4:
            break
    calibrated = at(theta)
    _, after = _residuals(cases, calibrated, bubble=bubble)
    factors = {t: math.exp(v) for t, v in zip(TERMS, theta, strict=True)}
    rows = [(c.name, b.step_s, a.step_s, c.measured_step_s) for c, b, a in zip(cases, before, after, strict=True)]
    return Fit(spec=calibrated, factors=factors, rows=rows, iterations=done, unconstrained=unconstrained)


# ---- meshplan.calibrate: RunRecord files in, a calibrated ClusterSpec out -----------------------
def read_record(path: str) -> dict[str, Any]:
    """A RunRecord's JSON with the fields calibration needs checked (clear errors)."""
    try:
        d = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"run record {path!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"run record {path!r} is not valid JSON: {e}") from None
    if not isinstance(d, dict) or not isinstance(d.get("steps"), list):
        raise ValueError(f"{path!r} is not a run record (no 'steps' list)")
    if not d.get("plan"):
        raise ValueError(f"run record {path!r} has no 'plan' (written by a meshplan before 'plan' was recorded): "
                         "re-run it with this version of meshplan run --record")  # fmt: skip
    if not d.get("model"):
        raise ValueError(f"run record {path!r} has no 'model' spec to trace")
    if d.get("optimizer") and d["optimizer"] not in OPTIMIZERS:
        raise ValueError(f"run record {path!r}: optimizer {d['optimizer']!r} unknown; the cost model knows "
                         f"{', '.join(OPTIMIZERS)}")
    return d


def measured_step_s(d: dict[str, Any]) -> float:
    """The record's median step time after its warm-up steps (RunRecord.measured_step_s)."""
    import statistics

    times = [float(s["step_s"]) for s in d["steps"] if isinstance(s, dict) and "step_s" in s]
    if not times:
        raise ValueError("run record has no measured steps")
    kept = times[int(d.get("warmup", 1)) :] or times
    return float(statistics.median(kept))


def measured_core_share(d: dict[str, Any]) -> float | None:
    """The share of a core a run's ranks got (``Case.core_share``), from a RunRecord: the busiest
    rank's CPU seconds over its wall seconds inside its forward and backward phases (the profiled
    steps' ``measured_cpu_s``: the rank is computing there, so CPU below wall is a core other
    processes held), else the median over ranks and steps (after the warm-up) of the rank's CPU
    seconds per step (``rank_cpu_s``) over the step's wall time (this counts a pipeline's waits for
    its peer as contention too); capped at 1 (several busy threads); None when the record has neither."""
    import statistics

    ph = d.get("phases") if isinstance(d.get("phases"), dict) else {}
    wall = cpu = 0.0
    for k in COMPUTE_PHASES:
        v = ph.get(k)
        if isinstance(v, dict) and isinstance(v.get("measured_cpu_s"), (int, float)):
            wall += float(v.get("measured_s") or 0.0)
            cpu += float(v["measured_cpu_s"])
    if wall > 0 and cpu > 0:
        return min(1.0, cpu / wall)
    walls = [float(s["step_s"]) for s in d.get("steps") or [] if isinstance(s, dict) and "step_s" in s]
    skip = int(d.get("warmup", 1))
    shares = [c / w for row in d.get("rank_cpu_s") or [] for c, w in list(zip(row, walls))[skip:] if w > 0 and c > 0]
    return min(1.0, statistics.median(shares)) if shares else None


def recorded_host(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The host figures the runs measured on their own GPU host (RunRecord ``host``, written by
    ``meshplan run``'s host probe, ``runtime.record.host_probe``): per field the median over the
    records that carry it, {} when none does. A probe on a CPU (``device`` "cpu: ...") or one that
    failed (``error``) is left out: the CPU has no host floor to set."""
    import statistics

    found: dict[str, list[float]] = {}
    for d in records:
        h = d.get("host")
        if not isinstance(h, dict) or h.get("error") or str(h.get("device", "")).startswith("cpu"):
            continue
        for k in HOST_FIELDS:
            v = h.get(k)
            if isinstance(v, (int, float)) and v > 0:
                found.setdefault(k, []).append(float(v))
    return {k: float(statistics.median(v)) for k, v in found.items() if "host_op_s" in found}


@dataclass(frozen=True)
class Calibration:
    """What ``calibrate`` returns: the calibrated ``spec`` (named, with its provenance and the
    factors in ``extra["calibration"]``), the cluster it started from (``before``) and the ``fit``
    (multipliers, per run predicted step seconds before / after vs measured)."""

    spec: ClusterSpec
    before: ClusterSpec
    fit: Fit


def calibrate(
    records: Sequence[str | Path] | str | Path,
    cluster: str | ClusterSpec | Path,
    *,
    name: str | None = None,
    use_phases: bool = False,
    core_share: bool = False,
    host: bool = True,
    progress: Callable[[str], None] | None = None,
) -> Calibration:
    """Fit ``cluster``'s efficiency terms to measured runs (``meshplan calibrate``): each record (a
    ``run_record.json`` of ``meshplan run --record``) holds the Plan that ran, the model spec and
    the measured step times; every run's layout is re-costed on ``cluster`` (a preset, a cluster
    JSON, "local" or a ClusterSpec) and the terms fitted (module docstring): a record with forward
    and backward phases (scaled to its step time) on its phases (``FIT_PHASES``), one without on its
    step time. ``use_phases`` also fits pipeline runs' bubble (off by default: a pipeline's waits
    beyond its simulated schedule would go into the p2p latency). ``core_share``: predict each run on
    the share of a core its ranks measured (``measured_core_share``; a gloo cluster only), so the
    calibrated spec is the host's full-core speed. ``host`` (default on): on a cluster with a
    host-dispatch floor (a GPU's, ``host_op_s`` > 0), the host figures the runs measured on their own
    host (``recorded_host``) replace the cluster's before the fit and stay in the calibrated cluster
    (measured, not fitted: a GPU-bound run's step says nothing about its host, a host-bound run of
    another configuration on the same host is priced with them); ``before`` stays the cluster as
    given. ``name``: the calibrated cluster's (default NAME-calibrated)."""
    from dataclasses import replace

    from meshplan.loading import load_graph
    from meshplan.profile.local import resolve

    say = progress or (lambda _m: None)
    paths = [records] if isinstance(records, str | Path) else list(records)
    cases, dicts = [], []
    for path in paths:
        d = read_record(str(path))
        dicts.append(d)
        plan = Plan.from_dict(d["plan"])
        say(f"{path}: {plan.summary()} on {d['model']}")
        graph = load_graph(d["model"], seq=plan.seq_len, progress=progress)
        step = measured_step_s(d)
        phases = measured_phases(d.get("phases"), step)
        share = measured_core_share(d) if core_share else None
        if core_share and share is None:
            raise ValueError(f"run record {path!r} has no CPU seconds (phases' measured_cpu_s or rank_cpu_s) to "
                             "measure its core share: re-run it with this version of meshplan run --record")
        cases.append(Case(name=Path(path).name, graph=graph, plan=plan, measured_step_s=step, measured_phases=phases,
                          measured_ratio=phase_ratio(d.get("phases")), optimizer=d.get("optimizer") or "",
                          core_share=share))  # fmt: skip
    if not cases:
        raise ValueError("calibration needs at least one run record")
    world = max(c.plan.world_size for c in cases)
    spec = resolve(cluster, world, say=say, log=say)
    names = ", ".join(c.name for c in cases)
    measured = recorded_host(dicts) if host else {}
    start = spec
    if measured and spec.host_op_s > 0:
        start = replace(spec, **measured)
        carried = sum(1 for d in dicts if isinstance(d.get("host"), dict) and d["host"].get("host_op_s"))
        say("host figures measured by the runs (RunRecord host, median of " + f"{carried} record(s)): "
            + ", ".join(f"{k} {getattr(spec, k) * 1e6:.3g} -> {v * 1e6:.3g} us" for k, v in measured.items()))
    elif measured:
        say(f"the records' host figures are not used: cluster {spec.name} has no host-dispatch floor (host_op_s 0)")
        measured = {}
    result = fit(cases, start, progress=progress, bubble=use_phases)
    out = result.spec
    fitted = {f: f"derived: fitted by meshplan calibrate to {names}" for f in ClusterSpec.__dataclass_fields__
              if f not in ("name", "source", "extra", "provenance") and getattr(out, f) != getattr(spec, f)}
    for k in measured:  # kept as measured unless a host-bound run moved host_op_s (the op_overhead term)
        if getattr(out, k) == measured[k]:
            fitted[k] = f"measured: meshplan run's host probe (RunRecord host) in {names}"
    out = replace(out, name=name or f"{spec.name}-calibrated", provenance={**out.provenance, **fitted},
                  source=f"{spec.name} calibrated by meshplan calibrate on {len(cases)} run(s): {names}",
                  extra={**out.extra, "calibration": {"factors": result.factors, "records": names,
                                                      **({"recorded_host": measured} if measured else {})}})  # fmt: skip
    return Calibration(out, spec, result)
