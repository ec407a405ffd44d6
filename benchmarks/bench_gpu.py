"""One CUDA GPU: a hand-written bf16 training loop vs meshplan's runtime at world size 1, and the plan's prediction.

    python benchmarks/bench_gpu.py [--models gpt2-small,gpt2-medium,gpt2-large,gpt2-xl,llama-1b]
                                   [--batch 8] [--seq 1024] [--steps 20] [--warmup 5] [--compile]

For every model shape, on ``cuda:0``:

(a) hand-written: fp32 parameters, ``torch.autocast("cuda", bfloat16)``, loss in fp32, AdamW
    ``fused=True``, optionally ``torch.compile`` per repeated block (``--compile``);
(b) meshplan: ``meshplan.estimate`` costs dp1 tp1 pp1 on the preset of this GPU
    (``preset_for_gpu_name``), ``apply_plan`` runs that plan (bf16 as planned, the runtime's AdamW,
    the same ``--compile``) in a one-rank NCCL process group.

Printed per model: measured step time of each (median of ``--steps`` after ``--warmup``),
tokens/s, MFU (model FLOPs ``6N + 12·L·h·s`` per token over the preset's bf16 peak), the ratio
runtime / hand-written, and the plan's predicted step time beside the runtime's measured one.
``--kernels FILE``: one more runtime step per model under ``torch.profiler`` (CUDA activity), and
its kernels written to FILE: device milliseconds by kind (GEMM, attention, optimizer, elementwise
and the rest, by kernel name) and the 40 longest kernels, so a phase the cost model misprices
(backward, optimizer) can be read kernel by kernel.
Without CUDA it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree

MODELS = ("gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "llama-1b")


def build(name: str, seq: int) -> torch.nn.Module:
    if name == "llama-1b":  # Llama 3.2 1B shape
        from meshplan.models.llama import Llama, LlamaConfig

        return Llama(LlamaConfig(n_layer=16, n_head=32, n_kv_head=8, dim=2048, ffn_hidden=8192, vocab_size=128256,
                                 max_seq_len=seq, rope_theta=500000.0))
    from meshplan.models.gpt import gpt

    return gpt(name, block_size=seq)


def loss_fn(out: Any, y: torch.Tensor) -> torch.Tensor:
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def flops_per_token(model: torch.nn.Module, seq: int) -> float:
    from meshplan.cost_models.formulas import model_flops_per_token

    n = sum(p.numel() for p in model.parameters())
    blocks = [c for m in model.modules() if isinstance(m, torch.nn.ModuleList) for c in m]
    hidden = next(p.shape[-1] for n_, p in model.named_parameters() if "emb" in n_ or "wte" in n_)
    return model_flops_per_token(n, len(blocks), hidden, seq)


def timed(step: Any, data: Any, steps: int, warmup: int) -> float:
    for i in range(warmup):
        step(*data(i))
    torch.cuda.synchronize()
    out = []
    for i in range(steps):
        x, y = data(warmup + i)
        t0 = time.perf_counter()
        step(x, y)
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def hand_loop(model: torch.nn.Module, compile_blocks: bool) -> Any:
    if compile_blocks:
        from meshplan.runtime.apply.compiling import apply_compile

        apply_compile([model], pipelined=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        loss_fn(out, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def runtime_loop(model: torch.nn.Module, preset: str, batch: int, seq: int, compile_blocks: bool) -> tuple[Any, Any]:
    from meshplan.api.plan import estimate
    from meshplan.runtime.apply.api import apply_plan
    from meshplan.runtime.apply.optim import make_optimizer

    ex = (torch.zeros(1, seq, dtype=torch.long),)
    plan = estimate(model, 1, tp=1, pp=1, dp=1, num_microbatches=1, global_batch_size=batch, seq_len=seq,
                    cluster=preset, example_inputs=ex)
    pm = apply_plan(model, plan, loss_fn=loss_fn, optimizer_factory=make_optimizer("adamw", 1e-4),
                    compile=compile_blocks)
    return pm.step, plan


#: kernel kinds by substrings of the CUDA kernel's name (first match wins; lower case)
KINDS = (("optimizer", ("multi_tensor", "fused_adam", "adam")), ("attention", ("flash", "fmha", "cudnn", "sdpa", "attention")),
         ("gemm", ("gemm", "cutlass", "xmma", "sm90", "sm80", "cublas", "nvjet")), ("reduce", ("reduce", "norm")),
         ("elementwise", ("elementwise", "vectorized", "unrolled", "copy", "fill")))


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((k for k, subs in KINDS if any(s in low for s in subs)), "other")


def kernel_table(step: Any, data: Any, name: str, activity: str = "CUDA") -> str:
    """One profiled runtime step's kernels: device ms by kind and the 40 longest (measured, torch.profiler;
    ``activity`` "CPU" times the ops on the host instead, to check the table here)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = activity == "CUDA"
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[getattr(ProfilerActivity, activity)]) as prof:
        step(*data(10_000))
        if cuda:
            torch.cuda.synchronize()
    rows = [(e.key, e.count, (e.device_time_total if cuda else e.self_cpu_time_total) / 1e3)
            for e in prof.key_averages() if (e.device_time_total if cuda else e.self_cpu_time_total) > 0]
    by_kind: dict[str, float] = {}
    for key, _, ms in rows:
        by_kind[kernel_kind(key)] = by_kind.get(kernel_kind(key), 0.0) + ms
    out = [f"## {name}: one runtime step's CUDA kernels (measured with torch.profiler; device ms)",
           "kind | ms", "---|---"]
    out += [f"{k} | {v:.2f}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])]
    out += [f"total | {sum(by_kind.values()):.2f}", "", "kernel | calls | ms | kind", "---|---|---|---"]
    out += [f"{k[:110]} | {c} | {ms:.2f} | {kernel_kind(k)}" for k, c, ms in sorted(rows, key=lambda r: -r[2])[:40]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--kernels", default=None, help="write one profiled runtime step's kernel table here")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; nothing measured (run it on a machine with one GPU)")
        return 0
    import torch.distributed as dist

    from meshplan.cost_models.hardware import preset_for_gpu_name, resolve_cluster

    gpu = torch.cuda.get_device_name(0)
    preset = preset_for_gpu_name(gpu)
    if preset is None:
        print(f"bench_gpu: no cluster preset matches {gpu!r}; add one to meshplan.cost_models.hardware", file=sys.stderr)
        return 2
    peak = resolve_cluster(preset, 1).peak("bf16")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))  # as meshplan run does
    print(f"{gpu} (preset {preset}, bf16 peak {peak / 1e12:.0f} TFLOP/s), batch {a.batch}x{a.seq}, "
          f"median of {a.steps} steps after {a.warmup}, compile={a.compile}; all step times measured")
    print("| model | hand ms | runtime ms | runtime/hand | tokens/s (runtime) | MFU hand | MFU runtime "
          "| predicted ms | predicted vs measured |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in a.models.split(","):
        torch.manual_seed(0)
        model = build(name, a.seq)
        vocab = next(m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding))
        fpt = flops_per_token(model, a.seq)

        def data(i: int, vocab: int = vocab) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(i)
            t = torch.randint(0, vocab, (a.batch, a.seq + 1), generator=g)
            return t[:, :-1].cuda(), t[:, 1:].cuda()

        hand_s = timed(hand_loop(model.cuda(), a.compile), data, a.steps, a.warmup)
        del model
        torch.cuda.empty_cache()
        torch.manual_seed(0)
        step, plan = runtime_loop(build(name, a.seq), preset, a.batch, a.seq, a.compile)
        rt_s = timed(step, data, a.steps, a.warmup)
        tok = a.batch * a.seq
        pred = plan.predicted.step_s
        print(f"| {name} | {hand_s * 1e3:.1f} | {rt_s * 1e3:.1f} | {rt_s / hand_s:.3f} | {tok / rt_s:,.0f} "
              f"| {fpt * tok / hand_s / peak:.1%} | {fpt * tok / rt_s / peak:.1%} | {pred * 1e3:.1f} "
              f"| {pred / rt_s - 1:+.1%} |")
        if a.kernels:
            with open(a.kernels, "a") as f:
                f.write(kernel_table(step, data, name) + "\n")
        torch.cuda.empty_cache()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
