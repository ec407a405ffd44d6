"""Faults without processes: the hang verdict from published progress, straggler figures, the
out-of-memory message and its re-plan limit, a token file changing under a reader, a full disk's message."""

from __future__ import annotations

import errno
import json

import numpy as np
import pytest

from meshplan.runtime.checkpoint import space
from meshplan.runtime.loop.faults import DataChangedError, OomFacts, replan_limit_bytes, requested_bytes
from meshplan.runtime.loop.watchdog import FAULT_EXIT, Watchdog, default_timeout_s, ranks_text
from meshplan.runtime.weights import files as cf
from meshplan.stragglers import find_stragglers, spread_text
from meshplan.tokenfile import FileIdentity, file_change


class DictStore:
    """The part of a torch Store the watchdog uses."""

    def __init__(self) -> None:
        self.d: dict[str, bytes] = {}

    def set(self, k: str, v: str) -> None:
        self.d[k] = v.encode()

    def get(self, k: str) -> bytes:
        return self.d[k]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.d[k] for k in keys]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.d for k in keys)

    def add(self, k: str, n: int) -> int:
        self.d[k] = str(int(self.d.get(k, b"0")) + n).encode()
        return int(self.d[k])


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _ranks(n: int, timeout: float = 10.0):
    store, clock, exits, said = DictStore(), Clock(), [], []
    wds = [Watchdog(store, rank=r, world_size=n, hang_timeout_s=timeout, clock=clock, exit_fn=exits.append,
                    report=said.append, checkpoint_hint=lambda: "newest complete checkpoint ck/step-000002 kept; ")
           for r in range(n)]
    return store, clock, exits, said, wds


def test_hang_names_the_rank_behind_and_stops_every_rank() -> None:
    store, clock, exits, said, wds = _ranks(3)
    for step in (1, 2):  # two good steps
        for w in wds:
            w.at("data", step), w.at("forward"), w.at("gradient/loss all-reduce"), w.finished_step(step)
            w.poll_once()
        clock.t += 1
    wds[0].at("data", 3), wds[0].at("forward"), wds[0].at("gradient/loss all-reduce")
    wds[2].at("data", 3), wds[2].at("forward"), wds[2].at("gradient/loss all-reduce")
    wds[1].at("data", 3), wds[1].at("forward")  # rank 1 sleeps in its forward
    for w in wds[::-1]:
        w.poll_once()  # rank 0 sees every rank's last progress now
    clock.t += 9.5
    wds[0].poll_once()
    assert exits == []  # 9.5 s < 10 s
    clock.t += 1.0
    wds[0].poll_once()
    assert exits == [FAULT_EXIT["hang"]] and len(said) == 1
    msg = said[0]
    assert "no rank advanced for 10 s (--hang-timeout 10 s)" in msg
    assert "rank 1" in msg and "stopped at step 3 in forward" in msg
    assert "waiting: ranks 0, 2 at step 3 in gradient/loss all-reduce" in msg
    assert "ck/step-000002 kept" in msg and "--max-restarts" in msg
    for w in wds[1:]:  # the others see the posted fault and end their processes
        w.poll_once()
    assert exits == [FAULT_EXIT["hang"]] * 3
    assert json.loads(store.get("fault"))["rank"] == 0
    assert json.loads(store.get("fault"))["kind"] == "hang"


def test_last_rank_watches_too_when_rank_0_is_stuck() -> None:
    _, clock, exits, said, wds = _ranks(2)
    for w in wds:  # the last rank sees rank 0's progress now
        w.finished_step(1), w.at("forward", 2)
        w.poll_once()
    clock.t += 11  # rank 0's thread would speak now, but it cannot run
    wds[1].poll_once()
    assert exits == []
    clock.t += 5  # 1.5 x 10 s
    wds[1].poll_once()
    assert exits == [FAULT_EXIT["hang"]] and "no rank advanced for 16 s" in said[0]


