"""torchrun entry: ``python -m meshplan.runtime.loop.train --plan plan.json --model MODEL --steps N ...``.

Builds the model on every rank with the same seed, applies the Plan, trains ``--steps`` steps on
``--data`` (``meshplan.runtime.loop.data``: a token file or a Dataset each rank reads its own share of,
the old per-step global-batch hook, or deterministic synthetic data by default), reports the
held-out loss every ``--eval-every`` steps, checkpoints every ``--checkpoint-every`` steps with
DCP (the data position in the manifest's "extra"), resumes with ``--resume`` (under any plan / world size), and
writes a RunRecord JSON. Rank 0 prints one line per step and the final
``step X ms measured, Y ms predicted (+Z%)`` line.

Per-step hook contract: ``fn(step: int, batch_size: int, seq_len: int) -> (inputs, targets)``
returning the GLOBAL batch as tensors (the same on every rank); see examples/data_hook.py.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from meshplan.cost_models.memory import OPTIMIZERS, optimizer_kind, run_optimizer
from meshplan.errors import NonFiniteError
from meshplan.plan import Plan
from meshplan.shapes import add_input_shape, input_shapes

# --init auto: the host-exact replay up to this many parameters, the device init above. The replay
# runs the whole construction on one CPU core of every rank, ~30-60 ns per parameter measured on a
# shared 2-core CPU (benchmarks/bench_startup.py, BENCHMARKS.md "start-up at scale"): about a minute
# at 1B parameters, an hour at 70B; the device init costs per shard element.
AUTO_HOST_EXACT_MAX_PARAMS = 1_000_000_000


def resolve_init(choice: str, n_params: int) -> tuple[str, str]:
    """(``host-exact`` | ``device``, why) for ``--init choice`` on a model of ``n_params`` parameters."""
    if choice != "auto":
        return choice, f"--init {choice}"
    if n_params <= AUTO_HOST_EXACT_MAX_PARAMS:
        return "host-exact", f"--init auto: {n_params / 1e9:.2f}B parameters <= {AUTO_HOST_EXACT_MAX_PARAMS / 1e9:g}B"
    return "device", f"--init auto: {n_params / 1e9:.2f}B parameters > {AUTO_HOST_EXACT_MAX_PARAMS / 1e9:g}B"


def build_label(meta: bool, plan: Plan, init_from: object, init: str, refused: str = "") -> str:
    """Which build a run used, for its startup line: ``meta build`` (+ how a QLoRA plan got its NF4 bases)
    or ``host build`` (+ why, where a meta build was refused: ``refused`` is ``MetaBuildRefused.reason``, or a
    quantized plan needs the host)."""
    q = plan.quantization.mode
    if meta:
        if q != "qlora":
            return "meta build"
        how = ("read from --init-from" if init_from is not None else "from the checkpoint resumed"
               if init == "checkpoint" else "device-initialised")
        return f"meta build, QLoRA bases {how} and quantized one linear at a time"
    if refused:
        from meshplan.runtime.apply.checks import REFUSED_QLORA_HOST_EXACT

        return "host build: the meta build was refused" + (" (QLoRA under --init host-exact)"
                                                          if refused == REFUSED_QLORA_HOST_EXACT else "")
    if q != "none":
        return f"host build ({q}: the whole fp32 model on the host before quantizing)"
    return "host build"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshplan.runtime.loop.train", description=__doc__)
    p.add_argument("--plan", required=True, help="plan JSON written by `meshplan plan`")
    p.add_argument("--model", required=True, help="zoo name, file.py:factory or package.module:factory")
    p.add_argument("--steps", type=int, default=10, help="the step to end at (timed steps; default 10)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate after warm-up (default 1e-3)")
    p.add_argument("--optimizer", choices=("adam", "adamw", "sgd"), default=None, help="optimizer (default: the plan's)")
    p.add_argument("--momentum", type=float, default=None,
                   help="SGD's momentum (default: the plan's SGD's, else 0.9; 0: plain SGD)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the data, on every rank")
    p.add_argument("--data", default=None,
                   help="tokens.bin, package.module:fn returning a Dataset, or fn(step, batch, seq_len) (default: synthetic)")
    p.add_argument("--log-every", type=int, default=10, help="a progress line every K steps and after the last (0: last only)")
    p.add_argument("--eval-every", type=int, default=0, help="validation loss on the held-out tokens every K steps")
    p.add_argument("--eval-batches", type=int, default=4, help="global batches per validation (default 4)")
    p.add_argument("--checkpoint-dir", default=None, help="folder of DCP checkpoints (written, resumed from)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save a checkpoint every K steps (0: never)")
    p.add_argument("--keep-checkpoints", type=int, default=3, help="keep the newest K checkpoints (0: all)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--init-from", default=None, help="pretrained weights: HF safetensors dir or meshplan/DCP checkpoint")
    p.add_argument("--record", default=None, help="RunRecord JSON path (default: run_record.json beside the plan)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank on CPU")
    p.add_argument("--profile-steps", type=int, default=1,
                   help="extra steps after the timed ones, under torch's profiler: RunRecord 'phases' (0: none)")
    p.add_argument("--host-probe", choices=("auto", "on", "off"), default="auto",
                   help="measure this host's dispatch figures after the steps for the RunRecord's 'host' (auto: on CUDA)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="process-group timeout, seconds (at least --hang-timeout + 60 while the watchdog is on)")
    p.add_argument("--hang-timeout", type=float, default=None,
                   help="stop the run when no rank advances for S seconds (default: 20 predicted steps, at least 180; 0: off)")
    p.add_argument("--skip-nonfinite", type=int, default=0, help="skip up to K NaN/inf steps instead of stopping")
    p.add_argument("--check-grads", action="store_true", help="also treat a NaN/inf gradient as a bad step")
    p.add_argument("--clip-grad-norm", type=float, default=1.0,
                   help="clip the global gradient norm (all ranks and stages) to this; 0 disables")
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                   help="after warm-up: constant, or cosine decay to 0 at --steps")
    p.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up steps before the schedule")
    p.add_argument("--compile", action="store_true", help="torch.compile each repeated block (off by default)")
    p.add_argument("--build", choices=("meta", "host"), default="meta",
                   help="meta: build on the meta device, materialize each rank's shard; host: the whole model per rank")
    p.add_argument("--dtype", choices=("plan", "bf16", "fp16", "fp32"), default="plan",
                   help="training precision (default: the plan's dtype)")
    p.add_argument("--init", choices=("auto", "host-exact", "device"), default="auto",
                   help="initial values of a meta build: host-exact (the host-built model's, by a CPU replay of the "
                        "whole construction on every rank), device (each rank's shard on its device: time follows "
                        "the shard; equal for every layout, not the host build's), auto (host-exact up to "
                        f"{AUTO_HOST_EXACT_MAX_PARAMS / 1e9:g}B parameters)")
    add_input_shape(p)
    p.add_argument("--verbose", action="store_true",
                   help="keep third-party warnings and log lines (meshplan run -v); cli_main hides them otherwise")
    return p


def default_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dim for integer targets (LM logits), MSE for float targets."""
    if not isinstance(out, torch.Tensor):
        out = out.logits
    if target.dtype.is_floating_point:
        return F.mse_loss(out, target)
    return F.cross_entropy(out.flatten(0, -2).float(), target.flatten())


