"""The pure-Python PNG rasterizer: real PNG files of the documented size, decoded back here."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest
from report_fixtures import make_plan

from meshplan.report.png import (
    ADVANCE,
    FONT,
    Canvas,
    encode_png,
    rasterize,
    write_overview_png,
    write_png,
    write_timeline_png,
)
from meshplan.report.svg import Drawing
from meshplan.report.timeline import timeline_height_px


def decode_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """Minimal PNG reader for what encode_png writes (8-bit RGB, any filter type 0..4)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    pos, idat, width = 8, b"", 0
    height = 0
    kinds = []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, f"bad CRC in {kind!r}"
        kinds.append(kind)
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert (depth, colour, interlace) == (8, 2, 0)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND"
    raw = zlib.decompress(idat)
    stride = 3 * width
    assert len(raw) == height * (stride + 1)
    rows, prev = [], bytes(stride)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride if f else 0):  # filter 0 (what encode_png writes) needs no work
            a = line[i - 3] if i >= 3 else 0
            b, c = prev[i], (prev[i - 3] if i >= 3 else 0)
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = bytes(line)
    return width, height, rows


def pixel(rows: list[bytes], x: int, y: int) -> tuple[int, int, int]:
    return tuple(rows[y][3 * x : 3 * x + 3])  # type: ignore[return-value]


@pytest.mark.parametrize(
    "kw",
    [dict(dp=8), dict(dp=2, tp=4, pp=4, m=8), dict(tp=2, pp=4, v=2, m=8, schedule="interleaved-1f1b"),
     dict(pp=4, m=8, schedule="zero-bubble"), dict(pp=16, m=64, layers=32)],
    ids=["dp-only", "tp-x-pp", "interleaved", "zero-bubble", "pp16-m64"],
)
def test_timeline_png_is_a_real_image_of_the_documented_size(kw: dict, tmp_path: Path) -> None:
    plan = make_plan(**kw)
    path = write_timeline_png(plan, tmp_path / "timeline.png", width=900)
    w, h, rows = decode_png(path.read_bytes())
    assert (w, h) == (900, timeline_height_px(plan.pp))
    colours = {rows[y][3 * x : 3 * x + 3] for y in range(0, h, 3) for x in range(0, w, 3)}
    assert len(colours) >= 4  # background, boxes of at least two kinds, bubbles, text
    # the forward colour of stage 0 appears (the first box starts at the plot's left edge)
    from meshplan.report.timeline import KIND_COLOURS, MARGIN_LEFT_PX, TITLE_PX

    assert pixel(rows, MARGIN_LEFT_PX + 1, TITLE_PX + 3) == tuple(bytes.fromhex(KIND_COLOURS["F"][0][1:]))


def test_default_width_is_1200(tmp_path: Path) -> None:
    path = write_timeline_png(make_plan(pp=2, m=4), tmp_path / "t.png")
    w, h, _ = decode_png(path.read_bytes())
    assert (w, h) == (1200, timeline_height_px(2))


def test_rectangles_lines_and_text_land_on_the_right_pixels() -> None:
    d = Drawing(40, 20, background="#ffffff")
    d.rect(2, 3, 5, 4, "#ff0000")
    d.rect(10, 2, 6, 6, "none", stroke="#0000ff")
    d.line(0, 19, 39, 19, "#00ff00")
    d.line(20, 0, 39, 19, "#000000")  # diagonal: Bresenham
    d.text(20, 16, "A", 10)
    w, h, rows = decode_png(encode_png(rasterize(d)))
    assert (w, h) == (40, 20)
    assert pixel(rows, 2, 3) == (255, 0, 0) and pixel(rows, 6, 6) == (255, 0, 0)
    assert pixel(rows, 7, 3) == (255, 255, 255) and pixel(rows, 2, 7) == (255, 255, 255)
    assert pixel(rows, 10, 2) == (0, 0, 255) and pixel(rows, 15, 7) == (0, 0, 255)
    assert pixel(rows, 12, 4) == (255, 255, 255)  # fill "none" leaves the inside alone
    assert pixel(rows, 0, 19) == (0, 255, 0) and pixel(rows, 39, 19) == (0, 0, 0)
    assert all(pixel(rows, 20 + k, k) == (0, 0, 0) for k in range(0, 19, 3))
    # "A" at baseline 16, scale 1: its top row is ".###." -> columns 21..23 of row 9
    assert [pixel(rows, x, 9) == (0, 0, 0) for x in range(20, 25)] == [False, True, True, True, False]


def test_font_covers_printable_ascii() -> None:
    assert set(FONT) == {chr(c) for c in range(32, 127)}
    assert all(len(g) == 7 for g in FONT.values())
    assert FONT[" "] == ((),) * 7 and FONT["I"][0] == (1, 2, 3)
    cv = Canvas(6 * ADVANCE, 10)
    cv.text(0, 8, "é€", b"\x00\x00\x00")  # non-ASCII draws as "?"
    assert cv.rows[1][3 * 1 : 3 * 4] == b"\x00" * 9


def test_clipping_and_bad_input(tmp_path: Path) -> None:
    d = Drawing(10, 10)
    d.rect(-5, -5, 100, 8, "#123456")
    d.line(-3, 5, 30, 5, "#654321")
    d.text(8, 9, "clipped text", 10)
    w, h, rows = decode_png(write_png(d, tmp_path / "c.png").read_bytes())
    assert pixel(rows, 0, 0) == (0x12, 0x34, 0x56) and pixel(rows, 9, 5) == (0x65, 0x43, 0x21)
    with pytest.raises(ValueError, match="colour"):
        rasterize(Drawing(4, 4, items=[], background="red"))
    with pytest.raises(ValueError, match="positive"):
        Canvas(0, 5)
    with pytest.raises(ValueError, match="at least 200"):
        write_timeline_png(make_plan(pp=2, m=4), tmp_path / "x.png", width=100)


def test_overview_png_stacks_the_report_figures(tmp_path: Path) -> None:
    from meshplan.report.svg import block_tp_drawing, memory_drawing, mesh_drawing

    plan = make_plan(dp=2, tp=4, pp=4, m=8, schedule="zbv", v=2)
    w, h, rows = decode_png(write_overview_png(plan, tmp_path / "o.png", width=1000).read_bytes())
    parts = [mesh_drawing(plan, 1000).height, timeline_height_px(4), memory_drawing(plan, 1000).height,
             block_tp_drawing(plan, 1000).height]
    assert w == 1000 and h == sum(parts) + 4 * 12 + 3 * 24  # figures, gaps, three title lines
    assert len({rows[y][3 * x : 3 * x + 3] for y in range(0, h, 4) for x in range(0, w, 4)}) > 10
