"""``apply_plan(model, plan, *, loss_fn, optimizer_factory) -> ParallelModel``: run a Plan.

Check once, then apply in one documented order:

1. ``checks.check_plan``: every refusal (the shared ``execution_rules`` and what only the model
   can tell), before the process group exists; under pp > 1 it captures and splits the graph the
   rules read. Plan options the runtime cannot execute as costed raise ``PlanMismatchError`` here.
2. process group + DeviceMesh (``launch.dist.init_runtime``); a host-built model moves to the
   rank's device, a meta-built one stays on meta until it is materialized.
3. the appliers of ``steps.STEPS``: EP/CP -> stage split -> TP -> (BatchNorm sync) -> quantization
   -> recompute -> precision (+ ``--compile``) -> data parallel (FSDP2) -> materialize -> gradient
   reduction (DDP / hooks) -> schedule; each returns its notes.
4. the optimizer over the parameters that still require grad (ZeroRedundancyOptimizer for zero1); under
   ``state_layout`` "megatron" over the fp32 masters (``runtime.apply.master_state``).

``ParallelModel`` (what a rank runs and its training step) lives in ``runtime.apply.parallel_model``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
from torch import nn

from meshplan.cost_models.grad_sync import DEFAULT_BUCKET_CAP_BYTES
from meshplan.models.init_tape import InitTape
from meshplan.plan import Plan
from meshplan.runtime.apply import split
from meshplan.runtime.apply.checks import REFUSED_QLORA_HOST_EXACT, MetaBuildRefused, check_plan
from meshplan.runtime.apply.epcp import EPCPState
from meshplan.runtime.apply.parallel_model import ParallelModel
from meshplan.runtime.apply.quant_load import qlora_refuses
from meshplan.runtime.apply.stage_params import tie_groups, unique_params
from meshplan.runtime.apply.steps import STEPS, ApplyState, MetaBuild, apply_materialize
from meshplan.runtime.apply.zero1 import zero1_optimizer
from meshplan.runtime.launch.dist import RuntimeEnv, check_launch, init_runtime
from meshplan.runtime.launch.host_memory import return_freed_memory
from meshplan.runtime.weights.pretrained import load_pretrained

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
    tape: InitTape | None = None,
    init: str = "host-exact",
    progress: Callable[[int, int], None] | None = None,
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
    checkpoint, ``runtime.weights.pretrained``), each rank reading the shards it holds once the plan is
    applied; under quantization they are read into the whole host model before it is applied, except
    for QLoRA from a Hugging Face directory on a meta-built model (``runtime.apply.quant_load``: the
    base read and quantized one linear at a time). A meta-built QLoRA model without ``init_from`` gets
    each targeted linear from the device init and quantizes it at once (``init`` "device", or
    "checkpoint": the values only give the NF4 layout the checkpoint then fills); "host-exact" is refused
    there (``MetaBuildRefused``: build on the host).

    A model built on the meta device (``load_model(spec, device="meta", tape=tape)``) is applied
    there and materialized as this rank's shards only (``steps.apply_materialize``): pass its
    ``tape`` (values equal to the host-built model's for the same seed; with ``init_from`` it
    gives the buffers and the file the weights). ``init``: "host-exact" (default: the CPU replay of
    the whole construction on every rank) or "device" (each rank's shard computed on its device,
    ``models.device_init``: start-up time follows the shard; values equal across layouts, not the
    host build's) or "checkpoint" (the buffers only: a checkpoint loaded next gives every parameter, as a
    resumed run's does; ``dcp.load`` refuses a checkpoint that lacks one); ``progress(done, total)`` is
    called as tensors are materialized.

    ``ParallelModel.startup_s`` keeps the seconds of each part (plan checks, process group,
    materialize, the other appliers).
    """
    if init not in ("host-exact", "device", "checkpoint"):
        raise ValueError(f"apply_plan: init must be 'host-exact', 'device' or 'checkpoint', got {init!r}")
    t0 = time.perf_counter()
    meta = _meta_build(model, tape, init_from)
    if meta is not None:
        meta.init, meta.progress = init, progress
        why = qlora_refuses(plan, init_from, init)
        if why:  # before any collective, alike on every rank: the caller may build on the host
            raise MetaBuildRefused(f"apply_plan: {why}", reason=REFUSED_QLORA_HOST_EXACT)
    check_launch(plan)  # the launched world size first: every rank refuses alike
    checked = check_plan(model, plan, example_inputs, dtype, init_from=init_from)
    startup = {"plan checks": time.perf_counter() - t0}
    notes = list(checked.notes)
    if init_from is not None and plan.quantization.mode != "none" and meta is None:  # quantizing needs the weights
        notes.append(load_pretrained(model, init_from, tied=checked.tied,
                                     transposed=[f"{m}.weight" for m in checked.conv]) + " (before quantizing)")
    return_freed_memory()
    t0 = time.perf_counter()
    env = init_runtime(plan, timeout_s=timeout_s)
    startup["process group"] = time.perf_counter() - t0
    s = ApplyState(model=model if meta else model.to(env.device), plan=plan, env=env, checked=checked,
                   loss_fn=loss_fn, bucket_cap_bytes=bucket_cap_bytes, compile=compile,
                   sync_batchnorm=sync_batchnorm, meta=meta,
                   init_from=init_from if init_from is not None and plan.quantization.mode == "none" and meta is None
                   else None)
    for step in STEPS:
        t0 = time.perf_counter()
        notes += step(s)
        part = "materialize" if step is apply_materialize else "wrapping"
        startup[part] = startup.get(part, 0.0) + time.perf_counter() - t0
    pm = ParallelModel(
        plan=plan, env=env, modules=s.modules, roots=s.roots, runners=s.runners, stage_indices=s.mine,
        optimizer=s.master.attach(optimizer_factory) if s.master is not None  # type: ignore[arg-type]
        else _optimizer(optimizer_factory, unique_params(s.modules), plan, env, s.ecs), loss_fn=loss_fn,
        dp_mode=s.mode, schedule=s.schedule, notes=notes, tied_fqns=checked.tied, converted=checked.conv,
        precision=checked.precision, scaler=s.scaler, grad_sync=s.grad_sync, sync_counter=s.counter,
        loss_parallel=checked.head is not None, epcp=s.ecs, input_names=checked.names, phase_spans=s.spans,
        master=s.master,
    )
    if s.pipelined:  # each stage reads its model inputs from the schedule's keywords (split.KeywordInputs)
        pm.input_keywords = tuple(split.input_keyword(n) for n in s.pieces[0].model_inputs)
        pm.reads_inputs = any(s.pieces[i].reads for i in s.mine)
    pm.ties = tie_groups(env, s.shared, pm.stage_indices, {i: s.pieces[i].module for i in s.mine} if s.pipelined else {})
    if s.init_from is not None:  # not read yet (a 16-bit layout reads it before its cast: steps.apply_state_layout)
        t0 = time.perf_counter()
        pm.notes.append(load_pretrained(pm.container(), init_from, tied=pm.tied_fqns,
                                        transposed=[f"{m}.weight" for m in pm.converted]))
        startup["pretrained weights"] = time.perf_counter() - t0
    pm.startup_s = startup
    return pm


