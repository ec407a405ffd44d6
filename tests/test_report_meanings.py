"""Every figure a person reads has one meaning: the pipeline bubble is its share of the step wherever
it is shown (the idle/compute ratio is named apart); a plan with tp=1 says which reason applied
(planner.tp_reason -> the "tp=1: ..." note -> explain). Hand-built graphs, no torch."""

from __future__ import annotations

import dataclasses
import re

from planner_fixtures import gpt_graph

from meshplan.plan import Plan
from meshplan.planner.api import plan_graph
from meshplan.report.diff import metric_deltas
from meshplan.report.explain import explain_plan
from meshplan.report.html import render_html
from meshplan.report.text import format_plan


def _tp_note(p: Plan) -> str:
    notes = [n for n in p.notes if n.startswith("tp=1: ")]
    assert len(notes) == (p.tp == 1), p.notes
    return notes[0] if notes else ""


def test_tp1_not_allowed_names_the_heads_and_the_node() -> None:
    p = plan_graph(gpt_graph(layers=2, h=64, heads=5, seq=32, vocab=128), 8, global_batch_size=16)
    note = _tp_note(p)
    assert "not allowed" in note and "the 5 attention heads" in note and "8 devices of a node" in note, note
    assert f"- {note}" in explain_plan(p)
    assert "(or was not allowed)" not in explain_plan(p)


def test_tp1_pinned() -> None:
    p = plan_graph(gpt_graph(layers=2, h=1024, heads=16, seq=1024, vocab=32000), 8, global_batch_size=64,
                   fixed={"tp": 1})
    assert _tp_note(p) == "tp=1: pinned (--tp 1)"


def test_tp1_because_the_placement_shards_nothing() -> None:
    p = plan_graph(gpt_graph(layers=2, h=64, heads=4, seq=32, vocab=128), 2, global_batch_size=4)
    assert "sharding does not pay for its communication: at tp=2" in _tp_note(p)


def test_tp1_lost_to_a_costed_tp2_plan_by_the_alternatives_figure() -> None:
    p = plan_graph(gpt_graph(layers=4, h=1024, heads=16, seq=1024, vocab=32000), 8, global_batch_size=64)
    note = _tp_note(p)
    m = re.fullmatch(r"tp=1: the best plan with tp=(\d+), (.+), is slower by ([\d.]+)%", note)
    assert m, note
    same = [a for a in p.alternatives if a.summary == m.group(2)]
    assert not same or same[0].reason.endswith(f"slower by {m.group(3)}%")
    assert f"- {note}" in explain_plan(p)


def test_tp_above_one_has_no_tp1_note_and_an_old_plan_says_it_records_none() -> None:
    p = plan_graph(gpt_graph(layers=2, h=1024, heads=16, seq=1024, vocab=32000), 8, global_batch_size=64,
                   fixed={"tp": 2})
    assert _tp_note(p) == ""
    q = plan_graph(gpt_graph(layers=2, h=64, heads=4, seq=32, vocab=128), 2, global_batch_size=4)
    old = dataclasses.replace(q, notes=tuple(n for n in q.notes if not n.startswith("tp=1")), alternatives=())
    assert "- tp=1: this plan records no reason" in explain_plan(old)


def test_the_bubble_is_one_quantity_in_every_report() -> None:
    p = plan_graph(gpt_graph(layers=8, h=256, heads=8, seq=128, vocab=1024), 8, global_batch_size=8,
                   fixed={"pp": 4, "schedule": "gpipe"})
    pr = p.predicted
    assert pr.bubble_s > 0 and pr.bubble_fraction > 0
    share = f"{pr.bubble_share:.1%}"
    assert share == f"{pr.bubble_s / pr.step_s:.1%}"
    text = format_plan(p)
    assert not re.search(r"bubble fraction \d", text)  # the old unnamed ratio beside the share
    row = next(ln for ln in text.splitlines() if ln.startswith("pipeline bubble  "))
    assert row.split()[-1] == share  # the table's share column
    assert f"pipeline bubble {share} of the step" in text
    assert f"idle/compute ratio {pr.bubble_fraction:.3f}" in text
    assert f"<b>{share} of the step</b>" in render_html(p)
    assert f"idle {share} of the step" in explain_plan(p)
    rows = {r[0]: r for r in metric_deltas(p, p)}
    assert rows["bubble share of the step"][1] == share and "bubble fraction" not in rows


def test_a_cp_degree_without_a_rival_says_why() -> None:
    g = gpt_graph(layers=4, h=256, heads=8, seq=4096, vocab=1024)
    p = plan_graph(g, 8, global_batch_size=8, fixed={"cp": 2})
    assert p.mesh.degree("cp") == 2 and "cp=2: pinned (--cp 2)" in p.notes
    text = explain_plan(p)
    assert "cp=2 because: pinned (--cp 2)" in text and "none fit or none was allowed" not in text
    free = plan_graph(g, 8, global_batch_size=8)
    assert not [n for n in free.notes if n.startswith(("cp=", "ep="))]  # its alternatives show the rival cp
