"""The ``EngineProfile`` type: one frozen record of how an engine version runs what a configuration
does not say, the values each field may take (the cost-model tables named per field), the fields a run
may set itself (``RUN_FLAGS``), and ``with_sources`` to derive one profile's traced sources from another's.
The records themselves are in this package's per-family modules; ``lookup`` finds one by name.
No torch import.
"""

from __future__ import annotations

import dataclasses
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
from meshplan.cost_models.eager_ops import ATTENTION_IMPLS, NORM_KERNELS, RUNTIME_NORM_KERNEL
from meshplan.cost_models.engine_saves import CUDA_GRAPH_SCOPES, GLU_KERNELS, MOE_COMBINES, RECOMPUTE_MODULES
from meshplan.cost_models.epcp import MOE_DISPATCHERS
from meshplan.cost_models.grad_accum import GRAD_ACCUM_PASSES
from meshplan.cost_models.grad_sync import DDP_IMPLS
from meshplan.cost_models.memory import LOSS_KERNELS, SAC_SAVES, SP_SAVES
from meshplan.cost_models.optimizer_phase import OPTIMIZER_IMPLS, OPTIMIZER_SYNCS
from meshplan.cost_models.pipe_p2p import PP_P2PS
from meshplan.cost_models.precision import DEFAULT_FP8_RECIPE, FP8_RECIPES

#: the fused attention kernels an engine may run (hardware.with_attention_backend)
ATTENTION_BACKENDS = ("flash", "cudnn")
#: stage split rules (``partition.engine_split.SPLIT_RULES``; not imported: partition sits above cost_models)
SPLIT_RULES = ("any", "even", "first_last", "fewer_first_last")

#: how long autocast's weight cache lives (``EngineProfile.autocast_cache``)
AUTOCAST_CACHES = ("call", "step")
#: what one activation-checkpoint region re-runs under pipeline parallelism (``EngineProfile.recompute_unit``)
RECOMPUTE_UNITS = ("block", "stage")
#: under full recompute, which layers an engine checkpoints (``EngineProfile.recompute_scope``)
RECOMPUTE_SCOPES = ("blocks", "modules")

#: the dtype an engine's data-parallel gradient collectives move (``EngineProfile.grad_reduce``):
#: "fp32" (FSDP2's ``reduce_dtype=float32``, DDP on fp32 gradients: meshplan's runtime, torchtitan) or
#: "param" (the gathered parameters' training dtype: torch FSDP1 with a low-precision ``param_dtype``
#: and no ``reduce_dtype``). Prices the collectives' bytes only, not the memory of the buffers.
GRAD_REDUCES = ("fp32", "param")

