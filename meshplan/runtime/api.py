"""``apply_plan(model, plan, *, loss_fn, optimizer_factory) -> ParallelModel``: run a Plan.

Order: checks (no collective) -> process group + DeviceMesh -> stage split (with sequence
parallelism at pp > 1, sequence shard/gather modules are first inserted in the captured graph) ->
TP per stage (with sequence parallelism when the plan asks; refused when ``tp.sp_blocker`` finds a
reason; an LM head sharded over the vocabulary keeps its logits sharded for ``loss_parallel``) ->
quantized training per stage (``meshplan.runtime.quant``; after TP because QLoRA quantizes each
rank's shard, QAT works either way) -> recompute -> precision (``runtime.precision``) ->
``--compile`` -> data parallel per stage (``runtime.data_parallel``; bucketed overlapped
all-reduce ``runtime.grad_sync`` where DDP cannot run) -> pipeline stages + schedule -> optimizer
(over the parameters that still require grad; ZeroRedundancyOptimizer for zero1).
Plan options the runtime cannot execute as costed raise PlanMismatchError before training.

``ParallelModel.step(inputs, targets)`` takes the GLOBAL batch (the same tensors on every rank),
keeps this rank's data-parallel slice (``step(x, y, local=True)``: the rank's own share, read by
``meshplan.runtime.data``; None where its pipeline stages do not need it), runs forward/backward (the pipeline schedule, or plain
gradient accumulation over the plan's microbatches when pp=1), waits for the bucketed data-parallel
all-reduces (manual mode), sums the gradients of tied weights between the pipeline ranks holding a
copy, unscales (fp16), clips the global gradient norm (``max_grad_norm``), sets this step's
learning rate (``lr_fn``), steps the optimizer, and returns the loss of the whole global step (mean of the microbatch
losses; identical on all ranks). A step whose loss is NaN/inf (or, with ``check_grads``, any
gradient) does not step the optimizer and is listed in ``skipped_steps``. ``loss_fn`` must average over its batch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from meshplan.cost_models.grad_sync import DEFAULT_BUCKET_CAP_BYTES
from meshplan.errors import PlanMismatchError
from meshplan.execution_rules import ZERO_BUBBLE_SCHEDULES
from meshplan.models.calls import call_names, microbatch_example, split_inputs
from meshplan.plan import Plan
from meshplan.runtime import data_parallel as dpmod
from meshplan.runtime import loss_parallel as lpmod
from meshplan.runtime import optim, recompute, schedules, split, tp
from meshplan.runtime import precision as prec
from meshplan.runtime.dist import RuntimeEnv, check_launch, init_runtime
from meshplan.runtime.epcp import EPCPState, apply_epcp, epcp_blocker, uses_epcp
from meshplan.runtime.grad_sync import BucketedGradSync
from meshplan.runtime.stage_params import Tie, merge_modules, shared_params, tie_groups, unique_params


@dataclass
class ParallelModel:
    plan: Plan
    env: RuntimeEnv
    modules: list[nn.Module]  # what runs: local stage GraphModules, or the model (HF: in HFLogits)
    roots: list[nn.Module]  # the same modules at the user's FQNs (state dicts, TP styles)
    runners: list[nn.Module]  # what runs forward: DDP wrappers or the modules themselves
    stage_indices: list[int]
    optimizer: torch.optim.Optimizer
    loss_fn: Callable
    dp_mode: str
    schedule: object | None
    ties: list[Tie] = field(default_factory=list)
    tied_fqns: list[tuple[str, ...]] = field(default_factory=list)  # user FQNs naming one Parameter
    notes: list[str] = field(default_factory=list)
    converted: list[str] = field(default_factory=list)  # HF Conv1D modules now nn.Linear (weight transposed)
    step_times_s: list[float] = field(default_factory=list)
    steps_done: int = 0
    # NaN guard: a step whose global loss (or, with check_grads, any gradient) is NaN/inf applies no
    # update; its number goes to skipped_steps and the caller decides whether to stop (train.py does)
    check_grads: bool = False
    skipped_steps: list[int] = field(default_factory=list)
    precision: str = "fp32"  # what runs: bf16 | fp16 | fp32 (runtime.precision)
    scaler: object | None = None  # fp16: torch's ShardedGradScaler over the world
    grad_sync: BucketedGradSync | None = None  # manual mode: bucketed overlapped all-reduce
    sync_counter: dpmod.SyncCounter = field(default_factory=dpmod.SyncCounter)
    grad_sync_collectives: int = 0  # gradient-reducing collective calls counted in the last step
    max_grad_norm: float | None = None  # clip the global gradient norm to this (runtime.optim); None: no clipping
    lr_fn: Callable[[int], float] | None = None  # 1-based step -> learning rate; None: the optimizer's own
    last_grad_norm: float | None = None  # global gradient norm before clipping, last step
    loss_parallel: bool = False  # the LM head's output is vocabulary-sharded: loss under loss_parallel()
    epcp: EPCPState | None = None  # expert/context parallelism (cp or ep > 1): batch shard + grad sync
    input_names: tuple[str, ...] | None = None  # dict keys of the example (batches are ordered so)

    # ---- info ---------------------------------------------------------------------------
    @property
    def has_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def has_last(self) -> bool:
        return len(self.plan.stages) - 1 in self.stage_indices if self.plan.pp > 1 else True

    def parameters(self) -> list[torch.Tensor]:
        return unique_params(self.modules)

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """FQN -> local parameter (a DTensor under TP/FSDP), over this rank's stages."""
        out: dict[str, torch.Tensor] = {}
        for m in self.roots:
            for n, p in m.named_parameters(remove_duplicate=False):
                out.setdefault(recompute.clean_fqn(n), p)
        return out

    def container(self) -> nn.Module:
        """One module whose FQNs are the original ones, over this rank's stages (for state dicts)."""
        if len(self.roots) == 1 and self.plan.pp == 1:
            return self.roots[0]
        return merge_modules(self.roots)

    # ---- training -----------------------------------------------------------------------
    def _local_batch(self, t: torch.Tensor) -> torch.Tensor:
        dp, d = self.env.degree("dp"), self.env.coord("dp")
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        b = t.shape[0]
        if b % (dp * self.plan.num_microbatches):
            raise ValueError(
                f"global batch {b} must be divisible by dp*microbatches = {dp}*{self.plan.num_microbatches}"
            )
        per = b // dp
        t = t[d * per : (d + 1) * per].to(self.env.device)
        return self.epcp.shard(t) if self.epcp is not None else t

    def _positional(self, inputs: object) -> tuple:
        """The batch as the positional tensors the modules take (dict keys as at apply time)."""
        names, vals = split_inputs(inputs)
        if names is not None and self.input_names is not None and names != self.input_names:
            if set(names) != set(self.input_names):
                raise ValueError(f"batch keys {list(names)} differ from the example's {list(self.input_names)}")
            vals = tuple(inputs[k] for k in self.input_names)  # type: ignore[index]
        return vals

    def rank_batch(self, inputs: object, targets: torch.Tensor | None, *,
                   local: bool) -> tuple[tuple, torch.Tensor | None]:
        """This rank's (inputs as positional tensors, targets) on its device: sliced from the global
        batch, or as given when ``local`` (the rank read its own share; inputs may be None off the
        first stage, targets off the last). ``inputs``: a tensor, tuple or dict (as the example)."""
        if not local:
            assert inputs is not None and targets is not None
            return tuple(self._local_batch(t) for t in self._positional(inputs)), self._local_batch(targets)
        if (inputs is None and self.has_first) or (targets is None and self.has_last):
            raise ValueError("step(local=True): the first stage needs inputs and the last stage needs targets")
        dev = self.env.device
        xs = () if inputs is None else tuple(t.to(dev) if isinstance(t, torch.Tensor) else t
                                             for t in self._positional(inputs))
        return xs, (None if targets is None else targets.to(dev))

    def step(self, inputs: object, targets: torch.Tensor | None, *, local: bool = False) -> float:
        """One training step on the GLOBAL batch (or this rank's share with ``local``): ``inputs`` a
        tensor, tuple or dict of tensors (as the example given to ``apply_plan``)."""
        t0 = time.perf_counter()
        xs, y = self.rank_batch(inputs, targets, local=local)
        m = self.plan.num_microbatches
        local_loss = torch.zeros((), dtype=torch.float64)
        self.sync_counter.calls = 0
        if self.schedule is None:
            model = self.runners[0]
            chunks = list(zip(*(t.chunk(m) for t in xs)))
            for i, (xm, ym) in enumerate(zip(chunks, y.chunk(m))):
                last = i == m - 1
                # reduce gradients once, after the last microbatch (DDP no_sync / FSDP2 sync flag)
                ctx = model.no_sync() if hasattr(model, "no_sync") and not last else _null()  # type: ignore[operator]
                if hasattr(model, "set_requires_gradient_sync"):
                    model.set_requires_gradient_sync(last)  # type: ignore[operator]
                with ctx, lpmod.context(self.loss_parallel):
                    loss = self.loss_fn(prec.to_fp32(model(*xm)), ym)
                    part = loss / m
                    (self.scaler.scale(part) if self.scaler is not None else part).backward()  # type: ignore[attr-defined]
                local_loss += lpmod.plain(loss.detach()).double().cpu() / m
        else:
            losses: list[torch.Tensor] = []
            args = xs if self.has_first else ()
            kw = {"target": y, "losses": losses} if self.has_last else {}
            with lpmod.context(self.loss_parallel):
                self.schedule.step(*args, **kw)  # type: ignore[attr-defined]
            for p in self.parameters():  # schedules run with scale_grads=False (see schedules.py)
                if p.grad is not None and not (self.grad_sync is not None and self.grad_sync.owns(p)):
                    p.grad.div_(m)
            if self.has_last:  # the schedule's losses carry the fp16 loss scale
                local_loss += torch.stack([lpmod.plain(v.detach()).double().cpu() for v in losses]).mean() / self._loss_scale()
        if self.grad_sync is not None:
            self.grad_sync.finish()
        self.grad_sync_collectives = self.sync_counter.calls + (
            self.grad_sync.collectives_last_step if self.grad_sync is not None else 0)
        if self.dp_mode == "epcp" and self.epcp is not None:
            self.epcp.sync(self.parameters())
        for tie in self.ties:
            if tie.param.grad is not None:
                g = tie.param.grad
                g = g.to_local() if hasattr(g, "to_local") else g
                dist.all_reduce(g, group=tie.group)
        loss, grads_bad = self._global_loss(local_loss)
        # fp16: non-finite gradients are the scaler's business (it skips the step and lowers the scale)
        if math.isfinite(loss) and (not grads_bad or self.scaler is not None):
            self._optimizer_step()
        else:
            self.skipped_steps.append(self.steps_done + 1)
        self.optimizer.zero_grad(set_to_none=True)
        self.step_times_s.append(time.perf_counter() - t0)
        self.steps_done += 1
        return loss

    def _optimizer_step(self) -> None:
        """fp16 unscale, global gradient-norm clipping, this step's learning rate, the update."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # type: ignore[attr-defined]
        if self.max_grad_norm:
            skip = [t.param for t in self.ties if dist.get_rank(t.group) != 0]  # a tied weight counts once
            self.last_grad_norm = optim.clip_grad_norm(self.parameters(), self.max_grad_norm,
                                                       pp_group=self.env.group("pp"), skip=skip)
        if self.lr_fn is not None:
            optim.set_lr(self.optimizer, self.lr_fn(self.steps_done + 1))
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # type: ignore[attr-defined]
            self.scaler.update()  # type: ignore[attr-defined]
        else:
            self.optimizer.step()

    def _loss_scale(self) -> float:
        if self.scaler is None:
            return 1.0
        return float(self.scaler.get_scale())  # type: ignore[attr-defined]

    def _global_loss(self, local_loss: torch.Tensor) -> tuple[float, bool]:
        """(loss of the global step, whether any rank has a non-finite gradient): ONE all-reduce."""
        share = self.env.degree("dp") * self.env.degree("cp") * self.env.degree("tp")
        contrib = (local_loss / share) if self.has_last else torch.zeros((), dtype=torch.float64)
        bad = torch.zeros((), dtype=torch.float64)
        if self.check_grads:
            grads = [g.to_local() if hasattr(g, "to_local") else g for p in self.parameters() if (g := p.grad) is not None]
            if grads and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()):
                bad += 1
        both = torch.stack([contrib, bad]).to(self.env.device)
        dist.all_reduce(both)
        return float(both[0].item()), bool(both[1].item() > 0)

    # ---- state --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, object]:
        """Model state (FQN -> tensor; DTensors under TP/FSDP) of this rank's stages."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.container())

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """FQN -> full (unsharded) trainable parameter of this rank's stages; a collective under TP/FSDP."""
        out = {}
        for n, p in self.named_parameters().items():
            if not p.requires_grad:
                continue
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[n] = t.detach().clone()
        return out


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


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
) -> ParallelModel:
    """Apply ``plan`` to ``model`` on this rank. ``example_inputs`` (a tensor, tuple or dict of
    tensors, as batches will be given to ``step``; any batch size, it is resized to the plan's
    microbatch) is needed when pp > 1 or the model is called by keyword.

    ``dtype`` ("plan", "bf16", "fp16", "fp32") is the precision to train in (``runtime.precision``);
    ``bucket_cap_bytes`` the gradient bucket size of the manual (pipelined) data-parallel sync;
    ``compile`` applies ``torch.compile`` per repeated block (``runtime.compiling``).
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
    why = epcp_blocker(model, plan)
    if why:
        raise PlanMismatchError(f"plan {plan.summary()!r} cannot run: {why}")
    notes: list[str] = []
    precision = prec.resolve_precision(plan.dtype, dtype)
    if any(p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError(
            "apply_plan: the model's parameters must be fp32 (master weights); the plan's precision "
            f"({precision}) is applied by autocast / FSDP2 mixed precision. Build the model in fp32"
        )

    # 2. process group and mesh
    env = init_runtime(plan, timeout_s=timeout_s)
    model = model.to(env.device)
    ecs = apply_epcp(model, plan, env) if uses_epcp(plan) else None  # experts sharded before anything wraps them
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
    head = None  # the LM head kept sharded over the vocabulary for loss_parallel (runtime.loss_parallel)
    names = None
    if example_inputs is not None:
        example_inputs = microbatch_example(example_inputs, plan.micro_batch_size)
        names = split_inputs(example_inputs)[0]
    if pp > 1:
        gm, prefix = split.capture_graph(model, example_inputs)
        if plan.tp > 1 and plan.quantization.mode == "none":
            head = lpmod.vocab_head(gm, prefix, styles, plan.tp_gathered_outputs)
        pieces = split.split_stages(gm, ordered)
        split.check_stage_chain(pieces, example_inputs)
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
        if plan.tp > 1 and plan.quantization.mode == "none" and example_inputs is not None and any(
                s == "colwise" for s in styles.values()):
            cg, cprefix = split.capture_graph(model, example_inputs)
            head = lpmod.vocab_head(cg, cprefix, styles, plan.tp_gathered_outputs)

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
            _check_tp_modules(r, styles)
            if sp and pp > 1:
                tp.apply_stage_sequence_parallel(r, env.mesh["tp"], styles, tp.block_fqns(model),
                                                 plan.tp_gathered_outputs, vocab_sharded=vs)
            elif sp:
                tp.apply_sequence_parallel(r, env.mesh["tp"], styles, plan.tp_gathered_outputs, vocab_sharded=vs)
            else:
                tp.apply_tp(r, env.mesh["tp"], styles, plan.tp_gathered_outputs, vocab_sharded=vs)
    elif plan.sequence_parallel:
        notes.append("sequence_parallel ignored: tp = 1")

    # 4b. quantized training (meshplan.runtime.quant), on each stage root after TP: QAT works in
    # either order with TP; QLoRA must follow parallelize_module (it quantizes each rank's shard)
    mode = dpmod.dp_mode(plan)
    if plan.quantization.mode != "none":
        from meshplan.runtime.quant import apply_quantization

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
        from meshplan.runtime.compiling import apply_compile

        notes.append(f"torch.compile: {apply_compile(modules, pipelined=pp > 1)} modules compiled")

    # 5. data parallel per stage
    dp_mesh = env.mesh["dp"] if plan.dp > 1 else None
    counter = dpmod.SyncCounter()
    if plan.quantization.mode == "qlora" and mode == "ddp":
        from meshplan.runtime.quant.qlora import ddp_ignore_quantized

        for m in modules:
            ddp_ignore_quantized(m)
    per_block = pp == 1 and plan.quantization.mode == "none"
    if plan.dp_kind == "hsdp" and dp_mesh is not None:
        shard = plan.hsdp_shard_degree()
        dp_mesh = dp_mesh._unflatten(0, (plan.dp // shard, shard), ("dp_replicate", "dp_shard"))
    runners = [dpmod.wrap_dp(m, mode, dp_mesh=dp_mesh, dp_group=env.group("dp"), counter=counter,
                             mp_policy=prec.fsdp_policy(precision), per_block=per_block,
                             reshard_after_forward=plan.dp_kind != "zero2") for m in modules]
    if plan.dp > 1:
        notes.append(f"data parallel {plan.dp_kind}: " + {
            "fsdp": "FSDP2 fully_shard (ZeRO-3)", "zero2": "FSDP2 fully_shard, reshard_after_forward=False (ZeRO-2)",
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

    # 6. pipeline stages and schedule
    schedule, scaler = None, None
    if pp > 1:
        from torch.distributed.pipelining import PipelineStage

        pstages = [
            PipelineStage(r, i, len(ordered), env.device, group=env.group("pp")) for r, i in zip(runners, mine)
        ]
        if grad_sync is not None and plan.schedule in ZERO_BUBBLE_SCHEDULES:
            for st, m in zip(pstages, modules):
                grad_sync.watch_weight_passes(st, list(m.parameters()))
        scaler = prec.make_scaler(precision)
        schedule = schedules.build_schedule(plan.schedule, pstages, plan.num_microbatches,
                                            _StageLoss(loss_fn, scaler))

    pm = ParallelModel(
        plan=plan, env=env, modules=modules, roots=roots, runners=runners, stage_indices=mine,
        optimizer=_optimizer(optimizer_factory, unique_params(modules), plan, env), loss_fn=loss_fn, dp_mode=mode,
        schedule=schedule, notes=notes, tied_fqns=tied, converted=conv, precision=precision,
        scaler=scaler if pp > 1 else prec.make_scaler(precision), grad_sync=grad_sync, sync_counter=counter,
        loss_parallel=head is not None, epcp=ecs, input_names=names,
    )
    pm.ties = tie_groups(env, shared, pm.stage_indices, {i: pieces[i].module for i in mine} if pp > 1 else {})
    return pm


def _optimizer(factory: Callable, params: list[torch.Tensor], plan: Plan, env: RuntimeEnv) -> torch.optim.Optimizer:
    opt = factory(params)
    if plan.dp_kind == "zero1" and plan.dp > 1:
        return optim.zero1_optimizer(opt, params, env.group("dp"))  # type: ignore[arg-type]
    return opt


class _StageLoss:
    """The pipeline schedule's loss: logits upcast to fp32, times the fp16 loss scale if any."""

    def __init__(self, loss_fn: Callable, scaler: object | None) -> None:
        self.loss_fn = loss_fn
        self.scaler = scaler

    def __call__(self, out: object, target: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(prec.to_fp32(out), target)
        return self.scaler.scale(loss) if self.scaler is not None else loss  # type: ignore[attr-defined]


def _sub_or_self(m: nn.Module, prefix: str) -> nn.Module:
    return m.get_submodule(prefix.rstrip(".")) if prefix else m


def _check_tp_modules(root: nn.Module, styles: dict[str, str]) -> None:
    mods = dict(root.named_modules())
    bad = [f for f, s in styles.items() if s != "replicate" and f in mods
           and not isinstance(mods[f], (nn.Linear, nn.Embedding))]
    if bad:
        raise PlanMismatchError(
            f"TP styles name modules that are not nn.Linear/nn.Embedding in this stage: {bad[:4]} "
            "(a torch.export capture keeps no Linear modules); TP inside pipeline stages needs an fx capture"
        )
