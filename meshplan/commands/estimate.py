"""``meshplan estimate MODEL --from-torchtitan job.toml | --from-megatron "ARGS" | --from-deepspeed ds.json``.

Flags parsed into ``meshplan.estimate_config`` (``meshplan/api/engine_cost.py``), which does the work.

Reads the configuration a user runs today (``meshplan.engines``), costs it with meshplan's cost
model on the given cluster, and prints it beside meshplan's best plan for the same model,
cluster and global batch (``--target`` restricts that search to an engine): predicted step time,
memory per rank, MFU, and every difference with its predicted effect (``report.diff.format_diff``).
Keys the reader does not know are listed as unknown, known ones that do not change the layout as
ignored: nothing is dropped silently. ``--from-megatron`` takes the arguments, or ``@FILE`` for a
file of them. ``--optimizer [--momentum]`` is the optimizer costed in both (default adam). ``-o``/``--best-output`` save the two plans.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshplan.api.plan import DEFAULT_STATE_LAYOUT, STATE_LAYOUT_CHOICES
from meshplan.commands.argtypes import add_optimizer_arguments, optimizer_of
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
    add_optimizer_arguments(parser, ", in the configuration and in meshplan's best plan alike")
    parser.add_argument("--state-layout", default=DEFAULT_STATE_LAYOUT, choices=STATE_LAYOUT_CHOICES,
                        help="the state layout of meshplan's best plan under --target meshplan, as `meshplan plan "
                             "--state-layout` (default auto: fp32 parameters while a plan fits, else the first "
                             "16-bit layout that fits)")
    parser.add_argument("-o", "--output", default=None, metavar="PLAN_JSON", help="save the costed user configuration")
    parser.add_argument("--best-output", default=None, metavar="PLAN_JSON", help="save meshplan's best plan")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def source(args: argparse.Namespace) -> tuple[str, str | Path]:
    """(engine, configuration) from the --from-* argument: a path for torchtitan and DeepSpeed,
    the arguments (or ``@FILE``) for Megatron-LM."""
    if args.from_torchtitan:
        return "torchtitan", Path(args.from_torchtitan)
    if args.from_deepspeed:
        return "deepspeed", Path(args.from_deepspeed)
    return "megatron", args.from_megatron


def run(args: argparse.Namespace) -> int:
    from meshplan.api.engine_cost import estimate_config, read_config
    from meshplan.profile.local import is_local, resolve

    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"[estimate] {msg}", file=sys.stderr, flush=True)

    engine, config = source(args)
    optimizer = optimizer_of(args)  # a bad --momentum fails before anything is read or traced
    if is_local(args.cluster):
        read_config(config, engine, args.world_size)  # a bad configuration fails before the (slow) profile
        args.cluster = resolve(args.cluster, args.world_size, say=progress, log=lambda m: progress(f"profile: {m}"))
        print(args.cluster.extra["local"])  # what the N devices are
    est = estimate_config(args.model, config, engine=engine, world_size=args.world_size, cluster=args.cluster,
                          seq_len=args.seq, input_shapes=input_shapes(args.input_shape), target=args.target,
                          optimizer=optimizer, state_layout=args.state_layout, progress=progress)  # fmt: skip
    imp = est.config
    print(est.summary())
    for label, keys in (("unknown (not understood, not costed)", imp.unknown),
                        ("ignored (do not change the parallel layout)", imp.ignored)):
        if keys:
            print(f"  {label}: {', '.join(keys)}")
    for n in imp.notes:
        print(f"  note: {n}")
    if imp.spec.layers_per_stage:
        print(f"  note: costed with the configured split: {list(imp.spec.layers_per_stage)} blocks per stage")
    print()
    print(est.comparison())
    for path, p in ((args.output, est.plan), (args.best_output, est.best)):
        if path:
            p.save(path)
            print(f"wrote {path}")
    return 0
