"""Host time of tensor parallelism on DTensors, measured on one rank pair (``meshplan profile`` on gloo, #33 item 6).

On a CPU host the rank's own cores run the model, torch's DTensor dispatch and gloo's collectives,
one after another. torch's tensor parallelism (``parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel``, what meshplan's runtime applies: ``runtime/apply/tp.py``) turns each sharded
linear's weight and bias into DTensors and wraps its input and output in hooks
(``torch/distributed/tensor/parallel/style.py``: ``_prepare_input_fn`` builds a DTensor with
``DTensor.from_local`` and redistributes it; ``_prepare_output_fn`` redistributes and calls
``to_local``). Every aten op on a DTensor goes through ``DTensor.__torch_dispatch__`` →
``OpDispatcher.dispatch`` (``torch/distributed/tensor/_dispatch.py``): sharding propagation (cached
by op schema), the local op, and wrapping the result. That is host work per sharded linear that
the plain linear of the same local shape does not do, in forward and in backward; and the
optimizer step and gradient-norm clipping over DTensor parameters dispatch every per-tensor op the
same way (``torch/nn/utils/clip_grad.py`` reduces the norms of DTensors through DTensor ops).

``measure_tp_host`` times, on every rank of an initialized process group (all ranks run it; rank 0's
figures are kept), ``PAIRS`` Megatron pairs (a column-parallel linear, ReLU, a row-parallel linear:
width ``WIDTH``, ``TOKENS`` tokens, fp32) under torch's styles over the whole group, against the
plain pairs of the same local shapes; the difference in forward and in backward, less the
collectives torch ran in them (counted with ``torch.distributed.tensor.debug.CommDebugMode``) at
the time of one all-reduce of the same size measured in between (the cost model prices those
collectives itself, with the profiled latency), per sharded linear. And AdamW's step (per tensor,
``foreach=False``, as the runtime on a CPU) with ``clip_grad_norm_`` over the sharded parameters
against the plain ones, per parameter tensor. Least wall and least CPU seconds of ``reps`` after
warm-up (CPU: ``time.process_time``, the process's every thread); the figures are CPU seconds
(``tp_host_figures``), clamped at 0.

``meshplan profile`` on gloo runs it in the processes that measured the collectives
(``profile.comm.measure_collectives_and_tp_host``: one thread each, the profile's ``--nproc`` ranks, a
pair by default; no second spawn). ``tp_host_figures`` maps the measurement to ``ClusterSpec.host_tp_linear_fwd_s``,
``host_tp_linear_bwd_s`` and ``host_dtensor_param_s`` (priced in ``planner.costing`` and
``planner.state_costs``). torch is imported inside the function only.
"""

from __future__ import annotations

import time
from typing import Any

#: Megatron pairs timed, their width and tokens (gpt-tiny's width; tiny, so the host's work dominates)
PAIRS = 4
WIDTH = 64
TOKENS = 16


def _least(fn: Any, reps: int, sync: Any) -> tuple[float, float]:
    """(least wall seconds, least CPU seconds) of ``fn()`` over ``reps`` timed calls after two
    warm-ups, ``sync()`` (a barrier) before each so both ranks start together. CPU seconds: the
    process's (``time.process_time``, every thread: gloo's included), what the call costs the host
    whatever share of a core it got."""
    wall = cpu = float("inf")
    for i in range(reps + 2):
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if i >= 2:
            wall, cpu = min(wall, dt), min(cpu, dc)
    return wall, cpu


