"""The Python API covers the CLI (#29): ``meshplan.autoparallel`` takes what ``meshplan plan`` takes
(dtype, target, memory limit, lora rank, a model name), ``meshplan.estimate`` precision, cp, ep and
an engine profile, ``meshplan.export`` what ``meshplan export`` writes; the commands call these
functions, so CLI and Python give the same plan and text. Bad arguments fail in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import meshplan
from meshplan.cli import main
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.plan import Plan


@pytest.fixture(scope="module")
def gpt_tiny_graph():
    from meshplan.loading import load_graph

    return load_graph("gpt-tiny")


def _same_plan(a: Plan, b: Plan) -> None:
    """Equal but for the solver's seconds (wall time)."""
    da, db = json.loads(a.to_json()), json.loads(b.to_json())
    for d in (da, db):
        d.pop("solver", None)
    assert da == db


def test_cli_plan_is_autoparallel(tmp_path: Path, gpt_tiny_graph) -> None:
    out = tmp_path / "p.json"
    assert main(["plan", "gpt-tiny", "-n", "4", "--target", "torchtitan", "--dtype", "fp32", "--memory-limit",
                 "40GiB", "--tp", "2", "-q", "-o", str(out)]) == 0  # fmt: skip
    cli = Plan.load(out)
    py = meshplan.autoparallel("gpt-tiny", 4, cluster="h100", target="torchtitan", dtype="fp32",
                               memory_limit="40GiB", fixed={"tp": 2})  # fmt: skip
    _same_plan(cli, py)
    assert py.dtype == "fp32" and py.tp == 2 and any("planned for torchtitan" in n for n in py.notes)
    assert py.cluster["mem_bytes"] - py.cluster["mem_reserved_bytes"] == 40 * 2**30
    # a traced graph is taken as is
    _same_plan(py, meshplan.autoparallel(gpt_tiny_graph, 4, cluster="h100", target="torchtitan", dtype="fp32",
                                         memory_limit=40 * 2**30, fixed={"tp": 2}))  # fmt: skip


def test_plan_optimizer_is_costed_and_recorded(tmp_path: Path, gpt_tiny_graph, capsys) -> None:
    """``meshplan plan --optimizer sgd --momentum 0`` is ``autoparallel(optimizer="sgd")`` (#28): plain
    SGD's plan records it and predicts less state memory and a shorter optimizer step than Adam's."""
    out = tmp_path / "p.json"
    assert main(["plan", "gpt-tiny", "-n", "2", "--dtype", "fp32", "--dp", "2", "--optimizer", "sgd", "--momentum",
                 "0", "-q", "-o", str(out)]) == 0  # fmt: skip
    sgd = meshplan.autoparallel(gpt_tiny_graph, 2, cluster="h100", dtype="fp32", fixed={"dp": 2}, optimizer="sgd")
    _same_plan(Plan.load(out), sgd)
    adam = meshplan.autoparallel(gpt_tiny_graph, 2, cluster="h100", dtype="fp32", fixed={"dp": 2})
    mom = meshplan.autoparallel(gpt_tiny_graph, 2, cluster="h100", dtype="fp32", fixed={"dp": 2},
                                optimizer="sgd-momentum")  # fmt: skip
    assert (adam.optimizer, mom.optimizer, sgd.optimizer) == ("adam", "sgd-momentum", "sgd")
    opt = [p.predicted.mem_breakdown["optimizer"] for p in (adam, mom, sgd)]
    # the step: on gpt-tiny the host's per-tensor work hides either update's kernels (meshplan's runtime
    # reads the norm after the update, "async", #33), so SGD's is no longer shorter, only not longer
    assert opt[0] > opt[1] > opt[2] and adam.predicted.optimizer_s >= sgd.predicted.optimizer_s
    assert main(["plan", "gpt-tiny", "-n", "2", "--optimizer", "sgd", "-q", "-o", str(out)]) == 0
    assert Plan.load(out).optimizer == "sgd-momentum"  # SGD's default momentum 0.9 keeps a buffer
    assert main(["plan", "gpt-tiny", "-n", "2", "--momentum", "0.5", "-q"]) == 1
    assert "--momentum is SGD's; --optimizer adam" in capsys.readouterr().err
    with pytest.raises(ValueError, match="optimizer 'lion' unknown"):
        meshplan.autoparallel("no-such-model-never-loaded", 2, optimizer="lion")


