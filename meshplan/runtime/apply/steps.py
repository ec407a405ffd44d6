"""The appliers of ``apply_plan``, in their order; each a short function over ``ApplyState`` that
returns its own notes (as torchtitan's ``parallelize_*`` / ``apply_*`` do).

Order (``STEPS``) and why where it matters:

1. ``apply_epcp``: expert sharding and cp/ep groups first, before anything wraps the MoE blocks.
2. ``apply_split``: this rank's stages (pp > 1; the sequence-parallel boundaries are inserted into
   the captured graph here, as they need the tp mesh, and the graph re-cut) or the whole model; under
   cp > 1 the stage graphs as cut last read the shard's positions (``epcp_pipeline``), and what runs
   is wrapped by the ring.
3. ``apply_tensor_parallel``: DTensor TP / sequence parallelism on the roots (the user's FQNs).
4. ``apply_sync_batchnorm``: BatchNorm statistics over the dp group.
5. ``apply_quantize``: QAT / QLoRA on each root, after TP because QLoRA quantizes each rank's shard
   (``tests/test_quant_qlora.py``: quantizing after ``parallelize_module`` equals quantizing in the
   TP layout, and differs from one device's NF4 by the per-shard statistics); a meta-built QLoRA model
   is materialized here, one targeted linear at a time (``runtime.apply.quant_load``).
6. ``apply_recompute``: activation checkpointing on what runs.
7. ``apply_precision``: autocast or FSDP2 mixed precision per module (+ ``--compile`` after it).
8. ``apply_data_parallel``: the sharded kinds (FSDP2), still on meta for a meta-built model.
9. ``apply_materialize``: a meta-built model gets this rank's tensors on its device, filled from
   the constructor's replay, a device init of the shard (``init="device"``) or ``init_from`` (after
   every step that shards: it allocates only
   shards; ``tests/test_meta_build.py`` checks the losses equal the host-built model's).
10. ``apply_state_layout``: ``state_layout`` "megatron": fp32 masters copied from the materialized
    parameters, which become 16-bit, and their fp32 main gradients (``runtime.apply.master_state``);
    before the gradient reduction, whose bucketed hooks fold into the main gradients after its own.
11. ``apply_grad_reduction``: DDP, bucketed hooks or the cp/ep reductions, which bind real tensors.
12. ``apply_schedule``: pipeline stages and the torch.distributed.pipelining schedule.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from meshplan.calls import call_names, split_inputs
from meshplan.errors import MeshplanWarning, PlanMismatchError
from meshplan.models.init_tape import InitTape, Ref
from meshplan.plan import Plan
from meshplan.plan.execution_rules import ZERO_BUBBLE_SCHEDULES
from meshplan.runtime.apply import data_parallel as dpmod
from meshplan.runtime.apply import precision as prec
from meshplan.runtime.apply import recompute, schedules, split, tp
from meshplan.runtime.apply import sync_batchnorm as sbn
from meshplan.runtime.apply.checks import Checked
from meshplan.runtime.apply.epcp import EPCPState, apply_epcp, uses_epcp
from meshplan.runtime.apply.epcp_pipeline import shard_position_tables
from meshplan.runtime.apply.grad_sync import BucketedGradSync
from meshplan.runtime.apply.master_state import MasterState
from meshplan.runtime.apply.stage_params import shared_params, unique_params
from meshplan.runtime.launch.dist import RuntimeEnv
from meshplan.runtime.launch.host_memory import peak_rss_bytes
from meshplan.runtime.record.phases import PhaseSpans, watch_stages


@dataclass
class MetaBuild:
    """How a meta-built model gets its values: its construction's tape (``models.init_tape``) and
    the tape's view of every parameter/buffer by user FQN, or pretrained weights."""

    tape: InitTape
    finals: dict[str, Ref]
    init_from: str | os.PathLike[str] | None = None
    init: str = "host-exact"  # or "device" (``models.device_init``), "checkpoint" (buffers only: resuming)
    progress: Callable[[int, int], None] | None = None  # (tensors done, total) while materializing