def measure_tp_host(reps: int = 7) -> dict[str, float]:
    """The raw timings (seconds, least of ``reps``) and counts ``tp_host_figures`` reads; call on every
    rank of an initialized CPU process group of two or more ranks (module docstring)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    class Pair(nn.Module):
        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.fc_in = nn.Linear(WIDTH, hidden)
            self.fc_out = nn.Linear(hidden, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc_out(torch.relu(self.fc_in(x)))

    torch.manual_seed(0)
    tp = nn.Sequential(*[Pair(4 * WIDTH) for _ in range(PAIRS)])
    for pair in tp:
        parallelize_module(pair, mesh, {"fc_in": ColwiseParallel(), "fc_out": RowwiseParallel()})
    plain = nn.Sequential(*[Pair(4 * WIDTH // world) for _ in range(PAIRS)])
    x = torch.randn(1, TOKENS, WIDTH, requires_grad=True)
    held: dict[str, torch.Tensor] = {}

    def fwd(model: nn.Module) -> Any:
        def run() -> None:
            held["out"] = model(x)
        return run

    def bwd() -> None:
        held.pop("out").sum().backward()

    def timed(model: nn.Module) -> dict[str, float]:
        out = {"fwd_s": float("inf"), "bwd_s": float("inf"), "fwd_cpu_s": float("inf"), "bwd_cpu_s": float("inf")}
        for i in range(reps + 2):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            fwd(model)()
            t1, c1 = time.perf_counter(), time.process_time()
            dist.barrier()
            t2, c2 = time.perf_counter(), time.process_time()
            bwd()
            t3, c3 = time.perf_counter(), time.process_time()
            if i >= 2:
                for k, v in (("fwd_s", t1 - t0), ("bwd_s", t3 - t2), ("fwd_cpu_s", c1 - c0), ("bwd_cpu_s", c3 - c2)):
                    out[k] = min(out[k], v)
        return out

    with CommDebugMode() as cf:
        fwd(tp)()
    n_fwd = cf.get_total_counts()
    with CommDebugMode() as cb:
        bwd()
    n_bwd = cb.get_total_counts()
    tp_t, plain_t = timed(tp), timed(plain)
    probe = torch.ones(TOKENS * WIDTH)
    ar, ar_cpu = _least(lambda: dist.all_reduce(probe), reps, dist.barrier)

    def opt_time(model: nn.Module) -> tuple[tuple[float, float], int]:
        params = [p for p in model.parameters()]
        for p in params:
            p.grad = torch.ones_like(p)
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=False)

        def step() -> None:
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            opt.step()
        return _least(step, reps, dist.barrier), len(params)

    (opt_tp, opt_tp_cpu), n_params = opt_time(tp)
    (opt_plain, opt_plain_cpu), _ = opt_time(plain)
    return {**{f"tp_{k}": v for k, v in tp_t.items()}, **{f"plain_{k}": v for k, v in plain_t.items()},
            "collectives_fwd": float(n_fwd), "collectives_bwd": float(n_bwd), "all_reduce_s": ar,
            "all_reduce_cpu_s": ar_cpu, "linears": float(2 * PAIRS), "opt_tp_s": opt_tp, "opt_tp_cpu_s": opt_tp_cpu,
            "opt_plain_s": opt_plain, "opt_plain_cpu_s": opt_plain_cpu, "params": float(n_params),
            "world": float(world), "width": float(WIDTH), "tokens": float(TOKENS)}  # fmt: skip


def tp_host_figures(m: dict[str, float]) -> dict[str, float]:
    """``ClusterSpec``'s DTensor host figures (seconds) from ``measure_tp_host``'s CPU seconds (the
    host's work, whatever share of a core the pair got while measured: on a shared host the wall
    time of two processes that wait on each other's collectives is mostly scheduling):

    - ``host_tp_linear_fwd_s``: (sharded forward - plain forward - its collectives x one all-reduce)
      per sharded linear;
    - ``host_tp_linear_bwd_s``: the same for backward;
    - ``host_dtensor_param_s``: (step + clipping over DTensor parameters - over plain ones) per tensor.
    Each clamped at 0."""
    lin = max(1.0, m["linears"])
    ar = m["all_reduce_cpu_s"]
    f = (m["tp_fwd_cpu_s"] - m["plain_fwd_cpu_s"] - m["collectives_fwd"] * ar) / lin
    b = (m["tp_bwd_cpu_s"] - m["plain_bwd_cpu_s"] - m["collectives_bwd"] * ar) / lin
    p = (m["opt_tp_cpu_s"] - m["opt_plain_cpu_s"]) / max(1.0, m["params"])
    return {"host_tp_linear_fwd_s": max(0.0, f), "host_tp_linear_bwd_s": max(0.0, b), "host_dtensor_param_s": max(0.0, p)}
