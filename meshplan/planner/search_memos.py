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
problem as an earlier size's reuses its answer. No torch import.
"""

from __future__ import annotations

from typing import Any

from meshplan.planner.search_types import Config


def share_table_memos(ev: Any) -> None:
    """Bind ``ev``'s (a ``ConfigCosts``) table-only memos to its coster's ``search_memos`` (see the module docstring)."""
    shared = ev.coster.search_memos
    ev._split_cache = shared.setdefault(("split",), ev._split_cache)  # (id(t), stages, rule): t's costs
    ev._prefix_cache = shared.setdefault(("prefix",), ev._prefix_cache)  # id(t): t's columns
    ev._transient_memo = shared.setdefault(("transient",), ev._transient_memo)  # (id(t), runs)
    ev._tied_memo = shared.setdefault(("tied",), ev._tied_memo)  # id(t)
    ev._infl_ranks = shared.setdefault(("inflight",), ev._infl_ranks)  # (schedule, pp, m, v)
    ev._pipe_memo = shared.setdefault(("pipe_buffers",), {})  # memory_floor.rank_pipeline_buffers: all its inputs
    # kind_free.stage_columns, keyed (id(t), runs, state layout): also the per-parameter state bytes
    # (dtype, optimizer) and the coster's quantization and pass-through bytes
    ev._stage_cols_memo = shared.setdefault(("stage_cols", ev.dtype, ev.optimizer), ev._stage_cols_memo)


def solve_split(ev: Any, c: Config, layers: list[Any], **kw: Any) -> Any:
    """``split_stages(layers, p2p_time=ev.p2p_time(c), **kw)``, memoized in the coster's
    ``search_memos`` by all it reads (see the module docstring). Read only; a failure is not kept."""
    from meshplan.partition.stage_ilp import split_stages

    memo = ev.coster.search_memos.setdefault(("split_solve",), {})
    key = (tuple(layers), ev._pp_spans(c), ev.links_key, tuple(sorted(kw.items())))
    if key not in memo:
        memo[key] = split_stages(layers, p2p_time=ev.p2p_time(c), **kw)
    return memo[key]


__all__ = ["share_table_memos", "solve_split"]
