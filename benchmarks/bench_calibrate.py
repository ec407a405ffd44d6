"""Calibration transfer on this machine: real 2-rank runs of several layouts; fit on each, predict the others.

    python benchmarks/bench_calibrate.py [--workdir DIR] [--global-batch 64] [--steps 8] [--repeats 1]
                                         [--configs dp,pp,fsdp,tp] [--cluster cpu.json|local]

Plans ``gpt-tiny`` on a nominal CPU cluster (``NOMINAL``: 100 GFLOP/s, 2 GB/s, 50 us; fp32) pinned to
each configuration (``CONFIGS``: dp2 zero1, pp2 (the planner's schedule), dp2 fsdp, tp2), runs each
with ``meshplan run`` (gloo, 2 ranks, ``--steps`` timed steps, then 3 profiled steps for the
RunRecord's phases), and for each run fits the cluster the way ``meshplan calibrate`` does (step
time, forward / backward phases and their ratio) and predicts every other run's step time (median
after the first step). Prints one row per (fitted on, predicted for) with the load average at the
start of each run. ``--cluster local`` starts the fit from this machine's measured profile (``meshplan
profile``) instead of the nominal figures. A timing measurement, so a benchmark and not a test
(tests/test_calibrate.py checks the fit against known terms). The runs of one repeat are minutes
apart on a shared machine: compare the spread between repeats before reading an error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NOMINAL = {"name": "cpu-nominal", "num_devices": 2, "devices_per_node": 2,
           "peak_flops": {"fp32": 100e9, "bf16": 100e9, "fp16": 100e9}, "mem_bytes": 8 * 10**9,
           "mem_bw_bytes_per_s": 10e9, "intra_bw_bytes_per_s": 2e9, "intra_latency_s": 5e-5,
           "inter_bw_bytes_per_s": 1e9, "inter_latency_s": 1e-4,
           "source": "nominal figures for a small CPU host with gloo (uncalibrated)"}  # fmt: skip
#: configuration name -> meshplan plan pins
CONFIGS = {"dp": ["--dp", "2", "--dp-kind", "zero1"], "pp": ["--pp", "2"], "fsdp": ["--dp", "2", "--dp-kind", "fsdp"],
           "tp": ["--tp", "2"]}  # fmt: skip


def _cli(args: list[str], cwd: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "meshplan.cli", *args], env=env, cwd=cwd, capture_output=True,
                         text=True)  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"meshplan {' '.join(args)} failed:\n{out.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default=None, help="where plans, run records and logs go (default: a temp dir)")
    ap.add_argument("--global-batch", type=int, default=64, help="global batch of every run")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per run")
    ap.add_argument("--repeats", type=int, default=1, help="runs of every configuration (noise)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of CONFIGS")
    ap.add_argument("--cluster", default="cpu.json", help="cluster the fit starts from: cpu.json (NOMINAL) or local")
    a = ap.parse_args()
    names = a.configs.split(",")
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        raise SystemExit(f"unknown configs {bad}; use {sorted(CONFIGS)}")
    wd = Path(a.workdir or tempfile.mkdtemp(prefix="meshplan-calibrate-"))
    wd.mkdir(parents=True, exist_ok=True)
    (wd / "cpu.json").write_text(json.dumps(NOMINAL))

    from meshplan.api import calibration as cal
    from meshplan.loading import load_graph
    from meshplan.plan import Plan
    from meshplan.profile.local import resolve

    load: dict[str, float] = {}
    for r in range(1, a.repeats + 1):
        for name in names:
            if not (wd / f"plan_{name}.json").exists():
                _cli(["plan", "gpt-tiny", "-n", "2", "--cluster", "cpu.json", "--dtype", "fp32", "--global-batch",
                      str(a.global_batch), *CONFIGS[name], "-q", "-o", f"plan_{name}.json"], wd)  # fmt: skip
            load[f"{name}_{r}"] = os.getloadavg()[0]
            print(f"repeat {r}: running {name} (load {load[f'{name}_{r}']:.1f})", file=sys.stderr, flush=True)
            _cli(["run", f"plan_{name}.json", "--model", "gpt-tiny", "--steps", str(a.steps), "--profile-steps", "3",
                  "--record", f"rec_{name}_{r}.json"], wd)  # fmt: skip
    spec = resolve(str(wd / "cpu.json") if a.cluster == "cpu.json" else a.cluster, 2)
    graphs: dict[int, object] = {}
    print("| repeat | fitted on | predicted for | predicted ms | measured ms | error | load at run |")
    print("|---|---|---|---|---|---|---|")
    for r in range(1, a.repeats + 1):
        cases = {}
        for name in names:
            d = cal.read_record(str(wd / f"rec_{name}_{r}.json"))
            plan = Plan.from_dict(d["plan"])
            step = cal.measured_step_s(d)
            phases = cal.measured_phases(d.get("phases"), step)
            g = graphs.setdefault(plan.seq_len, load_graph("gpt-tiny", seq=plan.seq_len))
            cases[name] = cal.Case(name, g, plan, step, {k: v for k, v in phases.items() if k in cal.COMPUTE_PHASES},
                                   cal.phase_ratio(d.get("phases")))  # type: ignore[arg-type]  # fmt: skip
        for fit_on in names:
            fitted = cal.fit([cases[fit_on]], spec).spec
            for other in names:
                c = cases[other]
                p = cal.predict(c, fitted).predicted.step_s
                tag = " (in sample)" if other == fit_on else ""
                print(f"| {r} | {fit_on} | {other}{tag} | {p * 1e3:.1f} | {c.measured_step_s * 1e3:.1f} | "
                      f"{p / c.measured_step_s - 1:+.1%} | {load[f'{other}_{r}']:.1f} |")
    print(f"files in {wd}; load average now {os.getloadavg()[0]:.1f}", file=sys.stderr)


if __name__ == "__main__":
    main()
