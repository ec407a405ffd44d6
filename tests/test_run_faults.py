"""Real `meshplan run`s (torchrun, 2 ranks on gloo, a tiny MLP) meeting the faults of a long run:
a rank that hangs inside a step, a GPU out of memory, a slow rank, a token file changing under the
job. Each ends with one message naming what, where and what to do, no process left, the newest
complete checkpoint loadable, and (under --max-restarts or --resume) the loss of a clean run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from meshplan.runtime.launch.supervise import tagged_pids
from meshplan.runtime.weights import files as cf

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
HERE = Path(__file__).parent
MODEL = "fault_hooks:model"
STEPS = 6


def _env(mark: str, case: str = "") -> dict[str, str]:
    return dict(os.environ, FAULT_CASE=case, TEST_FAULT_MARK=mark,
                PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]))


def _run(tmp: Path, *extra: str, case: str = "", timeout: float = 240) -> tuple[subprocess.CompletedProcess, str]:
    mark = uuid.uuid4().hex
    out = subprocess.run([sys.executable, "-m", "meshplan.cli", "run", str(tmp / "plan.json"), "--model", MODEL,
                          "--log-every", "1", "--profile-steps", "0", *extra],
                         env=_env(mark, case), capture_output=True, text=True, timeout=timeout)
    return out, mark


def _losses(path: Path) -> dict[int, float]:
    return {s["step"]: s["loss"] for s in json.loads(path.read_text())["steps"]}


@pytest.fixture(scope="class")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    out = subprocess.run([sys.executable, "-m", "meshplan.cli", "plan", MODEL, "-n", "2", "--cluster", "h100", "--dp", "2",
                          "--dp-kind", "ddp", "--global-batch", "8", "--micro-batch", "4", "--dtype", "fp32", "--quiet",
                          "--no-cache", "-o", str(tmp / "plan.json")], env=_env("plan"), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return tmp


class TestRunFaults:
    def test_slow_rank_named_and_reference_losses(self, setup) -> None:
        """Rank 1 sleeps 40 ms in every forward: the end line and the report name it; losses unchanged."""
        out, mark = _run(setup, "--steps", str(STEPS), "--data", "fault_hooks:batches", "--record",
                         str(setup / "slow.json"), case="slow:1:0:0.04")
        assert out.returncode == 0, out.stderr[-4000:]
        assert "straggler: rank 1 median step" in out.stdout, out.stdout[-2000:]
        rec = json.loads((setup / "slow.json").read_text())
        assert len(rec["rank_step_s"]) == 2 and len(rec["rank_step_s"][1]) == STEPS
        assert tagged_pids(mark, "TEST_FAULT_MARK") == []
        report = subprocess.run([sys.executable, "-m", "meshplan.cli", "report", str(setup / "slow.json")],
                                env=_env(mark), capture_output=True, text=True, timeout=60)
        assert report.returncode == 0, report.stderr
        assert "per-rank step time (own work" in report.stdout and "straggler: rank 1" in report.stdout
        (setup / "reference.json").write_text((setup / "slow.json").read_text())

    def test_hang_stops_every_rank_and_restart_finishes(self, setup) -> None:
        """Rank 1 sleeps inside step 3's forward: the watchdog names it, torchrun restarts from step 2."""
        ck = setup / "ck-hang"
        out, mark = _run(setup, "--steps", str(STEPS), "--data", "fault_hooks:batches", "--checkpoint-dir", str(ck),
                         "--checkpoint-every", "1", "--hang-timeout", "4", "--max-restarts", "1",
                         "--record", str(setup / "hang.json"), case="hang:1:3")
        assert out.returncode == 0, out.stderr[-6000:]  # _run's 240 s timeout: a hang the watchdog missed fails
        err = out.stderr
        assert "hang: no rank advanced for" in err and "rank 1" in err and "stopped at step 3 in forward" in err, err[-4000:]
        assert "waiting: rank 0 at step 3 in backward" in err  # DDP waits for the bucket all-reduce there
        assert "ck-hang/step-000002 kept" in err
        assert "meshplan run: recovered (--max-restarts) after: hang:" in err
        assert "resumed from" in out.stdout and "after restart 1" in out.stdout
        after, ref = _losses(setup / "hang.json"), _losses(setup / "reference.json")
        assert min(after) == 3 and after[STEPS] == pytest.approx(ref[STEPS], abs=1e-6)
        assert tagged_pids(mark, "TEST_FAULT_MARK") == []

    def test_oom_explained_then_resume_matches(self, setup) -> None:
        """Rank 1's allocator fails in step 3: one message with the re-plan; step 2 stays loadable."""
        ck = setup / "ck-oom"
        out, mark = _run(setup, "--steps", str(STEPS), "--data", "fault_hooks:batches", "--checkpoint-dir", str(ck),
                         "--checkpoint-every", "1", case="oom:1:3")
        assert out.returncode != 0
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith("meshplan run: stopped: out of GPU memory on rank 1 at step 3 in forward"), out.stderr[-4000:]
        assert "predicted for its stage; plan made for " in last and "GiB: re-plan with the measured headroom" in last
        assert f"`meshplan plan {MODEL} -n 2 --memory-limit " in last and "(+20.0 MiB it tried" in last
        assert out.stderr.count("out of GPU memory on rank 1") == 2  # the worker's line, repeated last
        assert out.stderr.count("Traceback") <= 1 and "OutOfMemoryError" not in out.stderr  # torchrun's own report only
        assert tagged_pids(mark, "TEST_FAULT_MARK") == []
        newest = cf.newest_complete(ck)
        assert newest is not None and newest.name == "step-000002"
        files = cf.read_manifest(newest)["files"]
        assert cf.verify_files(newest, files, files) == []
        out, _ = _run(setup, "--steps", str(STEPS), "--data", "fault_hooks:batches", "--checkpoint-dir", str(ck),
                      "--checkpoint-every", "1", "--resume", "--record", str(setup / "oom.json"))
        assert out.returncode == 0, out.stderr[-4000:]
        assert _losses(setup / "oom.json")[STEPS] == pytest.approx(_losses(setup / "reference.json")[STEPS], abs=1e-6)

    def test_unexplained_error_is_one_line_after_its_traceback(self, setup) -> None:
        """Rank 1 fails with an error meshplan cannot explain: its traceback, then the line naming rank,
        step and phase; rank 0, whose collective broke, exits without a traceback of its own."""
        out, mark = _run(setup, "--steps", "4", "--data", "fault_hooks:batches", case="error:1:2")
        assert out.returncode != 0
        last = out.stderr.strip().splitlines()[-1]
        assert last == ("meshplan run: stopped: rank 1 failed at step 2 in forward: RuntimeError: CUDA error: an "
                        "illegal memory access was encountered (simulated)"), out.stderr[-3000:]
        assert out.stderr.count("raise RuntimeError(\"CUDA error") == 1  # one worker traceback: rank 1's
        assert tagged_pids(mark, "TEST_FAULT_MARK") == []

    def test_token_file_truncated_under_the_job(self, setup) -> None:
        """tokens.bin shrinks mid-run: the run stops before reading it, naming the file and the change."""
        from meshplan.models import load_model
        from meshplan.runtime.apply import handplan
        from meshplan.tokenfile import TokenMeta, write_meta

        tokens = setup / "tokens.bin"
        np.random.default_rng(0).integers(0, 64, 20_000).astype(np.uint16).tofile(tokens)
        write_meta(tokens, TokenMeta(dtype="uint16", vocab_size=64, max_token_id=63, tokens=20_000))
        spec = load_model("gpt-tiny", batch_size=2, seq_len=16)
        plan = setup / "gpt.json"
        handplan.manual_plan(spec.model, None, model_name="gpt-tiny", dp=2, microbatches=1, micro_batch_size=2,
                             seq_len=16).save(plan)
        ck = setup / "ck-data"
        mark = uuid.uuid4().hex
        p = subprocess.Popen([sys.executable, "-m", "meshplan.cli", "run", str(plan), "--model", "gpt-tiny",
                              "--data", str(tokens), "--steps", "100000", "--checkpoint-dir", str(ck),
                              "--checkpoint-every", "2", "--log-every", "1", "--profile-steps", "0"],
                             env=_env(mark), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 180
            while not (ck / "step-000002").is_dir() and time.monotonic() < deadline and p.poll() is None:
                time.sleep(0.05)
            with open(tokens, "r+b") as f:
                f.truncate(10_000)
            _, err = p.communicate(timeout=120)
        finally:
            p.kill()
        assert p.returncode != 0
        last = err.strip().splitlines()[-1]
        assert "meshplan run: stopped: rank" in last and f"--data {tokens} changed under the running job" in last, err[-3000:]
        assert "shrank from 40,000 to 10,000 bytes" in last and "stopped before training on it" in last
        assert tagged_pids(mark, "TEST_FAULT_MARK") == []
        assert cf.newest_complete(ck) is not None
