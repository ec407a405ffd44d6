"""PNG pictures of a Plan drawn with matplotlib (the optional extra ``meshplan[plot]``).

:func:`timeline_figure` is the predicted pipeline schedule (``report.timeline.plan_timeline``: the
simulation that scored the plan): one row per pipeline rank, F / B / W boxes per microbatch (later
virtual chunks lighter, the microbatch number inside boxes wide enough for it), idle time shaded,
time in ms. :func:`overview_figure` puts the device mesh (one cell per rank, coloured by pipeline
stage, labelled with its rank and dp/tp index), the timeline and the predicted peak memory per
pipeline rank against the device memory on one page. Each function returns a
``matplotlib.figure.Figure`` (no pyplot state), so a user can restyle it before
:func:`save_png`. Pictures are ``width`` pixels wide at 100 dpi; the height follows the content
(:func:`timeline_height_px`).

matplotlib is imported inside the functions: without it, :func:`require_matplotlib` raises
``MissingExtraError`` naming the extra to install; the HTML report needs nothing. No torch import.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshplan.errors import MissingExtraError
from meshplan.report.timeline import KIND_COLOURS, KIND_NAMES, KINDS, plan_timeline

if TYPE_CHECKING:
    from meshplan.plan import Plan

DPI = 100
MIN_WIDTH_PX = 200
GIB = 2**30
MAX_MESH_NODES = 16
STAGE_COLOURS = ("#5b8fd0", "#62c07d", "#f0a352", "#b07cc6", "#e06666", "#46b3b3", "#c9b23c", "#8c8c8c")


def require_matplotlib() -> Any:
    """The ``matplotlib.figure.Figure`` class, or ``MissingExtraError`` naming ``meshplan[plot]``."""
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError as e:
        raise MissingExtraError(
            "PNG pictures are drawn with matplotlib, which is not installed: "
            "pip install 'meshplan[plot]' (the HTML report needs no extra)"
        ) from e
    return Figure


def warm_up() -> None:
    """Import matplotlib and draw a small picture with what the real ones use (log axes, whose tick
    labels are mathtext, an annotation, a title) into memory: the imports, the font loading and
    mathtext's parser are then made, so a later picture in this process takes about a third of its
    cold time (``meshplan capacity`` calls it while a CPU is idle in its sweep). Does nothing
    without matplotlib; changes no picture."""
    import io

    try:
        Figure = require_matplotlib()
    except MissingExtraError:
        return
    fig = Figure(figsize=(2, 1.5), dpi=DPI)
    ax = fig.subplots()
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.plot([1, 1000], [1, 100], "o-")
    ax.annotate("1", (10, 10), fontsize=6.5)
    fig.suptitle("warm-up", fontsize=11)
    fig.savefig(io.BytesIO(), format="png", dpi=DPI)


def check_width(width: int) -> None:
    if width < MIN_WIDTH_PX:
        raise ValueError(f"PNG width must be at least {MIN_WIDTH_PX} pixels, got {width}")


def timeline_height_px(num_ranks: int) -> int:
    """Height of the timeline picture: 90 px of title, axis and legend plus 18 to 32 px per rank
    (lanes shrink as the pipeline deepens, at most 600 px of lanes)."""
    lane = max(18, min(32, 600 // max(1, num_ranks)))
    return 90 + lane * max(1, num_ranks)


def _draw_timeline(ax: Any, plan: Plan, *, label_min_px: float = 14.0, width_px: int = 1200) -> None:
    tl = plan_timeline(plan)
    pp = plan.pp
    on_rank: dict[int, set[int]] = {}
    for e in tl.events:
        on_rank.setdefault(e.rank, set()).add(e.stage)
    chunk = {s: i for stages in on_rank.values() for i, s in enumerate(sorted(stages))}
    span_ms = max(tl.makespan_s * 1e3, 1e-9)
    px_per_ms = 0.8 * width_px / span_ms
    busy = [0.0] * pp
    boxes: dict[tuple[str, int], list[tuple[int, tuple[float, float]]]] = {}
    for e in tl.events:
        start, dur = e.start_s * 1e3, (e.end_s - e.start_s) * 1e3
        busy[e.rank] += dur
        boxes.setdefault((e.kind, chunk[e.stage]), []).append((e.rank, (start, dur)))
        if dur * px_per_ms >= label_min_px:
            ax.text(start + dur / 2, e.rank, str(e.microbatch), ha="center", va="center", fontsize=7,
                    color="white", gid=f"mb-{e.rank}-{e.stage}-{e.microbatch}-{e.kind}")
    for r in range(pp):
        ax.broken_barh([(0, span_ms)], (r - 0.4, 0.8), facecolors="#f6d5d5", zorder=0)
    for kind in KINDS:
        for ch in range(plan.virtual_stages):
            items = boxes.get((kind, ch), [])
            colour = KIND_COLOURS[kind][min(ch, len(KIND_COLOURS[kind]) - 1)]
            for r in range(pp):
                spans = [s for rr, s in items if rr == r]
                if spans:
                    ax.broken_barh(spans, (r - 0.4, 0.8), facecolors=colour, edgecolors="white", linewidth=0.3,
                                   label=KIND_NAMES[kind] if ch == 0 and r == min(rr for rr, _ in items) else None)
    ax.set_ylim(pp - 0.5, -0.5)
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.set_xlim(0, span_ms)
    ax.set_xlabel("time (ms, predicted)")
    idle = sum(span_ms - b for b in busy) / (pp * span_ms)
    ax.set_title(f"{plan.model_name}: {plan.summary()} - predicted pipeline schedule, "
                 f"{plan.pp * plan.virtual_stages} stages, {plan.num_microbatches} microbatches, "
                 f"{idle:.0%} idle", fontsize=9, loc="left")
    ax.legend(loc="upper right", fontsize=7, ncols=3, framealpha=0.9)


def timeline_figure(plan: Plan, width: int = 1200) -> Any:
    """The plan's predicted pipeline schedule as a matplotlib Figure ``width`` px wide."""
    check_width(width)
    Figure = require_matplotlib()
    fig = Figure(figsize=(width / DPI, timeline_height_px(plan.pp) / DPI), dpi=DPI, layout="constrained")
    _draw_timeline(fig.add_subplot(), plan, width_px=width)
    return fig


