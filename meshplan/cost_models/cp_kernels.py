"""Context parallelism as the engines' ring attention runs it: the flash calls at their chunk shapes,
and torch's ``context_parallel`` rotation, merge and gradient accumulation. Pure functions, no torch.

**The flash calls of a causal ring with the 2·cp-chunk split** (torch
``torch/distributed/tensor/experimental/_context_parallel/_attention.py`` ``_templated_ring_attention``
and its Note "Context parallelism load balance algorithm for causal masking"; Megatron-Core / TE's
p2p CP has the same split, ``attn_forward_func_with_cp``). A rank holds ``T_l = T/cp`` tokens
(chunks r and 2·cp−1−r) and calls the attention kernel once per ring step:

    step 0          q = T_l,   k = T_l,    causal       (its own two chunks)
    step i <= rank  q = T_l,   k = T_l/2,  not causal   (the earlier rank's first chunk)
    step i >  rank  q = T_l/2, k = T_l,    not causal   (its second chunk against both)

so every step holds ``T_l²/2`` score elements and the rank's ``cp`` calls do the ``T²/(2·cp)``
the cost table prices as one causal kernel of length ``T`` at batch ``1/cp``
(``compute.shape_efficiencies``). ``cp_step_shape_ratio`` is the time of the ``cp`` calls at their
own shapes (work fraction, ``efficiency.attention_shape_factor`` of the key blocks each query
block visits, ``attention_wave_factor`` of their grid) over the cost table's one kernel: at
``T_l`` of a few thousand tokens and more it is ~1; at short chunks each call's fixed work per
query block and its emptier grid make the ring slower than one long kernel.

**torch's context_parallel** (``EngineProfile.cp_rotate`` "allgather" or "alltoall", torch's
``_cp_options.rotate_method``; torchtitan 9dec370 ``--experimental.context_parallel_rotate_method``
default "allgather"). Per attention layer and microbatch on a rank, with ``kv`` its key + value
block (bytes, as SDPA receives them: a model that repeats its kv heads sends the copies), ``E``
the elements of its query / output, ``c`` one ring step's attention (the layer's / cp)::

    forward (each forward pass; a recompute re-runs it whole)
      "allgather": one all_gather_single of the cp blocks, posted before step 0, waited at step 1:
                   exposed max(0, t_ag − c_fwd)
      "alltoall":  cp − 1 permutes of kv (ft_c.permute_tensor), each waited one step later:
                   exposed (cp − 1)·max(0, t − c_fwd)
    backward
      key/value again by the same method (kv_rotater), over the backward's steps c_bwd
      dK/dV accumulated in fp32 (_cp_options.convert_to_f32) travel by all-to-all permute at every
      step: 2·kv bytes per send; step i's send is waited after step i+1's kernel, the last one
      after the loop with nothing to hide it: (cp − 1)·max(0, t_dkv − c_bwd) + t_dkv

each hidden part also paying ``contention.overlap_slowdown_s``. And memory passes the flash
kernels do not make, read from the same source (bytes per element of ``E`` or of ``kv``'s
elements; ``e`` = the activation's bytes; fp32 = 4; rank r runs r steps of the "i <= rank" kind
and cp − 1 − r of the other, so a step is costed as their mean):

    forward   key/value .contiguous() of the transposed SDPA inputs (2·kv), the [k; v] torch.cat
              before every step but the last (2·kv each; "allgather" sends only the first),
              _SDPAMerger.step: out.to(fp32) (e + 4),
              merge out − sigmoid(Δlse)·(out − block_out) (3 binary passes, 32), on the half
              query under "i > rank" plus _partial_update's torch.cat (8); results() to e (4 + e)
    backward  zeros of the fp32 dQ, dK, dV (4 each), key/value .contiguous() (2·kv), the [k; v]
              cat before every step but the last (2·kv each), dK/dV += (8 + e, on the half key under "i <= rank" with its
              _partial_update cat, 8), dQ += (8 + e; half plus cat under "i > rank"), the dK/dV
              send torch.cat in fp32 (8, every step), dQ and dK/dV back to e (4 + e)

at HBM speed (``mem_bw · mem_efficiency``), each step's ~10 forward / ~7 backward elementwise
kernels at least ``kernel_floor_s`` each. "ring" (Megatron-Core / TE's p2p ring: bf16 p2p shifts
overlapped step by step, ``epcp.cp_ring_exposed_s``) keeps that pricing. "ring-dkv" (meshplan's
runtime, ``runtime/apply/ring_attention.py``: the same shifts, the backward re-sending key/value
and an fp32 dK/dV accumulator, ``epcp.cp_ring_exposed_s(dkv_bytes=...)``) adds its own merge and
accumulation passes (``ring_dkv_memory_bytes``).
"""