def test_autoparallel_dtype_auto_and_qlora_rank(gpt_tiny_graph) -> None:
    p = meshplan.autoparallel(gpt_tiny_graph, 2, cluster="h100", dtype="auto", target="torchtitan")
    assert p.dtype in ("bf16", "fp8") and any("--dtype auto" in n for n in p.notes)
    q = meshplan.autoparallel(gpt_tiny_graph, 2, cluster="h100", quantization="qlora", lora_rank=4)
    assert q.quantization.mode == "qlora" and q.quantization.lora_rank == 4


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"target": "nemo"}, "target 'nemo' unknown"),
    ({"dtype": "int4"}, "dtype 'int4' unknown"),
    ({"dtype": "fp8", "cluster": "a100-80g"}, "FP8 tensor cores"),
    ({"memory_limit": "lots"}, "is not a size"),
    ({"memory_limit": "900GiB"}, "more than the"),
    ({"lora_rank": 4}, "--lora-rank applies to --quantization qlora only"),
    ({"target": "deepspeed", "fixed": {"cp": 2}}, "deepspeed has no cp axis"),
    ({"target": "megatron", "recompute": ["op"]}, "not one megatron runs"),
    ({"fixed": {"tpp": 2}}, "unknown keys"),
    ({"fixed": [("tp", 2)]}, "fixed must be a dict of pins"),
    ({"recompute": "full"}, r"recompute is the list of choices .* fixed=\{'recompute': 'full'\}"),
])  # fmt: skip
def test_autoparallel_refuses_bad_arguments_before_tracing(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        meshplan.autoparallel("no-such-model-never-loaded", 4, **kwargs)


def test_model_of_the_wrong_kind_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="model must be an nn.Module, a traced ModelGraph or a model name"):
        meshplan.autoparallel(42, 4)
    with pytest.raises(ValueError, match=r"dp·tp·pp·cp = 4·1·1·2 = 8 but world_size is 4"):
        meshplan.estimate("no-such-model-never-loaded", 4, tp=1, pp=1, dp=4, cp=2)


def test_estimate_precision_cp_ep_and_profile(gpt_tiny_graph) -> None:
    base = dict(tp=1, pp=1, dp=2, global_batch_size=8, cluster="h100")
    bf16 = meshplan.estimate(gpt_tiny_graph, 2, **base)
    fp32 = meshplan.estimate(gpt_tiny_graph, 2, dtype="fp32", **base)
    assert (bf16.dtype, fp32.dtype) == ("bf16", "fp32")
    # fp32 peak FLOP/s is lower on an H100: the device's time (gpt-tiny is host-bound on the preset,
    # where autocast's casts make bf16 more host work, cost_models.host)
    dev = dict(base, cluster=ClusterSpec.preset("h100").without_host_floor())
    assert (meshplan.estimate(gpt_tiny_graph, 2, dtype="fp32", **dev).predicted.step_s
            > meshplan.estimate(gpt_tiny_graph, 2, **dev).predicted.step_s)
    cp = meshplan.estimate(gpt_tiny_graph, 4, cp=2, **base)
    assert cp.mesh.degree("cp") == 2 and cp.world_size == 4
    tp2 = dict(base, tp=2, dp=1)
    own, megatron = (meshplan.estimate(gpt_tiny_graph, 2, profile=p, **tp2) for p in (None, "megatron-lm-2020"))
    assert megatron.predicted.step_s > own.predicted.step_s  # the engine's conventions price it
    from meshplan.planner.api import estimate_graph

    _same_plan(megatron, estimate_graph(gpt_tiny_graph, 2, profile="megatron-lm-2020", **tp2))
    moe = meshplan.estimate("moe-tiny", 2, tp=1, pp=1, dp=2, ep=2, global_batch_size=8, cluster="h100")
    assert moe.mesh.degree("ep") == 2
    with pytest.raises(ValueError, match="unknown engine profile"):
        meshplan.estimate(gpt_tiny_graph, 2, profile="titan", **base)
    with pytest.raises(ValueError, match="ep=2 must divide"):
        meshplan.estimate(gpt_tiny_graph, 2, ep=2, **base)
    with pytest.raises(ValueError, match="dtype 'fp9' unknown"):
        meshplan.estimate(gpt_tiny_graph, 2, dtype="fp9", **base)
    with pytest.raises(ValueError, match="seq_len and input_shapes both given"):
        meshplan.estimate("gpt-tiny", 2, seq_len=16, input_shapes={"idx": (1, 16)}, **base)
    with pytest.raises(ValueError, match="already traced ModelGraph"):
        meshplan.estimate(gpt_tiny_graph, 2, seq_len=16, **base)


