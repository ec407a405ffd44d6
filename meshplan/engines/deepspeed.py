"""DeepSpeed ``ds_config.json`` (keys of DeepSpeed 0.19's ``runtime/config.py`` and its sections).

Export: ``train_batch_size``, ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``,
``zero_optimization.stage`` (0 ddp, 1 zero1, 2 zero2, 3 fsdp) with ``overlap_comm``,
``bf16.enabled`` / ``fp16.enabled``, ``tensor_parallel.autotp_size`` (AutoTP), ``pipeline.stages``
with ``partition`` "uniform" and ``activation_checkpoint_interval`` 1 for full recompute (the
pipeline engine's PipelineModule is built in the user's code from these). Import reads them back
(the data-parallel degree from the world size: world / (tp * pp)), ``data_types.grad_accum_dtype``
as the run flag ``main_grads``; sections meshplan does not
model (optimizer, scheduler, logging) are listed as ignored, other keys as unknown. No torch import.
"""

from __future__ import annotations

import json
from typing import Any

from meshplan.engines.imported import Imported
from meshplan.engines.spec import EngineSpec

VERSION = "DeepSpeed 0.19.8 (deepspeed/runtime/config.py, zero/config.py, tensor_parallel/config.py)"
STAGE = {"none": 0, "ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3}
KNOWN = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "zero_optimization",
         "bf16", "fp16", "tensor_parallel", "pipeline", "activation_checkpointing", "data_types"}  # fmt: skip
IGNORED = {"optimizer", "scheduler", "gradient_clipping", "steps_per_print", "wall_clock_breakdown", "prescale_gradients",
           "communication_data_type", "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comms_logger",
           "zero_allow_untested_optimizer", "seq_parallel_communication_data_type"}  # fmt: skip


def config(spec: EngineSpec) -> dict[str, Any]:
    gas = spec.num_microbatches
    d: dict[str, Any] = {
        "train_batch_size": spec.global_batch_size,
        "train_micro_batch_size_per_gpu": spec.micro_batch_size,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": STAGE[spec.dp_kind], "overlap_comm": spec.dp > 1},
        "bf16": {"enabled": spec.dtype == "bf16"},
        "fp16": {"enabled": spec.dtype == "fp16"},
    }
    if spec.tp > 1:
        d["tensor_parallel"] = {"autotp_size": spec.tp}
    if spec.pp > 1:
        d["pipeline"] = {"stages": spec.pp, "partition": "uniform",
                         "activation_checkpoint_interval": 1 if spec.recompute == "full" else 0}
    elif spec.recompute == "full":
        d["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False}
    return d


def export(spec: EngineSpec) -> str:
    return json.dumps(config(spec), indent=2) + "\n"


def parse(text: str, world_size: int) -> Imported:
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not a DeepSpeed JSON config: {e}") from e
    if not isinstance(d, dict):
        raise ValueError("not a DeepSpeed JSON config: top level is not an object")
    unknown = [k for k in d if k not in KNOWN and k not in IGNORED]
    ignored = [k for k in d if k in IGNORED]
    tp = int(d.get("tensor_parallel", {}).get("autotp_size", 0) or 1)
    pipe = d.get("pipeline", {})
    stages = pipe.get("stages", 1)
    pp = 1 if stages in ("auto", None) else int(stages)
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by tp*pp = {tp}*{pp}")
    dp = world_size // (tp * pp)
    mb = d.get("train_micro_batch_size_per_gpu")
    gas = d.get("gradient_accumulation_steps")
    gb = d.get("train_batch_size")
    if mb is None and gb is not None and gas is not None:
        mb = gb // (gas * dp)
    mb = int(mb or 1)
    gas = int(gas or (gb // (mb * dp) if gb else 1))
    gb = int(gb or mb * gas * dp)
    if mb * gas * dp != gb:
        raise ValueError(f"train_batch_size {gb} != micro {mb} x gradient_accumulation_steps {gas} x dp {dp}")
    stage = int(d.get("zero_optimization", {}).get("stage", 0))
    kinds = {0: "ddp", 1: "zero1", 2: "zero2", 3: "fsdp"}
    if stage not in kinds:
        raise ValueError(f"zero_optimization.stage must be 0..3, got {stage}")
    full = bool(pipe.get("activation_checkpoint_interval", 0)) or "activation_checkpointing" in d
    dtype = "bf16" if d.get("bf16", {}).get("enabled") else "fp16" if d.get("fp16", {}).get("enabled") else "fp32"
    notes = []
    if pipe.get("partition", "uniform") != "uniform" and pp > 1:
        notes.append(f"pipeline.partition {pipe['partition']!r} costed as an even split")
    spec = EngineSpec(dp=dp, tp=tp, pp=pp, schedule="1f1b", micro_batch_size=mb, global_batch_size=gb,
                      recompute="full" if full else "none", dp_kind=kinds[stage] if dp > 1 else "none",
                      dtype=dtype)  # fmt: skip
    return Imported(spec, unknown, ignored, notes, run_flags=_grad_flags(d, dtype, stage))


def _grad_flags(d: dict[str, Any], dtype: str, stage: int) -> dict[str, str]:
    """The run flag ``main_grads`` where the config's gradient accumulation dtype departs from the
    deepspeed-2026 profile's 16-bit gradients: DeepSpeed ``engine.py`` ``get_data_types``
    accumulates in ``data_types.grad_accum_dtype`` when given, else in fp32 for bf16 without ZeRO
    (``BF16_Optimizer``), else in the model's dtype."""
    if dtype == "fp32":
        return {}
    acc = d.get("data_types", {}).get("grad_accum_dtype")
    if acc not in (None, "fp32", "bf16", "fp16"):
        raise ValueError(f"data_types.grad_accum_dtype must be fp32, bf16 or fp16, got {acc!r}")
    fp32 = acc == "fp32" or (acc is None and dtype == "bf16" and stage == 0)
    return {"main_grads": "fp32"} if fp32 else {}
