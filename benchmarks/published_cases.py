"""Predicted vs measured throughput on the 22 published runs in ``meshplan/data/published_cases.json``.

    python benchmarks/published_cases.py [--efficiency h100=0.55 --efficiency a100-80g=0.6 ...]

Each run is costed with ``estimate_graph`` at the authors' configuration (TP/PP/DP degrees,
global batch, microbatch, recompute, FSDP for MosaicML) on the preset of its GPU (V100 on a
16-GPU DGX-2 node, A100 40/80 GB, H100), the model traced on the meta device as a zoo GPT of the
run's shape (MPT: no biases, tied embeddings; learned positions stand in for ALiBi).

Compared quantity: throughput per GPU in tokens/s, which does not depend on a FLOP convention:
measured = global batch · seq / step time (Megatron, which reports step time) or the reported
tokens/s per GPU (MosaicML). The TFLOP/s columns follow each source's convention: Megatron counts
the recomputed forward pass (hardware FLOPs, SC'21 eq. 3); MosaicML reports MFU with
6N + 12·L·h·s model FLOPs per token. Prints the median |error|.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from importlib import resources
from typing import Any

from meshplan.cost_models.formulas import megatron_flops_per_iteration
from meshplan.cost_models.hardware import ClusterSpec


def load_cases() -> list[dict[str, Any]]:
    return json.loads(resources.files("meshplan.data").joinpath("published_cases.json").read_text())


def cluster_for(case: dict[str, Any]) -> ClusterSpec:
    gpu = case["cluster"]["gpu"].upper()
    n = case["cluster"]["n_gpus"]
    per_node = case["cluster"]["gpus_per_node"]
    if "V100" in gpu:
        name = "v100"
    elif "A100" in gpu:
        name = "a100-40g" if "40GB" in gpu else "a100-80g"
    elif "H100" in gpu:
        name = "h100"
    else:
        raise ValueError(f"no preset for {gpu}")
    nodes = max(1, n // per_node)
    spec = ClusterSpec.preset(name, num_nodes=nodes, devices_per_node=per_node).with_devices(n)
    if name in EFFICIENCY:
        spec = dataclasses.replace(spec, matmul_efficiency=EFFICIENCY[name])
    return spec


#: preset name -> matmul_efficiency override (``--efficiency``), to test a calibration
EFFICIENCY: dict[str, float] = {}

_GRAPHS: dict[tuple[Any, ...], Any] = {}


def graph_for(case: dict[str, Any]) -> Any:
    import torch

    from meshplan.models.gpt import GPT, GPTConfig
    from meshplan.models.registry import default_inputs
    from meshplan.trace import trace_model

    m = case["model"]
    mpt = case["id"].startswith("mpt")
    key = (m["layers"], m["hidden"], m["heads"], m["ffn_hidden"], m["seq_len"], m["vocab"], mpt)
    if key not in _GRAPHS:
        cfg = GPTConfig(n_layer=m["layers"], n_head=m["heads"], n_embd=m["hidden"], ffn_hidden=m["ffn_hidden"],
                        vocab_size=m["vocab"], block_size=m["seq_len"], bias=not mpt)  # fmt: skip
        with torch.device("meta"):
            model = GPT(cfg)
        _GRAPHS[key] = trace_model(
            model, default_inputs(model, device="meta"), name=case["id"].rsplit("-", 2)[0]
        )
    return _GRAPHS[key]


def _dp_kind(case: dict[str, Any], dp: int) -> str | None:
    """The authors' data-parallel kind: MosaicML FSDP, Megatron-LM 2020 plain DDP (the
    distributed optimizer came in 2022); None (dp = 1)."""
    if dp == 1:
        return None
    return "fsdp" if case["id"].startswith("mpt") else "ddp"


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    from meshplan.planner.api import estimate_graph

    tr, ex, ms, m = case["training"], case["expert_config"], case["measured"], case["model"]
    tp, pp, dp = ex["tp"], ex["pp"], ex["dp"]
    B = tr["global_batch"]
    mpt = case["id"].startswith("mpt")
    micro = tr.get("micro_batch") or tr.get("per_replica_batch") or B // dp
    recompute = "full" if str(tr.get("recompute", "")).lower().startswith(("yes", "full")) else "none"
    g = graph_for(case)
    spec = cluster_for(case)
    plan = estimate_graph(
        g, spec.num_devices, tp=tp, pp=pp, dp=dp, schedule="1f1b", micro_batch_size=micro, global_batch_size=B,
        recompute=recompute, dp_kind=_dp_kind(case, dp), sequence_parallel=False,
        cluster=spec, dtype="bf16" if mpt else "fp16",
    )  # fmt: skip
    s = m["seq_len"]
    n = spec.num_devices
    pred_tok = B * s / plan.predicted.step_s / n
    if ms.get("step_time_s"):
        meas_tok = B * s / ms["step_time_s"] / n
    else:
        meas_tok = ms["other"]["tokens_per_s_per_gpu"]
    if mpt:  # MosaicML: MFU convention (model FLOPs)
        pred_tflops, conv = plan.predicted.tflops_per_device, "model (MFU)"
    else:  # Megatron: hardware FLOPs incl. recompute (SC'21 eq. 3)
        flops = megatron_flops_per_iteration(B, s, m["layers"], m["hidden"], m["vocab"])
        pred_tflops, conv = flops / plan.predicted.step_s / n / 1e12, "hardware (eq. 3)"
    return {
        "id": case["id"], "gpus": n, "cluster": spec.name, "config": f"tp{tp} pp{pp} dp{dp} mb{micro} rc={recompute}"
        + (" fsdp" if mpt and dp > 1 else ""), "meas_tok": meas_tok, "pred_tok": pred_tok,
        "err": pred_tok / meas_tok - 1, "meas_tflops": ms["tflops_per_gpu"], "pred_tflops": pred_tflops,
        "convention": conv, "fits": not any("does not fit" in x for x in plan.notes),
        "mem_gib": max(plan.predicted.peak_mem_bytes) / 2**30,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--efficiency", action="append", default=[], metavar="PRESET=VALUE",
                    help="override a preset's matmul_efficiency, e.g. h100=0.55")  # fmt: skip
    args = ap.parse_args()
    for item in args.efficiency:
        name, _, value = item.partition("=")
        EFFICIENCY[name] = float(value)
    if EFFICIENCY:
        print(f"matmul_efficiency overrides: {EFFICIENCY}\n")
    t0 = time.perf_counter()
    rows = [run_case(c) for c in load_cases()]
    print("| run | GPUs | preset | config | measured tok/s/GPU | predicted tok/s/GPU | error | measured TFLOP/s | "
          "predicted TFLOP/s | FLOP convention | predicted peak GiB | fits |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['id']} | {r['gpus']} | {r['cluster']} | {r['config']} | {r['meas_tok']:.0f} | {r['pred_tok']:.0f} "
              f"| {100 * r['err']:+.1f}% | {r['meas_tflops']:.1f} | {r['pred_tflops']:.1f} | {r['convention']} "
              f"| {r['mem_gib']:.1f} | {'yes' if r['fits'] else 'no'} |")  # fmt: skip
    errs = [abs(r["err"]) for r in rows]
    print(f"\nmedian |error| {100 * statistics.median(errs):.1f}% over {len(rows)} runs "
          f"(max {100 * max(errs):.1f}%); false \"does not fit\": {sum(not r['fits'] for r in rows)}; "
          f"{time.perf_counter() - t0:.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()
