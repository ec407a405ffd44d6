"""The run's own host, measured by the run (``meshplan run --host-probe``; RunRecord ``host``, #33 item 6).

A host-bound step (a small microbatch on a fast GPU, recompute: ``cost_models.host``) takes as long as
the host needs to dispatch its ops, and that host time differs from machine to machine of one GPU
kind (the same gpt2-xl mb2x4 recompute=full run on three H100 hosts: 742 ms, 1173 ms; on an H200's
817 ms; BENCHMARKS.md "Wave 3 stop 10: calibration transfer on an H100"). A run that is GPU-bound says
nothing about its host in its step time, and its RunRecord's CPU seconds do not either: the runtime's
CUDA synchronizations spin on the host, so a rank's CPU seconds equal its wall seconds whether it
waited on the device or dispatched (the gpt2-xl records above: ``measured_cpu_s`` within 5 % of
``measured_s`` in the forward and backward, GPU-bound or not), and the profiled steps' op timings carry torch's
profiler's own per-op host work (the host-bound record's profiled phases add up to 1.9x its step).

So the run measures the host directly: after its timed and profiled steps (off the step times), every
rank runs ``profile.host.measure_host_figures`` on its own device, the same measurement ``meshplan
profile`` and ``benchmarks/host_overhead.py`` make (per-op dispatch of autograd-recording ops,
gpt2-xl-width zoo blocks forward and backward plain and under torch's checkpoint wrapper, the optimizer
step and clipping over many tensors; least of the reps), while the other ranks do the same, as in
training. Rank 0's figures go in the RunRecord; ``meshplan calibrate`` puts them in the calibrated
cluster (``api.calibration.recorded_host``), so a fit on a GPU-bound run predicts a host-bound one
on the host that ran it. A few seconds on a GPU; ``--host-probe auto`` (the default) probes on CUDA
only: on a CPU host and device are the same cores, the cost model has no host floor there
(``ClusterSpec.host_op_s`` 0) and calibration does not use the figures (``--host-probe on`` measures
them there at small sizes, ``probe_host``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from meshplan.cost_models.hardware import HOST_FIELDS  # the ClusterSpec fields a probe measures

if TYPE_CHECKING:
    import torch


def wants_probe(mode: str, device_type: str) -> bool:
    """Whether ``--host-probe MODE`` probes on a ``device_type`` rank: on, off, auto (CUDA only)."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"--host-probe {mode!r}: use auto, on or off")
    return mode == "on" or (mode == "auto" and device_type == "cuda")


def probe_host(dev: torch.device, *, quick: bool | None = None) -> dict[str, Any]:
    """This host's figures measured on ``dev`` now (module docstring): the ``HOST_FIELDS`` in seconds,
    with ``device`` (its type and name), ``seconds`` (the probe's wall time) and ``how``. ``quick``:
    small sizes (the figures then describe a 64-wide block, not gpt2-xl's); default on a CPU, where
    gpt2-xl-width blocks on one thread of a loaded 2-core host ran past the run's 180 s hang timeout
    (``--host-probe on``, stop 10) and calibration does not use the figures."""
    import torch

    from meshplan.profile.host import measure_host_figures

    if quick is None:
        quick = dev.type != "cuda"
    t0 = time.perf_counter()
    sizes: dict[str, int] = {"n_ops": 200, "hidden": 64, "heads": 4, "n_params": 16} if quick else {}
    figs = measure_host_figures(dev, blocks=2 if quick else 4, reps=2 if quick else 5, **sizes)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    how = ("profile.host.measure_host_figures on this rank's device after the run's steps (least of the reps): "
           + ("quick sizes" if quick else "2000-op loops, 4 gpt2-xl-width blocks at 1 x 16 tokens plain and "
              "checkpointed, AdamW + clipping over 772 tensors"))
    out: dict[str, Any] = {k: float(figs.get(k, 0.0)) for k in HOST_FIELDS}
    out.update({"device": f"{dev.type}: {name}", "seconds": round(time.perf_counter() - t0, 3), "how": how})
    return out
