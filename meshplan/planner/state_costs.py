"""Model states and data parallelism of one coster: ``StateCosts``, a collaborator the coster
(``planner.evaluate.ConfigEvaluator.states``) holds.

Under each data-parallel kind's sharding (``cost_models.dp_kinds``) and the engine profile's
conventions (model-state layout, FSDP units, ZeRO-3 implementation, optimizer kernel, DDP
wrapper): model-state bytes per parameter (and per expert parameter under MoE parallel folding,
sharded over the expert data-parallel group), the optimizer step, the DP collectives of a rank's
parameters and what of them a step exposes (``dp_sync``), what a sharded kind holds unsharded and FSDP2's side-stream pools, and the two rules
on when memory peaks apart (autocast's kept copies, gradients after activations). It reads the
coster's cost tables through ``Tables`` (a Protocol: this module sits below the coster) and the
expert data-parallel group from ``planner.epcp_coster.EPCPCosts``. Every memo is the coster's
``CostMemos``. No torch import.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from meshplan.cost_models.allocator import fsdp_stream_pool_bytes
from meshplan.cost_models.compute import node_time
from meshplan.cost_models.contention import overlap_slowdown_s
from meshplan.cost_models.dp_kinds import (
    ZERO3_PERSISTENCE_NUMEL,
    ZERO_STAGE,
    DPComm,
    dp_comm,
    dp_state_bytes,
    shard_degree,
    state_precision,
    state_zero_stage,
    unprefetched_share,
    unsharded_buffer_bytes,
    zero1_broadcast_s,
)
from meshplan.cost_models.ds2021_intervals import ds2021_tensors
from meshplan.cost_models.engine_profiles import EngineProfile
from meshplan.cost_models.engine_saves import fused_linears
from meshplan.cost_models.fsdp_units import UnitLayer, fsdp_step_floor, fsdp_step_peak
from meshplan.cost_models.grad_sync import (
    GRAD_REDUCE_BYTES,
    local_ddp_sync_s,
    overlapped_sync_terms,
    uniform_bucket_runs,
)
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.cost_models.memory import ModelStateBytes, model_state_bytes
from meshplan.cost_models.optimizer_phase import optimizer_step_s, phase_sync
from meshplan.graph import GraphNode, ModelGraph
from meshplan.plan.execution_rules import SHARDED_DP_KINDS
from meshplan.planner.cost_memos import CostMemos
from meshplan.planner.costing import CostTable
from meshplan.planner.dp_exposure import exposed_dp_s
from meshplan.planner.epcp_coster import EPCPCosts
from meshplan.planner.search_types import Config


class Tables(Protocol):
    """What ``StateCosts`` reads of the coster: a configuration's cost table and its prefix sums."""

    def table(self, c: Config) -> CostTable: ...
    def prefix(self, t: CostTable) -> dict[str, list[float]]: ...


def add_dp_comm(a: DPComm, b: DPComm) -> DPComm:
    """Two groups' DP collectives run one after the other (their seconds and bytes add; FSDP units
    as ``a``'s, or ``b``'s when ``a`` has none)."""
    bytes_ = {k: a.bytes.get(k, 0) + b.bytes.get(k, 0) for k in sorted(set(a.bytes) | set(b.bytes))}
    return DPComm(sync_s=a.sync_s + b.sync_s, gather_s=a.gather_s + b.gather_s,
                  per_microbatch_s=a.per_microbatch_s + b.per_microbatch_s, bytes=bytes_,
                  mb_forward_s=a.mb_forward_s + b.mb_forward_s, mb_bwd_gather_s=a.mb_bwd_gather_s + b.mb_bwd_gather_s,
                  units=a.units if a.per_microbatch_s else b.units, mb_serial_s=a.mb_serial_s + b.mb_serial_s)  # fmt: skip


