"""HTML report, timeline layout and text timeline on hand-made plans (dp only, tp x pp, interleaved, zero-bubble)."""

from __future__ import annotations

import re

import pytest
from report_fixtures import GIB, make_plan

from meshplan.cli import main
from meshplan.plan import Plan
from meshplan.report.html import render_html, write_html
from meshplan.report.svg import Rect, block_tp_groups, memory_drawing, mesh_drawing, rank_coords, to_svg
from meshplan.report.timeline import (
    MARGIN_LEFT_PX,
    MARGIN_RIGHT_PX,
    format_text_timeline,
    layout_timeline,
    plan_timeline,
    timeline_height_px,
)

PLANS = {
    "dp-only": dict(dp=8),
    "tp-x-pp": dict(dp=2, tp=4, pp=4, m=8),
    "interleaved": dict(tp=2, pp=4, v=2, m=8, schedule="interleaved-1f1b"),
    "zero-bubble": dict(pp=4, m=8, schedule="zero-bubble"),
    "zbv": dict(pp=4, v=2, m=8, schedule="zbv", dp=2),
    "gpipe": dict(pp=2, m=4, schedule="gpipe", tp=2),
}

# anything that would make the browser fetch or link outside the file
EXTERNAL = re.compile(r"https?:|//|\bsrc\s*=|\bhref\s*=|<script|@import|url\(|<link|<img|<iframe", re.I)


@pytest.fixture(params=sorted(PLANS))
def plan(request: pytest.FixtureRequest) -> Plan:
    p = make_plan(**PLANS[request.param])
    assert Plan.from_json(p.to_json()) == p
    return p


def test_html_is_self_contained_and_complete(plan: Plan, tmp_path) -> None:
    path = write_html(plan, tmp_path / "report.html")
    html = path.read_text()
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")
    assert EXTERNAL.search(html) is None, EXTERNAL.search(html)
    for section in ("Device mesh", "Pipeline schedule", "Stages", "Tensor parallelism per block",
                    "Memory per pipeline rank", "Alternatives, ranked"):
        assert f"<h2>{section}" in html
    assert html.count("<svg") == 4  # mesh, timeline, TP per block, memory
    assert html.count("predicted") >= 10
    assert "out of memory by 17.0 GiB" in html and "slower by 8.0%" in html
    assert "= the plan's predicted pipeline time" in html
    assert plan.summary() in html


def test_timeline_length_is_the_predicted_pipeline_time(plan: Plan) -> None:
    tl = plan_timeline(plan)
    assert tl.makespan_s == pytest.approx(plan.predicted.pipeline_s, rel=1e-12)
    assert max(e.end_s for e in tl.events) == pytest.approx(plan.predicted.pipeline_s, rel=1e-12)
    d = layout_timeline(tl, width_px=1000, num_ranks=plan.pp)
    assert (d.width, d.height) == (1000, timeline_height_px(plan.pp))
    boxes = [it for it in d.items if isinstance(it, Rect) and it.title[:1] in "FBW" and it.title[1:2] == " "]
    assert len(boxes) == len(tl.events)
    right = max(b.x + b.w for b in boxes)  # the last box ends at the right edge of the plot (1 px gap)
    assert 1000 - MARGIN_RIGHT_PX - 1.5 <= right <= 1000 - MARGIN_RIGHT_PX + 1e-6
    assert min(b.x for b in boxes) == pytest.approx(MARGIN_LEFT_PX)


def test_timeline_shows_bubbles_p2p_and_kinds() -> None:
    p = make_plan(pp=4, m=8, schedule="zero-bubble")
    tl = plan_timeline(p)
    assert {e.kind for e in tl.events} == {"F", "B", "W"}
    svg = to_svg(layout_timeline(tl, title="zb"))
    assert "idle (bubble)" in svg and "p2p send" in svg and ">ms<" in svg
    assert svg.count("<line") > 2 * 8 * 3  # p2p connectors (F down, B up) plus axis ticks


def test_large_plan_timeline_is_bounded() -> None:
    p = make_plan(dp=4, tp=8, pp=16, m=64, layers=32)
    tl = plan_timeline(p)
    assert len(tl.events) == 16 * 64 * 2
    d = layout_timeline(tl, width_px=1200, num_ranks=16)
    counts = d.counts()
    plot_w = 1200 - MARGIN_LEFT_PX - MARGIN_RIGHT_PX
    assert counts["rect"] <= 16 * 3 * plot_w / 6  # bins: bounded by lanes x kinds x plot width / 6
    assert counts["text"] < 40  # no microbatch labels
    assert counts["line"] < 40  # no p2p connectors
    assert "F/B/W share per 6 px" in d.caption
    deep = plan_timeline(make_plan(pp=16, m=512, layers=32))
    assert len(deep.events) == 16 * 512 * 2
    assert layout_timeline(deep, num_ranks=16).counts()["rect"] < len(deep.events) / 4
    html = render_html(p)
    assert len(html) < 400_000 and EXTERNAL.search(html) is None
    assert "<pre>" not in html  # no text timeline for big plans


def test_text_timeline_small_plan() -> None:
    p = make_plan(pp=4, m=4, schedule="1f1b")
    text = format_text_timeline(p, width=80)
    lines = text.splitlines()
    rows = [ln for ln in lines if ln.lstrip().startswith("rank")]
    assert len(rows) == 4
    assert all(len(r.split("|")[1]) == 80 for r in rows)
    assert rows[0].split("|")[1].startswith("F0")
    assert rows[3].split("|")[1].startswith(".")  # rank 3 waits for the first forward: a bubble
    assert "F3" in rows[3] and "B3" in rows[0]
    zbv = format_text_timeline(make_plan(pp=2, v=2, m=4, schedule="zbv"), width=120)
    assert "f0" in zbv and "lower case" in zbv  # second chunk drawn in lower case
    with pytest.raises(ValueError, match="at least 20"):
        format_text_timeline(p, width=5)


