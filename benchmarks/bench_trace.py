"""Benchmark: trace + annotate time of zoo models (``meshplan.trace_model``).

Usage: ``python benchmarks/bench_trace.py [--repeat 3] [MODEL[@meta] ...]``

Default cases: gpt2-small on real CPU tensors, gpt3-175b and llama3-8b on the meta device, and
the HF tiny Llama (export fallback). Prints a Markdown table: best and median wall seconds of
``trace_model`` over ``--repeat`` runs after one warm-up trace (model building is not timed),
node count, capture, and peak RSS of the process.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

DEFAULT_CASES = ("gpt2-small", "gpt3-175b@meta", "llama3-8b@meta", "hf-llama-tiny")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*", default=list(DEFAULT_CASES))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's maximum)")
    args = ap.parse_args()

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