@dataclass
class ApplyState:
    """What the appliers read and extend; ``modules`` is what runs, ``roots`` the same at the user's FQNs."""

    model: nn.Module
    plan: Plan
    env: RuntimeEnv
    checked: Checked
    loss_fn: Callable
    bucket_cap_bytes: int
    compile: bool = False
    sync_batchnorm: bool = True
    mine: list[int] = field(default_factory=lambda: [0])  # this rank's stage indices
    prefix: str = ""  # FQN prefix of the user's model inside the captured graph
    modules: list[nn.Module] = field(default_factory=list)
    roots: list[nn.Module] = field(default_factory=list)
    shared: list = field(default_factory=list)  # parameters several pipeline ranks hold (tied)
    pieces: list[split.StagePiece] = field(default_factory=list)  # pp > 1: every stage, as split last
    sp: bool = False  # sequence parallelism runs
    ecs: EPCPState | None = None
    mode: str = "single"  # how gradients are reduced: dpmod.dp_mode, or "epcp"
    runners: list[nn.Module] = field(default_factory=list)
    counter: dpmod.SyncCounter = field(default_factory=dpmod.SyncCounter)
    grad_sync: BucketedGradSync | None = None
    master: MasterState | None = None  # state_layout "megatron": 16-bit weights, fp32 main grads and masters
    schedule: object | None = None
    scaler: object | None = None
    spans: PhaseSpans = field(default_factory=PhaseSpans)
    meta: MetaBuild | None = None  # the model was built on the meta device
    # a host-built model's pretrained weights, read once the plan is applied (``api.apply_plan``), or by
    # ``apply_state_layout`` before its 16-bit cast (the fp32 masters copy the file's values); None once read
    init_from: str | os.PathLike[str] | None = None

    @property
    def pipelined(self) -> bool:
        return self.plan.pp > 1


def apply_epcp_step(s: ApplyState) -> list[str]:
    s.mode = dpmod.dp_mode(s.plan)
    if not uses_epcp(s.plan):
        return []
    s.ecs = apply_epcp(s.model, s.plan, s.env)  # stage modules hold the model's own MoE blocks
    if not dpmod.fsdp_over_cp(s.plan):  # FSDP2 over dp x cp reduces the cp ranks' gradients itself
        s.mode = "epcp"
    return list(s.ecs.notes)


def apply_split(s: ApplyState) -> list[str]:
    c, plan = s.checked, s.plan
    if s.pipelined:
        gm, s.prefix = c.capture.gm, c.capture.prefix
        pieces = c.pieces
        s.sp = plan.sequence_parallel and plan.tp > 1
        if plan.tp > 1 and c.capture.kind == "export":  # stages get nn.Linear modules and local shapes back
            from meshplan.runtime.apply.checks import stage_tp_plan
            from meshplan.runtime.apply.tp_export import prepare

            why = prepare(gm, s.prefix, c.styles, stage_tp_plan(s.model, plan, c), plan.tp, apply=True)
            assert not why, why  # (refused by check_plan before)
            pieces = split.split_stages(gm, c.ordered)
        if s.sp:  # after the chain check: the boundaries only make sense once the norms gather (TP)
            why = tp.insert_sequence_boundaries(gm, [s.prefix + b for b in tp.block_fqns(s.model)], s.env.mesh["tp"])
            if why:
                raise PlanMismatchError(f"sequence_parallel is planned but this model cannot run it ({why}); "
                                        "re-plan with sequence_parallel off")
            pieces = split.split_stages(gm, c.ordered)
        if plan.cp > 1:  # each stage graph reads its shard's positions: the graphs that run, cut last (SP or an
            for p in pieces:  # export capture re-cut ``gm`` above into new stage modules, without a rewrite)
                shard_position_tables(p.module, plan.cp, s.env.coord("cp"))
        s.mine = [st.index for st in c.ordered if st.rank == s.env.coord("pp")]
        s.modules = [pieces[i].module if s.meta else pieces[i].module.to(s.env.device) for i in s.mine]
        # the capture's device/dtype checks do not hold where stages run: the rank's device (a meta
        # build), inputs received in the send precision (bf16 under autocast)
        from meshplan.runtime.apply.materialize import drop_metadata_asserts

        for m in s.modules:
            for sub in m.modules():
                drop_metadata_asserts(sub)
        s.roots = [m.get_submodule(s.prefix.rstrip(".")) if s.prefix else m for m in s.modules]
        s.shared = shared_params(pieces, c.ordered)
        s.pieces = pieces
    else:
        from meshplan.trace import wrap_if_hf

        s.sp = plan.sequence_parallel and plan.tp > 1
        n_in = len(split_inputs(c.example)[1]) if c.example is not None else 1
        s.roots = [s.model]
        s.modules = [wrap_if_hf(s.model, call_names(s.model, c.names, n_in))[0]]
    if s.ecs is not None:  # cp: what runs is wrapped by the ring (the roots keep the user's FQNs)
        s.modules = [s.ecs.wrap(m) for m in s.modules]
    return []


