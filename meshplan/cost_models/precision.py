"""Training precision as a cost option: which dtypes a cluster runs, and what float8 training costs.

``TRAINING_DTYPES`` (``Plan.dtype``): "bf16" and "fp16" (16-bit mixed precision: fp32 master
weights, 16-bit compute and activations), "fp32", and "fp8" = torchao float8 training
(``torchao.float8.convert_to_float8_training``, as torchtitan's ``float8`` converter applies it):

- **which GEMMs**: every ``nn.Linear`` whose in/out features are multiples of 16 (the float8
  GEMM's alignment) except the LM head (torchtitan's default ``filter_fqns=["output"]``); all
  three GEMMs of such a linear (forward, input gradient, weight gradient) run on the FP8 tensor
  cores at ``ClusterSpec.peak("fp8")``. Attention (SDPA), norms, activations and the head stay in
  bf16, and so do the tensors between ops: activation memory is that of bf16.
- **scaling overhead**, by recipe (``FP8_RECIPES``, the engine profile's ``fp8_recipe``; every
  pass memory bound at the HBM roofline, ``fp8_cast_bytes``):

  * ``"tensorwise"``: torchao's dynamic tensorwise scaling as torchtitan runs it (eager). The
    autograd function ``matmul_with_hp_or_float8_args`` (torchao ``float8/float8_linear.py``)
    casts six operands per linear, each an amax pass (read 2 B) and a cast (read 2, write 1):
    x and W in forward, dY and W for dX, dY and x for dW (``FP8_DYNAMIC_CAST_BYTES`` 5 B/element).
    Under tensor parallelism torchtitan's ``Float8ColwiseParallel`` / ``PrepareFloat8ModuleInput``
    / ``Float8RowwiseParallel`` (torchao ``float8/float8_tensor_parallel.py``) cast the operand
    that crosses the TP group (x of a column-parallel linear, dY of a row-parallel one) on the
    rank's sequence shard, 1/tp of the tokens, before an fp8 all-gather; the linear then finds it
    already cast (``tensor_already_casted_to_fp8``) and its other GEMM reads it through a
    transpose copy (read 1, write 1: ``FP8_TRANSPOSE_BYTES``).
  * ``"rowwise"``: torchao's dynamic rowwise scaling (torchtitan 0.3's ``Float8LinearConverter``
    default ``recipe_name = "rowwise"``): the same six dynamic casts (the scale per row, the
    column-major operands scaled again along the other dimension), no fp8 all-gather under TP
    (torchao ``_float8_linear_supports_float8_allgather``: tensorwise only). The rowwise-scaled
    GEMM's lower throughput than tensorwise is not modelled.
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
  * ``"current"``: TE ``Float8CurrentScaling`` (Megatron ``--fp8-recipe tensorwise``,
    Megatron-Bridge / NeMo ``fp8_cs``; ``fp8_utils.py``): as ``"delayed"`` plus an amax pass
    (read 2) before each activation cast, the scale of this step's tensor.
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
  (``comm.group_collective_s``: latency-bound, the bytes are a few KiB). The fused history
  update after each (``fused_amax_and_scale_update_after_reduction``: read and roll the 1,024-long
  histories, ~8 KiB per tensor) is a sub-microsecond memory pass and not charged; nor is a
  recomputed forward's exit (the NeMo rows do not recompute). The other recipes' amax
  all-reduces (torchao's per-cast DTensor reductions, TE current scaling's) are not charged.
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

from meshplan.cost_models.comm import group_collective_s
from meshplan.cost_models.hardware import ClusterSpec

TRAINING_DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32", "fp8")
#: float8 GEMMs need every dimension a multiple of this (torchao float8 / cuBLASLt FP8)
FP8_ALIGN = 16
#: bytes per element of a dynamic cast: an amax pass (read 2) and the cast (read 2, write 1)
FP8_DYNAMIC_CAST_BYTES = 5
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
    #: bytes per element of casting an activation operand (x, dY) for both GEMMs that read it
    act_cast_bytes: int
    #: the weight is cast every microbatch (torchao: per GEMM, 2 casts) or once per step (TE: cached)
    weight_casts_per_microbatch: int
    #: torchao-style per-GEMM casts: x and dY are cast again for dW (act_cast_bytes each)
    recast_for_wgrad: bool
    #: under TP the operand crossing the group is cast on the rank's 1/tp sequence shard
    cast_on_tp_shard: bool
    source: str
    #: the MoE experts' grouped GEMMs run in fp8 too (TE GroupedLinear); torchao's float8 converter
    #: swaps nn.Linear only, so grouped experts stay bf16
    experts_fp8: bool = False
    #: a linear keeps its fp8-cast input for the weight-gradient GEMM (TE ``linear.py``: ``saved_inputmat =
    #: inputmat``, 1 B/element), not the bf16 one (torchao saves ``input_hp``): ``engine_saves.saved_bytes_delta``
    saves_fp8_inputs: bool = False
    #: blocking amax all-reduces over the tp x dp x cp group per fp8_autocast region (a model chunk) per
    #: microbatch: TE DelayedScaling 2 (forward at the region's exit, backward in its first module's backward)
    amax_reductions: int = 0


FP8_RECIPES: dict[str, Fp8Recipe] = {r.name: r for r in (
    Fp8Recipe("tensorwise", FP8_DYNAMIC_CAST_BYTES, 2, True, True,
              "torchao float8/float8_linear.py matmul_with_hp_or_float8_args (hp_tensor_to_float8_dynamic per GEMM "
              "operand); float8/float8_tensor_parallel.py Float8ColwiseParallel / PrepareFloat8ModuleInput / "
              "Float8RowwiseParallel (cast on the shard, fp8 all-gather)"),
    Fp8Recipe("rowwise", FP8_DYNAMIC_CAST_BYTES, 2, True, False,
              "torchtitan components/quantization/float8.py Float8LinearConverter.Config recipe_name default "
              "'rowwise'; torchao float8_tensor_parallel.py _float8_linear_supports_float8_allgather (tensorwise only)"),
    Fp8Recipe("delayed", FP8_CAST_TRANSPOSE_BYTES, 0, False, False,
              "Megatron-Core transformer_config.py fp8_recipe default 'delayed', fp8_utils.py TEDelayedScaling; "
              "TE cast_transpose (amax inside the kernel); extensions/transformer_engine.py is_first_microbatch "
              "(weights cast once per step); TE v1.9 fp8.py fp8_autocast_exit / module/base.py "
              "reduce_and_update_bwd_fp8_tensors (amax all-reduce per region exit, forward and backward)",
              experts_fp8=True, saves_fp8_inputs=True, amax_reductions=2),
    Fp8Recipe("current", FP8_AMAX_BYTES + FP8_CAST_TRANSPOSE_BYTES, 0, False, False,
              "Megatron-Core fp8_utils.py Float8CurrentScaling (--fp8-recipe tensorwise; Megatron-Bridge fp8_cs): "
              "an amax pass, then cast_transpose; weights cached as 'delayed'", experts_fp8=True,
              saves_fp8_inputs=True),
    Fp8Recipe("blockwise", 2 * 3, 0, False, False,
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

        tensorwise   fwd  c·M·K + c·K·N       dX  c·M·N + c·K·N       dW  c·M·N + c·M·K      (c = 5)
        delayed /    fwd  a·M·K               dX  a·M·N               dW  0                  (a = 4, 6, 6)
        current / blockwise                   (weights: once per step, cached)

    ``tp`` > 1 with ``style`` (``efficiency.linear_gemm_dims``: "rowwise" splits K, else N) and a
    recipe that casts on the TP shard (tensorwise): the crossing operand (x of a column-parallel
    linear, dY of a row-parallel one) is cast once on M/tp tokens and read by the other GEMM through
    an fp8 transpose copy (2 B/element over M)."""
    r = fp8_recipe(recipe)
    c, w = r.act_cast_bytes, r.weight_casts_per_microbatch
    x, dy = m * k, m * n  # activation operand elements: input, output gradient
    if not r.recast_for_wgrad:
        return c * x, c * dy, 0.0
    wf, wb = (c * k * n if w >= 1 else 0.0), (c * k * n if w >= 2 else 0.0)  # W for forward, Wᵀ for dX
    fwd, dx, dw = c * x + wf, c * dy + wb, c * dy + c * x
    if tp > 1 and r.cast_on_tp_shard:
        if style == "rowwise":  # dY crosses: cast once on the shard for dX, transposed for dW
            dx, dw = dx - c * dy + c * dy / tp, dw - c * dy + FP8_TRANSPOSE_BYTES * dy
        else:  # x crosses: cast once on the shard in forward, transposed for dW
            fwd, dw = fwd - c * x + c * x / tp, dw - c * x + FP8_TRANSPOSE_BYTES * x
    return fwd, dx, dw


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
    fwd = group_collective_s("all_reduce", 4 * FP8_META_FWD * linears, group_size, cluster)
    bwd = group_collective_s("all_reduce", 4 * FP8_META_BWD * linears, group_size, cluster)
    return fwd * (r.amax_reductions >= 1), bwd * (r.amax_reductions >= 2)


def fp8_weight_copy_bytes(largest_linear_params: float) -> float:
    """Transient float8 copies (W and Wᵀ, 1 B/element) of the largest converted weight on a rank."""
    return 2.0 * largest_linear_params
