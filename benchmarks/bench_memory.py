"""meshplan's predicted peak memory against PyTorch's fake-tensor accounting of the same program.

For every runtime path (FSDP2 / ZeRO-2 / HSDP, TP, TP+SP, CP, QLoRA and QAT alone / under DDP, FSDP2, TP
and a pipeline, pipeline schedules, recompute kinds; the zoo MoE alone, under DDP, FSDP2 and EP with
cp / a pipeline / full recompute, its routing balanced: ``fake_memory.BalancedRouting``)
a zoo Llama is planned with ``estimate_graph`` (h100 preset, bf16) and the plan is executed by
meshplan's runtime under fake tensors on a fake process group (``benchmarks/fake_memory.py``),
one process standing in for one rank of the plan's mesh, per pipeline rank. Prints one row per
(path, pipeline rank): predicted, measured (MemTracker peak) and the relative error.

    python benchmarks/bench_memory.py                 # the small sizes (what the tests check)
    python benchmarks/bench_memory.py --size 8b       # Llama-3-8B shapes, seq 2048
    python benchmarks/bench_memory.py --size 70b --only fsdp,tp
    python benchmarks/bench_memory.py --size 70b --layers 2,4   # 70B shapes, 2 and 4 blocks: per-block scaling
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from fake_memory import UNSUPPORTED, measure  # noqa: E402

from meshplan.cost_models.engine_profiles import MESHPLAN, MESHPLAN_BF16, MESHPLAN_BF16_GRADS  # noqa: E402
from meshplan.models.llama import LLAMA_PRESETS, Llama, LlamaConfig  # noqa: E402
from meshplan.models.moe import MOE_PRESETS, MoEConfig, moe_llama  # noqa: E402
from meshplan.planner.api import estimate_graph  # noqa: E402
from meshplan.trace import trace_model  # noqa: E402

SIZES: dict[str, tuple[LlamaConfig, int, int]] = {  # config, seq, micro batch
    "small": (LlamaConfig(n_layer=4, n_head=8, n_kv_head=4, dim=1024, ffn_hidden=2048, vocab_size=4096,
                          max_seq_len=512, rope_theta=10000.0), 512, 2),
    "medium": (LlamaConfig(n_layer=8, n_head=16, n_kv_head=4, dim=1024, ffn_hidden=2816, vocab_size=8192,
                           max_seq_len=1024), 1024, 1),
    "8b": (LLAMA_PRESETS["llama3-8b"], 2048, 1),
    "70b": (LLAMA_PRESETS["llama3-70b"], 2048, 1),
}


#: the MoE paths' model per size: the zoo MoE (Mixtral-shaped; mixtral-8x7b shapes at 8b / 70b)
MOE_SIZES: dict[str, MoEConfig] = {
    "small": MoEConfig(n_layer=4, n_head=8, n_kv_head=4, dim=1024, ffn_hidden=1024, vocab_size=4096, max_seq_len=512,
                       num_experts=8, top_k=2),
    "medium": MoEConfig(n_layer=8, n_head=16, n_kv_head=4, dim=1024, ffn_hidden=2816, vocab_size=8192,
                        max_seq_len=1024, num_experts=8, top_k=2),
    "8b": MOE_PRESETS["mixtral-8x7b"],
    "70b": MOE_PRESETS["mixtral-8x7b"],
}


@dataclass(frozen=True)
class Path_:
    name: str
    world: int
    kw: dict[str, Any] = field(default_factory=dict)
    microbatches: int = 1
    moe: bool = False  # the zoo MoE (MOE_SIZES) instead of the zoo Llama


def paths(big: bool) -> list[Path_]:
    """The runtime paths checked; ``big`` uses the mesh sizes a 8B/70B model needs."""
    w = 8 if big else 2
    return [
        Path_("single", 1, dict(tp=1, pp=1, dp=1)),
        Path_("single accum4", 1, dict(tp=1, pp=1, dp=1), microbatches=4),
        Path_("single+recompute_full", 1, dict(tp=1, pp=1, dp=1, recompute="full"), microbatches=2),
        Path_("single+recompute_op", 1, dict(tp=1, pp=1, dp=1, recompute="op"), microbatches=2),
        Path_("ddp", w, dict(tp=1, pp=1, dp=w, dp_kind="ddp")),
        Path_("zero1", w, dict(tp=1, pp=1, dp=w, dp_kind="zero1"), microbatches=2),
        Path_("fsdp", w, dict(tp=1, pp=1, dp=w, dp_kind="fsdp")),
        Path_("zero2", w, dict(tp=1, pp=1, dp=w, dp_kind="zero2")),
        Path_("hsdp", 2 * w, dict(tp=1, pp=1, dp=2 * w, dp_kind="hsdp")),
        Path_("fsdp+recompute_full", w, dict(tp=1, pp=1, dp=w, dp_kind="fsdp", recompute="full")),
        Path_("fsdp+recompute_selective", w, dict(tp=1, pp=1, dp=w, dp_kind="fsdp", recompute="selective")),
        Path_("fsdp+recompute_op", w, dict(tp=1, pp=1, dp=w, dp_kind="fsdp", recompute="op")),
        Path_("fsdp+accum4", w, dict(tp=1, pp=1, dp=w, dp_kind="fsdp"), microbatches=4),
        Path_("tp", w, dict(tp=w, pp=1, dp=1, sequence_parallel=False)),
        Path_("tp+sp", w, dict(tp=w, pp=1, dp=1, sequence_parallel=True)),
        Path_("2d fsdp x tp", 2 * w, dict(tp=w, pp=1, dp=2, dp_kind="fsdp", sequence_parallel=False)),
        Path_("cp", w, dict(tp=1, pp=1, dp=1, cp=w)),
        Path_("cp x fsdp (dp1)", w, dict(tp=1, pp=1, dp=1, cp=w, dp_kind="fsdp")),
        Path_("cp x fsdp (dp2)", 2 * w, dict(tp=1, pp=1, dp=2, cp=w, dp_kind="fsdp")),
        Path_("cp x zero2 (dp2)", 2 * w, dict(tp=1, pp=1, dp=2, cp=w, dp_kind="zero2")),
        Path_("fsdp qlora", w, dict(tp=1, pp=1, dp=w, dp_kind="fsdp", quantization="qlora")),
        Path_("zero2 qlora", w, dict(tp=1, pp=1, dp=w, dp_kind="zero2", quantization="qlora")),
        Path_("hsdp qlora", 2 * w, dict(tp=1, pp=1, dp=2 * w, dp_kind="hsdp", quantization="qlora")),
        Path_("fsdp qat", w, dict(tp=1, pp=1, dp=w, dp_kind="fsdp", quantization="qat")),
        Path_("single qat", 1, dict(tp=1, pp=1, dp=1, quantization="qat")),
        Path_("single qat accum2+recompute_full", 1, dict(tp=1, pp=1, dp=1, quantization="qat", recompute="full"),
              microbatches=2),
        Path_("ddp qat", w, dict(tp=1, pp=1, dp=w, dp_kind="ddp", quantization="qat")),
        Path_("zero2 qat", w, dict(tp=1, pp=1, dp=w, dp_kind="zero2", quantization="qat")),
        Path_("hsdp qat", 2 * w, dict(tp=1, pp=1, dp=2 * w, dp_kind="hsdp", quantization="qat")),
        Path_("tp qat", w, dict(tp=w, pp=1, dp=1, sequence_parallel=False, quantization="qat")),
        Path_("pp 1f1b qat", 2, dict(tp=1, pp=2, dp=1, schedule="1f1b", quantization="qat"), microbatches=4),
        Path_("single qlora", 1, dict(tp=1, pp=1, dp=1, quantization="qlora")),
        Path_("single qlora+recompute_op", 1, dict(tp=1, pp=1, dp=1, quantization="qlora", recompute="op")),
        Path_("ddp qlora", w, dict(tp=1, pp=1, dp=w, dp_kind="ddp", quantization="qlora")),
        Path_("tp qlora", w, dict(tp=w, pp=1, dp=1, sequence_parallel=False, quantization="qlora")),
        Path_("pp 1f1b qlora", 2, dict(tp=1, pp=2, dp=1, schedule="1f1b", quantization="qlora"), microbatches=4),
        Path_("pp gpipe", 2, dict(tp=1, pp=2, dp=1, schedule="gpipe"), microbatches=4),
        Path_("pp 1f1b", 2, dict(tp=1, pp=2, dp=1, schedule="1f1b"), microbatches=4),
        Path_("pp interleaved1f1b", 2, dict(tp=1, pp=2, dp=1, schedule="interleaved-1f1b", virtual_stages=2),
              microbatches=4),
        Path_("pp zero-bubble", 2, dict(tp=1, pp=2, dp=1, schedule="zero-bubble"), microbatches=4),
        Path_("pp4 zero-bubble", 4, dict(tp=1, pp=4, dp=1, schedule="zero-bubble"), microbatches=8),
        Path_("pp zbv", 2, dict(tp=1, pp=2, dp=1, schedule="zbv", virtual_stages=2), microbatches=4),
        Path_("pp 1f1b x fsdp", 4, dict(tp=1, pp=2, dp=2, schedule="1f1b", dp_kind="fsdp"), microbatches=4),
        Path_("pp 1f1b+recompute_full", 2, dict(tp=1, pp=2, dp=1, schedule="1f1b", recompute="full"),
              microbatches=4),
        Path_("pp zero-bubble+recompute_full", 2, dict(tp=1, pp=2, dp=1, schedule="zero-bubble", recompute="full"),
              microbatches=4),
        Path_("pp 1f1b x tp", 4, dict(tp=2, pp=2, dp=1, schedule="1f1b", sequence_parallel=False), microbatches=4),
        # 16-bit weights, fp32 main gradients and masters (profile meshplan-bf16, runtime/apply/master_state.py)
        Path_("bf16w single", 1, dict(tp=1, pp=1, dp=1, profile="meshplan-bf16")),
        Path_("bf16w ddp", w, dict(tp=1, pp=1, dp=w, dp_kind="ddp", profile="meshplan-bf16")),
        Path_("bf16w zero1", w, dict(tp=1, pp=1, dp=w, dp_kind="zero1", profile="meshplan-bf16"), microbatches=2),
        Path_("bf16w tp", w, dict(tp=w, pp=1, dp=1, sequence_parallel=False, profile="meshplan-bf16")),
        Path_("bf16w cp x zero1", w, dict(tp=1, pp=1, dp=1, cp=w, dp_kind="zero1", profile="meshplan-bf16"),
              microbatches=2),
        Path_("bf16w pp 1f1b", 2, dict(tp=1, pp=2, dp=1, schedule="1f1b", profile="meshplan-bf16"), microbatches=4),
        Path_("bf16w pp 1f1b+recompute_full", 2, dict(tp=1, pp=2, dp=1, schedule="1f1b", recompute="full",
                                                      profile="meshplan-bf16"), microbatches=4),
        Path_("bf16w pp zero-bubble x zero1", 4, dict(tp=1, pp=2, dp=2, schedule="zero-bubble", dp_kind="zero1",
                                                      profile="meshplan-bf16"), microbatches=4),
        Path_("pp 1f1b x tp+sp", 4, dict(tp=2, pp=2, dp=1, schedule="1f1b", sequence_parallel=True), microbatches=4),
        Path_("pp gpipe+recompute_full", 2, dict(tp=1, pp=2, dp=1, schedule="gpipe", recompute="full"),
              microbatches=4),
        Path_("pp gpipe+recompute_op", 2, dict(tp=1, pp=2, dp=1, schedule="gpipe", recompute="op"), microbatches=4),
        Path_("pp 1f1b+recompute_op", 2, dict(tp=1, pp=2, dp=1, schedule="1f1b", recompute="op"), microbatches=4),
        Path_("pp interleaved1f1b+recompute_op", 2, dict(tp=1, pp=2, dp=1, schedule="interleaved-1f1b",
                                                          virtual_stages=2, recompute="op"), microbatches=4),
        Path_("pp 1f1b+recompute_selective", 2, dict(tp=1, pp=2, dp=1, schedule="1f1b", recompute="selective"),
              microbatches=4),
        Path_("bf16w+grads zero1", w, dict(tp=1, pp=1, dp=w, dp_kind="zero1", profile="meshplan-bf16-grads"),
              microbatches=2),
        Path_("bf16w+grads pp 1f1b", 2, dict(tp=1, pp=2, dp=1, schedule="1f1b", profile="meshplan-bf16-grads"),
              microbatches=4),
        # the 16-bit layouts under the combinations the large published runs use (tp + SP inside a pipeline, cp)
        Path_("bf16w+grads pp 1f1b x tp+sp", 4, dict(tp=2, pp=2, dp=1, schedule="1f1b", sequence_parallel=True,
                                                     profile="meshplan-bf16-grads"), microbatches=4),
        # the token embedding vocab-parallel (a style the TP placement may pick; the engines' layout forces it)
        Path_("tp vocab-parallel", w, dict(tp=w, pp=1, dp=1, sequence_parallel=False,
                                           profile=MESHPLAN.but(vocab_parallel_embedding=True)), microbatches=2),
        Path_("bf16w tp vocab-parallel", w, dict(tp=w, pp=1, dp=1, sequence_parallel=False,
                                                 profile=MESHPLAN_BF16.but(vocab_parallel_embedding=True)),
              microbatches=2),
        Path_("bf16w+grads pp 1f1b x tp+sp vocab-parallel", 4, dict(
            tp=2, pp=2, dp=1, schedule="1f1b", sequence_parallel=True,
            profile=MESHPLAN_BF16_GRADS.but(vocab_parallel_embedding=True)), microbatches=4),
        Path_("bf16w+grads tp x cp x zero1", 4, dict(tp=2, pp=1, dp=1, cp=2, sequence_parallel=False,
                                                     dp_kind="zero1", profile="meshplan-bf16-grads"),
              microbatches=2),
        Path_("moe single", 1, dict(tp=1, pp=1, dp=1), moe=True),
        Path_("moe ddp", w, dict(tp=1, pp=1, dp=w, dp_kind="ddp"), moe=True),
        Path_("moe fsdp", w, dict(tp=1, pp=1, dp=w, dp_kind="fsdp"), moe=True),
        Path_("ep", w, dict(tp=1, pp=1, dp=w, ep=w, dp_kind="ddp"), moe=True),
        Path_("ep accum2+recompute_full", w, dict(tp=1, pp=1, dp=w, ep=w, dp_kind="ddp", recompute="full"),
              microbatches=2, moe=True),
        Path_("ep x cp", 2 * w, dict(tp=1, pp=1, dp=w, ep=w, cp=2, dp_kind="ddp"), moe=True),
        Path_("ep x pp 1f1b", 2 * w, dict(tp=1, pp=2, dp=w, ep=w, dp_kind="ddp", schedule="1f1b"), microbatches=4,
              moe=True),
    ]


def check(size: str, p: Path_, layers: int = 0) -> list[tuple[str, Any]]:
    cfg, seq, mb = SIZES[size]
    if p.moe:
        cfg = MOE_SIZES[size]  # type: ignore[assignment]
    if layers:
        cfg = dataclasses.replace(cfg, n_layer=layers)
    build = (lambda: moe_llama(cfg)) if p.moe else (lambda: Llama(cfg))  # type: ignore[arg-type]
    with torch.device("meta"):
        meta = build()
    graph = trace_model(meta, (torch.zeros(1, seq, dtype=torch.long, device="meta"),), name=f"llama-{size}")
    dp = p.kw.get("dp", 1)
    plan = estimate_graph(graph, p.world, global_batch_size=mb * p.microbatches * dp, micro_batch_size=mb,
                          num_microbatches=p.microbatches, cluster="h100", **p.kw)
    out = []
    pp = p.kw.get("pp", 1)
    for r in range(pp):
        res = measure(build, plan, rank=r * (p.world // pp), seq_len=seq, vocab=cfg.vocab_size)
        out.append((f"{p.name} (pp rank {res.pp_rank})" if pp > 1 else p.name, res))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--only", default="", help="comma-separated path names (prefix match)")
    ap.add_argument("--layers", default="", help="comma-separated block counts replacing the size's (e.g. 2,4: "
                    "the per-block growth of both columns at that size's shapes)")
    args = ap.parse_args(argv)
    want = [s for s in args.only.split(",") if s]
    counts = [int(x) for x in args.layers.split(",") if x] or [0]
    print(f"| path | predicted MiB | measured MiB (fake tensors) | error | ({args.size}) |")
    print("|---|---:|---:|---:|---|")
    worst = 0.0
    for p, layers in ((p, n) for p in paths(args.size in ("8b", "70b")) for n in counts):
        if want and not any(p.name.startswith(w) for w in want):
            continue
        t0 = time.perf_counter()
        label = f"{p.name}, {layers} blocks" if layers else p.name
        try:
            rows = check(args.size, p, layers)
        except Exception as e:  # a path that cannot run is reported, not hidden
            print(f"| {label} | | | | failed: {type(e).__name__}: {str(e).splitlines()[0][:120]} |")
            continue
        for name, r in rows:
            name = name.replace(p.name, label, 1)
            worst = max(worst, abs(r.rel_error))
            top = sorted(((v, k) for k, v in r.categories.items() if k != "Total"), reverse=True)[:3]
            print(f"| {name} | {r.predicted_bytes / 2**20:.1f} | {r.measured_bytes / 2**20:.1f} | "
                  f"{100 * r.rel_error:+.1f}% | {', '.join(f'{k} {v / 2**20:.0f}' for v, k in top)}; "
                  f"{time.perf_counter() - t0:.1f} s |", flush=True)
    for k, why in UNSUPPORTED.items():
        print(f"| {k} | | | | not run under fake tensors: {why} |")
    print(f"worst |error| {100 * worst:.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
