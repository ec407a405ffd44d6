"""``meshplan profile``: measure the local machine into a ClusterSpec (torch, imported inside each measurement).

Measures, on the device the run would use (CUDA when present, else CPU):

- matmul FLOP/s by size and dtype (``2·n³`` FLOPs per ``n×n @ n×n``); the best is the peak;
- memory bandwidth from a large tensor copy (``2·bytes`` moved: one read, one write);
- the kernel floor: the best time of a tiny kernel;
- how eager training runs GEMMs: the efficiency of chains of ``nn.Linear`` with autograd, forward
  and backward, by GEMM size (``measure_eager_matmul``), and the per-op cost of module call,
  dispatch and autograd beyond the floor (``measure_op_overhead``); on a GPU, where the host runs
  beside the device, the host's time per dispatched op instead (``profile.host``: the
  host-dispatch floor ``ClusterSpec.host_op_s`` and its siblings; the additive per-op figures are
  then 0);
- collectives across ``nproc`` processes: all-reduce and a send/recv ping-pong at sizes from
  ``min_bytes`` to ``max_bytes``, with the alpha-beta model fitted by least squares
  (``meshplan.profile.comm``); on gloo (a CPU) also tensor parallelism's host time on DTensors on
  a rank pair (``profile.tp_host``: ``host_tp_linear_fwd_s`` / ``_bwd_s``, ``host_dtensor_param_s``).

The result is a ClusterSpec with ``devices_per_node = nproc``, inter-node figures equal to the
intra-node ones (one machine), efficiencies 1.0 (the measured peaks already are what kernels
reach), the raw measurements in ``extra`` and ``source`` saying it was measured, when and how.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from meshplan.cost_models.hardware import ClusterSpec, default_reserved_bytes
from meshplan.profile.budget import FAST_FLAGS, Budget, Log, cpu_has_fast, cpu_name, fits, log_stderr
from meshplan.profile.comm import byte_sizes, fit_or_bound, measure_collectives_and_tp_host
from meshplan.profile.links import single_device_links
from meshplan.profile.provenance import collective_provenance, profile_provenance, tp_host_provenance

DEFAULT_MATMUL_SIZES = (256, 512, 1024, 2048)
QUICK_MATMUL_SIZES = (128, 256, 512)
#: on a GPU a 512x512 matmul reaches ~1% of the tensor-core peak (H200, measured: 9.9 TFLOP/s bf16 at 512
#: against ~790 at 8192), so a CPU's sizes would profile an H200 as a slow CPU; an 8192^3 bf16 matmul takes
#: ~1.4 ms there, so the large sizes cost nothing
GPU_MATMUL_SIZES = (1024, 2048, 4096, 8192)
QUICK_GPU_MATMUL_SIZES = (2048, 4096, 8192)


def _sync(torch: Any, device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_calls(
    fn: Callable[[], Any], torch: Any, device: Any, reps: int, deadline: float | None = None
) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn`` (device synchronized) after up to two warm-ups;
    past ``deadline`` (``time.monotonic()``) it stops early, after at least one timed call."""
    for _ in range(2):
        fn()
        _sync(torch, device)
        if deadline is not None and time.monotonic() > deadline:
            break
    times: list[float] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(torch, device)
        times.append(time.perf_counter() - t0)
        if deadline is not None and time.monotonic() > deadline:
            break
    return times


def _best_time(fn: Callable[[], Any], torch: Any, device: Any, reps: int, deadline: float | None = None) -> float:
    """Fastest of ``reps`` timed calls after two warm-ups: what the hardware can do (peaks are
    best-case figures; on a shared machine the median measures the neighbours)."""
    return min(_timed_calls(fn, torch, device, reps, deadline))


