"""Plan diff: the changed decisions with their effects, predicted deltas, the ``meshplan diff`` command."""

from __future__ import annotations

import dataclasses

import pytest
from report_fixtures import make_plan

from meshplan.cli import main
from meshplan.plan import Quantization
from meshplan.report.diff import (
    compress_fqns,
    diff_plans,
    format_diff,
    fqn_pattern,
    metric_deltas,
    what_if_pipeline,
)


def test_identical_plans_have_no_differences() -> None:
    a = make_plan(dp=2, tp=4, pp=4, m=8)
    assert diff_plans(a, make_plan(dp=2, tp=4, pp=4, m=8)) == []
    assert "same decisions" in format_diff(a, a)
    assert all(row[3] == "same" for row in metric_deltas(a, a))


def test_changed_fields_are_listed_with_effects() -> None:
    a = make_plan(dp=2, tp=4, pp=4, m=8)
    b = make_plan(dp=4, tp=2, pp=4, m=16, schedule="interleaved-1f1b", v=2, recompute="selective", dp_kind="fsdp",
                  quant="qlora")
    diffs = {d.field: d for d in diff_plans(a, b)}
    for name in ("dp", "tp", "schedule", "virtual_stages", "num_microbatches", "recompute", "dp_kind",
                 "quantization"):
        assert name in diffs, name
        assert diffs[name].effect
    assert "pp" not in diffs and "micro_batch_size" not in diffs
    assert (diffs["tp"].a, diffs["tp"].b) == ("4", "2")
    assert "narrower TP" in diffs["tp"].effect
    assert "bubble (p-1)/m shrinks" in diffs["num_microbatches"].effect
    assert "less activation memory" in diffs["recompute"].effect
    assert "sharded over dp" in diffs["dp_kind"].effect
    assert diffs["quantization"].b.startswith("qlora")
    # TP styles changed per FQN pattern (colwise -> colwise stays; nothing changed for tp 4 -> 2)
    assert not any(f.startswith("tp style") for f in diffs)


def test_tp_styles_and_stage_boundaries_per_pattern() -> None:
    a = make_plan(tp=2, pp=2, m=4)
    styles = {k: ("replicate" if ".mlp." in k else v) for k, v in a.tp_styles.items()}
    stages = list(a.stages)
    stages[1] = dataclasses.replace(stages[1], first_node="n12")
    b = dataclasses.replace(a, tp_styles=styles, stages=tuple(stages))
    diffs = {d.field: d for d in diff_plans(a, b)}
    assert set(diffs) == {"tp style blocks.*.mlp.fc_in", "tp style blocks.*.mlp.fc_out", "stage boundaries"}
    assert (diffs["tp style blocks.*.mlp.fc_in"].a, diffs["tp style blocks.*.mlp.fc_in"].b) == ("colwise", "replicate")
    assert "no TP comm" in diffs["tp style blocks.*.mlp.fc_in"].effect
    assert "n12" in diffs["stage boundaries"].b and "1 stage(s)" in diffs["stage boundaries"].effect
    one = dict(a.tp_styles, **{"blocks.0.attn.q_proj": "rowwise"})  # one instance differs: mixed
    d = {x.field: x for x in diff_plans(a, dataclasses.replace(a, tp_styles=one))}
    assert d["tp style blocks.*.attn.q_proj"].b == "colwise/rowwise"


def test_pipeline_changes_are_resimulated() -> None:
    a = make_plan(pp=4, m=4)
    b = make_plan(pp=4, m=16)
    diffs = {d.field: d for d in diff_plans(a, b)}
    text = diffs["num_microbatches"].predicted
    assert text.startswith("pipeline ") and "idle/compute ratio" in text
    base_ms, new_ms = (float(x) for x in text.split(" ms")[0].removeprefix("pipeline ").split(" -> "))
    assert base_ms == round(a.predicted.pipeline_s * 1e3, 3)
    assert new_ms > base_ms  # 4x the microbatches: longer step, smaller bubble share
    bubble_a, bubble_b = (float(x) for x in text.split("idle/compute ratio ")[1].split(" -> "))
    assert bubble_b < bubble_a
    zb = what_if_pipeline(a, schedule="zero-bubble")
    assert float(zb.split(" -> ")[1].split(" ms")[0]) <= base_ms
    assert what_if_pipeline(a, schedule="zbv", v=3).startswith("cannot simulate")


