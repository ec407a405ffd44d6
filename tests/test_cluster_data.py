"""Per-rank data under torchrun/gloo: each rank's own reads train like the global batch, and a tiny
GPT learns from text prepared by `meshplan prepare-data`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import runtime_cases as rc
from cluster_cases import local_vs_global_worker, meshplan, prepare_tokens, write_plan
from dist_utils import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


class TestPerRankData:
    def test_own_reads_equal_the_global_batch(self, tmp_path) -> None:
        f = tmp_path / "tokens.bin"
        (np.arange(5000) * 11 % rc.VOCAB).astype(np.uint16).tofile(f)
        res = run_ranks(local_vs_global_worker, 2, str(f))
        for r in res:
            for name in ("dp2", "pp2"):
                assert r[name]["local"] == pytest.approx(r[name]["global"], abs=1e-6), name
        # dp2: each replica reads its half (4 of 8 sequences), inputs and targets
        assert res[0]["dp2_reads"][0] == (True, True, (4, rc.SEQ))
        # pp2: the first stage reads only inputs (the whole batch of its replica), the last only targets
        assert res[0]["pp2_reads"][0] == (True, False, (8, rc.SEQ))
        assert res[1]["pp2_reads"][0] == (False, True, None)

    def test_tiny_gpt_learns_prepared_text_on_two_ranks(self, tmp_path) -> None:
        tokens = prepare_tokens(tmp_path)
        plan = write_plan(tmp_path / "plan.json", dp=2, micro_batch_size=4, seq_len=32)
        out = meshplan("run", str(plan), "--model", "gpt-tiny", "--steps", "60", "--data", str(tokens),
                       "--eval-every", "30", "--lr", "3e-3", "--record", str(tmp_path / "rec.json"))
        assert out.returncode == 0, out.stderr[-3000:]
        rec = json.loads((tmp_path / "rec.json").read_text())
        losses = [s["loss"] for s in rec["steps"]]
        assert len(losses) == 60
        # gpt-tiny starts near ln(128) = 4.85; byte-level English is learnable to below 3.3 in 60 steps
        assert losses[0] > 4.5
        assert np.mean(losses[-5:]) < losses[0] - 1.5, losses[-5:]
        assert [s for s, _ in rec["eval_losses"]] == [30, 60]
        assert rec["eval_losses"][-1][1] < losses[0] - 1.5
        assert "validation loss" in out.stdout
        progress = [line for line in out.stdout.splitlines() if "tokens/s" in line]
        assert [line.split()[1] for line in progress] == ["10/60", "20/60", "30/60", "40/60", "50/60", "60/60"]
        assert rec["tokens_per_s"] > 0 and rec["tokens_per_step"] == 8 * 32
        # per-phase times from one extra profiled step (runtime.record.phases), the largest mismatch on the end line
        assert rec["phases"]["how"]["profiled_steps"] == 1
        assert rec["phases"]["forward"]["measured_s"] > 0 and rec["phases"]["backward"]["measured_s"] > 0
        assert rec["phases"]["other"]["predicted_s"] == pytest.approx(0.05)  # a hand plan: no stage times
        assert "largest phase mismatch: " in out.stdout.strip().splitlines()[-1]
        assert "profiler_start" not in out.stderr
