"""``meshplan run plan.json --model MODEL --steps N``: launch torchrun on the plan.

Starts torchrun, ``python -m meshplan.runtime.launch.agent --nproc-per-node N -m meshplan.runtime.loop.train ...``
(``torch.distributed.run`` itself with meshplan's console settings, ``runtime/launch/agent.py``)
(N = the plan's world size unless ``--nproc`` says otherwise; a mismatch fails on every rank
with a clear error before any collective). ``--print-command`` prints the command only.
Several nodes: ``--nnodes N --nproc-per-node P --rdzv-endpoint HOST:PORT`` on every node (torchrun
c10d rendezvous, ``meshplan.runtime.launch.torchrun``); ``--max-restarts K`` restarts dead workers, which
resume from the newest complete checkpoint; ``--slurm-script job.sh`` writes an sbatch script
(``meshplan.runtime.launch.slurm``) instead of running.
Before spawning, ``commands/preflight.py`` checks the model spec, data, output directories, this
node's devices (more ranks than GPUs, or than CPU cores without ``--oversubscribe``, is refused; a
one-node launch of a multi-node plan is told the command for each node) and the plan against the
model built on the meta device (fingerprint, ``check_plan``); numbers are checked by argparse
(``--nproc 0`` is refused). The optimizer is the plan's (``meshplan plan --optimizer``) unless
``--optimizer`` / ``--momentum`` say otherwise; one with other state than the plan costed runs with
a one-line warning (``run_optimizer_of``). SIGINT/SIGTERM stop the whole process tree
(``runtime/launch/supervise.py``): exit code 130/143.
torch is imported only by the preflight (device count, meta build).
"""

from __future__ import annotations

import argparse
import shlex

from meshplan.commands.argtypes import (
    nonneg_float,
    nonneg_int,
    positive_float,
    positive_int,
    unit_interval,
)
from meshplan.cost_models.memory import OPTIMIZERS, RUN_OPTIMIZERS, optimizer_kind, run_optimizer
from meshplan.shapes import add_input_shape, input_shape_text

