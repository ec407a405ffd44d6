"""Where Megatron-LM 2022 and 2023 set the conventions of their engine profiles
(``engine_profiles.PROFILES`` "megatron-lm-2022", "megatron-lm-2023", "megatron-lm-2023+flash"): one
(field, file and default at that commit) per ``EngineProfile`` field, read from github.com/NVIDIA/Megatron-LM;
and the Megatron-LM 2021 sources, its fused QKV and the Transformer Engine attention choice the other
Megatron-family profiles (``megatron_profiles``, ``nemo_profiles``) build on, and what DeepSpeed's pipeline
engine does after its flush (``DEEPSPEED_PIPE``, the Megatron-DeepSpeed profiles).
Data only; no torch import."""

from __future__ import annotations

from meshplan.cost_models.engine_profiles.grad_accum_sources import FUSED_MEGATRON_2022, FUSED_MEGATRON_CORE
from meshplan.cost_models.engine_profiles.profile_type import Sources, with_sources

#: Megatron-LM's fused QKV before Megatron-Core (the 2021 code the SC'21 scripts ran, and the
#: Megatron-DeepSpeed fork of it)
FUSED_QKV_2021 = ("fused_projections", "megatron/model/transformer.py ParallelAttention.query_key_value (6985e58 "
                                        "line 140): one ColumnParallelLinear of 3 x projection size (q, k, v in one "
                                        "GEMM and one weight tensor)")

