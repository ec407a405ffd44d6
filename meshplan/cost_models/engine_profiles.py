"""Engine conventions as named, frozen profiles: how an engine (and version) runs what a
configuration does not say.

A parallel configuration (degrees, microbatch, schedule, recompute kind, data-parallel kind,
sequence parallelism, precision) is priced differently by the engine that runs it: how it keeps
the model states, what its pipeline runtime holds per microbatch, which kernels it runs for
attention, norms, the loss and the optimizer, how its data-parallel wrapper syncs gradients, what
a sharded step gathers at once and how it cuts layers into stages. Each of those is one field of
``EngineProfile``, with the values the cost model knows (the tables named per field), and each
profile in ``PROFILES`` traces every field to the engine's source (``EngineProfile.sources``:
file and default at the version named).

``meshplan estimate --from-*`` / ``--target``, ``planner.api.estimate_graph(profile=)`` /
``plan_graph(profile=)`` and the published-case benchmark take a profile by name; a published case
names its engine and version (``"engine"``; a version the repo has no profile for takes its
family's latest not newer, ``resolve``, and says so) and sets only its own run flags (``RUN_FLAGS``: what
its command line or config file says, e.g. ``--DDP-impl torch``), never an engine default.
No torch import.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass

from meshplan.cost_models.allocator import PP_BUFFERS
from meshplan.cost_models.cp_kernels import CP_ROTATES
from meshplan.cost_models.dp_kinds import (
    FSDP_UNITS,
    MAIN_GRADS,
    STATE_LAYOUTS,
    ZERO1_IMPLS,
    ZERO3_IMPLS,
    ZERO_STAGE,
)
from meshplan.cost_models.eager_ops import ATTENTION_IMPLS, NORM_KERNELS, OPTIMIZER_IMPLS, RUNTIME_NORM_KERNEL
from meshplan.cost_models.engine_saves import CUDA_GRAPH_SCOPES, GLU_KERNELS, MOE_COMBINES, RECOMPUTE_MODULES
from meshplan.cost_models.epcp import MOE_DISPATCHERS
from meshplan.cost_models.grad_sync import DDP_IMPLS
from meshplan.cost_models.megatron_sources import (
    MEGATRON_2022,
    MEGATRON_2023,
    MEGATRON_CORE_2023_12,
    MEGATRON_CORE_2024_04,
)
from meshplan.cost_models.memory import LOSS_KERNELS, SP_SAVES
from meshplan.cost_models.precision import DEFAULT_FP8_RECIPE, FP8_RECIPES

#: the fused attention kernels an engine may run (hardware.with_attention_backend)
ATTENTION_BACKENDS = ("flash", "cudnn")
#: stage split rules (``partition.engine_split.SPLIT_RULES``; not imported: partition sits above cost_models)
SPLIT_RULES = ("any", "even", "first_last", "fewer_first_last")

#: how long autocast's weight cache lives (``EngineProfile.autocast_cache``)
AUTOCAST_CACHES = ("call", "step")
#: what one activation-checkpoint region re-runs under pipeline parallelism (``EngineProfile.recompute_unit``)
RECOMPUTE_UNITS = ("block", "stage")

#: the dtype an engine's data-parallel gradient collectives move (``EngineProfile.grad_reduce``):
#: "fp32" (FSDP2's ``reduce_dtype=float32``, DDP on fp32 gradients: meshplan's runtime, torchtitan) or
#: "param" (the gathered parameters' training dtype: torch FSDP1 with a low-precision ``param_dtype``
#: and no ``reduce_dtype``). Prices the collectives' bytes only, not the memory of the buffers.
GRAD_REDUCES = ("fp32", "param")

#: fields a run may set from its own command line / config file (the case cites the line); the
#: engine's default otherwise
RUN_FLAGS = ("ddp_impl", "norm_kernel", "split_rule", "fp8_recipe", "moe_dispatcher", "tp_comm_overlap", "main_grads",
             "recompute_modules", "cuda_graph_scope")


@dataclass(frozen=True)
class EngineProfile:
    """How one engine version runs a configuration. Fields and the cost-model tables of their values:

    - ``state_layout`` (``dp_kinds.STATE_LAYOUTS``): "torch" fp32 parameters, gradients and Adam
      states; "megatron" 16-bit weights + fp32 main gradients + fp32 master weights and states;
      "zero" the ZeRO paper's 2 + 2 + 12 bytes per parameter.
    - ``pp_buffers`` (``allocator.PP_BUFFERS``): what the pipeline runtime keeps per microbatch.
    - ``sp_saves`` (``memory.SP_SAVES``): what a column-parallel linear saves under SP.
    - ``fsdp_units`` (``dp_kinds.FSDP_UNITS``): what a sharded step gathers at once.
    - ``zero3_impl`` (``dp_kinds.ZERO3_IMPLS``): how a ZeRO-3 step runs its collectives: FSDP2's
      per-unit gathers and reduce-scatter, or DeepSpeed 2021's per-tensor gathers (again in a full
      recompute's re-run) and 16-bit gradient all-reduce.
    - ``zero1_impl`` (``dp_kinds.ZERO1_IMPLS``): ZeRO-1 on flat buckets ("bucketed": Megatron's
      distributed optimizer, DeepSpeed) or torch's ZeroRedundancyOptimizer over DDP ("torch":
      DDP's all-reduce, then one broadcast per parameter tensor after the update).
    - ``norm_kernel``, ``optimizer_impl``, ``attention_impl`` (``eager_ops``): the kernels run.
    - ``ddp_impl`` (``grad_sync.DDP_IMPLS``): bucketed and overlapped ("torch") or one flat
      all-reduce after backward ("local", Megatron-LM's own wrapper).
    - ``loss_kernel`` (``memory.LOSS_KERNELS``; None = F.cross_entropy as meshplan's runtime runs it).
    - ``vocab_parallel_embedding``: the token embedding sharded over the vocabulary under TP.
    - ``pp_scatter_gather``: stage-to-stage sends split 1/tp and re-gathered (Megatron-LM 2021).
    - ``split_rule`` (``partition.engine_split.SPLIT_RULES``): how the engine cuts layers into stages.
    - ``fp8_recipe`` (``precision.FP8_RECIPES``): how fp8 training scales and casts a linear's
      operands (the engine's default; a run's ``--fp8-recipe`` is a run flag).
    - ``glu_kernel`` (``engine_saves.GLU_KERNELS``): a gated MLP's activation as traced ("eager") or
      Megatron-Core's fused bias_swiglu ("fused": keeps only the fc1 output for backward).
    - ``tp_comm_overlap``: TE userbuffers run the sequence-parallel TP collectives inside the GEMMs
      (``engine_saves.exposed_tp_comm_s``). Also a run flag: Megatron-LM's ``--tp-comm-overlap``
      (store_true, off by default; core_v0.8.0 ``megatron/training/arguments.py``).
    - ``fused_projections``: q/k/v (and a gated MLP's gate/up) run as one GEMM of the summed outputs
      (``engine_saves.fused_linears``), as Megatron-Core's ``linear_qkv`` / ``linear_fc1``.
    - ``shard_over_cp``: a sharded DP kind shards the model states over dp x cp (torchtitan's FSDP
      mesh folds the context-parallel ranks in; Megatron-Core's distributed optimizer, zero1, shards
      over its dp x cp group; meshplan's runtime too, at ep = 1), not over dp alone with cp ranks
      holding copies whose gradients are all-reduced separately.
    - ``moe_dispatcher`` (``epcp.MOE_DISPATCHERS``): how a MoE layer's tokens reach their experts' ranks
      ("alltoall": a copy per routed expert; "flex": a copy per destination rank, DeepEP / HybridEP). A
      run flag (``--moe-token-dispatcher-type``); Megatron-Core's own default, "allgather", is not
      modelled and is costed as "alltoall".
    - ``autocast_cache`` (``AUTOCAST_CACHES``): where a run computes under ``torch.autocast`` on fp32
      parameters, how long autocast's weight cache lives: one forward call ("call": a copy of each
      weight per microbatch in flight) or the whole pipeline step ("step": one copy per stage).
    - ``recompute_unit`` (``RECOMPUTE_UNITS``): under full / op recompute with pp > 1, what one
      checkpoint region re-runs in backward: one repeated block ("block": torchtitan's per-block
      wrappers, Megatron's ``recompute_num_layers`` = 1, meshplan's runtime's ``block_checkpoint``;
      under a split backward torch's checkpoint re-runs a block in the input pass and again in the
      weight pass, ``planner.kind_free``) or the whole stage ("stage": every layer of the stage
      rematerialized at once, beside each other; meshplan's runtime before per-block checkpointing,
      no profile now).
    - ``cp_rotate`` (``cp_kernels.CP_ROTATES``): how context parallelism's ring attention moves key /
      value blocks and what else it runs: "ring" (Megatron-Core / TE's p2p ring: bf16 shifts
      overlapped step by step, the gradient sent back), "ring-dkv" (meshplan's runtime: the same
      p2p shifts, the backward re-sending key / value and an fp32 dK/dV accumulator, its merge
      passes) or torch's context_parallel ("allgather" / "alltoall", its
      ``_cp_options.rotate_method``: the rotation, dK/dV sent in fp32, its merge passes).
    - ``attention_backend``: the fused attention kernel the engine runs ("flash": the cluster's own,
      torch SDPA's FlashAttention-2; "cudnn": Transformer Engine's FusedAttention, which TE selects
      over FlashAttention on Hopper: ``hardware.with_attention_backend``).
    - ``main_grads`` (``dp_kinds.MAIN_GRADS``; None = the state layout's own rule,
      ``dp_kinds.state_precision``): the dtype of the gradient buffer a 16-bit run accumulates into
      and reduces, "fp32" or "16-bit". Set per recipe as much as per engine (Megatron-Core's
      ``grad_reduce_in_fp32``, NeMo's ``optim.grad_sync_dtype``, Megatron-LM's
      ``--accumulate-allreduce-grads-in-fp32``), so also a run flag: a run whose recipe or command
      line departs from its profile's default sets it and cites the line.
    - ``grad_reduce`` (``GRAD_REDUCES``): the dtype the data-parallel gradient collectives move, "fp32"
      or "param" (the training dtype: torch FSDP1 under a 16-bit ``param_dtype`` without
      ``reduce_dtype``, as Composer runs it); the bytes of the collectives only.
    - ``dp_kinds`` (``dp_kinds.ZERO_STAGE``'s keys): the data-parallel kinds the engine version runs;
      ``estimate`` refuses a pinned kind outside them and no search proposes one (Megatron-LM before
      its distributed optimizer has no zero1, none of its versions a zero2 of its own).
    - ``moe_combine`` (``engine_saves.MOE_COMBINES``): where a MoE layer's routing probabilities meet
      its experts' output, so what of that output is kept for backward ("index_add": the eager
      block; "unpermute": Megatron-Core to 0.12; "in_act": inside Megatron-Core's fused activation,
      from 2025-04). With ``glu_kernel`` it sets what the experts keep (``engine_saves.moe_saved_delta``).
    - ``recompute_modules`` (``engine_saves.RECOMPUTE_MODULES``): what recompute "selective" re-runs:
      Megatron-Core's ``--recompute-modules`` (default ``core_attn``, the attention core; meshplan's
      runtime and torchtitan's "selective" mean the same); a run flag. "moe_act" and "layernorm":
      ``engine_saves`` module docstring.
    - ``cuda_graph_scope`` (``engine_saves.CUDA_GRAPH_SCOPES``): the parts of a layer the run captures
      in CUDA graphs (Megatron-Core ``--cuda-graph-scope``; a run flag): it can turn a recompute
      module off (``engine_saves.layernorm_recomputed``).
    """

    name: str
    engine: str
    version: str
    state_layout: str = "torch"
    pp_buffers: str = "torch"
    sp_saves: str = "gathered"
    fsdp_units: str = "block"
    zero3_impl: str = "fsdp2"
    zero1_impl: str = "bucketed"
    norm_kernel: str = RUNTIME_NORM_KERNEL
    optimizer_impl: str = "fused"
    attention_impl: str = "flash"
    ddp_impl: str = "torch"
    loss_kernel: str | None = None
    vocab_parallel_embedding: bool = False
    pp_scatter_gather: bool = False
    split_rule: str = "any"
    fp8_recipe: str = DEFAULT_FP8_RECIPE
    glu_kernel: str = "eager"
    tp_comm_overlap: bool = False
    fused_projections: bool = False
    shard_over_cp: bool = False
    moe_dispatcher: str = "alltoall"
    autocast_cache: str = "call"
    recompute_unit: str = "block"
    cp_rotate: str = "ring"
    attention_backend: str = "flash"
    main_grads: str | None = None
    grad_reduce: str = "fp32"
    dp_kinds: tuple[str, ...] = tuple(ZERO_STAGE)
    moe_combine: str = "index_add"
    recompute_modules: tuple[str, ...] = ("core_attn",)
    cuda_graph_scope: tuple[str, ...] = ()
    #: (field, where the engine sets it: file and default at this version)
    sources: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for fname, allowed in (("state_layout", STATE_LAYOUTS), ("pp_buffers", PP_BUFFERS), ("sp_saves", SP_SAVES),
                               ("fsdp_units", FSDP_UNITS), ("zero3_impl", ZERO3_IMPLS), ("zero1_impl", ZERO1_IMPLS),
                               ("norm_kernel", NORM_KERNELS),
                               ("optimizer_impl", OPTIMIZER_IMPLS), ("attention_impl", ATTENTION_IMPLS),
                               ("ddp_impl", DDP_IMPLS), ("split_rule", SPLIT_RULES),
                               ("fp8_recipe", tuple(FP8_RECIPES)), ("glu_kernel", GLU_KERNELS),
                               ("moe_dispatcher", MOE_DISPATCHERS), ("autocast_cache", AUTOCAST_CACHES),
                               ("recompute_unit", RECOMPUTE_UNITS),
                               ("cp_rotate", CP_ROTATES), ("attention_backend", ATTENTION_BACKENDS),
                               ("moe_combine", MOE_COMBINES), ("grad_reduce", GRAD_REDUCES)):  # fmt: skip
            if getattr(self, fname) not in allowed:
                raise ValueError(f"engine profile {self.name!r}: {fname} must be one of {', '.join(allowed)}, "
                                 f"got {getattr(self, fname)!r}")  # fmt: skip
        if self.main_grads is not None and (self.main_grads not in MAIN_GRADS
                                            or (self.state_layout == "torch" and self.main_grads != "fp32")):
            raise ValueError(f"engine profile {self.name!r}: main_grads must be None or one of {', '.join(MAIN_GRADS)} "
                             f"('fp32' under the 'torch' state layout), got {self.main_grads!r}")  # fmt: skip
        if "none" not in self.dp_kinds or not set(self.dp_kinds) <= set(ZERO_STAGE):
            raise ValueError(f"engine profile {self.name!r}: dp_kinds must hold 'none' and only "
                             f"{', '.join(ZERO_STAGE)}, got {self.dp_kinds!r}")  # fmt: skip
        for fname, allowed in (("recompute_modules", RECOMPUTE_MODULES), ("cuda_graph_scope", CUDA_GRAPH_SCOPES)):
            vals = getattr(self, fname)
            bad = [v for v in vals if v not in allowed] if isinstance(vals, tuple) else [vals]
            if bad:
                raise ValueError(f"engine profile {self.name!r}: {fname} must be a tuple of {', '.join(allowed)}, "
                                 f"got {vals!r}")  # fmt: skip
        if self.loss_kernel is not None and self.loss_kernel not in LOSS_KERNELS:
            raise ValueError(f"engine profile {self.name!r}: loss_kernel must be None or one of "
                             f"{', '.join(LOSS_KERNELS)}, got {self.loss_kernel!r}")  # fmt: skip

    def with_run_flags(self, **flags: str | bool | tuple[str, ...]) -> EngineProfile:
        """This profile with a run's own flags (``RUN_FLAGS`` only: a run's command line or config
        file may set them; an engine convention it may not)."""
        bad = sorted(set(flags) - set(RUN_FLAGS))
        if bad:
            raise ValueError(f"{', '.join(bad)} is an engine convention, not a run flag: name the engine profile "
                             f"that has it (run flags: {', '.join(RUN_FLAGS)})")  # fmt: skip
        return dataclasses.replace(self, **flags) if flags else self

    def check_dp_kind(self, kind: str | None, dp: int = 2) -> None:
        """Refuse, in one line, a data-parallel kind this engine version does not run (``dp_kinds``)."""
        if kind is not None and dp > 1 and kind not in self.dp_kinds:
            raise ValueError(f"dp_kind {kind!r}: engine profile {self.name!r} ({self.version}) has no such kind; it runs "
                             f"{', '.join(k for k in self.dp_kinds if k != 'none')} (its sources' dp_kinds line)")  # fmt: skip

    def but(self, **changes: object) -> EngineProfile:
        """A variant (tests, what-if costings): any field changed, named after this one."""
        return dataclasses.replace(self, **{"name": f"{self.name}*", **changes})  # type: ignore[arg-type]


_MESHPLAN = EngineProfile(
    "meshplan", "meshplan", "this repository", pp_buffers="in-flight", zero1_impl="torch", autocast_cache="step",
    shard_over_cp=True, recompute_unit="block", cp_rotate="ring-dkv",
    sources=(
        ("cp_rotate", "runtime/apply/ring_attention.py: one fused attention kernel per ring step (flash on CPU, "
                      "efficient on CUDA) in one autograd Function; forward [k; v] cp - 1 p2p shifts, backward "
                      "[k; v] again cp - 1 and the fp32 [dk; dv] accumulator cp shifts"),
        ("recompute_unit", "runtime/apply/block_checkpoint.py checkpoint_stage_blocks: at pp > 1 each block of a "
                           "stage's fx graph (the outermost nn.ModuleList child on a node's nn_module_stack) is "
                           "moved into a BlockCheckpoint run under torch.utils.checkpoint (use_reentrant=False); "
                           "called from runtime/apply/recompute.py apply_recompute"),
        ("autocast_cache", "runtime/apply/parallel_model.py ParallelModel.step: schedule.step inside "
                           "precision.step_cast_cache, one torch.autocast region over the step (recompute none / "
                           "selective): autocast's cache casts each fp32 weight once per step"),
        ("shard_over_cp", "runtime/apply/data_parallel.py state_mesh: under cp > 1 (ep = 1) fsdp / zero2 / hsdp "
                          "fully_shard over the (dp, cp) submesh flattened into 'dp_cp' (DeviceMesh._flatten); "
                          "runtime/apply/api.py: zero1's ZeroRedundancyOptimizer over the dp x cp group"),
        ("zero1_impl", "runtime/apply/zero1.py: torch ZeroRedundancyOptimizer (parameters_as_bucket_view=False) "
                       "over DDP: one broadcast per parameter tensor after the update"),
        ("state_layout", "runtime/loop optimizer: torch.optim.AdamW over fp32 parameters (FSDP2 MixedPrecisionPolicy "
                         "param bf16 / reduce fp32 keeps fp32 shards)"),
        ("pp_buffers", "runtime/apply/schedules.InFlightStage: torch.distributed.pipelining stages whose receive "
                       "buffers follow the microbatches in flight, a sent output's storage not cached (_OutputRoot: the backward "
                       "starts from an empty stand-in, as Megatron's deallocate_output_tensor) (allocator.PP_BUFFERS "
                       "'in-flight')"),
        ("norm_kernel", "eager_ops.RUNTIME_NORM_KERNEL: a Python RMSNorm run as its ops (no torch.compile unless --compile)"),
        ("optimizer_impl", "AdamW(fused=True) on CUDA"),
        ("attention_impl", "F.scaled_dot_product_attention (flash kernel)"),
        ("ddp_impl", "torch DDP / bucketed manual all-reduce overlapped with backward"),
        ("vocab_parallel_embedding", "the TP placement ILP chooses the embedding's style (tp.strategies)"),
        ("fsdp_units", "runtime/apply/data_parallel.wrap_dp: fully_shard per repeated block, then the root (every "
                       "other layer)"),
    ),
)  # fmt: skip

_TITAN_2024 = (
    ("recompute_unit", "apply_ac: checkpoint_wrapper per TransformerBlock of model.layers (each stage's model "
                       "under pipelining; 0.3.0 distributed/activation_checkpoint.py apply: _wrap_block per block)"),
    ("state_layout", "FSDP2 fully_shard with MixedPrecisionPolicy(param bf16, reduce fp32): fp32 sharded "
                     "parameters and AdamW states"),
    ("pp_buffers", "torch.distributed.pipelining schedule.step() keeps the last stage's outputs "
                   "(allocator.PP_BUFFERS 'torch-outputs')"),
    ("sp_saves", "torch TP ColwiseParallel after SequenceParallel: the linear saves its all-gathered input"),
    ("fsdp_units", "parallelize_llama.apply_fsdp: fully_shard per TransformerBlock, then fully_shard(model): the root "
                   "holds tok_embeddings, norm and output"),
    ("attention_impl", "models/llama/model.py: F.scaled_dot_product_attention"),
    ("vocab_parallel_embedding", "parallelize_llama.apply_tp: tok_embeddings RowwiseParallel, output ColwiseParallel, "
                                 "loss_parallel"),
    ("split_rule", "pipeline split: even layers, fewer in the first / last stage (engines.spec.CAPS)"),
    ("fp8_recipe", "float8 converter: torchao Float8LinearConfig() (tensorwise dynamic scaling); parallelize_llama "
                   "apply_tp: Float8ColwiseParallel / Float8RowwiseParallel / PrepareFloat8ModuleInput under TP"),
    ("zero1_impl", "none used: torchtitan shards with FSDP2 only (no ZeroRedundancyOptimizer); a zero1 costing "
                   "of it is the bucketed reduce-scatter + all-gather"),
    ("autocast_cache", "train.py maybe_enable_amp: torch.autocast around each model forward, and only without "
                       "FSDP and pipeline parallelism (config: mixed precision via autocast under DDP / one "
                       "device): one region per call"),
)  # fmt: skip

#: Megatron-LM's fused QKV before Megatron-Core (the 2021 code the SC'21 scripts ran, and the
#: Megatron-DeepSpeed fork of it)
_FUSED_QKV_2021 = ("fused_projections", "megatron/model/transformer.py ParallelAttention.query_key_value (6985e58 "
                                        "line 140): one ColumnParallelLinear of 3 x projection size (q, k, v in one "
                                        "GEMM and one weight tensor)")

_MEGATRON_2021 = (
    ("recompute_unit", "megatron/model/transformer.py ParallelTransformer._checkpointed_forward: chunks of "
                       "--checkpoint-num-layers layers (default 1) per checkpoint, within each stage"),
    ("state_layout", "megatron/optimizer: fp16 model + fp32 main gradients + fp32 master weights and Adam states "
                     "(README: 18 bytes per parameter, no distributed optimizer yet)"),
    ("pp_buffers", "megatron/p2p_communication.py: torch.distributed p2p into the next stage's input tensor, "
                   "nothing kept per microbatch beyond the stage inputs"),
    ("sp_saves", "megatron/mpu/layers.py ColumnParallelLinear (SP from 2022: saves its shard, all-gathers in backward)"),
    ("norm_kernel", "apex FusedLayerNorm (megatron/model/fused_layer_norm.py)"),
    ("optimizer_impl", "apex.optimizers.FusedAdam (megatron/optimizer/__init__.py)"),
    ("ddp_impl", "megatron/arguments.py: --DDP-impl default='local' (one flat all-reduce after backward)"),
    ("loss_kernel", "megatron/mpu/cross_entropy.py vocab_parallel_cross_entropy: softmax kept in place"),
    ("vocab_parallel_embedding", "megatron/mpu/layers.py VocabParallelEmbedding"),
    ("split_rule", "megatron/model/transformer.py ParallelTransformer: num_layers // pipeline size per stage"),
    ("zero1_impl", "Megatron's distributed optimizer (--use-distributed-optimizer, megatron/core/optimizer/"
                   "distrib_optimizer.py): reduce-scatter of gradient buckets, all-gather of parameter buckets; "
                   "Megatron-DeepSpeed runs DeepSpeed's ZeRO-1 (deepspeed/runtime/zero/stage_1_and_2.py), bucketed "
                   "too; versions before the distributed optimizer have none and are costed the same"),
    ("autocast_cache", "none used: 16-bit model parameters (state_layout), no torch.autocast"),
    ("dp_kinds", "megatron/arguments.py (5281919, 6985e58): --DDP-impl local | torch, the states replicated; no "
                 "--use-distributed-optimizer (from d07d29d, 2022-06-08) and no ZeRO-2 / ZeRO-3 of its own"),
    ("shard_over_cp", "none used: no context parallelism before Megatron-Core core_v0.4.0 (2023); the Megatron-LM "
                      "and Megatron-DeepSpeed versions of these profiles have no cp degree (profiles from "
                      "megatron-core-2024 on trace their own)"),
)  # fmt: skip


#: Transformer Engine's attention backend choice on Hopper, shared by every TE-based profile
_TE_CUDNN_ATTENTION = (
    "attention_backend",
    "Transformer Engine DotProductAttention get_attention_backend (transformer_engine/pytorch/attention.py; "
    "dot_product_attention/utils.py in later releases): 'Disabling FlashAttention to give FusedAttention preference "
    "on Hopper+ for performance reasons' when both are available (cuDNN F16_arbitrary_seqlen); the TE release of "
    "each container not pinned here",
)


def _with(sources: tuple[tuple[str, str], ...], *extra: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    keys = {k for k, _ in extra}
    return tuple(s for s in sources if s[0] not in keys) + extra


PROFILES: dict[str, EngineProfile] = {p.name: p for p in (
    _MESHPLAN,
    EngineProfile(
        "torchtitan-2024.04", "torchtitan", "0413364 (2024-04)", pp_buffers="torch-outputs", norm_kernel="eager",
        optimizer_impl="foreach", vocab_parallel_embedding=True, split_rule="fewer_first_last",
        dp_kinds=("none", "fsdp"),
        sources=_with(_TITAN_2024,
                      ("dp_kinds", "parallelisms/parallelize_llama.py: under parallel_dims.dp_enabled fully_shard per "
                                   "block and the root: FSDP2 is its only data parallelism (no DDP, no HSDP)"),
                      ("norm_kernel", "config_manager.py --model.norm_type default 'rmsnorm' (models/norms.py RMSNorm: "
                                      "eager ops; a train config choosing 'fused_rmsnorm' is a run flag)"),
                      ("optimizer_impl", "train.py build_optimizer: torch.optim.AdamW(..., foreach=True)"),
                      ("shard_over_cp", "none used: parallelisms/__init__.py ParallelDims(dp, tp, pp) has no cp "
                                        "degree (context parallelism came with b19456a, 2024-10-22)")),
    ),
    EngineProfile(
        "torchtitan-2024.12", "torchtitan", "9dec370 (2024-12)", pp_buffers="torch-outputs", norm_kernel="eager",
        optimizer_impl="foreach", vocab_parallel_embedding=True, split_rule="fewer_first_last", shard_over_cp=True,
        cp_rotate="allgather", dp_kinds=("none", "ddp", "fsdp", "hsdp"),
        sources=_with(_TITAN_2024,
                      ("dp_kinds", "parallelisms/parallelize_llama.py: apply_fsdp over ('dp_shard_cp',) (fsdp) or "
                                   "('dp_replicate', 'dp_shard_cp') (hsdp), apply_ddp when dp_replicate alone (ddp); "
                                   "reshard_after_forward only off under pp (no zero2 of its own)"),
                      ("cp_rotate", "config_manager.py --experimental.context_parallel_rotate_method default "
                                    "'allgather' (utils.create_context_parallel_ctx: set_rotate_method; torch's "
                                    "context_parallel ring attention, _templated_ring_attention)"),
                      ("shard_over_cp", "parallelisms/parallelize_llama.py: fully_shard over dp_mesh_dim_names "
                                        "('dp_shard_cp',) when dp_shard or cp is enabled"),
                      ("norm_kernel", "train_configs/*.toml norm_type = 'rmsnorm' (models/norms.py: eager ops; "
                                      "torch.compile, a run flag, fuses them)"),
                      ("optimizer_impl", "torchtitan/optimizer.py build_optimizers: fused = optimizer.fused "
                                         "(default False), foreach = not fused")),
    ),
    EngineProfile(
        "torchtitan-2025.06", "torchtitan", "6b11290 (2025-06-27)", pp_buffers="torch-outputs", norm_kernel="eager",
        optimizer_impl="fused", vocab_parallel_embedding=True, split_rule="fewer_first_last", shard_over_cp=True,
        dp_kinds=("none", "ddp", "zero2", "fsdp", "hsdp"),
        sources=_with(_TITAN_2024,
                      ("dp_kinds", "models/llama3/infra/parallelize.py: apply_fsdp over dp_shard_cp (fsdp) or "
                                   "(dp_replicate, dp_shard_cp) (hsdp), apply_ddp (ddp); "
                                   "--parallelism.fsdp_reshard_after_forward 'never' keeps the gathered parameters "
                                   "to backward (zero2); no ZeRO-1"),
                      ("shard_over_cp", "models/llama3/infra/parallelize.py: fully_shard over world_mesh[('dp_shard_cp',)] "
                                        "(('dp_replicate', 'dp_shard_cp') under HSDP)"),
                      ("norm_kernel", "models/llama3/model/model.py TransformerBlock: nn.RMSNorm, whose CUDA path was "
                                      "still torch's composite ops (the fused _fused_rms_norm kernel, pytorch#153666, "
                                      "was pending on 2025-07-09: pytorch#157345); torch.compile, a run flag, fuses them"),
                      ("optimizer_impl", "config_manager.py Optimizer.implementation default 'fused'"),
                      ("split_rule", "distributed/pipeline.py generate_split_points: num_layers + input_weight 1 + "
                                     "output_weight 1 effective layers spread evenly (the first / last stage one fewer)"),
                      ("fp8_recipe", "components/quantization/float8.py: recipe_name default None -> torchao "
                                     "Float8LinearConfig() (tensorwise dynamic scaling)")),
    ),
    EngineProfile(
        "torchtitan-2026", "torchtitan", "0.3.0 (installed)", pp_buffers="torch-outputs", norm_kernel="fused",
        optimizer_impl="fused", vocab_parallel_embedding=True, split_rule="fewer_first_last", fp8_recipe="rowwise",
        shard_over_cp=True, cp_rotate="allgather", fsdp_units="block-ends",
        dp_kinds=("none", "ddp", "zero2", "fsdp", "hsdp"),
        sources=_with(_TITAN_2024,
                      ("dp_kinds", "distributed/fsdp.py apply_fsdp over the 'fsdp' mesh dim (fsdp) or "
                                   "(dp_replicate, dp_shard_cp) (hsdp), distributed/ddp.py (ddp); "
                                   "parallelism fsdp_reshard_after_forward 'never' keeps the gathered parameters "
                                   "to backward (zero2); no ZeRO-1"),
                      ("cp_rotate", "no rotate-method option: torch's context_parallel with its default "
                                    "_cp_options.rotate_method = ALL_GATHER (torch 2.13 "
                                    "distributed/tensor/experimental/_context_parallel/_attention.py)"),
                      ("shard_over_cp", "distributed/parallel_dims.py: the 'fsdp' mesh dim is dp_shard * cp "
                                        "(distributed/fsdp.py folds dp_shard and cp into one FSDP shard dim)"),
                      ("fp8_recipe", "components/quantization/float8.py Float8LinearConverter.Config recipe_name "
                                     "default 'rowwise' (torchao Float8LinearConfig.from_recipe_name)"),
                      ("norm_kernel", "models/common/nn_modules.py RMSNorm(nn.RMSNorm): torch's fused rms_norm kernel"),
                      ("optimizer_impl", "components/optimizer/optimizer.py Config.implementation default 'fused'"),
                      ("fsdp_units", "distributed/fsdp.py apply_fsdp_to_decoder: fully_shard(tok_embeddings), "
                                     "fully_shard([norm, lm_head], reshard_after_forward=False), one per transformer "
                                     "block, then the root (since 83e6941, 2025-07-28)")),
    ),
    EngineProfile(
        "megatron-lm-2020", "megatron", "5281919 (2020-09)", state_layout="megatron", pp_buffers="megatron",
        sp_saves="shard", norm_kernel="fused", attention_impl="eager", ddp_impl="local", loss_kernel="fused",
        vocab_parallel_embedding=True, split_rule="even", dp_kinds=("none", "ddp"), fused_projections=True,
        sources=_with(_MEGATRON_2021,
                      ("attention_impl", "megatron/model/transformer.py ParallelSelfAttention: torch.matmul scores, "
                                         "masked_fill_, torch.nn.Softmax, dropout, torch.matmul (no fused softmax)"),
                      ("fused_projections", "megatron/model/transformer.py ParallelSelfAttention.query_key_value "
                                            "(5281919 line 123): one ColumnParallelLinear of 3 x hidden (q, k, v in "
                                            "one GEMM and one weight tensor)")),
    ),
    EngineProfile(
        "megatron-lm-2021", "megatron", "6985e58 (2021, examples/sc21)", state_layout="megatron",
        pp_buffers="megatron", sp_saves="shard", norm_kernel="fused", attention_impl="unfused", ddp_impl="local",
        loss_kernel="fused", vocab_parallel_embedding=True, pp_scatter_gather=True, split_rule="even",
        dp_kinds=("none", "ddp"), fused_projections=True,
        sources=_with(_MEGATRON_2021, _FUSED_QKV_2021,
                      ("attention_impl", "megatron/model/transformer.py: baddbmm scores, FusedScaleMaskSoftmax, "
                                         "dropout, bmm (no flash kernel)"),
                      ("pp_scatter_gather", "megatron/arguments.py: scatter/gather on unless "
                                            "--no-scatter-gather-tensors-in-pipeline (p2p_communication.py)")),
    ),
    EngineProfile(
        "megatron-lm-2022", "megatron", "9aad920 (2022-05-20, merge of 'sequence_parallel'; Korthikanti et al. 2022)",
        state_layout="megatron", pp_buffers="megatron", sp_saves="shard", norm_kernel="fused",
        attention_impl="unfused", ddp_impl="local", loss_kernel="fused", vocab_parallel_embedding=True,
        pp_scatter_gather=True, split_rule="even", fused_projections=True, dp_kinds=("none", "ddp", "zero1"),
        sources=_with(MEGATRON_2022,
                      ("dp_kinds", "megatron/arguments.py --DDP-impl local | torch (replicated states); "
                                   "--use-distributed-optimizer from d07d29d (2022-06-08, inside the span this "
                                   "profile prices, 2022.05 on) -> zero1; no sharded gradients or parameters"),
                      ("zero1_impl", "none at this commit (megatron/arguments.py has no --use-distributed-optimizer "
                                     "until d07d29d, 2022-06-08: megatron/optimizer/distrib_optimizer.py, gradient "
                                     "buckets reduce-scattered, parameters all-gathered); a zero1 costing is that "
                                     "bucketed optimizer"))),
    EngineProfile(
        "megatron-lm-2023", "megatron", "tag 23.06 (4f8e9ac, 2023-06-28)", state_layout="megatron",
        pp_buffers="megatron", sp_saves="shard", norm_kernel="fused", attention_impl="unfused", ddp_impl="local",
        loss_kernel="fused", vocab_parallel_embedding=True, split_rule="even",
        fused_projections=True, dp_kinds=("none", "ddp", "zero1"),
        sources=_with(MEGATRON_2023,
                      ("attention_impl", "megatron/arguments.py --use-flash-attn store_true (off by default): "
                                         "megatron/model/transformer.py CoreAttention, torch.baddbmm scores, "
                                         "FusedScaleMaskSoftmax, bmm; a run with --use-flash-attn is "
                                         "megatron-lm-2023+flash"))),
    EngineProfile(
        "megatron-lm-2023+flash", "megatron", "tag 23.06 (4f8e9ac, 2023-06-28) run with --use-flash-attn",
        state_layout="megatron", pp_buffers="megatron", sp_saves="shard", norm_kernel="fused",
        attention_impl="flash", ddp_impl="local", loss_kernel="fused", vocab_parallel_embedding=True,
        split_rule="even", fused_projections=True, dp_kinds=("none", "ddp", "zero1"),
        sources=_with(MEGATRON_2023,
                      ("attention_impl", "megatron/arguments.py --use-flash-attn (a run flag, store_true) -> "
                                         "megatron/model/transformer.py ParallelAttention core_attention_flash = "
                                         "FlashSelfAttention (flash_attn_unpadded_func, flash-attn 1.x)"))),
    EngineProfile(
        "megatron-core-2023.12", "megatron", "Megatron-LM core_v0.4.0 (38879f8, 2023-12-11) - core_v0.5.0 (0acc240, "
        "2024-02-26), legacy model, --transformer-impl local", state_layout="megatron", pp_buffers="megatron",
        sp_saves="shard", norm_kernel="fused", attention_impl="unfused", ddp_impl="local", loss_kernel="fused",
        vocab_parallel_embedding=True, split_rule="even", fused_projections=True, shard_over_cp=True,
        fp8_recipe="delayed", dp_kinds=("none", "ddp", "zero1"), sources=MEGATRON_CORE_2023_12),
    EngineProfile(
        "megatron-core-2023.12+flash", "megatron", "core_v0.4.0 - core_v0.5.0 run with --use-flash-attn",
        state_layout="megatron", pp_buffers="megatron", sp_saves="shard", norm_kernel="fused", attention_impl="flash",
        ddp_impl="local", loss_kernel="fused", vocab_parallel_embedding=True, split_rule="even", fused_projections=True,
        shard_over_cp=True, fp8_recipe="delayed", dp_kinds=("none", "ddp", "zero1"),
        sources=_with(MEGATRON_CORE_2023_12,
                      ("attention_impl", "megatron/arguments.py --use-flash-attn (a run flag, store_true) -> "
                                         "megatron/model/transformer.py ParallelAttention core_attention_flash = "
                                         "FlashSelfAttention (flash_attn_varlen_func)"))),
    EngineProfile(
        "megatron-core-2024.04", "megatron", "Megatron-LM core_v0.6.0 (cac60ce, 2024-04-18) - core_v0.7.0 (a645f89, "
        "2024-05-30), --transformer-impl transformer_engine", state_layout="megatron", pp_buffers="megatron",
        sp_saves="shard", norm_kernel="fused", attention_impl="flash", ddp_impl="local", loss_kernel="fused",
        vocab_parallel_embedding=True, split_rule="even", fused_projections=True, shard_over_cp=True,
        fp8_recipe="delayed", attention_backend="cudnn", dp_kinds=("none", "ddp", "zero1"),
        sources=_with(MEGATRON_CORE_2024_04, _TE_CUDNN_ATTENTION)),
    EngineProfile(
        "megatron-lm-2021+zero3", "megatron", "6985e58 + DeepSpeed ZeRO-3 (SC'21 Table 2)", state_layout="megatron",
        pp_buffers="megatron", sp_saves="shard", fsdp_units="module", zero3_impl="deepspeed-2021", norm_kernel="fused",
        attention_impl="unfused", ddp_impl="local", loss_kernel="fused", vocab_parallel_embedding=True,
        split_rule="even", dp_kinds=("none", "ddp", "fsdp"), fused_projections=True,
        sources=_with(_MEGATRON_2021, _FUSED_QKV_2021,
                      ("attention_impl", "megatron/model/transformer.py (2021): baddbmm, FusedScaleMaskSoftmax, bmm"),
                      ("dp_kinds", "Megatron-LM's --DDP-impl (replicated states) or DeepSpeed ZeRO-3 (SC'21 Table 2: "
                                   "the ZeRO-3 rows); no distributed optimizer of its own"),
                      ("fsdp_units", "deepspeed/runtime/zero/stage3.py: parameters fetched per submodule by "
                                     "forward/backward pre-hooks (partitioned_param_coordinator)"),
                      ("zero3_impl", "DeepSpeed v0.3.14 (April 2021): stage3.py fetch_sub_module on every submodule "
                                     "forward, a checkpointed re-run included, release_sub_module after it; "
                                     "partition_parameters.py _allgather_param: one all_gather per parameter; "
                                     "zero/constants.py ZERO3_OPTIMIZATION_CONTIGUOUS_GRADIENTS_DEFAULT False -> "
                                     "stage3.py buffered_reduce_fallback: dist.all_reduce of 16-bit gradients; "
                                     "_synchronize_communication: torch.cuda.synchronize() before each prefetch, and "
                                     "_allgather_param: torch.zeros + torch.cuda.synchronize() + one narrow per rank "
                                     "(for i in range(self.world_size)) on the host, the device idle")),
    ),
    EngineProfile(
        "megatron-deepspeed-2022", "megatron", "Megatron-DeepSpeed (MT-NLG 2021, BLOOM 2022)", state_layout="megatron",
        pp_buffers="megatron", sp_saves="shard", norm_kernel="fused", attention_impl="unfused", ddp_impl="torch",
        loss_kernel="fused", vocab_parallel_embedding=True, split_rule="even", dp_kinds=("none", "ddp", "zero1"),
        fused_projections=True,
        sources=_with(_MEGATRON_2021, _FUSED_QKV_2021,
                      ("attention_impl", "megatron/model/transformer.py: baddbmm, FusedScaleMaskSoftmax, bmm"),
                      ("dp_kinds", "DeepSpeed ZeRO-1 beside its pipeline engine: deepspeed/runtime/pipe/engine.py "
                                   "asserts zero_optimization_stage() < ZeroStageEnum.gradients ('ZeRO-2 and ZeRO-3 are "
                                   "incompatible with pipeline parallelism'); MT-NLG and BLOOM ran ZeRO-1"),
                      ("pp_buffers", "deepspeed/runtime/pipe/engine.py: p2p of whole activations, buffers per "
                                     "in-flight microbatch only"),
                      ("ddp_impl", "DeepSpeed engine: gradient all-reduce in buckets (allreduce_bucket_size), "
                                   "ZeRO-1 reduce-scatter overlapped"),
                      ("split_rule", "deepspeed/runtime/pipe/module.py PipelineModule partition_method "
                                     "(--pp-partition-method in the run's flags)")),
    ),
    EngineProfile(
        "megatron-core-2024", "megatron", "core_v0.8 (2024)", state_layout="megatron", pp_buffers="megatron",
        sp_saves="shard", norm_kernel="fused", attention_impl="flash", ddp_impl="torch", loss_kernel="fused",
        vocab_parallel_embedding=True, split_rule="first_last", fp8_recipe="delayed", glu_kernel="fused",
        fused_projections=True, shard_over_cp=True, attention_backend="cudnn", dp_kinds=("none", "ddp", "zero1"),
        moe_combine="unpermute",
        sources=_with(_MEGATRON_2021,
                      ("moe_combine", "core_v0.8.0 megatron/core/transformer/moe/moe_utils.py unpermute: probs * permuted_tokens (the experts' output kept for the probabilities' gradient); experts.py TEGroupedMLP bias_swiglu_impl (glu_kernel)"),
                      _TE_CUDNN_ATTENTION,
                      ("main_grads", "None, the megatron layout's rule: core_v0.8.0 megatron/training/arguments.py "
                                     "under --bf16 forces accumulate_allreduce_grads_in_fp32 = True (fp32 grad buffers, "
                                     "megatron/core/distributed/distributed_data_parallel.py grad_dtype = torch.float if "
                                     "grad_reduce_in_fp32)"),
                      ("dp_kinds", "core_v0.8.0 megatron/training/arguments.py --use-distributed-optimizer (zero1); no "
                                   "sharded gradients or parameters (--use-torch-fsdp2 arrives with e1993fa, 2024-11-13)"),
                      ("shard_over_cp", "core_v0.8.0 megatron/training/training.py get_megatron_optimizer(..., "
                                        "data_parallel_group=mpu.get_data_parallel_group(with_context_parallel=True)) "
                                        "and megatron/core/distributed/distributed_data_parallel.py gradient buffers "
                                        "over the same dp x cp group: the distributed optimizer shards over dp x cp "
                                        "(so since core_v0.4.0, megatron/training.py, context parallelism's first release)"),
                      ("glu_kernel", "core_v0.8.0 (baf94af) megatron/training/arguments.py --no-bias-swiglu-fusion "
                                     "(bias_swiglu_fusion default True), core_transformer_config_from_args "
                                     "bias_activation_fusion = args.bias_swiglu_fusion -> megatron/core/transformer/mlp.py "
                                     "bias_swiglu_impl (fusions/fused_bias_swiglu.py SwiGLUFunction saves its input only)"),
                      ("fused_projections", "core_v0.8.0 megatron/core/transformer/attention.py SelfAttention linear_qkv "
                                            "(query + 2 x kv projection outputs); transformer/mlp.py linear_fc1 of "
                                            "ffn_hidden_size x 2 under gated_linear_unit"),
                      ("fp8_recipe", "core_v0.8 arguments.py --fp8-format / --fp8-amax-history-len: TE DelayedScaling "
                                     "only (megatron/core/transformer/custom_layers/transformer_engine.py)"),
                      ("attention_impl", "megatron/core/transformer/dot_product_attention / TE DotProductAttention: "
                                         "fused flash kernel"),
                      ("norm_kernel", "Transformer Engine fused RMSNorm / LayerNorm"),
                      ("optimizer_impl", "megatron/core/optimizer: TE / apex FusedAdam"),
                      ("ddp_impl", "megatron/core/distributed/distributed_data_parallel.py: gradient buckets, "
                                   "--overlap-grad-reduce"),
                      ("loss_kernel", "megatron/core/tensor_parallel/cross_entropy.py VocabParallelCrossEntropy"),
                      ("split_rule", "num_layers / pp, the first / last set by --decoder-first/last-pipeline-num-layers")),
    ),
    EngineProfile(
        "megatron-core-2026", "megatron", "megatron-core 0.16 (installed)", state_layout="megatron",
        pp_buffers="megatron", sp_saves="shard", norm_kernel="fused", attention_impl="flash", ddp_impl="torch",
        loss_kernel="fused", vocab_parallel_embedding=True, split_rule="first_last", fp8_recipe="delayed",
        glu_kernel="fused", fused_projections=True, shard_over_cp=True, attention_backend="cudnn",
        moe_combine="in_act",
        sources=_with(_MEGATRON_2021,
                      ("moe_combine", "megatron/core/transformer/moe/experts.py TEGroupedMLP.forward bias_act_func: weighted_bias_swiglu_impl(fc1_output, bias, permuted_probs) keeps fc1's output and the probabilities, the experts' output is not kept (2659630, 2025-04-09, 'Memory efficient token permutation', core 0.13 on)"),
                      _TE_CUDNN_ATTENTION,
                      ("dp_kinds", "megatron/core/distributed/distributed_data_parallel_config.py: "
                                   "use_distributed_optimizer (zero1); use_megatron_fsdp with "
                                   "data_parallel_sharding_strategy 'optim_grads' (zero2) / 'optim_grads_params' (fsdp), "
                                   "outer_dp_sharding_strategy for a replicated outer group (hsdp); --use-torch-fsdp2 "
                                   "(fsdp, from e1993fa 2024-11-13)"),
                      ("main_grads", "None, the megatron layout's rule: Megatron-LM megatron/training/arguments.py "
                                     "under --bf16 sets accumulate_allreduce_grads_in_fp32 = True (fp32 main_grad "
                                     "buffers) unless --grad-reduce-in-bf16 (from d165a85, 2025-02-26): a run passing it "
                                     "sets the run flag main_grads '16-bit'"),
                      ("shard_over_cp", "megatron/core/optimizer/__init__.py get_megatron_optimizer: the distributed "
                                        "optimizer's data_parallel_group = intra_dp_cp_group (process_groups_config.py "
                                        "'intra_dp_cp': get_data_parallel_group(with_context_parallel=True, "
                                        "partial_data_parallel=True), all of dp x cp with one optimizer instance); "
                                        "distributed_data_parallel.py buckets over intra_dp_cp_group"),
                      ("fused_projections", "megatron/core/transformer/attention.py SelfAttention linear_qkv (query + 2 x "
                                            "kv projection outputs); transformer/mlp.py linear_fc1 of ffn_hidden_size x 2 "
                                            "under gated_linear_unit"),
                      ("glu_kernel", "Megatron-LM megatron/training/arguments.py: bias_swiglu_fusion default True "
                                     "(--no-bias-swiglu-fusion), core_transformer_config_from_args bias_activation_fusion "
                                     "= args.bias_swiglu_fusion under --swiglu -> megatron/core/transformer/mlp.py "
                                     "bias_swiglu_impl (fusions/fused_bias_swiglu.py SwiGLUFunction saves its input only)"),
                      ("fp8_recipe", "megatron/core/transformer/transformer_config.py fp8_recipe default 'delayed' (fp8_utils.py "
                                     "TEDelayedScaling; Transformer Engine linears)"),
                      ("attention_impl", "megatron/core/extensions/transformer_engine.py TEDotProductAttention"),
                      ("norm_kernel", "Transformer Engine fused RMSNorm / LayerNorm"),
                      ("ddp_impl", "megatron/core/distributed/distributed_data_parallel.py: buckets, overlap_grad_reduce"),
                      ("loss_kernel", "megatron/core/tensor_parallel/cross_entropy.py VocabParallelCrossEntropy"),
                      ("split_rule", "megatron/core/transformer/transformer_block.py: layers / pp, first / last stage "
                                     "by decoder_first/last_pipeline_num_layers")),
    ),
    EngineProfile(
        "megatron-bridge-2025", "megatron", "Megatron-Bridge performance recipes (NeMo 25.11 - 26.04 containers)",
        state_layout="zero", pp_buffers="megatron", sp_saves="shard", norm_kernel="fused", attention_impl="flash",
        ddp_impl="torch", loss_kernel="fused", vocab_parallel_embedding=True, split_rule="even", fp8_recipe="current",
        glu_kernel="fused", tp_comm_overlap=True, fused_projections=True, shard_over_cp=True, attention_backend="cudnn",
        main_grads="16-bit",
        moe_combine="in_act",
        sources=_with(_MEGATRON_2021,
                      ("moe_combine", "megatron/core/transformer/moe/experts.py TEGroupedMLP.forward bias_act_func: weighted_bias_swiglu_impl(fc1_output, bias, permuted_probs) keeps fc1's output and the probabilities, the experts' output is not kept (2659630, 2025-04-09, 'Memory efficient token permutation', core 0.13 on)"),
                      _TE_CUDNN_ATTENTION,
                      ("dp_kinds", "Megatron-Core (the bridge's) megatron/core/distributed/distributed_data_parallel_config.py: "
                                   "use_distributed_optimizer (zero1); use_megatron_fsdp with "
                                   "data_parallel_sharding_strategy 'optim_grads' (zero2) / 'optim_grads_params' (fsdp), "
                                   "outer_dp_sharding_strategy for a replicated outer group (hsdp); --use-torch-fsdp2 "
                                   "(fsdp, from e1993fa 2024-11-13)"),
                      ("main_grads", "scripts/performance/configs/llama/llama3_llm_pretrain.py set_llama3_common_configs "
                                     "(5776a6d, 21d102f): ddp.grad_reduce_in_fp32 = False -> Megatron-Core "
                                     "distributed_data_parallel.py grad_dtype = param.dtype (a recipe keeping fp32 sets "
                                     "training.main_grads 'fp32')"),
                      ("shard_over_cp", "recipes/llama/llama3.py _llama3_common: use_distributed_optimizer=True -> "
                                        "Megatron-Core optimizer/__init__.py get_megatron_optimizer: the distributed optimizer over "
                                        "get_data_parallel_group(with_context_parallel=True) (core_v0.12.0, 2025-05) / "
                                        "intra_dp_cp_group (core_v0.15.0, 2025-12): states sharded over dp x cp"),
                      ("fused_projections", "megatron/core/transformer/attention.py SelfAttention linear_qkv (query + 2 x "
                                            "kv projection outputs, one TELayerNormColumnParallelLinear); "
                                            "transformer/mlp.py linear_fc1 of ffn_hidden_size x 2 (gated_linear_unit)"),
                      ("glu_kernel", "models/llama/llama_provider.py LlamaModelProvider bias_activation_fusion = True "
                                     "(5776a6d) -> megatron/core/transformer/mlp.py bias_swiglu_impl; "
                                     "fusions/fused_bias_swiglu.py SwiGLUFunction saves only its input"),
                      ("tp_comm_overlap", "recipes/llama/llama3.py llama3_70b_pretrain_config: CommOverlapConfig("
                                          "tp_comm_overlap=True), the perf script's tp_comm_overlap_cfg "
                                          "userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192 (training/comm_overlap.py: "
                                          "ring-exchange / bulk overlap for qkv, proj, fc1, fc2 fprop, dgrad, wgrad)"),
                      ("state_layout", "Megatron-Bridge scripts/performance/configs/llama/llama3_llm_pretrain.py "
                                       "set_llama3_common_configs (5776a6d, 21d102f): ddp.grad_reduce_in_fp32 = False -> "
                                       "Megatron-Core distributed_data_parallel.py grad_dtype = param.dtype: bf16 weights "
                                       "and main gradients + fp32 master weights and Adam states (2 + 2 + 12 bytes)"),
                      ("fp8_recipe", "scripts/performance/utils/precision.py get_precision_config('fp8_cs'): "
                                     "mixed_precision.py bf16_with_fp8_current_scaling_mixed (fp8_recipe 'tensorwise' = "
                                     "TE Float8CurrentScaling), first_last_layers_bf16 = False"),
                      ("attention_impl", "Megatron-Core TEDotProductAttention (the bridge's GPT provider)"),
                      ("norm_kernel", "Transformer Engine fused RMSNorm (TE layer spec)"),
                      ("optimizer_impl", "recipes/utils/optimizer_utils.py distributed_fused_adam_with_cosine_annealing"),
                      ("zero1_impl", "recipes/llama/llama3.py _llama3_common: use_distributed_optimizer=True, "
                                     "overlap_grad_reduce / overlap_param_gather -> Megatron-Core distributed_data_parallel.py "
                                     "flat gradient buckets reduce-scattered, distrib_optimizer.py parameters all-gathered "
                                     "per bucket"),
                      ("ddp_impl", "recipes/llama/llama3.py _llama3_common: DistributedDataParallelConfig("
                                   "overlap_grad_reduce=True, overlap_param_gather=True, use_distributed_optimizer=True)"),
                      ("loss_kernel", "recipes/llama/llama3.py: cross_entropy_fusion_impl 'te' (fused vocab-parallel "
                                      "cross-entropy)"),
                      ("split_rule", "Megatron-Core transformer_block.py: num_layers / (pp x vp) layers per virtual "
                                     "stage; the 70B recipes set no --account-for-* flags or layout (5776a6d, 21d102f)")),
    ),
    EngineProfile(
        "nemo-2024", "megatron", "NeMo 24.05 / 24.09 containers (NeMo 2.0.0rc0 / rc1 megatron_gpt_pretraining.py, "
        "mcore_gpt; NVIDIA DGX Cloud Benchmarking recipes v24.11.1)",
        state_layout="zero", pp_buffers="megatron", sp_saves="shard", norm_kernel="fused", attention_impl="flash",
        ddp_impl="torch", loss_kernel="fused", vocab_parallel_embedding=True, split_rule="even", fp8_recipe="delayed",
        glu_kernel="fused", tp_comm_overlap=True, fused_projections=True, shard_over_cp=True, attention_backend="cudnn",
        main_grads="16-bit", dp_kinds=("none", "ddp", "zero1", "zero2", "fsdp"),
        moe_combine="unpermute",
        sources=_with(_MEGATRON_2021,
                      ("moe_combine", "core_v0.8.0 megatron/core/transformer/moe/moe_utils.py unpermute: probs * permuted_tokens (the experts' output kept for the probabilities' gradient); experts.py TEGroupedMLP bias_swiglu_impl (glu_kernel)"),
                      _TE_CUDNN_ATTENTION,
                      ("main_grads", "recipes' optim.grad_sync_dtype bf16 (dgxc-benchmarking 35a9aec llama3.1/*.yaml, "
                                     "gpt3_175b_hydra.yaml, nemotron 340b) -> apex DistributedFusedAdam's gradient buckets "
                                     "in bf16; a recipe without it (nemotron 15b) keeps the default grad_sync_dtype = the "
                                     "optimizer dtype, fp32: its run sets training.main_grads 'fp32'. NeMo 2.x runs resolve here "
                                     "(LINEAGES) and agree where they ran NeMo's performance mode: v2.3.0 "
                                     "nemo/collections/llm/recipes/llama31_405b.py pretrain_performance_optimizations "
                                     "sets trainer.plugins.grad_reduce_in_fp32 = False (the plain recipe keeps True: "
                                     "main_grads 'fp32')"),
                      ("dp_kinds", "NeMo r2.0.0rc1 megatron_base_model.py: optim distributed_fused_adam (zero1 "
                                   "accounting) or plain data parallelism; nlp_overrides.py NLPFSDPStrategy "
                                   "fsdp_sharding_strategy 'full' (fsdp) / 'grad' (zero2); 'hybrid' asserted unsupported"),
                      ("state_layout", "recipes' optim.name distributed_fused_adam, grad_sync_dtype bf16, megatron_amp_O2 "
                                       "(dgxc-benchmarking 35a9aec llama3.1/*.yaml, nemo_megatron/gpt3_175b_hydra.yaml) -> "
                                       "NeMo r2.0.0rc1 megatron_base_model.py setup_optimization: contiguous_grad_buffer "
                                       "True, optimizer dtype fp32 with bf16 params: store_param_remainders (apex "
                                       "DistributedFusedAdam: bf16 weights and gradients + sharded fp32 Adam states and "
                                       "a 16-bit master remainder, costed as the 2 + 2 + 12 layout: 2 bytes/param over dp "
                                       "too many)"),
                      ("zero1_impl", "NeMo r2.0.0rc1 core/optim/distributed_adam.py MegatronDistributedFusedAdam (apex "
                                     "DistributedFusedAdam): gradient buckets (bucket_cap_mb) reduce-scattered with "
                                     "overlap_grad_sync, parameter buckets all-gathered with overlap_param_sync"),
                      ("shard_over_cp", "NeMo r2.0.0rc1 core/optim/distributed_adam.py MegatronDistributedFusedAdam."
                                        "__init__: process_group = parallel_state.get_data_parallel_group("
                                        "with_context_parallel=True)"),
                      ("ddp_impl", "recipes' optim.overlap_grad_sync: true (bucketed, overlapped with backward)"),
                      ("tp_comm_overlap", "dgxc-benchmarking 35a9aec: model.ub_tp_comm_overlap true in llama3.1_70b / "
                                          "405b.yaml and gpt3_175b_hydra.yaml (ub_tp_comm_overlap_cfg: ring_exchange / "
                                          "bulk / pipeline per GEMM), nemotron/configure.sh model.ub_tp_comm_overlap=True "
                                          "(NeMo's default is False: megatron_gpt_model.py cfg.get('ub_tp_comm_overlap', "
                                          "False); the recipes of this profile all set it)"),
                      ("glu_kernel", "recipes' bias_activation_fusion: true with activation fast-swiglu -> Megatron-Core "
                                     "mlp.py bias_swiglu_impl (fused_bias_swiglu.py SwiGLUFunction saves its input only)"),
                      ("fused_projections", "mcore_gpt: true -> Megatron-Core attention.py linear_qkv, mlp.py linear_fc1 "
                                            "of 2 x ffn under a gated unit"),
                      ("fp8_recipe", "recipes' fp8_amax_history_len 1024, fp8_amax_compute_algo max: Transformer Engine "
                                     "DelayedScaling"),
                      ("attention_impl", "transformer_engine: true -> TE DotProductAttention (NVTE_FUSED_ATTN / "
                                         "NVTE_FLASH_ATTN: cuDNN fused or flash-attention kernels)"),
                      ("norm_kernel", "Transformer Engine fused LayerNorm / RMSNorm (TE layer spec)"),
                      ("optimizer_impl", "apex DistributedFusedAdam: fused multi-tensor Adam on the shards"),
                      ("loss_kernel", "Megatron-Core tensor_parallel/cross_entropy.py vocab-parallel cross-entropy "
                                      "(cross_entropy_loss_fusion: true in the Llama recipes)"),
                      ("split_rule", "Megatron-Core transformer_block.py: num_layers / (pp x vp) layers per virtual "
                                     "stage (the recipes set no uneven split)")),
    ),
    EngineProfile(
        "llm-foundry-2023", "llm-foundry", "MosaicML llm-foundry (MPT, 2023)", norm_kernel="fused",
        optimizer_impl="fused", loss_kernel="fused", dp_kinds=("none", "ddp", "zero2", "fsdp", "hsdp"),
        grad_reduce="param", fused_projections=True,
        sources=(
            ("dp_kinds", "Composer FSDP sharding_strategy FULL_SHARD (fsdp), SHARD_GRAD_OP (zero2), HYBRID_SHARD "
                         "(hsdp), NO_SHARD / Composer DDP (ddp); no ZeRO-1"),
            ("state_layout", "Composer FSDP (FULL_SHARD, mixed_precision PURE): fp32 sharded parameters and optimizer states"),
            ("fsdp_units", "llmfoundry/models/mpt/modeling_mpt.py fsdp_wrap_fn: one FSDP unit per MPTBlock"),
            ("fused_projections", "llmfoundry/models/layers/attention.py (v0.3.0) attention: self.Wqkv, one linear of "
                                  "d_model + 2 x kv heads x head dim (q, k, v in one GEMM)"),
            ("grad_reduce", "Composer v0.16.3 (llm-foundry v0.3.0's mosaicml>=0.16.3,<0.17) "
                            "composer/trainer/mosaic_fsdp_utils.py get_mixed_precision: 'PURE' sets param_dtype = "
                            "reduce_dtype = the precision (bf16), 'DEFAULT' (the benchmark README's H100 rows) "
                            "param_dtype = bf16 and no reduce_dtype, which torch FSDP1 reduces in the param dtype "
                            "(torch/distributed/fsdp/_flat_param.py _init_param_reduce_dtypes: 'infer gradient "
                            "reduction mixed precision'): bf16 gradient reduce-scatters either way"),
            ("norm_kernel", "MPT low_precision_layernorm (one F.layer_norm kernel under autocast)"),
            ("attention_impl", "MPT attn_impl 'triton' / 'flash'"),
            ("loss_kernel", "llmfoundry: flash_attn.losses.cross_entropy CrossEntropyLoss (fused)"),
            ("pp_buffers", "none used: llm-foundry trains with Composer FSDP only, no pipeline stages "
                           "(torch's convention kept, never costed)"),
            ("zero1_impl", "none used: Composer FSDP only (no ZeroRedundancyOptimizer); a zero1 costing of it is "
                           "the bucketed collectives, never costed"),
            ("autocast_cache", "none used here: Composer FSDP mixed precision, no pipeline stages"),
            ("recompute_unit", "none used: no pipeline stages (Composer activation_checkpointing_fn per MPTBlock)"),
            ("shard_over_cp", "none used: Composer FSDP only, no context parallelism"),
        ),
    ),
    EngineProfile(
        "deepspeed-2026", "deepspeed", "deepspeed 0.19 (installed)", state_layout="zero", fsdp_units="module",
        split_rule="even", pp_buffers="megatron", dp_kinds=("none", "ddp", "zero1", "zero2", "fsdp"),
        sources=(
            ("main_grads", "None, the zero layout's 16-bit gradients: deepspeed/runtime/engine.py get_data_types "
                           "accumulates in the model's dtype under ZeRO; in fp32 for bf16 without ZeRO (BF16_Optimizer) "
                           "or where data_types.grad_accum_dtype says fp32 (engines/deepspeed.py reads both as the run "
                           "flag main_grads 'fp32')"),
            ("dp_kinds", "deepspeed/runtime/zero/config.py zero_optimization.stage 0-3 (ddp, zero1, zero2, fsdp); "
                         "hierarchical ZeRO (ZeRO++ hpZ, MiCS) not modelled"),
            ("state_layout", "deepspeed/runtime/zero: 16-bit parameters and gradients + fp32 master weights and Adam "
                             "states (the ZeRO paper's 2 + 2 + 12 bytes per parameter)"),
            ("fsdp_units", "deepspeed/runtime/zero/partitioned_param_coordinator.py: parameters fetched per submodule"),
            ("optimizer_impl", "deepspeed/ops/adam/fused_adam.py FusedAdam"),
            ("ddp_impl", "deepspeed/runtime/engine.py: bucketed all-reduce overlapped with backward (overlap_comm)"),
            ("split_rule", "deepspeed/runtime/pipe/module.py PipelineModule(partition_method='parameters'): "
                           "balanced layers (uniform here)"),
            ("pp_buffers", "deepspeed/runtime/pipe/schedule.py TrainSchedule.num_pipe_buffers: "
                           "max(2, min(stages - stage_id, micro_batches)) buffers, the in-flight microbatches"),
            ("zero1_impl", "deepspeed/runtime/zero/stage_1_and_2.py: flat partitioned buffers, gradients "
                           "reduce-scattered and updated parameters all-gathered in buckets"),
            ("autocast_cache", "none used: 16-bit parameters in the engine (state_layout), no torch.autocast"),
            ("recompute_unit", "deepspeed/runtime/pipe/module.py PipelineModule activation_checkpoint_interval: "
                               "a checkpoint every that many layers of a stage (per layer at 1)"),
            ("shard_over_cp", "none costed: engines/spec.py CAPS['deepspeed'] has no cp axis (DeepSpeed-Ulysses "
                              "sequence parallelism is not modelled)"),
        ),
    ),
    EngineProfile(
        "unpublished", "zero", "an engine whose conventions are not published", state_layout="zero",
        pp_buffers="megatron", sp_saves="shard", norm_kernel="fused", vocab_parallel_embedding=True,
        sources=(
            ("state_layout", "the ZeRO paper's 2 + 2 + 12 bytes per parameter (Rajbhandari et al. 2020 §3)"),
            ("pp_buffers", "assumed: p2p into the next stage's input, as the Megatron-family engines (no source)"),
            ("sp_saves", "assumed: the sequence shard, as Megatron-LM (no source)"),
            ("norm_kernel", "assumed: a fused norm kernel, as every engine of 2024 at scale (no source)"),
            ("vocab_parallel_embedding", "assumed: vocabulary-parallel embedding, as Megatron-LM and torchtitan (no source)"),
            ("zero1_impl", "assumed: bucketed ZeRO-1 collectives, as Megatron-LM and DeepSpeed (no source)"),
            ("autocast_cache", "none used: 16-bit parameters (state_layout), no torch.autocast"),
            ("recompute_unit", "assumed: one checkpoint per layer, as Megatron-LM and torchtitan (no source)"),
            ("shard_over_cp", "assumed: states sharded over dp only, the cp ranks holding copies (no source)"),
        ),
    ),
)}  # fmt: skip

#: where a profile keeps the p2p "ring" (``cp_kernels.CP_ROTATES``; meshplan's runtime runs "ring-dkv"), why
_RING_SOURCES: dict[str, str] = {
    "megatron": "'ring': Megatron's context parallelism, where the version has it, is Transformer Engine's p2p "
                "ring (attention.py AttnFuncWithCPAndKVP2P, cp_comm_type 'p2p' default); before core_v0.5 none",
    "torchtitan": "'ring', not traced for this version (torch's context_parallel rotate method not read here; "
                  "0413364 has no context parallelism: it came with b19456a, 2024-10-22)",
    "llm-foundry": "'ring' unused: no context parallelism in this engine",
    "deepspeed": "'ring' unused: DeepSpeed's sequence parallelism is Ulysses (all-to-all of heads), no ring",
    "zero": "assumed: the p2p ring (no source)",
}
PROFILES = {n: p if p.cp_rotate != "ring" or any(f == "cp_rotate" for f, _ in p.sources)
            else dataclasses.replace(p, sources=(*p.sources, ("cp_rotate", _RING_SOURCES[p.engine])))
            for n, p in PROFILES.items()}

#: the profile of each engine of ``engines.spec.CAPS`` as installed here (``estimate --from-*``, ``--target``)
INSTALLED = {"torchtitan": "torchtitan-2026", "megatron": "megatron-core-2026", "deepspeed": "deepspeed-2026",
             "meshplan": "meshplan"}  # fmt: skip


#: engine families a profile name may name with any version (``resolve``): each family's profiles
#: in the order of their versions, with the version each stands for ("2024.08" = August 2024; a year
#: alone: that year). Megatron-LM and Megatron-Core are one lineage (Megatron-LM trains with
#: Megatron-Core's modules from core_v0.4, January 2024, on: megatron/training.py get_model wraps
#: megatron.core DDP). NeMo's are its own recipes' profiles, then Megatron-Bridge, which NeMo's
#: containers run from 25.11 on. A variant ("+zero3") resolves only to a profile of that variant
LINEAGES: dict[str, tuple[tuple[str, str], ...]] = {
    "megatron": (("megatron-lm-2020", "2020.09"), ("megatron-lm-2021", "2021"), ("megatron-lm-2021+zero3", "2021"),
                 ("megatron-lm-2022", "2022.05"), ("megatron-lm-2023", "2023.06"), ("megatron-lm-2023+flash", "2023.06"),
                 ("megatron-core-2023.12", "2023.12"), ("megatron-core-2023.12+flash", "2023.12"),
                 ("megatron-core-2024.04", "2024.04"), ("megatron-core-2024", "2024.08"), ("megatron-core-2026", "2026")),
    "nemo": (("nemo-2024", "2024.05"), ("megatron-bridge-2025", "2025.11")),
    "megatron-bridge": (("megatron-bridge-2025", "2025.11"),),
    "megatron-deepspeed": (("megatron-deepspeed-2022", "2022"),),
    "torchtitan": (("torchtitan-2024.04", "2024.04"), ("torchtitan-2024.12", "2024.12"), ("torchtitan-2025.06", "2025.06"),
                   ("torchtitan-2026", "2026")),
    "llm-foundry": (("llm-foundry-2023", "2023"),),
    "deepspeed": (("deepspeed-2026", "2026"),),
}  # fmt: skip

#: family names a run may give -> (lineage, why that lineage prices it)
FAMILIES: dict[str, tuple[str, str]] = {
    **{f: (f, "") for f in LINEAGES},
    "megatron-lm": ("megatron", "Megatron-LM and Megatron-Core are one lineage"),
    "megatron-core": ("megatron", "Megatron-LM and Megatron-Core are one lineage"),
    "mcore": ("megatron", "Megatron-LM and Megatron-Core are one lineage"),
    "nemo": ("nemo", "NeMo's recipes, then Megatron-Bridge from the 25.11 containers"),
}  # fmt: skip

#: (lineage, variant) -> (the version from which the variant's flag no longer selects anything, why):
#: a run of that version or later named with the variant takes the lineage's plain profile
VARIANT_ENDS: dict[tuple[str, str], tuple[str, str]] = {
    ("megatron", "flash"): ("2024.04", "--use-flash-attn selects only the legacy local layers' FlashSelfAttention; "
                                       "from core_v0.6.0 --transformer-impl defaults to 'transformer_engine', whose "
                                       "fused attention every later profile prices"),
}  # fmt: skip

_NAME = re.compile(r"^(?P<family>[a-z][a-z-]*?)(?:-(?P<version>\d{2,4}(?:\.\d{1,2})?))?(?:\+(?P<variant>[a-z0-9]+))?$")


def _version(text: str) -> tuple[int, ...]:
    """A version of a profile name or a run's engine as (year[, month]); "24.07" (a NeMo container) is 2024.07."""
    parts = tuple(int(x) for x in text.split("."))
    return (parts[0] + 2000 if parts[0] < 100 else parts[0], *parts[1:])


def _not_newer(have: tuple[int, ...], named: tuple[int, ...]) -> bool:
    """``have`` is not newer than ``named``, compared at the coarser of the two (a profile of 2024 is
    not newer than a run of 2024.03, nor one of 2024.12 than a run of 2024)."""
    k = min(len(have), len(named))
    return have[:k] <= named[:k]


def _lineage(lineage: str) -> list[tuple[str, str]]:
    """(profile, version) of a lineage in version order: ``LINEAGES``' and any profile named
    "<lineage>-<version>" it does not list (a profile added later joins its family)."""
    have = dict(LINEAGES[lineage])
    for n in PROFILES:
        m = _NAME.match(n)
        if m and m["version"] and m["family"] == lineage and n not in have:
            have[n] = m["version"]
    return sorted(have.items(), key=lambda nv: _version(nv[1]))


def resolve(name: str) -> tuple[EngineProfile, str]:
    """(the profile of ``name``, a one-line note of which profile prices it and why; "" when ``name``
    names a profile). ``name`` is a profile name or "<engine family>[-<year>[.<month>]][+variant]":
    the family's profile (``FAMILIES`` -> ``LINEAGES``) whose version is the latest not newer than the
    one named, the earliest where it is older than all, the newest where no version is named; a
    variant whose flag no longer selects anything from some version on (``VARIANT_ENDS``) takes the
    family's plain profile there."""
    if name in PROFILES:
        return PROFILES[name], ""
    m = _NAME.match(re.sub(r"[\s_]+", "-", name.strip().lower()))  # "Megatron-LM 2022", "NeMo_24.07"
    if not m or m["family"] not in FAMILIES:
        raise ValueError(f"unknown engine profile {name!r}; use one of {', '.join(PROFILES)}, or an engine family "
                         f"with an optional year[.month] version (families: {', '.join(FAMILIES)})")  # fmt: skip
    lineage, why = FAMILIES[m["family"]]
    variant = m["variant"] or ""
    end = VARIANT_ENDS.get((lineage, variant))
    if end and (m["version"] is None or _not_newer(_version(end[0]), _version(m["version"]))):
        base = m["family"] + (f"-{m['version']}" if m["version"] else "")
        prof, note = resolve(base)
        return prof, f"engine {name!r} costed as {base!r}: +{variant} {end[1]}; {note or 'its own profile'}"
    every = _lineage(lineage)
    have = [(n, v) for n, v in every if n.partition("+")[2] == variant]
    if not have:
        raise ValueError(f"engine profile {name!r}: no {lineage} profile of variant +{variant} "
                         f"(profiles: {', '.join(n for n, _ in every)})")  # fmt: skip
    if m["version"] is None:
        chosen, how = have[-1][0], "no version named: the newest"
    else:
        named = _version(m["version"])
        older = [n for n, v in have if _not_newer(_version(v), named)]
        chosen, how = ((older[-1], "the latest not newer") if older
                       else (have[0][0], "older than every profile of the family: the earliest"))  # fmt: skip
    note = f"engine {name!r} costed with profile {chosen!r} ({how}{'; ' + why if why else ''})"
    return PROFILES[chosen], note


_SAID: set[str] = set()


def profile(name: str | EngineProfile | None) -> EngineProfile:
    """The profile named ``name`` (an EngineProfile passes through; None is meshplan's runtime); a
    family or version without a profile of its own resolves as ``resolve`` says, the note logged
    once (logger ``meshplan.engine_profiles``; ``resolve`` returns it)."""
    if isinstance(name, EngineProfile):
        return name
    if name is None:
        return _MESHPLAN
    prof, note = resolve(name)
    if note and note not in _SAID:
        _SAID.add(note)
        logging.getLogger("meshplan.engine_profiles").info(note)
    return prof


MESHPLAN = _MESHPLAN
