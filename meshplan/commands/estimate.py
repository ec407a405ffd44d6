"""``meshplan estimate MODEL --from-torchtitan job.toml | --from-megatron "ARGS" | --from-deepspeed ds.json``.

Reads the configuration a user runs today (``meshplan.engines``), costs it with meshplan's cost
model on the given cluster, and prints it beside meshplan's best plan for the same model,
cluster and global batch (``--target`` restricts that search to an engine): predicted step time,
memory per rank, MFU, and every difference with its predicted effect (``report.diff.format_diff``).
Keys the reader does not know are listed as unknown, known ones that do not change the layout as
ignored: nothing is dropped silently. ``--from-megatron`` takes the arguments, or ``@FILE`` for a
file of them. ``-o``/``--best-output`` save the two plans.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshplan.engines.spec import TARGETS
from meshplan.shapes import add_input_shape, input_shapes

HELP = "cost a torchtitan / Megatron-LM / DeepSpeed configuration and compare it with meshplan's best plan"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="zoo name, path/to/file.py:factory or package.module:factory")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-torchtitan", metavar="TOML", help="torchtitan job config (TOML)")
    src.add_argument("--from-megatron", metavar="ARGS", help='Megatron-LM arguments, or "@FILE" of them')
    src.add_argument("--from-deepspeed", metavar="JSON", help="DeepSpeed ds_config.json")
    parser.add_argument("--world-size", "-n", type=int, required=True, help="number of devices the job runs on")
    parser.add_argument("--cluster", default="h100",
                        help="cluster preset, profile JSON, or local: this machine, profiled once and cached (default h100)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: the config's, else the model's)")
    add_input_shape(parser)
    parser.add_argument("--target", default=None, choices=TARGETS,
                        help="restrict meshplan's best plan to what this engine runs (default: the source engine)")
    parser.add_argument("-o", "--output", default=None, metavar="PLAN_JSON", help="save the costed user configuration")
    parser.add_argument("--best-output", default=None, metavar="PLAN_JSON", help="save meshplan's best plan")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def read_config(args: argparse.Namespace, num_layers: int = 0):  # type: ignore[no-untyped-def]
    """(engine name, Imported) from the --from-* argument."""
    from meshplan.engines import deepspeed, megatron, torchtitan

    if args.from_torchtitan:
        return "torchtitan", torchtitan.parse(Path(args.from_torchtitan).read_text(), args.world_size, num_layers)
    if args.from_deepspeed:
        return "deepspeed", deepspeed.parse(Path(args.from_deepspeed).read_text(), args.world_size)
    text = args.from_megatron
    if text.startswith("@"):
        text = Path(text[1:]).read_text()
    return "megatron", megatron.parse(text, args.world_size)


def run(args: argparse.Namespace) -> int:
    from meshplan.api.engine_cost import cost_spec, trace_graph
    from meshplan.engines.spec import CAPS, search_limits
    from meshplan.planner.api import plan_graph
    from meshplan.profile.local import is_local, resolve
    from meshplan.report.diff import format_diff

    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"[estimate] {msg}", file=sys.stderr, flush=True)

    engine, imp = read_config(args)  # bad config fails before the (slow) trace
    spec = imp.spec
    if is_local(args.cluster):
        args.cluster = resolve(args.cluster, args.world_size, say=progress, log=lambda m: progress(f"profile: {m}"))
        print(args.cluster.extra["local"])  # what the N devices are
    progress(f"tracing {args.model}")
    shapes = input_shapes(args.input_shape)
    graph = trace_graph(args.model, None if shapes else (args.seq or spec.seq_len or None), shapes)
    if engine == "torchtitan" and spec.schedule == "interleaved-1f1b":
        engine, imp = read_config(args, int(graph.meta.get("num_layers") or 0))
        spec = imp.spec
    print(f"{engine} configuration: dp{spec.dp} tp{spec.tp} pp{spec.pp}"
          + (f" cp{spec.cp}" if spec.cp > 1 else "") + (f" ep{spec.ep}" if spec.ep > 1 else "")
          + (" moe-folding" if spec.moe_folding else "")
          + f" {spec.schedule}" + (f" v{spec.virtual_stages}" if spec.virtual_stages > 1 else "")
          + f" mb{spec.micro_batch_size}x{spec.num_microbatches} recompute={spec.recompute} {spec.dp_kind} {spec.dtype}")
    for label, keys in (("unknown (not understood, not costed)", imp.unknown),
                        ("ignored (do not change the parallel layout)", imp.ignored)):
        if keys:
            print(f"  {label}: {', '.join(keys)}")
    for n in imp.notes:
        print(f"  note: {n}")
    if spec.layers_per_stage:
        print(f"  note: costed with the configured split: {list(spec.layers_per_stage)} blocks per stage")
    progress("costing it")
    mine = cost_spec(graph, spec, args.cluster, engine)
    target = args.target or engine
    progress("searching meshplan's best plan" + (f" for {target}" if target != "meshplan" else ""))
    limits = search_limits(target, {}, spec.dtype) if target in CAPS else {}
    best = plan_graph(graph, spec.world_size, cluster=args.cluster, global_batch_size=spec.global_batch_size,
                      dtype=spec.dtype, progress=None, **limits)  # fmt: skip
    print()
    print(format_diff(mine, best, names=(f"your {engine} config", f"meshplan best ({target})")))
    for path, p in ((args.output, mine), (args.best_output, best)):
        if path:
            p.save(path)
            print(f"wrote {path}")
    return 0
