"""Pictures of a capacity answer (``meshplan capacity --png / --html``), drawn with matplotlib.

:func:`capacity_figure` has two panels: time to train (days) against cost (dollars, or GPU-hours
where no price is given), one colour per cluster kind, each point labelled with its GPU count and
plan degrees, the ± band as error bars, the Pareto front joined, the deadline/budget picks starred
and the deadline/budget drawn as lines; and predicted tokens/s per GPU against GPU count (log 2),
one line per kind, with each kind's 80%-of-the-smallest-size level dashed and the sizes under it
hollow. Every figure is predicted and the titles say so. :func:`write_capacity_html` writes a page
with the table, the lines under it and the picture inline (SVG). Returns a matplotlib ``Figure``
(no pyplot state). No torch import.
"""

from __future__ import annotations

import io
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshplan.report.html_base import CSS, table
from meshplan.report.plot import DPI, check_width, require_matplotlib, save_png

if TYPE_CHECKING:
    from meshplan.sizing.api import CapacityReport
    from meshplan.sizing.rows import CapacityRow

KIND_COLOURS = ("#3b6fb6", "#e07b16", "#2e9e4f", "#7a4fa0", "#c0392b", "#46b3b3")


def degrees(plan: str) -> str:
    """``dp128 tp2 pp1 1f1b mb1x4 recompute=op fsdp`` -> ``dp128 tp2 pp1`` (cp/ep kept)."""
    return " ".join(w for w in plan.split() if w[:2] in ("dp", "tp", "pp", "cp", "ep") and w[2:].isdigit())


def _spend(r: CapacityRow, priced: bool) -> tuple[float, float, float]:
    if priced and r.cost is not None:
        return r.cost, r.cost - (r.cost_low or r.cost), (r.cost_high or r.cost) - r.cost
    return r.gpu_hours, r.gpu_hours * (r.days - r.days_low) / r.days, r.gpu_hours * (r.days_high - r.days) / r.days


def _time_cost(ax: Any, rep: CapacityReport) -> None:
    rows = [r for r in rep.rows if r.fits]
    priced = any(r.cost is not None for r in rows)
    if priced:  # dollars and GPU-hours share no axis: kinds without a price are left out of this panel
        rows = [r for r in rows if r.cost is not None]
    kinds = list(dict.fromkeys(r.cluster for r in rep.rows))
    for i, kind in enumerate(kinds):
        mine = [r for r in rows if r.cluster == kind]
        if not mine:
            continue
        c = KIND_COLOURS[i % len(KIND_COLOURS)]  # the same colour per kind as in the scaling panel
        xs = [r.days for r in mine]
        ys = [_spend(r, priced)[0] for r in mine]
        xerr = [[r.days - r.days_low for r in mine], [r.days_high - r.days for r in mine]]
        yerr = [[_spend(r, priced)[1] for r in mine], [_spend(r, priced)[2] for r in mine]]
        ax.errorbar(xs, ys, xerr=xerr, yerr=yerr, fmt="o", color=c, ms=5, elinewidth=0.8, capsize=2, label=kind)
        for r, x, y in zip(mine, xs, ys, strict=True):
            ax.annotate(f"{r.gpus} {degrees(r.plan)}", (x, y), xytext=(4, 3), textcoords="offset points", fontsize=6.5,
                        color=c)  # fmt: skip
    front = sorted((r for r in rows if r.pareto), key=lambda r: r.days)
    if len(front) > 1:
        ax.plot([r.days for r in front], [_spend(r, priced)[0] for r in front], "-", color="#888888", lw=1,
                zorder=0, label="Pareto front")  # fmt: skip
    for r in rows:
        if r.deadline_pick or r.budget_pick:
            what = " & ".join(w for w, on in (("deadline pick", r.deadline_pick), ("budget pick", r.budget_pick)) if on)
            ax.plot([r.days], [_spend(r, priced)[0]], "*", color="#c0392b", ms=14, mfc="none", mew=1.4)
            ax.annotate(what, (r.days, _spend(r, priced)[0]), xytext=(6, -11), textcoords="offset points",
                        fontsize=7.5, color="#c0392b")  # fmt: skip
    if rep.deadline_days is not None:
        ax.axvline(rep.deadline_days, color="#c0392b", ls=":", lw=1, label=f"deadline {rep.deadline_days:.3g} d")
    if rep.budget is not None and priced:
        ax.axhline(rep.budget, color="#c0392b", ls="--", lw=1, label=f"budget ${rep.budget:,.0f}")
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log")
    ax.set_yscale("log")
    from meshplan.sizing.parse import si

    def label(v: float, money: bool, minor: bool) -> str:
        if minor and f"{v:.0e}"[0] not in "25":  # minor ticks: 2x and 5x the decade only
            return ""
        return ("$" if money else "") + si(v) if money or v >= 1e4 else f"{v:,.4g}"

    for axis, money in ((ax.xaxis, False), (ax.yaxis, priced)):
        axis.set_major_formatter(FuncFormatter(lambda v, _p, m=money: label(v, m, False)))
        axis.set_minor_formatter(FuncFormatter(lambda v, _p, m=money: label(v, m, True)))
    ax.set_xlabel("days to train (predicted)")
    unpriced = sorted({r.cluster for r in rep.rows if r.fits} - {r.cluster for r in rows})
    ax.set_ylabel("cost, dollars (predicted)" + (f"; no price: {', '.join(unpriced)} not shown" if unpriced else "")
                  if priced else "GPU-hours (predicted; no prices given)")  # fmt: skip
    ax.set_title("Time to train vs " + ("cost" if priced else "GPU-hours") + f" (± {100 * rep.band.median:.1f}% band)",
                 fontsize=10)  # fmt: skip
    ax.grid(True, which="both", color="#eeeeee", lw=0.6)
    ax.legend(fontsize=7.5, loc="best")


