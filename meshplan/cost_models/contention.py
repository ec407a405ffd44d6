"""NCCL kernels take streaming multiprocessors from the compute they overlap.

A collective runs as a CUDA kernel of one thread block (CTA) per channel, each resident on its own
SM for the collective's whole duration ("Demystifying NCCL", Hu et al. 2025, arXiv 2507.04786
§3; NCCL's ``NCCL_MIN_CTAS`` / ``NCCL_MAX_CTAS``, ``ncclConfig_t.maxCTAs``: "the number of CTAs
NCCL uses" = channels). NCCL's channel cap is ``MAXCHANNELS = 32`` (``src/include/device.h``);
on 8-GPU NVSwitch nodes of A100 and H100 its search settles on 24 collective channels (the
``NCCL INFO 24 coll channels, …`` init line; ``hardware.NCCL_NVSWITCH_COLL_CHANNELS``), all used
by the bandwidth-bound messages DP buckets and FSDP units are. A GEMM or attention kernel that
overlaps the collective therefore runs on ``S − C`` of the ``S`` SMs (its thread blocks use most
of an SM's shared memory and registers and cannot share the SM with NCCL's 512–640-thread CTA),
so hidden communication is not free (DeepSeek-V3 technical report §3.2.2 keeps its all-to-all
kernels to 20 of 132 SMs for that reason; PyTorch exposes ``max_ctas`` to trade the two, PR
#97394).

Model (``ClusterSpec.comm_sms`` = C, ``ClusterSpec.sm_count`` = S, f = C/S): compute of W seconds
(at the full GPU) overlapping a collective that runs for h seconds progresses at ``1 − f`` of its
speed while the collective runs, so it ends later by::

    slowdown = min(h · f, W · f / (1 − f))

(h · f while the compute outlasts the collective; ``W/(1 − f) − W`` when the compute is entirely
inside it). Memory-bandwidth contention is not modelled (NCCL's copies are a few % of HBM
bandwidth at NVLink/NIC rates). ``comm_sms = 0`` or ``sm_count = 0`` (a profile that measured
neither): no slowdown. Where it applies (``planner``): the DP gradient buckets under the last
backward, the ZeRO/FSDP collectives under forward/backward — every collective the cost model
counts as hidden, and the CP ring's shifts under the attention blocks they overlap
(``epcp.cp_ring_exposed_s``). TP and EP collectives are not overlapped, so they take nothing from
compute. No torch import.
"""

from __future__ import annotations

from meshplan.cost_models.hardware import ClusterSpec


def comm_sm_fraction(cluster: ClusterSpec) -> float:
    """Fraction of the SMs a running collective occupies: ``comm_sms / sm_count`` (0 when either is 0)."""
    if cluster.sm_count <= 0 or cluster.comm_sms <= 0:
        return 0.0
    return cluster.comm_sms / cluster.sm_count


def overlap_slowdown_s(hidden_comm_s: float, compute_s: float, cluster: ClusterSpec) -> float:
    """Seconds the compute of ``compute_s`` loses to NCCL's SMs while a collective runs under it
    for ``hidden_comm_s`` (module docstring): ``min(h·f, W·f/(1−f))``, f = ``comm_sm_fraction``."""
    if hidden_comm_s < 0 or compute_s < 0:
        raise ValueError(f"hidden_comm_s and compute_s must be >= 0, got {hidden_comm_s!r}, {compute_s!r}")
    f = comm_sm_fraction(cluster)
    if f <= 0 or hidden_comm_s == 0 or compute_s == 0:
        return 0.0
    return min(hidden_comm_s * f, compute_s * f / (1.0 - f))
