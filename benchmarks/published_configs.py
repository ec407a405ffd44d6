"""Published runs costed the way a user costs them: from the run's own configuration text.

``published_cases.py`` costs each published run from its case fields. A user instead hands
``meshplan estimate --from-megatron`` / ``--from-torchtitan`` the arguments or TOML the run used,
written in its engine's layout of the time. This benchmark writes that text for the runs whose engine
wrote a fixed layout (Megatron-LM 2020/2021 scripts: ``--checkpoint-activations``, ``--DDP-impl``;
torchtitan 2024: ``[training] batch_size`` and degrees, ``[experimental]``), costs it through
``api.engine_cost.estimate_config`` on the case's own hardware (``case_cluster``) and prints predicted
against measured, beside the costing from the case fields. ``--as-today`` writes today's argument
names instead: the same runs must cost the same either way.

    python benchmarks/published_configs.py [--only PREFIX] [--as-today] [--omit-seq]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree
from meshplan.api.engine_cost import estimate_config
from meshplan.commands.published_estimate import case_cluster
from meshplan.loading import case_graph

OLD_MEGATRON = ("megatron-lm-2020", "megatron-lm-2021")
OLD_TITAN = ("torchtitan-2024.04", "torchtitan-2024.12")


def megatron_args(c: dict[str, Any], legacy: bool) -> str:
    ex, tr, m = c["expert_config"], c["training"], c["model"]
    mb = tr.get("micro_batch") or tr.get("per_replica_batch")
    v1 = legacy and c["engine"] == "megatron-lm-2020"  # Megatron v1's scripts: --model-parallel-size, --batch-size
    a = [f"--model-parallel-size {ex['tp']}" if v1 else f"--tensor-model-parallel-size {ex['tp']}",
         f"--pipeline-model-parallel-size {ex.get('pp') or 1}",
         f"--batch-size {mb}" if v1 else f"--micro-batch-size {mb}", f"--global-batch-size {tr['global_batch']}",
         f"--num-layers {m['layers']}", f"--seq-length {m['seq_len']}",
         "--fp16" if "fp16" in str(tr.get("precision")) else "--bf16"]
    if ex.get("interleave"):
        a.append(f"--num-layers-per-virtual-pipeline-stage {m['layers'] // (ex['pp'] * ex['interleave'])}")
    if str(tr.get("recompute", "")).startswith(("yes", "full")):
        a.append("--checkpoint-activations" if legacy else "--recompute-granularity full --recompute-method uniform")
    if legacy and ex.get("ddp_impl"):
        a.append(f"--DDP-impl {ex['ddp_impl']}")
    return " ".join(a)


def titan_toml(c: dict[str, Any], legacy: bool) -> str:
    ex, tr, m = c["expert_config"], c["training"], c["model"]
    ac = {"selective op": 'mode = "selective"\nselective_ac_option = "op"', "full": 'mode = "full"'}.get(
        str(tr.get("recompute")), 'mode = "none"')
    batch = "batch_size" if legacy else "local_batch_size"
    degrees = f"data_parallel_shard_degree = {ex['dp']}\ntensor_parallel_degree = {ex['tp']}\n"
    pp = f"pipeline_parallel_degree = {ex.get('pp') or 1}\n"
    body = f"[training]\n{batch} = {tr['per_replica_batch']}\nseq_len = {m['seq_len']}\n"
    if legacy:
        return (f'[model]\nnorm_type = "rmsnorm"\n{body}{degrees}\n[experimental]\n{pp}\n'
                f"[activation_checkpoint]\n{ac}\n")
    return f"{body}\n[parallelism]\n{degrees}{pp}\n[activation_checkpoint]\n{ac}\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="")
    ap.add_argument("--as-today", action="store_true", help="today's argument names instead of the era's")
    ap.add_argument("--omit-seq", action="store_true", help="leave the sequence length out of the text")
    a = ap.parse_args()
    cases = json.load(open("meshplan/data/published_cases.json"))
    rows, errs, nofit = [], [], 0
    for c in cases:
        if not c["id"].startswith(a.only) or c.get("engine") not in OLD_MEGATRON + OLD_TITAN:
            continue
        if c["training"].get("precision", "").lower().startswith(("fp8", "float8")) or (c["expert_config"].get("cp") or 1) > 1:
            continue
        engine = "megatron" if c["engine"] in OLD_MEGATRON else "torchtitan"
        text = (megatron_args if engine == "megatron" else titan_toml)(c, legacy=not a.as_today)
        if a.omit_seq:  # the traced graph carries the sequence (a reader that cannot take a graph and a seq_len)
            text = "\n".join(ln for ln in text.split("\n") if not ln.startswith("seq_len")).replace(
                f"--seq-length {c['model']['seq_len']}", "")
        n = c["cluster"]["n_gpus"]
        est = estimate_config(case_graph(c), text, engine=engine, world_size=n, cluster=case_cluster(c), target=engine)
        p = est.plan.predicted
        tok = c["training"]["global_batch"] * c["model"]["seq_len"] / p.step_s / n
        meas = c["measured"]
        mtok = (meas.get("other") or {}).get("tokens_per_s_per_gpu") or (
            c["training"]["global_batch"] * c["model"]["seq_len"] / meas["step_time_s"] / n if meas.get("step_time_s") else None)
        peak = max(p.peak_mem_bytes) / 2**30
        fits = peak <= c["cluster"]["mem_gb"] * 1e9 / 2**30
        nofit += not fits
        err = (tok / mtok - 1) * 100 if mtok else None
        if err is not None:
            errs.append(abs(err))
        rows.append(f"| {c['id']} | {engine} | {est.config.profile or 'installed'} | {mtok and round(mtok)} | {tok:.0f} | "
                    f"{'—' if err is None else f'{err:+.1f}%'} | {peak:.1f} | {c['cluster']['mem_gb']} | {'yes' if fits else 'NO'} |")
    print("| run | engine | profile read from the text | measured tok/s/GPU | predicted tok/s/GPU | error | predicted peak GiB | GPU GB | fits |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if errs:
        print(f"\n{len(rows)} runs; median |tok/s error| {statistics.median(errs):.1f}% over {len(errs)}; predicted not to fit: "
              f"{nofit} (all of them ran); {'today' if a.as_today else 'their era'}'s argument names (predicted figures from "
              "the cost model, measured from the sources)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
