"""The optimizer step of ``meshplan run`` timed part by part on one device (#33: the cost model's
optimizer phase, ``cost_models.optimizer_phase``, against what the kernels and the host do).

On one H200 and one H100 (gpu_check, 2026-11-27) the RunRecords' "optimizer" phase of gpt2-xl
(1.56 B fp32 parameters, Adam, gradient-norm clipping) measured 28.9 and 44.4 ms against 16.2 and
23.2 ms predicted then (one profiled step each). This script times each part alone, with the runtime's own
code (``runtime/apply/optim.py``: ``make_optimizer``, ``total_grad_norm``, ``clip_grad_norm``) over the
parameter shapes of a zoo model (default gpt2-xl, its tied head once), synchronized CUDA events around each
part (median of ``--reps`` after ``--warmup``):

- ``adam``: ``optimizer.step()`` (fused on CUDA), 28 B per parameter;
- ``norm``: ``total_grad_norm`` (foreach norm + the host read), 4 B;
- ``scale``: ``clip_grads_with_norm_`` (foreach multiply in place), 8 B;
- ``clip+adam``: both as the runtime runs them (``ParallelModel._optimizer_step``: since #33's stop 10 the
  norm stays on the device until the update is issued, then is read once; before, it was read twice
  inside the clipping, ``host-wait``);
- ``clip+adam@profiler``: the same inside an active ``torch.profiler.profile`` (CPU activity, as
  ``runtime/record/phases.measure`` runs the RunRecord's phases): what recording every op adds;
- ``copy``: ``dst.copy_(src)`` over one flat buffer of the same parameter count (8 B), the
  bandwidth ``meshplan profile`` measures.

For each: milliseconds (events), the host's milliseconds inside the call (``host_ms``: until the call
returns, no sync), bytes by the model's count, achieved GB/s and the fraction of the copy's, and the cost
model's price of the part (``predicted_ms``: ``optimizer_phase`` on the GPU's preset, and
``phase_own_host_ms`` with this host's own per-tensor figure, measured here as ``meshplan profile`` does).
``--kernels`` adds one ``clip+adam`` under ``torch.profiler`` (CUDA activity): every kernel's name, launches
and device milliseconds, so the kernels' own bandwidth is read apart from the host's work (the event
timings hold both). Prints one JSON object (``--out`` writes it too). Usage:
``python benchmarks/optimizer_device.py [--model gpt2-xl] [--device cuda] [--kernels] [--out F]``; on a GPU
it takes ~30 s; ``--device cpu --model gpt-tiny --preset h100`` checks the script here (no kernels).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshplan.cost_models.engine_profiles.meshplan_runtime import MESHPLAN  # noqa: E402
from meshplan.cost_models.hardware import ClusterSpec, preset_for_gpu_name  # noqa: E402
from meshplan.cost_models.optimizer_phase import (  # noqa: E402
    ADAM_UPDATE_BYTES,
    CLIP_BYTES,
    NORM_BYTES,
    optimizer_phase,
)
from meshplan.models.registry import load_model  # noqa: E402
from meshplan.runtime.apply import optim  # noqa: E402

#: bytes per parameter the cost model prices (``cost_models.optimizer_phase``: the fused update, and the
#: clipping's CLIP_BYTES as its foreach norm's one read and its foreach scale's read + write)
PRICED = {"adam": ADAM_UPDATE_BYTES["fused"], "norm": NORM_BYTES, "scale": CLIP_BYTES - NORM_BYTES,
          "clip+adam": ADAM_UPDATE_BYTES["fused"] + CLIP_BYTES, "clip+adam@profiler": ADAM_UPDATE_BYTES["fused"] + CLIP_BYTES,
          "copy": 8.0}


def _profiler_if(on: bool, device: torch.device) -> contextlib.AbstractContextManager[object]:
    """An active ``torch.profiler.profile`` with CPU activity (what ``runtime/record/phases.measure`` runs the
    RunRecord's phases under) when ``on``, else nothing."""
    if not on:
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "99")
    return profile(activities=[ProfilerActivity.CPU])


