"""Memory-bound work an engine runs as separate kernels that a fused graph node does not show:
an RMSNorm written in Python (eager), the cross-entropy over the logits, attention without a flash
kernel. (The optimizer step's kernels and host work: ``cost_models.optimizer_phase``.)

Each term is bytes over the device's memory bandwidth (``compute.roofline_time_s``'s memory
term, ``mem_bw · mem_efficiency``), with the kernel floor once per launched kernel. The byte
counts are read off the ops the source code runs (reads + writes per element, the autograd
backward of each op as ``tools/autograd/derivatives.yaml`` defines it); nothing is fitted.

**Eager RMSNorm** (``norm_kernel="eager"``: torchtitan's ``norm_type = "rmsnorm"``, the Llama
reference, HF ``LlamaRMSNorm`` and meshplan's zoo Llama all run
``(x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).type_as(x) * weight``): per element of a
16-bit input, forward ``x.float()`` r2 w4, ``pow`` r4 w4, ``mean`` r4, ``x·rsqrt`` r4 w4,
``type_as`` r4 w2, ``·weight`` r2 w2 = **36 B** (a fused kernel: read 2, write 2 = 4 B). Backward:
``MulBackward`` (·weight) input grad r2 w2, weight grad ``g·y`` r2 r2 w2 + the token-sum r2;
``ToCopyBackward`` r2 w4; ``MulBackward`` (x·rsqrt) ``g·r`` r4 w4 and ``(g·x).sum(-1)`` r4 r4 w4
+ r4; ``MeanBackward`` the expanded grad w4; ``PowBackward`` ``g·2·x`` (x.pow(1), ·2, ·g) r4 w4 +
r4 w4 + r4 r4 w4; the two gradients of ``x.float()`` summed r4 r4 w4; ``ToCopyBackward`` r4 w2:
**84 B** input-gradient + **8 B** weight-gradient (fused: 6 + 2 B, ``compute.backward_factors``).
A LayerNorm module (``F.layer_norm``: one kernel in eager) and any norm under ``"fused"`` keep
the graph node's roofline.

**Cross-entropy over the logits** (a graph without a traced loss: the engine computes it on
the head's 16-bit logits, ``V`` / vocab_shard columns per token), per logit element:

- ``cross_entropy`` (``F.cross_entropy(logits.float(), y)``: torchtitan, meshplan's runtime, HF):
  forward cast r2 w4, ``log_softmax`` for rows wider than 1024 (``cunn_SoftMaxForward``: max
  pass r4, sum-exp pass r4, write pass r4 w4) = 22 B; backward ``nll_loss_backward``'s zero-filled
  fp32 gradient w4, ``cunn_SoftMaxBackward`` (sum pass r4, write pass r4 r4 w4), cast back r4 w2 = 26 B;
- ``loss_parallel`` (torch's ``loss_parallel`` on vocab-sharded DTensor logits,
  ``torch/distributed/tensor/parallel/loss.py``): cast 6, max r4, ``x − max`` r4 w4, ``exp`` r4
  w4, sum r4, ``− log Σ`` r4 w4 = 38 B; backward ``exp(x)`` r4 w4, zeros w4, add r4 r4 w4, ``·g``
  r4 w4, cast r4 w2 = 38 B;
- ``fused`` (Megatron-LM's ``vocab_parallel_cross_entropy(output.float(), labels)``: in place on
  one fp32 buffer): cast 6, max r4, ``sub_`` r4 w4, ``exp`` r4 w4, sum r4, ``div_`` r4 w4 = 38 B;
  backward ``grad.mul_`` r4 w4, cast back r4 w2 = 14 B. (A one-pass Triton cross-entropy, as
  llm-foundry can use, moves less; the MPT rows' logits are < 1 % of their step either way.)

**Attention without a flash kernel** (``attention_impl``; engines before FlashAttention): the
scores are materialized, ``B = batch · heads/tp`` matrices of ``s × s`` in the 16-bit dtype, and
every kernel reads or writes them. Megatron-LM 2021 (``megatron/model/transformer.py`` at
6985e58, SC'21): ``torch.baddbmm`` (QKᵀ, scaled) writes them, ``FusedScaleMaskSoftmax``
(scale + causal mask + softmax, one kernel for s ≤ 2048) reads and writes them,
``attention_dropout`` (p = 0.1, ``--attention-dropout`` default) reads them and writes them and
a 1-byte mask, ``torch.bmm`` with V reads them ("unfused"); Megatron-LM 2020 (5281919) ran the
scaled matmul, ``masked_fill_`` of the causal mask and ``torch.nn.Softmax`` as separate kernels
(``"eager"``: one more read and write). Backward: ``dP = dO·Vᵀ`` writes, ``dV = Pᵀ·dO`` reads,
dropout backward reads the gradient and the mask and writes, softmax backward reads P and the
gradient and writes (eager: the mask fill's backward reads and writes once more), ``dQ`` and
``dK`` each read the score gradient. The six GEMMs do the full ``s²`` work (no causal block
skip): ``2·B·s²·d`` FLOPs each, each on the roofline with its ``s²`` operand's bytes, at
``matmul_efficiency × gemm_shape_factor`` of its shape (QKᵀ and dP: M = s, N = s, K = d —
memory bound at d ≤ 128 on every generation); ``"flash"`` (default) is the flash-attention
costing of ``compute.shape_efficiencies``. No torch import.
"""

