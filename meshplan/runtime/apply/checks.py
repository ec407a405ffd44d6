"""``check_plan``: every refusal of a Plan on this model, made once, before anything is applied.

Runs on every rank before the process group exists (no collective), so all ranks refuse alike and
none hangs. It needs no launch (``apply_plan`` checks the world size first): ``meshplan run`` also
runs it once in the launching process on a meta build, before torchrun starts
(``commands/preflight.py``). The rules are the shared ``meshplan.plan.execution_rules`` (the ones
the search obeys) plus what only the model can tell. Under pp > 1 the rules read the captured graph,
so the capture and the stage split are made here (every rank splits every stage and runs the chain
once); the ``Checked`` it returns carries them to the appliers (``runtime.apply.steps``).

The one change made to the model here is the one the capture must see: HF ``Conv1D`` modules that
TP shards become ``nn.Linear`` (weights transposed), as ``tp.convert_conv1d`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from meshplan.calls import microbatch_example, split_inputs
from meshplan.errors import PlanMismatchError
from meshplan.plan import Plan, StageSpec
from meshplan.plan.execution_rules import (
    BATCH_NORM_CLASSES,
    epcp_rule,
    microbatch_blocker,
    state_layout_blocker,
    tied_weight_blocker,
    tp_pp_blocker,
)
from meshplan.runtime.apply import data_parallel as dpmod
from meshplan.runtime.apply import loss_parallel as lpmod
from meshplan.runtime.apply import precision as prec
from meshplan.runtime.apply import schedules, split, tp, tp_export
from meshplan.runtime.apply.epcp import epcp_blocker, uses_epcp
from meshplan.runtime.apply.epcp_pipeline import pipeline_cp_blocker
from meshplan.runtime.apply.quant_load import streams

#: why a meta build was refused (``MetaBuildRefused.reason``)
REFUSED_STAGES = "stages"  # the pipeline stages do not run on the meta device
REFUSED_QLORA_HOST_EXACT = "qlora-host-exact"  # a QLoRA plan under --init host-exact (quant_load.qlora_refuses)


class MetaBuildRefused(ValueError):
    """A meta-built model this plan cannot be checked or applied on (raised before any collective:
    the caller may build the model on the host and apply again). ``reason`` says which refusal
    (``REFUSED_STAGES`` or ``REFUSED_QLORA_HOST_EXACT``), for a caller to tell them apart without
    reading the message."""

    def __init__(self, message: str, *, reason: str) -> None:
        if reason not in (REFUSED_STAGES, REFUSED_QLORA_HOST_EXACT):
            raise ValueError(f"MetaBuildRefused: reason {reason!r} unknown")
        super().__init__(message)
        self.reason = reason


@dataclass
class Checked:
    """What the checks found and the appliers use: nothing here has touched a process group."""

    precision: str  # what runs: bf16 | fp16 | fp32
    ordered: list[StageSpec]  # the plan's stages by index
    styles: dict[str, str]  # effective TP styles (tied pairs resolved)
    tied: list[tuple[str, ...]]  # user FQNs naming one Parameter
    conv: list[str] = field(default_factory=list)  # HF Conv1D modules converted to nn.Linear
    example: Any = None  # one microbatch of example inputs (None when not given)
    names: list[str] | None = None  # keyword names of the inputs
    head: str | None = None  # the LM head kept vocabulary-sharded for loss_parallel
    capture: Any = None  # pp > 1: the captured graph (``tracing.capture.Captured``)
    pieces: list[split.StagePiece] = field(default_factory=list)  # pp > 1: every stage module
    notes: list[str] = field(default_factory=list)


def _refuse(plan: Plan, why: str) -> None:
    if why:
        raise PlanMismatchError(f"plan {plan.summary()!r} cannot run: {why}")


def check_plan(model: nn.Module, plan: Plan, example_inputs: Any = None, dtype: str = "plan", *,
               capture: bool = True, init_from: Any = None) -> Checked:
    """Refuse (``PlanMismatchError`` / ``ValueError``, one line) what this runtime cannot run as
    costed; return what the appliers need (see the module docstring). Needs no launch or process group.
    ``capture=False`` (the launcher's check) leaves out what needs the captured graph (pp > 1: the
    stage split and the rules on it; tp: the vocabulary-parallel head): the ranks check those."""
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
    _refuse(plan, epcp_blocker(model, plan) or microbatch_blocker(
        pp=pp, num_microbatches=plan.num_microbatches,
        batch_norms=sum(type(m).__name__ in BATCH_NORM_CLASSES and m.training for m in model.modules()),
    ))
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and plan.quantization.mode != "none" and not streams(plan, model, init_from):
        raise ValueError(f"apply_plan: quantization ({plan.quantization.mode}) runs on a meta-built model only as "
                         "QLoRA with a Hugging Face safetensors init_from or none, or QAT without TP or pipelining: "
                         "build the model on the host (load_model without device='meta')")
    precision = prec.resolve_precision(plan.dtype, dtype)
    why = state_layout_blocker(state_layout=plan.state_layout, dp_kind=plan.dp_kind if plan.dp > 1 else "none",
                               dtype=precision, cp=plan.cp, ep=plan.ep, quantization=plan.quantization.mode)
    if why:
        raise PlanMismatchError(why)
    if any(p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError(
            "apply_plan: the model's parameters must be fp32 (master weights); the plan's precision "
            f"({precision}) is applied by autocast / FSDP2 mixed precision. Build the model in fp32"
        )
    tied = split.tied_parameter_groups(model)
    styles, notes = tp.effective_styles(model, plan.tp_styles, tied)
    c = Checked(precision=precision, ordered=ordered, styles=styles, tied=tied, notes=list(notes))
    if plan.tp > 1:
        c.conv = tp.convert_conv1d(model, [f for f, s in styles.items() if s != "replicate"])
        if c.conv:
            c.notes.append(f"HF Conv1D converted to nn.Linear for TP (weights transposed): {c.conv}")
    if plan.sequence_parallel and plan.tp > 1:
        sp_why = tp.sp_blocker(model, styles)
        if sp_why:  # refused, not run as something else than planned
            raise PlanMismatchError(f"sequence_parallel is planned but this model cannot run it ({sp_why}); "
                                    "re-plan with sequence_parallel off")
    if example_inputs is not None:
        c.example = microbatch_example(example_inputs, plan.micro_batch_size)
        if on_meta:  # captured and checked on the meta device, like the model
            c.example = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, c.example)
        c.names = split_inputs(c.example)[0]
    if not capture:
        return c
    if pp > 1:
        _check_stages(model, plan, c)
    elif plan.tp > 1 and c.example is not None and any(s == "colwise" for s in styles.values()):
        cg, cprefix = split.capture_graph(model, c.example)
        c.head = lpmod.vocab_head(cg, cprefix, styles, plan.tp_gathered_outputs, tp.embedding_fqns(model))
    if c.head and plan.quantization.mode != "none":
        from meshplan.runtime.apply.quant.targets import targeted_linears

        if c.head in targeted_linears(model, plan.quantization):  # a quantized head's layouts gather its output
            c.notes.append(f"loss_parallel not applied: the LM head {c.head} is quantized ({plan.quantization.mode}); "
                           "its logits are gathered")
            c.head = None
    return c


def _check_stages(model: nn.Module, plan: Plan, c: Checked) -> None:
    """pp > 1: capture, the rule on the capture kind, split, the stage chain, tied weights, cp/ep in stages."""
    cap = split.capture(model, c.example)
    c.capture = cap
    why = tp_pp_blocker(tp=plan.tp, pp=plan.pp, capture=cap.kind, sequence_parallel=plan.sequence_parallel)
    if why:  # the rule the search obeys
        raise PlanMismatchError(f"plan {plan.summary()!r} cannot run: {why}; this model's fx capture: {cap.fx_error}")
    if plan.tp > 1:
        c.head = lpmod.vocab_head(cap.gm, cap.prefix, c.styles, plan.tp_gathered_outputs, tp.embedding_fqns(model))
        if cap.kind == "export":  # TP inside exported stages: can every shard be followed? (tp_export)
            _refuse(plan, tp_export.prepare(cap.gm, cap.prefix, c.styles, stage_tp_plan(model, plan, c), plan.tp,
                                            apply=False))
    c.pieces = split.split_stages(cap.gm, c.ordered)
    try:
        split.check_stage_chain(c.pieces, c.example)
    except (NotImplementedError, RuntimeError) as e:
        if not any(p.is_meta for p in model.parameters()):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MetaBuildRefused("apply_plan: this model's pipeline stages do not run on the meta device, so their "
                         f"boundaries cannot be checked there ({first[:160]}); build it on the host "
                         "(meshplan run --build host)", reason=REFUSED_STAGES) from e
    for piece in c.pieces:  # every rank checks every stage: all refuse together, none hangs
        pname, uses = split.most_used_parameter(piece)
        why = tied_weight_blocker(pp=plan.pp, schedule=plan.schedule, uses=uses, name=pname)
        _refuse(plan, f"stage {piece.index}: {why}" if why else "")
    if uses_epcp(plan):  # the capture this run got decides what cp/ep can do inside stages
        _refuse(plan, epcp_rule(cp=plan.cp, ep=plan.ep, tp=plan.tp, pp=plan.pp, dp=plan.dp, seq_len=plan.seq_len or 2 * plan.cp,
                                num_experts=0, recompute=plan.recompute, capture=cap.kind))
        if plan.cp > 1:
            _refuse(plan, pipeline_cp_blocker([p.module for p in c.pieces], cap.kind))


def stage_tp_plan(model: nn.Module, plan: Plan, c: Checked) -> dict[str, Any]:
    """User FQN -> the ParallelStyle ``tp.apply_tp`` gives each sharded module (what runs in the stages)."""
    return tp.build_parallel_plan(c.styles, {n for n, _ in model.named_modules()}, plan.tp_gathered_outputs,
                                  vocab_sharded=[c.head] if c.head else [], embeddings=tp.embedding_fqns(model))
