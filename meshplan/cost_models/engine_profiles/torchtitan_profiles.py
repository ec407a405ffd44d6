"""torchtitan's engine profiles by version (2024.04, 2024.12, 2025.06, the installed 0.3.0), each field
traced to torchtitan's source at the commit named.
No torch import."""

from __future__ import annotations

from meshplan.cost_models.engine_profiles.grad_accum_sources import AUTOGRAD_TORCHTITAN
from meshplan.cost_models.engine_profiles.profile_type import EngineProfile, with_sources

#: the sources every torchtitan profile shares (each version's own fields replace them)
TITAN_2024 = (
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
    ("optimizer_sync", "train.py: clip_grad_norm_(..., foreach=True) (torch's, then dist_utils.clip_grad_norm_: "
                       "get_total_norm + clip_grads_with_norm_ on the device), then optimizers.step(); the loss and "
                       "grad norm read with .item() only at logging steps, after the update (0.3.0 trainer.py "
                       "train_step: float(grad_norm.item()) under should_log)"),
    ("autocast_cache", "train.py maybe_enable_amp: torch.autocast around each model forward, and only without "
                       "FSDP and pipeline parallelism (config: mixed precision via autocast under DDP / one "
                       "device): one region per call"),
)  # fmt: skip


TORCHTITAN: tuple[EngineProfile, ...] = (
    EngineProfile(
        "torchtitan-2024.04", "torchtitan", "0413364 (2024-04)", pp_buffers="torch-outputs", norm_kernel="eager",
        optimizer_impl="foreach", vocab_parallel_embedding=True, split_rule="fewer_first_last",
        optimizer_sync="async",
        dp_kinds=("none", "fsdp"),
        grad_accum_pass="autograd", sources=with_sources(TITAN_2024, AUTOGRAD_TORCHTITAN,
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
        optimizer_impl="foreach", vocab_parallel_embedding=True, split_rule="fewer_first_last",
        optimizer_sync="async", shard_over_cp=True,
        cp_rotate="allgather", dp_kinds=("none", "ddp", "fsdp", "hsdp"),
        grad_accum_pass="autograd", sources=with_sources(TITAN_2024, AUTOGRAD_TORCHTITAN,
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
        optimizer_impl="fused", vocab_parallel_embedding=True, split_rule="fewer_first_last",
        optimizer_sync="async", shard_over_cp=True,
        dp_kinds=("none", "ddp", "zero2", "fsdp", "hsdp"),
        grad_accum_pass="autograd", sources=with_sources(TITAN_2024, AUTOGRAD_TORCHTITAN,
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
        optimizer_impl="fused", vocab_parallel_embedding=True, split_rule="fewer_first_last",
        optimizer_sync="async", fp8_recipe="rowwise",
        shard_over_cp=True, cp_rotate="allgather", fsdp_units="block-ends",
        dp_kinds=("none", "ddp", "zero2", "fsdp", "hsdp"),
        grad_accum_pass="autograd", sources=with_sources(TITAN_2024, AUTOGRAD_TORCHTITAN,
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
)  # fmt: skip
