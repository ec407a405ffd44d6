"""PNG pictures drawn with matplotlib: image size as documented, and the pictured facts (ranks,
stages, microbatches, memory) present in the figure's artists, not checked pixel by pixel."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from report_fixtures import block_matplotlib, make_plan

pytest.importorskip("matplotlib")

from meshplan.errors import MissingExtraError  # noqa: E402
from meshplan.report import plot  # noqa: E402


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def texts(fig) -> list[str]:
    out = [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text"))]
    for ax in fig.axes:
        out += [t.get_text() for t in ax.get_yticklabels()] + [ax.get_title(loc="left")]
    return out


@pytest.mark.parametrize("kw", [dict(dp=2, tp=4, pp=4, m=8), dict(tp=2, pp=2, v=2, m=4, schedule="interleaved-1f1b")],
                         ids=["tp-x-pp", "interleaved"])
def test_timeline_png_size_and_facts(kw: dict, tmp_path: Path) -> None:
    plan = make_plan(**kw)
    fig = plot.timeline_figure(plan, width=900)
    words = texts(fig)
    assert all(f"rank {r}" in words for r in range(plan.pp)) and f"rank {plan.pp}" not in words
    title = fig.axes[0].get_title(loc="left")
    assert f"{plan.pp * plan.virtual_stages} stages" in title and f"{plan.num_microbatches} microbatches" in title
    labelled = {t.get_gid() for t in fig.axes[0].texts}
    # every microbatch of the last stage has its forward box labelled with its number
    last = plan.pp * plan.virtual_stages - 1
    assert {m for m in range(plan.num_microbatches) if any(g and g.split("-")[2:4] == [str(last), str(m)]
                                                             for g in labelled)} == set(range(plan.num_microbatches))
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "forward" in legend and "backward (input grad)" in legend
    path = plot.save_png(fig, tmp_path / "t.png")
    assert png_size(path) == (900, plot.timeline_height_px(plan.pp))


def test_overview_png_has_mesh_timeline_and_memory(tmp_path: Path) -> None:
    plan = make_plan(dp=2, tp=2, pp=2, m=4)
    fig = plot.overview_figure(plan, width=1000)
    words = " ".join(texts(fig))
    assert all(f"rank {r}\npp{r // 4}" in words for r in range(plan.world_size))  # mesh: every rank and its stage
    assert "predicted pipeline schedule" in words and "predicted peak memory per pipeline rank" in words
    assert "29.00 GiB" not in words and "23.00 GiB" in words  # memory bars of pp ranks 0 and 1 (20, 23 GiB)
    w, h = png_size(plot.save_png(fig, tmp_path / "o.png"))
    assert w == 1000 and h > plot.timeline_height_px(plan.pp)


def test_bad_width_and_missing_matplotlib(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(ValueError, match="at least 200"):
        plot.write_timeline_png(make_plan(pp=2, m=4), tmp_path / "x.png", width=100)
    block_matplotlib(monkeypatch)
    with pytest.raises(MissingExtraError, match=r"meshplan\[plot\]"):
        plot.timeline_figure(make_plan(pp=2, m=4))
