"""The host side of eager PyTorch training, measured on this machine (the host-dispatch floor, #33).

Shapes where the device's work is negligible, so what is timed is the host: ``per_op`` (ops launched
without a sync), ``block_host`` (meshplan's zoo GPT block at a given width, forward and backward
under bf16 autocast, plain and under torch's ``checkpoint_wrapper``, with the ATen ops torch
dispatches), ``optimizer_host`` (AdamW, clipping, zero_grad over many tiny tensors).
``host_figures`` turns the measurements into ``ClusterSpec``'s host figures (``cost_models.host``).
Used by ``meshplan profile`` on a GPU and by ``benchmarks/host_overhead.py``.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def _sync(dev: torch.device) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time_once(fn: Callable[[], Any], dev: torch.device) -> tuple[float, float]:
    """(host seconds of one ``fn()`` call, seconds including the sync after it), the device
    synchronized before the call."""
    _sync(dev)
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    _sync(dev)
    return t1 - t0, time.perf_counter() - t0


def _host_timed(fn: Callable[[], Any], dev: torch.device, reps: int) -> tuple[float, float, float]:
    """(median host seconds of ``fn()``, median seconds including the final sync, least host
    seconds) over ``reps`` runs after two warm-ups (``_time_once``)."""
    host, wall = [], []
    for i in range(reps + 2):
        h, w = _time_once(fn, dev)
        if i >= 2:
            host.append(h)
            wall.append(w)
    return statistics.median(host), statistics.median(wall), min(host)


def _op_counter() -> Any:
    """A ``TorchDispatchMode`` counting the ATen ops dispatched below autograd (views apart)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCounter(TorchDispatchMode):
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

    return OpCounter()


def per_op(dev: torch.device, n_ops: int, reps: int) -> dict[str, float]:
    """Host microseconds per op of ``n_ops``-op loops launched without a sync (module docstring of
    ``benchmarks/host_overhead.py``): median and least of ``reps``, and the sync after each loop."""
    import torch
    from torch import nn

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
    with _op_counter() as c:
        fn()
    return sum(c.ops.values()), c.views, dict(c.ops.most_common())


def block_host(dev: torch.device, n_blocks: int, tokens: int, reps: int, checkpoint: bool, hidden: int = 1600,
               heads: int = 25) -> dict[str, Any]:
    """Host milliseconds per block of forward and backward of ``n_blocks`` zoo GPT blocks of width
    ``hidden`` on 1 x ``tokens`` under bf16 autocast (fp32 weights), plain or each under torch's
    ``checkpoint_wrapper`` (NO_REENTRANT), and the ATen ops and views torch dispatches per block."""
    import torch
    from torch import nn

    from meshplan.models.gpt import Block, GPTConfig

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
        fh, fw = _time_once(forward, dev)
        bh, bw = _time_once(backward, dev)
        if i >= 2:
            fwd_h.append(fh)
            fwd_w.append(fw)
            bwd_h.append(bh)
            bwd_w.append(bw)
        blocks.zero_grad(set_to_none=False)  # as a training step after the first: gradients accumulate
    n_f, v_f, ops_f = _count(forward)
    out = held.pop("out")
    with _op_counter() as c:
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
    """Host milliseconds of AdamW's step (fused on CUDA, per tensor on a CPU, as the runtime),
    gradient-norm clipping and ``zero_grad(set_to_none=True)`` over ``n_params`` tiny tensors."""
    import torch
    from torch import nn

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


def host_figures(res: dict[str, Any]) -> dict[str, float]:
    """``ClusterSpec``'s host figures from one measurement (``per_op``, ``block``,
    ``block_checkpoint`` as ``benchmarks/host_overhead.py`` prints them; least times):

    - ``host_op_s``: one autograd-recording op issued from Python (``mul_autograd_min_us``);
    - ``host_bwd_op_s``: the block's backward host time over the ops + views it dispatched;
    - ``host_checkpoint_fwd_s``: what the checkpoint wrapper adds to the block's forward;
    - ``host_checkpoint_bwd_s``: what it adds to the backward beyond its extra dispatches (the
      re-run forward and the unpacking) at ``host_op_s``;
    - ``host_optimizer_tensor_s`` (when ``res`` has ``optimizer``): the fused step's and the foreach
      clipping's host time per parameter tensor (``cost_models.optimizer_phase``).
    Each clamped at 0. Unit: seconds."""
    op = res["per_op"]["mul_autograd_min_us"] * 1e-6
    plain, ck = res["block"], res["block_checkpoint"]
    ms = 1e-3

    def n(b: dict[str, Any], phase: str) -> float:
        return float(b[f"{phase}_ops_per_block"]) + float(b[f"{phase}_views_per_block"])

    bwd_op = plain["bwd_host_min_ms_per_block"] * ms / max(1.0, n(plain, "bwd"))
    ck_f = ck["fwd_host_min_ms_per_block"] * ms - plain["fwd_host_min_ms_per_block"] * ms
    extra = max(0.0, n(ck, "bwd") - n(plain, "bwd"))
    ck_b = ck["bwd_host_min_ms_per_block"] * ms - plain["bwd_host_min_ms_per_block"] * ms - extra * op
    out = {"host_op_s": max(0.0, op), "host_bwd_op_s": max(0.0, bwd_op),
           "host_checkpoint_fwd_s": max(0.0, ck_f), "host_checkpoint_bwd_s": max(0.0, ck_b)}
    opt = res.get("optimizer")
    if opt and opt.get("params"):
        out["host_optimizer_tensor_s"] = max(0.0, (opt["step_host_ms"] + opt["clip_host_ms"]) * ms / opt["params"])
    return out


def measure_host_figures(dev: torch.device, blocks: int = 4, reps: int = 5, *, n_ops: int = 2000,
                         hidden: int = 1600, heads: int = 25, n_params: int = 772) -> dict[str, float]:
    """``host_figures`` measured on ``dev`` now: ``n_ops``-op loops, ``blocks`` gpt2-xl-width blocks
    (``hidden``, ``heads``) at 1 x 16 tokens, plain and checkpointed, and the optimizer step and
    clipping over gpt2-xl's 772 tensors (``n_params``) (``meshplan profile`` on a GPU, ``meshplan
    run``'s host probe, ``runtime.record.host_probe``; a few seconds)."""
    res = {"per_op": per_op(dev, n_ops, reps),
           "block": block_host(dev, blocks, 16, reps, False, hidden=hidden, heads=heads),
           "block_checkpoint": block_host(dev, blocks, 16, reps, True, hidden=hidden, heads=heads),
           "optimizer": optimizer_host(dev, n_params, reps)}
    return host_figures(res)
