"""The ``meshplan`` command line: ``meshplan plan | report | run | profile | inspect | explain | diff | export | estimate | prepare-data | calibrate | capacity``.

Dispatch only; each subcommand lives in ``meshplan.commands.<name>``. Every command takes
``-v``/``--verbose``: without it, third-party warnings and log lines stay off its output
(``meshplan.console``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from meshplan.console import VERBOSE_HELP, third_party_quiet

COMMANDS = ("inspect", "profile", "plan", "report", "explain", "diff", "run", "export", "estimate", "prepare-data",
            "calibrate", "capacity")
#: commands whose one-shot process ends without the interpreter's teardown (``commands/heap.exit_now``)
FAST_EXIT = ("plan",)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshplan",
        description="Automatic data/tensor/pipeline parallelism planner for PyTorch training.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"meshplan.commands.{name.replace('-', '_')}")
        except ModuleNotFoundError as e:
            if e.name == f"meshplan.commands.{name.replace('-', '_')}":
                continue  # command not built in this version
            raise
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. ``argv=None`` (the ``meshplan`` script, ``python -m meshplan.cli``) means
    this process is the command: it may tune the process for one shot (``commands/heap.py``; a
    ``FAST_EXIT`` command ends the process itself, ``heap.exit_now``); a caller passing ``argv``
    keeps its process as it was and gets the exit code back."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.one_shot = argv is None
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    from meshplan.errors import MeshplanError

    try:
        with third_party_quiet(args.verbose):
            code = int(args._run(args) or 0)
    except (MeshplanError, ValueError, FileNotFoundError) as e:
        print(f"meshplan {args.command}: error: {e}", file=sys.stderr)
        code = 1
    if args.one_shot and args.command in FAST_EXIT:
        from meshplan.commands.heap import exit_now

        exit_now(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
