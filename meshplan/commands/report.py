"""``meshplan report plan.json``: print the text report of a saved plan (no tracing, no torch).

``--html PATH`` also writes the standalone HTML report (``meshplan.report.html.write_html``),
``--png PATH`` the predicted pipeline timeline as a PNG (``meshplan.report.png.write_timeline_png``,
``--png-width`` pixels wide); each written file is announced as "wrote PATH".
"""

from __future__ import annotations

import argparse

HELP = "print the text report of a plan JSON (predicted costs, stages, TP styles, alternatives)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", help="plan JSON written by `meshplan plan`")
    parser.add_argument("--html", default=None, metavar="PATH", help="also write an HTML report here")
    parser.add_argument("--png", default=None, metavar="PATH", help="also write the timeline PNG here")
    parser.add_argument("--png-width", type=int, default=1200, metavar="N", help="PNG width in pixels (default 1200)")


def run(args: argparse.Namespace) -> int:
    from meshplan.plan import Plan
    from meshplan.report.text import format_plan

    if args.png_width < 200:
        raise ValueError(f"--png-width must be at least 200 pixels, got {args.png_width}")
    plan = Plan.load(args.plan)
    print(format_plan(plan))
    if args.html:
        from meshplan.report.html import write_html

        print(f"wrote {write_html(plan, args.html)}")
    if args.png:
        from meshplan.report.png import write_timeline_png

        print(f"wrote {write_timeline_png(plan, args.png, width=args.png_width)}")
    return 0
