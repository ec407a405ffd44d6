r"""A tiny pure-Python PNG rasterizer for report pictures: no imaging dependency.

:func:`rasterize` turns a :class:`meshplan.report.svg.Drawing` into RGB rows (one ``bytearray``
per row): filled rectangles by slice assignment, axis-aligned lines as thin rectangles, other
lines with Bresenham, text with the built-in 5x7 bitmap font below (printable ASCII; any other
character draws as ``?``), scaled by an integer factor from the font size. :func:`encode_png`
writes 8-bit truecolour PNG (filter 0 on every row, one zlib IDAT chunk, CRC-32 per chunk as the
PNG specification, RFC 2083, requires). :func:`write_timeline_png` draws a plan's pipeline
schedule: ``width`` pixels wide (default 1200), height from the number of pipeline ranks
(:func:`meshplan.report.timeline.timeline_height_px`); :func:`write_overview_png` stacks the
report's figures (mesh, timeline, memory, TP per block) into one image.

The font was drawn for this project: 5 columns x 7 rows per glyph, advance 6 px at scale 1.
No torch import.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

from meshplan.report.svg import CHAR_ADVANCE, Drawing, Line, Rect, Text

if TYPE_CHECKING:
    from meshplan.plan import Plan

_FONT_ART = r"""
  ..... ..... ..... ..... ..... ..... .....
