"""Compute time of graph nodes on a ClusterSpec: a roofline with a per-kernel floor.

Owns ``roofline_time_s`` (one kernel), ``backward_factors`` (backward split into the input-gradient
part B and the weight-gradient part W, per node kind, so zero-bubble schedules can be costed) and
``node_time`` (one GraphNode at a tensor-parallel shard and a microbatch size).

Model (Williams, Waterman & Patterson, "Roofline", CACM 2009)::

    t = max( FLOPs / (peak(dtype) · matmul_efficiency),
             bytes / (mem_bw · mem_efficiency),
             kernel_floor_s )

Matmul-like kinds (linear, matmul, attention) run on the tensor cores at ``peak(dtype)``; every
other kind runs on the vector units, taken as ``peak("fp32")``. The efficiencies and the floor are
ClusterSpec fields, so a measured profile calibrates them.

Eager calibration (fields a ``meshplan profile`` fills; presets leave them empty, so GPU costing
is unchanged): ``matmul_efficiency_by_flops`` replaces the flat ``matmul_efficiency`` of a GEMM by
one interpolated at its size, separately for forward and backward (small GEMMs reach far less of
the peak than big ones); ``op_overhead_s`` / ``bwd_op_overhead_s`` add eager PyTorch's per-op
dispatch and autograd cost to every op's forward and to each non-zero backward part (views
included: they are free on the device but not on the host). No torch import.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Concatenate, ParamSpec

from meshplan.cost_models.eager_ops import (
    ATTENTION_IMPLS,
    NORM_KERNELS,
    eager_rmsnorm_s,
    is_python_rmsnorm,
    norm_numel,
    unfused_attention_s,
)
from meshplan.cost_models.efficiency import (
    ATTENTION_REF_SHAPE,
    FP8_TILE_K,
    attention_shape_factor,
    attention_wave_factor,
    causal_work_fraction,
    fp8_k_factor,
    gemm_shape_factor,
    grouped_gemm_factor,
    linear_factors,
    linear_gemm_dims,
)
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.cost_models.moe_kernels import moe_kernels
from meshplan.cost_models.precision import (
    DEFAULT_FP8_RECIPE,
    activation_dtype,
    fp8_cast_bytes,
    fp8_eligible,
    fp8_moe_cast_bytes,
)
from meshplan.cost_models.precision import fp8_recipe as fp8_recipe_of
from meshplan.graph import NODE_KINDS, GraphNode

#: Kinds that run as GEMMs on the tensor cores.
MATMUL_KINDS = frozenset({"linear", "matmul", "attention", "moe"})
#: Kinds that cost nothing (no kernel: placeholders, views, buffers).
FREE_KINDS = frozenset({"input", "output", "constant", "reshape"})
#: Kinds whose weights are split by tensor parallelism (so ``shard`` divides their parameter bytes).
SHARDED_WEIGHT_KINDS = frozenset({"linear", "embedding", "matmul"})

# Backward time as multiples of forward time: (input gradient B, weight gradient W).
# linear/matmul: dX = dY·Wᵀ and dW = Xᵀ·dY are each one GEMM the size of the forward
#   (FORMULAS.md "Backward costs about 2× forward"; Qi et al. 2023 split them as B and W).
# attention (no weights; the flash kernel: a kernel without flash is priced by eager_ops): the
#   forward runs two GEMMs (S = QKᵀ, O = PV), the backward five of the same size (S recomputed,
#   dV = Pᵀ·dO, dP = dO·Vᵀ, dQ = dS·K, dK = dSᵀ·Q): 2.5× forward, the FLOP count FlashAttention-2
#   (Dao 2023, §4.1 benchmarks) and FlashAttention-3 report their speeds in, so the efficiencies
#   read from them (hardware.FA2_A100, FA2_H100) apply to it; W = 0.
# norm: memory bound; dX reads x, dY and the saved statistics (≈ 1.5× forward), dγ/dβ is a
#   reduction over the tokens (≈ 0.5× forward).
# activation / elementwise / loss: one memory-bound pass over the same tensors (≈ 1× forward).
# embedding: no gradient w.r.t. integer ids (B = 0); W is a scatter-add the size of the output.
_BACKWARD_FACTORS: dict[str, tuple[float, float]] = {
    "linear": (1.0, 1.0),
    "matmul": (1.0, 1.0),
    "moe": (1.0, 1.0),  # the router and the expert MLPs are GEMMs: dX and dW one forward each
    "attention": (2.5, 0.0),
    "norm": (1.5, 0.5),
    "activation": (1.0, 0.0),
    "elementwise": (1.0, 0.0),
    "loss": (1.0, 0.0),
    "embedding": (0.0, 1.0),
    "other": (1.0, 1.0),
    "input": (0.0, 0.0),
    "output": (0.0, 0.0),
    "constant": (0.0, 0.0),
    "reshape": (0.0, 0.0),
}

DTYPE_BYTES = {
    "float64": 8, "fp64": 8, "float32": 4, "fp32": 4, "tf32": 4, "float16": 2, "fp16": 2,
    "bfloat16": 2, "bf16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1,
}  # fmt: skip


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a floating dtype name (torch or short spelling: "bfloat16", "bf16")."""
    key = dtype.replace("torch.", "")
    if key not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} unknown; use one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


