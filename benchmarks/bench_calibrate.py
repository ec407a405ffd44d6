"""Calibration on this machine: two real 2-rank runs of different layouts, calibrate on one, predict the other.

    python benchmarks/bench_calibrate.py [--workdir DIR] [--global-batch 64] [--steps 12]

Plans ``gpt-tiny`` on a nominal CPU cluster (``NOMINAL``: 100 GFLOP/s, 2 GB/s, 50 us; fp32) pinned
to dp2 and to pp2, runs each with ``meshplan run`` (gloo, 2 ranks, ``--steps`` steps, no profiled
steps), calibrates the nominal cluster on the dp2 run (``meshplan calibrate``) and prints the pp2
run's measured step time (median after the first step) beside its prediction with the nominal and
with the calibrated cluster. A timing measurement, so a benchmark and not a test (tests/
test_calibrate.py checks the fit against known terms). Global batch 64 keeps both steps
compute-bound; at 8 they are mostly per-op host time and gloo waits.
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


def _cli(args: list[str], cwd: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "meshplan.cli", *args], env=env, cwd=cwd, capture_output=True,
                         text=True)  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"meshplan {' '.join(args)} failed:\n{out.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    wd = Path(a.workdir or tempfile.mkdtemp(prefix="meshplan-calibrate-"))
    wd.mkdir(parents=True, exist_ok=True)
    (wd / "cpu.json").write_text(json.dumps(NOMINAL))
    for name, pins in (("dp", ["--dp", "2"]), ("pp", ["--pp", "2"])):
        _cli(["plan", "gpt-tiny", "-n", "2", "--cluster", "cpu.json", "--dtype", "fp32", "--global-batch",
              str(a.global_batch), *pins, "-q", "-o", f"plan_{name}.json"], wd)  # fmt: skip
        _cli(["run", f"plan_{name}.json", "--model", "gpt-tiny", "--steps", str(a.steps), "--profile-steps", "0",
              "--record", f"rec_{name}.json"], wd)  # fmt: skip
    _cli(["calibrate", "rec_dp.json", "--cluster", "cpu.json", "-o", "cal_dp.json", "-q"], wd)

    from meshplan.api import calibration as cal
    from meshplan.api.calibration import measured_step_s
    from meshplan.cost_models.hardware import ClusterSpec, resolve_cluster
    from meshplan.loading import load_graph
    from meshplan.plan import Plan

    rec = json.loads((wd / "rec_pp.json").read_text())
    plan = Plan.from_dict(rec["plan"])
    case = cal.Case("pp", load_graph("gpt-tiny", seq=plan.seq_len), plan, measured_step_s(rec))
    nominal = cal.predict(case, resolve_cluster(ClusterSpec.from_dict(NOMINAL), 2)).predicted.step_s
    fitted = cal.predict(case, ClusterSpec.load(wd / "cal_dp.json")).predicted.step_s
    m = case.measured_step_s
    print(f"pp2 run ({plan.summary()}): measured {m * 1e3:.1f} ms (median of steps 2..{a.steps})")
    print(f"  predicted with the nominal cluster:           {nominal * 1e3:8.1f} ms ({nominal / m - 1:+.1%})")
    print(f"  predicted with the cluster calibrated on dp2: {fitted * 1e3:8.1f} ms ({fitted / m - 1:+.1%})")
    print(f"  load average now: {os.getloadavg()[0]:.1f}; files in {wd}")


if __name__ == "__main__":
    main()
