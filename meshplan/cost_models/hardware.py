"""ClusterSpec: the hardware a plan is made for, with published presets and JSON profiles.

Figures and sources: FORMULAS.md "Hardware" (vendor datasheets): dense BF16 peak, SM count
(V100 80, A100 108, H100/H200 SXM 132: NVIDIA architecture whitepapers), HBM size and bandwidth, NVLink bandwidth (the datasheet's bidirectional figure halved to one direction),
InfiniBand per GPU per direction (DGX A100: 8x HDR 200 Gb/s = 25 GB/s; DGX H100: 8x NDR 400 Gb/s
= 50 GB/s). Efficiencies are the calibratable fraction of peak that real kernels reach.

No torch import: a ClusterSpec is plain data, always passed as an argument, never a global.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from meshplan.cost_models.efficiency import GEMM_CEILING_H100

GB = 1e9
GiB = 1024**3
#: how a ``ClusterSpec.provenance`` entry starts
PROVENANCE_KINDS = ("measured", "derived")


#: the ClusterSpec host figures a host measurement yields (``profile.host.host_figures``; ``meshplan run``'s
#: probe writes them to its RunRecord ``host``, ``meshplan calibrate`` reads them back)
HOST_FIELDS = ("host_op_s", "host_bwd_op_s", "host_checkpoint_fwd_s", "host_checkpoint_bwd_s", "host_optimizer_tensor_s")


@dataclass(frozen=True)
class ClusterSpec:
    """A homogeneous cluster: ``num_devices`` accelerators, ``devices_per_node`` per node.

    Units are in the names: FLOP/s, bytes, bytes/s, seconds. Bandwidths are per device, per
    direction. ``source`` says where the figures come from (a preset's datasheet or a profile).
    """

    name: str
    num_devices: int
    devices_per_node: int
    peak_flops: dict[str, float]  # dtype ("bf16", "fp16", "fp32") -> FLOP/s per device
    mem_bytes: int  # memory per device
    mem_bw_bytes_per_s: float  # device memory bandwidth
    intra_bw_bytes_per_s: float  # per device, per direction, inside a node
    intra_latency_s: float
    inter_bw_bytes_per_s: float  # per device, per direction, between nodes
    inter_latency_s: float
    matmul_efficiency: float = 0.75  # fraction of peak FLOP/s that large GEMMs reach
    mem_efficiency: float = 0.8  # fraction of memory bandwidth that memory-bound kernels reach
    comm_efficiency: float = 0.8  # fraction of link bandwidth that collectives reach
    kernel_floor_s: float = 5e-6  # smallest time any kernel launch takes
    # memory the allocator cannot hand to tensors: CUDA context, NCCL buffers, fragmentation
    # (presets: ``default_reserved_bytes``; 0 for a bare spec or a measured profile)
    mem_reserved_bytes: int = 0
    # Eager-framework calibration (``meshplan profile``; presets leave them empty/0, so their
    # costing is unchanged): seconds of dispatch + autograd bookkeeping per op in forward and per
    # backward part, and GEMM efficiency by size as rows [flops per GEMM, fwd eff, bwd eff]
    # (interpolated in log(flops) by ``cost_models.compute.matmul_efficiency_at``).
    op_overhead_s: float = 0.0
    bwd_op_overhead_s: float = 0.0
    # The host-dispatch floor (``cost_models.host``): seconds of host work per op eager PyTorch
    # dispatches (Python, dispatcher, autograd, autocast, launch; views too) on the thread that
    # feeds one accelerator. The device runs concurrently, so one stage's forward (or backward) of
    # one microbatch takes at least its dispatched ops times this. A host property: measured by
    # ``meshplan profile`` on a GPU (``benchmarks/host_overhead.py`` for the block-level check);
    # every GPU preset carries ``HOST_H200`` (the one host measured so far); 0 = no floor (a CPU
    # host, where ``op_overhead_s`` adds it instead; ``without_host_floor()``).
    # ``host_bwd_op_s``: the same per op the autograd engine dispatches in backward (0 = host_op_s);
    # ``host_checkpoint_fwd_s`` / ``host_checkpoint_bwd_s``: host seconds per checkpointed block
    # per microbatch that torch's non-reentrant checkpoint adds beyond the ops it re-runs (state
    # capture in forward; saved-tensor hooks and recompute bookkeeping in backward);
    # ``host_optimizer_tensor_s``: host seconds per parameter tensor of the optimizer phase (foreach
    # gradient-norm clipping + the fused Adam step's Python and dispatch, ``cost_models.optimizer_phase``)
    host_op_s: float = 0.0
    host_bwd_op_s: float = 0.0
    host_checkpoint_fwd_s: float = 0.0
    host_checkpoint_bwd_s: float = 0.0
    host_optimizer_tensor_s: float = 0.0
    # Tensor parallelism's host time on DTensors, additive (a CPU host, where the rank's cores run
    # dispatch, compute and gloo's collectives in turn; ``profile.tp_host``, measured by ``meshplan
    # profile`` on gloo; presets and GPU profiles leave them 0): seconds a tensor-parallel linear adds
    # per microbatch beyond the plain linear of its local shape and the collectives the cost model
    # prices, in forward and in backward (DTensor dispatch, the styles' input / output hooks), and
    # seconds the optimizer step with gradient clipping adds per DTensor parameter tensor (a
    # tensor-parallel linear's weight or bias; FSDP2's sharded parameters)
    host_tp_linear_fwd_s: float = 0.0
    host_tp_linear_bwd_s: float = 0.0
    host_dtensor_param_s: float = 0.0
    matmul_efficiency_by_flops: list[list[float]] = field(default_factory=list)
    # streaming multiprocessors per device (datasheet): GEMM tile/wave quantization and the
    # flash-attention grid (``cost_models.efficiency``); 0 = unknown, no shape factor
    sm_count: int = 0
    # the best-shaped GEMM's measured fraction of the datasheet peak, per dtype ("bf16", "fp8"):
    # ``gemm_peak`` prices a GEMM of another dtype by its ceiling over the 16-bit one's (presets:
    # ``efficiency.GEMM_CEILING_H100``); empty = every dtype at its datasheet peak
    gemm_ceiling: dict[str, float] = field(default_factory=dict)
    # fraction of peak the fused (flash) attention kernel reaches on its real work, forward +
    # backward (``cost_models.efficiency``); 0 = ``matmul_efficiency``
    attention_efficiency: float = 0.0
    # SMs a running NCCL collective occupies (one CTA per channel; presets: NCCL's MAXCHANNELS 32):
    # compute that overlaps it runs on the others (``cost_models.contention``); 0 = not modelled
    comm_sms: int = 0
    # the flash-attention kernel SDPA runs ("fa2"; "fa3" = FlashAttention-3, Hopper only) and the
    # matmul FLOPs one exponential costs in time (tensor-core peak / special-function peak; 0 = no
    # softmax term): attention efficiency by shape (``cost_models.efficiency.attention_shape_factor``)
    attention_kernel: str = "fa2"
    exp_cost_flops: float = 0.0
    # fraction of the communication the cost model counts as hidden under compute (DP gradient
    # buckets under the last backward, ZeRO/FSDP gathers and reduce-scatters under forward and
    # backward) that the machine really hides; the rest is exposed (1 = as modelled; ``meshplan
    # calibrate`` fits it: e.g. gloo on a CPU host, where the collectives compete for the cores)
    comm_overlap: float = 1.0
    # speed of the backward parts (input and weight gradients) relative to what the roofline and
    # ``backward_factors`` give them (1 = as modelled): eager autograd on a host CPU runs backward
    # slower than its FLOPs say (memory-bound gradient kernels, accumulation, per-op bookkeeping).
    # ``meshplan calibrate`` fits it from the backward : forward ratio a run measures
    backward_speed: float = 1.0
    # the collective library the runtime uses ("nccl": accelerators, the presets; "gloo": a CPU host,
    # ``meshplan profile`` on CPU). On gloo a pipeline send occupies the sending rank for its transfer
    # (the host's cores copy the bytes through the socket; torch's 1F1B waits on each send), where
    # NCCL's copy engines / kernels do not hold the rank's compute (``sends_occupy_rank``)
    comm_backend: str = "nccl"
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # where each figure comes from, by field name ("peak_flops.bf16" for one dtype): "measured: how"
    # or "derived: from what" (``meshplan profile`` fills it for every figure; presets leave it
    # empty: their figures are the datasheet's, named in ``source``). ``derived_figures()`` lists
    # the derived ones for reports.
    provenance: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def bad(field_name: str, why: str) -> ValueError:
            return ValueError(f"ClusterSpec.{field_name}: {why}")

        if not isinstance(self.name, str) or not self.name:
            raise bad("name", f"must be a non-empty string, got {self.name!r}")
        if (
            not isinstance(self.num_devices, int)
            or isinstance(self.num_devices, bool)
            or self.num_devices < 1
        ):
            raise bad("num_devices", f"must be a positive integer, got {self.num_devices!r}")
        if not isinstance(self.devices_per_node, int) or self.devices_per_node < 1:
            raise bad("devices_per_node", f"must be a positive integer, got {self.devices_per_node!r}")
        if self.num_devices > self.devices_per_node and self.num_devices % self.devices_per_node:
            raise bad(
                "num_devices",
                f"{self.num_devices} is not a whole number of nodes of {self.devices_per_node} devices",
            )
        if not isinstance(self.peak_flops, dict) or not self.peak_flops:
            raise bad("peak_flops", f"needs a dict of at least one dtype -> FLOP/s, got {self.peak_flops!r}")
        for dt, v in self.peak_flops.items():
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise bad("peak_flops", f"{dt} must be a positive number, got {v!r}")
        for name in ("mem_bytes", "mem_bw_bytes_per_s", "intra_bw_bytes_per_s", "inter_bw_bytes_per_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise bad(name, f"must be a positive number, got {v!r}")
        for name in ("intra_latency_s", "inter_latency_s", "kernel_floor_s", "mem_reserved_bytes",
                     "op_overhead_s", "bwd_op_overhead_s", "host_op_s", "host_bwd_op_s",
                     "host_checkpoint_fwd_s", "host_checkpoint_bwd_s", "host_optimizer_tensor_s",
                     "host_tp_linear_fwd_s", "host_tp_linear_bwd_s", "host_dtensor_param_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise bad(name, f"must be a non-negative number, got {v!r}")
        for name in ("matmul_efficiency", "mem_efficiency", "comm_efficiency"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v <= 1):
                raise bad(name, f"must be in (0, 1], got {v!r}")
        if not isinstance(self.sm_count, int) or isinstance(self.sm_count, bool) or self.sm_count < 0:
            raise bad("sm_count", f"must be a non-negative integer (0 = unknown), got {self.sm_count!r}")
        if (not isinstance(self.comm_sms, int) or isinstance(self.comm_sms, bool) or self.comm_sms < 0
                or (self.sm_count and self.comm_sms >= self.sm_count)):  # fmt: skip
            raise bad("comm_sms", f"must be an integer in [0, sm_count) (0 = not modelled), got {self.comm_sms!r}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise bad("attention_kernel", f"must be one of {', '.join(ATTENTION_KERNELS)}, got {self.attention_kernel!r}")
        if self.attention_kernel == "fa3" and "fp8" not in self.peak_flops:
            raise bad("attention_kernel", "'fa3' (FlashAttention-3) runs only on Hopper GPUs (FP8 tensor cores in "
                      "peak_flops); use 'fa2'")
        if not (isinstance(self.exp_cost_flops, (int, float)) and self.exp_cost_flops >= 0):
            raise bad("exp_cost_flops", f"must be a number >= 0 (0 = no softmax term), got {self.exp_cost_flops!r}")
        if not (isinstance(self.comm_overlap, (int, float)) and 0 <= self.comm_overlap <= 1):
            raise bad("comm_overlap", f"must be in [0, 1] (1 = hidden communication fully hidden), got {self.comm_overlap!r}")
        if self.comm_backend not in ("nccl", "gloo"):
            raise bad("comm_backend", f"must be 'nccl' or 'gloo', got {self.comm_backend!r}")
        if not (isinstance(self.backward_speed, (int, float)) and self.backward_speed > 0
                and math.isfinite(self.backward_speed)):  # fmt: skip
            raise bad("backward_speed", f"must be a positive number (1 = as modelled), got {self.backward_speed!r}")
        if not (isinstance(self.attention_efficiency, (int, float)) and 0 <= self.attention_efficiency <= 1):
            raise bad("attention_efficiency", f"must be in [0, 1] (0 = matmul_efficiency), got {self.attention_efficiency!r}")
        if self.mem_reserved_bytes >= self.mem_bytes:
            raise bad("mem_reserved_bytes", f"{self.mem_reserved_bytes} leaves no memory of {self.mem_bytes}")
        if not isinstance(self.gemm_ceiling, dict) or any(
                not (isinstance(v, (int, float)) and 0 < v <= 1) for v in self.gemm_ceiling.values()):  # fmt: skip
            raise bad("gemm_ceiling", f"needs a dict of dtype -> fraction of peak in (0, 1], got {self.gemm_ceiling!r}")
        rows = self.matmul_efficiency_by_flops
        if not isinstance(rows, list) or any(
            not isinstance(r, (list, tuple)) or len(r) != 3 or not r[0] > 0 or not all(0 < e <= 1 for e in r[1:])
            for r in rows
        ):
            raise bad("matmul_efficiency_by_flops", f"needs rows [flops > 0, fwd eff, bwd eff in (0, 1]], got {rows!r}")
        if not isinstance(self.extra, dict):
            raise bad("extra", f"must be a dict, got {type(self.extra).__name__}")
        if not isinstance(self.provenance, dict):
            raise bad("provenance", f"must be a dict of figure -> 'measured: ...'/'derived: ...', got {self.provenance!r}")
        for key, how in self.provenance.items():
            if key.partition(".")[0] not in self.__dataclass_fields__:
                raise bad("provenance", f"{key!r} is not a ClusterSpec figure")
            if not isinstance(how, str) or not how.startswith(PROVENANCE_KINDS):
                raise bad("provenance", f"{key}: must start with one of {PROVENANCE_KINDS}, got {how!r}")

    # ---- derived -----------------------------------------------------------------------
    def derived_figures(self) -> dict[str, str]:
        """Figure -> what it was derived from, for the figures a profile did not measure."""
        return {k: v.partition(":")[2].strip() for k, v in self.provenance.items() if v.startswith("derived")}

    @property
    def num_nodes(self) -> int:
        return max(1, math.ceil(self.num_devices / self.devices_per_node))

    def peak(self, dtype: str = "bf16") -> float:
        """Peak FLOP/s per device for ``dtype`` (falls back to fp16/bf16, then the largest)."""
        if dtype in self.peak_flops:
            return float(self.peak_flops[dtype])
        for alt in ("bf16", "fp16"):
            if alt in self.peak_flops and dtype in ("bf16", "fp16"):
                return float(self.peak_flops[alt])
        return float(max(self.peak_flops.values()))

    def gemm_peak(self, dtype: str = "bf16") -> float:
        """FLOP/s a GEMM in ``dtype`` is priced at before ``matmul_efficiency``: ``peak(dtype)`` times the
        measured GEMM ceiling of ``dtype`` over the 16-bit one's (``gemm_ceiling``), so that
        ``matmul_efficiency``, read off 16-bit runs, carries to float8 GEMMs without reading 2x the
        bf16 rate into the datasheet's doubled FP8 peak; ``peak(dtype)`` where either ceiling is unknown."""
        ref = self.gemm_ceiling.get("bf16") or self.gemm_ceiling.get("fp16")
        own = self.gemm_ceiling.get(dtype)
        return self.peak(dtype) * (own / ref if own and ref else 1.0)

    @property
    def usable_mem_bytes(self) -> int:
        return int(self.mem_bytes - self.mem_reserved_bytes)

    def without_host_floor(self) -> ClusterSpec:
        """The same hardware with no host-dispatch floor (``host_op_s`` and its siblings 0): the
        device's time alone, as if the host always kept ahead (CUDA graphs, a compiled step)."""
        return replace(self, host_op_s=0.0, host_bwd_op_s=0.0, host_checkpoint_fwd_s=0.0, host_checkpoint_bwd_s=0.0,
                       host_optimizer_tensor_s=0.0)

    def with_devices(self, num_devices: int) -> ClusterSpec:
        """The same hardware with another device count (whole nodes, or part of one)."""
        return replace(self, num_devices=num_devices)

    # ---- presets and I/O ---------------------------------------------------------------
    @staticmethod
    def preset(name: str, num_nodes: int = 1, devices_per_node: int | None = None) -> ClusterSpec:
        """A published preset: a100-40g, a100-80g, h100, h200, v100 (``num_nodes`` nodes)."""
        key = name.lower()
        if key not in PRESETS:
            raise ValueError(
                f"unknown cluster preset {name!r}; choose one of {sorted(PRESETS)}, local (this machine) or a profile "
                "JSON path"
            )
        if not isinstance(num_nodes, int) or num_nodes < 1:
            raise ValueError(f"ClusterSpec.num_nodes: must be a positive integer, got {num_nodes!r}")
        return PRESETS[key](num_nodes, devices_per_node)

    @property
    def sends_occupy_rank(self) -> bool:
        """Whether a pipeline send holds its sending rank for the transfer time (gloo on a CPU host:
        ``comm_backend``, ``sends_occupy``); the schedule simulator then counts it in the sender's action."""
        return sends_occupy(self.comm_backend)

    def contended(self, share: float) -> ClusterSpec:
        """This CPU host when each rank's process gets only ``share`` (in (0, 1]) of a core, the rest
        held by other processes: every rate (peak FLOP/s, memory and link bandwidth) times ``share``,
        every fixed time (collective latency, per-op host time, kernel floor) over it. A uniform
        stretch of every rank's timeline: on a CPU host the compute, gloo's copies and reductions and
        the wake-up that ends a wait for a peer all run on the same cores. ``share`` is measured per
        run (``api.calibration.measured_core_share``: the ranks' CPU seconds against the wall time),
        an input and never a fitted term; only a gloo (CPU) cluster takes it."""
        if self.comm_backend != "gloo":
            raise ValueError(f"ClusterSpec.contended: a core share prices a CPU host (comm_backend 'gloo'); "
                             f"{self.name} runs {self.comm_backend}")
        if not (isinstance(share, (int, float)) and 0 < share <= 1):
            raise ValueError(f"ClusterSpec.contended: share must be in (0, 1], got {share!r}")
        if share == 1:
            return self
        s = float(share)
        return replace(
            self,
            peak_flops={k: v * s for k, v in self.peak_flops.items()},
            mem_bw_bytes_per_s=self.mem_bw_bytes_per_s * s,
            intra_bw_bytes_per_s=self.intra_bw_bytes_per_s * s,
            inter_bw_bytes_per_s=self.inter_bw_bytes_per_s * s,
            intra_latency_s=self.intra_latency_s / s,
            inter_latency_s=self.inter_latency_s / s,
            op_overhead_s=self.op_overhead_s / s,
            bwd_op_overhead_s=self.bwd_op_overhead_s / s,
            host_op_s=self.host_op_s / s,
            host_bwd_op_s=self.host_bwd_op_s / s,
            host_checkpoint_fwd_s=self.host_checkpoint_fwd_s / s,
            host_checkpoint_bwd_s=self.host_checkpoint_bwd_s / s,
            host_optimizer_tensor_s=self.host_optimizer_tensor_s / s,
            host_tp_linear_fwd_s=self.host_tp_linear_fwd_s / s,
            host_tp_linear_bwd_s=self.host_tp_linear_bwd_s / s,
            host_dtensor_param_s=self.host_dtensor_param_s / s,
            kernel_floor_s=self.kernel_floor_s / s,
            extra={**self.extra, "core_share": s},
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ClusterSpec:
        if not isinstance(d, dict):
            raise ValueError(f"ClusterSpec: expected a JSON object, got {type(d).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"ClusterSpec: unknown fields {sorted(unknown)}")
        missing = {
            f.name
            for f in cls.__dataclass_fields__.values()
            if f.name not in d and f.default is f.default_factory  # type: ignore[misc]
        }
        missing = {m for m in missing if m not in ("extra",)}
        if missing:
            raise ValueError(f"ClusterSpec: missing fields {sorted(missing)}")
        peak = d["peak_flops"]
        if not isinstance(peak, dict):
            raise ValueError(f"ClusterSpec.peak_flops: must be an object of dtype -> FLOP/s, got {peak!r}")
        if "comm_backend" not in d and record_backend(d) == "gloo":  # profiles before the field
            d = {**d, "comm_backend": "gloo"}
        return cls(**{**d, "peak_flops": dict(peak), "extra": dict(d.get("extra") or {}),
                      "provenance": dict(d.get("provenance") or {})})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, s: str) -> ClusterSpec:
        return cls.from_dict(json.loads(s))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ClusterSpec:
        """A ClusterSpec from a JSON file (a saved preset or a ``meshplan profile`` output)."""
        try:
            return cls.from_json(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"cluster profile {str(path)!r} is not valid JSON: {e}") from e


#: CUDA context + cuBLAS/cuBLASLt workspaces per process: about 0.5 GiB on A100/H100 with lazy
#: module loading (PyTorch "CUDA semantics" notes; CUDA_MODULE_LOADING=LAZY default since 11.7)
CUDA_CONTEXT_BYTES = GiB // 2
#: NCCL communicator buffers: NCCL_BUFFSIZE (4 MiB) per channel, direction and peer, a few
#: channels per ring/tree and 3-4 communicators (tp, dp, pp, world): about 0.5 GiB (NCCL env docs)
NCCL_BUFFER_BYTES = GiB // 2
#: caching-allocator fragmentation (reserved minus allocated at peak) as a fraction of device
#: memory: Megatron-LM logs max reserved 3-8 % above max allocated; 3 % is taken (with
#: expandable segments, torchtitan's default, it is lower)
FRAGMENTATION_FRACTION = 0.03


def record_backend(record: dict[str, Any]) -> str:
    """The collective backend a cluster record names (``ClusterSpec.to_dict``, a plan's ``cluster``):
    ``comm_backend``, or ``extra["backend"]`` in profiles written before that field, else "nccl" (the
    field's default; hand-made and partial records)."""
    return record.get("comm_backend") or (record.get("extra") or {}).get("backend") or "nccl"


def sends_occupy(backend: str) -> bool:
    """Whether a pipeline send holds its sending rank for its transfer under ``backend`` (gloo: the
    host's cores copy the bytes; NCCL's copy engines do not hold the rank's compute)."""
    return backend == "gloo"


def default_reserved_bytes(mem_bytes: int) -> int:
    """Memory a training process on a device of ``mem_bytes`` cannot use for tensors::

        CUDA_CONTEXT_BYTES + NCCL_BUFFER_BYTES + FRAGMENTATION_FRACTION · mem_bytes

    (3.2 GiB on an 80 GB device). Unit: bytes. Sources in the constants' comments.
    """
    return int(CUDA_CONTEXT_BYTES + NCCL_BUFFER_BYTES + FRAGMENTATION_FRACTION * mem_bytes)


def preset_for_gpu_name(name: str) -> str | None:
    """Preset name for a GPU name ("NVIDIA H100 80GB HBM3" -> "h100",
    "A100-SXM4-40GB" -> "a100-40g"), or None when no preset matches."""
    n = name.upper().replace(" ", "")
    if "H200" in n:
        return "h200"
    if "H100" in n:
        return "h100"
    if "A100" in n:
        return "a100-40g" if "40GB" in n else "a100-80g"
    if "V100" in n:
        return "v100"
    return None


def resolve_cluster(cluster: str | ClusterSpec | Path, world_size: int) -> ClusterSpec:
    """A ClusterSpec with ``world_size`` devices from a preset name, a profile path or a spec.

    A preset gets as many nodes as ``world_size`` needs (a partial node when world_size is
    smaller than one node); a profile or spec keeps its per-device figures.
    """
    if isinstance(cluster, ClusterSpec):
        spec = cluster
    elif isinstance(cluster, Path) or str(cluster).endswith(".json"):
        p = Path(cluster)
        if not p.exists():
            raise ValueError(f"cluster profile {str(p)!r} does not exist")
        spec = ClusterSpec.load(p)
    else:
        spec = ClusterSpec.preset(str(cluster))
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if world_size > spec.devices_per_node and world_size % spec.devices_per_node:
        raise ValueError(
            f"world_size {world_size} is not a whole number of {spec.name} nodes of {spec.devices_per_node} devices"
        )
    return spec.with_devices(world_size)


#: Device memory a CUDA process can allocate from, per preset: ``torch.cuda.get_device_properties(i).total_memory``,
#: what every OOM message calls "total capacity". A datasheet's "80GB" is binary (80 GiB of HBM) less what the
#: driver and ECC keep, not 80·10⁹ bytes: reading it as decimal hid ~4.6 GiB of every 80 GB GPU from the plans.
#: h100 / h200 MEASURED on the GPUs lent to this project (benchmarks/gpu_results/2026-11-27-h100, -h200:
#: ``meshplan profile``'s mem_bytes); a100-40g / a100-80g / v100: the capacities PyTorch's OOM messages print on
#: those GPUs ("39.59 GiB", "79.15 GiB", "31.75 GiB total capacity"), not measured here.
VISIBLE_MEM_BYTES = {
    "a100-40g": int(39.59 * GiB),
    "a100-80g": int(79.15 * GiB),
    "h100": 85_017_493_504,  # 79.18 GiB, H100 80GB HBM3
    "h200": 150_109_880_320,  # 139.80 GiB, H200 (141 GB datasheet)
    "v100": int(31.75 * GiB),
}
#: the datasheet's memory size per preset (its marketing "GB"), which published cases quote (``mem_gb``)
DATASHEET_MEM_GB = {"a100-40g": 40, "a100-80g": 80, "h100": 80, "h200": 141, "v100": 32}


def visible_mem_bytes(preset: str, datasheet_gb: float | None = None) -> int:
    """Allocatable bytes of ``preset``'s GPU (``VISIBLE_MEM_BYTES``); for a variant of another datasheet size
    (an H100 94 GB or 96 GB, a V100 16 GB), that size at the preset's visible fraction of its own."""
    base = VISIBLE_MEM_BYTES[preset]
    if datasheet_gb is None or datasheet_gb == DATASHEET_MEM_GB[preset]:
        return base
    return int(base * datasheet_gb / DATASHEET_MEM_GB[preset])


def _make(
    name: str,
    *,
    tflops_bf16: float,
    tflops_fp32: float,
    hbm_tb_s: float,
    nvlink_bidir_gb_s: float,
    ib_gb_s: float,
    per_node: int,
    source: str,
    sm_count: int,
    matmul_efficiency: float = 0.75,
    tflops_fp8: float | None = None,
    attention_efficiency: float = 0.0,
    comm_sms: int = 0,
    exp_cost_flops: float = 0.0,
    gemm_ceiling: dict[str, float] | None = None,
):
    mem = visible_mem_bytes(name)  # its datasheet size is DATASHEET_MEM_GB[name]

    def build(num_nodes: int, devices_per_node: int | None = None) -> ClusterSpec:
        dpn = devices_per_node or per_node
        return ClusterSpec(
            name=name,
            num_devices=num_nodes * dpn,
            devices_per_node=dpn,
            peak_flops={"bf16": tflops_bf16 * 1e12, "fp16": tflops_bf16 * 1e12, "fp32": tflops_fp32 * 1e12,
                        **({"fp8": tflops_fp8 * 1e12} if tflops_fp8 else {})},
            mem_bytes=mem,
            mem_reserved_bytes=default_reserved_bytes(mem),
            mem_bw_bytes_per_s=hbm_tb_s * 1e12,
            intra_bw_bytes_per_s=nvlink_bidir_gb_s / 2 * GB,
            intra_latency_s=5e-6,
            inter_bw_bytes_per_s=ib_gb_s * GB,
            inter_latency_s=1e-5,
            matmul_efficiency=matmul_efficiency,
            sm_count=sm_count,
            gemm_ceiling=dict(gemm_ceiling or {}),
            attention_efficiency=attention_efficiency,
            comm_sms=comm_sms,
            exp_cost_flops=exp_cost_flops,
            source=source,
            **HOST_H200,
        )

    return build


# The host-dispatch floor's figures (ClusterSpec.host_op_s and its siblings, cost_models.host): a
# property of the host CPU, Python and torch build, not of the GPU. No public source gives them for a
# training host (public write-ups put eager PyTorch's CPU-side work at ~5-25 us per op, e.g. the
# dispatch-chain breakdowns of the Python binding, autograd, dispatcher and launch), so every GPU
# preset carries the one host measured so far (an H100/A100 node's host is the same class of x86
# server CPU running the same Python and torch), and a measured profile carries its own host's
# (``meshplan profile`` on a GPU); ``ClusterSpec.without_host_floor()`` prices the device alone.
# These were MEASURED: benchmarks/host_overhead.py on the host of one H200 (torch 2.11, Python 3.12,
# 16 cores, load 0.2; the lead's gpu_check, 2026-11-27; tests/data/host_overhead_h200.json), read by
# profile.host.host_figures: 8.1 us per op issued from Python (2000 autograd-recording multiplications
# without a sync), 15.2 us per op the autograd engine dispatches (a gpt2-xl-width zoo block's
# backward at 1 x 16 tokens, 1.69 ms for 111 ops + views), and torch's checkpoint wrapper 0.44 ms
# per block in forward and 1.02 ms in backward beyond the ops it re-runs, and 8.3 us per parameter
# tensor of the optimizer phase (fused AdamW step 2.063 ms + foreach clipping 4.354 ms over 772 tensors).
# Not fitted to any run.
HOST_H200 = {"host_op_s": 8.124e-6, "host_bwd_op_s": 1.6922e-3 / 111.25,
             "host_checkpoint_fwd_s": 0.9577e-3 - 0.5133e-3,
             "host_checkpoint_bwd_s": 3.4916e-3 - 1.6922e-3 - (207.25 - 111.25) * 8.124e-6,
             "host_optimizer_tensor_s": (2.063e-3 + 4.354e-3) / 772}

# matmul_efficiency per preset: the fraction of dense peak the training step's large GEMMs reach,
# read off the published runs of each GPU family (benchmarks/published_cases.py, BENCHMARKS.md
# "Published runs") once the work the GEMMs do not do is priced separately. Session 4 re-derived it
# after pricing Megatron-LM's attention without a flash kernel (cost_models/eager_ops.py: its
# materialized s x s scores are 25-40 % of a 2020/2021 Megatron step at h <= 3072), which the
# earlier A100 figure had absorbed: before, Megatron-LM fp16 rows implied 0.55 and the FSDP rows
# (MPT, torchtitan) 0.70 on the same A100, so 0.60 was taken; with the attention priced both imply
# 0.66 (SC'21 1.7B..1T within -7..+4 %, MPT/torchtitan A100 within -14..+5 %). V100 (DGX-2H, Megatron
# 2020 only) 0.65 -> 0.74 by the same reading. H100 0.55 (MPT 700 W, torchtitan 500 W at its derived
# clock) is unchanged: its rows are centred. Against the measured GEMM ceiling (Bekman, ml-engineering
# "Maximum Achievable Matmul FLOPS": A100 SXM 267.9 of 312 = 0.86, H100 SXM 792.1 of 989 = 0.80) the
# step reaches 0.77 (A100) and 0.69 (H100) of it: the H100 step loses more than its GEMM ceiling
# says, which no mechanism here prices yet. H200 shares H100's compute, so its value.
# Wave 3 stop 5 refit them by the leave-one-group-out rule (benchmarks/published_logo.py: per family,
# the value at which the median signed log error of its runs is 0, over all 88 time-comparable
# runs, to two decimals) once a tied LM head's weight-gradient GEMM was priced
# (GraphNode.trains_weight): on main 2a34e4d the rule gives a100 0.678, h100 0.554, v100 0.772
# (without the fix, on 4b9c03d's 82 runs: 0.673, 0.554, 0.765; the shipped 0.66 / 0.55 / 0.74 were
# the hand reading above).
# Wave 3 stop 9 applied the same rule again once later stops had moved the H100 runs (stop 8's
# closing note: with its fp8 mechanisms, fp8 GEMMs at their measured ceiling): on main a10be65 over
# all 102 time-comparable runs it gives a100 0.6755 (52 runs), h100 0.5901 (46), v100 0.7788 (4), so
# h100 (and h200, which shares its compute) 0.55 -> 0.59 and v100 0.77 -> 0.78; a100 stays 0.68.
# Against Bekman's GEMM ceiling above, the H100 step now reaches 0.74 of it (A100 0.79).
# Later in stop 9, once autograd's own gradient accumulation across microbatches was priced
# (cost_models/grad_accum.py, 448aede: memory-bound time the A100 Megatron-LM 2020/2021 and
# Megatron-DeepSpeed 2021 rows had absorbed), the rule on main 25f5030 gives a100 0.686, h100 0.590,
# v100 0.779: a100 0.68 -> 0.69 (Bekman's ceiling: 0.80 of it).
_MATMUL_EFF = {"a100-40g": 0.69, "a100-80g": 0.69, "h100": 0.59, "h200": 0.59, "v100": 0.78}


# attention_efficiency: what the flash-attention kernel PyTorch's SDPA runs (FlashAttention-2)
# reaches of dense peak on its real (causal-skipped) work, read at efficiency.ATTENTION_REF_SHAPE
# (head dim 128, causal, seq 2k; the shape factor carries it to other shapes). A100: Dao 2023
# (FlashAttention-2) fig. "attention forward + backward speed on A100", causal, head dim 128, seq 2k:
# ~165 of 312 TFLOP/s (the abstract's range is 50-73 %); H100: Shah et al. 2024 (FlashAttention-3)
# fig. 5 "attention forward speed, with causal mask, head dim 128 (H100 80GB SXM5)", FlashAttention-2
# at seq 2k: 298 of 989 TFLOP/s = 0.30 (its backward, fig. 6, head dim 128 at 2k: 291, 0.29, without
# the mask). The abstract's "FlashAttention-2 achieves only 35% utilization on H100", read here until
# Wave 3 stop 5, is its long-sequence figure (16k causal 335, 0.34; unmasked up to 370, 0.37), which the
# shape factor reaches from 0.30 on its own (x1.10 at 16k causal): reading 0.35 at 2k counted that
# rise twice. H200 shares H100's SMs. V100 has no FlashAttention-2 kernel: its attention stays at
# matmul_efficiency.
FA2_A100 = 0.53
FA2_H100 = 0.30
# cuDNN's fused attention (Transformer Engine's FusedAttention, "F16_arbitrary_seqlen"), what TE runs
# on Hopper (engine_profiles: attention_backend "cudnn"): Shah et al. 2024 (FlashAttention-3) fig. 5,
# cuDNN forward with causal mask, head dim 128, seq 2k on H100 80GB SXM5: 484 of 989 TFLOP/s (its
# backward, fig. 6, 465 at 2k unmasked); read at the same reference shape as FA2_H100.
CUDNN_ATTN_H100 = 0.49
#: the attention kernels ClusterSpec.attention_kernel names (efficiency.attention_shape_factor)
ATTENTION_KERNELS = ("fa2", "fa3", "cudnn")


def with_attention_backend(spec: ClusterSpec, backend: str) -> ClusterSpec:
    """``spec`` as an engine running its attention on ``backend`` ("flash": the spec's own kernel;
    "cudnn": cuDNN's fused attention on a Hopper GPU (FP8 tensor cores in ``peak_flops``) whose spec
    prices FlashAttention-2, at ``CUDNN_ATTN_H100``; anything else unchanged: other GPUs keep the
    spec's kernel, and a spec that already names another kernel or no attention efficiency keeps
    it)."""
    if backend not in ("flash", "cudnn"):
        raise ValueError(f"attention backend must be 'flash' or 'cudnn', got {backend!r}")
    if (backend == "flash" or "fp8" not in spec.peak_flops or spec.attention_kernel != "fa2"
            or not spec.attention_efficiency):  # fmt: skip
        return spec
    return replace(spec, attention_kernel="cudnn", attention_efficiency=CUDNN_ATTN_H100)
# exp_cost_flops: tensor-core FLOP/s over special-function (exp) op/s. H100: 989 TFLOP/s vs 3.9
# TFLOP/s of special functions (Shah et al. 2024, FlashAttention-3 §3.1) = 253.6; A100: 312 TFLOP/s
# vs 16 exp/clock/SM (CUDA C++ Programming Guide, arithmetic instruction throughput, cc 8.0) x 108
# SMs x 1.41 GHz = 2.44 T/s -> 128. V100 runs no flash kernel: 0.
EXP_COST_H100 = 989 / 3.9
EXP_COST_A100 = 312e12 / (16 * 108 * 1.41e9)

# comm_sms: the CTAs (one SM each) a bandwidth-bound NCCL collective runs on (cost_models/
# contention.py): NCCL's channel search settles on "24 coll channels" on 8-GPU NVSwitch nodes of
# A100 SXM4 and H100 (NCCL_DEBUG=INFO init lines, e.g. AWS p5.48xlarge = 8x H100 and DGX/HGX
# A100), under its cap MAXCHANNELS = 32 (src/include/device.h). V100: no published log found, 0
# (not modelled). NCCL_MAX_CTAS or a profile sets another.
NCCL_MAX_CHANNELS = 32
NCCL_NVSWITCH_COLL_CHANNELS = 24

PRESETS = {
    "a100-40g": _make(
        "a100-40g",
        comm_sms=NCCL_NVSWITCH_COLL_CHANNELS,
        exp_cost_flops=EXP_COST_A100,
        sm_count=108,
        attention_efficiency=FA2_A100,
        matmul_efficiency=_MATMUL_EFF["a100-40g"],
        tflops_bf16=312,
        tflops_fp32=19.5,
        hbm_tb_s=1.555,
        nvlink_bidir_gb_s=600,
        ib_gb_s=25,
        per_node=8,
        source="NVIDIA A100 datasheet (SXM4 40GB); DGX A100 8x HDR 200Gb/s (FORMULAS.md)",
    ),
    "a100-80g": _make(
        "a100-80g",
        comm_sms=NCCL_NVSWITCH_COLL_CHANNELS,
        exp_cost_flops=EXP_COST_A100,
        sm_count=108,
        attention_efficiency=FA2_A100,
        matmul_efficiency=_MATMUL_EFF["a100-80g"],
        tflops_bf16=312,
        tflops_fp32=19.5,
        hbm_tb_s=2.039,
        nvlink_bidir_gb_s=600,
        ib_gb_s=25,
        per_node=8,
        source="NVIDIA A100 datasheet (SXM4 80GB); DGX A100 8x HDR 200Gb/s (FORMULAS.md)",
    ),
    "h100": _make(
        "h100",
        comm_sms=NCCL_NVSWITCH_COLL_CHANNELS,
        exp_cost_flops=EXP_COST_H100,
        sm_count=132,
        attention_efficiency=FA2_H100,
        tflops_fp8=1979,  # dense FP8 tensor-core peak (datasheet; 3,958 is with sparsity)
        gemm_ceiling=GEMM_CEILING_H100,
        matmul_efficiency=_MATMUL_EFF["h100"],
        tflops_bf16=989,
        tflops_fp32=67,
        hbm_tb_s=3.35,
        nvlink_bidir_gb_s=900,
        ib_gb_s=50,
        per_node=8,
        source="NVIDIA H100 datasheet (SXM5 80GB); DGX H100 8x NDR 400Gb/s (FORMULAS.md)",
    ),
    "h200": _make(
        "h200",
        comm_sms=NCCL_NVSWITCH_COLL_CHANNELS,
        exp_cost_flops=EXP_COST_H100,
        sm_count=132,
        attention_efficiency=FA2_H100,
        tflops_fp8=1979,  # dense FP8 tensor-core peak (datasheet; 3,958 is with sparsity)
        gemm_ceiling=GEMM_CEILING_H100,
        matmul_efficiency=_MATMUL_EFF["h200"],
        tflops_bf16=989,
        tflops_fp32=67,
        hbm_tb_s=4.8,
        nvlink_bidir_gb_s=900,
        ib_gb_s=50,
        per_node=8,
        source="NVIDIA H200 datasheet (SXM 141GB); 8x NDR 400Gb/s per node (FORMULAS.md)",
    ),
    "v100": _make(
        "v100",
        sm_count=80,
        matmul_efficiency=_MATMUL_EFF["v100"],
        tflops_bf16=125,
        tflops_fp32=15.7,
        hbm_tb_s=0.9,
        nvlink_bidir_gb_s=300,
        ib_gb_s=6.25,
        per_node=8,
        source="NVIDIA V100 datasheet (SXM2 32GB, FP16 tensor core); DGX-1 4x EDR 100Gb/s "
        "(12.5 GB/s each) shared by 8 GPUs = 6.25 GB/s per GPU (FORMULAS.md)",
    ),
}