def test_rank_layout_follows_axis_order() -> None:
    p = make_plan(dp=2, tp=4, pp=4, m=8)
    assert rank_coords(p.mesh, 0) == {"tp": 0, "dp": 0, "pp": 0}
    assert rank_coords(p.mesh, 5) == {"tp": 1, "dp": 1, "pp": 0}
    assert rank_coords(p.mesh, 31) == {"tp": 3, "dp": 1, "pp": 3}
    d = mesh_drawing(p)
    outlines = [it for it in d.items if isinstance(it, Rect) and it.fill == "none"]
    assert len(outlines) == 8  # 32 devices / tp 4 = 8 TP groups, each 4 consecutive ranks
    assert all(o.w == pytest.approx(outlines[0].w) for o in outlines)
    cells = [it for it in d.items if isinstance(it, Rect) and it.title.startswith("rank ")]
    assert len(cells) == 32 and cells[9].title == "rank 9: pp=1, dp=0, tp=1"
    q = make_plan(dp=2, tp=4, pp=4, m=8, axis_names=("tp", "pp", "dp"))  # tp outermost: groups not consecutive
    assert rank_coords(q.mesh, 1) == {"dp": 1, "pp": 0, "tp": 0}


def test_huge_mesh_is_sampled() -> None:
    p = make_plan(dp=32, tp=8, pp=16, m=64, layers=32)
    d = mesh_drawing(p)
    cells = [it for it in d.items if isinstance(it, Rect) and it.title.startswith("rank ")]
    assert len(cells) == 32 * 8
    assert "32 of 512 nodes shown" in d.caption
    stages = {c.fill for c in cells}
    assert len(stages) == 12  # all stage colours appear (16 stages, 12 colours cycle)


def test_memory_bars_against_device_limit() -> None:
    p = make_plan(pp=4, m=8)
    d = memory_drawing(p)
    bars = [it for it in d.items if isinstance(it, Rect) and it.title.endswith("predicted")]
    assert [b.title.split(":")[0] for b in bars] == ["rank 0", "rank 1", "rank 2", "rank 3"]
    assert bars[3].w > bars[0].w
    full = [it for it in d.items if isinstance(it, Rect) and it.fill == "#eeeeee"][0]
    assert bars[3].w / full.w == pytest.approx(29 / 80)
    assert all(b.fill != "#c0392b" for b in bars)
    over = make_plan(pp=2, m=4)
    over = Plan.from_dict({**over.to_dict(), "predicted": {**over.to_dict()["predicted"],
                                                           "peak_mem_bytes": [90 * GIB, 10 * GIB]}})
    bars = [it for it in memory_drawing(over).items if isinstance(it, Rect) and it.title.endswith("predicted")]
    assert bars[0].fill == "#c0392b" and bars[1].fill != "#c0392b"


def test_block_tp_groups() -> None:
    p = make_plan(tp=4, pp=2, m=4)
    groups = dict((k, (n, dict(lin))) for k, n, lin in block_tp_groups(p.tp_styles))
    assert groups["blocks.*"][0] == 8
    assert groups["blocks.*"][1]["attn.q_proj"] == "colwise"
    assert groups["blocks.*"][1]["mlp.fc_out"] == "rowwise"
    assert groups[""][1] == {"lm_head": "colwise"}
    mixed = dict(p.tp_styles, **{"blocks.3.attn.q_proj": "replicate"})
    assert dict(block_tp_groups(mixed)[0][2])["attn.q_proj"] == "mixed"


def test_explain_command(tmp_path, capsys) -> None:
    p = make_plan(pp=2, m=4)
    path = tmp_path / "plan.json"
    p.save(path)
    rc = main(["explain", str(path), "--timeline", "--width", "60"])
    out, err = capsys.readouterr()
    assert rc == 0 and "rank 1 |" in out and "Why " in out
    assert main(["explain", str(tmp_path / "missing.json")]) == 1
    assert "missing.json" in capsys.readouterr().err


def test_report_of_real_planner_plans(tmp_path) -> None:
    """Plans from the planner (GPT-shaped graph): timeline = predicted pipeline time, report self-contained."""
    from planner_fixtures import gpt_graph  # a GPT-shaped ModelGraph built without torch

    from meshplan.planner import api
    from meshplan.report.diff import diff_plans
    from meshplan.report.plot import write_timeline_png

    graph = gpt_graph(layers=4)
    kw = dict(tp=2, pp=2, dp=2, num_microbatches=4, cluster="h100")
    a = api.estimate_graph(graph, 8, schedule="1f1b", **kw)
    b = api.estimate_graph(graph, 8, schedule="zbv", **kw)
    for p in (a, b):
        tl = plan_timeline(p)
        assert tl.makespan_s == pytest.approx(p.predicted.pipeline_s, rel=1e-9)
        html = render_html(p)
        assert EXTERNAL.search(html) is None and "= the plan's predicted pipeline time" in html
        assert write_timeline_png(p, tmp_path / "t.png").stat().st_size > 1000
    assert "W" in {e.kind for e in plan_timeline(b).events}
    fields = {d.field for d in diff_plans(a, b)}
    assert {"schedule", "virtual_stages"} <= fields
