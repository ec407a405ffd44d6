"""Export to torchtitan / Megatron-LM / DeepSpeed, import back, and cost: round trips keep degrees,
schedule, batch, recompute and the predicted cost; every exported key is one the engine defines
(its own parser when importable, else the schema snapshot ``engine_schemas.json`` with the
engine version it was taken from); what an engine cannot run is refused or made nearest."""

from __future__ import annotations

import json
import shlex
import tomllib
from pathlib import Path

import pytest
from planner_fixtures import gpt_graph

from meshplan.api.engine_cost import cost_spec
from meshplan.cost_models.engine_profiles import INSTALLED
from meshplan.engines import deepspeed, megatron, torchtitan
from meshplan.engines.spec import CAPS, EngineSpec, nearest, spec_from_plan, unsupported
from meshplan.planner.api import estimate_graph

SCHEMA = json.loads((Path(__file__).parent / "engine_schemas.json").read_text())
CASES = {
    "megatron": dict(tp=2, pp=2, dp=2, schedule="interleaved-1f1b", virtual_stages=2, num_microbatches=4,
                     recompute="selective", dp_kind="zero1"),
    "torchtitan": dict(tp=2, pp=2, dp=2, schedule="zbv", num_microbatches=4, recompute="full", dp_kind="fsdp"),
    "deepspeed": dict(tp=1, pp=2, dp=4, schedule="1f1b", num_microbatches=4, recompute="full", dp_kind="zero2"),
}


@pytest.fixture(scope="module")
def graph():
    return gpt_graph(layers=8, h=512, heads=8, seq=256, vocab=8192)


def _parse(engine: str, text: str, world: int, layers: int):
    if engine == "megatron":
        return megatron.parse(text, world)
    if engine == "torchtitan":
        return torchtitan.parse(text, world, layers)
    return deepspeed.parse(text, world)


def _export(engine: str, spec: EngineSpec) -> str:
    return {"megatron": megatron.export, "torchtitan": torchtitan.export, "deepspeed": deepspeed.export}[engine](spec)


@pytest.mark.parametrize("engine", list(CASES))
def test_round_trip_keeps_layout_and_predicted_cost(engine: str, graph) -> None:
    # costed as the engine runs it on both sides of the round trip: its stage-split rule and its
    # token-embedding layout (an "any" split may leave a stage only the head and loss)
    plan = estimate_graph(graph, 8, global_batch_size=32, cluster="h100", profile=INSTALLED[engine],
                          **CASES[engine])  # fmt: skip
    spec = spec_from_plan(plan)
    assert not unsupported(spec, engine), unsupported(spec, engine)
    back = _parse(engine, _export(engine, spec), 8, 8)
    s = back.spec
    assert not back.unknown and not back.ignored
    assert (s.dp, s.tp, s.pp, s.virtual_stages, s.schedule) == (plan.dp, plan.tp, plan.pp, plan.virtual_stages,
                                                                plan.schedule)
    assert (s.micro_batch_size, s.num_microbatches, s.global_batch_size) == (
        plan.micro_batch_size, plan.num_microbatches, plan.global_batch_size)
    assert (s.recompute, s.dp_kind, s.dtype) == (plan.recompute, plan.dp_kind, plan.dtype)
    again = cost_spec(graph, s, "h100", engine)
    assert again.predicted.step_s == pytest.approx(plan.predicted.step_s, rel=1e-9)
    assert again.predicted.peak_mem_bytes == plan.predicted.peak_mem_bytes


def test_exported_keys_are_the_engines_own(graph) -> None:
    spec = EngineSpec(dp=2, tp=2, pp=2, virtual_stages=2, schedule="interleaved-1f1b", micro_batch_size=1,
                      global_batch_size=16, seq_len=256, recompute="full", sequence_parallel=True, dp_kind="zero1",
                      dtype="bf16", num_layers=8)  # fmt: skip
    # Megatron: every flag is a Megatron-LM argument, values where it takes one, choices respected
    toks = shlex.split(megatron.export(spec))
    sm = SCHEMA["megatron"]
    for i, t in enumerate(toks):
        if t.startswith("--"):
            assert t in sm["value_args"] + sm["flag_args"], t
            if t in sm["choices"]:
                assert toks[i + 1] in sm["choices"][t]
    # torchtitan: sections/keys of its config classes, a schedule it knows
    st = SCHEMA["torchtitan"]
    tt = tomllib.loads(torchtitan.export(dataclass_replace(spec, dp_kind="fsdp")))
    assert set(tt["training"]) <= set(st["training"]) and set(tt["parallelism"]) <= set(st["parallelism"])
    assert tt["parallelism"]["pipeline_parallel_schedule"] in st["pipeline_parallel_schedule"]
    assert tt["activation_checkpoint"]["mode"] in st["activation_checkpoint.mode"]
    # DeepSpeed: top-level keys and the keys of each section
    sd = SCHEMA["deepspeed"]
    ds = json.loads(deepspeed.export(dataclass_replace(spec, virtual_stages=1, schedule="1f1b")))
    assert set(ds) <= set(sd["top"])
    for sec, body in ds.items():
        if isinstance(body, dict):
            assert set(body) <= set(sd[sec]), sec
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 2


