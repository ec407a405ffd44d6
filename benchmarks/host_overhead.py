"""Host-side (CPU) time of eager PyTorch training on this machine: the host-dispatch floor (#33).

On a fast GPU a small microbatch is host-bound: Python, the dispatcher, autograd, autocast, the
checkpoint wrapper and the kernel launches take longer than the kernels. This script measures the
host's side alone, at shapes where the device work is negligible, and prints one JSON object:

- ``per_op``: microseconds of host time per op, ``n_ops`` ops launched without a sync and timed
  on the host (``time.perf_counter`` before the first call and after the last; the device is
  synchronized only before and after; median and least of ``--reps``): ``add_`` in place (dispatch + launch, no allocation),
  ``add`` (+ allocation), ``mul`` of a tensor that requires grad (+ autograd recording), and an
  ``nn.Linear(8, 8)`` under bf16 autocast (module call + casts + addmm + autograd). ``sync_us``:
  one synchronize after the loop (how far the device lagged: ~0 when host-bound, as intended).
- ``block``: meshplan's zoo GPT block at gpt2-xl's width (hidden 1600, 25 heads, FFN 6400) on
  batch 1 × 16 tokens, ``--blocks`` of them in sequence, under bf16 autocast with fp32 weights as
  ``meshplan run`` trains: host milliseconds per block of forward and of ``backward()`` (on CUDA
  ``backward()`` returns when every kernel is queued, so the call's time is the host's), plain and
  wrapped in torch's ``checkpoint_wrapper`` (NO_REENTRANT, as ``runtime/apply/recompute.py``
  wraps the blocks for recompute=full: its backward runs the forward again). Beside each, the ATen
  ops dispatched per block (a ``TorchDispatchMode`` counting pass, untimed; views apart), so host
  time per op can be compared with ``per_op``; and ``device_ms_per_block``: wall time with a sync
  at the end, to show the device really is idle (≈ host time).
- ``optimizer``: host milliseconds of ``AdamW.step()`` (fused on CUDA, per tensor on CPU, as
  ``runtime/apply/optim.py``), of gradient-norm clipping (foreach) and of
  ``zero_grad(set_to_none=True)`` over as many tiny parameter tensors as gpt2-xl has (``--params``, 772 with its tied head), host-timed.

Usage: ``python benchmarks/host_overhead.py [--device cuda|cpu] [--out FILE]``; on CUDA it runs in
well under a minute. The numbers are a property of the host (CPU, Python, torch build), not of the
model: ``ClusterSpec.host_op_s`` reads ``per_op``; the block figures check the op-count model
(``cost_models.host``). Needs torch and meshplan only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshplan.models.gpt import Block, GPTConfig  # noqa: E402


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _host_timed(fn: Callable[[], Any], dev: torch.device, reps: int) -> tuple[float, float, float]:
    """(median host seconds of ``fn()``, median seconds including the final sync, least host
    seconds) over ``reps`` runs after two warm-ups; the device is synchronized before each run."""
    host, wall = [], []
    for i in range(reps + 2):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        _sync(dev)
        t2 = time.perf_counter()
        if i >= 2:
            host.append(t1 - t0)
            wall.append(t2 - t0)
    return statistics.median(host), statistics.median(wall), min(host)


class _OpCounter(TorchDispatchMode):
    """Counts ATen ops dispatched below autograd (views apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if getattr(func, "is_view", False):
            self.views += 1
        else:
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def per_op(dev: torch.device, n_ops: int, reps: int) -> dict[str, float]:
    x = torch.zeros(1, device=dev)
    leaf = torch.zeros(1, device=dev, requires_grad=True)
    lin = nn.Linear(8, 8).to(dev)
    row = torch.randn(1, 8, device=dev, requires_grad=True)
    out: dict[str, float] = {}

    def loop_inplace() -> None:
        for _ in range(n_ops):
            x.add_(1.0)

    def loop_add() -> None:
        for _ in range(n_ops):
            x.add(1.0)

    def loop_autograd() -> None:
        y = leaf
        for _ in range(n_ops):
            y = y * 1.0

    def loop_linear_autocast() -> None:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            for _ in range(n_ops // 4):
                lin(row)

    for name, fn, n in (("add_inplace", loop_inplace, n_ops), ("add", loop_add, n_ops),
                        ("mul_autograd", loop_autograd, n_ops), ("linear_autocast", loop_linear_autocast, n_ops // 4)):
        host, wall, least = _host_timed(fn, dev, reps)
        out[f"{name}_us"] = round(host / n * 1e6, 3)
        out[f"{name}_min_us"] = round(least / n * 1e6, 3)
        out[f"{name}_sync_us"] = round((wall - host) * 1e6, 1)
    return out


def _count(fn: Callable[[], Any]) -> tuple[int, int, dict[str, int]]:
    with _OpCounter() as c:
        fn()
    return sum(c.ops.values()), c.views, dict(c.ops.most_common())


def block_host(dev: torch.device, n_blocks: int, tokens: int, reps: int, checkpoint: bool, hidden: int = 1600,
               heads: int = 25) -> dict[str, Any]:
    cfg = GPTConfig(n_layer=n_blocks, n_head=heads, n_embd=hidden)
    blocks = nn.Sequential(*[Block(cfg) for _ in range(n_blocks)]).to(dev)
    if checkpoint:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            checkpoint_wrapper,
        )

        blocks = nn.Sequential(*[checkpoint_wrapper(b, checkpoint_impl=CheckpointImpl.NO_REENTRANT) for b in blocks])
    x = torch.randn(1, tokens, cfg.n_embd, device=dev, requires_grad=True)
    grad = torch.ones(1, tokens, cfg.n_embd, device=dev, dtype=torch.bfloat16)
    held: dict[str, torch.Tensor] = {}

    def forward() -> None:  # the blocks alone: no loss, so the op counts are the blocks'
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            held["out"] = blocks(x)

    def backward() -> None:
        held.pop("out").backward(grad)

    fwd_h, bwd_h, fwd_w, bwd_w = [], [], [], []
    for i in range(reps + 2):
        _sync(dev)
        t0 = time.perf_counter()
        forward()
        t1 = time.perf_counter()
        _sync(dev)
        t2 = time.perf_counter()
        backward()
        t3 = time.perf_counter()
        _sync(dev)
        t4 = time.perf_counter()
        if i >= 2:
            fwd_h.append(t1 - t0)
            fwd_w.append(t2 - t0)
            bwd_h.append(t3 - t2)
            bwd_w.append(t4 - t2)
        blocks.zero_grad(set_to_none=False)  # as a training step after the first: gradients accumulate
    n_f, v_f, ops_f = _count(forward)
    out = held.pop("out")
    with _OpCounter() as c:
        out.backward(grad)
    blocks.zero_grad(set_to_none=True)
    ms = 1e3 / n_blocks
    return {
        "fwd_host_ms_per_block": round(statistics.median(fwd_h) * ms, 4),
        "bwd_host_ms_per_block": round(statistics.median(bwd_h) * ms, 4),
        "fwd_host_min_ms_per_block": round(min(fwd_h) * ms, 4),
        "bwd_host_min_ms_per_block": round(min(bwd_h) * ms, 4),
        "fwd_device_ms_per_block": round(statistics.median(fwd_w) * ms, 4),
        "bwd_device_ms_per_block": round(statistics.median(bwd_w) * ms, 4),
        "fwd_ops_per_block": round(n_f / n_blocks, 2), "fwd_views_per_block": round(v_f / n_blocks, 2),
        "bwd_ops_per_block": round(sum(c.ops.values()) / n_blocks, 2), "bwd_views_per_block": round(c.views / n_blocks, 2),
        "fwd_ops": ops_f, "bwd_ops": dict(c.ops.most_common()),
    }


def optimizer_host(dev: torch.device, n_params: int, reps: int) -> dict[str, Any]:
    params = [nn.Parameter(torch.randn(16, device=dev)) for _ in range(n_params)]
    for p in params:
        p.grad = torch.randn_like(p)
    cuda = dev.type == "cuda"
    opt = torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if cuda else {"foreach": False}))
    step_h, _, _ = _host_timed(opt.step, dev, reps)
    clip_h, _, _ = _host_timed(lambda: torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True), dev, reps)

    grads = [p.grad for p in params]
    zero = []
    for _ in range(reps):  # as the runtime: set_to_none=True (a Python loop); gradients put back untimed
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        zero.append(time.perf_counter() - t0)
        for p, g in zip(params, grads):
            p.grad = g
    zero_h = statistics.median(zero)
    return {"params": n_params, "impl": "fused" if cuda else "per-tensor (foreach=False)",
            "step_host_ms": round(step_h * 1e3, 3), "clip_host_ms": round(clip_h * 1e3, 3),
            "zero_grad_host_ms": round(zero_h * 1e3, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--n-ops", type=int, default=2000, help="ops per timed loop (default 2000)")
    ap.add_argument("--blocks", type=int, default=8, help="gpt2-xl-width blocks in sequence (default 8)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens of the one sequence (default 16)")
    ap.add_argument("--hidden", type=int, default=1600, help="block width (default 1600: gpt2-xl)")
    ap.add_argument("--heads", type=int, default=25, help="attention heads (default 25: gpt2-xl)")
    ap.add_argument("--params", type=int, default=772, help="parameter tensors for the optimizer (default 772: gpt2-xl, head tied)")
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions, median reported (default 7)")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("host_overhead: --device cuda but no CUDA device; use --device cpu", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
        "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "load_avg_1m_start": round(os.getloadavg()[0], 2),
        "n_ops": a.n_ops, "tokens": a.tokens, "blocks": a.blocks, "hidden": a.hidden, "heads": a.heads,
    }
    print(f"[host_overhead] {res['device']}, torch {res['torch']}: per-op loops", file=sys.stderr)
    res["per_op"] = per_op(dev, a.n_ops, a.reps)
    for ckpt in (False, True):
        print(f"[host_overhead] {a.blocks} blocks of width {a.hidden}, 1x{a.tokens} tokens, checkpoint={ckpt}",
              file=sys.stderr)
        res["block_checkpoint" if ckpt else "block"] = block_host(dev, a.blocks, a.tokens, a.reps, ckpt, a.hidden,
                                                                  a.heads)
    print("[host_overhead] optimizer", file=sys.stderr)
    res["optimizer"] = optimizer_host(dev, a.params, a.reps)
    res["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    res["seconds"] = round(time.perf_counter() - t0, 2)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out is not None:
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