def test_metric_deltas_cover_time_memory_bubble_comm_mfu() -> None:
    a = make_plan(dp=2, tp=4, pp=4, m=8)
    pred = dataclasses.replace(a.predicted, step_s=a.predicted.step_s * 0.8, mfu=0.5,
                               comm_bytes={**a.predicted.comm_bytes, "all_gather": 2**30},
                               peak_mem_bytes=tuple(x // 2 for x in a.predicted.peak_mem_bytes))
    b = dataclasses.replace(a, predicted=pred, quantization=Quantization(mode="qat"))
    rows = {r[0]: r for r in metric_deltas(a, b)}
    assert rows["step time"][3] == "-20.0%"
    assert rows["MFU"][3] == "+9.0 pt"
    assert rows["peak memory (max rank)"][3] == "-50.0%"
    assert rows["comm bytes: all_gather"][3] == "new"
    assert rows["comm bytes: all_reduce"][3] == "same"
    assert "bubble fraction" not in rows  # one name per quantity: the share of the step, the idle/compute ratio
    assert rows["bubble share of the step"][1] == f"{a.predicted.bubble_s / a.predicted.step_s:.1%}"
    assert rows["idle/compute ratio"][1] == f"{a.predicted.bubble_fraction:.3f}"


def test_fqn_helpers() -> None:
    assert fqn_pattern("blocks.3.attn.q_proj") == ("blocks.*.attn.q_proj", (3,))
    assert fqn_pattern("model.layers.12.mlp.0") == ("model.layers.*.mlp.*", (12, 0))
    assert fqn_pattern("lm_head") == ("lm_head", ())
    assert fqn_pattern("h2.attn") == ("h2.attn", ())
    assert compress_fqns(("wte", "blocks.0", "blocks.1", "blocks.2", "blocks.5", "lm_head")) == \
        "wte, blocks.{0-2,5}, lm_head"
    assert compress_fqns(()) == "-"


def test_diff_command(tmp_path, capsys) -> None:
    a, b = make_plan(pp=2, m=4), make_plan(pp=2, m=8, recompute="full")
    a.save(tmp_path / "a.json")
    b.save(tmp_path / "b.json")
    assert main(["diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "num_microbatches" in out and "recompute" in out and "step time" in out
    assert "Predicted effect of each pipeline change alone" in out
    (tmp_path / "bad.json").write_text("{}")
    assert main(["diff", str(tmp_path / "a.json"), str(tmp_path / "bad.json")]) == 1
    assert "format_version" in capsys.readouterr().err


def test_timeline_holds_gloo_sends_as_the_search_scored_them() -> None:
    """A plan made on a gloo cluster was scored with each pipeline send holding its sending rank
    (ClusterSpec.sends_occupy_rank); its timeline and the what-if re-simulation use the same rule."""
    from meshplan.partition.schedule import simulate
    from meshplan.report.timeline import plan_timeline

    nccl = make_plan(pp=2, m=4, schedule="gpipe")
    gloo = dataclasses.replace(nccl, cluster=dict(nccl.cluster, comm_backend="gloo"))
    stages = sorted(nccl.stages, key=lambda s: s.index)
    kw = dict(fwd_s=[s.fwd_s for s in stages], bwd_input_s=[s.bwd_s - s.bwd_weight_s for s in stages],
              bwd_weight_s=[s.bwd_weight_s for s in stages], p2p_s=[s.send_s for s in stages])
    held = simulate("gpipe", 2, 4, sends_occupy=True, **kw).makespan_s
    free = simulate("gpipe", 2, 4, **kw).makespan_s
    assert held > free
    assert plan_timeline(nccl).makespan_s == pytest.approx(free)
    assert plan_timeline(gloo).makespan_s == pytest.approx(held)
    assert what_if_pipeline(gloo, m=4).startswith(f"pipeline {held * 1e3:.3f} -> {held * 1e3:.3f} ms")
    assert what_if_pipeline(nccl, m=4).startswith(f"pipeline {free * 1e3:.3f} -> ")
