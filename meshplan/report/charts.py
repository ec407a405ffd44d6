"""Small SVG charts for the HTML report (no dependency): a line chart and a grouped bar chart.

Both return a :class:`meshplan.report.svg.Drawing` (``to_svg`` makes it inline SVG): axes with
a few round ticks, one colour per series, a legend line under the plot. Used for the run
section of the HTML report (loss, step time, memory, tokens/s). No torch import.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from meshplan.report.svg import Drawing

LEFT, RIGHT, TOP, BOTTOM = 64, 16, 24, 44
SERIES_COLOURS = ("#3b6fb6", "#7a4fa0", "#2e9e4f", "#e07b16", "#c0392b")


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(f * mag for f in (1, 2, 2.5, 5, 10) if f * mag >= raw)
    first = math.floor(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 2) if first + i * step <= hi + 1e-12 * step]


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _frame(title: str, width: int, height: int, lo: float, hi: float, y_label: str) -> tuple[Drawing, float, float]:
    d = Drawing(width, height)
    d.text(LEFT, 14, title, 11, bold=True)
    plot_h = height - TOP - BOTTOM
    d.line(LEFT, TOP, LEFT, TOP + plot_h, "#444444")
    d.line(LEFT, TOP + plot_h, width - RIGHT, TOP + plot_h, "#444444")
    for t in _ticks(lo, hi):
        y = TOP + plot_h - (t - lo) / (hi - lo) * plot_h
        d.line(LEFT - 4, y, width - RIGHT, y, "#e6e6e6")
        d.text(LEFT - 6, y + 3, _fmt(t), 9, anchor="end")
    d.text(8, TOP - 6, y_label, 9, fill="#444444")
    return d, plot_h, width - LEFT - RIGHT


def line_chart(
    title: str, xs: Sequence[float], series: Sequence[tuple[str, Sequence[float]]], *, width: int = 560,
    height: int = 240, y_label: str = "", x_label: str = "step",
) -> Drawing:
    """``series``: (label, y per x); a series of one value repeated is drawn as a dashed level."""
    vals = [y for _, ys in series for y in ys if y == y]
    lo, hi = (min(vals + [0.0]), max(vals + [1e-12])) if vals else (0.0, 1.0)
    hi = hi if hi > lo else lo + 1.0
    d, plot_h, plot_w = _frame(title, width, height, lo, hi, y_label)
    x0, x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
    span = (x1 - x0) or 1.0

    def px(x: float, y: float) -> tuple[float, float]:
        return LEFT + (x - x0) / span * plot_w, TOP + plot_h - (y - lo) / (hi - lo) * plot_h

    for t in _ticks(x0, x1, 6):
        if x0 <= t <= x1:
            d.text(px(t, lo)[0], TOP + plot_h + 14, _fmt(t), 9, anchor="middle")
    d.text(LEFT + plot_w / 2, height - 18, x_label, 9, anchor="middle", fill="#444444")
    legend_x = LEFT
    for i, (label, ys) in enumerate(series):
        colour = SERIES_COLOURS[i % len(SERIES_COLOURS)]
        pts = [px(x, y) for x, y in zip(xs, ys) if y == y]
        for (ax, ay), (bx, by) in zip(pts, pts[1:]):
            d.line(ax, ay, bx, by, colour, 2)
        if len(pts) == 1:
            d.rect(pts[0][0] - 2, pts[0][1] - 2, 4, 4, colour)
        d.rect(legend_x, height - 10, 10, 4, colour)
        d.text(legend_x + 14, height - 5, label, 9)
        legend_x += 24 + len(label) * 6
    d.caption = f"{title}: " + "; ".join(label for label, _ in series)
    return d


def bar_chart(
    title: str, labels: Sequence[str], series: Sequence[tuple[str, Sequence[float | None]]], *, width: int = 560,
    height: int = 240, y_label: str = "",
) -> Drawing:
    """Grouped bars: one group per label, one bar per series (None: no bar)."""
    vals = [v for _, ys in series for v in ys if v is not None]
    hi = max(vals + [1e-12])
    d, plot_h, plot_w = _frame(title, width, height, 0.0, hi, y_label)
    group_w = plot_w / max(1, len(labels))
    bar_w = 0.8 * group_w / max(1, len(series))
    for g, label in enumerate(labels):
        gx = LEFT + g * group_w + 0.1 * group_w
        d.text(gx + 0.4 * group_w, TOP + plot_h + 14, label, 9, anchor="middle")
        for i, (name, ys) in enumerate(series):
            v = ys[g] if g < len(ys) else None
            if v is None:
                continue
            h = v / hi * plot_h
            d.rect(gx + i * bar_w, TOP + plot_h - h, bar_w, h, SERIES_COLOURS[i % len(SERIES_COLOURS)],
                   title=f"{label} {name}: {_fmt(v)} {y_label}")
    legend_x = LEFT
    for i, (name, _) in enumerate(series):
        d.rect(legend_x, height - 10, 10, 4, SERIES_COLOURS[i % len(SERIES_COLOURS)])
        d.text(legend_x + 14, height - 5, name, 9)
        legend_x += 24 + len(name) * 6
    d.caption = f"{title}: " + "; ".join(name for name, _ in series)
    return d
