"""The pipeline schedule of a Plan as a timeline: simulated, laid out as a picture, or as text.

:func:`plan_timeline` runs ``meshplan.partition.schedule.simulate`` (the same simulation that
scored the plan, so its makespan is ``Prediction.pipeline_s``) with the plan's per-stage times:
``fwd_s``, ``bwd_s - bwd_weight_s`` (input gradient), ``bwd_weight_s`` and ``send_s`` (p2p).

:func:`layout_timeline` lays the timeline out as a :class:`~meshplan.report.svg.Drawing`, one
swimlane per pipeline rank: F / B / W boxes per microbatch (later virtual chunks a shade lighter,
the microbatch number written in a box wide enough for it), idle time (bubbles) in pale red,
p2p sends as thin connectors from producer to consumer (above 300 events: as a thin bar on the
receiving lane, from the producer's end to the consumer's start), a time axis in ms and a legend.
The Drawing becomes inline SVG (HTML report); the PNG is drawn by matplotlib (:mod:`meshplan.report.plot`).

Large plans stay bounded: with more than ``max_events`` events (e.g. pp 16 x m 64 x 2 kinds)
microbatches are no longer drawn one by one: each lane becomes 6-pixel bins, each a stacked bar
of the F / B / W share of its time (rounded to quarters, equal neighbours merged), so the
rectangle count is bounded by lanes x width / 6 whatever m is (a few per lane in practice);
connectors and labels are then left out and the picture says so. :func:`format_text_timeline` is the terminal form for small plans.

No torch import.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from meshplan.report.svg import Drawing, text_width_px

if TYPE_CHECKING:
    from meshplan.plan import Plan

KINDS = ("F", "B", "W")
KIND_NAMES = {"F": "forward", "B": "backward (input grad)", "W": "backward (weight grad)"}
# base colour per kind, then lighter shades for later virtual chunks
KIND_COLOURS = {
    "F": ("#3b6fb6", "#6f9bd6", "#a3c2e8"),
    "B": ("#2e9e4f", "#62c07d", "#9bdbab"),
    "W": ("#e07b16", "#f0a352", "#f7c892"),
}
BUBBLE_COLOUR = "#f6d5d5"
P2P_COLOUR = "#7a4fa0"
LANE_BG = "#fafafa"

MARGIN_LEFT_PX, MARGIN_RIGHT_PX = 64, 16
TITLE_PX, AXIS_PX, LEGEND_PX, NOTE_PX = 26, 30, 20, 16
DEFAULT_MAX_EVENTS = 2000
BIN_PX = 6  # bin width of dense lanes
MAX_CONNECTOR_EVENTS = 300  # above this, p2p is drawn inside the receiving lane instead of across lanes


class EventLike(Protocol):
    rank: int
    stage: int
    microbatch: int
    kind: str
    start_s: float
    end_s: float


class TimelineLike(Protocol):
    @property
    def events(self) -> Sequence[Any]: ...

    @property
    def makespan_s(self) -> float: ...


def plan_timeline(plan: Plan) -> TimelineLike:
    """Simulate ``plan``'s schedule with its predicted stage times and send rule (what scored the plan:
    ``ClusterSpec.sends_occupy_rank`` of its cluster record, which hand-made and older plans hold in part)."""
    from meshplan.cost_models.hardware import record_backend, sends_occupy
    from meshplan.partition.schedule import simulate

    stages = sorted(plan.stages, key=lambda s: s.index)
    want = plan.pp * plan.virtual_stages
    if len(stages) != want:
        raise ValueError(
            f"plan has {len(stages)} stages but pp={plan.pp} x virtual_stages={plan.virtual_stages} "
            f"needs {want}; the plan file is inconsistent, re-plan it"
        )
    return simulate(
        plan.schedule,
        plan.pp,
        plan.num_microbatches,
        virtual_stages=plan.virtual_stages,
        fwd_s=[s.fwd_s for s in stages],
        bwd_input_s=[max(0.0, s.bwd_s - s.bwd_weight_s) for s in stages],
        bwd_weight_s=[s.bwd_weight_s for s in stages],
        p2p_s=[s.send_s for s in stages],
        sends_occupy=sends_occupy(record_backend(plan.cluster)),
    )


@dataclass(frozen=True)
class LaneStats:
    rank: int
    busy_s: float
    idle_s: float  # bubble: makespan minus busy time


def lane_stats(tl: TimelineLike, num_ranks: int | None = None) -> list[LaneStats]:
    """Busy and idle seconds per pipeline rank over the makespan."""
    n = num_ranks if num_ranks is not None else 1 + max((e.rank for e in tl.events), default=0)
    busy = [0.0] * n
    for e in tl.events:
        busy[e.rank] += e.end_s - e.start_s
    return [LaneStats(r, b, max(0.0, tl.makespan_s - b)) for r, b in enumerate(busy)]


def _chunk_of(tl: TimelineLike) -> dict[int, int]:
    """stage -> its position among the stages of its rank (virtual chunk 0, 1, ...)."""
    per_rank: dict[int, set[int]] = {}
    for e in tl.events:
        per_rank.setdefault(e.rank, set()).add(e.stage)
    return {s: i for stages in per_rank.values() for i, s in enumerate(sorted(stages))}


def _nice_step(span: float, target_ticks: int = 8) -> float:
    raw = span / max(1, target_ticks)
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    for f in (1, 2, 2.5, 5, 10):
        if f * mag >= raw:
            return f * mag
    return 10 * mag


def lane_geometry(num_lanes: int) -> tuple[int, int]:
    """(lane height, gap) in pixels: lanes shrink as the pipeline deepens (bounded picture)."""
    lane_h = int(max(6, min(24, 480 // max(1, num_lanes))))
    return lane_h, max(1, lane_h // 5)


def timeline_height_px(num_lanes: int) -> int:
    """Height in pixels of the timeline picture for ``num_lanes`` pipeline ranks."""
    lane_h, gap = lane_geometry(num_lanes)
    return TITLE_PX + num_lanes * (lane_h + gap) + AXIS_PX + LEGEND_PX + NOTE_PX


def layout_timeline(
    tl: TimelineLike,
    *,
    width_px: int = 1200,
    title: str = "",
    num_ranks: int | None = None,
    max_events: int = DEFAULT_MAX_EVENTS,
) -> Drawing:
    """Lay ``tl`` out as a Drawing ``width_px`` wide, ``timeline_height_px(ranks)`` high."""
    if width_px < 200:
        raise ValueError(f"timeline width must be at least 200 px, got {width_px}")
    if tl.makespan_s <= 0 or not tl.events:
        raise ValueError("timeline is empty (makespan 0): the plan has no stage times to draw")
    lanes = num_ranks if num_ranks is not None else 1 + max(e.rank for e in tl.events)
    lane_h, gap = lane_geometry(lanes)
    d = Drawing(width_px, timeline_height_px(lanes))
    plot_w = width_px - MARGIN_LEFT_PX - MARGIN_RIGHT_PX
    px_per_s = plot_w / tl.makespan_s

    def x_of(t: float) -> float:
        return MARGIN_LEFT_PX + t * px_per_s

    def y_of(rank: int) -> float:
        return TITLE_PX + rank * (lane_h + gap)

    if title:
        d.text(MARGIN_LEFT_PX, 16, title, 11, bold=True)
    chunk = _chunk_of(tl)
    aggregated = len(tl.events) > max_events
    label_every = max(1, math.ceil(11 / (lane_h + gap)))
    by_rank: dict[int, list[Any]] = {}
    for e in tl.events:
        by_rank.setdefault(e.rank, []).append(e)
    for r in range(lanes):
        y = y_of(r)
        d.rect(MARGIN_LEFT_PX, y, plot_w, lane_h, BUBBLE_COLOUR, title=f"rank {r} idle (bubble)")
        if r % label_every == 0:
            d.text(MARGIN_LEFT_PX - 6, y + lane_h / 2 + 4, f"rank {r}", 10, anchor="end")
        evs = sorted(by_rank.get(r, []), key=lambda e: e.start_s)
        if aggregated:
            _draw_lane_binned(d, evs, y, lane_h, plot_w, px_per_s)
            continue
        for e in evs:
            x0, x1 = x_of(e.start_s), x_of(e.end_s)
            fill = KIND_COLOURS.get(e.kind, ("#888888",))[min(chunk.get(e.stage, 0), 2)]
            w = x1 - x0 - 1 if x1 - x0 > 4 else max(x1 - x0, 0.5)  # a 1 px gap separates neighbours
            d.rect(x0, y, w, lane_h, fill,
                   title=f"{e.kind} mb {e.microbatch} stage {e.stage}: {e.start_s * 1e3:.3f}-{e.end_s * 1e3:.3f} ms")
            label = str(e.microbatch)
            if lane_h >= 10 and x1 - x0 >= text_width_px(label, 9) + 3:
                d.text((x0 + x1) / 2, y + lane_h / 2 + 3.5, label, 9, fill="#ffffff", anchor="middle")
    if not aggregated:
        _draw_p2p(d, tl, x_of, y_of, lane_h, connectors=len(tl.events) <= MAX_CONNECTOR_EVENTS)
    # time axis in ms
    axis_y = y_of(lanes) + 2
    d.line(MARGIN_LEFT_PX, axis_y, MARGIN_LEFT_PX + plot_w, axis_y, "#333333")
    span_ms = tl.makespan_s * 1e3
    step = _nice_step(span_ms)
    t, k = 0.0, 0
    while t <= span_ms * 1.0001:
        x = x_of(t / 1e3)
        d.line(x, axis_y, x, axis_y + 4, "#333333")
        d.text(x, axis_y + 15, f"{t:g}", 9, anchor="middle", fill="#333333")
        k += 1
        t = round(k * step, 10)
    xe = x_of(tl.makespan_s)
    d.line(xe, TITLE_PX - 2, xe, axis_y + 4, "#c0392b")
    d.text(MARGIN_LEFT_PX - 16, axis_y + 15, "ms", 9, anchor="end", fill="#333333")
    # legend
    ly = axis_y + AXIS_PX - 6
    x = float(MARGIN_LEFT_PX)
    kinds_present = [k for k in KINDS if any(e.kind == k for e in tl.events)]
    for kd in kinds_present:
        d.rect(x, ly - 8, 10, 10, KIND_COLOURS[kd][0])
        d.text(x + 14, ly + 1, f"{kd} {KIND_NAMES[kd]}", 10)
        x += 14 + text_width_px(f"{kd} {KIND_NAMES[kd]}", 10) + 16
    d.rect(x, ly - 8, 10, 10, BUBBLE_COLOUR, stroke="#c9a0a0")
    d.text(x + 14, ly + 1, "idle (bubble)", 10)
    x += 14 + text_width_px("idle (bubble)", 10) + 16
    if not aggregated:
        d.line(x, ly - 3, x + 12, ly - 3, P2P_COLOUR, 2)
        d.text(x + 16, ly + 1, "p2p send", 10)
    stats = lane_stats(tl, lanes)
    idle = sum(s.idle_s for s in stats) / max(1e-30, lanes * tl.makespan_s)
    note = f"predicted makespan {span_ms:.3f} ms, idle share {idle:.1%}; {len(tl.events)} events"
    if aggregated:
        note += f" (> {max_events}: drawn as F/B/W share per {BIN_PX} px, no labels or p2p)"
    d.text(MARGIN_LEFT_PX, ly + NOTE_PX + 2, note, 10, fill="#444444")
    d.caption = f"Pipeline schedule timeline, {lanes} ranks. {note}"
    return d


def _draw_lane_binned(d: Drawing, evs: list[Any], y: float, lane_h: int, plot_w: int, px_per_s: float) -> None:
    """Dense lanes: per ``BIN_PX``-wide bin, a stacked bar of the F / B / W share of the bin's time.

    Shares are rounded to quarters and equal neighbouring bins merge, so a steady 1F1B phase is a
    few rectangles whatever m is; idle time stays the pale lane background.
    """
    bins = -(-plot_w // BIN_PX)
    cover = [[0.0] * len(KINDS) for _ in range(bins)]
    kind_idx = {k: i for i, k in enumerate(KINDS)}
    for e in evs:
        a, b, k = e.start_s * px_per_s / BIN_PX, e.end_s * px_per_s / BIN_PX, kind_idx.get(e.kind, 0)
        for c in range(max(0, int(a)), min(bins, int(math.ceil(b)))):
            part = min(b, c + 1) - max(a, c)
            if part > 0:
                cover[c][k] += part
    runs: list[tuple[int, int, tuple[int, ...]]] = []  # (first bin, last bin + 1, quarters per kind)
    for c in range(bins):
        q = _quarters(cover[c])
        if runs and runs[-1][2] == q and runs[-1][1] == c:
            runs[-1] = (runs[-1][0], c + 1, q)
        else:
            runs.append((c, c + 1, q))
    for c0, c1, q in runs:
        x0 = MARGIN_LEFT_PX + c0 * BIN_PX
        w = min(c1 * BIN_PX, plot_w) - c0 * BIN_PX
        bottom = y + lane_h
        for k, quarters in enumerate(q):
            h = lane_h * min(quarters, 4) / 4
            if h > 0 and bottom > y:
                h = min(h, bottom - y)
                d.rect(x0, bottom - h, w, h, KIND_COLOURS[KINDS[k]][0])
                bottom -= h


def _quarters(shares: list[float]) -> tuple[int, ...]:
    """Shares rounded to quarters by largest remainder, so the rounded total matches the busy share."""
    total = min(4, round(sum(shares) * 4))
    q = [int(v * 4) for v in shares]
    rest = sorted(range(len(shares)), key=lambda i: shares[i] * 4 - q[i], reverse=True)
    for i in rest[: max(0, total - sum(q))]:
        q[i] += 1
    return tuple(q)


def _draw_p2p(d: Drawing, tl: TimelineLike, x_of: Any, y_of: Any, lane_h: int, *, connectors: bool) -> None:
    """p2p of each F to the next stage's F (same microbatch) and each B to the previous stage's B.

    ``connectors``: a line from the producer's end to the consumer's start across the lanes;
    otherwise (busy pictures) a 2 px bar on top of the consumer's lane over the same interval.
    """
    index = {(e.stage, e.microbatch, e.kind): e for e in tl.events}
    for e in tl.events:
        if e.kind == "F":
            nxt = index.get((e.stage + 1, e.microbatch, "F"))
        elif e.kind == "B":
            nxt = index.get((e.stage - 1, e.microbatch, "B"))
        else:
            continue
        if nxt is None or nxt.rank == e.rank:
            continue
        if not connectors:
            x0, x1 = x_of(e.end_s), x_of(max(nxt.start_s, e.end_s))
            if x1 - x0 >= 1:
                d.rect(x0, y_of(nxt.rank), x1 - x0, 2, P2P_COLOUR)
            continue
        down = nxt.rank > e.rank
        y0 = y_of(e.rank) + (lane_h if down else 0)
        y1 = y_of(nxt.rank) + (0 if down else lane_h)
        d.line(x_of(e.end_s), y0, x_of(max(nxt.start_s, e.end_s)), y1, P2P_COLOUR, 1)


# ---- terminal form -------------------------------------------------------------------------


def format_text_timeline(plan_or_timeline: Plan | TimelineLike, width: int = 100, *, max_ranks: int = 32) -> str:
    """A character timeline: one row per pipeline rank, ``.`` for idle time.

    Each event fills its columns with its kind letter and microbatch number (``F3--`` is the
    forward of microbatch 3; ``B`` input grad, ``W`` weight grad; lower case for a rank's later
    virtual chunks) when it is wide enough, else with its kind letter alone. Meant for small plans (pp x m up to a few hundred events);
    ranks beyond ``max_ranks`` are left out, and the last line says so.
    """
    if width < 20:
        raise ValueError(f"text timeline width must be at least 20 columns, got {width}")
    tl = plan_timeline(plan_or_timeline) if hasattr(plan_or_timeline, "stages") else plan_or_timeline
    if tl.makespan_s <= 0 or not tl.events:
        raise ValueError("timeline is empty (makespan 0): nothing to draw")
    ranks = 1 + max(e.rank for e in tl.events)
    dt = tl.makespan_s / width
    rows = [["."] * width for _ in range(min(ranks, max_ranks))]
    squeezed = False
    chunk = _chunk_of(tl)
    for e in sorted(tl.events, key=lambda e: e.start_s):
        if e.rank >= max_ranks:
            continue
        row = rows[e.rank]
        a = min(width - 1, int(round(e.start_s / dt)))
        b = max(a + 1, min(width, int(round(e.end_s / dt))))
        kind = e.kind if chunk.get(e.stage, 0) == 0 else e.kind.lower()
        label = f"{kind}{e.microbatch}"
        if b - a >= len(label):
            cells = label + "-" * (b - a - len(label))
        else:
            cells = kind * (b - a)
            squeezed = True
        row[a:b] = list(cells)
    name_w = len(f"rank {len(rows) - 1}")
    ms = tl.makespan_s * 1e3
    lines = [f"{'':>{name_w}} |0 ms{f'{ms:.3f} ms|':>{width - 3}}"]
    lines += [f"{f'rank {r}':>{name_w}} |{''.join(row)}|" for r, row in enumerate(rows)]
    legend = ["F forward, B backward (input grad), W backward (weight grad), . idle (bubble)"]
    if any(c > 0 for c in chunk.values()):
        legend.append("lower case: a later virtual stage (chunk) of the rank")
    if squeezed:
        legend.append("short events show their kind letter only")
    lines += [f"{'':>{name_w}}  {text}" for text in legend]
    if ranks > max_ranks:
        lines.append(f"{'':>{name_w}}  ({ranks - max_ranks} more ranks not shown)")
    return "\n".join(lines)
