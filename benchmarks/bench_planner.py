"""Planner speed: search growth over world sizes × layer counts, and the whole-command targets.

    python benchmarks/bench_planner.py growth [--worlds 8 64 512 4096 16384] [--layers 12 48 96 200]
    python benchmarks/bench_planner.py commands [--cache-dir DIR] [--only SUBSTR ...] [--repeat N] [--no-compile]

``growth``: for each (world size, layer count) a GPT (hidden 4096, 32 heads, seq 2048) is traced on
the meta device (through the trace cache, so each depth is traced once) and searched on H100
(global batch 2 × world); prints the search time split by phase (measured wall seconds:
enumerate incl. the TP placement ILPs, bound, cost, simulate, finalize incl. the stage-split ILPs), the configurations enumerated / costed /
skipped as unable to change the result (``planner.search_prune``) / simulated,
the search's CPU seconds (steadier than wall on a shared machine), the CPU time per costed
configuration, and two growth exponents: the least-squares slope of log(search CPU s) against
log(configurations costed), and against log(candidate configurations enumerated), over the rows
where something was costed (1.0 = linear).

``commands``: the issue's targets as whole ``meshplan plan`` commands (Python start-up and import
included), each run twice: cold (an empty trace cache of its own) and warm (cache filled by the cold run);
prints measured wall and user+sys CPU seconds of the child process (CPU time is the stable figure
on a shared machine; on an idle machine a single-threaded command's wall time is about its CPU
time), the 1-minute load average before the case, the goal (seconds) and the planner's own search
seconds. ``--only`` runs the cases whose name contains one of the given strings (e.g. ``8b``),
``--repeat N`` each case N times (cold and warm each time, a fresh empty cache for every cold run).
Before timing, meshplan's bytecode is compiled (``compileall`` into its ``__pycache__``), as an
installed package has it: with ``PYTHONDONTWRITEBYTECODE=1`` (this machine's shells set it) an
editable checkout would recompile every meshplan module on every run (~0.1 s CPU of a cold plan).
``--no-compile`` skips that step (bytecode already in the tree's ``__pycache__`` is still used).
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree

ROOT = Path(__file__).resolve().parent.parent
HF70B = str(ROOT / "benchmarks" / "models" / "hf_llama3_70b.py") + ":model"
GPT1T = str(ROOT / "benchmarks" / "models" / "gpt_1t.py") + ":model"

#: name: (model spec, world size, cluster, global batch, goal in seconds (issue 21))
TARGETS = {
    "gpt3-175b @ 1024 H100": ("gpt3-175b", 1024, "h100", 1536, 10.0),
    "gpt3-175b @ 16384 H100": ("gpt3-175b", 16384, "h100", 16384, 10.0),
    "gpt-1t @ 3072 A100": (GPT1T, 3072, "a100-80g", 3072, 10.0),
    "hf llama-3-70b @ 512 H100": (HF70B, 512, "h100", 1024, 10.0),
    "llama3-8b @ 64 H100": ("llama3-8b", 64, "h100", 512, 3.0),
}


def _graph(layers: int):
    import torch

    from meshplan.models.gpt import GPT, GPTConfig
    from meshplan.models.meta_init import skip_init_on_meta
    from meshplan.models.registry import default_inputs
    from meshplan.trace import trace_model
    from meshplan.tracing.cache import GraphCache
    from meshplan.tracing.fingerprint import model_key

    with torch.device("meta"), skip_init_on_meta():
        model = GPT(GPTConfig(n_layer=layers, n_head=32, n_embd=4096, block_size=2048, vocab_size=50304))
    inputs = default_inputs(model, device="meta")
    cache = GraphCache()
    key = model_key(model, inputs)
    g = cache.get(key)
    if g is None:
        g = trace_model(model, inputs, name=f"gpt-{layers}L")
        cache.put(key, g)
    return g


def growth(worlds: list[int], layer_counts: list[int]) -> None:
    from meshplan.cost_models.hardware import resolve_cluster
    from meshplan.planner.costing import GraphCoster
    from meshplan.planner.search import Searcher

    phases = ("enumerate", "bound", "cost", "simulate", "finalize")
    head = f"{'world':>6} {'layers':>6} {'configs':>7} {'costed':>6} {'skipped':>7} {'simul':>5} " + " ".join(
        f"{p:>9}" for p in phases
    ) + f" {'search s':>8} {'CPU s':>6} {'ms/costed':>9}"
    print("search time per phase, measured wall seconds on this machine; CPU s = the search's process CPU time")
    print(head)
    pts = []
    for layers in layer_counts:
        g = _graph(layers)
        for world in worlds:
            spec = resolve_cluster("h100", world)
            s = Searcher(g, spec, global_batch=2 * world, coster=GraphCoster(g, spec))
            t0, c0 = time.perf_counter(), time.process_time()
            r = s.run()
            total, cpu = time.perf_counter() - t0, time.process_time() - c0
            pts.append((r.candidates, r.evaluated, cpu))
            print(
                f"{world:>6} {layers:>6} {r.candidates:>7} {r.evaluated:>6} {r.skipped:>7} {r.simulated:>5} "
                + " ".join(f"{r.phase_s.get(p, 0.0):>9.3f}" for p in phases)
                + f" {total:>8.2f} {cpu:>6.2f} {1e3 * cpu / max(1, r.evaluated):>9.2f}",
                flush=True,
            )
    for label, col in (("configurations costed", 1), ("candidate configurations", 0)):
        rows = [(p[col], p[2]) for p in pts if p[1] > 0]  # a row where nothing was costed has no search to time
        print(f"growth exponent: search CPU s ~ ({label})^{_slope(rows):.2f} over {len(rows)} rows with something costed")


def _slope(rows: list[tuple[int, float]]) -> float:
    """Least-squares slope of log(CPU s) against log(count): 1.0 = linear growth."""
    xs = [math.log(n) for n, _ in rows]
    ys = [math.log(t) for _, t in rows]
    if len(xs) < 2:
        return float("nan")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / max(1e-12, sum((x - mx) ** 2 for x in xs))


def _run(cmd: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    done = [ln for ln in out.stderr.splitlines() if "done:" in ln]
    return wall, cpu, done[-1].split("done:")[-1].strip() if done else ""


def commands(cache_dir: str | None, only: list[str] | None = None, repeat: int = 1, compile_first: bool = True) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    base = cache_dir or tempfile.mkdtemp(prefix="meshplan-bench-cache-")
    if not compile_first:
        print("meshplan's bytecode not compiled first (--no-compile)")
    else:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "meshplan")], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        print("meshplan's bytecode compiled first (compileall), as an installed package has it")
    wall, cpu, _ = _run([sys.executable, "-c", "import meshplan"], env)
    print(f"python -c 'import meshplan': {wall:.2f} s wall, {cpu:.2f} s CPU (measured)")
    print(f"{'case':<28} {'load':>5} {'cold wall':>9} {'cold CPU':>8} {'warm wall':>9} {'warm CPU':>8} {'goal':>5}"
          "  search (warm)")  # fmt: skip
    for name, (model, world, cluster, batch, goal) in TARGETS.items():
        if only and not any(o.lower() in name.lower() for o in only):
            continue
        cmd = [sys.executable, "-m", "meshplan.cli", "plan", model, "-n", str(world), "--cluster", cluster,
               "--global-batch", str(batch)]  # fmt: skip
        for _ in range(repeat):
            # each cold run its own cache: two cases of one model (175B at 1024 and 16384) share a
            # graph, so a shared cache would make the second "cold" run warm
            env["MESHPLAN_CACHE_DIR"] = tempfile.mkdtemp(prefix="case-", dir=base)
            load = os.getloadavg()[0]
            cold = _run(cmd, env)
            warm = _run(cmd, env)
            print(f"{name:<28} {load:>5.2f} {cold[0]:>9.2f} {cold[1]:>8.2f} {warm[0]:>9.2f} {warm[1]:>8.2f} "
                  f"{goal:>5.0f}  {warm[2]}", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    g = sub.add_parser("growth")
    g.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 512, 4096, 16384])
    g.add_argument("--layers", type=int, nargs="+", default=[12, 48, 96, 200])
    c = sub.add_parser("commands")
    c.add_argument("--cache-dir", default=None, help="where the per-case trace caches go (default: a fresh temporary dir)")
    c.add_argument("--only", nargs="+", default=None, help="only the cases whose name contains one of these strings")
    c.add_argument("--repeat", type=int, default=1, help="run each case this many times (default 1)")
    c.add_argument("--no-compile", action="store_true", help="do not compile meshplan's bytecode before timing")
    args = ap.parse_args()
    if args.what == "growth":
        growth(args.worlds, args.layers)
    else:
        commands(args.cache_dir, args.only, args.repeat, not args.no_compile)


if __name__ == "__main__":
    main()
