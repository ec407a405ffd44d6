"""``apply_plan(model, plan, *, loss_fn, optimizer_factory) -> ParallelModel``: run a Plan.

Order: checks (no collective) -> process group + DeviceMesh -> stage split (with sequence
parallelism at pp > 1, sequence shard/gather modules are first inserted in the captured graph) ->
TP per stage (with sequence parallelism when the plan asks; refused when ``tp.sp_blocker`` finds a
reason; an LM head sharded over the vocabulary keeps its logits sharded for ``loss_parallel``) ->
quantized training per stage (``meshplan.runtime.apply.quant``; after TP because QLoRA quantizes each
rank's shard, QAT works either way) -> recompute -> precision (``runtime.apply.precision``) ->
``--compile`` -> data parallel per stage (``runtime.apply.data_parallel``; bucketed overlapped
all-reduce ``runtime.apply.grad_sync`` where DDP cannot run) -> pipeline stages + schedule -> optimizer
(over the parameters that still require grad; ZeroRedundancyOptimizer for zero1).
Plan options the runtime cannot execute as costed raise PlanMismatchError before training.

``ParallelModel`` (what a rank runs and its training step) lives in ``runtime.apply.parallel_model``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch
from torch import nn

from meshplan.cost_models.grad_sync import DEFAULT_BUCKET_CAP_BYTES
from meshplan.errors import PlanMismatchError
from meshplan.models.calls import call_names, microbatch_example, split_inputs
from meshplan.plan import Plan
from meshplan.plan.execution_rules import (
    BATCH_NORM_CLASSES,
    ZERO_BUBBLE_SCHEDULES,
    epcp_rule,
    microbatch_blocker,
    tied_weight_blocker,
    tp_pp_blocker,
)
from meshplan.runtime.apply import data_parallel as dpmod
from meshplan.runtime.apply import loss_parallel as lpmod
from meshplan.runtime.apply import precision as prec
from meshplan.runtime.apply import recompute, schedules, split, tp
from meshplan.runtime.apply import sync_batchnorm as sbn
from meshplan.runtime.apply.epcp import EPCPState, apply_epcp, epcp_blocker, uses_epcp
from meshplan.runtime.apply.epcp_pipeline import pipeline_cp_blocker, shard_position_tables
from meshplan.runtime.apply.grad_sync import BucketedGradSync
from meshplan.runtime.apply.parallel_model import ParallelModel
from meshplan.runtime.apply.stage_params import shared_params, tie_groups, unique_params
from meshplan.runtime.apply.zero1 import zero1_optimizer
from meshplan.runtime.checkpoint.pretrained import load_pretrained
from meshplan.runtime.launch.dist import RuntimeEnv, check_launch, init_runtime
from meshplan.runtime.record.phases import PhaseSpans, watch_stages

__all__ = ["ParallelModel", "apply_plan"]


def apply_plan(
    model: nn.Module,
    plan: Plan,
    *,
    loss_fn: Callable,
    optimizer_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    example_inputs: object = None,
    timeout_s: float = 120.0,
    dtype: str = "plan",
    bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
    compile: bool = False,
    sync_batchnorm: bool = True,
    init_from: str | os.PathLike[str] | None = None,
) -> ParallelModel:
    """Apply ``plan`` to ``model`` on this rank. ``example_inputs`` (a tensor, tuple or dict of
    tensors, as batches will be given to ``step``; any batch size, it is resized to the plan's
    microbatch) is needed when pp > 1 or the model is called by keyword.

    ``dtype`` ("plan", "bf16", "fp16", "fp32") is the precision to train in (``runtime.apply.precision``);
    ``bucket_cap_bytes`` the gradient bucket size of the manual (pipelined) data-parallel sync;
    ``compile`` applies ``torch.compile`` per repeated block (``runtime.apply.compiling``);
    ``sync_batchnorm`` (dp > 1) reduces BatchNorm statistics over the dp group (``runtime.apply.sync_batchnorm``;
    False keeps per-rank statistics, with a warning);
    ``init_from``: pretrained weights (a Hugging Face safetensors directory or a meshplan/DCP
    checkpoint, ``runtime.checkpoint.pretrained``), each rank reading the shards it holds once the plan is
    applied; under quantization they are read into the whole host model before it is applied.
    """
    # 1. checks that need no collective
    check_launch(plan)
    dpmod.check_dp_kind(plan)
    split.check_fqns(model, plan)
    pp = plan.pp
    ordered = sorted(plan.stages, key=lambda s: s.index)
    if pp > 1:
        if example_inputs is None:
            raise ValueError("apply_plan: a pipelined plan needs example_inputs (one microbatch) to capture the graph")
        schedules.check_placement(plan.schedule, pp, [s.rank for s in ordered], plan.num_microbatches)
    if plan.global_batch_size % (plan.dp * plan.num_microbatches):
        raise PlanMismatchError(
            f"global batch {plan.global_batch_size} is not divisible by dp*microbatches = {plan.dp}*{plan.num_microbatches}"
        )
    why = epcp_blocker(model, plan) or microbatch_blocker(
        pp=pp, num_microbatches=plan.num_microbatches,
        batch_norms=sum(type(m).__name__ in BATCH_NORM_CLASSES and m.training for m in model.modules()),
    )
    if why:
        raise PlanMismatchError(f"plan {plan.summary()!r} cannot run: {why}")
    notes: list[str] = []
    precision = prec.resolve_precision(plan.dtype, dtype)
    if any(p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError(
            "apply_plan: the model's parameters must be fp32 (master weights); the plan's precision "
            f"({precision}) is applied by autocast / FSDP2 mixed precision. Build the model in fp32"
        )

    if init_from is not None and plan.quantization.mode != "none":  # quantizing needs the loaded weights
        notes.append(load_pretrained(model, init_from, tied=split.tied_parameter_groups(model)) + " (before quantizing)")
    # 2. process group and mesh
    env = init_runtime(plan, timeout_s=timeout_s)
    model = model.to(env.device)
    # experts sharded before anything wraps them (pp > 1: after the stage chain check below, which runs
    # every stage on one rank, so the MoE blocks there run whole, without their ep group)
    ecs = apply_epcp(model, plan, env) if uses_epcp(plan) and pp == 1 else None
    tied = split.tied_parameter_groups(model)
    styles, tnotes = tp.effective_styles(model, plan.tp_styles, tied)
    notes += tnotes
    conv: list[str] = []
    if plan.tp > 1:
        conv = tp.convert_conv1d(model, [f for f, s in styles.items() if s != "replicate"])
        if conv:
            notes.append(f"HF Conv1D converted to nn.Linear for TP (weights transposed): {conv}")

    # 3. stage split
    sp_why = ""
    if plan.sequence_parallel and plan.tp > 1:
        sp_why = tp.sp_blocker(model, styles)
    head = None  # the LM head kept sharded over the vocabulary for loss_parallel (runtime.apply.loss_parallel)
    names = None
    if example_inputs is not None:
        example_inputs = microbatch_example(example_inputs, plan.micro_batch_size)
        names = split_inputs(example_inputs)[0]
    if pp > 1:
        cap = split.capture(model, example_inputs)
        gm, prefix = cap.gm, cap.prefix
        why = tp_pp_blocker(tp=plan.tp, pp=pp, capture=cap.kind)  # the rule the search obeys
        if why:
            raise PlanMismatchError(f"plan {plan.summary()!r} cannot run: {why}; this model's fx capture: {cap.fx_error}")
        if plan.tp > 1:
            head = lpmod.vocab_head(gm, prefix, styles, plan.tp_gathered_outputs, tp.embedding_fqns(model))
        pieces = split.split_stages(gm, ordered)
        split.check_stage_chain(pieces, example_inputs)
        for piece in pieces:  # every rank checks every stage: all refuse together, none hangs
            pname, uses = split.most_used_parameter(piece)
            why = tied_weight_blocker(pp=pp, schedule=plan.schedule, uses=uses, name=pname)
            if why:
                raise PlanMismatchError(f"plan {plan.summary()!r} cannot run: stage {piece.index}: {why}")
        if uses_epcp(plan):  # cp/ep inside the stages: groups of the stage's ranks (runtime.apply.epcp_pipeline)
            ecs = _pipeline_epcp(model, plan, env, pieces, cap.kind)
        if plan.sequence_parallel and plan.tp > 1 and not sp_why:
            # after the chain check: the boundaries only make sense once the norms gather (TP below)
            sp_why = tp.insert_sequence_boundaries(gm, [prefix + b for b in tp.block_fqns(model)], env.mesh["tp"])
            if not sp_why:
                pieces = split.split_stages(gm, ordered)
        mine = [s.index for s in ordered if s.rank == env.coord("pp")]
        modules: list[nn.Module] = [pieces[i].module for i in mine]
        roots = [_sub_or_self(m, prefix) for m in modules]
        shared = shared_params(pieces, ordered)
    else:
        from meshplan.tracing.capture import wrap_if_hf

        mine, prefix, shared = [0], "", []
        roots = [model]
        n_in = len(split_inputs(example_inputs)[1]) if example_inputs is not None else 1
        modules = [wrap_if_hf(model, call_names(model, names, n_in))[0]]
        if plan.tp > 1 and example_inputs is not None and any(s == "colwise" for s in styles.values()):
            cg, cprefix = split.capture_graph(model, example_inputs)
            head = lpmod.vocab_head(cg, cprefix, styles, plan.tp_gathered_outputs, tp.embedding_fqns(model))

    if head and plan.quantization.mode != "none":
        from meshplan.runtime.apply.quant.targets import targeted_linears

        if head in targeted_linears(model, plan.quantization):  # a quantized head's layouts gather its output
            notes.append(f"loss_parallel not applied: the LM head {head} is quantized ({plan.quantization.mode}); "
                         "its logits are gathered")
            head = None

    # 4. TP per stage (styles are keyed by the user's FQNs: apply them on the un-prefixed roots)
    if plan.tp > 1:
        sp = plan.sequence_parallel and not sp_why
        if plan.sequence_parallel and sp_why:  # refused, not run as something else than planned
            raise PlanMismatchError(
                f"sequence_parallel is planned but this model cannot run it ({sp_why}); "
                "re-plan with sequence_parallel off"
            )
        if sp:
            notes.append("sequence_parallel applied: norms under SequenceParallel, residual stream sequence-sharded")
        if head:
            notes.append(f"loss_parallel: {head} output kept sharded over the vocabulary (no gathered logits)")
        vs = [head] if head else []
        for r in roots:
            if sp and pp > 1:
                tp.apply_stage_sequence_parallel(r, env.mesh["tp"], styles, tp.block_fqns(model),
                                                 plan.tp_gathered_outputs, vocab_sharded=vs)
            elif sp:
                tp.apply_sequence_parallel(r, env.mesh["tp"], styles, plan.tp_gathered_outputs, vocab_sharded=vs)
            else:
                tp.apply_tp(r, env.mesh["tp"], styles, plan.tp_gathered_outputs, vocab_sharded=vs)
        if tp.retie(roots, tied):  # a vocab-parallel tied pair: one DTensor Parameter again (grads as Shard(0))
            notes.append("tied embedding + LM head re-tied after TP: one Parameter sharded over the vocabulary")
    elif plan.sequence_parallel:
        notes.append("sequence_parallel ignored: tp = 1")

    # 4a. BatchNorm under DP: statistics over the whole data-parallel microbatch (runtime.apply.sync_batchnorm)
    bns = [n for r in roots for n in sbn.batchnorm_names(r)] if plan.dp > 1 else []
    if bns and sync_batchnorm:
        for r in roots:
            sbn.sync_batchnorm(r, env.group("dp"), env.device.type)
        notes.append(f"BatchNorm synchronised over dp={plan.dp} ({len(bns)} layers): statistics of the whole "
                     "data-parallel microbatch, equal running buffers on every rank")
    elif bns:
        warnings.warn(f"{len(bns)} BatchNorm layers are not synchronised (sync_batchnorm=False): each of the "
                      f"{plan.dp} dp ranks normalises with its own share of the batch", stacklevel=2)
        notes.append(f"BatchNorm NOT synchronised ({len(bns)} layers, sync_batchnorm=False): per-rank statistics "
                     "of 1/dp of the batch, running buffers differ per rank; results differ from one device")

    # 4b. quantized training (meshplan.runtime.apply.quant), on each stage root after TP: QAT works in
    # either order with TP; QLoRA must follow parallelize_module (it quantizes each rank's shard)
    mode = dpmod.dp_mode(plan)
    if plan.quantization.mode != "none":
        from meshplan.runtime.apply.quant import apply_quantization

        for r in roots:
            changed = apply_quantization(
                r, plan.quantization, tp_mesh=env.mesh["tp"] if plan.tp > 1 else None, tp_styles=styles,
                fsdp_shards=plan.dp if mode == "fsdp" else 1,
            )
        notes.append(f"quantization {plan.quantization.mode}: {len(changed)} linears per stage root (last)")

    if ecs is not None:  # cp: the sequence-shard wrapper; cp/ep: gradients reduced by epcp_groups
        modules = [ecs.wrap(m) for m in modules]
        mode = "epcp"
        notes += ecs.notes

    # 4c. activation recomputation (wraps what runs; roots keep the user's FQNs)
    modules, rnote = recompute.apply_recompute(modules, plan.recompute, pipelined=pp > 1, schedule=plan.schedule)
    if rnote:
        notes.append(rnote)

    # 4d. precision: autocast (or FSDP2 mixed precision) per module, bf16/fp16 sends between stages
    modules = [
        prec.wrap_precision(m, precision, fsdp=mode == "fsdp", last_stage=i == len(ordered) - 1,
                            pipelined=pp > 1, device_type=env.device.type)
        for m, i in zip(modules, mine)
    ]
    notes.append(f"precision {precision}: " + (
        "fp32 throughout" if precision == "fp32" else
        ("FSDP2 MixedPrecisionPolicy (params " + precision + ", reduce fp32)" if mode == "fsdp" else
         "torch.autocast, fp32 parameters and optimizer state") + (", stage sends in " + precision if pp > 1 else "")
        + (", ShardedGradScaler" if precision == "fp16" else "")))

    if compile:
        from meshplan.runtime.apply.compiling import apply_compile

        notes.append(f"torch.compile: {apply_compile(modules, pipelined=pp > 1)} modules compiled")

    # 5. data parallel per stage
    dp_mesh = env.mesh["dp"] if plan.dp > 1 else None
    counter = dpmod.SyncCounter()
    if plan.quantization.mode == "qlora" and mode == "ddp":
        from meshplan.runtime.apply.quant.qlora import ddp_ignore_quantized

        for m in modules:
            ddp_ignore_quantized(m)
    per_block = pp == 1 and plan.quantization.mode == "none"
    if plan.dp_kind == "hsdp" and dp_mesh is not None:
        shard = plan.hsdp_shard_degree()
        dp_mesh = dp_mesh._unflatten(0, (plan.dp // shard, shard), ("dp_replicate", "dp_shard"))
    runners = [dpmod.wrap_dp(m, mode, dp_mesh=dp_mesh, dp_group=env.group("dp"), counter=counter,
                             mp_policy=prec.fsdp_policy(precision), per_block=per_block,
                             # under pp > 1 every kind keeps the stage gathered from the first forward to the
                             # last backward (torchtitan; one all-gather per step, as dp_kinds costs it)
                             reshard_after_forward=plan.dp_kind != "zero2" and pp == 1) for m in modules]
    if plan.dp > 1:
        notes.append(f"data parallel {plan.dp_kind}: " + {
            "fsdp": "FSDP2 fully_shard (ZeRO-3" + (")" if pp == 1 else ", stage gathered once per step)"), "zero2": "FSDP2 fully_shard, reshard_after_forward=False (ZeRO-2)",
            "hsdp": f"FSDP2 on a (dp_replicate={plan.dp // plan.hsdp_shard_degree()}, "
                    f"dp_shard={plan.hsdp_shard_degree()}) mesh",
        }.get(plan.dp_kind, "DDP" if mode == "ddp" else "bucketed all-reduce from gradient hooks")
            + (", ZeroRedundancyOptimizer (ZeRO-1)" if plan.dp_kind == "zero1" else ""))
    grad_sync = None
    if mode == "manual":
        grad_sync = BucketedGradSync(
            [[p for p in m.parameters()] for m in modules], env.group("dp"),  # type: ignore[arg-type]
            microbatches=plan.num_microbatches, cap_bytes=bucket_cap_bytes,
            divide_by=plan.dp * (plan.num_microbatches if pp > 1 else 1),  # pp > 1: also the microbatch mean
            use_hooks=not (pp > 1 and plan.schedule in ZERO_BUBBLE_SCHEDULES),
        )

    if ecs is not None:  # hooks on the final (post-TP) parameters: bucketed reduction over dc / replicas
        ecs.attach(unique_params(modules), plan.num_microbatches, bucket_cap_bytes, pipelined=pp > 1,
                   use_hooks=not (pp > 1 and plan.schedule in ZERO_BUBBLE_SCHEDULES))

    # 6. pipeline stages and schedule
    schedule, scaler, spans = None, None, PhaseSpans()
    if pp > 1:
        from torch.distributed.pipelining import PipelineStage

        pstages = [
            PipelineStage(r, i, len(ordered), env.device, group=env.group("pp")) for r, i in zip(runners, mine)
        ]
        if plan.schedule in ZERO_BUBBLE_SCHEDULES:
            for st, m in zip(pstages, modules):
                for sync in (grad_sync, ecs):
                    if sync is not None:
                        sync.watch_weight_passes(st, list(m.parameters()))
        watch_stages(spans, pstages)
        scaler = prec.make_scaler(precision)
        schedule = schedules.build_schedule(plan.schedule, pstages, plan.num_microbatches,
                                            _StageLoss(loss_fn, scaler, spans))

    pm = ParallelModel(
        plan=plan, env=env, modules=modules, roots=roots, runners=runners, stage_indices=mine,
        optimizer=_optimizer(optimizer_factory, unique_params(modules), plan, env), loss_fn=loss_fn, dp_mode=mode,
        schedule=schedule, notes=notes, tied_fqns=tied, converted=conv, precision=precision,
        scaler=scaler if pp > 1 else prec.make_scaler(precision), grad_sync=grad_sync, sync_counter=counter,
        loss_parallel=head is not None, epcp=ecs, input_names=names, phase_spans=spans,
    )
    pm.ties = tie_groups(env, shared, pm.stage_indices, {i: pieces[i].module for i in mine} if pp > 1 else {})
    if init_from is not None and plan.quantization.mode == "none":
        pm.notes.append(load_pretrained(pm.container(), init_from, tied=pm.tied_fqns,
                                        transposed=[f"{m}.weight" for m in pm.converted]))
    return pm


def _pipeline_epcp(model: nn.Module, plan: Plan, env: RuntimeEnv, pieces: list, capture: str) -> EPCPState:
    """cp/ep for pipeline stages: the cp position rewrite of this rank's stages (refused on every
    rank alike when a stage graph reads positions otherwise), then the groups and expert sharding.
    The stage modules hold the model's own MoE blocks, so sharding them in ``model`` shards the stages'."""
    why = epcp_rule(cp=plan.cp, ep=plan.ep, tp=plan.tp, pp=plan.pp, seq_len=plan.seq_len or 2 * plan.cp,
                    num_experts=0, recompute=plan.recompute, capture=capture)  # the capture this run got
    if why:
        raise PlanMismatchError(f"plan {plan.summary()!r} cannot run: {why}")
    if plan.cp > 1:
        why = pipeline_cp_blocker([p.module for p in pieces], capture)
        if why:
            raise PlanMismatchError(f"plan {plan.summary()!r} cannot run: {why}")
        for p in pieces:
            shard_position_tables(p.module, plan.cp, env.coord("cp"))
    return apply_epcp(model, plan, env)


def _optimizer(factory: Callable, params: list[torch.Tensor], plan: Plan, env: RuntimeEnv) -> torch.optim.Optimizer:
    opt = factory(params)
    if plan.dp_kind == "zero1" and plan.dp > 1:
        return zero1_optimizer(opt, params, env.group("dp"))  # type: ignore[arg-type]
    return opt


class _StageLoss:
    """The pipeline schedule's loss: logits upcast to fp32, times the fp16 loss scale if any."""

    def __init__(self, loss_fn: Callable, scaler: object | None, spans: PhaseSpans) -> None:
        self.loss_fn = loss_fn
        self.scaler = scaler
        self.spans = spans

    def __call__(self, out: object, target: torch.Tensor) -> torch.Tensor:
        with self.spans.span("forward"):
            loss = self.loss_fn(prec.to_fp32(out), target)
            return self.scaler.scale(loss) if self.scaler is not None else loss  # type: ignore[attr-defined]


def _sub_or_self(m: nn.Module, prefix: str) -> nn.Module:
    return m.get_submodule(prefix.rstrip(".")) if prefix else m