HELP = "run a plan under torchrun (synthetic data by default) and record measured vs predicted step time"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="plan JSON written by `meshplan plan`")
    p.add_argument("--model", required=True, help="zoo name, file.py:factory or package.module:factory")
    p.add_argument("--steps", type=positive_int, default=10,
                   help="training steps to run (timed; --profile-steps come after them); with --resume, the step to end at "
                        "(default 10)")
    p.add_argument("--nproc", type=positive_int, default=None, help="ranks to launch (default: the plan's world size)")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="folder of DCP checkpoints: written every --checkpoint-every steps, read by --resume and "
                        "after a --max-restarts restart (default: no checkpoints)")
    p.add_argument("--checkpoint-every", type=nonneg_int, default=0, metavar="K",
                   help="save a checkpoint in --checkpoint-dir after every K steps (default 0: never)")
    p.add_argument("--keep-checkpoints", type=nonneg_int, default=3,
                   help="keep the newest K complete checkpoints, delete older ones (0: keep all; default 3)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint (any plan/world size)")
    p.add_argument("--init-from", default=None, metavar="PATH",
                   help="start from pretrained weights: a Hugging Face safetensors directory (save_pretrained) or a "
                        "meshplan/DCP checkpoint; each rank reads only the shards it holds (a resumed checkpoint replaces them)")
    p.add_argument("--data", default=None,
                   help="tokens.bin from `meshplan prepare-data` (each rank reads its share), package.module:fn "
                        "returning a torch Dataset, or a hook fn(step, batch, seq_len) -> global (inputs, targets)")
    p.add_argument("--log-every", type=nonneg_int, default=10,
                   help="a progress line every K steps and after the last (0: last only)")
    p.add_argument("--eval-every", type=nonneg_int, default=0, help="validation loss on tokens.val.bin every K steps")
    p.add_argument("--eval-batches", type=positive_int, default=4, help="global batches per validation (default 4)")
    p.add_argument("--record", default=None, help="RunRecord JSON path (default: run_record.json beside the plan)")
    p.add_argument("--lr", type=positive_float, default=1e-3,
                   help="learning rate, the peak of --lr-schedule after --warmup-steps (default 1e-3)")
    p.add_argument("--optimizer", choices=RUN_OPTIMIZERS, default=None,
                   help="adam, adamw (weight decay 0) or sgd (momentum 0.9 unless --momentum); default: the plan's "
                        "(`meshplan plan --optimizer`, adam unless given). Another one than the plan's runs, with a "
                        "warning: the plan's predictions are for its own optimizer")
    p.add_argument("--momentum", type=unit_interval, default=None, metavar="M",
                   help="SGD's momentum (--optimizer sgd only; default: the plan's SGD's, else 0.9); 0: plain SGD, "
                        "which keeps no momentum buffer (one fp32 copy of the rank's parameter shards less memory)")
    p.add_argument("--seed", type=int, default=0,
                   help="random seed of the initial weights, the synthetic data and the data order, the same on "
                        "every rank (default 0)")
    p.add_argument("--clip-grad-norm", type=nonneg_float, default=1.0,
                   help="clip the global gradient norm (all ranks and stages) to this; 0 disables")
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                   help="after --warmup-steps: constant, or cosine decay to 0 at --steps")
    p.add_argument("--warmup-steps", type=nonneg_int, default=0, help="linear learning-rate warm-up steps")
    p.add_argument("--compile", action="store_true", help="torch.compile each repeated block (first step compiles)")
    p.add_argument("--build", choices=("meta", "host"), default="meta",
                   help="meta (default): build on the meta device, apply the plan there, materialize only each "
                        "rank's shard (host memory bounded by the shard); host: build the whole model on every rank "
                        "(quantized plans always build on the host)")
    p.add_argument("--dtype", choices=("plan", "bf16", "fp16", "fp32"), default="plan",
                   help="training precision: the plan's dtype (default) or bf16 / fp16 / fp32")
    p.add_argument("--init", choices=("auto", "host-exact", "device"), default="auto",
                   help="initial values of the meta build: host-exact (the host-built model's values: every rank "
                        "replays the whole construction on its CPU, ~30-60 ns per parameter: minutes at 10B+), "
                        "device (each rank computes only its shard, on its device: start-up follows the shard; the "
                        "same values under every plan, but not the host build's), auto (default: host-exact up to "
                        "1B parameters, device above)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank (CPU)")
    p.add_argument("--oversubscribe", action="store_true",
                   help="on CPU, start more ranks x --threads than this node has cores (refused without it: "
                        "step times then mean little; fine for a correctness run)")
    p.add_argument("--profile-steps", type=nonneg_int, default=1, metavar="K",
                   help="after the timed steps, K extra steps under torch's profiler for the RunRecord's "
                        "per-phase times (0: none; default 1)")
    p.add_argument("--host-probe", choices=("auto", "on", "off"), default="auto",
                   help="after the steps, measure this host's dispatch figures (a few seconds) for the RunRecord's "
                        "'host', which meshplan calibrate puts in the calibrated cluster (auto, the default: on CUDA)")
    p.add_argument("--skip-nonfinite", type=nonneg_int, default=0, metavar="K",
                   help="skip up to K steps whose loss is NaN/inf (no update applied) instead of stopping at the first")
    p.add_argument("--check-grads", action="store_true", help="also count a NaN/inf gradient as a non-finite step")
    p.add_argument("--timeout", type=positive_float, default=120.0,
                   help="process-group timeout in seconds: a rank waiting longer on a collective fails (default 120)")
    p.add_argument("--hang-timeout", type=nonneg_float, default=None, metavar="S",
                   help="stop all ranks when none advances for S seconds, naming the stuck ranks and phases "
                        "(default: 20 predicted steps, at least 180; 0: off); the process-group timeout becomes at least S + 60")
    p.add_argument("--master-port", type=int, default=None, metavar="PORT",
                   help="one node: torchrun's master port on 127.0.0.1 (default: torchrun --standalone picks a free one)")
    add_input_shape(p)
    g = p.add_argument_group("several nodes (torchrun c10d rendezvous; run once per node) and restarts")
    g.add_argument("--nnodes", type=int, default=None, help="nodes (default 1); nnodes x nproc-per-node = plan world size")
    g.add_argument("--nproc-per-node", type=int, default=None, help="ranks per node (default: world size / nnodes)")
    g.add_argument("--node-rank", type=int, default=0, help="this node's index (torchrun's c10d ignores it: rank order follows rendezvous order)")
    g.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="rendezvous address, the same on every node")
    g.add_argument("--rdzv-id", default="meshplan", help="job id shared by the nodes of one run")
    g.add_argument("--rdzv-timeout", type=float, default=900.0, metavar="S",
                   help="seconds to wait for the endpoint and for all nodes to join (default 900)")
    g.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="restart all workers up to K times when one dies; they resume from the newest complete checkpoint")
    s_ = p.add_argument_group("Slurm: write an sbatch script instead of running")
    s_.add_argument("--slurm-script", default=None, metavar="JOB.SH", help="write (and print) an sbatch script running this plan")
    s_.add_argument("--partition", default=None, help="Slurm partition (#SBATCH --partition)")
    s_.add_argument("--time", default=None, help="Slurm time limit, e.g. 04:00:00")
    s_.add_argument("--gpus-per-node", type=int, default=None, metavar="N",
                    help="GPUs to ask Slurm for on each node (#SBATCH --gpus-per-node)")
    p.add_argument("--print-command", action="store_true", help="print the torchrun command and exit")


