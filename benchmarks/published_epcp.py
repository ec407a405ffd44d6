"""Predicted vs measured for the published context-parallel runs in ``meshplan/data/published_cases.json`` (#17).

    python benchmarks/published_epcp.py [--ids ID ...] [--schedule interleaved-1f1b --virtual 2]

Costs every case whose ``expert_config`` sets ``cp`` > 1 (the expert-parallel runs are costed by
``benchmarks/published_cases.py``), and the runs its source
published beside it at cp = 1 (same ``group``), at the authors' configuration: the zoo Llama of
the case's shape traced on the meta device at the case's sequence length, the H100 preset with
the case's GPU count (8 per node), ``ConfigEvaluator.evaluate`` on the authors' degrees, one
sequence per microbatch, FSDP, sequence parallelism under TP, no recomputation, the schedule of
``--schedule``/``--virtual`` (default interleaved 1F1B with 2 virtual stages: the source says it
uses an interleaved schedule but not its depth; microbatch, depth and recompute are assumptions,
printed in the configuration column).
The search never emits cp with pp > 1 (the runtime does not execute it); this only costs it
(``docs/cost_model.md``: cp/ep terms under PP).

Compared: TFLOP/s per GPU. The measured figure is the source's; its FLOP convention is not
stated, so the prediction is printed under two: ``6N + 12·L·h·s`` (attention counted whole,
PaLM appendix B, what ``Plan.predicted`` uses) and ``6N + 6·L·h·s`` (causal attention counted
half). Prints one row per case with predicted step time and peak memory. No GPU needed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree


def load_cases(ids: list[str] | None = None) -> list[dict[str, Any]]:
    from meshplan.cost_models.published import assumed_epcp_groups

    cases = json.loads(resources.files("meshplan.data").joinpath("published_cases.json").read_text())
    # expert-parallel (MoE) runs are costed by benchmarks/published_cases.py (a MoE twin of their model)
    epcp_groups = assumed_epcp_groups(cases)
    out = [c for c in cases if c["group"] in epcp_groups]
    return [c for c in out if c["id"] in ids] if ids else out


def run_case(case: dict[str, Any], schedule: str = "interleaved-1f1b", virtual: int = 2) -> dict[str, Any]:
    import torch

    from meshplan.cost_models.hardware import ClusterSpec
    from meshplan.models.llama import Llama, LlamaConfig
    from meshplan.models.meta_init import skip_init_on_meta
    from meshplan.planner.evaluate import ConfigEvaluator
    from meshplan.planner.search_types import Config
    from meshplan.trace import trace_model

    m, x, tr = case["model"], case["expert_config"], case["training"]
    seq = m["seq_len"]
    cfg = LlamaConfig(n_layer=m["layers"], n_head=m["heads"], n_kv_head=m["kv_heads"], dim=m["hidden"],
                      ffn_hidden=m["ffn_hidden"], vocab_size=m["vocab"], max_seq_len=seq, rope_theta=500000.0)
    t0 = time.perf_counter()
    with torch.device("meta"), skip_init_on_meta():
        model = Llama(cfg)
    g = trace_model(model, (torch.zeros(1, seq, dtype=torch.long, device="meta"),), name=case["id"])
    n = case["cluster"]["n_gpus"]
    cluster = ClusterSpec.preset("h100", num_nodes=n // 8, devices_per_node=8).with_devices(n)
    tp, pp, cp, dp = x["tp"], x["pp"], x.get("cp") or 1, x["dp"]
    per_replica = tr["per_replica_batch"]
    c = Config(dp=dp, tp=tp, pp=pp, micro_batch=1, num_microbatches=per_replica, schedule=schedule, virtual_stages=virtual,
               recompute="none", sequence_parallel=tp > 1, dp_kind="fsdp", cp=cp, ep=x.get("ep") or 1)
    ev = ConfigEvaluator(g, cluster, fixed={"tp": tp, "pp": pp, "dp": dp}).evaluate(c)
    tokens = tr["global_batch"] * seq
    L, h = m["layers"], m["hidden"]
    flops = {"6N+12Lhs": 6 * g.param_count + 12 * L * h * seq, "6N+6Lhs": 6 * g.param_count + 6 * L * h * seq}
    pred = {k: f * tokens / ev.step_s / n / 1e12 for k, f in flops.items()}
    return {"id": case["id"], "config": c.summary(), "step_s": ev.step_s, "cp_comm_s": ev.cp_comm_s,
            "peak_gib": ev.max_mem_bytes / 2**30, "fits": ev.fits, "pred_tflops": pred,
            "measured_tflops": case["measured"]["tflops_per_gpu"], "wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ids", nargs="*", help="only these case ids")
    ap.add_argument("--schedule", default="interleaved-1f1b")
    ap.add_argument("--virtual", type=int, default=2, help="virtual stages per rank (interleaved)")
    args = ap.parse_args()
    print(f"{'case':34} {'authors config (costed)':58} {'step s':>8} {'cp ring s':>9} {'peak GiB':>8} "
          f"{'TFLOP/s pred 12Lhs / 6Lhs':>26} {'meas':>5} {'err 12Lhs / 6Lhs':>17}")
    for case in load_cases(args.ids):
        r = run_case(case, args.schedule, args.virtual)
        a, b = r["pred_tflops"]["6N+12Lhs"], r["pred_tflops"]["6N+6Lhs"]
        meas = r["measured_tflops"]
        print(f"{r['id']:34} {r['config']:58} {r['step_s']:8.2f} {r['cp_comm_s']:9.3f} "
              f"{r['peak_gib']:8.1f}{'' if r['fits'] else '!'} {a:12.0f} / {b:11.0f} {meas:5.0f} "
              f"{100 * (a / meas - 1):+7.1f}% / {100 * (b / meas - 1):+6.1f}%  ({r['wall_s']:.0f} s)", flush=True)
    print("all figures predicted by meshplan's cost model except 'meas' (the source's); '!' after the peak: "
          "does not fit the 80 GB H100 as costed")


if __name__ == "__main__":
    main()
