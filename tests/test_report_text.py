"""Text report and explain: sections, grouping of TP styles per block type, predicted labels."""

from __future__ import annotations

from planner_fixtures import gpt_graph

from meshplan.plan import Plan
from meshplan.planner.api import plan_graph
from meshplan.report.explain import explain_plan
from meshplan.report.text import fmt_bytes, fmt_s, format_plan, group_tp_styles


def _plan() -> Plan:
    g = gpt_graph(layers=12, h=4096, heads=32, seq=1024, vocab=32768)
    p = plan_graph(g, 16, global_batch_size=64, fixed={"tp": 8})
    assert Plan.from_json(p.to_json()) == p
    return p


def test_group_tp_styles_collapses_identical_blocks():
    styles = {
        f"blocks.{i}.{r}": s for i in range(3) for r, s in (("attn.q", "colwise"), ("attn.o", "rowwise"))
    }
    styles["lm_head"] = "replicate"
    styles["blocks.2.attn.o"] = "replicate"  # a block that differs gets its own group
    groups = group_tp_styles(styles)
    assert groups[0] == ("blocks.*", 2, [("attn.q", "colwise"), ("attn.o", "rowwise")])
    assert groups[1] == ("blocks.*", 1, [("attn.q", "colwise"), ("attn.o", "replicate")])
    assert groups[-1] == ("(rest)", 1, [("lm_head", "replicate")])


def test_format_plan_sections():
    p = _plan()
    text = format_plan(p)
    assert p.summary() in str(p) and "\n" not in str(p)
    for needle in ("Mesh", "axis", "Pipeline stages (predicted", "Tensor parallelism (tp=8)", "blocks.* × 12",
                   "attn.q_proj", "colwise", "rowwise", "Step time breakdown (predicted)", "TP communication",
                   "pipeline bubble", "DP communication", "tokens/s", "TFLOP/s per device", "MFU",
                   "Peak memory per pipeline rank (predicted"):  # fmt: skip
        assert needle in text, needle
    assert text.count("attn.q_proj") == 1  # one block shown for all twelve
    if p.alternatives:
        assert "Alternatives considered (predicted)" in text
        assert p.alternatives[0].reason in text


def test_explain_names_the_runner_up():
    p = _plan()
    text = explain_plan(p)
    assert p.summary() in text and "predicted" in text
    if p.alternatives:
        assert f"Runner-up: {p.alternatives[0].summary}" in text


def test_formatters():
    assert fmt_bytes(3 * 1024**3) == "3.00 GiB"
    assert fmt_bytes(512) == "512 B"
    assert fmt_s(2.5) == "2.500 s" and fmt_s(0.0125) == "12.50 ms" and fmt_s(3e-6) == "3.0 us"
