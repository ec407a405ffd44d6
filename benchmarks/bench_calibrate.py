"""Calibration transfer on this machine: real 2-rank runs of several layouts, timed interleaved; fit on each, predict the others.

    python benchmarks/bench_calibrate.py [--workdir DIR] [--rounds 3] [--steps 8] [--global-batch 64]
                                         [--configs dp,pp,fsdp,tp] [--cluster cpu.json|local] [--fit-only]
                                         [--core-share] [--max-load L] [--no-dtensor-host] [--cpu-seconds]

Plans ``gpt-tiny`` on a nominal CPU cluster (``NOMINAL``: 100 GFLOP/s, 2 GB/s, 50 us; fp32; gloo)
pinned to each configuration (``CONFIGS``: dp2 zero1, pp2 (the planner's schedule), dp2 fsdp,
tp2), once; then runs the configurations **interleaved**: ``--rounds`` rounds, each running every
configuration once with ``meshplan run`` (gloo, 2 ranks, ``--steps`` timed steps, then 3 profiled
steps for the RunRecord's phases), the order rotated by one each round so no configuration always
follows the same neighbour. A shared machine's load drifts over minutes (a configuration measured
back to back minutes apart moved 2.4x at stop 2); interleaving puts every configuration under the
same drift, and the median over rounds drops a round that met a burst.

Per run it keeps (``runs.json`` in the workdir): the 1-minute load average before and after, the
wall and CPU seconds of the whole command (``RUSAGE_CHILDREN``, every rank), the step time (median
after the first step), and the ranks' CPU seconds per step against the step's wall time
(``RunRecord.rank_cpu_s``: a rank whose process used less CPU than the step lasted waited, for a
peer or for a core other processes held).

Then per configuration the median step over the rounds and its spread (max / min), and the
transfer matrix: fitted (as ``meshplan calibrate`` fits: on the forward, backward and update phases
and the backward : forward ratio) on the round whose step is that configuration's median, predicting
every configuration's median step; then the same within each round (single runs). ``--core-share``
fits and predicts each run on the share of a core its ranks measured (``meshplan calibrate
--core-share``; ``calibration.measured_core_share``): the fit then finds the host's full-core speed,
and each prediction is judged on the share the predicted run got (an input measured on that run). ``--fit-only`` re-fits from a workdir's existing ``runs.json`` and
records (to compare cost models on the same measurements). ``--cluster local`` starts the fit from
this machine's measured profile (``meshplan profile``) instead of the nominal figures, and
``--cluster PROFILE.json`` a ``meshplan profile --nproc 2`` output (on gloo it carries the DTensor
host figures a rank pair measured, ``profile.tp_host``; ``--no-dtensor-host`` zeroes them, to see
what they move). ``--cpu-seconds`` fits and predicts the busiest rank's CPU seconds per step and
phase (``cpu_record``) instead of wall seconds: the host's work with the contention taken out. A timing
measurement, so a benchmark and not a test (tests/test_calibrate.py checks the fit against known
terms).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NOMINAL = {"name": "cpu-nominal", "num_devices": 2, "devices_per_node": 2,
           "peak_flops": {"fp32": 100e9, "bf16": 100e9, "fp16": 100e9}, "mem_bytes": 8 * 10**9,
           "mem_bw_bytes_per_s": 10e9, "intra_bw_bytes_per_s": 2e9, "intra_latency_s": 5e-5,
           "inter_bw_bytes_per_s": 1e9, "inter_latency_s": 1e-4, "comm_backend": "gloo",
           "source": "nominal figures for a small CPU host with gloo (uncalibrated)"}  # fmt: skip
#: configuration name -> meshplan plan pins
CONFIGS = {"dp": ["--dp", "2", "--dp-kind", "zero1"], "pp": ["--pp", "2"], "fsdp": ["--dp", "2", "--dp-kind", "fsdp"],
           "tp": ["--tp", "2"]}  # fmt: skip
GOAL = 0.25


def _cli(args: list[str], cwd: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "meshplan.cli", *args], env=env, cwd=cwd, capture_output=True,
                         text=True)  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"meshplan {' '.join(args)} failed:\n{out.stderr[-3000:]}")


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_rounds(wd: Path, names: list[str], rounds: int, steps: int, max_load: float = 0.0) -> list[dict[str, Any]]:
    """``rounds`` rounds of every configuration in ``names`` (rotated by one each round); one fact
    dict per run (module docstring). ``max_load`` > 0: before each run, wait until the 1-minute
    load average is below it (a shared host's rule for multi-rank runs)."""
    runs = []
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            rec = f"rec_{name}_{r + 1}.json"
            while max_load > 0 and os.getloadavg()[0] >= max_load:
                print(f"round {r + 1}/{rounds}: waiting for load {os.getloadavg()[0]:.1f} < {max_load:g} before {name}",
                      file=sys.stderr, flush=True)  # fmt: skip
                time.sleep(30)
            load0, t0, c0 = os.getloadavg()[0], time.perf_counter(), _children_cpu_s()
            print(f"round {r + 1}/{rounds}: running {name} (load {load0:.1f})", file=sys.stderr, flush=True)
            _cli(["run", f"plan_{name}.json", "--model", "gpt-tiny", "--steps", str(steps), "--profile-steps", "3",
                  "--record", rec], wd)  # fmt: skip
            runs.append({"name": name, "round": r + 1, "record": rec, "load_before": round(load0, 2),
                         "load_after": round(os.getloadavg()[0], 2),
                         "command_wall_s": round(time.perf_counter() - t0, 3),
                         "command_cpu_s": round(_children_cpu_s() - c0, 3)})  # fmt: skip
            (wd / "runs.json").write_text(json.dumps(runs, indent=1) + "\n")
    return runs


def cpu_share(d: dict[str, Any]) -> float | None:
    """Median over ranks and steps (after the first) of a rank's CPU seconds / its step's wall
    seconds (``RunRecord.rank_cpu_s``, ``steps``); None in records without it."""
    walls = [float(s["step_s"]) for s in d["steps"]]
    shares = [c / w for row in d.get("rank_cpu_s") or [] for c, w in zip(row[1:], walls[1:]) if w > 0]
    return statistics.median(shares) if shares else None


def rank_cpu_ms(d: dict[str, Any]) -> float | None:
    """Median over ranks and steps (after the first) of a rank's CPU milliseconds per step
    (``RunRecord.rank_cpu_s``): the work a step is, whatever share of a core it got."""
    cpu = [c for row in d.get("rank_cpu_s") or [] for c in row[1:]]
    return statistics.median(cpu) * 1e3 if cpu else None


def cpu_record(d: dict[str, Any]) -> dict[str, Any]:
    """The record as a full core would have run it: each step's time the busiest rank's CPU seconds in
    it (``rank_cpu_s``), each phase its CPU seconds (``measured_cpu_s``); ``--cpu-seconds``. On a
    shared host the CPU seconds hardly move with the load (stop 5: dp 72-83 ms per step while its wall
    time moved 1.5x), so a transfer judged on them checks the priced host work without the contention."""
    rows = d.get("rank_cpu_s") or []
    ph = d.get("phases")
    if not rows or not isinstance(ph, dict) or not any(isinstance(v, dict) and "measured_cpu_s" in v for v in ph.values()):
        raise SystemExit("--cpu-seconds needs records with rank_cpu_s and phases with measured_cpu_s (stop 5 on)")
    steps = [{**s, "step_s": max(r[i] for r in rows)} for i, s in enumerate(d["steps"])]
    phases = {k: ({**v, "measured_s": v.get("measured_cpu_s", 0.0)} if isinstance(v, dict) and "measured_s" in v else v)
              for k, v in ph.items()}  # fmt: skip
    return {**d, "steps": steps, "phases": phases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default=None, help="where plans, run records and logs go (default: a temp dir)")
    ap.add_argument("--global-batch", type=int, default=64, help="global batch of every run")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per run")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each runs every configuration once)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of CONFIGS")
    ap.add_argument("--cluster", default="cpu.json", help="cluster the fit starts from: cpu.json (NOMINAL) or local")
    ap.add_argument("--fit-only", action="store_true", help="re-fit from the workdir's runs.json; run nothing")
    ap.add_argument("--max-load", type=float, default=0.0,
                    help="before each run, wait until the 1-minute load average is below this (0: never wait)")
    ap.add_argument("--core-share", action="store_true",
                    help="fit and predict each run on the core share its ranks measured (calibrate --core-share)")
    ap.add_argument("--no-dtensor-host", action="store_true",
                    help="zero the start cluster's DTensor host figures (host_tp_linear_*_s, host_dtensor_param_s)")
    ap.add_argument("--cpu-seconds", action="store_true",
                    help="fit and predict the busiest rank's CPU seconds per step and phase instead of wall seconds")
    a = ap.parse_args()
    names = a.configs.split(",")
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        raise SystemExit(f"unknown configs {bad}; use {sorted(CONFIGS)}")
    wd = Path(a.workdir or tempfile.mkdtemp(prefix="meshplan-calibrate-"))
    wd.mkdir(parents=True, exist_ok=True)
    if not (wd / "cpu.json").exists():
        (wd / "cpu.json").write_text(json.dumps(NOMINAL))

    from meshplan.api import calibration as cal
    from meshplan.loading import load_graph
    from meshplan.plan import Plan
    from meshplan.profile.local import resolve

    if a.fit_only:
        if not (wd / "runs.json").exists():
            raise SystemExit(f"--fit-only: no runs.json in {wd}; run without --fit-only first")
        runs = [r for r in json.loads((wd / "runs.json").read_text()) if r["name"] in names]
    else:
        for name in names:
            if not (wd / f"plan_{name}.json").exists():
                _cli(["plan", "gpt-tiny", "-n", "2", "--cluster", "cpu.json", "--dtype", "fp32", "--global-batch",
                      str(a.global_batch), *CONFIGS[name], "-q", "-o", f"plan_{name}.json"], wd)  # fmt: skip
        runs = run_rounds(wd, names, a.rounds, a.steps, a.max_load)

    graphs: dict[int, Any] = {}
    by_name: dict[str, list[tuple[float, dict[str, Any], dict[str, Any]]]] = {n: [] for n in names}
    for run in runs:
        d = cal.read_record(str(wd / run["record"]))
        d = cpu_record(d) if a.cpu_seconds else d
        by_name[run["name"]].append((cal.measured_step_s(d), d, run))
    print("| configuration | plan | step ms per round (load before) | median ms | spread max/min | "
          "rank CPU / wall in steps (median per round) | rank CPU ms per step (per round) | core share (measured_core_share, per round) | "
          "command CPU / wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    cases = {}
    for name in names:
        rows = sorted(by_name[name], key=lambda t: t[2]["round"])
        steps = [t[0] for t in rows]
        med = statistics.median(steps)
        # the round whose step is the median (the lower middle for an even count): its phases and plan
        step, d, _ = sorted(rows, key=lambda t: t[0])[(len(rows) - 1) // 2]
        plan = Plan.from_dict(d["plan"])
        phases = cal.measured_phases(d.get("phases"), med)
        g = graphs.setdefault(plan.seq_len, load_graph("gpt-tiny", seq=plan.seq_len))
        cases[name] = cal.Case(name, g, plan, med, phases, cal.phase_ratio(d.get("phases")),
                               core_share=cal.measured_core_share(d) if a.core_share else None)  # type: ignore[arg-type]  # fmt: skip
        per_round = ", ".join(f"{s * 1e3:.0f} ({t[2]['load_before']:.1f})" for s, t in zip(steps, rows))
        shares = ", ".join(f"{x:.2f}" if (x := cpu_share(t[1])) is not None else "-" for t in rows)
        cmd = ", ".join(f"{t[2]['command_cpu_s']:.0f}/{t[2]['command_wall_s']:.0f}" for t in rows)
        cpu_ms = ", ".join(f"{x:.0f}" if (x := rank_cpu_ms(t[1])) is not None else "-" for t in rows)
        cores = ", ".join(f"{x:.2f}" if (x := cal.measured_core_share(t[1])) is not None else "-" for t in rows)
        print(f"| {name} | {plan.summary()} | {per_round} | {med * 1e3:.1f} | {max(steps) / min(steps):.2f}x | "
              f"{shares} | {cpu_ms} | {cores} | {cmd} |")
    spec = resolve(str(wd / "cpu.json") if a.cluster == "cpu.json" else a.cluster, 2)
    if a.no_dtensor_host:
        from dataclasses import replace

        spec = replace(spec, host_tp_linear_fwd_s=0.0, host_tp_linear_bwd_s=0.0, host_dtensor_param_s=0.0)
    print(f"start cluster {spec.name}: op overhead {spec.op_overhead_s * 1e6:.1f} / {spec.bwd_op_overhead_s * 1e6:.1f} us, "
          f"latency {spec.intra_latency_s * 1e6:.0f} us, DTensor host {spec.host_tp_linear_fwd_s * 1e6:.0f} / "
          f"{spec.host_tp_linear_bwd_s * 1e6:.0f} us per TP linear, {spec.host_dtensor_param_s * 1e6:.0f} us per DTensor "
          "parameter")  # fmt: skip
    print()
    print("| fitted on \\ predicted for | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    errs = []
    for fit_on in names:
        fitted = cal.fit([cases[fit_on]], spec).spec
        cells = []
        for other in names:
            c = cases[other]
            e = cal.predict(c, fitted).predicted.step_s / c.measured_step_s - 1
            cells.append(f"{e:+.0%}" + (" (in sample)" if other == fit_on else ""))
            if other != fit_on:
                errs.append(abs(e))
        print(f"| {fit_on} | " + " | ".join(cells) + " |")
    if errs:
        print(f"\nmedian |error| over {len(errs)} transfers {statistics.median(errs):.0%}, "
              f"{sum(e <= GOAL for e in errs)} of {len(errs)} within {GOAL:.0%}, largest {max(errs):.0%}")
    # the same fit and predictions within each round (one run per configuration): what single runs give
    per_round: list[float] = []
    for r in sorted({run["round"] for run in runs}):
        one = {}
        for name in names:
            step, d, _ = next(t for t in by_name[name] if t[2]["round"] == r)
            ph = cal.measured_phases(d.get("phases"), step)
            one[name] = cal.Case(name, cases[name].graph, Plan.from_dict(d["plan"]), step, ph,
                                 cal.phase_ratio(d.get("phases")),
                                 core_share=cal.measured_core_share(d) if a.core_share else None)  # fmt: skip
        for fit_on in names:
            fitted = cal.fit([one[fit_on]], spec).spec
            per_round += [abs(cal.predict(one[o], fitted).predicted.step_s / one[o].measured_step_s - 1)
                          for o in names if o != fit_on]  # fmt: skip
    if per_round:
        print(f"fitted and predicted within each round instead: median |error| {statistics.median(per_round):.0%}, "
              f"{sum(e <= GOAL for e in per_round)} of {len(per_round)} within {GOAL:.0%}")
    print(f"files in {wd}; load average now {os.getloadavg()[0]:.1f}", file=sys.stderr)


if __name__ == "__main__":
    main()
