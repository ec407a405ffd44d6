"""``meshplan export plan.json --to {torchtitan,megatron,deepspeed} [-o FILE] [--nearest]``.

Writes the plan as the engine's own configuration (``meshplan.engines``): torchtitan 0.3's
command-line overrides (what follows ``--module M --config C``; ``--toml`` writes the job TOML of
torchtitan <= 0.2 instead), Megatron-LM its command-line arguments, DeepSpeed a ``ds_config.json``. What the engine cannot express (a
schedule it lacks, an uneven split it has no setting for, a DP kind) is never dropped: export
stops naming each item, or with ``--nearest`` exports the closest configuration the engine runs
and prints its predicted cost beside the plan's (tracing ``--model``, default the plan's model).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from meshplan.engines.spec import ENGINES

HELP = "write a plan as a torchtitan job TOML, Megatron-LM arguments or a DeepSpeed ds_config.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", help="plan JSON written by `meshplan plan`")
    parser.add_argument("--to", required=True, choices=ENGINES, help="target engine")
    parser.add_argument("-o", "--output", default=None, metavar="FILE", help="write here (default: print)")
    parser.add_argument("--nearest", action="store_true",
                        help="export the closest configuration the engine runs, with its predicted cost")
    parser.add_argument("--model", default=None, help="model to re-cost the nearest configuration (default: the plan's)")
    parser.add_argument("--toml", action="store_true",
                        help="torchtitan: write the job TOML of torchtitan <= 0.2 instead of 0.3's command-line overrides")


def render(spec, engine: str, devices_per_node: int = 8, toml: bool = False) -> str:  # type: ignore[no-untyped-def]
    from meshplan.engines import deepspeed, megatron, torchtitan

    if engine == "megatron":
        return megatron.export(spec) + "\n"
    if engine == "torchtitan":
        if toml:
            return torchtitan.export(spec, devices_per_node)
        notes = "".join(f"# note: {n}\n" for n in torchtitan.cli_notes(spec))
        return notes + torchtitan.cli_overrides(spec, devices_per_node) + "\n"
    return deepspeed.export(spec)


def run(args: argparse.Namespace) -> int:
    from meshplan.engines.spec import nearest, spec_from_plan, unsupported
    from meshplan.plan import Plan

    plan = Plan.load(args.plan)
    spec = spec_from_plan(plan)
    missing = unsupported(spec, args.to)
    if missing and not args.nearest:
        raise ValueError(f"{args.to} cannot run this plan as it is: " + "; ".join(missing)
                         + ". Re-plan with `meshplan plan ... --target " + args.to
                         + "`, or export the closest it runs with --nearest")
    if missing:
        from meshplan.commands.engine_cost import cost_spec, trace_graph

        spec, changes = nearest(spec, args.to)
        from meshplan.cost_models.hardware import ClusterSpec

        near = cost_spec(trace_graph(args.model or plan.model_name, plan.seq_len or None), spec,
                         ClusterSpec.from_dict(plan.cluster), args.to)  # fmt: skip
        print(f"# nearest {args.to} configuration: " + "; ".join(changes))
        p, q = plan.predicted, near.predicted
        print(f"# predicted step: plan {p.step_s * 1e3:.1f} ms, nearest {q.step_s * 1e3:.1f} ms "
              f"({q.step_s / p.step_s - 1:+.1%}); peak memory {max(p.peak_mem_bytes) / 2**30:.1f} -> "
              f"{max(q.peak_mem_bytes) / 2**30:.1f} GiB")
        for n in near.notes:
            if n.startswith("does not fit"):
                print(f"# nearest {n}")
    text = render(spec, args.to, int(plan.cluster.get("devices_per_node", 8) or 8), args.toml)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}")
    else:
        print(text, end="")
    return 0