def apply_tensor_parallel(s: ApplyState) -> list[str]:
    plan, c = s.plan, s.checked
    if plan.tp <= 1:
        return ["sequence_parallel ignored: tp = 1"] if plan.sequence_parallel else []
    notes = []
    if s.sp:
        notes.append("sequence_parallel applied: norms under SequenceParallel, residual stream sequence-sharded")
    if c.head:
        notes.append(f"loss_parallel: {c.head} output kept sharded over the vocabulary (no gathered logits)")
    vs = [c.head] if c.head else []
    mesh = s.env.mesh["tp"]
    for r in s.roots:  # styles are keyed by the user's FQNs: applied on the un-prefixed roots
        if s.sp and s.pipelined:
            tp.apply_stage_sequence_parallel(r, mesh, c.styles, tp.block_fqns(s.model), plan.tp_gathered_outputs,
                                             vocab_sharded=vs)
        elif s.sp:
            tp.apply_sequence_parallel(r, mesh, c.styles, plan.tp_gathered_outputs, vocab_sharded=vs)
        else:
            tp.apply_tp(r, mesh, c.styles, plan.tp_gathered_outputs, vocab_sharded=vs)
    if tp.retie(s.roots, c.tied):  # a vocab-parallel tied pair: one DTensor Parameter again (grads as Shard(0))
        notes.append("tied embedding + LM head re-tied after TP: one Parameter sharded over the vocabulary")
    return notes


def apply_sync_batchnorm(s: ApplyState) -> list[str]:
    bns = [n for r in s.roots for n in sbn.batchnorm_names(r)] if s.plan.dp > 1 else []
    if not bns:
        return []
    if s.sync_batchnorm:
        for r in s.roots:
            sbn.sync_batchnorm(r, s.env.group("dp"), s.env.device.type)
        return [f"BatchNorm synchronised over dp={s.plan.dp} ({len(bns)} layers): statistics of the whole "
                "data-parallel microbatch, equal running buffers on every rank"]
    warnings.warn(f"{len(bns)} BatchNorm layers are not synchronised (sync_batchnorm=False): each of the "
                  f"{s.plan.dp} dp ranks normalises with its own share of the batch", MeshplanWarning, stacklevel=3)
    return [f"BatchNorm NOT synchronised ({len(bns)} layers, sync_batchnorm=False): per-rank statistics "
            "of 1/dp of the batch, running buffers differ per rank; results differ from one device"]