from __future__ import annotations

import math

from meshplan.cost_models.efficiency import gemm_shape_factor
from meshplan.cost_models.hardware import ClusterSpec

NORM_KERNELS = ("fused", "eager")
#: how meshplan's own runtime runs a Python RMSNorm module (the zoo Llama's, HF's LlamaRMSNorm): as the
#: eager ops it is written in, since ``meshplan run`` compiles nothing unless ``--compile`` is given
#: (a compiled run is then faster than its plan says); engines that ship a fused norm kernel
#: (Megatron's Transformer Engine / Apex) are costed "fused"
RUNTIME_NORM_KERNEL = "eager"
#: eager RMSNorm bytes per element: (forward, input gradient, weight gradient), kernels launched
EAGER_RMSNORM_BYTES = (36.0, 84.0, 8.0)
EAGER_RMSNORM_KERNELS = (7, 10, 2)

#: cross-entropy bytes per logit element (forward, backward) and kernels launched, by loss kernel
#: (``cost_models.memory.LOSS_KERNELS`` keys)
LOSS_PASS_BYTES: dict[str, tuple[float, float]] = {
    "cross_entropy": (22.0, 26.0),
    "loss_parallel": (38.0, 38.0),
    "fused": (38.0, 14.0),
    "compiled": (2.0, 4.0),  # one read of the 16-bit logits; read them again, write their gradient
}
LOSS_KERNEL_LAUNCHES: dict[str, tuple[int, int]] = {"cross_entropy": (3, 3), "loss_parallel": (6, 5), "fused": (6, 2),
                                                    "compiled": (1, 1)}

def _bw(cluster: ClusterSpec) -> float:
    return cluster.mem_bw_bytes_per_s * cluster.mem_efficiency


def _pass_s(nbytes: float, kernels: int, cluster: ClusterSpec) -> float:
    if nbytes <= 0:
        return 0.0
    return max(nbytes / _bw(cluster), kernels * cluster.kernel_floor_s)


def is_python_rmsnorm(target: str) -> bool:
    """Whether a traced norm module is an RMSNorm (a Python module of eager ops unless compiled);
    LayerNorm modules are one ``F.layer_norm`` kernel in eager."""
    return "rmsnorm" in target.lower()


def eager_rmsnorm_s(numel: float, cluster: ClusterSpec, *, weight_grad: bool = True) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of an eager RMSNorm over ``numel``
    elements of a 16-bit tensor (module docstring); the weight gradient is 0 when frozen."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel!r}")
    f, b, w = (numel * x for x in EAGER_RMSNORM_BYTES)
    kf, kb, kw = EAGER_RMSNORM_KERNELS
    return _pass_s(f, kf, cluster), _pass_s(b, kb, cluster), (_pass_s(w, kw, cluster) if weight_grad else 0.0)


