"""tp > 1 with pp > 1 on a torch.export capture (every HF transformers model): searched and run
(``runtime/apply/tp_export.py``), except with sequence parallelism, which one rule,
``execution_rules.tp_pp_blocker``, leaves out of the search (SP off for those configurations, a
pinned SP named in the plan's notes) and the runtime refuses (``apply_plan`` raises
PlanMismatchError after its capture, before any TP or training), with the same reason.

The runtime side runs in this one process on torch's fake process group (world size 4, no
communication): the refusal comes before any collective.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshplan.errors import PlanMismatchError
from meshplan.plan.execution_rules import tp_pp_blocker

pytest.importorskip("transformers")


@pytest.fixture
def fake_world_4():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _llama_and_batch() -> tuple[torch.nn.Module, torch.Tensor]:
    import model_families as mf

    torch.manual_seed(0)
    return mf.hf_llama(), mf.tokens(0)[0][:2]


def test_search_offers_hf_tp_pp_without_sp_and_runtime_refuses_sp_with_one_reason(fake_world_4) -> None:
    from meshplan import trace_model
    from meshplan.planner.api import estimate_graph, plan_graph
    from meshplan.runtime.apply import handplan, split
    from meshplan.runtime.apply.api import apply_plan

    reason = tp_pp_blocker(tp=2, pp=2, capture="export", sequence_parallel=True)
    assert reason and tp_pp_blocker(tp=2, pp=2, capture="export") == ""
    assert tp_pp_blocker(tp=2, pp=2, capture="fx", sequence_parallel=True) == ""
    model, x = _llama_and_batch()

    # the search: an export capture, 4 ranks, tp2 x pp2 pinned: offered, with SP left off
    g = trace_model(model, (x,))
    assert g.capture == "export"
    plan = plan_graph(g, 4, cluster="h100", global_batch_size=4, fixed={"dp": 1, "cp": 1, "tp": 2, "pp": 2})
    assert (plan.tp, plan.pp) == (2, 2) and not plan.sequence_parallel, plan.summary()
    assert not any("not searched" in n for n in plan.notes), plan.notes
    with pytest.raises(ValueError, match="sequence parallelism with tp > 1 and pp > 1"):
        estimate_graph(g, 4, cluster="h100", dp=1, tp=2, pp=2, num_microbatches=2, global_batch_size=4,
                       sequence_parallel=True)

    # the runtime: a hand-made tp2 x pp2 plan with sequence parallelism is refused with the same reason
    gm = split.capture_graph(model, (x,))[0]
    hand = handplan.manual_plan(model, gm, tp=2, pp=2, microbatches=2, micro_batch_size=1, seq_len=x.shape[1],
                                tp_styles=handplan.megatron_styles(model))
    with pytest.raises(PlanMismatchError) as err:
        apply_plan(model, dataclasses.replace(hand, sequence_parallel=True), loss_fn=lambda out, y: out.sum(),
                   optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.1), example_inputs=(x,))
    assert reason in str(err.value)
    assert "fx capture: skipped (HF transformers model)" in str(err.value)