def elem_scale(traced_dtype: str | None, dtype: str) -> float:
    """Bytes of ``dtype`` over bytes of ``traced_dtype`` for float tensors (0.5 for an fp32 trace
    costed in bf16); 1.0 when either is not a float dtype (int64 ids, unknown)."""
    key = (traced_dtype or "").replace("torch.", "")
    if key not in DTYPE_BYTES or dtype not in DTYPE_BYTES:
        return 1.0
    return DTYPE_BYTES[dtype] / DTYPE_BYTES[key]


P = ParamSpec("P")


@dataclass(frozen=True)
class NodeTime:
    """Seconds for one node on one device: forward, backward input-grad (B), backward weight-grad (W)."""

    fwd_s: float
    bwd_input_s: float
    bwd_weight_s: float

    @property
    def bwd_s(self) -> float:
        return self.bwd_input_s + self.bwd_weight_s

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_input_s + self.bwd_weight_s

    def __add__(self, other: NodeTime) -> NodeTime:
        return NodeTime(
            self.fwd_s + other.fwd_s,
            self.bwd_input_s + other.bwd_input_s,
            self.bwd_weight_s + other.bwd_weight_s,
        )


def _check_kind(kind: str) -> None:
    if kind not in NODE_KINDS:
        raise ValueError(f"node kind {kind!r} unknown; use one of {NODE_KINDS}")


def matmul_efficiency_at(cluster: ClusterSpec, flops: float, *, backward: bool = False) -> float:
    """Fraction of peak a GEMM of ``flops`` FLOPs reaches on ``cluster``.

    Without a table (``cluster.matmul_efficiency_by_flops`` empty: every preset) it is
    ``cluster.matmul_efficiency`` at any size. With one (rows ``[flops, fwd_eff, bwd_eff]``, from
    ``meshplan profile``), it is the forward (or ``backward``) column interpolated linearly in
    ``log(flops)`` between the two nearest rows, clamped to the first/last row outside them.
    """
    rows = sorted(cluster.matmul_efficiency_by_flops)
    if not rows:
        return cluster.matmul_efficiency
    col = 2 if backward else 1
    if flops <= rows[0][0]:
        return float(rows[0][col])
    if flops >= rows[-1][0]:
        return float(rows[-1][col])
    for lo, hi in zip(rows, rows[1:], strict=False):
        if lo[0] <= flops <= hi[0]:
            if hi[0] == lo[0]:
                return float(hi[col])
            f = (math.log(flops) - math.log(lo[0])) / (math.log(hi[0]) - math.log(lo[0]))
            return float(lo[col] + f * (hi[col] - lo[col]))
    return float(rows[-1][col])  # unreachable: the rows bracket flops


