"""Costing one given configuration (``planner.api.estimate_graph``): ``estimate_config(costs,
config)`` is the coster's evaluation of that ``Config`` (on its own stage split, or the given
``runs``; the fastest fitting DP kind when ``choose_kind``), its pipeline split re-solved by the
stage-split ILP as the search's winner's is (``planner.finalize.refine_split``), and
``estimate_notes`` what the plan says of it (does not fit, what meshplan's runtime would not run).
No torch import.
"""

from __future__ import annotations

from meshplan.plan.execution_rules import state_layout_blocker
from meshplan.planner.evaluate import ConfigEvaluator
from meshplan.planner.finalize import WINNER_SPLIT_LIMIT_S, WINNER_SPLIT_NODES, refine_split
from meshplan.planner.search_types import Config, Evaluation, GiB, SplitSolve


def estimate_config(
    costs: ConfigEvaluator, config: Config, *, runs: list[tuple[int, int]] | None = None, choose_kind: bool = False
) -> tuple[Evaluation, SplitSolve | None]:
    """``config`` costed exactly on ``costs``: on ``runs`` (each stage's layer range) when given,
    else on the coster's split, re-solved by the stage-split ILP when it fits and the split rule
    is free; with ``choose_kind`` (ddp, not pinned) the fastest data-parallel kind that fits
    (``ConfigEvaluator.evaluate_auto``). Returns the evaluation and what the split ILP reported."""
    if runs is not None or not choose_kind:
        ev = costs.evaluate(config, runs=runs)
    else:
        ev = costs.evaluate_auto(config)
    if ev.fits and config.pp > 1 and runs is None and costs.split_rule == "any":
        return refine_split(costs, ev, WINNER_SPLIT_LIMIT_S, WINNER_SPLIT_NODES)
    return ev, None


def estimate_notes(costs: ConfigEvaluator, ev: Evaluation) -> list[str]:
    """The plan's notes on an estimated configuration: that it does not fit, that meshplan's
    runtime would not run its cp / ep, and MoE parallel folding's layout when costed."""
    c = ev.config
    notes = [] if ev.fits else [
        f"does not fit: needs {ev.max_mem_bytes / GiB:.1f} GiB per device, limit {ev.mem_limit_bytes / GiB:.1f} GiB"]
    # the configuration's own sequence parallelism (an estimate's is given, not pinned through ``fixed``)
    why = costs.ep_cp.epcp_why(c.tp, c.pp, c.cp, c.ep, c.recompute, dp=c.dp, sequence_parallel=c.sequence_parallel)
    if why:
        notes.append(f"cp={c.cp} ep={c.ep} costed (cost_models/epcp.py), but meshplan's runtime does not run it: {why}")
    co = costs.coster
    why = state_layout_blocker(state_layout=co.runtime_state_layout, dp_kind=c.dp_kind if c.dp > 1 else "none",
                               dtype=co.train_dtype, cp=c.cp, ep=c.ep, quantization=co.quant.mode)
    if why:
        notes.append(f"costed, but meshplan's runtime does not run it: {why}")
    if costs.moe_folding and c.tp > 1:
        edp, _ = costs.ep_cp.expert_dp_group(c)
        notes.append(f"MoE parallel folding costed (Megatron-Core, ETP 1 with sequence parallelism): each tp rank routes "
                     f"its 1/{c.tp} of the tokens over an ep group of {c.ep} consecutive ranks, expert gradients over "
                     f"{edp} expert data-parallel ranks; meshplan's runtime does not run it (its MoE block is replicated "
                     f"over tp and its ep group borrows dp ranks {c.tp} apart)")
    return notes


__all__ = ["estimate_config", "estimate_notes"]
