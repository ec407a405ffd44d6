"""Where each engine version accumulates a parameter's gradient across microbatches
(``EngineProfile.grad_accum_pass``, ``cost_models.grad_accum``): the ``sources`` entries the profiles
cite, traced to the engine's code at the version the profile names. No torch import."""

from __future__ import annotations

#: torch's AccumulateGrad, which every "autograd" entry below runs
_ACCUMULATE_GRAD = ("torch/csrc/autograd/functions/accumulate_grad.h (torch 2.13) line 252: "
                    "variable_grad += new_grad once .grad exists (the first microbatch's gradient stolen)")

AUTOGRAD_MESHPLAN = ("grad_accum_pass", "autograd: runtime/apply/parallel_model.py (ddp: model.no_sync() but for the "
                     "last microbatch, so .grad accumulates in fp32 through autograd; FSDP2 zero2 / fsdp / hsdp "
                     "reduce-scatter every microbatch and add into the sharded gradient, torch "
                     "fsdp/_fully_shard/_fsdp_collectives.py line 749; pipelines: torch.distributed.pipelining "
                     "stage.py line 847 set_requires_gradient_sync(False) but for the last microbatch); "
                     + _ACCUMULATE_GRAD)
MAIN_GRAD_HOOK_MESHPLAN = ("grad_accum_pass", "main-grad-hook: runtime/apply/master_state.py MasterState.fold "
                           "(register_post_accumulate_grad_hook): main += grad, grad = None, every microbatch")
AUTOGRAD_TORCHTITAN = ("grad_accum_pass", "autograd: torchtitan trainer.py (0.3.0 line 885) runs "
                       "gradient_accumulation_steps forward-backward calls with no no_sync / "
                       "set_requires_gradient_sync: FSDP2 reduce-scatters every microbatch and adds into the "
                       "sharded gradient (torch _fsdp_collectives.py line 749), replicate / DDP accumulates .grad; "
                       + _ACCUMULATE_GRAD)
AUTOGRAD_LLM_FOUNDRY = ("grad_accum_pass", "autograd: Composer's microbatch loop calls loss.backward() per "
                        "microbatch under composer/distributed/dist_strategy.py ddp_sync_context, which applies "
                        "no_sync (DDPSyncStrategy SINGLE_AUTO_SYNC, the default) only to a DistributedDataParallel "
                        "model; torch FSDP1 reduce-scatters each microbatch and adds into the sharded gradient "
                        "(_runtime_utils._post_backward: _saved_grad_shard += new shard), DDP accumulates .grad under "
                        "no_sync; " + _ACCUMULATE_GRAD)
AUTOGRAD_MEGATRON_2020 = ("grad_accum_pass", "autograd: 5281919 has no main_grad buffer (megatron/fp16/fp16.py "
                          "FP16_Optimizer reads the fp16 .grad of FP16_Module's parameters at the step): the fp16 "
                          ".grad accumulates through autograd; " + _ACCUMULATE_GRAD)
AUTOGRAD_MEGATRON_2021 = ("grad_accum_pass", "autograd: 6985e58 megatron/arguments.py --use-contiguous-buffers-in-ddp "
                          "store_true (off): megatron/model/distributed.py DistributedDataParallel registers its "
                          "main_grad hook only with contiguous buffers, so the fp16 .grad accumulates through autograd; "
                          + _ACCUMULATE_GRAD)
AUTOGRAD_MEGATRON_DEEPSPEED_2021 = ("grad_accum_pass", "autograd: DeepSpeed before e2fdd254e, ZeRO-1 "
                                    "(deepspeed/runtime/zero/stage1.py FP16_DeepSpeedZeroOptimizer_Stage1) reduce-"
                                    "scatters the fp16 .grad at the gradient-accumulation boundary only, the "
                                    "PipelineEngine's BackwardPass a plain torch.autograd.backward: the fp16 .grad "
                                    "accumulates through autograd; " + _ACCUMULATE_GRAD)
AUTOGRAD_DEEPSPEED_2026 = ("grad_accum_pass", "autograd: deepspeed 0.19 runtime/zero/stage_1_and_2.py line 2290: "
                           "gradient hooks only with partition_gradients (ZeRO-2) or overlap_comm, so ZeRO-1 and the "
                           "engine's DDP accumulate the 16-bit .grad through autograd; ZeRO-2 / 3 add each "
                           "microbatch's reduced partition into the rank's gradient partition (the shard); "
                           + _ACCUMULATE_GRAD)
AUTOGRAD_UNPUBLISHED = ("grad_accum_pass", "assumed: torch autograd's own accumulation into .grad (no fusion "
                        "published); " + _ACCUMULATE_GRAD)
FUSED_MEGATRON_2022 = ("grad_accum_pass", "none: 9aad920 megatron/arguments.py --no-gradient-accumulation-fusion "
                       "(fusion on by default from 83b1e42, 2022-02): megatron/mpu/layers.py "
                       "LinearWithGradAccumulationAndAsyncCommunication.backward runs "
                       "fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32 into main_grad (the linears; the "
                       "embedding's and norms' main_grad hook add not priced)")
FUSED_MEGATRON_CORE = ("grad_accum_pass", "none: Megatron-LM arguments.py --no-gradient-accumulation-fusion (fusion on "
                       "by default) -> gradient_accumulation_fusion: megatron/core/tensor_parallel/layers.py "
                       "LinearWithGradAccumulationAndAsyncCommunication (--transformer-impl local) or Transformer "
                       "Engine fuse_wgrad_accumulation (megatron/core/extensions/transformer_engine.py line 626 at "
                       "megatron-core 0.16): the wgrad GEMM accumulates into main_grad")
FUSED_NEMO = ("grad_accum_pass", "none: the recipes' model config gradient_accumulation_fusion defaults to whether the "
              "fused kernel imports (Megatron-Bridge src/megatron/bridge/models/gpt_provider.py field(default_factory="
              "fusions.can_enable_gradient_accumulation_fusion), True with Transformer Engine): TE "
              "fuse_wgrad_accumulation into main_grad")

__all__ = ["AUTOGRAD_DEEPSPEED_2026", "AUTOGRAD_LLM_FOUNDRY", "AUTOGRAD_MEGATRON_2020", "AUTOGRAD_MEGATRON_2021",
           "AUTOGRAD_MEGATRON_DEEPSPEED_2021", "AUTOGRAD_MESHPLAN", "AUTOGRAD_TORCHTITAN", "AUTOGRAD_UNPUBLISHED",
           "FUSED_MEGATRON_2022", "FUSED_MEGATRON_CORE", "FUSED_NEMO", "MAIN_GRAD_HOOK_MESHPLAN"]
