"""Every flag of the commands that have a Python function reaches Python (#29): a flag is one of the
function's parameters (under the name ``FLAGS`` gives), a key of its ``fixed`` pins, or what a
named public function does with the result (save, write HTML, print). A flag added to one of these
commands without its Python spelling fails here, so the CLI and the API cannot drift apart."""

from __future__ import annotations

import importlib
import inspect

import pytest

import meshplan
from meshplan.cli import build_parser
from meshplan.planner.validate import FIXED_KEYS

#: command -> (its Python function, {flag dest: parameter name, "fixed:KEY", or "call:module:attr"})
FLAGS: dict[str, tuple[str, dict[str, str]]] = {
    "plan": ("autoparallel", {
        "model": "model", "world_size": "world_size", "cluster": "cluster", "memory_limit": "memory_limit",
        "global_batch": "global_batch_size", "seq": "seq_len", "input_shape": "input_shapes",
        "tp": "fixed:tp", "pp": "fixed:pp", "dp": "fixed:dp", "cp": "fixed:cp", "ep": "fixed:ep",
        "capacity_factor": "fixed:capacity_factor", "schedule": "fixed:schedule",
        "micro_batch": "fixed:micro_batch_size", "recompute": "fixed:recompute", "dp_kind": "fixed:dp_kind",
        "quantization": "quantization", "lora_rank": "lora_rank", "dtype": "dtype", "target": "target",
        # --optimizer sgd --momentum 0 is optimizer="sgd", any other momentum "sgd-momentum"
        "optimizer": "optimizer", "momentum": "optimizer", "state_layout": "state_layout",
        "no_cache": "use_cache", "quiet": "progress", "output": "call:meshplan.plan:Plan.save",
        "html": "call:meshplan:write_html", "png": "call:meshplan.report.plot:write_timeline_png",
    }),
    "estimate": ("estimate_config", {
        "model": "model", "from_torchtitan": "config", "from_megatron": "config", "from_deepspeed": "config",
        "world_size": "world_size", "cluster": "cluster", "seq": "seq_len", "input_shape": "input_shapes",
        "target": "target", "quiet": "progress", "output": "call:meshplan.plan:Plan.save",
        "best_output": "call:meshplan.plan:Plan.save", "optimizer": "optimizer", "momentum": "optimizer",
        "state_layout": "state_layout",
    }),
    "export": ("export", {
        "plan": "plan", "to": "to", "form": "form", "base": "base", "nearest": "nearest", "model": "model",
        "toml": "form", "output": "call:meshplan.api.export:Exported.save",
    }),
    "capacity": ("capacity", {
        "model": "model", "tokens": "tokens", "gpus": "gpus", "cluster": "clusters", "price": "prices",
        "deadline": "deadline", "budget": "budget", "global_batch": "global_batch", "seq": "seq_len",
        "dtype": "dtype", "jobs": "jobs", "error_band": "error_band", "scaling_band": "scaling_band", "quiet": "progress",
        "optimizer": "optimizer", "momentum": "optimizer",
        "png": "call:meshplan.report.capacity_plot:write_capacity_png",
        "no_png": "call:meshplan.report.capacity_plot:write_capacity_png",
        "html": "call:meshplan.report.capacity_plot:write_capacity_html",
        "json": "call:meshplan.sizing.api:capacity_report",
    }),
    "calibrate": ("calibrate", {
        "records": "records", "cluster": "cluster", "name": "name", "use_phases": "use_phases",
        "core_share": "core_share", "cluster_host": "host", "quiet": "progress",
        "output": "call:meshplan.cost_models.hardware:ClusterSpec.save",
    }),
    "prepare-data": ("prepare_data", {
        "inputs": "inputs", "output": "output", "tokenizer": "tokenizer", "val_fraction": "val_fraction",
        "quiet": "progress",
    }),
    "profile": ("profile_machine", {
        "nproc": "nproc", "quick": "quick", "min_bytes": "min_bytes", "max_bytes": "max_bytes", "reps": "reps",
        "matmul_sizes": "matmul_sizes", "eager_shapes": "eager_shapes", "mem_test_bytes": "mem_test_bytes",
        "backend": "backend", "name": "name", "budget": "budget_s",
        "output": "call:meshplan.cost_models.hardware:ClusterSpec.save",
    }),
    "explain": ("explain_plan", {"plan": "call:meshplan.plan:Plan.load",
                                 "timeline": "call:meshplan.report.timeline:format_text_timeline",
                                 "width": "call:meshplan.report.timeline:format_text_timeline"}),
    "diff": ("format_diff", {"plan_a": "a", "plan_b": "b"}),
}  # fmt: skip
#: flags about the command's own output that a Python caller controls itself (warnings filters)
CLI_ONLY = {"verbose"}
#: capacity's keywords go through ``**kw`` to ``sizing.api.capacity_report`` and on to ``sizing.api.ask``
KW_TARGET = {"capacity": ("meshplan.sizing.api:capacity_report", "meshplan.sizing.api:ask")}


def _dests(command: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return {a.dest for a in sub.choices[command]._actions if a.dest != "help"}


def _resolve(target: str) -> object:
    mod, _, attr = target.partition(":")
    obj: object = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("command", list(FLAGS))
def test_every_flag_has_its_python_spelling(command: str) -> None:
    fn_name, mapping = FLAGS[command]
    fn = getattr(meshplan, fn_name)
    assert fn_name in meshplan.__all__
    params = set(inspect.signature(fn).parameters)
    if command in KW_TARGET:
        for target in KW_TARGET[command]:
            params |= set(inspect.signature(_resolve(target)).parameters)
    missing = sorted(_dests(command) - set(mapping) - CLI_ONLY)
    assert not missing, f"`meshplan {command}` flags with no Python spelling in tests/test_api_flags.py: {missing}"
    for dest, where in mapping.items():
        if where.startswith("fixed:"):
            assert "fixed" in params and where[6:] in FIXED_KEYS, (command, dest)
        elif where.startswith("call:"):
            assert callable(_resolve(where[5:])), (command, dest, where)
        else:
            assert where in params, f"meshplan.{fn_name} has no parameter {where!r} (for --{dest})"


def test_the_check_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = dict(FLAGS["plan"][1])
    del plan["lora_rank"]
    monkeypatch.setitem(FLAGS, "plan", ("autoparallel", plan))
    with pytest.raises(AssertionError, match=r"no Python spelling .*\['lora_rank'\]"):
        test_every_flag_has_its_python_spelling("plan")
    monkeypatch.setitem(FLAGS, "plan", ("autoparallel", {**plan, "lora_rank": "lora_rnk"}))
    with pytest.raises(AssertionError, match="has no parameter 'lora_rnk'"):
        test_every_flag_has_its_python_spelling("plan")
