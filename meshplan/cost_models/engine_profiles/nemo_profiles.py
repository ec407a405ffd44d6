"""NeMo's and Megatron-Bridge's engine profiles (their recipes over Megatron-Core), each field traced to
the recipe or container named.
No torch import."""

from __future__ import annotations

from meshplan.cost_models.engine_profiles.grad_accum_sources import FUSED_NEMO
from meshplan.cost_models.engine_profiles.megatron_sources import (
    MEGATRON_2021,
    TE_CUDNN_ATTENTION,
)
from meshplan.cost_models.engine_profiles.profile_type import EngineProfile, with_sources

NEMO: tuple[EngineProfile, ...] = (
    EngineProfile(
        "megatron-bridge-2025", "megatron", "Megatron-Bridge performance recipes (NeMo 25.11 - 26.04 containers)",
        state_layout="zero", pp_buffers="megatron", sp_saves="shard", norm_kernel="fused", attention_impl="flash",
        ddp_impl="torch", loss_kernel="fused", vocab_parallel_embedding=True, split_rule="even", fp8_recipe="current",
        glu_kernel="fused", tp_comm_overlap=True, fused_projections=True, shard_over_cp=True, attention_backend="cudnn",
        main_grads="16-bit",
        moe_combine="in_act",
        sources=with_sources(MEGATRON_2021, FUSED_NEMO,
                             ("moe_combine", "megatron/core/transformer/moe/experts.py TEGroupedMLP.forward bias_act_func: weighted_bias_swiglu_impl(fc1_output, bias, permuted_probs) keeps fc1's output and the probabilities, the experts' output is not kept (2659630, 2025-04-09, 'Memory efficient token permutation', core 0.13 on)"),
                             TE_CUDNN_ATTENTION,
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
        sources=with_sources(MEGATRON_2021, FUSED_NEMO,
                             ("moe_combine", "core_v0.8.0 megatron/core/transformer/moe/moe_utils.py unpermute: probs * permuted_tokens (the experts' output kept for the probabilities' gradient); experts.py TEGroupedMLP bias_swiglu_impl (glu_kernel)"),
                             TE_CUDNN_ATTENTION,
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
)  # fmt: skip