def apply_quantize(s: ApplyState) -> list[str]:
    q = s.plan.quantization
    if q.mode == "none":
        return []
    from meshplan.runtime.apply.quant import apply_quantization, convert_targeted_conv1d

    changed: list = []
    # QLoRA on a meta build (quant_load.streams) gets each targeted linear's values (read from a HF file, or
    # the device init) and quantizes it here, one at a time, then materializes the rest; QAT prepares its fake
    # quantizers on meta and is materialized with the rest (apply_materialize)
    meta = s.meta if q.mode == "qlora" else None
    transposed = {f"{m}.weight" for m in s.checked.conv}
    rows = s.ecs.expert_rows if s.ecs is not None else {}
    readers: list = []
    di = None
    if meta is not None and meta.init_from is None:
        from meshplan.models.device_init import DeviceInit

        di = DeviceInit(meta.tape, meta.finals)
    for r in s.roots:
        reader = None
        if meta is not None:
            from meshplan.runtime.apply.quant_load import LinearInit, LinearReader

            transposed.update(f"{m}.weight" for m in convert_targeted_conv1d(r, q))
            reader = (LinearReader(meta.init_from, s.env.device, transposed) if meta.init_from is not None
                      else LinearInit(di, s.env.device, transposed, rows=rows))
            readers.append(reader)
        changed = apply_quantization(
            r, q, tp_mesh=s.env.mesh["tp"] if s.plan.tp > 1 else None, tp_styles=s.checked.styles,
            fsdp_shards=s.plan.dp_state_ranks() if dpmod.dp_mode(s.plan) == "fsdp" else 1, before_each=reader,
        )
    notes = [f"quantization {q.mode}: {len(changed)} linears per stage root (last)"]
    if meta is not None:
        from meshplan.runtime.apply import materialize as mat
        from meshplan.runtime.apply.quant_load import materialize_rest

        n_rest, rest = materialize_rest(s.roots, meta.init_from, s.env.device, tape=meta.tape, finals=meta.finals,
                                        tied=s.checked.tied, transposed=transposed, init=meta.init, di=di, rows=rows)
        for m in s.modules if s.pipelined else []:  # stage graphs captured on meta
            for sub in m.modules():
                mat.retarget_graph(sub, s.env.device)
        s.meta = None  # from here on a host model (data parallel wraps it as one)
        base = sum(rd.bytes for rd in readers)
        n_lin = sum(rd.linears for rd in readers)
        if meta.init_from is not None:
            notes.append(f"initialized from the Hugging Face checkpoint {meta.init_from}: built on the meta device, "
                         f"{n_lin} targeted linears read and quantized one at a time "
                         f"({base / 2**20:.1f} MiB fp32 read, never whole), the other weights {rest / 2**20:.1f} MiB "
                         f"(this rank's TP shards), buffers from the constructor")
        else:
            largest = max((rd.largest for rd in readers), default=0)
            on_cpu = sum(rd.on_cpu for rd in readers)
            cpu = f" ({on_cpu} of their tensors computed whole on the CPU and cut)" if on_cpu else ""
            rest_how = ("the other parameters left to the checkpoint it resumes from (it holds the NF4 bases and "
                        "the adapters), buffers from the constructor's replay" if meta.init == "checkpoint" else
                        "the other tensors device-initialised the same way")
            notes.append(f"built on the meta device (QLoRA): {n_lin} targeted linears initialised on {s.env.device} "
                         f"for this rank's part by the constructor's device init (models.device_init: random ones "
                         f"drawn per tile, the same for every layout){cpu} and quantized to NF4 one at a time "
                         f"({base / 2**20:.3g} MiB fp32 made in all, at most {largest / 2**20:.3g} MiB at once: "
                         f"never the whole model); {n_rest} other tensors allocated on {s.env.device}, {rest_how}")
    return notes


def apply_recompute(s: ApplyState) -> list[str]:
    s.modules, note = recompute.apply_recompute(s.modules, s.plan.recompute, pipelined=s.pipelined,
                                                schedule=s.plan.schedule)
    return [note] if note else []


def apply_precision(s: ApplyState) -> list[str]:
    p, fsdp = s.checked.precision, s.mode == "fsdp"
    s.modules = [
        prec.wrap_precision(m, p, fsdp=fsdp, last_stage=i == len(s.checked.ordered) - 1,
                            pipelined=s.pipelined, device_type=s.env.device.type)
        for m, i in zip(s.modules, s.mine)
    ]
    return [f"precision {p}: " + (
        "fp32 throughout" if p == "fp32" else
        ("FSDP2 MixedPrecisionPolicy (params " + p + ", reduce fp32)" if fsdp else
         "torch.autocast, " + (f"bf16 parameters, {s.plan.state_layout} state layout (fp32 masters)" if s.plan.state_layout != "torch"
                               else "fp32 parameters and optimizer state")) + (", stage sends in " + p if s.pipelined else "")
        + (", ShardedGradScaler" if p == "fp16" else ""))]