def test_export_is_the_command(tmp_path: Path, gpt_tiny_graph, capsys) -> None:
    plan = meshplan.estimate(gpt_tiny_graph, 8, tp=2, pp=2, dp=2, schedule="zbv", num_microbatches=4,
                             recompute="full", dp_kind="fsdp", global_batch_size=32, cluster="h100")  # fmt: skip
    path = tmp_path / "plan.json"
    plan.save(path)
    for to, form, extra in (("torchtitan", None, []), ("torchtitan", "toml", ["--toml"]),
                            ("torchtitan", "module", ["--form", "module", "--base", "llama3:llama3_8b"])):
        out = tmp_path / f"{to}-{form}.txt"
        assert main(["export", str(path), "--to", to, "-o", str(out), *extra]) == 0
        py = meshplan.export(plan, to=to, form=form, base="llama3:llama3_8b" if form == "module" else None)
        assert out.read_text() == py.text == str(py) and (py.engine, py.form) == (to, form or "overrides")
    module = meshplan.export(path, to="torchtitan", form="module", base="llama3:llama3_8b").text
    compile(module, "job.py", "exec")
    assert "from torchtitan.models.llama3.config_registry import llama3_8b as base_config" in module
    assert "'pipeline_parallel_schedule': 'ZBVZeroBubble'" in module and "FullAC.Config()" in module
    assert "def meshplan_config() -> Trainer.Config:" in module
    # megatron cannot run zbv: refused as the command does, or the nearest with its cost
    with pytest.raises(ValueError, match="schedule 'zbv'.*--nearest"):
        meshplan.export(plan, to="megatron")
    near = meshplan.export(plan, to="megatron", nearest=True, model="gpt-tiny")
    assert near.changes and near.nearest is not None and near.header[0].startswith("# nearest megatron")
    assert "--pipeline-model-parallel-size 2" in near.text
    capsys.readouterr()
    assert main(["export", str(path), "--to", "megatron", "--nearest", "--model", "gpt-tiny"]) == 0
    assert capsys.readouterr().out == "\n".join(near.header) + "\n" + near.text


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"to": "nemo"}, "to='nemo' unknown"),
    ({"to": "megatron", "form": "toml"}, "form 'toml' is not one megatron has"),
    ({"to": "torchtitan", "form": "module"}, "needs base='MODULE:CONFIG'"),
    ({"to": "torchtitan", "form": "module", "base": "llama3"}, "is not MODULE:CONFIG"),
    ({"to": "torchtitan", "base": "llama3:llama3_8b"}, "base .--base. applies to the torchtitan module form only"),
])  # fmt: skip
def test_export_refuses_bad_arguments(gpt_tiny_graph, kwargs, match) -> None:
    plan = meshplan.estimate(gpt_tiny_graph, 2, tp=1, pp=1, dp=2, global_batch_size=8, cluster="h100")
    with pytest.raises(ValueError, match=match):
        meshplan.export(plan, **kwargs)


def test_export_command_flags_disagree(tmp_path: Path, gpt_tiny_graph, capsys) -> None:
    meshplan.estimate(gpt_tiny_graph, 2, tp=1, pp=1, dp=2, global_batch_size=8, cluster="h100").save(tmp_path / "p.json")
    assert main(["export", str(tmp_path / "p.json"), "--to", "torchtitan", "--toml", "--form", "module"]) == 1
    assert "--toml and --form module disagree" in capsys.readouterr().err


