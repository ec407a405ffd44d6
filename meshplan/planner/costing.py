"""Costing a ModelGraph into per-layer tables for the search and the stage split.

A *layer* is the run of nodes between two cut points (``partition.cuts.layer_ranges``): the
pre-block segment (embeddings), each repeated-block instance, the post-block segment (final norm,
head, loss); a graph without (enough) repeated blocks is cut at its candidate cut points.
For one (tp, sequence_parallel, recompute, micro_batch) the table gives, per layer and per
microbatch on one device:

- ``fwd_s``, ``bwd_input_s``, ``bwd_weight_s``: ``node_time`` summed over the layer's nodes at
  the TP shard the placement ILP chose, ``batch_scale = micro_batch / traced batch`` (RMSNorm
  modules as the engine runs them, ``norm_kernel``); the post layer adds the engine's
  cross-entropy over the logits when the graph did not trace its loss (``eager_ops.loss_time_s``);
  on a host with DTensor figures (``ClusterSpec.host_tp_linear_fwd_s`` / ``_bwd_s``, a CPU profiled
  on gloo: ``profile.tp_host``) each TP-sharded linear adds them to forward and input-gradient time;
- ``tp_comm_s``: the placement's resharding collectives (forward + backward); half is charged
  to the forward, half to the backward (they sit on the critical path, not overlapped; an engine
  with ``tp_comm_overlap`` hides them behind the layer's GEMMs, one with ``tp_bwd_overlap`` the
  column-parallel input-gradient collectives behind those linears' weight-gradient GEMMs);
- ``recompute_s``: forward work redone in backward (selective: the attention core and the
  s×s score tensors; op: every op of a block but the saved linears and attention, with the
  TP collectives not saved; full: the whole forward with its TP collectives);
- ``param_count``: parameters held per device (TP-sharded weights ÷ tp);
- ``act_bytes``: what the layer keeps for backward (``node_activation_bytes``; full recompute
  keeps only the layer input, op-level recompute the input, every other linear's output and
  the attention outputs); ``transient_bytes`` what recompute rematerializes while the layer is
  back-propagated; ``loss_bytes`` what the cross-entropy keeps per microbatch until its
  backward, ``loss_peak_bytes`` its backward's peak beyond that (post layer);
- ``out_bytes``: the tensors crossing the cut after the layer (``CutPoint.crossing_bytes``
  × batch_scale in the training dtype, ÷ tp with sequence parallelism);
- ``host_fwd_s``, ``host_bwd_s``: the host's dispatch time of the layer's ops per microbatch
  (``cost_models.host.layer_host_ops`` × ``ClusterSpec.host_op_s``, + the engine's own MoE layer
  host time, ``host.engine_moe_host_s``), forward and backward with its recompute: the
  host-dispatch floor ``kind_free.stage_columns`` applies per stage;
- ``autocast_cast_params``, ``autocast_recast_params``: the parameters torch.autocast casts in the
  layer's forward (and again in a full / op recompute's re-run) where a run computes under bf16 /
  fp16 autocast on fp32 parameters; ``kind_free_terms`` prices their device bytes
  (``cost_models.autocast_casts``) only for configurations that do (``StateCosts.runs_autocast``).

The TP placement is solved once per (tp, sp) and microbatch bucket (1, 4 or 16 sequences) and
re-costed at each microbatch size in the bucket (the placement hardly moves within a bucket; the
ILP stays out of the search's inner loop).
Block instances of one type share one costed row.

With a ``Quantization`` (QAT or QLoRA), linear nodes are timed by ``cost_models.quant_nodes.
quant_node_time`` (fake-quantize passes; NF4 dequantization + LoRA GEMMs, no base weight-grad
GEMM) and each layer also carries its model-state bytes (``quant_state_bytes``: NF4 base,
fp32 LoRA factors with gradients and optimizer states, frozen weights without either), its
trainable parameter count and the extra bytes QAT saves for backward. No torch import.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from meshplan.cost_models.autocast_casts import (
    AUTOCAST_DTYPES,
    RECASTING_RECOMPUTE,
    ActivationCastBytes,
    activation_cast_bytes,
    fp32_activations,
)
from meshplan.cost_models.compute import NodeTime, backward_factors, dtype_bytes, elem_scale, node_time
from meshplan.cost_models.dp_kinds import main_grad_bytes
from meshplan.cost_models.eager_ops import is_python_rmsnorm, loss_time_s
from meshplan.cost_models.engine_profiles import EngineProfile
from meshplan.cost_models.engine_profiles import profile as engine_profile
from meshplan.cost_models.engine_saves import (
    async_bwd_hidden_s,
    exposed_tp_comm_s,
    fused_linears,
    layernorm_recomputed,
    moe_recompute_traced_bytes,
    moe_saved_delta,
    saved_bytes_delta,
)
from meshplan.cost_models.hardware import ClusterSpec, with_attention_backend
from meshplan.cost_models.host import (
    HostOps,
    engine_moe_host_s,
    fp32_under_autocast,
    layer_host_ops,
    layer_host_s,
)
from meshplan.cost_models.memory import (
    loss_buffer_bytes,
    loss_kept_bytes,
    node_activation_bytes,
    recompute_transient_bytes,
)
from meshplan.cost_models.precision import activation_dtype, fp8_eligible, fp8_gathered_bytes, fp8_recipe
from meshplan.cost_models.quant_nodes import (
    input_elem_bytes,
    qlora_host_ops,
    quant_node_time,
    without_frozen_weight_grad,
)
from meshplan.graph import GraphNode, ModelGraph
from meshplan.partition.cuts import layer_ranges
from meshplan.plan import Quantization
from meshplan.plan.execution_rules import RUNTIME_STATE_LAYOUTS
from meshplan.planner.layer_saves import LayerSaves, out_shard, saved_shard
from meshplan.planner.tp.graph import GraphTPSolution, solve_tp
from meshplan.planner.tp.groups import GraphIndex
from meshplan.planner.tp.types import collective_passes


@dataclass(frozen=True)
class LayerCost:
    """Costs of one layer for one microbatch on one device (see the module docstring)."""

    name: str
    node_start: int
    node_end: int
    modules: tuple[str, ...]
    fwd_s: float
    bwd_input_s: float
    bwd_weight_s: float
    tp_comm_s: float
    recompute_s: float
    param_count: float
    param_count_full: int
    act_bytes: float
    out_bytes: float
    kind: str = "block"  # pre | block | post
    #: (owner node id, parameters per device) of tied weights this layer reads but another layer
    #: owns (an LM head tied to the embedding): a stage without the owner holds its own copy
    tied: tuple[tuple[int, float], ...] = ()
    #: under quantization only (else -1): model-state bytes per device without ZeRO (params,
    #: grads, optimizer states) and the trainable parameter count
    state_param_bytes: float = -1.0
    state_grad_bytes: float = -1.0
    state_opt_bytes: float = -1.0
    trainable_params: float = -1.0
    #: under QLoRA only (else -1): bytes of its parameters as FSDP2 gathers them, NF4 bases at their
    #: stored size and the rest (adapters, norms, embedding, head) in the training dtype
    gather_bytes: float = -1.0
    #: bytes one op of this layer allocates and frees inside its forward and again inside its
    #: backward, one op at a time (QLoRA: ``cost_models.quant.nf4_dequant_bytes`` of its largest NF4 weight)
    work_bytes: float = 0.0
    #: what ``work_bytes`` grows by under autocast on fp32 parameters (QAT: the fake quantization
    #: runs on the fp32 weight, ``cost_models.quant.qat_work_bytes``); not under FSDP2's mixed precision
    autocast_work_bytes: float = 0.0
    #: bytes per microbatch alive only while this layer is back-propagated: what recompute
    #: dropped, rematerialized by the re-run forward (``memory.recompute_transient_bytes``)
    transient_bytes: float = 0.0
    #: of ``act_bytes``, what the cross-entropy keeps for its backward (the fp32 log-softmax,
    #: ``memory.loss_kept_bytes``): per microbatch in flight, freed before any block of that
    #: microbatch is back-propagated
    loss_bytes: float = 0.0
    #: the cross-entropy's peak (``memory.loss_buffer_bytes``) beyond ``loss_bytes``: the fp32
    #: buffers its backward writes, one microbatch at a time (not in ``act_bytes``)
    loss_peak_bytes: float = 0.0
    #: bytes of the logits this (post) layer returns per microbatch and rank, in the training dtype
    logits_bytes: float = 0.0
    #: bytes per microbatch this layer keeps beyond ``act_bytes`` when it runs under autocast on
    #: fp32 parameters (``autocast_kept_bytes``; not under FSDP2's MixedPrecisionPolicy)
    autocast_bytes: float = 0.0
    #: of ``autocast_bytes``, the compute-dtype weight copies (per microbatch where each stage call is
    #: its own autocast region; once per step where the engine runs a step in one region,
    #: ``EngineProfile.autocast_cache`` "step")
    autocast_weight_bytes: float = 0.0
    #: bytes per microbatch an eager MoE layer's experts keep under autocast as compute-dtype copies of
    #: their weights, all E experts (a rank holding E/ep keeps 1/ep of it: the evaluator divides);
    #: slices of grouped expert weights are not leaves, so autocast's cache never holds them
    #: (``_moe_autocast_bytes``); not in ``autocast_bytes``
    autocast_expert_bytes: float = 0.0
    #: the compute-dtype weight copies the layer's forward casts but does not keep (full / op
    #: recompute drops them with the rest of its saved tensors): autocast's weight cache holds them
    #: until the forward's autocast region ends (one stage call), beside the stage's kept
    #: activations, and releases them before the backward (``kind_free`` "forward end")
    autocast_cache_bytes: float = 0.0
    #: what a recomputed layer's re-run forward saves beyond ``transient_bytes`` under autocast (the
    #: weight copies and fp32 inputs ``autocast_bytes`` counts without recompute), alive with it
    autocast_remat_bytes: float = 0.0
    #: parameters per device this layer's forward casts to the compute dtype under bf16 / fp16 autocast
    #: on fp32 parameters (every linear / matmul weight and bias it reads, a tied head's weight; QLoRA:
    #: the adapters), and of them those a full / op recompute casts again in its re-run forward: the
    #: cast passes ``cost_models.autocast_casts`` prices (``kind_free_terms``, where the run casts)
    autocast_cast_params: float = 0.0
    autocast_recast_params: float = 0.0
    #: of the cast parameters, those whose bf16 gradient the cast's backward converts to fp32: the trained
    #: ones (QLoRA: the adapters; a frozen weight has no weight gradient); -1: all of them
    autocast_gradcast_params: float = -1.0
    #: bytes per microbatch of the memory-bound passes this layer's fp32 activations add where the run
    #: casts (``cost_models.autocast_casts.activation_cast_bytes``: the casts into its linears and their
    #: gradients back, the promotion gradients, the norms' and residual adds' 4-byte width); priced by
    #: ``kind_free_terms`` where the run casts, the forward parts again where the layer is re-run
    autocast_act: ActivationCastBytes = ActivationCastBytes()
    autocast_act_recomputed: bool = False
    #: bytes per microbatch a split backward (zero-bubble schedules) keeps from the layer's input
    #: backward to its weight pass: the gradient of every weight-reading op's output
    #: (``_wgrad_bytes``), beside the activations it still holds then
    wgrad_bytes: float = 0.0
    #: host seconds per microbatch the eager framework spends dispatching this layer's forward ops,
    #: and its backward's (the recompute included): ``cost_models.host``, at ``ClusterSpec.host_op_s``
    #: (0 without a host floor); a stage's forward / backward takes at least their sums
    host_fwd_s: float = 0.0
    host_bwd_s: float = 0.0

    @property
    def fwd_total_s(self) -> float:
        return self.fwd_s + self.tp_comm_s / 2

    @property
    def bwd_input_total_s(self) -> float:
        return self.bwd_input_s + self.tp_comm_s / 2 + self.recompute_s

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_input_s + self.bwd_weight_s + self.tp_comm_s + self.recompute_s


def replaced(obj: Any, **changes: Any) -> Any:
    """``dataclasses.replace(obj, **changes)`` without re-running ``__init__``, for dataclasses
    without ``__post_init__`` or ``__slots__`` (frozen ones too: the fields are set in ``__dict__``);
    an unknown field raises TypeError as ``replace`` does."""
    unknown = set(changes) - set(obj.__dict__)
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no field(s) {sorted(unknown)}")
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(changes)
    return new


@dataclass
class CostTable:
    """Per-layer costs of a graph for one (tp, sp, recompute, micro_batch)."""

    tp: int
    sequence_parallel: bool
    recompute: str
    micro_batch: int
    layers: list[LayerCost]
    tp_solution: GraphTPSolution
    tp_comm_bytes: dict[str, int] = field(default_factory=dict)  # per microbatch, whole model

    @property
    def total_s(self) -> float:
        return sum(layer.total_s for layer in self.layers)

    @property
    def param_count(self) -> float:
        return sum(layer.param_count for layer in self.layers)


class GraphCoster(LayerSaves):
    """Caches TP placements and cost tables of one graph on one cluster."""

    def __init__(
        self,
        graph: ModelGraph,
        cluster: ClusterSpec,
        *,
        dtype: str = "bf16",
        time_limit_s: float = 10.0,
        quantization: Quantization | None = None,
        optimizer: str = "adam",
        profile: EngineProfile | str | None = None,
        moe_folding: bool = False,
    ):
        # the engine whose conventions price the nodes (cost_models.engine_profiles; None = meshplan's runtime)
        self.profile = engine_profile(profile)
        p = self.profile
        # memory.SP_SAVES: what a column-parallel linear saves under sequence parallelism
        self.sp_saves = p.sp_saves
        self.norm_kernel = p.norm_kernel  # eager_ops.NORM_KERNELS: how the engine runs an RMSNorm module
        self.attention_impl = p.attention_impl  # eager_ops.ATTENTION_IMPLS: flash, or the scores materialized
        self.g = graph
        # the engines' TP layout (tp.strategies): the token embedding always vocab-parallel
        self.vocab_parallel = p.vocab_parallel_embedding
        # Megatron-Core's MoE parallel folding (tp.strategies): a MoE node on the sequence shard, so its
        # time, saved activations and the TP collectives around it are a tp rank's share
        self.moe_folding = moe_folding
        self.loss_kernel = p.loss_kernel  # memory.LOSS_KERNELS key; None = what the runtime runs
        self.quant = quantization or Quantization()
        self.optimizer = optimizer
        # the attention kernel the engine runs (TE's cuDNN FusedAttention on Hopper, else the cluster's)
        self.cluster = with_attention_backend(cluster, p.attention_backend)
        # tensors (activations, logits, TP traffic) in the activation dtype; the GEMMs of fp8
        # training on the FP8 tensor cores (cost_models.precision)
        self.train_dtype = dtype
        self.dtype = activation_dtype(dtype)
        # the gradient a weight-gradient GEMM accumulates into (a MoE node's grouped wgrad: fp32, or the
        # 16-bit gradients of a "zero" state layout or a recipe's; dp_kinds.main_grad_bytes)
        self.main_grad_bytes = main_grad_bytes(p.state_layout, dtype, p.main_grads)
        # the layout a plan of meshplan's own runtime runs (Plan.state_layout): its profile's; other engines' "torch".
        # A dtype or quantization the layout does not run is refused by the runtime (execution_rules), as fp8 is
        self.runtime_state_layout = p.state_layout if p.engine == "meshplan" and p.state_layout in RUNTIME_STATE_LAYOUTS \
            else "torch"
        vocab = int(graph.meta.get("vocab") or 0)
        self._heads = {n.id for n in graph.nodes if n.kind == "linear" and vocab and n.attrs.get("out_features") == vocab}
        self._fp8_gathers = fp8_gathered_events(graph, self._heads) if (
            dtype == "fp8" and fp8_recipe(p.fp8_recipe).gathers_fp8) else frozenset()  # fmt: skip
        self.time_limit_s = time_limit_s
        self.ranges = layer_ranges(graph)
        self._tp: dict[tuple[int, bool, int], GraphTPSolution] = {}
        self._tp_index: GraphIndex | None = None  # built at the first TP solve, shared by all
        self._tables: dict[tuple[int, bool, str, int], CostTable] = {}
        self._module_cache: dict[tuple[int, int], tuple[str, ...]] = {}
        self._cuts = {c.after: c for c in graph.cut_points}
        self._through: dict[tuple[int, int, int], float] = {}
        self._cut_total: dict[int, float] = {}  # _boundary_bytes' crossing bytes per cut (node id)
        self._in_bytes: dict[int, int] = {}
        for _, d, b in graph.edges:
            self._in_bytes[d] = self._in_bytes.get(d, 0) + b
        self.ilp_solves = 0
        # memos of the searches that share this coster (a sweep over world sizes: ``planner.api.PlanMemo``),
        # per name and what besides the tables their values depend on (``ConfigEvaluator.__init__``):
        # values keyed by id(table) stay right because the coster keeps every table it made
        self.search_memos: dict[tuple, dict] = {}
        self.ilp_seconds = 0.0
        self._owner: dict[str, tuple[int, int]] = {}  # parameter FQN -> (node counting it, numel)
        for n in graph.nodes:
            if n.param_numel:
                for p in n.param_names:
                    self._owner.setdefault(p, (n.id, n.param_numel))
        # a tied group's other names -> the name its owner counts it under (wte.weight for lm_head.weight);
        # read where autocast casts a tied head's weight (``_autocast_bytes``)
        self._tied_alias: dict[str, str] = {}
        for grp in graph.tied_params:
            owned = next((q for q in grp if q in self._owner), None)
            for q in grp if owned is not None else ():
                if q not in self._owner:
                    self._tied_alias[q] = owned

    def quant_errors(self, sol: GraphTPSolution, fsdp_dp: int = 1) -> list[str]:
        """``cost_models.quant.quant_constraint_errors`` of this graph's linears at ``sol``'s styles."""
        from meshplan.cost_models.quant import quant_constraint_errors

        linears = [
            (n.module_fqn, int(n.attrs["in_features"]), int(n.attrs["out_features"]),
             sol.styles.get(n.module_fqn, "replicate"))
            for n in self.g.nodes
            if n.kind == "linear" and n.module_fqn and "in_features" in n.attrs and "out_features" in n.attrs
        ]  # fmt: skip
        return quant_constraint_errors(linears, self.quant, tp=sol.tp, fsdp_dp=fsdp_dp)

    # ---- TP placement ------------------------------------------------------------------
    def tp_solution(self, tp: int, sp: bool, micro_batch: int = 1) -> GraphTPSolution:
        """Placement for (tp, sp), solved at the microbatch bucket of ``micro_batch``
        (1, 4 or 16 sequences) and reused for the sizes around it."""
        ref = placement_bucket(micro_batch)
        key = (tp, sp, ref)
        if key not in self._tp:
            if self._tp_index is None:
                self._tp_index = GraphIndex(self.g)
            sol = solve_tp(
                self.g, tp, self.cluster, sequence_parallel=sp, batch_scale=ref / max(1, self.g.batch_size),
                dtype=self.dtype, time_limit_s=self.time_limit_s, vocab_parallel=self.vocab_parallel,
                moe_folding=self.moe_folding, index=self._tp_index,
            )  # fmt: skip
            self.ilp_solves += sol.solves
            self.ilp_seconds += sol.seconds
            self._tp[key] = sol
        return self._tp[key]

    def reuse_placements(self, other: GraphCoster) -> None:
        """Take ``other``'s solved TP placements (same graph and cluster) instead of solving them
        again (``planner.assemble.quant_effect``: the plan costed without quantization)."""
        self._tp.update(other._tp)

    # ---- tables ------------------------------------------------------------------------
    def table(self, tp: int, sp: bool, recompute: str, micro_batch: int) -> CostTable:
        key = (tp, sp, recompute, micro_batch)
        if key in self._tables:
            return self._tables[key]
        sol = self.tp_solution(tp, sp, micro_batch)
        scale = micro_batch / max(1, self.g.batch_size)
        layers: list[LayerCost] = []
        by_type: dict[tuple[str, int], LayerCost] = {}
        comm_total: dict[str, int] = {}
        for name, a, b, kind, tid in self.ranges:
            tkey = (tid or "", b - a)
            proto = by_type.get(tkey) if tid else None
            if proto is not None:
                layer = replaced(  # ~130 copies per table of a 128-layer model, hundreds of tables per search
                    proto, name=name, node_start=a, node_end=b, modules=self._modules(a, b),
                    out_bytes=self._boundary_bytes(b - 1, tp, sp, scale), kind=kind,
                )  # fmt: skip
            else:
                layer = self._cost_layer(name, a, b, kind, tid, sol, recompute, scale)
                if tid:
                    by_type[tkey] = layer
            for nid, k, v in self._layer_events(a, b, tid, sol):
                comm_total[k] = comm_total.get(k, 0) + int(
                    collective_passes(self.g.nodes[nid].kind, k) * v * scale * self.g.batch_size / sol.micro_batch
                )
            layers.append(layer)
        table = CostTable(tp, sp, recompute, micro_batch, layers, sol, comm_total)
        self._tables[key] = table
        return table

    def _modules(self, a: int, b: int) -> tuple[str, ...]:
        """Modules holding parameters in nodes [a, b) (the same for every table: computed once per range)."""
        key = (a, b)
        if key not in self._module_cache:
            seen: dict[str, None] = {}
            for n in self.g.nodes[a:b]:
                if n.module_fqn and (n.param_numel or n.param_names):  # tied heads too (they read a weight)
                    seen[n.module_fqn] = None
            self._module_cache[key] = tuple(seen)
        return self._module_cache[key]

    def passthrough_bytes(self, t: CostTable, a: int, b: int) -> float:
        """Bytes per microbatch that a stage of layers [a, b) receives and sends on unchanged (a
        skip tensor crossing the whole stage: a UNet's encoder outputs). The stage holds them for
        every in-flight microbatch although none of its layers saves them. 0 for the first and
        last stage; constants are copied into each stage, never sent."""
        if a == 0 or b >= len(t.layers):
            return 0.0
        key = (id(t), a, b)
        if key not in self._through:
            cin, cout = self._cuts.get(t.layers[a].node_start - 1), self._cuts.get(t.layers[b - 1].node_end - 1)
            nodes = self.g.nodes
            through = set(cin.crossing) & set(cout.crossing) if cin is not None and cout is not None else set()
            total = sum(nodes[i].out_bytes * elem_scale(nodes[i].out_dtype, self.dtype)
                        for i in through if nodes[i].kind != "constant")  # fmt: skip
            scale = t.micro_batch / max(1, self.g.batch_size)
            self._through[key] = total * scale / (t.tp if t.sequence_parallel else 1)
        return self._through[key]

    def _boundary_bytes(self, after: int, tp: int, sp: bool, scale: float) -> float:
        cut = self._cuts.get(after)
        if cut is None:
            return 0.0
        if after not in self._cut_total:  # the traced bytes crossing the cut (the same for every table)
            total = sum(
                self.g.nodes[i].out_bytes * elem_scale(self.g.nodes[i].out_dtype, self.dtype)
                for i in cut.crossing
            )
            self._cut_total[after] = total if cut.crossing else cut.crossing_bytes
        return self._cut_total[after] * scale / (tp if sp else 1)

    def _layer_events(
        self, a: int, b: int, tid: str | None, sol: GraphTPSolution
    ) -> list[tuple[int, str, float]]:
        if tid:
            return sol.segment_events.get(f"block:{tid}", [])
        return [e for e in sol.segment_events.get("rest", []) if a <= e[0] < b]

    def _layer_comm_s(self, a: int, b: int, tid: str | None, sol: GraphTPSolution, scale: float) -> float:
        """TP comm of one layer per microbatch: the placement's collectives re-costed at ``scale``
        (the ILP ran at ``placement_bucket`` sequences)."""
        factor = scale * self.g.batch_size / sol.micro_batch
        return _events_comm_s(self._layer_events(a, b, tid, sol), factor, sol.tp, self.cluster, self.g,
                              self._fp8_gathers)

    def _cost_layer(
        self,
        name: str,
        a: int,
        b: int,
        kind: str,
        tid: str | None,
        sol: GraphTPSolution,
        recompute: str,
        scale: float,
    ) -> LayerCost:
        nodes = self.g.nodes[a:b]
        fwd = bi = bw = 0.0
        attn_fwd = 0.0
        params = 0.0
        params_full = 0
        tied: list[tuple[int, float]] = []
        seq = self.g.seq_len
        quant = self.quant.mode != "none"
        op_saved_fwd_s = 0.0  # forward time of what op-level recompute keeps (not re-run)
        n_linear = 0
        gemm_s = 0.0  # the linears' GEMM time, what TE userbuffers hide TP collectives behind
        col_wgrad_s = 0.0  # the column-parallel linears' weight-gradient GEMMs (``tp_bwd_overlap``)
        last_linear = (0, 0.0)
        fused = fused_linears(nodes, lambda n: sol.styles.get(n.module_fqn or ""), lambda n: sol.node_shard.get(n.id, 1)) \
            if self.profile.fused_projections and not quant else {}  # fmt: skip
        for n in nodes:
            s = sol.node_shard.get(n.id, 1)
            t = NodeTime(0.0, 0.0, 0.0) if fused.get(n.id, n) is None else node_time(
                          fused.get(n.id) or n, self.cluster, shard=s, batch_scale=scale, dtype=self.train_dtype,
                          input_bytes=self._in_bytes.get(n.id, 0), style=sol.styles.get(n.module_fqn or ""),
                          is_head=n.id in self._heads, norm_kernel=self.norm_kernel,
                          attention_impl=self.attention_impl, fp8_recipe=self.profile.fp8_recipe,
                          main_grad_bytes=self.main_grad_bytes, sequence_parallel=sol.sequence_parallel)  # fmt: skip
            if quant and n.kind == "linear":
                t = quant_node_time(n, self.quant, self.cluster, shard=s, style=sol.styles.get(n.module_fqn or ""),
                                    batch_scale=scale, dtype=self.dtype, input_bytes=self._in_bytes.get(n.id, 0),
                                    input_elem_bytes=input_elem_bytes(n, self._fp32_under_autocast,
                                                                      self._autocast_dtype, self.dtype))  # fmt: skip
            if quant:
                t = without_frozen_weight_grad(t, n, self.quant)
            fwd += t.fwd_s
            bi += t.bwd_input_s
            bw += t.bwd_weight_s
            if n.kind == "attention" or _score_shaped(n, seq):
                attn_fwd += t.fwd_s
            if n.kind == "linear":
                n_linear += 1
                gemm_s += t.fwd_s + t.bwd_input_s + t.bwd_weight_s
                if sol.styles.get(n.module_fqn or "") == "colwise":
                    col_wgrad_s += t.bwd_weight_s
            if n.kind == "attention" or (n.kind == "linear" and n_linear % 2):
                op_saved_fwd_s += t.fwd_s
            if n.kind == "linear":
                last_linear = (n_linear, t.fwd_s)
            w_shard = s if n.kind in ("linear", "embedding", "matmul") else 1
            params += n.param_numel / w_shard
            for p in n.shared_params if not n.param_numel else ():
                owner = self._owner.get(p)
                if owner is not None and not a <= owner[0] < b:
                    tied.append((owner[0], owner[1] / w_shard))
            params_full += n.param_numel
        if sol.tp > 1 and (self.cluster.host_tp_linear_fwd_s or self.cluster.host_tp_linear_bwd_s):
            # torch's TP styles on DTensors: each sharded linear's dispatch and hooks (profile.tp_host), additive
            n_dt = sum(1 for n in nodes if n.kind in ("linear", "embedding")
                       and sol.styles.get(n.module_fqn or "") in ("colwise", "rowwise"))  # fmt: skip
            fwd += n_dt * self.cluster.host_tp_linear_fwd_s
            bi += n_dt * self.cluster.host_tp_linear_bwd_s
        userbuffers = self.profile.tp_comm_overlap and sol.sequence_parallel
        comm = exposed_tp_comm_s(self._layer_comm_s(a, b, tid, sol, scale), gemm_s, userbuffers)
        rerun_comm = comm / 2  # the forward collectives a recomputed forward runs again
        if self.profile.tp_bwd_overlap and not userbuffers and sol.tp > 1:
            # the backward mirrors of the forward all-reduces (and, under SP, of the all-gathers into the
            # column-parallel linears) are those linears' input-gradient collectives, run beside their
            # weight-gradient GEMMs (engine_saves.async_bwd_hidden_s); an embedding's all-reduce has none
            mirrored = [e for e in self._layer_events(a, b, tid, sol)
                        if e[1] in ("all_reduce", "all_gather") and collective_passes(self.g.nodes[e[0]].kind, e[1]) == 2]
            factor = scale * self.g.batch_size / sol.micro_batch
            comm -= async_bwd_hidden_s(_events_comm_s(mirrored, factor, sol.tp, self.cluster, self.g) / 2, col_wgrad_s)
        first_cut = self._cuts.get(a - 1)
        elem = elem_scale(_float_dtype(nodes), self.dtype)
        in_bytes = 0.0  # layer input in the traced dtype (what full recompute keeps)
        if first_cut is not None:
            in_bytes = sum(self.g.nodes[i].out_bytes for i in first_cut.crossing)
        # what is checkpointed is the repeated blocks: torchtitan's apply_ac wraps model.layers,
        # Megatron-LM recomputes inside its transformer block, meshplan's runtime wraps the children
        # of the ModuleLists at pp = 1 (runtime/apply/recompute.py); the embedding, final norm and head keep
        # their activations. A graph without repeated blocks is one checkpointed segment (full). DeepSpeed's
        # PipelineModule before e2fdd254e checkpointed every layer holding parameters (recompute_scope "modules")
        every = recompute == "full" and self.profile.recompute_scope == "modules"
        rc = recompute if kind == "block" or every or (recompute != "op" and not self.g.blocks) else "none"

        modules = self.profile.recompute_modules  # what "selective" re-runs (Megatron's --recompute-modules)

        def kept(mode: str) -> float:
            out = node_activation_bytes(
                nodes, tp=sol.tp, sp=sol.sequence_parallel,
                recompute="none" if mode == "selective" and "core_attn" not in modules else mode, batch_scale=scale,
                hidden=self.g.meta.get("hidden"), seq_len=seq, shard_of=lambda n: saved_shard(n, sol, self.sp_saves),
                input_bytes=in_bytes, elem_scale=elem, out_shard_of=lambda n: out_shard(n, sol),
                attention_impl=self.attention_impl,  # an engine without flash keeps the s x s scores
                sac_saves=self.profile.sac_saves,  # op recompute under torch.compile keeps less
                mm_parts=self._op_mm_parts if self.quant.mode == "qlora" else None,  # LoRA's own matmuls
            )  # fmt: skip
            if mode in ("none", "selective"):  # the engine's fused kernels / fp8 saves (cost_models.engine_saves)
                out += saved_bytes_delta(nodes, self.g.nodes.__getitem__, shard_of=lambda n: saved_shard(n, sol, self.sp_saves),
                                         scale=scale * elem, fused_glu=self.profile.glu_kernel == "fused",
                                         fp8_input=self._fp8_saves_input)  # fmt: skip
                out += self._moe_saved_delta(nodes, sol, scale * elem, modules if mode == "selective" else ())
            return out

        act = kept(rc)
        transient = recompute_transient_bytes(kept("none"), act) if rc != "none" else 0.0
        lg = self._logits(nodes, sol, scale) if kind == "post" else None
        loss = loss_peak = logits = 0.0
        if lg is not None:
            elem = 4 if self.dtype in ("fp32", "float32") else 2
            peak = loss_buffer_bytes(lg[0], lg[1], vocab_shard=lg[2], logits_bytes=elem, kernel=self.loss_kernel)
            loss = min(peak, loss_kept_bytes(lg[0], lg[1], vocab_shard=lg[2]))
            loss_peak = peak - loss
            logits = lg[0] * lg[1] / lg[2] * elem
        act += loss
        cast, cast_w, cached = (self._autocast_bytes(nodes, sol, rc, scale, elem, in_bytes) if self._autocast_dtype
                                else (0.0, 0.0, 0.0))
        # the parameters autocast casts (its copies are 2 bytes each: ``_autocast_bytes``), fp8 aside
        # (torchao casts its float8 linears' fp32 weights itself: precision.fp8_cast_bytes)
        cast_p = (cast_w + cached) / 2.0 if self.train_dtype in AUTOCAST_DTYPES else 0.0
        recast_p = cast_p if rc in RECASTING_RECOMPUTE else 0.0
        act_cast = (self._activation_cast_bytes(nodes, sol, scale)
                    if self.train_dtype in AUTOCAST_DTYPES and not quant else ActivationCastBytes())
        remat_cast = 0.0
        if cast and rc in ("full", "op"):
            # the re-run forward runs under autocast again (torch.utils.checkpoint restores the
            # forward's autocast state) and saves what the layer saves without recompute: its
            # weight copies and fp32 inputs, rematerialized with the rest until its backward ends
            remat_cast = self._autocast_bytes(nodes, sol, "none", scale, elem, in_bytes)[0] - cast
        cast_x = 0.0
        if self._autocast_dtype and rc in ("none", "selective") and self.profile.moe_combine == "index_add":
            moe_tok, cast_x = self._moe_autocast_bytes(nodes, sol, scale)
            cast += moe_tok
        if rc == "full":
            rec = fwd + rerun_comm
        elif rc == "selective":  # the modules re-run: the attention core, the experts' activation (cost_models.engine_saves)
            rec = (attn_fwd if "core_attn" in modules else 0.0) + sum(
                moe_recompute_traced_bytes(n, modules) * scale * elem / saved_shard(n, sol, self.sp_saves)
                for n in nodes) / self.cluster.mem_bw_bytes_per_s  # fmt: skip
        elif rc == "op":  # the block's last matmul is never re-run (torch's early stop)
            rec = fwd - op_saved_fwd_s - (last_linear[1] if last_linear[0] % 2 == 0 else 0.0)
            rec += rerun_comm * (0.5 if sol.sequence_parallel else 1.0)
        else:
            rec = 0.0
        if lg is not None:  # the engine's cross-entropy, never recomputed (after the checkpointed blocks)
            lf, lb = loss_time_s(lg[0], lg[1], self.cluster, vocab_shard=lg[2], kernel=self.loss_kernel)
            fwd, bi = fwd + lf, bi + lb
        host_f = host_b = 0.0
        if self.cluster.host_op_s:
            ops = layer_host_ops(nodes, consumers=self._consumers.__getitem__, autocast=self._autocast_dtype,
                                 fp32_ids=self._fp32_under_autocast if self._autocast_dtype else frozenset(),
                                 recompute=rc, attention_impl=self.attention_impl,
                                 norm_kernel=self.norm_kernel, differentiable=self._differentiable.__contains__,
                                 linear_ops=(lambda n: qlora_host_ops(n, self.quant, autocast=self._autocast_dtype))
                                 if quant else None)  # fmt: skip
            # the engine's cross-entropy on the logits (fp32 cast, log-softmax, nll, the 1/m scale)
            loss_ops = 4.0 if lg is not None else 0.0
            ops = HostOps(ops.fwd + loss_ops, ops.bwd + loss_ops, ops.recompute)
            host_f, host_b = layer_host_s(ops, self.cluster, checkpointed=rc in ("full", "op"))
            n_moe = sum(1 for n in nodes if n.kind == "moe")
            if n_moe:  # the engine's own MoE layer host time (cost_models.host.engine_moe_host_s)
                mf, mb = engine_moe_host_s(self.profile.engine, self.cluster, recomputed=rc in ("full", "op"))
                host_f, host_b = host_f + n_moe * mf, host_b + n_moe * mb
        layer = LayerCost(
            name, a, b, self._modules(a, b), fwd, bi, bw, comm, rec, params, params_full, act,
            self._boundary_bytes(b - 1, sol.tp, sol.sequence_parallel, scale), kind, tuple(tied),
            transient_bytes=transient, loss_bytes=loss, loss_peak_bytes=loss_peak, logits_bytes=logits,
            autocast_bytes=cast, autocast_weight_bytes=cast_w, autocast_cache_bytes=cached, autocast_remat_bytes=remat_cast,
            wgrad_bytes=self._wgrad_bytes(nodes, sol, scale, elem), host_fwd_s=host_f, host_bwd_s=host_b,
            autocast_expert_bytes=cast_x, autocast_cast_params=cast_p, autocast_recast_params=recast_p,
            autocast_act=act_cast, autocast_act_recomputed=rc in RECASTING_RECOMPUTE,
        )  # fmt: skip
        return self._quant_states(layer, nodes, sol, scale, rc) if quant else layer

    def _activation_cast_bytes(self, nodes: list[GraphNode], sol: GraphTPSolution, scale: float) -> ActivationCastBytes:
        """Bytes per microbatch of the passes ``nodes``' fp32 activations add under autocast
        (``autocast_casts.activation_cast_bytes``), each tensor the rank's share (``out_shard``). An RMSNorm
        run as its eager Python ops (``norm_kernel`` "eager") is left out: ``eager_ops.eager_rmsnorm_s``
        already prices its fp32 passes (the linears reading its fp32 output still cast it)."""
        def numel(n: Any) -> float:
            return n.out_bytes / dtype_bytes(n.out_dtype) * scale / out_shard(n, sol)

        if self.norm_kernel == "eager":
            nodes = [n for n in nodes if not (n.kind == "norm" and is_python_rmsnorm(n.target))]
        return activation_cast_bytes(nodes, self._fp32_activations, self.g.nodes.__getitem__, numel=numel,
                                     backward_factor=lambda k: sum(backward_factors(k)))

    @functools.cached_property
    def _fp32_activations(self) -> frozenset[int]:
        """Ids of the float tensors that stay fp32 under autocast (``autocast_casts.fp32_activations``)."""
        return fp32_activations(self.g.nodes)

    def _moe_saved_delta(self, nodes: list[GraphNode], sol: GraphTPSolution, scale: float,
                         modules: tuple[str, ...]) -> float:
        """Bytes per microbatch the engine's MoE experts keep beyond the traced eager block's saves
        (``engine_saves.moe_saved_delta``: ``moe_combine``, ``glu_kernel``, the recompute ``modules``)."""
        p = self.profile
        norm = layernorm_recomputed(modules, p.cuda_graph_scope, p.moe_dispatcher)
        return sum(moe_saved_delta(n, self.g.nodes.__getitem__, combine=p.moe_combine, fused_glu=p.glu_kernel == "fused",
                                   modules=modules, norm_recomputed=norm) * scale / saved_shard(n, sol, self.sp_saves)
                   for n in nodes if n.kind == "moe")  # fmt: skip

    def fp8_linears(self, start: int, end: int, *, by_input: bool = False) -> int:
        """Converted fp8 linears among graph nodes ``start``..``end`` (0 unless training in fp8);
        ``by_input``: the distinct inputs they read instead (linears sharing an input, q / k / v or
        gate / up, are one fused Transformer Engine module)."""
        if self.train_dtype != "fp8":
            return 0
        lin = [n for n in self.g.nodes[start:end] if n.kind == "linear" and fp8_eligible(
            n.attrs.get("in_features"), n.attrs.get("out_features"), is_head=n.id in self._heads)]
        return len({n.inputs[:1] for n in lin}) if by_input else len(lin)

    def _fp8_saves_input(self, n: GraphNode) -> bool:
        """Whether linear ``n`` keeps its input in fp8 for backward (a TE fp8 recipe, a converted linear)."""
        a = n.attrs
        return (self.train_dtype == "fp8" and fp8_recipe(self.profile.fp8_recipe).saves_fp8_inputs
                and fp8_eligible(a.get("in_features"), a.get("out_features"), is_head=n.id in self._heads))  # fmt: skip

    @functools.cached_property
    def _autocast_dtype(self) -> bool:
        """Whether the training dtype runs under torch.autocast (bf16, fp16; fp8: torchao's float8
        linears inside a bf16 autocast, their own fp8 weight copies costed apart) on fp32 weights
        (QAT: its fake-quantized weight is cast again; QLoRA: its NF4 bases are dequantized by their
        own layout, ``quant_nodes``, and take no autocast copy, but its adapters, frozen head and
        fp32 norm outputs do, ``_autocast_bytes``)."""
        return self.train_dtype in ("bf16", "fp16", "fp8")

    @functools.cached_property
    def _fp32_under_autocast(self) -> frozenset[int]:
        """Ids of the nodes whose output stays fp32 under ``torch.autocast`` on fp32 parameters
        (``cost_models.host.fp32_under_autocast``)."""
        return fp32_under_autocast(self.g.nodes)

    @functools.cached_property
    def _differentiable(self) -> frozenset[int]:
        """Ids of the nodes that take part in the backward (all but inputs, constants, the output)."""
        return frozenset(n.id for n in self.g.nodes if n.kind not in ("input", "constant", "output"))

    @functools.cached_property
    def _consumers(self) -> dict[int, tuple[int, ...]]:
        """Node id -> the ids of the nodes reading its output (every node has an entry)."""
        out: dict[int, list[int]] = {n.id: [] for n in self.g.nodes}
        for s, d, _ in self.g.edges:
            out.setdefault(s, []).append(d)
        return {k: tuple(v) for k, v in out.items()}

    @functools.cached_property
    def _traced_loss(self) -> bool:
        """Whether the graph traced its loss (read per layer costed: scanned once)."""
        return any(n.kind == "loss" for n in self.g.nodes)

    def _logits(self, nodes: list[GraphNode], sol: GraphTPSolution, scale: float) -> tuple[float, int, int] | None:
        """(tokens, vocab, vocab shard) of the logits a graph without a traced loss returns (the
        engine's cross-entropy: ``memory.loss_buffer_bytes``, ``eager_ops.loss_time_s``): the last
        linear producing ``vocab`` features, vocab-parallel unless the placement gathers its output;
        None when the graph traced its loss or has no such head."""
        vocab = int(self.g.meta.get("vocab") or 0)
        if not vocab or self._traced_loss:
            return None
        head = next((n for n in reversed(nodes) if n.kind == "linear" and n.out_shape and n.out_shape[-1] == vocab), None)
        if head is None:
            return None
        tokens = 1.0
        for d in head.out_shape[:-1]:
            tokens *= d
        shard = 1 if (head.module_fqn in sol.gathered or sol.styles.get(head.module_fqn or "") != "colwise") else sol.tp
        return tokens * scale, vocab, shard



def placement_bucket(micro_batch: int) -> int:
    """Microbatch size the TP placement is solved at for ``micro_batch``: 1, 4 or 16."""
    return 1 if micro_batch < 2 else 4 if micro_batch < 8 else 16


def _float_dtype(nodes: list[GraphNode]) -> str | None:
    for n in nodes:
        if n.out_dtype and "float" in n.out_dtype:
            return n.out_dtype
    return None


def _score_shaped(n: GraphNode, seq_len: int) -> bool:
    sh = n.out_shape
    return bool(sh) and len(sh) >= 2 and sh[-1] == seq_len and sh[-2] == seq_len and seq_len > 1


def _events_comm_s(
    events: list[tuple[int, str, float]], factor: float, tp: int, cluster: ClusterSpec, graph: ModelGraph,
    fp8_gathers: frozenset[tuple[int, str]] = frozenset(),
) -> float:
    """Forward + backward seconds of the placement's collectives at ``factor`` × their bytes
    (``tp.types.collective_passes``: twice, once for a vocab-parallel embedding's all-reduce); a
    sequence-parallel pair in ``fp8_gathers`` (``fp8_gathered_events``) all-gathers in fp8
    (``precision.fp8_gathered_bytes``) and reduce-scatters in bf16."""
    from meshplan.planner.tp.ilp import collective_time

    total = 0.0
    for nid, kind, nbytes in events:
        b = nbytes * factor
        if (nid, kind) in fp8_gathers:
            total += collective_time("all_gather", fp8_gathered_bytes(b), tp, cluster) + collective_time(
                "reduce_scatter", b, tp, cluster)
        else:
            total += collective_passes(graph.nodes[nid].kind, kind) * collective_time(kind, b, tp, cluster)
    return total


def fp8_gathered_events(graph: ModelGraph, heads: set[int]) -> frozenset[tuple[int, str]]:
    """The sequence-parallel collectives (node id, kind) whose all-gather pass moves fp8 under a
    recipe that gathers in fp8 (``Fp8Recipe.gathers_fp8``): the all-gather of a tensor every linear
    consumer of which is a converted fp8 linear (forward: its input cast on the shard), and the
    reduce-scatter after a converted row-parallel linear (backward: its dY gathered in fp8). The
    LM head (``heads``) and anything feeding a non-converted linear gather in bf16."""
    def converted(n: GraphNode) -> bool:
        a = n.attrs
        return n.kind == "linear" and fp8_eligible(a.get("in_features"), a.get("out_features"), is_head=n.id in heads)

    users: dict[int, list[int]] = {}
    for s, d, _ in graph.edges:
        users.setdefault(s, []).append(d)
    out: set[tuple[int, str]] = set()
    for n in graph.nodes:
        if converted(n):
            out.add((n.id, "reduce_scatter"))
        lin = [graph.nodes[d] for d in users.get(n.id, ()) if graph.nodes[d].kind == "linear"]
        if lin and all(converted(x) for x in lin):
            out.add((n.id, "all_gather"))
    return frozenset(out)
