"""Atomic DCP checkpoints at 2 ranks: pruning, manifest, checksum, model-fingerprint and optimizer-state refusals, no NaN
saved; a NaN loss or (with check_grads) an inf gradient on one rank applies no update on any rank;
a data-hook batch that differs between ranks is refused on every rank."""

from __future__ import annotations

import pytest
import runtime_cases as rc
from dist_utils import run_ranks

pytestmark = [pytest.mark.distributed]


class TestCheckpoint:
    def test_atomic_pruned_verified_and_refusing(self, tmp_path) -> None:
        res = run_ranks(rc.checkpoint_worker, 2, str(tmp_path / "ck"))
        for r in res:
            assert r["dirs"] == ["latest", "step-000002", "step-000003"]  # keep=2, no temp dir left
            assert r["newest"] == "step-000003" and r["loaded_step"] == 3
            assert r["extra"] == {"data_pos": 30}
            assert {"files", "model_fingerprint", "plan", "step"} <= set(r["manifest_keys"])
            assert r["other_model"].startswith("CheckpointError") and "different model" in r["other_model"]
            assert "wte.weight" in r["other_model"] or "lm_head" in r["other_model"], r["other_model"]
            assert r["other_optimizer"].startswith("CheckpointError") and "momentum_buffer" in r["other_optimizer"]
            assert "none (plain SGD)" in r["other_optimizer"] and "--momentum" in r["other_optimizer"]
            assert r["zeroed"].startswith("CheckpointError") and "checksum mismatch" in r["zeroed"], r["zeroed"]
            assert r["nan"].startswith("NonFiniteError") and "step 4" in r["nan"], r["nan"]
            assert r["dirs_after_nan"] == r["dirs"]
            # a NaN loss / an inf gradient (rank 1 only, with check_grads) applies no update, on every rank
            assert r["nan_loss"] != r["nan_loss"] and r["unchanged_after_nan"]
            assert r["inf_grad_loss"] == r["inf_grad_loss"] and r["after_bad_loss"] == r["after_bad_loss"]
            assert r["skipped"] == [2, 3]
            assert "rank 1 got a different batch than rank 0" in r["batch_differs"], r["batch_differs"]