def shaped_example(model: torch.nn.Module, shapes: dict | None) -> tuple:
    """Example inputs built from ``--input-shape`` (zeros; synthetic data draws its batches in their
    shape). Synthetic data feeds one input, so the model's forward must take exactly these inputs
    and the first one is the batch; anything else needs ``--data``."""
    from meshplan.trace import resolve_inputs

    example = resolve_inputs(model, None, shapes)
    if isinstance(example, dict):
        raise ValueError(f"--input-shape names {sorted(example)} are passed by keyword to {type(model).__name__}; "
                         "meshplan run feeds positional inputs: name the forward's first arguments in order")
    return tuple(example)


def run_example(model: torch.nn.Module, example: Any, input_shape: Any, model_arg: str) -> Any:
    """The example inputs a run uses: ``--input-shape`` (the shapes the plan was made with, for a factory
    without examples) over the model's own; ValueError when there are none (``meshplan run`` checks it too)."""
    if input_shape:
        example = shaped_example(model, input_shapes(input_shape))
    if example is None:
        raise ValueError(f"model {model_arg!r} gives no example inputs; return (model, example_inputs) from the "
                         "factory or give --input-shape NAME=2x3x224x224[:dtype]")
    return example


def run_seq_len(plan: Plan, example: Any) -> int:
    """Tokens per sequence the run reads: the plan's, else the example's second dimension (0: no sequence)."""
    first_in = next(iter(example.values())) if isinstance(example, dict) else example[0]  # keyword inputs too
    return plan.seq_len or (first_in.shape[1] if first_in.dim() > 1 else 0)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    from meshplan.runtime.record.startup import MaterializeProgress, StartupClock, startup_line

    clock = StartupClock.since_process_start("interpreter and imports")
    from meshplan.fingerprint import check_plan_model
    from meshplan.models import load_model
    from meshplan.models.init_tape import InitTape
    from meshplan.runtime.apply.api import apply_plan
    from meshplan.runtime.apply.checks import MetaBuildRefused
    from meshplan.runtime.apply.optim import lr_at, make_optimizer
    from meshplan.runtime.apply.quant_load import builds_on_meta
    from meshplan.runtime.checkpoint import dcp as checkpoint
    from meshplan.runtime.launch.dist import check_launch
    from meshplan.runtime.launch.host_memory import return_freed_memory
    from meshplan.runtime.loop import data, faults
    from meshplan.runtime.loop.guard import NonFiniteGuard
    from meshplan.runtime.loop.synthetic import synthetic_data
    from meshplan.runtime.loop.watchdog import Watchdog, default_timeout_s
    from meshplan.runtime.record.comparable import local_device, not_comparable_reason
    from meshplan.runtime.record.progress import Progress
    from meshplan.runtime.record.run_record import RunRecord

    plan = Plan.load(args.plan)
    check_launch(plan)  # before any collective
    return_freed_memory()  # before the model is built: freed host buffers go back to the system
    mbs = plan.micro_batch_size
    torch.manual_seed(args.seed)
    # meta: built without values, the plan applied there, each rank's shard materialized from the
    # constructor's replay (tape) or --init-from; QAT too; QLoRA needs the weights to quantize: it gets them
    # linear by linear in the meta build (apply.quant_load: read from a HF directory, or the device init),
    # from a DCP --init-from the host build
    meta = args.build == "meta" and (plan.quantization.mode == "none" or builds_on_meta(plan, args.init_from))
    if args.init == "device" and not meta:
        raise ValueError("--init device initialises a meta build's shards: drop --build host (QAT under TP or "
                         "pipelining and QLoRA from a DCP --init-from build on the host)")
    tape = InitTape() if meta else None
    clock.phase("meta build" if meta else "host build")
    spec = load_model(args.model, batch_size=mbs, seq_len=plan.seq_len or None, device="meta" if meta else None,
                      tape=tape)
    model = spec.model
    clock.phase("checks")
    # torchrun restarted the workers after one died (--max-restarts): resume without --resume
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    if args.resume and not args.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir")
    ck = checkpoint.newest_complete(args.checkpoint_dir) if args.checkpoint_dir and (args.resume or restarted) else None
    if args.resume and ck is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {args.checkpoint_dir}")
    init, init_why = resolve_init(args.init, sum(p.numel() for p in model.parameters()))
    if ck is not None and args.init_from is None:  # the checkpoint overwrites every parameter: none is drawn
        init, init_why = "checkpoint", f"resuming from {ck}"
    rank0 = os.environ.get("RANK", "0") == "0"
    what = ("buffers from the constructor's replay, weights from --init-from" if args.init_from else
            f"buffers from the constructor's replay, parameters from the checkpoint: {init_why}"
            if init == "checkpoint" else
            f"host-exact replay on the CPU, {init_why}" if init == "host-exact" else f"device init of the shard, {init_why}")
    progress = MaterializeProgress(what, rank=0 if rank0 else 1)
    example = run_example(model, spec.example_inputs, args.input_shape, args.model)
    check_plan_model(plan, model, args.model)  # before any collective: every rank refuses alike
    synthetic = None if args.data else synthetic_data(model, example, args.seed)  # no forward pass
    seq_len = run_seq_len(plan, example)
    hang_s = default_timeout_s(plan.predicted.step_s) if args.hang_timeout is None else args.hang_timeout
    if args.optimizer is None:  # the plan's (``meshplan run`` passes it resolved)
        args.optimizer, planned_momentum = run_optimizer(plan.optimizer)
        args.momentum = planned_momentum if args.momentum is None else args.momentum
    optimizer = make_optimizer(args.optimizer, args.lr, momentum=args.momentum)  # refuses before any collective
    ran_optimizer = optimizer_kind(args.optimizer, args.momentum)  # the cost model's name, for the RunRecord

    def apply(model: Any, example: Any, tape: Any) -> Any:
        return apply_plan(model, plan, loss_fn=default_loss, optimizer_factory=optimizer,
                          example_inputs=example, timeout_s=faults.pg_timeout_s(args.timeout, hang_s),
                          dtype=args.dtype, compile=args.compile, init_from=args.init_from, tape=tape,
                          init=init, progress=progress)

    clock.phase("apply")
    refused = ""
    try:
        pm = apply(model, example, tape)
    except MetaBuildRefused as e:  # raised before any collective, alike on every rank: build on the host
        if os.environ.get("RANK", "0") == "0":
            print(f"note: {e}; building on the host instead", flush=True)
        refused = e.reason
        torch.manual_seed(args.seed)
        spec = load_model(args.model, batch_size=mbs, seq_len=plan.seq_len or None)
        model = spec.model
        example = run_example(model, spec.example_inputs, args.input_shape, args.model)
        pm = apply(model, example, None)
        tape = None
    clock.phase("data and resume")
    how = init if tape is not None and args.init_from is None else "pretrained weights" if tape is not None else ""
    clock.add({k if k != "materialize" or not how else f"materialize ({how})": v for k, v in pm.startup_s.items()},
              within="apply")
    rank = pm.env.rank
    pm.check_grads = args.check_grads
    guard = NonFiniteGuard(args.skip_nonfinite)
    pm.max_grad_norm = args.clip_grad_norm or None
    pm.lr_fn = functools.partial(lr_at, lr=args.lr, schedule=args.lr_schedule, warmup_steps=args.warmup_steps,
                                 total_steps=args.steps)
    stream = data.open_stream(args.data, seq_len=seq_len, seed=args.seed, global_batch=plan.global_batch_size,
                              share=data.rank_share(pm.env, pm.reads_inputs, pm.has_last), synthetic=synthetic)
    data.check_vocab(stream, model, args.data)
    held_out = None
    if args.eval_every:
        if not isinstance(stream, data.TokenStream):
            raise ValueError("--eval-every needs --data tokens.bin (its held-out tokens.val.bin)")
        held_out = stream.eval_batches(args.eval_batches)
    start = 0
    if ck is not None:
        start = checkpoint.load(pm, ck)
        pos = (checkpoint.read_manifest(ck).get("extra") or {}).get("data")
        if pos:
            stream.load_state_dict(pos)
        else:  # a checkpoint from before data positions were saved: one global batch per step
            stream.samples_seen = start * plan.global_batch_size
        if rank == 0:
            why = f" after restart {os.environ['TORCHELASTIC_RESTART_COUNT']}" if restarted else ""
            print(f"resumed from {ck} (step {start}){why}", flush=True)
    rec = RunRecord(
        plan_summary=plan.summary(), model=args.model, world_size=plan.world_size,
        predicted_step_s=plan.predicted.step_s, predicted_peak_mem_bytes=list(plan.predicted.peak_mem_bytes),
        memory_kind="cuda_max_allocated" if torch.cuda.is_available() else "cpu_peak_rss", notes=list(pm.notes),
        precision=pm.precision, dp_kind=plan.dp_kind if plan.dp > 1 else "none",
        not_comparable=not_comparable_reason(plan.cluster, **dict(zip(("device_type", "device_name", "host"),
                                                                     local_device(torch)))),
    )
    rec.tokens_per_step = plan.global_batch_size * max(seq_len, 1) if seq_len else 0
    rec.plan = plan.to_dict()
    rec.optimizer = ran_optimizer
    rec.init = how if how != "pretrained weights" else ""
    clock.phase("first step")  # ends in _loop: rec.startup_s gets it after step 1
    rec.startup_s = clock.seconds()
    if rank == 0:
        print(startup_line(rec.startup_s, clock.elapsed(), "from the worker's start to its first step",
                           build=build_label(tape is not None, plan, args.init_from, init, refused)), flush=True)
    if OPTIMIZERS[ran_optimizer] != OPTIMIZERS[plan.optimizer]:
        rec.notes.append(f"optimizer {ran_optimizer} run; the plan's predictions are for {plan.optimizer}")
    progress = Progress(total_steps=args.steps, start_step=start, log_every=args.log_every,
                        tokens_per_step=rec.tokens_per_step or plan.global_batch_size,
                        predicted_step_s=plan.predicted.step_s,
                        predicted_peak_mem_bytes=max(plan.predicted.peak_mem_bytes, default=0),
                        memory_kind="CUDA max allocated" if torch.cuda.is_available() else "peak RSS",
                        comparable=not rec.not_comparable)
    ck_dir = args.checkpoint_dir

    def newest() -> str:
        ck_now = checkpoint.newest_complete(ck_dir) if ck_dir else None
        return f"newest complete checkpoint {ck_now} kept; " if ck_now else "no complete checkpoint yet; "

    # the store also carries the fault broadcast, so it is used with --hang-timeout 0 too
    wd = Watchdog(faults.watchdog_store(max(args.timeout, 60.0)), rank=rank,
                  world_size=pm.env.world_size, hang_timeout_s=hang_s, checkpoint_hint=newest, report=faults.report,
                  start_step=start).start()
    pm.phase_spans.on_enter = lambda phase: wd.at(faults.SPAN_PHASES.get(phase, phase))
    own_s: list[float] = []
    wait_s: list[float] = []
    cpu_s: list[float] = []
    try:
        ran_to = _loop(args, pm, stream, rec, progress, guard, wd, start=start, seq_len=seq_len,
                       held_out=held_out, own_s=own_s, wait_s=wait_s, cpu_s=cpu_s)
    except BaseException as e:  # noqa: BLE001 - explained faults end here; the rest is re-raised
        faults.stop_on_fault(e, wd, rank=rank, step=wd.step, plan=plan, pp_rank=pm.env.coord("pp"), model=args.model)
        raise  # a signal's KeyboardInterrupt / SystemExit
    if ran_to is not None:
        return ran_to
    ran = bool(rec.steps)
    rec.rank_step_s, rec.rank_wait_s, rec.rank_cpu_s = faults.gather_rank_times(own_s, wait_s, cpu_s)
    if args.profile_steps > 0 and ran:  # after the timed steps and the last checkpoint: off the step times
        wd.at("profile")
        rec.phases = _profile_phases(pm, stream, args.profile_steps)
    if ran:
        wd.at("host probe")
        rec.host = _probe_host(args.host_probe, pm)
    wd.at("finished")
    if pm.scaler is not None:
        rec.notes.append(scaler_note(pm))
    if rank == 0:
        out = args.record or os.path.join(os.path.dirname(os.path.abspath(args.plan)), "run_record.json")
        rec.save(out)
        for n in rec.notes:
            print(f"note: {n}")
        print(rec.summary_line(), flush=True)
    wd.stop()
    torch.distributed.destroy_process_group()
    return 0


