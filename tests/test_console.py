"""Third-party warnings and log lines stay off a command's output unless ``-v`` (``meshplan.console``):
in the CLI process and in the ranks ``meshplan run`` starts; meshplan's own warnings and any
library's errors still show."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from meshplan.console import third_party_quiet
from meshplan.errors import MeshplanWarning

ROOT = Path(__file__).resolve().parents[1]


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def lib_log():
    log = logging.getLogger("meshplan_test_thirdparty")
    kept = _Kept()
    log.addHandler(kept)
    log.setLevel(logging.DEBUG)
    yield log, kept.lines
    log.removeHandler(kept)


def _warn_from_a_library(text: str, category: type[Warning] = FutureWarning) -> None:
    warnings.warn_explicit(text, category, "site-packages/somelib/__init__.py", 1, module="somelib")


def test_quiet_keeps_meshplan_warnings_and_errors_only(lib_log, monkeypatch) -> None:
    log, lines = lib_log
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    monkeypatch.setattr(sys, "warnoptions", [])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with third_party_quiet():
            _warn_from_a_library("a library's deprecation")
            _warn_from_a_library("a library's advice", UserWarning)
            warnings.warn("meshplan's own", MeshplanWarning, stacklevel=1)
            log.warning("Failed to load some_kernel.so")
            log.error("a library's error")
        assert [str(w.message) for w in seen] == ["meshplan's own"]
        assert lines == ["a library's error"]
        _warn_from_a_library("after the block")  # restored: the caller's filters again
        log.warning("after the block")
    assert [str(w.message) for w in seen][-1] == "after the block"
    assert lines[-1] == "after the block"
    assert logging.root.manager.disable == logging.NOTSET


def test_verbose_and_explicit_requests_keep_everything(lib_log, monkeypatch) -> None:
    log, lines = lib_log
    monkeypatch.setattr(sys, "warnoptions", [])
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with third_party_quiet(verbose=True):
            _warn_from_a_library("verbose")
            log.warning("verbose")
        monkeypatch.setattr(sys, "warnoptions", ["default"])  # python -W default / PYTHONWARNINGS
        monkeypatch.setenv("TORCH_LOGS", "dynamo")  # the user asked torch for its logs
        with third_party_quiet():
            _warn_from_a_library("-W given")
            log.warning("TORCH_LOGS given")
    assert [str(w.message) for w in seen] == ["verbose", "-W given"]
    assert lines == ["verbose", "TORCH_LOGS given"]


def test_run_passes_verbose_to_the_ranks(tmp_path) -> None:
    from meshplan.cli import build_parser
    from meshplan.commands import run as run_cmd
    from meshplan.runtime.loop.train import build_parser as rank_parser

    plan = tmp_path / "plan.json"
    _tiny_plan(plan)
    parse = build_parser().parse_args
    quiet = run_cmd.build_command(parse(["run", str(plan), "--model", "gpt-tiny"]))
    loud_args = parse(["run", str(plan), "--model", "gpt-tiny", "-v"])
    assert "--verbose" not in quiet and run_cmd.build_command(loud_args)[-1] == "--verbose"
    assert "--verbose" in run_cmd.run_argv(loud_args)  # what a Slurm script's nodes run
    assert rank_parser().parse_args(["--plan", "p", "--model", "m", "--verbose"]).verbose


def _tiny_plan(path: Path) -> None:
    from meshplan.cli import main

    assert main(["plan", "mlp", "-n", "2", "--quiet", "-o", str(path)]) == 0


NOISY_FACTORY = '''
import logging
import os
import warnings

import torch
from torch import nn

logging.getLogger("noisylib").warning("NOISE-LOG Failed to load noisylib/_C.so")
warnings.warn("NOISE-WARN noisylib.thing is deprecated", FutureWarning)


def build():
    logging.getLogger("noisylib.build").warning("NOISE-LOG while building")
    warnings.warn("NOISE-WARN build-time advice", UserWarning)
    if "LOCAL_RANK" in os.environ:  # the launcher's own check builds it fine; the ranks fail
        raise RuntimeError("boom in the rank")
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), (torch.randn(2, 8),)
'''


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for var in ("PYTHONWARNINGS", "TORCH_LOGS", "LOGLEVEL"):
        env.pop(var, None)
    return subprocess.run([sys.executable, "-m", "meshplan.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_plan_and_run_show_meshplans_lines_only_unless_verbose(tmp_path) -> None:
    """A model whose library logs and warns on import and build: `meshplan plan` prints meshplan's
    lines only and `plan -v` the library's too; a 2-rank `meshplan run` whose ranks fail prints no
    library line either, the rank's own error, then one line per failed rank from
    runtime/launch/agent.py instead of torchrun's report (no OMP_NUM_THREADS banner, no "closing
    signal" notices, no ChildFailedError)."""
    f = tmp_path / "noisy.py"
    f.write_text(NOISY_FACTORY)
    model = f"{f}:build"
    plan = _cli("plan", model, "-n", "2", "--global-batch", "4", "--no-cache", "-o", "plan.json", cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert "meshplan plan for" in plan.stdout and "wrote plan.json" in plan.stderr
    assert "NOISE" not in plan.stdout + plan.stderr, plan.stderr
    loud = _cli("plan", model, "-n", "2", "--global-batch", "4", "--no-cache", "-q", "-v", cwd=tmp_path)
    assert loud.returncode == 0, loud.stderr[-3000:]
    for noise in ("NOISE-LOG Failed to load", "NOISE-WARN noisylib.thing", "NOISE-LOG while building",
                  "NOISE-WARN build-time advice"):
        assert noise in loud.stderr, loud.stderr
    run = _cli("run", "plan.json", "--model", model, "--steps", "1", "--dtype", "fp32", cwd=tmp_path)
    assert run.returncode == 1
    err = run.stdout + run.stderr
    assert "boom in the rank" in err, err[-3000:]
    assert "torchrun: rank 0 (pid " in err and "stopped: exit code 1" in err, err[-3000:]
    for noise in ("NOISE", "ChildFailedError", "OMP_NUM_THREADS", "closing signal", "Root Cause"):
        assert noise not in err, err[-3000:]


def test_failure_text_names_exit_codes_and_signals() -> None:
    from meshplan.runtime.launch.agent import failure_text

    assert failure_text(1) == "exit code 1"
    assert failure_text(-9) == "signal 9 (SIGKILL)"