MEGATRON_2021: Sources = (
    ("recompute_unit", "megatron/model/transformer.py ParallelTransformer._checkpointed_forward: chunks of "
                       "--checkpoint-num-layers layers (default 1) per checkpoint, within each stage"),
    ("state_layout", "megatron/optimizer: fp16 model + fp32 main gradients + fp32 master weights and Adam states "
                     "(README: 18 bytes per parameter, no distributed optimizer yet)"),
    ("pp_buffers", "megatron/p2p_communication.py: torch.distributed p2p into the next stage's input tensor, "
                   "nothing kept per microbatch beyond the stage inputs"),
    ("sp_saves", "megatron/mpu/layers.py ColumnParallelLinear (SP from 2022: saves its shard, all-gathers in backward)"),
    ("norm_kernel", "apex FusedLayerNorm (megatron/model/fused_layer_norm.py)"),
    ("optimizer_impl", "apex.optimizers.FusedAdam (megatron/optimizer/__init__.py)"),
    ("optimizer_sync", "megatron/optimizer/clip_grads.py clip_grad_norm_fp32: amp_C.multi_tensor_l2norm, then "
                       "total_norm.item() before multi_tensor_scale (only when clip_coeff < 1.0) and the update: the "
                       "host waits (Megatron-Core: megatron/core/optimizer/clip_grads.py get_grad_norm_fp32)"),
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
TE_CUDNN_ATTENTION = (
    "attention_backend",
    "Transformer Engine DotProductAttention get_attention_backend (transformer_engine/pytorch/attention.py; "
    "dot_product_attention/utils.py in later releases): 'Disabling FlashAttention to give FusedAttention preference "
    "on Hopper+ for performance reasons' when both are available (cuDNN F16_arbitrary_seqlen); the TE release of "
    "each container not pinned here",
)


#: Megatron-LM at 9aad920 (2022-05-20), the merge that brought sequence parallelism and selective
#: recompute (run flags: ``expert_config.sequence_parallel`` from --sequence-parallel,
#: ``training.recompute`` "selective" from --recompute-activations / --recompute-granularity selective)
MEGATRON_2022: Sources = (
    ("optimizer_sync", "megatron/optimizer/clip_grads.py clip_grad_norm_fp32: total_norm.item() before the "
                       "update (the host waits; Megatron-Core: megatron/core/optimizer/clip_grads.py "
                       "get_grad_norm_fp32); traced since meshplan's own profile went 'async' (#33)"),
    FUSED_MEGATRON_2022,
    ("recompute_unit", "megatron/model/transformer.py ParallelTransformer._checkpointed_forward: --recompute-method "
                       "uniform / block, chunks of --recompute-num-layers layers (default 1), within each stage"),
    ("state_layout", "megatron/optimizer/optimizer.py Float16OptimizerWithFloat16Params: 16-bit model parameters, "
                     "fp32 main parameters and Adam states; megatron/model/distributed.py LocalDDP main_grad buffer "
                     "fp32 under --accumulate-allreduce-grads-in-fp32 (forced on for --bf16, megatron/arguments.py)"),
    ("pp_buffers", "megatron/p2p_communication.py _communicate: torch.distributed p2p into the next stage's "
                   "input tensor, nothing kept per microbatch beyond the stage inputs"),
    ("sp_saves", "megatron/mpu/layers.py LinearWithGradAccumulationAndAsyncCommunication.forward: under "
                 "sequence_parallel all-gathers its input, ctx.save_for_backward(input, weight) keeps the shard, "
                 "backward all-gathers it again"),
    ("norm_kernel", "megatron/model/fused_layer_norm.py MixedFusedLayerNorm (apex fused / persistent layer norm, "
                    "--no-persist-layer-norm to turn the latter off)"),
    ("optimizer_impl", "megatron/optimizer/__init__.py: apex.optimizers.FusedAdam (--optimizer default 'adam')"),
    ("attention_impl", "megatron/model/transformer.py CoreAttention: torch.baddbmm scores, FusedScaleMaskSoftmax "
                       "(--no-masked-softmax-fusion off), dropout, bmm; no flash kernel (--recompute-granularity "
                       "selective checkpoints this CoreAttention: _checkpointed_attention_forward)"),
    ("ddp_impl", "megatron/arguments.py --DDP-impl default 'local' (megatron/model/distributed.py: one "
                 "all-reduce of the contiguous gradient buffer after backward)"),
    ("loss_kernel", "megatron/mpu/cross_entropy.py vocab_parallel_cross_entropy (--fp16-lm-cross-entropy off: "
                    "fp32 logits)"),
    ("vocab_parallel_embedding", "megatron/mpu/layers.py VocabParallelEmbedding; the output layer is the "
                                 "tied embedding, column parallel"),
    ("pp_scatter_gather", "megatron/arguments.py --no-scatter-gather-tensors-in-pipeline (on by default); "
                          "megatron/p2p_communication.py applies it only `not args.sequence_parallel`"),
    ("tp_bwd_overlap", "megatron/mpu/layers.py LinearWithGradAccumulationAndAsyncCommunication.backward (83b1e42, "
                       "2022-02-13; 9aad920): ColumnParallelLinear's input-gradient all_reduce (async_grad_allreduce = "
                       "--async-tensor-model-parallel-allreduce, on by default, off under --sequence-parallel) or, under "
                       "sequence parallelism, its _reduce_scatter_base runs async_op=True before the weight-gradient GEMM "
                       "and is waited on after it (and the saved shard's _all_gather_base before the input-gradient GEMM)"),
    ("split_rule", "megatron/mpu/initialize.py / model/transformer.py: num_layers // pipeline size per stage "
                   "(--num-layers-per-virtual-pipeline-stage for interleaving)"),
    ("fused_projections", "megatron/model/transformer.py ParallelAttention.query_key_value: one "
                          "ColumnParallelLinear of 3 x projection size (q, k, v in one GEMM)"),
    ("zero1_impl", "Megatron's distributed optimizer (--use-distributed-optimizer, from d07d29d 2022-06-08, "
                   "megatron/optimizer/distrib_optimizer.py): gradient buckets reduce-scattered, parameter "
                   "buckets all-gathered"),
    ("autocast_cache", "none used: 16-bit model parameters (state_layout), no torch.autocast"),
    ("dp_kinds", "megatron/arguments.py --DDP-impl local | torch (replicated states); no --use-distributed-optimizer "
                 "until d07d29d (2022-06-08), no ZeRO-2 / ZeRO-3"),
    ("shard_over_cp", "none used: megatron/arguments.py has no --context-parallel-size (context parallelism "
                      "came with Megatron-Core core_v0.4.0, 2023-12; tag 23.06 has none either)"),
)  # fmt: skip

#: Megatron-LM at tag 23.06 (4f8e9ac, 2023-06-28): the 2022 conventions, megatron/mpu moved to
#: megatron/core/tensor_parallel, the distributed optimizer (--use-distributed-optimizer, a run flag:
#: ``expert_config.dp_kind`` "zero1") and --use-flash-attn (opt-in: the "+flash" variant)
MEGATRON_2023: Sources = with_sources(
    MEGATRON_2022,
    ("tp_bwd_overlap", "megatron/core/tensor_parallel/layers.py LinearWithGradAccumulationAndAsyncCommunication."
                       "backward: the input-gradient all_reduce (async_grad_allreduce, ColumnParallelLinear's "
                       "async_tensor_model_parallel_allreduce default True) or under sequence parallelism the "
                       "_reduce_scatter_base launched async_op=True before the weight-gradient GEMM, waited after it"),
    ("sp_saves", "megatron/core/tensor_parallel/layers.py LinearWithGradAccumulationAndAsyncCommunication.forward: "
                 "under sequence_parallel ctx.save_for_backward(input, weight) keeps the shard, all-gathered again "
                 "in backward"),
    ("loss_kernel", "megatron/core/tensor_parallel/cross_entropy.py vocab_parallel_cross_entropy"),
    ("vocab_parallel_embedding", "megatron/core/tensor_parallel/layers.py VocabParallelEmbedding"),
    ("ddp_impl", "megatron/arguments.py --DDP-impl default 'local' (megatron/model/distributed.py "
                 "DistributedDataParallel: the contiguous gradient buffer all-reduced after backward; the "
                 "distributed optimizer reduce-scatters it after backward: --overlap-grad-reduce arrives with "
                 "e801b2b, 2023-09-07)"),
    ("dp_kinds", "megatron/arguments.py --DDP-impl local | torch and --use-distributed-optimizer (zero1); no "
                 "sharded gradients or parameters"),
    ("zero1_impl", "megatron/arguments.py --use-distributed-optimizer (store_true) -> megatron/optimizer/"
                   "distrib_optimizer.py DistributedOptimizer: gradient buckets reduce-scattered, parameter "
                   "buckets all-gathered"),
    ("fused_projections", "megatron/model/transformer.py ParallelAttention.query_key_value (3 x projection size); "
                          "ParallelMLP.dense_h_to_4h of ffn_hidden_size x 2 under --swiglu (gate and up in one GEMM)"),
    ("pp_scatter_gather", "megatron/core/pipeline_parallel/p2p_communication.py (from the core-pipeline merge "
                          "edca71d, 2023-03-23): whole tensors sent; --no-scatter-gather-tensors-in-pipeline is "
                          "still parsed (megatron/arguments.py) but nothing reads it"),
)  # fmt: skip

#: Megatron-LM at core_v0.4.0 (38879f8, 2023-12-11) and core_v0.5.0 (0acc240, 2024-02-26): Megatron-Core's
#: DDP and context parallelism; the legacy model (megatron/model, ``--use-mcore-models`` is opt-in) with
#: ``--transformer-impl`` default 'local', so the 23.06 layers and kernels. Run flags: --overlap-grad-reduce
#: (``expert_config.ddp_impl`` "torch"), --use-flash-attn (the "+flash" variant), --tp-comm-overlap
MEGATRON_CORE_2023_12: Sources = with_sources(
    MEGATRON_2023,
    FUSED_MEGATRON_CORE,
    ("ddp_impl", "megatron/arguments.py: no --DDP-impl; megatron/training.py get_model wraps megatron/core/"
                 "distributed/distributed_data_parallel.py DDP (contiguous grad buffers); --overlap-grad-reduce "
                 "store_true, default False: the buffers reduced after backward (finish_grad_sync), the distributed "
                 "optimizer's reduce-scatter and all-gather waited for; a run with the flag is ddp_impl 'torch'"),
    ("shard_over_cp", "megatron/training.py get_model: DDP(..., data_parallel_group=mpu.get_data_parallel_group("
                      "with_context_parallel=True)); megatron/optimizer/distrib_optimizer.py build_model_gbuf_range "
                      "over get_data_parallel_world_size(with_context_parallel=True): states sharded over dp x cp"),
    ("state_layout", "megatron/optimizer/optimizer.py Float16OptimizerWithFloat16Params (fp32 main parameters and "
                     "Adam states); megatron/arguments.py forces accumulate_allreduce_grads_in_fp32 under --bf16 -> "
                     "distributed_data_parallel.py grad buffer dtype torch.float"),
    ("dp_kinds", "megatron/arguments.py --use-distributed-optimizer (zero1), else DDP's replicated states; no "
                 "sharded gradients or parameters"),
    ("fp8_recipe", "megatron/arguments.py --fp8-format (needs --transformer-impl transformer_engine): "
                   "megatron/core/transformer/custom_layers/transformer_engine.py TE DelayedScaling"),
    ("attention_impl", "megatron/arguments.py --transformer-impl default 'local', --use-mcore-models opt-in: "
                       "pretrain_gpt.py builds the legacy megatron/model GPTModel, whose CoreAttention runs baddbmm "
                       "scores, FusedScaleMaskSoftmax, bmm; --use-flash-attn (store_true) is the '+flash' variant"),
)  # fmt: skip

#: Megatron-LM at core_v0.6.0 (cac60ce, 2024-04-18) and core_v0.7.0 (a645f89, 2024-05-30): the same DDP,
#: distributed optimizer and context parallelism, ``--transformer-impl`` default now 'transformer_engine':
#: the legacy model (still the default, megatron/legacy/model) builds each layer as Transformer Engine's
#: TransformerLayer, an mcore model (--use-mcore-models) the TE layer spec
MEGATRON_CORE_2024_04: Sources = with_sources(
    MEGATRON_CORE_2023_12,
    ("attention_impl", "megatron/training/arguments.py --transformer-impl default 'transformer_engine': "
                       "megatron/legacy/model/transformer.py ParallelTransformer build_layer -> "
                       "transformer_engine.pytorch.TransformerLayer (TE DotProductAttention: fused flash / cuDNN "
                       "kernels); pretrain_gpt.py under --use-mcore-models get_gpt_layer_with_transformer_engine_spec"),
    ("norm_kernel", "TE TransformerLayer's LayerNormLinear / LayerNormMLP: the norm fused into the next GEMM's "
                    "kernel (normalization = args.normalization)"),
    ("fused_projections", "TE TransformerLayer: one LayerNormLinear of 3 x projection size for q, k, v; LayerNormMLP "
                          "fc1 of 2 x ffn_hidden_size under activation 'swiglu' (gate and up in one GEMM)"),
    ("sp_saves", "TE LayerNormLinear / Linear under sequence_parallel: the local shard of the GEMM input saved, "
                 "all-gathered again in backward (transformer_engine/pytorch/module/layernorm_linear.py)"),
    ("fp8_recipe", "megatron/training/arguments.py --fp8-format, --fp8-amax-history-len default 1: TE "
                   "DelayedScaling (megatron/core/transformer/custom_layers/transformer_engine.py)"),
    ("loss_kernel", "megatron/core/tensor_parallel/cross_entropy.py vocab_parallel_cross_entropy"),
    ("tp_bwd_overlap", "not priced: Transformer Engine's Linear / LayerNormLinear replace megatron/core/tensor_parallel/"
                       "layers.py, and their backward's collective order is not traced here"),
)  # fmt: skip

#: DeepSpeed's PipelineEngine as Megatron-DeepSpeed runs it (GPTModelPipe): what every version of it does
#: after the pipeline flush (the MT-NLG 2021 and BLOOM 2022 versions alike)
DEEPSPEED_PIPE: Sources = (
    ("ddp_impl", "DeepSpeed deepspeed/runtime/pipe/engine.py PipelineEngine.__init__ sets enable_backward_allreduce = "
                 "False (line 59 at ddffbae0, 75 at 9b70ce56); schedule.py TrainSchedule.steps appends "
                 "ReduceTiedGrads, ReduceGrads, OptimizerStep after the last step (lines 235-237): _exec_reduce_grads "
                 "-> allreduce_gradients (ZeRO-1: optimizer.reduce_gradients) after every microbatch's backward, "
                 "nothing overlapped, then the step and its parameter all-gather (the 'local' order)"),
    ("pp_buffers", "deepspeed/runtime/pipe/engine.py pipe_buffers (inputs, outputs per buffer): "
                   "schedule.py TrainSchedule.num_pipe_buffers = min(stages - stage_id + 1, micro_batches), the "
                   "microbatches in flight"),
)  # fmt: skip
