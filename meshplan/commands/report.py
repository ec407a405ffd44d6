"""``meshplan report plan.json``: print the text report of a saved plan (no tracing, no torch)."""

from __future__ import annotations

import argparse

HELP = "print the text report of a plan JSON (predicted costs, stages, TP styles, alternatives)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", help="plan JSON written by `meshplan plan`")


def run(args: argparse.Namespace) -> int:
    from meshplan.plan import Plan

    print(Plan.load(args.plan))
    return 0