from __future__ import annotations

from meshplan.cost_models.comm import group_collective_s, group_layout, p2p_time_s
from meshplan.cost_models.contention import overlap_slowdown_s
from meshplan.cost_models.efficiency import (
    attention_shape_factor,
    attention_wave_factor,
    causal_work_fraction,
)
from meshplan.cost_models.hardware import ClusterSpec

#: how a CP implementation moves key/value blocks: "ring" (Megatron-Core / TE p2p:
#: ``epcp.cp_ring_exposed_s``), "ring-dkv" (meshplan's runtime: the same p2p ring, its backward
#: re-sending key/value and an fp32 dK/dV accumulator, ``ring_dkv_memory_bytes``), "allgather" /
#: "alltoall" (torch's context_parallel rotate methods)
CP_ROTATES = ("ring", "ring-dkv", "allgather", "alltoall")
#: the torch context_parallel rotate methods (``torch_ring_exposed_s``)
TORCH_ROTATES = ("allgather", "alltoall")
#: torch's _cp_options.convert_to_f32: the merge and the dQ/dK/dV accumulation run in fp32
ACCUM_BYTES = 4
#: elementwise kernels per ring step of torch's _templated_ring_attention (forward: out/lse to fp32,
#: the merge's subtractions, sigmoid, product, logsigmoid, the partial update's cats; backward: the
#: dK/dV/dQ additions or partial updates and the dK/dV send cat), counted from the source
TORCH_STEP_KERNELS = (10, 7)
#: elementwise kernels per ring step of meshplan's ring (runtime/apply/ring_attention.py _RingAttention):
#: forward the step's output and log-sum-exp to fp32, logaddexp, two exps, the weighted output,
#: mul_, add_, copy_; backward dq +=, dk +=, dv +=
RING_DKV_STEP_KERNELS = (9, 3)
#: the mean share of a rank's rows a ring step after the first updates under the causal 2·cp split:
#: steps s <= rank merge every query row and add to half the key rows, steps s > rank the reverse
RING_STEP_ROWS = 0.75


