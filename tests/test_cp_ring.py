"""The context-parallel ring as run and as costed (#17, #33): one fused attention kernel per ring
step, the ring one autograd Function, grouped-query key/value heads exchanged un-repeated, each
shift overlapped with a kernel call, selective recompute under cp.

* The ring alone equals SDPA (``enable_gqa``) on the whole sequence, output and q/k/v gradients,
  causal and not; its events show every shift posted before the kernel it overlaps and waited
  after it, forward and backward (the backward re-sends key/value and sends each block's fp32
  dK/dV accumulator with it, the last one waited after the loop).
* Whole plans (the zoo Llama, 4 query / 2 key-value heads) train like one device for 3 steps under
  recompute none / selective / full / op at cp2, cp4, cp2 x dp2 and cp2 x tp2, and the bytes the
  ring sent over the steps (counted at its ``isend`` call sites) equal ``STEPS ×`` the cost model's
  ``epcp_terms(...).comm_bytes["send_recv"]`` per step for that configuration.
"""

from __future__ import annotations

import pytest
from cp_ring_cases import costed_bytes as _costed_bytes
from dist_utils import run_ranks
from epcp_cases import STEPS

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ATOL = 1e-5  # fp32 ring merge vs one device's SDPA (losses and parameters after 3 SGD steps, lr 0.5)


def _check_plans(rows: list, cfgs: list[dict]) -> None:
    assert [r[0] for r in rows] == cfgs
    for cfg, loss_err, param_err, sent, notes in rows:
        assert loss_err <= ATOL, f"{cfg}: loss differs by {loss_err}"
        assert param_err <= ATOL, f"{cfg}: a parameter differs by {param_err}"
        assert sent == STEPS * _costed_bytes(cfg), (cfg, sent)
        cp_note = next(s for s in notes if s.startswith("context parallelism"))
        assert "un-repeated" in cp_note and "overlapped" in cp_note
        assert ("checkpointed" in cp_note) == (cfg["recompute"] == "selective"), cp_note


class TestTwoRanks:
    def test_ring_attention_and_plans(self) -> None:
        cfgs = [dict(cp=2, recompute=rc) for rc in ("none", "selective", "full", "op")]
        results = run_ranks(_worker(), 2, cfgs, timeout_s=500)
        for attn, plans in results:
            for causal, errs, events, sends, nbytes in attn:
                assert max(errs) <= ATOL, (causal, errs)
                # forward: the shift posted before the own kernel, waited after it; backward: key/value
                # shifted again over step 0's kernel, step 0's accumulator over step 1's, the last
                # accumulator (this rank's own block's gradient) waited after the loop
                assert events == ["post kv", "block 0", "wait kv", "block 1",
                                  "post kv", "block bw 0", "post dkv", "wait kv",
                                  "block bw 1", "wait dkv", "post dkv", "wait dkv"], events
                # [k;v] of 2 kv heads in float64 forward and backward, two float64 accumulators of its size
                assert sends == 4 and nbytes == 4 * (2 * 2 * 2 * 8 * 8 * 8)
            _check_plans(plans, cfgs)
        # the replayed forward under recomputation sends its shifts again: at cp2 in fp32 the plain
        # ring sends 4 blocks' bytes per call (key/value each way, two accumulators), recomputed 5
        sent = {r[0]["recompute"]: r[3] for r in results[0][1]}
        assert sent["selective"] == sent["full"] == sent["op"] == 5 * sent["none"] // 4


class TestFourRanks:
    def test_ring_attention_and_plans(self) -> None:
        cfgs = [dict(cp=4, recompute="none"), dict(cp=2, dp=2, m=2, recompute="selective"),
                dict(cp=2, tp=2, recompute="selective")]
        for attn, plans in run_ranks(_worker(), 4, cfgs, timeout_s=600):
            for causal, errs, events, sends, _ in attn:
                assert max(errs) <= ATOL, (causal, errs)
                assert events[:6] == ["post kv", "block 0", "wait kv", "post kv", "block 1", "wait kv"], events
                assert events[-5:] == ["wait kv", "block bw 3", "wait dkv", "post dkv", "wait dkv"], events
                assert sends == 3 + 3 + 4  # key/value forward and backward, cp accumulators
            _check_plans(plans, cfgs)


def _worker():  # imported lazily: the workers import torch.distributed only in the spawned ranks
    from cp_ring_cases import both_worker

    return both_worker
