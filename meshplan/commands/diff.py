"""``meshplan diff a.json b.json``: the decisions two plans differ in, and the predicted effect.

Prints two tables (``meshplan.report.diff.format_diff``): each changed decision (degrees, axis
order, schedule, microbatches, recompute, dp kind, stage boundaries, TP style per FQN pattern,
quantization, ...) with the usual effect of the change, then the predicted figures of both plans
(step time and breakdown, bubble, memory, bytes per collective kind, MFU) with the change.
No torch import.
"""

from __future__ import annotations

import argparse

HELP = "Compare two plans: what differs and its predicted effect on step time, memory, bubble, comm, MFU."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan_a", help="first plan JSON (A)")
    parser.add_argument("plan_b", help="second plan JSON (B)")


def run(args: argparse.Namespace) -> int:
    from meshplan.plan import Plan
    from meshplan.report.diff import format_diff

    a, b = Plan.load(args.plan_a), Plan.load(args.plan_b)
    print(f"A = {args.plan_a}\nB = {args.plan_b}")
    print(format_diff(a, b))
    return 0
