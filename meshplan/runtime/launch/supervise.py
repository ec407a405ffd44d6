"""Run a launcher command (torchrun) as a supervised process tree that a signal stops completely.

``run_tree(cmd)`` starts ``cmd`` in its own session (so a terminal's Ctrl-C reaches only us) with
these in its environment that every descendant inherits:

- ``MESHPLAN_RUN_TAG=<unique>``: torchrun starts each worker in a session of its own, and a
  worker whose torchrun died is re-parented to init, so neither the process group nor the
  parent links find them all; the tag in ``/proc/<pid>/environ`` does.
- ``MESHPLAN_FAULT_FILE=<that directory>/faults.txt``: a worker that stops the run on a fault
  (``runtime.loop.faults.report``) appends its one line there; ``run_tree`` repeats the last one after
  torchrun's own failure report (or, when ``--max-restarts`` recovered, each one as a note).
- ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless the user set an allocator
  configuration (``worker_env``, ``ALLOC_CONF``: less fragmentation of the CUDA caching allocator).
- ``TMPDIR=<a fresh directory>``: torchelastic's ``torchelastic_*`` log/temp directories (and any
  other temp file of the run) land there and are deleted when the run ends, however it ends.

On SIGINT or SIGTERM it forwards the signal to the launcher's process group and to every tagged
process, waits up to ``grace_s`` for them to exit (a second signal cuts the wait short), then
SIGKILLs whatever is left and returns ``128 + signal`` (130 / 143). A checkpoint being written
when the signal lands is never published: ``checkpoint.save`` renames its temporary directory
only after every rank finished, so the newest complete checkpoint stays the previous one.
torch is not imported here.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

TAG_VAR = "MESHPLAN_RUN_TAG"
FAULT_FILE_VAR = "MESHPLAN_FAULT_FILE"
GRACE_S = 20.0
_POLL_S = 0.2


def tagged_pids(tag: str, var: str = TAG_VAR) -> list[int]:
    """Live processes (of this user) whose environment holds ``var=tag``; [] without /proc."""
    needle = f"{var}={tag}".encode()
    out = []
    proc = Path("/proc")
    if not proc.is_dir():
        return out
    for p in proc.iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            env = (p / "environ").read_bytes()
            state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and needle in env.split(b"\0"):
            out.append(int(p.name))
    return out


def _signal_all(pgid: int, tag: str, sig: int) -> None:
    for kill, target in [(os.killpg, pgid)] + [(os.kill, pid) for pid in tagged_pids(tag)]:
        try:
            kill(target, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_gone(proc: subprocess.Popen, tag: str, deadline: float, stop: list[int] | None = None) -> bool:
    """Wait until the launcher and every tagged process exited; False at ``deadline`` (or a 2nd signal)."""
    while time.monotonic() < deadline:
        proc.poll()
        if proc.returncode is not None and not tagged_pids(tag):
            return True
        if stop is not None and len(stop) > 1:
            return False
        time.sleep(_POLL_S)
    return False


#: the CUDA caching allocator's setting the workers get unless the user set one: expandable segments,
#: whose blocks grow in place instead of splitting fixed segments (torchtitan's run_train.sh sets it,
#: ``PYTORCH_ALLOC_CONF="expandable_segments:True"``). Without it, on one H100 (gpu_check, 2026-11-27) a
#: Llama-3-8B QLoRA step ran out of memory with 67.9 GiB allocated of 79.2: about 11 GiB lay in
#: reserved segments the allocator could not split for the request (NF4 dequantization temporaries of
#: many sizes), far beyond the 3 % fragmentation the memory model reserves (``hardware.FRAGMENTATION_FRACTION``).
ALLOC_CONF = "expandable_segments:True"
ALLOC_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the old name and torch >= 2.9's


def worker_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with ``ALLOC_CONF`` added when neither allocator variable is set (a user's own wins)."""
    env = dict(environ)
    if not any(env.get(v) for v in ALLOC_VARS):
        env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF
    return env


def run_tree(cmd: Sequence[str], *, grace_s: float = GRACE_S, env: Mapping[str, str] | None = None) -> int:
    """Run ``cmd`` supervised (see the module docstring); its exit code, or 128+signal if stopped by one."""
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    tmp = tempfile.mkdtemp(prefix="meshplan-run-")
    child_env = worker_env(os.environ if env is None else env)
    child_env[TAG_VAR] = tag
    child_env["TMPDIR"] = tmp
    fault_file = os.path.join(tmp, "faults.txt")  # runtime.loop.faults.report appends each fault's one line
    child_env[FAULT_FILE_VAR] = fault_file
    received: list[int] = []
    proc = subprocess.Popen(list(cmd), env=child_env, start_new_session=True)

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)
        _signal_all(proc.pid, tag, signum if len(received) == 1 else signal.SIGKILL)

    handled = (signal.SIGINT, signal.SIGTERM)
    old = {s: signal.signal(s, on_signal) for s in handled}
    try:
        while proc.poll() is None and not received:
            time.sleep(_POLL_S)
        if received:
            if not _wait_gone(proc, tag, time.monotonic() + grace_s, received):
                _signal_all(proc.pid, tag, signal.SIGKILL)
        elif tagged_pids(tag):  # the launcher exited and left workers behind: give them a moment
            _signal_all(proc.pid, tag, signal.SIGTERM)
            if not _wait_gone(proc, tag, time.monotonic() + min(grace_s, 5.0)):
                _signal_all(proc.pid, tag, signal.SIGKILL)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if proc.poll() is None:
            _signal_all(proc.pid, tag, signal.SIGKILL)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        _wait_gone(proc, tag, time.monotonic() + 5.0)
        said = _faults_said(fault_file)
        shutil.rmtree(tmp, ignore_errors=True)
    if received:
        return 128 + int(received[0])
    rc = int(proc.returncode)
    if said:  # after torchrun's own failure report: the run's last words are the explanation
        what = f"stopped: {said[-1]}" if rc else "recovered (--max-restarts) after: " + " | ".join(said)
        print(f"meshplan run: {what}", file=sys.stderr, flush=True)
    return rc


def _faults_said(path: str) -> list[str]:
    try:
        with open(path) as f:
            return [line.strip() for line in f if line.strip()]
    except OSError:
        return []