! ..#.. ..#.. ..#.. ..#.. ..#.. ..... ..#..
" .#.#. .#.#. ..... ..... ..... ..... .....
# .#.#. .#.#. ##### .#.#. ##### .#.#. .#.#.
$ ..#.. .#### #.#.. .###. ..#.# ####. ..#..
% ##... ##..# ...#. ..#.. .#... #..## ...##
& .##.. #..#. #.#.. .#... #.#.# #..#. .##.#
' ..#.. ..#.. ..... ..... ..... ..... .....
( ...#. ..#.. .#... .#... .#... ..#.. ...#.
) .#... ..#.. ...#. ...#. ...#. ..#.. .#...
* ..... ..#.. #.#.# .###. #.#.# ..#.. .....
+ ..... ..#.. ..#.. ##### ..#.. ..#.. .....
, ..... ..... ..... ..... .##.. ..#.. .#...
- ..... ..... ..... ##### ..... ..... .....
. ..... ..... ..... ..... ..... .##.. .##..
/ ..... ....# ...#. ..#.. .#... #.... .....
0 .###. #...# #..## #.#.# ##..# #...# .###.
1 ..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.
2 .###. #...# ....# ...#. ..#.. .#... #####
3 ##### ...#. ..#.. ...#. ....# #...# .###.
4 ...#. ..##. .#.#. #..#. ##### ...#. ...#.
5 ##### #.... ####. ....# ....# #...# .###.
6 ..##. .#... #.... ####. #...# #...# .###.
7 ##### ....# ...#. ..#.. .#... .#... .#...
8 .###. #...# #...# .###. #...# #...# .###.
9 .###. #...# #...# .#### ....# ...#. .##..
: ..... .##.. .##.. ..... .##.. .##.. .....
; ..... .##.. .##.. ..... .##.. ..#.. .#...
< ...#. ..#.. .#... #.... .#... ..#.. ...#.
= ..... ..... ##### ..... ##### ..... .....
> .#... ..#.. ...#. ....# ...#. ..#.. .#...
? .###. #...# ....# ...#. ..#.. ..... ..#..
@ .###. #...# ....# .##.# #.#.# #.#.# .###.
A .###. #...# #...# ##### #...# #...# #...#
B ####. #...# #...# ####. #...# #...# ####.
C .###. #...# #.... #.... #.... #...# .###.
D ###.. #..#. #...# #...# #...# #..#. ###..
E ##### #.... #.... ####. #.... #.... #####
F ##### #.... #.... ####. #.... #.... #....
G .###. #...# #.... #.### #...# #...# .####
H #...# #...# #...# ##### #...# #...# #...#
I .###. ..#.. ..#.. ..#.. ..#.. ..#.. .###.
J ..### ...#. ...#. ...#. ...#. #..#. .##..
K #...# #..#. #.#.. ##... #.#.. #..#. #...#
L #.... #.... #.... #.... #.... #.... #####
M #...# ##.## #.#.# #.#.# #...# #...# #...#
N #...# #...# ##..# #.#.# #..## #...# #...#
O .###. #...# #...# #...# #...# #...# .###.
P ####. #...# #...# ####. #.... #.... #....
Q .###. #...# #...# #...# #.#.# #..#. .##.#
R ####. #...# #...# ####. #.#.. #..#. #...#
S .#### #.... #.... .###. ....# ....# ####.
T ##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#..
U #...# #...# #...# #...# #...# #...# .###.
V #...# #...# #...# #...# #...# .#.#. ..#..
W #...# #...# #...# #.#.# #.#.# #.#.# .#.#.
X #...# #...# .#.#. ..#.. .#.#. #...# #...#
Y #...# #...# .#.#. ..#.. ..#.. ..#.. ..#..
Z ##### ....# ...#. ..#.. .#... #.... #####
[ .###. .#... .#... .#... .#... .#... .###.
\ ..... #.... .#... ..#.. ...#. ....# .....
] .###. ...#. ...#. ...#. ...#. ...#. .###.
^ ..#.. .#.#. #...# ..... ..... ..... .....
_ ..... ..... ..... ..... ..... ..... #####
` .#... ..#.. ..... ..... ..... ..... .....
a ..... ..... .###. ....# .#### #...# .####
b #.... #.... #.##. ##..# #...# #...# ####.
c ..... ..... .###. #.... #.... #...# .###.
d ....# ....# .##.# #..## #...# #...# .####
e ..... ..... .###. #...# ##### #.... .###.
f ..##. .#..# .#... ###.. .#... .#... .#...
g ..... .#### #...# #...# .#### ....# .###.
h #.... #.... #.##. ##..# #...# #...# #...#
i ..#.. ..... .##.. ..#.. ..#.. ..#.. .###.
j ...#. ..... ..##. ...#. ...#. #..#. .##..
k #.... #.... #..#. #.#.. ##... #.#.. #..#.
l .##.. ..#.. ..#.. ..#.. ..#.. ..#.. .###.
m ..... ..... ##.#. #.#.# #.#.# #...# #...#
n ..... ..... #.##. ##..# #...# #...# #...#
o ..... ..... .###. #...# #...# #...# .###.
p ..... ..... ####. #...# ####. #.... #....
q ..... ..... .##.# #..## .#### ....# ....#
r ..... ..... #.##. ##..# #.... #.... #....
s ..... ..... .###. #.... .###. ....# ####.
t .#... .#... ###.. .#... .#... .#..# ..##.
u ..... ..... #...# #...# #...# #..## .##.#
v ..... ..... #...# #...# #...# .#.#. ..#..
w ..... ..... #...# #...# #.#.# #.#.# .#.#.
x ..... ..... #...# .#.#. ..#.. .#.#. #...#
y ..... ..... #...# #...# .#### ....# .###.
z ..... ..... ##### ...#. ..#.. .#... #####
{ ...#. ..#.. ..#.. .#... ..#.. ..#.. ...#.
| ..#.. ..#.. ..#.. ..#.. ..#.. ..#.. ..#..
} .#... ..#.. ..#.. ...#. ..#.. ..#.. .#...
~ ..... ..... .#... #.#.# ...#. ..... .....
"""

GLYPH_W, GLYPH_H, ADVANCE = 5, 7, 6


def _parse_font(art: str) -> dict[str, tuple[tuple[int, ...], ...]]:
    """char -> rows, each row the tuple of lit columns."""
    font: dict[str, tuple[tuple[int, ...], ...]] = {}
    for line in art.split("\n"):
        if len(line) < 3:
            continue
        rows = line[2:].split(" ")
        assert len(rows) == GLYPH_H and all(len(r) == GLYPH_W for r in rows), line
        font[line[0]] = tuple(tuple(i for i, c in enumerate(r) if c == "#") for r in rows)
    return font


FONT = _parse_font(_FONT_ART)


def _rgb(colour: str) -> bytes:
    c = colour.lstrip("#")
    if len(c) == 3:
        c = "".join(ch * 2 for ch in c)
    try:
        if len(c) != 6:
            raise ValueError
        return bytes.fromhex(c)
    except ValueError:
        raise ValueError(f"colour {colour!r}: use #rrggbb") from None


class Canvas:
    """RGB pixels as one bytearray per row, with clipped drawing operations."""

    def __init__(self, width: int, height: int, background: str = "#ffffff") -> None:
        if width < 1 or height < 1:
            raise ValueError(f"image size must be positive, got {width}x{height}")
        self.width, self.height = width, height
        row = _rgb(background) * width
        self.rows = [bytearray(row) for _ in range(height)]

    def fill_rect(self, x0: int, y0: int, x1: int, y1: int, colour: bytes) -> None:
        """Fill [x0, x1) x [y0, y1), clipped to the canvas."""
        x0, x1 = max(0, x0), min(self.width, x1)
        y0, y1 = max(0, y0), min(self.height, y1)
        if x1 <= x0 or y1 <= y0:
            return
        span = colour * (x1 - x0)
        for y in range(y0, y1):
            self.rows[y][3 * x0 : 3 * x1] = span

    def line(self, x0: int, y0: int, x1: int, y1: int, colour: bytes, width: int = 1) -> None:
        if x0 == x1 or y0 == y1:  # axis-aligned: a thin rectangle
            lo = width // 2
            self.fill_rect(min(x0, x1) - (lo if x0 == x1 else 0), min(y0, y1) - (lo if y0 == y1 else 0),
                           max(x0, x1) + (width - lo if x0 == x1 else 1), max(y0, y1) + (width - lo if y0 == y1 else 1),
                           colour)
            return
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            self.fill_rect(x0, y0, x0 + width, y0 + width, colour)
            if x0 == x1 and y0 == y1:
                break
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y_baseline: int, text: str, colour: bytes, scale: int = 1) -> None:
        top = y_baseline - GLYPH_H * scale
        for i, ch in enumerate(text):
            glyph = FONT.get(ch, FONT["?"])
            gx = x + i * ADVANCE * scale
            if gx >= self.width:
                break
            for r, cols in enumerate(glyph):
                for c in cols:
                    px, py = gx + c * scale, top + r * scale
                    self.fill_rect(px, py, px + scale, py + scale, colour)


def font_scale(size: float) -> int:
    """Integer scale of the 5x7 font that best matches an SVG font size (advance 0.6 * size)."""
    return max(1, round(size * CHAR_ADVANCE / ADVANCE))


def rasterize(d: Drawing) -> Canvas:
    """Draw every item of ``d`` onto a new canvas of its size."""
    cv = Canvas(d.width, d.height, d.background)
    colours: dict[str, bytes] = {}

    def col(c: str) -> bytes:
        if c not in colours:
            colours[c] = _rgb(c)
        return colours[c]

    for it in d.items:
        if isinstance(it, Rect):
            x0, y0 = round(it.x), round(it.y)
            x1, y1 = max(x0 + 1, round(it.x + it.w)), max(y0 + 1, round(it.y + it.h))
            if it.fill != "none":
                cv.fill_rect(x0, y0, x1, y1, col(it.fill))
            if it.stroke:
                s, w = col(it.stroke), max(1, round(it.stroke_w))
                cv.fill_rect(x0, y0, x1, y0 + w, s)
                cv.fill_rect(x0, y1 - w, x1, y1, s)
                cv.fill_rect(x0, y0, x0 + w, y1, s)
                cv.fill_rect(x1 - w, y0, x1, y1, s)
        elif isinstance(it, Line):
            cv.line(round(it.x1), round(it.y1), round(it.x2), round(it.y2), col(it.stroke), max(1, round(it.width)))
        elif isinstance(it, Text):
            scale = font_scale(it.size)
            w = len(it.text) * ADVANCE * scale
            x = it.x - (w / 2 if it.anchor == "middle" else w if it.anchor == "end" else 0)
            cv.text(round(x), round(it.y), it.text, col(it.fill), scale)
            if it.bold:  # a second pass one pixel to the right
                cv.text(round(x) + 1, round(it.y), it.text, col(it.fill), scale)
    return cv


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(cv: Canvas, *, level: int = 6) -> bytes:
    """8-bit RGB PNG bytes of ``cv``."""
    header = struct.pack(">IIBBBBB", cv.width, cv.height, 8, 2, 0, 0, 0)
    raw = b"".join(b"\x00" + bytes(r) for r in cv.rows)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, level))
            + _chunk(b"IEND", b""))


def write_png(d: Drawing, path: str | Path) -> Path:
    """Rasterize ``d`` and write it as a PNG file; returns the path."""
    p = Path(path)
    p.write_bytes(encode_png(rasterize(d)))
    return p


def write_timeline_png(plan: Plan, path: str | Path, width: int = 1200) -> Path:
    """Write the plan's simulated pipeline schedule as a PNG ``width`` pixels wide.

    The height is ``timeline_height_px(plan.pp)`` (lanes, axis and legend). Drawn from
    ``partition.schedule.simulate`` with the plan's stage times, like the HTML report.
    """
    from meshplan.report.timeline import layout_timeline, plan_timeline

    return write_png(layout_timeline(plan_timeline(plan), width_px=width, title=_title(plan)), path)


def write_overview_png(plan: Plan, path: str | Path, width: int = 1200) -> Path:
    """One picture of the report's figures: device mesh, pipeline timeline, memory bars, TP per block."""
    from meshplan.report.svg import block_tp_drawing, memory_drawing, mesh_drawing, stack_drawings
    from meshplan.report.timeline import layout_timeline, plan_timeline

    parts = [mesh_drawing(plan, width_px=width),
             layout_timeline(plan_timeline(plan), width_px=width, num_ranks=plan.pp, title=_title(plan)),
             memory_drawing(plan, width_px=width)]
    titles = [f"{plan.model_name}: {plan.summary()} on {plan.world_size} devices - device mesh",
              "", "Predicted peak memory per pipeline rank"]
    if plan.tp_styles:
        parts.append(block_tp_drawing(plan, width_px=width))
        titles.append("Tensor-parallel style per linear")
    return write_png(stack_drawings(parts, titles=titles), path)


def _title(plan: Plan) -> str:
    return f"{plan.model_name}: {plan.summary()} - predicted pipeline schedule"