def apply_compile(s: ApplyState) -> list[str]:
    if not s.compile:
        return []
    from meshplan.runtime.apply.compiling import apply_compile as compile_blocks

    return [f"torch.compile: {compile_blocks(s.modules, pipelined=s.pipelined)} modules compiled"]


def _dp_note(plan: Plan, mode: str) -> str:
    ranks = plan.dp_state_ranks()
    over = f" over dp x cp = {ranks} ranks (the flattened dp_cp mesh)" if ranks != plan.dp else ""
    kind = {
        "fsdp": "FSDP2 fully_shard (ZeRO-3" + (")" if plan.pp == 1 else ", stage gathered once per step)") + over,
        "zero2": "FSDP2 fully_shard, reshard_after_forward=False (ZeRO-2)" + over,
        "hsdp": f"FSDP2 on a (dp_replicate={ranks // plan.hsdp_shard_degree()}, "
                f"dp_shard={plan.hsdp_shard_degree()}) mesh" + over,
    }.get(plan.dp_kind, "DDP" if mode == "ddp" else "bucketed all-reduce from gradient hooks")
    if plan.state_layout != "torch":
        return f"data parallel {plan.dp_kind}: {kind} of the main gradients" + (
            ", fp32 masters partitioned over dp (ZeRO-1, runtime.apply.master_state)" if plan.dp_kind == "zero1" else "")
    return f"data parallel {plan.dp_kind}: {kind}" + (
        ", ZeroRedundancyOptimizer (ZeRO-1)" + (f" over dp x cp = {ranks} ranks" if ranks != plan.dp else "")
        if plan.dp_kind == "zero1" else "")


def _wrap_dp(s: ApplyState) -> list[nn.Module]:
    """What each stage's PipelineStage (or the pp = 1 loop) runs: the data-parallel wrapper around the
    module; under pp > 1 around ``split.KeywordInputs``, which hands the stage the model inputs it reads."""
    plan = s.plan
    mods = [split.KeywordInputs(m, s.pieces[i]) for m, i in zip(s.modules, s.mine)] if s.pipelined else s.modules
    return [dpmod.wrap_dp(m, s.mode, dp_mesh=dpmod.state_mesh(plan, s.env.mesh), dp_group=s.env.group("dp"), counter=s.counter,
                          mp_policy=prec.fsdp_policy(s.checked.precision),
                          # QLoRA too (torchtune's order): each block's NF4 base is gathered for its forward and
                          # again for its backward (torchao's NF4Tensor.fsdp_pre/post_all_gather), not for the step
                          per_block=plan.pp == 1,
                          # under pp > 1 every kind keeps the stage gathered from the first forward to the
                          # last backward (torchtitan; one all-gather per step, as dp_kinds costs it)
                          reshard_after_forward=plan.dp_kind != "zero2" and plan.pp == 1) for m in mods]


def apply_data_parallel(s: ApplyState) -> list[str]:
    """The sharded kinds (FSDP2 ``fully_shard``: fsdp, zero2, hsdp), before materializing, so a
    meta-built model is only ever allocated as this rank's shards."""
    if s.mode != "fsdp":
        return []
    s.runners = _wrap_dp(s)
    return [_dp_note(s.plan, s.mode)]