def test_estimate_config_is_the_command(tmp_path: Path, capsys) -> None:
    args = ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 4 --micro-batch-size 1 "
            "--global-batch-size 8 --seq-length 16 --recompute-granularity full --bf16 --foo 3")
    (tmp_path / "args.txt").write_text(args)
    rc = main(["estimate", "gpt-tiny", "-n", "8", "--from-megatron", "@" + str(tmp_path / "args.txt"), "--quiet",
               "-o", str(tmp_path / "mine.json"), "--best-output", str(tmp_path / "best.json")])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    est = meshplan.estimate_config("gpt-tiny", args, engine="megatron", world_size=8, cluster="h100")
    assert est.summary() in out and est.comparison() in out and est.config.unknown == ["--foo"]
    _same_plan(est.plan, Plan.load(tmp_path / "mine.json"))
    _same_plan(est.best, Plan.load(tmp_path / "best.json"))
    assert (est.plan.tp, est.plan.pp, est.plan.dp, est.plan.seq_len) == (2, 2, 2, 16)
    # a Path is read, "@FILE" too; another target restricts the best plan to what it runs
    via_path = meshplan.estimate_config("gpt-tiny", tmp_path / "args.txt", engine="megatron", world_size=8,
                                        cluster="h100", target="deepspeed")  # fmt: skip
    assert via_path.target == "deepspeed" and via_path.best.schedule in ("1f1b",) and via_path.plan.tp == 2
    # --optimizer / --momentum: the optimizer costed in the configuration and in the best plan (#28's flags)
    rc = main(["estimate", "gpt-tiny", "-n", "8", "--from-megatron", args, "--quiet", "--optimizer", "sgd",
               "--momentum", "0", "-o", str(tmp_path / "sgd.json"), "--best-output", str(tmp_path / "sgd-best.json")])
    sgd = meshplan.estimate_config("gpt-tiny", args, engine="megatron", world_size=8, cluster="h100", optimizer="sgd")
    assert rc == 0 and (sgd.plan.optimizer, sgd.best.optimizer) == ("sgd", "sgd")
    _same_plan(sgd.plan, Plan.load(tmp_path / "sgd.json"))
    _same_plan(sgd.best, Plan.load(tmp_path / "sgd-best.json"))
    assert sgd.plan.predicted.mem_breakdown["optimizer"] < est.plan.predicted.mem_breakdown["optimizer"]
    # --state-layout: the layout of meshplan's best plan under --target meshplan (default auto: fp32 parameters here)
    rc = main(["estimate", "gpt-tiny", "-n", "8", "--from-megatron", args, "--quiet", "--target", "meshplan",
               "--state-layout", "megatron", "--best-output", str(tmp_path / "bf16-best.json")])
    bf16 = meshplan.estimate_config("gpt-tiny", args, engine="megatron", world_size=8, cluster="h100",
                                    target="meshplan", state_layout="megatron")  # fmt: skip
    assert rc == 0 and bf16.best.state_layout == "megatron"
    _same_plan(bf16.best, Plan.load(tmp_path / "bf16-best.json"))
    auto = meshplan.estimate_config("gpt-tiny", args, engine="megatron", world_size=8, cluster="h100", target="meshplan")
    assert auto.best.state_layout == "torch"
    with pytest.raises(ValueError, match="applies to --target meshplan"):
        meshplan.estimate_config("gpt-tiny", args, engine="megatron", world_size=8, state_layout="zero")
    capsys.readouterr()
    assert main(["estimate", "gpt-tiny", "-n", "8", "--from-megatron", args, "--quiet", "--momentum", "0.5"]) == 1
    assert "--momentum is SGD's" in capsys.readouterr().err
    with pytest.raises(ValueError, match="optimizer 'lion' unknown"):
        meshplan.estimate_config("no-such-model-never-loaded", args, engine="megatron", world_size=8, optimizer="lion")
    with pytest.raises(ValueError, match="engine 'nemo' unknown"):
        meshplan.estimate_config("gpt-tiny", args, engine="nemo", world_size=8)
    with pytest.raises(ValueError, match="target 'nemo' unknown"):
        meshplan.estimate_config("gpt-tiny", args, engine="megatron", world_size=8, target="nemo")
    with pytest.raises(ValueError, match="not a torchtitan TOML"):
        meshplan.estimate_config("no-such-model-never-loaded", "[training", engine="torchtitan", world_size=8)