def roofline_time_s(
    flops: float,
    bytes_moved: float,
    cluster: ClusterSpec,
    *,
    dtype: str = "bf16",
    kind: str = "linear",
    efficiency: float | None = None,
) -> float:
    """Seconds for one kernel: ``max(flops/(peak·eff_mm), bytes/(mem_bw·eff_mem), floor)``.

    ``peak`` is ``cluster.gemm_peak(dtype)`` for matmul kinds (linear, matmul, attention: the
    datasheet peak, a float8 GEMM's scaled by its measured ceiling over bf16's,
    ``efficiency.GEMM_CEILING_H100``) and ``cluster.peak("fp32")`` (vector units) for the rest; ``eff_mm = efficiency`` when given, else
    ``cluster.matmul_efficiency``; ``eff_mem = cluster.mem_efficiency``, ``floor = cluster.kernel_floor_s`` (launch overhead).
    A kernel that does no work (0 FLOPs, 0 bytes) or a free kind (reshape, input, ...) costs 0.
    Units: FLOPs, bytes -> seconds. Source: roofline model (Williams et al., CACM 2009).
    """
    _check_kind(kind)
    if flops < 0 or bytes_moved < 0:
        raise ValueError(f"flops and bytes_moved must be >= 0, got {flops!r}, {bytes_moved!r}")
    if kind in FREE_KINDS or (flops == 0 and bytes_moved == 0):
        return 0.0
    peak = cluster.gemm_peak(dtype) if kind in MATMUL_KINDS else cluster.peak("fp32")
    if efficiency is not None and not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency!r}")
    eff = cluster.matmul_efficiency if efficiency is None else efficiency
    t_compute = flops / (peak * eff)
    t_memory = bytes_moved / (cluster.mem_bw_bytes_per_s * cluster.mem_efficiency)
    return max(t_compute, t_memory, cluster.kernel_floor_s)


def gemm_time_s(m: float, n: float, k: float, cluster: ClusterSpec, dtype: str = "bf16", *,
                fp8_tile_k: float = FP8_TILE_K) -> float:
    """Seconds of one ``m×k · k×n`` GEMM in ``dtype`` with a 16-bit output, as ``modelled_node_time``
    prices a linear's GEMM on a spec without a calibration table: ``roofline_time_s`` at
    ``matmul_efficiency × gemm_shape_factor`` (× ``fp8_k_factor(k)`` for "fp8"), the operands at
    ``dtype_bytes(dtype)`` per element (1 B in fp8) and the output at 2 B; ``fp8_tile_k``: another
    fp8 k-step depth (a fit check). Unit: seconds."""
    elem = dtype_bytes(dtype)
    eff = cluster.matmul_efficiency * gemm_shape_factor(m, n, k, cluster.sm_count)
    if dtype == "fp8":
        eff *= fp8_k_factor(k, fp8_tile_k)
    return roofline_time_s(2.0 * m * n * k, elem * (m * k + k * n) + 2.0 * m * n, cluster, dtype=dtype,
                           kind="linear", efficiency=eff)


def backward_factors(kind: str) -> tuple[float, float]:
    """(B, W): input-gradient and weight-gradient time as multiples of forward time.

    linear/matmul (1, 1); attention (2, 0); norm (1.5, 0.5); activation, elementwise, loss (1, 0);
    embedding (0, 1); other (1, 1); input, output, constant, reshape (0, 0). Sources: FORMULAS.md
    (backward ≈ 2× forward), Qi et al. 2023 (the B/W split), Dao 2023 (attention backward ≈ 2×).
    """
    _check_kind(kind)
    return _BACKWARD_FACTORS[kind]


def estimate_input_bytes(node: GraphNode) -> int:
    """Bytes a node reads besides its weights, when the graph's edges are not at hand.

    linear: ``out_bytes · in_features / out_features``; norm/activation/loss/embedding:
    ``out_bytes`` (one input the size of the output; ids are small, counted as output-sized
    upper bound for embedding); elementwise/other: one ``out_bytes`` per input (capped at 2).
    Prefer the exact sum of ``ModelGraph.edges`` into the node (``node_input_bytes``).
    """
    if node.kind == "linear" and node.attrs.get("in_features") and node.attrs.get("out_features"):
        return int(node.out_bytes * node.attrs["in_features"] / node.attrs["out_features"])
    if node.kind in ("elementwise", "other", "matmul", "attention"):
        return node.out_bytes * max(1, min(len(node.inputs), 3 if node.kind == "attention" else 2))
    return node.out_bytes


