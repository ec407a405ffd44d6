"""The optimizer step of ``meshplan run`` timed part by part on one device (#33: the cost model's
optimizer term, ``cost_models.eager_ops.optimizer_step_s``, against what the kernels reach).

On one H200 and one H100 (gpu_check, 2026-11-27) the RunRecords' "optimizer" phase of gpt2-xl
(1.56 B fp32 parameters, Adam, gradient-norm clipping) measured 28.9 and 44.4 ms against 16.2 and
23.2 ms predicted: the model prices 28 B/parameter for fused Adam and 12 B for the clipping (a
foreach norm and a foreach scale) at ``mem_bw · mem_efficiency``. This script times each part
alone, with the runtime's own code (``runtime/apply/optim.py``: ``make_optimizer``, ``total_grad_norm``,
``clip_grad_norm``) over the parameter shapes of a zoo model (default gpt2-xl, its tied head once),
synchronized CUDA events around each part (median of ``--reps`` after ``--warmup``):

- ``adam``: ``optimizer.step()`` (fused on CUDA), priced at 28 B per parameter;
- ``norm``: ``total_grad_norm`` (foreach norm + the host read), 4 B;
- ``scale``: ``clip_grads_with_norm_`` (foreach multiply in place), 8 B;
- ``clip+adam``: both as the runtime runs them (``ParallelModel._optimizer_step``);
- ``copy``: ``dst.copy_(src)`` over one flat buffer of the same parameter count (8 B), the
  bandwidth ``meshplan profile`` measures.

For each: milliseconds, bytes by the model's count, achieved GB/s and the fraction of the copy's.
Prints one JSON object (``--out`` writes it too). Usage:
``python benchmarks/optimizer_device.py [--model gpt2-xl] [--device cuda] [--out F]``; on a GPU it
takes ~20 s; ``--device cpu --model gpt-tiny`` checks the script here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshplan.cost_models.eager_ops import ADAM_UPDATE_BYTES, CLIP_BYTES  # noqa: E402
from meshplan.models.registry import load_model  # noqa: E402
from meshplan.runtime.apply import optim  # noqa: E402

#: bytes per parameter the cost model prices (``cost_models.eager_ops``: the fused update, and the clipping's
#: CLIP_BYTES as its foreach norm's one read and its foreach scale's read + write)
NORM_BYTES = 4.0
PRICED = {"adam": ADAM_UPDATE_BYTES["fused"], "norm": NORM_BYTES, "scale": CLIP_BYTES - NORM_BYTES,
          "clip+adam": ADAM_UPDATE_BYTES["fused"] + CLIP_BYTES, "copy": 8.0}


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    def run(fn: Callable[[], object]) -> float:
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            return a.elapsed_time(b) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-xl")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    shapes = [tuple(p.shape) for p in load_model(a.model, device="meta").model.parameters()]
    params = [torch.zeros(s, device=dev, requires_grad=True) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    n = sum(p.numel() for p in params)
    opt = optim.make_optimizer("adam", 1e-4)(params)
    src, dst = torch.empty(n, device=dev), torch.empty(n, device=dev)
    parts: dict[str, Callable[[], object]] = {
        "adam": opt.step,
        "norm": lambda: float(optim.total_grad_norm(params)),
        "scale": lambda: torch.nn.utils.clip_grads_with_norm_(params, 1.0, torch.tensor(2.0, device=dev), foreach=True),
        "clip+adam": lambda: (optim.clip_grad_norm(params, 1.0), opt.step()),
        "copy": lambda: dst.copy_(src),
    }
    timed = _timer(dev)
    out: dict[str, object] = {"model": a.model, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                              "torch": torch.__version__, "params": n, "tensors": len(params), "reps": a.reps}
    res: dict[str, dict[str, float]] = {}
    for name, fn in parts.items():
        for _ in range(a.warmup):
            timed(fn)
        s = statistics.median(timed(fn) for _ in range(a.reps))
        nbytes = PRICED[name] * n
        res[name] = {"ms": round(s * 1e3, 3), "priced_bytes": nbytes, "gb_s": round(nbytes / s / 1e9, 1)}
    copy_bw = res["copy"]["gb_s"]
    for r in res.values():
        r["fraction_of_copy"] = round(r["gb_s"] / copy_bw, 3)
    out["parts"] = res
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