def _scaling(ax: Any, rep: CapacityReport) -> None:
    kinds = list(dict.fromkeys(r.cluster for r in rep.rows))
    for i, kind in enumerate(kinds):
        mine = sorted((r for r in rep.rows if r.cluster == kind and r.fits), key=lambda r: r.gpus)
        if not mine:
            continue
        c = KIND_COLOURS[i % len(KIND_COLOURS)]
        xs = [r.gpus for r in mine]
        ys = [r.tokens_per_s_per_gpu for r in mine]
        ax.plot(xs, ys, "-", color=c, lw=1.2, label=kind)
        for r in mine:
            ax.plot([r.gpus], [r.tokens_per_s_per_gpu], "o", color=c, ms=5,
                    mfc="none" if r.below_efficiency_mark else c)  # fmt: skip
        ax.axhline(0.8 * ys[0], color=c, ls="--", lw=0.8, alpha=0.7)
        ax.annotate(f"80% of {xs[0]}", (xs[-1], 0.8 * ys[0]), xytext=(-2, 3), textcoords="offset points", fontsize=7,
                    color=c, ha="right")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("tokens/s per GPU (predicted)")
    sb = rep.scaling_band
    pm = "" if sb is None else (f"\nscaling band ± {100 * sb.median:.1f}% (median"
                                + (f"; 90th percentile ± {100 * sb.p90:.1f}%" if sb.p90 is not None else "") + ")")
    ax.set_title(f"Scaling: tokens/s per GPU (hollow: under 80% of the smallest size){pm}", fontsize=10)
    ax.grid(True, which="both", color="#eeeeee", lw=0.6)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7.5, loc="best")


def capacity_figure(rep: CapacityReport, width: int = 1400) -> Any:
    """The two panels side by side, ``width`` px wide at 100 dpi (see the module docstring)."""
    check_width(width)
    Figure = require_matplotlib()
    fig = Figure(figsize=(width / DPI, 0.42 * width / DPI), dpi=DPI)
    a, b = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.35, 1]})
    _time_cost(a, rep)
    _scaling(b, rep)
    from meshplan.sizing.parse import si

    fig.suptitle(f"{rep.model}: {si(rep.tokens)} tokens, PREDICTED by meshplan's cost model", fontsize=11)
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.12, top=0.86, wspace=0.2)
    return fig


def write_capacity_png(rep: CapacityReport, path: str | Path, width: int = 1400) -> Path:
    return save_png(capacity_figure(rep, width), path)


def capacity_html(rep: CapacityReport) -> str:
    """A self-contained page: what was asked, the table, the lines under it, the picture (SVG)."""
    from meshplan.sizing.text import HEADERS, row_cells, summary_lines

    buf = io.StringIO()
    capacity_figure(rep).savefig(buf, format="svg")
    svg = buf.getvalue()
    svg = svg[svg.find("<svg"):]
    prices = ", ".join(f"{k} ${v:g}/GPU-h" for k, v in rep.prices.items()) or "none"
    lines = "".join(f"<li>{escape(x)}</li>" for x in summary_lines(rep))
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>capacity: {escape(rep.model)}</title>"
        f"<style>{CSS}</style></head><body><h1>Capacity: {escape(rep.model)}, {rep.tokens:,} tokens</h1>"
        "<p class=pred>predicted by meshplan's cost model; nothing here was measured</p>"
        f"<p class=note>{escape(rep.batch_rule)}<br>prices: {escape(prices)}<br>band: {escape(rep.band.describe())}"
        + (f"<br>scaling band: {escape(rep.scaling_band.describe())}" if rep.scaling_band is not None else "")
        + "</p>"
        f"<div class=figure>{svg}</div><h2>Plans</h2>"
        + table(HEADERS, [row_cells(r) for r in rep.rows], numeric={1, 3, 4, 5, 6, 10, 11})
        + f"<ul>{lines}</ul><p class=note>answered in {rep.seconds:.1f} s wall</p></body></html>\n"
    )


def write_capacity_html(rep: CapacityReport, path: str | Path) -> Path:
    p = Path(path)
    p.write_text(capacity_html(rep))
    return p


__all__ = ["capacity_figure", "capacity_html", "degrees", "write_capacity_html", "write_capacity_png"]