def node_input_bytes(edges: list[tuple[int, int, int]], node_id: int) -> int:
    """Sum of the tensor bytes on ``ModelGraph.edges`` that end at ``node_id``."""
    return sum(b for _, d, b in edges if d == node_id)


def modelled_node_time(
    node: GraphNode,
    cluster: ClusterSpec,
    *,
    shard: int = 1,
    batch_scale: float = 1.0,
    dtype: str = "bf16",
    input_bytes: int | None = None,
    style: str | None = None,
    is_head: bool = False,
    norm_kernel: str = "fused",
    attention_impl: str = "flash",
    fp8_recipe: str = DEFAULT_FP8_RECIPE,
    ep: int = 1,
    main_grad_bytes: int = 4,
    sequence_parallel: bool = True,
) -> NodeTime:
    """Forward, backward-input and backward-weight seconds of ``node`` on one device, as the
    roofline and ``backward_factors`` model them (``node_time`` applies ``backward_speed``).

    Formula::

        flops   = fwd_flops · batch_scale / shard
        bytes   = (input_bytes + out_bytes) · batch_scale · r / shard + param_bytes · r / s_w
        fwd_s   = roofline_time_s(flops, bytes, cluster, dtype, kind)
        (B, W)  = backward_factors(kind);  bwd_input_s = B · fwd_s;  bwd_weight_s = W · fwd_s

    ``shard`` is the tensor-parallel split of this node's work; ``s_w = shard`` for kinds whose
    weight TP splits (linear, embedding, matmul), else 1; an embedding reads only the rows it
    returns (its weight term is 0). ``batch_scale`` turns the traced batch
    into a microbatch (parameter bytes do not scale with it). ``r = dtype_bytes(dtype) /
    dtype_bytes(node.out_dtype)`` when the node was traced in another float dtype (a model traced
    in fp32 and trained in bf16 moves half the bytes). ``input_bytes`` defaults to
    ``estimate_input_bytes(node)``; pass ``node_input_bytes(graph.edges, node.id)`` when known.
    W is 0 for a node that reads no trainable parameter (``GraphNode.trains_weight``: frozen base
    weights get no weight gradient); a node reading a trainable weight counted at another node (a
    tied LM head reads the embedding's) has its W as any other: torch and Megatron compute
    dW = dYᵀ·X at each use and sum them into the one gradient. A MoE node's weight gradients
    accumulate into a main gradient of ``main_grad_bytes`` per element (``moe_node_time``). Each
    non-zero part is at least ``cluster.kernel_floor_s``. With an eager
    calibration (see the module docstring) matmul kinds use ``matmul_efficiency_at(cluster, flops)``
    for forward and its backward column for B and W, ``op_overhead_s`` is added to forward and
    ``bwd_op_overhead_s`` to each non-zero backward part, and a reshape costs just those.
    Without one, on a spec that knows its SM count (``cluster.sm_count``, every GPU preset), the
    kernel's shape sets the efficiency (``cost_models.efficiency``): a linear layer's forward,
    input-gradient and weight-gradient GEMMs each run at ``matmul_efficiency × gemm_shape_factor``
    of their own (M, N, K) (``style`` "rowwise" says TP splits K, else N), and a flash attention
    does ``causal_work_fraction`` of the counted FLOPs at ``attention_wave_factor``. With
    ``dtype="fp8"`` (torchao float8 training, ``cost_models.precision``) a convertible linear
    (16-aligned, not ``is_head``) runs its three GEMMs at ``gemm_peak("fp8")`` times
    ``efficiency.fp8_k_factor`` of each GEMM's reduction depth (forward K = in, input gradient
    K = out, weight gradient K = tokens), each moving its own bytes (its two operands in fp8, 1 B,
    its output in bf16: ``gemm_time_s``), plus the memory-bound
    scaling/cast bytes ``fp8_cast_bytes`` of the engine's ``fp8_recipe`` (the operand crossing the TP
    group cast on its sequence shard where ``sequence_parallel``); a MoE node's expert GEMMs
    run in fp8 where the recipe runs them so (TE: ``fp8_moe_cast_bytes``); everything else, and every tensor's bytes, is bf16. Unit: seconds.
    A MoE node whose expert shape was traced (``num_experts``, ``hidden``, ``expert_numel``) is timed
    as the kernels Megatron-Core runs for it on a rank holding ``E/ep`` experts
    (``moe_kernels.moe_kernels``: router, permute, grouped fc1 / activation / fc2, unpermute, and
    their backward, the weight gradients accumulated into fp32), each on the roofline, its GEMMs at
    ``efficiency.grouped_gemm_factor`` of their per-expert shape (``moe_node_time``).
    With ``norm_kernel="eager"`` an RMSNorm module runs as the Python ops it is written in
    (``eager_ops.eager_rmsnorm_s``: fp32 upcast, 7 kernels forward), not as one fused pass; with
    ``attention_impl`` "unfused" / "eager" an attention node runs without a flash kernel, its
    scores materialized (``eager_ops.unfused_attention_s``).
    Sources: roofline (Williams et al. 2009); B/W split (Qi et al. 2023, zero-bubble); NVIDIA
    Matrix Multiplication Background guide (tile/wave quantization); FlashAttention-2 (Dao 2023).
    """
    if norm_kernel not in NORM_KERNELS:
        raise ValueError(f"norm_kernel must be one of {', '.join(NORM_KERNELS)}, got {norm_kernel!r}")
    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {', '.join(ATTENTION_IMPLS)}, got {attention_impl!r}")
    if not isinstance(shard, int) or shard < 1:
        raise ValueError(f"shard must be a positive integer, got {shard!r}")
    if not batch_scale > 0:
        raise ValueError(f"batch_scale must be > 0, got {batch_scale!r}")
    _check_kind(node.kind)
    if node.kind == "reshape" and (cluster.op_overhead_s or cluster.bwd_op_overhead_s):
        return NodeTime(cluster.op_overhead_s, cluster.bwd_op_overhead_s, 0.0)  # a view: host cost only
    if node.kind in FREE_KINDS:
        return NodeTime(0.0, 0.0, 0.0)
    dtype_bytes(dtype)  # validates the name
    if node.kind == "norm" and norm_kernel == "eager" and is_python_rmsnorm(node.target):
        f, b, w = eager_rmsnorm_s(norm_numel(node.out_shape, batch_scale, shard), cluster,
                                  weight_grad=node.trains_weight)
        ov = cluster.bwd_op_overhead_s
        return NodeTime(f + cluster.op_overhead_s, b + ov, w + ov if w else 0.0)
    a = node.attrs
    if node.kind == "attention" and attention_impl != "flash" and a.get("num_heads") and a.get("seq_len"):
        batch = (node.out_shape[0] if node.out_shape and len(node.out_shape) == 4 else 1) * batch_scale
        hd = int(a.get("head_dim") or (node.out_shape[-1] if node.out_shape else 0) or 64)
        f, b = unfused_attention_s(batch * a["num_heads"] / shard, int(a["seq_len"]), hd, cluster, impl=attention_impl,
                                   dtype=activation_dtype(dtype), elem=dtype_bytes(activation_dtype(dtype)))  # fmt: skip
        return NodeTime(f + cluster.op_overhead_s, b + cluster.bwd_op_overhead_s, 0.0)
    train_dtype, dtype = dtype, activation_dtype(dtype)  # fp8 training: bf16 tensors, fp8 GEMMs
    if node.kind == "moe" and a.get("num_experts") and a.get("hidden") and a.get("expert_numel"):
        return moe_node_time(node, cluster, tokens=a.get("tokens", 0) * batch_scale / shard, ep=ep,
                             dtype=train_dtype, fp8_recipe=fp8_recipe, main_grad_bytes=main_grad_bytes)
    r = elem_scale(node.out_dtype, dtype)
    in_b = estimate_input_bytes(node) if input_bytes is None else input_bytes
    w_shard = shard if node.kind in SHARDED_WEIGHT_KINDS else 1
    # A lookup reads only the rows it returns (counted as its input), never the whole table.
    w_bytes = 0 if node.kind == "embedding" else node.param_bytes * r / w_shard
    flops = node.fwd_flops * batch_scale / shard
    bytes_moved = (in_b + node.out_bytes) * batch_scale * r / shard + w_bytes
    sized = node.kind in MATMUL_KINDS and bool(cluster.matmul_efficiency_by_flops)
    shaped = shape_efficiencies(node, cluster, shard=shard, batch_scale=batch_scale, style=style)
    if shaped is not None:
        flops *= shaped[0]  # the kernel's work (a causal flash attention skips masked blocks)
        shaped = None if sized else shaped  # a measured per-size table sets the efficiency
    eff_f = matmul_efficiency_at(cluster, flops) if sized else (shaped[1] if shaped else None)
    fp8 = (train_dtype == "fp8" and node.kind == "linear"
           and fp8_eligible(a.get("in_features"), a.get("out_features"), is_head=is_head))  # fmt: skip
    cast = (0.0, 0.0, 0.0)
    if train_dtype == "fp8" and node.kind == "moe" and fp8_recipe_of(fp8_recipe).experts_fp8:
        dtype = "fp8"  # TE grouped expert GEMMs in fp8 (cost_models.precision)
        routed = a.get("tokens", 0) * batch_scale / shard * a.get("top_k", 1)
        mem_bw = cluster.mem_bw_bytes_per_s * cluster.mem_efficiency
        cf, cb = fp8_moe_cast_bytes(routed, a.get("expert_act_numel", 0), fp8_recipe)
        cast = (cf / mem_bw, cb / mem_bw, 0.0)
    # backward GEMMs run at the table's backward efficiency (same FLOPs per part as forward), or
    # at the efficiency of their own shape (dX: M×K by N, dW: K×N by M)
    eff_b = eff_w = eff_f
    if sized:
        eff_b = eff_w = matmul_efficiency_at(cluster, flops, backward=True)
    elif shaped is not None:
        eff_b, eff_w = shaped[2], shaped[3]
    bytes_b = bytes_w = bytes_moved  # 16-bit: the three GEMMs move the same three tensors
    if fp8:
        dtype = "fp8"  # the GEMMs' peak
        tokens = max(1.0, math.prod(node.out_shape or (1,)) / a["out_features"] * batch_scale)
        mem_bw = cluster.mem_bw_bytes_per_s * cluster.mem_efficiency
        dims = linear_gemm_dims(tokens, a["in_features"], a["out_features"], shard, style)
        # each GEMM reads its operands' fp8 copies (1 B of the 2 a bf16 tensor holds) and writes bf16:
        # forward X, W -> Y; input gradient dY, W -> dX; weight gradient X, dY -> dW
        x_b, y_b = in_b * batch_scale * r / shard, node.out_bytes * batch_scale * r / shard
        bytes_moved, bytes_b, bytes_w = x_b / 2 + w_bytes / 2 + y_b, y_b / 2 + w_bytes / 2 + x_b, x_b / 2 + y_b / 2 + w_bytes
        # a short-K fp8 GEMM loses one fp8 k-step per output tile (efficiency.fp8_k_factor); K: in, out, tokens
        me = cluster.matmul_efficiency
        eff_f, eff_b, eff_w = ((me if e is None else e) * fp8_k_factor(max(1.0, k))
                               for e, k in zip((eff_f, eff_b, eff_w), (dims[2], dims[1], dims[0]), strict=True))
        sp_tp = shard if sequence_parallel else 1  # the crossing operand is a sequence shard only under SP
        cast = tuple(b / mem_bw for b in fp8_cast_bytes(*dims, fp8_recipe, tp=sp_tp, style=style))  # type: ignore[assignment]
    fwd = roofline_time_s(flops, bytes_moved, cluster, dtype=dtype, kind=node.kind, efficiency=eff_f)
    if fwd == 0.0:
        return NodeTime(0.0, 0.0, 0.0)
    bwd_in_unit = roofline_time_s(flops, bytes_b, cluster, dtype=dtype, kind=node.kind, efficiency=eff_b)
    bwd_w_unit = roofline_time_s(flops, bytes_w, cluster, dtype=dtype, kind=node.kind, efficiency=eff_w)
    fb, fw = backward_factors(node.kind)
    if not node.trains_weight:  # no weight gradient: no parameter read, or only frozen ones
        fw = 0.0
    floor = cluster.kernel_floor_s
    ov_b = cluster.bwd_op_overhead_s
    bwd_in = max(fb * bwd_in_unit, floor) + ov_b + cast[1] if fb > 0 else 0.0
    bwd_w = max(fw * bwd_w_unit, floor) + ov_b + cast[2] if fw > 0 else 0.0
    return NodeTime(fwd + cluster.op_overhead_s + cast[0], bwd_in, bwd_w)


