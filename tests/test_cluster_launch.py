"""Multi-node launch, Slurm script and elastic restart of `meshplan run` (torchrun, gloo, CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from cluster_cases import meshplan, prepare_tokens, write_plan
from dist_utils import free_port

from meshplan.cli import main

RUN = [sys.executable, "-m", "meshplan.cli", "run"]


def _plan(tmp_path: Path) -> Path:
    return write_plan(tmp_path / "plan.json", dp=2, micro_batch_size=2, seq_len=16)


def test_launch_sizes_must_match_the_plan(tmp_path, capsys) -> None:
    plan = _plan(tmp_path)
    assert main(["run", str(plan), "--model", "gpt-tiny", "--nnodes", "2", "--nproc-per-node", "2",
                 "--rdzv-endpoint", "127.0.0.1:29500", "--print-command"]) == 1
    err = capsys.readouterr().err
    assert "needs 2 ranks but --nnodes 2 x --nproc-per-node 2 = 4" in err and len(err.strip().splitlines()) == 1
    assert main(["run", str(plan), "--model", "gpt-tiny", "--nnodes", "2", "--print-command"]) == 1
    assert "needs --rdzv-endpoint" in capsys.readouterr().err
    assert main(["run", str(plan), "--model", "gpt-tiny", "--nnodes", "2", "--node-rank", "1",
                 "--rdzv-endpoint", "node001:29400", "--rdzv-id", "job7", "--max-restarts", "2", "--print-command"]) == 0
    cmd = capsys.readouterr().out
    for part in ("--nproc-per-node=1", "--nnodes=2", "--node-rank=1", "--rdzv-backend=c10d",
                 "--rdzv-endpoint=node001:29400", "--rdzv-id=job7", "--max-restarts=2"):
        assert part in cmd


def test_unreachable_endpoint_fails_within_the_timeout(tmp_path, capsys) -> None:
    plan = _plan(tmp_path)
    # 192.0.2.0/24 is TEST-NET-1 (RFC 5737): never routed, so the connection cannot succeed
    assert main(["run", str(plan), "--model", "gpt-tiny", "--nnodes", "2", "--rdzv-endpoint", "192.0.2.1:29500",
                 "--rdzv-timeout", "2"]) == 1
    assert "rendezvous endpoint 192.0.2.1:29500 not reachable within 2 s" in capsys.readouterr().err


def test_endpoint_wait_keeps_its_deadline(monkeypatch) -> None:
    """check_endpoint on a clock of its own (no wall-clock bound in the test): every connection try
    gets at most the time left, tries repeat every poll_s, and the error comes once the deadline passed."""
    from meshplan.runtime.launch import torchrun

    clock = [100.0]
    tries: list[float] = []

    def connect(_addr: tuple[str, int], timeout: float) -> None:
        tries.append(timeout)
        clock[0] += timeout  # an unrouted address: the try uses all of its timeout
        raise OSError("timed out")

    fake_time = types.SimpleNamespace(monotonic=lambda: clock[0], sleep=lambda s: clock.__setitem__(0, clock[0] + s))
    monkeypatch.setattr(torchrun, "time", fake_time)  # the module's clock only
    monkeypatch.setattr(torchrun.socket, "create_connection", connect)
    with pytest.raises(ValueError, match=r"192\.0\.2\.1:29500 not reachable within 5 s \(timed out\)"):
        torchrun.check_endpoint("192.0.2.1:29500", 5, poll_s=0.5)
    # 2 s tries with 0.5 s polls between; at the deadline one last 0.1 s try, then the error
    assert tries == [2.0, 2.0, 0.1] and clock[0] == pytest.approx(105.1)


def test_slurm_script(tmp_path, capsys, monkeypatch) -> None:
    plan = _plan(tmp_path)
    monkeypatch.chdir(tmp_path)
    job = tmp_path / "job.sh"
    assert main(["run", str(plan), "--model", "gpt-tiny", "--steps", "50", "--data", "tokens.bin",
                 "--slurm-script", str(job), "--nnodes", "2", "--partition", "gpu", "--time", "01:00:00",
                 "--gpus-per-node", "1", "--max-restarts", "1"]) == 0
    text = job.read_text()
    assert text in capsys.readouterr().out
    assert subprocess.run(["bash", "-n", str(job)]).returncode == 0
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=gpu",
                 "#SBATCH --time=01:00:00", "#SBATCH --gpus-per-node=1",
                 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'):
        assert line in text.splitlines()
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    for part in ("meshplan.cli run", "--steps 50", "--data tokens.bin", "--max-restarts 1", "--nnodes 2",
                 "--nproc-per-node 1", '--node-rank "$SLURM_NODEID"', '--rdzv-endpoint "$MESHPLAN_RDZV_ENDPOINT"'):
        assert part in srun, part
    assert "--slurm-script" not in srun and "--partition" not in srun
    bad = tmp_path / "bad.sh"
    assert main(["run", str(plan), "--model", "gpt-tiny", "--slurm-script", str(bad), "--nnodes", "3"]) == 1
    assert not bad.exists()  # a 2-rank plan cannot run on 3 nodes: no file


def _losses(record: Path) -> dict[int, float]:
    return {s["step"]: s["loss"] for s in json.loads(record.read_text())["steps"]}


@pytest.mark.distributed
@pytest.mark.slow
class TestClusterRuns:
    def test_two_nodes_and_a_restart_match_one_node(self, tmp_path) -> None:
        plan = _plan(tmp_path)
        tokens = prepare_tokens(tmp_path)
        common = [str(plan), "--model", "gpt-tiny", "--data", str(tokens), "--lr", "3e-3"]
        steps = 8
        # reference: one node, two ranks
        out = meshplan("run", *common, "--steps", str(steps), "--record", str(tmp_path / "one.json"))
        assert out.returncode == 0, out.stderr[-12000:]
        ref = _losses(tmp_path / "one.json")
        # two "nodes" on this machine: two launchers meeting at a c10d rendezvous
        port = free_port()
        nodes = [subprocess.Popen([*RUN, *common, "--steps", "4", "--nnodes", "2", "--nproc-per-node", "1",
                                   "--node-rank", str(r), "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "t2n",
                                   "--rdzv-timeout", "120", "--record", str(tmp_path / f"two{r}.json")],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
        outs = [n.communicate(timeout=240) for n in nodes]
        assert all(n.returncode == 0 for n in nodes), [o[1][-2000:] for o in outs]
        recs = [p for p in (tmp_path / "two0.json", tmp_path / "two1.json") if p.exists()]
        assert len(recs) == 1  # rank 0 (whichever node got it) writes the record
        two = _losses(recs[0])
        assert two == pytest.approx({s: ref[s] for s in range(1, 5)}, abs=1e-6)
        # a worker SIGKILLed mid-run: torchrun restarts both, they resume from the newest complete checkpoint
        ck = tmp_path / "ck"
        proc = subprocess.Popen([*RUN, *common, "--steps", str(steps), "--checkpoint-dir", str(ck),
                                 "--checkpoint-every", "1", "--max-restarts", "1",
                                 "--record", str(tmp_path / "restart.json")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 180
        while not (ck / "step-000003").is_dir() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        victims = _workers(str(ck))
        assert victims, "no worker found to kill"
        os.kill(victims[-1], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 0, stderr[-12000:]
        assert "after restart" in stdout
        after = _losses(tmp_path / "restart.json")
        assert min(after) > 1 and max(after) == steps  # the record is the resumed attempt's
        assert after[steps] == pytest.approx(ref[steps], abs=1e-6)


def _workers(marker: str) -> list[int]:
    """pids of meshplan.runtime.loop.train workers whose command line holds ``marker`` (started by this test)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"meshplan.runtime.loop.train" in cmd and marker.encode() in cmd:
            out.append(int(d.name))
    return sorted(out)