def _draw_mesh(ax: Any, plan: Plan) -> None:
    from meshplan.report.svg import rank_coords

    cols, rows = _mesh_grid(plan)
    shown = min(plan.world_size, cols * rows)
    for rank in range(shown):
        c = rank_coords(plan.mesh, rank)
        y, x = divmod(rank, cols)
        pp_rank = c.get("pp", 0)
        ax.add_patch(_rect(x, y, STAGE_COLOURS[pp_rank % len(STAGE_COLOURS)]))
        extra = " ".join(f"{a}{c[a]}" for a in plan.mesh.axis_names if a != "pp" and plan.mesh.degree(a) > 1)
        ax.text(x + 0.5, y + 0.5, f"rank {rank}\npp{pp_rank} {extra}".strip(), ha="center", va="center", fontsize=7)
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    ax.set_yticks([r + 0.5 for r in range(rows)], [f"node {r}" for r in range(rows)])
    ax.set_xticks([])
    degrees = " x ".join(f"{a}={d}" for a, d in zip(plan.mesh.axis_names, plan.mesh.degrees))
    more = f"; first {shown} of {plan.world_size} ranks shown" if shown < plan.world_size else ""
    ax.set_title(f"device mesh ({degrees}); colour = pipeline rank{more}", fontsize=9, loc="left")


def _mesh_grid(plan: Plan) -> tuple[int, int]:
    """(columns, rows) of the mesh picture: one row per node, at most ``MAX_MESH_NODES`` rows."""
    cols = min(int(plan.cluster.get("devices_per_node", 0)) or 8, plan.world_size)
    return cols, min(MAX_MESH_NODES, -(-plan.world_size // cols))


def _rect(x: float, y: float, colour: str) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle((x + 0.04, y + 0.06), 0.92, 0.88, facecolor=colour, edgecolor="#333333", linewidth=0.5)


def _draw_memory(ax: Any, plan: Plan) -> None:
    peaks = [p / GIB for p in plan.predicted.peak_mem_bytes] or [0.0]
    limit = int(plan.cluster.get("mem_bytes", 0)) / GIB
    usable = limit - int(plan.cluster.get("mem_reserved_bytes", 0)) / GIB
    ranks = range(len(peaks))
    ax.barh(list(ranks), peaks, color=["#c0392b" if limit and p > usable else "#5b8fd0" for p in peaks],
            label="predicted peak")
    if limit:
        ax.axvline(limit, color="#222222", linewidth=1.5, label=f"device memory {limit:.0f} GiB")
        if usable < limit:
            ax.axvline(usable, color="#c0392b", linewidth=1, linestyle="--", label=f"usable {usable:.1f} GiB")
    for r, p in zip(ranks, peaks):
        ax.text(p, r, f" {p:.2f} GiB", va="center", fontsize=7)
    ax.set_yticks(list(ranks), [f"rank {r}" for r in ranks])
    ax.set_ylim(len(peaks) - 0.5, -0.5)
    ax.set_xlabel("GiB")
    ax.set_title("predicted peak memory per pipeline rank", fontsize=9, loc="left")
    ax.legend(loc="lower right", fontsize=7)


def overview_figure(plan: Plan, width: int = 1200) -> Any:
    """Device mesh, predicted pipeline timeline and predicted memory per pipeline rank, stacked."""
    check_width(width)
    Figure = require_matplotlib()
    heights = [50 + 40 * _mesh_grid(plan)[1], timeline_height_px(plan.pp), 70 + 24 * plan.pp]
    fig = Figure(figsize=(width / DPI, sum(heights) / DPI), dpi=DPI, layout="constrained")
    axes = fig.subplots(3, 1, height_ratios=heights)
    _draw_mesh(axes[0], plan)
    _draw_timeline(axes[1], plan, width_px=width)
    _draw_memory(axes[2], plan)
    return fig


def save_png(fig: Any, path: str | Path) -> Path:
    """Write ``fig`` as a PNG of exactly its pixel size (no tight cropping); returns the path."""
    p = Path(path)
    fig.savefig(p, format="png", dpi=DPI)
    return p


def write_timeline_png(plan: Plan, path: str | Path, width: int = 1200) -> Path:
    return save_png(timeline_figure(plan, width), path)


def write_overview_png(plan: Plan, path: str | Path, width: int = 1200) -> Path:
    return save_png(overview_figure(plan, width), path)