def _meta_build(model: nn.Module, tape: InitTape | None, init_from: object) -> MetaBuild | None:
    """None for a host-built model; else what materializes it (refused when nothing can)."""
    if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        if tape is not None:
            raise ValueError("apply_plan: a tape is for a model built on the meta device; this one has values")
        return None
    if tape is None:
        raise ValueError("apply_plan: the model is on the meta device: pass the InitTape it was built under "
                         "(load_model(spec, device='meta', tape=InitTape()))")
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return MetaBuild(tape=tape, finals=tape.refs_of(iter(named)), init_from=init_from)  # type: ignore[arg-type]


def _optimizer(factory: Callable, params: list[torch.Tensor], plan: Plan, env: RuntimeEnv,
               ecs: EPCPState | None) -> torch.optim.Optimizer:
    """``factory``'s optimizer; zero1: ZeroRedundancyOptimizer over the dp group, or under cp over
    the dp x cp group (``Plan.dp_state_ranks``), whose gradients ``ecs`` all-reduces before the step."""
    opt = factory(params)
    if plan.dp_kind == "zero1" and plan.dp_state_ranks() > 1:
        group = ecs.groups.dc_group if plan.dp_state_ranks() != plan.dp and ecs is not None else env.group("dp")
        return zero1_optimizer(opt, params, group)  # type: ignore[arg-type]
    return opt
