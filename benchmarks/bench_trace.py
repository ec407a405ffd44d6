"""Benchmark: trace + annotate time of zoo models (``meshplan.trace_model``).

Usage: ``python benchmarks/bench_trace.py [--repeat 3] [MODEL[@meta] ...]``
       ``python benchmarks/bench_trace.py --cold [SPEC ...]``

Default cases: gpt2-small on real CPU tensors, gpt3-175b and llama3-8b on the meta device, and
the HF tiny Llama (export fallback). Prints a Markdown table: best and median wall seconds of
``trace_model`` over ``--repeat`` runs after one warm-up trace (model building is not timed),
node count, capture, and peak RSS of the process.

``--cold``: a user's first plan. Each spec (zoo name or ``file.py:factory``) is built on the meta
device and traced by ``load_graph(spec, use_cache=False)`` once, in a fresh process that has
imported torch and meshplan (not timed); prints the measured CPU seconds (user+sys, steadier than
wall on a shared machine) and wall seconds of that call, the load average, and which heavy modules
the trace imported (torch._dynamo, sympy, triton).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

_COLD = """
import os, sys, time
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree
import meshplan.trace
from meshplan.loading import load_graph
t, w = time.process_time(), time.perf_counter()
g = load_graph(sys.argv[1], use_cache=False)
heavy = [m for m in ("torch._dynamo", "sympy", "triton") if m in sys.modules]
print(f"| {sys.argv[1]} | {len(g)} | {time.process_time() - t:.2f} | {time.perf_counter() - w:.1f} | "
      f"{os.getloadavg()[0]:.1f} | {', '.join(heavy) or '-'} |")
"""


def cold(specs: list[str]) -> None:
    print("| spec | nodes | build+trace CPU s | wall s | load | imported by the trace |")
    print("|---|---|---|---|---|---|")
    for spec in specs:
        out = subprocess.run([sys.executable, "-c", _COLD, spec], capture_output=True, text=True, env=os.environ)
        if out.returncode != 0:
            raise SystemExit(f"{spec}: {out.stderr[-2000:]}")
        print(out.stdout.strip(), flush=True)

DEFAULT_CASES = ("gpt2-small", "gpt3-175b@meta", "llama3-8b@meta", "hf-llama-tiny")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*", default=list(DEFAULT_CASES))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's maximum)")
    ap.add_argument("--cold", action="store_true", help="first trace of each spec in a fresh process (see above)")
    args = ap.parse_args()
    if args.cold:
        cold(args.cases if args.cases != list(DEFAULT_CASES) else ["gpt3-175b", "llama3-8b"])
        return

    from meshplan.models import load_model
    from meshplan.trace import trace_model

    print("| model | device | seq | capture | nodes | blocks | best s | median s | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case in args.cases:
        name, _, dev = case.partition("@")
        spec = load_model(name, device=dev or None, seq_len=args.seq)
        trace_model(spec.model, spec.example_inputs)  # warm-up (first-use costs of fake tensors, export)
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            g = trace_model(spec.model, spec.example_inputs)
            times.append(time.perf_counter() - t0)
        rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        blocks = ", ".join(f"{b.module_class}x{b.count}" for b in g.blocks) or "-"
        print(f"| {name} | {dev or 'cpu'} | {g.seq_len} | {g.capture} | {len(g)} | {blocks} | "
              f"{min(times):.2f} | {statistics.median(times):.2f} | {rss_mib:.0f} |", flush=True)


if __name__ == "__main__":
    main()