def _loop(args: argparse.Namespace, pm: Any, stream: Any, rec: Any, progress: Any, guard: Any, wd: Any, *,
          start: int, seq_len: int, held_out: Any, own_s: list[float], wait_s: list[float],
          cpu_s: list[float]) -> int | None:
    """Steps ``start + 1 .. --steps``, telling ``wd`` each phase and keeping this rank's own and waiting time
    per step (``meshplan.stragglers``) and the CPU seconds its process used in the step (all its threads:
    against the step's wall time it shows contention for the cores); an exit code when the run must stop,
    else None."""
    from meshplan.runtime.checkpoint import dcp as checkpoint
    from meshplan.runtime.launch import collectives
    from meshplan.runtime.loop.batch_check import check_batch
    from meshplan.runtime.loop.evaluate import eval_loss
    from meshplan.runtime.record.run_record import gather_peak_mem

    plan, rank, first = pm.plan, pm.env.rank, None
    for step in range(start + 1, args.steps + 1):
        wd.at("data", step)
        t_data = time.perf_counter()
        x, y = stream.next_batch()
        if args.data and not stream.local:  # a user's hook: shape, dtype and sameness on every rank checked each step
            first = check_batch(step, (x, y), global_batch=plan.global_batch_size, seq_len=seq_len, first=first)
        wd.at("barrier")
        t_in = time.perf_counter()
        collectives.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = pm.step(x, y, local=stream.local)
        dt = time.perf_counter() - t0
        cpu_s.append(time.process_time() - c0)
        own_s.append(t_in - t_data + dt - pm.last_wait_s)
        wait_s.append(t0 - t_in + pm.last_wait_s)
        wd.at("all_gather of step facts")
        mem = rec.add_rank_peaks(gather_peak_mem(pm.env.coord("pp"), plan.predicted.peak_mem_bytes))
        rec.add(step, dt, loss, mem)
        if len(rec.steps) == 1 and rec.startup_s:  # the first step this process runs (after a resume too)
            rec.startup_s["first step"] = time.perf_counter() - t_data
        rec.grad_sync_collectives_per_step = pm.grad_sync_collectives  # counted in this step
        line = progress.line(step, loss, dt, mem)
        if line and rank == 0:
            print(line, flush=True)
        try:
            warning = guard.after_step(step, loss, step in pm.skipped_steps)
        except NonFiniteError as e:
            if rank == 0:
                print(f"error: {e}", file=sys.stderr, flush=True)
            torch.distributed.destroy_process_group()
            return 3
        if warning and rank == 0:
            print(warning, file=sys.stderr, flush=True)
        if held_out is not None and (step % args.eval_every == 0 or step == args.steps):
            wd.at("validation")
            val = eval_loss(pm, held_out)
            rec.add_eval(step, val)
            if rank == 0:
                print(f"step {step:5d}/{args.steps}  validation loss {val:.4f} (held-out tokens)", flush=True)
        if args.checkpoint_dir and args.checkpoint_every and step % args.checkpoint_every == 0:
            wd.at("checkpoint")
            checkpoint.save(pm, args.checkpoint_dir, step, keep=args.keep_checkpoints,
                            extra={"data": stream.state_dict()})
        wd.finished_step(step)
    return None


