"""Golden check of the planner's costing: every prediction of a spread of plans and estimates,
written once and compared after a refactor that must not change behaviour (issue 33 item 2).

    python benchmarks/golden_costing.py --write FILE [--only SUBSTR] [--no-published]
    python benchmarks/golden_costing.py --check FILE [--only SUBSTR] [--no-published]

The spread: ``plan_graph`` searches (GPT-3 175B on 1,024 H100, Llama-3 8B/70B, Mixtral 8x7B with
expert parallelism, pinned schedules, a QLoRA search, an engine target with its profile, split rule
and DP kinds), ``autoparallel`` with its default state layout, ``estimate_graph`` at given configurations (every pipeline schedule, every DP kind,
recompute kinds, cp, ep, MoE parallel folding, fp8, QLoRA, engine profiles, blocks per stage), a
capacity sweep's rows, and the predictions of every case of ``benchmarks/published_cases.py``
(``commands.published_estimate.estimate_case``). Each result is recorded whole (``Plan.to_dict``)
less the fields that time the planner itself (seconds). ``--check`` prints every differing field
and exits 1 on any difference. Graphs come through the trace cache (``MESHPLAN_CACHE_DIR``).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree

#: keys of a serialized plan / row that time the planner (they differ run to run)
TIMING_KEYS = {"seconds", "split_seconds", "plan_seconds", "phase_s", "ilp_seconds", "search_seconds", "wall_s"}
#: a duration inside a note ("highs, 0.60 s")
TIMED_TEXT = re.compile(r"\b\d+(\.\d+)? s\b")


def _clean(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items() if k not in TIMING_KEYS}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    if isinstance(x, str):
        return TIMED_TEXT.sub("<t> s", x)
    if isinstance(x, float) and not math.isfinite(x):
        return repr(x)
    if hasattr(x, "to_dict"):
        return _clean(x.to_dict())
    if hasattr(x, "__dataclass_fields__"):
        import dataclasses

        return _clean(dataclasses.asdict(x))
    return x


def _graph(name: str) -> Any:
    from meshplan.loading import load_graph

    return load_graph(name)


def _plans() -> dict[str, Callable[[], Any]]:
    from meshplan.planner.api import plan_graph

    def plan(model: str, world: int, **kw: Any) -> Callable[[], Any]:
        return lambda: plan_graph(_graph(model), world, **kw)

    def auto(model: str, world: int, **kw: Any) -> Callable[[], Any]:
        from meshplan import autoparallel

        return lambda: autoparallel(_graph(model), world, **kw)

    return {
        "plan gpt3-175b 1024 h100": plan("gpt3-175b", 1024, cluster="h100", global_batch_size=1536),
        "plan llama3-8b 64 h100": plan("llama3-8b", 64, cluster="h100", global_batch_size=512),
        "plan llama3-70b 256 a100-80g": plan("llama3-70b", 256, cluster="a100-80g", global_batch_size=512),
        "plan mixtral-8x7b 64 h100": plan("mixtral-8x7b", 64, cluster="h100", global_batch_size=256),
        "plan llama3-8b 16 zbv pinned": plan("llama3-8b", 16, cluster="h100", global_batch_size=64,
                                             fixed={"pp": 4, "schedule": "zbv"}),
        "plan llama3-8b 16 interleaved pinned": plan("llama3-8b", 16, cluster="h100", global_batch_size=64,
                                                     fixed={"pp": 2, "schedule": "interleaved-1f1b"}),
        "plan llama3-8b 8 qlora": plan("llama3-8b", 8, cluster="a100-80g", global_batch_size=32, quantization="qlora"),
        "plan gpt3-175b 512 megatron target": plan("gpt3-175b", 512, cluster="a100-80g", global_batch_size=1536,
                                                   profile="megatron-lm-2021", dp_kinds=("none", "ddp")),
        "plan llama3-8b 32 fp8": plan("llama3-8b", 32, cluster="h100", global_batch_size=128, dtype="fp8"),
        "plan llama3-8b 64 exhaustive": plan("llama3-8b", 64, cluster="h100", global_batch_size=256, exhaustive=True),
        # ``meshplan plan`` / ``autoparallel`` with their default state layout: one request fp32 parameters fit, one
        # they do not (16-bit weights do: the default "auto" takes them since wave 3 stop 9)
        "autoparallel llama3-8b 64 h100 default layout": auto("llama3-8b", 64, cluster="h100", global_batch_size=256),
        "autoparallel llama3-8b 8 h100 zero1 pinned default layout": auto(
            "llama3-8b", 8, cluster="h100", global_batch_size=64,
            fixed={"tp": 1, "pp": 1, "dp_kind": "zero1", "recompute": "full"}),
    }  # fmt: skip


def _estimates() -> dict[str, Callable[[], Any]]:
    from meshplan.planner.api import estimate_graph

    def est(model: str, world: int, **kw: Any) -> Callable[[], Any]:
        return lambda: estimate_graph(_graph(model), world, **kw)

    out: dict[str, Callable[[], Any]] = {}
    base = {"cluster": "h100", "global_batch_size": 64}
    for sched, v in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 1), ("zbv", 2)):
        out[f"estimate llama3-8b tp2 pp4 {sched}"] = est("llama3-8b", 16, tp=2, pp=4, dp=2, schedule=sched,
                                                        virtual_stages=v, num_microbatches=8, **base)  # fmt: skip
    for kind in ("ddp", "zero1", "zero2", "fsdp", "hsdp"):
        out[f"estimate llama3-8b dp16 {kind}"] = est("llama3-8b", 16, tp=1, pp=1, dp=16, dp_kind=kind, **base)
    for rc in ("none", "selective", "full"):
        out[f"estimate llama3-70b tp8 pp4 {rc}"] = est("llama3-70b", 64, tp=8, pp=4, dp=2, recompute=rc,
                                                      cluster="h100", global_batch_size=64)  # fmt: skip
    out["estimate llama3-8b auto kind"] = est("llama3-8b", 64, tp=1, pp=1, dp=64, cluster="h100", global_batch_size=128)
    out["estimate llama3-8b cp2"] = est("llama3-8b", 16, tp=2, pp=1, dp=4, cp=2, **base)
    out["estimate mixtral ep4"] = est("mixtral-8x7b", 32, tp=2, pp=2, dp=8, ep=4, cluster="h100", global_batch_size=64)
    out["estimate mixtral ep8 folding"] = est("mixtral-8x7b", 64, tp=4, pp=2, dp=8, ep=8, moe_folding=True,
                                              sequence_parallel=True, cluster="h100", global_batch_size=64,
                                              profile="megatron-core-2024")  # fmt: skip
    out["estimate mixtral ep2 cf1.5"] = est("mixtral-8x7b", 16, tp=1, pp=2, dp=8, ep=2, capacity_factor=1.5,
                                            cluster="h100", global_batch_size=64)  # fmt: skip
    out["estimate llama3-8b fp8"] = est("llama3-8b", 16, tp=2, pp=1, dp=8, dtype="fp8", **base)
    out["estimate llama3-8b qlora"] = est("llama3-8b", 8, tp=1, pp=1, dp=8, quantization="qlora",
                                          cluster="a100-80g", global_batch_size=32)  # fmt: skip
    out["estimate gpt3-175b megatron-lm-2021"] = est("gpt3-175b", 1024, tp=8, pp=16, dp=8, schedule="interleaved-1f1b",
                                                     virtual_stages=2, micro_batch_size=1, cluster="a100-80g",
                                                     global_batch_size=1536, profile="megatron-lm-2021")  # fmt: skip
    out["estimate gpt3-175b blocks_per_stage"] = est("gpt3-175b", 512, tp=8, pp=8, dp=8, micro_batch_size=1,
                                                     blocks_per_stage=(12,) * 8, cluster="a100-80g",
                                                     global_batch_size=512, profile="megatron-lm-2021")  # fmt: skip
    out["estimate llama3-70b torchtitan fsdp"] = est("llama3-70b", 64, tp=8, pp=1, dp=8, dp_kind="fsdp",
                                                     cluster="h100", global_batch_size=64,
                                                     profile="torchtitan-2024.12")  # fmt: skip
    out["estimate llama3-8b does not fit"] = est("llama3-8b", 1, tp=1, pp=1, dp=1, cluster="a100-80g",
                                                 global_batch_size=16)  # fmt: skip
    return out


def _capacity() -> dict[str, Callable[[], Any]]:
    from meshplan.sizing.api import capacity

    return {"capacity llama3-70b h100,a100-80g 128-1024": lambda: capacity(
        "llama3-70b", tokens="15T", gpus="128,256,512,1024", clusters=("h100", "a100-80g"), jobs=1)}


def _published() -> dict[str, Callable[[], Any]]:
    from pathlib import Path

    from meshplan.commands import published_estimate as pe
    from meshplan.cost_models.published import assumed_epcp_groups, load_published_cases
    from meshplan.loading import case_graph

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import published_epcp  # the cases with context parallelism, as benchmarks/published_cases.py leaves them to it

    cases = load_published_cases()
    cp_groups = assumed_epcp_groups(cases)
    out: dict[str, Callable[[], Any]] = {}
    for case in cases:
        def run(case: dict[str, Any] = case) -> Any:
            try:
                if case["group"] in cp_groups:
                    return published_epcp.run_case(case)
                return pe.estimate_case(case, case_graph(case))
            except Exception as e:  # recorded: a case the costing refuses must keep refusing the same way
                return {"error": f"{type(e).__name__}: {e}"}

        out[f"published {case['id']}"] = run
    return out


def collect(only: str, published: bool) -> dict[str, Any]:
    cases = {**_plans(), **_estimates(), **_capacity(), **(_published() if published else {})}
    out: dict[str, Any] = {}
    for name, fn in cases.items():
        if only and only not in name:
            continue
        t0 = time.perf_counter()
        try:
            out[name] = _clean(fn())
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"{time.perf_counter() - t0:7.2f} s  {name}", file=sys.stderr, flush=True)
    return out


def diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{path}/{k}: {'missing before' if k not in a else 'missing after'}")
            else:
                out += diff(a[k], b[k], f"{path}/{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {str(a)[:200]} -> {str(b)[:200]}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="FILE")
    mode.add_argument("--check", metavar="FILE")
    ap.add_argument("--only", default="", help="only the entries whose name contains this")
    ap.add_argument("--no-published", action="store_true", help="leave out the published cases")
    a = ap.parse_args()
    got = collect(a.only, not a.no_published)
    if a.write:
        with open(a.write, "w") as fh:
            json.dump(got, fh, indent=1, sort_keys=True)
        print(f"wrote {len(got)} entries to {a.write}")
        return
    with open(a.check) as fh:
        want = json.load(fh)
    want = {k: v for k, v in want.items() if k in got}
    bad = diff(want, json.loads(json.dumps(got)))
    for line in bad:
        print(line)
    print(f"{len(got)} entries: {'IDENTICAL' if not bad else f'{len(bad)} differing fields'}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
