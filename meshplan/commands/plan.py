"""``meshplan plan MODEL --world-size N``: search the best parallel plan, print it, write plan.json.

Traces MODEL on the meta device (``meshplan.loading.load_graph``: the traced graph comes
from the trace cache when it holds this model, ``--no-cache`` to bypass it), runs
``meshplan.planner.api.plan_graph`` with progress lines on stderr, writes the Plan JSON with
``-o`` first (and ``--html``/``--png`` as ``meshplan report`` would, creating missing folders),
then prints the text report once (so ``| true`` or a full disk behind stdout cannot lose it). Pins (``--tp/--pp/--dp/--schedule/...``) narrow the search; ``--dtype`` pins the
training precision or (``auto``) plans in bf16 and fp8 and keeps the faster. ``--optimizer [--momentum]`` is the
optimizer costed (``cost_models.memory.optimizer_kind``; default adam) and recorded in the plan, which
``meshplan run`` runs by default. ``--state-layout`` picks how the runtime keeps the model's state (default auto: fp32
parameters while a plan fits, else 16-bit weights with fp32 masters: ``autoparallel(state_layout=)``). The checks and the
search are ``meshplan.autoparallel``'s (``meshplan/api/plan.py``: ``plan_request`` then
``PlanRequest.plan``); this module parses flags into them. torch is imported inside ``run`` only.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from meshplan.api.plan import DEFAULT_STATE_LAYOUT, STATE_LAYOUT_CHOICES
from meshplan.commands.argtypes import add_optimizer_arguments, byte_size, optimizer_of, positive_int
from meshplan.cost_models.precision import TRAINING_DTYPES
from meshplan.engines.spec import TARGETS
from meshplan.shapes import add_input_shape, input_shapes

HELP = "plan data/tensor/pipeline parallelism for a model on N devices (predicted costs)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", help="zoo name (gpt2-small, llama3-8b, gpt3-175b, ...), file.py:factory or pkg.mod:factory"
    )
    parser.add_argument("--world-size", "-n", type=positive_int, required=True, help="number of devices")
    parser.add_argument(
        "--cluster", default="h100",
        help="preset (h100, h200, a100-80g, a100-40g, v100), profile .json, or local: this machine, profiled once "
             "(seconds) and cached, its device replicated -n times"
    )
    parser.add_argument(
        "--memory-limit", type=byte_size, default=None, metavar="SIZE",
        help="memory a rank may use, e.g. 60GiB (default: the cluster's usable device memory); what an "
             "out-of-memory stop of `meshplan run` suggests",
    )
    parser.add_argument(
        "--global-batch", type=positive_int, default=None, help="sequences per step (default 8 × world size)"
    )
    parser.add_argument(
        "--seq", type=positive_int, default=None,
        help="sequence length (default: the model's maximum, from its config; a factory's example inputs' length "
             "when it returns them); the printed report says which",
    )
    add_input_shape(parser)
    parser.add_argument("--tp", type=positive_int, default=None, help="pin the tensor-parallel degree")
    parser.add_argument("--pp", type=positive_int, default=None, help="pin the pipeline-parallel degree")
    parser.add_argument("--dp", type=positive_int, default=None, help="pin the data-parallel degree")
    parser.add_argument("--cp", type=positive_int, default=None, help="pin the context-parallel degree (sequence split)")
    parser.add_argument("--ep", type=positive_int, default=None,
                        help="pin the expert-parallel degree (MoE; borrows dp x cp ranks)")
    parser.add_argument("--capacity-factor", type=float, default=None,
                        help="MoE load imbalance the costing assumes: busiest expert rank / mean (default 1.0)")
    parser.add_argument(
        "--schedule",
        default=None,
        help="pin the pipeline schedule (gpipe, 1f1b, interleaved-1f1b, zero-bubble, zbv)",
    )
    parser.add_argument("--micro-batch", type=positive_int, default=None, help="pin the microbatch size")
    parser.add_argument("--recompute", default=None, help="pin activation recompute (none, selective, op, full)")
    parser.add_argument("--dp-kind", default=None, help="pin data parallelism (ddp, zero1, zero2, fsdp, hsdp)")
    parser.add_argument(
        "--quantization", default="none", choices=("none", "qat", "qlora"),
        help="plan quantized training: qat (fake-quantized weights) or qlora (NF4 base + LoRA adapters)",
    )  # fmt: skip
    parser.add_argument("--lora-rank", type=positive_int, default=None, help="LoRA rank for --quantization qlora (default 16)")
    parser.add_argument("-o", "--output", default=None, metavar="PLAN_JSON", help="write the plan here")
    parser.add_argument("--html", default=None, metavar="PATH",
                        help="also write the HTML report here (as `meshplan report PLAN_JSON --html PATH`)")
    parser.add_argument("--png", default=None, metavar="PATH",
                        help="also write the predicted pipeline timeline as a PNG here (needs meshplan[plot])")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument(
        "--no-cache", action="store_true",
        help="trace the model even when its graph is in the trace cache (~/.cache/meshplan/graphs)",
    )  # fmt: skip
    parser.add_argument("--dtype", default="bf16", choices=(*TRAINING_DTYPES, "auto"),
                        help="training precision (default bf16); fp8 = torchao float8 training, costed on GPUs with "
                             "FP8 tensor cores (h100/h200) and run by torchtitan (--target torchtitan); auto: the "
                             "fastest that fits among bf16 and fp8 where the cluster and the target run them")  # fmt: skip
    add_optimizer_arguments(parser, "; recorded in the plan, which `meshplan run` then runs")
    parser.add_argument("--state-layout", default=DEFAULT_STATE_LAYOUT, choices=STATE_LAYOUT_CHOICES,
                        help="how meshplan's runtime keeps the model's state (--target meshplan): torch (fp32 "
                             "parameters under autocast), megatron (bf16 weights, fp32 main gradients and masters; "
                             "dp kinds none/ddp/zero1), zero (bf16 gradients too), auto (default: torch while a plan "
                             "fits, else the first of megatron, zero with a plan that fits, said in the plan's notes; "
                             "torch alone for another --target, --dtype fp16/fp32 or --quantization)")  # fmt: skip
    parser.add_argument("--target", default="meshplan", choices=TARGETS,
                        help="plan only what this engine runs (its schedules, DP kinds, recompute kinds and "
                             "stage-split rule); export with "
                             "`meshplan export --to ENGINE` (default meshplan: everything meshplan's runtime runs)")


def pins(args: argparse.Namespace) -> dict[str, object]:
    """The pin flags as ``autoparallel``'s ``fixed`` (``--micro-batch`` is micro_batch_size)."""
    fixed: dict[str, object] = {}
    for arg, key in (("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("cp", "cp"), ("ep", "ep"),
                     ("capacity_factor", "capacity_factor"), ("schedule", "schedule"),
                     ("micro_batch", "micro_batch_size"), ("recompute", "recompute"), ("dp_kind", "dp_kind")):  # fmt: skip
        v = getattr(args, arg)
        if v is not None:
            fixed[key] = v
    return fixed


def run(args: argparse.Namespace) -> int:
    from meshplan.api.plan import plan_request, seq_note
    from meshplan.profile.local import is_local, resolve
    from meshplan.report.text import format_plan

    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"[{time.perf_counter() - t0:6.2f}s] {msg}", file=sys.stderr, flush=True)

    if is_local(args.cluster):  # measured (or read from the cache) once, before the trace
        args.cluster = resolve(args.cluster, args.world_size, say=progress, log=lambda m: progress(f"profile: {m}"))
    # every check (pins, target, dtype, memory limit, quantization) before the (slow) trace: meshplan.autoparallel's
    request = plan_request(args.world_size, cluster=args.cluster, global_batch_size=args.global_batch,
                           fixed=pins(args), quantization=args.quantization, lora_rank=args.lora_rank,
                           dtype=args.dtype, target=args.target, memory_limit=args.memory_limit,
                           optimizer=optimizer_of(args), state_layout=args.state_layout)  # fmt: skip
    from meshplan.commands.heap import loading, searching
    from meshplan.loading import load_graph

    with loading(getattr(args, "one_shot", False)):  # imports, build, trace: no collections, then frozen
        graph = load_graph(args.model, seq=args.seq, use_cache=not args.no_cache, progress=progress,
                           input_shapes=input_shapes(args.input_shape))
    progress(f"traced {len(graph.nodes)} nodes, {graph.param_count:,} parameters; searching")
    with searching(getattr(args, "one_shot", False)):  # long-lived memos, few cycles: no collections
        plan = request.plan(graph, progress)
    if args.output:  # saved before the report: a closed or full stdout must not lose the plan
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        plan.save(args.output)
        progress(f"wrote {args.output}")
    if args.html or args.png:
        from meshplan.commands.report import write_plan_files

        for path in write_plan_files(plan, html=args.html, png=args.png):
            progress(f"wrote {path}")
    text = format_plan(plan)
    if args.seq is None and not args.input_shape and seq_note(graph):  # the default said where it came from
        text += f"\nnote: {seq_note(graph)}"
    return print_report(text, args.output)


def print_report(text: str, saved: str | None) -> int:
    """Print ``text`` on stdout; a reader that went away (``| head``) is fine, a failed write is an error."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
    except OSError as e:
        _silence_stdout()
        where = f"; the plan was saved to {saved}" if saved else "; pass -o plan.json to keep the plan"
        print(f"meshplan plan: error: could not write the report to stdout ({e}){where}", file=sys.stderr)
        return 1
    return 0


def _silence_stdout() -> None:
    """Stop Python's exit-time flush from failing again on the same broken stdout."""
    import os

    try:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives until exit
    except OSError:
        pass
