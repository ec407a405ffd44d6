"""The reported PP comm is the p2p the busiest pipeline rank sends: its stages' outputs forward and
their input gradients backward. (It was the forward sends doubled, so a busiest last stage, which
only sends gradients, showed 0 ms: Megatron's GPT-3 175B at pp16.)"""

from __future__ import annotations

import pytest
from planner_fixtures import gpt_graph

from meshplan.cost_models.engine_profiles import MESHPLAN
from meshplan.planner.api import estimate_graph


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_pp_comm_counts_both_directions_of_the_busiest_rank(schedule: str, v: int) -> None:
    # a big head and its cross-entropy on an even split: the last stage is busiest (meshplan's own
    # split would give that stage no block at all)
    g = gpt_graph(layers=8, h=512, heads=8, seq=256, vocab=32000)
    plan = estimate_graph(g, 8, tp=1, pp=4, dp=2, schedule=schedule, virtual_stages=v, num_microbatches=8,
                          global_batch_size=16, cluster="h100", profile=MESHPLAN.but(split_rule="even"))  # fmt: skip
    st = sorted(plan.stages, key=lambda s: s.index)
    work = {r: sum(s.fwd_s + s.bwd_s for s in st if s.rank == r) for r in range(4)}
    busiest = max(work, key=work.get)
    mine = [s.index for s in st if s.rank == busiest]
    n = len(st)
    want = plan.num_microbatches * sum((st[i].send_s if i < n - 1 else 0) + (st[i - 1].send_s if i else 0)
                                       for i in mine)  # fmt: skip
    assert want > 0
    assert plan.predicted.pp_comm_s == pytest.approx(want, rel=1e-9)
    sent = sum((st[i].send_bytes if i < n - 1 else 0) + (st[i - 1].send_bytes if i else 0) for i in mine)
    assert plan.predicted.comm_bytes["send_recv"] == plan.num_microbatches * sent
    if v == 1:
        assert busiest == 3 and st[3].send_s == 0  # the head's stage sends only gradients