class StateCosts:
    """Model states, optimizer step and DP collectives of one coster (see the module docstring)."""

    def __init__(self, graph: ModelGraph, cluster: ClusterSpec, *, dtype: str, optimizer: str,
                 profile: EngineProfile, elem_bytes: int, memos: CostMemos, tables: Tables, ep_cp: EPCPCosts,
                 quant_mode: str = "none") -> None:
        self.g = graph
        self.quant_mode = quant_mode  # Plan.quantization's mode: "none", "qat" or "qlora"
        self.cluster = cluster
        self.dtype = dtype
        self.optimizer = optimizer
        self.memos = memos
        self.tables = tables
        self.ep_cp = ep_cp
        # whose model-state layout (dp_kinds.STATE_LAYOUTS): "torch" = meshplan's runtime (fp32 parameters
        # and optimizer states on every path); an engine's configuration is costed with its own
        self.state_layout = profile.state_layout
        # the gradient buffer's dtype a recipe sets (dp_kinds.MAIN_GRADS; None = the layout's own rule)
        self.main_grads = profile.main_grads
        # what the model-state bytes depend on, for the memo keys
        self.layout_key = (self.state_layout, self.main_grads)
        # meshplan's runtime with 16-bit weights (runtime/apply/master_state.py): its gradients reduced by
        # BucketedGradSync (no DDP), so at pp = 1 their flat fp32 copies exist at the backward's end
        self.master_state = profile.engine == "meshplan" and profile.state_layout in ("megatron", "zero")
        # what a sharded kind gathers at once (dp_kinds.FSDP_UNITS): "block" = FSDP2 per repeated block,
        # as meshplan's runtime wraps; "module" = DeepSpeed ZeRO-3's per-module gathers (an engine's)
        self.fsdp_units = profile.fsdp_units
        # how its ZeRO-3 runs the collectives (dp_kinds.ZERO3_IMPLS): FSDP2's, or DeepSpeed 2021's
        # per-tensor gathers (three under full recompute) and 16-bit gradient all-reduce
        self.zero3_impl = profile.zero3_impl
        # how the engine runs the optimizer update (cost_models.optimizer_phase.OPTIMIZER_IMPLS) and whether
        # its host waits for the device inside the phase (OPTIMIZER_SYNCS)
        self.optimizer_impl = profile.optimizer_impl
        self.optimizer_sync = profile.optimizer_sync
        # how ddp reduces gradients (grad_sync.DDP_IMPLS): "torch" = bucketed and overlapped with the
        # last backward, as meshplan's runtime and torch DDP run it; "local" = Megatron-LM's own
        # wrapper, one flat all-reduce after backward
        self.ddp_impl = profile.ddp_impl
        # how zero1 communicates (dp_kinds.ZERO1_IMPLS): "torch" = meshplan's runtime, DDP's all-reduce +
        # one broadcast per parameter tensor after the update; "bucketed" = Megatron / DeepSpeed buckets
        self.zero1_impl = profile.zero1_impl
        # whether a sharded kind shards over dp x cp (EngineProfile.shard_over_cp: torchtitan's FSDP mesh)
        self.shard_over_cp = profile.shard_over_cp
        # trainable parameter tensors of the model (a tied parameter once) and their elements: a
        # pipeline rank's share of the tensors is taken in proportion to its parameters (zero1 "torch")
        self.param_tensors = len({p for n in graph.nodes if n.param_numel - n.frozen_param_numel > 0
                                  for p in n.param_names})  # fmt: skip
        self.param_numel = sum(n.param_numel - n.frozen_param_numel for n in graph.nodes)
        # of those, the repeated blocks' linear weights and biases: what tensor parallelism turns into
        # DTensors (the runtime's styles shard the blocks' linears; embeddings, norms and head replicate)
        self.tp_param_tensors = len({p for n in graph.nodes if n.kind == "linear" and n.block is not None
                                     and n.param_numel - n.frozen_param_numel > 0 for p in n.param_names})  # fmt: skip
        # bytes per element of the gradients DP syncs and of the parameters FSDP gathers (the training dtype's)
        self.elem_bytes = elem_bytes
        # bytes per element the gradient collectives move (EngineProfile.grad_reduce): fp32 (FSDP2's
        # reduce_dtype, meshplan's runtime) or the training dtype (torch FSDP1 under Composer's mixed precision)
        self.grad_reduce_bytes = GRAD_REDUCE_BYTES if profile.grad_reduce == "fp32" else elem_bytes
        self.largest_linear = max((n.param_numel for n in graph.nodes if n.kind == "linear"), default=0)
        # parameter tensors a per-tensor ZeRO-3 gathers one by one (the rest stay whole on every rank:
        # DeepSpeed's stage3_param_persistence_threshold); the linears an engine fuses
        # (EngineProfile.fused_projections: Megatron-LM's query_key_value) are one tensor
        fused = fused_linears(graph.nodes, lambda n: None, lambda n: 1) if profile.fused_projections else {}
        self.gathered_sizes = [float(m.param_numel) for n in graph.nodes
                               if (m := fused.get(n.id, n)) is not None and m.param_numel >= ZERO3_PERSISTENCE_NUMEL]
        # DeepSpeed 2021's gathered tensors in forward order with the share of the compute each one's
        # module runs before the next one's device-wide sync (cost_models.ds2021_intervals)
        self.ds_layout = ds2021_tensors(
            graph.nodes, lambda n: _gathered(fused, n),
            lambda n: _seconds(fused, n, cluster, dtype, profile)) if self.zero3_impl == "deepspeed-2021" else ()
        # FSDP units at pp = 1: the runtime wraps every repeated block, then the root
        self.fsdp_unit_count = sum(len(b.instances) for b in graph.blocks) + 1

    # ---- model states ---------------------------------------------------------------------
    @property
    def precision(self) -> str:
        """The ``memory.PRECISIONS`` row of the model states (``dp_kinds.state_precision``)."""
        return state_precision(self.state_layout, self.dtype, self.main_grads)

    @property
    def unsharded_state_bytes(self) -> ModelStateBytes:
        """Model-state bytes per parameter without sharding (memoized per layout: read per stage)."""
        key = (self.layout_key, self.dtype, self.optimizer)
        if key not in self.memos.unsharded:
            self.memos.unsharded[key] = model_state_bytes(1.0, optimizer=self.optimizer, precision=self.precision)
        return self.memos.unsharded[key]

    def state_dp(self, c: Config) -> int:
        """Ranks a sharded kind of ``c`` spreads its states over: dp, or dp x cp where the engine folds
        the context-parallel ranks into its sharding mesh (``EngineProfile.shard_over_cp``; cp ranks
        are tp apart too in the (pp, dp, cp, tp) mesh, so the group keeps stride tp)."""
        if self.shard_over_cp and c.cp > 1 and c.dp_kind is not None and ZERO_STAGE[c.dp_kind] >= 1:
            return c.dp * c.cp
        return c.dp

    def state_bytes_per_param(self, c: Config) -> ModelStateBytes:
        """Model-state bytes per parameter under ``c``'s DP kind over dp (ranks tp apart; ``state_dp``)."""
        key = (c.dp_kind, self.state_dp(c), c.tp, self.layout_key)
        if key not in self.memos.state_bytes:
            self.memos.state_bytes[key] = dp_state_bytes(1.0, c.dp_kind, self.state_dp(c), stride=c.tp, optimizer=self.optimizer,
                                                  devices_per_node=self.cluster.devices_per_node,
                                                  precision=self.precision, layout=self.state_layout)  # fmt: skip
        return self.memos.state_bytes[key]

    def expert_state_bytes_per_param(self, c: Config) -> ModelStateBytes:
        """Model-state bytes per expert parameter under folding: sharded over the expert dp group."""
        grp, gst = self.ep_cp.expert_dp_group(c)
        key = (c.dp_kind, -grp, gst, self.layout_key)  # the same engine layout as state_bytes_per_param
        if key not in self.memos.state_bytes:
            self.memos.state_bytes[key] = dp_state_bytes(1.0, c.dp_kind, grp, stride=gst, optimizer=self.optimizer,
                                                  devices_per_node=self.cluster.devices_per_node,
                                                  precision=self.precision, layout=self.state_layout)  # fmt: skip
        return self.memos.state_bytes[key]

    def total_state_bytes(self, params: float, c: Config) -> float:
        """Model-state bytes of ``params`` parameters under ``c``'s DP kind (the lower bound's)."""
        return dp_state_bytes(params, c.dp_kind, self.state_dp(c), stride=c.tp, devices_per_node=self.cluster.devices_per_node,
                              optimizer=self.optimizer, precision=self.precision, layout=self.state_layout).total  # fmt: skip

    def shard(self, c: Config) -> int:
        """Ranks ``c``'s model states are sharded over (``dp_kinds.shard_degree``; mesh (pp, dp, tp):
        a DP group's ranks are tp apart)."""
        return shard_degree(c.dp_kind, self.state_dp(c), stride=c.tp, devices_per_node=self.cluster.devices_per_node)

    def zero_divs(self, c: Config) -> tuple[int, int, int]:
        """Divisors of (parameter, gradient, optimizer) bytes under ``c``'s ZeRO stage (memoized)."""
        key = (c.dp_kind, self.state_dp(c), c.tp, self.state_layout)
        if key not in self.memos.zero_divs:
            s, z = self.shard(c), state_zero_stage(c.dp_kind, self.state_layout)
            self.memos.zero_divs[key] = (s if z >= 3 else 1, s if z >= 2 else 1, s if z >= 1 else 1)
        return self.memos.zero_divs[key]

    def optimizer_s(self, params: float, c: Config) -> float:
        """Optimizer step on the rank's shard with gradient-norm clipping (``optimizer_phase.optimizer_step_s``:
        the kernels' bytes by ``optimizer_impl``, fused 28 B/param + 12 B clipping, + 6 B for the masters'
        copy into 16-bit weights where the state layout keeps fp32 masters, and the host's work per
        parameter tensor, composed by ``optimizer_sync``, "host-wait" under fp16: ``phase_sync``).
        Memoized per (params, and the fields of ``c`` it reads: kind, sharding group, tp, pp)."""
        key = (params, c.dp_kind, self.state_dp(c), c.tp, c.pp)
        hit = self.memos.optimizer.get(key)
        if hit is None:
            hit = self.memos.optimizer[key] = self._optimizer_s(params, c)
        return hit

    def _optimizer_s(self, params: float, c: Config) -> float:
        local = params / self.zero_divs(c)[2]
        tensors = self.optimizer_tensors(params, c)
        step = optimizer_step_s(local, self.cluster, impl=self.optimizer_impl, optimizer=self.optimizer,
                                tensors=tensors, sync=phase_sync(self.optimizer_sync, self.dtype),
                                master_copy=self.precision != "fp32")
        if self.cluster.host_dtensor_param_s and self.param_tensors:
            step += self.dtensor_tensors(tensors, c) * self.cluster.host_dtensor_param_s
        return step

    def dtensor_tensors(self, tensors: float, c: Config) -> float:
        """Of the rank's ``tensors`` optimizer tensors, the DTensors (``ClusterSpec.host_dtensor_param_s``
        each, a CPU host's figure: ``profile.tp_host``): every one under FSDP2 (a sharded kind over dp > 1,
        the "torch" state layout: ``fully_shard`` makes each parameter a DTensor shard), else under
        tp > 1 the blocks' linear weights and biases (``tp_param_tensors``), each held by every tp rank
        as a shard, split evenly over the pipeline stages (the blocks are)."""
        if self.state_layout == "torch" and c.dp_kind in SHARDED_DP_KINDS and self.state_dp(c) > 1:
            return tensors
        if c.tp > 1:
            return self.tp_param_tensors / c.pp
        return 0.0

    def optimizer_tensors(self, params: float, c: Config) -> float:
        """Parameter tensors the rank's optimizer step loops over for ``params`` of its stage's parameters:
        the model's trainable tensors in proportion to the parameters; FSDP2's per-parameter DTensor shards
        (fsdp, zero2, hsdp under the "torch" state layout) keep every tensor, a flat-partitioned optimizer
        (zero1: ZeroRedundancyOptimizer, Megatron's distributed optimizer, DeepSpeed) holds 1/shard of them."""
        if not self.param_numel:
            return 0.0
        tensors = self.param_tensors * params / self.param_numel
        if self.state_layout == "torch" and c.dp_kind in SHARDED_DP_KINDS:
            return tensors
        return tensors / self.zero_divs(c)[2]

    # ---- when memory peaks apart ------------------------------------------------------------
    def runs_autocast(self, c: Config) -> bool:
        """Whether ``c`` trains under ``torch.autocast`` on fp32 parameters, as meshplan's runtime
        (``runtime/precision.py``) and torchtitan do whenever FSDP2's MixedPrecisionPolicy does not
        hold the parameters in the compute dtype (no sharded DP kind over dp > 1); Megatron-LM and
        DeepSpeed keep 16-bit parameters instead (their ``state_layout``)."""
        return self.state_layout == "torch" and not (self.state_dp(c) > 1 and c.dp_kind in SHARDED_DP_KINDS)

    def grads_after_activations(self, c: Config) -> bool:
        """Whether no gradient of ``c`` outlives the backward that makes it before the next
        microbatch's activations exist: one microbatch, no pipeline, no recompute, and no data
        parallelism or a sharded kind (FSDP2: fsdp, zero2, hsdp), as meshplan's runtime and
        torchtitan step (gradients set to None after the optimizer): the peak holds the larger of
        activations (backward's start) and gradients (its end, beside the first layer's
        rematerialized activations under recompute), not both. FSDP2's per-unit unsharded
        gradients and fp32 reduce-scatter copies are its buffers (``fsdp_buffers``), counted
        beside. Measured on benchmarks/bench_memory.py (4 blocks): fsdp -2.4 %, zero2 -5.3 %, hsdp
        -3.2 % with the rule, +15.5 / +10.4 / +7.0 % without (an earlier harness, whose tracker
        hooks leaked autograd nodes, had shown +4 to +12 % and -5 to -14 %). Under torch's DDP
        (ddp, zero1) too, its Reducer's buckets counted beside (``ddp_bucket_bytes``), and under
        meshplan's own bucketed reduction (``grad_sync_flats``), its flat copies at the backward's end."""
        return (self.state_layout == "torch" and c.pp == 1 and c.num_microbatches == 1
                and (c.dp * c.cp == 1 or c.dp_kind in ("fsdp", "zero2", "hsdp")
                     or self.ddp_buckets(c) or self.grad_sync_flats(c)))

    def ddp_buckets(self, c: Config) -> bool:
        """Whether ``c`` runs torch's DistributedDataParallel over its parameters (ddp, zero1 at pp = 1
        in meshplan's runtime, ``runtime/apply/data_parallel.wrap_dp``; ``ddp_impl`` "torch", the
        "torch" state layout). Not under cp or ep: there the runtime reduces the gradients with its
        own ``BucketedGradSync`` over dp x cp (``runtime/apply/steps.apply_epcp_step``, mode "epcp";
        ``grad_sync_flats``)."""
        return (c.pp == 1 and c.dp_kind in ("ddp", "zero1") and c.dp > 1 and c.cp * c.ep == 1
                and self.ddp_impl == "torch" and self.state_layout == "torch")

    def grad_sync_flats(self, c: Config) -> bool:
        """Whether ``c``'s gradients are reduced by meshplan's ``BucketedGradSync`` at pp = 1 under cp or
        ep (ddp, zero1, none: ``runtime/apply/epcp.py`` attach), or at dp > 1 under the runtime's 16-bit
        weights (``master_state``: the fp32 main gradients, every bucket): each bucket's gradients are
        flattened into a new buffer when the bucket is final in the last backward and written back
        in ``finish()`` after it, so at the backward's end every gradient has its flat copy beside
        it (``runtime/apply/grad_sync.py``), and nothing of it lives in the forward."""
        if self.master_state:  # 16-bit weights: BucketedGradSync reduces the fp32 main gradients at any dp (no DDP)
            return c.pp == 1 and c.dp_kind in ("ddp", "zero1", "none") and c.dp * c.cp > 1
        return (c.pp == 1 and c.dp_kind in ("ddp", "zero1", "none") and c.dp * c.cp > 1 and c.cp * c.ep > 1
                and self.ddp_impl == "torch" and self.state_layout == "torch")

    def ddp_bucket_bytes(self, c: Config, params: float) -> float:
        """DDP's Reducer buckets for ``params`` trainable parameters (``ddp_buckets``): flat copies
        of every gradient in the parameters' dtype (``gradient_as_bucket_view=False``, torch's
        default and the runtime's), allocated when DDP is built and held for the run, beside the
        ``.grad`` tensors. Under fake tensors (``benchmarks/fake_memory.py``) ddp with 2 microbatches
        tracked 641 MiB where the model without them gave 528 (-17.7 %)."""
        return params * self.state_bytes_per_param(c).params if self.ddp_buckets(c) else 0.0

    def embedding_grad_extra(self, c: Config) -> float:
        """Gradient bytes a vocab-parallel embedding holds beyond its shard under torch's DTensor TP
        (the "torch" state layout's engines: meshplan's runtime, torchtitan): DTensor's
        ``embedding_dense_backward`` strategy (``torch/distributed/tensor/_ops/_embedding_ops.py``)
        offers a Shard(1) or Partial weight gradient, none on Shard(0) (RowwiseParallel's vocab
        shard), so the gradient is computed whole on every rank and the sharded ``.grad`` is a view
        of it: the whole storage lives until the gradients are dropped. The layers before the first
        repeated block (token / position embeddings), full minus held parameters; 0 without tp,
        under a sharded kind (FSDP2 copies it into its reduce-scatter input; not priced here) or
        another layout (Megatron's VocabParallelEmbedding computes its shard's gradient)."""
        full, held = self._pre_block_params(c)
        return max(0.0, full - held) * self.state_bytes_per_param(c).grads

    def embedding_grad_new(self, c: Config) -> float:
        """Where ``embedding_grad_extra`` holds and gradients accumulate over microbatches: the whole
        gradient DTensor's ``embedding_dense_backward`` computes again in every later microbatch's
        backward, beside the accumulated one, before it is added in (bytes; 0 otherwise). Measured
        under PyTorch's fake-tensor accounting (``tests/test_memory_fake.py``, pp2 x tp2 rank 0)."""
        if c.num_microbatches < 2:
            return 0.0
        full, held = self._pre_block_params(c)
        return full * self.state_bytes_per_param(c).grads if full > held else 0.0

    def _pre_block_params(self, c: Config) -> tuple[float, float]:
        """(whole, held) parameter counts of the layers before the first repeated block (token /
        position embeddings) where a vocab-parallel embedding's gradient is computed whole (DTensor
        TP under the "torch" state layout, ZeRO below 2); (0, 0) otherwise."""
        if c.tp == 1 or self.state_layout != "torch" or ZERO_STAGE[c.dp_kind] >= 2:
            return 0.0, 0.0
        t = self.tables.table(c)
        hit = self.memos.pre_block.get(id(t))  # per table (the coster keeps its tables: ids stay unique)
        if hit is None:
            full = held = 0.0
            for x in t.layers:
                if x.kind == "block":
                    break
                full, held = full + x.param_count_full, held + min(x.param_count, x.param_count_full)
            hit = self.memos.pre_block[id(t)] = (full, held)
        return hit

    # ---- what a sharded kind holds unsharded --------------------------------------------------
    def fsdp_buffer(self, c: Config, stage_params: float = 0.0) -> float:
        """What a parameter-sharding kind holds unsharded (``dp_kinds.unsharded_buffer_bytes``:
        two layers' weights at pp = 1, the stage's weights and gradients under PP; else 0). Where
        ``fsdp_steps`` prices the step unit by unit, the least it adds (``fsdp_units.fsdp_step_floor``:
        the memory floors' share; ``evaluate`` takes ``fsdp_step_peak``)."""
        if self.fsdp_steps(c):
            e, units = self.elem_bytes, self.fsdp_units
            return fsdp_step_floor(self.unit_layers(c), elem_bytes=e, reduce_bytes=GRAD_REDUCE_BYTES, units=units)
        return unsharded_buffer_bytes(
            c.dp_kind, self.state_dp(c), stage_param_count=stage_params, elem_bytes=self.elem_bytes, pp=c.pp,
            largest_layer_params=self.largest_unit(c), layout=self.state_layout,
        )  # fmt: skip

    def fsdp_buffers(self, c: Config, rank_params: list[float], runs: list[tuple[int, int]] | None = None,
                     on_rank: list[list[int]] | None = None) -> list[float]:
        """``fsdp_buffer`` of every pipeline rank (its parameters ``rank_params[r]``), the table looked up once.
        Under QLoRA with the stages' layer ranges ``runs`` and each rank's stages ``on_rank``: a rank's
        gathered bytes (``LayerCost.gather_bytes``: NF4 bases as stored) and its adapters' gradients."""
        if self.fsdp_steps(c):
            return [self.fsdp_buffer(c)]
        sdp = self.state_dp(c)
        if ZERO_STAGE.get(c.dp_kind, 3) < 2 or sdp == 1:  # unsharded_buffer_bytes: nothing held unsharded
            return [0.0 for _ in rank_params]
        largest = self.largest_unit(c)
        kw = dict(elem_bytes=self.elem_bytes, pp=c.pp, largest_layer_params=largest, layout=self.state_layout)
        if self.quant_mode == "qlora" and runs is not None and on_rank is not None:
            t = self.tables.table(c)
            idx = [[i for s_ in stages for i in range(*runs[s_])] for stages in on_rank]
            big = max(x.gather_bytes for x in t.layers)
            return [unsharded_buffer_bytes(c.dp_kind, self.state_dp(c), stage_param_count=p,
                                           gathered_bytes=sum(t.layers[i].gather_bytes for i in ix),
                                           grad_params=sum(t.layers[i].trainable_params for i in ix),
                                           largest_gathered_bytes=big, **kw)  # type: ignore[arg-type]
                    for p, ix in zip(rank_params, idx)]  # fmt: skip
        return [unsharded_buffer_bytes(c.dp_kind, sdp, stage_param_count=p, **kw)  # type: ignore[arg-type]
                for p in rank_params]  # fmt: skip

    def fsdp_steps(self, c: Config) -> bool:
        """Whether ``c``'s sharded step is priced unit by unit (``fsdp_units.fsdp_step_peak``): FSDP2
        per block (units "block" / "block-ends") resharding after forward (fsdp, hsdp) over more than
        one rank, no pipeline, any quantization (meshplan's runtime wraps QLoRA and QAT models per
        block too: ``runtime/apply/steps._wrap_dp``), no expert parallelism or MoE
        folding, and a model with repeated blocks (a graph without them, e.g. a CNN or a small MLP,
        is one FSDP unit: the two-layer buffer of ``dp_kinds.unsharded_buffer_bytes``)."""
        return (c.pp == 1 and c.dp_kind in ("fsdp", "hsdp") and self.fsdp_units in ("block", "block-ends")
                and c.ep == 1 and not self.ep_cp.moe_folding
                and self.shard(c) > 1 and any(u.kind == "block" for u in self.unit_layers(c)))

    def unit_layers(self, c: Config) -> list[UnitLayer]:
        """``c``'s cost-table layers as FSDP2 units see them (memoized per table). Under QLoRA a unit
        gathers its NF4 bases as stored and the rest in the training dtype (``LayerCost.gather_bytes``),
        only the adapters have gradients (``LayerCost.trainable_params``; every other layer is frozen),
        and a block's largest NF4 weight is dequantized inside its forward and backward
        (``LayerCost.work_bytes``)."""
        t = self.tables.table(c)
        if id(t) not in self.memos.units:
            qlora = self.quant_mode == "qlora"
            whole = c.tp > 1 and self.state_layout == "torch" and not qlora  # embedding_grad_extra's DTensor gradient
            first = next((i for i, x in enumerate(t.layers) if x.kind == "block"), len(t.layers))
            self.memos.units[id(t)] = [UnitLayer(x.kind, x.param_count, x.act_bytes, x.transient_bytes,
                                                 sum(p for _, p in x.tied),
                                                 float(x.param_count_full) if whole and i < first else -1.0,
                                                 gather_bytes=x.gather_bytes if qlora else -1.0,
                                                 trainable=x.trainable_params if qlora else -1.0, work=x.work_bytes)
                                       for i, x in enumerate(t.layers)]  # fmt: skip
        return self.memos.units[id(t)]

    def fsdp_step_peak(self, c: Config, acts: float) -> float:
        """``fsdp_units.fsdp_step_peak`` of ``c`` (``fsdp_steps``): beyond the sharded parameters and
        optimizer states, with ``acts`` held at the backward's start; the sharded gradients are
        held for the whole backward unless they come after the activations (one microbatch)."""
        return fsdp_step_peak(self.unit_layers(c), acts=acts, grad_bytes=self.state_bytes_per_param(c).grads,
                              grads_held=not self.grads_after_activations(c), elem_bytes=self.elem_bytes,
                              reduce_bytes=GRAD_REDUCE_BYTES, units=self.fsdp_units)  # fmt: skip

    def largest_unit(self, c: Config) -> float:
        """Parameters per rank of the largest unit a sharded kind gathers (``dp_kinds.FSDP_UNITS``):
        the largest layer (block, or the root's embedding / head), or under "module" the largest
        linear (its TP shard)."""
        if self.fsdp_units == "module":
            return self.largest_linear / c.tp
        return self.tables.prefix(self.tables.table(c))["largest"][0]

    def stream_pools(self, c: Config, t: CostTable, runs: list[tuple[int, int]], on_rank: list[list[int]]) -> float:
        """The largest of the pipeline ranks' FSDP2 side-stream pools (``allocator.fsdp_stream_pool_bytes``):
        units are a rank's repeated blocks and its other layers together (the root's, or its stage's,
        ``fully_shard``); 0 for kinds that do not run FSDP2 (ddp, zero1) or without sharding.
        ``runs``: the stages' layer ranges, ``on_rank``: each pipeline rank's stages (memoized per
        table, split and placement: the same for every configuration sharing them). Under QLoRA a
        unit's all-gather output is its gathered bytes (``LayerCost.gather_bytes``) and its
        reduce-scatter input its adapters' gradients."""
        if ZERO_STAGE[c.dp_kind] < 2 or self.shard(c) == 1 or self.fsdp_units == "module":
            return 0.0
        key = (id(t), tuple(runs), tuple(tuple(x) for x in on_rank))
        if key not in self.memos.pools:
            pools = []
            qlora = self.quant_mode == "qlora"
            for stages in on_rank:
                idx = [i for s_ in stages for i in range(*runs[s_])]
                units = [[i] for i in idx if t.layers[i].kind == "block"]
                rest = [i for i in idx if t.layers[i].kind != "block"]
                if self.fsdp_units == "block-ends" and units:  # the embedding's and the head's own units
                    first = next(i for i in idx if t.layers[i].kind == "block")
                    units += [[i for i in rest if i < first], [i for i in rest if i > first]]
                else:
                    units.append(rest)
                if qlora:  # flat buffers: gathered bytes on one stream, the adapters' fp32 gradients on the other
                    gathered = [sum(t.layers[i].gather_bytes for i in u) for u in units]
                    grads = [sum(t.layers[i].trainable_params for i in u) for u in units]
                    pools.append(fsdp_stream_pool_bytes(gathered, param_bytes=1.0, reduce_bytes=0.0)
                                 + fsdp_stream_pool_bytes(grads, param_bytes=0.0, reduce_bytes=GRAD_REDUCE_BYTES))
                    continue
                params = [sum(t.layers[i].param_count for i in u) for u in units]
                pools.append(fsdp_stream_pool_bytes(params, param_bytes=self.elem_bytes, reduce_bytes=GRAD_REDUCE_BYTES))
            self.memos.pools[key] = max(pools, default=0.0)
        return self.memos.pools[key]

    # ---- DP collectives ---------------------------------------------------------------------
    def dp_collectives(self, params_bytes: float, grad_bytes: float, c: Config) -> DPComm:
        """The DP collectives of a rank's ``params_bytes`` gathered and ``grad_bytes`` reduced over
        dp·cp (``dp_kinds.dp_comm``, the profile's ZeRO-3 implementation). Memoized per (bytes, and the
        fields of ``c`` it reads): DDP's buckets are mostly of one size (read only)."""
        key = (params_bytes, grad_bytes, c.dp_kind, c.dp * c.cp, c.tp, c.pp, c.num_microbatches, c.recompute == "full")
        hit = self.memos.dp_collectives.get(key)
        if hit is None:
            hit = self.memos.dp_collectives[key] = self._dp_collectives(params_bytes, grad_bytes, c)
        return hit

    def _dp_collectives(self, params_bytes: float, grad_bytes: float, c: Config) -> DPComm:
        per_tensor = self.zero3_impl == "deepspeed-2021"  # the share gathered only when needed, at its tp shard
        late = unprefetched_share([x / c.tp for x in self.gathered_sizes]) if per_tensor else 0.0
        return dp_comm(c.dp_kind, grad_bytes, params_bytes, c.dp * c.cp, self.cluster, stride=c.tp, pp=c.pp,
                       num_microbatches=c.num_microbatches, units=self.fsdp_unit_count, impl=self.zero3_impl,
                       recompute_regather=c.recompute == "full", tensors=len(self.gathered_sizes),
                       unprefetched=late, layout=self.ds_layout)  # fmt: skip

    def dp_collectives_split(self, params_bytes: float, grad_bytes: float, expert_params: float, c: Config) -> DPComm:
        """``dp_collectives``; with ``expert_params`` (> 0 only under MoE parallel folding: the rank's
        held expert parameters) those are gathered / reduced over the expert data-parallel group
        (``EPCPCosts.expert_dp_group``) and the rest over dp·cp, one after the other (two communicators)."""
        if expert_params <= 0 or c.dp_kind in ("none", "ddp"):  # ddp's split is evaluate's (bucketed)
            return self.dp_collectives(params_bytes, grad_bytes, c)
        eg, ep_ = expert_params * self.grad_reduce_bytes, expert_params * self.elem_bytes
        dense = self.dp_collectives(params_bytes - ep_, grad_bytes - eg, c)
        grp, gst = self.ep_cp.expert_dp_group(c)
        exp = dp_comm(c.dp_kind, eg, ep_, grp, self.cluster, stride=gst, pp=c.pp,
                      num_microbatches=c.num_microbatches, units=self.fsdp_unit_count)  # fmt: skip
        return add_dp_comm(dense, exp)

    def dp_sync(self, c: Config, *, grad_bytes: float, gather_bytes: float, experts: float, backward_s: float,
                forward_s: float, microbatch_s: float, params: float, quantized: bool,
                recompute_s: float = 0.0) -> tuple[DPComm, float]:
        """(collectives, exposed seconds) of ``c``'s data-parallel sync on its busiest rank, which
        reduces ``grad_bytes`` of gradients, gathers ``gather_bytes`` of parameters, holds
        ``experts`` expert parameters (its share under ep) and ``params`` parameters, and spends
        ``backward_s`` (of which ``recompute_s`` re-runs the forward) / ``forward_s`` per step and ``microbatch_s`` per microbatch: Megatron-LM's
        local DDP after backward, DDP's buckets overlapped with the last backward (expert gradients
        over their own group; torch's ZeroRedundancyOptimizer on gloo: the same, then a broadcast per
        parameter tensor), or a sharded kind's collectives as ``dp_exposure.exposed_dp_s`` exposes them."""
        folded = self.ep_cp.moe_folding and c.tp > 1
        # torch's ZeroRedundancyOptimizer (dp_kinds.ZERO1_IMPLS "torch", meshplan's runtime): DDP's
        # gradient all-reduce, then one broadcast per parameter tensor after the update. Priced where it
        # was measured (gloo: benchmarks/bench_calibrate.py); on NCCL the runtime runs the same
        # broadcasts, still costed as bucketed ZeRO-1 until a GPU run checks them (BENCHMARKS.md,
        # "Wave 3 stop 4: calibration transfer")
        torch_zero1 = (c.dp_kind == "zero1" and self.zero1_impl == "torch" and self.cluster.comm_backend == "gloo"
                       and c.dp * c.cp > 1 and not folded and c.ep == 1 and not quantized)  # fmt: skip
        cd = replace(c, dp_kind="ddp") if torch_zero1 else c  # the configuration whose collectives DP runs
        d = self.dp_collectives_split(gather_bytes, grad_bytes, experts if folded else 0.0, cd)
        if c.dp_kind == "ddp" and c.dp * c.cp > 1 and self.ddp_impl == "local":
            # Megatron-LM's local DDP: one flat all-reduce of the gradients in the training dtype
            # after backward, nothing overlapped, no SMs taken from compute (grad_sync.local_ddp_sync_s)
            gb = grad_bytes / self.grad_reduce_bytes * self.elem_bytes
            d = self.dp_collectives(gb, gb, c)
            exposed = local_ddp_sync_s(gb, lambda b: self.dp_collectives(b, b, c).sync_s,
                                       self.cluster.mem_bw_bytes_per_s * self.cluster.mem_efficiency)  # fmt: skip
        elif c.dp_kind == "zero1" and c.dp * c.cp > 1 and self.ddp_impl == "local" and not folded:
            # Megatron-LM's distributed optimizer before --overlap-grad-reduce (e801b2b, 2023-09): training.py
            # train_step calls optimizer.reduce_model_grads after forward_backward_func (distrib_optimizer.py:
            # _reduce_scatter_base per gradient buffer) and gather_model_params after the step
            # (_all_gather_base): both after the compute, nothing overlapped (tag 23.06)
            exposed = d.sync_s + d.gather_s
        elif (c.dp_kind == "ddp" or torch_zero1) and c.dp * c.cp > 1:  # cp ranks hold the same weights: reduced too
            # what the runtime executes (cost_models.grad_sync): fp32 gradients in 25 MiB buckets,
            # each all-reduced (NCCL-costed over the DP group's layout) as soon as it is final in
            # the last microbatch's backward
            exp_b = experts * self.grad_reduce_bytes if c.ep > 1 or folded else 0.0  # the rank's stages
            exposed, hid = overlapped_sync_terms(
                uniform_bucket_runs(grad_bytes - exp_b), backward_s, lambda b: self.dp_collectives(b, b, cd).sync_s)
            grp, gst = self.ep_cp.expert_dp_group(c)
            if exp_b and grp > 1:  # ep: expert gradients over their replicas only (runtime/epcp; folded: EDP)
                rep = dp_comm("ddp", exp_b, exp_b, grp, self.cluster, stride=gst)
                e_x, h_x = overlapped_sync_terms(
                    uniform_bucket_runs(exp_b), backward_s,
                    lambda b: dp_comm("ddp", b, b, grp, self.cluster, stride=gst).sync_s)
                exposed, hid = exposed + e_x, hid + h_x
                d = replace(d, bytes={"all_reduce": d.bytes.get("all_reduce", 0) - int(exp_b)
                                      + rep.bytes.get("all_reduce", 0)})
            elif exp_b:
                d = replace(d, bytes={"all_reduce": d.bytes.get("all_reduce", 0) - int(exp_b)})
            # only the share comm_overlap of the hidden buckets is hidden (ClusterSpec.comm_overlap); their
            # NCCL kernels hold SMs the backward they overlap needs (cost_models.contention)
            phi = self.cluster.comm_overlap
            exposed += (1.0 - phi) * hid + overlap_slowdown_s(phi * hid, backward_s, self.cluster)
            if torch_zero1:  # + the per-tensor broadcasts after the update, waited for (exposed)
                # every tensor at pp = 1; a pipeline rank's share in proportion to its parameters
                share = 1.0 if c.pp == 1 else params / max(1.0, self.param_numel)
                bcast = params * self.state_bytes_per_param(c).params
                exposed += zero1_broadcast_s(bcast, self.param_tensors * share, c.dp * c.cp, self.cluster,
                                             stride=c.tp)  # fmt: skip
                d = replace(d, bytes={**d.bytes, "broadcast": int(bcast)})
        else:
            exposed = exposed_dp_s(d, backward_s=backward_s, forward_s=forward_s, microbatch_s=microbatch_s,
                                   num_microbatches=c.num_microbatches, cluster=self.cluster,
                                   recompute_s=recompute_s)  # fmt: skip
        return d, exposed


def _gathered(fused: dict, n: GraphNode) -> float:
    """Elements a per-tensor ZeRO-3 gathers at node ``n``: its (fused) parameters at or above the
    persistence threshold, else 0 (``fused``: ``engine_saves.fused_linears``, None = fused away)."""
    m = fused.get(n.id, n)
    return float(m.param_numel) if m is not None and m.param_numel >= ZERO3_PERSISTENCE_NUMEL else 0.0


def _seconds(fused: dict, n: GraphNode, cluster: ClusterSpec, dtype: str, profile: EngineProfile) -> tuple[float, float]:
    """(forward, backward) seconds of node ``n`` at the traced batch under ``profile``'s kernels (0 for a
    node fused into another): the weights of a step's compute between two syncs (``ds2021_tensors``)."""
    m = fused.get(n.id, n)
    if m is None:
        return 0.0, 0.0
    t = node_time(m, cluster, dtype=dtype, attention_impl=profile.attention_impl, norm_kernel=profile.norm_kernel)
    return t.fwd_s, t.bwd_input_s + t.bwd_weight_s


__all__ = ["StateCosts", "Tables", "add_dp_comm"]
