"""meshplan's own runtime as an engine profile (``MESHPLAN``, the profile ``estimate_graph`` prices
by default), each field traced to the runtime module that runs it; ``MESHPLAN_BF16`` ("meshplan-bf16"),
the same runtime with 16-bit model weights, fp32 main gradients and masters (``Plan.state_layout``), and
``MESHPLAN_BF16_GRADS`` ("meshplan-bf16-grads") with 16-bit main gradients too.
No torch import."""

from __future__ import annotations

import dataclasses

from meshplan.cost_models.engine_profiles.grad_accum_sources import AUTOGRAD_MESHPLAN, MAIN_GRAD_HOOK_MESHPLAN
from meshplan.cost_models.engine_profiles.profile_type import EngineProfile, with_sources

MESHPLAN = EngineProfile(
    "meshplan", "meshplan", "this repository", pp_buffers="in-flight", zero1_impl="torch", autocast_cache="step",
    shard_over_cp=True, recompute_unit="block", cp_rotate="ring-dkv", sp_saves="shard", grad_accum_pass="autograd",
    optimizer_sync="async",
    sources=(
        AUTOGRAD_MESHPLAN,
        ("sp_saves", "runtime/apply/sp_saves.py ShardSaves: under SP the column-parallel linears reading an "
                     "all-gathered sequence shard save the shard (saved_tensors_hooks) and all-gather it again in "
                     "backward, as Megatron's LinearWithGradAccumulationAndAsyncCommunication; under autocast the "
                     "shard is cast before its gather, so its readers share one 16-bit copy"),
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
        ("optimizer_sync", "runtime/apply/optim.py grads_norm / clip_grad_norm: the norm's squares summed on the "
                           "device and returned as a device tensor; parallel_model.py ParallelModel._optimizer_step "
                           "reads it (last_grad_norm) after optimizer.step() is issued, so the step's Python runs "
                           "while the device clips (#33; fp16: torch's GradScaler reads its found-inf flags before "
                           "the update, optimizer_phase.phase_sync)"),
        ("attention_impl", "F.scaled_dot_product_attention (flash kernel)"),
        ("ddp_impl", "torch DDP / bucketed manual all-reduce overlapped with backward"),
        ("vocab_parallel_embedding", "the TP placement ILP chooses the embedding's style (tp.strategies)"),
        ("fsdp_units", "runtime/apply/data_parallel.wrap_dp: fully_shard per repeated block, then the root (every "
                       "other layer)"),
    ),
)  # fmt: skip

#: meshplan's runtime with 16-bit model weights (``Plan.state_layout`` "megatron",
#: ``runtime/apply/master_state.py``): Megatron's mixed-precision state layout, run by meshplan's
#: runtime for dp_kind none / ddp / zero1 in bf16 without cp, ep or quantization (the combinations
#: ``plan.execution_rules.state_layout_blocker`` lets through; the search proposes no others)
MESHPLAN_BF16 = dataclasses.replace(
    MESHPLAN, name="meshplan-bf16", state_layout="megatron", main_grads="fp32", dp_kinds=("none", "ddp", "zero1"),
    grad_accum_pass="main-grad-hook",
    sources=with_sources(
        MESHPLAN.sources, MAIN_GRAD_HOOK_MESHPLAN,
        ("state_layout", "runtime/apply/master_state.py MasterState: the trainable parameters cast to bf16 in place "
                         "(p.data, DTensors by torch.utils.swap_tensors), fp32 master copies of the rank's zero1 "
                         "partition (every parameter at ddp / none) stepped by the run's optimizer, the updated "
                         "weights broadcast from their owner in bf16"),
        ("main_grads", "runtime/apply/master_state.py MasterState.fold: a persistent fp32 main gradient per "
                       "parameter, its bf16 .grad added in by register_post_accumulate_grad_hook and freed; "
                       "runtime/apply/grad_sync.py BucketedGradSync all-reduces the fp32 main gradients"),
        ("autocast_cache", "unused: torch.autocast around each stage call finds the weights already bf16 "
                           "(no cast, nothing cached)"),
        ("dp_kinds", "none, ddp, zero1: plan.execution_rules.state_layout_blocker refuses the FSDP2 kinds"),
    ),
)  # fmt: skip

#: the same with 16-bit main gradients (``Plan.state_layout`` "zero"): accumulated and all-reduced in bf16
MESHPLAN_BF16_GRADS = dataclasses.replace(
    MESHPLAN_BF16, name="meshplan-bf16-grads", state_layout="zero", main_grads="16-bit", grad_reduce="param",
    sources=with_sources(
        MESHPLAN_BF16.sources,
        ("state_layout", "runtime/apply/master_state.py MasterState(main_dtype=bf16): bf16 weights and a persistent "
                         "bf16 gradient buffer, fp32 masters of the rank's zero1 partition (an fp32 copy of their "
                         "gradients made for the update)"),
        ("main_grads", "runtime/apply/master_state.py MasterState.fold adds the bf16 .grad into the bf16 buffer; "
                       "runtime/apply/grad_sync.py BucketedGradSync buckets and all-reduces it in bf16"),
        ("grad_reduce", "'param': the bucketed all-reduce moves the bf16 main gradients"),
    ),
)  # fmt: skip
