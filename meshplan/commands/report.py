"""``meshplan report FILE``: the report of a saved plan, or of a run record (no tracing, no torch).

FILE is a plan JSON (``meshplan plan -o``) or a run record (``run_record.json`` written by
``meshplan run``); the kind is read from its content. For a plan: the text report;
``--html PATH`` the standalone HTML report (``report.html.write_html``), with ``--record RUN``
the run's section too; ``--png PATH`` the predicted pipeline timeline and ``--overview-png PATH``
mesh + timeline + memory (``report.plot``, matplotlib: the ``meshplan[plot]`` extra). For a run
record: its text summary, ``--html`` its page (``report.run_html``), ``--png`` loss, step time
and memory measured vs predicted and tokens/s (``report.plot_run``). ``--png-width`` sets the
pictures' width in pixels. Each written file is announced as "wrote PATH".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HELP = "report of a plan JSON (predicted costs, stages, TP, alternatives) or of a run record (measured vs predicted)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="plan JSON written by `meshplan plan`, or a run_record.json")
    parser.add_argument("--html", default=None, metavar="PATH", help="also write an HTML report here")
    parser.add_argument("--png", default=None, metavar="PATH",
                        help="also write a PNG here: a plan's timeline, a run's measured-vs-predicted charts "
                             "(needs meshplan[plot])")
    parser.add_argument("--overview-png", default=None, metavar="PATH",
                        help="plan only: write mesh + timeline + memory as one PNG (needs meshplan[plot])")
    parser.add_argument("--png-width", type=int, default=1200, metavar="N", help="PNG width in pixels (default 1200)")
    parser.add_argument("--record", default=None, metavar="RUN_JSON",
                        help="plan only: a run record of this plan to show beside the predictions")


def _read(path: str) -> dict:
    try:
        d = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a JSON file: {e}") from e
    if not isinstance(d, dict):
        raise ValueError(f"{path}: neither a plan nor a run record (top level is not an object)")
    return d


def run(args: argparse.Namespace) -> int:
    from meshplan.report.run_view import format_run, is_run_record, load_run, run_view

    if args.png_width < 200:
        raise ValueError(f"--png-width must be at least 200 pixels, got {args.png_width}")
    d = _read(args.file)
    if is_run_record(d):
        if args.record or args.overview_png:
            raise ValueError(f"{args.file} is a run record: --record and --overview-png apply to a plan JSON")
        view = run_view(d)
        print(format_run(view))
        if args.html:
            from meshplan.report.run_html import render_run_html

            Path(args.html).write_text(render_run_html(view), encoding="utf-8")
            print(f"wrote {args.html}")
        if args.png:
            from meshplan.report.plot_run import write_run_png

            print(f"wrote {write_run_png(view, args.png, width=args.png_width)}")
        return 0
    from meshplan.plan import Plan
    from meshplan.report.text import format_plan

    plan = Plan.from_dict(d)
    record = load_run(args.record, plan) if args.record else None
    print(format_plan(plan))
    if record is not None:
        print()
        print(format_run(record))
    for path in write_plan_files(plan, html=args.html, png=args.png, overview_png=args.overview_png,
                                 width=args.png_width, record=record):
        print(f"wrote {path}")
    return 0


def write_plan_files(plan: object, *, html: str | None = None, png: str | None = None,
                     overview_png: str | None = None, width: int = 1200, record: object = None) -> list[Path]:
    """Write the plan's HTML report, timeline PNG and overview PNG where asked (creating missing
    folders); returns the paths written, in that order. ``meshplan plan --html/--png`` shares it."""
    written: list[Path] = []
    for path in (html, png, overview_png):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    if html:
        from meshplan.report.html import write_html

        written.append(write_html(plan, html, record=record))  # type: ignore[arg-type]
    if png:
        from meshplan.report.plot import write_timeline_png

        written.append(write_timeline_png(plan, png, width=width))  # type: ignore[arg-type]
    if overview_png:
        from meshplan.report.plot import write_overview_png

        written.append(write_overview_png(plan, overview_png, width=width))  # type: ignore[arg-type]
    return written
