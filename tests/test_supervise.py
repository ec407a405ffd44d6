"""`run_tree` (what `meshplan run` launches torchrun with): a signal stops the whole tree, temp dirs go."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from meshplan.runtime.launch.supervise import tagged_pids

# Like torchrun: a launcher that makes a temp dir and starts a worker in a session of its own;
# with "stubborn" both ignore SIGTERM/SIGINT, so only the SIGKILL after the grace period stops them.
CHILD = r"""
import signal, subprocess, sys, tempfile, time
stubborn = sys.argv[1] == "stubborn"
if stubborn:
    signal.signal(signal.SIGTERM, signal.SIG_IGN); signal.signal(signal.SIGINT, signal.SIG_IGN)
tempfile.mkdtemp(prefix="torchelastic_")
code = "import signal, time\n" + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if stubborn else "") + "time.sleep(600)"
subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
print("ready", flush=True)
time.sleep(600)
"""

SUPERVISOR = (
    "import sys; from meshplan.runtime.launch.supervise import run_tree; "
    "sys.exit(run_tree([sys.executable, '-c', sys.argv[1], sys.argv[2]], grace_s=1.5))"
)


@pytest.mark.parametrize(("sig", "mode", "code"), [(signal.SIGINT, "polite", 130), (signal.SIGTERM, "stubborn", 143)])
def test_signal_stops_the_whole_tree(tmp_path: Path, sig: int, mode: str, code: int) -> None:
    mark = uuid.uuid4().hex
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = dict(os.environ, TEST_TREE_MARK=mark, TMPDIR=str(tmpdir),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, "-c", SUPERVISOR, CHILD, mode], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        assert len(tagged_pids(mark, "TEST_TREE_MARK")) >= 2  # launcher + its worker
        t0 = time.monotonic()
        p.send_signal(sig)
        assert p.wait(timeout=30) == code
        assert time.monotonic() - t0 < 15
        assert tagged_pids(mark, "TEST_TREE_MARK") == []  # nothing left running
        assert list(tmpdir.iterdir()) == []  # the run's TMPDIR (torchelastic_* inside) is gone
    finally:
        for pid in tagged_pids(mark, "TEST_TREE_MARK"):
            os.kill(pid, signal.SIGKILL)
        p.kill()


def test_workers_get_expandable_segments_unless_the_user_set_an_allocator() -> None:
    """The CUDA caching allocator's expandable segments (torchtitan's default) for every worker; a user's
    own setting, under either variable name, is left as it is."""
    from meshplan.runtime.launch.supervise import ALLOC_CONF, worker_env

    assert worker_env({"PATH": "/bin"}) == {"PATH": "/bin", "PYTORCH_CUDA_ALLOC_CONF": ALLOC_CONF}
    assert worker_env({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) == {
        "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    assert worker_env({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}) == {
        "PYTORCH_ALLOC_CONF": "expandable_segments:False"}
    child = subprocess.run([sys.executable, "-c", SUPERVISOR, "import os; print(os.environ['PYTORCH_CUDA_ALLOC_CONF'])",
                            "x"], capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                                        if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")},
                           timeout=60)
    assert child.stdout.strip() == ALLOC_CONF, child.stderr