SLURM_ONLY = {"slurm_script", "partition", "time", "gpus_per_node", "print_command", "nnodes", "nproc_per_node",
              "node_rank", "rdzv_endpoint", "rdzv_id", "nproc", "master_port"}


def _launch(args: argparse.Namespace, world_size: int, endpoint: str | None = None):  # -> launch.Launch
    from meshplan.runtime.launch.torchrun import plan_launch

    return plan_launch(world_size, nproc=args.nproc, nnodes=args.nnodes, nproc_per_node=args.nproc_per_node,
                       node_rank=args.node_rank, rdzv_endpoint=endpoint or args.rdzv_endpoint, rdzv_id=args.rdzv_id,
                       rdzv_timeout_s=args.rdzv_timeout, max_restarts=args.max_restarts, master_port=args.master_port)


def run_argv(args: argparse.Namespace) -> list[str]:
    """The ``meshplan run`` argv that repeats ``args`` (launch and Slurm flags left out): what each node runs."""
    import sys

    ref = argparse.ArgumentParser()
    add_arguments(ref)
    out = [sys.executable, "-m", "meshplan.cli", "run", args.plan]
    for a in ref._actions:
        if not a.option_strings or a.dest in SLURM_ONLY or a.dest == "help":
            continue
        v = getattr(args, a.dest, a.default)
        if v == a.default or v is None:
            continue
        flag = next(o for o in a.option_strings if o.startswith("--"))
        if a.dest == "input_shape":
            out += [w for name, spec in v for w in (flag, input_shape_text(name, spec))]
            continue
        out += [flag] if isinstance(a, argparse._StoreTrueAction) else [flag, str(v)]
    return out + (["--verbose"] if getattr(args, "verbose", False) else [])  # cli.py adds -v to every command


def run_optimizer_of(args: argparse.Namespace, planned: str) -> tuple[str, float | None]:
    """(--optimizer, --momentum) the workers run: the plan's optimizer (``planned``, the cost model's
    name) unless the flags say otherwise. One that the plan did not cost (other state: SGD vs Adam,
    SGD with vs without momentum; adam and adamw cost alike) runs with one warning on stderr: the
    plan's predicted memory and step time are its own optimizer's, the RunRecord records the one run
    (``meshplan calibrate`` re-costs with it)."""
    import sys

    plan_name, plan_momentum = run_optimizer(planned)
    name = args.optimizer or plan_name
    momentum = args.momentum if args.momentum is not None else plan_momentum if name == plan_name else None
    if args.momentum is not None and name != "sgd":
        whose = "" if args.optimizer else " (the plan's)"
        raise ValueError(f"--momentum is SGD's; --optimizer {name}{whose} keeps its two moments "
                         "(drop --momentum, or use --optimizer sgd)")
    ran = optimizer_kind(name, momentum)
    if OPTIMIZERS[ran] != OPTIMIZERS[planned]:
        print(f"warning: the plan's predictions (memory, step time) are for {planned}, this run uses {ran} "
              f"(re-plan with `meshplan plan --optimizer {name}"
              f"{' --momentum 0' if ran == 'sgd' else ''}` for a matching prediction)", file=sys.stderr)
    return name, momentum


