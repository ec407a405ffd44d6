"""``meshplan export plan.json --to {torchtitan,megatron,deepspeed} [--form F] [-o FILE] [--nearest]``.

Writes the plan as the engine's own configuration: ``meshplan.export`` (``meshplan/api/export.py``)
does the work, this module parses flags into it. torchtitan: 0.3's command-line overrides (what
follows ``--module M --config C``; the default), ``--form module --base MODULE:CONFIG`` a Python
config module in 0.3's ``Trainer.Config`` form (``--module NAME --config meshplan_config``; torchtitan
says its ``--section.option`` flags will be removed), ``--form toml`` (or ``--toml``) the job TOML of
torchtitan <= 0.2; Megatron-LM its command-line arguments, DeepSpeed a ``ds_config.json``. What the
engine cannot express (a schedule it lacks, an uneven split it has no setting for, a DP kind) is
never dropped: export stops naming each item, or with ``--nearest`` exports the closest
configuration the engine runs and prints its predicted cost beside the plan's (tracing ``--model``,
default the plan's model).
"""

from __future__ import annotations

import argparse

from meshplan.engines.spec import ENGINES

HELP = ("write a plan as torchtitan overrides / Trainer.Config module / job TOML, Megatron-LM arguments "
        "or a DeepSpeed ds_config.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", help="plan JSON written by `meshplan plan`")
    parser.add_argument("--to", required=True, choices=ENGINES, help="target engine")
    parser.add_argument("--form", default=None, choices=("overrides", "module", "toml", "args", "json"),
                        help="torchtitan: overrides (0.3 command line, default), module (a Python Trainer.Config "
                             "module for --module/--config; needs --base) or toml (<= 0.2 job file); "
                             "megatron: args; deepspeed: json")
    parser.add_argument("--base", default=None, metavar="MODULE:CONFIG",
                        help="--form module: torchtitan's --module and --config of the model the plan trains "
                             "(e.g. llama3:llama3_8b); the written module applies the plan to that config")
    parser.add_argument("-o", "--output", default=None, metavar="FILE", help="write here (default: print)")
    parser.add_argument("--nearest", action="store_true",
                        help="export the closest configuration the engine runs, with its predicted cost")
    parser.add_argument("--model", default=None, help="model to re-cost the nearest configuration (default: the plan's)")
    parser.add_argument("--toml", action="store_true", help="torchtitan: same as --form toml")


def run(args: argparse.Namespace) -> int:
    from meshplan.api.export import export

    if args.toml and args.form not in (None, "toml"):
        raise ValueError(f"--toml and --form {args.form} disagree; give one")
    out = export(args.plan, args.to, form="toml" if args.toml else args.form, nearest=args.nearest,
                 model=args.model, base=args.base)  # fmt: skip
    for line in out.header:
        print(line)
    if args.output:
        out.save(args.output)
        print(f"wrote {args.output}")
    else:
        print(out.text, end="")
    return 0