def dataclass_replace(spec: EngineSpec, **kw) -> EngineSpec:
    import dataclasses

    return dataclasses.replace(spec, **kw)


def test_unsupported_is_refused_or_nearest() -> None:
    zb = EngineSpec(dp=2, pp=4, schedule="zbv", virtual_stages=2, micro_batch_size=1, global_batch_size=16,
                    dp_kind="zero2", num_layers=16, layers_per_stage=(1, 2, 2, 2, 2, 2, 2, 3))  # fmt: skip
    why = " ".join(unsupported(zb, "megatron"))
    assert "schedule 'zbv'" in why and "dp_kind 'zero2'" in why and "uneven stage split" in why
    near, changes = nearest(zb, "megatron")
    assert not unsupported(near, "megatron")
    assert (near.schedule, near.virtual_stages, near.dp_kind, near.layers_per_stage) == ("interleaved-1f1b", 2,
                                                                                         "zero1", ())
    assert any(c.startswith("schedule 'zbv'") for c in changes)
    ds, _ = nearest(zb, "deepspeed")
    assert (ds.schedule, ds.virtual_stages, ds.dp_kind) == ("1f1b", 1, "zero2") and not unsupported(ds, "deepspeed")
    first_last = dataclass_replace(zb, schedule="1f1b", virtual_stages=1, dp_kind="ddp",
                                   layers_per_stage=(3, 4, 4, 5))
    assert not unsupported(first_last, "megatron")
    args = megatron.export(first_last)
    assert "--decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 5" in args
    assert megatron.parse(args, 8).spec.layers_per_stage == (3, 4, 4, 5)
    assert set(CAPS) == {"torchtitan", "megatron", "deepspeed"}


def test_unknown_and_ignored_keys_are_listed() -> None:
    m = megatron.parse("--tensor-model-parallel-size 2 --hidden-size 4096 --lr 3e-4 --my-new-flag 7 "
                       "--micro-batch-size 1 --global-batch-size 64 --bf16", 16)
    assert m.spec.dp == 8 and m.unknown == ["--my-new-flag"] and set(m.ignored) == {"--hidden-size", "--lr"}
    t = torchtitan.parse('[parallelism]\ntensor_parallel_degree = 2\nmystery = 1\n[optimizer]\nname = "AdamW"\n'
                         "[training]\nlocal_batch_size = 2\n", 8)
    assert t.spec.dp == 4 and t.spec.dp_kind == "fsdp" and t.unknown == ["parallelism.mystery"]
    assert t.ignored == ["[optimizer]"]
    d = deepspeed.parse(json.dumps({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2,
                                    "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"},
                                    "mystery": 1}), 8)
    assert d.spec.num_microbatches == 2 and d.spec.dp_kind == "fsdp" and d.unknown == ["mystery"]
    with pytest.raises(ValueError, match="recompute-granularity"):
        megatron.parse("--recompute-granularity everything", 8)
    with pytest.raises(ValueError, match="train_batch_size"):
        deepspeed.parse('{"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, '
                        '"gradient_accumulation_steps": 1}', 8)
    # DeepSpeed engine.py get_data_types: bf16 accumulates in fp32 without ZeRO, in bf16 under it,
    # data_types.grad_accum_dtype overrides both (the run flag main_grads)
    def grads(stage: int, **types: str) -> dict[str, str]:
        cfg = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
               "zero_optimization": {"stage": stage}, **({"data_types": types} if types else {})}
        return deepspeed.parse(json.dumps(cfg), 8).run_flags

    assert grads(0) == {"main_grads": "fp32"} and grads(1) == {} and grads(2, grad_accum_dtype="fp32") == {"main_grads": "fp32"}
    assert grads(0, grad_accum_dtype="bf16") == {}
    with pytest.raises(ValueError, match="grad_accum_dtype"):
        grads(1, grad_accum_dtype="int8")