def apply_materialize(s: ApplyState) -> list[str]:
    """A meta-built model: allocate this rank's tensors on its device and fill them, from the
    constructor's replay or from ``init_from`` (``runtime.apply.materialize``). Host-built: nothing."""
    if s.meta is None:
        return []
    from meshplan.runtime.apply import materialize as mat
    from meshplan.runtime.apply.stage_params import merge_modules

    dev, c = s.env.device, s.checked
    for m in s.modules:
        m.to_empty(device=dev)
    mat.retie(s.roots, c.tied)
    for m in s.modules if s.pipelined else []:  # stage graphs captured on meta
        for sub in m.modules():
            mat.retarget_graph(sub, dev)
    if s.ecs is not None:  # the expert parameters are new objects: found again by FQN
        s.ecs.expert_ids = {id(t) for f, ts in mat.local_tensors(s.roots).items() if f in s.ecs.expert_fqns for t in ts}
    left = mat.meta_leftovers(s.modules)
    if left:
        raise mat.TapeError(f"tensors kept outside parameters and buffers cannot be materialized: {left[:4]}; "
                            "register them as buffers")
    transposed = [f"{m}.weight" for m in c.conv]
    rows = s.ecs.expert_rows if s.ecs is not None else {}
    if s.meta.init_from is not None:  # buffers (rotary tables, masks) from the constructor, weights from the file
        from meshplan.runtime.weights.pretrained import load_pretrained

        mat.fill_from_tape(s.meta.tape, s.meta.finals, s.roots, set(transposed), rows, buffers_only=True)
        return [load_pretrained(merge_modules(s.roots), s.meta.init_from, tied=c.tied, transposed=transposed)
                + f" (into this rank's shards on {dev}; the model was built on the meta device)"]
    if s.meta.init == "checkpoint":  # resuming: the checkpoint gives every parameter, no draw is needed
        n, _ = mat.fill_from_tape(s.meta.tape, s.meta.finals, s.roots, set(transposed), rows, buffers_only=True,
                                  progress=s.meta.progress)
        return [f"built on the meta device; this rank's shards allocated on {dev}, {n} buffers from the "
                "constructor's replay, the parameters left to the checkpoint it resumes from (none drawn)"]
    if s.meta.init == "device":
        n, whole, peak = mat.fill_on_device(s.meta.tape, s.meta.finals, s.roots, set(transposed), rows,
                                            progress=s.meta.progress)
        cpu = f", {whole} computed whole on the CPU and cut (replay peak {peak / 2**20:.1f} MiB)" if whole else ""
        return [f"built on the meta device; --init device: {n} tensors initialised on {dev} for this rank's shard "
                f"only{cpu}: the constructor's own init ops, random ones drawn per tile (models.device_init), the "
                "same values for every parallel layout but not the host-built model's (--init host-exact gives those)"]
    n, peak = mat.fill_from_tape(s.meta.tape, s.meta.finals, s.roots, set(transposed), rows,
                                 progress=s.meta.progress)
    return [f"built on the meta device; {n} tensors materialized on {dev} as this rank's shards, initialised by "
            f"replaying the constructor one tensor at a time (replay peak {peak / 2**20:.1f} MiB; process peak "
            f"RSS {peak_rss_bytes() / 2**30:.2f} GiB after materializing, measured)"]


def apply_state_layout(s: ApplyState) -> list[str]:
    """``state_layout`` "megatron" / "zero" (``runtime.apply.master_state``): the parameters become 16-bit,
    each with an fp32 / 16-bit main gradient; fp32 masters of the parameters this rank's optimizer steps (zero1 at dp > 1:
    its partition; else all). After materializing (the masters copy real values), before the reduction."""
    plan = s.plan
    if plan.state_layout == "torch" or s.checked.precision == "fp32":
        return []
    # zero1: over the dp group, or under cp over the dp x cp group whose gradients epcp reduces (as ZeRO-1)
    shard = plan.dp_kind == "zero1" and plan.dp_state_ranks() > 1
    folded = plan.dp_state_ranks() != plan.dp and s.ecs is not None
    group = (s.ecs.groups.dc_group if folded else s.env.group("dp")) if shard else None  # type: ignore[union-attr]
    dt = prec.torch_dtype(s.checked.precision)
    main = dt if plan.state_layout == "zero" else torch.float32  # zero: 16-bit main gradients, reduced in 16 bits
    notes = []
    if s.init_from is not None:  # a host build's pretrained weights, read in fp32 before the masters copy them
        from meshplan.runtime.apply.stage_params import merge_modules
        from meshplan.runtime.weights.pretrained import load_pretrained

        notes.append(load_pretrained(merge_modules(s.roots), s.init_from, tied=s.checked.tied,
                                     transposed=[f"{m}.weight" for m in s.checked.conv])
                     + " (before the 16-bit cast: the fp32 masters are the file's values)")
        s.init_from = None
    s.master = MasterState(unique_params(s.modules), dt, group=group, shard=shard, main_dtype=main)
    n = len(s.master.params)
    return notes + [f"state layout {plan.state_layout}: {n} parameters in {s.checked.precision}, "
            f"{str(main).removeprefix('torch.')} main gradients (post-accumulate "
            f"hooks), fp32 masters + optimizer state of {len(s.master.masters)} of them on this rank"
            + (f" (zero1 partition over {plan.dp_state_ranks()} ranks, the updated weights broadcast in "
               f"{s.checked.precision})"
               if shard else "")]