def moe_node_time(node: GraphNode, cluster: ClusterSpec, *, tokens: float, ep: int = 1, dtype: str = "bf16",
                  fp8_recipe: str = DEFAULT_FP8_RECIPE, main_grad_bytes: int = 4) -> NodeTime:
    """Forward, backward-input and backward-weight seconds of a MoE node routing ``tokens`` on a rank
    holding E/``ep`` experts: the sum of its kernels (``moe_kernels.moe_kernels``), each
    ``roofline_time_s`` with its own floor, a GEMM at ``matmul_efficiency`` (or the calibrated
    per-size table) × ``grouped_gemm_factor`` of its per-expert shape on ``cluster.sm_count`` SMs;
    under fp8 where the recipe runs the experts in fp8 the expert GEMMs at the fp8 peak plus
    ``fp8_moe_cast_bytes``. The eager per-op host costs of a calibration are added per pass, as for
    any node. A frozen node gets no weight gradient. ``main_grad_bytes``: the element size of the
    gradient the weight gradients accumulate into (``dp_kinds.main_grad_bytes``). Unit: seconds."""
    a = node.attrs
    act = activation_dtype(dtype)
    elem = dtype_bytes(act)
    fp8 = dtype == "fp8" and fp8_recipe_of(fp8_recipe).experts_fp8
    sized = bool(cluster.matmul_efficiency_by_flops)
    parts = {"fwd": 0.0, "bwd_input": 0.0, "bwd_weight": 0.0}
    for kern in moe_kernels(a, tokens, ep=ep, elem=elem, weight_elem=elem, grad_elem=main_grad_bytes):
        if kern.groups:
            base = matmul_efficiency_at(cluster, kern.flops, backward=kern.phase != "fwd") if sized else None
            if base is None:
                m, n, k = (max(1.0, x) for x in kern.shape)
                base = cluster.matmul_efficiency * grouped_gemm_factor(m, n, k, kern.groups, cluster.sm_count)
            gemm_dtype = "fp8" if fp8 and not kern.name.startswith("router") else act
            if gemm_dtype == "fp8":  # a short-K fp8 GEMM loses one fp8 k-step per output tile
                base *= fp8_k_factor(max(1.0, kern.shape[2]))
            parts[kern.phase] += roofline_time_s(kern.flops, kern.bytes, cluster, dtype=gemm_dtype, kind="moe",
                                                 efficiency=base)
        else:
            parts[kern.phase] += roofline_time_s(0.0, kern.bytes, cluster, kind="elementwise")
    cf = cb = 0.0
    if fp8:
        mem_bw = cluster.mem_bw_bytes_per_s * cluster.mem_efficiency
        cf, cb = (x / mem_bw for x in fp8_moe_cast_bytes(tokens * a.get("top_k", 1), a.get("expert_act_numel", 0),
                                                          fp8_recipe))
    if parts["fwd"] == 0.0:
        return NodeTime(0.0, 0.0, 0.0)
    ov_b = cluster.bwd_op_overhead_s
    w = parts["bwd_weight"] + ov_b if node.trains_weight else 0.0
    return NodeTime(parts["fwd"] + cluster.op_overhead_s + cf, parts["bwd_input"] + ov_b + cb, w)