def test_first_step_and_checkpoints_get_longer() -> None:
    _, clock, exits, _, wds = _ranks(2)
    for w in wds[::-1]:
        w.at("forward", 1)
        w.poll_once()
    clock.t += 25  # < 3 x 10 s while no rank finished a step
    wds[0].poll_once()
    assert exits == []
    for w in wds[::-1]:
        w.finished_step(1), w.at("checkpoint")
        w.poll_once()
    clock.t += 25  # < 3 x 10 s while a rank writes a checkpoint
    wds[0].poll_once()
    assert exits == []
    for w in wds[::-1]:
        w.at("data", 2)
        w.poll_once()
    clock.t += 10
    wds[0].poll_once()
    assert exits == [FAULT_EXIT["hang"]]


def test_a_rank_that_never_reports_is_named_and_timeout_default() -> None:
    _, clock, exits, said, wds = _ranks(2)
    wds[0].at("forward", 1)
    wds[0].poll_once()
    clock.t += 31
    wds[0].poll_once()
    assert exits and "rank 1 never reported progress" in said[0]
    assert default_timeout_s(0.05) == 180.0 and default_timeout_s(30.0) == 600.0
    assert ranks_text([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8"
    with pytest.raises(ValueError, match="--hang-timeout must be >= 0"):
        Watchdog(None, rank=0, world_size=1, hang_timeout_s=-1)


def test_own_fault_is_left_to_the_main_thread_and_first_poster_wins() -> None:
    _, _, exits, _, wds = _ranks(2)
    assert wds[1].post("oom", "out of GPU memory on rank 1") is True
    assert wds[0].post("data", "later") is False
    wds[1].poll_once()
    assert exits == []  # rank 1's main thread reports and exits itself
    wds[0].poll_once()
    assert exits == [FAULT_EXIT["oom"]]


def test_straggler_named_with_the_time_others_lost() -> None:
    fast, slow = [0.1] * 11, [0.13] * 11
    waits_fast, waits_slow = [0.035] * 11, [0.005] * 11
    found = find_stragglers([fast, slow, fast, fast], [waits_fast, waits_slow, waits_fast, waits_fast])
    assert [s.rank for s in found] == [1]
    s = found[0]
    assert s.slower == pytest.approx(0.30) and s.steps == 10
    assert s.lost_s == pytest.approx(0.3) and s.lost_total_s == pytest.approx(0.9)
    assert "rank 1 median step 130.0 ms vs 100.0 ms on the other ranks (+30%" in s.text()
    assert find_stragglers([fast, [0.112] * 11]) == []  # 12 % is within the spread
    lines = spread_text([fast, slow], [waits_fast, waits_slow])
    assert "max 130.0 ms (rank 1) (max +30% over min)" in lines[0] and lines[-1].startswith("straggler: rank 1")


def test_oom_message_and_replan_limit() -> None:
    assert requested_bytes("Tried to allocate 20.00 MiB. GPU 0") == 20 * 2**20
    assert replan_limit_bytes(80, 40, 80) == 40  # needed twice the prediction: plan for half
    assert replan_limit_bytes(80, 40, 30) == 72  # prediction was not low: 10 % room
    f = OomFacts(rank=1, step=3, phase="forward", measured_peak_bytes=70 * 2**30, requested_bytes=2 * 2**30,
                 predicted_peak_bytes=48 * 2**30, limit_bytes=72 * 2**30, memory_kind="CUDA max allocated",
                 model="llama3-8b", world_size=64)
    m = f.message()
    assert m.startswith("out of GPU memory on rank 1 at step 3 in forward: measured peak 70.00 GiB")
    assert "48.00 GiB predicted" in m and "--memory-limit 48.00GiB" in m and "meshplan plan llama3-8b -n 64" in m


def test_token_file_changes_are_named(tmp_path) -> None:
    from meshplan.runtime.loop.data import Share, TokenStream

    path = tmp_path / "tokens.bin"
    np.arange(4000, dtype=np.uint16).tofile(path)
    before = FileIdentity.of(path)
    assert file_change(before, path) is None
    s = TokenStream(path, seq_len=8, seed=0, global_batch=4, share=Share(0, 1))
    s.next_batch()
    np.arange(2000, dtype=np.uint16).tofile(path)  # truncated in place
    assert "shrank from 8,000 to 4,000 bytes" in file_change(before, path)
    with pytest.raises(DataChangedError, match=r"changed under the running job before step 2: it shrank"):
        s.next_batch()
    other = tmp_path / "new.bin"
    np.arange(4000, dtype=np.uint16)[::-1].copy().tofile(other)
    other.replace(path)  # replaced by another file of the same size
    what = file_change(before, path)
    assert "new inode" in what and "changed (sha256)" in what
    s2 = TokenStream(path, seq_len=8, seed=0, global_batch=4, share=Share(0, 1))
    with pytest.raises(ValueError, match="not the token file this checkpoint was trained on"):
        s2.load_state_dict({**s.state_dict(), "samples_seen": 4})


def test_full_disk_message_says_what_was_needed(tmp_path) -> None:
    ck = tmp_path / "ck"
    done = ck / cf.step_name(2)
    done.mkdir(parents=True)
    (done / "x.distcp").write_bytes(b"0" * 3000)
    cf.write_manifest(done, {"step": 2, "files": cf.hash_files(done, ["x.distcp"])})
    full = OSError(errno.ENOSPC, "No space left on device", str(ck / ".tmp-step-000004" / "y.distcp"))
    wrapped = RuntimeError("write failed")
    wrapped.__cause__ = full
    assert space.is_no_space(wrapped)
    msg = space.failure_message(ck, cf.step_name(4), wrapped, 10_000)
    assert "checkpoint step-000004 not written: no space left on the device of" in msg
    assert "it needs about 0.0 MiB, the size of step-000002" in msg or "the size of step-000002" in msg
    assert f"the previous checkpoint {done} is intact" in msg and "--resume" in msg
    other = space.failure_message(ck, cf.step_name(4), PermissionError(errno.EACCES, "Permission denied", "f"), 0)
    assert "Permission denied (f)" in other


def test_flags_reach_the_workers_and_sizes_parse(tmp_path, capsys) -> None:
    import argparse
    import dataclasses

    from meshplan.cli import main
    from meshplan.commands.argtypes import byte_size
    from meshplan.models import load_model
    from meshplan.plan import Plan
    from meshplan.runtime.apply import handplan
    from meshplan.runtime.loop.faults import pg_timeout_s

    spec = load_model("mlp", batch_size=4)
    handplan.manual_plan(spec.model, None, model_name="mlp", micro_batch_size=4).save(tmp_path / "plan.json")
    assert main(["run", str(tmp_path / "plan.json"), "--model", "mlp", "--hang-timeout", "30", "--print-command"]) == 0
    assert "--hang-timeout 30.0" in capsys.readouterr().out
    plan = str(tmp_path / "plan.json")
    assert main(["run", plan, "--model", "mlp", "--optimizer", "sgd", "--momentum", "0", "--print-command"]) == 0
    out = capsys.readouterr().out
    assert "--optimizer sgd" in out and "--momentum 0.0" in out  # plain SGD reaches the workers
    assert main(["run", plan, "--model", "mlp", "--momentum", "0.5", "--print-command"]) == 1  # the plan's adam
    assert "--momentum is SGD's; --optimizer adam (the plan's)" in capsys.readouterr().err
    # the plan's optimizer runs by default (#28); another one with other state is said in one line
    assert main(["run", plan, "--model", "mlp", "--print-command"]) == 0
    out, err = capsys.readouterr()
    assert "--optimizer adam " in out and "--momentum" not in out and not err
    assert main(["run", plan, "--model", "mlp", "--optimizer", "adamw", "--print-command"]) == 0
    assert not capsys.readouterr().err  # adamw costs as adam does
    sgd_plan = str(tmp_path / "sgd.json")
    dataclasses.replace(Plan.load(plan), optimizer="sgd").save(sgd_plan)
    assert main(["run", sgd_plan, "--model", "mlp", "--print-command"]) == 0
    out, err = capsys.readouterr()
    assert "--optimizer sgd" in out and "--momentum 0.0" in out and not err  # plain SGD, as planned
    assert main(["run", sgd_plan, "--model", "mlp", "--optimizer", "adam", "--print-command"]) == 0
    out, err = capsys.readouterr()
    assert "--optimizer adam " in out and err.count("\n") == 1
    assert "predictions (memory, step time) are for sgd, this run uses adam" in err
    assert main(["run", sgd_plan, "--model", "mlp", "--momentum", "0.9", "--print-command"]) == 0
    assert "are for sgd, this run uses sgd-momentum" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", plan, "--model", "mlp", "--optimizer", "sgd", "--momentum", "1"])
    assert "must be < 1" in capsys.readouterr().err
    assert pg_timeout_s(120, 300) == 360 and pg_timeout_s(120, 0) == 120 and pg_timeout_s(900, 30) == 900
    assert byte_size("60GiB") == 60 * 2**30 and byte_size("80GB") == 80 * 10**9 and byte_size("1024") == 1024
    with pytest.raises(argparse.ArgumentTypeError, match="is not a size"):
        byte_size("lots")


def test_explain_maps_each_fault_to_its_kind() -> None:
    from types import SimpleNamespace

    from meshplan.runtime.loop.faults import explain
    from meshplan.runtime.weights.files import CheckpointError

    plan = SimpleNamespace(predicted=SimpleNamespace(peak_mem_bytes=[2**30, 2**30]), world_size=4,
                           cluster={"mem_bytes": 8 * 2**30, "mem_reserved_bytes": 0})
    kw = dict(rank=3, step=7, plan=plan, pp_rank=1, model="gpt-tiny")
    kind, msg = explain(MemoryError(), phase="backward", **kw)
    assert kind == "oom" and msg.startswith("out of host memory on rank 3 at step 7 in backward")
    assert "1.00 GiB predicted" in msg and "plan made for 8.00 GiB" in msg and "-n 4 --memory-limit" in msg
    assert explain(DataChangedError("--data t.bin changed"), phase="data", **kw) == ("data", "rank 3: --data t.bin changed")
    assert explain(CheckpointError("checkpoint step-000007 not written: ..."), phase="checkpoint", **kw) == (
        "disk", "step 7: checkpoint step-000007 not written: ...")
    assert explain(CheckpointError("damaged"), phase="forward", **kw) is None
    assert explain(RuntimeError("NCCL error"), phase="backward", **kw) is None


def test_report_shows_the_rank_spread_as_text_and_html() -> None:
    from meshplan.report.run_html import render_run_html
    from meshplan.report.run_view import format_run, run_view

    d = {"steps": [{"step": i, "step_s": 0.14, "loss": 1.0, "peak_mem_bytes": 0} for i in range(1, 7)],
         "rank_step_s": [[0.1] * 6, [0.13] * 6], "rank_wait_s": [[0.035] * 6, [0.005] * 6], "world_size": 2}
    v = run_view(d)
    text = format_run(v)
    assert "per-rank step time (own work" in text and "rank 1: 130.0 ms own, 5.0 ms waiting" in text
    assert "straggler: rank 1 median step 130.0 ms vs 100.0 ms on the other rank (+30%" in text
    page = render_run_html(v)
    assert "Step time per rank" in page and "straggler: rank 1" in page
    with pytest.raises(ValueError, match="rank_step_s"):
        run_view({**d, "rank_step_s": [0.1, 0.2]})
