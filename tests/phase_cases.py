"""Worker for the per-phase measurement test: dp2, pp2 1F1B and pp2 zero-bubble runs profiled."""

from __future__ import annotations

from typing import Any

import runtime_cases as rc
import torch


def phases_worker(rank: int, world: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from meshplan.runtime.apply import handplan, split
    from meshplan.runtime.apply.api import apply_plan
    from meshplan.runtime.record import phases

    data = rc.batches(3)
    out: dict[str, Any] = {}
    for name, pp, schedule in (("dp2", 1, "1f1b"), ("pp2", 2, "1f1b"), ("pp2_zb", 2, "zero-bubble")):
        model = rc.tiny_gpt()
        ex = (data[0][0][:2],)
        gm = split.capture_graph(model, ex)[0] if pp > 1 else None
        plan = handplan.manual_plan(model, gm, dp=2 // pp, pp=pp, schedule=schedule, microbatches=2,
                                    micro_batch_size=rc.BATCH // (2 * (2 // pp)), seq_len=rc.SEQ, step_s=0.05)
        pm = apply_plan(model, plan, loss_fn=rc.loss_fn, optimizer_factory=rc.opt_factory, example_inputs=ex)
        pm.step(*data[0])
        with profile(activities=[ProfilerActivity.CPU]) as prof:  # a timed step: no phase ranges
            pm.step(*data[1])
        timed_ranges = sum(e.name.startswith(phases.PREFIX) for e in prof.events())
        mine = phases.measure(pm, [data[2]])
        rec = phases.record_phases(phases.gather(mine), plan, steps=1)
        out[name] = {"mine": mine, "timed_ranges": timed_ranges, "rec": rec, "wall": pm.step_times_s[-1],
                     "enabled_after": pm.phase_spans.enabled, "steps": pm.steps_done}
        torch.distributed.barrier()
    return out
