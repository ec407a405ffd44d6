"""What the searches of one world-size sweep share (``planner.api.PlanMemo``: one ``GraphCoster``
per cluster hardware, precision, quantization, optimizer and engine profile, reused by every size).

``share_table_memos`` binds a search's memos whose values depend only on a cost table (and the
settings named in their group key) to the coster's ``search_memos``: the time-balanced split of a
table into n stages, its prefix sums, recompute transients, tied-weight layers, per-stage columns
the in-flight microbatch counts of a schedule shape and the pipeline buffers of a split. None of them reads the device count, the
global batch, the pins or the data-parallel degree, and the coster keeps every table it made, so a
key holding ``id(table)`` names one table for the coster's life. ``solve_split`` memoizes the
stage-split solves (``partition.stage_ilp.split_stages``: the winner's ILP, the memory re-splits)
by everything a solve reads: the layers' figures, the solve's arguments and the send time (the
cluster's links, whether the pipeline crosses nodes), so a size whose winner has the same split
problem as an earlier size's reuses its answer. ``share_epcp_memos`` binds the EP / CP memos
(``planner.epcp_coster.EPCPCosts``: per-node terms, their prefix sums, the whole model's and each
stage's, and the lower bound's part read from them) the same way: they read the configuration's cp, ep, tp, micro-batch, recompute (and dp
under MoE folding), the graph, the cluster's hardware (never its device count) and the coster's
settings, so they are grouped by the settings a search adds (capacity factor, element bytes, MoE
folding). No torch import.
"""

from __future__ import annotations

from typing import Any

from meshplan.planner.cost_memos import CostMemos
from meshplan.planner.search_types import Config


def share_table_memos(memos: CostMemos, shared: dict[tuple, Any], dtype: str, optimizer: str) -> None:
    """Bind a coster's table-only ``memos`` to its ``GraphCoster.search_memos`` (``shared``; see
    the module docstring)."""
    memos.split = shared.setdefault(("split",), memos.split)  # (id(t), stages, rule): t's costs
    memos.prefix = shared.setdefault(("prefix",), memos.prefix)  # id(t): t's columns
    memos.transient = shared.setdefault(("transient",), memos.transient)  # (id(t), runs)
    memos.tied = shared.setdefault(("tied",), memos.tied)  # id(t)
    memos.inflight = shared.setdefault(("inflight",), memos.inflight)  # (schedule, pp, m, v)
    memos.pipe_buffers = shared.setdefault(("pipe_buffers",), {})  # memory_floor.rank_pipeline_buffers: all its inputs
    # kind_free.stage_columns, keyed (id(t), runs, state layout): also the per-parameter state bytes
    # (dtype, optimizer) and the coster's quantization and pass-through bytes
    memos.stage_cols = shared.setdefault(("stage_cols", dtype, optimizer), memos.stage_cols)
    # kind_free's per (table, split, placement, state layout) memos, functions of those stage columns:
    # the stages on the ranks, the ranks' transients, autocast's kept bytes, the in-flight counts and
    # pipeline buffers (keyed with the pipeline runtime's buffer convention too)
    memos.rank_layout = shared.setdefault(("rank_layout", dtype, optimizer), memos.rank_layout)
    memos.rank_transient = shared.setdefault(("rank_transient", dtype, optimizer), memos.rank_transient)
    memos.cast_kept = shared.setdefault(("cast_kept", dtype, optimizer), memos.cast_kept)
    memos.stage_buffers = shared.setdefault(("stage_buffers", dtype, optimizer), memos.stage_buffers)


def share_epcp_memos(memos: CostMemos, shared: dict[tuple, Any], capacity_factor: float, elem_bytes: int,
                     moe_folding: bool) -> None:
    """Bind a coster's EP / CP ``memos`` to its ``GraphCoster.search_memos`` (``shared``), one group
    per the settings of ``EPCPCosts`` not in ``EPCPCosts.key`` nor the coster's own (see the module
    docstring). The node memo also keeps the node-copy keys (``EPCPCosts._copies``), whose id it
    holds in keys, so that list lives as long as the memo."""
    group = ("epcp", float(capacity_factor), int(elem_bytes), bool(moe_folding))
    memos.epcp_prefix = shared.setdefault((*group, "prefix"), memos.epcp_prefix)  # per EPCPCosts.key
    memos.epcp_node = shared.setdefault((*group, "node"), memos.epcp_node)  # per node key (epcp_cost._node_key)
    memos.epcp_whole = shared.setdefault((*group, "whole"), memos.epcp_whole)  # per EPCPCosts.key
    memos.epcp_stages = shared.setdefault((*group, "stages"), memos.epcp_stages)  # (key, id(t), runs)
    # ConfigEvaluator._lower_bound's part per (tp, sp, recompute, micro-batch, cp, ep[, dp folded]):
    # a table's sums and the whole model's EP / CP terms
    memos.lower_bound_part = shared.setdefault((*group, "lower_bound_part"), memos.lower_bound_part)


def solve_split(ev: Any, c: Config, layers: list[Any], **kw: Any) -> Any:
    """``split_stages(layers, p2p_time=ev.p2p_time(c), **kw)``, memoized in the coster's
    ``search_memos`` by all it reads (see the module docstring). Read only; a failure is not kept."""
    from meshplan.partition.stage_ilp import split_stages

    memo = ev.coster.search_memos.setdefault(("split_solve",), {})
    key = (tuple(layers), ev.pp_spans(c), ev.links_key, tuple(sorted(kw.items())))
    if key not in memo:
        memo[key] = split_stages(layers, p2p_time=ev.p2p_time(c), **kw)
    return memo[key]


__all__ = ["share_epcp_memos", "share_table_memos", "solve_split"]
