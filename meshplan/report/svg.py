"""Vector drawing primitives for the inline SVG pictures of the HTML report, and the SVG serializer.

A picture (the pipeline timeline, the device mesh, memory bars) is laid out once as a
:class:`Drawing`: a list of filled rectangles, straight lines and one-line ASCII text in pixel
coordinates (origin top-left). :func:`to_svg` writes it as an inline ``<svg>`` element for the HTML
report; the PNG pictures are drawn with matplotlib from the same data (:mod:`meshplan.report.plot`).

Colours are ``#rrggbb`` strings. Text is drawn in a monospace face whose advance is
``0.6 * size`` pixels per character, which is what layout
code uses to decide whether a label fits. No torch import; no external references in the output.

Also the plan pictures other than the timeline: :func:`mesh_drawing` (devices by node, coloured
by pipeline stage, TP groups outlined), :func:`memory_drawing` (peak memory per pipeline rank
against the device limit) and :func:`block_tp_drawing` (TP style of each linear, one block of
each repeated type shown with its count).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape
from typing import TYPE_CHECKING

from meshplan.plan import MeshSpec

if TYPE_CHECKING:
    from meshplan.plan import Plan

CHAR_ADVANCE = 0.6  # character advance as a fraction of the font size (monospace)


@dataclass(frozen=True)
class Rect:
    x: float
    y: float
    w: float
    h: float
    fill: str
    stroke: str | None = None
    stroke_w: float = 1.0
    title: str = ""  # hover text in SVG (a <title> child)


@dataclass(frozen=True)
class Line:
    x1: float
    y1: float
    x2: float
    y2: float
    stroke: str = "#000000"
    width: float = 1.0


@dataclass(frozen=True)
class Text:
    x: float
    y: float  # baseline
    text: str
    size: float = 10.0
    fill: str = "#000000"
    anchor: str = "start"  # start | middle | end
    bold: bool = False


@dataclass
class Drawing:
    width: int
    height: int
    items: list[Rect | Line | Text] = field(default_factory=list)
    background: str = "#ffffff"
    caption: str = ""  # accessible description (SVG <desc>)

    def rect(self, x: float, y: float, w: float, h: float, fill: str, **kw: object) -> None:
        self.items.append(Rect(x, y, w, h, fill, **kw))  # type: ignore[arg-type]

    def line(self, x1: float, y1: float, x2: float, y2: float, stroke: str = "#000000", width: float = 1.0) -> None:
        self.items.append(Line(x1, y1, x2, y2, stroke, width))

    def text(self, x: float, y: float, text: str, size: float = 10.0, **kw: object) -> None:
        self.items.append(Text(x, y, text, size, **kw))  # type: ignore[arg-type]

    def counts(self) -> dict[str, int]:
        out = {"rect": 0, "line": 0, "text": 0}
        for it in self.items:
            out[type(it).__name__.lower()] += 1
        return out


def text_width_px(text: str, size: float = 10.0) -> float:
    """Width of ``text`` in pixels in the monospace face at ``size``."""
    return len(text) * size * CHAR_ADVANCE


def _n(v: float) -> str:
    """A compact number for SVG attributes (2 decimals at most)."""
    s = f"{v:.2f}".rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


def to_svg(d: Drawing, *, css_class: str = "", scale_to_width: bool = True, standalone: bool = False) -> str:
    """Serialize ``d`` as an ``<svg>`` element (no scripts, fonts or external references).

    Inline in HTML5 an ``<svg>`` needs no namespace, so none is written (the HTML report then holds
    no URL at all); ``standalone=True`` adds the SVG namespace that a separate ``.svg`` file needs.
    """
    ns = ' xmlns="http://www.w3.org/2000/svg"' if standalone else ""
    cls = f' class="{escape(css_class)}"' if css_class else ""
    style = ' style="max-width:100%;height:auto"' if scale_to_width else ""
    out = [
        f'<svg{ns} width="{d.width}" height="{d.height}" '
        f'viewBox="0 0 {d.width} {d.height}"{cls}{style} role="img" '
        'font-family="DejaVu Sans Mono,Menlo,Consolas,monospace">'
    ]
    if d.caption:
        out.append(f"<desc>{escape(d.caption)}</desc>")
    out.append(f'<rect x="0" y="0" width="{d.width}" height="{d.height}" fill="{d.background}"/>')
    for it in d.items:
        if isinstance(it, Rect):
            stroke = f' stroke="{it.stroke}" stroke-width="{_n(it.stroke_w)}"' if it.stroke else ""
            attrs = f'x="{_n(it.x)}" y="{_n(it.y)}" width="{_n(max(it.w, 0.0))}" height="{_n(max(it.h, 0.0))}" fill="{it.fill}"{stroke}'
            if it.title:
                out.append(f"<rect {attrs}><title>{escape(it.title)}</title></rect>")
            else:
                out.append(f"<rect {attrs}/>")
        elif isinstance(it, Line):
            out.append(
                f'<line x1="{_n(it.x1)}" y1="{_n(it.y1)}" x2="{_n(it.x2)}" y2="{_n(it.y2)}" '
                f'stroke="{it.stroke}" stroke-width="{_n(it.width)}"/>'
            )
        else:
            anchor = f' text-anchor="{it.anchor}"' if it.anchor != "start" else ""
            weight = ' font-weight="bold"' if it.bold else ""
            out.append(
                f'<text x="{_n(it.x)}" y="{_n(it.y)}" font-size="{_n(it.size)}" fill="{it.fill}"{anchor}{weight}>'
                f"{escape(it.text)}</text>"
            )
    out.append("</svg>")
    return "\n".join(out)


# ---- plan pictures: device mesh, memory bars, TP styles per block ------------------------------

STAGE_FILLS = ("#cfe0f5", "#d4efd6", "#fde2c4", "#e6d7f2", "#f8d3dc", "#d2f0ee",
               "#f3ecc2", "#dedede", "#c9d9ec", "#e9d6c5", "#d9ecc9", "#f0cfe8")
STYLE_FILLS = {"colwise": "#3b6fb6", "rowwise": "#2e9e4f", "replicate": "#9a9a9a"}
MAX_MESH_NODES = 32


def rank_coords(mesh: MeshSpec, rank: int) -> dict[str, int]:
    """Mesh coordinate of ``rank`` per axis; the innermost (last) axis varies fastest."""
    out: dict[str, int] = {}
    for name, deg in zip(reversed(mesh.axis_names), reversed(mesh.degrees)):
        out[name] = rank % deg
        rank //= deg
    return {name: out[name] for name in mesh.axis_names}  # outermost first, like the mesh


def mesh_drawing(plan: Plan, width_px: int = 960) -> Drawing:
    """Devices as a grid, one row per node: fill = pipeline stage, outline = one TP group, label = rank, dp, tp.

    Ranks are laid out by the mesh axis order (innermost axis = consecutive ranks). With more than
    32 nodes, 32 evenly spaced nodes are drawn and the caption says so.
    """
    mesh = plan.mesh
    per_node = max(1, int(plan.cluster.get("devices_per_node", 8)))
    per_node = min(per_node, plan.world_size)
    nodes = -(-plan.world_size // per_node)
    shown = list(range(nodes))
    if nodes > MAX_MESH_NODES:
        shown = sorted({round(i * (nodes - 1) / (MAX_MESH_NODES - 1)) for i in range(MAX_MESH_NODES)})
    left, top = 70, 8
    cell_w = max(14.0, min(96.0, (width_px - left - 10) / per_node))
    cell_h = 34.0 if cell_w >= 40 else 18.0
    d = Drawing(width_px, int(top + len(shown) * (cell_h + 6) + 44))
    tp_axis = "tp" in mesh.axis_names and mesh.tp > 1
    for row, node in enumerate(shown):
        y = top + row * (cell_h + 6)
        d.text(left - 8, y + cell_h / 2 + 4, f"node {node}", 10, anchor="end")
        run_start, run_key = 0, None
        for col in range(per_node + 1):
            rank = node * per_node + col
            key = None
            if col < per_node and rank < plan.world_size:
                c = rank_coords(mesh, rank)
                key = tuple(v for k, v in c.items() if k != "tp")
                x = left + col * cell_w
                stage = c.get("pp", 0)
                d.rect(x + 1, y, cell_w - 2, cell_h, STAGE_FILLS[stage % len(STAGE_FILLS)],
                       title=f"rank {rank}: " + ", ".join(f"{k}={v}" for k, v in c.items()))
                if cell_w >= 40:
                    d.text(x + cell_w / 2, y + 13, f"r{rank}", 10, anchor="middle")
                    d.text(x + cell_w / 2, y + 27, f"d{c.get('dp', 0)} t{c.get('tp', 0)}", 9,
                           anchor="middle", fill="#444444")
            if tp_axis and key != run_key:
                if run_key is not None:
                    d.rect(left + run_start * cell_w, y - 1, (col - run_start) * cell_w, cell_h + 2, "none",
                           stroke="#222222", stroke_w=2)
                run_start, run_key = col, key
    y = top + len(shown) * (cell_h + 6) + 8
    x = float(left)
    for s in range(min(plan.pp, len(STAGE_FILLS))):
        d.rect(x, y, 12, 12, STAGE_FILLS[s], stroke="#999999")
        d.text(x + 16, y + 10, f"stage rank {s}", 10)
        x += 16 + text_width_px(f"stage rank {s}", 10) + 12
        if x > width_px - 120:
            break
    note = (f"{plan.world_size} devices, {per_node} per node, mesh "
            + " x ".join(f"{n}={g}" for n, g in zip(mesh.axis_names, mesh.degrees))
            + " (outermost first; innermost = consecutive ranks)")
    if tp_axis:
        note += "; black outline = one TP group"
    if len(shown) < nodes:
        note += f"; {len(shown)} of {nodes} nodes shown (evenly spaced)"
    d.text(left, y + 30, note, 10, fill="#444444")
    d.caption = "Device mesh. " + note
    return d


def memory_drawing(plan: Plan, width_px: int = 960) -> Drawing:
    """One bar per pipeline rank: predicted peak memory against the device memory (cluster mem_bytes)."""
    peaks = list(plan.predicted.peak_mem_bytes) or [0]
    limit = int(plan.cluster.get("mem_bytes", 0)) or max(peaks) or 1
    usable = limit - int(plan.cluster.get("mem_reserved_bytes", 0))
    gib = 2**30
    left, right, bar_h, gap = 70, 170, 14, 4
    scale = (width_px - left - right) / max(limit, max(peaks))
    d = Drawing(width_px, 16 + len(peaks) * (bar_h + gap) + 24)
    top = 8
    for r, peak in enumerate(peaks):
        y = top + r * (bar_h + gap)
        d.text(left - 8, y + 11, f"rank {r}", 10, anchor="end")
        d.rect(left, y, limit * scale, bar_h, "#eeeeee")
        fill = "#c0392b" if peak > usable else "#5b8fd0"
        d.rect(left, y, max(1.0, peak * scale), bar_h, fill, title=f"rank {r}: {peak / gib:.2f} GiB predicted")
        d.text(left + max(limit, max(peaks)) * scale + 6, y + 11,
               f"{peak / gib:.2f} / {limit / gib:.0f} GiB ({peak / limit:.0%})", 10)
    y_end = top + len(peaks) * (bar_h + gap)
    d.line(left + limit * scale, top - 2, left + limit * scale, y_end, "#222222", 2)
    if usable < limit:
        d.line(left + usable * scale, top - 2, left + usable * scale, y_end, "#c0392b", 1)
    d.text(left, y_end + 14, "predicted peak memory per pipeline rank; black line = device memory"
           + ("; red line = usable (minus reserved)" if usable < limit else ""), 10, fill="#444444")
    d.caption = "Predicted peak memory per pipeline rank against the device limit."
    return d


def block_tp_groups(tp_styles: dict[str, str]) -> list[tuple[str, int, list[tuple[str, str]]]]:
    """Group linears by repeated block: [(block pattern, instance count, [(linear suffix, style)])].

    ``blocks.3.attn.q_proj`` belongs to block ``blocks.*`` (count = distinct indices); a linear
    whose instances disagree gets the style ``"mixed"``. Linears outside blocks form one group ``""``.
    """
    from meshplan.report.diff import fqn_pattern

    blocks: dict[str, dict[str, set[str]]] = {}
    counts: dict[str, set[int]] = {}
    for fqn, style in tp_styles.items():
        pat, idx = fqn_pattern(fqn)
        if idx and "*" in pat:
            head, _, tail = pat.partition("*")
            key, suffix = head + "*", tail.lstrip(".")
            counts.setdefault(key, set()).add(idx[0])
        else:
            key, suffix = "", pat
        blocks.setdefault(key, {}).setdefault(suffix, set()).add(style)
    out = []
    for key in sorted(blocks, key=lambda k: (k == "", k)):
        linears = [(sfx, next(iter(st)) if len(st) == 1 else "mixed") for sfx, st in blocks[key].items()]
        out.append((key, len(counts.get(key, ())) or 1, linears))
    return out


def block_tp_drawing(plan: Plan, width_px: int = 960) -> Drawing:
    """Each linear of one block drawn as its weight split over tp: colwise = column strips, rowwise = row strips."""
    groups = block_tp_groups(plan.tp_styles)
    icon, pad, left = 36, 18, 10
    per_row = max(1, (width_px - left) // (icon * 3 + pad))
    height = sum(20 + -(-len(lin) // per_row) * (icon + 30) for _, _, lin in groups)
    d = Drawing(width_px, height + 30)
    y = 6.0
    tp = max(1, plan.tp)
    for key, count, linears in groups:
        title = f"{key} x {count} (one block shown)" if key else "outside repeated blocks"
        d.text(left, y + 12, title, 11, bold=True)
        y += 20
        for i, (name, style) in enumerate(linears):
            if i and i % per_row == 0:
                y += icon + 30
            x = left + (i % per_row) * (icon * 3 + pad)
            fill = STYLE_FILLS.get(style, "#c0392b")
            d.rect(x, y, icon, icon, "#ffffff", stroke="#555555", title=f"{name}: {style}")
            n = tp if style in ("colwise", "rowwise") else 1
            for k in range(n):
                shade = fill if k % 2 == 0 else "#ffffff"
                if style == "colwise":
                    d.rect(x + k * icon / n, y, icon / n, icon, shade, stroke=fill, stroke_w=0.5)
                elif style == "rowwise":
                    d.rect(x, y + k * icon / n, icon, icon / n, shade, stroke=fill, stroke_w=0.5)
                else:
                    d.rect(x, y, icon, icon, fill)
            label = name if len(name) <= 20 else "~" + name[-19:]
            d.text(x + icon + 4, y + 14, label, 10)
            d.text(x + icon + 4, y + 28, style, 10, fill=fill)
        y += icon + 30
    d.text(left, d.height - 8, f"weight split over tp={tp}: colwise = output columns sharded, rowwise = input rows "
           "sharded, replicate = full copy", 10, fill="#444444")
    d.caption = "Tensor-parallel style of each linear, per repeated block."
    return d
