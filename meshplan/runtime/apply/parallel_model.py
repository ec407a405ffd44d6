"""``ParallelModel``: what one rank runs for a Plan (built by ``runtime.apply.api.apply_plan``), and its step.

``ParallelModel.step(inputs, targets)`` takes the GLOBAL batch (the same tensors on every rank),
keeps this rank's data-parallel slice (``step(x, y, local=True)``: the rank's own share, read by
``meshplan.runtime.loop.data``; None where its pipeline stages do not need it), runs forward/backward (the pipeline schedule, or plain
gradient accumulation over the plan's microbatches when pp=1), waits for the bucketed data-parallel
all-reduces (manual mode), sums the gradients of tied weights between the pipeline ranks holding a
copy, unscales (fp16), clips the global gradient norm (``max_grad_norm``), sets this step's
learning rate (``lr_fn``), steps the optimizer, and returns the loss of the whole global step (mean of the microbatch
losses; identical on all ranks). A step whose loss is NaN/inf (or, with ``check_grads``, any
gradient) does not step the optimizer and is listed in ``skipped_steps``. ``loss_fn`` must average over its batch.
Each phase of the step (forward, backward, exposed gradient communication, optimizer, the pipeline
schedule) runs inside a ``phase_spans`` range, which costs nothing unless ``runtime.record.phases.measure``
turns the profiler ranges on for extra profiled steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from meshplan.calls import split_inputs
from meshplan.plan import Plan
from meshplan.runtime.apply import data_parallel as dpmod
from meshplan.runtime.apply import loss_parallel as lpmod
from meshplan.runtime.apply import optim, recompute
from meshplan.runtime.apply import precision as prec
from meshplan.runtime.apply.epcp import EPCPState
from meshplan.runtime.apply.grad_sync import BucketedGradSync
from meshplan.runtime.apply.master_state import MasterState
from meshplan.runtime.apply.stage_params import Tie, merge_modules, unique_params
from meshplan.runtime.launch import collectives
from meshplan.runtime.launch.dist import RuntimeEnv
from meshplan.runtime.record.phases import PhaseSpans


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
    precision: str = "fp32"  # what runs: bf16 | fp16 | fp32 (runtime.apply.precision)
    scaler: object | None = None  # fp16: torch's ShardedGradScaler over the world
    # fp16: steps whose update the scaler skipped (inf/NaN gradients on some rank; the scale halves)
    scaler_skipped_steps: list[int] = field(default_factory=list)
    grad_sync: BucketedGradSync | None = None  # manual mode: bucketed overlapped all-reduce
    sync_counter: dpmod.SyncCounter = field(default_factory=dpmod.SyncCounter)
    grad_sync_collectives: int = 0  # gradient-reducing collective calls counted in the last step
    grad_sync_bytes: int = 0  # bytes those collectives reduced (counted), last step
    max_grad_norm: float | None = None  # clip the global gradient norm to this (runtime.apply.optim); None: no clipping
    lr_fn: Callable[[int], float] | None = None  # 1-based step -> learning rate; None: the optimizer's own
    last_grad_norm: float | None = None  # global gradient norm before clipping, last step
    loss_parallel: bool = False  # the LM head's output is vocabulary-sharded: loss under loss_parallel()
    epcp: EPCPState | None = None  # expert/context parallelism (cp or ep > 1): batch shard + grad sync
    input_names: tuple[str, ...] | None = None  # dict keys of the example (batches are ordered so)
    # pp > 1: the keyword each positional model input goes to the schedule under (split.input_keyword);
    # every stage takes the ones it reads (split.KeywordInputs), none crosses a stage boundary
    input_keywords: tuple[str, ...] = ()
    reads_inputs: bool = True  # this rank's modules read model inputs (pp > 1: one of its stages does)
    phase_spans: PhaseSpans = field(default_factory=PhaseSpans)  # profiler ranges per phase (runtime.record.phases)
    # seconds of the last step this rank waited for others: from its last gradient bucket (its own work
    # done) to the end of the gradient and loss reductions (``meshplan.stragglers``)
    last_wait_s: float = 0.0
    # seconds of apply_plan's parts on this rank (plan checks, process group, materialize, wrapping)
    startup_s: dict[str, float] = field(default_factory=dict)
    # state_layout "megatron": 16-bit parameters whose gradients live in fp32 main gradients, stepped
    # through fp32 masters (``runtime.apply.master_state``; it is also ``optimizer``)
    master: MasterState | None = None

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
        if (inputs is None and self.reads_inputs) or (targets is None and self.has_last):
            raise ValueError("step(local=True): a rank whose stages read model inputs needs them, the last stage "
                             "needs targets")
        dev = self.env.device
        shard = self.epcp.shard if self.epcp is not None else (lambda t: t)  # cp: this rank's sequence shard
        xs = () if inputs is None else tuple(shard(t.to(dev)) if isinstance(t, torch.Tensor) else t
                                             for t in self._positional(inputs))
        return xs, (None if targets is None else shard(targets.to(dev)))

    def schedule_inputs(self, xs: tuple) -> dict[str, object]:
        """pp > 1: this rank's model inputs (``rank_batch``'s) as the keywords of ``schedule.step``,
        which hands them to every stage of the rank per microbatch; empty where no stage reads one."""
        if not self.reads_inputs or not xs:
            return {}
        if len(xs) > len(self.input_keywords):
            raise ValueError(f"the batch has {len(xs)} inputs, the model was captured with {len(self.input_keywords)}")
        return dict(zip(self.input_keywords, xs))  # inputs left out (position_ids=None) take their defaults

    def step(self, inputs: object, targets: torch.Tensor | None, *, local: bool = False) -> float:
        """One training step on the GLOBAL batch (or this rank's share with ``local``): ``inputs`` a
        tensor, tuple or dict of tensors (as the example given to ``apply_plan``)."""
        t0 = time.perf_counter()
        xs, y = self.rank_batch(inputs, targets, local=local)
        m = self.plan.num_microbatches
        local_loss = torch.zeros((), dtype=torch.float64)
        self.sync_counter.reset()
        if self.schedule is None:
            model = self.runners[0]
            chunks = list(zip(*(t.chunk(m) for t in xs)))
            for i, (xm, ym) in enumerate(zip(chunks, y.chunk(m))):
                last = i == m - 1
                # DDP reduces once, after the last microbatch (no_sync); FSDP2 (zero2/fsdp/hsdp)
                # reduce-scatters every microbatch, so gradients accumulate sharded (the ZeRO-2/3
                # memory and the per-microbatch reduce-scatter that cost_models.dp_kinds prices)
                ctx = model.no_sync() if hasattr(model, "no_sync") and not last else _null()  # type: ignore[operator]
                with ctx, lpmod.context(self.loss_parallel):
                    with self.phase_spans.span("forward"):
                        loss = self.loss_fn(prec.to_fp32(model(*xm)), ym)
                        part = loss / m
                    with self.phase_spans.span("backward"):
                        (self.scaler.scale(part) if self.scaler is not None else part).backward()  # type: ignore[attr-defined]
                local_loss += lpmod.plain(loss.detach()).double().cpu() / m
            if self.master is not None:
                self.master.fold_all()
        else:
            losses: list[torch.Tensor] = []
            # return_outputs=False: the last stage keeps no microbatch's output (the logits) until the step
            # ends; the losses list is all this step reads (cost_models.allocator costs the same)
            kw = {"target": y, "losses": losses, "return_outputs": False} if self.has_last else {}
            # one autocast region over the step: each weight cast once, not once per microbatch in flight
            with lpmod.context(self.loss_parallel), self.phase_spans.span("schedule"), \
                    prec.step_cast_cache(self.modules, self.plan.recompute):
                self.schedule.step(**kw, **self.schedule_inputs(xs))  # type: ignore[attr-defined]
            if self.master is not None:  # weight-gradient passes assign .grad without a hook
                self.master.fold_all()
                for p in self.master.params:
                    if not (self.grad_sync is not None and self.grad_sync.owns(p)) \
                            and not (self.epcp is not None and self.epcp.owns(p)):
                        self.master.main_grad(p).div_(m)
            for p in self.parameters():  # schedules run with scale_grads=False (see schedules.py)
                if p.grad is not None and not (self.grad_sync is not None and self.grad_sync.owns(p)) \
                        and not (self.epcp is not None and self.epcp.owns(p)):
                    p.grad.div_(m)
            if self.has_last:  # the schedule's losses carry the fp16 loss scale
                local_loss += torch.stack([lpmod.plain(v.detach()).double().cpu() for v in losses]).mean() / self.loss_scale()
        t_sync = time.perf_counter()
        with self.phase_spans.span("comm"):
            loss, grads_bad = self._sync_grads(local_loss)
        self.last_wait_s = time.perf_counter() - self._local_done(t_sync)
        # fp16: non-finite gradients are the scaler's business (it skips the step and lowers the scale)
        if math.isfinite(loss) and (not grads_bad or self.scaler is not None):
            with self.phase_spans.span("optimizer"):
                self._optimizer_step()
        else:
            self.skipped_steps.append(self.steps_done + 1)
        self.optimizer.zero_grad(set_to_none=True)
        self.step_times_s.append(time.perf_counter() - t0)
        self.steps_done += 1
        return loss

    def _local_done(self, t_sync: float) -> float:
        """When this rank's own work of the step ended: its last gradient bucket handed to the reduction
        (DDP/FSDP hook or the bucketed all-reduce), else the start of the gradient sync. From then on it waits."""
        marks = [self.sync_counter.last_call_s if self.sync_counter.calls else 0.0,
                 self.grad_sync.last_issue_s if self.grad_sync is not None and self.grad_sync.collectives_last_step else 0.0]
        done = max(marks)
        return done if 0.0 < done <= t_sync else t_sync

    def _sync_grads(self, local_loss: torch.Tensor) -> tuple[float, bool]:
        """Wait for / run the gradient reductions left after the backward; the global loss."""
        if self.grad_sync is not None:
            self.grad_sync.finish()
        self.grad_sync_collectives = self.sync_counter.calls + (
            self.grad_sync.collectives_last_step if self.grad_sync is not None else 0)
        self.grad_sync_bytes = self.sync_counter.bytes + (
            self.grad_sync.bytes_last_step if self.grad_sync is not None else 0)
        if self.dp_mode == "epcp" and self.epcp is not None:  # dense over dp x cp, experts over replicas
            calls, nbytes = self.epcp.sync()
            self.grad_sync_collectives += calls
            self.grad_sync_bytes += nbytes
        for tie in self.ties:
            if self.master is not None and self.master.owns(tie.param):
                collectives.all_reduce(self.master.main_grad(tie.param), group=tie.group)
            elif tie.param.grad is not None:
                g = tie.param.grad
                g = g.to_local() if hasattr(g, "to_local") else g
                collectives.all_reduce(g, group=tie.group)
        return self._global_loss(local_loss)

    def _optimizer_step(self) -> None:
        """fp16 unscale, global gradient-norm clipping, this step's learning rate, the update; then the norm
        read on the host (``last_grad_norm``), once the update's kernels are issued: nothing inside the phase
        waits for the device, so the update's host work runs while the device clips (``runtime.apply.optim``;
        fp16's scaler still reads its found-inf flags before the update, as torch's GradScaler does)."""
        norm: torch.Tensor | None = None
        if hasattr(self.optimizer, "bind_grads"):  # zero1 over TP shards (runtime.apply.zero1.TPZero)
            self.optimizer.bind_grads()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # type: ignore[attr-defined]
        if self.max_grad_norm and self.master is not None:
            skip = {id(t.param) for t in self.ties if dist.get_rank(t.group) != 0}  # a tied weight counts once
            views = [v for p, v in zip(self.master.params, self.master.norm_views()) if id(p) not in skip]
            norm = optim.clip_grads(list(self.master.main.values()), self.max_grad_norm,
                                    pp_group=self.env.group("pp"), norm_of=views)
        elif self.max_grad_norm:
            skip = [t.param for t in self.ties if dist.get_rank(t.group) != 0]  # a tied weight counts once
            norm = optim.clip_grad_norm(self.parameters(), self.max_grad_norm,
                                        pp_group=self.env.group("pp"), skip=skip)
        if self.lr_fn is not None:
            optim.set_lr(self.optimizer, self.lr_fn(self.steps_done + 1))
        if self.scaler is not None:
            before = self.loss_scale()
            self.scaler.step(self.optimizer)  # type: ignore[attr-defined]
            self.scaler.update()  # type: ignore[attr-defined]
            if self.loss_scale() < before:  # it found inf/NaN gradients: no update, scale backed off
                self.scaler_skipped_steps.append(self.steps_done + 1)
        else:
            self.optimizer.step()
        if norm is not None:
            self.last_grad_norm = norm.item()

    def loss_scale(self) -> float:
        """The fp16 gradient scaler's current loss scale (1.0 without one)."""
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
            grads += list(self.master.main.values()) if self.master is not None else []
            if grads and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()):
                bad += 1
        both = collectives.all_reduce(torch.stack([contrib, bad.to(contrib.device)]))
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
