"""Expert and context parallelism of one coster: ``EPCPCosts``, a collaborator the coster
(``planner.evaluate.ConfigEvaluator.ep_cp``) holds.

What the runtime refuses at given cp / ep degrees (``execution_rules.epcp_rule``, a pinned
sequence parallelism counted), the EP all-to-all / CP ring / expert terms of every MoE and
attention node for a configuration's degrees, prefix-summed (``planner.epcp_cost.EPCPPrefix``,
each node of a block's copies costed once), the whole model's and each pipeline stage's, and
the group expert gradients are reduced over (Megatron-Core's MoE parallel folding or meshplan's
runtime). Every memo is the coster's ``CostMemos``. No torch import.
"""

from __future__ import annotations

import functools

from meshplan.cost_models.epcp import folded_expert_mesh
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.graph import ModelGraph
from meshplan.plan.execution_rules import cp_forward_blocker, epcp_rule
from meshplan.planner.cost_memos import CostMemos
from meshplan.planner.costing import CostTable, GraphCoster
from meshplan.planner.epcp_cost import EPCPPrefix, EPCPTerms, expert_params
from meshplan.planner.search_types import Config


class EPCPCosts:
    """EP / CP terms of one coster (see the module docstring)."""

    def __init__(self, graph: ModelGraph, cluster: ClusterSpec, coster: GraphCoster, memos: CostMemos, *,
                 dtype: str, elem_bytes: int, capacity_factor: float, moe_folding: bool, sp_pinned: bool,
                 quant: bool) -> None:  # fmt: skip
        self.g = graph
        self.cluster = cluster
        self.coster = coster
        self.memos = memos
        self.dtype = dtype
        self.elem_bytes = elem_bytes
        # MoE load imbalance assumed by the costing (busiest expert rank / mean); a setting, not a pin
        self.capacity_factor = capacity_factor
        # Megatron-Core's MoE parallel folding (planner.epcp_cost, cost_models.epcp): a tp rank routes
        # and computes its 1/tp sequence shard over an ep group of consecutive ranks, expert gradients
        # reduced over the expert data-parallel group; an engine costing option (estimate_graph),
        # never the planner's own plans (meshplan's runtime replicates the MoE block over tp)
        self.moe_folding = bool(moe_folding)
        self.sp_pinned = sp_pinned  # a pinned sequence_parallel=True counts in epcp_why
        self.quant = quant
        self.epcp_nodes = [n for n in graph.nodes if n.kind in ("moe", "attention")]  # what EP/CP terms read

    def epcp_why(self, tp: int, pp: int, cp: int, ep: int, recompute: str, dp: int = 0,
                 sequence_parallel: bool | None = None) -> str:
        """``execution_rules.epcp_rule`` (what the runtime refuses) for these degrees; a pinned
        sequence_parallel counts (``Searcher.configs`` asks without SP, ``Searcher.candidates`` again with SP
        on where the TP degree takes it: cp runs with it, ep does not), or the one given
        (an estimated configuration's own). Memoized per degrees (``Searcher.configs`` asks it once per
        microbatch size and schedule). ``dp`` (0: not checked, the search's ep always divides dp·cp): an
        ep spanning tensor-parallel ranks is refused."""
        sp = self.sp_pinned if sequence_parallel is None else sequence_parallel
        key = (tp, pp, cp, ep, recompute, dp, sp)
        if key not in self.memos.epcp_why:
            self.memos.epcp_why[key] = self._rule(tp, pp, cp, ep, recompute, dp, sp)
        return self.memos.epcp_why[key]

    def _rule(self, tp: int, pp: int, cp: int, ep: int, recompute: str, dp: int = 0, sp: bool = False) -> str:
        if cp > 1 and "forward_params" in self.g.meta:  # graphs traced before the names were recorded: unknown
            why = cp_forward_blocker(str(self.g.meta.get("model_class", "")), self.g.meta["forward_params"],
                                     self.g.meta.get("seq_positions", ()))
            if why:
                return why
        return epcp_rule(cp=cp, ep=ep, tp=tp, pp=pp, seq_len=self.g.seq_len,
                         num_experts=int(self.g.meta.get("num_experts", 0) or 0), recompute=recompute,
                         quantized=self.quant, sequence_parallel=sp, capture=self.g.capture, dp=dp)

    def key(self, c: Config) -> tuple:
        """What ``c``'s EP/CP terms depend on (the dp degree only under MoE parallel folding)."""
        return (c.cp, c.ep, c.micro_batch, c.tp, c.recompute, self.moe_folding, c.dp if self.moe_folding else 0)

    def has_epcp(self, c: Config) -> bool:
        """Whether ``c`` has EP/CP terms: cp or ep > 1, or MoE parallel folding at tp > 1."""
        return c.cp * c.ep > 1 or (self.moe_folding and c.tp > 1)

    def expert_dp_group(self, c: Config) -> tuple[int, int]:
        """(size, rank stride) of the group expert gradients are reduced over: their dp·cp/ep
        replicas tp·ep apart (meshplan's runtime, runtime/epcp), or folded the expert data-parallel
        group, dp·cp·tp/ep ranks ep apart (``cost_models.epcp.folded_expert_mesh``)."""
        if self.moe_folding and c.tp > 1:
            m = folded_expert_mesh(c.dp * c.cp * c.tp, c.ep)
            return m.edp, m.edp_stride
        return c.dp * c.cp // c.ep, c.tp * c.ep

    def epcp_prefix(self, c: Config) -> EPCPPrefix:
        """The EP/CP terms of every MoE / attention node for ``c``'s degrees, prefix-summed (memoized)."""
        key = self.key(c)
        if key not in self.memos.epcp_prefix:
            self.memos.epcp_prefix[key] = EPCPPrefix(
                self.g, self.cluster, self.epcp_nodes, cp=c.cp, ep=c.ep, micro_batch=c.micro_batch,
                dtype=self.dtype, capacity_factor=self.capacity_factor, elem_bytes=self.elem_bytes, tp=c.tp,
                recompute=c.recompute, stride=c.tp,  # ep and cp groups: dc-row positions, tp apart
                folding=self.moe_folding, dp=c.dp,  # folded: the ep group laid out on its own
                fp8_recipe=self.coster.profile.fp8_recipe,  # under fp8: TE recipes run the experts in fp8
                moe_dispatcher=self.coster.profile.moe_dispatcher,  # copies of a token a dispatch moves
                cp_rotate=self.coster.profile.cp_rotate,  # how the engine's ring moves key/value blocks
                main_grad_bytes=self.coster.main_grad_bytes,  # what the experts' weight gradients accumulate into
                ep_combine_bytes=self._ep_combine_bytes,  # meshplan's runtime exchange: what it keeps
                memo=self.memos.epcp_node, copies=self._copies)
        return self.memos.epcp_prefix[key]

    @functools.cached_property
    def _ep_combine_bytes(self) -> int:
        """The element size of meshplan's runtime exchange's combine (``epcp_cost.ep_kept_bytes``): the
        MoE block input's, fp32 on the runtime's fp32 parameters (under autocast the norm before it
        outputs fp32); 0 for another engine's profile (its exchange is not this code)."""
        return 4 if self.coster.profile.engine == "meshplan" else 0

    @functools.cached_property
    def _copies(self) -> list[tuple]:
        """Per EP/CP node, a key equal for the nodes at the same place of repeated layers of one type
        (the cost table's prototype layers, ``GraphCoster.table``: a block's copies cost the same)."""
        if ("copies",) in self.memos.epcp_node:  # shared by the searches of a sweep (search_memos.share_epcp_memos)
            return self.memos.epcp_node["copies",]
        where: dict[int, tuple] = {}
        for _name, a, b, _kind, tid in self.coster.ranges:
            if tid:
                for i in range(a, b):
                    where[i] = (tid, b - a, i - a)
        # kept in the node memo, whose keys hold its id: it lives as long as they do
        return self.memos.epcp_node.setdefault(("copies",), [where.get(n.id, ("node", n.id)) for n in self.epcp_nodes])

    @functools.cached_property
    def expert_param_count(self) -> float:
        """All experts' parameters of the graph (``epcp_cost.expert_params``)."""
        return expert_params(self.g, self.epcp_nodes)

    def epcp(self, c: Config) -> EPCPTerms:
        """The whole model's EP/CP terms per microbatch (``planner.epcp_cost.epcp_terms``)."""
        key = self.key(c)
        if key not in self.memos.epcp_whole:
            self.memos.epcp_whole[key] = self.epcp_prefix(c).whole()
        return self.memos.epcp_whole[key]

    def epcp_stages(self, c: Config, t: CostTable, runs: list[tuple[int, int]]) -> list[EPCPTerms]:
        """``epcp`` per pipeline stage: over the MoE / attention nodes of the stage's layers."""
        key = (self.key(c), id(t), tuple(runs))  # per search: the prefix reads this cluster
        if key not in self.memos.epcp_stages:
            pre = self.epcp_prefix(c)
            self.memos.epcp_stages[key] = [pre.terms(t.layers[a].node_start, t.layers[b - 1].node_end) for a, b in runs]
        return self.memos.epcp_stages[key]


__all__ = ["EPCPCosts"]
