"""The engine profiles of llm-foundry (MosaicML, 2023), DeepSpeed (the installed 0.19) and an engine whose
conventions are not published (``unpublished``: the ZeRO paper's states, the rest assumed and said so).
No torch import."""

from __future__ import annotations

from meshplan.cost_models.engine_profiles.grad_accum_sources import (
    AUTOGRAD_DEEPSPEED_2026,
    AUTOGRAD_LLM_FOUNDRY,
    AUTOGRAD_UNPUBLISHED,
)
from meshplan.cost_models.engine_profiles.profile_type import EngineProfile

OTHERS: tuple[EngineProfile, ...] = (
    EngineProfile(
        "llm-foundry-2023", "llm-foundry", "MosaicML llm-foundry (MPT, 2023)", norm_kernel="fused",
        optimizer_impl="fused", loss_kernel="fused", dp_kinds=("none", "ddp", "zero2", "fsdp", "hsdp"),
        grad_reduce="param", fused_projections=True, optimizer_sync="async",
        grad_accum_pass="autograd", sources=(
            AUTOGRAD_LLM_FOUNDRY,
            ("optimizer_sync", "Composer GradientClipping (clipping_type 'norm') under FSDP: torch FSDP1 "
                               "FullyShardedDataParallel.clip_grad_norm_ computes the norm and clamps the clip "
                               "coefficient on the device (no host read before the update)"),
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
            ("sp_saves", "none used: Composer FSDP only, no tensor or sequence parallelism (torch TP's convention "
                         "kept, never costed)"),
        ),
    ),
    EngineProfile(
        "deepspeed-2026", "deepspeed", "deepspeed 0.19 (installed)", state_layout="zero", fsdp_units="module",
        split_rule="even", pp_buffers="megatron", dp_kinds=("none", "ddp", "zero1", "zero2", "fsdp"),
        grad_accum_pass="autograd", sources=(
            AUTOGRAD_DEEPSPEED_2026,
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
            ("optimizer_sync", "deepspeed/runtime/zero/stage_1_and_2.py step: check_overflow's overflow_gpu[0].item() "
                               "and the norm's .item() (runtime/utils.py) before the update: the host waits"),
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
            ("sp_saves", "none costed: DeepSpeed has no Megatron-style sequence parallelism of its own (torch TP's "
                         "convention kept)"),
        ),
    ),
    EngineProfile(
        "unpublished", "zero", "an engine whose conventions are not published", state_layout="zero",
        pp_buffers="megatron", sp_saves="shard", norm_kernel="fused", vocab_parallel_embedding=True,
        grad_accum_pass="autograd", sources=(
            AUTOGRAD_UNPUBLISHED,
            ("state_layout", "the ZeRO paper's 2 + 2 + 12 bytes per parameter (Rajbhandari et al. 2020 §3)"),
            ("pp_buffers", "assumed: p2p into the next stage's input, as the Megatron-family engines (no source)"),
            ("sp_saves", "assumed: the sequence shard, as Megatron-LM (no source)"),
            ("norm_kernel", "assumed: a fused norm kernel, as every engine of 2024 at scale (no source)"),
            ("optimizer_sync", "assumed: a host read of the gradient norm before the update, as Megatron-LM "
                               "and DeepSpeed (no source)"),
            ("vocab_parallel_embedding", "assumed: vocabulary-parallel embedding, as Megatron-LM and torchtitan (no source)"),
            ("zero1_impl", "assumed: bucketed ZeRO-1 collectives, as Megatron-LM and DeepSpeed (no source)"),
            ("autocast_cache", "none used: 16-bit parameters (state_layout), no torch.autocast"),
            ("recompute_unit", "assumed: one checkpoint per layer, as Megatron-LM and torchtitan (no source)"),
            ("shard_over_cp", "assumed: states sharded over dp only, the cp ranks holding copies (no source)"),
        ),
    ),
)  # fmt: skip
