"""Time torchao's NF4 dequantization and the runtime's QLoRA linear at Llama-3-8B shapes on one GPU (#33).

    python benchmarks/qlora_dequant_gpu.py [--tokens 4096] [--reps 10] [--compile] [--json FILE]

For each Llama-3-8B projection shape (q 4096→4096, k/v 4096→1024, gate/up 4096→14336,
down 14336→4096) it measures with CUDA events, after warm-up, the mean over ``--reps`` of

- ``dequant``: one eager dequantization to bf16 (``NF4Tensor.get_original_weight().to(bf16)``);
- ``qlora``: ``LoRALinear`` (``meshplan.runtime.apply.quant``, rank 16) forward under bf16
  autocast + backward, input fp32 (q/k/gate: a norm's output) or bf16 (o/down), one microbatch of
  ``--tokens`` rows;
- ``plain``: a frozen bf16 ``nn.Linear`` of the same shape, forward + input backward (the base
  GEMMs both variants run, for reference);
- with ``--compile``: ``torch.compile`` of the dequantization alone (a fused alternative the
  runtime does not use today; its compile time is not counted).

Next to each it prints the cost model's prediction for the GPU's preset
(``cost_models.qlora_kernels`` on the roofline, ``compute.roofline_time_s``), so the line reads
measured vs predicted. Under a minute on one H100 (default sizes). Needs CUDA and torchao.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: (name, in, out, input dtype) of Llama-3-8B's block linears
SHAPES = [("q", 4096, 4096, "fp32"), ("k", 4096, 1024, "fp32"), ("o", 4096, 4096, "bf16"),
          ("gate", 4096, 14336, "fp32"), ("down", 14336, 4096, "bf16")]


def _events_ms(fn: Any, reps: int, warmup: int = 2) -> float:
    import torch

    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():  # the --device cpu smoke check: host clock
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / reps
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _predicted_ms(cluster: Any, in_f: int, out_f: int, tokens: int, x_bytes: float, rank: int) -> dict[str, float]:
    from meshplan.cost_models.compute import roofline_time_s
    from meshplan.cost_models.qlora_kernels import _gemm, nf4_dequant_kernels, qlora_linear_kernels

    def t(ks: list[Any]) -> float:
        return 1e3 * sum(roofline_time_s(k.flops, k.bytes, cluster, kind="linear" if k.gemm else "elementwise")
                         for k in ks)  # fmt: skip

    base = [_gemm("fwd", tokens, out_f, in_f, 2.0), _gemm("bwd_input", tokens, in_f, out_f, 2.0)]
    return {
        "dequant": t(nf4_dequant_kernels(in_f * out_f)),
        "qlora": t(qlora_linear_kernels(in_f * out_f, tokens, in_f, out_f, rank, input_bytes=x_bytes) + base),
        "plain": t(base),
    }


def _measure(shape: tuple[str, int, int, str], a: argparse.Namespace, cluster: Any, dev: Any) -> dict[str, Any]:
    """Measured and predicted milliseconds of one linear shape (module docstring)."""
    import torch
    from torch import nn

    from meshplan.runtime.apply.quant.lora_linear import LoRALinear

    lname, in_f, out_f, xd = shape
    torch.manual_seed(0)
    w = torch.randn(out_f, in_f, device=dev) * 0.02
    m = LoRALinear(w, None, torch.randn(a.rank, in_f, device=dev) * 0.01, torch.zeros(out_f, a.rank, device=dev),
                   in_features=in_f, out_features=out_f, alpha=2.0 * a.rank)  # fmt: skip
    del w
    nf4 = m.weight.data if hasattr(m.weight.data, "get_original_weight") else m.weight
    x_dtype = torch.float32 if xd == "fp32" else torch.bfloat16
    leaf = torch.randn(1, a.tokens, in_f, device=dev, dtype=x_dtype, requires_grad=True)

    def qlora_step() -> None:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            y = m(leaf.view(1, a.tokens, in_f))  # a non-leaf input, as in a model
        y.backward(torch.ones_like(y))

    plain = nn.Linear(in_f, out_f, bias=False, device=dev, dtype=torch.bfloat16).requires_grad_(False)
    xb = torch.randn(1, a.tokens, in_f, device=dev, dtype=torch.bfloat16, requires_grad=True)

    def plain_step() -> None:
        y = plain(xb)
        y.backward(torch.ones_like(y))

    def dequant() -> Any:
        return nf4.get_original_weight().to(torch.bfloat16)

    meas = {"dequant": _events_ms(dequant, a.reps), "qlora": _events_ms(qlora_step, a.reps),
            "plain": _events_ms(plain_step, a.reps)}  # fmt: skip
    if a.compile:
        meas["dequant_compiled"] = _events_ms(torch.compile(dequant), a.reps, warmup=3)
    pred = _predicted_ms(cluster, in_f, out_f, a.tokens, 4.0 if xd == "fp32" else 2.0, a.rank)
    print(f"  {lname:5s} {in_f:>5d}->{out_f:<5d} x {xd}: " + "; ".join(
        f"{k} {v:.2f} ms measured" + (f" / {pred[k]:.2f} predicted ({100 * (v / pred[k] - 1):+.0f}%)" if k in pred else "")
        for k, v in meas.items()), flush=True)  # fmt: skip
    return {"linear": lname, "in": in_f, "out": out_f, "input": xd, "measured_ms": meas, "predicted_ms": pred}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile of the dequantization")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--scale", type=int, default=1, help="divide every size by this (a CPU smoke check)")
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu for a smoke check of the code path")
    a = ap.parse_args(argv)
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("qlora_dequant_gpu: needs a CUDA GPU (or --device cpu --scale 64 for a smoke check)", file=sys.stderr)
        return 2
    from meshplan.cost_models.hardware import ClusterSpec, preset_for_gpu_name

    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu (smoke check, not a measurement)"
    preset = preset_for_gpu_name(name) or "h100"
    cluster = ClusterSpec.preset(preset)
    dev = torch.device(a.device)
    a.tokens //= a.scale
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    print(f"{name}, torch {torch.__version__}, preset {preset}; {a.tokens} tokens, rank {a.rank}; "
          f"{'CUDA events' if a.device == 'cuda' else 'host clock'}, mean of {a.reps} after 2 warm-up")
    for lname, in_f, out_f, xd in SHAPES:
        rows.append(_measure((lname, in_f // a.scale, out_f // a.scale, xd), a, cluster, dev))
        if a.device == "cuda":
            torch.cuda.empty_cache()
    peak = torch.cuda.max_memory_allocated() / 2**30 if a.device == "cuda" else 0.0
    print(f"done in {time.perf_counter() - t0:.1f} s; peak {peak:.1f} GiB")
    if a.json:
        a.json.write_text(json.dumps({"device": name, "torch": torch.__version__, "preset": preset,
                                      "tokens": a.tokens, "rank": a.rank, "rows": rows}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
