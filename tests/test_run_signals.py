"""A real `meshplan run` (torchrun, 2 ranks, gpt-tiny) stopped by SIGINT mid-training: exit 130,
no process of the run left, no torchelastic temp dir left, the newest checkpoint complete and intact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from meshplan.runtime.launch.supervise import tagged_pids
from meshplan.runtime.weights import files as cf

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_sigint_stops_meshplan_run_cleanly(tmp_path: Path) -> None:
    from meshplan.models import load_model
    from meshplan.runtime.apply import handplan

    spec = load_model("gpt-tiny", batch_size=2, seq_len=16)
    plan = handplan.manual_plan(spec.model, None, model_name="gpt-tiny", dp=2, microbatches=1,
                                micro_batch_size=2, seq_len=16, step_s=0.05)
    plan.save(tmp_path / "plan.json")
    mark, tmpdir, ck = uuid.uuid4().hex, tmp_path / "tmp", tmp_path / "ck"
    tmpdir.mkdir()
    env = dict(os.environ, TEST_RUN_MARK=mark, TMPDIR=str(tmpdir),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen(
        [sys.executable, "-m", "meshplan.cli", "run", str(tmp_path / "plan.json"), "--model", "gpt-tiny",
         "--steps", "100000", "--checkpoint-dir", str(ck), "--checkpoint-every", "1", "--keep-checkpoints", "2", "--log-every", "1"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    seen = []
    try:
        assert p.stdout is not None
        for line in p.stdout:
            seen.append(line)
            if line.startswith("step     3"):
                break
        else:
            raise AssertionError("".join(seen)[-3000:])
        assert len(tagged_pids(mark, "TEST_RUN_MARK")) >= 4  # meshplan, torchrun, 2 workers
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=60) == 130
        assert tagged_pids(mark, "TEST_RUN_MARK") == []
        assert list(tmpdir.iterdir()) == []  # torchelastic_* went with the run's TMPDIR
        newest = cf.newest_complete(ck)
        assert newest is not None and cf.read_manifest(newest)["step"] >= 2
        files = cf.read_manifest(newest)["files"]
        assert cf.verify_files(newest, files, files) == []
        assert len(cf.complete_checkpoints(ck)) <= 2
    finally:
        for pid in tagged_pids(mark, "TEST_RUN_MARK"):
            os.kill(pid, signal.SIGKILL)
        p.kill()