def measure_matmul(
    sizes: Sequence[int], dtypes: Sequence[str], reps: int, device: Any, log: Log = log_stderr,
    deadline: float | None = None, slow_dtypes: Sequence[str] = (),
) -> dict[str, list[tuple[int, float]]]:
    """FLOP/s of ``n×n @ n×n`` per dtype and size (``2·n³ / best seconds``).

    With a ``deadline`` each dtype gets an equal share of the time left, and a size that would not
    finish in it (estimated from the last size by FLOPs) is skipped with a log line; the smallest
    size is always measured. ``slow_dtypes`` are measured at the smallest size only.
    """
    import torch

    tdt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    out: dict[str, list[tuple[int, float]]] = {}
    sizes = sorted(sizes)
    for i, dt in enumerate(dtypes):
        out[dt] = []
        end = None if deadline is None else time.monotonic() + (deadline - time.monotonic()) / (len(dtypes) - i)
        todo = sizes[:1] if dt in slow_dtypes else sizes
        if dt in slow_dtypes and len(sizes) > 1:
            log(f"matmul {dt}: this CPU has no native {dt} (no {'/'.join(FAST_FLAGS[dt])} flag): sizes "
                f"{sizes[1:]} skipped, {sizes[0]} only")
        last: tuple[int, float] | None = None
        for n in todo:
            if end is not None and last is not None and not fits(last[1], (n / last[0]) ** 3, reps, end):
                log(f"matmul {dt}: sizes from {n} skipped (budget)")
                break
            a = torch.randn(n, n, device=device).to(tdt[dt])
            b = torch.randn(n, n, device=device).to(tdt[dt])
            t = _best_time(lambda a=a, b=b: torch.mm(a, b), torch, device, reps, end)
            last = (n, t)
            out[dt].append((n, 2 * n**3 / t))
            log(f"matmul {dt} {n}x{n}: {2 * n**3 / t / 1e9:.1f} GFLOP/s")
    return out


def measure_mem_bw(nbytes: int, reps: int, device: Any, log: Log = log_stderr, deadline: float | None = None) -> float:
    """Device memory bandwidth in bytes/s: ``2·nbytes / t`` for a copy of ``nbytes``."""
    import torch

    n = max(1, nbytes // 4)
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    t = _best_time(lambda: dst.copy_(src), torch, device, reps, deadline)
    bw = 2 * n * 4 / t
    log(f"memory copy {n * 4 / 1e6:.0f} MB: {bw / 1e9:.2f} GB/s")
    return bw


def measure_kernel_floor(device: Any, reps: int = 50) -> float:
    """Best seconds of a one-element add: the launch overhead every kernel pays."""
    import torch

    x = torch.ones(1, device=device)
    return _best_time(lambda: torch.add(x, x), torch, device, reps)


#: (tokens, hidden) of the eager linear chains ``measure_eager_matmul`` times: GEMMs of ~17 MFLOP
#: to ~2 GFLOP, the range small models train at.
DEFAULT_EAGER_SHAPES = ((128, 128), (512, 256), (2048, 256), (1024, 512))
QUICK_EAGER_SHAPES = ((128, 128), (512, 256), (2048, 256))


def _median_time(fn: Callable[[], Any], torch: Any, device: Any, reps: int, deadline: float | None = None) -> float:
    """Median of ``reps`` timed calls after two warm-ups (what a training step sees)."""
    return statistics.median(_timed_calls(fn, torch, device, reps, deadline))


def median_time_s(fn: Callable[[], Any], reps: int = 5) -> float:
    """Median seconds of ``reps`` calls of ``fn`` on the CPU after two warm-ups (for benchmarks)."""
    import torch

    return _median_time(fn, torch, torch.device("cpu"), reps)


def _median_backward_time(
    forward: Callable[[], Any], torch: Any, device: Any, reps: int, deadline: float | None = None
) -> float:
    """Median seconds of ``forward().sum().backward()``'s backward alone (forward run untimed)."""
    times = []
    for i in range(reps + 2):
        loss = forward().sum()
        _sync(torch, device)
        t0 = time.perf_counter()
        loss.backward()
        _sync(torch, device)
        if i >= 2:  # two warm-ups
            times.append(time.perf_counter() - t0)
        if deadline is not None and time.monotonic() > deadline and (times or i >= 1):
            break
    return statistics.median(times or [time.perf_counter() - t0])


def measure_eager_matmul(
    shapes: Sequence[tuple[int, int]], peak_flops: float, reps: int, device: Any, log: Log = log_stderr,
    deadline: float | None = None,
) -> list[list[float]]:
    """GEMM efficiency by size as eager training runs GEMMs: rows ``[flops per GEMM, fwd eff, bwd eff]``.

    For each (tokens ``T``, hidden ``h``) a chain of 4 ``nn.Linear`` (h→4h→h→4h→h, distinct
    weights, autograd on) runs forward, then forward+backward of ``sum()``; forward does
    ``4·2·T·h·4h`` FLOPs, backward (timed alone) twice that (dX and dW). Efficiency = FLOP/s over
    ``peak_flops`` (the square-matmul peak), clamped to (0, 1]. It includes what a square
    ``torch.mm`` loop hides: bias adds, allocation, autograd, weights that left the cache.
    """
    import torch

    rows = []
    for k, (t, h) in enumerate(shapes):
        if deadline is not None and rows and time.monotonic() > deadline:
            log(f"eager linear chains {list(shapes[k:])} skipped (budget)")
            break
        layers = torch.nn.Sequential(*[
            torch.nn.Linear(h, 4 * h) if i % 2 == 0 else torch.nn.Linear(4 * h, h) for i in range(4)
        ]).to(device)  # fmt: skip
        x = torch.randn(t, h, device=device, requires_grad=True)
        t_f = _median_time(lambda x=x, m=layers: m(x), torch, device, reps, deadline)
        t_b = _median_backward_time(lambda x=x, m=layers: m(x), torch, device, reps, deadline)
        gemm = 2.0 * t * h * 4 * h
        eff_f = min(1.0, 4 * gemm / t_f / peak_flops)
        eff_b = min(1.0, 8 * gemm / t_b / peak_flops)
        rows.append([gemm, eff_f, eff_b])
        log(f"eager linear chain {t}x{h}: GEMM {gemm / 1e6:.0f} MFLOP, efficiency fwd {eff_f:.2f} bwd {eff_b:.2f}")
    return rows


def measure_op_overhead(
    device: Any, floor_s: float, reps: int = 15, n_ops: int = 20, deadline: float | None = None
) -> tuple[float, float]:
    """(forward, per-backward-part) seconds eager PyTorch spends per op beyond the kernel floor.

    Times a chain of ``n_ops`` tiny ``nn.Linear(8, 8)`` modules on one row (module call, dispatch,
    autograd graph recording; the kernels do almost nothing): forward per module, and backward
    per module split over its two parts (input grad, weight grad). ``floor_s`` (already paid by
    every kernel in the roofline) is subtracted; results are clamped at 0.
    """
    import torch

    chain = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(n_ops)]).to(device)
    x = torch.randn(1, 8, device=device, requires_grad=True)
    t_f = _median_time(lambda: chain(x), torch, device, reps, deadline) / n_ops
    t_b = _median_backward_time(lambda: chain(x), torch, device, reps, deadline) / n_ops
    return max(0.0, t_f - floor_s), max(0.0, t_b / 2 - floor_s)


