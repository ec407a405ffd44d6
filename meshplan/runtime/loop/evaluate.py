"""Validation loss of a ParallelModel on held-out batches (forward only, no optimizer step).

``eval_loss(pm, batches)`` takes this rank's share of each batch (``meshplan.runtime.loop.data``:
inputs on the pipeline ranks whose stages read them, targets on the last), runs the forward pass in microbatches
(under pp > 1 the schedule's own ``eval``, which skips backward), and returns the mean loss over
the batches, averaged over data-parallel replicas and identical on every rank. Model modules are
put in ``eval()`` mode for the pass and restored after (dropout off).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from meshplan.runtime.apply import loss_parallel as lpmod
from meshplan.runtime.apply import precision as prec
from meshplan.runtime.launch import collectives

if TYPE_CHECKING:
    from meshplan.runtime.apply.api import ParallelModel
    from meshplan.runtime.loop.data import Batch


def _batch_loss(pm: ParallelModel, x: tuple, y: torch.Tensor | None) -> torch.Tensor:
    """``x``: this rank's inputs as positional tensors (``ParallelModel.rank_batch``)."""
    m = pm.plan.num_microbatches
    local = torch.zeros((), dtype=torch.float64)
    if pm.schedule is None:
        assert x and y is not None
        for xm, ym in zip(zip(*(t.chunk(m) for t in x)), y.chunk(m)):
            with lpmod.context(pm.loss_parallel):
                loss = pm.loss_fn(prec.to_fp32(pm.runners[0](*xm)), ym)
            local += lpmod.plain(loss.detach()).double().cpu() / m
        return local
    losses: list[torch.Tensor] = []
    kw = {"target": y, "losses": losses} if pm.has_last else {}
    with lpmod.context(pm.loss_parallel):
        pm.schedule.eval(**kw, **pm.schedule_inputs(x))  # type: ignore[attr-defined]
    if pm.has_last:
        local += torch.stack([lpmod.plain(v.detach()).double().cpu() for v in losses]).mean() / pm.loss_scale()
    return local


def eval_loss(pm: ParallelModel, batches: list[Batch]) -> float:
    """Mean validation loss over ``batches`` (this rank's shares); a collective over all ranks."""
    if not batches:
        raise ValueError("eval_loss: no batches")
    modes = [(mod, mod.training) for mod in pm.modules]
    for mod, _ in modes:
        mod.eval()
    try:
        total = torch.zeros((), dtype=torch.float64)
        with torch.no_grad():
            for xb, yb in batches:
                x, y = pm.rank_batch(xb, yb, local=True)
                total += _batch_loss(pm, x, y)
    finally:
        for mod, was in modes:
            mod.train(was)
    # every rank holding the last stage has its replica's mean; the dp x tp copies are averaged
    share = pm.env.degree("dp") * pm.env.degree("tp")
    contrib = (total / len(batches) / share) if pm.has_last else torch.zeros((), dtype=torch.float64)
    return float(collectives.all_reduce(contrib).item())
