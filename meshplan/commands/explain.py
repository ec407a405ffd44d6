"""``meshplan explain plan.json``: why this plan won, what the runner-up cost (``report.explain.explain_plan``).

The explanation text itself is ``meshplan.report.explain.explain_plan``; ``--timeline`` appends
the predicted pipeline schedule as a character timeline (``meshplan.report.timeline``).
No torch import.
"""

from __future__ import annotations

import argparse

HELP = "Explain a plan: why its configuration won and what the alternatives cost (predicted)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", help="plan JSON written by `meshplan plan`")
    parser.add_argument("--timeline", action="store_true",
                        help="also print the predicted pipeline schedule as a text timeline")
    parser.add_argument("--width", type=int, default=100, help="text timeline width in columns (default 100)")


def run(args: argparse.Namespace) -> int:
    from meshplan.plan import Plan
    from meshplan.report.explain import explain_plan

    plan = Plan.load(args.plan)
    print(explain_plan(plan))
    if args.timeline:
        from meshplan.report.timeline import format_text_timeline

        print()
        print(format_text_timeline(plan, width=args.width))
    return 0
