"""Every configuration meshplan exports is read by the engine's own code, and reads as meant.

Runs ``tests/engine_parsers.py`` once per engine in a subprocess (torchtitan 0.3's ConfigManager,
megatron-core's TransformerConfig / DistributedDataParallelConfig / micro-batch calculator,
DeepSpeed's DeepSpeedConfig). Skipped per engine when its package is not installed
(``pip install -c constraints.txt -e ".[engines]"``; ``dev`` includes it): ``test_engines.py``
then checks the same exports against the schema snapshot ``engine_schemas.json``. Each engine is
also handed one configuration it must refuse, so a parser that accepts anything fails here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshplan.engines import deepspeed, megatron, torchtitan
from meshplan.engines.spec import EngineSpec, unsupported
from meshplan.engines.torchtitan_module import FUNCTION, config_module

SCHEMA = json.loads((Path(__file__).parent / "engine_schemas.json").read_text())
BASE = EngineSpec(dp=2, tp=2, pp=2, micro_batch_size=1, global_batch_size=16, seq_len=256, num_layers=8,
                  dp_kind="ddp", dtype="bf16")  # fmt: skip
SPECS = {
    "torchtitan": [
        dataclasses.replace(BASE, schedule="1f1b", sequence_parallel=True, recompute="full", dp_kind="fsdp"),
        dataclasses.replace(BASE, dp=16, tp=1, schedule="interleaved-1f1b", virtual_stages=2, micro_batch_size=2,
                            global_batch_size=64, recompute="op", dp_kind="hsdp",
                            layers_per_stage=(1, 2, 2, 1)),
        dataclasses.replace(BASE, pp=1, dp=4, micro_batch_size=2, global_batch_size=16, dp_kind="ddp",
                            dtype="fp32"),
        dataclasses.replace(BASE, schedule="zbv", virtual_stages=2, dp_kind="fsdp"),
        dataclasses.replace(BASE, tp=1, dp=4, schedule="gpipe", layers_per_stage=(5, 3), num_layers=8),
    ],
    "megatron": [
        dataclasses.replace(BASE, schedule="interleaved-1f1b", virtual_stages=2, sequence_parallel=True,
                            recompute="full", dp_kind="zero1"),
        dataclasses.replace(BASE, tp=1, pp=4, dp=2, num_layers=10, layers_per_stage=(2, 3, 3, 2),
                            recompute="selective"),
        dataclasses.replace(BASE, pp=1, tp=4, dp=2, micro_batch_size=2, dtype="fp16", dp_kind="ddp"),
        dataclasses.replace(BASE, cp=2, dp=1, dtype="fp8"),
    ],
    "deepspeed": [
        dataclasses.replace(BASE, tp=1, pp=2, dp=4, recompute="full", dp_kind="zero1"),
        dataclasses.replace(BASE, pp=1, tp=2, dp=4, micro_batch_size=2, dp_kind="zero2", dtype="fp16"),
        dataclasses.replace(BASE, pp=1, tp=1, dp=8, dp_kind="fsdp", dtype="fp32"),
    ],
}
#: one configuration each engine must refuse (so the check cannot pass on a parser that takes anything)
REFUSE = {
    "torchtitan": "--parallelism.pipeline_parallel_degree 2 --training.local_batch_size 3 "
                  "--parallelism.pipeline_parallel_microbatch_size 2 --training.disable_cuda_graphs",
    "megatron": "--tensor-model-parallel-size 1 --sequence-parallel --micro-batch-size 1 --global-batch-size 8",
    "deepspeed": '{"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}',
}
#: the Trainer.Config module form: torchtitan's debug model as the base (its 6 layers hold each split above)
TT_BASE = "llama3:llama3_debugmodel"
PACKAGE = {"torchtitan": "torchtitan", "megatron": "megatron.core", "deepspeed": "deepspeed"}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _export(engine: str, spec: EngineSpec) -> str:
    if engine == "torchtitan":
        return torchtitan.cli_overrides(spec)
    return megatron.export(spec) if engine == "megatron" else deepspeed.export(spec)


def _engine_read(engine: str, cases: list[dict]) -> list[dict]:
    script = Path(__file__).with_name("engine_parsers.py")
    r = subprocess.run([sys.executable, str(script), engine], input=json.dumps(cases), capture_output=True,
                       text=True, timeout=600)  # fmt: skip
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("ENGINE-PARSERS ")), None)
    assert line is not None, f"{engine} parser run failed (rc {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return json.loads(line.removeprefix("ENGINE-PARSERS "))


def _expect(engine: str, s: EngineSpec) -> dict:
    """What the engine must read back from the export of ``s``."""
    if engine == "torchtitan":
        # hsdp: shards inside an 8-device node (dp 16, tp 1: 2 replicas of 8 shards)
        rep, shard = {"fsdp": (1, s.dp), "hsdp": (s.dp // 8, 8)}.get(s.dp_kind, (s.dp, 1))
        out = {"dp_replicate": rep, "dp_shard": shard, "tp": s.tp, "pp": s.pp, "cp": s.cp, "ep": s.ep,
               "sp": s.sequence_parallel, "global_batch": s.global_batch_size, "seq_len": s.seq_len,
               "param_dtype": torchtitan.DTYPES[s.dtype],
               "ac": {"none": None, "full": "FullAC.Config", "op": "SelectiveAC.Config"}[s.recompute]}
        if s.pp > 1:
            out.update(schedule=torchtitan.SCHEDULES[s.schedule], pp_microbatch=s.micro_batch_size,
                       local_batch=s.global_batch_size // s.dp)
            if s.uneven():
                mid = s.layers_per_stage[1] if len(s.layers_per_stage) > 2 else max(s.layers_per_stage)
                out.update(layers_per_stage=mid, first_less=mid - s.layers_per_stage[0],
                           last_less=mid - s.layers_per_stage[-1])
        else:
            out["local_batch"] = s.micro_batch_size
        return out
    if engine == "megatron":
        fl = s.first_last() if s.uneven() else None
        return {"tp": s.tp, "pp": s.pp, "v": s.virtual_stages, "cp": s.cp, "ep": s.ep, "sp": s.sequence_parallel,
                "recompute": None if s.recompute == "none" else s.recompute,
                "first": fl[0] if fl else None, "last": fl[1] if fl else None,
                "bf16": s.dtype in ("bf16", "fp8"), "fp16": s.dtype == "fp16",
                "fp8": "hybrid" if s.dtype == "fp8" else None, "distributed_optimizer": s.dp_kind == "zero1",
                "overlap_grad_reduce": s.dp > 1, "num_microbatches": s.num_microbatches}  # fmt: skip
    return {"train_batch_size": s.global_batch_size, "micro": s.micro_batch_size, "gas": s.num_microbatches,
            "zero_stage": deepspeed.STAGE[s.dp_kind], "bf16": s.dtype == "bf16", "fp16": s.dtype == "fp16",
            "pipeline_stages": s.pp if s.pp > 1 else "auto", "autotp_size": s.tp if s.tp > 1 else 0,
            "ac_interval": 1 if s.recompute == "full" and s.pp > 1 else 0}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(SPECS))
def test_engine_reads_every_export_as_meant(engine: str) -> None:
    if not _installed(PACKAGE[engine]):
        pytest.skip(f"{PACKAGE[engine]} not installed (meshplan[engines]); test_engines checks the schema snapshot")
    specs = SPECS[engine]
    for s in specs:
        assert not unsupported(s, engine), (s, unsupported(s, engine))
    cases = [{"text": _export(engine, s), "dp": s.dp} for s in specs] + [{"text": REFUSE[engine], "dp": 2}]
    if engine == "torchtitan":  # the same plans as Trainer.Config modules, and one torchtitan must refuse
        bad = config_module(dataclasses.replace(BASE, global_batch_size=6, micro_batch_size=2), TT_BASE)
        cases = cases[:-1] + [{"module": config_module(s, TT_BASE), "config": FUNCTION, "dp": s.dp} for s in specs] \
            + [{"module": bad, "config": FUNCTION, "dp": 2}, cases[-1]]
    results = _engine_read(engine, cases)
    if engine == "torchtitan":
        bad_result = results.pop(-2)
        assert not bad_result["ok"], "torchtitan accepted a config module with local batch 3 in microbatches of 2"
        assert "divisible" in bad_result["error"], bad_result["error"]
        cases.pop(-2)
        specs = specs + specs  # overrides, then modules
    assert len(results) == len(specs) + 1, "one result per case"
    for s, case, r in zip(specs, cases, results):
        assert r["ok"], f"{engine} refused meshplan's export {case.get('text') or case['module']!r}: {r['error']}"
        got = r["values"]
        want = _expect(engine, s)
        assert {k: got[k] for k in want} == want, case.get("text") or case["module"]
        if engine == "megatron":  # flags that are Megatron-LM training arguments, not core fields
            sm = SCHEMA["megatron"]
            assert set(got["not_core"]) <= set(sm["value_args"] + sm["flag_args"]), got["not_core"]
    assert not results[-1]["ok"], f"{engine} accepted {REFUSE[engine]!r}"
    # and meshplan reads its own export back to the same spec
    for s, case in zip(specs, cases):
        if "module" in case:
            continue
        if engine == "torchtitan":
            back = torchtitan.parse(case["text"], s.world_size, s.num_layers).spec
        else:
            back = (megatron if engine == "megatron" else deepspeed).parse(case["text"], s.world_size).spec
        assert (back.dp, back.tp, back.pp, back.cp, back.virtual_stages, back.micro_batch_size,
                back.global_batch_size, back.recompute, back.dtype) == (
            s.dp, s.tp, s.pp, s.cp, s.virtual_stages, s.micro_batch_size, s.global_batch_size, s.recompute,
            s.dtype if engine != "torchtitan" or s.dtype != "fp8" else "bf16")  # fmt: skip
