"""Runtime benchmarks (2 ranks, one thread each, gloo on CPU).

    (runtime overhead against hand-written loops: ``benchmarks/bench_overhead.py``)
    python benchmarks/bench_runtime.py predict --cluster profile.json [--steps 8] [--repeats 3]
        plans costed by ``meshplan.planner.api.estimate_graph`` on a ``meshplan profile`` of this
        machine (dtype fp32, what the CPU runtime executes) vs the runtime's measured step time
        (median of ``steps`` steps; with ``repeats`` > 1, the median over that many spawns).
    python benchmarks/bench_runtime.py nodes --cluster profile.json [--batch 4]
        one process, one thread: every traced node of the GPT run alone (forward, then backward
        with autograd), summed per node kind, vs ``cost_models.compute.node_time`` on the profile,
        with and without the profile's eager calibration; plus the whole model and AdamW's step.

Each mode spawns its 2 ranks once (``tcp://127.0.0.1``) and runs every configuration inside.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree
from meshplan.profile.machine import median_time_s

CFG = dict(n_layer=4, n_head=4, n_embd=256, vocab_size=2048, block_size=128, tie_weights=False)
BATCH, SEQ = 8, 128


def _model() -> nn.Module:
    from meshplan.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(**CFG))  # type: ignore[arg-type]


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _opt(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, foreach=False)


def _data(step: int, batch: int = BATCH, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    t = torch.randint(0, CFG["vocab_size"], (batch, seq + 1), generator=g)  # type: ignore[call-overload]
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _timed(step_fn: Any, steps: int, offset: int) -> list[float]:
    out = []
    for s in range(steps):
        x, y = _data(offset + s)
        dist.barrier()
        t0 = time.perf_counter()
        step_fn(x, y)
        out.append(time.perf_counter() - t0)
    return out


PREDICT_CASES = [
    dict(dp=2, tp=1, pp=1, schedule="1f1b", num_microbatches=1),
    dict(dp=2, tp=1, pp=1, schedule="1f1b", num_microbatches=2),
    dict(dp=1, tp=2, pp=1, schedule="1f1b", num_microbatches=1),
    dict(dp=1, tp=1, pp=2, schedule="gpipe", num_microbatches=4),
    dict(dp=1, tp=1, pp=2, schedule="1f1b", num_microbatches=4),
    dict(dp=1, tp=1, pp=2, schedule="1f1b", num_microbatches=8),
    dict(dp=1, tp=1, pp=2, schedule="interleaved-1f1b", num_microbatches=4, virtual_stages=2),
    dict(dp=1, tp=1, pp=2, schedule="zero-bubble", num_microbatches=4),
]


def predict_worker(rank: int, world: int, plans_json: list[str], steps: int) -> list[dict[str, Any]]:
    from meshplan.plan import Plan
    from meshplan.runtime.apply.api import apply_plan

    out = []
    for pj in plans_json:
        plan = Plan.from_json(pj)
        model = _model()
        ex = (_data(0)[0][: plan.micro_batch_size],)
        pm = apply_plan(model, plan, loss_fn=_loss, optimizer_factory=_opt, example_inputs=ex)
        pm.step(*_data(0, plan.global_batch_size))
        times = []
        for s in range(steps):
            x, y = _data(s + 1, plan.global_batch_size)
            dist.barrier()
            t0 = time.perf_counter()
            pm.step(x, y)
            times.append(time.perf_counter() - t0)
        out.append({"plan": plan.summary(), "predicted_ms": plan.predicted.step_s * 1e3,
                    "measured_ms": statistics.median(times) * 1e3, "notes": pm.notes})
    return out


def _node_callable(gm: Any, n: Any, env: dict[str, Any]) -> tuple[Any, list[torch.Tensor]]:
    """A closure running fx node ``n`` alone on fresh leaf copies of its recorded inputs, and the
    tensors its backward differentiates (float inputs, the module's parameters)."""
    from torch.fx.node import map_arg
    from torch.utils._pytree import tree_map

    leaves: list[torch.Tensor] = []

    def prep(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            t = v.detach().clone().requires_grad_(True)
            leaves.append(t)
            return t
        return v

    args = tree_map(prep, map_arg(n.args, lambda m: env[m.name]))
    kwargs = tree_map(prep, map_arg(n.kwargs, lambda m: env[m.name]))
    if n.op == "call_module":
        mod = gm.get_submodule(n.target)
        return (lambda: mod(*args, **kwargs)), leaves + list(mod.parameters())
    if n.op == "call_function":
        return (lambda: n.target(*args, **kwargs)), leaves
    return (lambda: getattr(args[0], n.target)(*args[1:], **kwargs)), leaves


def nodes_report(cluster: str, batch: int, reps: int = 15) -> None:
    """Per-kind measured vs predicted node times (see the module docstring); prints tables."""
    import dataclasses

    from torch import fx

    from meshplan.cost_models.compute import node_time
    from meshplan.cost_models.hardware import ClusterSpec
    from meshplan.trace import capture, trace_model

    torch.set_num_threads(1)
    spec = ClusterSpec.load(cluster)
    flat = dataclasses.replace(spec, op_overhead_s=0.0, bwd_op_overhead_s=0.0, matmul_efficiency_by_flops=[])
    model = _model()
    x, y = _data(0, batch)
    graph = trace_model(model, (x,))
    gm, _ = capture(model, (x,))
    in_bytes: dict[int, int] = {}
    for _, d, b in graph.edges:
        in_bytes[d] = in_bytes.get(d, 0) + b
    by_name = {n.name: n for n in graph.nodes}
    env: dict[str, Any] = {}

    class _Record(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            env[n.name] = super().run_node(n)
            return env[n.name]

    _Record(gm).run(x)
    agg: dict[str, list[float]] = {}
    for n in gm.graph.nodes:
        gn = by_name.get(n.name)
        if n.op in ("placeholder", "output", "get_attr") or gn is None:
            continue
        f, wrt = _node_callable(gm, n, env)
        t_f = median_time_s(f, reps)
        out = f()
        t_b = 0.0
        if isinstance(out, torch.Tensor) and out.requires_grad:
            go = torch.ones_like(out)
            t_b = max(0.0, median_time_s(lambda f=f, wrt=wrt, go=go: torch.autograd.grad(f(), wrt, go, allow_unused=True), reps) - t_f)
        new = node_time(gn, spec, dtype="fp32", input_bytes=in_bytes.get(gn.id, 0))
        old = node_time(gn, flat, dtype="fp32", input_bytes=in_bytes.get(gn.id, 0))
        a = agg.setdefault(gn.kind, [0.0] * 7)
        for i, v in enumerate((1, t_f, t_b, old.fwd_s, old.bwd_s, new.fwd_s, new.bwd_s)):
            a[i] += v
    print(f"per node kind, microbatch {batch}x{SEQ}, 1 thread (ms): measured alone vs node_time "
          "without / with the eager calibration")
    print("| kind | nodes | measured fwd | measured bwd | flat fwd | flat bwd | calibrated fwd | calibrated bwd |")
    print("|---|---|---|---|---|---|---|---|")
    tot = [0.0] * 7
    for k, a in sorted(agg.items()):
        tot = [t + v for t, v in zip(tot, a, strict=True)]
        print(f"| {k} | {int(a[0])} | " + " | ".join(f"{v * 1e3:.2f}" for v in a[1:]) + " |")
    print(f"| **sum** | {int(tot[0])} | " + " | ".join(f"**{v * 1e3:.1f}**" for v in tot[1:]) + " |")
    opt = _opt(list(model.parameters()))

    def fb() -> None:
        _loss(model(x), y).backward()

    t_fwd = median_time_s(lambda: model(x), 7)
    t_fb = median_time_s(fb, 7)
    t_opt = median_time_s(opt.step, 7)  # grads stay set: every step does the full AdamW update
    params = sum(p.numel() for p in model.parameters())
    print(f"whole model (one call, loss included): fwd {t_fwd * 1e3:.1f} ms, fwd+bwd {t_fb * 1e3:.1f} ms; "
          f"AdamW (foreach=False) step {t_opt * 1e3:.1f} ms for {params} parameters "
          f"(2·16 B/param at the profile's memory bandwidth: {32 * params / spec.mem_bw_bytes_per_s * 1e3:.1f} ms)")


def make_plans(cluster: str) -> list[str]:
    from meshplan.planner.api import estimate_graph
    from meshplan.trace import trace_model

    model = _model()
    graph = trace_model(model, (_data(0)[0][:1],))
    plans = []
    for kw in PREDICT_CASES:
        p = estimate_graph(graph, 2, global_batch_size=BATCH, cluster=cluster, dtype="fp32", optimizer="adam", **kw)
        plans.append(p.to_json())
    return plans


# ---- spawning ---------------------------------------------------------------------------------------
def _entry(rank: int, world: int, port: int, fn: Any, args: tuple, q: Any) -> None:
    torch.set_num_threads(1)
    os.environ["WORLD_SIZE"] = str(world)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        res = fn(rank, world, *args)
        if rank == 0:
            q.put(res)
    finally:
        dist.destroy_process_group()


def spawn(fn: Any, *args: Any, world: int = 2) -> Any:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.start_processes(_entry, args=(world, port, fn, args, q), nprocs=world, join=True, start_method="spawn")
    return q.get()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("predict", "nodes"))
    ap.add_argument("--repeats", type=int, default=1, help="predict: spawns to take the median over")
    ap.add_argument("--batch", type=int, default=4, help="nodes: microbatch size")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--cluster", default=None, help="profile JSON from `meshplan profile` (predict mode)")
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args(argv)
    if a.mode == "nodes":
        if not a.cluster:
            print("nodes needs --cluster profile.json (run `meshplan profile -o profile.json`)", file=sys.stderr)
            return 2
        print(f"model GPT {CFG}")
        nodes_report(a.cluster, a.batch)
        return 0
    print(f"model GPT {CFG}, global batch {BATCH}x{SEQ}, 2 ranks x 1 thread, gloo")
    if not a.cluster:
        print("predict needs --cluster profile.json (run `meshplan profile -o profile.json`)", file=sys.stderr)
        return 2
    plans = make_plans(a.cluster)
    runs, loads = [], [os.getloadavg()[0]]
    for _ in range(max(1, a.repeats)):
        runs.append(spawn(predict_worker, plans, a.steps))
        loads.append(os.getloadavg()[0])
    res = runs[0]
    for i, r in enumerate(res):
        r["runs_ms"] = [run[i]["measured_ms"] for run in runs]
        r["measured_ms"] = statistics.median(r["runs_ms"])
        r["best_run_ms"] = min(r["runs_ms"])
    print(f"1-minute load average before/after each spawn: {', '.join(f'{x:.1f}' for x in loads)}")
    print("| plan | predicted ms | measured ms (median) | error | fastest run ms | error |")
    print("|---|---|---|---|---|---|")
    errs, errs_best = [], []
    for r in res:
        e = r["predicted_ms"] / r["measured_ms"] - 1
        eb = r["predicted_ms"] / r["best_run_ms"] - 1
        errs.append(abs(e))
        errs_best.append(abs(eb))
        print(f"| {r['plan']} | {r['predicted_ms']:.1f} | {r['measured_ms']:.1f} | {e:+.1%} "
              f"| {r['best_run_ms']:.1f} | {eb:+.1%} |")
    print(f"median |error| {statistics.median(errs):.1%} (median of runs), "
          f"{statistics.median(errs_best):.1%} (fastest run) over {len(errs)} plans")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
