"""Every collective meshplan's runtime issues hands torch.distributed tensors on the group's device.

A real H200 run crashed at its end: the peak-memory ``all_gather`` of CPU tensors on the NCCL group.
Two 2-rank ``meshplan.runtime.loop.train`` runs under ``collective_guard`` (which makes "placed on the
group's device" visible on a CPU machine, see there) cover the runtime's own collectives: a pp2 run
with tied weights split across stages, gradient clipping, a token file with held-out evaluation and
checkpoints every step; an FSDP dp2 run on a per-step hook (checked across ranks every step) with
profiled phases. Without ``meshplan.runtime.launch.collectives`` (the code before it) the guard reports,
among others, ``meshplan.runtime.record.run_record calls torch.distributed.all_gather directly``.
"""

from __future__ import annotations

import pytest
from cluster_cases import prepare_tokens, write_plan
from dist_utils import free_port, run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_runtime_collectives_use_the_group_device(tmp_path) -> None:
    from meshplan.runtime.apply.handplan import manual_plan

    tokens = prepare_tokens(tmp_path)
    pp2 = write_plan(tmp_path / "pp2.json", pp=2, microbatches=2, micro_batch_size=2, seq_len=16)
    from meshplan.models import load_model

    spec = load_model("gpt-tiny", batch_size=2, seq_len=16)
    manual_plan(spec.model, None, model_name="gpt-tiny", dp=2, dp_kind="fsdp", microbatches=1, micro_batch_size=2,
                seq_len=16, step_s=0.05).save(tmp_path / "fsdp.json")
    common = ["--model", "gpt-tiny", "--steps", "2", "--log-every", "0"]
    runs = [
        ["--plan", str(pp2), *common, "--data", str(tokens), "--eval-every", "2", "--eval-batches", "1",
         "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "1", "--profile-steps", "0",
         "--record", str(tmp_path / "pp2_record.json")],
        ["--plan", str(tmp_path / "fsdp.json"), *common, "--data", "collective_guard:tokens_hook",
         "--profile-steps", "1", "--record", str(tmp_path / "fsdp_record.json")],
    ]
    res = run_ranks(__import__("collective_guard").run_worker, 2, runs, [0, free_port()], timeout_s=300)
    for r in res:
        assert r["codes"] == [0, 0]
        assert r["violations"] == []
        # the guard saw the runtime's own collectives (not a test that cannot fail)
        for name in ("all_gather", "all_reduce", "barrier", "all_gather_object"):
            assert f"torch.distributed.{name}" in r["seen"], r["seen"]
    assert (tmp_path / "pp2_record.json").is_file() and (tmp_path / "fsdp_record.json").is_file()