def loss_time_s(
    tokens: float, vocab: int, cluster: ClusterSpec, *, vocab_shard: int = 1, kernel: str | None = None
) -> tuple[float, float]:
    """(forward, backward) seconds of the cross-entropy over ``tokens × vocab / vocab_shard``
    16-bit logits under ``kernel`` (``LOSS_PASS_BYTES``; None: ``loss_parallel`` when the vocabulary
    is sharded, else ``cross_entropy``, as ``memory.loss_buffer_bytes`` chooses)."""
    if tokens < 0 or vocab < 1 or vocab_shard < 1:
        raise ValueError(f"tokens >= 0, vocab >= 1 and vocab_shard >= 1 needed, got {tokens}, {vocab}, {vocab_shard}")
    kernel = kernel or ("loss_parallel" if vocab_shard > 1 else "cross_entropy")
    if kernel not in LOSS_PASS_BYTES:
        raise ValueError(f"loss kernel {kernel!r} unknown; use one of {sorted(LOSS_PASS_BYTES)}")
    n = tokens * vocab / vocab_shard
    (bf, bb), (kf, kb) = LOSS_PASS_BYTES[kernel], LOSS_KERNEL_LAUNCHES[kernel]
    return _pass_s(n * bf, kf, cluster), _pass_s(n * bb, kb, cluster)


def norm_numel(out_shape: tuple[int, ...] | None, batch_scale: float, shard: int = 1) -> float:
    """Elements a norm node touches at ``batch_scale`` on a rank holding 1/``shard`` of them."""
    if not out_shape:
        return 0.0
    return math.prod(out_shape) * batch_scale / shard


ATTENTION_IMPLS = ("flash", "unfused", "eager")
#: attention dropout of the unfused engines (Megatron-LM ``--attention-dropout`` default)
ATTENTION_DROPOUT = True


def _elementwise_score_bytes(impl: str, elem: int, dropout: bool) -> tuple[float, float]:
    """Bytes per score element of the non-GEMM kernels of unfused attention (forward, backward)."""
    fwd, bwd = 2.0 * elem, 3.0 * elem  # softmax (fused scale/mask in "unfused"): r w; backward r r w
    if dropout:
        fwd, bwd = fwd + 2 * elem + 1, bwd + 2 * elem + 1  # r w + 1-byte mask; backward r (mask) w
    if impl == "eager":
        fwd, bwd = fwd + 2 * elem, bwd + 2 * elem  # masked_fill_ and its backward
    return fwd, bwd


def unfused_attention_s(
    bh: float, seq: int, head_dim: int, cluster: ClusterSpec, *, impl: str = "unfused", dtype: str = "bf16",
    elem: int = 2, dropout: bool = ATTENTION_DROPOUT,
) -> tuple[float, float]:
    """(forward, backward) seconds of attention over ``bh`` score matrices of ``seq × seq`` (batch
    × local heads) at ``head_dim`` without a flash kernel (module docstring): six full GEMMs on the
    roofline and the softmax / dropout (/ mask) passes over the materialized scores."""
    if impl not in ("unfused", "eager"):
        raise ValueError(f"attention_impl must be 'unfused' or 'eager' here, got {impl!r}")
    if bh <= 0 or seq < 1 or head_dim < 1:
        raise ValueError(f"bh > 0, seq >= 1 and head_dim >= 1 needed, got {bh!r}, {seq!r}, {head_dim!r}")
    s, d = float(seq), float(head_dim)
    score_bytes = bh * s * s * elem
    peak = cluster.peak(dtype)

    def gemm(m: float, n: float, k: float) -> float:  # one batched GEMM touching the scores once
        eff = cluster.matmul_efficiency * gemm_shape_factor(bh * m, n, k, cluster.sm_count)
        return max(2 * bh * m * n * k / (peak * eff), score_bytes / _bw(cluster), cluster.kernel_floor_s)

    qk, pv = gemm(s, s, d), gemm(s, d, s)  # QKᵀ writes the scores; PV reads them
    ew_f, ew_b = _elementwise_score_bytes(impl, elem, dropout)
    kf = 2 + (1 if dropout else 0) + (1 if impl == "eager" else 0)
    fwd = qk + pv + _pass_s(bh * s * s * ew_f, kf, cluster)
    bwd = qk + 3 * pv + _pass_s(bh * s * s * ew_b, kf, cluster)  # dP (s,s,d); dV, dQ, dK (·, d, s)
    return fwd, bwd