def _host_mem_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 * 1024**3


def profile_machine(
    *,
    nproc: int = 2,
    quick: bool = False,
    min_bytes: int = 4096,
    max_bytes: int | None = None,
    reps: int | None = None,
    matmul_sizes: Sequence[int] | None = None,
    mem_test_bytes: int | None = None,
    backend: str = "auto",
    name: str | None = None,
    eager_shapes: Sequence[tuple[int, int]] | None = None,
    log: Log = log_stderr,
    budget_s: float | None = None,
) -> ClusterSpec:
    """Measure this machine and return it as a ClusterSpec of ``nproc`` devices on one node.

    Defaults: collectives 4 KB–64 MB, 5 reps (``quick``: up to 16 MB, 3 reps); matmul sizes
    256–2048 (``quick``: 128–512), on a GPU 1024–8192 (``quick``: 2048–8192); memory copy of 256 MB
    (``quick``: 32 MB), on a GPU 1 GiB (``quick``: 256 MB); eager linear chains
    ``DEFAULT_EAGER_SHAPES`` (``quick``: ``QUICK_EAGER_SHAPES``) for the size-dependent GEMM
    efficiency, and the per-op overhead of eager PyTorch (``measure_op_overhead``). ``backend``:
    ``auto`` (nccl with a GPU per process, else gloo), ``gloo`` or ``nccl``. Per-device memory is
    the GPU's memory, or on CPU the host memory divided by ``nproc``. ``budget_s``: total seconds
    (``budget.Budget``: each measurement bounded, larger sizes skipped when out of time,
    progress lines prefixed with elapsed/budget); None: unbounded. On a CPU without native bf16
    (fp16) the bf16 (fp16) matmul sweep is skipped (smallest size only) with a note.

    ``nproc=1``: one device, no collectives; the links between devices are derived
    (``profile.links.single_device_links``) and marked so in ``provenance``, as is every figure
    that is not measured (``profile.provenance``).
    """
    import torch

    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer, got {nproc!r}")
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    has_gpus = found >= nproc
    if backend == "auto" and 0 < found < nproc:  # a silent CPU profile would mislead a GPU user
        raise ValueError(f"--nproc {nproc} needs {nproc} GPUs, this machine has {found}: --nproc {found} profiles "
                         f"the GPU{'s' if found > 1 else ''}" + (" (links derived)" if found == 1 else "")
                         + f", --backend gloo the CPU across {nproc} processes")
    if backend == "auto":
        backend = "nccl" if has_gpus else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be auto, gloo or nccl, got {backend!r}")
    if backend == "nccl" and not has_gpus:
        raise ValueError(f"backend nccl needs {nproc} GPUs, found {torch.cuda.device_count()}")
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    max_bytes = max_bytes or (16 << 20 if quick else 64 << 20)
    reps = reps or (3 if quick else 5)
    gpu = device.type == "cuda"
    sizes_mm = tuple(matmul_sizes or (
        (QUICK_GPU_MATMUL_SIZES if quick else GPU_MATMUL_SIZES) if gpu else (QUICK_MATMUL_SIZES if quick else DEFAULT_MATMUL_SIZES)))
    # a GPU's copy bandwidth needs copies far larger than its caches (H200, measured: 2.3 TB/s at 32 MB)
    mem_test_bytes = mem_test_bytes or ((256 << 20 if quick else 1 << 30) if gpu else (32 << 20 if quick else 256 << 20))
    started = datetime.now(UTC)
    t_start = time.perf_counter()
    load_start = _load()

    budget = Budget(budget_s, log) if budget_s is not None else None
    if budget is not None:
        log = budget.log

    def phase(name: str) -> float | None:
        return budget.phase(name) if budget is not None else None

    log(f"device {device}, " + (f"backend {backend}, nproc {nproc}" if nproc > 1 else "one device: no collectives"))
    dtypes = ("fp32", "bf16", "fp16")
    slow = tuple(dt for dt in ("bf16", "fp16") if device.type == "cpu" and not cpu_has_fast(dt))
    mm = measure_matmul(sizes_mm, dtypes, reps, device, log, deadline=phase("matmul"), slow_dtypes=slow)
    peak = {dt: max(f for _, f in v) for dt, v in mm.items()}
    mem_bw = measure_mem_bw(mem_test_bytes, reps, device, log, deadline=phase("memory"))
    floor = measure_kernel_floor(device)
    log(f"kernel floor {floor * 1e6:.1f} us")
    shapes = tuple(eager_shapes or (QUICK_EAGER_SHAPES if quick else DEFAULT_EAGER_SHAPES))
    eff_table = measure_eager_matmul(shapes, peak["fp32"], max(reps, 5), device, log, deadline=phase("eager"))
    op_f, op_b = measure_op_overhead(device, floor, deadline=phase("overhead"))
    log(f"eager op overhead: forward {op_f * 1e6:.1f} us, per backward part {op_b * 1e6:.1f} us")
    host: dict[str, float] = {}
    if device.type == "cuda":  # the host runs beside the device: a floor, not an addition (cost_models.host)
        from meshplan.profile.host import measure_host_figures

        host = measure_host_figures(device)
        log(f"host dispatch per op {host['host_op_s'] * 1e6:.1f} us forward, {host['host_bwd_op_s'] * 1e6:.1f} us "
            f"backward; checkpoint wrapper {host['host_checkpoint_fwd_s'] * 1e3:.2f} / "
            f"{host['host_checkpoint_bwd_s'] * 1e3:.2f} ms per block (the host-dispatch floor; the additive "
            "per-op overhead is not used on a GPU)")
        op_f = op_b = 0.0

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        mem, dev_name, sms = int(props.total_memory), props.name, int(props.multi_processor_count)
    else:  # a CPU has no SM grid: no GEMM/attention shape factor (sm_count 0)
        mem, dev_name, sms = _host_mem_bytes() // nproc, cpu_name(), 0
    coll: dict[str, list[tuple[int, float]]] = {}
    tp_raw: dict[str, float] = {}
    if nproc == 1:
        links, link_why = single_device_links(device, dev_name, reps, log, deadline=phase("collectives"),
                                              mem_bw=mem_bw)
        p2p_alpha, p2p_bw = links["intra_latency_s"], links["intra_bw_bytes_per_s"]
        comm_how = "no collectives (one device): links derived, see provenance"
    else:
        phase("collectives")
        # on gloo (a CPU) the same ranks then measure tensor parallelism's DTensor host time (profile.tp_host)
        coll, tp_raw = measure_collectives_and_tp_host(
            nproc, byte_sizes(min_bytes, max_bytes), reps, backend, log,
            wall_deadline=budget.wall_deadline() if budget is not None else None,
            tp_host_reps=max(reps, 3) if backend == "gloo" else 0)
        alpha, bw = fit_or_bound(coll["all_reduce"], "all_reduce", nproc, log)
        p2p_alpha, p2p_bw = fit_or_bound(coll["send_recv"], "send_recv", 2, log)
        log(f"all_reduce fit: alpha {alpha * 1e6:.1f} us, bw {bw / 1e9:.3f} GB/s; "
            f"send_recv fit: alpha {p2p_alpha * 1e6:.1f} us, bw {p2p_bw / 1e9:.3f} GB/s")  # fmt: skip
        links = {"intra_latency_s": alpha, "intra_bw_bytes_per_s": bw,
                 "inter_latency_s": alpha, "inter_bw_bytes_per_s": bw}  # one machine: "between nodes" is the same link
        link_why = collective_provenance(backend, nproc, min_bytes, max_bytes)
        if tp_raw:  # a CPU host: tensor parallelism's DTensor host time, additive here (profile.tp_host)
            from meshplan.profile.tp_host import tp_host_figures

            host.update(tp_host_figures(tp_raw))
            log(f"DTensor host time per tensor-parallel linear {host['host_tp_linear_fwd_s'] * 1e6:.0f} us forward, "
                f"{host['host_tp_linear_bwd_s'] * 1e6:.0f} us backward; {host['host_dtensor_param_s'] * 1e6:.0f} us "
                "per DTensor parameter in the optimizer step")  # fmt: skip
            link_why = {**link_why, **tp_host_provenance()}
        comm_how = (f"{backend} across {nproc} processes (spawn, tcp://127.0.0.1), collectives "
                    f"{min_bytes}-{max_bytes} bytes, alpha-beta fit (least-squares slope, intercept from the small sizes)")
    elapsed = time.perf_counter() - t_start
    source = (
        f"measured by `meshplan profile` on {platform.node() or 'localhost'} ({dev_name}) at "
        f"{started.isoformat(timespec='seconds')}: torch {torch.__version__}, {comm_how}, matmul sizes "
        f"{list(sizes_mm)}, {reps} reps (best time for matmul/memory, median for collectives), eager linear "
        f"chains {[list(x) for x in shapes]} (median time, fp32)"
    )
    measured_sizes = {dt: [n for n, _ in v] for dt, v in mm.items()}
    return ClusterSpec(
        name=name or f"local-{device.type}-{nproc}",
        num_devices=nproc,
        devices_per_node=nproc,
        peak_flops=peak,
        mem_bytes=mem,
        # a GPU process cannot use all of it: CUDA context, NCCL buffers, fragmentation (as the presets)
        mem_reserved_bytes=default_reserved_bytes(mem) if device.type == "cuda" else 0,
        mem_bw_bytes_per_s=mem_bw,
        **links,
        matmul_efficiency=1.0,
        mem_efficiency=1.0,
        comm_efficiency=1.0,
        kernel_floor_s=floor,
        op_overhead_s=op_f,
        bwd_op_overhead_s=op_b,
        **host,
        matmul_efficiency_by_flops=eff_table,
        comm_backend="nccl" if backend == "nccl" else "gloo",
        sm_count=sms,
        source=source,
        provenance={**profile_provenance(device.type, nproc, measured_sizes, mem_test_bytes, shapes), **link_why},
        extra={
            "measured": True,
            "measured_at": started.isoformat(timespec="seconds"),
            "profile_seconds": round(elapsed, 3),
            "device": dev_name,
            "device_type": device.type,
            "host": platform.node(),
            "backend": backend if nproc > 1 else "none",
            "torch": torch.__version__,
            "cpu_threads": torch.get_num_threads(),
            # how busy the machine was (1-minute load average, the larger of start and end): check_profile warns
            "load_avg_1m": max((x for x in (load_start, _load()) if x is not None), default=None),
            "cpu_count": os.cpu_count(),
            "matmul_flops_by_size": {dt: [[n, f] for n, f in v] for dt, v in mm.items()},
            "collectives": {k: [[n, t] for n, t in v] for k, v in coll.items()},
            **({"tp_host": tp_raw} if tp_raw else {}),
            "send_recv_latency_s": p2p_alpha,
            "send_recv_bw_bytes_per_s": p2p_bw,
        },
    )


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):  # not available on this platform
        return None


def check_profile(spec: ClusterSpec) -> list[str]:
    """Warnings about a measured profile whose figures look implausible (empty when fine)."""
    warn = []
    load, cores = spec.extra.get("load_avg_1m"), spec.extra.get("cpu_count")
    if isinstance(load, (int, float)) and isinstance(cores, int) and load > cores:
        warn.append(f"measured while this machine was busy (1-minute load {load:g} on {cores} cores): the figures "
                    "may be low; measure again when it is idle")
    if spec.intra_latency_s == 0 and spec.provenance.get("intra_latency_s", "measured").startswith("measured"):
        warn.append("fitted latency is 0: the smallest sizes were not latency bound; lower --min-bytes")
    if not math.isfinite(spec.intra_bw_bytes_per_s) or spec.intra_bw_bytes_per_s > 1e13:
        warn.append("fitted bandwidth is implausibly high; raise --max-bytes")
    return warn
