"""Report rendering speed: HTML report, timeline PNG, overview PNG, text timeline.

Run: ``python benchmarks/bench_report.py`` (from the repository root). Uses the hand-made plans
of ``tests/report_fixtures.py`` (made-up stage times, simulated makespan) and prints a Markdown
table: best of 3 wall-clock runs, plus the output sizes.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree

from report_fixtures import make_plan  # noqa: E402

from meshplan.report.html import render_html  # noqa: E402
from meshplan.report.plot import write_overview_png, write_timeline_png  # noqa: E402
from meshplan.report.timeline import format_text_timeline, plan_timeline  # noqa: E402

CASES = {
    "dp2 tp4 pp4 1f1b m8 (32 ranks)": dict(dp=2, tp=4, pp=4, m=8),
    "tp2 pp4 zbv v2 m8": dict(tp=2, pp=4, v=2, m=8, schedule="zbv"),
    "dp32 tp8 pp16 1f1b m64 (4096 ranks)": dict(dp=32, tp=8, pp=16, m=64, layers=32),
    "pp32 interleaved v2 m256": dict(pp=32, v=2, m=256, layers=64, schedule="interleaved-1f1b"),
}


def best_of(fn, n: int = 3) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    print("| plan | events | HTML | HTML size | timeline PNG (1200 px) | PNG size | overview PNG | text timeline |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, kw in CASES.items():
            plan = make_plan(**kw)
            events = len(plan_timeline(plan).events)
            t_html = best_of(lambda: render_html(plan))  # noqa: B023
            size_html = len(render_html(plan).encode())
            png = Path(tmp) / "t.png"
            t_png = best_of(lambda: write_timeline_png(plan, png))  # noqa: B023
            size_png = png.stat().st_size
            t_ov = best_of(lambda: write_overview_png(plan, Path(tmp) / "o.png"))  # noqa: B023
            t_txt = best_of(lambda: format_text_timeline(plan, width=100))  # noqa: B023
            print(f"| {name} | {events} | {t_html * 1e3:.0f} ms | {size_html / 1024:.0f} KiB | {t_png * 1e3:.0f} ms "
                  f"| {size_png / 1024:.0f} KiB | {t_ov * 1e3:.0f} ms | {t_txt * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
