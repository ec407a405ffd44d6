"""Whole-command timing of ``meshplan capacity`` (issue 32 item 4): cold (empty trace cache) and
warm (the trace cached), each as its own process, wall and CPU (the process and its forked
workers) and the load average around it.

    python benchmarks/bench_capacity.py [--model llama3-70b] [--gpus 128-6144] [--cluster h100,h200,a100-80g]
                                        [--jobs 2] [--repeat 1] [-- extra capacity arguments]

The default is the issue's target: 3 cluster kinds × 12 sizes of Llama-3-70B (128 … 6,144 GPUs,
2^k and 3·2^k). Prints one line per run and the command's own timing line ("answered in ..."); the
default picture is written in the run's temporary folder.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_once(cmd: list[str], cache: str) -> tuple[float, float, str, tuple[float, float]]:
    env = dict(os.environ, MESHPLAN_CACHE_DIR=cache, PYTHONPATH=str(ROOT))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    # cwd: the run's temporary folder, where the command writes its default picture (capacity-MODEL.png)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=cache, timeout=1800)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode:
        sys.exit(f"command failed ({out.returncode}): {out.stderr.strip().splitlines()[-1:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = out.stdout.strip().splitlines()
    said = next((x for x in lines if x.startswith("answered in")), lines[-1])  # a "wrote ..." line may follow it
    return wall, cpu, said, (load0, os.getloadavg()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--tokens", default="15T")
    ap.add_argument("--gpus", default="128-6144")
    ap.add_argument("--cluster", default="h100,h200,a100-80g")
    ap.add_argument("--jobs", default="2")
    ap.add_argument("--repeat", type=int, default=1, help="warm runs after the cold one")
    ap.add_argument("extra", nargs="*", help="more capacity arguments (after --)")
    a = ap.parse_args()
    cmd = [sys.executable, "-m", "meshplan.cli", "capacity", a.model, "--tokens", a.tokens, "--gpus", a.gpus,
           "--cluster", a.cluster, "--jobs", a.jobs, "-q", *a.extra]  # fmt: skip
    print("command: meshplan " + " ".join(cmd[3:]))
    with tempfile.TemporaryDirectory() as cache:
        for i in range(1 + a.repeat):
            wall, cpu, last, load = run_once(cmd, cache)
            print(f"{'cold' if i == 0 else 'warm'}: {wall:.1f} s wall, {cpu:.1f} s CPU (process + workers), "
                  f"load average {load[0]:.1f} -> {load[1]:.1f}; {last}")


if __name__ == "__main__":
    main()