def scaler_note(pm: Any) -> str:
    """The fp16 gradient scaler's end state, for the RunRecord's notes (one line)."""
    skipped = pm.scaler_skipped_steps
    return (f"fp16 loss scale {pm.loss_scale():g} at the end; the scaler skipped the update of "
            + (f"{len(skipped)} step{'s' * (len(skipped) != 1)} ({', '.join(map(str, skipped[:8]))}"
               + (", ..." if len(skipped) > 8 else "") + ") with inf/NaN gradients" if skipped else "no step"))


def _probe_host(mode: str, pm: Any) -> dict[str, Any]:
    """This rank's host figures (``runtime.record.host_probe``) when ``--host-probe`` asks for them, else {}."""
    from meshplan.runtime.record.host_probe import probe_host, wants_probe

    dev = pm.env.device
    if not wants_probe(mode, dev.type):
        return {}
    try:
        return probe_host(dev)
    except Exception as e:  # noqa: BLE001 - a side measurement (e.g. out of memory beside a full model): the run stands
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def _profile_phases(pm: Any, stream: Any, k: int) -> dict[str, Any]:
    """``k`` extra steps under torch's profiler (``runtime.record.phases``): the RunRecord's ``phases``.
    Their updates are not checkpointed and their times are not in the step times."""
    from meshplan.runtime.record import phases

    mine = phases.measure(pm, [stream.next_batch() for _ in range(k)], local=stream.local)
    return phases.record_phases(phases.gather(mine), pm.plan, steps=k)


def cli_main(argv: Sequence[str] | None = None) -> int:
    """``main`` with a user's mistake (bad plan, wrong model, damaged checkpoint) as one line, exit 2;
    third-party warnings and log lines kept off the output unless ``--verbose`` (``meshplan.console``)."""
    from meshplan.console import third_party_quiet
    from meshplan.errors import MeshplanError

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        with third_party_quiet("--verbose" in argv):  # as the meshplan CLI: third-party notices off unless -v
            return main(argv)
    except (MeshplanError, ValueError, FileNotFoundError) as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"meshplan run: error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    raise SystemExit(cli_main())
