"""Every memo of one configuration coster (``planner.evaluate.ConfigEvaluator``): ``CostMemos``, one
typed record instead of two dozen private dict attributes, which the helper modules
(``planner.kind_free``, ``planner.memory_floor``) read and fill through the coster's public
``memos``, and ``planner.search_memos.share_table_memos`` binds, where the values depend on a cost
table only, to the dicts every search on one ``GraphCoster`` shares (a world-size sweep).

A key holding ``id(table)`` names one table for the ``GraphCoster``'s life (it keeps every table it
made). Values are read only once stored. No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meshplan.cost_models.memory import ModelStateBytes
from meshplan.planner.epcp_cost import EPCPPrefix, EPCPTerms
from meshplan.planner.search_types import Config


@dataclass
class CostMemos:
    """The memos of one coster, each named by what it holds (key -> value). The first seven are
    table-only (shared per ``GraphCoster`` by ``search_memos.share_table_memos``)."""

    split: dict[tuple, list[tuple[int, int]]] = field(default_factory=dict)  # (id(t), stages, rule) -> runs
    prefix: dict[int, dict[str, list[float]]] = field(default_factory=dict)  # id(t) -> prefix-summed columns
    transient: dict[tuple, float] = field(default_factory=dict)  # (id(t), runs) -> recompute transient bytes
    tied: dict[int, list[int]] = field(default_factory=dict)  # id(t) -> layers reading a tied weight
    inflight: dict[tuple, list[float]] = field(default_factory=dict)  # (schedule, pp, m, v) -> per rank
    pipe_buffers: dict[tuple, list[float]] = field(default_factory=dict)  # memory_floor.rank_pipeline_buffers
    stage_cols: dict[tuple, Any] = field(default_factory=dict)  # (id(t), runs, layout) -> kind_free.StageColumns
    #: (pipeline stride, devices per node) -> {(rank, next rank): comm.p2p_crosses_nodes}
    crosses: dict[tuple[int, int], dict[tuple[int, int], bool]] = field(default_factory=dict)
    state_bytes: dict[tuple, ModelStateBytes] = field(default_factory=dict)  # per-parameter state bytes per kind, dp, tp
    unsharded: dict[tuple, ModelStateBytes] = field(default_factory=dict)  # per parameter, no sharding, per layout
    kind_free: dict[tuple, Any] = field(default_factory=dict)  # Config's fields but dp_kind, exact, runs -> KindFreeTerms
    other_kinds: dict[Config, list[Config]] = field(default_factory=dict)  # the sharded kinds a ddp config may take
    epcp_prefix: dict[tuple, EPCPPrefix] = field(default_factory=dict)  # per epcp_key
    epcp_node: dict[tuple, Any] = field(default_factory=dict)  # one node's terms and shared node sums (EPCPPrefix)
    epcp_stages: dict[tuple, list[EPCPTerms]] = field(default_factory=dict)  # (epcp_key, id(t), runs)
    epcp_whole: dict[tuple, EPCPTerms] = field(default_factory=dict)  # the whole model's terms per epcp_key
    pools: dict[tuple, float] = field(default_factory=dict)  # stream_pools per (table, split, placement)
    units: dict[int, list[Any]] = field(default_factory=dict)  # id(t) -> its layers as FSDP2 units (fsdp_units.UnitLayer)
    states: dict[tuple, float] = field(default_factory=dict)  # lower_bound's model states per (params, kind, dp, tp, ...)
    lower_bound_part: dict[tuple, tuple[float, float, dict[str, list[float]]]] = field(default_factory=dict)
    # _lower_bound's (work, optimizer seconds, model states, activations) per (table's fields, cp, ep, dp, pp, kind)
    lower_bound_rest: dict[tuple, tuple[float, float, float, float]] = field(default_factory=dict)
    # memory_floor.split_floor's per-rank (parameters, held bytes) per (id(t), pp, v, schedule, m)
    split_held: dict[tuple, tuple[list[float], list[float]]] = field(default_factory=dict)
    # kind_free's per split: stage times before the m-dependent terms (kind_free.stage_work), the stages on
    # the ranks (rank_layout), per-rank transients, autocast's kept bytes and cast terms, the sends, the
    # stages' in-flight counts and pipeline buffers
    stage_work: dict[tuple, tuple] = field(default_factory=dict)
    rank_layout: dict[tuple, Any] = field(default_factory=dict)
    rank_transient: dict[tuple, list[float]] = field(default_factory=dict)
    cast_kept: dict[tuple, tuple] = field(default_factory=dict)
    cast_parts: dict[tuple, tuple] = field(default_factory=dict)
    stage_sends: dict[tuple, list[float]] = field(default_factory=dict)
    pre_block: dict[int, tuple[float, float]] = field(default_factory=dict)  # id(t) -> StateCosts._pre_block_params
    stage_buffers: dict[tuple, tuple[list[float], list[float]]] = field(default_factory=dict)
    epcp_why: dict[tuple, str] = field(default_factory=dict)  # epcp_why per (tp, pp, cp, ep, recompute)
    bound: dict[tuple, tuple[float, float]] = field(default_factory=dict)  # lower_bound per (config, layout, impl)
    optimizer: dict[tuple, float] = field(default_factory=dict)  # StateCosts.optimizer_s per (params, kind, dp, tp, pp)
    dp_collectives: dict[tuple, Any] = field(default_factory=dict)  # StateCosts.dp_collectives per (bytes, c's fields it reads)
    zero_divs: dict[tuple, tuple[int, int, int]] = field(default_factory=dict)  # per (kind, dp, tp, layout)
    quant_errors: dict[tuple[int, int], list[str]] = field(default_factory=dict)  # (id(solution), fsdp dp)
    sp_choice: dict[int, bool] = field(default_factory=dict)  # sp_for per tp degree


__all__ = ["CostMemos"]