def test_torchtitan_module_applies_the_plan_and_names_fields_a_torchtitan_lacks(monkeypatch) -> None:
    """The written module run against stand-ins for torchtitan's classes (the real load is
    tests/test_engine_parsers.py): it sets the plan's fields, and a torchtitan whose config lacks
    one (main after 0.3.0 counts the batch in tokens) stops with their names."""
    import dataclasses
    import sys
    import types

    from meshplan.engines.spec import EngineSpec
    from meshplan.engines.torchtitan_module import FUNCTION, config_module

    @dataclasses.dataclass
    class Parallelism:
        data_parallel_replicate_degree: int = 1
        data_parallel_shard_degree: int = -1
        tensor_parallel_degree: int = 1
        enable_sequence_parallel: bool = True
        pipeline_parallel_degree: int = 1
        context_parallel_degree: int = 1
        expert_parallel_degree: int = 1

    @dataclasses.dataclass
    class Training:
        local_batch_size: int = 8
        global_batch_size: int = -1
        seq_len: int = 2048
        mixed_precision_param: str = "bfloat16"

    @dataclasses.dataclass
    class Tokens:  # torchtitan main's TrainingConfig fields
        num_tokens_per_microbatch_per_dp_rank: int = 16384
        max_context_length: int = 2048
        mixed_precision_param: str = "bfloat16"

    @dataclasses.dataclass
    class Config:
        training: object
        parallelism: Parallelism = dataclasses.field(default_factory=Parallelism)
        activation_checkpoint: object = "selective"

    class FullAC:
        Config = type("Config", (), {})

    fake = {"torchtitan": types.ModuleType("torchtitan"), "torchtitan.trainer": types.ModuleType("torchtitan.trainer"),
            "torchtitan.distributed": types.ModuleType("torchtitan.distributed"),
            "torchtitan.distributed.activation_checkpoint": types.ModuleType("ac"),
            "fake_pkg": types.ModuleType("fake_pkg"), "fake_pkg.base": types.ModuleType("fake_pkg.base")}  # fmt: skip
    fake["torchtitan.trainer"].Trainer = types.SimpleNamespace(Config=Config)
    fake["torchtitan.distributed.activation_checkpoint"].FullAC = FullAC
    fake["fake_pkg.base"].old = lambda: Config(training=Training())
    fake["fake_pkg.base"].new = lambda: Config(training=Tokens())
    for name, mod in fake.items():
        monkeypatch.setitem(sys.modules, name, mod)
    spec = EngineSpec(dp=4, tp=2, micro_batch_size=2, global_batch_size=16, seq_len=256, recompute="full",
                      sequence_parallel=True, dp_kind="fsdp")  # fmt: skip
    ns: dict = {}
    exec(config_module(spec, "fake_pkg.base:old"), ns)
    cfg = ns[FUNCTION]()
    assert (cfg.training.local_batch_size, cfg.training.global_batch_size, cfg.training.seq_len) == (2, 16, 256)
    p = cfg.parallelism
    assert (p.data_parallel_replicate_degree, p.data_parallel_shard_degree, p.tensor_parallel_degree) == (1, 4, 2)
    assert isinstance(cfg.activation_checkpoint, FullAC.Config)
    ns = {}
    exec(config_module(spec, "fake_pkg.base:new"), ns)
    with pytest.raises(ValueError, match="Tokens has no global_batch_size, local_batch_size, seq_len: this module "
                                         "was written for torchtitan 0.3.0"):  # fmt: skip
        ns[FUNCTION]()


def test_calibrate_is_the_command(tmp_path: Path, gpt_tiny_graph, capsys) -> None:
    from meshplan.cost_models.hardware import ClusterSpec

    plan = meshplan.estimate(gpt_tiny_graph, 2, tp=1, pp=1, dp=2, global_batch_size=8, cluster="h100")
    rec = meshplan.RunRecord(plan_summary=plan.summary(), model="gpt-tiny", world_size=2,
                             predicted_step_s=plan.predicted.step_s, plan=plan.to_dict())  # fmt: skip
    for step in range(3):
        rec.add(step, 2.0 * plan.predicted.step_s, 4.0, 2**30)
    rec.save(tmp_path / "run.json")
    assert main(["calibrate", str(tmp_path / "run.json"), "--cluster", "h100", "-o", str(tmp_path / "cal.json"),
                 "-q"]) == 0  # fmt: skip
    cal = meshplan.calibrate(tmp_path / "run.json", "h100")
    assert ClusterSpec.load(tmp_path / "cal.json") == cal.spec and cal.before.name == "h100"
    assert cal.spec.name == "h100-calibrated" and abs(cal.fit.rows[0][2] / cal.fit.rows[0][3] - 1) < 0.05
    with pytest.raises(ValueError, match="does not exist"):
        meshplan.calibrate(tmp_path / "missing.json", "h100")