def test_export_and_estimate_commands(tmp_path: Path, graph, capsys) -> None:
    from meshplan.cli import main

    plan = estimate_graph(graph, 8, global_batch_size=32, cluster="h100", **CASES["torchtitan"])
    plan.save(tmp_path / "plan.json")
    out = tmp_path / "job.toml"
    assert main(["export", str(tmp_path / "plan.json"), "--to", "torchtitan", "-o", str(out), "--toml"]) == 0
    assert tomllib.loads(out.read_text())["parallelism"]["pipeline_parallel_schedule"] == "ZBVZeroBubble"
    assert main(["export", str(tmp_path / "plan.json"), "--to", "torchtitan", "-o", str(tmp_path / "tt.args")]) == 0
    cli = (tmp_path / "tt.args").read_text()
    assert "--parallelism.pipeline_parallel_schedule ZBVZeroBubble" in cli and "activation-checkpoint:full" in cli
    assert torchtitan.parse(cli, 8, 8).spec == torchtitan.parse(out.read_text(), 8, 8).spec
    capsys.readouterr()
    assert main(["export", str(tmp_path / "plan.json"), "--to", "megatron"]) == 1
    err = capsys.readouterr().err
    assert "schedule 'zbv'" in err and "--nearest" in err and "--target megatron" in err
    args = ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 2 --micro-batch-size 1 "
            "--global-batch-size 8 --seq-length 16 --recompute-granularity full --bf16 --hidden-size 64 --foo 3")
    (tmp_path / "args.txt").write_text(args.replace(" --", " \\\n--"))
    rc = main(["estimate", "gpt-tiny", "-n", "8", "--from-megatron", "@" + str(tmp_path / "args.txt"), "--quiet",
               "-o", str(tmp_path / "mine.json")])
    o = capsys.readouterr().out
    assert rc == 0
    assert "unknown (not understood, not costed): --foo" in o and "ignored" in o and "--hidden-size" in o
    assert "your megatron config: dp2 tp2 pp2 1f1b mb1x4 recompute=full" in o and "step time" in o
    from meshplan.plan import Plan

    mine = Plan.load(tmp_path / "mine.json")
    assert (mine.dp, mine.tp, mine.pp, mine.recompute) == (2, 2, 2, "full")


def test_torchtitan_uneven_first_last_round_trip() -> None:
    spec = EngineSpec(dp=8, pp=2, virtual_stages=2, schedule="interleaved-1f1b", micro_batch_size=4,
                      global_batch_size=64, seq_len=1024, num_layers=12, layers_per_stage=(3, 4, 4, 1))
    assert not unsupported(spec, "torchtitan") and unsupported(spec, "megatron")  # Megatron: v = 1 only
    assert torchtitan.parse(torchtitan.export(spec), 16, 12).spec == spec


def test_torchtitan_selective_ac_is_meshplans_op_level_recompute() -> None:
    op = EngineSpec(dp=8, micro_batch_size=2, global_batch_size=16, recompute="op", dp_kind="fsdp")
    assert "activation-checkpoint:selective" in torchtitan.cli_overrides(op)
    toml = tomllib.loads(torchtitan.export(op))["activation_checkpoint"]
    assert toml == {"mode": "selective", "selective_ac_option": "op"}
    assert torchtitan.parse(torchtitan.export(op), 8).spec.recompute == "op"
    assert torchtitan.parse(torchtitan.cli_overrides(op), 8).spec.recompute == "op"
    layer = torchtitan.parse('[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "2"\n', 8)
    assert layer.spec.recompute == "op" and "costed as op-level" in layer.notes[0]
    megatron_selective = dataclass_replace(op, recompute="selective")
    assert "recompute 'selective'" in " ".join(unsupported(megatron_selective, "torchtitan"))
    assert nearest(megatron_selective, "torchtitan")[0].recompute == "op"
    assert nearest(op, "megatron")[0].recompute == "selective" and nearest(op, "deepspeed")[0].recompute == "full"


def test_megatron_recompute_modules_and_cuda_graph_scope_are_run_flags() -> None:
    """Megatron-Core's --recompute-modules / --cuda-graph-scope take several values: read as the
    profile's run flags (engine_saves), --recompute-modules only under selective granularity."""
    from meshplan.api.engine_cost import config_profile

    imp = megatron.parse("--tensor-model-parallel-size 2 --recompute-granularity selective --recompute-modules "
                         "moe_act layernorm --cuda-graph-scope moe_router moe_preprocess --bf16", 8)
    assert imp.run_flags == {"recompute_modules": ("moe_act", "layernorm"),
                             "cuda_graph_scope": ("moe_router", "moe_preprocess")}
    assert imp.spec.recompute == "selective" and not imp.unknown
    prof = config_profile("megatron", imp.profile, imp.run_flags)
    assert prof.recompute_modules == ("moe_act", "layernorm")
    assert "recompute_modules" not in megatron.parse("--recompute-modules moe_act --bf16", 8).run_flags
    with pytest.raises(ValueError, match="recompute_modules"):
        config_profile("megatron", None, megatron.parse("--recompute-granularity selective --recompute-modules mlp", 8).run_flags)