def clip_then_step(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> float:
    """The phase as ``ParallelModel._optimizer_step`` runs it (fp32 parameters, no loss scaler): the clipping
    (norm kept on the device), the update, then the norm read on the host."""
    norm = optim.clip_grad_norm(params, 1.0)
    opt.step()
    return norm.item()


def _timer(device: torch.device) -> Callable[[Callable[[], object]], tuple[float, float]]:
    """(device seconds between two CUDA events around the call, host seconds until the call returned)."""
    def run(fn: Callable[[], object]) -> tuple[float, float]:
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            t0 = time.perf_counter()
            fn()
            host = time.perf_counter() - t0
            b.record()
            torch.cuda.synchronize()
            return a.elapsed_time(b) / 1e3, host
        t0 = time.perf_counter()
        fn()
        host = time.perf_counter() - t0
        return host, host
    return run


def kernel_rows(fn: Callable[[], object]) -> list[dict[str, object]]:
    """One call of ``fn`` under torch.profiler (CUDA activity): each kernel's name, launches, device ms."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [{"kernel": e.key[:160], "launches": e.count, "device_ms": round(e.device_time_total / 1e3, 3)}
            for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -float(r["device_ms"]))  # type: ignore[arg-type]


#: a block measurement of nothing (``host_figures`` reads one; only its optimizer figure is used here)
_NO_BLOCK = {f"{ph}_{k}": 0.0 for ph in ("fwd", "bwd") for k in ("host_min_ms_per_block", "ops_per_block", "views_per_block")}


def predicted(n: int, tensors: int, cluster: ClusterSpec, host_tensor_s: float) -> dict[str, object]:
    """The cost model's price of the parts and the phase (``optimizer_phase`` composed as meshplan's runtime
    profile says, ``MESHPLAN.optimizer_sync``) on ``cluster``, and with this host's own per-tensor figure
    ``host_tensor_s`` in place of the preset's; ``host_wait_phase_ms``: the "host-wait" price (the runtime
    before #33's stop 10, which read the norm twice inside the clipping)."""
    sync = MESHPLAN.optimizer_sync
    ph = optimizer_phase(n, cluster, tensors=tensors, sync=sync)
    own = optimizer_phase(n, dataclasses.replace(cluster, host_optimizer_tensor_s=host_tensor_s), tensors=tensors,
                          sync=sync)
    wait = optimizer_phase(n, cluster, tensors=tensors, sync="host-wait")
    bw = cluster.mem_bw_bytes_per_s * cluster.mem_efficiency

    def ms(x: float) -> float:
        return round(x * 1e3, 3)

    parts = {"adam": ph.update_s, "norm": ph.norm_s, "scale": ph.scale_s, "clip+adam": ph.total_s,
             "clip+adam@profiler": ph.total_s, "copy": 8.0 * n / bw}
    return {"preset": cluster.name, "sync": sync, "device_ms": ms(ph.device_s), "host_ms": ms(ph.host_s),
            "phase_ms": ms(ph.total_s), "host_wait_phase_ms": ms(wait.total_s),
            "own_host_tensor_us": round(host_tensor_s * 1e6, 3), "own_host_ms": ms(own.host_s),
            "phase_own_host_ms": ms(own.total_s), "parts_ms": {k: ms(v) for k, v in parts.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-xl")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--kernels", action="store_true", help="also profile one clip+adam's CUDA kernels")
    ap.add_argument("--preset", default=None, help="price against this cluster preset (default: the GPU's own)")
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
        "clip+adam": lambda: clip_then_step(params, opt),
        "clip+adam@profiler": lambda: clip_then_step(params, opt),
        "copy": lambda: dst.copy_(src),
    }
    timed = _timer(dev)
    name_ = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    out: dict[str, object] = {"model": a.model, "device": name_, "torch": torch.__version__, "params": n,
                              "tensors": len(params), "reps": a.reps, "load_avg_1m": round(os.getloadavg()[0], 2)}
    res: dict[str, dict[str, float]] = {}
    for name, fn in parts.items():
        with _profiler_if(name.endswith("@profiler"), dev):
            for _ in range(a.warmup):
                timed(fn)
            runs = [timed(fn) for _ in range(a.reps)]
        s = statistics.median(r[0] for r in runs)
        nbytes = PRICED[name] * n
        res[name] = {"ms": round(s * 1e3, 3), "host_ms": round(statistics.median(r[1] for r in runs) * 1e3, 3),
                     "priced_bytes": nbytes, "gb_s": round(nbytes / s / 1e9, 1)}
    copy_s = res["copy"]["ms"] / PRICED["copy"]  # ms per byte-per-parameter of the copy
    for name, r in res.items():
        r["fraction_of_copy"] = round(copy_s * PRICED[name] / r["ms"], 3) if r["ms"] > 0 else 0.0
    out["parts"] = res
    preset = a.preset or (preset_for_gpu_name(name_) if dev.type == "cuda" else None)
    if preset is not None:
        from meshplan.profile.host import host_figures, optimizer_host, per_op

        # this host's figure as host_overhead.py / meshplan profile measure it (772 tiny tensors)
        own = host_figures({"per_op": per_op(dev, 200, 3), "block": _NO_BLOCK, "block_checkpoint": _NO_BLOCK,
                            "optimizer": optimizer_host(dev, 772, 7)})["host_optimizer_tensor_s"]
        out["predicted"] = predicted(n, len(params), ClusterSpec.preset(preset), own)
    if a.kernels and dev.type == "cuda":
        out["kernels_clip+adam"] = kernel_rows(parts["clip+adam"])
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
