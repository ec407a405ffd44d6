"""CLI failure modes end cleanly: the plan survives a broken stdout, an empty search names why,
nonsense numbers are refused by the argument parser."""

from __future__ import annotations

import errno

import pytest

from meshplan.cli import main
from meshplan.plan import Plan


class _FullStdout:
    def write(self, _s: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_plan_saved_before_a_failing_report(tmp_path, monkeypatch, capsys) -> None:
    out = tmp_path / "plan.json"
    monkeypatch.setattr("sys.stdout", _FullStdout())
    assert main(["plan", "mlp", "-n", "2", "--cluster", "h100", "--quiet", "--no-cache", "-o", str(out)]) == 1
    assert Plan.load(out).world_size == 2
    err = capsys.readouterr().err
    assert "could not write the report" in err and f"the plan was saved to {out}" in err


@pytest.mark.parametrize(("argv", "reason"), [
    (["-n", "7", "--global-batch", "8"], "dp=7, which does not divide the global batch 8"),
    (["-n", "2", "--micro-batch", "3"], "not divisible by micro batch [3]"),
])
def test_empty_search_is_no_feasible_plan_with_reason(argv, reason, capsys) -> None:
    assert main(["plan", "gpt-tiny", "--cluster", "h100", "--quiet", "--no-cache", *argv]) == 1
    err = capsys.readouterr().err
    assert "no parallel configuration" in err and reason in err and "Overflow" not in err


@pytest.mark.parametrize("argv", [
    ["plan", "gpt-tiny", "-n", "2", "--seq", "0"],
    ["plan", "gpt-tiny", "-n", "0"],
    ["plan", "gpt-tiny", "-n", "2", "--micro-batch", "-1"],
    ["run", "plan.json", "--model", "mlp", "--nproc", "0"],
    ["run", "plan.json", "--model", "mlp", "--steps", "0"],
    ["run", "plan.json", "--model", "mlp", "--timeout", "0"],
])
def test_nonsense_numbers_refused_by_argparse(argv, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "must be > 0" in capsys.readouterr().err


@pytest.fixture(scope="module")
def mlp_plan(tmp_path_factory) -> str:
    from meshplan.models import load_model
    from meshplan.runtime.apply import handplan

    spec = load_model("mlp", batch_size=4)
    path = tmp_path_factory.mktemp("p") / "plan.json"
    handplan.manual_plan(spec.model, None, model_name="mlp", micro_batch_size=4).save(path)
    return str(path)


@pytest.mark.parametrize(("extra", "msg"), [
    (["--model", "no-such-model"], "--model 'no-such-model' is not a zoo model"),
    (["--model", "no_such_pkg.mod:factory"], "No module named 'no_such_pkg'"),
    (["--model", "mlp", "--data", "missing/tokens.bin"], "no such file"),
    (["--model", "mlp", "--data", "no_such_pkg.mod:fn"], "module 'no_such_pkg.mod' not found"),
    (["--model", "mlp", "--checkpoint-dir", "{file}/ck"], "--checkpoint-dir {file}/ck is not writable"),
    (["--model", "mlp", "--record", "{file}/r/rec.json"], "the RunRecord directory {file}/r is not writable"),
    (["--model", "mlp", "--resume", "--checkpoint-dir", "{empty}"], "no complete checkpoint in"),
])
def test_preflight_refuses_before_spawning(mlp_plan, tmp_path, capsys, monkeypatch, extra, msg) -> None:
    from meshplan.runtime.launch import supervise

    def spawned(*_a: object, **_k: object) -> int:
        raise AssertionError("torchrun was started before the refusal")

    monkeypatch.setattr(supervise, "run_tree", spawned)
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    fill = {"file": str(tmp_path / "file"), "empty": str(tmp_path / "empty")}
    assert main(["run", mlp_plan, *[a.format(**fill) for a in extra]]) == 1  # run_tree never called
    err = capsys.readouterr().err
    assert msg.format(**fill) in err, err


def test_timeout_reaches_the_workers(mlp_plan, capsys) -> None:
    assert main(["run", mlp_plan, "--model", "mlp", "--timeout", "7.5", "--print-command"]) == 0
    assert "--timeout 7.5" in capsys.readouterr().out
