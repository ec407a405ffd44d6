"""A checkpoint that cannot be written completely (the disk fills: ENOSPC) on 2 gloo ranks: every
rank gets the same one-line CheckpointError saying how much space it needed, the partial directory
is gone, and the previous checkpoint is still the newest complete one and loads."""

from __future__ import annotations

import errno

import pytest
import runtime_cases as rc
from dist_utils import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def full_disk_worker(rank: int, world: int, ckpt_dir: str) -> dict:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from meshplan.runtime.apply import handplan
    from meshplan.runtime.apply.api import apply_plan
    from meshplan.runtime.checkpoint import dcp as checkpoint
    from meshplan.runtime.weights.files import CheckpointError

    data = rc.batches(3)
    model = rc.tiny_gpt()
    plan = handplan.manual_plan(model, None, dp=2, microbatches=1, micro_batch_size=4, seq_len=rc.SEQ)
    pm = apply_plan(model, plan, loss_fn=rc.loss_fn, optimizer_factory=rc.opt_factory)
    pm.step(*data[0])
    checkpoint.save(pm, ckpt_dir, 1)
    pm.step(*data[1])
    real = FileSystemWriter.write_data

    def fill_the_disk(self, plan, planner):  # type: ignore[no-untyped-def]
        if rank == 1:  # one rank's disk fills part-way through its shard
            with open(f"{self.path}/__1_0.distcp", "wb") as f:
                f.write(b"\0" * 1000)
            raise OSError(errno.ENOSPC, "No space left on device", f"{self.path}/__1_0.distcp")
        return real(self, plan, planner)

    FileSystemWriter.write_data = fill_the_disk  # type: ignore[method-assign]
    try:
        checkpoint.save(pm, ckpt_dir, 2)
        message = None
    except CheckpointError as e:
        message = str(e)
    finally:
        FileSystemWriter.write_data = real  # type: ignore[method-assign]
    newest = checkpoint.newest_complete(ckpt_dir)
    step = checkpoint.load(pm, newest) if newest is not None else None
    return {"message": message, "newest": str(newest), "loaded_step": step, "loss": pm.step(*data[1])}


class TestFullDisk:
    def test_enospc_keeps_the_previous_checkpoint(self, tmp_path) -> None:
        ck = tmp_path / "ck"
        res = run_ranks(full_disk_worker, 2, str(ck))
        msg = res[0]["message"]
        assert msg is not None and res[1]["message"] == msg
        assert msg.startswith(f"checkpoint step-000002 not written: no space left on the device of {ck}")
        assert "it needs about" in msg and "the size of step-000001" in msg and "free now" in msg
        assert f"the previous checkpoint {ck / 'step-000001'} is intact" in msg and "--resume" in msg
        assert [p.name for p in ck.iterdir() if p.is_dir()] == ["step-000001"]  # the partial .tmp- is gone
        assert all(r["newest"] == str(ck / "step-000001") and r["loaded_step"] == 1 for r in res)
        assert res[0]["loss"] == pytest.approx(res[1]["loss"])
