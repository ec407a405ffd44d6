"""Resume under another plan: a dp2 checkpoint after step 2 continues under tp2 and pp2 (DCP reshard)."""

from __future__ import annotations

import pytest
import runtime_cases as rc
from dist_utils import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


class TestResume:
    def test_dp2_checkpoint_resumes_under_tp2_and_pp2(self, tmp_path) -> None:
        res = run_ranks(rc.resume_worker, 2, str(tmp_path / "ck"))
        assert (tmp_path / "ck" / "latest").read_text().strip() == "step-000002"
        for r in res:
            full = r["dp2"]
            assert len(full) == 4
            assert r["tp2"] == pytest.approx(full[2:], abs=1e-5)
            assert r["pp2"] == pytest.approx(full[2:], abs=1e-5)
        ref_losses, _ = rc.reference(rc.tiny_gpt(), rc.batches(4))
        assert res[0]["dp2"] == pytest.approx(ref_losses, abs=1e-5)
