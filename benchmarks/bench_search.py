"""Planner speed on the three target cases (trace on the meta device + joint search).

    python benchmarks/bench_search.py            # all three
    python benchmarks/bench_search.py --case llama3-8b --repeat 3

Targets (issue 4): gpt3-175b on 1,024 H100 (128 nodes) <= 10 s; llama3-8b on 64 H100 <= 3 s;
a 1T-parameter GPT shape (Megatron SC'21 table 1: 128 layers, hidden 25600, 160 heads, seq 2048)
on 3,072 A100-80G <= 30 s. Times are wall-clock seconds on whatever machine runs this; "search CPU s" is the search's
process CPU time (stable when the machine is shared).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree

CASES = {
    # name: (model spec or GPTConfig overrides, world size, cluster, global batch)
    "gpt3-175b": ("gpt3-175b", 1024, "h100", 1536),
    "llama3-8b": ("llama3-8b", 64, "h100", 512),
    "gpt-1t": (
        {"n_layer": 128, "n_head": 160, "n_embd": 25600, "block_size": 2048, "vocab_size": 51200},
        3072,
        "a100-80g",
        3072,
    ),  # fmt: skip
}


def build(spec):
    import torch

    from meshplan.models import load_model
    from meshplan.models.gpt import GPT, GPTConfig
    from meshplan.models.registry import default_inputs

    if isinstance(spec, str):
        m = load_model(spec, device="meta")
        return m.model, m.example_inputs
    with torch.device("meta"):
        model = GPT(GPTConfig(**spec))
    return model, default_inputs(model, device="meta")


def run_case(name: str) -> dict[str, float | str]:
    from meshplan.planner.api import plan_graph
    from meshplan.trace import trace_model

    spec, world, cluster, batch = CASES[name]
    t0 = time.perf_counter()
    model, inputs = build(spec)
    t1 = time.perf_counter()
    graph = trace_model(model, inputs, name=name)
    t2 = time.perf_counter()
    c2 = time.process_time()
    plan = plan_graph(graph, world, cluster=cluster, global_batch_size=batch)
    t3 = time.perf_counter()
    c3 = time.process_time()
    return {
        "case": name, "devices": world, "cluster": cluster, "batch": batch, "build_s": t1 - t0,
        "trace_s": t2 - t1, "search_s": t3 - t2, "search_cpu_s": c3 - c2, "total_s": t3 - t0, "plan": plan.summary(),
        "configs": plan.solver.candidates, "ilp_solves": plan.solver.ilp_solves,
        "mfu": plan.predicted.mfu, "step_s": plan.predicted.step_s,
        "split": f"{plan.solver.split_method} {plan.solver.split_status} {plan.solver.split_seconds:.2f} s"
        if plan.solver.split_method else "-",
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--case", choices=sorted(CASES), action="append")
    ap.add_argument("--repeat", type=int, default=1, help="runs per case; the fastest total is reported")
    args = ap.parse_args()
    import torch  # noqa: F401  (import cost is not part of any case)

    print(
        "| case | devices | cluster | global batch | build s | trace s | search s | search CPU s | total s | configs | ILP solves | stage-split ILP | plan | predicted step s | predicted MFU |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.case or list(CASES):
        r = min((run_case(name) for _ in range(args.repeat)), key=lambda x: x["total_s"])
        print(f"| {r['case']} | {r['devices']} | {r['cluster']} | {r['batch']} | {r['build_s']:.2f} | {r['trace_s']:.2f} "
              f"| {r['search_s']:.2f} | {r['search_cpu_s']:.2f} | {r['total_s']:.2f} | {r['configs']} | {r['ilp_solves']} | {r['split']} | {r['plan']} "
              f"| {r['step_s']:.2f} | {100 * r['mfu']:.1f}% |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
