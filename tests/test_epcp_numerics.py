"""Expert and context parallelism train like one device: per-step losses and final parameters (#17).

Composed with TP (attention and dense MLP sharded, MoE blocks replicated over tp) and with full
recomputation. MoE models route without a capacity limit (no token dropped on either side); fp32 everywhere.
Ring attention merges fp32 partial softmaxes, so losses agree with one device's SDPA to ~1e-6.
"""

from __future__ import annotations

import pytest
from dist_utils import run_ranks
from epcp_cases import check_rows as _check
from epcp_cases import worker

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


class TestTwoRanks:
    def test_ep_and_cp(self) -> None:
        cfgs = [dict(model="moe", dp=2, ep=2, m=2), dict(model="plain", dp=2, ep=2),
                dict(model="mixtral", dp=2, ep=2), dict(model="llama", cp=2), dict(model="moe", cp=2, ep=2),
                dict(model="llama", cp=2, recompute="full"),  # checkpointed blocks re-run the ring in backward
                dict(model="gpt", cp=2), dict(model="gpt", cp=2, recompute="full")]  # #30: no position_ids
        _check(run_ranks(worker, 2, cfgs, timeout_s=400), len(cfgs))


class TestFourRanks:
    def test_ep_dp_cp_and_tp(self) -> None:
        cfgs = [dict(model="moe", dp=4, ep=2), dict(model="plain", dp=4, ep=2), dict(model="llama", dp=2, cp=2),
                dict(model="moe", dp=2, cp=2, ep=4), dict(model="llama", cp=2, tp=2),
                dict(model="moe", cp=2, ep=2, tp=2, recompute="full")]
        _check(run_ranks(worker, 4, cfgs, timeout_s=500), len(cfgs))