def apply_grad_reduction(s: ApplyState) -> list[str]:
    """The replicated kinds, on materialized parameters (DDP and the hooks bind real tensors): DDP,
    bucketed all-reduce from gradient hooks, or the cp/ep reductions."""
    plan, env = s.plan, s.env
    if s.mode == "fsdp":
        return []
    if plan.quantization.mode == "qlora" and s.mode == "ddp":
        from meshplan.runtime.apply.quant.qlora import ddp_ignore_quantized

        for m in s.modules:
            ddp_ignore_quantized(m)
    s.runners = _wrap_dp(s)
    zb = s.pipelined and plan.schedule in ZERO_BUBBLE_SCHEDULES
    if s.mode == "manual":
        s.grad_sync = BucketedGradSync(
            [list(m.parameters()) for m in s.modules], env.group("dp"),  # type: ignore[arg-type]
            microbatches=plan.num_microbatches, cap_bytes=s.bucket_cap_bytes,
            divide_by=plan.dp * (plan.num_microbatches if s.pipelined else 1),  # pp > 1: also the microbatch mean
            use_hooks=not zb, main=s.master,
        )
    if s.ecs is not None:  # hooks on the final (post-TP) parameters: bucketed reduction over dc / replicas
        s.ecs.attach(unique_params(s.modules), plan.num_microbatches, s.bucket_cap_bytes, pipelined=s.pipelined,
                     use_hooks=not zb, main=s.master)
    return [_dp_note(plan, s.mode)] if plan.dp_state_ranks() > 1 else []


def apply_schedule(s: ApplyState) -> list[str]:
    s.scaler = prec.make_scaler(s.checked.precision)
    if not s.pipelined:
        return []
    n = len(s.checked.ordered)
    pstages = [schedules.pipeline_stage(r, i, n, s.env.device, s.env.group("pp")) for r, i in zip(s.runners, s.mine)]
    if s.plan.schedule in ZERO_BUBBLE_SCHEDULES:
        for st, m in zip(pstages, s.modules):
            for sync in (s.grad_sync, s.ecs):
                if sync is not None:
                    sync.watch_weight_passes(st, list(m.parameters()))
    watch_stages(s.spans, pstages)
    s.schedule = schedules.build_schedule(s.plan.schedule, pstages, s.plan.num_microbatches,
                                          StageLoss(s.loss_fn, s.scaler, s.spans))
    return []


class StageLoss:
    """The pipeline schedule's loss: logits upcast to fp32, times the fp16 loss scale if any."""

    def __init__(self, loss_fn: Callable, scaler: object | None, spans: PhaseSpans) -> None:
        self.loss_fn = loss_fn
        self.scaler = scaler
        self.spans = spans

    def __call__(self, out: object, target: torch.Tensor) -> torch.Tensor:
        with self.spans.span("forward"):
            loss = self.loss_fn(prec.to_fp32(out), target)
            return self.scaler.scale(loss) if self.scaler is not None else loss  # type: ignore[attr-defined]


Step = Callable[[ApplyState], list[str]]
STEPS: tuple[Step, ...] = (
    apply_epcp_step, apply_split, apply_tensor_parallel, apply_sync_batchnorm, apply_quantize, apply_recompute,
    apply_precision, apply_compile, apply_data_parallel, apply_materialize, apply_state_layout, apply_grad_reduction,
    apply_schedule,
)
