"""Where Megatron-LM 2022 and 2023 set the conventions of their engine profiles
(``engine_profiles.PROFILES`` "megatron-lm-2022", "megatron-lm-2023", "megatron-lm-2023+flash"): one
(field, file and default at that commit) per ``EngineProfile`` field, read from github.com/NVIDIA/Megatron-LM.
Data only; no torch import."""

from __future__ import annotations

Sources = tuple[tuple[str, str], ...]


def _override(sources: Sources, *extra: tuple[str, str]) -> Sources:
    keys = {k for k, _ in extra}
    return tuple(s for s in sources if s[0] not in keys) + extra



#: Megatron-LM at 9aad920 (2022-05-20), the merge that brought sequence parallelism and selective
#: recompute (run flags: ``expert_config.sequence_parallel`` from --sequence-parallel,
#: ``training.recompute`` "selective" from --recompute-activations / --recompute-granularity selective)
MEGATRON_2022: Sources = (
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
    ("split_rule", "megatron/mpu/initialize.py / model/transformer.py: num_layers // pipeline size per stage "
                   "(--num-layers-per-virtual-pipeline-stage for interleaving)"),
    ("fused_projections", "megatron/model/transformer.py ParallelAttention.query_key_value: one "
                          "ColumnParallelLinear of 3 x projection size (q, k, v in one GEMM)"),
    ("zero1_impl", "Megatron's distributed optimizer (--use-distributed-optimizer, from d07d29d 2022-06-08, "
                   "megatron/optimizer/distrib_optimizer.py): gradient buckets reduce-scattered, parameter "
                   "buckets all-gathered"),
    ("autocast_cache", "none used: 16-bit model parameters (state_layout), no torch.autocast"),
    ("shard_over_cp", "none used: megatron/arguments.py has no --context-parallel-size (context parallelism "
                      "came with Megatron-Core core_v0.4.0, 2023-12; tag 23.06 has none either)"),
)  # fmt: skip

#: Megatron-LM at tag 23.06 (4f8e9ac, 2023-06-28): the 2022 conventions, megatron/mpu moved to
#: megatron/core/tensor_parallel, the distributed optimizer (--use-distributed-optimizer, a run flag:
#: ``expert_config.dp_kind`` "zero1") and --use-flash-attn (opt-in: the "+flash" variant)
MEGATRON_2023: Sources = _override(
    MEGATRON_2022,
    ("sp_saves", "megatron/core/tensor_parallel/layers.py LinearWithGradAccumulationAndAsyncCommunication.forward: "
                 "under sequence_parallel ctx.save_for_backward(input, weight) keeps the shard, all-gathered again "
                 "in backward"),
    ("loss_kernel", "megatron/core/tensor_parallel/cross_entropy.py vocab_parallel_cross_entropy"),
    ("vocab_parallel_embedding", "megatron/core/tensor_parallel/layers.py VocabParallelEmbedding"),
    ("ddp_impl", "megatron/arguments.py --DDP-impl default 'local' (megatron/model/distributed.py "
                 "DistributedDataParallel: the contiguous gradient buffer all-reduced after backward; the "
                 "distributed optimizer reduce-scatters it after backward: --overlap-grad-reduce arrives with "
                 "e801b2b, 2023-09-07)"),
    ("zero1_impl", "megatron/arguments.py --use-distributed-optimizer (store_true) -> megatron/optimizer/"
                   "distrib_optimizer.py DistributedOptimizer: gradient buckets reduce-scattered, parameter "
                   "buckets all-gathered"),
    ("fused_projections", "megatron/model/transformer.py ParallelAttention.query_key_value (3 x projection size); "
                          "ParallelMLP.dense_h_to_4h of ffn_hidden_size x 2 under --swiglu (gate and up in one GEMM)"),
    ("pp_scatter_gather", "megatron/core/pipeline_parallel/p2p_communication.py (from the core-pipeline merge "
                          "edca71d, 2023-03-23): whole tensors sent; --no-scatter-gather-tensors-in-pipeline is "
                          "still parsed (megatron/arguments.py) but nothing reads it"),
)  # fmt: skip
