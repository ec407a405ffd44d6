"""The whole-command published timing (``benchmarks/published_timing.py``): each case's
``meshplan plan`` command plans what the in-process timing plans (model, cluster, batch,
precision), and the table's parsing and summary. Nothing is timed here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from meshplan.cli import build_parser
from meshplan.commands import published_estimate as pe
from meshplan.cost_models.hardware import ClusterSpec, resolve_cluster
from meshplan.cost_models.published import load_published_cases
from meshplan.models.registry import load_factory

ROOT = Path(__file__).resolve().parents[1]


def _module() -> Any:
    spec = importlib.util.spec_from_file_location("published_timing", ROOT / "benchmarks" / "published_timing.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["published_timing"] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def _case(prefix: str) -> dict[str, Any]:
    return next(c for c in load_published_cases() if c["id"].startswith(prefix))


def test_every_case_has_its_own_factory_name() -> None:
    pt = _module()
    ids = [c["id"] for c in load_published_cases()]
    names = [pt.factory_name(i) for i in ids]
    assert len(set(names)) == len(ids)
    assert all(n.isidentifier() for n in names)
    assert pt.factory_name("llama3-405b-h100-8192gpu-seq8k") == "llama3_405b_h100_8192gpu_seq8k"


@pytest.mark.parametrize("prefix", ["llama3-405b-h100-16384gpu-cp16", "tt-llama3.1-70b-h100-256gpu", "megv1-1b-dgx2"])
def test_case_command_is_a_plan_command_of_the_case(prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pt = _module()
    case = _case(prefix)
    cluster = pt.write_cluster(case, tmp_path)
    cmd = pt.case_command(case, cluster, tmp_path / "p.json", python="PY")
    assert cmd[:4] == ["PY", "-m", "meshplan.cli", "plan"]
    args = build_parser().parse_args(cmd[3:])
    setup, spec = pe.case_setup(case), pe.case_cluster(case)
    assert args.world_size == spec.num_devices == case["cluster"]["n_gpus"]
    assert args.global_batch == setup["global_batch_size"]
    assert args.dtype == setup["dtype"]
    assert args.output == str(tmp_path / "p.json")
    assert not any(getattr(args, k) for k in ("tp", "pp", "dp", "cp", "ep", "schedule", "micro_batch", "quiet"))
    # the profile is the case's cluster, as `plan_graph(cluster=case_cluster(case))` resolves it
    assert resolve_cluster(args.cluster, args.world_size).to_dict() == resolve_cluster(spec, spec.num_devices).to_dict()
    assert ClusterSpec.load(cluster).to_dict() == spec.to_dict()
    # the model spec names the case's zoo model (relative to the repository root, where it runs)
    monkeypatch.chdir(ROOT)
    factory = load_factory(args.model)
    if prefix.startswith("megv1"):  # building a small one on meta is cheap: the same module as case_model
        from meshplan.models.published import case_model

        built, ref = factory(), case_model(case)
        assert type(built) is type(ref) and built.config == ref.config


def test_parse_progress_reads_the_plan_commands_lines() -> None:
    pt = _module()
    err = ("[  0.00s] building x on the meta device\n[  1.25s] tracing\n"
           "[  2.50s] traced 812 nodes, 8,030,261,248 parameters; searching\n"
           "[  3.10s] searching 930 configurations\n[  4.75s] done: 937 evaluated in 2.21 s\n")  # fmt: skip
    assert pt.parse_progress(err) == (2.5, 2.21)
    assert pt.parse_progress("Traceback ...\nValueError: x\n") == (None, None)


def test_summary_gives_median_slowest_and_flags_over_the_goal() -> None:
    pt = _module()

    def run(i: str, wall: float, cpu: float, rc: int = 0) -> Any:
        return pt.WholeRun(i, wall, cpu, None, None, 1.0, 1.0, rc, config="boom" if rc else "tp1 pp1 dp8")

    rows = [run("a", 3.0, 2.5), run("b", 12.0, 9.0), run("c", 5.0, 10.5), run("d", 1.0, 1.0, rc=1)]
    text = "\n".join(pt.summarize(rows))
    assert "3 of 4 cases planned; median 5.00 s wall, 9.00 s CPU" in text
    assert "slowest 12.00 s wall (b), 10.50 s CPU (c)" in text
    assert "over 10 s: b (12.00 s wall, 9.00 s CPU), c (5.00 s wall, 10.50 s CPU)" in text
    assert "failed: d (exit 1: boom)" in text
    assert pt.flag(rows[0]) == "" and pt.flag(rows[1]) == "OVER 10 s (wall)" and pt.flag(rows[3]) == "FAILED"
    assert pt.summarize([run("a", 1.0, 1.0)])[-1] == "over 10 s: none"


def test_plan_differences_ignore_the_runs_own_timings() -> None:
    pt = _module()
    a = {"tp": 2, "solver": {"status": "optimal", "seconds": 1.25, "split_seconds": 0.5},
         "notes": ["stage split re-solved by the stage-split ILP (optimal, highs, 0.07 s)"]}  # fmt: skip
    b = {"tp": 2, "solver": {"status": "optimal", "seconds": 3.5, "split_seconds": 0.1},
         "notes": ["stage split re-solved by the stage-split ILP (optimal, highs, 1.20 s)"]}  # fmt: skip
    assert pt.plan_differences(a, b) == []
    c = {**b, "tp": 4, "solver": {**b["solver"], "status": "feasible"}}
    assert pt.plan_differences(a, c) == ["solver", "tp"]
