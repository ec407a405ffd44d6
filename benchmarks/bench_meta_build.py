"""Host memory of ``meshplan run`` with the meta-device build: peak RSS per rank (#28's CPU check).

Plans GPT-2-large (774M parameters, 2.88 GiB in fp32) at dp4 FSDP on this CPU (4 gloo ranks),
runs ``meshplan run --build meta`` for a couple of steps and prints, per rank, the peak RSS after
materializing (the note ``apply_materialize`` writes) and at the end of the run (the RunRecord's
``rank_peak_mem_bytes``, ``cpu_peak_rss``), against the bound half the fp32 model + 1.2 GiB.

    python benchmarks/bench_meta_build.py [--model gpt2-large] [--steps 2] [--optimizer sgd] [--seq 64]

Runs under a timeout; check ``uptime`` first: 4 ranks x ~2.5 GiB on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-large")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw"))
    ap.add_argument("--build", default="meta", choices=("meta", "host"))
    ap.add_argument("--timeout", type=float, default=1500)
    a = ap.parse_args()

    import torch

    from meshplan.models import load_model

    spec = load_model(a.model, device="meta")
    model_bytes = sum(p.numel() * 4 for p in spec.model.parameters())
    bound = model_bytes / 2 + 1.2 * 2**30
    cli = [sys.executable, "-m", "meshplan.cli"]
    with tempfile.TemporaryDirectory() as d:
        plan, rec = os.path.join(d, "plan.json"), os.path.join(d, "rec.json")
        subprocess.run([*cli, "plan", a.model, "-n", str(a.ranks), "--dp", str(a.ranks), "--tp", "1", "--pp", "1",
                        "--dp-kind", "fsdp", "--global-batch", str(a.ranks), "--seq", str(a.seq), "--cluster", "h100",
                        "-o", plan], check=True, capture_output=True, timeout=600)
        t0 = time.time()
        out = subprocess.run([*cli, "run", plan, "--model", a.model, "--steps", str(a.steps), "--optimizer",
                              a.optimizer, "--dtype", "fp32", "--profile-steps", "0", "--record", rec,
                              "--build", a.build, "--timeout", "900"],
                             capture_output=True, text=True, timeout=a.timeout)
        wall = time.time() - t0
        if out.returncode != 0:
            print(out.stdout[-3000:], out.stderr[-3000:])
            return 1
        r = json.load(open(rec))
    after = [float(x) for x in re.findall(r"process peak RSS ([0-9.]+) GiB after materializing", out.stdout + out.stderr)]
    print(f"{a.model}: {model_bytes / 2**30:.2f} GiB fp32 parameters; bound half + 1.2 GiB = {bound / 2**30:.2f} GiB")
    print(f"meshplan run --build {a.build}, dp{a.ranks} FSDP, {a.steps} steps, {a.optimizer}, seq {a.seq}: "
          f"{wall:.0f} s wall ({r['memory_kind']})")
    if after:
        print("peak RSS per rank after materializing (GiB, the note of rank 0's log):", after)
    peaks = [b / 2**30 for b in r["rank_peak_mem_bytes"]]
    print("peak RSS per rank over the run (GiB):", [round(p, 2) for p in peaks])
    print("under the bound:", all(p * 2**30 < bound for p in peaks))
    del torch
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