#: fields a run may set from its own command line / config file (the case cites the line); the
#: engine's default otherwise
RUN_FLAGS = ("ddp_impl", "norm_kernel", "split_rule", "fp8_recipe", "moe_dispatcher", "tp_comm_overlap", "main_grads",
             "recompute_modules", "cuda_graph_scope", "sac_saves", "loss_kernel")


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
    - ``norm_kernel``, ``attention_impl`` (``eager_ops``), ``optimizer_impl`` (``optimizer_phase``): the kernels run.
    - ``optimizer_sync`` (``optimizer_phase.OPTIMIZER_SYNCS``): whether the host waits for the device inside
      the optimizer phase ("host-wait": a host read of the gradient norm, so the step's per-tensor host work
      runs with the device idle; Megatron, DeepSpeed) or not ("async": torchtitan, meshplan's runtime since
      #33's stop 10). Under fp16 every engine's dynamic loss scaler reads its found-inf flag on the host before
      the update, so fp16 is priced "host-wait" whatever the profile says (``optimizer_phase.phase_sync``).
    - ``ddp_impl`` (``grad_sync.DDP_IMPLS``): bucketed and overlapped ("torch") or one flat
      all-reduce after backward ("local", Megatron-LM's own wrapper).
    - ``loss_kernel`` (``memory.LOSS_KERNELS``; None = F.cross_entropy as meshplan's runtime runs it). Also a
      run flag: torchtitan compiles its loss with the run's ``training.compile`` ("compiled", from 2025).
    - ``vocab_parallel_embedding``: the token embedding sharded over the vocabulary under TP.
    - ``pp_scatter_gather``: stage-to-stage sends split 1/tp and re-gathered (Megatron-LM 2021).
    - ``pp_p2p`` (``pipe_p2p.PP_P2PS``): how stage-to-stage tensors move: one message each way off the
      compute ("nccl": torch, Megatron-LM) or DeepSpeed's PipelineEngine's blocking exchange of the
      activation then the gradient, partitioned over tp ("deepspeed"; "deepspeed-grad-whole" before
      e2fdd254e, 2021-09-29: the gradient sent whole).
    - ``split_rule`` (``partition.engine_split.SPLIT_RULES``): how the engine cuts layers into stages.
    - ``fp8_recipe`` (``precision.FP8_RECIPES``): how fp8 training scales and casts a linear's
      operands (the engine's default; a run's ``--fp8-recipe`` is a run flag).
    - ``glu_kernel`` (``engine_saves.GLU_KERNELS``): a gated MLP's activation as traced ("eager") or
      Megatron-Core's fused bias_swiglu ("fused": keeps only the fc1 output for backward).
    - ``tp_comm_overlap``: TE userbuffers run the sequence-parallel TP collectives inside the GEMMs
      (``engine_saves.exposed_tp_comm_s``). Also a run flag: Megatron-LM's ``--tp-comm-overlap``
      (store_true, off by default; core_v0.8.0 ``megatron/training/arguments.py``).
    - ``tp_bwd_overlap``: a column-parallel linear's backward collective runs asynchronously beside its
      weight-gradient GEMM (the input-gradient all-reduce, or under sequence parallelism its
      reduce-scatter; Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication.backward``, from
      83b1e42, 2022-02): that backward part of a layer's TP communication is exposed only where it
      outlasts the column-parallel linears' weight-gradient GEMMs (``engine_saves.async_bwd_hidden_s``).
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
    - ``grad_accum_pass`` (``grad_accum.GRAD_ACCUM_PASSES``): how the engine accumulates gradients across
      microbatches beyond what the backward writes: "autograd" (torch's ``.grad += new`` from the second
      microbatch, on the rank's shard where FSDP reduce-scatters each microbatch), "main-grad-hook" (a hook
      folds each microbatch's 16-bit gradient into a main gradient), "bf16-optimizer" (DeepSpeed's
      BF16_Optimizer copies each 16-bit gradient into its fp32 one); "none" where the weight-gradient GEMM
      accumulates itself (gradient-accumulation fusion). Sources per profile: ``grad_accum_sources``.
    - ``recompute_scope`` (``RECOMPUTE_SCOPES``): under full recompute, which layers are checkpointed: the
      repeated blocks only ("blocks": Megatron-LM, torchtitan, meshplan's runtime) or every layer that
      holds parameters, the embedding and the final norm and output head too ("modules": DeepSpeed's
      PipelineModule before e2fdd254e, 2021-09-29, whose ``_is_checkpointable`` excepted only a class
      named GPT2ModelPipe, not Megatron-DeepSpeed's GPTModelPipe).
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
    - ``sac_saves`` (``memory.SAC_SAVES``): what op-level selective checkpointing keeps of the ops it
      saves: "cached" (eager ``torch.utils.checkpoint``: every saved op's output) or "partitioned"
      (the checkpointed block under ``torch.compile``: AOTAutograd's partitioner keeps a saved output
      only where the backward reads it). A run flag: torchtitan's ``training.compile``
      (``memory.op_sac_kept_bytes``).
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
    optimizer_sync: str = "host-wait"
    attention_impl: str = "flash"
    ddp_impl: str = "torch"
    loss_kernel: str | None = None
    vocab_parallel_embedding: bool = False
    pp_scatter_gather: bool = False
    pp_p2p: str = "nccl"
    split_rule: str = "any"
    fp8_recipe: str = DEFAULT_FP8_RECIPE
    glu_kernel: str = "eager"
    tp_comm_overlap: bool = False
    tp_bwd_overlap: bool = False
    fused_projections: bool = False
    shard_over_cp: bool = False
    moe_dispatcher: str = "alltoall"
    autocast_cache: str = "call"
    recompute_unit: str = "block"
    recompute_scope: str = "blocks"
    grad_accum_pass: str = "none"
    cp_rotate: str = "ring"
    attention_backend: str = "flash"
    main_grads: str | None = None
    grad_reduce: str = "fp32"
    dp_kinds: tuple[str, ...] = tuple(ZERO_STAGE)
    moe_combine: str = "index_add"
    recompute_modules: tuple[str, ...] = ("core_attn",)
    cuda_graph_scope: tuple[str, ...] = ()
    sac_saves: str = "cached"
    #: (field, where the engine sets it: file and default at this version)
    sources: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for fname, allowed in (("state_layout", STATE_LAYOUTS), ("pp_buffers", PP_BUFFERS), ("sp_saves", SP_SAVES),
                               ("fsdp_units", FSDP_UNITS), ("zero3_impl", ZERO3_IMPLS), ("zero1_impl", ZERO1_IMPLS),
                               ("norm_kernel", NORM_KERNELS),
                               ("optimizer_impl", OPTIMIZER_IMPLS), ("optimizer_sync", OPTIMIZER_SYNCS),
                               ("attention_impl", ATTENTION_IMPLS), ("pp_p2p", PP_P2PS),
                               ("ddp_impl", DDP_IMPLS), ("split_rule", SPLIT_RULES),
                               ("fp8_recipe", tuple(FP8_RECIPES)), ("glu_kernel", GLU_KERNELS),
                               ("moe_dispatcher", MOE_DISPATCHERS), ("autocast_cache", AUTOCAST_CACHES),
                               ("recompute_unit", RECOMPUTE_UNITS), ("recompute_scope", RECOMPUTE_SCOPES),
                               ("grad_accum_pass", GRAD_ACCUM_PASSES),
                               ("cp_rotate", CP_ROTATES), ("attention_backend", ATTENTION_BACKENDS),
                               ("moe_combine", MOE_COMBINES), ("grad_reduce", GRAD_REDUCES),
                               ("sac_saves", SAC_SAVES)):  # fmt: skip
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


#: a profile's traced sources: (field, file and default at the version named)
Sources = tuple[tuple[str, str], ...]


def with_sources(sources: Sources, *extra: tuple[str, str]) -> Sources:
    """``sources`` with the fields of ``extra`` replaced (appended in ``extra``'s order)."""
    keys = {k for k, _ in extra}
    return tuple(s for s in sources if s[0] not in keys) + extra
