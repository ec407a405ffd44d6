"""Megatron-LM / Megatron-Core engine profiles by version (2020 to the installed megatron-core 0.16), with
the DeepSpeed variants of Megatron-LM (ZeRO-3, Megatron-DeepSpeed), each field traced to the source at
the commit or tag named (``megatron_sources``).
No torch import."""

from __future__ import annotations

from meshplan.cost_models.engine_profiles.grad_accum_sources import (
    AUTOGRAD_MEGATRON_2020,
    AUTOGRAD_MEGATRON_2021,
    AUTOGRAD_MEGATRON_DEEPSPEED_2021,
    FUSED_MEGATRON_CORE,
)
from meshplan.cost_models.engine_profiles.megatron_sources import (
    DEEPSPEED_PIPE,
    FUSED_QKV_2021,
    MEGATRON_2021,
    MEGATRON_2022,
    MEGATRON_2023,
    MEGATRON_CORE_2023_12,
    MEGATRON_CORE_2024_04,
    TE_CUDNN_ATTENTION,
)
from meshplan.cost_models.engine_profiles.profile_type import EngineProfile, with_sources

MEGATRON: tuple[EngineProfile, ...] = (
    EngineProfile(
        "megatron-lm-2020", "megatron", "5281919 (2020-09)", state_layout="megatron", pp_buffers="megatron",
        sp_saves="shard", norm_kernel="fused", attention_impl="eager", ddp_impl="local", loss_kernel="fused",
        vocab_parallel_embedding=True, split_rule="even", dp_kinds=("none", "ddp"), fused_projections=True,
        grad_reduce="param",
        grad_accum_pass="autograd", sources=with_sources(MEGATRON_2021, AUTOGRAD_MEGATRON_2020,
                             ("attention_impl", "megatron/model/transformer.py ParallelSelfAttention: torch.matmul scores, "
                                                "masked_fill_, torch.nn.Softmax, dropout, torch.matmul (no fused softmax)"),
                             ("fused_projections", "megatron/model/transformer.py ParallelSelfAttention.query_key_value "
                                                   "(5281919 line 123): one ColumnParallelLinear of 3 x hidden (q, k, v in "
                                                   "one GEMM and one weight tensor)"),
                             ("grad_reduce", "megatron/training.py get_model (5281919 lines 135-144): FP16_Module "
                                             "(megatron/fp16/fp16.py: module.half()) inside torchDDP or LocalDDP: the "
                                             "gradients are the fp16 parameters' own, so --DDP-impl torch all-reduces "
                                             "fp16 buckets (local: its flat fp16 buffer; --fp32-allreduce off)")),
    ),
    EngineProfile(
        "megatron-lm-2021", "megatron", "6985e58 (2021, examples/sc21)", state_layout="megatron",
        pp_buffers="megatron", sp_saves="shard", norm_kernel="fused", attention_impl="unfused", ddp_impl="local",
        loss_kernel="fused", vocab_parallel_embedding=True, pp_scatter_gather=True, split_rule="even",
        dp_kinds=("none", "ddp"), fused_projections=True, grad_reduce="param",
        grad_accum_pass="autograd", sources=with_sources(MEGATRON_2021, AUTOGRAD_MEGATRON_2021, FUSED_QKV_2021,
                             ("attention_impl", "megatron/model/transformer.py: baddbmm scores, FusedScaleMaskSoftmax, "
                                                "dropout, bmm (no flash kernel)"),
                             ("pp_scatter_gather", "megatron/arguments.py: scatter/gather on unless "
                                                   "--no-scatter-gather-tensors-in-pipeline (p2p_communication.py)"),
                             ("grad_reduce", "megatron/training.py get_model (6985e58 lines 244-256): Float16Module "
                                             "(megatron/model/module.py: module.half()) inside torchDDP or LocalDDP: "
                                             "--DDP-impl torch all-reduces buckets of the fp16 parameters' gradients "
                                             "(local: its main_grad buffer, fp16 unless "
                                             "--accumulate-allreduce-grads-in-fp32, off by default)")),
    ),
    EngineProfile(
        "megatron-lm-2022", "megatron", "9aad920 (2022-05-20, merge of 'sequence_parallel'; Korthikanti et al. 2022)",
        tp_bwd_overlap=True, state_layout="megatron", pp_buffers="megatron", sp_saves="shard", norm_kernel="fused",
        attention_impl="unfused", ddp_impl="local", loss_kernel="fused", vocab_parallel_embedding=True,
        pp_scatter_gather=True, split_rule="even", fused_projections=True, dp_kinds=("none", "ddp", "zero1"),
        sources=with_sources(MEGATRON_2022,
                             ("dp_kinds", "megatron/arguments.py --DDP-impl local | torch (replicated states); "
                                          "--use-distributed-optimizer from d07d29d (2022-06-08, inside the span this "
                                          "profile prices, 2022.05 on) -> zero1; no sharded gradients or parameters"),
                             ("zero1_impl", "none at this commit (megatron/arguments.py has no --use-distributed-optimizer "
                                            "until d07d29d, 2022-06-08: megatron/optimizer/distrib_optimizer.py, gradient "
                                            "buckets reduce-scattered, parameters all-gathered); a zero1 costing is that "
                                            "bucketed optimizer"))),
    EngineProfile(
        "megatron-lm-2023", "megatron", "tag 23.06 (4f8e9ac, 2023-06-28)", tp_bwd_overlap=True, state_layout="megatron",
        pp_buffers="megatron", sp_saves="shard", norm_kernel="fused", attention_impl="unfused", ddp_impl="local",
        loss_kernel="fused", vocab_parallel_embedding=True, split_rule="even",
        fused_projections=True, dp_kinds=("none", "ddp", "zero1"),
        sources=with_sources(MEGATRON_2023,
                             ("attention_impl", "megatron/arguments.py --use-flash-attn store_true (off by default): "
                                                "megatron/model/transformer.py CoreAttention, torch.baddbmm scores, "
                                                "FusedScaleMaskSoftmax, bmm; a run with --use-flash-attn is "
                                                "megatron-lm-2023+flash"))),
    EngineProfile(
        "megatron-lm-2023+flash", "megatron", "tag 23.06 (4f8e9ac, 2023-06-28) run with --use-flash-attn",
        tp_bwd_overlap=True, state_layout="megatron", pp_buffers="megatron", sp_saves="shard", norm_kernel="fused",
        attention_impl="flash", ddp_impl="local", loss_kernel="fused", vocab_parallel_embedding=True,
        split_rule="even", fused_projections=True, dp_kinds=("none", "ddp", "zero1"),
        sources=with_sources(MEGATRON_2023,
                             ("attention_impl", "megatron/arguments.py --use-flash-attn (a run flag, store_true) -> "
                                                "megatron/model/transformer.py ParallelAttention core_attention_flash = "
                                                "FlashSelfAttention (flash_attn_unpadded_func, flash-attn 1.x)"))),
    EngineProfile(
        "megatron-core-2023.12", "megatron", "Megatron-LM core_v0.4.0 (38879f8, 2023-12-11) - core_v0.5.0 (0acc240, "
        "2024-02-26), legacy model, --transformer-impl local", tp_bwd_overlap=True, state_layout="megatron", pp_buffers="megatron",
        sp_saves="shard", norm_kernel="fused", attention_impl="unfused", ddp_impl="local", loss_kernel="fused",
        vocab_parallel_embedding=True, split_rule="even", fused_projections=True, shard_over_cp=True,
        fp8_recipe="delayed", dp_kinds=("none", "ddp", "zero1"), sources=MEGATRON_CORE_2023_12),
    EngineProfile(
        "megatron-core-2023.12+flash", "megatron", "core_v0.4.0 - core_v0.5.0 run with --use-flash-attn",
        tp_bwd_overlap=True, state_layout="megatron", pp_buffers="megatron", sp_saves="shard", norm_kernel="fused", attention_impl="flash",
        ddp_impl="local", loss_kernel="fused", vocab_parallel_embedding=True, split_rule="even", fused_projections=True,
        shard_over_cp=True, fp8_recipe="delayed", dp_kinds=("none", "ddp", "zero1"),
        sources=with_sources(MEGATRON_CORE_2023_12,
                             ("attention_impl", "megatron/arguments.py --use-flash-attn (a run flag, store_true) -> "
                                                "megatron/model/transformer.py ParallelAttention core_attention_flash = "
                                                "FlashSelfAttention (flash_attn_varlen_func)"))),
    EngineProfile(
        "megatron-core-2024.04", "megatron", "Megatron-LM core_v0.6.0 (cac60ce, 2024-04-18) - core_v0.7.0 (a645f89, "
        "2024-05-30), --transformer-impl transformer_engine", state_layout="megatron", pp_buffers="megatron",
        sp_saves="shard", norm_kernel="fused", attention_impl="flash", ddp_impl="local", loss_kernel="fused",
        vocab_parallel_embedding=True, split_rule="even", fused_projections=True, shard_over_cp=True,
        fp8_recipe="delayed", attention_backend="cudnn", dp_kinds=("none", "ddp", "zero1"),
        sources=with_sources(MEGATRON_CORE_2024_04, TE_CUDNN_ATTENTION)),
    EngineProfile(
        "megatron-lm-2021+zero3", "megatron", "6985e58 + DeepSpeed ZeRO-3 (SC'21 Table 2)", state_layout="megatron",
        pp_buffers="megatron", sp_saves="shard", fsdp_units="module", zero3_impl="deepspeed-2021", norm_kernel="fused",
        attention_impl="unfused", ddp_impl="local", loss_kernel="fused", vocab_parallel_embedding=True,
        split_rule="even", dp_kinds=("none", "ddp", "fsdp"), fused_projections=True,
        grad_accum_pass="autograd", sources=with_sources(MEGATRON_2021, AUTOGRAD_MEGATRON_2021, FUSED_QKV_2021,
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
                                            "(for i in range(self.world_size)) on the host, the device idle; torch's "
                                            "list-form all_gather (ProcessGroupNCCL allgather) copies each rank's chunk "
                                            "out of its flat output, one copy_ per output tensor; per gathered module "
                                            "the sync, then one tensor prefetched (stage3_prefetch_bucket_size 5e7), "
                                            "its gather (+ a bucket's all-reduce) hidden only by that module's compute "
                                            "(cost_models/ds2021_intervals.py); _keep_for_later under "
                                            "stage3_max_reuse_distance 1e9: a recomputed block's last tensors not "
                                            "gathered again for their backward")),
    ),
    EngineProfile(
        "megatron-deepspeed-2021", "megatron", "Megatron-DeepSpeed with DeepSpeed before e2fdd254e (2021-09-29; MT-NLG "
        "2021)", state_layout="zero", pp_buffers="megatron", sp_saves="shard", norm_kernel="fused",
        attention_impl="unfused", ddp_impl="local", loss_kernel="fused", vocab_parallel_embedding=True,
        split_rule="even", dp_kinds=("none", "ddp", "zero1"), fused_projections=True, pp_p2p="deepspeed-grad-whole",
        grad_reduce="param", recompute_scope="modules",
        grad_accum_pass="autograd", sources=with_sources(MEGATRON_2021, AUTOGRAD_MEGATRON_DEEPSPEED_2021, FUSED_QKV_2021, *DEEPSPEED_PIPE,
                             ("attention_impl", "megatron/model/transformer.py: baddbmm, FusedScaleMaskSoftmax, bmm"),
                             ("pp_p2p", "DeepSpeed ddffbae0 (2021-08-30) deepspeed/runtime/pipe/engine.py lines 113-114: "
                                        "is_pipe_partitioned = is_model_parallel, is_grad_partitioned = False (the gradient "
                                        "sent whole by every tp rank; _exec_recv_grads re-gathers the sender's output); "
                                        "p2p.py lines 31-55: blocking dist.broadcast in two-rank groups"),
                             ("state_layout", "DeepSpeed ddffbae0 deepspeed/runtime/zero/stage2.py (ZeRO stage 1 since "
                                              "cfa63f5d, 2021-05): fp16 parameters and gradients, the fp32 master weights "
                                              "and Adam states of the rank's partition; no bf16 in the engine before "
                                              "56c52238 (2022-04-19, 'bf16+pipeline parallelism')"),
                             ("recompute_scope", "DeepSpeed ddffbae0 deepspeed/runtime/pipe/module.py forward (lines "
                                                 "336-352) checkpoints each activation_checkpoint_interval of layers "
                                                 "where _is_checkpointable (lines 598-604): any layer with parameters "
                                                 "unless the class is named GPT2ModelPipe; Megatron-DeepSpeed's is "
                                                 "GPTModelPipe (megatron/model/gpt_model.py at ec166f1c, interval = "
                                                 "--checkpoint-num-layers): its embedding, final LayerNorm and tied "
                                                 "output head re-run in backward too (only the blocks from e2fdd254e)"),
                             ("grad_reduce", "DeepSpeed ddffbae0 stage2.py reduce_gradients (lines 552-572): the ipg "
                                             "buffer in self.dtype (fp16), reduced per partition (allreduce_always_fp32 "
                                             "off by default)"),
                             ("dp_kinds", "DeepSpeed ZeRO-1 beside its pipeline engine: deepspeed/runtime/pipe/engine.py "
                                          "asserts zero_optimization_stage() < 2 (fbece50b, 2021-04); MT-NLG ran ZeRO-1"),
                             ("split_rule", "deepspeed/runtime/pipe/module.py PipelineModule partition_method "
                                            "(Megatron-DeepSpeed gpt_model.py GPTModelPipe: 'type:transformer')")),
    ),
    EngineProfile(
        "megatron-deepspeed-2022", "megatron", "Megatron-DeepSpeed with DeepSpeed from e2fdd254e (2021-09-29; BLOOM 2022)",
        state_layout="megatron", pp_buffers="megatron", sp_saves="shard", norm_kernel="fused", attention_impl="unfused",
        ddp_impl="local", loss_kernel="fused", vocab_parallel_embedding=True, split_rule="even",
        dp_kinds=("none", "ddp", "zero1"), fused_projections=True, pp_p2p="deepspeed", grad_accum_pass="bf16-optimizer",
        sources=with_sources(MEGATRON_2021, FUSED_QKV_2021, *DEEPSPEED_PIPE,
                             ("attention_impl", "megatron/model/transformer.py: baddbmm, FusedScaleMaskSoftmax, bmm"),
                             ("pp_p2p", "DeepSpeed 9b70ce56 (2022-06-29) deepspeed/runtime/pipe/engine.py lines 133-134: "
                                        "is_pipe_partitioned = is_grad_partitioned = is_model_parallel (from e2fdd254e, "
                                        "2021-09-29): activation and gradient sent as 1/tp slices, re-gathered by "
                                        "PartitionedTensor.full(); p2p.py lines 48-83: blocking dist.send / dist.recv "
                                        "(async_op asserted False)"),
                             ("grad_accum_pass", "DeepSpeed 9b70ce56 deepspeed/runtime/pipe/engine.py lines 771-773: "
                                                 "after every BackwardPass under bf16, optimizer.update_hp_grads "
                                                 "(bf16_optimizer.py line 400: hp_grad.add_(lp.grad.to(fp32))); the "
                                                 "last stage through optimizer.backward (BF16_Optimizer.backward)"),
                             ("dp_kinds", "DeepSpeed ZeRO-1 beside its pipeline engine: deepspeed/runtime/pipe/engine.py "
                                          "asserts zero_optimization_stage() < ZeroStageEnum.gradients ('ZeRO-2 and ZeRO-3 are "
                                          "incompatible with pipeline parallelism'); BLOOM ran ZeRO-1 (BF16_Optimizer)"),
                             ("split_rule", "deepspeed/runtime/pipe/module.py PipelineModule partition_method "
                                            "(--pp-partition-method in the run's flags)")),
    ),
    EngineProfile(
        "megatron-core-2024", "megatron", "core_v0.8 (2024)", state_layout="megatron", pp_buffers="megatron",
        sp_saves="shard", norm_kernel="fused", attention_impl="flash", ddp_impl="local", loss_kernel="fused",
        vocab_parallel_embedding=True, split_rule="first_last", fp8_recipe="delayed", glu_kernel="fused",
        fused_projections=True, shard_over_cp=True, attention_backend="cudnn", dp_kinds=("none", "ddp", "zero1"),
        moe_combine="unpermute",
        sources=with_sources(MEGATRON_2021, FUSED_MEGATRON_CORE,
                             ("moe_combine", "core_v0.8.0 megatron/core/transformer/moe/moe_utils.py unpermute: probs * permuted_tokens (the experts' output kept for the probabilities' gradient); experts.py TEGroupedMLP bias_swiglu_impl (glu_kernel)"),
                             TE_CUDNN_ATTENTION,
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
                             ("ddp_impl", "core_v0.8.0 (baf94af) megatron/training/arguments.py line 1413: "
                                          "--overlap-grad-reduce store_true, default False (megatron/core/distributed/"
                                          "distributed_data_parallel_config.py line 14 overlap_grad_reduce: bool = "
                                          "False): the contiguous gradient buffers reduced after backward "
                                          "(finish_grad_sync), not overlapped, as megatron-core-2023.12 / 2024.04; a "
                                          "run with the flag is ddp_impl 'torch' (a run flag)"),
                             ("loss_kernel", "megatron/core/tensor_parallel/cross_entropy.py VocabParallelCrossEntropy"),
                             ("split_rule", "num_layers / pp, the first / last set by --decoder-first/last-pipeline-num-layers")),
    ),
    EngineProfile(
        "megatron-core-2026", "megatron", "megatron-core 0.16 (installed)", state_layout="megatron",
        pp_buffers="megatron", sp_saves="shard", norm_kernel="fused", attention_impl="flash", ddp_impl="torch",
        loss_kernel="fused", vocab_parallel_embedding=True, split_rule="first_last", fp8_recipe="delayed",
        glu_kernel="fused", fused_projections=True, shard_over_cp=True, attention_backend="cudnn",
        moe_combine="in_act",
        sources=with_sources(MEGATRON_2021, FUSED_MEGATRON_CORE,
                             ("moe_combine", "megatron/core/transformer/moe/experts.py TEGroupedMLP.forward bias_act_func: weighted_bias_swiglu_impl(fc1_output, bias, permuted_probs) keeps fc1's output and the probabilities, the experts' output is not kept (2659630, 2025-04-09, 'Memory efficient token permutation', core 0.13 on)"),
                             TE_CUDNN_ATTENTION,
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
)  # fmt: skip
