"""Where each figure of a measured profile comes from: ``ClusterSpec.provenance`` entries.

Every figure field of the ClusterSpec ``meshplan profile`` writes gets an entry, "measured: how"
or "derived: from what" (``profile_provenance``; the links come from ``collective_provenance`` or
``profile.links``), and ``provenance_lines`` prints them for ``meshplan profile`` and
``--cluster local``. No torch import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from meshplan.cost_models.hardware import ClusterSpec

#: the ClusterSpec fields that are figures (what ``provenance`` covers); ``peak_flops`` per dtype
FIGURES = (
    "mem_bytes", "mem_bw_bytes_per_s", "intra_bw_bytes_per_s", "intra_latency_s", "inter_bw_bytes_per_s",
    "inter_latency_s", "matmul_efficiency", "mem_efficiency", "comm_efficiency", "kernel_floor_s",
    "mem_reserved_bytes", "op_overhead_s", "bwd_op_overhead_s", "matmul_efficiency_by_flops", "sm_count",
    "attention_efficiency", "comm_sms", "attention_kernel", "exp_cost_flops", "comm_overlap",
    "backward_speed", "host_op_s", "host_bwd_op_s", "host_checkpoint_fwd_s", "host_checkpoint_bwd_s",
    "host_optimizer_tensor_s", "host_tp_linear_fwd_s", "host_tp_linear_bwd_s", "host_dtensor_param_s",
)  # fmt: skip

_DEFAULT = "derived: the ClusterSpec default (not modelled on a measured profile)"


def collective_provenance(backend: str, nproc: int, min_bytes: int, max_bytes: int) -> dict[str, str]:
    """Provenance of the link figures fitted to collectives measured across ``nproc`` processes."""
    how = (f"measured: all_reduce across {nproc} processes ({backend}, one host), {min_bytes}-{max_bytes} B, "
           "alpha-beta fit")  # fmt: skip
    same = "derived: equal to the intra-node figure (one machine: no link between nodes to measure)"
    return {"intra_latency_s": how, "intra_bw_bytes_per_s": how, "inter_latency_s": same, "inter_bw_bytes_per_s": same}


def tp_host_provenance() -> dict[str, str]:
    """Provenance of the DTensor host figures measured on a gloo rank pair (``profile.tp_host``)."""
    how = ("measured: torch's ColwiseParallel / RowwiseParallel Megatron pairs against plain linears of the local "
           "shape on two gloo processes, less the collectives they ran at one small all-reduce each (profile.tp_host)")
    return {"host_tp_linear_fwd_s": how + ", forward, per sharded linear",
            "host_tp_linear_bwd_s": how + ", backward, per sharded linear",
            "host_dtensor_param_s": ("measured: AdamW (foreach=False) step + gradient-norm clipping over those DTensor "
                                     "parameters less over plain ones, per tensor (profile.tp_host)")}


def profile_provenance(
    device_type: str, nproc: int, matmul_sizes: Mapping[str, Sequence[int]], mem_test_bytes: int,
    eager_shapes: Sequence[tuple[int, int]],
) -> dict[str, str]:
    """Provenance of every figure but the links (see ``collective_provenance`` / ``profile.links``)."""
    out = {f"peak_flops.{dt}": f"measured: best n x n matmul in {dt}, n in {list(sizes)}"
           for dt, sizes in matmul_sizes.items()}  # fmt: skip
    out.update({
        "mem_bytes": ("measured: the device's total memory (torch.cuda.get_device_properties)" if device_type == "cuda"
                      else f"derived: host memory (sysconf) / {nproc} process(es) sharing it"),
        "mem_bw_bytes_per_s": f"measured: best copy of {mem_test_bytes} B (one read + one write per byte)",
        "kernel_floor_s": "measured: best time of a one-element add",
        "op_overhead_s": ("measured: a chain of tiny nn.Linear modules, forward, per module less the kernel floor"
                          if device_type != "cuda" else "derived: 0 on a GPU, whose host runs beside the device "
                          "(host_op_s prices it as a floor)"),
        "bwd_op_overhead_s": ("measured: the same chain's backward, per module and backward part, less the kernel "
                              "floor" if device_type != "cuda" else "derived: 0 on a GPU (host_op_s)"),
        **{f: (f"measured: {how} (profile.host.host_figures)" if device_type == "cuda"
               else "derived: 0 on a CPU, where host and device are the same cores (op_overhead_s adds it)")
           for f, how in (("host_op_s", "host time per op of 2000 tiny autograd-recording multiplications "
                                        "launched without a sync"),
                          ("host_bwd_op_s", "a gpt2-xl-width zoo block's backward host time per dispatched op "
                                            "(1 x 16 tokens)"),
                          ("host_checkpoint_fwd_s", "the same block's forward host time under checkpoint_wrapper, "
                                                    "less without"),
                          ("host_checkpoint_bwd_s", "its backward's, less without, less the extra ops at "
                                                    "host_op_s"),
                          ("host_optimizer_tensor_s", "fused AdamW step + foreach gradient-norm clipping host time "
                                                      "over 772 tiny tensors, per tensor"))},
        "matmul_efficiency_by_flops": f"measured: eager nn.Linear chains {[list(s) for s in eager_shapes]} (fp32) "
                                      "against the fp32 peak",
        "matmul_efficiency": "derived: 1.0, the measured peaks already are what kernels reach here",
        "mem_efficiency": "derived: 1.0, the measured copy bandwidth already is what kernels reach here",
        "comm_efficiency": "derived: 1.0, the link figures already are effective rates",
        "mem_reserved_bytes": ("derived: CUDA context + NCCL buffers + 3% fragmentation, as the presets "
                               "(cost_models.hardware.default_reserved_bytes)" if device_type == "cuda"
                               else "derived: 0, no allocator reserve modelled on a CPU"),
        "sm_count": ("measured: the device's multiprocessor count" if device_type == "cuda"
                     else "derived: 0, a CPU has no SM grid (no tile/wave shape factor)"),
    })  # fmt: skip
    for f in ("attention_efficiency", "comm_sms", "attention_kernel", "exp_cost_flops", "comm_overlap", "backward_speed"):
        out[f] = _DEFAULT
    for f in ("host_tp_linear_fwd_s", "host_tp_linear_bwd_s", "host_dtensor_param_s"):  # tp_host_provenance on gloo
        out[f] = ("derived: 0, measured only on a CPU across gloo processes (profile.tp_host); a GPU's host runs "
                  "beside the device" if device_type == "cuda" else "derived: 0, one process: no rank pair to measure")
    return out


def _value(spec: ClusterSpec, key: str) -> str:
    field, _, dt = key.partition(".")
    v = spec.peak_flops.get(dt) if dt else getattr(spec, field)
    if isinstance(v, list):
        return f"{len(v)} rows"
    if isinstance(v, str):
        return v
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if field == "peak_flops" or field == "exp_cost_flops":
            return f"{v / 1e9:.3g} GFLOP/s" if field == "peak_flops" else f"{v:.3g}"
        if field.endswith("_bytes"):
            return f"{v / 2**30:.2f} GiB"
        if field.endswith("bytes_per_s"):
            return f"{v / 1e9:.3g} GB/s"
        if field.endswith("_s"):
            return f"{v * 1e6:.1f} us"
        return f"{v:g}"
    return repr(v)


def provenance_lines(spec: ClusterSpec, *, derived_only: bool = False) -> list[str]:
    """One line per figure with a provenance entry: ``  MEASURED|DERIVED  figure = value  (how)``,
    the measured ones first."""
    lines = []
    for key, how in sorted(spec.provenance.items(), key=lambda kv: not kv[1].startswith("measured")):
        kind, _, what = how.partition(":")
        if derived_only and kind != "derived":
            continue
        lines.append(f"  {kind.upper():8s} {key} = {_value(spec, key)}  ({what.strip()})")
    return lines


def missing_provenance(spec: ClusterSpec) -> list[str]:
    """Figures of ``spec`` without a provenance entry (empty for a complete profile)."""
    keys = [*(f"peak_flops.{dt}" for dt in spec.peak_flops), *FIGURES]
    return [k for k in keys if k not in spec.provenance]
