"""The printed answer of ``meshplan capacity``: a table per (kind, GPU count), then the Pareto
front, the deadline and budget picks, where scaling efficiency falls below 80%, and where the bands
(times and costs; the scaling column's own) come from. Every figure says predicted. No torch import.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from meshplan.sizing.api import CapacityReport
from meshplan.sizing.parse import si
from meshplan.sizing.rows import EFFICIENCY_MARK, CapacityRow, pick_ranges


def money(x: float | None) -> str:
    """``12_400_000`` -> ``$12.4M``."""
    return "—" if x is None else "$" + si(x)


def percent_down(x: float) -> str:
    """``0.795`` -> ``79%``: rounded down, so a value under the 80% mark never prints as 80%."""
    return f"{math.floor(100 * x + 1e-9):.0f}%"


def days_text(r: CapacityRow) -> str:
    half = (r.days_high - r.days_low) / 2
    return f"{r.days:.3g} ± {half:.2g}"


def cost_text(r: CapacityRow) -> str:
    if r.cost is None or r.cost_high is None or r.cost_low is None:
        return "—"
    return f"{money(r.cost)} ± {si((r.cost_high - r.cost_low) / 2)}"


def marks(r: CapacityRow) -> str:
    out = []
    if r.pareto:
        out.append("front")
    if r.deadline_pick:
        out.append("DEADLINE PICK")
    if r.budget_pick:
        out.append("BUDGET PICK")
    if r.below_efficiency_mark:
        out.append(f"<{EFFICIENCY_MARK:.0%} scaling")
    return ", ".join(out)


def row_cells(r: CapacityRow) -> list[str]:
    if not r.fits:
        return [r.cluster, str(r.gpus), f"no plan: {r.reason}", "", "", "", "", "", "", "", "", "", ""]
    eff = "—" if r.scaling_efficiency is None else percent_down(r.scaling_efficiency)
    return [r.cluster, f"{r.gpus:,}", r.plan, si(r.tokens_per_s), f"{r.tokens_per_s_per_gpu:,.0f}", f"{r.mfu:.1%}",
            f"{r.step_s:.3g}",
            days_text(r), si(r.gpu_hours), cost_text(r), f"{r.peak_mem_gib:.1f}", eff, marks(r)]  # fmt: skip


HEADERS = ["cluster", "GPUs", "best plan", "tok/s", "tok/s/GPU", "MFU", "step s", "days", "GPU-h", "cost", "peak GiB",
           "scaling", "marks"]  # fmt: skip


def _short(r: CapacityRow) -> str:
    cost = f", {money(r.cost)}" if r.cost is not None else f", {si(r.gpu_hours)} GPU-h"
    return f"{r.cluster} x {r.gpus:,} ({r.days:.3g} days{cost})"


def summary_lines(rep: CapacityReport) -> list[str]:
    """The lines under the table: front, picks, efficiency, sizes left out."""
    rows = rep.rows
    fitting = [r for r in rows if r.fits]
    lines = []
    front = sorted((r for r in rows if r.pareto), key=lambda r: r.days)
    priced = {r.cluster for r in rows if r.cost is not None}
    unpriced = sorted({r.cluster for r in fitting} - priced)
    what = ("GPU-hours (no prices given)" if not priced
            else "cost" + (f" (priced kinds only; no price for {', '.join(unpriced)})" if unpriced else ""))  # fmt: skip
    lines.append(f"Pareto front, time vs {what}: " + ("; ".join(_short(r) for r in front) if front else "none"))
    if rep.deadline_days is not None:
        pick = next((r for r in rows if r.deadline_pick), None)
        if pick is not None:
            safe = "also" if pick.days_high <= rep.deadline_days else "NOT"
            lines.append(f"Cheapest meeting the {rep.deadline_days:.3g}-day deadline: {_short(pick)}: {pick.plan}; "
                         f"{safe} within it at the band's slow end ({pick.days_high:.3g} days)")  # fmt: skip
        elif fitting:
            fast = min(fitting, key=lambda r: r.days)
            lines.append(f"No plan meets the {rep.deadline_days:.3g}-day deadline: the fastest is {_short(fast)}")
    if rep.budget is not None:
        pick = next((r for r in rows if r.budget_pick), None)
        if pick is not None:
            safe = "also" if (pick.cost_high or 0) <= rep.budget else "NOT"
            lines.append(f"Fastest within the {money(rep.budget)} budget: {_short(pick)}: {pick.plan}; {safe} within "
                         f"it at the band's costly end ({money(pick.cost_high)})")  # fmt: skip
        else:
            priced = [r for r in fitting if r.cost is not None]
            cheap = min(priced, key=lambda r: r.spend) if priced else None
            lines.append(f"No plan fits the {money(rep.budget)} budget"
                         + (f": the cheapest is {_short(cheap)}" if cheap else " (no priced plan)"))
    if rep.deadline_days is None or (rep.budget is None and priced):
        lines += pick_lines(rep)
    for kind in dict.fromkeys(r.cluster for r in rows):
        low = [r for r in rows if r.cluster == kind and r.below_efficiency_mark]
        if low:
            first = min(low, key=lambda r: r.gpus)
            base = min((r for r in fitting if r.cluster == kind), key=lambda r: r.gpus)
            sb = rep.scaling_band
            pm = "" if sb is None else f" ± {100 * sb.median:.1f}%" + (
                f" (median; ± {100 * sb.p90:.1f}% at the 90th percentile)" if sb.p90 is not None else " (median)")
            lines.append(f"Scaling efficiency of {kind} falls below {EFFICIENCY_MARK:.0%} at {first.gpus:,} GPUs "
                         f"({percent_down(first.scaling_efficiency or 0.0)}{pm} of {base.gpus:,} GPUs' tokens/s per GPU)")  # fmt: skip
        elif any(r.cluster == kind and r.fits for r in rows):
            lines.append(f"Scaling efficiency of {kind} stays at or above {EFFICIENCY_MARK:.0%} over the sizes planned")
    if rep.skipped:
        lines.append("Sizes left out of the range: " + "; ".join(rep.skipped))
    return lines


def pick_lines(rep: CapacityReport) -> list[str]:
    """Without ``--deadline`` / ``--budget``: which plan each deadline / budget would pick (front rows,
    fastest first; ``sizing.rows.pick_ranges``)."""
    ranges = pick_ranges(rep.rows)
    if not ranges:
        return []
    want = [w for w, none in (("deadline", rep.deadline_days is None), ("budget", rep.budget is None)) if none]
    lines = [f"Deadline / budget picks (no --{' / --'.join(want)} given; predicted days and cost, the band not applied):"]
    for p in ranges:
        parts = []
        if rep.deadline_days is None:
            to = f"to <{p.days_to:.3g} days" if p.days_to is not None else "days or more"
            parts.append(f"deadline {p.days_from:.3g} {to}")
        if rep.budget is None and p.spend_from is not None:
            lo, hi = money(p.spend_from), money(p.spend_to)
            if p.spend_to is not None and lo == hi:  # ends that round alike: whole dollars
                lo, hi = f"${p.spend_from:,.0f}", f"${p.spend_to:,.0f}"
            parts.append(f"budget {lo} " + (f"to <{hi}" if p.spend_to is not None else "or more"))
        lines.append(f"  {', or '.join(parts)}: {_short(p.row)}: {p.row.plan}")
    return lines


def format_report(rep: CapacityReport, rows: Sequence[CapacityRow] | None = None) -> str:
    """The whole printed answer."""
    from tabulate import tabulate

    rows = rep.rows if rows is None else rows
    prices = ", ".join(f"{k} ${v:g}/GPU-h" for k, v in rep.prices.items()) or "none (cost columns empty)"
    head = [
        f"meshplan capacity: {rep.model}, {si(rep.tokens)} tokens. PREDICTED by meshplan's cost model "
        "(no figure below was measured)",
        rep.batch_rule,
        f"prices: {prices}",
        f"band: {rep.band.describe()}",
        *([f"scaling band: {rep.scaling_band.describe()}"] if rep.scaling_band is not None else []),
        "",
    ]
    table = tabulate([row_cells(r) for r in rows], headers=HEADERS, tablefmt="simple", disable_numparse=True)
    n = len(rows)
    tail = [f"answered in {rep.seconds:.1f} s wall ({n} searches, trace {rep.trace_seconds:.1f} s)"]
    return "\n".join(head + [table, ""] + summary_lines(rep) + tail)


__all__ = ["format_report", "money", "pick_lines", "summary_lines"]
