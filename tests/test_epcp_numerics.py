"""Expert and context parallelism train like one device: per-step losses and final parameters (#17).

Composed with TP (attention and dense MLP sharded, MoE blocks replicated over tp) and with full
recomputation. MoE models route without a capacity limit (no token dropped on either side); fp32 everywhere.
Ring attention merges fp32 partial softmaxes, so losses agree with one device's SDPA to ~1e-6.
The sharding DP kinds under cp shard over dp x cp (#33: FSDP2 on the flattened dp_cp mesh, zero1's
ZeroRedundancyOptimizer over the dp x cp group): each rank holds 1/(dp x cp) of the parameters
(hsdp: 1/shard), and a DCP checkpoint of it loads under the same plan and under DDP.
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
                dict(model="gpt", cp=2), dict(model="gpt", cp=2, recompute="full"),  # #30: no position_ids
                dict(model="llama", cp=2, kind="fsdp", ckpt=True), dict(model="gpt", cp=2, kind="zero1"),
                dict(model="gpt", cp=2, kind="zero2", m=2)]  # sharded over dp x cp at dp 1 (#33)
        _check(run_ranks(worker, 2, cfgs, timeout_s=400), len(cfgs))


class TestFourRanks:
    def test_ep_dp_cp_and_tp(self) -> None:
        cfgs = [dict(model="moe", dp=4, ep=2), dict(model="plain", dp=4, ep=2), dict(model="llama", dp=2, cp=2),
                dict(model="moe", dp=2, cp=2, ep=4), dict(model="llama", cp=2, tp=2),
                dict(model="moe", cp=2, ep=2, tp=2, recompute="full"),
                dict(model="llama", dp=2, cp=2, kind="fsdp", m=2),  # 1/4 of the states per rank (#33)
                dict(model="llama", dp=2, cp=2, kind="hsdp", node=2, ckpt=True)]  # (replicate 2, shard 2)
        _check(run_ranks(worker, 4, cfgs, timeout_s=500), len(cfgs))