def cp_step_shape_ratio(batch: float, heads: float, seq_len: int, cp: int, head_dim: int, cluster: ClusterSpec) -> float:
    """Time of a rank's ``cp`` flash calls at their chunk shapes over the cost table's one causal
    kernel of length ``seq_len`` at batch ``batch/cp`` (module docstring); ``batch``: sequences a rank
    holds chunks of, ``heads``: its query heads. 1.0 when the cluster prices attention without
    shapes (no SM count or attention efficiency) or cp <= 1."""
    sms = cluster.sm_count
    if cp <= 1 or sms <= 0 or not cluster.attention_efficiency or seq_len < 2 * cp:
        return 1.0
    kern, ex = cluster.attention_kernel, cluster.exp_cost_flops

    def time(q: int, k: int, causal: bool, b: float) -> float:  # work / efficiency, in units of q·k scores
        frac = causal_work_fraction(k, causal)
        eff = attention_shape_factor(k, head_dim, causal, kernel=kern, exp_cost_flops=ex)
        return q * k * frac / (eff * attention_wave_factor(b, heads, q, sms))

    t_l = seq_len // cp
    half = max(1, t_l // 2)
    steps = time(t_l, t_l, True, batch) + (cp - 1) * (time(t_l, half, False, batch) + time(half, t_l, False, batch)) / 2
    return steps / time(seq_len, seq_len, True, batch / cp) * cp


def _send_s(nbytes: float, cp: int, cluster: ClusterSpec, stride: int) -> float:
    crosses = group_layout(cp, stride, cluster.devices_per_node)[0] > 1 if stride > 0 else False
    return p2p_time_s(nbytes, cluster, crosses_nodes=crosses)


def _hidden(t: float, c: float, cluster: ClusterSpec) -> float:
    """A transfer of ``t`` posted before ``c`` of compute and waited after it: its exposed part plus
    what its hidden part takes from the compute's SMs."""
    return max(0.0, t - c) + overlap_slowdown_s(min(t, c), c, cluster)


def torch_ring_memory_bytes(kv_bytes: float, q_bytes: float, cp: int, elem_bytes: int, rotate: str) -> tuple[float, float]:
    """(forward, backward) bytes of torch's ring attention's own memory passes on one rank per
    attention layer (module docstring's table): ``kv_bytes`` its key + value block, ``q_bytes`` its
    query (= output) block, both in the activation dtype of ``elem_bytes``."""
    e, f = float(elem_bytes), float(ACCUM_BYTES)
    E, kv = q_bytes / e, kv_bytes / e  # elements
    cats = cp - 1  # the loop concatenates [k; v] before every step but the last, whatever the method sends
    full = (e + f) * E + 32 * E  # a step merging the whole output
    part = (e + f) * E / 2 + 16 * E + 8 * E  # the second half, then _partial_update's cat
    fwd = 2 * kv_bytes + 2 * kv_bytes * cats + (e + f) * E + (cp - 1) * (full + part) / 2 + (f + e) * E
    add_kv, add_q = (2 * f + e) * kv, (2 * f + e) * E
    early = add_kv / 2 + 2 * f * kv + add_q  # i <= rank: dK/dV on their first half + cat; dQ whole
    late = add_kv + add_q / 2 + 2 * f * E  # i > rank: dK/dV whole; dQ's second half + cat
    bwd = (f * (E + kv) + 2 * kv_bytes + 2 * kv_bytes * cats + add_kv + add_q + (cp - 1) * (early + late) / 2
           + cp * 2 * f * kv + (f + e) * (E + kv))  # fmt: skip
    return fwd, bwd


def ring_dkv_memory_bytes(kv_bytes: float, q_bytes: float, cp: int, elem_bytes: int) -> tuple[float, float]:
    """(forward, backward) bytes of meshplan's ring's own memory passes on one rank per attention
    layer (``runtime/apply/ring_attention.py``; ``kv_bytes`` its key + value block, ``q_bytes`` its
    query (= output) block, in the activation dtype of ``elem_bytes``; per element, fp32 = 4):

        forward   torch.stack([k, v]) (2·kv); step 0's output to fp32 (e + 4); each later step on
                  its rows (``RING_STEP_ROWS``): output to fp32 (e + 4), the weighted output (8),
                  mul_ (8), add_ (12); the merged output back to e (4 + e)
        backward  zeros of the fp32 dq (4) and dk/dv (4), torch.stack([k, v]) (2·kv); dq, dk, dv +=
                  (8 + e) at step 0 and on each later step's rows; dq, dk, dv back to e (4 + e)

    The log-sum-exp passes (1/head_dim of these) are left out."""
    e, f = float(elem_bytes), float(ACCUM_BYTES)
    E, kv = q_bytes / e, kv_bytes / e  # elements
    later = (cp - 1) * RING_STEP_ROWS
    fwd = 2 * kv_bytes + (e + f) * E + later * (e + f + 28) * E + (f + e) * E
    add = (2 * f + e) * (E + kv)
    bwd = f * (E + kv) + 2 * kv_bytes + add * (1 + later) + (f + e) * (E + kv)
    return fwd, bwd


def ring_dkv_passes_s(kv_bytes: float, q_bytes: float, cp: int, elem_bytes: int,
                      cluster: ClusterSpec) -> tuple[float, float]:
    """(forward, backward) seconds of ``ring_dkv_memory_bytes`` at HBM speed, each ring step's
    ``RING_DKV_STEP_KERNELS`` at least ``kernel_floor_s`` each; (0, 0) at cp <= 1."""
    if cp <= 1:
        return 0.0, 0.0
    mb_f, mb_b = ring_dkv_memory_bytes(kv_bytes, q_bytes, cp, elem_bytes)
    bw = cluster.mem_bw_bytes_per_s * cluster.mem_efficiency
    if bw <= 0:
        return 0.0, 0.0
    floor = cluster.kernel_floor_s
    return (max(mb_f / bw, cp * RING_DKV_STEP_KERNELS[0] * floor),
            max(mb_b / bw, cp * RING_DKV_STEP_KERNELS[1] * floor))


def torch_ring_exposed_s(kv_bytes: float, q_bytes: float, cp: int, attn_fwd_s: float, attn_bwd_s: float,
                         cluster: ClusterSpec, *, rotate: str, elem_bytes: int, stride: int = 0,
                         forward_passes: int = 1) -> tuple[float, float]:
    """(each forward pass's, the backward's) exposed seconds of one attention layer under torch's
    context_parallel on one rank (module docstring): the rotation's exposed transfers and the SMs
    its hidden ones take, the fp32 dK/dV ring with its last send exposed, and the merge /
    accumulation memory passes. ``attn_fwd_s`` / ``attn_bwd_s``: the layer's attention on this rank
    (all cp steps); ``stride``: the cp group's rank distance (tp; 0: inside one node).
    ``forward_passes`` only checks its argument (the caller multiplies the forward part)."""
    if rotate not in TORCH_ROTATES:
        raise ValueError(f"rotate must be one of {', '.join(TORCH_ROTATES)}, got {rotate!r}")
    if forward_passes < 0:
        raise ValueError(f"forward_passes must be >= 0, got {forward_passes!r}")
    if cp <= 1:
        return 0.0, 0.0
    c_f, c_b = attn_fwd_s / cp, attn_bwd_s / cp

    def rotation(c: float) -> float:
        if rotate == "allgather":
            t = group_collective_s("all_gather", cp * kv_bytes, cp, cluster, stride=max(1, stride))
            return _hidden(t, c, cluster)
        return (cp - 1) * _hidden(_send_s(kv_bytes, cp, cluster, stride), c, cluster)

    t_dkv = _send_s(kv_bytes * ACCUM_BYTES / elem_bytes, cp, cluster, stride)
    mb_f, mb_b = torch_ring_memory_bytes(kv_bytes, q_bytes, cp, elem_bytes, rotate)
    bw = cluster.mem_bw_bytes_per_s * cluster.mem_efficiency
    floor = cluster.kernel_floor_s
    mem_f = max(mb_f / bw, cp * TORCH_STEP_KERNELS[0] * floor) if bw > 0 else 0.0
    mem_b = max(mb_b / bw, cp * TORCH_STEP_KERNELS[1] * floor) if bw > 0 else 0.0
    fwd = rotation(c_f) + mem_f
    bwd = rotation(c_b) + (cp - 1) * _hidden(t_dkv, c_b, cluster) + t_dkv + mem_b
    return fwd, bwd


__all__ = ["ACCUM_BYTES", "CP_ROTATES", "RING_DKV_STEP_KERNELS", "RING_STEP_ROWS", "TORCH_ROTATES",
           "TORCH_STEP_KERNELS", "cp_step_shape_ratio", "ring_dkv_memory_bytes", "ring_dkv_passes_s",
           "torch_ring_exposed_s", "torch_ring_memory_bytes"]
