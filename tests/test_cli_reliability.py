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