def test_state_layout_cli_is_autoparallel(tmp_path: Path, gpt_tiny_graph) -> None:
    """``meshplan plan --state-layout megatron`` is ``autoparallel(state_layout="megatron")``: the plan
    records the runtime's 16-bit-weight layout and predicts less memory than fp32 parameters; "auto" (the
    default) keeps fp32 parameters while they fit and takes the first 16-bit layout that fits where they do not
    (said in the notes), and only a layout the runtime runs: fp32 parameters alone for another target, another
    dtype, quantization or a pinned FSDP kind; bad combinations fail in one line."""
    out = tmp_path / "p.json"
    pins = {"dp": 2, "dp_kind": "ddp", "recompute": "none", "micro_batch_size": 1}
    assert main(["plan", "gpt-tiny", "-n", "2", "--dp", "2", "--dp-kind", "ddp", "--recompute", "none", "--micro-batch", "1",
                 "--state-layout", "megatron", "-q", "-o", str(out)]) == 0  # fmt: skip
    py = meshplan.autoparallel(gpt_tiny_graph, 2, cluster="h100", fixed=pins, state_layout="megatron")
    _same_plan(Plan.load(out), py)
    torch_layout = meshplan.autoparallel(gpt_tiny_graph, 2, cluster="h100", fixed=pins, state_layout="torch")
    assert (py.state_layout, torch_layout.state_layout) == ("megatron", "torch")
    assert max(py.predicted.peak_mem_bytes) < max(torch_layout.predicted.peak_mem_bytes)
    # a limit between the two layouts' smallest needs: fp32 parameters do not fit, 16-bit weights do
    limit = (max(py.predicted.peak_mem_bytes) + max(torch_layout.predicted.peak_mem_bytes)) // 2
    with pytest.raises(meshplan.NoFeasiblePlanError):
        meshplan.autoparallel(gpt_tiny_graph, 2, cluster="h100", fixed=pins, memory_limit=limit, state_layout="torch")
    auto = meshplan.autoparallel(gpt_tiny_graph, 2, cluster="h100", fixed=pins, memory_limit=limit)  # the default
    assert auto.state_layout in ("megatron", "zero")
    assert any("--state-layout auto): no plan fits in torch" in n for n in auto.notes)
    _same_plan(auto, meshplan.autoparallel(gpt_tiny_graph, 2, cluster="h100", fixed=pins, memory_limit=limit,
                                           state_layout="auto"))
    free = meshplan.autoparallel(gpt_tiny_graph, 2, cluster="h100", fixed=pins)
    assert free.state_layout == "torch"
    _same_plan(free, torch_layout)  # where fp32 parameters fit, the default is the torch layout's plan
    # requests no 16-bit layout runs keep fp32 parameters (and do not fit here) rather than take one
    fsdp = {**pins, "dp_kind": "fsdp"}  # pinned, below its fp32 need: no plan (not the 16-bit profiles' ValueError)
    fsdp_need = max(meshplan.autoparallel(gpt_tiny_graph, 2, cluster="h100", fixed=fsdp).predicted.peak_mem_bytes)
    for kw in ({"dtype": "fp32"}, {"target": "torchtitan"}, {"quantization": "qat"},
               {"fixed": fsdp, "memory_limit": fsdp_need * 9 // 10}):
        with pytest.raises(meshplan.NoFeasiblePlanError):
            meshplan.autoparallel(gpt_tiny_graph, 2, cluster="h100", **{"fixed": pins, "memory_limit": limit, **kw})
    for bad, msg in (({"state_layout": "bf16"}, "state_layout 'bf16' unknown"),
                     ({"state_layout": "megatron", "target": "torchtitan"}, "layout of meshplan's runtime"),
                     ({"state_layout": "megatron", "dtype": "fp32"}, "keeps bf16 model weights")):  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            meshplan.autoparallel(gpt_tiny_graph, 2, cluster="h100", fixed=pins, **bad)
