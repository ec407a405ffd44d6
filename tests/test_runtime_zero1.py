"""ZeRO-1 (ZeroRedundancyOptimizer) checkpoints: a resumed zero1 run gives the losses of an
uninterrupted one, and the sharded optimizer state loads under ddp, another world size, and back."""

from __future__ import annotations

import pytest
import zero_cases as zc
from dist_utils import free_port, run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


class TestZero1Checkpoint:
    def test_resume_equals_uninterrupted(self, tmp_path) -> None:
        res = run_ranks(zc.checkpoint_worker, 2, str(tmp_path), free_port())  # one spawn, the 1-rank resume in it
        r = res[0]
        assert r["zero1_optimizer"] == "ZeroRedundancyOptimizer" and r["ddp_optimizer"] == "AdamW"
        assert r["zero1"] == pytest.approx(r["ddp"], abs=1e-6)  # zero1 is ddp with sharded state
        for key in ("zero1->zero1", "zero1->ddp", "ddp->zero1"):
            assert r[key] == pytest.approx(r["zero1"][2:], abs=1e-6), key
        assert res[1]["zero1->zero1"] == r["zero1->zero1"]
        assert r["one"] == pytest.approx(r["zero1"][2:], abs=1e-5)  # resumed on ONE rank (world size 1)


class TestZero1TP:
    def test_zero1_with_tp_equals_ddp_and_checkpoints(self, tmp_path) -> None:
        res = run_ranks(zc.tp_worker, 4, str(tmp_path), timeout_s=400)
        for r in res:
            assert r["zero1_optimizer"] == "TPZero", r["zero1_optimizer"]
            assert any("ZeroRedundancyOptimizer" in n for n in r["zero1_notes"]), r["zero1_notes"]
            assert r["zero1"] == pytest.approx(r["ddp"], abs=1e-6)
            assert r["param_err"] <= 1e-6, r["param_err"]
            assert r["->zero12x2"] == pytest.approx(r["zero1"][2:], abs=1e-6)
            assert r["->ddp4x1"] == pytest.approx(r["zero1"][2:], abs=1e-5)