def build_command(args: argparse.Namespace) -> list[str]:
    from meshplan.plan import Plan
    from meshplan.runtime.launch.torchrun import torchrun_command

    plan = Plan.load(args.plan)
    nproc = args.nproc or plan.world_size
    if nproc != plan.world_size:
        raise ValueError(
            f"plan {args.plan} needs {plan.world_size} ranks ({plan.summary()}), --nproc is {nproc}; "
            f"drop --nproc or re-plan for {nproc}"
        )
    name, momentum = run_optimizer_of(args, plan.optimizer)
    launch = _launch(args, plan.world_size)
    train = ["--plan", args.plan, "--model", args.model, "--steps", str(args.steps), "--lr", str(args.lr),
             "--optimizer", name, "--seed", str(args.seed), "--threads", str(args.threads),
             "--timeout", str(args.timeout),
             "--dtype", args.dtype, "--clip-grad-norm", str(args.clip_grad_norm), "--lr-schedule",
             args.lr_schedule, "--warmup-steps", str(args.warmup_steps)] + (["--compile"] if args.compile else [])
    if momentum is not None:
        train += ["--momentum", str(momentum)]
    if args.checkpoint_dir:
        train += ["--checkpoint-dir", args.checkpoint_dir, "--checkpoint-every", str(args.checkpoint_every),
                  "--keep-checkpoints", str(args.keep_checkpoints)]
    if args.resume:
        train.append("--resume")
    if args.init_from:
        train += ["--init-from", args.init_from]
    if args.build != "meta":
        train += ["--build", args.build]
    if args.init != "auto":
        train += ["--init", args.init]
    if args.skip_nonfinite:
        train += ["--skip-nonfinite", str(args.skip_nonfinite)]
    if args.hang_timeout is not None:
        train += ["--hang-timeout", str(args.hang_timeout)]
    if args.check_grads:
        train.append("--check-grads")
    if args.data:
        train += ["--data", args.data]
    train += ["--log-every", str(args.log_every), "--profile-steps", str(args.profile_steps)]
    if getattr(args, "host_probe", "auto") != "auto":
        train += ["--host-probe", args.host_probe]
    if args.eval_every:
        train += ["--eval-every", str(args.eval_every), "--eval-batches", str(args.eval_batches)]
    if args.record:
        train += ["--record", args.record]
    for name, spec in args.input_shape or []:
        train += ["--input-shape", input_shape_text(name, spec)]
    if getattr(args, "verbose", False):  # the ranks keep third-party warnings too (meshplan.console)
        train.append("--verbose")
    return torchrun_command(launch, train)


def write_slurm(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from meshplan.plan import Plan
    from meshplan.runtime.launch.slurm import sbatch_script

    plan = Plan.load(args.plan)
    if args.nnodes is None:
        raise ValueError("--slurm-script needs --nnodes N (and --nproc-per-node P unless P = world size / N)")
    launch = _launch(args, plan.world_size, "slurm-head:0")  # refuses before any file is written
    text = sbatch_script(run_argv(args), nnodes=launch.nnodes, nproc_per_node=launch.nproc_per_node,
                         workdir=os.getcwd(), partition=args.partition, time=args.time,
                         gpus_per_node=args.gpus_per_node)
    Path(args.slurm_script).write_text(text)
    print(text, end="")
    print(f"# wrote {args.slurm_script}: submit with `sbatch {args.slurm_script}`")
    return 0


def node_command(args: argparse.Namespace, nnodes: int, nproc_per_node: int) -> str:
    """The ``meshplan run`` line each of ``nnodes`` nodes runs for this run (a refusal names it)."""
    argv = ["meshplan", *run_argv(args)[3:], "--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node),
            "--rdzv-endpoint", "HOST:29500"]
    return shlex.join(argv)


def run(args: argparse.Namespace) -> int:
    if args.slurm_script:
        return write_slurm(args)
    cmd = build_command(args)
    if args.print_command:
        print(shlex.join(cmd))
        return 0
    from meshplan.commands.preflight import preflight
    from meshplan.plan import Plan

    plan = Plan.load(args.plan)
    # before torchrun: model, data, writable dirs, this node's devices, the plan against the model
    preflight(args, plan, _launch(args, plan.world_size), lambda n, p: node_command(args, n, p))
    if args.rdzv_endpoint:
        from meshplan.runtime.launch.torchrun import check_endpoint

        check_endpoint(args.rdzv_endpoint, args.rdzv_timeout)
    from meshplan.runtime.launch.supervise import run_tree

    return run_tree(cmd)
