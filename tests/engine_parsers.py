"""Parse exported engine configurations with the engines' own code (run as a subprocess).

``python tests/engine_parsers.py ENGINE`` reads a JSON list of cases ``{"text": ..., "dp": N}`` on
stdin and prints one JSON list: per case ``{"ok": true, "values": {...}}`` with what the engine
read, or ``{"ok": false, "error": "..."}`` with the engine's refusal. A subprocess because the
engines import slowly (torchtitan ~30 s on this CPU) and set global state (DeepSpeed's comm).

- torchtitan 0.3: ``ConfigManager().parse_args(["--module", "llama3", "--config",
  "llama3_debugmodel", *overrides])`` (tyro on ``Trainer.Config``, with its ``__post_init__``
  checks); a case with ``"module"`` instead of ``"text"`` is a Python config module, written to a
  temporary folder put on ``sys.path`` and loaded the way ``torchtitan.train`` does,
  ``ConfigManager().parse_args(["--module", NAME, "--config", case["config"]])``;
- Megatron-LM: its training argument parser (``megatron/training/arguments.py``) is not in the
  ``megatron-core`` package; what is importable is the configuration Megatron-LM builds from those
  arguments: ``TransformerConfig`` (with ``ModelParallelConfig``), ``DistributedDataParallelConfig``
  and the micro-batch calculator, each validating in its constructor. Each flag goes to the
  field Megatron-LM's ``core_transformer_config_from_args`` fills (``--a-b`` -> ``a_b``, plus its
  renames); a flag that is not a field is reported back for the schema snapshot to check;
- DeepSpeed: ``DeepSpeedConfig(dict, mpu=...)`` with the data-parallel size given by ``mpu`` (its
  ``deepspeed.comm`` told it is rank 0 of an initialised job: ``init_distributed`` would JIT-build
  a C++ op on CPU).
"""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import sys
import warnings
from typing import Any

warnings.filterwarnings("ignore")


def _module_args(case: dict[str, Any], index: int) -> list[str]:
    """``--module NAME --config F`` for a case's config module, written where ``import NAME`` finds it."""
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp(prefix="tt_module_"))
    name = f"meshplan_case_{index}"
    (folder / f"{name}.py").write_text(case["module"])
    sys.path.insert(0, str(folder))
    return ["--module", name, "--config", case["config"]]


def torchtitan(case: dict[str, Any], index: int = 0) -> dict[str, Any]:
    from torchtitan.config import ConfigManager

    err = io.StringIO()
    try:
        args = _module_args(case, index) if "module" in case else [
            "--module", "llama3", "--config", "llama3_debugmodel", *shlex.split(case["text"])]
        with contextlib.redirect_stderr(err):
            cfg = ConfigManager().parse_args(args)
    except SystemExit:
        lines = [ln.strip("│ ").strip() for ln in err.getvalue().splitlines()]
        return {"ok": False, "error": " ".join(ln for ln in lines if ln and not set(ln) <= set("─╭╮╰╯"))}
    except Exception as e:  # noqa: BLE001 - the engine's refusal, reported back
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    p, t = cfg.parallelism, cfg.training
    return {"ok": True, "values": {
        "dp_replicate": p.data_parallel_replicate_degree, "dp_shard": p.data_parallel_shard_degree,
        "tp": p.tensor_parallel_degree, "pp": p.pipeline_parallel_degree, "cp": p.context_parallel_degree,
        "ep": p.expert_parallel_degree, "sp": p.enable_sequence_parallel, "schedule": p.pipeline_parallel_schedule,
        "pp_microbatch": p.pipeline_parallel_microbatch_size, "layers_per_stage": p.pipeline_parallel_layers_per_stage,
        "first_less": p.pipeline_parallel_first_stage_less_layers,
        "last_less": p.pipeline_parallel_last_stage_less_layers, "local_batch": t.local_batch_size,
        "global_batch": t.global_batch_size, "seq_len": t.seq_len, "param_dtype": t.mixed_precision_param,
        "ac": type(cfg.activation_checkpoint).__qualname__ if cfg.activation_checkpoint is not None else None,
    }}  # fmt: skip


#: Megatron-LM arguments whose core field has another name (core_transformer_config_from_args)
MEGATRON_RENAMES = {"--decoder-first-pipeline-num-layers": "num_layers_in_first_pipeline_stage",
                    "--decoder-last-pipeline-num-layers": "num_layers_in_last_pipeline_stage",
                    "--num-virtual-stages-per-pipeline-rank": "virtual_pipeline_model_parallel_size",
                    "--fp8-format": "fp8"}  # fmt: skip
