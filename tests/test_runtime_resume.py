"""Resume under another plan: a dp2 checkpoint after step 2 continues under tp2 and pp2 (DCP reshard); a
checkpoint of the 16-bit layout (fp32 masters, ``runtime.apply.master_state``) resumes exactly under its own
plan and loads its masters exactly under tp2 and under the torch layout."""

from __future__ import annotations

import pytest
import runtime_cases as rc
from dist_utils import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


#: the AdamW lr of ``runtime_cases.master_resume_worker`` and the steps run after the resume
MASTER_LR, RESUMED_STEPS = 1e-3, 2


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
        for r in res:  # state_layout "megatron", dp2 zero1: each rank saved the masters of its partition
            m = r["master"]
            assert 0 < m["masters_here"] < m["params"], m
            full = m["full"]
            # the same plan: bit for bit the uninterrupted run (masters, AdamW state, 16-bit weights, losses)
            assert m["same"]["losses"] == full[2:], m
            assert m["same"]["loaded"] == m["same"]["masters"] == m["same"]["weights"] == 0.0, m
            assert m["same"]["dtypes"] == ["torch.bfloat16"] and m["torch"]["dtypes"] == ["torch.float32"], m
            # tp2 (whole DTensor masters) and the torch layout (fp32 parameters) load the saved masters exactly;
            # their two steps then differ by their own numerics: TP's bf16 partial sums, autocast's fp32 weights.
            # Adam moves an element by at most lr per step (|m^/sqrt(v^)| <= 1.0014 over these steps): a gradient
            # of the other sign moves it by up to 2 lr a step
            bound = 2 * 1.0014 * MASTER_LR * RESUMED_STEPS
            for name in ("tp2", "torch"):
                assert m[name]["loaded"] == 0.0 and m[name]["masters"] <= bound, (name, m)
                assert m[name]["losses"] == pytest.approx(full[2:], abs=2e-3), (name, m)
            # the two layouts write the same keys, dtypes and sizes: either checkpoint resumes under the other
            assert m["same_layout"], m
