"""Vector drawing primitives shared by the SVG and PNG renderers, and the SVG serializer.

A picture (the pipeline timeline, the device mesh, memory bars) is laid out once as a
:class:`Drawing`: a list of filled rectangles, straight lines and one-line ASCII text in pixel
coordinates (origin top-left). :func:`to_svg` writes it as an inline ``<svg>`` element for the HTML
report; :mod:`meshplan.report.png` rasterizes the same Drawing, so the two pictures agree.

Colours are ``#rrggbb`` strings. Text is drawn in a monospace face whose advance is
``0.6 * size`` pixels per character (the PNG font has the same advance), which is what layout
code uses to decide whether a label fits. No torch import; no external references in the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape

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
    title: str = ""  # hover text in SVG (a <title> child); ignored by the PNG rasterizer


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
