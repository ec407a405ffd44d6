"""Training precision as a cost option: which dtypes a cluster runs, and what float8 training costs.

``TRAINING_DTYPES`` (``Plan.dtype``): "bf16" and "fp16" (16-bit mixed precision: fp32 master
weights, 16-bit compute and activations), "fp32", and "fp8" = torchao float8 training
(``torchao.float8.convert_to_float8_training``, as torchtitan's ``float8`` converter applies it):

- **which GEMMs**: every ``nn.Linear`` whose in/out features are multiples of 16 (the float8
  GEMM's alignment) except the LM head (torchtitan's default ``filter_fqns=["output"]``); all
  three GEMMs of such a linear (forward, input gradient, weight gradient) run on the FP8 tensor
  cores at ``ClusterSpec.gemm_peak("fp8")`` (the datasheet FP8 peak scaled by the measured GEMM
  ceiling of fp8 over bf16's, ``efficiency.GEMM_CEILING_H100``: 1.77x a bf16 GEMM, not 2x), times
  ``efficiency.fp8_k_factor(K) = K / (K + 128)`` of the GEMM's own reduction depth (a short-K fp8
  GEMM keeps less of the gain: 1.41x at K = 512, measured 1.40 on an H100), each reading its two
  operands in fp8 (1 B) and writing bf16 (a memory-bound input gradient of a thin linear, K = 128,
  runs no faster than bf16: measured 0.98x).
  Attention (SDPA), norms, activations and the head stay in bf16, and so do the tensors between ops: activation memory is that of bf16.
- **scaling overhead**, by recipe (``FP8_RECIPES``, the engine profile's ``fp8_recipe``; every
  pass memory bound at the HBM roofline, ``fp8_cast_bytes``):

  * ``"tensorwise"``: torchao's dynamic tensorwise scaling as torchtitan runs it, under
    torch.compile (torchao's float8 recipes "are built natively on top of torch.compile"; its docs:
    "you must use --training.compile to achieve high performance", ``docs/source/eager_tutorials/
    pretraining.rst`` at 36027d8; every torchtitan float8 run the published cases hold is compiled).
    The kernels are those of torchao's own roofline of its compiled recipe
    (``torchao/testing/training/roofline_utils.py`` ``get_tensor_memory_traffic_ovhd_s``, tensorwise,
    no fusion with the previous op): an activation operand (x, dY) takes an amax pass (read 2) and
    one cast kernel writing both fp8 layouts its two GEMMs read (read 2, write 1 + 1), 6 B/element,
    x in forward and dY in the input-gradient part; the weight an amax pass and a cast per
    direction (read 2, write 1), 2 + 3 B/element in forward and 3 in backward, every microbatch
    (eager torchao casts each of the six GEMM operands on its own: 5 B/element each, ten per
    activation element). Under tensor parallelism torchtitan's ``Float8ColwiseParallel`` /
    ``PrepareFloat8ModuleInput`` / ``Float8RowwiseParallel`` (torchao ``float8/float8_tensor_parallel.py``)
    cast the operand that crosses the TP group (x of a column-parallel linear, dY of a row-parallel
    one) on the rank's sequence shard, 1/tp of the tokens (an amax pass and a one-layout cast,
    ``FP8_DYNAMIC_CAST_BYTES``), before an fp8 all-gather; the linear then finds it already cast
    (``tensor_already_casted_to_fp8``) and its other GEMM reads it through a transpose copy (read 1,
    write 1: ``FP8_TRANSPOSE_BYTES``).
  * ``"rowwise"``: torchao's dynamic rowwise scaling (torchtitan 0.3's ``Float8LinearConverter``
    default ``recipe_name = "rowwise"``), compiled, torchao's roofline again: an activation operand
    is cast along rows while a bf16 transposed copy is written (read 2, write 1 + 2), then that copy
    cast along the other dimension (read 2, write 1), 8 B/element; the weight 3 B in forward, a bf16
    transpose and its cast (4 + 3) in backward. No fp8 all-gather under TP (torchao
    ``_float8_linear_supports_float8_allgather``: tensorwise only). The rowwise-scaled GEMM's lower
    throughput than tensorwise is not modelled.
  * ``"delayed"``: Transformer Engine's ``DelayedScaling`` (Megatron-Core ``--fp8-recipe``
    default, ``transformer_config.py`` ``fp8_recipe = "delayed"``; ``fp8_utils.py``
    ``TEDelayedScaling``): the scale comes from the amax history, the amax of this step is
    taken inside the cast kernel, and one ``cast_transpose`` pass writes the row- and
    column-major copies the forward and backward GEMMs need (Transformer Engine
    ``pytorch/module/linear.py``: ``fp8_cast_transpose_fused``, later a quantizer with rowwise +
    columnwise usage, ``csrc/extensions/cast.cu`` writing ``data`` and ``data_transpose``; read 2, write 1 + 1:
    ``FP8_CAST_TRANSPOSE_BYTES`` 4): x in forward, dY once for both backward GEMMs. Weights are
    cast once per step and cached over the microbatches (``extensions/transformer_engine.py``
    ``is_first_microbatch``): at most 4 B per weight per step, not charged per microbatch.
    Under sequence parallelism Transformer Engine all-gathers in fp8 too (v1.9
    ``module/layernorm_linear.py``: the norm kernel writes the fp8 input itself, the gather moves it;
    ``module/base.py`` ``grad_output_preprocess``: a row-parallel linear's dY cast on the shard, read 2
    write 1, gathered in fp8, then ``fp8_transpose``d; at d0067d0 (2026-08) ``distributed.py``
    ``gather_along_first_dim`` with a quantizer, ``_all_gather_fp8``, for delayed and current
    scaling): the crossing operand costs its shard's cast (``shard_cast_bytes``: x 0, the norm's
    fp8 output is its cast; dY 3) and a transpose of the gathered fp8 tensor (2), not a
    ``cast_transpose`` over all M tokens; the all-gather moves 1 B/element
    (``fp8_gathered_bytes``), its reduce-scatter partner stays bf16.
  * ``"current"``: TE ``Float8CurrentScaling`` (Megatron ``--fp8-recipe tensorwise``,
    Megatron-Bridge / NeMo ``fp8_cs``; ``fp8_utils.py``): as ``"delayed"`` plus an amax pass
    (read 2) before each activation cast, the scale of this step's tensor (a dY shard: 2 + 3).
  * ``"blockwise"``: TE ``Float8BlockScaling`` (1×128 activation, 128×128 weight blocks, the
    DeepSeek-V3 recipe): the block amaxes are taken in the quantize kernel (no extra pass), the
    column-major copy is scaled along the other dimension, so a second quantize pass (read 2,
    write 1) replaces the transpose: 2 + 1 + 2 + 1 = 6 B per activation element.

  MoE experts (a ``moe`` node): under the TE recipes Megatron-Core runs the grouped expert GEMMs
  in fp8 too (``TEGroupedMLP`` over TE ``GroupedLinear``, ``--moe-grouped-gemm``), each GEMM
  input cast in forward and each output gradient in backward, ``act_cast_bytes`` per element
  (``fp8_moe_cast_bytes``: the expert activation elements a routed token meets, ``expert_act_numel``
  = the GEMMs' inputs + outputs, split half forward, half backward); the router stays bf16
  (its few FLOPs are priced with the node). torchao's recipes leave grouped experts in bf16.

  **Amax reductions** (``Fp8Recipe.amax_reductions``, ``fp8_amax_reduction_s``): under
  ``"delayed"`` Megatron-Core wraps each model chunk's ``TransformerBlock.forward`` in one
  ``fp8_autocast`` whose ``fp8_group`` is the amax reduction group, tp × dp × cp ranks
  (core_v0.8.0 ``transformer_block.py``, ``parallel_state.get_amax_reduction_group(
  with_context_parallel=True)``). Transformer Engine (v1.6-v1.9, NeMo 24.05 / 24.09) all-reduces
  (MAX, ``async_op=False``, on the compute stream's path) one fp32 buffer of the amaxes of every
  fp8 tensor the rank registered under that recipe and group, at each outermost
  ``fp8_autocast`` exit with grad enabled (``fp8.py`` ``fp8_autocast_exit`` ->
  ``reduce_and_update_fp8_tensors(forward=True)``: 3 meta tensors per GEMM, input / weight /
  output) and once in backward, in the backward of the region's first fp8 module
  (``module/linear.py`` / ``layernorm_linear.py``: ``ctx.reduce_and_update_bwd_fp8_tensors``
  from ``is_first_fp8_module``; 2 per GEMM, output and input gradients): two all-reduces per
  model chunk per microbatch, each priced as the group's all-reduce of those bytes
  (latency-bound, the bytes are a few KiB). The fused history
  update after each (``fused_amax_and_scale_update_after_reduction``: read and roll the 1,024-long
  histories, ~8 KiB per tensor) is a sub-microsecond memory pass and not charged; nor is a
  recomputed forward's exit (the NeMo rows do not recompute). Each is priced as NCCL prices an
  all-reduce of a few KiB, under its LL protocol (``comm.latency_bound_all_reduce_s``; the ring
  model's Simple-protocol latency, used before Wave 3 stop 9, overstated it 2-7x). TE current
  scaling (``"current"``, ``Fp8Recipe.sp_amax_reductions``) reduces no history buffer but, under
  sequence parallelism, the amax of each crossing operand over the TP group before its cast (TE
  3f5b47549 ``module/linear.py`` L1637-1661 and its layernorm_linear / layernorm_mlp twins:
  ``with_amax_reduction = True``, ``amax_reduction_group = self.tp_group`` on a column-parallel
  module's input quantizer and a row-parallel module's grad-output quantizer; ``csrc/quantizer.cpp``
  L517-524: ``allreduce(MAX)`` of the one fp32 amax, ``wait()``ed before the scale),
  ``fp8_sp_amax_reduction_s``. torchao's per-cast DTensor reductions are not charged.
  torch.compile fuses some of these passes into neighbouring kernels; none of that fusion is
  credited.
- **memory**: the float8 copies of the computing layer's weight and its transpose
  (1 B/element each, transient; ``fp8_weight_copy_bytes``); master weights, gradients and
  optimizer states as in bf16 mixed precision. Under the TE recipes a converted linear keeps its
  fp8-cast input for backward (``Fp8Recipe.saves_fp8_inputs``, ``engine_saves.saved_bytes_delta``):
  1 B per element of the saved linear inputs; torchao's keep the bf16 input.

Only GPUs with FP8 tensor cores run it (Hopper and later: the h100/h200 presets carry
``peak_flops["fp8"]``, the datasheets' dense FP8 figure); ``check_training_dtype`` refuses it
elsewhere with the reason. Sources: torchao ``float8`` README (recipes, tensorwise dynamic
scaling, 16-alignment); torchtitan ``docs/float8.md``; NVIDIA H100 datasheet (1,979 TFLOP/s dense
FP8). No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.cost_models.comm import latency_bound_all_reduce_s
from meshplan.cost_models.hardware import ClusterSpec

TRAINING_DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32", "fp8")
#: float8 GEMMs need every dimension a multiple of this (torchao float8 / cuBLASLt FP8)
FP8_ALIGN = 16
#: bytes per element of a dynamic cast: an amax pass (read 2) and the cast (read 2, write 1)
FP8_DYNAMIC_CAST_BYTES = 5
#: torchao's compiled tensorwise cast of an activation operand: an amax pass (read 2), one kernel
#: writing both fp8 layouts (read 2, write 1 + 1); of its weight: amax + cast (2 + 3) forward, cast (3) backward
TORCHAO_TENSORWISE_ACT_BYTES, TORCHAO_TENSORWISE_WEIGHT_BYTES = 2 + 2 + 2, (2 + 3, 3)
#: torchao's compiled rowwise cast of an activation operand: cast + bf16 transpose (read 2, write 1 + 2),
#: the transpose's cast (read 2, write 1); of its weight: cast (3) forward, bf16 transpose + cast (4 + 3) backward
TORCHAO_ROWWISE_ACT_BYTES, TORCHAO_ROWWISE_WEIGHT_BYTES = 2 + 1 + 2 + 2 + 1, (3, 4 + 3)
#: bytes per element of a cast writing one fp8 layout (read 2, write 1; TE delayed: the amax inside it)
FP8_CAST_BYTES = 3
#: bytes per element of a fused cast + transpose writing both fp8 layouts (read 2, write 1 + 1)
FP8_CAST_TRANSPOSE_BYTES = 4
#: bytes per element of transposing an fp8 tensor (read 1, write 1)
FP8_TRANSPOSE_BYTES = 2
#: bytes per element of an amax pass over a bf16 tensor (read 2)
FP8_AMAX_BYTES = 2
#: TE fp8 meta tensors per GEMM whose amaxes the forward / backward reduction carries (fp32 each):
#: input, weight, output (``scaling_fwd``); output gradient, input gradient (``scaling_bwd``)
FP8_META_FWD, FP8_META_BWD = 3, 2


@dataclass(frozen=True)
class Fp8Recipe:
    """How one engine scales and casts a float8 linear (module docstring, per recipe)."""

    name: str
    #: bytes per element of casting an activation operand (x in forward, dY in the input-gradient part)
    #: into every fp8 layout its two GEMMs read, charged once
    act_cast_bytes: int
    #: (forward, backward) bytes per weight element of casting the weight every microbatch (torchao);
    #: (0, 0) where it is cast once per step and cached over the microbatches (TE)
    weight_cast_bytes: tuple[int, int]
    #: under sequence parallelism the operand crossing the TP group (x of a column-parallel linear, dY of
    #: a row-parallel one) is cast on the rank's 1/tp sequence shard and all-gathered in fp8 (1 B/element)
    gathers_fp8: bool
    source: str
    #: the MoE experts' grouped GEMMs run in fp8 too (TE GroupedLinear); torchao's float8 converter
    #: swaps nn.Linear only, so grouped experts stay bf16
    experts_fp8: bool = False
    #: a linear keeps its fp8-cast input for the weight-gradient GEMM (TE ``linear.py``: ``saved_inputmat =
    #: inputmat``, 1 B/element), not the bf16 one (torchao saves ``input_hp``): ``engine_saves.saved_bytes_delta``
    saves_fp8_inputs: bool = False
    #: bytes per element of the shard's cast when ``gathers_fp8``: (x, over M/tp; dY, over M/tp)
    shard_cast_bytes: tuple[int, int] = (FP8_DYNAMIC_CAST_BYTES, FP8_DYNAMIC_CAST_BYTES)
    #: blocking amax all-reduces over the tp x dp x cp group per fp8_autocast region (a model chunk) per
    #: microbatch: TE DelayedScaling 2 (forward at the region's exit, backward in its first module's backward)
    amax_reductions: int = 0
    #: under sequence parallelism each TE module's crossing operand (a column-parallel module's input in
    #: forward, a row-parallel module's output gradient in backward) takes a 4-byte amax all-reduce over the
    #: TP group before its cast (TE current scaling: ``with_amax_reduction`` on that quantizer)
    sp_amax_reductions: bool = False


FP8_RECIPES: dict[str, Fp8Recipe] = {r.name: r for r in (
    Fp8Recipe("tensorwise", TORCHAO_TENSORWISE_ACT_BYTES, TORCHAO_TENSORWISE_WEIGHT_BYTES, True,
              "torchao float8/float8_linear.py matmul_with_hp_or_float8_args under torch.compile, its kernels as "
              "torchao/testing/training/roofline_utils.py get_tensor_memory_traffic_ovhd_s (tensorwise) counts them; "
              "float8/float8_tensor_parallel.py Float8ColwiseParallel / PrepareFloat8ModuleInput / "
              "Float8RowwiseParallel (cast on the shard, fp8 all-gather)"),  # shards: amax + cast, 5 B
    Fp8Recipe("rowwise", TORCHAO_ROWWISE_ACT_BYTES, TORCHAO_ROWWISE_WEIGHT_BYTES, False,
              "torchtitan components/quantization/float8.py Float8LinearConverter.Config recipe_name default "
              "'rowwise'; torchao roofline_utils.py get_tensor_memory_traffic_ovhd_s (rowwise), compiled; "
              "float8_tensor_parallel.py _float8_linear_supports_float8_allgather (tensorwise only)"),
    Fp8Recipe("delayed", FP8_CAST_TRANSPOSE_BYTES, (0, 0), True,
              "Megatron-Core transformer_config.py fp8_recipe default 'delayed', fp8_utils.py TEDelayedScaling; "
              "TE cast_transpose (amax inside the kernel); extensions/transformer_engine.py is_first_microbatch "
              "(weights cast once per step); TE v1.9 fp8.py fp8_autocast_exit / module/base.py "
              "reduce_and_update_bwd_fp8_tensors (amax all-reduce per region exit, forward and backward); TE v1.9 "
              "module/layernorm_linear.py (the norm writes fp8, gather_along_first_dim of it) and base.py "
              "grad_output_preprocess (cast_to_fp8 of the dY shard, fp8 gather, fp8_transpose)",
              experts_fp8=True, saves_fp8_inputs=True, shard_cast_bytes=(0, FP8_CAST_BYTES), amax_reductions=2),
    Fp8Recipe("current", FP8_AMAX_BYTES + FP8_CAST_TRANSPOSE_BYTES, (0, 0), True,
              "Megatron-Core fp8_utils.py Float8CurrentScaling (--fp8-recipe tensorwise; Megatron-Bridge fp8_cs): "
              "an amax pass, then cast_transpose; weights cached as 'delayed'; TE gather_along_first_dim "
              "_all_gather_fp8 for Float8CurrentScalingQuantizer; TE 3f5b47549 module/linear.py L1637-1661, "
              "layernorm_linear.py L1749-1779, layernorm_mlp.py L2106-2142 (with_amax_reduction over tp_group under "
              "SP), csrc/quantizer.cpp L517-524 (allreduce MAX of the amax, waited on)", experts_fp8=True,
              saves_fp8_inputs=True, shard_cast_bytes=(0, FP8_AMAX_BYTES + FP8_CAST_BYTES), sp_amax_reductions=True),
    Fp8Recipe("blockwise", 2 * 3, (0, 0), False,
              "Megatron-Core fp8_utils.py Float8BlockScaling (--fp8-recipe blockwise): 1x128 / 128x128 blocks, "
              "block amax in the quantize kernel, a second quantize pass for the column-major copy", experts_fp8=True,
              saves_fp8_inputs=True),
)}  # fmt: skip
#: the recipe ``--dtype fp8`` costs where no engine names one (torchao tensorwise, torchtitan's default)
DEFAULT_FP8_RECIPE = "tensorwise"


def fp8_recipe(name: str) -> Fp8Recipe:
    """The recipe named ``name`` (``FP8_RECIPES``); ValueError naming the known ones."""
    try:
        return FP8_RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown fp8 recipe {name!r}; use one of {', '.join(FP8_RECIPES)}") from None

def check_training_dtype(dtype: str, cluster: ClusterSpec) -> None:
    """ValueError unless ``dtype`` is a training dtype ``cluster`` runs (fp8 needs FP8 tensor cores:
    a ``peak_flops["fp8"]`` entry, the h100/h200 presets)."""
    if dtype not in TRAINING_DTYPES:
        raise ValueError(f"dtype {dtype!r} unknown; use one of {TRAINING_DTYPES}")
    if dtype == "fp8" and "fp8" not in cluster.peak_flops:
        raise ValueError(
            f"dtype fp8 (torchao float8 training) needs FP8 tensor cores (Hopper or newer: the h100/h200 "
            f"presets); cluster {cluster.name!r} has none (peak_flops: {', '.join(sorted(cluster.peak_flops))}): "
            f"use --dtype bf16, or a profile whose peak_flops has an 'fp8' entry"
        )


def activation_dtype(dtype: str) -> str:
    """The dtype tensors between ops have under training ``dtype`` (fp8 training keeps bf16)."""
    return "bf16" if dtype == "fp8" else dtype


def fp8_eligible(in_features: int | None, out_features: int | None, *, is_head: bool = False) -> bool:
    """Whether torchao float8 converts a linear of these features (16-aligned, not the LM head)."""
    if is_head or not in_features or not out_features:
        return False
    return in_features % FP8_ALIGN == 0 and out_features % FP8_ALIGN == 0


def fp8_cast_bytes(m: float, n: float, k: float, recipe: str = DEFAULT_FP8_RECIPE, *, tp: int = 1,
                   style: str | None = None) -> tuple[float, float, float]:
    """Bytes the float8 scaling and casts of one linear (M tokens, K in, N out on this rank) move
    in its forward, input-gradient and weight-gradient parts under ``recipe`` (module docstring)::

        fwd  a·M·K + wf·K·N        dX  a·M·N + wb·K·N        dW  0

    a = ``act_cast_bytes`` (tensorwise 6, rowwise 8, delayed 4, current / blockwise 6), (wf, wb) =
    ``weight_cast_bytes`` (tensorwise (5, 3), rowwise (3, 7); TE recipes (0, 0): once per step, cached).
    ``tp`` > 1 (under sequence parallelism; ``tp`` = 1 without it) with ``style``
    (``efficiency.linear_gemm_dims``: "rowwise" splits K, else N) and a recipe that gathers in fp8
    (``gathers_fp8``: tensorwise, delayed, current): the crossing operand (x of a column-parallel
    linear, dY of a row-parallel one) is cast once on its M/tp-token shard (``shard_cast_bytes``) and
    read by the other GEMM through an fp8 transpose copy of the gathered tensor
    (``FP8_TRANSPOSE_BYTES`` over M, in dW)."""
    r = fp8_recipe(recipe)
    a, (wf, wb) = r.act_cast_bytes, r.weight_cast_bytes
    x, dy, w = m * k, m * n, k * n  # elements: input, output gradient, weight
    fwd, dx, dw = a * x + wf * w, a * dy + wb * w, 0.0
    if tp > 1 and r.gathers_fp8:
        sx, sdy = r.shard_cast_bytes
        if style == "rowwise":  # dY crosses: cast once on the shard for dX, transposed for dW
            dx, dw = sdy * dy / tp + wb * w, FP8_TRANSPOSE_BYTES * dy
        else:  # x crosses: cast once on the shard in forward, transposed for dW
            fwd, dw = sx * x / tp + wf * w, FP8_TRANSPOSE_BYTES * x
    return fwd, dx, dw


def fp8_gathered_bytes(nbytes: float) -> float:
    """Bytes an all-gather of a 16-bit activation of ``nbytes`` moves when it is gathered in fp8
    (``Fp8Recipe.gathers_fp8``): one byte per element."""
    return nbytes / 2


def fp8_moe_cast_bytes(routed_tokens: float, expert_act_numel: float, recipe: str) -> tuple[float, float]:
    """(forward, backward) bytes of casting a MoE layer's expert GEMM operands under ``recipe``
    (module docstring): ``act_cast_bytes · routed_tokens · expert_act_numel / 2`` each; 0 where the
    recipe leaves the experts in bf16."""
    r = fp8_recipe(recipe)
    if not r.experts_fp8:
        return 0.0, 0.0
    half = r.act_cast_bytes * routed_tokens * expert_act_numel / 2
    return half, half


def fp8_amax_reduction_s(recipe: str, linears: int, group_size: int, cluster: ClusterSpec) -> tuple[float, float]:
    """(forward, backward) seconds per fp8_autocast region (a model chunk) per microbatch of the amax
    all-reduces of ``recipe`` (module docstring) on a rank holding ``linears`` converted linears,
    over an amax group of ``group_size`` consecutive ranks (tp x dp x cp); (0, 0) where the recipe
    reduces none or the group is one rank (TE skips a group of world size 1)."""
    r = fp8_recipe(recipe)
    if not r.amax_reductions or group_size <= 1 or linears <= 0:
        return 0.0, 0.0
    fwd = latency_bound_all_reduce_s(4 * FP8_META_FWD * linears, group_size, cluster)
    bwd = latency_bound_all_reduce_s(4 * FP8_META_BWD * linears, group_size, cluster)
    return fwd * (r.amax_reductions >= 1), bwd * (r.amax_reductions >= 2)


def fp8_sp_amax_reduction_s(recipe: str, modules: int, tp: int, cluster: ClusterSpec) -> tuple[float, float]:
    """(forward, backward) seconds per microbatch of TE current scaling's per-tensor amax all-reduces
    under sequence parallelism (module docstring, ``Fp8Recipe.sp_amax_reductions``) on a rank whose
    chunk holds ``modules`` Transformer Engine modules (one per distinct input of its converted
    linears: a fused QKV, the attention projection, a fused FC1, FC2), over its TP group of ``tp``
    consecutive ranks: Megatron's layers alternate a column-parallel module (its input reduced in
    forward) and a row-parallel one (its output gradient reduced in backward), so half of them each
    way, each one 4-byte ``comm.latency_bound_all_reduce_s``. (0, 0) for the other recipes or tp 1."""
    if not fp8_recipe(recipe).sp_amax_reductions or tp <= 1 or modules <= 0:
        return 0.0, 0.0
    one = latency_bound_all_reduce_s(4, tp, cluster)
    return modules / 2 * one, modules / 2 * one


def fp8_weight_copy_bytes(largest_linear_params: float) -> float:
    """Transient float8 copies (W and Wᵀ, 1 B/element) of the largest converted weight on a rank."""
    return 2.0 * largest_linear_params