MEGATRON_BATCH = {"--micro-batch-size", "--global-batch-size"}


def megatron(case: dict[str, Any]) -> dict[str, Any]:
    import dataclasses

    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator
    from megatron.core.transformer.transformer_config import TransformerConfig

    core = {f.name for f in dataclasses.fields(TransformerConfig)}
    ddp = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    toks = shlex.split(case["text"])
    kw_core: dict[str, Any] = {}
    kw_ddp: dict[str, Any] = {}
    batch: dict[str, int] = {}
    not_core: list[str] = []
    for i, t in enumerate(toks):
        if not t.startswith("--"):
            continue
        value: Any = True
        if i + 1 < len(toks) and not toks[i + 1].startswith("--"):
            v = toks[i + 1]
            value = int(v) if v.lstrip("-").isdigit() else v
        name = MEGATRON_RENAMES.get(t, t[2:].replace("-", "_"))
        if t in MEGATRON_BATCH:
            batch[t] = int(value)
        elif name in core:
            kw_core[name] = value
        elif name in ddp:
            kw_ddp[name] = value
        else:
            not_core.append(t)
    dtype = torch.bfloat16 if kw_core.get("bf16") or "fp8" in kw_core else torch.float16 if kw_core.get("fp16") \
        else torch.float32
    kw_core.setdefault("num_layers", 2 * kw_core.get("pipeline_model_parallel_size", 1)
                       * kw_core.get("virtual_pipeline_model_parallel_size", 1))
    try:
        tc = TransformerConfig(hidden_size=64, num_attention_heads=4, params_dtype=dtype, pipeline_dtype=dtype,
                               **kw_core)
        dc = DistributedDataParallelConfig(**kw_ddp)
        nmb = ConstantNumMicroBatchesCalculator(batch["--global-batch-size"], batch["--micro-batch-size"],
                                                case["dp"], False, 0).get()
    except Exception as e:  # noqa: BLE001 - the engine's refusal, reported back
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return {"ok": True, "values": {
        "tp": tc.tensor_model_parallel_size, "pp": tc.pipeline_model_parallel_size,
        "v": tc.virtual_pipeline_model_parallel_size or 1, "cp": tc.context_parallel_size,
        "ep": tc.expert_model_parallel_size, "sp": tc.sequence_parallel, "recompute": tc.recompute_granularity,
        "recompute_method": tc.recompute_method, "first": tc.num_layers_in_first_pipeline_stage,
        "last": tc.num_layers_in_last_pipeline_stage, "bf16": tc.bf16, "fp16": tc.fp16, "fp8": tc.fp8,
        "distributed_optimizer": dc.use_distributed_optimizer, "overlap_grad_reduce": dc.overlap_grad_reduce,
        "num_microbatches": nmb, "not_core": not_core,
    }}  # fmt: skip


def deepspeed(case: dict[str, Any]) -> dict[str, Any]:
    import deepspeed.comm.comm as dcomm
    from deepspeed.runtime.config import DeepSpeedConfig

    class OneRank:  # rank 0 of an initialised job, for the config's dist.get_rank()
        def is_initialized(self) -> bool:
            return True

        def get_rank(self, group: Any = None) -> int:
            return 0

    class DataParallel:  # DeepSpeed's mpu interface: the data-parallel size the batch arithmetic uses
        def get_data_parallel_world_size(self) -> int:
            return int(case["dp"])

    dcomm.cdb = OneRank()
    try:
        c = DeepSpeedConfig(json.loads(case["text"]), mpu=DataParallel())
    except Exception as e:  # noqa: BLE001 - the engine's refusal, reported back
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return {"ok": True, "values": {
        "train_batch_size": c.train_batch_size, "micro": c.train_micro_batch_size_per_gpu,
        "gas": c.gradient_accumulation_steps, "zero_stage": c.zero_optimization_stage,
        "bf16": bool(c.bfloat16_config.enabled), "fp16": bool(c.float16_config.enabled),
        "pipeline_stages": c.pipeline.get("stages"), "partition": c.pipeline.get("partition"),
        "ac_interval": c.pipeline.get("activation_checkpoint_interval"),
        "autotp_size": c.tensor_parallel_config.autotp_size,
    }}  # fmt: skip


if __name__ == "__main__":
    engine = {"torchtitan": torchtitan, "megatron": megatron, "deepspeed": deepspeed}[sys.argv[1]]
    cases = json.load(sys.stdin)
    results = [engine(c, i) if engine is torchtitan else engine(c) for i, c in enumerate(cases)]
    print("ENGINE-PARSERS " + json.dumps(results, default=str))