def _at_backward_speed(
    modelled: Callable[Concatenate[GraphNode, ClusterSpec, P], NodeTime],
) -> Callable[Concatenate[GraphNode, ClusterSpec, P], NodeTime]:
    """``modelled`` with both backward parts divided by ``cluster.backward_speed`` (the backward :
    forward speed a calibration measured; 1 = as modelled)."""

    def timed(node: GraphNode, cluster: ClusterSpec, /, *args: P.args, **kwargs: P.kwargs) -> NodeTime:
        t = modelled(node, cluster, *args, **kwargs)
        v = cluster.backward_speed
        return t if v == 1.0 else NodeTime(t.fwd_s, t.bwd_input_s / v, t.bwd_weight_s / v)

    return timed


#: Forward, backward-input and backward-weight seconds of a node on one device: the modelled
#: times (``modelled_node_time``, same keywords, formula there) with both backward parts divided
#: by ``cluster.backward_speed``.
node_time = _at_backward_speed(modelled_node_time)


def shape_efficiencies(
    node: GraphNode, cluster: ClusterSpec, *, shard: int = 1, batch_scale: float = 1.0, style: str | None = None
) -> tuple[float, float, float, float] | None:
    """(work fraction, forward, input-gradient, weight-gradient efficiency) of a linear or
    attention node by its kernel's shape on ``cluster`` (``cost_models.efficiency``), or None when
    the shape is unknown or the spec has no SM count (then the flat ``matmul_efficiency``)."""
    sms = cluster.sm_count
    if sms <= 0 or not node.out_shape:
        return None
    base = cluster.matmul_efficiency
    a = node.attrs
    if node.kind == "linear" and a.get("in_features") and a.get("out_features"):
        numel = math.prod(node.out_shape)
        tokens = max(1.0, numel / a["out_features"] * batch_scale)
        m, n, k = linear_gemm_dims(tokens, a["in_features"], a["out_features"], shard, style)
        f, b, w = linear_factors(m, max(1.0, n), max(1.0, k), sms)
        return 1.0, base * f, base * b, base * w
    if node.kind == "attention" and a.get("num_heads") and a.get("seq_len"):
        frac = causal_work_fraction(int(a["seq_len"]), bool(a.get("is_causal")))
        batch = (node.out_shape[0] if len(node.out_shape) == 4 else 1) * batch_scale
        if cluster.attention_efficiency:  # a flash kernel: its own fraction of peak, by shape and generation
            hd = int(a.get("head_dim") or 0) or ATTENTION_REF_SHAPE[0]
            base = min(1.0, cluster.attention_efficiency * attention_shape_factor(
                int(a["seq_len"]), hd, bool(a.get("is_causal")), kernel=cluster.attention_kernel,
                exp_cost_flops=cluster.exp_cost_flops))  # fmt: skip
        e = base * attention_wave_factor(batch, a["num_heads"] / shard, int(a["seq_len"]), sms)
        return frac, e, e, e
    return None


def nodes_time(
    nodes: list[GraphNode],
    cluster: ClusterSpec,
    *,
    shard: int | dict[int, int] = 1,
    batch_scale: float = 1.0,
    dtype: str = "bf16",
    edges: list[tuple[int, int, int]] | None = None,
) -> NodeTime:
    """Sum of ``node_time`` over ``nodes`` (e.g. one block or one stage).

    ``shard`` is one TP split for all nodes or a dict node id -> split (missing ids: 1). With
    ``edges`` (``ModelGraph.edges``) input bytes are exact, else estimated. Unit: seconds.
    """
    in_bytes: dict[int, int] = {}
    if edges is not None:
        for _, d, b in edges:
            in_bytes[d] = in_bytes.get(d, 0) + b
    total = NodeTime(0.0, 0.0, 0.0)
    for n in nodes:
        s = shard.get(n.id, 1) if isinstance(shard, dict) else shard
        total = total + node_time(
            n, cluster, shard=s, batch_scale=batch_scale, dtype=dtype,
            input_bytes=in_bytes.get(n.id, 0) if edges is not None else None,
        )  # fmt: skip
    return total
